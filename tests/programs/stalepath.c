/* stalepath: a dead call's pieces whose bits form a VALID context for the next sample, reached only
 * through zero-code edges -- the shape behind /usr/bin/find's wrong complete samples in instrumented
 * mode (a call piece from sub_c080, returned before the traversal, decoded as sub_7890's call at
 * 0x7c13, which never executes).
 *
 * Usage: stalepath [ROUNDS]   (default 3)
 *   Each round: main -> pre -> mid -> target (no syscall there: no piece above mid's call), all
 *   returned; then main -> wide -> target, which calls getppid (the sample).  wide has a large frame it does not write, so the words below the dead calls -- their
 *   return addresses -- survive inside it.  target has two callers: the encoding gives one of its
 *   incoming edges the zero code, and wide's single site (with main -> wide) is the zero-code path
 *   here: wide is defined first, so its call is target's first incoming edge (the test checks the
 *   codes in the plan).  With no event between the return and the sample
 *   in target (zero-code edges had no probe), the dead pieces pass the top-piece liveness check and
 *   their bits decode to main -> pre -> mid -> target: a context that is valid, complete -- and wrong.
 *
 * Call graph (by hand):
 *   main -> pre, wide (direct);  pre -> mid (two sites);  mid -> target (three sites);
 *   wide -> target (one site, called with syscall=1);  target -> getppid@plt (only when syscall).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void target(long k, int syscall) {
    if (syscall)
        sink = getppid() + k;
    else
        sink = k;
}

/* Before mid: its call into target is target's first incoming edge, the one the encodings give
 * the zero code (the test checks). */
NOINLINE void wide(long k) {
    volatile char pad[8192];  /* not written unless k < 0 (never): the dead frames' words survive */
    if (k < 0)
        memset((char *)pad, 0, sizeof(pad));
    target(k, 1);
    sink = k;
}

NOINLINE void mid(long k) {
    if (k % 3 == 0)
        target(k, 0);
    else if (k % 3 == 1)
        target(k + 1, 0);
    else
        target(k + 2, 0);
    sink = k;
}

NOINLINE void pre(long k) {
    if (k & 1)
        mid(k);
    else
        mid(k + 5);
    sink = k;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? strtol(argv[1], NULL, 10) : 3;
    for (long i = 0; i < rounds; i++) {
        pre(i);
        wide(i);
    }
    printf("done %ld\n", rounds);
    return 0;
}
