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
#define UW_KIND_RA_REG 7  // return address in rdi (glibc's vfork), CFA = rsp + cfa_off
#define UW_KIND_GO_SWITCH 8  // Go's systemstack on g0: the caller goes on from m.curg.sched (uw_go_switch)
#define UW_KIND_CFA_DEREF 9  // CFA = *(rsp + cfa_off) + aux, return address at CFA - 8 (Go's asmcgocall)
#define UW_KIND_GO_MORESTACK 10  // Go's morestack on g0: the goroutine goes on at m.curg.sched (uw_go_switch)
#define UW_KIND_GO_VDSO 11  // Go's vDSO calls: the caller goes on at m.vdsoPC, m.vdsoSP (uw_go_switch)
#define UW_AUX_CALLER_EXACT 1  // UW_KIND_RSP: the return address is an interrupted pc (Go's asyncPreempt)
#define UW_AUX_GO_CURG_SET 2   // UW_KIND_RSP: Go's execute or schedule, which may set m.curg (go_curg_set)
#define UW_AUX_CLONE_CHILD 4   // UW_KIND_RSP: a clone's child window: with rax 0 (the child), the chain ends

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
#define UW_EV_HIT 18
#define UW_SAMPLE_HDR_BYTES 112  // struct uw_sample up to arg
#define UW_ARG_LEN 4096         // PATH_MAX
#define UE_ANALYSED 0x80000000u

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
#define UW_STAT_MAPS_LOST 10  // a new-mapping event refused by the full ring (samples may then be flagged)
#define UW_STAT_RESTOPPED 11  // a held process found running (a SIGCONT not ours) and stopped again
// where the frame loop's time goes (bench/, issue #18): search steps (rule table, and the encoding
// pass's function table), user stack copies and mapping searches, summed over the samples
#define UW_STAT_LOOKUP_STEPS 12
#define UW_STAT_STACK_COPIES 13
#define UW_STAT_MAP_SEARCHES 14
// per-thread memoisation of the outer frames (issue #18): samples that reused the previous
// sample's chain, frames taken from it (each re-read and found unchanged), reuses refused because
// a re-read return-address or saved-register slot had changed (the frame was unwound afresh)
#define UW_STAT_MEMO_HITS 15
#define UW_STAT_MEMO_FRAMES 16
#define UW_STAT_MEMO_REJECTS 17
#define UW_STAT_SAME_AS_PREVIOUS 18  // pcs equal to the previous sample of the thread on this CPU: its encoding reused
#define UW_STAT_CHAIN_CACHE_HITS 19  // pcs equal to a recent chain of this CPU's (uw_kc): counted without encoding
#define UW_STAT_MEMO_CHAINS 20  // samples whose whole chain, frame 0 included, was the memo's (uw_memo_chain)
#define UW_STAT_MEMO_COUNTED 21  // ... counted at the entry their memo way's context was verified at (uw_way_hit)
#define UW_NR_STATS 22

#define UW_CFG_AGGREGATE 0
#define UW_CFG_SAMPLE_CPU_ALL 1
#define UW_CFG_EMIT_HITS 2
#define UW_CFG_MEMO 3  // UW_MEMO_ON (0, the default), UW_MEMO_OFF, UW_MEMO_UNCHECKED
#define UW_MEMO_ON 0
#define UW_MEMO_OFF 1
#define UW_MEMO_UNCHECKED 2  // tests only: reuse without re-reading the slots (unsound; shows the check matters)
#define UW_MEMO_CHAIN_UNCHECKED 3  // tests only: whole chains (uw_memo_chain) reused without the re-read
#define UW_MEMO_RBP_UNCHECKED 4    // tests only: ... without re-reading any saved rbp (live or not)

// Per-thread memo of the last complete chain (syscall samples only): the outer frames of a thread's
// stack rarely change between two syscalls.  Each frame of the chain keeps its entry state (pc,
// CFA/rsp, rbp and its validity, exactness) and the stack slots its step read with their values.
// A step is a function of that state, those slots' contents and the process's mappings (uw_proc.gen
// names one upload of them; module tables are never rewritten), so once a new sample reaches a
// frame whose state equals a cached frame's, re-reading that frame's slots and finding the same
// values proves the next state equal too: frame by frame, the rest of the chain is taken from the
// memo only as far as every slot re-reads unchanged; at the first changed slot the unwind goes on
// afresh from the (proved) state of that frame.
#ifndef UW_MEMO_DEPTH
#define UW_MEMO_DEPTH 128  // frames a memoised chain may have (power of two); deeper stacks: no memo
#endif
// Each syscall slot keeps up to UW_MEMO_WAYS chains (struct uw_mway), each a thread's last one that
// started in its frame-0 state (pc, rsp, rbp): a service's thread alternates between a few syscalls
// (redis: epoll_wait, read, write), each of which repeats its chain, and one memo per thread would
// only ever hold the previous one.  Chains live in UW_MEMO_BUFS frame buffers: one per way and the
// spare the sample being unwound is recorded into, swapped with the way it replaces.
#ifndef UW_MEMO_WAYS
#define UW_MEMO_WAYS 7
#endif
#define UW_MEMO_BUFS 8  // a power of two, UW_MEMO_WAYS + 1
#define UW_MF_BP_VALID 1
#define UW_MF_EXACT 2
#define UW_MF_FP 4
#define UW_MF_USES_BP 8   // its step took the CFA from rbp (an rbp rule, or the frame-pointer rule)
#define UW_MF_RBP_SLOT 16  // its second slot (addr[1]) is the saved rbp its step restored
#define UW_MF_BP_LIVE 32   // ... and a later step used that rbp (before another restored one)
#define UW_BP_ENTRY 0xffffffffU  // bp_src: rbp is still the sample's frame-0 value
#define UW_MEMO_SCAN 4  // cached frames skipped at most per step looking for the new frame's CFA

struct uw_rule {
    u8 kind;
    u8 rbp_kind;
    u8 aux;
    u8 aux_hi;  // aux's high byte (GO_MORESTACK: m.curg's offset)
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
    u32 base;   // page index (tables.py page_index): bucket b covers vaddrs base + [b, b + 1) << shift
    u32 shift;
    u32 pfirst; // bucket 0 in uw_pages
    u32 pcount; // buckets; 0: no index, search every row
};

struct uw_mapping {
    u64 start;
    u64 end;
    u64 bias;    // runtime = vaddr + bias
    u32 module;  // uw_modules index, UW_NO_MODULE without a table
    u32 info;    // UE_ANALYSED | module key (userspace's id of the file, for unanalysed frames)
};

struct uw_proc {
    u32 n;
    u32 gen;
    u64 start_stack;  // the main thread's initial rsp (/proc/PID/stat): the stack ends there
    struct uw_mapping m[UW_MAX_MAPS];
};

#define UW_EXACT_BIT (1ULL << 63)
#define UE_NONE 0xffffffffu

#ifdef UE_ENABLED
// The Valence encoding of one unwound stack (see plan.py / mode.py).  Its first
// UE_HDR_WORDS words, then the used segments, recID words and unanalysed frames, are the context
// that is hashed, stored in the arena and compared.
#define UE_F_ANCHOR 1       // the frames above the first segment are unknown (caller NONE)
#define UE_F_SEG_OVF 2      // too many segments: restarted (anchor) at an inner frame
#define UE_F_REC_OVF 4      // recID full: restarted (anchor) at an inner frame
#define UE_F_UNAN_OVF 8     // too many unanalysed frames: the innermost ones are not recorded
#define UE_F_INNER_EXACT 16 // the innermost analysed frame's pc is exact (syscall/sample in the binary)

#define UE_SEGW (UE_ACYC_WORDS + 4)
#define UE_HDR_WORDS (4 + UE_ACYC_WORDS)
#define UE_OFF_SEGS UE_HDR_WORDS
#define UE_OFF_REC (UE_OFF_SEGS + UE_MAX_SEGS * UE_SEGW)
#define UE_OFF_UNAN (UE_OFF_REC + UE_REC_WORDS)
#define UE_TOTAL_WORDS (UE_OFF_UNAN + 2 * UE_MAX_UNAN)

struct ue_seg {
    u64 saved[UE_ACYC_WORDS];
    u32 rec_height;
    u32 callee;  // dense node
    u32 caller;  // dense node, UE_NONE: unknown (anchor)
    u32 pad;
    s64 site;    // call-site vaddr, -1 OUTSIDE
    u64 ret;     // the caller's return address (vaddr) when its pc was one, else 0
};

struct ue_rec {
    u32 node;    // dense node of the innermost analysed frame, UE_NONE: none
    u32 flags;   // UE_F_*
    u32 rec_len;
    u32 nsegs;
    u64 inner;   // vaddr of the innermost analysed frame's pc
    u32 nunan;
    u32 nframes; // analysed frames encoded (since the anchor)
    u64 acyc[UE_ACYC_WORDS];
    struct ue_seg segs[UE_MAX_SEGS];
    u64 rec[UE_REC_WORDS];
    u64 unan[2 * UE_MAX_UNAN];  // per unanalysed frame: (analysed frame index | module key << 32, vaddr | exact << 63)
};

struct ue_func {
    u32 start;
    u32 end;
    u32 node;
    u32 flags;  // 1: skip (the ELF entry function)
};

struct ue_edge_key {
    u64 ret;     // return-address vaddr, 0 for root edges
    u32 callee;  // dense node
    u32 pad;
};

struct ue_row {
    u64 mask[UE_ACYC_WORDS];
    u64 val[UE_ACYC_WORDS];
    u32 nrec;
    u32 rec[UE_ROW_REC];
};

// walking state of the encoding pass
struct ue_work {
    u32 cur;
    u32 cur_exact;
    u64 cur_v;
    u32 gap;
    u32 pad;
    u64 f_lo;
    u64 f_hi;
    u32 f_node;
    u32 f_flags;
};
#endif

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
    u32 arg_len;   // bytes of arg with its NUL, 0: the syscall has no path argument or it was unreadable
    u32 arg_pad;
    u64 sargs[6];  // the syscall's argument registers at entry (rdi rsi rdx r10 r8 r9); 0 for CPU samples
    // The sample's own path argument (open*, creat, exec*): not part of the context, so a repeated
    // context's header-only record carries it too.  PATH_MAX bytes: never truncated.
    char arg[UW_ARG_LEN];
#ifdef UE_ENABLED
    struct ue_rec e;
#endif
    u64 pcs[UW_MAX_DEPTH];  // bit 63 (UW_EXACT_BIT): the pc is exact, not a return address
};

struct uw_mframe {
    u64 pc;
    u64 sp;
    u64 bp;
    u64 addr[2];
    u64 val[2];
    u32 flags;  // UW_MF_*
    u32 nread;  // slots read by this frame's step (addr/val); 3 (a signal frame's rbp): not cached
};

// one memoised chain (see UW_MEMO_WAYS)
struct uw_mway {
    u32 buf;   // mf[buf] holds its frames
    u32 n;     // frames (0: none)
    u32 tid;   // whose chain it is
    u32 tgid;
    u32 gen;   // the upload of the mappings it was unwound with
    u32 lo;    // its first frame that may be reused (frames below an uncached one may not)
    u32 fp;    // its fp_frames
    u32 bp_dep;  // a step used rbp before any restored it: the chain depends on frame 0's rbp
    u64 h1;    // its pcs hash (uw_mix over its pcs)
    u64 h2;
    u64 slo;   // the lowest and highest slot its steps read (uw_memo_chain copies that span at once)
    u64 shi;
    // The counts entry this chain's context was last verified or stored at, for syscall k_nr (k_ok:
    // valid; a chain kept anew clears it): a sample whose whole chain is this way's (uw_memo_chain)
    // is counted there without looking its pcs up in the chain cache (uw_way_hit).
    u64 kh1;
    u64 kh2;
    u64 k_off;
    u32 k_alen;
    s32 k_nr;
    u32 k_ok;
    u32 k_pad;
};

// a mapping as uw_state caches it (uw_state.c): the second most recent one is kept in uw_state.alt,
// since stacks alternate between two modules (an interpreter and libc) and each switch would
// otherwise search the process's mappings again (issue #18)
struct uw_cmap {
    u64 start;
    u64 end;
    u64 bias;
    u32 module;
    u32 first;
    u32 count;
    u32 base;
    u32 shift;
    u32 pfirst;
    u32 pcount;
    u32 info;
};

// A recent distinct chain of a slot's syscall samples and the counts entry its context was last
// verified at (issue #18): a service alternates a few chains (redis: read, write, epoll_wait; nginx:
// seven per request), which defeats the "same as the previous sample" shortcut, so every sample was
// encoded, hashed and compared against the stored context again.  A sample whose pcs equal such a
// chain's, word for word (the pcs hash only picks the way), in the same process and upload of its
// mappings, with the same reason, is counted at that entry when the entry is still the one verified
// (key, arena offset, length, syscall): exactly what the arena compare would have concluded, as the
// encoding is a function of those.  Chains deeper than UW_KC_DEPTH frames are not kept.
#define UW_KC_WAYS 8    // power of two
#define UW_KC_DEPTH 32  // power of two
struct uw_kc {
    u64 ph1;   // pcs hash
    u64 ph2;
    u64 kh1;   // the counts key it was verified under (its nr, reason and alen below made it)
    u64 kh2;
    u64 off;   // that entry's arena offset
    u32 n;
    u32 reason;
    u32 gen;
    u32 tgid;
    u32 alen;
    s32 nr;
    u32 valid;
    u32 pad;
    u64 pcs[UW_KC_DEPTH];
};

