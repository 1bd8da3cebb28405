// ccprofd syscall sampler: reports selected syscalls of tracked processes with the user registers
// at syscall entry, and follows processes through fork (children inherit tracking) and exec
// (tracking stops, unless the entry still has exec credit: see track(), or the new image is an exec
// target: see exec_target.c, which is compiled before this file and before any prelude).
//
// Compile-time knobs (-D or a prelude; Python sets them): MAX_TRACKED (hash entries: tracked
// processes + live threads they created), RINGBUF_PAGES (power of two), HAVE_GROUP_DEAD (the
// sched_process_exit format has group_dead).  Extension points for programs built on this one:
// CCPROF_EVENT_EXTRA (fields appended to struct ccprof_event) and
// CCPROF_SYSCALL_HOOK(ctx, regs, ev) (fills them at each reported syscall); with
// CCPROF_HOOK_SENDS_SYSCALLS the hook sends each syscall's record itself (instrumented.c: through its
// own ring buffer, or counted in the kernel) and the event is per-CPU scratch, never sent.
#include <asm/ptrace.h>  // struct pt_regs; much cheaper to compile than linux/ptrace.h

#ifndef MAX_TRACKED
#define MAX_TRACKED 4096
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif
#define NR_SYSCALL_SLOTS 1024

#define EV_SYSCALL 1
#define EV_FORK 2
#define EV_EXEC 3
#define EV_EXIT 4
#define EV_RET 5  // a reported syscall's return (ccprof_sys_exit): nr, aux = the return value

#define TRACKED_VIA_FORK 1
#define TRACKED_VIA_EXEC 2  // found at its exec of an exec target

#define CCPROF_EXEC_TARGET (1ULL << 32)  // EV_EXEC aux flag: the new image is an exec target

#define STAT_EVENTS 0
#define STAT_RINGBUF_FULL 1
#define STAT_TRACKED_FULL 2
#define STAT_FORKS 3
#define STAT_EXECS_STOPPED 4
#define STAT_EXECS_FOUND 5
#define NR_STATS 8

#define CFG_ALL_SYSCALLS 0
// Which attachment samples: raw_syscalls:sys_enter (0, the default) or the per-syscall events (1);
// none (2) from detach on (the events' perf fds may be closed in the background, and no sample may
// follow a detach).  A set that grows past the events attached one by one moves to the raw
// tracepoint: attached with this still 1, then switched, then the events detached -- no syscall is
// missed meanwhile.
#define CFG_SYSCALL_PATH 1
#define PATH_RAW 0
#define PATH_EVENTS 1
#define PATH_OFF 2
// The compat watch (unwind mode; kbpf/syscall_entry.py): ia32 syscalls -- `int $0x80` in a 64-bit
// process -- are sampled whatever the set, as `ia32:<name>`.  Under a set they are otherwise in no
// set (their numbers are marked CCPROF_IA32_BIT), and on the per-syscall path never seen at all.
#define CFG_COMPAT_WATCH 2

struct ccprof_tracked {
    u32 execs_left;  // execs that keep tracking (a launcher's exec of the target)
    u32 flags;
};

struct ccprof_event {
    u64 ktime_ns;    // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u32 kind;        // EV_*
    u32 tgid;
    u32 tid;
    s32 nr;          // syscall number, -1 for process events
    u64 ip;          // user registers at syscall entry (0 for process events)
    u64 sp;
    u64 bp;
    u64 aux;         // EV_FORK: child pid; EV_EXEC: old pid | CCPROF_EXEC_TARGET; EV_EXIT: group died
#ifdef CCPROF_EVENT_EXTRA
    CCPROF_EVENT_EXTRA
#endif
};

BPF_HASH(tracked, u32, struct ccprof_tracked, MAX_TRACKED);
BPF_ARRAY(syscall_set, u8, NR_SYSCALL_SLOTS);
BPF_ARRAY(config, u64, 4);
BPF_PERCPU_ARRAY(stats, u64, NR_STATS);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
#ifdef CCPROF_HOOK_SENDS_SYSCALLS
BPF_PERCPU_ARRAY(syscall_scratch, struct ccprof_event, 1);  // sys_enter does not nest on a CPU
#endif

