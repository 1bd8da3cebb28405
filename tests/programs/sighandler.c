/* sighandler: a signal handler that makes syscalls, entered while main>trigger>raise is running.
 *
 * Address-taken (root): on_signal (stored into struct sigaction).
 * Expected call graph (same at -O0 and -O2):
 *   main -> puts 1 plt   main -> install 1 direct   main -> trigger 1 direct
 *   main -> write 1 plt   main -> fflush 1 plt
 *   install -> sigemptyset 1 plt   install -> sigaction 1 plt
 *   trigger -> raise 1 plt
 *   on_signal -> in_handler 1 direct   on_signal -> write 1 plt
 *   in_handler -> getppid 1 plt
 * Syscalls: write and getppid inside the handler (on_signal>..., interrupting main>trigger>raise),
 * then write from main.
 */
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void in_handler(void) {
    sink = getppid();
}

NOINLINE void on_signal(int sig) {
    sink = sig;
    sink = write(1, "sighandler: in handler\n", 23);
    in_handler();
    sink = 0;
}

NOINLINE int install(void) {
    static struct sigaction sa;     /* zero-initialised: no memset call */
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    int r = sigaction(SIGUSR1, &sa, NULL);
    sink = r;
    return r;
}

NOINLINE int trigger(void) {
    int r = raise(SIGUSR1);
    sink = r;
    return r;
}

int main(void) {
    puts("sighandler: start");
    fflush(stdout);
    if (install() != 0)
        return 1;
    sink = trigger();
    sink = write(1, "sighandler: done\n", 17);
    return 0;
}
