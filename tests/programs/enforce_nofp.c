/* enforce_nofp: the enforcement-from-the-unwinder test program (issue 19), built with
 * -O2 -fomit-frame-pointer (no frame-pointer chain for a walk to follow).
 *
 * Usage: enforce_nofp CMD ARG [CMD ARG ...]
 *   cat FILE    print the file              rm FILE      unlink FILE (the normal way to remove it)
 * Hidden command (the attack path enforcement must stop):
 *   wipe FILE   unlinks FILE through another chain of calls, then writes "ATTACK-DONE\n" right
 *               after the unlink returns (the marker the tests look for)
 *
 * Contexts (outermost first):
 *   openat: main > run_script > dispatch > cmd_cat > load_file > open_file > open
 *   read:   main > run_script > dispatch > cmd_cat > load_file > read
 *   write:  main > run_script > dispatch > cmd_cat > emit > write
 *   unlink: main > run_script > dispatch > cmd_rm > remove_file > unlink
 * and, only for the hidden command:
 *   unlink: main > run_script > dispatch > cmd_wipe > wipe_file > unlink
 *   write:  main > run_script > dispatch > cmd_wipe > emit > write
 * No stdio and no malloc.
 */
#include <fcntl.h>
#include <unistd.h>

#include "cmdloop.h" /* main > run_script > dispatch > cmd_X; emit, open_file, buf, sink */

NOINLINE static long load_file(const char *path) {
    int fd = open_file(path);
    if (fd < 0)
        return -1;
    long total = 0, n;
    while (total < (long)sizeof buf && (n = read(fd, buf + total, sizeof buf - (size_t)total)) > 0)
        total += n;
    close(fd);
    return total;
}

NOINLINE static int remove_file(const char *path) {
    int r = unlink(path);
    sink = r;
    return r;
}

NOINLINE static int wipe_file(const char *path) {
    int r = unlink(path);
    sink = r;
    return r;
}

NOINLINE static int cmd_cat(const char *arg) {
    long n = load_file(arg);
    if (n < 0)
        return 1;
    emit(buf, n);
    return 0;
}

NOINLINE static int cmd_rm(const char *arg) {
    return remove_file(arg) == 0 ? 0 : 1;
}

NOINLINE static int cmd_wipe(const char *arg) {
    int r = wipe_file(arg);
    emit("ATTACK-DONE\n", 12);
    return r == 0 ? 0 : 1;
}

const struct command commands[] = {{"cat", cmd_cat}, {"rm", cmd_rm}, {"wipe", cmd_wipe}};
const unsigned ncommands = sizeof commands / sizeof commands[0];
