/* seeding: threads already deep in recursion when a tracer attaches to the running process (-p),
 * then released; they make syscalls at several depths while unwinding and while recursing again.
 *
 * Usage: seeding [DEPTH [THREADS]]   (defaults 40, 0)
 *   every thread (main and THREADS workers, start routine `worker`):
 *     dive_a(DEPTH) -> dive_b -> dive_a ... (mutual recursion) -> park: read(0, 1 byte) (blocks)
 *     after its byte, on the way back up, each level n with n % 5 == 0 calls getppid();
 *     then climb(DEPTH / 2): direct recursion, getppid() at the bottom and at every n % 3 == 0 on
 *     the way down.
 * Main prints "ready <pid>" once every worker is about to block, then blocks itself; the tracer
 * attaches, then the test writes one byte per thread on stdin.  Prints "done" and exits 0.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
static atomic_int parked;

NOINLINE static long park(void) {
    char c = 0;
    atomic_fetch_add(&parked, 1);
    long n = read(0, &c, 1);
    sink = n;
    return n + c;
}

NOINLINE static long dive_b(long n);

NOINLINE static long dive_a(long n) {
    long r = n == 0 ? park() : dive_b(n - 1);
    if (n % 5 == 0)
        r += getppid() & 1;
    sink = r;
    return r;
}

NOINLINE static long dive_b(long n) {
    long r = n == 0 ? park() : dive_a(n - 1);
    if (n % 5 == 0)
        r += getppid() & 1;
    sink = r;
    return r;
}

NOINLINE static long climb(long n) {
    if (n % 3 == 0)
        sink = getppid();
    long r = n == 0 ? (long)getppid() : climb(n - 1);
    sink = r;
    return r + 1;
}

static long depth = 40;

NOINLINE static void *worker(void *arg) {
    sink = dive_a(depth + (long)arg);
    sink = climb(depth / 2);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1)
        depth = strtol(argv[1], NULL, 10);
    long threads = argc > 2 ? strtol(argv[2], NULL, 10) : 0;
    pthread_t tids[16];
    if (threads > 16)
        threads = 16;
    for (long i = 0; i < threads; i++)
        if (pthread_create(&tids[i], NULL, worker, (void *)(i + 1)) != 0)
            return 1;
    while (atomic_load(&parked) < threads)
        usleep(1000);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    sink = dive_a(depth);
    sink = climb(depth / 2);
    for (long i = 0; i < threads; i++)
        pthread_join(tids[i], NULL);
    puts("done");
    return 0;
}
