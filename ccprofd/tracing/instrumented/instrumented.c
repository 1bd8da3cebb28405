// ccprofd instrumented mode: per-thread Valence / PCCE / HCCE state maintained by uprobes, no
// return probes.
//
// Compiled as the prelude of syscall_sampler.c (which provides tracked-process filtering, fork
// following and the syscall ring buffer); CCPROF_SYSCALL_HOOK fills each syscall event's context.
//
// Per thread (a slot of cc_states, found through cc_slot_of[tid]) the state is a stack of
// *pieces*, one per probe event that changed the context: the recorded stack pointer of the frame
// it belongs to, the return address expected in the word below it, and a snapshot of the encoded
// state (acycID words, recID length, segment count) from *before* the piece.  A piece is dead once
// its frame is gone; at every event the dead pieces are dropped first and the state restored from
// the snapshot of the lowest dropped piece (Encoder.unwind semantics), so nothing has to run when
// a function returns, longjmps or unwinds an exception.
//
// Live pieces are sorted by recorded sp (each new piece belongs to a frame nested in the previous
// ones), so "drop every piece whose frame lies below the current frame" is a binary search -- within
// one stack: a signal handler's pieces on the sigaltstack follow those of the stack it interrupted,
// wherever the two stacks lie, and each event cuts only pieces on its own stack (cc_cut).  The
// current frame is known exactly at probes (CFA from .eh_frame: sp- or rbp-based, per site) and
// bounded at samples (sp + 8).  A few top pieces are then checked against the stack word below
// their recorded sp: a sibling call made at the same stack depth, or a return address overwritten
// since, means the piece is dead.
//
// Schemes (the plan's acyc_op, compile-time ACYC_OP_ADD / PCCE_PAIRS):
//  - Valence ("set"): an acyclic edge sets its bit range of acycID; a cyclic edge appends its
//    REC_BITS-wide code to the recID bit string.
//  - HCCE ("add"): an acyclic edge adds En(e) to the multi-word id (carry across ACYC_WORDS words);
//    a cyclic edge appends its code to recID as Valence does.
//  - PCCE ("add" + pairs): forward edges add as HCCE does; a back edge pushes the pair (id before
//    it, back-edge code) and sets the id to the edge's code.  The pair stack lives in the same bit
//    string as recID: one REC_BITS-wide record per pair, PAIR_CODE_BITS of code then PAIR_ID_BITS
//    of saved id (the piece's snapshot holds the id too, but a sample must carry every pair).
// Restoring a piece's snapshot undoes all three.  An id that does not fit (a carry out of the top
// word, bits above PAIR_ID_BITS, or a code wider than the id: site flag F_OVERFLOW) is never
// wrapped: the thread is frozen at that frame (samples say SF_OVERFLOW) until the frame is gone.
//
// Compile-time parameters (set by instrumented.py): ACYC_WORDS, MAX_PIECES, MAX_SEGS, EMIT_SEGS,
// REC_BITS, REC_WORDS, REC_EMIT_WORDS, NPROBES, NCALLSITES, NSLOTS, LOG2_MAX_PIECES, ACYC_OP_ADD,
// PCCE_PAIRS, PAIR_CODE_BITS, PAIR_ID_BITS, ID_BITS.  None of them changes the code's size with the
// target binary: per-site data lives in maps.

#include <asm/ptrace.h>  // struct pt_regs (the sampler includes it too, after this prelude)
#include <uapi/linux/bpf_perf_event.h>

#define CC_NONE 0xffffffffu
#ifndef CC_ARG_LEN
#define CC_ARG_LEN 256
#endif

// piece kinds
#define K_CALL 1      // acyc / cyclic edge at a call instruction
#define K_TAIL 2      // acyc / cyclic edge at a tail jmp (recorded sp = the frame's CFA)
#define K_EXIT 3      // call leaving the binary (PLT, GOT)
#define K_TAILEXIT 4  // tail jmp leaving the binary
#define K_ROOT 5      // root edge: the thread's first analysed function
#define K_SEG 6       // segment: entry from outside code / an indirect call / unknown (anchor)

// site flags (the probe plan's reasons)
#define F_ACYC 1
#define F_CYCLIC 2
#define F_EXIT 4
#define F_OUTSIDE 8
#define F_INDIRECT 16
#define F_SCOPE 32
#define F_OVERFLOW 64  // the edge's code does not fit in ACYC_WORDS words
#define F_CUT 128      // a zero-code edge: the probe only cuts the state at the caller's CFA (no piece)

// thread state flags
#define ST_INCOMPLETE_BASE 1  // frames above the first event are unknown (attached to a running thread)
#define ST_FROZEN 2           // a push failed (bounds): nothing is recorded until that frame is gone
#define ST_FORK_PENDING 4     // copied at fork; a thread of the same process resets at first use
#define ST_BIAS 8             // bias is known
#define ST_READFAIL 16        // a stack word could not be read: liveness was assumed
#define ST_OVERFLOW 32        // frozen because an id did not fit (PCCE/HCCE)

// sample flags
#define SF_NOSTATE 1
#define SF_FROZEN 2
#define SF_INCOMPLETE_BASE 4
#define SF_SEGS_TRUNC 8
#define SF_REC_TRUNC 16
#define SF_READFAIL 32
#define SF_BIAS 64
#define SF_OVERFLOW 128

// return-address table values
#define RS_INDIRECT 0x80000000u
#define RS_IN_SCOPE 0x40000000u
#define RS_VIA_PLT 0x20000000u
#define RS_INDEX 0x1fffffffu

// config slots
#define CFG_LAUNCH_TGID 0
#define CFG_LAUNCHED 1
#define CFG_SCOPED 2
#define CFG_AGGREGATE 3  // count syscall samples per context in cc_agg_counts (the daemon)
#define CFG_EMIT_HITS 4  // aggregating: also send a header record per sample of a known context
#define CFG_TEXT_LO 5    // the binary's analysed functions span [lo, hi) (ELF vaddrs)
#define CFG_TEXT_HI 6
#define NR_CFG 8

// statistics
#define S_SITE 0
#define S_TAIL 1
#define S_ENTRY 2
#define S_SAMPLES 3
#define S_PUSH 4
#define S_DROPPED 5
#define S_FROZEN 6
#define S_NO_SLOT 7
#define S_READFAIL 8
#define S_FORK_COPIES 9
#define S_RET_DEAD 10
#define S_RINGBUF_FULL 11
#define S_OVERFLOW 12
#define S_AGG_NEW 13       // contexts counted in the kernel (each sent once, whole)
#define S_COUNTS_FULL 14   // a new context found cc_agg_counts full: its samples are sent one by one
#define S_AGG_TOO_BIG 15   // a state larger than an aggregation key: sent on its own
#define S_SCOPE_LOST 16    // a --scope entry's record did not fit in cc_scope_events
#define NR_CC_STATS 17

#ifndef ACYC_OP_ADD
#define ACYC_OP_ADD 0
#endif
#ifndef SCOPE_PAGES
#define SCOPE_PAGES 0  // --scope: stack pages copied at a scope entry for the prefix unwind
#endif
#ifndef PCCE_PAIRS
#define PCCE_PAIRS 0
#endif
#ifndef ID_BITS
#define ID_BITS (64 * ACYC_WORDS)
#endif

