/* threads: two threads with different start routines, each recursing independently; depth from
 * argv[1] (default 10).
 *
 * Address-taken (roots): worker_a, worker_b (pthread start routines).
 * Expected call graph (same at -O0 and -O2):
 *   main -> strtol 1 plt  main -> puts 2 plt  main -> fflush 1 plt
 *   main -> pthread_create 2 plt  main -> pthread_join 2 plt
 *   worker_a -> down_a 1 direct   down_a -> down_a 1 direct   down_a -> getppid 1 plt
 *   worker_b -> down_b 1 direct   down_b -> down_b 1 direct   down_b -> write 1 plt
 * Syscalls: getppid from thread A (worker_a>down_a^depth), write from thread B (worker_b>down_b^depth).
 * Thread B starts after thread A has finished, so the order of syscalls is deterministic.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE long down_a(long n) {
    if (n == 0)
        return getppid();
    long r = down_a(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE long down_b(long n) {
    if (n == 0) {
        long w = write(1, "threads: b\n", 11);
        sink = w;           /* not a tail call */
        return w;
    }
    long r = down_b(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE void *worker_a(void *arg) {
    long r = down_a((long)arg);
    sink = r;
    return NULL;
}

NOINLINE void *worker_b(void *arg) {
    long r = down_b((long)arg);
    sink = r;
    return NULL;
}

int main(int argc, char **argv) {
    long depth = argc > 1 ? strtol(argv[1], NULL, 10) : 10;
    pthread_t a, b;
    puts("threads: start");
    fflush(stdout);
    if (pthread_create(&a, NULL, worker_a, (void *)depth) != 0)
        return 1;
    pthread_join(a, NULL);
    if (pthread_create(&b, NULL, worker_b, (void *)depth) != 0)
        return 1;
    pthread_join(b, NULL);
    puts("threads: done");
    return 0;
}
