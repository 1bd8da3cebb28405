// ccprofd unwinder: at raw_syscalls:sys_enter of tracked processes (and at CPU-clock perf samples),
// walk the user stack from the task's registers using per-module unwind tables (CFI) in maps.
//
// Compiled after syscall_sampler.c (its tracked/syscall_set/config maps, fork/exec/exit programs
// and events ring buffer are reused).  The frame loop runs in bpf_loop, so the depth is a setting
// (UW_MAX_DEPTH), not the verifier's limit.  bcc 0.26 cannot relocate a bpf_loop callback, so the
// Python side loads each program together with its callback itself (see unwind.py); callbacks
// take only the loop index (bcc rewrites the arguments of non-static functions past the first),
// and find their state in uw_state at this CPU's slot.
//
// Knobs (Python defines them): UW_MAX_DEPTH (power of two), UW_MAX_MAPS (executable mappings per
// process, power of two), UW_MAX_PROCS, UW_MAX_ENTRIES, UW_MAX_MODULES, UW_MAX_RULES, UW_NSLOTS
// (2 x possible CPUs), UW_ARENA_WORDS, UW_RINGBUF_PAGES.

#include <uapi/linux/bpf_perf_event.h>

#define UW_KIND_NONE 0
#define UW_KIND_RSP 1
#define UW_KIND_RBP 2
#define UW_KIND_PLT 3
#define UW_KIND_SIGNAL 4
#define UW_KIND_END 5
#define UW_KIND_UNSUPPORTED 6

#define UW_RBP_SAME 0
#define UW_RBP_AT_CFA 1
#define UW_RBP_UNDEF 2
#define UW_RBP_AT_SP 3

// why a sample is incomplete (0: complete)
#define UW_WHY_MAX_DEPTH 1
#define UW_WHY_UNKNOWN_PC 2   // pc in no known executable mapping (maps are re-read)
#define UW_WHY_NO_MAPS 3      // process has no mappings loaded yet
#define UW_WHY_NO_CFI 4       // no CFI and rbp does not look like a frame pointer
#define UW_WHY_UNSUPPORTED 5  // CFI rule the unwinder does not evaluate
#define UW_WHY_RBP_LOST 6     // CFA is rbp-based but rbp was not recovered
#define UW_WHY_READ_FAULT 7   // stack memory not readable
#define UW_WHY_BAD_FRAME 8    // CFA did not move up the stack
#define UW_WHY_NO_TABLE 9     // module has no unwind table loaded
#define UW_WHY_NO_REGS 10     // no user registers (kernel thread)

#define UW_EV_SAMPLE 16
#define UW_EV_MAPS 17

#define UW_F_NEW 1          // first sample of a context (aggregated mode)
#define UW_F_COLLISION 2    // same 128-bit hash as a different stored context: not merged
#define UW_F_UNAGGREGATED 4 // could not be stored (arena or counts map full): reported alone

#define UW_OP_UNWIND 0
#define UW_OP_COPY 1
#define UW_OP_COMPARE 2

#define UW_NO_MODULE 0xffffffff
#define UW_WIN_BYTES 4096
#define UW_WIN_WORDS (UW_WIN_BYTES / 8)
#define UW_MAPS_PENDING 1

#define UW_STAT_SAMPLES 0
#define UW_STAT_INCOMPLETE 1
#define UW_STAT_FRAMES 2
#define UW_STAT_FP_FRAMES 3
#define UW_STAT_COLLISIONS 4
#define UW_STAT_ARENA_FULL 5
#define UW_STAT_COUNTS_FULL 6
#define UW_STAT_RINGBUF_FULL 7
#define UW_STAT_NEW 8
#define UW_STAT_PROC_COPIED 9
#define UW_NR_STATS 16

#define UW_CFG_AGGREGATE 0
#define UW_CFG_SAMPLE_CPU_ALL 1

struct uw_rule {
    u8 kind;
    u8 rbp_kind;
    u8 aux;
    u8 pad;
    s32 cfa_off;
    s32 rbp_off;
    s32 ra_off;
};