#define RET_CHECKS 4
#define STACK_SWITCH_GAP (64ULL << 20)  // farther than any one stack reaches: another stack

struct cc_site {
    u64 vaddr;
    u64 ret_vaddr;
    u64 mask[ACYC_WORDS];
    u64 val[ACYC_WORDS];
    u32 flags;
    u32 rec_code;
    u32 callsite;
    s32 cfa_reg;  // 7 rsp, 6 rbp, -1 unknown
    s64 cfa_off;
    u32 node;  // entry probes: the entered function (dense index)
    s32 cond;  // tail probes on a conditional jump: x86 condition code; -1 unconditional
};

struct cc_piece {
    u64 sp;
    u64 ret;
    u32 probe;
    u32 aux;  // K_EXIT/K_TAILEXIT/K_SEG: callsite id of the exit (CC_NONE: unknown)
    u32 kind;
    u32 rec_before;
    u32 nsegs_before;
    u32 pad;
    u64 acyc_before[ACYC_WORDS];
};

struct cc_state {
    u32 n;
    u32 rec_len;
    u32 nsegs;
    u32 flags;
    u64 frozen_sp;
    u64 bias;
    u32 parent_tgid;
    u32 scope_seq;  // --scope: entries into a scope function so far (a prefix record's join key)
    u64 search_pos;  // scratch of cc_cut
    u64 acyc[ACYC_WORDS];
    u32 segs[MAX_SEGS];
    u64 rec[REC_WORDS];
    struct cc_piece p[MAX_PIECES];
};

struct cc_seg_out {
    u64 saved[ACYC_WORDS];
    u32 rec_height;
    u32 aux;
    u32 probe;
    u32 pad;
};

struct cc_sample {
    u32 flags;
    u32 depth;
    u32 top_kind;
    u32 top_probe;
    u32 top_aux;
    u32 rec_len;
    u32 nsegs;
    u32 rec_base;  // index of the first emitted recID word
    u64 bias;
    u64 acyc[ACYC_WORDS];
    struct cc_seg_out segs[EMIT_SEGS];  // the innermost segments, outermost first
    u64 rec[REC_EMIT_WORDS];
};

// One context sample, built here whole and sent through cc_events compacted (cc_send): the header
// up to arg, the arg_len bytes of the path argument, the sample up to its segments, its emitted
// segments, its recID words -- nothing for what is absent (sent whole, a sample took 1.9 KB of the
// ring even without recursion or segments, and a burst of 100k syscalls overflowed it).  An
// AGG_HIT record is the header and the argument alone.
struct cc_record {
    u64 ktime_ns;  // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u32 tgid;
    u32 tid;
    s32 nr;        // syscall number; -1 for CPU samples
    u32 event;     // 1 syscall, 2 cpu
    u64 ip;
    u64 sp;
    u32 agg;       // AGG_*: how the sample is counted
    u32 ctx_id;    // AGG_NEW / AGG_HIT: the context's id in cc_agg_counts
    u32 arg_len;   // bytes of arg sent (its NUL included); 0: none or unreadable
    u32 pad;
    u64 sargs[6];  // the syscall's argument registers at entry (rdi rsi rdx r10 r8 r9); 0 for CPU samples
    char arg[CC_ARG_LEN];  // path argument of open/openat/execve..., NUL-terminated (empty: none/unreadable)
    struct cc_sample cc;
};

#define EV_CC_SYSCALL 1
#define EV_CC_CPU 2

// Aggregate mode (CFG_AGGREGATE, the daemon): syscall samples are counted per context in the
// kernel; only a context's first sample is sent (AGG_NEW), later ones only counted (and sent as a
// header when CFG_EMIT_HITS).  The key is everything decoding reads, compared whole by the hash
// map (no hash of it stands in for it, so two contexts are never merged): the syscall, the sample
// flags, the top piece, the id words, the emitted segments and the recID bits (masked to rec_len),
// and the sampled instruction as an ELF vaddr of the binary (ip - bias) -- or "outside the binary"
// (decoding looks up only which analysed function holds it), so processes of one binary share
// keys.  A state larger than a key (more than AGG_SEGS segments or AGG_REC_WORDS recID words, or
// truncated) and a new context when the table is full are sent on their own (AGG_UNAGGREGATED).
#define AGG_NONE 0          // a sample of its own, not counted in the kernel
#define AGG_NEW 1           // first sample of a context: counted under ctx_id, sent whole
#define AGG_HIT 2           // a sample of a known context (CFG_EMIT_HITS): header only
#define AGG_UNAGGREGATED 3  // could not be counted in the kernel: sent whole, counted by userspace
#define AGG_OUTSIDE 0xffffffffffffffffULL

struct cc_agg_key {
    s32 nr;
    u32 flags;
    u32 depth;
    u32 top_kind;
    u32 top_probe;
    u32 top_aux;
    u32 rec_len;
    u32 nsegs;
    u64 ipv;
    u64 acyc[ACYC_WORDS];
    struct cc_seg_out segs[AGG_SEGS];
    u64 rec[AGG_REC_WORDS];
};

struct cc_agg_val {
    u64 count;
    u32 id;
    u32 pad;
};

// The sampler's event is small and zeroed with memset: the context goes to our own ring buffer (or
// is counted in the kernel), and the sampler's event is not sent at all.
#define CCPROF_HOOK_SENDS_SYSCALLS 1
#define CCPROF_SYSCALL_HOOK(ctx, regs, e) \
    cc_emit((e)->ktime_ns, (e)->nr, EV_CC_SYSCALL, (e)->ip, (e)->sp, cc_path_arg((regs), (e)->nr), (regs))

BPF_ARRAY(cc_sites, struct cc_site, NPROBES);
BPF_HASH(cc_ret_sites, u64, u32, NCALLSITES);
BPF_ARRAY(cc_cs_callee, u32, NCALLSITES);          // callsite id -> direct callee (dense), CC_NONE
BPF_HASH(cc_tail_reach, u64, u8, NTAILREACH);      // (g << 32 | f): g tail-jumps (transitively) to f
// The value types bcc sees are opaque char blobs: bcc generates printf/scanf helpers for every map
// value type, element by element (seconds of compile time for the piece stack and the sample
// record); a char array is one string to it.  The sizes come from Python as plain numbers (bcc
// writes array bounds into a JSON type description as spelled, so an expression there breaks it).
struct cc_state_blob {
    char b[CC_STATE_BYTES];
};
_Static_assert(sizeof(struct cc_state) <= CC_STATE_BYTES, "CC_STATE_BYTES too small");
struct cc_record_blob {
    char b[CC_RECORD_BYTES];
};
_Static_assert(sizeof(struct cc_record) <= CC_RECORD_BYTES, "CC_RECORD_BYTES too small");
BPF_ARRAY(cc_states, struct cc_state_blob, NSLOTS);
BPF_HASH(cc_slot_of, u32, u32, NSLOTS);
BPF_QUEUE(cc_free, u32, NSLOTS);
BPF_ARRAY(cc_config, u64, NR_CFG);
BPF_PERCPU_ARRAY(cc_stats, u64, NR_CC_STATS);
// [event - 1]: the record being built (a CPU sample may interrupt a syscall one); [2 + event - 1]:
// its compacted copy (cc_send)
BPF_PERCPU_ARRAY(cc_scratch, struct cc_record_blob, 4);
BPF_RINGBUF_OUTPUT(cc_events, CC_RINGBUF_PAGES);
struct cc_agg_key_blob {
    char b[CC_AGG_KEY_BYTES];
};
_Static_assert(sizeof(struct cc_agg_key) == CC_AGG_KEY_BYTES, "CC_AGG_KEY_BYTES differs from the key");
BPF_HASH(cc_agg_counts, struct cc_agg_key_blob, struct cc_agg_val, AGG_CONTEXTS);
BPF_PERCPU_ARRAY(cc_agg_scratch, struct cc_agg_key_blob, 1);  // syscall samples only: one per CPU
BPF_ARRAY(cc_agg_next, u64, 1);  // the next context id

