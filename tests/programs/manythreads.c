/* manythreads: many threads alive at once (more than instrumented mode used to have state for).
 * argv[1]: threads (default 300); argv[2]: writes each makes (default 10); argv[3] = "loop": the
 * threads keep writing (one write every 20 ms each) until the process is killed, for -p.
 *
 * Every thread is created before any of them writes (a barrier), so all of them exist at once.
 * Expected call graph (same at -O0 and -O2):
 *   main -> strtol 2 plt  main -> open 1 plt  main -> pthread_barrier_init 1 plt
 *   main -> pthread_create 1 plt  main -> pthread_barrier_wait 1 plt  main -> pthread_join 1 plt
 *   main -> strcmp 1 plt  main -> puts 1 plt  main -> fflush 1 plt
 *   worker -> pthread_barrier_wait 1 plt  worker -> burst 2 direct  worker -> usleep 1 plt
 *   burst -> put 1 direct  put -> write 1 plt
 * Syscalls: write(fd of /dev/null) from each thread through worker > burst > put (pthread start
 * routine: worker is address-taken).
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
static int fd;
static long writes = 10;
static int forever;
static pthread_barrier_t start;

NOINLINE void put(void) {
    long w = write(fd, "x", 1);
    sink = w; /* not a tail call */
}

NOINLINE void burst(long n) {
    for (long i = 0; i < n; i++)
        put();
    sink++;
}

NOINLINE void *worker(void *arg) {
    pthread_barrier_wait(&start);
    burst(writes);
    while (forever) {
        usleep(20000);
        burst(1);
    }
    sink = (long)arg;
    return NULL;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? strtol(argv[1], NULL, 10) : 300;
    if (argc > 2)
        writes = strtol(argv[2], NULL, 10);
    forever = argc > 3 && strcmp(argv[3], "loop") == 0;
    fd = open("/dev/null", O_WRONLY);
    if (fd < 0 || n < 1)
        return 1;
    pthread_t *tids = calloc((size_t)n, sizeof(pthread_t));
    if (!tids)
        return 1;
    pthread_barrier_init(&start, NULL, (unsigned)n + 1);
    for (long i = 0; i < n; i++)
        if (pthread_create(&tids[i], NULL, worker, (void *)i) != 0)
            return 2;
    puts("manythreads: started");
    fflush(stdout);
    pthread_barrier_wait(&start);
    for (long i = 0; i < n; i++)
        pthread_join(tids[i], NULL);
    return 0;
}
