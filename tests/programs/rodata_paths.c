/* rodata_paths: open(2) of path strings whose pages the process has not touched before the call,
 * for tests/test_trace_rodata_paths.py (a syscall's path argument, read by BPF at syscall entry).
 *
 * rodata_path has 64 KiB of .rodata to itself (64 KiB-aligned): nothing the program reads before the
 * open lies on its page nor in the 64 KiB around it that the kernel maps along with a faulted-in page
 * of a file (fault-around, /sys/kernel/debug/fault_around_bytes, 64 KiB by default), so at the open
 * its page is not in the process's page tables yet, bpf_probe_read_user_str fails (-EFAULT; it
 * cannot fault pages in) and the kernel faults it in only during the syscall.  rodata_path2 is
 * another such window, opened right after from the same call site (a loop the compiler cannot
 * unroll: its count is argc + 1): a repeated context, whose sample is a short "hit" record in BPF.
 * data_path is the same in .data (writable: written under a condition that is never true, so the
 * compiler cannot make it read-only).  Before each open the program looks up, in
 * /proc/self/pagemap, whether the string's page is present, and prints it at the end:
 *   rodata_paths: rodata_present=0 data_present=0
 * so the test knows the case it checks did happen (rodata_present counts both .rodata pages).
 * Syscalls after start-up: openat (the pagemap twice, the two .rodata paths, the pagemap, the .data
 * path), pread64, close, write, exit_group.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#define PAGE 4096
#define WINDOW 65536 /* the fault-around window */

__attribute__((aligned(WINDOW))) static const char rodata_path[WINDOW] = "/etc/passwd";
__attribute__((aligned(WINDOW))) static const char rodata_path2[WINDOW] = "/etc/hosts";
__attribute__((aligned(WINDOW))) static char data_path[WINDOW] = "/etc/group";

/* 1 if the page of p is in the page tables, 0 if not, -1 if pagemap cannot be read. */
__attribute__((noinline)) static int page_present(const void *p) {
    uint64_t entry = 0;
    int fd = open("/proc/self/pagemap", O_RDONLY);
    if (fd < 0)
        return -1;
    ssize_t got = pread(fd, &entry, sizeof(entry), (off_t)((uintptr_t)p / PAGE * sizeof(entry)));
    close(fd);
    return got == (ssize_t)sizeof(entry) ? (int)(entry >> 63) : -1;
}

__attribute__((noinline)) static void open_close(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd >= 0)
        close(fd);
}

int main(int argc, char **argv) {
    (void)argv;
    if (argc > 100)
        data_path[0] = 'x'; /* never: keeps data_path writable */
    int rodata_present = page_present(rodata_path) + page_present(rodata_path2);
    /* one call site for both: the second open is a repeat of the first one's context */
    for (int i = 0; i < argc + 1; i++) /* run without arguments: twice */
        open_close(i == 0 ? rodata_path : rodata_path2);
    int data_present = page_present(data_path);
    open_close(data_path);
    printf("rodata_paths: rodata_present=%d data_present=%d\n", rodata_present, data_present);
    return 0;
}