// Index masking the compiler cannot drop (it would otherwise reason the mask away from earlier
// bounds checks, and the verifier, which tracks less, would reject the access).
static __always_inline u32 cc_ix(u32 i, u32 mask) {
    asm volatile("" : "+r"(i));
    return i & mask;
}
#define PIX(i) cc_ix((i), MAX_PIECES - 1)
#define SIX(i) cc_ix((i), MAX_SEGS - 1)
#define RIX(i) cc_ix((i), REC_WORDS - 1)

// 1 when a >= b (unsigned), without a branch (see cc_cut).
static __always_inline u64 cc_ge(u64 a, u64 b) {
    asm volatile("" : "+r"(a), "+r"(b));
    u64 d = a - b;
    u64 borrow = ((~a & b) | ((~a | b) & d)) >> 63;
    asm volatile("" : "+r"(borrow));
    return 1 - borrow;
}

static __always_inline void cc_stat(u32 idx) {
    u64 *v = cc_stats.lookup(&idx);
    if (v)
        (*v)++;
}

static __always_inline u64 cc_cfg(u32 k) {
    u64 *v = cc_config.lookup(&k);
    return v ? *v : 0;
}

static __always_inline void cc_reset(struct cc_state *s, u32 flags) {
    s->n = 0;
    s->rec_len = 0;
    s->nsegs = 0;
    s->flags = flags;
    s->frozen_sp = 0;
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        s->acyc[w] = 0;
}

// The calling thread's state, or NULL when the thread is not traced.
static __always_inline struct cc_state *cc_state_of_current(void) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tid = (u32)pid_tgid;
    u32 *slot = cc_slot_of.lookup(&tid);
    if (!slot)
        return 0;
    u32 k = *slot;
    struct cc_state *s = (struct cc_state *)cc_states.lookup(&k);
    if (!s)
        return 0;
    if (s->flags & ST_FORK_PENDING) {
        if ((u32)(pid_tgid >> 32) == s->parent_tgid)
            cc_reset(s, 0);  // a new thread: its stack starts empty
        else
            s->flags &= ~ST_FORK_PENDING;  // a new process: keeps the parent's context
    }
    return s;
}

// Restore the state to what it was before piece m, dropping pieces m..n-1.
static __always_inline void cc_truncate(struct cc_state *s, u32 m) {
    if (m >= s->n)
        return;
    struct cc_piece *p = &s->p[PIX(m)];
    s->rec_len = p->rec_before;
    s->nsegs = p->nsegs_before;
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        s->acyc[w] = p->acyc_before[w];
    s->n = m;
}

// Drop the pieces whose frames are gone: every piece recorded below `limit` (the current frame's
// CFA), then top pieces whose return address is no longer in the word below their recorded sp.
static __always_inline void cc_cut_base(struct cc_state *s);

// The calling task's alternate signal stack, (lo, lo + size] as the kernel's on_sig_stack() tests
// it (task->sas_ss_sp/sas_ss_size, offsets from the kernel's BTF); (0, 0): none, or unknown.
static __always_inline void cc_altstack(u64 *lo, u64 *size) {
    *lo = 0;
    *size = 0;
#ifdef CCPROF_OFF_TASK_SAS_SS_SP
    char *task = (char *)bpf_get_current_task();
    if (bpf_probe_read_kernel(lo, sizeof(*lo), task + CCPROF_OFF_TASK_SAS_SS_SP) != 0 ||
        bpf_probe_read_kernel(size, sizeof(*size), task + CCPROF_OFF_TASK_SAS_SS_SIZE) != 0) {
        *lo = 0;
        *size = 0;
    }
#endif
}

// 1 when stack address v lies on the alternate signal stack (lo, lo + size], without a branch.
static __always_inline u64 cc_on_alt(u64 v, u64 lo, u64 size) {
    return cc_ge(v, lo + 1) & cc_ge(size, v - lo);
}

static __always_inline void cc_cut(struct cc_state *s, u64 limit) {
    // Stack pointers are compared only within one stack.  A handler running on the sigaltstack
    // pushes its pieces after those of the stack it interrupted, and the alternate stack may lie
    // above that stack as well as below it: an event on the alternate stack cuts only pieces on it
    // (the interrupted stack's pieces stay, whatever their addresses), and an event off it drops
    // every piece on it (the handler has returned or jumped out) and cuts the others as usual.
    // Pieces off the alternate stack always come first, so "the piece stays" is still a prefix of
    // the pieces and one binary search finds it.
    u64 alt_lo, alt_size;
    cc_altstack(&alt_lo, &alt_size);
    u64 on_alt = cc_on_alt(limit, alt_lo, alt_size);
    // Branch-free binary search for the number of pieces that stay.  The running position lives in
    // map memory, whose contents the verifier does not track: in registers it would be split into
    // every reachable value (2^LOG2_MAX_PIECES verifier paths).
    u64 n = s->n;
    s->search_pos = 0;
#pragma unroll
    for (int j = LOG2_MAX_PIECES; j >= 0; j--) {
        u64 step = 1ULL << j;
        u64 pos = s->search_pos;
        u64 cand = pos + step;
        u64 v = s->p[PIX((u32)(cand - 1))].sp;
        u64 ge = cc_ge(v, limit);
        u64 off = cc_on_alt(v, alt_lo, alt_size) ^ 1;  // the piece is not on the alternate stack
        u64 stays = (off & ge) | (on_alt & (off | ge));
        u64 ok = cc_ge(n, cand) & stays;
        s->search_pos = pos + step * ok;
    }
    u64 pos = s->search_pos;
    if (pos == 0 && n > 0 && limit - s->p[0].sp > STACK_SWITCH_GAP) {
        // Everything, the thread's outermost recorded frame included, lies far below this event.
        // If that frame's return address is still in place it may well be alive and this event on
        // another stack (makecontext; a sigaltstack whose range the task no longer names, e.g.
        // SS_AUTODISARM) above it: from now on, the context above what is recorded next is not known.
        struct cc_piece *base = &s->p[0];
        u64 word = 0;
        if (bpf_probe_read_user(&word, sizeof(word), (void *)(base->sp - 8)) == 0 && word == base->ret)
            s->flags |= ST_INCOMPLETE_BASE;
    }
    if (pos < n) {
        cc_stat(S_DROPPED);
        cc_truncate(s, (u32)pos);
    }
#pragma unroll
    for (int k = 0; k < RET_CHECKS; k++) {
        u32 n = s->n;
        if (n == 0 || n > MAX_PIECES)
            break;
        struct cc_piece *top = &s->p[PIX(n - 1)];
        u64 word = 0;
        if (bpf_probe_read_user(&word, sizeof(word), (void *)(top->sp - 8)) != 0) {
            s->flags |= ST_READFAIL;
            cc_stat(S_READFAIL);
            break;
        }
        if (word == top->ret)
            break;
        cc_stat(S_RET_DEAD);
        cc_truncate(s, n - 1);
    }
    if (s->flags & ST_FROZEN) {
        // The frame that could not be recorded is gone once this event is above it on its own
        // stack, or off the alternate stack it was on; a handler on the alternate stack leaves a
        // frame of the interrupted stack in place.
        u64 frozen_alt = cc_on_alt(s->frozen_sp, alt_lo, alt_size);
        if ((frozen_alt == on_alt && s->frozen_sp < limit) || (frozen_alt && !on_alt))
            s->flags &= ~(ST_FROZEN | ST_OVERFLOW);
    }
}

