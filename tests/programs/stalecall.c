/* stalecall: instrumented mode's per-thread state holding a piece whose frame has returned, when the
 * next probe fires in a callback called through a function pointer from code reached only through
 * unprobed (zero-code) edges -- the shape of /usr/bin/find's predicate evaluation (fts traversal ->
 * consider_visiting -> apply_predicate -> pred_xxx through pred->pred_func).
 *
 * Usage: stalecall [ROUNDS]   (default 3)
 *   Each round: main -> deep_a -> deep_b -> leaf (getppid at the bottom), all returned; then
 *   main -> wide -> dispatch, whose indirect call reaches report (an entry-probed callback) which
 *   calls getppid.  wide has a large frame it does not write, so the word below the dead leaf call
 *   -- its return address -- survives inside it: the dead call's piece passes instrumented mode's
 *   liveness check (the return-address word) and its edge bits are still in the state when report is
 *   entered.  The callback's sample must be exact or flagged with a suffix of the true stack
 *   (never a context built on the dead call).
 *
 * Call graph (by hand):
 *   main -> deep_a, wide (direct);  deep_a -> deep_b (direct, two sites);  deep_b -> leaf (three
 *   sites);  leaf -> getppid@plt;  wide -> dispatch (direct);  dispatch -> *fn (indirect: report);
 *   report -> getppid@plt.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void leaf(long k) {
    sink = getppid() + k;
}

NOINLINE void deep_b(long k) {
    if (k % 3 == 0)
        leaf(k);
    else if (k % 3 == 1)
        leaf(k + 1);
    else
        leaf(k + 2);
    sink = k;
}

NOINLINE void deep_a(long k) {
    if (k & 1)
        deep_b(k);
    else
        deep_b(k + 5);
    sink = k;
}

NOINLINE void report(long k) {
    sink = getppid() + k;
}

typedef void (*callback)(long);
callback volatile chosen = report;

NOINLINE void dispatch(long k) {
    callback fn = chosen;
    fn(k);
    sink = k;
}

NOINLINE void wide(long k) {
    volatile char pad[8192];  /* not written unless k < 0 (never): the dead frames' words survive */
    if (k < 0)
        memset((char *)pad, 0, sizeof(pad));
    dispatch(k);
    sink = k;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? strtol(argv[1], NULL, 10) : 3;
    for (long i = 0; i < rounds; i++) {
        deep_a(i);
        wide(i);
    }
    printf("done %ld\n", rounds);
    return 0;
}
