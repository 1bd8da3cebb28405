/* anomaly_server: a long-running process for the daemon's anomaly tests.
 *
 * Reads "CMD FILE" lines on stdin; each command runs on a new thread (so a daemon that attached to
 * the process while it was running sees the thread's whole context), then "done N\n" is printed
 * (N: the command's result).  Commands, and their openat context (outermost first):
 *   cat FILE    worker > dispatch > cmd_cat > load_file > open_file > open
 *   count FILE  worker > dispatch > cmd_count > load_file > open_file > open
 *   debug FILE  worker > dispatch > cmd_debug > raw_open > open       (the hidden one)
 * The main thread makes no openat after start-up.  Build with -DVARIANT=N for a binary with the
 * same code paths and another build-id (an "upgrade").
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

#ifndef VARIANT
#define VARIANT 0
#endif
#define STR_(x) #x
#define VARIANT_STR(x) STR_(x)

volatile long sink;
const char variant_tag[] = "anomaly_server variant " VARIANT_STR(VARIANT);

struct job {
    char cmd[32];
    char arg[256];
    long result;
};

NOINLINE static int open_file(const char *path) {
    int fd = open(path, O_RDONLY);
    sink = fd;
    return fd;
}

NOINLINE static int raw_open(const char *path) {
    int fd = open(path, O_RDONLY);
    sink = fd;
    return fd;
}

NOINLINE static long load_file(const char *path) {
    char buf[4096];
    int fd = open_file(path);
    if (fd < 0)
        return -1;
    long n = read(fd, buf, sizeof buf);
    close(fd);
    return n;
}

NOINLINE static long cmd_cat(const char *arg) {
    return load_file(arg);
}

NOINLINE static long cmd_count(const char *arg) {
    return load_file(arg) + 1000;
}

NOINLINE static long cmd_debug(const char *arg) {
    int fd = raw_open(arg);
    if (fd >= 0)
        close(fd);
    return fd >= 0 ? 7 : -1;
}

NOINLINE static long dispatch(const struct job *j) {
    if (strcmp(j->cmd, "cat") == 0)
        return cmd_cat(j->arg);
    if (strcmp(j->cmd, "count") == 0)
        return cmd_count(j->arg);
    if (strcmp(j->cmd, "debug") == 0)
        return cmd_debug(j->arg);
    return -2;
}

static void *worker(void *p) {
    struct job *j = p;
    j->result = dispatch(j);
    return NULL;
}

int main(void) {
    char line[300];
    setvbuf(stdout, NULL, _IONBF, 0);
    sink = (long)variant_tag[0];
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        struct job j = {0};
        if (sscanf(line, "%31s %255s", j.cmd, j.arg) != 2)
            continue;
        pthread_t t;
        if (pthread_create(&t, NULL, worker, &j) != 0)
            return 1;
        pthread_join(t, NULL);
        printf("done %ld\n", j.result);
    }
    return 0;
}
