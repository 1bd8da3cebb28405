/* tailcall: tail calls at -O2 (intended tail calls are marked TAIL CALL).
 *
 * Expected call graph at -O0 (every call is a `call`):
 *   main -> chain 1 direct   main -> tail_plt 1 direct   main -> notail 1 direct
 *   main -> puts 2 plt       main -> strtol 1 plt
 *   chain -> step 1 direct   step -> finish 1 direct     notail -> finish 1 direct
 *   finish -> getppid 1 plt  tail_plt -> getppid 1 plt   finish -> write 1 plt
 * At -O2 the three TAIL CALLs become `jmp` (kind "tail"), everything else is unchanged:
 *   chain -> step 1 tail     step -> finish 1 tail       tail_plt -> getppid 1 tail
 * Syscalls: getppid with the chain main>chain>step>finish at -O0, and at -O2 main>chain>finish
 * on the machine stack while the context is main>chain>step>finish (tail frames); getppid from
 * main>tail_plt (tail into libc at -O2); getppid from main>notail>finish.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE int finish(int x) {
    sink = x;
    int r = (int)getppid() + x;
    sink = write(1, "tailcall: finish\n", 17);
    return r;
}

NOINLINE int step(int x) {
    sink = x;
    return finish(x + 1);   /* TAIL CALL at -O2 */
}

NOINLINE int chain(int x) {
    sink = x;
    return step(x * 2);     /* TAIL CALL at -O2 */
}

NOINLINE pid_t tail_plt(void) {
    sink = 1;
    return getppid();       /* TAIL CALL into the PLT at -O2 */
}

NOINLINE int notail(int x) {
    int r = finish(x);      /* not a tail call: the store below follows it */
    sink = r;
    return r;
}

int main(int argc, char **argv) {
    int x = argc > 1 ? (int)strtol(argv[1], NULL, 10) : 1;
    puts("tailcall: start");
    sink = chain(x);
    sink = tail_plt();
    sink = notail(x);
    puts("tailcall: done");
    return 0;
}
