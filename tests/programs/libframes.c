/* libframes: library functions between program frames, and a function inlined into its caller,
 * for symbolisation from separate debug files and DWARF lines (tests/test_symbolize_debug.py).
 *
 *   main > sort_all > qsort > [libc's local msort_with_tmp.part.0, named only by libc6-dbg's
 *   .symtab] > cmp_sys > getppid          (once, from the first comparison)
 *   main > outer > note (always inlined into outer) > getpid
 */
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
static int calls;

NOINLINE int cmp_sys(const void *a, const void *b) {
    if (calls++ == 0)
        sink = getppid();
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

NOINLINE void sort_all(int *v, size_t n) {
    qsort(v, n, sizeof *v, cmp_sys);
    sink = v[0];
}

static inline __attribute__((always_inline)) void note(int x) {
    sink = getpid() + x;
}

NOINLINE void outer(int x) {
    note(x);
    sink += 1;
}

int main(void) {
    int v[64];
    for (int i = 0; i < 64; i++)
        v[i] = (i * 37) % 64;
    sort_all(v, 64);
    outer(3);
    return 0;
}
