"""The constants unwind.c and its Python side share, read from unwind.c (the one source;
:mod:`ccprofd.kbpf.cdefs`)."""

from __future__ import annotations

from pathlib import Path

from ccprofd.kbpf.cdefs import c_constants

C_SOURCE = "unwind.c"
_C = c_constants(Path(__file__).with_name(C_SOURCE))

#: why an unwind stopped early (uw_sample.reason), by UW_WHY_* value
REASONS: dict[int, str | None] = {0: None, **{_C[f"UW_WHY_{name.upper()}"]: reason for name, reason in (
    ("max_depth", "max_depth"), ("unknown_pc", "unknown_pc"), ("no_maps", "no_maps"), ("no_cfi", "no_cfi"),
    ("unsupported", "unsupported_cfi"), ("rbp_lost", "rbp_lost"), ("read_fault", "read_fault"),
    ("bad_frame", "bad_frame"), ("no_table", "no_table"), ("no_regs", "no_user_regs"))}}
# record flags (uw_sample.flags); FLAG_HIT is userspace only: a header-only record of a known context
FLAG_NEW, FLAG_COLLISION, FLAG_UNAGGREGATED = _C["UW_F_NEW"], _C["UW_F_COLLISION"], _C["UW_F_UNAGGREGATED"]
FLAG_HIT = 0x100
EXACT_BIT = _C["UW_EXACT_BIT"]
# encoded-context flags (struct ue_rec)
UE_F_ANCHOR, UE_F_SEG_OVF, UE_F_REC_OVF, UE_F_UNAN_OVF, UE_F_INNER_EXACT = (
    _C[n] for n in ("UE_F_ANCHOR", "UE_F_SEG_OVF", "UE_F_REC_OVF", "UE_F_UNAN_OVF", "UE_F_INNER_EXACT"))
UE_ANALYSED = _C["UE_ANALYSED"]
#: uw_stats indexes, in the order of their UW_STAT_* values
STATS = ("samples", "incomplete", "frames", "fp_frames", "collisions", "arena_full", "counts_full",
         "ringbuf_full", "new_contexts", "procs_inherited", "maps_lost", "restopped", "lookup_steps",
         "stack_copies", "map_searches", "memo_hits", "memo_frames", "memo_rejects",
         "same_as_previous", "chain_cache_hits", "memo_chains", "memo_counted")
# the UW_STAT_ names of STATS, same order
STAT_NAMES = ("SAMPLES", "INCOMPLETE", "FRAMES", "FP_FRAMES", "COLLISIONS", "ARENA_FULL", "COUNTS_FULL",
              "RINGBUF_FULL", "NEW", "PROC_COPIED", "MAPS_LOST", "RESTOPPED", "LOOKUP_STEPS",
              "STACK_COPIES", "MAP_SEARCHES", "MEMO_HITS", "MEMO_FRAMES", "MEMO_REJECTS",
              "SAME_AS_PREVIOUS", "CHAIN_CACHE_HITS", "MEMO_CHAINS", "MEMO_COUNTED")
EV_SAMPLE, EV_MAPS, EV_HIT = _C["UW_EV_SAMPLE"], _C["UW_EV_MAPS"], _C["UW_EV_HIT"]
ARG_LEN = _C["UW_ARG_LEN"]  # the path argument's buffer (PATH_MAX)
#: the syscalls uw_watch_maps looks at (PROT_EXEC mappings), attached on the per-syscall path even
#: when not sampled (kbpf/syscall_entry.py)
UW_NR_MMAP, UW_NR_MPROTECT, UW_NR_PKEY_MPROTECT = (_C[n] for n in ("UW_NR_MMAP", "UW_NR_MPROTECT",
                                                                 "UW_NR_PKEY_MPROTECT"))
CFG_AGGREGATE, CFG_EMIT_HITS, CFG_MEMO = _C["UW_CFG_AGGREGATE"], _C["UW_CFG_EMIT_HITS"], _C["UW_CFG_MEMO"]
#: uw_config[CFG_MEMO] values: the per-thread memo of outer frames on (default), off, or on without
#: re-reading the reused slots (unsound: only for the test that shows the re-read matters)
MEMO_ON, MEMO_OFF, MEMO_UNCHECKED = _C["UW_MEMO_ON"], _C["UW_MEMO_OFF"], _C["UW_MEMO_UNCHECKED"]
MEMO_CHAIN_UNCHECKED, MEMO_RBP_UNCHECKED = _C["UW_MEMO_CHAIN_UNCHECKED"], _C["UW_MEMO_RBP_UNCHECKED"]
