/* fptr: indirect calls through a function-pointer table and through a pointer chosen at run time,
 * and a callback called from library code (qsort's comparator).
 *
 * Address-taken (so roots): op_add, op_mul, op_sys (in the data table `ops`), cmp_int (passed to
 * qsort), op_neg (returned by pick).  main is a root as well.
 * Expected call graph (same at -O0 and -O2):
 *   main -> puts 1 plt  main -> run_table 1 direct  main -> sort_it 1 direct  main -> pick 1 direct
 *   main -> write 1 plt
 *   run_table: 1 indirect call site (table[i](x) in a loop), no edges
 *   main: 1 indirect call site (f(5), f from pick)
 *   sort_it -> qsort 1 plt     cmp_int -> getppid 1 plt     op_sys -> getppid 1 plt
 * Syscalls: getppid from qsort's callback (main>sort_it>[qsort]>cmp_int), getppid from the table
 * (main>run_table>op_sys), write from main.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
volatile int nops = 3;

typedef int (*op_fn)(int);

NOINLINE int op_add(int x) {
    sink = x;
    return x + 1;
}

NOINLINE int op_mul(int x) {
    sink = x;
    return x * 3;
}

NOINLINE int op_sys(int x) {
    int r = x + (int)getppid();
    sink = r;
    return r;
}

NOINLINE int op_neg(int x) {
    sink = x;
    return -x;
}

/* Not const and not static: the compiler cannot fold table[i] into direct calls. */
op_fn ops[] = {op_add, op_mul, op_sys};

NOINLINE int run_table(int x) {
    for (int i = 0; i < nops; i++) {
        x = ops[i](x);      /* the one indirect call site */
        sink = x;
    }
    return x;
}

static int calls_seen;

NOINLINE int cmp_int(const void *a, const void *b) {
    if (calls_seen++ == 0)
        sink = getppid();   /* one syscall from inside qsort */
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

NOINLINE void sort_it(int *v, size_t n) {
    qsort(v, n, sizeof *v, cmp_int);
    sink = v[0];            /* not a tail call */
}

NOINLINE op_fn pick(int which) {
    sink = which;
    return which == 12345 ? op_add : op_neg;
}

int main(int argc, char **argv) {
    (void)argv;
    int v[] = {5, 3, 9, 1, 7, 2};
    puts("fptr: start");
    sink = run_table(argc);
    sort_it(v, sizeof v / sizeof v[0]);
    op_fn f = pick(argc);
    sink = f(5);            /* indirect call through a register */
    sink = write(1, "fptr: done\n", 11);
    return 0;
}
