/* longjmp: longjmp out of deep recursion, then more calls from the frames that remain; depth from
 * argv[1] (default 10).
 *
 * Expected call graph (same at -O0 and -O2):
 *   main -> strtol 1 plt   main -> puts 1 plt   main -> guarded 1 direct   main -> after 1 direct
 *   guarded -> _setjmp 1 plt   guarded -> dive 1 direct   guarded -> after 1 direct
 *   dive -> dive 1 direct   dive -> getppid 1 plt   dive -> longjmp 1 plt
 *   after -> write 1 plt
 * Syscalls: getppid at the bottom (main>guarded>dive^(depth+1)), then write from
 * main>guarded>after (after the longjmp: the dive frames are gone), then write from main>after.
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
static jmp_buf env;

NOINLINE void after(const char *msg, unsigned long len) {
    sink = write(1, msg, len);
}

NOINLINE long dive(long n) {
    if (n == 0) {
        sink = getppid();
        longjmp(env, 1);
    }
    long r = dive(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE int guarded(long depth) {
    if (setjmp(env) == 0) {
        sink = dive(depth);
        return 1;           /* not reached: dive always longjmps */
    }
    after("longjmp: caught\n", 16);
    return 0;
}

int main(int argc, char **argv) {
    long depth = argc > 1 ? strtol(argv[1], NULL, 10) : 10;
    puts("longjmp: start");
    sink = guarded(depth);
    after("longjmp: done\n", 14);
    return 0;
}
