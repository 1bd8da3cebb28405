/* scoped: a rarely called function (`handler`) reached through a deep chain that varies from call
 * to call, amid call-heavy code outside it -- for `ccprofd trace --scope handler`.
 *
 * Usage: scoped [ROUNDS [EXTRA]]   (defaults 12, 0)
 *   round i: main -> route_a/route_b (mutual recursion, EXTRA + 4 + (7 * i) % 37 deep, a and b
 *   depending on i) -> handler(i) -> h_inner^(i % 4) -> getppid(); handler itself calls getppid()
 *   before h_inner.  Outside the scope: main calls busy() (2,000 calls of step() from two call sites, the
 *   last one making getppid()) each round, and getppid() directly.
 * Then prints "rounds done" and waits for its stdin to close before exiting (so a tracer can still
 * read its maps while it processes the last samples).
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE long h_inner(long n) {
    long r = n == 0 ? (long)getppid() : h_inner(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE long handler(long i) {
    sink = getppid();
    long r = h_inner(i % 4);
    sink = r;
    return r;
}

NOINLINE long route_b(long n, long i);

NOINLINE long route_a(long n, long i) {
    long r = n == 0 ? handler(i) : ((n + i) % 3 == 0 ? route_a(n - 1, i) : route_b(n - 1, i));
    sink = r;
    return r;
}

NOINLINE long route_b(long n, long i) {
    long r = n == 0 ? handler(i) : ((n * i) % 2 == 0 ? route_a(n - 1, i) : route_b(n - 1, i));
    sink = r;
    return r;
}

NOINLINE long step(long j) {
    if (j == 1999)
        return getppid();
    sink = j;
    return j;
}

NOINLINE long busy(void) {
    long r = 0;
    for (long j = 0; j < 2000; j++) {
        if (j & 1)
            r += step(j);  /* two call sites of step: one edge carries a non-zero code (a probe) */
        else
            r += step(j | 0x100000);
    }
    sink = r;
    return r;
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? strtol(argv[1], NULL, 10) : 12;
    long extra = argc > 2 ? strtol(argv[2], NULL, 10) : 0;
    for (long i = 0; i < rounds; i++) {
        sink = busy();
        sink = route_a(extra + 4 + (7 * i) % 37, i);
        sink = getppid();
    }
    puts("rounds done");
    fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0)
        ;
    return 0;
}
