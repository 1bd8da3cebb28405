/* locked_entry: a callback whose first instruction is lock-prefixed, for
 * tests/test_uprobe_insn.py.  x86 uprobes refuse lock-prefixed instructions (ENOTSUPP, errno 524),
 * so instrumented mode's entry probe of cmp_locked -- a root entered from outside the binary, by
 * libc's qsort -- must sit past it.  Postgres' SetLatch starts the same way (a memory barrier).
 * Syscalls: getppid once per comparison, from cmp_inner (main > qsort [libc] > cmp_locked >
 * cmp_inner), then write and exit_group.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int cmp_inner(const void *a, const void *b);
int cmp_locked(const void *a, const void *b);

/* The barrier, then a call of cmp_inner with the stack aligned; CFI for the unwinder. */
__asm__(".text\n"
        ".globl cmp_locked\n"
        ".type cmp_locked, @function\n"
        "cmp_locked:\n"
        "  .cfi_startproc\n"
        "  lock addl $0, (%rsp)\n"
        "  subq $8, %rsp\n"
        "  .cfi_def_cfa_offset 16\n"
        "  call cmp_inner\n"
        "  addq $8, %rsp\n"
        "  .cfi_def_cfa_offset 8\n"
        "  ret\n"
        "  .cfi_endproc\n"
        ".size cmp_locked, .-cmp_locked\n");

__attribute__((noinline)) int cmp_inner(const void *a, const void *b) {
    getppid();
    return *(const int *)a - *(const int *)b;
}

int main(void) {
    int values[] = {3, 1, 2};
    qsort(values, 3, sizeof values[0], cmp_locked);
    printf("locked_entry: %d %d %d\n", values[0], values[1], values[2]);
    return 0;
}
