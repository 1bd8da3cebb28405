/* switch: a dense switch that -O2 compiles to a jump table (an indirect `jmp` that is not a call),
 * next to ordinary calls from each case; also a function whose only caller is in a jump-table case.
 *
 * Expected call graph (same at -O0 and -O2):
 *   main -> puts 1 plt   main -> dispatch 1 direct   main -> write 1 plt
 *   dispatch -> k0 1 direct  k1 1  k2 1  k3 1  k4 1  k5 1  k6 1  k7 1 (each direct, one site)
 *   k5 -> getppid 1 plt
 * Syscalls: getppid from main>dispatch>k5, write from main.
 */
#include <stdio.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
volatile int rounds = 8;

NOINLINE int k0(int x) { sink = x; return x + 10; }
NOINLINE int k1(int x) { sink = x; return x + 11; }
NOINLINE int k2(int x) { sink = x; return x * 12; }
NOINLINE int k3(int x) { sink = x; return x - 13; }
NOINLINE int k4(int x) { sink = x; return x ^ 14; }
NOINLINE int k5(int x) { int r = x + (int)getppid(); sink = r; return r; }
NOINLINE int k6(int x) { sink = x; return x | 16; }
NOINLINE int k7(int x) { sink = x; return x & 17; }

NOINLINE int dispatch(int n) {
    int acc = 0;
    for (int i = 0; i < n; i++) {
        int r = 0;
        switch (i & 7) {    /* all eight values covered: no range check, no default */
        case 0: r = k0(acc); break;
        case 1: r = k1(acc); break;
        case 2: r = k2(acc); break;
        case 3: r = k3(acc); break;
        case 4: r = k4(acc); break;
        case 5: r = k5(acc); break;
        case 6: r = k6(acc); break;
        case 7: r = k7(acc); break;
        }
        sink = r;
        acc += r;
    }
    return acc;
}

int main(void) {
    puts("switch: start");
    sink = dispatch(rounds);
    sink = write(1, "switch: done\n", 13);
    return 0;
}