// The thread's outermost recorded frame has returned when its return address is gone from the word
// below its recorded sp: main returned and exit() now runs atexit handlers and destructors in frames
// that reuse main's stack, where stale pieces above them can pass the top-piece checks by chance
// (their words not yet overwritten).  Everything recorded is nested in that frame, so it all goes.
// Checked at entry probes and samples only: the events a frame can be re-entered through.
static __always_inline void cc_cut_base(struct cc_state *s) {
    u32 n = s->n;
    if (n == 0 || n > MAX_PIECES)
        return;
    struct cc_piece *base = &s->p[0];
    u64 word = 0;
    if (bpf_probe_read_user(&word, sizeof(word), (void *)(base->sp - 8)) != 0) {
        s->flags |= ST_READFAIL;
        cc_stat(S_READFAIL);
        return;
    }
    if (word != base->ret) {
        cc_stat(S_RET_DEAD);
        cc_truncate(s, 0);
        s->flags &= ~ST_FROZEN;  // the frame that could not be recorded was nested in it too
    }
}

// Append a piece (snapshotting the state before it); NULL when full (the thread freezes).
static __always_inline struct cc_piece *cc_push(struct cc_state *s, u64 sp, u64 ret, u32 probe, u32 kind,
                                                u32 aux) {
    u32 n = s->n;
    if (n >= MAX_PIECES) {
        s->flags |= ST_FROZEN;
        s->frozen_sp = sp;
        cc_stat(S_FROZEN);
        return 0;
    }
    struct cc_piece *p = &s->p[PIX(n)];
    p->sp = sp;
    p->ret = ret;
    p->probe = probe;
    p->aux = aux;
    p->kind = kind;
    p->pad = 0;
    p->rec_before = s->rec_len;
    p->nsegs_before = s->nsegs;
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        p->acyc_before[w] = s->acyc[w];
    s->n = n + 1;
    cc_stat(S_PUSH);
    return p;
}

// Append the low `nbits` (1..64, a compile-time constant at every use) of v to the recID bit string.
static __always_inline void cc_push_bits(struct cc_state *s, u64 v, u32 nbits) {
    u32 pos = s->rec_len;
    u32 w = RIX(pos >> 6);
    u32 sh = pos & 63;
    u64 m = nbits >= 64 ? ~0ULL : ((1ULL << nbits) - 1);
    v &= m;
    s->rec[w] = (s->rec[w] & ~(m << sh)) | (v << sh);
    if (sh + nbits > 64) {  // then sh >= 1: both shifts below are < 64
        u32 w1 = RIX(w + 1);
        s->rec[w1] = (s->rec[w1] & ~(m >> (64 - sh))) | (v >> (64 - sh));
    }
    s->rec_len = pos + nbits;
}

static __always_inline void cc_push_rec(struct cc_state *s, u32 code) {
#if REC_BITS > 0
    cc_push_bits(s, code, REC_BITS);
#endif
}

static __always_inline void cc_freeze(struct cc_state *s, u64 sp, u32 stat) {
    s->flags |= ST_FROZEN;
    s->frozen_sp = sp;
    cc_stat(stat);
}

// The acyclic part of an edge: set its bits (Valence) or add its code (PCCE/HCCE).  Returns 0
// when the resulting id does not fit (nothing is changed then).
static __always_inline int cc_apply_acyc(struct cc_state *s, struct cc_site *si) {
    if (si->flags & F_OVERFLOW)
        return 0;
#if ACYC_OP_ADD
    u64 out[ACYC_WORDS];
    u64 carry = 0;
    u64 high = 0;  // bits at or above ID_BITS
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++) {
        u64 a = s->acyc[w];
        u64 t = a + si->val[w];
        u64 c1 = t < a;
        u64 r = t + carry;
        u64 c2 = r < t;
        out[w] = r;
        carry = c1 | c2;
        if (ID_BITS - 64 * w < 64)
            high |= ID_BITS <= 64 * w ? r : (r >> (ID_BITS - 64 * w));
    }
    if (carry | high)
        return 0;
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        s->acyc[w] = out[w];
#else
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        s->acyc[w] = (s->acyc[w] & ~si->mask[w]) | si->val[w];
#endif
    return 1;
}

// A cyclic edge: Valence/HCCE push the recID code; PCCE pushes (id, back-edge code) and sets the id
// to the edge's code.
static __always_inline int cc_apply_cyclic(struct cc_state *s, struct cc_site *si) {
    if (si->flags & F_OVERFLOW)
        return 0;
#if PCCE_PAIRS
#if PAIR_CODE_BITS > 0
    cc_push_bits(s, si->rec_code, PAIR_CODE_BITS);
#endif
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++) {
        if (PAIR_ID_BITS > 64 * w)
            cc_push_bits(s, s->acyc[w], PAIR_ID_BITS - 64 * w >= 64 ? 64 : PAIR_ID_BITS - 64 * w);
    }
#if PAIR_CODE_BITS + PAIR_ID_BITS == 0
    cc_push_bits(s, 0, 1);  // a record must take room: its count is the pair stack's height
#endif
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        s->acyc[w] = si->val[w];
#else
    cc_push_rec(s, si->rec_code);
#endif
    return 1;
}

// Push the piece of an edge probe (call or tail jump) and apply the edge; an id that would not
// fit freezes the thread at this frame instead (flagged, never wrapped).
static __always_inline void cc_edge(struct cc_state *s, struct cc_site *si, u64 sp, u64 ret, u32 id, u32 kind) {
    if (!(si->flags & (F_CYCLIC | F_ACYC)))
        return;
    if (!cc_push(s, sp, ret, id, kind, si->callsite))
        return;
    int ok = (si->flags & F_CYCLIC) ? cc_apply_cyclic(s, si) : cc_apply_acyc(s, si);
    if (!ok) {
        cc_truncate(s, s->n - 1);
        cc_freeze(s, sp, S_OVERFLOW);
        s->flags |= ST_OVERFLOW;
    }
}

