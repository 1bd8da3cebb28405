/* execs: syscalls from known chains, then exec of another program (/bin/echo), whose exit status
 * (0) becomes this program's.
 *
 * Expected call graph (same at -O0 and -O2):
 *   main -> puts 1 plt   main -> fflush 1 plt   main -> prepare 1 direct   main -> run_exec 1 direct
 *   prepare -> getppid 1 plt   prepare -> write 1 plt
 *   run_exec -> execv 1 plt   run_exec -> write 1 plt
 * Syscalls: getppid and write from main>prepare, execve from main>run_exec.  After execve the
 * image is /bin/echo (not the analysed binary).
 */
#include <stdio.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void prepare(void) {
    sink = getppid();
    sink = write(1, "execs: before exec\n", 19);
}

NOINLINE int run_exec(void) {
    char *const args[] = {"echo", "execs: after exec", NULL};
    int r = execv("/bin/echo", args);
    sink = write(2, "execs: execv failed\n", 20);  /* only if execv returns */
    return r;
}

int main(void) {
    puts("execs: start");
    fflush(stdout);
    prepare();
    sink = run_exec();
    return 1;
}