static __always_inline void ccprof_stat(u32 idx) {
    u64 *v = stats.lookup(&idx);
    if (v)
        (*v)++;
}

static __always_inline int ccprof_syscall_wanted(long nr) {
    u32 k = CFG_ALL_SYSCALLS;
    u64 *all = config.lookup(&k);
    if (all && *all)
        return 1;
    if (nr >= 0 && (nr & CCPROF_IA32_BIT)) {
        k = CFG_COMPAT_WATCH;
        u64 *watch = config.lookup(&k);
        return watch && *watch;
    }
    if (nr < 0 || nr >= NR_SYSCALL_SLOTS)
        return 0;
    k = (u32)nr;
    u8 *on = syscall_set.lookup(&k);
    return on && *on;
}

static __always_inline struct ccprof_event *ccprof_reserve(u32 kind, u64 pid_tgid) {
    struct ccprof_event *e = events.ringbuf_reserve(sizeof(struct ccprof_event));
    if (!e) {
        ccprof_stat(STAT_RINGBUF_FULL);
        return 0;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->ktime_ns = bpf_ktime_get_ns();
    e->kind = kind;
    e->tgid = pid_tgid >> 32;
    e->tid = (u32)pid_tgid;
    e->nr = -1;
    return e;
}

static __always_inline void ccprof_submit(struct ccprof_event *e) {
    events.ringbuf_submit(e, 0);
    ccprof_stat(STAT_EVENTS);
}

// An ia32 (compat) syscall -- `int $0x80` in a 64-bit process -- reaches raw_syscalls with its ia32
// number, which names another call in the x86-64 table (ia32 20, getpid, is x86-64 writev): a raw-path
// program marks it CCPROF_IA32_BIT | that number (kbpf/syscalls.py says what userspace makes of it),
// outside every syscall set as on the per-syscall path, whose events leave compat calls out.  The
// kernel's in_ia32_syscall() is TS_COMPAT in the task's thread_info.status (offsets from the running
// kernel's BTF; without them nothing is marked).  Tracked processes only: one read per syscall.
static __always_inline long ccprof_mark_compat(long nr) {
#ifdef CCPROF_OFF_THREAD_INFO_STATUS
    char *task = (char *)bpf_get_current_task();
    u32 status = 0;
    if (bpf_probe_read_kernel(&status, sizeof(status),
                              task + CCPROF_OFF_TASK_THREAD_INFO + CCPROF_OFF_THREAD_INFO_STATUS) == 0 &&
        (status & CCPROF_TS_COMPAT))
        return CCPROF_IA32_BIT | nr;
#endif
    return nr;
}

// Whether a program on raw_syscalls (sys_enter or sys_exit) goes on with the current call: always
// on the raw path; beside the per-syscall events only for an ia32 call -- the compat watch
// (CFG_COMPAT_WATCH) attaches it there for those, which the events leave out, so the test comes
// before any lookup of the tracked process (the program runs on every syscall of the machine);
// never once detached (PATH_OFF).
static __always_inline int ccprof_raw_takes_call(void) {
    u32 k = CFG_SYSCALL_PATH;
    u64 *path = config.lookup(&k);
    if (!path || *path == PATH_RAW)
        return 1;
    return *path == PATH_EVENTS && (ccprof_mark_compat(0) & CCPROF_IA32_BIT);
}

// One syscall entry of the current task: the user registers and the number (shared by the two
// attach paths below; `raw`, a constant per caller: from raw_syscalls, where compat calls arrive).
static __always_inline int ccprof_sys_sample(void *ctx, struct pt_regs *regs, long nr, int raw) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    if (!tracked.lookup(&tgid))
        return 0;
    if (raw)
        nr = ccprof_mark_compat(nr);
    if (!ccprof_syscall_wanted(nr))
        return 0;
#ifdef CCPROF_HOOK_SENDS_SYSCALLS
    u32 zero = 0;
    struct ccprof_event *e = syscall_scratch.lookup(&zero);
    if (!e)
        return 0;
    __builtin_memset(e, 0, sizeof(*e));
    e->ktime_ns = bpf_ktime_get_ns();
    e->kind = EV_SYSCALL;
    e->tgid = tgid;
    e->tid = (u32)pid_tgid;
#else
    struct ccprof_event *e = ccprof_reserve(EV_SYSCALL, pid_tgid);
    if (!e)
        return 0;
#endif
    e->nr = (s32)nr;
    bpf_probe_read_kernel(&e->ip, sizeof(e->ip), &regs->ip);
    bpf_probe_read_kernel(&e->sp, sizeof(e->sp), &regs->sp);
    bpf_probe_read_kernel(&e->bp, sizeof(e->bp), &regs->bp);
#ifdef CCPROF_SYSCALL_HOOK
    CCPROF_SYSCALL_HOOK(ctx, regs, e);
#endif
#ifndef CCPROF_HOOK_SENDS_SYSCALLS
    ccprof_submit(e);
#endif
    return 0;
}