static __always_inline void cc_push_segment(struct cc_state *s, u64 sp, u64 ret, u32 probe, u32 aux) {
    if (s->nsegs >= MAX_SEGS) {
        s->flags |= ST_FROZEN;
        s->frozen_sp = sp;
        cc_stat(S_FROZEN);
        return;
    }
    u32 idx = s->n;
    if (!cc_push(s, sp, ret, probe, K_SEG, aux))
        return;
    s->segs[SIX(s->nsegs)] = idx;
    s->nsegs += 1;
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        s->acyc[w] = 0;
}

static __always_inline u64 cc_read_word(struct cc_state *s, u64 addr) {
    u64 word = 0;
    if (bpf_probe_read_user(&word, sizeof(word), (void *)addr) != 0) {
        s->flags |= ST_READFAIL;
        cc_stat(S_READFAIL);
    }
    return word;
}

static __always_inline u64 cc_cfa(struct pt_regs *ctx, struct cc_site *si) {
    // Both registers are loaded unconditionally: a load whose address depends on cfa_reg would be a
    // "modified ctx pointer" to the verifier.
    u64 sp = ctx->sp;
    u64 bp = ctx->bp;
    asm volatile("" : "+r"(sp), "+r"(bp));
    if (si->cfa_reg == 6)
        return bp + si->cfa_off;
    if (si->cfa_reg == 7)
        return sp + si->cfa_off;
    return sp + 8;  // no CFI: only the stack pointer bounds the frame
}

// An anchor: the thread's context above this frame is unknown (attached mid-run, --scope).
// Also when the innermost live piece is a call *out of* the binary: binary code running inside a
// library call was entered by a path no probe saw (a callback into a function without an entry
// probe, a context switch), so its callers are unknown too.
static __always_inline void cc_anchor_if_empty(struct cc_state *s, u64 cfa, u32 probe) {
    u32 n = s->n;
    int unknown = n == 0 && (s->flags & ST_INCOMPLETE_BASE);
    if (n > 0 && n <= MAX_PIECES) {
        struct cc_piece *top = &s->p[PIX(n - 1)];
        unknown = top->kind == K_EXIT || top->kind == K_TAILEXIT;
    }
    if (unknown)
        cc_push_segment(s, cfa, cc_read_word(s, cfa - 8), probe, CC_NONE);
}

// Probe on a call instruction.  A zero-code edge (F_CUT) is probed too, for its cut alone: it drops
// the pieces of calls the caller made earlier (returned), whose return-address words may survive in
// the frames the callee is about to build; cc_edge then pushes nothing.
int cc_site_probe(struct pt_regs *ctx) {
    struct cc_state *s = cc_state_of_current();
    if (!s)
        return 0;
    u32 id = (u32)bpf_get_attach_cookie(ctx);
    struct cc_site *si = cc_sites.lookup(&id);
    if (!si)
        return 0;
    cc_stat(S_SITE);
    s->bias = ctx->ip - si->vaddr;
    s->flags |= ST_BIAS;
    u64 cfa = cc_cfa(ctx, si);
    cc_cut(s, cfa);
    if (s->flags & ST_FROZEN)
        return 0;
    cc_anchor_if_empty(s, cfa, id);
    u64 ret = si->ret_vaddr + s->bias;
    if (si->flags & F_EXIT)
        cc_push(s, ctx->sp, ret, id, K_EXIT, si->callsite);
    else
        cc_edge(s, si, ctx->sp, ret, id, K_CALL);
    return 0;
}

// Whether a jcc with condition code `cc` jumps, given the flags before it executes.
static __always_inline int cc_jump_taken(struct pt_regs *ctx, s32 cc) {
    u64 fl = ctx->flags;
    int cf = fl & 1, pf = (fl >> 2) & 1, zf = (fl >> 6) & 1, sf = (fl >> 7) & 1, of = (fl >> 11) & 1;
    int r;
    switch (cc >> 1) {
    case 0: r = of; break;
    case 1: r = cf; break;
    case 2: r = zf; break;
    case 3: r = cf | zf; break;
    case 4: r = sf; break;
    case 5: r = pf; break;
    case 6: r = sf != of; break;
    default: r = zf | (sf != of); break;
    }
    return (cc & 1) ? !r : r;
}

// Probe on a tail jmp: the callee replaces the frame, so the piece lives as long as the frame
// (recorded sp = CFA, expected return address = the one already on the stack).
int cc_tail_probe(struct pt_regs *ctx) {
    struct cc_state *s = cc_state_of_current();
    if (!s)
        return 0;
    u32 id = (u32)bpf_get_attach_cookie(ctx);
    struct cc_site *si = cc_sites.lookup(&id);
    if (!si)
        return 0;
    if (si->cond >= 0 && !cc_jump_taken(ctx, si->cond))
        return 0;  // a conditional tail call that falls through: no call happens
    cc_stat(S_TAIL);
    s->bias = ctx->ip - si->vaddr;
    s->flags |= ST_BIAS;
    u64 cfa = cc_cfa(ctx, si);
    cc_cut(s, cfa);
    if (s->flags & ST_FROZEN)
        return 0;
    cc_anchor_if_empty(s, cfa, id);
    u64 ret = cc_read_word(s, cfa - 8);
    if (si->flags & F_EXIT)
        cc_push(s, cfa, ret, id, K_TAILEXIT, si->callsite);
    else
        cc_edge(s, si, cfa, ret, id, K_TAIL);
    return 0;
}

#if SCOPE_PAGES > 0
// --scope: what userspace needs for one unwind of the stack above a scope function's entry -- its
// registers and the stack pages from the one holding sp upwards (SCOPE_PAGES at most, stopping at the
// first unreadable page).  The segment just pushed gets the entry's per-thread sequence number (in
// its piece's pad, emitted with the segment), so a sample joins the prefix of its own entry.
struct cc_scope_rec {
    u64 ktime_ns;
    u32 tgid;
    u32 tid;
    u32 seq;
    u32 pages;
    u64 ip;
    u64 sp;
    u64 bp;
    u64 base;
    char data[SCOPE_PAGES * 4096];
};
BPF_RINGBUF_OUTPUT(cc_scope_events, SCOPE_RINGBUF_PAGES);

static __always_inline void cc_scope_prefix(struct pt_regs *ctx, struct cc_state *s, u64 cfa, u32 id) {
    u32 n = s->n;
    if (n == 0 || n > MAX_PIECES)
        return;
    struct cc_piece *top = &s->p[PIX(n - 1)];
    if (top->kind != K_SEG || top->sp != cfa || top->probe != id)
        return;  // not pushed (the thread is frozen)
    u32 seq = s->scope_seq + 1;
    s->scope_seq = seq;
    top->pad = seq;
    struct cc_scope_rec *r = cc_scope_events.ringbuf_reserve(sizeof(struct cc_scope_rec));
    if (!r) {
        cc_stat(S_SCOPE_LOST);
        return;
    }
    u64 pid_tgid = bpf_get_current_pid_tgid();
    r->ktime_ns = bpf_ktime_get_ns();
    r->tgid = pid_tgid >> 32;
    r->tid = (u32)pid_tgid;
    r->seq = seq;
    r->ip = ctx->ip;
    r->sp = ctx->sp;
    r->bp = ctx->bp;
    u64 base = ctx->sp & ~4095ULL;
    r->base = base;
    u32 pages = 0;
#pragma unroll
    for (int i = 0; i < SCOPE_PAGES; i++) {
        if (bpf_probe_read_user(&r->data[i * 4096], 4096, (void *)(base + i * 4096ULL)) != 0)
            break;
        pages = i + 1;
    }
    r->pages = pages;
    cc_scope_events.ringbuf_submit(r, 0);
}
#endif

