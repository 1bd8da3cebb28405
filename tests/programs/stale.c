/* stale: a thread that returned from a deep recursion and is now blocked shallower, with no probe
 * event since the return -- instrumented mode's BPF state still holds the recursion's pieces (they are
 * dropped lazily, at the next event), so a context read from it now must drop them first.
 *
 * Usage: stale [DEPTH]   (default 40)
 *   main prints "ready <pid>", then deep^(DEPTH+1) (getppid at the bottom), returns, and calls park(),
 *   which blocks in read(stdin) through an inline `syscall` instruction: no call after the return, so
 *   no probe fires.  Blocked: main -> park.  A line on stdin releases it; it prints "done <n>" and
 *   exits 0.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE long deep(long n) {
    if (n == 0) {
        sink = getppid();
        return 0;
    }
    long r = deep(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE static long park(void) {
    char c = 0;
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(0L), "D"(0L), "S"(&c), "d"(1L) : "rcx", "r11", "memory");
    return ret;
}

int main(int argc, char **argv) {
    long depth = argc > 1 ? strtol(argv[1], NULL, 10) : 40;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    long d = deep(depth);
    long got = park();
    printf("done %ld %ld\n", d, got);
    return 0;
}
