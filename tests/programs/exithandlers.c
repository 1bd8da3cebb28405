/* exithandlers: syscalls made after main has returned, from atexit handlers and a destructor.
 *
 * main -> work -> deeper -> write (several frames live while main runs), then main returns.  exit()
 * (called by libc's start-up code, not by main) runs the handlers: handler_a -> flush_chain ->
 * emit -> write, and handler_b -> emit -> write, then the destructor fini_hook -> emit -> write.
 * At those writes main, work and deeper are gone: a debugger shows only the handler's chain below
 * libc's exit code.  The argument sets how deep work recurses before returning (default 3), so
 * frames of different sizes are left behind on the stack.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void emit(const char *msg) {
    ssize_t r = write(1, msg, strlen(msg));
    sink = r;
}

NOINLINE void flush_chain(int n) {
    if (n > 0) {
        flush_chain(n - 1);
        sink += n;
        return;
    }
    emit("exithandlers: handler a\n");
}

NOINLINE void handler_a(void) {
    flush_chain(2);
    sink++;  /* not a tail call: the handler's frame stays on the stack */
}

NOINLINE void handler_b(void) {
    emit("exithandlers: handler b\n");
    sink++;
}

__attribute__((destructor)) NOINLINE void fini_hook(void) {
    emit("exithandlers: destructor\n");
    sink++;
}

NOINLINE int deeper(int n) {
    volatile char pad[64];
    memset((char *)pad, n, sizeof(pad));
    emit("exithandlers: deeper\n");
    return pad[3];
}

NOINLINE int work(int n) {
    if (n > 0) {
        int r = work(n - 1);
        sink += r;
        return r + 1;
    }
    return deeper(n);
}

int main(int argc, char **argv) {
    int depth = argc > 1 ? atoi(argv[1]) : 3;
    atexit(handler_b);  /* runs second: handlers run in reverse order of registration */
    atexit(handler_a);
    sink = work(depth);
    return 0;
}
