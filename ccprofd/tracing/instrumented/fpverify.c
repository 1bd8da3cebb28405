// ccprofd --verify (instrumented mode): a frame-pointer walk of the user stack at every sampled
// syscall, for comparison with the context instrumented mode decoded for the same syscall.
//
// This is the prelude of the syscall sampler (syscall_sampler.c): the sampler's tracking (by tgid,
// fork following, exec gate) and syscall filter are the ones instrumented mode's own sampler uses,
// so both report the same syscall hits of the same threads, in the same per-thread order; userspace
// joins them by (tid, order, syscall number, user ip, user sp).  The stack goes to a ring buffer of
// its own (the sampler's event is small and zeroed with memset).
//
// Knobs (Python sets them): FP_MAX_FRAMES (bpf_get_stack's limit, kernel.perf_event_max_stack),
// FP_RINGBUF_PAGES (power of two).

#define FP_STAT_EVENTS 0
#define FP_STAT_RINGBUF_FULL 1
#define FP_STAT_STACK_FAILED 2
#define FP_NR_STATS 4

struct fp_record {
    u64 ktime_ns;  // the sampler's bpf_ktime_get_ns for this hit (CLOCK_MONOTONIC)
    u32 tgid;
    u32 tid;
    s32 nr;
    u32 nframes;  // entries bpf_get_stack wrote (0 when it failed)
    u64 ip;       // user registers at syscall entry (as the sampler read them)
    u64 sp;
    u64 stack[FP_MAX_FRAMES];  // [0] = ip, then return addresses along the rbp chain
};

BPF_RINGBUF_OUTPUT(fp_events, FP_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(fp_stats, u64, FP_NR_STATS);

static __always_inline void fp_stat(u32 idx) {
    u64 *v = fp_stats.lookup(&idx);
    if (v)
        (*v)++;
}

static __always_inline void fp_emit(void *ctx, u64 ktime, u32 tgid, u32 tid, s32 nr, u64 ip, u64 sp) {
    struct fp_record *r = fp_events.ringbuf_reserve(sizeof(struct fp_record));
    if (!r) {
        fp_stat(FP_STAT_RINGBUF_FULL);
        return;
    }
    r->ktime_ns = ktime;
    r->tgid = tgid;
    r->tid = tid;
    r->nr = nr;
    r->ip = ip;
    r->sp = sp;
    long n = bpf_get_stack(ctx, r->stack, sizeof(r->stack), BPF_F_USER_STACK);
    if (n < 0) {
        fp_stat(FP_STAT_STACK_FAILED);
        n = 0;
    }
    r->nframes = (u32)(n / 8);
    fp_events.ringbuf_submit(r, 0);
    fp_stat(FP_STAT_EVENTS);
}

#define CCPROF_SYSCALL_HOOK(ctx, regs, e) \
    fp_emit((ctx), (e)->ktime_ns, (e)->tgid, (e)->tid, (e)->nr, (e)->ip, (e)->sp)
