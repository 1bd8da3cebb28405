/* history: a known syscall sequence for the flight recorder's tests (tests/test_history_e2e.py).
 *
 * With an argument, first waits for a line on stdin (so a daemon can be seen to follow it), and at
 * the end prints "done\n" and waits for EOF on stdin (so its history can be read while it lives).
 * Then, with only write/getppid/lseek counted (every other syscall is left out by the test):
 *   main thread, for i = 1..300:   write(-1, NULL, i) from emit  [main > emit]
 *                 when i % 100 == 0: getppid(), lseek(-1, i, SEEK_SET) from other  [main > other]
 *   a worker thread, k = 1..20:    write(-2, NULL, k) from twrite  [worker > twrite]
 *   main thread after the join:    write(1, "worker TID\n", len) (printf), TID: the worker's gettid()
 * Every write to fds -1/-2 fails with EBADF: nothing is written.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
static volatile pid_t worker_tid;

NOINLINE static void emit(long n) {
    sink = write(-1, NULL, (size_t)n);
}

NOINLINE static void other(long n) {
    sink = getppid();
    sink = lseek(-1, n, SEEK_SET);
}

NOINLINE static void twrite(long n) {
    sink = write(-2, NULL, (size_t)n);
}

static void *worker(void *p) {
    (void)p;
    worker_tid = gettid();
    for (long k = 1; k <= 20; k++)
        twrite(k);
    return NULL;
}

int main(int argc, char **argv) {
    (void)argv;
    char line[64];
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc > 1 && !fgets(line, sizeof line, stdin))
        return 1;
    for (long i = 1; i <= 300; i++) {
        emit(i);
        if (i % 100 == 0)
            other(i);
    }
    pthread_t t;
    if (pthread_create(&t, NULL, worker, NULL) != 0)
        return 1;
    pthread_join(t, NULL);
    printf("worker %d\n", (int)worker_tid);
    if (argc > 1) {
        sink = write(1, "done\n", 5);
        while (fgets(line, sizeof line, stdin))
            ;
    }
    return 0;
}