struct uw_state {
    u64 pc;
    u64 sp;
    u64 bp;
    u32 bp_valid;
    u32 exact;     // pc is not a return address (innermost frame, or interrupted by a signal)
    u32 done;
    u32 op;
    u32 go_curg_set;  // a frame so far is Go's execute or schedule: m.curg may be another goroutine
    u32 go_pad;
    u64 ax0;          // the sample's rax (a clone's child window: 0 in the child)
    struct uw_cmap c;    // cached mapping of the last pc, with its module's rows and page index
    u32 mismatch;
    u32 mismatch_pad;
    u64 arena_off; // COPY / COMPARE
    u64 r_lo;      // cached row: ELF vaddrs [r_lo, r_hi) of module c.module use rule r_id
    u64 r_hi;
    u32 r_id;
    u32 r_module;
    u32 bs_lo;     // binary searches' bounds, kept in map memory (see uw_opaque)
    u32 bs_hi;
    struct uw_cmap alt;  // the mapping cached before c (alt.end == 0: none)
    u32 n_steps;   // this sample's rule-search steps, stack copies, mapping searches (uw_stats)
    u32 n_copies;
    u32 n_maps;
    u32 n_pad;
    u64 argp;      // the sample's path argument (user address; 0: none), read by uw_read_arg
#ifdef UE_ENABLED
    struct ue_work w;
    u32 alen;      // words of the context (hash, arena)
    u32 alen_pad;
#endif
    u32 gen;       // uw_proc.gen of the mappings this sample used (0: none yet)
    u32 gen_mixed; // the sample saw two generations: not memoised
    u32 memo_mode; // uw_config[UW_CFG_MEMO]
    u32 m_rec;     // mf[m_rec]: the spare buffer, this sample's chain being recorded
    u32 m_way;     // the way whose frame 0 this sample starts in (UW_MEMO_WAYS: none)
    u32 m_last;    // the way kept last (the thread's previous chain, when it is this thread's)
    u32 m_next;    // the way a chain with no way of its own replaces next
    u32 m_init;    // the ways' buffers are assigned
    u32 m_c;       // cursor: the cached frame the unwind is at (or looking for)
    u32 m_on;      // the current frame is m_c's: it is checked, not unwound
    u32 m_cut;     // this sample's m.lo
    u32 m_hit;     // frames this sample reused
    u32 m_whole;   // this sample's chain is the memo's, every frame (uw_memo_chain): the memo stays as it is
    u32 m_hold;    // the way that holds exactly this sample's chain once it is done (UW_MEMO_WAYS: none)
    u32 m_hold_pad;
    u32 m_try;     // uw_memo_chain is checking the memo's frames (m_chk: the next one)
    u32 m_chk;
    u32 bp_src;    // the frame whose step restored the current rbp from a slot (UW_BP_ENTRY: none yet)
    u32 bp_dep;    // a step used rbp while it was frame 0's (this sample's uw_mway.bp_dep)
    u32 bp_pad;
    struct uw_mway m;  // the memoised chain this sample uses: a copy of a way's (see uw_memo_pick; m.n 0: none)
    struct uw_mway ways[UW_MEMO_WAYS];
    u32 k_tgid;    // the process and uw_proc.gen the mapping and rule caches hold (see uw_sample)
    u32 k_gen;
    // The previous sample of this slot, when this one's pcs turn out to be the same (same process,
    // mappings, frames and reason): its encoding and context words are then this one's (a function
    // of those), so the encoding and hashing passes are skipped, and so is the arena compare when
    // the counts entry is the one that sample compared equal or stored.
    u32 same;      // every pc so far equals the previous sample's (tracked while p_valid)
    u32 p_valid;
    u32 p_tgid;
    u32 p_gen;
    u32 p_n;
    u32 p_reason;
    u32 p_agg;     // the previous sample's context is the arena's at p_off under key (p_h1, p_h2)
    u32 p_pad;
    u64 p_h1;
    u64 p_h2;
    u64 p_off;
    u64 p_eh1;     // hash state after the previous sample's hashing pass (before nr, reason, length)
    u64 p_eh2;
    u64 start_stack;
    u64 win_base;  // stack window: win_len bytes of user memory at win_base are copied into win (odd: none)
    u64 win_len;   // a page, or a memoised chain's slot span (uw_memo_chain)
    u64 r_slo;     // this sample's recorded slots span [r_slo, r_shi] (uw_mway.slo, shi)
    u64 r_shi;
    u64 win[UW_WIN_WORDS];
    struct uw_mframe mf[UW_MEMO_BUFS][UW_MEMO_DEPTH];
#ifdef UE_ENABLED
    struct uw_kc kc[UW_KC_WAYS];
    u64 kc_ph1;    // this sample's pcs hash (the unwind's uw_mix state, before the encoding's)
    u64 kc_ph2;
    u64 kc_off;    // the arena offset of the entry uw_kc_hit counted this sample at
    u32 kc_next;   // the way the next new chain replaces
    u32 kc_pad;
#endif
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
// per bucket: rows starting at or before its first vaddr, and at or before the next bucket's (one
// lookup gives both bounds; an array's values take 8 bytes anyway)
struct uw_page {
    u32 lo;
    u32 hi;
};
BPF_ARRAY(uw_pages, struct uw_page, UW_MAX_PAGES);
BPF_HASH(uw_procs, u32, struct uw_proc, UW_MAX_PROCS);
BPF_HASH(uw_parent, u32, u32, UW_MAX_PROCS);          // child pid -> parent tgid (fork)
// tgid -> execs left at which to stop: a process ccprofd launched stops (SIGSTOP) after exec and
// after each new executable mapping until userspace has loaded its mappings (it sends SIGCONT),
// so no sample of it is taken with stale mappings.  For children of ccprofd itself and for
// processes that exec an exec target (exec_target.c; their entry is 0).
BPF_HASH(uw_stop, u32, u32, UW_MAX_PROCS);
// tgid -> 1 while BPF holds the process stopped: userspace releases every entry (after loading
// its mappings), and so do close() and the hold guard (unwind.py) if the daemon dies.
BPF_HASH(uw_held, u32, u32, UW_MAX_PROCS);
BPF_ARRAY(uw_state, struct uw_state, UW_NSLOTS);
BPF_HASH(uw_counts, struct uw_key, struct uw_count, UW_MAX_CONTEXTS);
BPF_ARRAY(uw_arena, u64, UW_ARENA_WORDS);
BPF_ARRAY(uw_arena_top, u64, 1);
BPF_ARRAY(uw_config, u64, 4);
BPF_PERCPU_ARRAY(uw_stats, u64, UW_NR_STATS);
BPF_RINGBUF_OUTPUT(uw_events, UW_RINGBUF_PAGES);

// Stop the current process until userspace releases it.  The signal is sent first: an entry in
// uw_held always means a SIGSTOP is already pending or delivered, so a release never comes early.
static __always_inline void uw_hold(u32 tgid) {
    bpf_send_signal(19);  // SIGSTOP (to the whole process)
    u32 one = 1;
    uw_held.update(&tgid, &one);
}

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

// v, unknown to the verifier: a value read back from map memory has no tracked range.  A binary
// search's bounds pass through here after each step, so the paths its branches fork end in equal
// states that the verifier prunes, instead of distinct ranges multiplying per step.
static __always_inline u32 uw_opaque(volatile u32 *slot, u32 v) {
    *slot = v;
    return *slot;
}

// The mapping containing pc, by binary search in the process's sorted mapping array.
static __always_inline int uw_find_mapping(struct uw_state *st, u64 pc) {
    u32 tgid = st->s.tgid;
    struct uw_proc *p = uw_procs.lookup(&tgid);
    if (!p)
        return -UW_WHY_NO_MAPS;
    st->n_maps++;
    st->start_stack = p->start_stack;
    if (st->gen == 0)
        st->gen = p->gen;
    else if (st->gen != p->gen)
        st->gen_mixed = 1;
    u32 lo = 0, hi = p->n;
    if (hi > UW_MAX_MAPS)
        hi = UW_MAX_MAPS;
#pragma unroll
    for (int i = 0; i < UW_MAPS_LOG2 + 1; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        asm volatile("" : "+r"(mid));  // checked as itself: clang may test lo + hi, which bounds no index
        if (mid >= UW_MAX_MAPS)
            break;
        if (p->m[mid].start <= pc)
            lo = mid + 1;
        else
            hi = mid;
        lo = uw_opaque(&st->bs_lo, lo);
        hi = uw_opaque(&st->bs_hi, hi);
    }
    if (lo == 0)
        return -UW_WHY_UNKNOWN_PC;
    u32 i = lo - 1;
    if (i >= UW_MAX_MAPS)
        return -UW_WHY_UNKNOWN_PC;
    if (pc >= p->m[i].end)
        return -UW_WHY_UNKNOWN_PC;
    st->c.start = p->m[i].start;
    st->c.end = p->m[i].end;
    st->c.bias = p->m[i].bias;
    st->c.module = p->m[i].module;
#ifdef UE_ENABLED
    st->c.info = p->m[i].info;
#endif
    st->c.first = 0;
    st->c.count = 0;
    st->c.pcount = 0;
    if (st->c.module != UW_NO_MODULE) {
        u32 mid = st->c.module;
        struct uw_module *mod = uw_modules.lookup(&mid);
        if (mod) {
            st->c.first = mod->first;
            st->c.count = mod->count;
            st->c.base = mod->base;
            st->c.shift = mod->shift;
            st->c.pfirst = mod->pfirst;
            st->c.pcount = mod->pcount;
        }
    }
    return 0;
}

// Make the mapping holding pc the cached one: the previous one if it holds pc (the two swap),
// else a search (the one it replaces becomes the previous one).
static __always_inline int uw_switch_mapping(struct uw_state *st, u64 pc) {
    struct uw_cmap cur = st->c;
    if (pc >= st->alt.start && pc < st->alt.end) {
        st->c = st->alt;
        st->alt = cur;
        return 0;
    }
    int err = uw_find_mapping(st, pc);
    if (err == 0 && cur.end)
        st->alt = cur;
    return err;
}

// The rule for ELF vaddr v: the last row with vaddr <= v in the module's slice (the row found
// last time is checked first: recursion repeats return addresses).  The page index bounds the
// search to the rows that can cover v's bucket: lo = rows at or before the bucket's start (all
// <= v), hi = rows at or before the next bucket's start (every later row starts beyond v).
static __always_inline struct uw_rule *uw_find_rule(struct uw_state *st, u64 v) {
    u32 lo = 0, hi = st->c.count;
    if (v >= 0x100000000ULL)
        return 0;
    if (st->r_module == st->c.module && v >= st->r_lo && v < st->r_hi) {
        u32 rid = st->r_id;
        return uw_rules.lookup(&rid);
    }
    if (st->c.pcount) {
        if (v < st->c.base) {
            hi = 0;
        } else {
            u64 b = (v - st->c.base) >> (st->c.shift & 31);
            if (b >= st->c.pcount) {
                lo = hi;  // past the last bucket: the last row
            } else {
                u32 pi = st->c.pfirst + (u32)b;
                struct uw_page *pg = uw_pages.lookup(&pi);
                if (!pg)
                    return 0;
                lo = pg->lo;
                hi = pg->hi;
                if (hi > st->c.count)
                    hi = st->c.count;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < UW_ENTRIES_LOG2 + 1; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        u32 idx = st->c.first + mid;
        struct uw_entry *e = uw_entries.lookup(&idx);
        if (!e)
            return 0;
        st->n_steps++;
        if (e->vaddr <= (u32)v)
            lo = mid + 1;
        else
            hi = mid;        lo = uw_opaque(&st->bs_lo, lo);
        hi = uw_opaque(&st->bs_hi, hi);
    }
    if (lo == 0)
        return 0;
    u32 idx = st->c.first + lo - 1;
    struct uw_entry *e = uw_entries.lookup(&idx);
    if (!e)
        return 0;
    u32 rid = e->rule;
    st->r_lo = e->vaddr;
    st->r_hi = 0x100000000ULL;
    if (lo < st->c.count) {
        u32 nidx = idx + 1;
        struct uw_entry *ne = uw_entries.lookup(&nidx);
        if (ne)
            st->r_hi = ne->vaddr;
    }
    st->r_id = rid;
    st->r_module = st->c.module;
    return uw_rules.lookup(&rid);
}

// Read one stack word through a window: one bpf_probe_read_user copies the whole page holding
// addr (a constant size, never crossing into a page that may be unmapped), and the frames above
// usually lie in the same page, so most frames cost no user copy at all.
static __always_inline int uw_read(struct uw_state *st, u64 addr, u64 *out) {
    // (addr and win_base are 8-aligned and win_len a multiple of 8: an offset below it is a whole word)
    if (addr - st->win_base >= st->win_len || (addr & 7)) {
        if (addr & 7)
            return bpf_probe_read_user(out, 8, (void *)addr);
        u64 page = addr & ~(u64)(UW_WIN_BYTES - 1);
        st->n_copies++;
        if (bpf_probe_read_user(st->win, UW_WIN_BYTES, (void *)page) != 0) {
            st->win_base = 1;  // nothing cached (an odd base never matches an aligned addr)
            st->win_len = UW_WIN_BYTES;
            return bpf_probe_read_user(out, 8, (void *)addr);
        }
        st->win_base = page;
        st->win_len = UW_WIN_BYTES;
    }
    *out = st->win[((addr - st->win_base) >> 3) & (UW_WIN_WORDS - 1)];
    return 0;
}

static __always_inline long uw_finish(struct uw_state *st, u32 reason) {
    st->s.reason = reason;
    st->done = 1;
    return 1;
}

// Which rbp values a chain depends on (uw_memo_chain re-reads only those of the saved-rbp slots):
// frame n's step used rbp (uses) and/or restored it from its second slot (restores).  A use marks
// the frame that restored the rbp used (its record, UW_MF_BP_LIVE), or the chain as depending on
// frame 0's rbp (bp_dep).  Code built without frame pointers keeps data in rbp, saved and restored
// by every function that uses it and read by no step: slots that differ at every call.
static __always_inline void uw_bp_flow(struct uw_state *st, u32 n, int uses, int restores, int memo) {
    if (uses) {
        u32 src = st->bp_src;
        if (src == UW_BP_ENTRY)
            st->bp_dep = 1;
        else if (memo && src < UW_MEMO_DEPTH)
            st->mf[st->m_rec & (UW_MEMO_BUFS - 1)][src & (UW_MEMO_DEPTH - 1)].flags |= UW_MF_BP_LIVE;
    }
    if (restores)
        st->bp_src = n;
}

// The recorded slots' span (uw_memo_chain reads it in one copy): the lowest and highest of the
// (at most two kept) slots of each frame.
static __always_inline void uw_span(struct uw_state *st, u32 nread, u64 *addr) {
#pragma unroll
    for (int k = 0; k < 2; k++) {
        if (k >= nread)
            break;
        if (addr[k] < st->r_slo)
            st->r_slo = addr[k];
        if (addr[k] > st->r_shi)
            st->r_shi = addr[k];
    }
}

// Record frame n of this sample for the next one's memo (see UW_MEMO_DEPTH).
static __always_inline void uw_memo_rec(struct uw_state *st, u32 n, u64 pc, u64 sp, u64 bp, u32 flags, u32 nread,
                                        u64 *addr, u64 *val) {
    if (n >= UW_MEMO_DEPTH)
        return;
    struct uw_mframe *f = &st->mf[st->m_rec & (UW_MEMO_BUFS - 1)][n & (UW_MEMO_DEPTH - 1)];
    f->pc = pc;
    f->sp = sp;
    f->bp = bp;
    f->flags = flags;
    f->nread = nread;
    f->addr[0] = addr[0];
    f->addr[1] = addr[1];
    f->val[0] = val[0];
    f->val[1] = val[1];
    uw_span(st, nread, addr);
    if (nread > 2)
        st->m_cut = n + 1;  // its third slot is not kept: the next sample may reuse only frames above it
}

// Frame n (>= 1) from the memo: 1/0 as a step returns, -1 to unwind it afresh.  Frame 0 is never
// reused (its step may read rdi at the syscall entry, RA_REG), nor is a frame below m.lo.
static __always_inline long uw_memo_step(struct uw_state *st, u32 n) {
    if (st->m.n == 0 || n == 0)
        return -1;
    u32 prev = st->m.buf & (UW_MEMO_BUFS - 1);
    u32 c = st->m_c;
    if (!st->m_on) {
        // the sample's mappings (looked up at frame 0) must be those the chain was unwound with
        if (st->gen == 0 || st->gen != st->m.gen || st->gen_mixed)
            return -1;
        // CFAs grow outwards: skip the cached frames below this one's (a few per step)
#pragma unroll
        for (int i = 0; i < UW_MEMO_SCAN; i++) {
            if (c >= st->m.n || st->mf[prev][c & (UW_MEMO_DEPTH - 1)].sp >= st->sp)
                break;
            c++;
        }
        st->m_c = c;
        if (c >= st->m.n || c < st->m.lo)
            return -1;
        struct uw_mframe *f = &st->mf[prev][c & (UW_MEMO_DEPTH - 1)];
        u32 fl = (st->bp_valid ? UW_MF_BP_VALID : 0) | (st->exact ? UW_MF_EXACT : 0);
        if (f->sp != st->sp || f->pc != st->pc || f->bp != st->bp || (f->flags & (UW_MF_BP_VALID | UW_MF_EXACT)) != fl)
            return -1;
        st->m_on = 1;
    }
    struct uw_mframe *f = &st->mf[prev][c & (UW_MEMO_DEPTH - 1)];
    if (st->memo_mode != UW_MEMO_UNCHECKED) {
        // every slot the cached step read (return address, saved rbp), re-read now
#pragma unroll
        for (int k = 0; k < 2; k++) {
            if (k >= f->nread)
                break;
            u64 v = 0;
            if (uw_read(st, f->addr[k], &v) || v != f->val[k]) {
                st->m_on = 0;
                st->m_c = c + 1;
                uw_stat(UW_STAT_MEMO_REJECTS, 1);
                return -1;  // state is still this frame's (proved): unwound afresh from here
            }
        }
    }
    uw_bp_flow(st, n, f->flags & UW_MF_USES_BP, f->nread >= 2, 1);
    u64 pc = f->pc;
    u64 tagged = pc | ((f->flags & UW_MF_EXACT) ? UW_EXACT_BIT : 0);
    if (st->s.pcs[n & (UW_MAX_DEPTH - 1)] != tagged)
        st->same = 0;
    st->s.pcs[n & (UW_MAX_DEPTH - 1)] = tagged;
    st->s.n = n + 1;
    uw_mix(st, pc);
    if (f->flags & UW_MF_FP)
        st->s.fp_frames++;
    if (n < UW_MEMO_DEPTH) {
        struct uw_mframe *g = &st->mf[st->m_rec & (UW_MEMO_BUFS - 1)][n & (UW_MEMO_DEPTH - 1)];
        *g = *f;
        g->flags &= ~UW_MF_BP_LIVE;  // this chain's later steps say whether its rbp is used
        uw_span(st, f->nread, f->addr);
    }
    st->m_hit++;
    if (c + 1 >= st->m.n)
        return uw_finish(st, 0);  // the chain's last frame: it ended there (only complete chains are kept)
    struct uw_mframe *g = &st->mf[prev][(c + 1) & (UW_MEMO_DEPTH - 1)];
    st->pc = g->pc;
    st->sp = g->sp;
    st->bp = g->bp;
    st->bp_valid = g->flags & UW_MF_BP_VALID;
    st->exact = (g->flags & UW_MF_EXACT) ? 1 : 0;
    st->m_c = c + 1;
    return 0;
}

// The whole memoised chain at once, frame 0 included (issue #18): a thread making the same call
// from the same place again starts in the state the memo's frame 0 was entered in, and when every
// slot every frame's step read re-reads unchanged, each step's result is the memo's (uw_memo_step's
// argument, frame after frame), so the chain is the memo's without a step per frame: no rule or
// mapping work, no frame records (the memo is kept as it is), UW_CHAIN_STEP frames per bpf_loop
// callback.  Tried only when uw_sample found the sample eligible (m_try; see there).  The pcs are
// written as the frames are checked, so a changed slot leaves some of them the memo's: the sample
// is then not "same as previous" (which compares against pcs), and is unwound from frame 0 as usual
// (the unwind's state is untouched until the chain is done).  0: go on; 1: the chain is the memo's;
// -1: unwind as usual.
#define UW_CHAIN_STEP 16
static __always_inline long uw_memo_chain(struct uw_state *st) {
    u32 prev = st->m.buf & (UW_MEMO_BUFS - 1);
    u32 m = st->m.n;
    u32 i = st->m_chk;
    if (i == 0) {
        // every slot the chain's steps read, in one copy when they lie within a window's size
        // (a page copy would take two where they cross a page); else page by page as uw_read goes
        u64 lo = st->m.slo, len = st->m.shi - st->m.slo + 8;
        if (st->m.shi >= lo && !(lo & 7) && len <= UW_WIN_BYTES) {
            st->n_copies++;
            if (bpf_probe_read_user(st->win, len, (void *)lo) == 0) {
                st->win_base = lo;
                st->win_len = len;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < UW_CHAIN_STEP; t++) {
        if (i >= m)
            break;
        u32 j = i;
        asm volatile("" : "+r"(j));  // the masks below stay: a pointer stepped by clang has no bound
        struct uw_mframe *f = &st->mf[prev][j & (UW_MEMO_DEPTH - 1)];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            if (k >= f->nread)
                break;
            u64 v = 0;
            if (st->memo_mode == UW_MEMO_CHAIN_UNCHECKED)
                break;
            if (k == 1 && (f->flags & (UW_MF_RBP_SLOT | UW_MF_BP_LIVE)) == UW_MF_RBP_SLOT)
                break;  // a saved rbp no later step used: any value gives the same chain
            if (k == 1 && (f->flags & UW_MF_RBP_SLOT) && st->memo_mode == UW_MEMO_RBP_UNCHECKED)
                break;
            if (uw_read(st, f->addr[k], &v) || v != f->val[k]) {
                st->m_try = 0;
                st->same = 0;
                return -1;
            }
        }
        u64 tagged = f->pc | ((f->flags & UW_MF_EXACT) ? UW_EXACT_BIT : 0);
        if (st->s.pcs[j & (UW_MAX_DEPTH - 1)] != tagged)
            st->same = 0;
        st->s.pcs[j & (UW_MAX_DEPTH - 1)] = tagged;
        i++;
    }
    st->m_chk = i;
    if (i < m)
        return 0;
    st->s.n = m;
    st->s.fp_frames = st->m.fp;
    st->s.h1 = st->m.h1;
    st->s.h2 = st->m.h2;
    st->m_hit = m;
    st->m_whole = 1;
    return uw_finish(st, 0);
}

// Go's systemstack called a function on the thread's g0 stack (the rule is at its call's last
// byte): the goroutine that called systemstack is the thread's m.curg, and gosave_systemstack_switch
// saved in its g.sched the rsp at that call (pointing at systemstack's return address into its
// caller) and rbp.  Go's own traceback crosses the switch the same way.  The rule carries the
// binary's offsets (elf/gostack.py): cfa_off g's TLS slot from the fs base, aux g.m, rbp_off m.curg,
// rbp_kind g.sched.sp (pc at +8, bp at +48), ra_off the pc gosave stores (a vaddr).  A sched with
// another pc, or sp 0 (systemstack returned), is not this switch's: flagged, never followed.
// GO_MORESTACK (morestack's call of newstack): the goroutine goes on *at* its sched -- pc a return
// address into the function that called morestack, sp and bp that function's -- when the
// instruction before that pc is a direct call of morestack (rbp_off) or morestack_noctxt (ra_off);
// m.curg's offset is in aux_hi.  A chain that passed Go's execute or schedule on g0 (go_curg_set)
// may find another goroutine in m.curg: systemstack's is flagged; morestack's ends there, complete,
// as does one whose m.curg is nil (the goroutine dropped: a growth preempted inside newstack runs
// the scheduler on g0, whose stack starts at morestack's call -- as under mcall, END).  *gra = 0:
// the chain ends here.  GO_VDSO (the code of Go's vDSO calls, nanotime1 and time.now, while they have
// m.vdsoPC and m.vdsoSP set): the caller goes on at pc m.vdsoPC (a return address), rsp m.vdsoSP, rbp
// unknown, when the slot below that rsp holds that pc (rbp_off m.vdsoSP, ra_off m.vdsoPC).
static __always_inline u32 uw_go_switch(struct uw_state *st, struct uw_rule *r, u64 *gsp, u64 *gbp, u64 *gra) {
#ifdef CCPROF_OFF_THREAD_FSBASE
    int morestack = r->kind == UW_KIND_GO_MORESTACK;
    int vdso = r->kind == UW_KIND_GO_VDSO;
    *gra = 0;
    *gbp = 0;
    if (st->go_curg_set && !vdso)
        return morestack ? 0 : UW_WHY_UNSUPPORTED;
    u64 curg_off = morestack ? r->aux_hi : (u64)(u32)r->rbp_off;
    char *task = (char *)bpf_get_current_task();
    u64 fsbase = 0, g = 0, m = 0, curg = 0, ssp = 0, spc = 0, sbp = 0;
    if (bpf_probe_read_kernel(&fsbase, 8, task + CCPROF_OFF_TASK_THREAD + CCPROF_OFF_THREAD_FSBASE) || !fsbase)
        return UW_WHY_UNSUPPORTED;
    if (bpf_probe_read_user(&g, 8, (void *)(fsbase + (s64)r->cfa_off)) || !g)
        return UW_WHY_UNSUPPORTED;
    if (bpf_probe_read_user(&m, 8, (void *)(g + r->aux)) || !m)
        return UW_WHY_UNSUPPORTED;
    if (vdso) {
        u64 vsp = 0, vpc = 0, slot = 0;
        if (bpf_probe_read_user(&vsp, 8, (void *)(m + (u32)r->rbp_off)) ||
            bpf_probe_read_user(&vpc, 8, (void *)(m + (u32)r->ra_off)) || vsp < 8 || (vsp & 7) || !vpc)
            return UW_WHY_UNSUPPORTED;
        if (uw_read(st, vsp - 8, &slot))
            return UW_WHY_READ_FAULT;
        if (slot != vpc)
            return UW_WHY_UNSUPPORTED;
        *gsp = vsp;
        *gra = vpc;
        return 0;
    }
    if (bpf_probe_read_user(&curg, 8, (void *)(m + curg_off)))
        return UW_WHY_UNSUPPORTED;
    if (!curg)
        return morestack ? 0 : UW_WHY_UNSUPPORTED;
    u64 sched = curg + r->rbp_kind;
    if (bpf_probe_read_user(&ssp, 8, (void *)sched) || bpf_probe_read_user(&spc, 8, (void *)(sched + 8)) ||
        bpf_probe_read_user(&sbp, 8, (void *)(sched + 48)))
        return UW_WHY_UNSUPPORTED;
    if (!ssp)
        return UW_WHY_UNSUPPORTED;
    *gbp = sbp;
    if (morestack) {
        // the call before sched.pc: e8 and a 32-bit displacement from sched.pc
        u8 call[8] = {};
        if (spc < 5 || bpf_probe_read_user(call, 5, (void *)(spc - 5)) || call[0] != 0xe8)
            return UW_WHY_UNSUPPORTED;
        s32 rel = (s32)((u32)call[1] | (u32)call[2] << 8 | (u32)call[3] << 16 | (u32)call[4] << 24);
        u64 target = spc + (s64)rel - st->c.bias;
        if (target != (u64)(u32)r->rbp_off && (r->ra_off == 0 || target != (u64)(u32)r->ra_off))
            return UW_WHY_UNSUPPORTED;
        *gsp = ssp;
        *gra = spc;
        return 0;
    }
    if (spc - st->c.bias != (u64)(u32)r->ra_off)
        return UW_WHY_UNSUPPORTED;
    if (uw_read(st, ssp, gra))
        return UW_WHY_READ_FAULT;
    *gsp = ssp + 8;
    return 0;
#else
    return UW_WHY_UNSUPPORTED;  // no BTF: the fs base cannot be read
#endif
}

static __always_inline long uw_unwind_step(struct uw_state *st, int memo) {
    if (st->done)
        return 1;
    u32 n = st->s.n;
    if (n >= UW_MAX_DEPTH)
        return uw_finish(st, UW_WHY_MAX_DEPTH);
    if (memo && st->m_try) {
        long r = uw_memo_chain(st);
        if (r >= 0)
            return r;
    }
    if (memo) {
        long r = uw_memo_step(st, n);
        if (r >= 0)
            return r;
    }
    u64 pc = st->pc;
    u32 eflags = (st->bp_valid ? UW_MF_BP_VALID : 0) | (st->exact ? UW_MF_EXACT : 0);
    u64 tagged = pc | (st->exact ? UW_EXACT_BIT : 0);
    if (memo && st->s.pcs[n & (UW_MAX_DEPTH - 1)] != tagged)
        st->same = 0;
    st->s.pcs[n & (UW_MAX_DEPTH - 1)] = tagged;
    st->s.n = n + 1;
    uw_mix(st, pc);

    if (!(pc >= st->c.start && pc < st->c.end)) {
        int err = uw_switch_mapping(st, pc);
        if (err < 0)
            return uw_finish(st, -err);
    }
    // A return address is looked up at pc - 1 (inside its call), an interrupted instruction as it
    // is -- except a syscall sample's own pc: it follows the syscall instruction, which changes no
    // stack state, and may lie past the end of its FDE (glibc's __restore_rt: the 9 bytes of
    // "mov $15, %rax; syscall" and no more), so it is looked up inside that instruction too.
    u64 lookup = (st->exact && !(n == 0 && st->s.nr >= 0)) ? pc : pc - 1;
    u8 kind = UW_KIND_NONE;
    struct uw_rule *r = 0;
    if (st->c.module != UW_NO_MODULE) {
        r = uw_find_rule(st, lookup - st->c.bias);
        if (r)
            kind = r->kind;
    }
    u64 sp = st->sp, bp = st->bp, cfa = 0;
    u64 addr[3] = {0, 0, 0};
    u64 val[3] = {0, 0, 0};
    if (kind == UW_KIND_END || (kind == UW_KIND_NONE && pc == 0)) {
        if (memo)
            uw_memo_rec(st, n, pc, sp, bp, eflags, 0, addr, val);
        return uw_finish(st, 0);
    }

    // A CPU sample in the instructions after a clone's syscall that the child runs too, on its new
    // stack, with the parent's row: the child (rax 0) has no caller there (cfi.CLONE_CHILD).
    if (kind == UW_KIND_RSP && n == 0 && st->exact && st->s.nr < 0 && (r->aux & UW_AUX_CLONE_CHILD) &&
        st->ax0 == 0) {
        if (memo)
            uw_memo_rec(st, n, pc, sp, bp, eflags, 0, addr, val);
        return uw_finish(st, 0);
    }

    if (kind == UW_KIND_GO_SWITCH || kind == UW_KIND_GO_MORESTACK || kind == UW_KIND_GO_VDSO) {
        u64 gsp = 0, gbp = 0, gra = 0;
        u32 why = uw_go_switch(st, r, &gsp, &gbp, &gra);
        if (why)
            return uw_finish(st, why);
        if (memo) {
            // its step read Go's structures, not stack slots a re-read could check: the next
            // sample may reuse only frames above it (as above a frame with a third slot)
            uw_memo_rec(st, n, pc, sp, bp, eflags, 0, addr, val);
            st->m_cut = n + 1;
        }
        uw_bp_flow(st, n, 0, 1, memo);
        if (gra == 0)
            return uw_finish(st, 0);
        st->sp = gsp;
        st->bp = gbp;
        st->bp_valid = kind != UW_KIND_GO_VDSO;  // (a vDSO call's caller's rbp is not kept)
        st->pc = gra;
        st->exact = 0;
        return 0;
    }

    if (kind == UW_KIND_CFA_DEREF) {
        // an rsp was kept in a slot before rsp was realigned (asmcgocall on g0, callCgoMmap)
        u64 base = 0, dra = 0;
        if (uw_read(st, sp + r->cfa_off, &base))
            return uw_finish(st, UW_WHY_READ_FAULT);
        base += r->aux;  // the CFA
        if (base <= sp || (base & 7) || uw_read(st, base - 8, &dra))
            return uw_finish(st, base <= sp ? UW_WHY_BAD_FRAME : UW_WHY_READ_FAULT);
        if (memo) {
            // the return address's slot depends on the first slot's value: not re-read frame by
            // frame, so (as above) the next sample may reuse only frames above it
            uw_memo_rec(st, n, pc, sp, bp, eflags, 0, addr, val);
            st->m_cut = n + 1;
        }
        uw_bp_flow(st, n, 0, 0, memo);
        if (r->rbp_kind != UW_RBP_SAME)
            st->bp_valid = 0;
        if (dra == 0)
            return uw_finish(st, 0);
        st->sp = base;
        st->pc = dra;
        st->exact = 0;
        return 0;
    }

    // Decide which stack words to read (return address, saved rbp, signal frame's rsp), then read
    // them in one loop: one copy of the read code keeps the verifier's work small.
    u32 nread = 1;
    int fp = 0;
    if (!r || kind == UW_KIND_NONE) {
        // The main thread's first frame (the loader's _start often has no CFI) ends the stack.
        if (sp == st->start_stack) {
            if (memo)
                uw_memo_rec(st, n, pc, sp, bp, eflags, 0, addr, val);
            return uw_finish(st, 0);
        }
        // no CFI: frame-pointer rule, only where rbp looks like a frame pointer, and only at a
        // return address.  At an exact pc (the sampled instruction, or one a signal interrupted)
        // the function may not have set rbp up yet, or ever (a leaf, a prologue, an epilogue):
        // rbp is then its caller's and the walk would silently skip that caller.
        if (st->exact || !st->bp_valid || bp < sp || bp - sp > (8ULL << 20) || (bp & 7))
            return uw_finish(st, st->c.module == UW_NO_MODULE ? UW_WHY_NO_TABLE : UW_WHY_NO_CFI);
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
        } else if (kind == UW_KIND_RA_REG && n == 0 && st->s.nr >= 0) {
            // only the innermost frame of a syscall sample has rdi (sargs[0], saved at the entry)
            cfa = sp + r->cfa_off;
            nread = 0;
        } else {
            return uw_finish(st, UW_WHY_UNSUPPORTED);
        }
        addr[0] = cfa + r->ra_off;
        if (r->rbp_kind == UW_RBP_AT_CFA) {
            addr[1] = cfa + r->rbp_off;
            nread = 2;
        }
    }
#pragma nounroll
    for (u32 k = 0; k < 3; k++) {
        if (k >= nread)
            break;
        if (uw_read(st, addr[k], &val[k]))
            return uw_finish(st, UW_WHY_READ_FAULT);
    }
    int uses_bp = fp || kind == UW_KIND_RBP;
    int rbp_slot = kind != UW_KIND_SIGNAL && nread == 2;  // fp, or an rbp saved at the CFA
    if (memo)
        uw_memo_rec(st, n, pc, sp, bp,
                    eflags | (fp ? UW_MF_FP : 0) | (uses_bp ? UW_MF_USES_BP : 0) | (rbp_slot ? UW_MF_RBP_SLOT : 0),
                    nread, addr, val);
    // (a signal frame sets rbp from its third slot or to unknown: restored, either way)
    uw_bp_flow(st, n, uses_bp, nread >= 2 || kind == UW_KIND_SIGNAL, memo);
    if (kind == UW_KIND_SIGNAL) {
        st->pc = val[0];
        st->sp = val[1];
        st->bp = val[2];
        st->bp_valid = nread == 3;
        st->exact = 1;  // the interrupted instruction itself, not a return address
        return 0;
    }
    u64 ra = nread ? val[0] : st->s.sargs[0];
    if (fp) {
        bp = val[1];
        st->s.fp_frames++;
    } else if (nread == 2) {
        bp = val[1];
        st->bp_valid = 1;  // rbp restored from the stack: known again even if an inner frame lost it
    } else if (r->rbp_kind != UW_RBP_SAME) {
        st->bp_valid = 0;
    }
    if (ra == 0)
        return uw_finish(st, 0);  // conventional end of the stack
    if (cfa <= sp && nread)  // (RA_REG: the return address was popped, so the CFA may be rsp itself)
        return uw_finish(st, UW_WHY_BAD_FRAME);
    st->sp = cfa;
    st->bp = bp;
    st->pc = ra;
    st->exact = (kind == UW_KIND_RSP && r && (r->aux & UW_AUX_CALLER_EXACT)) ? 1 : 0;
    if (kind == UW_KIND_RSP && r && (r->aux & UW_AUX_GO_CURG_SET))
        st->go_curg_set = 1;
    return 0;
}

#ifdef UE_ENABLED
BPF_ARRAY(ue_funcs, struct ue_func, UE_MAX_FUNCS);
BPF_HASH(ue_edges, struct ue_edge_key, struct ue_row, UE_MAX_EDGES);
BPF_HASH(ue_sites, u64, u64, UE_MAX_SITES);  // return-address vaddr -> call-instruction vaddr
// [0] functions, [1] dense index of the virtual root, [2] and [3] the functions' page index (as
// uw_module's, tables.py page_index): base, and buckets << 8 | shift (0: none)
BPF_ARRAY(ue_config, u64, 4);
BPF_ARRAY(ue_fpages, struct uw_page, UE_MAX_FPAGES);

// Word k of the context: the header, the used segments, the used recID words, the unanalysed frames.
static __always_inline int ue_word(struct uw_state *st, u32 k, u64 *out) {
    struct ue_rec *e = &st->s.e;
    u32 hs = UE_HDR_WORDS + e->nsegs * UE_SEGW;
    u32 r = (e->rec_len + 63) / 64;
    u32 phys;
    if (k < hs)
        phys = k;
    else if (k < hs + r)
        phys = k - hs + UE_OFF_REC;
    else
        phys = k - (hs + r) + UE_OFF_UNAN;
    if (phys >= UE_TOTAL_WORDS)
        return -1;
    *out = ((u64 *)e)[phys];
    return 0;
}

static __always_inline void ue_seg_at(struct ue_rec *e, u32 idx, u32 callee, u32 caller, s64 site, u64 ret) {
    struct ue_seg *g = &e->segs[idx & (UE_MAX_SEGS - 1)];
#pragma unroll
    for (int w = 0; w < UE_ACYC_WORDS; w++) {
        g->saved[w] = e->acyc[w];
        e->acyc[w] = 0;
    }
    g->rec_height = e->rec_len;
    g->callee = callee;
    g->caller = caller;
    g->pad = 0;
    g->site = site;
    g->ret = ret;
    e->nsegs = idx + 1;
}

// Forget everything above `callee`: the context restarts there with an unknown caller.
static __always_inline void ue_anchor(struct ue_rec *e, u32 callee, u32 why) {
#pragma unroll
    for (int w = 0; w < UE_ACYC_WORDS; w++)
        e->acyc[w] = 0;
    e->rec_len = 0;
    e->nunan = 0;
    e->nframes = 0;
    e->flags |= UE_F_ANCHOR | why;
    ue_seg_at(e, 0, callee, UE_NONE, -1, 0);
}

// Encoder.enter_from_outside / unencoded_call: save acycID and the recID height, restart at callee.
static __always_inline void ue_segment(struct ue_rec *e, u32 callee, u32 caller, s64 site, u64 ret) {
    u32 n = e->nsegs;
    if (n >= UE_MAX_SEGS) {
        ue_anchor(e, callee, UE_F_SEG_OVF);
        return;
    }
    ue_seg_at(e, n, callee, caller, site, ret);
}

static __always_inline int ue_push_rec(struct ue_rec *e, u32 code) {
#if UE_REC_BITS > 0
    u32 pos = e->rec_len;
    if (pos + UE_REC_BITS > UE_REC_WORDS * 64)
        return -1;
    u32 w = (pos >> 6) & (UE_REC_WORDS - 1);
    u32 sh = pos & 63;
    u64 m = ((1ULL << UE_REC_BITS) - 1);
    e->rec[w] = (e->rec[w] & ~(m << sh)) | ((u64)code << sh);
    if (sh + UE_REC_BITS > 64) {
        u32 w1 = (w + 1) & (UE_REC_WORDS - 1);
        e->rec[w1] = (e->rec[w1] & ~(m >> (64 - sh))) | ((u64)code >> (64 - sh));
    }
    e->rec_len = pos + UE_REC_BITS;
    return 0;
#else
    return -1;
#endif
}

// Encoder.call for one edge (or a call plus the tail jumps that replaced its callee).
static __always_inline void ue_apply(struct ue_rec *e, struct ue_row *r, u32 callee) {
#pragma unroll
    for (int w = 0; w < UE_ACYC_WORDS; w++)
        e->acyc[w] = (e->acyc[w] & ~r->mask[w]) | r->val[w];
#pragma unroll
    for (int k = 0; k < UE_ROW_REC; k++) {
        if (k >= r->nrec)
            break;
        if (ue_push_rec(e, r->rec[k]) < 0) {
            ue_anchor(e, callee, UE_F_REC_OVF);
            return;
        }
    }
}

// The analysed function holding ELF vaddr v (last range found is checked first).
static __always_inline int ue_function(struct uw_state *st, u64 v, u32 *node, u32 *flags) {
    if (v >= st->w.f_lo && v < st->w.f_hi) {
        *node = st->w.f_node;
        *flags = st->w.f_flags;
        return 0;
    }
    if (v >= 0x100000000ULL)
        return -1;
    u32 k0 = 0;
    u64 *nf = ue_config.lookup(&k0);
    if (!nf)
        return -1;
    u32 lo = 0, hi = (u32)*nf;
    if (hi > UE_MAX_FUNCS)
        hi = UE_MAX_FUNCS;
    u32 k2 = 2, k3 = 3;
    u64 *pbase = ue_config.lookup(&k2);
    u64 *pgeo = ue_config.lookup(&k3);
    if (pbase && pgeo && (*pgeo >> 8)) {
        if (v < *pbase) {
            return -1;
        } else {
            u64 b = (v - *pbase) >> (*pgeo & 31);
            if (b >= (*pgeo >> 8)) {
                lo = hi;  // past the last bucket: the last function
            } else {
                u32 pi = (u32)b;
                struct uw_page *pg = ue_fpages.lookup(&pi);
                if (!pg)
                    return -1;
                lo = pg->lo;
                if (pg->hi < hi)
                    hi = pg->hi;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < UE_FUNCS_LOG2 + 1; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        struct ue_func *f = ue_funcs.lookup(&mid);
        if (!f)
            return -1;
        st->n_steps++;
        if (f->start <= (u32)v)
            lo = mid + 1;
        else
            hi = mid;        lo = uw_opaque(&st->bs_lo, lo);
        hi = uw_opaque(&st->bs_hi, hi);
    }
    if (lo == 0)
        return -1;
    u32 idx = lo - 1;
    struct ue_func *f = ue_funcs.lookup(&idx);
    if (!f || (u32)v >= f->end)
        return -1;
    st->w.f_lo = f->start;
    st->w.f_hi = f->end;
    st->w.f_node = f->node;
    st->w.f_flags = f->flags;
    *node = f->node;
    *flags = f->flags;
    return 0;
}

// One frame of the encoding pass, outermost first (i = 0 is the outermost unwound frame).
static __always_inline long ue_step(struct uw_state *st, u32 i) {
    u32 n = st->s.n;
    if (i >= n || n > UW_MAX_DEPTH)
        return 1;
    u32 j = n - 1 - i;
    u64 raw = st->s.pcs[j & (UW_MAX_DEPTH - 1)];
    u64 pc = raw & ~UW_EXACT_BIT;
    u32 exact = raw >> 63;
    struct ue_rec *e = &st->s.e;
    if (!(pc >= st->c.start && pc < st->c.end)) {
        if (uw_switch_mapping(st, pc) < 0) {
            st->c.start = 0;
            st->c.end = 0;
            st->c.bias = 0;
            st->c.info = 0xffff;
        }
    }
    u32 info = st->c.info;
    u64 v = pc - st->c.bias;
    u32 node = UE_NONE, fflags = 0;
    if (info & UE_ANALYSED) {
        if (ue_function(st, exact ? v : v - 1, &node, &fflags) < 0 || (fflags & 1))
            node = UE_NONE;
    }
    if (node == UE_NONE) {
        // Above the thread's first analysed frame a frame is not part of the context -- unless no
        // analysed frame follows (the dynamic loader before the binary's entry, a thread a library
        // started): then the library frames are the whole context.  So they are kept here and
        // dropped at the first analysed frame (below), which they are above.  The binary's own
        // code up there (its entry function, `_start`) is above the context's root either way.
        if (st->w.cur == UE_NONE && (info & UE_ANALYSED))
            return 0;
        u32 k = e->nunan;
        if (k >= UE_MAX_UNAN) {
            e->flags |= UE_F_UNAN_OVF;
            return 0;
        }
        e->unan[(2 * k) & (2 * UE_MAX_UNAN - 1)] = (u64)(e->nframes - 1) | ((u64)(info & 0xffff) << 32);
        e->unan[(2 * k + 1) & (2 * UE_MAX_UNAN - 1)] = v | (exact ? UW_EXACT_BIT : 0);
        e->nunan = k + 1;
        st->w.gap++;
        return 0;
    }
    u32 cur = st->w.cur;
    if (cur == UE_NONE) {
        e->nunan = 0;  // the frames above the first analysed one (see above)
        e->flags &= ~UE_F_UNAN_OVF;
        if (st->s.reason) {
            ue_anchor(e, node, 0);  // the unwind stopped early: frames above are unknown
        } else {
            struct ue_edge_key key = {0, node, 0};
            struct ue_row *row = ue_edges.lookup(&key);
            if (row) {
                ue_apply(e, row, node);
            } else {
                u32 k1 = 1;
                u64 *root = ue_config.lookup(&k1);
                ue_segment(e, node, root ? (u32)*root : UE_NONE, -1, 0);
            }
        }
    } else if (st->w.cur_exact) {
        ue_segment(e, node, cur, -1, 0);  // the caller was interrupted (signal): no call site
    } else {
        struct ue_row *row = 0;
        if (st->w.gap == 0) {
            struct ue_edge_key key = {st->w.cur_v, node, 0};
            row = ue_edges.lookup(&key);
        }
        if (row) {
            ue_apply(e, row, node);
        } else {
            u64 cv = st->w.cur_v;
            u64 *site = ue_sites.lookup(&cv);
            ue_segment(e, node, cur, site ? (s64)*site : -1, cv);
        }
    }
    e->nframes++;
    st->w.cur = node;
    st->w.cur_v = v;
    st->w.cur_exact = exact;
    st->w.gap = 0;
    return 0;
}

static __always_inline long ue_hash_step(struct uw_state *st, u32 k) {
    if (k >= st->alen)
        return 1;
    u64 word = 0;
    if (ue_word(st, k, &word) < 0)
        return 1;
    uw_mix(st, word);
    return 0;
}

static __always_inline void ue_reset(struct uw_state *st) {
    struct ue_rec *e = &st->s.e;
    e->node = UE_NONE;
    e->flags = 0;
    e->rec_len = 0;
    e->nsegs = 0;
    e->inner = 0;
    e->nunan = 0;
    e->nframes = 0;
#pragma unroll
    for (int w = 0; w < UE_ACYC_WORDS; w++)
        e->acyc[w] = 0;
    st->w.cur = UE_NONE;
    st->w.cur_exact = 0;
    st->w.cur_v = 0;
    st->w.gap = 0;
    st->w.f_lo = 0;
    st->w.f_hi = 0;
}
#define UW_CTX_LEN(st) ((st)->alen)
#else
#define UW_CTX_LEN(st) ((st)->s.n)
#endif

static __always_inline long uw_arena_step(struct uw_state *st, u32 i) {
    if (i >= UW_CTX_LEN(st))
        return 1;
    u32 idx = (u32)(st->arena_off + i);
    u64 *w = uw_arena.lookup(&idx);
    if (!w)
        return 1;
#ifdef UE_ENABLED
    u64 pc = 0;
    if (ue_word(st, i, &pc) < 0)
        return 1;
#else
    u64 pc = st->s.pcs[i & (UW_MAX_DEPTH - 1)];
#endif
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

static __always_inline long uw_step(u32 slot, int memo) {
    struct uw_state *st = uw_state.lookup(&slot);
    if (!st)
        return 1;
    return uw_unwind_step(st, memo);
}

static __always_inline long uw_arena_slot(u32 slot, u32 i) {
    struct uw_state *st = uw_state.lookup(&slot);
    if (!st)
        return 1;
    return uw_arena_step(st, i);
}

// bpf_loop callbacks, one set per program kind (each program's state is in its own slot, so a CPU
// sample interrupting a syscall sample on the same CPU does not clobber it).  The verifier checks
// a callback once per call site, so each loop has its own small callback; Python tells their call
// sites apart by the loop count (UW_UNWIND_LOOPS, UW_ARENA_LOOPS, UE_ENC_LOOPS, UE_HASH_LOOPS).
long uw_step_sys(u64 i) { return uw_step(bpf_get_smp_processor_id() * 2, 1); }
long uw_step_cpu(u64 i) { return uw_step(bpf_get_smp_processor_id() * 2 + 1, 0); }
long uw_arena_sys(u64 i) { return uw_arena_slot(bpf_get_smp_processor_id() * 2, (u32)i); }
long uw_arena_cpu(u64 i) { return uw_arena_slot(bpf_get_smp_processor_id() * 2 + 1, (u32)i); }
#ifdef UE_ENABLED
static __always_inline long ue_enc_slot(u32 slot, u32 i) {
    struct uw_state *st = uw_state.lookup(&slot);
    if (!st)
        return 1;
    return ue_step(st, i);
}
static __always_inline long ue_hash_slot(u32 slot, u32 i) {
    struct uw_state *st = uw_state.lookup(&slot);
    if (!st)
        return 1;
    return ue_hash_step(st, i);
}
long ue_enc_sys(u64 i) { return ue_enc_slot(bpf_get_smp_processor_id() * 2, (u32)i); }
long ue_enc_cpu(u64 i) { return ue_enc_slot(bpf_get_smp_processor_id() * 2 + 1, (u32)i); }
long ue_hash_sys(u64 i) { return ue_hash_slot(bpf_get_smp_processor_id() * 2, (u32)i); }
long ue_hash_cpu(u64 i) { return ue_hash_slot(bpf_get_smp_processor_id() * 2 + 1, (u32)i); }
#define UE_CALLBACKS_SYS , ue_enc_sys, ue_hash_sys
#define UE_CALLBACKS_CPU , ue_enc_cpu, ue_hash_cpu
#define UE_CALLBACK_PARAMS , void *enc_cb, void *hash_cb
#else
#define UE_CALLBACKS_SYS
#define UE_CALLBACKS_CPU
#define UE_CALLBACK_PARAMS
#endif

// The sample's path argument, read only when a record will carry it: in aggregate mode a counted
// repeat sends nothing, and the read (a helper call, ending in a costly kernel `ret` on this CPU) was
// paid on every sample.  Still at the syscall's entry, before the kernel reads the same string (a
// page not resident makes the read fail: the record goes without its argument).
static __always_inline void uw_read_arg(struct uw_state *st) {
    if (!st->argp)
        return;
    long got = bpf_probe_read_user_str(st->s.arg, UW_ARG_LEN, (void *)st->argp);
    if (got > 0)
        st->s.arg_len = (u32)got;
}

static __always_inline int uw_emit(struct uw_state *st) {
    uw_read_arg(st);
    u32 n = st->s.n;
    if (n > UW_MAX_DEPTH)
        n = UW_MAX_DEPTH;
    u64 size = sizeof(struct uw_sample) - sizeof(st->s.pcs) + (u64)n * 8;
    if (size > sizeof(struct uw_sample))
        size = sizeof(struct uw_sample);
    if (uw_events.ringbuf_output(&st->s, size, 0) != 0) {
        uw_stat(UW_STAT_RINGBUF_FULL, 1);
        return -1;
    }
    return 0;
}

// A known context: only the header (time, thread, syscall, key) and the sample's path argument
// when every sample is wanted.
static __always_inline void uw_emit_hit(struct uw_state *st) {
    u32 k = UW_CFG_EMIT_HITS;
    u64 *on = uw_config.lookup(&k);
    if (!on || !*on)
        return;
    uw_read_arg(st);
    st->s.kind = UW_EV_HIT;
    u64 size = UW_SAMPLE_HDR_BYTES + (u64)st->s.arg_len;
    if (size > UW_SAMPLE_HDR_BYTES + UW_ARG_LEN)
        size = UW_SAMPLE_HDR_BYTES + UW_ARG_LEN;
    if (uw_events.ringbuf_output(&st->s, size, 0) != 0)
        uw_stat(UW_STAT_RINGBUF_FULL, 1);
    st->s.kind = UW_EV_SAMPLE;
}

// Count the context in the kernel; only contexts not seen before go to userspace.
static __always_inline void uw_aggregate(struct uw_state *st, void *arena_cb) {
    struct uw_key key = {st->s.h1, st->s.h2};
    struct uw_count *c = uw_counts.lookup(&key);
    u32 len = UW_CTX_LEN(st);
    int alike = 0;
    if (c) {
#ifdef UE_ENABLED
        alike = c->len == len && c->nr == st->s.nr && c->reason == st->s.reason;
#else
        alike = c->len == len && c->tgid == st->s.tgid && c->nr == st->s.nr && c->reason == st->s.reason;
#endif
        if (alike && st->same && st->p_agg && st->p_h1 == key.h1 && st->p_h2 == key.h2 &&
            st->p_off == c->arena_off) {
            // the words the previous sample compared equal (or stored) at this very entry
            __sync_fetch_and_add(&c->count, 1);
            uw_emit_hit(st);
            return;
        }
    }
    st->p_agg = 0;  // set again below only once this sample's words are those at an entry's offset
    if (c) {
        if (alike) {
            st->op = UW_OP_COMPARE;
            st->mismatch = 0;
            st->arena_off = c->arena_off;
            bpf_loop(UW_ARENA_LOOPS, arena_cb, 0, 0);
            if (!st->mismatch) {
                __sync_fetch_and_add(&c->count, 1);
                uw_emit_hit(st);
                st->p_agg = 1;
                st->p_h1 = key.h1;
                st->p_h2 = key.h2;
                st->p_off = c->arena_off;
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
    u64 off = __sync_fetch_and_add(top, (u64)len);
    if (off + len > UW_ARENA_WORDS) {
        uw_stat(UW_STAT_ARENA_FULL, 1);
        st->s.flags |= UW_F_UNAGGREGATED;
        uw_emit(st);
        return;
    }
    st->op = UW_OP_COPY;
    st->arena_off = off;
    bpf_loop(UW_ARENA_LOOPS, arena_cb, 0, 0);
    struct uw_count nc = {};
    nc.count = 1;
    nc.arena_off = off;
    nc.len = len;
    nc.tgid = st->s.tgid;
    nc.nr = st->s.nr;
    nc.reason = st->s.reason;
    if (uw_counts.update(&key, &nc) != 0) {  // full
        uw_stat(UW_STAT_COUNTS_FULL, 1);
        st->s.flags |= UW_F_UNAGGREGATED;
        uw_emit(st);
        return;
    }
    st->s.flags |= UW_F_NEW;
    uw_stat(UW_STAT_NEW, 1);
    if (uw_emit(st) != 0) {
        uw_counts.delete(&key);  // userspace never saw it: the next occurrence is new again
        return;
    }
    st->p_agg = 1;
    st->p_h1 = key.h1;
    st->p_h2 = key.h2;
    st->p_off = off;
}

#ifdef UE_ENABLED
// Count this sample at the counts entry under key (h1, h2) that its context was verified at (arena
// offset `off`, `alen` words), while that entry is still the one verified: 1, with the sample's
// context hash and length set as the encoding path would have made them; 0 when the entry is gone
// or another one (userspace cleared the counts), for the caller to verify afresh.  The chain cache
// (uw_kc_hit) and the memo ways (uw_way_hit) count through it.
static __always_inline int uw_count_at(struct uw_state *st, u64 h1, u64 h2, u64 off, u32 alen) {
    struct uw_key key = {h1, h2};
    struct uw_count *c = uw_counts.lookup(&key);
    if (!c || c->arena_off != off || c->len != alen || c->nr != st->s.nr || c->reason != st->s.reason)
        return 0;
    __sync_fetch_and_add(&c->count, 1);
    st->s.h1 = h1;
    st->s.h2 = h2;
    st->alen = alen;
    return 1;
}

// A syscall sample whose chain is one of the slot's recent ones (struct uw_kc), when aggregating:
// count it at the entry that chain's context was verified at and return 1, or return 0 to take
// the encoding path.
static __always_inline int uw_kc_hit(struct uw_state *st) {
    u32 n = st->s.n;
    if (n == 0 || n > UW_KC_DEPTH || st->gen == 0 || st->gen_mixed)
        return 0;
    u32 w = UW_KC_WAYS;
#pragma unroll
    for (u32 i = 0; i < UW_KC_WAYS; i++) {
        struct uw_kc *k = &st->kc[i];
        if (k->valid && k->ph1 == st->kc_ph1 && k->ph2 == st->kc_ph2 && k->n == n && k->reason == st->s.reason &&
            k->gen == st->gen && k->tgid == st->s.tgid && k->nr == st->s.nr) {
            w = i;
            break;
        }
    }
    if (w >= UW_KC_WAYS)
        return 0;
    struct uw_kc *k = &st->kc[w & (UW_KC_WAYS - 1)];
    // the pcs themselves, not their hash; branch-free over all UW_KC_DEPTH words (constant offsets:
    // a loop bounded by n was compiled into one the verifier could not bound)
    u64 diff = 0;
#pragma unroll
    for (u32 i = 0; i < UW_KC_DEPTH; i++)
        diff |= (i < n) ? (k->pcs[i] ^ st->s.pcs[i & (UW_MAX_DEPTH - 1)]) : 0;
    if (diff || !uw_count_at(st, k->kh1, k->kh2, k->off, k->alen))
        return 0;
    st->kc_off = k->off;
    return 1;
}

// A syscall sample whose whole chain is its memo way's (m_whole: uw_memo_chain proved its pcs the
// way's, in the same process and upload of the mappings), when aggregating: count it at the entry
// the way's context was verified at for this syscall while that entry is still the one verified --
// what uw_kc_hit concludes for the same pcs, without looking them up and comparing them word by
// word (most of a repeated syscall's cost on nginx, whose workers alternate on each CPU).  1: counted.
static __always_inline int uw_way_hit(struct uw_state *st) {
    if (!st->m_whole || !st->m.k_ok || st->m.k_nr != st->s.nr || st->s.reason != 0 || st->gen == 0 ||
        st->gen_mixed)
        return 0;
    return uw_count_at(st, st->m.kh1, st->m.kh2, st->m.k_off, st->m.k_alen);
}

// This sample's context is the arena's at `off` under key (h1, h2): the way that holds its chain
// (m_hold; a way kept anew starts without) remembers that for this syscall (uw_way_hit).
static __always_inline void uw_way_put(struct uw_state *st, u64 h1, u64 h2, u64 off) {
    u32 w = st->m_hold;
    if (w >= UW_MEMO_WAYS || st->s.reason != 0 || st->gen == 0 || st->gen_mixed)
        return;
    struct uw_mway *y = &st->ways[w];
    y->kh1 = h1;
    y->kh2 = h2;
    y->k_off = off;
    y->k_alen = st->alen;
    y->k_nr = st->s.nr;
    y->k_ok = 1;
}

// After the encoding path verified or stored this sample's context (p_agg): remember its chain.
static __always_inline void uw_kc_put(struct uw_state *st) {
    u32 n = st->s.n;
    if (!st->p_agg || n == 0 || n > UW_KC_DEPTH || st->gen == 0 || st->gen_mixed)
        return;
    u32 w = st->kc_next & (UW_KC_WAYS - 1);
#pragma unroll
    for (u32 i = 0; i < UW_KC_WAYS; i++) {  // a way of the same chain (another syscall through it) is replaced
        struct uw_kc *o = &st->kc[i];
        if (o->valid && o->ph1 == st->kc_ph1 && o->ph2 == st->kc_ph2 && o->n == n) {
            w = i;
            break;
        }
    }
    if (w == (st->kc_next & (UW_KC_WAYS - 1)))
        st->kc_next++;
    struct uw_kc *k = &st->kc[w & (UW_KC_WAYS - 1)];
    k->valid = 0;
#pragma unroll
    for (u32 i = 0; i < UW_KC_DEPTH; i++)  // all of them (words past n are never compared)
        k->pcs[i] = st->s.pcs[i & (UW_MAX_DEPTH - 1)];
    k->ph1 = st->kc_ph1;
    k->ph2 = st->kc_ph2;
    k->kh1 = st->p_h1;
    k->kh2 = st->p_h2;
    k->off = st->p_off;
    k->n = n;
    k->reason = st->s.reason;
    k->gen = st->gen;
    k->tgid = st->s.tgid;
    k->alen = st->alen;
    k->nr = st->s.nr;
    k->valid = 1;
}
#endif

#define UW_UNWIND_LOOPS (UW_MAX_DEPTH + 1)

// The user registers a sample needs, pt_regs from bp to sp (ip, sp, bp and the six argument
// registers lie in between), in one read: each helper call ends in a kernel `ret`, costly under
// this CPU's SRSO / retpoline mitigations, and four reads (ip, sp, bp, arguments) cost four
// (issue #18).  A failed read leaves zeros (ip = sp = 0: "no user registers").
#define UW_RW(r) ((offsetof(struct pt_regs, r) - offsetof(struct pt_regs, bp)) / 8)
#define UW_REGS_WORDS (UW_RW(sp) + 1)
static __always_inline void uw_read_regs(u64 *rw, struct pt_regs *regs) {
    if (bpf_probe_read_kernel(rw, UW_REGS_WORDS * 8, &regs->bp) != 0)
        __builtin_memset(rw, 0, UW_REGS_WORDS * 8);
}

// The same words loaded directly, no helper call: `regs` must be bpf_task_pt_regs' result, a
// pointer the verifier knows as the kernel's struct pt_regs (BTF), whose loads it allows and makes
// fault-safe; a raw tracepoint's args[0] is a plain number and needs uw_read_regs.  One helper call
// (copy_from_kernel_nofault) was ~8% of a security-set sample's BPF time on nginx (perf, issue 14).
static __always_inline void uw_load_regs(u64 *rw, struct pt_regs *regs) {
    // Each word stored as two halves: the verifier then keeps the slot as unknown bytes, as after
    // a helper's write.  A whole-word store spills the value, which it tracks, and its tests later
    // split the unwinder's states: twice the instructions processed (66k -> 128k).
#define UW_LOAD(r)                                                   \
    do {                                                             \
        u64 v_ = regs->r;                                            \
        volatile u32 *h_ = (volatile u32 *)&rw[UW_RW(r)];            \
        h_[0] = (u32)v_;                                             \
        h_[1] = (u32)(v_ >> 32);                                     \
    } while (0)
    UW_LOAD(bp);
    UW_LOAD(bx);
    UW_LOAD(r11);
    UW_LOAD(r10);
    UW_LOAD(r9);
    UW_LOAD(r8);
    UW_LOAD(ax);
    UW_LOAD(cx);
    UW_LOAD(dx);
    UW_LOAD(si);
    UW_LOAD(di);
    UW_LOAD(orig_ax);
    UW_LOAD(ip);
    UW_LOAD(flags);
    UW_LOAD(sp);
#undef UW_LOAD
    rw[UW_RW(cs)] = 0;  // (a union since FRED; nothing reads it)
}
_Static_assert(UW_REGS_WORDS == 16, "uw_load_regs loads pt_regs from bp to sp: 16 words");

// The memo this sample uses (m: a copy of a way): the way of this thread's whose chain started in
// the state this sample starts in (its whole chain may be reused: uw_memo_chain), else the
// thread's previous chain (its outer frames may be: uw_memo_step), else none.
static __always_inline void uw_memo_pick(struct uw_state *st, u64 pid_tgid, u64 ip, u64 sp, u64 bp) {
    if (!st->m_init) {
#pragma unroll
        for (int w = 0; w < UW_MEMO_WAYS; w++) {
            st->ways[w].buf = w;
            st->ways[w].n = 0;
        }
        st->m_rec = UW_MEMO_WAYS;
        st->m_last = 0;
        st->m_next = 0;
        st->m_init = 1;
    }
    u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
    u32 pick = UW_MEMO_WAYS;
    st->m.n = 0;
    st->m_way = UW_MEMO_WAYS;
    if (st->memo_mode == UW_MEMO_OFF)
        return;
#pragma unroll
    for (int w = 0; w < UW_MEMO_WAYS; w++) {
        struct uw_mway *y = &st->ways[w];
        if (y->n && y->tid == tid && y->tgid == tgid) {
            struct uw_mframe *f0 = &st->mf[y->buf & (UW_MEMO_BUFS - 1)][0];
            if (f0->pc == ip && f0->sp == sp && (f0->bp == bp || !y->bp_dep)) {
                pick = w;
                break;
            }
        }
    }
    if (pick < UW_MEMO_WAYS) {
        st->m_way = pick;
    } else {
        pick = st->m_last;
        if (pick >= UW_MEMO_WAYS)
            return;
    }
    struct uw_mway *y = &st->ways[pick];
    if (!y->n || y->tid != tid || y->tgid != tgid)
        return;
    st->m = *y;
}

// Keep this sample's chain (recorded in the spare buffer, m_rec) in the way it started in, or else
// in the next way round; the buffer that way had becomes the spare.
static __always_inline void uw_memo_keep(struct uw_state *st, u64 pid_tgid) {
    u32 w = st->m_way;
    if (w >= UW_MEMO_WAYS) {
        w = st->m_next;
        if (w >= UW_MEMO_WAYS)
            w = 0;
        st->m_next = w + 1 < UW_MEMO_WAYS ? w + 1 : 0;
    }
    struct uw_mway *y = &st->ways[w];
    u32 old = y->buf;
    y->buf = st->m_rec;
    y->n = st->s.n;
    y->tid = (u32)pid_tgid;
    y->tgid = pid_tgid >> 32;
    y->gen = st->gen;
    y->lo = st->m_cut;
    y->fp = st->s.fp_frames;
    y->bp_dep = st->bp_dep;
    y->h1 = st->s.h1;
    y->h2 = st->s.h2;
    y->slo = st->r_slo;
    y->shi = st->r_shi;
    y->k_ok = 0;
    st->m_rec = old;
    st->m_last = w;
    st->m_hold = w;
}

// `can_aggregate` is a constant per program: the CPU sampler sends every sample (the aggregation
// code would double its verification cost past the verifier's limit; CPU samples are few).
// `syscall_sample` too (1: from uw_sys_enter, whose argument registers `rw` holds, and the flight
// recorder gets the sample); never test a value the verifier does not know for that (the
// tracepoint's `regs` once), see the recorder's call below.  `rw`: uw_read_regs's words.
static __always_inline void uw_sample(u32 slot, u64 pid_tgid, s32 nr, const u64 *rw, u64 argp, void *loop_cb,
                                      void *arena_cb, int can_aggregate, int memo,
                                      int syscall_sample UE_CALLBACK_PARAMS) {
    struct uw_state *st = uw_state.lookup(&slot);
    if (!st)
        return;
    u64 ip = rw[UW_RW(ip)], sp = rw[UW_RW(sp)], bp = rw[UW_RW(bp)];
    u32 tgid = pid_tgid >> 32;
    st->pc = ip;
    st->sp = sp;
    st->bp = bp;
    st->bp_valid = 1;
    st->bp_src = UW_BP_ENTRY;
    st->bp_dep = 0;
    st->exact = 1;
    st->done = 0;
    st->go_curg_set = 0;
    st->ax0 = rw[UW_RW(ax)];
    st->op = UW_OP_UNWIND;
    st->win_base = 1;
    st->win_len = UW_WIN_BYTES;
    st->r_slo = ~0ULL;
    st->r_shi = 0;
    st->n_steps = 0;
    st->n_copies = 0;
    st->n_maps = 0;
    st->gen = 0;
    st->gen_mixed = 0;
    // The mapping and rule caches (c, alt, r_*) are kept from this slot's previous sample when it
    // was of the same process and the same upload of its mappings (uw_proc.gen; an upload never
    // changes, module tables are never rewritten): a thread's syscalls mostly come from one
    // wrapper, whose frame then needs no mapping or rule search -- their lookups in the big
    // mapping, page and row arrays were most of a sample's fixed cost (issue #18).
    struct uw_proc *p = uw_procs.lookup(&tgid);
    if (p) {
        st->gen = p->gen;
        st->start_stack = p->start_stack;
    }
    if (!p || st->k_tgid != tgid || st->k_gen != st->gen) {
        st->c.start = 0;
        st->c.end = 0;
        st->alt.start = 0;
        st->alt.end = 0;
        st->r_module = UW_NO_MODULE;
        st->k_tgid = tgid;
        st->k_gen = st->gen;
    }
    st->m_hold = UW_MEMO_WAYS;
    if (memo) {
        u32 km = UW_CFG_MEMO;
        u64 *mm = uw_config.lookup(&km);
        st->memo_mode = mm ? (u32)*mm : UW_MEMO_ON;
        // a way of this thread's (tid and process; uw_memo_step and the check below look at the mappings)
        uw_memo_pick(st, pid_tgid, ip, sp, bp);
        st->m_c = 0;
        st->m_on = 0;
        st->m_cut = 1;
        st->m_hit = 0;
        st->m_whole = 0;
        st->m_chk = 0;
        // The whole chain may be the memo's (uw_memo_chain) when the sample starts in the state its
        // frame 0 did -- the way uw_memo_pick matched it by (m_way; rbp only when a step used it
        // before one restored it from a slot: code built without frame pointers keeps data in rbp,
        // different at every call, that no step reads) -- with the same upload of the mappings, and
        // every slot of every frame's step was kept: not when frame 0's step read rdi (RA_REG,
        // nread 0) or a frame read a third slot (a signal frame: m.lo above 1, or frame 0's own
        // nread 3); not in the tests' unchecked mode.
        struct uw_mframe *f0 = &st->mf[st->m.buf & (UW_MEMO_BUFS - 1)][0];
        st->m_try = st->m_way < UW_MEMO_WAYS && st->m.n > 0 && st->m.n <= UW_MEMO_DEPTH && st->m.lo == 1 &&
                    (st->memo_mode == UW_MEMO_ON || st->memo_mode == UW_MEMO_CHAIN_UNCHECKED ||
                     st->memo_mode == UW_MEMO_RBP_UNCHECKED) &&
                    st->gen != 0 && st->gen == st->m.gen && f0->nread >= 1 && f0->nread <= 2 &&
                    (f0->flags & (UW_MF_BP_VALID | UW_MF_EXACT)) == (UW_MF_BP_VALID | UW_MF_EXACT);
        st->same = st->p_valid && st->p_tgid == tgid && st->memo_mode != UW_MEMO_OFF;
    } else {
        st->same = 0;
    }
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
    st->s.arg_len = 0;
    if (syscall_sample) {  // a constant per program (regs is not: the tracepoint's argument)
        st->s.sargs[0] = rw[UW_RW(di)];
        st->s.sargs[1] = rw[UW_RW(si)];
        st->s.sargs[2] = rw[UW_RW(dx)];
        st->s.sargs[3] = rw[UW_RW(r10)];
        st->s.sargs[4] = rw[UW_RW(r8)];
        st->s.sargs[5] = rw[UW_RW(r9)];
    } else {
        __builtin_memset(st->s.sargs, 0, sizeof(st->s.sargs));
    }
    st->argp = argp;  // read only for a record that carries it (uw_read_arg)
    if (ip == 0 && sp == 0) {
        st->s.reason = UW_WHY_NO_REGS;
    } else {
        bpf_loop(UW_UNWIND_LOOPS, loop_cb, 0, 0);
        if (!st->done)
            st->s.reason = UW_WHY_MAX_DEPTH;
    }
    if (st->gen_mixed)
        st->k_gen = 0;  // its caches may hold two uploads' mappings: not reused (gen is never 0)
    if (memo) {
        if (st->m_hit) {
            uw_stat(UW_STAT_MEMO_HITS, 1);
            uw_stat(UW_STAT_MEMO_FRAMES, st->m_hit);
        }
        // keep this chain for the thread's next sample: complete, every frame recorded, one
        // generation of mappings (a chain that was the memo's whole leaves it as it is: its frames
        // were not recorded again)
        if (st->m_whole) {
            uw_stat(UW_STAT_MEMO_CHAINS, 1);
            st->m_last = st->m_way;
            st->m_hold = st->m_way;
        } else if (st->memo_mode != UW_MEMO_OFF && st->s.reason == 0 && st->s.n > 0 &&
                   st->s.n <= UW_MEMO_DEPTH && st->gen != 0 && !st->gen_mixed) {
            uw_memo_keep(st, pid_tgid);
        }
        st->same = st->same && st->s.n == st->p_n && st->s.reason == st->p_reason && st->gen == st->p_gen &&
                   st->gen != 0 && !st->gen_mixed;
        if (st->same)
            uw_stat(UW_STAT_SAME_AS_PREVIOUS, 1);
        st->p_valid = 1;
        st->p_tgid = tgid;
        st->p_gen = st->gen_mixed ? 0 : st->gen;
        st->p_n = st->s.n;
        st->p_reason = st->s.reason;
    }
    u32 k = UW_CFG_AGGREGATE;
    u64 *agg = uw_config.lookup(&k);
    int aggregating = can_aggregate && agg && *agg;  // else every sample is sent
#ifdef UE_ENABLED
    int counted = 0;  // by the chain cache: no encoding, no aggregation below
    st->kc_ph1 = st->s.h1;
    st->kc_ph2 = st->s.h2;
    if (memo && st->same) {
        // the previous sample's pcs: st->s.e and alen still hold its encoding, which is this one's
        st->s.h1 = st->p_eh1;
        st->s.h2 = st->p_eh2;
    } else if (aggregating && memo && uw_way_hit(st)) {
        counted = 1;
        uw_stat(UW_STAT_MEMO_COUNTED, 1);
        st->p_valid = 0;  // as below
        st->p_agg = 0;
    } else if (aggregating && memo && uw_kc_hit(st)) {
        counted = 1;
        uw_stat(UW_STAT_CHAIN_CACHE_HITS, 1);
        uw_way_put(st, st->s.h1, st->s.h2, st->kc_off);
        // st->s.e is not this sample's encoding: the next sample may not reuse it as "same"
        st->p_valid = 0;
        st->p_agg = 0;
    } else {
        ue_reset(st);
        bpf_loop(UE_ENC_LOOPS, enc_cb, 0, 0);
        struct ue_rec *e = &st->s.e;
        e->node = st->w.cur;
        e->inner = st->w.cur_v;
        if (st->w.cur_exact)
            e->flags |= UE_F_INNER_EXACT;
        st->alen = UE_HDR_WORDS + e->nsegs * UE_SEGW + (e->rec_len + 63) / 64 + 2 * e->nunan;
        st->s.h1 = 0x243F6A8885A308D3ULL;
        st->s.h2 = 0x13198A2E03707344ULL;
        bpf_loop(UE_HASH_LOOPS, hash_cb, 0, 0);
        st->p_eh1 = st->s.h1;
        st->p_eh2 = st->s.h2;
    }
    if (!counted) {
        uw_mix(st, ((u64)st->s.reason << 32) | (u32)nr);
        uw_mix(st, st->alen);
    }
#else
    uw_mix(st, ((u64)tgid << 32) | (u32)nr);
    uw_mix(st, ((u64)st->s.reason << 32) | st->s.n);
#endif
    uw_stat(UW_STAT_SAMPLES, 1);
    uw_stat(UW_STAT_FRAMES, st->s.n);
    if (st->s.fp_frames)
        uw_stat(UW_STAT_FP_FRAMES, st->s.fp_frames);
    uw_stat(UW_STAT_LOOKUP_STEPS, st->n_steps);
    uw_stat(UW_STAT_STACK_COPIES, st->n_copies);
    uw_stat(UW_STAT_MAP_SEARCHES, st->n_maps);
    if (st->s.reason)
        uw_stat(UW_STAT_INCOMPLETE, 1);
    if (!st->same)
        st->p_agg = 0;
#ifdef UE_ENABLED
    if (counted) {
        uw_emit_hit(st);
    } else if (aggregating) {
        int was_same = st->same;
        uw_aggregate(st, arena_cb);
        if (memo && !was_same)
            uw_kc_put(st);
        if (memo && st->p_agg)
            uw_way_put(st, st->p_h1, st->p_h2, st->p_off);
    } else {
#else
    if (aggregating) {
        uw_aggregate(st, arena_cb);
    } else {
#endif
        st->p_agg = 0;
        uw_emit(st);
    }
    // A syscall sample: flight recorder (history.c), the context is its 128-bit hash.  Tested on the
    // constant, not on regs: a branch on regs (a value the verifier does not know) made it precise
    // and kept its two cases apart through every bpf_loop above, twice the verification.
    if (syscall_sample)
        ccprof_history_put(pid_tgid, st->s.ktime_ns, nr, st->s.flags, st->s.h1, st->s.h2, st->s.sargs);
}

// unwind.c's per-process state at every syscall, kept in the shared sampler's `tracked` entry (the
// lookup each syscall makes anyway) rather than in maps of its own, whose lookups cost a kernel
// call and `ret` each (issue #18): bytes of ccprof_tracked.flags above the low one, which
// syscall_sampler.c writes only when it makes the entry.  Each byte is written alone (a byte store,
// or an atomic add that carries out of the word's top byte only), so no writer loses another's.
#define UW_TB_HAS_PROC 1   // 1: the process has mappings in uw_procs (uw_inherit has nothing to do)
#define UW_TB_MAPS_SEEN 2  // the count of UW_TB_MAPS the last maps event was sent for
#define UW_TB_MAPS 3       // executable mmap/mprotect calls of the process (mod 256), counted at their entry
static __always_inline volatile u8 *uw_tbyte(struct ccprof_tracked *t, int b) {
    return (volatile u8 *)&t->flags + b;
}

// A forked child has its parent's mappings until it execs: copy them on its first syscall.
// Only a process tracked through a fork can need it, and only until it has mappings (UW_TB_HAS_PROC),
// so the other syscalls cost no uw_procs lookup (issue #18).
static __always_inline void uw_inherit(struct ccprof_tracked *t, u32 tgid) {
    if (!(t->flags & TRACKED_VIA_FORK) || *uw_tbyte(t, UW_TB_HAS_PROC))
        return;
    if (!uw_procs.lookup(&tgid)) {
        u32 *parent = uw_parent.lookup(&tgid);
        if (!parent)
            return;
        u32 ptgid = *parent;
        struct uw_proc *pp = uw_procs.lookup(&ptgid);
        int copied = pp && uw_procs.update(&tgid, pp) == 0;
        uw_parent.delete(&tgid);
        if (!copied)
            return;
        uw_stat(UW_STAT_PROC_COPIED, 1);
    }
    // (an exec deletes the mappings and the parent entry: nothing is inherited after it either)
    *uw_tbyte(t, UW_TB_HAS_PROC) = 1;
}

// Calls that may map code: mmap, mprotect and pkey_mprotect with PROT_EXEC (prot is their third
// argument, rdx) and, seen under the compat watch only (marked CCPROF_IA32_BIT), the ia32 mmap2 and
// mprotect (prot in edx) and old_mmap (its arguments a struct in user memory, prot its third u32;
// unreadable: counted as exec).  Missing one would leave BPF unwinding through a stale table, e.g.
// through a library mapped where another was.  The mapping exists once the call returns: userspace
// is told then (uw_maps_exit, on their exit events) so that it re-reads the maps, and at the
// process's next syscall if that was missed.  (On the per-syscall attach path these are attached
// whatever the set: constants.py.)  The count of such calls is UW_TB_MAPS (an atomic add: calls
// of two threads both count); a check that finds it differing from UW_TB_MAPS_SEEN stores the
// count it read there, then tells userspace.  Two threads may both tell it (as with a map entry
// that both found); none is missed, as the count stored is always one an event is sent for.
#define UW_NR_MMAP 9
#define UW_NR_MPROTECT 10
#define UW_NR_PKEY_MPROTECT 329
#define UW_NR_IA32_OLD_MMAP 90
#define UW_NR_IA32_MPROTECT 125
#define UW_NR_IA32_MMAP2 192
// The counted calls' part: tell userspace if UW_TB_MAPS moved since this process last looked,
// holding it first if BPF holds it at new executable mappings (uw_stop).
static __always_inline void uw_maps_moved(struct ccprof_tracked *t, u32 tgid) {
    u8 maps = *uw_tbyte(t, UW_TB_MAPS);
    if (maps != *uw_tbyte(t, UW_TB_MAPS_SEEN)) {
        *uw_tbyte(t, UW_TB_MAPS_SEEN) = maps;
        if (uw_stop.lookup(&tgid))
            uw_hold(tgid);  // until userspace has re-read the mappings
        struct uw_maps_event *e = uw_events.ringbuf_reserve(sizeof(struct uw_maps_event));
        if (e) {
            e->ktime_ns = bpf_ktime_get_ns();
            e->kind = UW_EV_MAPS;
            e->tgid = tgid;
            uw_events.ringbuf_submit(e, 0);
        } else {
            uw_stat(UW_STAT_MAPS_LOST, 1);
        }
    }
}

static __always_inline void uw_watch_maps(struct ccprof_tracked *t, u32 tgid, long nr, struct pt_regs *regs) {
    uw_maps_moved(t, tgid);
    // The numbers are tested on an opaque copy (nr + 1, hidden from the compiler): a test of nr
    // itself would leave the verifier one state per number tested, each verified again through
    // the whole unwinder after this (nr is used there).
    u64 key = (u64)nr + 1;
    asm volatile("" : "+r"(key));
    u64 prot = 0;
    if (key == UW_NR_MMAP + 1 || key == UW_NR_MPROTECT + 1 || key == UW_NR_PKEY_MPROTECT + 1 ||
        key == (CCPROF_IA32_BIT | UW_NR_IA32_MMAP2) + 1 || key == (CCPROF_IA32_BIT | UW_NR_IA32_MPROTECT) + 1) {
        bpf_probe_read_kernel(&prot, sizeof(prot), &regs->dx);  // the third argument
    } else if (key == (CCPROF_IA32_BIT | UW_NR_IA32_OLD_MMAP) + 1) {
        u64 args = 0;
        bpf_probe_read_kernel(&args, sizeof(args), &regs->bx);
        if (bpf_probe_read_user(&prot, 4, (void *)((u32)args + 8)) != 0)
            prot = 4;
    }
    if (prot & 4)  // PROT_EXEC
        __sync_fetch_and_add(&t->flags, 1U << (8 * UW_TB_MAPS));
}

// The user pointer to the path argument of the syscalls whose path is cheap to report (x86-64:
// open, creat, execve take it in rdi; openat, openat2, execveat in rsi), else 0 -- the same set
// as instrumented mode's cc_path_arg.
// `rw`: uw_read_regs' words (the registers are read once per sample).
static __always_inline u64 uw_path_arg(const u64 *rw, long nr) {
    if (nr == 2 || nr == 85 || nr == 59)
        return rw[UW_RW(di)];
    if (nr == 257 || nr == 437 || nr == 322)
        return rw[UW_RW(si)];
    return 0;
}

#ifdef UW_ENFORCE
// Enforcement from the unwinder (issue 19): at sys_enter, after the sample is taken, the
// (syscall, context) pair is looked up in the model's allowed set and a pair outside it kills the
// process (bpf_send_signal(SIGKILL)).  The key hashes the unwound pcs that lie in an analysed
// function of the target binary (as ELF vaddrs, innermost first; an exact pc -- the instruction
// after a syscall in the binary -- with bit 63 set): exactly the frames the decoder reports as
// analysed, so userspace computes the same key from a learned model's frames
// (anomaly/unwind_enforce.py).  Library frames and the entry function (_start) are skipped on both
// sides.  Everything here is separate from the unwinding loop: its own bpf_loop over the pcs.
#ifndef UE_ENABLED
#error "UW_ENFORCE needs the encoding (UE_ENABLED): it tells the binary's analysed frames apart"
#endif
#define UW_ENF_SEED 0xcbf29ce484222325ULL
#define UW_ENF_PRIME 0x100000001b3ULL
#define UW_ENF_EXACT (1ULL << 63)
#define UW_ENF_STAT_CHECKED 0
#define UW_ENF_STAT_ALLOWED 1
#define UW_ENF_STAT_DENIED 2
#define UW_ENF_STAT_INCOMPLETE 3
#define UW_ENF_STAT_KILLED 4
#define UW_ENF_NR_STATS 8
#define UW_ENF_CFG_KILL 0        // 1: SIGKILL on a denied pair; 0: audit (counted and recorded only)
#define UW_ENF_CFG_INCOMPLETE 1  // 1: an incomplete context (no key the model can hold) is denied
#define UW_ENF_VERDICT_DENIED 2
#define UW_ENF_VERDICT_KILLED 3

struct uw_enf_key {
    u32 nr;
    u32 pad;
    u64 hash;
};

struct uw_enf_denial {
    u64 ktime_ns;
    u64 hash;
    u32 tgid;
    s32 nr;
    u32 verdict;     // UW_ENF_VERDICT_*
    u32 incomplete;  // 1: denied because the context was incomplete
};

BPF_HASH(uw_enf_allowed, struct uw_enf_key, u8, UW_ENF_MAX_KEYS);
BPF_ARRAY(uw_enf_nrs, u8, 1024);              // syscall numbers the model judges
BPF_ARRAY(uw_enf_config, u64, 4);
BPF_ARRAY(uw_enf_acc, u64, UW_NSLOTS);        // the key being hashed, per program slot
BPF_PERCPU_ARRAY(uw_enf_stats, u64, UW_ENF_NR_STATS);
BPF_HASH(uw_enf_denials, u32, struct uw_enf_denial, 4096);  // tid -> its first denial

static __always_inline void uw_enf_stat(u32 idx) {
    u64 *v = uw_enf_stats.lookup(&idx);
    if (v)
        *v += 1;
}

// One pc of the sample (innermost first): mixed into the key when it is in an analysed function.
static __always_inline long uw_enf_step(u32 slot, u32 i) {
    struct uw_state *st = uw_state.lookup(&slot);
    u64 *h = uw_enf_acc.lookup(&slot);
    if (!st || !h)
        return 1;
    u32 n = st->s.n;
    if (i >= n)  // (no i < UW_MAX_DEPTH test: the compiler would drop the mask below)
        return 1;
    u64 raw = st->s.pcs[i & (UW_MAX_DEPTH - 1)];
    u64 pc = raw & ~UW_EXACT_BIT;
    u32 exact = raw >> 63;
    if (!(pc >= st->c.start && pc < st->c.end)) {
        if (uw_find_mapping(st, pc) < 0) {
            st->c.start = 0;
            st->c.end = 0;
            st->c.info = 0;
            return 0;
        }
    }
    if (!(st->c.info & UE_ANALYSED))
        return 0;
    u64 v = pc - st->c.bias;
    u32 node = UE_NONE, fflags = 0;
    if (ue_function(st, exact ? v : v - 1, &node, &fflags) < 0 || (fflags & 1))
        return 0;
    *h = (*h ^ (v | (exact ? UW_ENF_EXACT : 0))) * UW_ENF_PRIME;
    return 0;
}

long uw_enf_sys(u64 i) { return uw_enf_step(bpf_get_smp_processor_id() * 2, (u32)i); }

// Called at the end of the sys_enter sample path, the sample in this CPU's syscall slot.
static __always_inline void uw_enforce(u32 slot, u32 tgid, u32 tid, long nr) {
    u32 inr = (u32)nr;
    u8 *judged = uw_enf_nrs.lookup(&inr);
    // an ia32 call (sampled under the compat watch or "all") is always judged: a model allows one
    // only if it learned that very context
    if (!(inr & CCPROF_IA32_BIT) && (!judged || !*judged))
        return;
    struct uw_state *st = uw_state.lookup(&slot);
    u64 *h = uw_enf_acc.lookup(&slot);
    if (!st || !h)
        return;
    uw_enf_stat(UW_ENF_STAT_CHECKED);
    u32 k_kill = UW_ENF_CFG_KILL, k_inc = UW_ENF_CFG_INCOMPLETE;
    u64 *kill = uw_enf_config.lookup(&k_kill);
    u64 *deny_incomplete = uw_enf_config.lookup(&k_inc);
    u32 incomplete = st->s.reason != 0 ||
                     (st->s.e.flags & (UE_F_ANCHOR | UE_F_SEG_OVF | UE_F_REC_OVF | UE_F_UNAN_OVF)) != 0;
    int denied = 0;
    if (incomplete) {
        uw_enf_stat(UW_ENF_STAT_INCOMPLETE);
        denied = deny_incomplete && *deny_incomplete;
    } else {
        *h = UW_ENF_SEED;
        st->c.start = 0;  // the mapping cache may hold another process's mapping: look up afresh
        st->c.end = 0;
        st->w.f_lo = 0;
        st->w.f_hi = 0;
        bpf_loop(UW_ENF_LOOPS, uw_enf_sys, 0, 0);
        struct uw_enf_key key = {};
        key.nr = inr;
        key.hash = *h;
        denied = uw_enf_allowed.lookup(&key) == 0;
    }
    if (!denied) {
        uw_enf_stat(UW_ENF_STAT_ALLOWED);
        return;
    }
    uw_enf_stat(UW_ENF_STAT_DENIED);
    struct uw_enf_denial d = {};
    d.ktime_ns = bpf_ktime_get_ns();
    d.hash = incomplete ? 0 : *h;
    d.tgid = tgid;
    d.nr = (s32)nr;
    d.incomplete = incomplete;
    d.verdict = UW_ENF_VERDICT_DENIED;
    if (kill && *kill) {
        // Queued now, acted on when the task returns to user space -- after the syscall ran.
        bpf_send_signal(9);  // SIGKILL, to the whole process
        uw_enf_stat(UW_ENF_STAT_KILLED);
        d.verdict = UW_ENF_VERDICT_KILLED;
    }
    uw_enf_denials.insert(&tid, &d);  // the thread's first denial stays (audit mode makes more)
}
#define UW_ENFORCE_SYS(tgid, tid, nr) uw_enforce(bpf_get_smp_processor_id() * 2, tgid, tid, nr)
#else
#define UW_ENFORCE_SYS(tgid, tid, nr)
#endif

// One syscall entry (shared by the raw_syscalls:sys_enter and the per-syscall attach paths below;
// `raw`, a constant per caller: compat calls arrive only there, ccprof_mark_compat).
static __always_inline int uw_sys_sample(struct pt_regs *regs, long nr, int raw) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    struct ccprof_tracked *t = tracked.lookup(&tgid);
    if (!t || t->execs_left)
        return 0;  // not tracked, or a launcher that has not exec'd the target yet
    if (raw)
        nr = ccprof_mark_compat(nr);
    uw_inherit(t, tgid);
    if (uw_held.lookup(&tgid)) {
        // Running although we still hold it: a SIGCONT that was not ours -- another instance's
        // release that came late (it checked our map before this hold, then the process ran into
        // the hold), or a `kill -CONT`.  A SIGCONT cannot be refused, so stop it again here, at
        // its first syscall; userspace releases it once its mappings are loaded, as for any hold.
        bpf_send_signal(19);
        uw_stat(UW_STAT_RESTOPPED, 1);
    }
    uw_watch_maps(t, tgid, nr, regs);
    if (!ccprof_syscall_wanted(nr))
        return 0;
    u32 slot = bpf_get_smp_processor_id() * 2;
    u64 rw[UW_REGS_WORDS];
    if (raw)
        uw_read_regs(rw, regs);
    else
        uw_load_regs(rw, regs);  // bpf_task_pt_regs' pointer (uw_sys_tp): no helper call
    uw_sample(slot, pid_tgid, (s32)nr, rw, uw_path_arg(rw, nr), uw_step_sys,
              uw_arena_sys, 1, 1, 1 UE_CALLBACKS_SYS);
    UW_ENFORCE_SYS(tgid, (u32)pid_tgid, nr);
    return 0;
}

int uw_sys_enter(struct bpf_raw_tracepoint_args *ctx) {
    if (!ccprof_raw_takes_call())  // (beside the events: only ia32 calls, the compat watch)
        return 0;
    return uw_sys_sample((struct pt_regs *)ctx->args[0], (long)ctx->args[1], 1);
}

// A syscalls:sys_enter_<name> event (per-syscall attach path; syscall_sampler.c's ccprof_sys_tp
// says what the record holds).  Only the sampled syscalls and mmap/mprotect (uw_watch_maps) are
// attached.
int uw_sys_tp(void *ctx) {
    if (ccprof_path_is(PATH_EVENTS))  // (else detached: the events' fds may still be closing)
        uw_sys_sample(ccprof_task_regs(), (long)*(int *)((char *)ctx + SYSCALL_NR_OFFSET), 0);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

// The return of a call uw_watch_maps counts: its mapping exists now, so userspace is told here
// and a held process stops here, before its first instruction after the call.  Waiting for its
// next syscall, as the entry does, is too late when that syscall is made by the code just mapped:
// it would be unwound with the mappings of before.  On mmap's, mprotect's and pkey_mprotect's exit
// events (whatever the entry path), and under the compat watch on raw_syscalls:sys_exit for the
// ia32 calls the events leave out.
static __always_inline int uw_maps_exit(void) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct ccprof_tracked *t = tracked.lookup(&tgid);
    if (!t || t->execs_left)
        return 0;
    uw_maps_moved(t, tgid);
    return 0;
}

int uw_maps_exit_tp(void *ctx) {
    if (!ccprof_path_is(PATH_OFF))  // (else detached: no new hold)
        uw_maps_exit();
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

int uw_maps_exit_raw(struct bpf_raw_tracepoint_args *ctx) {
    if (!ccprof_raw_takes_call())  // beside the events: ia32 calls only; never once detached
        return 0;
    return uw_maps_exit();
}

// CPU-clock sample of a tracked process: unwind from its user registers.  The task's pt_regs (top
// of its kernel stack) hold them whether the tick interrupted user mode (saved at the interrupt
// entry) or a syscall (saved at the syscall entry), so one code path serves both (two would
// double the verifier's work).
int uw_cpu_sample(struct bpf_perf_event_data *ctx) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    struct ccprof_tracked *t = tracked.lookup(&tgid);
    if (!t || t->execs_left)
        return 0;
    uw_inherit(t, tgid);
    // (a NULL regs makes the read fail and leave zeros: "no user registers")
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
    u64 rw[UW_REGS_WORDS];
    uw_read_regs(rw, regs);
    uw_sample(bpf_get_smp_processor_id() * 2 + 1, pid_tgid, -1, rw, 0, uw_step_cpu, uw_arena_cpu, 0, 0, 0
              UE_CALLBACKS_CPU);
    return 0;
}

// Tracepoint programs read their fields at offsets Python takes from the tracefs format (kernels
// differ; bcc generates one struct per tracepoint and syscall_sampler.c already has those).
static __always_inline void uw_fork_do(void *args) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!uw_procs.lookup(&tgid))
        return;
    u32 child = *(u32 *)((char *)args + UW_FORK_CHILD_PID_OFF);
    uw_parent.update(&child, &tgid);
}

int uw_fork(void *args) {
    uw_fork_do(args);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

int uw_exec(void *args) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    uw_procs.delete(&tgid);  // a new image: userspace loads its mappings (EV_EXEC)
    uw_parent.delete(&tgid);
    u32 *stop = uw_stop.lookup(&tgid);
    if (stop && *stop > 0) {
        __sync_fetch_and_add(stop, -1);
        uw_hold(tgid);
    } else if (ccprof_exec_is_target()) {
        // a new process of a followed binary (ccprof_exec tracks it): hold it at its first
        // instruction until userspace has loaded its mappings, and at each new executable mapping
        u32 zero = 0;
        uw_stop.update(&tgid, &zero);
        uw_hold(tgid);
    } else if (stop) {
        uw_stop.delete(&tgid);  // exec of another program: not ours any more
    }
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
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
        uw_stop.delete(&tgid);
        uw_held.delete(&tgid);
    }
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}