// Probe on the entry of a root function (sp points at the return address).
int cc_entry_probe(struct pt_regs *ctx) {
    struct cc_state *s = cc_state_of_current();
    if (!s)
        return 0;
    u32 id = (u32)bpf_get_attach_cookie(ctx);
    struct cc_site *si = cc_sites.lookup(&id);
    if (!si)
        return 0;
    cc_stat(S_ENTRY);
    u64 bias = ctx->ip - si->vaddr;
    s->bias = bias;
    s->flags |= ST_BIAS;
    u64 cfa = ctx->sp + 8;
    u64 ra = cc_read_word(s, ctx->sp);
    u64 rv = ra - bias;
    u32 *rs = cc_ret_sites.lookup(&rv);
    u32 site_cs = CC_NONE;
    if (rs) {
        u32 v = *rs;
        u32 cs = v & RS_INDEX;
        if (v & (RS_INDIRECT | RS_VIA_PLT)) {
            site_cs = cs;  // called by an indirect call / a PLT call of the binary
        } else {
            // A direct call: of this function, or of one that tail-jumps here (edges the encoding
            // has, whose probes did the work); anything else came by an indirect tail jump.
            u32 *g = cc_cs_callee.lookup(&cs);
            u64 key = g ? (((u64)*g << 32) | si->node) : 0;
            if (g && (*g == si->node || cc_tail_reach.lookup(&key))) {
                if ((v & RS_IN_SCOPE) || !(si->flags & F_SCOPE))
                    return 0;
            } else {
                site_cs = cs;
            }
        }
    }
    cc_cut(s, cfa);
    cc_cut_base(s);
    if (s->flags & ST_FROZEN)
        return 0;
    u32 n = s->n;
    if (n > MAX_PIECES)
        return 0;
    u32 aux = CC_NONE;
    if (n > 0) {
        struct cc_piece *top = &s->p[PIX(n - 1)];
        if (top->probe == id && top->sp == cfa && top->ret == ra && (top->kind == K_ROOT || top->kind == K_SEG))
            return 0;  // the entry instruction is also a loop head (or the same call again): same context
        // Entered from the library the binary called (or tail-jumped into) there: on the same
        // stack, or as a signal handler on the alternate stack that interrupted that call -- not on
        // another stack (makecontext, an alternate stack the task does not name): then its callers
        // are unknown.
        u64 alt_lo, alt_size;
        cc_altstack(&alt_lo, &alt_size);
        u64 handler = cc_on_alt(cfa, alt_lo, alt_size) & (cc_on_alt(top->sp, alt_lo, alt_size) ^ 1);
        if ((top->kind == K_EXIT || top->kind == K_TAILEXIT) && (top->sp - cfa < STACK_SWITCH_GAP || handler))
            aux = top->aux;
    }
    // Pieces recorded for this very frame slot belong to earlier occupants of it (an earlier call
    // from the same call site, or the frame a tail jump just replaced): drop them too.
    cc_cut(s, cfa + 1);
    n = s->n;
    if (site_cs != CC_NONE) {
        // With no known context below (attached mid-run) the caller's own context is unknown.
        aux = (n > 0 || !(s->flags & ST_INCOMPLETE_BASE)) ? site_cs : CC_NONE;
    } else if (si->flags & F_SCOPE) {
        aux = CC_NONE;  // the context above a --scope function is not recorded
    } else if (n == 0 && !(s->flags & ST_INCOMPLETE_BASE)) {
        // The thread's first analysed function: the root edge's code.
        if (cc_push(s, cfa, ra, id, K_ROOT, CC_NONE) && !cc_apply_acyc(s, si)) {
            cc_truncate(s, s->n - 1);
            cc_freeze(s, cfa, S_OVERFLOW);
            s->flags |= ST_OVERFLOW;
        }
        return 0;
    }
    cc_push_segment(s, cfa, ra, id, aux);
#if SCOPE_PAGES > 0
    if (si->flags & F_SCOPE)
        cc_scope_prefix(ctx, s, cfa, id);
#endif
    return 0;
}

// Fill a syscall sample: drop what died since the last probe, then copy the context out.
// Returns the number of recID words filled in.
static __always_inline u32 cc_fill_sample(u64 sp, struct cc_sample *out) {
    struct cc_state *s = cc_state_of_current();
    cc_stat(S_SAMPLES);
    out->top_kind = 0;
    out->top_probe = CC_NONE;
    out->top_aux = CC_NONE;
    out->depth = 0;
    out->nsegs = 0;
    out->rec_len = 0;
    out->rec_base = 0;
    out->bias = 0;
    if (!s) {
        out->flags = SF_NOSTATE;
        return 0;
    }
    cc_cut(s, sp + 8);
    cc_cut_base(s);
    u32 f = 0;
    if (s->flags & ST_FROZEN)
        f |= SF_FROZEN;
    if (s->flags & ST_INCOMPLETE_BASE)
        f |= SF_INCOMPLETE_BASE;
    if (s->flags & ST_READFAIL)
        f |= SF_READFAIL;
    if (s->flags & ST_OVERFLOW)
        f |= SF_OVERFLOW;
    if (s->flags & ST_BIAS)
        f |= SF_BIAS;
    u32 n = s->n;
    out->depth = n;
    out->bias = s->bias;
    if (n > 0 && n <= MAX_PIECES) {
        struct cc_piece *top = &s->p[PIX(n - 1)];
        out->top_kind = top->kind;
        out->top_probe = top->probe;
        out->top_aux = top->aux;
    }
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        out->acyc[w] = s->acyc[w];
    u32 nsegs = s->nsegs;
    if (nsegs > MAX_SEGS)
        nsegs = MAX_SEGS;
    out->nsegs = nsegs;
    u32 first = 0;
    if (nsegs > EMIT_SEGS) {
        first = nsegs - EMIT_SEGS;
        f |= SF_SEGS_TRUNC;
    }
#pragma unroll
    for (int i = 0; i < EMIT_SEGS; i++) {
        u32 j = first + i;
        if (j < nsegs) {
            u32 pi = s->segs[SIX(j)];
            struct cc_piece *p = &s->p[PIX(pi)];
#pragma unroll
            for (int w = 0; w < ACYC_WORDS; w++)
                out->segs[i].saved[w] = p->acyc_before[w];
            out->segs[i].rec_height = p->rec_before;
            out->segs[i].aux = p->aux;
            out->segs[i].probe = p->probe;
            out->segs[i].pad = p->pad;  // a --scope segment: its entry's sequence number
        }
    }
    u32 rl = s->rec_len;
    out->rec_len = rl;
    u32 words = (rl + 63) >> 6;
    u32 base = 0;
    if (words > REC_EMIT_WORDS) {
        base = words - REC_EMIT_WORDS;
        words = REC_EMIT_WORDS;
        f |= SF_REC_TRUNC;
    }
    out->rec_base = base;
    if (words > 0 && words <= REC_EMIT_WORDS && base < REC_WORDS)
        bpf_probe_read_kernel(out->rec, words * 8, &s->rec[RIX(base)]);
    else
        words = 0;
    out->flags = f;
    return words;
}

