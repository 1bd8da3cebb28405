/* forks: fork, the child makes syscalls from its own chain (and keeps the parent's context), the
 * parent waits and makes syscalls from another chain.
 *
 * Expected call graph (same at -O0 and -O2):
 *   main -> puts 1 plt   main -> fflush 1 plt   main -> spawn 1 direct   main -> write 1 plt
 *   spawn -> fork 1 plt   spawn -> child_work 1 direct   spawn -> parent_work 1 direct
 *   child_work -> getppid 1 plt   child_work -> write 1 plt   child_work -> _exit 1 plt
 *   parent_work -> waitpid 1 plt   parent_work -> write 1 plt
 * Syscalls: in the child write and getppid from main>spawn>child_work, exit_group; in the parent
 * wait4 and write from main>spawn>parent_work, then write from main.
 */
#include <stdio.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void child_work(void) {
    sink = write(1, "forks: child\n", 13);
    sink = getppid();
    _exit(0);
}

NOINLINE int parent_work(pid_t child) {
    int status = -1;
    sink = waitpid(child, &status, 0);
    sink = write(1, "forks: parent\n", 14);
    return status;
}

NOINLINE int spawn(void) {
    pid_t pid = fork();
    if (pid == 0)
        child_work();
    int status = parent_work(pid);
    sink = status;
    return status;
}

int main(void) {
    puts("forks: start");
    fflush(stdout);
    int status = spawn();
    sink = write(1, "forks: done\n", 12);
    return status == 0 ? 0 : 1;
}
