/* anomaly_cpu: a call path that runs in training without making a syscall, then makes one through
 * a shared routine (granularity "routines" with CPU-sample evidence, issue 14).
 *
 * Usage: anomaly_cpu MODE [ROUNDS]
 *   train  main > cmd_a > say > write; main > cmd_b > say > write (say: called from 2 sites)
 *          main > crunch: ROUNDS (default 300,000,000) rounds of arithmetic, no syscall
 *   held   main > crunch: ROUNDS rounds, then crunch > say > write (the new edge: crunch -> say;
 *          main -> crunch, the same call site, only ran in training)
 *   evil   main > evil > say > write (evil never runs in training)
 *   again  main > cmd_a > say > write through main's *second* call site of cmd_a, which never runs
 *          in training (prefix_match "functions": the call main -> cmd_a is known at another site)
 * Every call is followed by a volatile store: no tail calls.  No stdio and no malloc: the only
 * write calls are say's.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE static void say(const char *s) {
    sink = write(1, s, strlen(s));
}

NOINLINE static void cmd_a(void) {
    say("a\n");
    sink = 1;
}

NOINLINE static void cmd_b(void) {
    say("b\n");
    sink = 2;
}

NOINLINE static void crunch(int speak, long rounds) {
    unsigned long x = 1;
    for (long i = 0; i < rounds; i++) {
        x = x * 6364136223846793005UL + 1442695040888963407UL;
        if ((x & 0xffffff) == 0) sink = (long)x;  /* a store now and then: the loop stays a loop */
    }
    sink = (long)x;
    if (speak) say("crunched\n");
    sink = 3;
}

NOINLINE static void evil(void) {
    say("evil\n");
    sink = 4;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "train";
    long rounds = argc > 2 ? atol(argv[2]) : 300000000L;
    if (strcmp(mode, "train") == 0) {
        cmd_a();
        cmd_b();
    } else if (strcmp(mode, "evil") == 0) {
        evil();
        return (int)(sink & 0);
    } else if (strcmp(mode, "again") == 0) {
        sink = 5;
        cmd_a();  /* main's second call site of cmd_a */
        sink = 6;
        return (int)(sink & 0);
    }
    crunch(strcmp(mode, "held") == 0, rounds);  /* one call site for train and held */
    return (int)(sink & 0);
}