// The user pointer to the path argument of the syscalls whose path is cheap to report (x86-64
// numbers: open, creat, execve take it in rdi; openat, openat2, execveat in rsi), else 0.
static __always_inline u64 cc_path_arg(struct pt_regs *regs, long nr) {
    u64 v = 0;
    if (nr == 2 || nr == 85 || nr == 59)
        bpf_probe_read_kernel(&v, sizeof(v), &regs->di);
    else if (nr == 257 || nr == 437 || nr == 322)
        bpf_probe_read_kernel(&v, sizeof(v), &regs->si);
    return v;
}

// Send record `r` compacted (see struct cc_record): with its sample (`whole`, `words` recID words)
// or as a header (AGG_HIT).
static __always_inline int cc_send(struct cc_record *r, u32 words, int whole) {
    u32 idx = 2 + cc_ix(r->event - 1, 1);
    char *out = (char *)cc_scratch.lookup(&idx);
    if (!out)
        return -1;
    __builtin_memcpy(out, r, __builtin_offsetof(struct cc_record, arg));
    u64 off = __builtin_offsetof(struct cc_record, arg);
    u32 al = cc_ix(r->arg_len, 511);
    if (al > CC_ARG_LEN)
        al = CC_ARG_LEN;
    if (al > 0)
        bpf_probe_read_kernel(out + off, al, r->arg);
    off += al;
    if (whole) {
        u32 ns = cc_ix(r->cc.nsegs, 2 * MAX_SEGS - 1);
        if (ns > EMIT_SEGS)
            ns = EMIT_SEGS;
        u32 hs = __builtin_offsetof(struct cc_sample, segs) + ns * sizeof(struct cc_seg_out);
        bpf_probe_read_kernel(out + off, hs, &r->cc);
        off += hs;
        u32 rw = cc_ix(words, 2 * REC_EMIT_WORDS - 1);
        if (rw > REC_EMIT_WORDS)
            rw = REC_EMIT_WORDS;
        if (rw > 0)
            bpf_probe_read_kernel(out + off, rw * 8, r->cc.rec);
        off += rw * 8;
    }
    if (off > sizeof(struct cc_record))
        return -1;
    if (cc_events.ringbuf_output(out, off, 0) != 0) {
        cc_stat(S_RINGBUF_FULL);
        return -1;
    }
    return 0;
}

#define AGG_SEG_MASK (AGG_SEGS * 2 - 1)
#define AGG_REC_MASK (AGG_REC_WORDS - 1)

// A known context's sample: counted; sent as a header when every sample is wanted.
static __always_inline void cc_agg_hit(struct cc_record *r, struct cc_agg_val *v) {
    __sync_fetch_and_add(&v->count, 1);
    r->agg = AGG_HIT;  // also what the flight recorder keeps (cc_emit)
    r->ctx_id = v->id;
    if (cc_cfg(CFG_EMIT_HITS))
        cc_send(r, 0, 0);
}

// Aggregate mode: count the sample under its context (see AGG_*); `words`: its recID words.
static __always_inline void cc_aggregate(struct cc_record *r, u32 words) {
    struct cc_sample *c = &r->cc;
    u32 nsegs = c->nsegs;
    if ((c->flags & (SF_SEGS_TRUNC | SF_REC_TRUNC)) || nsegs > AGG_SEGS || words > AGG_REC_WORDS) {
        cc_stat(S_AGG_TOO_BIG);
        r->agg = AGG_UNAGGREGATED;
        cc_send(r, words, 1);
        return;
    }
    u32 zero = 0;
    struct cc_agg_key *k = (struct cc_agg_key *)cc_agg_scratch.lookup(&zero);
    if (!k) {
        cc_send(r, words, 1);  // cannot happen (a per-CPU array): sent as a sample of its own
        return;
    }
    __builtin_memset(k, 0, sizeof(*k));  // every byte is key: unused segments and words are zero
    k->nr = r->nr;
    k->flags = c->flags;
    k->depth = c->depth;
    k->top_kind = c->top_kind;
    k->top_probe = c->top_probe;
    k->top_aux = c->top_aux;
    k->rec_len = c->rec_len;
    k->nsegs = nsegs;
    k->ipv = AGG_OUTSIDE;
    if (c->flags & SF_BIAS) {
        u64 v = r->ip - c->bias;
        if (v >= cc_cfg(CFG_TEXT_LO) && v < cc_cfg(CFG_TEXT_HI))
            k->ipv = v;
    }
    if (!(c->flags & SF_NOSTATE)) {  // a thread without state: cc_fill_sample leaves the words stale
#pragma unroll
        for (int w = 0; w < ACYC_WORDS; w++)
            k->acyc[w] = c->acyc[w];
    }
    u32 ns = cc_ix(nsegs, AGG_SEG_MASK);  // bounds the verifier sees (the compiler drops re-checks)
    if (ns > AGG_SEGS)
        ns = AGG_SEGS;
    if (ns > 0)
        bpf_probe_read_kernel(k->segs, ns * sizeof(struct cc_seg_out), c->segs);
    u32 nw = cc_ix(words, AGG_REC_WORDS * 2 - 1);
    if (nw > AGG_REC_WORDS)
        nw = AGG_REC_WORDS;
    if (nw > 0) {
        bpf_probe_read_kernel(k->rec, nw * 8, c->rec);
        u32 tail = c->rec_len & 63;
        if (tail)
            k->rec[cc_ix(nw - 1, AGG_REC_MASK)] &= (1ULL << tail) - 1;  // bits past rec_len are stale
    }
    struct cc_agg_val *v = cc_agg_counts.lookup((struct cc_agg_key_blob *)k);
    if (v) {
        cc_agg_hit(r, v);
        return;
    }
    u64 *next = cc_agg_next.lookup(&zero);
    if (!next)
        return;
    u64 id = __sync_fetch_and_add(next, 1);
    struct cc_agg_val nv = {};
    nv.count = 1;
    nv.id = (u32)id;
    if (id >= AGG_CONTEXTS || cc_agg_counts.insert((struct cc_agg_key_blob *)k, &nv) != 0) {
        v = cc_agg_counts.lookup((struct cc_agg_key_blob *)k);
        if (v) {  // another CPU stored the same context meanwhile
            cc_agg_hit(r, v);
            return;
        }
        cc_stat(S_COUNTS_FULL);
        r->agg = AGG_UNAGGREGATED;
        cc_send(r, words, 1);
        return;
    }
    cc_stat(S_AGG_NEW);
    r->agg = AGG_NEW;
    r->ctx_id = (u32)id;
    if (cc_send(r, words, 1) != 0)
        cc_agg_counts.delete((struct cc_agg_key_blob *)k);  // userspace never saw it: the next sample is new again
}

