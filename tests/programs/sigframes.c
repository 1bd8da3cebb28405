/* sigframes: a signal that interrupts the binary's own code (not a libc call), with the handler on
 * the thread's stack and then on a sigaltstack; the handler makes syscalls.
 *
 * `fault_here` executes `ud2` (SIGILL, a fault: the saved pc is the ud2 itself).  The SIGILL handler
 * `on_ill` makes a write and (through `handler_leaf`) a getppid, then moves the saved pc past the
 * two-byte ud2 so `fault_here` continues.  Round 1 runs the handler on the normal stack, round 2 on an
 * alternate signal stack (SA_ONSTACK).
 *
 * Address-taken (root): on_ill (stored into struct sigaction).
 * Expected call graph (same at -O0 and -O2):
 *   main -> puts 1 plt   main -> fflush 1 plt   main -> install 2 direct   main -> round 2 direct
 *   main -> write 1 plt  main -> sigaltstack 1 plt
 *   install -> sigemptyset 1 plt   install -> sigaction 1 plt
 *   round -> fault_here 1 direct
 *   fault_here: no calls (the ud2 is the interrupted instruction)
 *   on_ill -> write 1 plt   on_ill -> handler_leaf 1 direct
 *   handler_leaf -> getppid 1 plt
 * Syscalls, per round: write from on_ill and getppid from on_ill>handler_leaf, both interrupting
 * main>round>fault_here (fault_here's frame is interrupted at its ud2); then write from main.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
static char altstack[1 << 16];

NOINLINE void handler_leaf(void) {
    sink = getppid();
}

NOINLINE void on_ill(int sig, siginfo_t *info, void *ctx) {
    (void)info;
    sink = sig;
    sink = write(1, "sigframes: in handler\n", 22);
    handler_leaf();
    ucontext_t *uc = ctx;
    uc->uc_mcontext.gregs[REG_RIP] += 2;   /* skip the ud2 */
    sink = 0;
}

NOINLINE int install(int flags) {
    static struct sigaction sa;     /* zero-initialised: no memset call */
    sa.sa_sigaction = on_ill;
    sa.sa_flags = SA_SIGINFO | flags;
    sigemptyset(&sa.sa_mask);
    int r = sigaction(SIGILL, &sa, NULL);
    sink = r;
    return r;
}

NOINLINE void fault_here(void) {
    sink = 1;
    __asm__ volatile("ud2");
    sink = 2;
}

NOINLINE void round(void) {
    fault_here();
    sink = 3;
}

int main(void) {
    puts("sigframes: start");
    fflush(stdout);
    if (install(0) != 0)
        return 1;
    round();
    stack_t ss = {.ss_sp = altstack, .ss_size = sizeof altstack, .ss_flags = 0};
    if (sigaltstack(&ss, NULL) != 0)
        return 1;
    if (install(SA_ONSTACK) != 0)
        return 1;
    round();
    sink = write(1, "sigframes: done\n", 16);
    return 0;
}
