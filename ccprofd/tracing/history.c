// Flight recorder: the last CCPROF_HISTORY_LEN syscall samples of each traced thread, kept in BPF
// memory at the sample point and read by userspace only on demand (ccprofctl history, GetHistory,
// an alert's `history`): no ring-buffer record, a few stores per sample.
//
// One entry per thread of ccprof_history (an LRU hash keyed by tid, not task storage: task storage
// dies with its thread and is reachable from userspace only through a pidfd of a live thread, but
// an alert is read after the fact, often once its thread has exited; and the LRU bound keeps the
// memory fixed, least recently sampled threads going first).  The entry is a ring: `next` counts
// the events written, event i lives in slot i % CCPROF_HISTORY_LEN.  Only the thread itself writes
// its entry (one CPU at a time), so no atomics; a reader may see the one slot being written torn
// (userspace drops events whose time runs backwards).  A tid reused by another process restarts
// the ring (the header's tgid differs).
//
// Each event holds what identifies the sample's context in the mode's decoded-context cache:
// instrumented mode its aggregation id (ctx_kind = AGG_*), unwind mode the 128-bit context hash
// (ctx, ctx2; ctx_kind = UW_F_*); userspace decodes it on demand.
//
// Knobs (Python defines them): CCPROF_HISTORY_LEN (power of two; 0: no recorder, no map),
// CCPROF_HISTORY_THREADS (LRU entries), CCPROF_HISTORY_BYTES (sizeof(struct ccprof_hist), a
// plain number for bcc's type description).
#ifndef CCPROF_HISTORY_C
#define CCPROF_HISTORY_C

#ifndef CCPROF_HISTORY_LEN
#define CCPROF_HISTORY_LEN 0
#endif
#define CCPROF_HISTORY_ARGS 3  // argument words kept per event (rdi rsi rdx)
#define CCPROF_HISTORY_HDR_BYTES 16
#define CCPROF_HISTORY_EV_BYTES 56

struct ccprof_hist_ev {
    u64 ktime_ns;  // the sample's bpf_ktime_get_ns (the same value its ring-buffer record carries)
    s32 nr;        // syscall number
    u32 ctx_kind;  // mode-specific: how `ctx` identifies the context (see above)
    u64 ctx;
    u64 ctx2;
    u64 args[CCPROF_HISTORY_ARGS];
};

#if CCPROF_HISTORY_LEN > 0
struct ccprof_hist {
    u64 next;  // events written so far
    u32 tgid;  // the process of the thread that wrote them
    u32 pad;
    struct ccprof_hist_ev ev[CCPROF_HISTORY_LEN];
};
struct ccprof_hist_blob {
    char b[CCPROF_HISTORY_BYTES];
};
_Static_assert(sizeof(struct ccprof_hist_ev) == CCPROF_HISTORY_EV_BYTES, "history event size");
_Static_assert(sizeof(struct ccprof_hist) == CCPROF_HISTORY_BYTES, "CCPROF_HISTORY_BYTES differs");
_Static_assert((CCPROF_HISTORY_LEN & (CCPROF_HISTORY_LEN - 1)) == 0, "CCPROF_HISTORY_LEN: power of two");

BPF_TABLE("lru_hash", u32, struct ccprof_hist_blob, ccprof_history, CCPROF_HISTORY_THREADS);
BPF_ARRAY(ccprof_history_zero, struct ccprof_hist_blob, 1);  // never written: a new thread's entry

// Append one event to the calling thread's ring.  `args`: the syscall's argument registers as the
// sample read them (map memory), so the recorder reads no register itself.
static __always_inline void ccprof_history_put(u64 pid_tgid, u64 ktime, s32 nr, u32 ctx_kind, u64 ctx,
                                               u64 ctx2, const u64 *args) {
    u32 tid = (u32)pid_tgid;
    u32 tgid = pid_tgid >> 32;
    struct ccprof_hist *h = (struct ccprof_hist *)ccprof_history.lookup(&tid);
    if (!h) {
        u32 zero = 0;
        struct ccprof_hist_blob *z = ccprof_history_zero.lookup(&zero);
        if (!z)
            return;
        ccprof_history.update(&tid, z);
        h = (struct ccprof_hist *)ccprof_history.lookup(&tid);
        if (!h)
            return;
        h->tgid = tgid;
    }
    if (h->tgid != tgid) {  // a reused tid: another process's thread
        h->tgid = tgid;
        h->next = 0;
    }
    u64 i = h->next;
    struct ccprof_hist_ev *e = &h->ev[i & (CCPROF_HISTORY_LEN - 1)];
    e->ktime_ns = ktime;
    e->nr = nr;
    e->ctx_kind = ctx_kind;
    e->ctx = ctx;
    e->ctx2 = ctx2;
    e->args[0] = args[0];
    e->args[1] = args[1];
    e->args[2] = args[2];
    h->next = i + 1;
}
#else
#define ccprof_history_put(pid_tgid, ktime, nr, ctx_kind, ctx, ctx2, args) do { } while (0)
#endif

#endif  // CCPROF_HISTORY_C