static __always_inline void cc_emit(u64 ktime, s32 nr, u32 event, u64 ip, u64 sp, u64 argp,
                                    struct pt_regs *regs) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 kl = CFG_LAUNCH_TGID;
    u64 *launch = cc_config.lookup(&kl);
    if (launch && *launch == (pid_tgid >> 32) && cc_cfg(CFG_LAUNCHED) == 0)
        return;  // ccprofd's own child before it execs the command: not the traced program yet
    u32 idx = event - 1;
    struct cc_record *r = (struct cc_record *)cc_scratch.lookup(&idx);
    if (!r)
        return;
    r->ktime_ns = ktime;
    r->tgid = pid_tgid >> 32;
    r->tid = (u32)pid_tgid;
    r->nr = nr;
    r->event = event;
    r->ip = ip;
    r->sp = sp;
    r->agg = AGG_NONE;
    r->ctx_id = 0;
    r->arg[0] = 0;
    r->arg_len = 0;
    r->pad = 0;
    if (regs) {  // a constant per program: CPU samples pass 0
        bpf_probe_read_kernel(&r->sargs[0], 8, &regs->di);
        bpf_probe_read_kernel(&r->sargs[1], 8, &regs->si);
        bpf_probe_read_kernel(&r->sargs[2], 8, &regs->dx);
        bpf_probe_read_kernel(&r->sargs[3], 8, &regs->r10);
        bpf_probe_read_kernel(&r->sargs[4], 8, &regs->r8);
        bpf_probe_read_kernel(&r->sargs[5], 8, &regs->r9);
    } else {
        __builtin_memset(r->sargs, 0, sizeof(r->sargs));
    }
    if (argp) {
        long got = bpf_probe_read_user_str(r->arg, sizeof(r->arg), (void *)argp);
        if (got > 0)  // else not resident at syscall entry: reported without the argument
            r->arg_len = (u32)got;
    }
    u32 words = cc_fill_sample(sp, &r->cc);
    if (words > REC_EMIT_WORDS)
        words = REC_EMIT_WORDS;
    if (event == EV_CC_SYSCALL && cc_cfg(CFG_AGGREGATE))  // `event` is a constant per program
        cc_aggregate(r, words);
    else
        cc_send(r, words, 1);
    if (event == EV_CC_SYSCALL)  // flight recorder (history.c): the context is its aggregation id
        ccprof_history_put(pid_tgid, ktime, nr, r->agg, r->ctx_id, 0, r->sargs);
}

// CPU-clock sample (--sample-hz) of a traced thread.  The task's pt_regs hold its user registers
// whether the tick interrupted user mode or a syscall (then: the registers at syscall entry).
int cc_cpu_sample(struct bpf_perf_event_data *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (!cc_slot_of.lookup(&tid))
        return 0;
    u64 ip = 0, sp = 0;
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
    bpf_probe_read_kernel(&ip, sizeof(ip), &regs->ip);
    bpf_probe_read_kernel(&sp, sizeof(sp), &regs->sp);
    if (!sp)
        return 0;  // no user registers (a kernel thread, or an exiting task)
    cc_emit(bpf_ktime_get_ns(), -1, EV_CC_CPU, ip, sp, 0, 0);
    return 0;
}

// Fork and thread creation: the child starts with a copy of the parent's state; its first event
// decides whether it is a thread (reset) or a process (keeps it).
// Tracepoint arguments are read at offsets taken from tracefs (CC_FORK_CHILD_PID_OFF,
// CC_EXEC_OLD_PID_OFF): bcc generates one struct per tracepoint and the sampler already has them.
static __always_inline void cc_fork_do(void *args) {
    struct cc_state *s = cc_state_of_current();
    if (!s)
        return;
    u32 child = (u32)*(s32 *)((char *)args + CC_FORK_CHILD_PID_OFF);
    u32 slot = 0;
    if (cc_free.pop(&slot) != 0) {
        cc_stat(S_NO_SLOT);
        return;
    }
    struct cc_state *c = (struct cc_state *)cc_states.lookup(&slot);
    if (!c)
        return;
    c->n = s->n;
    c->rec_len = s->rec_len;
    c->nsegs = s->nsegs;
    c->flags = (s->flags & ~ST_READFAIL) | ST_FORK_PENDING;
    c->frozen_sp = s->frozen_sp;
    c->bias = s->bias;
    c->parent_tgid = (u32)(bpf_get_current_pid_tgid() >> 32);
    c->scope_seq = s->scope_seq;
#pragma unroll
    for (int w = 0; w < ACYC_WORDS; w++)
        c->acyc[w] = s->acyc[w];
    bpf_probe_read_kernel(c->segs, sizeof(c->segs), s->segs);
    bpf_probe_read_kernel(c->rec, sizeof(c->rec), s->rec);
    u32 n = s->n;
    if (n > MAX_PIECES)
        n = MAX_PIECES;
    if (n > 0)
        bpf_probe_read_kernel(c->p, n * sizeof(struct cc_piece), s->p);
    if (cc_slot_of.update(&child, &slot) != 0) {
        cc_free.push(&slot, 0);
        cc_stat(S_NO_SLOT);
        return;
    }
    cc_stat(S_FORK_COPIES);
}

int cc_fork(void *args) {
    cc_fork_do(args);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

static __always_inline void cc_release(u32 tid) {
    u32 *slot = cc_slot_of.lookup(&tid);
    if (!slot)
        return;
    u32 k = *slot;
    cc_slot_of.delete(&tid);
    cc_free.push(&k, 0);
}

// A state slot for thread `tid`, taken in BPF (userspace normally hands them out: add_thread).
static __always_inline struct cc_state *cc_take_slot(u32 tid) {
    u32 slot = 0;
    if (cc_free.pop(&slot) != 0) {
        cc_stat(S_NO_SLOT);
        return 0;
    }
    struct cc_state *s = (struct cc_state *)cc_states.lookup(&slot);
    if (!s || cc_slot_of.update(&tid, &slot) != 0) {
        cc_free.push(&slot, 0);
        cc_stat(S_NO_SLOT);
        return 0;
    }
    return s;
}

int cc_exit(void *args) {
    cc_release((u32)bpf_get_current_pid_tgid());
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

// The launch exec (the traced command replacing ccprofd's child) starts a fresh context; any other
// exec replaces the analysed image: stop keeping state for it.
static __always_inline void cc_exec_do(void *args) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    u32 old = (u32)*(s32 *)((char *)args + CC_EXEC_OLD_PID_OFF);
    if (old != (u32)pid_tgid)
        cc_release(old);
    u32 k = CFG_LAUNCH_TGID;
    u64 *launch = cc_config.lookup(&k);
    u32 kl = CFG_LAUNCHED;
    u64 *launched = cc_config.lookup(&kl);
    if (launch && launched && *launch == tgid && *launched == 0) {
        *launched = 1;
        struct cc_state *s = cc_state_of_current();
        if (s)
            cc_reset(s, 0);
        return;
    }
    if (ccprof_exec_is_target()) {
        // a new process of the analysed binary (exec_target.c; the sampler tracks it from here):
        // a fresh state before its first instruction, so its contexts are complete from main
        struct cc_state *s = cc_state_of_current();
        if (!s)
            s = cc_take_slot((u32)pid_tgid);
        if (s)
            cc_reset(s, 0);
        return;
    }
    cc_release((u32)pid_tgid);
}

int cc_exec(void *args) {
    cc_exec_do(args);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}