struct uw_entry {
    u32 vaddr;  // ELF vaddr where the row starts
    u32 rule;   // index into uw_rules
};

struct uw_module {
    u32 first;  // first row in uw_entries
    u32 count;  // rows
};

struct uw_mapping {
    u64 start;
    u64 end;
    u64 bias;    // runtime = vaddr + bias
    u32 module;  // uw_modules index, UW_NO_MODULE without a table
    u32 pad;
};

struct uw_proc {
    u32 n;
    u32 gen;
    struct uw_mapping m[UW_MAX_MAPS];
};

// ring buffer record (and the sample part of the per-CPU state); pcs innermost first
struct uw_sample {
    u64 ktime_ns;
    u32 kind;      // UW_EV_SAMPLE
    u32 tgid;
    u32 tid;
    s32 nr;        // syscall number, -1 for a CPU sample
    u32 n;         // pcs used
    u32 reason;    // UW_WHY_*, 0 = complete
    u32 fp_frames; // frames unwound through rbp without CFI
    u32 flags;     // UW_F_*
    u64 h1;
    u64 h2;
    u64 pcs[UW_MAX_DEPTH];
};

struct uw_state {
    u64 pc;
    u64 sp;
    u64 bp;
    u32 bp_valid;
    u32 exact;     // pc is not a return address (innermost frame, or interrupted by a signal)
    u32 done;
    u32 op;
    u64 c_start;   // cached mapping of the last pc
    u64 c_end;
    u64 c_bias;
    u32 c_module;
    u32 c_first;
    u32 c_count;
    u32 mismatch;
    u64 arena_off; // COPY / COMPARE
    u64 r_lo;      // cached row: ELF vaddrs [r_lo, r_hi) of module c_module use rule r_id
    u64 r_hi;
    u32 r_id;
    u32 r_module;
    u64 win_base;  // stack window: the user page at win_base is copied into win (odd: none)
    u64 win[UW_WIN_WORDS];
    struct uw_sample s;
};

struct uw_key {
    u64 h1;
    u64 h2;
};

struct uw_count {
    u64 count;
    u64 arena_off;
    u32 len;
    u32 tgid;
    s32 nr;
    u32 reason;
};

struct uw_maps_event {
    u64 ktime_ns;
    u32 kind;  // UW_EV_MAPS
    u32 tgid;
};

BPF_ARRAY(uw_rules, struct uw_rule, UW_MAX_RULES);
BPF_ARRAY(uw_entries, struct uw_entry, UW_MAX_ENTRIES);
BPF_ARRAY(uw_modules, struct uw_module, UW_MAX_MODULES);
BPF_HASH(uw_procs, u32, struct uw_proc, UW_MAX_PROCS);
BPF_HASH(uw_parent, u32, u32, UW_MAX_PROCS);          // child pid -> parent tgid (fork)
BPF_HASH(uw_pending, u32, u32, UW_MAX_PROCS);         // tgid -> exec mmap/mprotect seen
BPF_ARRAY(uw_state, struct uw_state, UW_NSLOTS);
BPF_HASH(uw_counts, struct uw_key, struct uw_count, UW_MAX_CONTEXTS);
BPF_ARRAY(uw_arena, u64, UW_ARENA_WORDS);
BPF_ARRAY(uw_arena_top, u64, 1);
BPF_ARRAY(uw_config, u64, 4);
BPF_PERCPU_ARRAY(uw_stats, u64, UW_NR_STATS);
BPF_RINGBUF_OUTPUT(uw_events, UW_RINGBUF_PAGES);

static __always_inline void uw_stat(u32 idx, u64 by) {
    u64 *v = uw_stats.lookup(&idx);
    if (v)
        *v += by;
}

static __always_inline u64 uw_rotl(u64 x, int r) { return (x << r) | (x >> (64 - r)); }

