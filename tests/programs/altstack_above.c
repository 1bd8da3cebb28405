/* altstack_above: a thread whose signal handler runs on a sigaltstack placed ABOVE the thread's own
 * stack (higher addresses), then makes more calls and syscalls after the handler returned.
 *
 * One PROT_NONE reservation holds both: the thread's stack at its bottom (1 MiB, given to
 * pthread_attr_setstack) and the alternate signal stack above it, either `near` (2 MiB above the
 * reservation's start: less than any stack's reach) or `far` (200 MiB above: farther than one stack
 * reaches).  The argument chooses (default far).  The signal interrupts a libc call (raise), as in
 * sighandler.c, so the handler's caller is raise's call site in `trigger`.
 *
 * Address-taken (root): worker (pthread start), on_signal (struct sigaction).
 * Expected call graph (same at -O0 and -O2):
 *   main -> mmap 1 plt   main -> mprotect 2 plt   main -> install 1 direct
 *   main -> pthread_attr_init 1 plt   main -> pthread_attr_setstack 1 plt
 *   main -> pthread_create 1 plt   main -> pthread_join 1 plt   main -> write 1 plt
 *   main -> strcmp 1 plt
 *   install -> sigemptyset 1 plt   install -> sigaction 1 plt
 *   worker -> sigaltstack 1 plt   worker -> before 1 direct   worker -> trigger 1 direct
 *   worker -> after 1 direct   worker -> write 1 plt
 *   before -> getppid 1 plt   after -> getppid 1 plt   after -> leaf 1 direct
 *   leaf -> getppid 1 plt
 *   trigger -> raise 1 plt
 *   on_signal -> in_handler 1 direct   on_signal -> write 1 plt
 *   in_handler -> getppid 1 plt
 * Syscalls of the worker: getppid from worker>before; write and getppid in the handler (on_signal,
 * interrupting worker>trigger>raise); getppid from worker>after and worker>after>leaf; write from
 * worker.  Then write from main.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

#define STACK_SIZE (1L << 20)
#define ALT_SIZE (1L << 16)
#define RESERVE (256L << 20)

static char *alt_sp;

NOINLINE void in_handler(void) {
    sink = getppid();
}

NOINLINE void on_signal(int sig) {
    sink = sig;
    sink = write(1, "altstack_above: in handler\n", 27);
    in_handler();
    sink = 0;
}

NOINLINE int install(void) {
    static struct sigaction sa;     /* zero-initialised: no memset call */
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    int r = sigaction(SIGUSR1, &sa, NULL);
    sink = r;
    return r;
}

NOINLINE void before(void) {
    sink = getppid();
}

NOINLINE int trigger(void) {
    int r = raise(SIGUSR1);
    sink = r;
    return r;
}

NOINLINE void leaf(void) {
    sink = getppid();
}

NOINLINE void after(void) {
    sink = getppid();
    leaf();
    sink = 0;
}

NOINLINE void *worker(void *arg) {
    (void)arg;
    stack_t ss = {.ss_sp = alt_sp, .ss_size = ALT_SIZE, .ss_flags = 0};
    if (sigaltstack(&ss, NULL) != 0)
        return (void *)1;
    before();
    sink = trigger();
    after();
    sink = write(1, "altstack_above: worker done\n", 28);
    return 0;
}

int main(int argc, char **argv) {
    long alt_off = (argc > 1 && strcmp(argv[1], "near") == 0) ? (2L << 20) : (200L << 20);
    char *base = mmap(NULL, RESERVE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
        return 1;
    if (mprotect(base, STACK_SIZE, PROT_READ | PROT_WRITE) != 0)
        return 1;
    alt_sp = base + alt_off;
    if (mprotect(alt_sp, ALT_SIZE, PROT_READ | PROT_WRITE) != 0)
        return 1;
    if (install() != 0)
        return 1;
    pthread_attr_t attr;
    pthread_t t;
    pthread_attr_init(&attr);
    pthread_attr_setstack(&attr, base, STACK_SIZE);
    if (pthread_create(&t, &attr, worker, NULL) != 0)
        return 1;
    pthread_join(t, NULL);
    sink = write(1, "altstack_above: done\n", 21);
    return 0;
}
