// exceptions: a C++ exception thrown at the bottom of a recursion and caught several frames up;
// depth from argv[1] (default 10).  extern "C" keeps the names unmangled.
//
// Expected call graph (same at -O0 and -O2):
//   main -> strtol 1 plt   main -> puts 1 plt   main -> catcher 1 direct   main -> note 1 direct
//   catcher -> descend 1 direct   catcher -> note 1 direct   catcher -> __cxa_begin_catch 1 plt
//   catcher -> __cxa_end_catch 2 plt   catcher -> _Unwind_Resume 2 plt
//   (the second __cxa_end_catch and the _Unwind_Resume calls are gcc's cleanup landing pads)
// At -O2 gcc moves the handler into `catcher.cold`, a fragment with its own FUNC symbol and FDE
// that catcher's landing pad enters by `jmp catcher.cold`; it runs in catcher's frame, so it is
// part of catcher: its call sites are catcher's, and the jmp into it is not a tail call.
//   descend -> descend 1 direct   descend -> getppid 1 plt
//   descend -> __cxa_allocate_exception 1 plt   descend -> __cxa_throw 1 plt
//   note -> write 1 plt
// Syscalls: getppid at the bottom (main>catcher>descend^(depth+1)), write from main>catcher>note
// inside the handler, write from main>note.
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

#define NOINLINE __attribute__((noinline, noipa))

extern "C" {

volatile long sink;

NOINLINE void note(const char *msg, unsigned long len) {
    sink = write(1, msg, len);
}

NOINLINE long descend(long n) {
    if (n == 0) {
        sink = getppid();
        throw 42;
    }
    long r = descend(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE int catcher(long depth) {
    try {
        sink = descend(depth);
    } catch (int e) {
        sink = e;
        note("exceptions: caught\n", 19);
        return 0;
    }
    return 1;
}

}  // extern "C"

int main(int argc, char **argv) {
    long depth = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 10;
    std::puts("exceptions: start");
    sink = catcher(depth);
    note("exceptions: done\n", 17);
    return 0;
}
