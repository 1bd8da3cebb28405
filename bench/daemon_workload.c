/* Syscall-heavy workload for bench/daemon.py: write(2) of one byte to /dev/null at a paced RATE per
 * second for SECONDS seconds, from three distinct calling contexts (main > phase_a > emit,
 * main > phase_b > emit, main > phase_b > helper_c > emit), about 2:1:1 in every 1 ms batch, so the
 * profiler's per-context counts can be checked against the program's own.
 *
 * Usage: daemon_workload RATE SECONDS
 * Prints "ready <pid>", waits for a line on stdin (the bench starts the tracer first), runs, then
 * prints one line "done made=N a=NA b=NB c=NC wall=S utime=S stime=S" (these stdout writes come
 * from main > printf, a context of their own) and exits.  Pacing: absolute-deadline
 * clock_nanosleep every 1 ms, so the rate holds even when a tracer slows single calls down.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

static int devnull;
static long made_a, made_b, made_c;

__attribute__((noinline)) static long emit(void) {
    static const char byte = 'x';
    return write(devnull, &byte, 1);
}

__attribute__((noinline)) static void phase_a(long n) {
    for (long i = 0; i < n; i++) made_a += emit() == 1;
}

__attribute__((noinline)) static void helper_c(long n) {
    for (long i = 0; i < n; i++) made_c += emit() == 1;
}

__attribute__((noinline)) static void phase_b(long n, long m) {
    for (long i = 0; i < n; i++) made_b += emit() == 1;
    helper_c(m);
}

static double secs(struct timeval tv) { return tv.tv_sec + tv.tv_usec / 1e6; }

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s RATE SECONDS\n", argv[0]);
        return 2;
    }
    long rate = atol(argv[1]);
    double seconds = atof(argv[2]);
    if (rate <= 0 || seconds <= 0) {
        fprintf(stderr, "RATE and SECONDS must be positive\n");
        return 2;
    }
    devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (devnull < 0) {
        perror("/dev/null");
        return 1;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready %d\n", (int)getpid());
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 1;

    const long tick_ns = 1000000; /* 1 ms */
    long ticks = (long)(seconds * 1000);
    struct timespec start, next, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    next = start;
    long owed = 0; /* syscalls due so far, in units of 1/1000 of a syscall */
    long done = 0;
    for (long t = 1; t <= ticks; t++) {
        owed = t * rate;
        long due = owed / 1000 - done;
        /* 2:1:1 rotation over the three contexts, in quarters of the batch */
        long q = due / 4, r = due % 4;
        phase_a(2 * q + (r > 0) + (r > 2));
        phase_b(q + (r > 1), q);
        done += due;
        next.tv_nsec += tick_ns;
        while (next.tv_nsec >= 1000000000) {
            next.tv_nsec -= 1000000000;
            next.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double wall = (end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) / 1e9;
    printf("done made=%ld a=%ld b=%ld c=%ld wall=%.3f utime=%.3f stime=%.3f\n", made_a + made_b + made_c,
           made_a, made_b, made_c, wall, secs(ru.ru_utime), secs(ru.ru_stime));
    return 0;
}
