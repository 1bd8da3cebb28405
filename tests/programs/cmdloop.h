/* cmdloop.h: the command interpreter shared by anomaly_cmds.c and enforce_nofp.c (one copy, so
 * the two programs' common contexts stay the same chain of calls).
 *
 * A program includes it, defines its commands (int cmd_X(const char *arg)) and the table
 *     const struct command commands[] = {{"cat", cmd_cat}, ...};
 *     const unsigned ncommands = sizeof commands / sizeof commands[0];
 * and gets main: ``PROG CMD ARG [CMD ARG ...]`` runs each command in turn (exit status: the
 * largest command status; 2 for bad usage or an unknown command).  What it adds to every context:
 *     main > run_script > dispatch > cmd_X     (the table is called from one call site)
 * and the helpers the commands share:
 *     emit(s, n)       write(1, s, n)                     (context ... > emit > write)
 *     open_file(path)  open(path, O_RDONLY)               (context ... > open_file > open)
 * No stdio and no malloc. */
#ifndef CCPROFD_TEST_CMDLOOP_H
#define CCPROFD_TEST_CMDLOOP_H

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

static char buf[65536];

struct command {
    const char *name;
    int (*fn)(const char *);
};

extern const struct command commands[]; /* the program's, with ncommands entries */
extern const unsigned ncommands;

NOINLINE static void emit(const char *s, long n) {
    sink = write(1, s, (size_t)n);
}

NOINLINE static int open_file(const char *path) {
    int fd = open(path, O_RDONLY);
    sink = fd;
    return fd;
}

NOINLINE static int dispatch(const char *name, const char *arg) {
    for (unsigned i = 0; i < ncommands; i++) {
        if (strcmp(commands[i].name, name) == 0) {
            int r = commands[i].fn(arg);
            sink = r;
            return r;
        }
    }
    return 2;
}

NOINLINE static int run_script(int argc, char **argv) {
    int status = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        int r = dispatch(argv[i], argv[i + 1]);
        if (r > status)
            status = r;
    }
    return status;
}

int main(int argc, char **argv) {
    if (argc < 3 || argc % 2 == 0)
        return 2;
    int r = run_script(argc, argv);
    sink = r;
    return r;
}

#endif
