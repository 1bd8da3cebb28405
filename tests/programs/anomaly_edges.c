/* anomaly_edges: normal runs combine known calls in new ways; one command reaches write through
 * a call never made in normal runs (the anomaly tests' "edges" granularity, issue 19).
 *
 * Usage: anomaly_edges FRONT DEPTH STYLE [FRONT DEPTH STYLE ...]
 *   FRONT  a | b         which front end calls the recursive walk (two call sites in run_script)
 *   DEPTH  0..100        recursion depth of walk
 *   STYLE  plain | loud  how finish prints (two call sites in finish)
 *          leak          the attack: finish calls leak, which writes itself
 * write is reached (outermost first; every call is followed by a volatile store: no tail calls):
 *   main > run_script > front_a|front_b > walk (> walk)* > finish > say_plain|say_loud > emit > write
 *   attack: main > run_script > front_X > walk (> walk)* > finish > leak > write
 * Call edges of the attack never made in normal runs: finish -> leak, leak -> write.
 * No stdio and no malloc: the only write calls are these.
 */
#include <string.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE static void emit(const char *s, long n) {
    sink = write(1, s, (size_t)n);
}

NOINLINE static void say_plain(long depth) {
    char out[2] = {(char)('0' + depth % 10), '\n'};
    emit(out, 2);
    sink = depth;
}

NOINLINE static void say_loud(long depth) {
    char out[3] = {'!', (char)('0' + depth % 10), '\n'};
    emit(out, 3);
    sink = depth;
}

NOINLINE static void leak(long depth) {
    sink = write(1, "LEAKED\n", 7);
    sink = depth;
}

NOINLINE static void finish(long depth, int style) {
    if (style == 0)
        say_plain(depth);
    else if (style == 1)
        say_loud(depth);
    else
        leak(depth);
    sink = style;
}

NOINLINE static void walk(long depth, long left, int style) {
    if (left > 0)
        walk(depth, left - 1, style);
    else
        finish(depth, style);
    sink = left;
}

NOINLINE static void front_a(long depth, int style) {
    walk(depth, depth, style);
    sink = 1;
}

NOINLINE static void front_b(long depth, int style) {
    walk(depth, depth, style);
    sink = 2;
}

NOINLINE static int run_script(int argc, char **argv) {
    for (int i = 1; i + 2 < argc; i += 3) {
        long depth = 0;
        for (const char *p = argv[i + 1]; *p >= '0' && *p <= '9'; p++)
            depth = depth * 10 + (*p - '0');
        if (depth > 100)
            return 2;
        int style = strcmp(argv[i + 2], "plain") == 0 ? 0 : strcmp(argv[i + 2], "loud") == 0 ? 1
                    : strcmp(argv[i + 2], "leak") == 0 ? 2 : -1;
        if (style < 0)
            return 2;
        if (argv[i][0] == 'a')
            front_a(depth, style);
        else
            front_b(depth, style);
        sink = i;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4 || (argc - 1) % 3 != 0)
        return 2;
    int r = run_script(argc, argv);
    sink = r;
    return r;
}
