"""Stack unwinding in BPF from CFI tables: the user call stack of tracked processes at each sampled
syscall (and CPU-clock sample), to any depth, without frame pointers.

Layout of the BPF maps (filled from :mod:`ccprofd.elf.cfi` tables):

* ``uw_rules``: array of distinct unwind rules (kind, rbp rule, offsets), shared by all modules;
* ``uw_entries``: one array holding every loaded module's rows, each ``(u32 vaddr, u32 rule)``,
  sorted per module; ``uw_modules[id] = (first row, row count)`` is the module's slice, searched by
  binary search with a bounded loop, narrowed first by ``uw_pages``, the module's two-level index
  (:func:`~ccprofd.tracing.unwind.tables.page_index`: per small bucket of vaddrs, the rows that
  can cover it), so a frame costs a step or two instead of ~17.  A module's rows are loaded once
  (keyed by build-id) and shared by every process that maps it;
* ``uw_procs[tgid]``: the process's executable mappings ``(start, end, bias, module id)``, sorted,
  from /proc/PID/maps; re-read when a pc falls outside them, after exec-permission mmap/mprotect
  calls (reported by BPF at the process's next syscall), and at exec.  A forked child inherits
  its parent's entry on its first sample.  The vDSO is one of these modules: its ELF image is read
  from the process's memory (it has no file), kept in the cache directory, and its ``.eh_frame``
  table is built and cached like a file's.

The frame loop runs in ``bpf_loop`` (depth = ``max_depth``, default 4,096).  bcc 0.26 cannot
relocate a ``bpf_loop`` callback, so this module loads those two programs itself: it takes bcc's
compiled instructions of the program and of its callback, points the callback's ``ld_imm64`` at the
appended callback (``BPF_PSEUDO_FUNC``) and loads them with BTF FUNC info through raw ``bpf(2)``.

Syscall samples reuse the outer frames of the same thread's previous complete chain (unwind.c,
``uw_memo_step``: a cached frame is taken only when its state equals the new frame's and every
stack slot its step read re-reads unchanged, under the same upload of the process's mappings,
``uw_proc.gen``), and a sample whose pcs equal the previous one's reuses its encoding;
:meth:`UnwindSampler.set_memo` switches this off for tests and benchmarks.

Output: :class:`UnwoundSample` (tgid, tid, syscall number, runtime pcs innermost first, complete
flag and reason).  With ``aggregate=True`` contexts are counted in the kernel under a 128-bit hash
of (pcs, tgid, syscall, completeness); the full pc list is stored once in an arena map and compared
on every hit, so a hash collision is counted and reported, never merged; only new contexts reach
userspace.  :meth:`UnwindSampler.symbolize` maps runtime pcs to (module, build-id, ELF vaddr).

With an ``encoding`` (:class:`ccprofd.tracing.unwind.plan.UnwindEncoding`, built from the analysed
binary's call graph and Valence plan) a second pass encodes each unwound stack in BPF (its
function lookups narrowed by the same kind of page index, ``ue_fpages``), outermost analysed frame
first, into the plan's ``acycID``/``recID``/segments (the state instrumented mode
would hold), plus the unanalysed frames (module key, vaddr) inside the context; aggregation then
keys on a 128-bit hash of that encoded context and the syscall number, the context itself is the
arena entry compared on every hit, and each new context reaches userspace as an
:class:`EncodedRecord`.  ``emit_hits`` also sends a small record (time, thread, key) per repeated
context, for per-sample output such as ``ccprofd trace``.

Processes started by ccprofd (``track(pid, launched=True)``, before their exec), and processes
that exec a binary followed with :meth:`UnwindSampler.follow_exec` (found by BPF at their exec, see
exec_target.c), are stopped with SIGSTOP by BPF at exec and at each new executable mapping until
:meth:`poll` has loaded their mappings, then continued: their samples are never taken with stale
mappings.  Every stop is recorded in the ``uw_held`` map, and every entry there is released: by
:meth:`poll`, by :meth:`close`, and, should this process die without closing (SIGKILL), by the hold
guard (:mod:`ccprofd.kbpf.holdguard`), a small process that outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccprofd.kbpf.attach import (
    attach_raw_tracepoint_fd,
    online_cpus,
    perf_event_open_cpu_clock,
    perf_event_set_bpf,
)
from ccprofd.kbpf.bpfmap import RawMap
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.objcache import cache_dir_under
from ccprofd.kbpf.rawmodule import load_module
from ccprofd.kbpf.syscall_entry import entry_plan, exit_event
from ccprofd.kbpf.syscalls import syscall_table
from ccprofd.kbpf.tracefs import tracefs_syscalls, tracepoint_field_offset, tracepoint_has_field
from ccprofd.persist.cache import AnalysisCache
from ccprofd.proc.maps import DEFAULT_PROC_ROOT
from ccprofd.tracing.api import RECORDS_PER_POLL
from ccprofd.tracing.history import configured_length, history_source
from ccprofd.tracing.syscall_sampler import (
    CFG_COMPAT_WATCH,
    CFG_SYSCALL_PATH,
    NR_SYSCALL_SLOTS,
    PATH_EVENTS,
    PATH_OFF,
    SYSCALL_NR_OFFSET,
    SYSCALL_RET_OFFSET,
    SamplerEvent,
    sampler_source,
)
from ccprofd.tracing.syscall_sampler import (
    KINDS as SAMPLER_KINDS,
)
from ccprofd.tracing.syscall_sampler import read_stats as read_sampler_stats
from ccprofd.tracing.unwind.constants import (
    ARG_LEN,
    C_SOURCE,
    CFG_AGGREGATE,
    CFG_EMIT_HITS,
    CFG_MEMO,
    EV_HIT,
    EV_MAPS,
    EXACT_BIT,
    FLAG_HIT,
    MEMO_CHAIN_UNCHECKED,
    MEMO_OFF,
    MEMO_ON,
    MEMO_RBP_UNCHECKED,
    MEMO_UNCHECKED,
    REASONS,
    STATS,
    UW_NR_MMAP,
    UW_NR_MPROTECT,
    UW_NR_PKEY_MPROTECT,
)
from ccprofd.tracing.unwind.plan import UnwindEncoding
from ccprofd.tracing.unwind.processes import ProcessTracker, ResolvedPc
from ccprofd.tracing.unwind.programs import ProgramLoader
from ccprofd.tracing.unwind.tables import (
    UE_ROW_REC,
    ModuleTables,
)

DEFAULT_MAX_DEPTH = 4096
# Smallest table buckets of the encoded program (see _program_defines).
MIN_FUNCS_BUCKET = 1024
MIN_EDGES_BUCKET = 4096

_SAMPLE_HDR = struct.Struct("<QIIIiIIIIQQII6Q")  # struct uw_sample up to arg (UW_SAMPLE_HDR_BYTES)
_HDR_SIZE = _SAMPLE_HDR.size
_KIND = struct.Struct("<I")
if EXACT_BIT != 1 << 63:  # the decoders below test it as the top bit (v >= EXACT_BIT)
    raise ImportError(f"UW_EXACT_BIT is {EXACT_BIT:#x}, expected bit 63")
_PC_MASK = (1 << 64) - 1 - EXACT_BIT
_WORDS: dict[int, struct.Struct] = {}


def _words(n: int) -> struct.Struct:
    """The precompiled Struct of ``n`` little-endian u64 words."""
    got = _WORDS.get(n)
    if got is None:
        got = _WORDS[n] = struct.Struct(f"<{n}Q")
    return got

_EV_RET = next(k for k, v in SAMPLER_KINDS.items() if v == "ret")


@dataclass(slots=True)
class UnwoundSample:
    """One unwound stack (not frozen: a frozen dataclass's __init__ costs a microsecond more per
    record, and a flood of repeated samples is decoded at hundreds of thousands a second).

    ``pcs``: runtime addresses, innermost first (the interrupted pc, then
    return addresses; after a signal frame, the interrupted pc of the frame below it).  ``syscall``
    is None for CPU samples.  ``key``: the 128-bit context hash (aggregated mode)."""

    time_ns: int
    tgid: int
    tid: int
    syscall: int | None
    pcs: tuple[int, ...]
    reason: str | None
    fp_frames: int
    flags: int
    key: tuple[int, int]
    exact: tuple[bool, ...] = ()  # per pc: exact (innermost, interrupted by a signal), not a return address
    encoded: EncodedRecord | None = None
    #: The syscall's path argument (open*, creat, exec*) read at its entry; None when it has none
    #: or it was not readable then (this sample's own, also for a repeated context).
    arg: str | None = None
    #: The six argument registers at syscall entry (rdi, rsi, rdx, r10, r8, r9); None for CPU samples.
    sargs: tuple[int, ...] | None = None

    @property
    def complete(self) -> bool:
        return self.reason is None

    @property
    def event(self) -> str:
        return "cpu" if self.syscall is None else "syscall"

    @classmethod
    def decode(cls, raw: bytes, layout: RecordLayout | None = None) -> UnwoundSample:
        t, kind, tgid, tid, nr, n, reason, fp, flags, h1, h2, arg_len, _, *ws = _SAMPLE_HDR.unpack_from(raw)
        regs = None if nr < 0 else tuple(ws)
        why = None if reason == 0 else REASONS.get(reason, f"reason_{reason}")
        arg = None
        if 0 < arg_len <= ARG_LEN:
            text = raw[_SAMPLE_HDR.size:_SAMPLE_HDR.size + arg_len].split(b"\0", 1)[0]
            arg = text.decode("utf-8", "surrogateescape")
        if kind == EV_HIT:
            return cls(t, tgid, tid, None if nr < 0 else nr, (), why, fp, flags | FLAG_HIT, (h1, h2), arg=arg,
                       sargs=regs)
        off = _SAMPLE_HDR.size + ARG_LEN
        enc = None
        if layout is not None:
            enc = layout.parse(raw, off)
            off += layout.size
        tagged = _words(n).unpack_from(raw, off)
        if max(tagged, default=0) < EXACT_BIT:  # no pc flagged exact: the words are the pcs
            pcs, exact = tagged, (False,) * n
        elif max(tagged[1:], default=0) < EXACT_BIT:  # only the innermost (a syscall's own pc)
            pcs, exact = (tagged[0] & _PC_MASK, *tagged[1:]), (True,) + (False,) * (n - 1)
        else:
            pcs = tuple(map(_PC_MASK.__and__, tagged))
            exact = tuple(map(bool, map(EXACT_BIT.__and__, tagged)))
        return cls(t, tgid, tid, None if nr < 0 else nr, pcs, why, fp, flags, (h1, h2), exact, enc, arg, regs)


#: A hit record (``EV_HIT``, complete, no path argument) as :meth:`UnwindSampler.take` returns it:
#: the fields of ``_SAMPLE_HDR`` -- [0] time, [2] tgid, [3] tid, [4] syscall nr (< 0: a CPU sample),
#: [7] fp frames, [8] flags, [9]/[10] the context key, [13:19] the argument registers.
HitHeader = tuple[int, ...]
HIT_TIME, HIT_TGID, HIT_TID, HIT_NR, HIT_FP, HIT_FLAGS = 0, 2, 3, 4, 7, 8
HIT_KEY1, HIT_KEY2, HIT_ARGS = 9, 10, 13


def hit_sample(v: HitHeader) -> UnwoundSample:
    """The :class:`UnwoundSample` of a :data:`HitHeader`."""
    nr = v[HIT_NR]
    return UnwoundSample(v[HIT_TIME], v[HIT_TGID], v[HIT_TID], None if nr < 0 else nr, (), None, v[HIT_FP],
                         v[HIT_FLAGS] | FLAG_HIT, (v[HIT_KEY1], v[HIT_KEY2]), (), None, None,
                         None if nr < 0 else v[HIT_ARGS:])


@dataclass(slots=True, unsafe_hash=True)  # immutable by use; a frozen __init__ costs 3x
class EncodedSegment:
    """One segment of an encoded context (dense node indices; ``caller`` NO_NODE: unknown)."""

    saved: tuple[int, ...]
    rec_height: int
    callee: int
    caller: int
    site: int  # call-site vaddr, -1 OUTSIDE
    ret: int  # the caller frame's return address (vaddr), 0 when its pc was not one


@dataclass(slots=True, unsafe_hash=True)  # immutable by use; a frozen __init__ costs 3x
class UnanalysedFrame:
    """A frame outside the analysed binary (or outside its functions) inside the context."""

    after: int  # index of the analysed frame (outermost = 0) it lies below
    module_key: int
    vaddr: int
    exact: bool


@dataclass(slots=True, unsafe_hash=True)  # immutable by use; a frozen __init__ costs 3x
class EncodedRecord:
    """The context BPF encoded for one stack (struct ue_rec), dense node indices."""

    node: int  # innermost analysed frame, NO_NODE: none
    flags: int
    inner: int  # vaddr of the innermost analysed frame's pc
    nframes: int
    acyc: tuple[int, ...]
    rec: int
    rec_len: int
    segments: tuple[EncodedSegment, ...]
    unanalysed: tuple[UnanalysedFrame, ...]


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """Sizes of struct ue_rec (they follow the compile-time parameters)."""

    acyc_words: int
    max_segs: int
    rec_words: int
    max_unan: int

    @property
    def seg_words(self) -> int:
        return self.acyc_words + 4

    @property
    def hdr_words(self) -> int:
        return 4 + self.acyc_words

    @property
    def total_words(self) -> int:
        return self.hdr_words + self.max_segs * self.seg_words + self.rec_words + 2 * self.max_unan

    @property
    def size(self) -> int:
        return 8 * self.total_words

    def parse(self, raw: bytes, off: int) -> EncodedRecord:
        w = self.acyc_words
        words = _words(w)
        node, flags, rec_len, nsegs, inner, nunan, nframes = _REC_HDR.unpack_from(raw, off)
        acyc = words.unpack_from(raw, off + 32)
        segs = []
        base = off + 8 * self.hdr_words
        seg_bytes = 8 * self.seg_words
        for i in range(min(nsegs, self.max_segs)):
            p = base + seg_bytes * i
            saved = words.unpack_from(raw, p)
            rh, callee, caller, _pad, site, ret = _SEG_TAIL.unpack_from(raw, p + 8 * w)
            segs.append(EncodedSegment(saved, rh, callee, caller, site, ret))
        rbase = base + seg_bytes * self.max_segs
        nwords = min((rec_len + 63) // 64, self.rec_words)
        rec = 0
        if nwords:
            for i, word in enumerate(_words(nwords).unpack_from(raw, rbase)):
                rec |= word << (64 * i)
            rec &= (1 << rec_len) - 1
        ubase = rbase + 8 * self.rec_words
        unan = []
        if nunan:
            flat = _words(2 * min(nunan, self.max_unan)).unpack_from(raw, ubase)
            for i in range(0, len(flat), 2):
                a, v = flat[i], flat[i + 1]
                unan.append(UnanalysedFrame(a & 0xFFFFFFFF, (a >> 32) & 0xFFFF, v & _PC_MASK,
                                            v >= EXACT_BIT))
        return EncodedRecord(node, flags, inner, nframes, acyc, rec, rec_len, tuple(segs), tuple(unan))


_REC_HDR = struct.Struct("<IIIIQII")  # struct ue_rec's header
_SEG_TAIL = struct.Struct("<IIIIqQ")  # a segment after its saved acycID words

# The compiled record decoder (chits.c, built by scripts/build_ext.sh at set-up): UnwoundSample.decode
# of a whole record into the same objects, or None for what it leaves to Python (hits, short records,
# unknown reasons, multi-word recIDs).  CCPROFD_PURE_PYTHON=1 leaves it out.
try:
    if os.environ.get("CCPROFD_PURE_PYTHON"):
        raise ImportError("CCPROFD_PURE_PYTHON is set")
    from ccprofd.tracing.unwind import chits  # type: ignore[attr-defined, unused-ignore]

    if _SAMPLE_HDR.size != 112:
        raise ImportError("chits.c reads another sample header than sampler.py's")  # rebuild it
    chits.prepare_records(
        UnwoundSample, EncodedRecord, EncodedSegment, UnanalysedFrame,
        ("time_ns", "tgid", "tid", "syscall", "pcs", "reason", "fp_frames", "flags", "key", "exact",
         "encoded", "arg", "sargs"),
        ("node", "flags", "inner", "nframes", "acyc", "rec", "rec_len", "segments", "unanalysed"),
        ("saved", "rec_height", "callee", "caller", "site", "ret"),
        ("after", "module_key", "vaddr", "exact"))
except ImportError:
    chits = None


def decode_record(raw: bytes, layout: RecordLayout | None) -> UnwoundSample:
    """:meth:`UnwoundSample.decode`, compiled when chits.c is built and takes the record."""
    if chits is not None and layout is not None:
        words = (layout.acyc_words, layout.max_segs, layout.rec_words, layout.max_unan)
        got: UnwoundSample | None = chits.decode_record(raw, EV_HIT, ARG_LEN, words, REASONS)
        if got is not None:
            return got
    return UnwoundSample.decode(raw, layout)


def _log2_ceil(n: int) -> int:
    return max(1, (n - 1).bit_length())


def unwind_source() -> str:
    return Path(__file__).with_name(C_SOURCE).read_text(encoding="utf-8")




def _map_memory_bytes(module: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in ("uw_entries", "uw_pages", "uw_procs", "uw_counts", "uw_rules", "uw_modules"):
        m = module.map(name)
        out[name] = m.max_entries * (ctypes.sizeof(m.leaf_type) + ctypes.sizeof(m.key_type))
    state = module.map("uw_state")
    out["uw_state"] = state.max_entries * ctypes.sizeof(state.leaf_type)
    out["uw_arena"] = module.map("uw_arena").max_entries * 8
    return out


def memo_setting(mode: str) -> int:
    """``uw_config[UW_CFG_MEMO]`` for ``mode``: ``"on"`` (the default), ``"off"`` (every frame
    unwound afresh: the reference for tests and benchmarks), ``"unchecked"`` (reuse without
    re-reading the reused stack slots: unsound, only for the test that shows the re-read is what
    makes the memo correct), ``"chain unchecked"`` (whole chains reused without the re-read, frame by
    frame reuse still checked: unsound, for the test of uw_memo_chain's re-read), ``"rbp unchecked"``
    (whole chains reused without re-reading saved rbp slots, even those a later step used: unsound,
    for the test that shows which rbp slots uw_memo_chain must re-read)."""
    modes = {"on": MEMO_ON, "off": MEMO_OFF, "unchecked": MEMO_UNCHECKED,
             "chain unchecked": MEMO_CHAIN_UNCHECKED, "rbp unchecked": MEMO_RBP_UNCHECKED}
    if mode not in modes:
        raise ValueError(f"memo mode {mode!r}: one of {', '.join(modes)}")
    return modes[mode]


#: syscalls the unwinder always looks at (unwind.c's uw_watch_maps: mmap, mprotect, pkey_mprotect
#: with PROT_EXEC), attached on the per-syscall path even when not sampled
MAPS_WATCHED = (UW_NR_MMAP, UW_NR_MPROTECT, UW_NR_PKEY_MPROTECT)


class UnwindSampler:
    """Unwind the user stacks of tracked processes at selected syscalls.

    ``track(pid)`` loads the unwind tables of every module the process maps (cached by build-id)
    and starts sampling it and the children it forks; ``poll()`` returns :class:`UnwoundSample`s.
    The parts: :class:`~ccprofd.tracing.unwind.tables.ModuleTables` (unwind tables and the
    encoding in the maps), :class:`~ccprofd.tracing.unwind.processes.ProcessTracker` (processes
    and their mappings), :class:`~ccprofd.tracing.unwind.programs.ProgramLoader` (the unwinders'
    verifier loads); this class owns the BPF module and its attachments and ties them together.
    Why this class is long: it is the one owner of the module and of every attachment (process
    tracepoints, the syscall program on raw_syscalls or on per-syscall events, CPU sampling), which
    are made and closed in an order that matters; splitting it would spread that order over classes.
    """

    def __init__(
        self,
        *,
        syscalls: list[int] | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        aggregate: bool = False,
        max_procs: int = 256,
        max_maps: int = 256,
        max_entries: int = 1 << 20,
        max_modules: int = 1024,
        max_rules: int = 4096,
        max_contexts: int = 1 << 16,
        arena_words: int = 1 << 21,
        ringbuf_pages: int = 4096,  # 16 MB: a 100k-syscall burst of one context fits (120-byte hits)
        events_ringbuf_pages: int = 16,  # the shared sampler's ring: process events (and --retval's returns)
        cache: AnalysisCache | None = None,
        proc_root: str = DEFAULT_PROC_ROOT,
        encoding: UnwindEncoding | None = None,
        max_segments: int = 64,
        max_unanalysed: int = 128,
        emit_hits: bool = False,
        load_early: bool = False, enforce_keys: int = 0,  # enforce_keys: UW_ENFORCE, see enforcement.py
        history: int | None = None,  # flight recorder events per thread (history.configured_length)
        entry_attach: bool = True,  # a small set on its syscalls:sys_enter_* events (kbpf/syscall_entry.py)
        compat_watch: bool = False,  # also sample every ia32 syscall (kbpf/syscall_entry.py, compat watch)
    ) -> None:
        if max_depth < 1 or max_depth & (max_depth - 1):
            raise BPFError(f"max_depth must be a power of two, not {max_depth}")
        if max_maps < 2 or max_maps & (max_maps - 1):
            raise BPFError(f"max_maps must be a power of two, not {max_maps}")
        self.encoding = encoding
        self.layout: RecordLayout | None = None
        if encoding is not None:
            for name, v in (("max_segments", max_segments), ("max_unanalysed", max_unanalysed)):
                if v < 1 or v & (v - 1):
                    raise BPFError(f"{name} must be a power of two, not {v}")
            rec_words = _pow2_at_least(max_depth * encoding.rec_code_bits // 64 + 2)
            self.layout = RecordLayout(encoding.acyc_words, max_segments, rec_words, max_unanalysed)
        record = _SAMPLE_HDR.size + ARG_LEN + (self.layout.size if self.layout else 0) + max_depth * 8
        if ringbuf_pages * 4096 < 2 * record:
            raise BPFError("ring buffer too small for one sample at max_depth")
        self.max_depth = max_depth
        self.proc_root = proc_root
        self.cache = cache if cache is not None else AnalysisCache()
        defines, loops = _program_defines(
            max_depth=max_depth, max_maps=max_maps, max_procs=max_procs, max_entries=max_entries,
            max_modules=max_modules, max_rules=max_rules, max_contexts=max_contexts, arena_words=arena_words,
            ringbuf_pages=ringbuf_pages, encoding=encoding, layout=self.layout,
            events_ringbuf_pages=events_ringbuf_pages, enforce_keys=enforce_keys, history=history)
        bpf_cache = cache_dir_under(self.cache.directory) if cache is not None else None
        self.module = load_module(defines + sampler_source(self.cache.directory) + "\n" + unwind_source(),
                                  cache_dir=bpf_cache)
        self.programs = ProgramLoader(self.module, loops)
        self._links: list[int] = []
        self._perf_fds: list[int] = []
        self._attached = False
        self._pending: list[UnwoundSample | HitHeader] = []
        self.malformed = 0  # records too short for their kind (never expected; counted, not decoded)
        self.fp_frames = 0  # frames the samples received so far recovered by frame pointer
        self._m: dict[str, RawMap] = {name: self.module.map(name) for name in (
            "tracked", "syscall_set", "config", "uw_procs", "uw_counts", "uw_config", "uw_stats",
            "uw_stop", "uw_held", "exec_targets")}
        self.tables = ModuleTables(self.module, self.cache, proc_root=proc_root, encoding=encoding,
                                   max_modules=max_modules, max_entries=max_entries, max_rules=max_rules)
        self.processes = ProcessTracker(self._m, self.tables, proc_root=proc_root, max_maps=max_maps)
        self.module.open_ring_buffer("uw_events", self.deliver)
        self.returns: list[SamplerEvent] = []  # "ret" events (attach_returns), taken by the mode
        self.module.open_ring_buffer("events", self._on_sampler_event)
        self._m["uw_config"].set(CFG_AGGREGATE, 1 if aggregate else 0)
        self._m["uw_config"].set(CFG_EMIT_HITS, 1 if emit_hits else 0)
        # The syscalls attached one by one (None: raw_syscalls:sys_enter): the sampled ones and
        # mmap/mprotect/pkey_mprotect, whose PROT_EXEC calls uw_watch_maps must see.
        self.entry_plan = entry_plan(syscalls, extra=MAPS_WATCHED, nr_offset=SYSCALL_NR_OFFSET,
                                     ret_offset=SYSCALL_RET_OFFSET) if entry_attach else None
        self._sys_fd = -1  # the syscall program's fd once attached
        self.compat_watch = compat_watch
        self._m["config"].set(CFG_COMPAT_WATCH, 1 if compat_watch else 0)
        if load_early:  # the verifier runs while the maps are filled and the modules loaded
            self.programs.start("uw_sys_enter" if self.entry_plan is None else "uw_sys_tp")
            if self.entry_plan is not None and compat_watch:
                self.programs.start("uw_sys_enter")
        if encoding is not None:
            try:
                self.tables.upload_encoding(encoding)
            except BaseException:
                self.programs.close()
                raise
        self.aggregate = aggregate
        self.set_syscalls(syscalls)

    # ---------------------------------------------------------------------------- configuration
    def set_syscalls(self, syscalls: list[int] | None) -> None:
        """Sample these syscall numbers (None: all)."""
        if syscalls is None:
            self._m["config"].set(0, 1)
            return
        nrs = sorted(set(syscalls))
        bad = [n for n in nrs if not 0 <= n < NR_SYSCALL_SLOTS]
        if bad:
            raise BPFError(f"syscall number out of range: {bad[0]}")
        self._m["config"].set(0, 0)
        self._m["syscall_set"].clear()
        self._m["syscall_set"].update_many([(n, 1) for n in nrs])

    def attach(self) -> None:
        """Attach process tracking (fork/exec/exit) first, then the syscall unwinder."""
        if self._attached:
            return
        for tp, fn in (("sched:sched_process_fork", "uw_fork"), ("sched:sched_process_fork", "ccprof_fork"),
                       ("sched:sched_process_exec", "uw_exec"), ("sched:sched_process_exec", "ccprof_exec"),
                       ("sched:sched_process_exit", "uw_exit"), ("sched:sched_process_exit", "ccprof_exit")):
            self.module.attach_tracepoint(tp, fn)
        if self.entry_plan is None:
            self._sys_fd = self.programs.load("uw_sys_enter")
            self._links.append(attach_raw_tracepoint_fd(self._sys_fd, "sys_enter"))
        else:
            self._sys_fd = self.programs.load("uw_sys_tp")
            self._m["config"].set(CFG_SYSCALL_PATH, PATH_EVENTS)  # ccprof_sys_exit_tp's, for returns
            for event in self.entry_plan.values():
                self.module.attach_tracepoint_prog(event, self._sys_fd)
            if self.compat_watch:
                # the events leave ia32 calls out: uw_sys_enter on raw_syscalls takes only those
                # (with the path set to the events, it returns for every other call)
                self._links.append(attach_raw_tracepoint_fd(self.programs.load("uw_sys_enter"), "sys_enter"))
        self._attach_maps_exits()
        self._attached = True

    def _attach_maps_exits(self) -> None:
        """uw_maps_exit on the returns of the calls that may map code, whatever the entry path (a
        kernel without their exit events falls back to the next syscall, uw_watch_maps)."""
        known = tracefs_syscalls() or frozenset()
        table = syscall_table()
        for nr in MAPS_WATCHED:
            if table.get(nr) in known:
                self.module.attach_tracepoint(f"syscalls:sys_exit_{table[nr]}", "uw_maps_exit_tp")
        if self.compat_watch:  # the ia32 ones, which the exit events leave out
            self.module.attach_raw_tracepoint("sys_exit", "uw_maps_exit_raw")

    def syscall_program_fd(self) -> int:
        """The program that runs at syscall entry (on raw_syscalls:sys_enter, or on the per-syscall
        events), -1 before :meth:`attach`: its run count is how many syscalls paid for the sampler."""
        return self._sys_fd

    def attach_returns(self) -> None:
        """Report each sampled syscall's return too (the shared sampler's sys_exit program, or its
        per-syscall exit events' program)."""
        if self.entry_plan is None:
            self.module.attach_raw_tracepoint("sys_exit", "ccprof_sys_exit")
            return
        for event in self.entry_plan.values():
            self.module.attach_tracepoint(exit_event(event), "ccprof_sys_exit_tp")
        if self.compat_watch:  # the exit events leave ia32 calls out too
            self.module.attach_raw_tracepoint("sys_exit", "ccprof_sys_exit")

    def _on_sampler_event(self, raw: bytes) -> None:
        if _KIND.unpack_from(raw, 8)[0] == _EV_RET:
            self.returns.append(SamplerEvent.decode(raw))
        else:
            self.processes.on_event(raw)

    def verified_insns(self) -> dict[str, int]:
        """Instructions the verifier processed for the syscall and CPU-sampling unwinders (loaded,
        not attached; :meth:`close` closes them): how far their loads are from the kernel's limit."""
        return self.programs.verified_insns()

    def attach_cpu_sampling(self, hz: int) -> None:
        """CPU-clock samples of every tracked process (all threads, children included) at ``hz``:
        one software perf event per CPU runs the unwinder, which keeps only tracked processes."""
        if hz <= 0:
            raise BPFError(f"sampling frequency must be positive, not {hz}")
        fd = self.programs.load("uw_cpu_sample")
        for cpu in online_cpus():
            pfd = perf_event_open_cpu_clock(cpu, hz)
            self._perf_fds.append(pfd)
            perf_event_set_bpf(pfd, fd)

    # ------------------------------------------------------------ processes (ProcessTracker)
    def track(self, tgid: int, *, launched: bool = False) -> None:
        self.processes.track(tgid, launched=launched)

    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None:
        self.processes.follow_exec(inode, cgroup_id)

    def unfollow_exec(self, inode: tuple[int, int]) -> None:
        self.processes.unfollow_exec(inode)

    @property
    def new_processes(self) -> list[int]:
        """Processes found at their exec of a followed file (the caller empties the list)."""
        return self.processes.new_processes

    @new_processes.setter
    def new_processes(self, value: list[int]) -> None:
        self.processes.new_processes = value

    @property
    def process_events(self) -> list[SamplerEvent]:
        return self.processes.events

    def preload(self, path: str) -> bool:
        """Load (and upload) the unwind table of an object a process will map, ahead of time, so
        the stop at its exec or dlopen is short; False when it is not a usable ELF file."""
        return self.tables.addrspace_of(path) is not None

    def forget(self, tgid: int) -> None:
        self.processes.forget(tgid)

    def untrack(self, tgid: int) -> None:
        self.processes.untrack(tgid)

    def refresh_maps(self, tgid: int) -> bool:
        return self.processes.refresh_maps(tgid)

    def symbolize(self, tgid: int, pc: int) -> ResolvedPc | None:
        return self.processes.symbolize(tgid, pc)

    def resolve(self, tgid: int, pc: int, time_ns: int | None = None) -> tuple[int, bool, int] | None:
        return self.processes.resolve(tgid, pc, time_ns)

    def module_of_key(self, key: int) -> tuple[str, str | None, str] | None:
        return self.tables.module_of_key(key)

    # ---------------------------------------------------------------------------------- samples
    def deliver(self, raw: bytes) -> None:
        """Take one ``uw_events`` record (the ring buffer's callback; bench/trace_throughput.py
        replays captured records through it to time decoding apart from the kernel side)."""
        if len(raw) == _HDR_SIZE:  # a flood's record (a repeated context): header only
            v = _SAMPLE_HDR.unpack_from(raw)
            if v[1] == EV_HIT and v[6] == 0:  # complete, no argument: kept as its header's fields
                self._pending.append(v)
                if v[7]:
                    self.fp_frames += v[7]
                return
        kind = _KIND.unpack_from(raw, 8)[0]
        if kind == EV_MAPS:
            self.processes.stale.add(_KIND.unpack_from(raw, 12)[0])
            return
        try:
            sample = decode_record(raw, self.layout)
        except struct.error:  # shorter than its kind says: counted (stats "malformed"), never decoded
            self.malformed += 1
            return
        if sample.reason is not None and sample.reason in ("unknown_pc", "no_maps"):
            self.processes.stale.add(sample.tgid)
        self._pending.append(sample)
        self.fp_frames += sample.fp_frames

    def poll(self, timeout_ms: int = 0) -> list[UnwoundSample]:
        """Samples that arrived since the last call (waits up to ``timeout_ms`` when there are none).
        Processes whose mappings changed are re-read here."""
        return [hit_sample(r) if isinstance(r, tuple) else r for r in self.take(timeout_ms)]

    def take(self, timeout_ms: int = 0) -> list[UnwoundSample | HitHeader]:
        """:meth:`poll`, with each complete, argument-less hit left as its :data:`HitHeader` (the
        unpacked header: no object is made for the bulk of a flood of repeated samples)."""
        if not self.module.ring_buffer_consume(RECORDS_PER_POLL) and timeout_ms != 0:
            self.module.ring_buffer_poll(timeout_ms, RECORDS_PER_POLL)
        # The process events again, with their own budget: a full budget of samples leaves them
        # unread, and a fork's child's samples would then be decoded before the fork that gives it
        # its parent's mappings (--verify's re-encoding, a path argument read from the file).
        # Every event written before a sample taken above is in the ring by now.
        self.module.ring_buffer_consume(RECORDS_PER_POLL, rings=("events",))
        self.processes.refresh_stale()
        out, self._pending = self._pending, []
        return out

    def counts(self) -> dict[tuple[int, int], int]:
        """Aggregated mode: samples per context key."""
        return {(int(k.h1), int(k.h2)): int(v.count) for k, v in self._m["uw_counts"].items_batch()}

    def set_emit_hits(self, on: bool) -> None:
        """Runtime switch (``uw_config[UW_CFG_EMIT_HITS]``): send a header record per repeated
        context (every sample reaches userspace) or only new contexts (the kernel's per-context
        counts, read with :meth:`counts`, are then the only record of repeated samples).  The
        kernel count is incremented whether or not the record is sent."""
        self._m["uw_config"].set(CFG_EMIT_HITS, 1 if on else 0)

    def set_memo(self, mode: str) -> None:
        """Runtime switch of the per-thread memo of outer frames: see :func:`memo_setting`."""
        self._m["uw_config"].set(CFG_MEMO, memo_setting(mode))

    # ------------------------------------------------------------------------------- reporting
    def stats(self) -> dict[str, int]:
        out = {name: int(self._m["uw_stats"].get(i) or 0) for i, name in enumerate(STATS)}
        # the shared syscall sampler's, as instrumented mode reports them
        out.update({f"sampler_{name}": n for name, n in read_sampler_stats(self.module.map("stats")).items()})
        out["exec_mismatches"] = self.processes.exec_mismatches
        out["malformed"] = self.malformed
        out["refresh_failures"] = self.processes.refresh_failures
        return out

    def drops(self) -> dict[str, int]:
        """What the kernel side could not do, by reason (api.DROPS): samples the ring refused, and
        the syscall sampler's own losses (processes not followed, process events lost)."""
        sampler = read_sampler_stats(self.module.map("stats"))
        uw = self._m["uw_stats"]
        return {"ringbuf_full": int(uw.get(STATS.index("ringbuf_full")) or 0),
                "maps_ringbuf_full": int(uw.get(STATS.index("maps_lost")) or 0),
                "tracked_full": sampler["tracked_full"], "events_ringbuf_full": sampler["ringbuf_full"]}

    def table_rows(self) -> int:
        return self.tables.next_entry

    def map_memory_bytes(self) -> dict[str, int]:
        """Allocated size of the big maps (preallocated arrays/hashes), for the memory report."""
        return _map_memory_bytes(self.module)

    def detach(self) -> None:
        """Stop sampling: no new holds at exec, no syscall or CPU samples; the rings and tables stay
        until :meth:`close`, so what was recorded can still be read and decoded."""
        with contextlib.suppress(BPFError):
            self._m["exec_targets"].clear()
        # No more holds at exec either: the sched tracepoints may be closed in the background
        # (rawmodule.BACKGROUND_TRACEPOINT_CLOSE) and uw_exec runs until then.
        with contextlib.suppress(BPFError):
            self._m["uw_stop"].clear()
        with contextlib.suppress(BPFError):  # no sample from here on, before the events' background close
            self._m["config"].set(CFG_SYSCALL_PATH, PATH_OFF)
        for fd in self._perf_fds + self._links:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._links.clear()
        self._perf_fds.clear()
        self.module.detach()

    def close(self) -> None:
        self.processes.continue_launched()
        self.programs.join()
        self.detach()
        self.programs.close()
        self.processes.release_all()
        self.module.cleanup()
        self.tables.close()
        self.processes.close_guard()

    def __enter__(self) -> UnwindSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _program_defines(*, max_depth: int, max_maps: int, max_procs: int, max_entries: int,
                     max_modules: int, max_rules: int, max_contexts: int, arena_words: int,
                     ringbuf_pages: int, encoding: UnwindEncoding | None, layout: RecordLayout | None,
                     events_ringbuf_pages: int = 16, enforce_keys: int = 0,
                     history: int | None = None) -> tuple[str, dict[str, int]]:
    """The ``#define`` prelude of unwind.c for these limits (and encoding), and the bpf_loop
    iteration counts by loop name (they pick each loop's callback when the program is linked)."""
    ncpu = os.cpu_count() or 1
    try:
        with open("/sys/devices/system/cpu/possible") as fh:
            ncpu = max(ncpu, _count_cpus(fh.read()))
    except OSError:
        pass
    defines = {
        # the tracked table also holds every live thread of a tracked process (a tid each): a
        # 300-thread server filled 256 entries, and a process forked then was not followed
        "MAX_TRACKED": max(8192, max_procs), "RINGBUF_PAGES": events_ringbuf_pages, "UW_MAX_DEPTH": max_depth,
        "UW_MAX_MAPS": max_maps,
        "UW_MAPS_LOG2": _log2_ceil(max_maps), "UW_MAX_PROCS": max_procs, "UW_MAX_ENTRIES": max_entries,
        "UW_MAX_PAGES": max_entries + max_modules, "UW_ENTRIES_LOG2": _log2_ceil(max_entries),
        "UW_MAX_MODULES": max_modules,
        "UW_MAX_RULES": max_rules, "UW_NSLOTS": 2 * ncpu, "UW_ARENA_WORDS": arena_words,
        "UW_MAX_CONTEXTS": max_contexts, "UW_RINGBUF_PAGES": ringbuf_pages,
    }
    loops = {"unwind": max_depth + 1, "arena": max_depth}
    if encoding is not None and layout is not None:
        # Table sizes in buckets (powers of two, at least those of a small program), not each
        # target's own counts: every small target with the same encoding widths then has the same
        # program text, so one compiled object serves them all (and set-up can build it ahead:
        # kbpf/objcache.prebuilt_dir).  BPF bounds its lookups by the loaded counts (ue_config).
        nfuncs = _pow2_at_least(max(MIN_FUNCS_BUCKET, len(encoding.functions)))
        loops = {"unwind": max_depth + 1, "enc": max_depth + 2,
                 "hash": layout.total_words + max_depth + 3, "arena": layout.total_words + max_depth + 4}
        defines.update({
            "UE_ENABLED": 1, "UE_ACYC_WORDS": layout.acyc_words, "UE_REC_BITS": encoding.rec_code_bits,
            "UE_REC_WORDS": layout.rec_words, "UE_MAX_SEGS": layout.max_segs, "UE_MAX_UNAN": layout.max_unan,
            "UE_MAX_FUNCS": nfuncs, "UE_FUNCS_LOG2": _log2_ceil(nfuncs), "UE_MAX_FPAGES": nfuncs + 1,
            "UE_MAX_EDGES": _pow2_at_least(max(MIN_EDGES_BUCKET, len(encoding.edges))),
            "UE_MAX_SITES": _pow2_at_least(max(MIN_EDGES_BUCKET, len(encoding.callsites))),
            "UE_ROW_REC": UE_ROW_REC, "UE_ENC_LOOPS": loops["enc"], "UE_HASH_LOOPS": loops["hash"]})
    defines["UW_ARENA_LOOPS"] = loops["arena"]
    if enforce_keys and encoding is None:
        raise BPFError("enforcement from the unwinder needs the encoding (the binary's analysed frames)")
    if enforce_keys:
        # enforcement (unwind.c, UW_ENFORCE): its own loop over the pcs; a count no other loop has
        loops["enf"] = max_depth + 3
        defines.update({"UW_ENFORCE": 1, "UW_ENF_LOOPS": loops["enf"],
                        "UW_ENF_MAX_KEYS": _pow2_at_least(max(1024, enforce_keys))})
    if len(set(loops.values())) != len(loops):
        raise BPFError(f"bpf_loop counts must differ (they pick the callbacks): {loops}")
    # the flight recorder (tracing/history.c): uw_sample calls its ccprof_history_put
    text = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    text += history_source(configured_length(history))
    if tracepoint_has_field("sched", "sched_process_exit", "group_dead"):
        text += "#define HAVE_GROUP_DEAD 1\n"
        off = tracepoint_field_offset("sched", "sched_process_exit", "group_dead")
        text += f"#define UW_EXIT_GROUP_DEAD_OFF {off}\n"
    off = tracepoint_field_offset("sched", "sched_process_fork", "child_pid")
    text += f"#define UW_FORK_CHILD_PID_OFF {off}\n"
    return text, loops


def _count_cpus(text: str) -> int:
    """Number of CPUs in a kernel cpu list such as ``0-3,8``."""
    n = 0
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
