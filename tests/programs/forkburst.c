/* forkburst: a fork child's syscalls between two bursts of the parent's, then the child execs.
 *
 * Expected call graph (same at -O0 and -O2):
 *   main -> burst 2 direct   main -> spawn 1 direct   main -> puts 1 plt   main -> fflush 1 plt
 *   burst -> getppid 1 plt
 *   spawn -> fork 1 plt   spawn -> child_work 1 direct   spawn -> execl 1 plt   spawn -> _exit 1 plt
 *   spawn -> waitpid 1 plt
 *   child_work -> close 3 plt
 * Syscalls: 20000 getppid from main>burst; clone (fork); in the child three
 * close(-1) from main>spawn>child_work, then execve of /bin/true; wait4; then the parent's second
 * burst.  The tracer meets the child's samples behind a backlog of the first burst's and in the
 * middle of the second's, so a poll that takes a full budget of samples holds them.
 */
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void burst(long n) {
    for (long i = 0; i < n; i++)
        sink = getppid();
}

NOINLINE void child_work(void) {
    sink = close(-1);
    sink = close(-1);
    sink = close(-1);
}

NOINLINE int spawn(void) {
    pid_t pid = fork();
    if (pid == 0) {
        child_work();
        execl("/bin/true", "true", (char *)0);
        _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return status;
}

int main(void) {
    burst(20000);
    int status = spawn();
    burst(20000);
    puts(status == 0 ? "forkburst: done" : "forkburst: child failed");
    fflush(stdout);
    return status != 0;
}
