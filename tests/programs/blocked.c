/* blocked: threads that block at known depths, for per-thread context snapshots (GetThreadContexts).
 *
 * Usage: blocked [DEPTH]   (default 8)
 *   thread "reader":   reader_main -> down_read^(DEPTH+1) -> read(pipe)           (blocks in read)
 *   thread "sleeper":  sleeper_main -> down_sleep^(DEPTH+1) -> nanosleep(1 hour)  (blocks in nanosleep)
 *   thread "handler":  handler_main -> raise(SIGUSR2) ... on_usr2 -> down_sig^(DEPTH+1) -> read(pipe)
 *                      (blocks in read inside a signal handler: the stack crosses __restore_rt)
 *   main thread:       main -> down_main^(DEPTH+1) -> read(stdin)                  (blocks in read)
 * Once all four are about to block, main prints "ready <pid>".  A line on stdin releases everyone:
 * main writes one byte to each pipe and wakes the sleeper with SIGUSR1 (its handler sets `woken`).
 * Each thread counts the EINTRs nobody asked for (a read that fails with EINTR; a nanosleep that
 * returns early before `woken` is set) and checks what it read; main prints one line per thread and
 * exits 0 when every check holds.  Stopping the threads with ptrace and letting them go must not
 * change that output.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shapes.h"

volatile long sink;
static atomic_int ready_count, sleeper_done;
static volatile sig_atomic_t woken;
static int pipe_reader[2], pipe_handler[2];
static long depth = 8;

struct result {
    long got;        /* bytes read (1 expected) / 1 when the sleep ended by the wake-up */
    long spurious;   /* EINTRs not caused by the wake-up */
    char byte;
};
static struct result r_reader, r_sleeper, r_handler, r_main;

NOINLINE static long blocking_read(int fd, struct result *res) {
    char c = 0;
    atomic_fetch_add(&ready_count, 1);
    for (;;) {
        ssize_t n = read(fd, &c, 1);
        if (n < 0 && errno == EINTR) {
            res->spurious++;
            continue;
        }
        res->got = n;
        res->byte = c;
        sink = n;
        return n;
    }
}

NOINLINE long down_read(long n) {
    if (n == 0) {
        long got = blocking_read(pipe_reader[0], &r_reader);
        sink = got;  /* not a tail call: the caller's frame stays on the stack */
        return got;
    }
    long r = down_read(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE long down_sleep(long n) {
    if (n == 0) {
        struct timespec req = {3600, 0}, rem;
        atomic_fetch_add(&ready_count, 1);
        while (!woken) {
            int rc = nanosleep(&req, &rem);
            if (rc == 0)
                break;
            if (errno == EINTR && !woken)
                r_sleeper.spurious++;
            req = rem;
        }
        r_sleeper.got = woken ? 1 : 0;
        atomic_store(&sleeper_done, 1);
        sink = r_sleeper.got;
        return r_sleeper.got;
    }
    long r = down_sleep(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE long down_sig(long n) {
    if (n == 0) {
        long got = blocking_read(pipe_handler[0], &r_handler);
        sink = got;
        return got;
    }
    long r = down_sig(n - 1);
    sink = r;
    return r + 1;
}

NOINLINE long down_main(long n) {
    if (n == 0) {
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        long got = blocking_read(0, &r_main);
        sink = got;
        return got;
    }
    long r = down_main(n - 1);
    sink = r;
    return r + 1;
}

static void on_usr1(int sig) {
    (void)sig;
    woken = 1;
}

NOINLINE static void on_usr2(int sig) {
    long r = down_sig(depth);
    sink = r + sig;
}

NOINLINE static void *reader_main(void *arg) {
    (void)arg;
    long r = down_read(depth);
    sink = r;
    return NULL;
}

NOINLINE static void *sleeper_main(void *arg) {
    (void)arg;
    long r = down_sleep(depth);
    sink = r;
    return NULL;
}

NOINLINE static void *handler_main(void *arg) {
    (void)arg;
    raise(SIGUSR2);
    sink = 1;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1)
        depth = strtol(argv[1], NULL, 10);
    if (pipe(pipe_reader) || pipe(pipe_handler))
        return 2;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;  /* no SA_RESTART: the wake-up must interrupt nanosleep */
    sigaction(SIGUSR1, &sa, NULL);
    sa.sa_handler = on_usr2;
    sigaction(SIGUSR2, &sa, NULL);
    pthread_t t_reader, t_sleeper, t_handler;
    pthread_create(&t_reader, NULL, reader_main, NULL);
    pthread_create(&t_sleeper, NULL, sleeper_main, NULL);
    pthread_create(&t_handler, NULL, handler_main, NULL);
    while (atomic_load(&ready_count) < 3)
        usleep(1000);
    long r = down_main(depth);  /* prints "ready", blocks until a line arrives on stdin */
    sink = r;
    if (write(pipe_reader[1], "R", 1) != 1 || write(pipe_handler[1], "H", 1) != 1)
        return 3;
    while (!atomic_load(&sleeper_done)) {  /* again if it was between its check and nanosleep */
        pthread_kill(t_sleeper, SIGUSR1);
        usleep(10000);
    }
    pthread_join(t_reader, NULL);
    pthread_join(t_sleeper, NULL);
    pthread_join(t_handler, NULL);
    printf("main: got=%ld spurious=%ld\n", r_main.got, r_main.spurious);
    printf("reader: got=%ld byte=%c spurious=%ld\n", r_reader.got, r_reader.byte, r_reader.spurious);
    printf("sleeper: woken=%ld spurious=%ld\n", r_sleeper.got, r_sleeper.spurious);
    printf("handler: got=%ld byte=%c spurious=%ld\n", r_handler.got, r_handler.byte, r_handler.spurious);
    int ok = r_main.got == 1 && r_main.spurious == 0 && r_reader.got == 1 && r_reader.byte == 'R' &&
             r_reader.spurious == 0 && r_sleeper.got == 1 && r_sleeper.spurious == 0 &&
             r_handler.got == 1 && r_handler.byte == 'H' && r_handler.spurious == 0;
    return ok ? 0 : 1;
}
