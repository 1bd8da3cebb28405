/* The bundled example: a tiny "service" whose syscalls are reached through distinct call chains,
 * including recursion. `bash scripts/demo.sh` analyses it and traces it. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

__attribute__((noinline)) static void log_line(const char *msg) {
    write(1, msg, strlen(msg));
}

__attribute__((noinline)) static int load_config(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd >= 0) close(fd);
    return fd >= 0;
}

__attribute__((noinline)) static long walk(int depth) {
    if (depth == 0) {
        log_line("walk: reached the bottom\n");
        return 0;
    }
    return 1 + walk(depth - 1);
}

__attribute__((noinline)) static void handle_request(int n) {
    if (n % 2 == 0)
        log_line("request: even\n");
    else
        walk(3);
}

int main(void) {
    load_config("/etc/hostname");
    for (int i = 0; i < 3; i++)
        handle_request(i);
    log_line("done\n");
    return 0;
}