static __always_inline void uw_mix(struct uw_state *st, u64 v) {
    st->s.h1 = uw_rotl(st->s.h1 ^ v, 29) * 0x9E3779B97F4A7C15ULL;
    st->s.h2 = uw_rotl(st->s.h2 + v * 0xC2B2AE3D27D4EB4FULL, 31) ^ 0x165667B19E3779F9ULL;
}

// The mapping containing pc, by binary search in the process's sorted mapping array.
static __always_inline int uw_find_mapping(struct uw_state *st, u64 pc) {
    u32 tgid = st->s.tgid;
    struct uw_proc *p = uw_procs.lookup(&tgid);
    if (!p)
        return -UW_WHY_NO_MAPS;
    u32 lo = 0, hi = p->n;
    if (hi > UW_MAX_MAPS)
        hi = UW_MAX_MAPS;
#pragma unroll
    for (int i = 0; i < UW_MAPS_LOG2 + 1; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        if (mid >= UW_MAX_MAPS)
            break;
        if (p->m[mid].start <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return -UW_WHY_UNKNOWN_PC;
    u32 i = lo - 1;
    if (i >= UW_MAX_MAPS)
        return -UW_WHY_UNKNOWN_PC;
    if (pc >= p->m[i].end)
        return -UW_WHY_UNKNOWN_PC;
    st->c_start = p->m[i].start;
    st->c_end = p->m[i].end;
    st->c_bias = p->m[i].bias;
    st->c_module = p->m[i].module;
    st->c_first = 0;
    st->c_count = 0;
    if (st->c_module != UW_NO_MODULE) {
        u32 mid = st->c_module;
        struct uw_module *mod = uw_modules.lookup(&mid);
        if (mod) {
            st->c_first = mod->first;
            st->c_count = mod->count;
        }
    }
    return 0;
}

// The rule for ELF vaddr v: the last row with vaddr <= v in the module's slice (the row found
// last time is checked first: recursion repeats return addresses).
static __always_inline struct uw_rule *uw_find_rule(struct uw_state *st, u64 v) {
    u32 lo = 0, hi = st->c_count;
    if (v >= 0x100000000ULL)
        return 0;
    if (st->r_module == st->c_module && v >= st->r_lo && v < st->r_hi) {
        u32 rid = st->r_id;
        return uw_rules.lookup(&rid);
    }
#pragma unroll
    for (int i = 0; i < UW_ENTRIES_LOG2 + 1; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        u32 idx = st->c_first + mid;
        struct uw_entry *e = uw_entries.lookup(&idx);
        if (!e)
            return 0;
        if (e->vaddr <= (u32)v)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return 0;
    u32 idx = st->c_first + lo - 1;
    struct uw_entry *e = uw_entries.lookup(&idx);
    if (!e)
        return 0;
    u32 rid = e->rule;
    st->r_lo = e->vaddr;
    st->r_hi = 0x100000000ULL;
    if (lo < st->c_count) {
        u32 nidx = idx + 1;
        struct uw_entry *ne = uw_entries.lookup(&nidx);
        if (ne)
            st->r_hi = ne->vaddr;
    }
    st->r_id = rid;
    st->r_module = st->c_module;
    return uw_rules.lookup(&rid);
}

// Read one stack word through a window: one bpf_probe_read_user copies the whole page holding
// addr (a constant size, never crossing into a page that may be unmapped), and the frames above
// usually lie in the same page, so most frames cost no user copy at all.
static __always_inline int uw_read(struct uw_state *st, u64 addr, u64 *out) {
    if (addr - st->win_base >= UW_WIN_BYTES || (addr & 7)) {
        if (addr & 7)
            return bpf_probe_read_user(out, 8, (void *)addr);
        u64 page = addr & ~(u64)(UW_WIN_BYTES - 1);
        if (bpf_probe_read_user(st->win, UW_WIN_BYTES, (void *)page) != 0) {
            st->win_base = 1;  // nothing cached (an odd base never matches an aligned addr)
            return bpf_probe_read_user(out, 8, (void *)addr);
        }
        st->win_base = page;
    }
    *out = st->win[((addr - st->win_base) >> 3) & (UW_WIN_WORDS - 1)];
    return 0;
}

static __always_inline long uw_finish(struct uw_state *st, u32 reason) {
    st->s.reason = reason;
    st->done = 1;
    return 1;
}

static __always_inline long uw_unwind_step(struct uw_state *st) {
    if (st->done)
        return 1;
    u64 pc = st->pc;
    u32 n = st->s.n;
    if (n >= UW_MAX_DEPTH)
        return uw_finish(st, UW_WHY_MAX_DEPTH);
    st->s.pcs[n & (UW_MAX_DEPTH - 1)] = pc;
    st->s.n = n + 1;
    uw_mix(st, pc);

    if (!(pc >= st->c_start && pc < st->c_end)) {
        int err = uw_find_mapping(st, pc);
        if (err < 0)
            return uw_finish(st, -err);
    }
    u64 lookup = st->exact ? pc : pc - 1;
    u8 kind = UW_KIND_NONE;
    struct uw_rule *r = 0;
    if (st->c_module != UW_NO_MODULE) {
        r = uw_find_rule(st, lookup - st->c_bias);
        if (r)
            kind = r->kind;
    }
    if (kind == UW_KIND_END || (kind == UW_KIND_NONE && pc == 0))
        return uw_finish(st, 0);

    // Decide which stack words to read (return address, saved rbp, signal frame's rsp), then read
    // them in one loop: one copy of the read code keeps the verifier's work small.
    u64 sp = st->sp, bp = st->bp, cfa = 0;
    u64 addr[3] = {0, 0, 0};
    u32 nread = 1;
    int fp = 0;
    if (!r || kind == UW_KIND_NONE) {
        // no CFI: frame-pointer rule, only where rbp looks like a frame pointer
        if (!st->bp_valid || bp < sp || bp - sp > (8ULL << 20) || (bp & 7))
            return uw_finish(st, st->c_module == UW_NO_MODULE ? UW_WHY_NO_TABLE : UW_WHY_NO_CFI);
        cfa = bp + 16;
        addr[0] = bp + 8;
        addr[1] = bp;
        nread = 2;
        fp = 1;
    } else if (kind == UW_KIND_SIGNAL) {
        addr[0] = sp + r->ra_off;
        addr[1] = sp + r->cfa_off;
        nread = 2;
        if (r->rbp_kind == UW_RBP_AT_SP) {
            addr[2] = sp + r->rbp_off;
            nread = 3;
        }
    } else {
        if (kind == UW_KIND_RSP) {
            cfa = sp + r->cfa_off;
        } else if (kind == UW_KIND_RBP) {
            if (!st->bp_valid)
                return uw_finish(st, UW_WHY_RBP_LOST);
            cfa = bp + r->cfa_off;
        } else if (kind == UW_KIND_PLT) {
            cfa = sp + r->cfa_off + (((pc & 15) >= r->aux) ? 8 : 0);
        } else {
            return uw_finish(st, UW_WHY_UNSUPPORTED);
        }
        addr[0] = cfa + r->ra_off;
        if (r->rbp_kind == UW_RBP_AT_CFA) {
            addr[1] = cfa + r->rbp_off;
            nread = 2;
        }
    }
    u64 val[3] = {0, 0, 0};
#pragma nounroll
    for (u32 k = 0; k < 3; k++) {
        if (k >= nread)
            break;
        if (uw_read(st, addr[k], &val[k]))
            return uw_finish(st, UW_WHY_READ_FAULT);
    }
    if (kind == UW_KIND_SIGNAL) {
        st->pc = val[0];
        st->sp = val[1];
        st->bp = val[2];
        st->bp_valid = nread == 3;
        st->exact = 1;  // the interrupted instruction itself, not a return address
        return 0;
    }
    u64 ra = val[0];
    if (fp) {
        bp = val[1];
        st->s.fp_frames++;
    } else if (nread == 2) {
        bp = val[1];
    } else if (r->rbp_kind != UW_RBP_SAME) {
        st->bp_valid = 0;
    }
    if (ra == 0)
        return uw_finish(st, 0);  // conventional end of the stack
    if (cfa <= sp)
        return uw_finish(st, UW_WHY_BAD_FRAME);
    st->sp = cfa;
    st->bp = bp;
    st->pc = ra;
    st->exact = 0;
    return 0;
}

static __always_inline long uw_arena_step(struct uw_state *st, u32 i) {
    if (i >= st->s.n)
        return 1;
    u32 idx = (u32)(st->arena_off + i);
    u64 *w = uw_arena.lookup(&idx);
    if (!w)
        return 1;
    u64 pc = st->s.pcs[i & (UW_MAX_DEPTH - 1)];
    if (st->op == UW_OP_COPY) {
        *w = pc;
        return 0;
    }
    if (*w != pc) {
        st->mismatch = 1;
        return 1;
    }
    return 0;
}

static __always_inline long uw_step(u32 slot) {
    struct uw_state *st = uw_state.lookup(&slot);
    if (!st)
        return 1;
    return uw_unwind_step(st);
}

static __always_inline long uw_arena_slot(u32 slot, u32 i) {
    struct uw_state *st = uw_state.lookup(&slot);
    if (!st)
        return 1;
    return uw_arena_step(st, i);
}

// bpf_loop callbacks, two per program kind (each program's state is in its own slot, so a CPU
// sample interrupting a syscall sample on the same CPU does not clobber it).  The verifier checks
// a callback once per call site, so the big unwind step and the small arena copy/compare step are
// separate callbacks; Python tells their call sites apart by the loop count (UW_UNWIND_LOOPS for
// the unwind loop, UW_MAX_DEPTH for the arena loops).
long uw_step_sys(u64 i) { return uw_step(bpf_get_smp_processor_id() * 2); }
long uw_step_cpu(u64 i) { return uw_step(bpf_get_smp_processor_id() * 2 + 1); }
long uw_arena_sys(u64 i) { return uw_arena_slot(bpf_get_smp_processor_id() * 2, (u32)i); }
long uw_arena_cpu(u64 i) { return uw_arena_slot(bpf_get_smp_processor_id() * 2 + 1, (u32)i); }

static __always_inline void uw_emit(struct uw_state *st) {
    u32 n = st->s.n;
    if (n > UW_MAX_DEPTH)
        n = UW_MAX_DEPTH;
    u64 size = sizeof(struct uw_sample) - sizeof(st->s.pcs) + (u64)n * 8;
    if (size > sizeof(struct uw_sample))
        size = sizeof(struct uw_sample);
    if (uw_events.ringbuf_output(&st->s, size, 0) != 0)
        uw_stat(UW_STAT_RINGBUF_FULL, 1);
}

// Count the context in the kernel; only contexts not seen before go to userspace.
static __always_inline void uw_aggregate(struct uw_state *st, void *arena_cb) {
    struct uw_key key = {st->s.h1, st->s.h2};
    struct uw_count *c = uw_counts.lookup(&key);
    if (c) {
        if (c->len == st->s.n && c->tgid == st->s.tgid && c->nr == st->s.nr && c->reason == st->s.reason) {
            st->op = UW_OP_COMPARE;
            st->mismatch = 0;
            st->arena_off = c->arena_off;
            bpf_loop(UW_MAX_DEPTH, arena_cb, 0, 0);
            if (!st->mismatch) {
                __sync_fetch_and_add(&c->count, 1);
                return;
            }
        }
        uw_stat(UW_STAT_COLLISIONS, 1);
        st->s.flags |= UW_F_COLLISION;
        uw_emit(st);
        return;
    }
    u32 zero = 0;
    u64 *top = uw_arena_top.lookup(&zero);
    if (!top)
        return;
    u64 off = __sync_fetch_and_add(top, (u64)st->s.n);
    if (off + st->s.n > UW_ARENA_WORDS) {
        uw_stat(UW_STAT_ARENA_FULL, 1);
        st->s.flags |= UW_F_UNAGGREGATED;
        uw_emit(st);
        return;
    }
    st->op = UW_OP_COPY;
    st->arena_off = off;
    bpf_loop(UW_MAX_DEPTH, arena_cb, 0, 0);
    struct uw_count nc = {};
    nc.count = 1;
    nc.arena_off = off;
    nc.len = st->s.n;
    nc.tgid = st->s.tgid;
    nc.nr = st->s.nr;
    nc.reason = st->s.reason;
    if (uw_counts.update(&key, &nc) != 0) {  // full
        uw_stat(UW_STAT_COUNTS_FULL, 1);
        st->s.flags |= UW_F_UNAGGREGATED;
    } else {
        st->s.flags |= UW_F_NEW;
        uw_stat(UW_STAT_NEW, 1);
    }
    uw_emit(st);
}

#define UW_UNWIND_LOOPS (UW_MAX_DEPTH + 1)

static __always_inline void uw_sample(u32 slot, u64 pid_tgid, s32 nr, u64 ip, u64 sp, u64 bp, void *loop_cb,
                                      void *arena_cb) {
    struct uw_state *st = uw_state.lookup(&slot);
    if (!st)
        return;
    u32 tgid = pid_tgid >> 32;
    st->pc = ip;
    st->sp = sp;
    st->bp = bp;
    st->bp_valid = 1;
    st->exact = 1;
    st->done = 0;
    st->op = UW_OP_UNWIND;
    st->c_start = 0;
    st->c_end = 0;
    st->r_module = UW_NO_MODULE;
    st->win_base = 1;
    st->s.ktime_ns = bpf_ktime_get_ns();
    st->s.kind = UW_EV_SAMPLE;
    st->s.tgid = tgid;
    st->s.tid = (u32)pid_tgid;
    st->s.nr = nr;
    st->s.n = 0;
    st->s.reason = 0;
    st->s.fp_frames = 0;
    st->s.flags = 0;
    st->s.h1 = 0x243F6A8885A308D3ULL;
    st->s.h2 = 0x13198A2E03707344ULL;
    if (ip == 0 && sp == 0) {
        st->s.reason = UW_WHY_NO_REGS;
    } else {
        bpf_loop(UW_UNWIND_LOOPS, loop_cb, 0, 0);
        if (!st->done)
            st->s.reason = UW_WHY_MAX_DEPTH;
    }
    uw_mix(st, ((u64)tgid << 32) | (u32)nr);
    uw_mix(st, ((u64)st->s.reason << 32) | st->s.n);
    uw_stat(UW_STAT_SAMPLES, 1);
    uw_stat(UW_STAT_FRAMES, st->s.n);
    if (st->s.fp_frames)
        uw_stat(UW_STAT_FP_FRAMES, st->s.fp_frames);
    if (st->s.reason)
        uw_stat(UW_STAT_INCOMPLETE, 1);
    u32 k = UW_CFG_AGGREGATE;
    u64 *agg = uw_config.lookup(&k);
    if (agg && *agg)
        uw_aggregate(st, arena_cb);
    else
        uw_emit(st);
}

// A forked child has its parent's mappings until it execs: copy them on its first sample.
static __always_inline void uw_inherit(u32 tgid) {
    if (uw_procs.lookup(&tgid))
        return;
    u32 *parent = uw_parent.lookup(&tgid);
    if (!parent)
        return;
    u32 ptgid = *parent;
    struct uw_proc *pp = uw_procs.lookup(&ptgid);
    if (pp && uw_procs.update(&tgid, pp) == 0)
        uw_stat(UW_STAT_PROC_COPIED, 1);
    uw_parent.delete(&tgid);
}

// mmap/mprotect with PROT_EXEC: the mapping exists once the call returns, i.e. at the process's
// next syscall; tell userspace then so it re-reads the maps.
static __always_inline void uw_watch_maps(u32 tgid, long nr, struct pt_regs *regs) {
    u32 *pending = uw_pending.lookup(&tgid);
    if (pending) {
        uw_pending.delete(&tgid);
        struct uw_maps_event *e = uw_events.ringbuf_reserve(sizeof(struct uw_maps_event));
        if (e) {
            e->ktime_ns = bpf_ktime_get_ns();
            e->kind = UW_EV_MAPS;
            e->tgid = tgid;
            uw_events.ringbuf_submit(e, 0);
        } else {
            uw_stat(UW_STAT_RINGBUF_FULL, 1);
        }
    }
    if (nr == 9 || nr == 10) {  // mmap, mprotect: prot is the third argument (rdx)
        u64 prot = 0;
        bpf_probe_read_kernel(&prot, sizeof(prot), &regs->dx);
        if (prot & 4) {  // PROT_EXEC
            u32 one = 1;
            uw_pending.update(&tgid, &one);
        }
    }
}

int uw_sys_enter(struct bpf_raw_tracepoint_args *ctx) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    if (!tracked.lookup(&tgid))
        return 0;
    long nr = (long)ctx->args[1];
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
    uw_inherit(tgid);
    uw_watch_maps(tgid, nr, regs);
    if (!ccprof_syscall_wanted(nr))
        return 0;
    u64 ip = 0, sp = 0, bp = 0;
    bpf_probe_read_kernel(&ip, sizeof(ip), &regs->ip);
    bpf_probe_read_kernel(&sp, sizeof(sp), &regs->sp);
    bpf_probe_read_kernel(&bp, sizeof(bp), &regs->bp);
    uw_sample(bpf_get_smp_processor_id() * 2, pid_tgid, (s32)nr, ip, sp, bp, uw_step_sys, uw_arena_sys);
    return 0;
}

// CPU-clock sample of a tracked process: unwind from its user registers (from the interrupted
// context when it was in user mode, else from the saved user registers of the task).
int uw_cpu_sample(struct bpf_perf_event_data *ctx) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    if (!tracked.lookup(&tgid))
        return 0;
    uw_inherit(tgid);
    u64 ip = 0, sp = 0, bp = 0, cs = 0;
    bpf_probe_read_kernel(&cs, sizeof(cs), &ctx->regs.cs);
    if ((cs & 3) == 3) {
        bpf_probe_read_kernel(&ip, sizeof(ip), &ctx->regs.ip);
        bpf_probe_read_kernel(&sp, sizeof(sp), &ctx->regs.sp);
        bpf_probe_read_kernel(&bp, sizeof(bp), &ctx->regs.bp);
    } else {
        struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
        if (regs) {
            bpf_probe_read_kernel(&ip, sizeof(ip), &regs->ip);
            bpf_probe_read_kernel(&sp, sizeof(sp), &regs->sp);
            bpf_probe_read_kernel(&bp, sizeof(bp), &regs->bp);
        }
    }
    uw_sample(bpf_get_smp_processor_id() * 2 + 1, pid_tgid, -1, ip, sp, bp, uw_step_cpu, uw_arena_cpu);
    return 0;
}

// Tracepoint programs read their fields at offsets Python takes from the tracefs format (kernels
// differ; bcc generates one struct per tracepoint and syscall_sampler.c already has those).
int uw_fork(void *args) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!uw_procs.lookup(&tgid))
        return 0;
    u32 child = *(u32 *)((char *)args + UW_FORK_CHILD_PID_OFF);
    uw_parent.update(&child, &tgid);
    return 0;
}

int uw_exec(void *args) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    uw_procs.delete(&tgid);  // a new image: userspace loads its mappings (EV_EXEC)
    uw_parent.delete(&tgid);
    return 0;
}

int uw_exit(void *args) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32, tid = (u32)pid_tgid;
    uw_parent.delete(&tid);
#ifdef UW_EXIT_GROUP_DEAD_OFF
    int group_dead = *(u8 *)((char *)args + UW_EXIT_GROUP_DEAD_OFF);
#else
    int group_dead = (tid == tgid);
#endif
    if (group_dead) {
        uw_procs.delete(&tgid);
        uw_pending.delete(&tgid);
    }
    return 0;
}
