/* spawns: every ordinary way a program creates a thread or a process, each from its own chain.
 *
 * Expected call graph (same at -O0 and -O2):
 *   main -> make_thread 1 direct   main -> make_fork 1 direct   main -> make_spawn 1 direct
 *   main -> make_vfork 1 direct   main -> puts 1 plt   main -> fflush 1 plt
 *   make_thread -> pthread_create 1 plt   make_thread -> pthread_join 1 plt
 *   worker -> getppid 1 plt   (worker: address-taken, a pthread start routine)
 *   make_fork -> fork 1 plt   make_fork -> fork_child 1 direct   make_fork -> waitpid 1 plt
 *   fork_child -> getppid 1 plt   fork_child -> _exit 1 plt
 *   make_spawn -> posix_spawn 1 plt   make_spawn -> waitpid 1 plt
 *   make_vfork -> vfork 1 plt   make_vfork -> _exit 1 plt   make_vfork -> waitpid 1 plt
 * Syscalls: clone3 (pthread_create: glibc's __clone3, whose parent path after the syscall is in no
 * FDE), then in the thread rseq, set_robust_list, getppid; clone (fork, SIGCHLD); in the fork child
 * set_robust_list and getppid; clone3 with CLONE_VM|CLONE_VFORK (posix_spawn of /bin/true); vfork.
 */
#include <pthread.h>
#include <spawn.h>
#include <stdio.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shapes.h"

extern char **environ;
volatile long sink;

NOINLINE void *worker(void *arg) {
    sink = getppid();
    return arg;
}

NOINLINE void make_thread(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, worker, NULL) == 0)
        pthread_join(t, NULL);
    sink = 1;
}

NOINLINE void fork_child(void) {
    sink = getppid();
    _exit(0);
}

NOINLINE void make_fork(void) {
    int status;
    pid_t pid = fork();
    if (pid == 0)
        fork_child();
    sink = waitpid(pid, &status, 0);
}

NOINLINE void make_spawn(void) {
    int status;
    pid_t pid;
    char *argv[] = {"true", NULL};
    if (posix_spawn(&pid, "/bin/true", NULL, NULL, argv, environ) == 0)
        sink = waitpid(pid, &status, 0);
    sink = 2;
}

NOINLINE void make_vfork(void) {
    int status;
    pid_t pid = vfork();
    if (pid == 0)
        _exit(0);
    sink = waitpid(pid, &status, 0);
}

int main(void) {
    make_thread();
    make_fork();
    make_spawn();
    make_vfork();
    puts("spawns: done");  /* after every spawn: the programs' common "NAME:" line */
    fflush(stdout);
    return 0;
}
