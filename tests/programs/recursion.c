/* recursion: direct recursion, mutual recursion, 3-function recursion; depth from argv[1]
 * (default 10; tests use > 64 and a few thousand).
 *
 * Expected call graph (same at -O0 and -O2):
 *   main    -> strtol 1 plt      main -> fact 1 direct    main -> is_even 1 direct
 *   main    -> ring_a 1 direct   main -> puts 1 plt       main -> report 3 direct
 *   fact    -> fact   1 direct   fact -> getppid 1 plt
 *   is_even -> is_odd 1 direct   is_odd -> is_even 1 direct   is_even -> report 1 direct
 *   ring_a  -> ring_b 1 direct   ring_b -> ring_c 1 direct    ring_c -> ring_a 1 direct
 *   ring_c  -> open   1 plt      ring_c -> close 1 plt
 *   report  -> write  1 plt
 * SCCs with cycles: {fact}, {is_even, is_odd}, {ring_a, ring_b, ring_c}.
 * Syscalls at the bottom of each recursion: getppid (fact), write (is_even>report), openat (ring_c).
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;

NOINLINE void report(const char *msg, unsigned long len) {
    sink = write(1, msg, len);
}

NOINLINE unsigned long fact(unsigned long n) {
    if (n == 0) {
        sink = getppid();
        return 1;
    }
    unsigned long r = fact(n - 1);
    sink = (long)r;         /* keeps the recursion a real call (no accumulator loop) */
    return n * r;
}

NOINLINE int is_odd(unsigned n);

NOINLINE int is_even(unsigned n) {
    if (n == 0) {
        report("recursion: even\n", 16);
        return 1;
    }
    int r = is_odd(n - 1);
    sink = r;
    return r;
}

NOINLINE int is_odd(unsigned n) {
    if (n == 0)
        return 0;
    int r = is_even(n - 1);
    sink = r;
    return r;
}

NOINLINE int ring_a(unsigned n);

NOINLINE int ring_c(unsigned n) {
    if (n == 0) {
        int fd = open("/dev/null", O_RDONLY);
        if (fd >= 0)
            sink = close(fd);
        return 7;
    }
    int r = ring_a(n - 1);
    sink = r;
    return r;
}

NOINLINE int ring_b(unsigned n) {
    int r = ring_c(n);
    sink = r;
    return r;
}

NOINLINE int ring_a(unsigned n) {
    int r = ring_b(n);
    sink = r;
    return r;
}

int main(int argc, char **argv) {
    unsigned depth = argc > 1 ? (unsigned)strtol(argv[1], NULL, 10) : 10;
    puts("recursion: start");
    sink = (long)fact(depth);
    report("recursion: fact done\n", 21);
    sink = is_even(2 * depth);
    report("recursion: mutual done\n", 23);
    sink = ring_a(depth);
    report("recursion: ring done\n", 21);
    return 0;
}
