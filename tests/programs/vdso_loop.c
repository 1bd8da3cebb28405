/* vdso_loop: time calls that run in the vDSO, in tight loops, from known chains.
 *
 *   main -> spin_monotonic -> clock_gettime (CLOCK_MONOTONIC: answered inside the vDSO, no syscall)
 *   main -> spin_tod -> gettimeofday        (inside the vDSO, no syscall)
 *   main -> cpu_clock_calls -> clock_gettime (CLOCK_PROCESS_CPUTIME_ID: the vDSO has no data for
 *           it and makes the clock_gettime syscall itself, from its own code)
 *   main -> say -> write                    (a plain syscall, marks the phases)
 * Usage: vdso_loop [ITERATIONS]  (default 2,000,000 per spin loop; cpu_clock_calls makes 50 calls)
 */
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void say(const char *msg) {
    ssize_t n = write(1, msg, strlen(msg));
    sink = n;
}

NOINLINE void spin_monotonic(long n) {
    struct timespec ts;
    for (long i = 0; i < n; i++) {
        clock_gettime(CLOCK_MONOTONIC, &ts);
        sink = ts.tv_nsec;
    }
}

NOINLINE void spin_tod(long n) {
    struct timeval tv;
    for (long i = 0; i < n; i++) {
        gettimeofday(&tv, NULL);
        sink = tv.tv_usec;
    }
}

NOINLINE void cpu_clock_calls(int n) {
    struct timespec ts;
    for (int i = 0; i < n; i++) {
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
        sink = ts.tv_nsec;
    }
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 2000000;
    say("vdso_loop: start\n");
    spin_monotonic(n);
    spin_tod(n);
    cpu_clock_calls(50);
    say("vdso_loop: done\n");
    return 0;
}
