/* hotedges: one function reached through two call sites, a cold one first in address order and a
 * hot one inside a recursion -- the case hot-edge zero coding is for (tests/test_trace_weights.py).
 * Without edge weights Valence gives the all-zero code (no probe) to the edge visited first, the
 * cold one (lowest call-site address); with the counts of a profiling run it gives it to the hot one.
 *
 * Call graph (same at -O0 and -O2):
 *   main -> strtol 1 plt       main -> cold_path 1 direct   main -> descend 1 direct
 *   main -> write 1 plt
 *   cold_path -> step 1 direct          hot_path -> step 1 direct (called ITERS times per hot_path)
 *   descend -> descend 1 direct         descend -> hot_path 1 direct
 *   step -> getppid 1 plt (every 100th call)
 * Depth from argv[1] (default 20); getppid calls: 1 + 2 * (depth + 1).
 */
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

#define ITERS 200

volatile long sink;

NOINLINE void step(unsigned i) {
    if (i % 100 == 0)
        sink = getppid();
    else
        sink = i;
}

NOINLINE void cold_path(void) {
    step(0);
    sink = 1;
}

NOINLINE void hot_path(void) {
    for (unsigned i = 0; i < ITERS; i++) {
        step(i);
        sink = i;
    }
}

NOINLINE unsigned descend(unsigned n) {
    if (n > 0) {
        unsigned r = descend(n - 1);
        sink = r;
    }
    hot_path();
    sink = n;
    return n;
}

int main(int argc, char **argv) {
    unsigned depth = argc > 1 ? (unsigned)strtol(argv[1], NULL, 10) : 20;
    cold_path();
    descend(depth);
    sink = write(1, "hotedges: done\n", 15);
    return 0;
}
