/* anomaly_cmds: a tiny command interpreter for the anomaly-detection tests.
 *
 * Usage: anomaly_cmds CMD ARG [CMD ARG ...]
 *   cat FILE    print the file             count FILE   print its size in bytes
 *   head FILE   print its first line       run PROG     exec PROG (no arguments; ends the run)
 * Hidden commands (what the detector must find):
 *   debug FILE  opens FILE through a different chain of calls, prints "HIDDEN-OPENED\n" right after
 *               a successful open (the enforcement tests look for this marker), then the contents
 *   shell PROG  execs PROG from a different chain (PROG's own output is the marker)
 *
 * Every normal command reaches openat, read and write from the same contexts whatever the order
 * and the arguments (files must exist): the command table is called from one call site.
 * Expected contexts (outermost first; "@n" = distinct call sites):
 *   openat: main > run_script > dispatch > cmd_X > load_file > open_file > open
 *   read:   main > run_script > dispatch > cmd_X > load_file > read_chunk > read
 *   write:  main > run_script > dispatch > cmd_X > emit > write
 *   execve: main > run_script > dispatch > cmd_run > run_program > do_exec > execv
 * and, only for the hidden commands:
 *   openat: main > run_script > dispatch > cmd_debug > audit_dump > raw_open > open
 *   read:   main > run_script > dispatch > cmd_debug > audit_dump > read_chunk > read
 *   write:  main > run_script > dispatch > cmd_debug > emit > write
 *   execve: main > run_script > dispatch > cmd_shell > escape > execv
 * No stdio and no malloc: the only syscalls after start-up are the ones above (and exit_group).
 */
#include <fcntl.h>
#include <unistd.h>

#include "cmdloop.h" /* main > run_script > dispatch > cmd_X; emit, open_file, buf, sink */

NOINLINE static int raw_open(const char *path) {
    int fd = open(path, O_RDONLY);
    sink = fd;
    return fd;
}

NOINLINE static long read_chunk(int fd, char *p, long room) {
    long n = read(fd, p, (size_t)room);
    sink = n;
    return n;
}

NOINLINE static long load_file(const char *path) {
    int fd = open_file(path);
    if (fd < 0)
        return -1;
    long total = 0, n;
    while (total < (long)sizeof buf && (n = read_chunk(fd, buf + total, (long)sizeof buf - total)) > 0)
        total += n;
    close(fd);
    return total;
}

NOINLINE static long audit_dump(const char *path) {
    int fd = raw_open(path);
    if (fd < 0)
        return -1;
    emit("HIDDEN-OPENED\n", 14);
    long total = 0, n;
    while (total < (long)sizeof buf && (n = read_chunk(fd, buf + total, (long)sizeof buf - total)) > 0)
        total += n;
    close(fd);
    return total;
}

NOINLINE static long format_number(long v, char *out) {
    char tmp[24];
    long n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v > 0);
    for (long i = 0; i < n; i++)
        out[i] = tmp[n - 1 - i];
    out[n] = '\n';
    return n + 1;
}

NOINLINE static int cmd_cat(const char *arg) {
    long n = load_file(arg);
    if (n < 0)
        return 1;
    emit(buf, n);
    return 0;
}

NOINLINE static int cmd_count(const char *arg) {
    char out[32];
    long n = load_file(arg);
    if (n < 0)
        return 1;
    emit(out, format_number(n, out));
    return 0;
}

NOINLINE static int cmd_head(const char *arg) {
    long n = load_file(arg);
    if (n < 0)
        return 1;
    long i = 0;
    while (i < n && buf[i] != '\n')
        i++;
    emit(buf, i < n ? i + 1 : n);
    return 0;
}

NOINLINE static int do_exec(const char *prog) {
    char *const argv[] = {(char *)prog, NULL};
    return execv(prog, argv);
}

NOINLINE static int run_program(const char *prog) {
    int r = do_exec(prog);
    sink = r;
    return 1;
}

NOINLINE static int cmd_run(const char *arg) {
    return run_program(arg);
}

NOINLINE static int cmd_debug(const char *arg) {
    long n = audit_dump(arg);
    if (n < 0)
        return 1;
    emit(buf, n);
    return 0;
}

NOINLINE static int escape(const char *prog) {
    char *const argv[] = {(char *)prog, "HIDDEN-EXECED", NULL};
    int r = execv(prog, argv);
    sink = r;
    return 1;
}

NOINLINE static int cmd_shell(const char *arg) {
    int r = escape(arg);
    sink = r;
    return r;
}

const struct command commands[] = {
    {"cat", cmd_cat}, {"count", cmd_count}, {"head", cmd_head}, {"run", cmd_run},
    {"debug", cmd_debug}, {"shell", cmd_shell},
};
const unsigned ncommands = sizeof commands / sizeof commands[0];
