/* attachset: two syscalls of a small sampled set (openat, connect) among many outside it (getppid),
 * for the per-syscall attach path (issue 14: a syscall outside the set must cost no BPF run).
 *
 * Call graph (same at -O0 and -O2):
 *   main -> chatter 2 direct     chatter -> getppid 1 plt     main -> opener 1 direct
 *   main -> connector 1 direct   opener  -> open    1 plt     opener -> close 1 plt
 *   connector -> socket 1 plt    connector -> connect 1 plt   connector -> close 1 plt
 * Syscalls of the set and their chains: openat (main>opener>open), connect (main>connector>connect,
 * to a unix socket path that does not exist: it fails, and is a syscall all the same).
 * argv[1]: getppid calls per chatter (default 1000).
 */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void chatter(long n) {
    for (long i = 0; i < n; i++)
        sink = getppid();
}

NOINLINE void opener(void) {
    int fd = open("/dev/null", O_RDONLY);
    sink = fd;
    if (fd >= 0)
        close(fd);
}

NOINLINE void connector(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    strcpy(addr.sun_path, "/nonexistent/ccprofd-attachset");
    sink = connect(fd, (struct sockaddr *)&addr, sizeof(addr));
    close(fd);
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    chatter(n);
    opener();
    connector();
    chatter(n);
    sink = 0;
    return 0;
}