static __always_inline int ccprof_path_is(u64 path) {
    u32 k = CFG_SYSCALL_PATH;
    u64 *v = config.lookup(&k);
    return (v ? *v : PATH_RAW) == path;
}

// raw_syscalls:sys_enter as a raw tracepoint: args[0] is the user pt_regs, args[1] the number.
int ccprof_sys_enter(struct bpf_raw_tracepoint_args *ctx) {
    if (!ccprof_path_is(PATH_RAW))
        return 0;
    return ccprof_sys_sample(ctx, (struct pt_regs *)ctx->args[0], (long)ctx->args[1], 1);
}

// A syscalls:sys_enter_<name> event (the per-syscall attach path, kbpf/syscall_entry.py, which says
// why): the number is the record's __syscall_nr (offset SYSCALL_NR_OFFSET); the user registers are
// the task's pt_regs, the very pointer sys_enter passes (the entry code saved them at the top of
// the kernel stack; the record's first word holds it too, but the verifier hides that word).
#define SYSCALL_NR_OFFSET 8
static __always_inline struct pt_regs *ccprof_task_regs(void) {
    return (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
}
int ccprof_sys_tp(void *ctx) {
    if (ccprof_path_is(PATH_EVENTS))
        ccprof_sys_sample(ctx, ccprof_task_regs(), (long)*(int *)((char *)ctx + SYSCALL_NR_OFFSET), 0);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

static __always_inline void ccprof_send_ret(u64 pid_tgid, long nr, u64 ret) {
    struct ccprof_event *e = ccprof_reserve(EV_RET, pid_tgid);
    if (!e)
        return;
    e->nr = (s32)nr;
    e->aux = ret;
    ccprof_submit(e);
}

// raw_syscalls:sys_exit as a raw tracepoint (attached only when return values are wanted): args[0]
// is the user pt_regs, args[1] the return value.  Same filter as the samples (a launcher that has
// not exec'd the target yet sends none); userspace joins it to the thread's pending sample.
int ccprof_sys_exit(struct bpf_raw_tracepoint_args *ctx) {
    if (!ccprof_raw_takes_call())  // (beside the exit events: an ia32 call's return, compat watch)
        return 0;
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    struct ccprof_tracked *t = tracked.lookup(&tgid);
    if (!t || t->execs_left)
        return 0;
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
    long nr = -1;
    bpf_probe_read_kernel(&nr, sizeof(nr), &regs->orig_ax);
    nr = ccprof_mark_compat(nr);  // as its entry was (still in the compat syscall here)
    if (!ccprof_syscall_wanted(nr))
        return 0;
    ccprof_send_ret(pid_tgid, nr, (u64)ctx->args[1]);
    return 0;
}

// A syscalls:sys_exit_<name> event (per-syscall path, with ccprof_sys_tp): the record's
// __syscall_nr and ret (offsets SYSCALL_NR_OFFSET, SYSCALL_RET_OFFSET).
#define SYSCALL_RET_OFFSET 16
static __always_inline void ccprof_sys_exit_tp_do(void *ctx) {
    if (!ccprof_path_is(PATH_EVENTS))
        return;
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    struct ccprof_tracked *t = tracked.lookup(&tgid);
    if (!t || t->execs_left)
        return;
    long nr = (long)*(int *)((char *)ctx + SYSCALL_NR_OFFSET);
    if (!ccprof_syscall_wanted(nr))
        return;
    ccprof_send_ret(pid_tgid, nr, *(u64 *)((char *)ctx + SYSCALL_RET_OFFSET));
}

int ccprof_sys_exit_tp(void *ctx) {
    ccprof_sys_exit_tp_do(ctx);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

// Runs in the parent.  For a new thread child_pid is a tid: its entry is harmless (a live tid is
// never another process's tgid) and is removed when the thread exits.
static __always_inline void ccprof_fork_do(u32 child) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    if (!tracked.lookup(&tgid))
        return;
    struct ccprof_tracked c = {};
    c.flags = TRACKED_VIA_FORK;
    if (tracked.update(&child, &c) != 0) {
        ccprof_stat(STAT_TRACKED_FULL);
        return;
    }
    ccprof_stat(STAT_FORKS);
    struct ccprof_event *e = ccprof_reserve(EV_FORK, pid_tgid);
    if (!e)
        return;
    e->aux = child;
    ccprof_submit(e);
}

int ccprof_fork(struct tracepoint__sched__sched_process_fork *args) {
    ccprof_fork_do((u32)args->child_pid);  // (bcc defines the struct for this function only)
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

// Runs in the new image after a successful exec, before its first user instruction.  A tracked
// process stays tracked through the exec it has credit for, or into an exec target; an untracked
// process that execs an exec target starts being tracked here.  Userspace hears of both (EV_EXEC).
static __always_inline void ccprof_exec_do(u32 old) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    struct ccprof_tracked *t = tracked.lookup(&tgid);
    int target = ccprof_exec_is_target();
    if (!t && !target)
        return;
    struct ccprof_event *e = ccprof_reserve(EV_EXEC, pid_tgid);
    if (e) {
        e->aux = old | (target ? CCPROF_EXEC_TARGET : 0);
        ccprof_submit(e);
    }
    if (old != tgid)
        tracked.delete(&old);  // a non-leader thread exec'd: its tid entry is stale
    if (t && t->execs_left > 0) {
        __sync_fetch_and_add(&t->execs_left, -1);
        return;
    }
    if (target) {
        struct ccprof_tracked n = {};
        n.flags = TRACKED_VIA_EXEC;
        if (tracked.update(&tgid, &n) != 0)
            ccprof_stat(STAT_TRACKED_FULL);
        else
            ccprof_stat(STAT_EXECS_FOUND);
        return;
    }
    tracked.delete(&tgid);
    ccprof_stat(STAT_EXECS_STOPPED);
}

int ccprof_exec(struct tracepoint__sched__sched_process_exec *args) {
    ccprof_exec_do((u32)args->old_pid);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

// group_dead: the tracepoint's field, or -1 where the kernel has none (the leader's exit is then
// taken for the group's, an approximation).
static __always_inline void ccprof_exit_do(int group_dead) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    u32 tid = (u32)pid_tgid;
    if (tid != tgid)
        tracked.delete(&tid);
    if (!tracked.lookup(&tgid))
        return;
    if (group_dead < 0)
        group_dead = (tid == tgid);
    if (group_dead) {
        struct ccprof_event *e = ccprof_reserve(EV_EXIT, pid_tgid);
        if (e) {
            e->aux = 1;
            ccprof_submit(e);
        }
        tracked.delete(&tgid);
    }
}

int ccprof_exit(struct tracepoint__sched__sched_process_exit *args) {
#ifdef HAVE_GROUP_DEAD
    ccprof_exit_do(args->group_dead);
#else
    ccprof_exit_do(-1);
#endif
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}
