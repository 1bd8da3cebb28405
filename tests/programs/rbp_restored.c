/* rbp_restored: a frame whose CFI cannot recover rbp, under a frame whose CFI restores it from the
 * stack, under a frame whose CFA is rbp-based -- for tests/test_unwind_rbp_restored.py.
 *
 *   main > outer (-O0, frame pointers: at their calls, CFA = rbp + 16)
 *   > mid  pushes rbp (CFI: rbp saved at CFA - 16), then clobbers rbp and calls leaf
 *   > leaf moves rbp to r12 (CFI: DW_CFA_register rbp r12, which the unwinders do not follow:
 *          rbp is lost below leaf) and blocks in read(0, ..., 1) by a syscall instruction
 *
 * Unwinding leaf loses rbp; unwinding mid reads main's rbp back from mid's stack (rbp known again);
 * outer's CFA needs it (and main's, above).  gdb walks main > outer > mid > leaf (it reads r12 in
 * leaf's frame).  Prints the byte read and exits 0.
 */
#include <stdio.h>

long leaf(void);
long mid(void);

__asm__(".text\n"
        ".globl leaf\n.type leaf, @function\nleaf:\n"
        "  .cfi_startproc\n"
        "  pushq %r12\n"
        "  .cfi_def_cfa_offset 16\n"
        "  .cfi_offset %r12, -16\n"
        "  movq %rbp, %r12\n"
        "  .cfi_register %rbp, %r12\n"
        "  movq $-1, %rbp\n"
        "  subq $16, %rsp\n"
        "  .cfi_def_cfa_offset 32\n"
        "  movq $0, (%rsp)\n"
        "  xorl %eax, %eax\n"        /* read */
        "  xorl %edi, %edi\n"        /* fd 0 */
        "  movq %rsp, %rsi\n"
        "  movl $1, %edx\n"
        "  syscall\n"
        "  movq (%rsp), %rax\n"
        "  addq $16, %rsp\n"
        "  .cfi_def_cfa_offset 16\n"
        "  movq %r12, %rbp\n"
        "  .cfi_restore %rbp\n"
        "  popq %r12\n"
        "  .cfi_restore %r12\n"
        "  .cfi_def_cfa_offset 8\n"
        "  ret\n"
        "  .cfi_endproc\n"
        ".size leaf, .-leaf\n"
        ".globl mid\n.type mid, @function\nmid:\n"
        "  .cfi_startproc\n"
        "  pushq %rbp\n"
        "  .cfi_def_cfa_offset 16\n"
        "  .cfi_offset %rbp, -16\n"
        "  xorl %ebp, %ebp\n"
        "  call leaf\n"
        "  popq %rbp\n"
        "  .cfi_restore %rbp\n"
        "  .cfi_def_cfa_offset 8\n"
        "  ret\n"
        "  .cfi_endproc\n"
        ".size mid, .-mid\n");

__attribute__((noinline)) long outer(void) { return mid(); }

int main(void) {
    long byte = outer();
    printf("rbp_restored: %c\n", (int)(byte & 0xff));
    return 0;
}
