/* calls: direct calls, several call sites between the same pair, calls through the PLT.
 *
 * Expected call graph (same at -O0 and -O2; every call below is a `call`, none is a tail call):
 *   main  -> puts     1 plt        main  -> twice  1 direct     main -> helper 3 direct
 *   main  -> opener   1 direct     main  -> say    2 direct
 *   twice -> helper   2 direct     say   -> strlen 1 plt        say  -> write  1 plt
 *   opener-> open     1 plt        opener-> close  1 plt        opener -> getppid 1 plt
 * Syscalls and their chains: write (main>say>write, two sites), getppid (main>opener>getppid),
 * openat (main>opener>open), close.
 */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE int helper(int x) {
    sink = x;
    return x + 1;
}

NOINLINE int twice(int x) {
    int a = helper(x);      /* site 1 */
    int b = helper(a);      /* site 2 */
    sink = b;
    return a + b;
}

NOINLINE void say(const char *msg) {
    ssize_t n = write(1, msg, strlen(msg));
    sink = n;               /* not a tail call */
}

NOINLINE int opener(void) {
    int fd = open("/dev/null", O_RDONLY);
    sink = getppid();
    if (fd >= 0)
        sink = close(fd);
    return fd >= 0;
}

int main(void) {
    puts("calls: start");
    sink = twice(1);
    sink = helper(2);       /* main -> helper, site 1 */
    sink = helper(3);       /* site 2 */
    sink = helper(4);       /* site 3 */
    sink = opener();
    say("calls: say 1\n");  /* main -> say, site 1 */
    say("calls: say 2\n");  /* site 2 */
    return 0;
}
