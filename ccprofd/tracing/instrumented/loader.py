"""Instrumented mode's BPF side: load ``instrumented.c`` for a probe plan, attach it, drain samples.

The C program (see its header comment for the per-thread state and the no-return-probe rule) is
compiled as the prelude of the syscall sampler, which contributes tracked-process filtering, fork
following and the syscall ring buffer; each syscall event carries the thread's encoded context
(:class:`RawContext`).  Per-site data (bit masks, recID codes, CFA rules, reasons) goes into array
maps indexed by the uprobe_multi attach cookie, so the compiled code does not depend on the target
binary's size.

Plans of the Valence (``acyc_op`` "set"), HCCE and PCCE ("add") schemes are supported; the scheme
is a compile-time choice of the C code (:class:`SchemeParams`), the per-site codes are map data.
PCCE's back-edge pairs share recID's bit string (one fixed-width record per pair) and are turned
back into :attr:`RawContext.pairs` here, so the plan's own decoder reads every sample.
"""

from __future__ import annotations

import ctypes
import os
import struct
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ccprofd.encode.plan import COL
from ccprofd.kbpf.btf import BTFError, sigaltstack_offsets
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.rawbpf import map_update_batch
from ccprofd.kbpf.rawmodule import RawModule
from ccprofd.kbpf.tracefs import tracepoint_field_offset
from ccprofd.kbpf.uprobe_multi import UprobeMultiLink, attach_uprobe_multi
from ccprofd.proc.tasks import threads_of
from ccprofd.tracing.history import configured_length, history_source
from ccprofd.tracing.instrumented.constants import (
    AGG_HIT,
    AGG_NEW,
    AGG_NONE,
    AGG_UNAGGREGATED,
    ARG_LEN,
    C_SOURCE,
    CFG_AGGREGATE,
    CFG_EMIT_HITS,
    CFG_LAUNCH_TGID,
    CFG_LAUNCHED,
    CFG_TEXT_HI,
    CFG_TEXT_LO,
    EXIT_KINDS,
    F_ACYC,
    F_CUT,
    F_CYCLIC,
    F_EXIT,
    F_OVERFLOW,
    INCOMPLETE_FLAGS,
    K_CALL,
    K_EXIT,
    K_ROOT,
    K_SEG,
    K_TAIL,
    K_TAILEXIT,
    NONE32,
    SF_OVERFLOW,
    SF_REC_TRUNC,
    ST_INCOMPLETE_BASE,
)
from ccprofd.tracing.instrumented.probeplan import CCOL, PCOL, R_CUT, R_CYCLIC, R_PLT_EXIT, R_SCOPE, ProbePlan
from ccprofd.tracing.instrumented.sitetables import dense_nodes, ret_table
from ccprofd.tracing.syscall_sampler import SamplerEvent, SyscallSampler, monotonic_to_realtime_ns

STATS = ("site_hits", "tail_hits", "entry_hits", "samples", "pushes", "cuts", "frozen", "no_slot",
         "read_failures", "fork_copies", "ret_dead", "ringbuf_full", "overflows", "agg_new", "counts_full",
         "agg_too_big", "scope_lost")
SCHEMES = ("valence", "pcce", "hcce")
PROGRAMS = {"site": "cc_site_probe", "tail": "cc_tail_probe", "entry": "cc_entry_probe"}



def _program_text(history: int | None = None) -> str:
    """The flight recorder (tracing/history.c: cc_emit calls its ccprof_history_put; ``history``
    events per thread, see history.configured_length), then instrumented.c."""
    own = Path(__file__).with_name(C_SOURCE).read_text(encoding="utf-8")
    return history_source(configured_length(history)) + own


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds of BPF-side memory; past them a sample says ``complete: false``.

    ``max_pieces``: probe events kept per thread at most (about one per probed frame on the stack;
    a recursion deeper than this is reported incomplete).  ``max_segments``: nested entries from
    outside code.  ``emit_segments``/``rec_emit_words``: what one sample carries.  ``slots``:
    threads with per-thread state at once (a thread past them is traced without it, its samples
    flagged ``no per-thread state``; ``CCPROFD_THREADS``).  ``state_memory``: bytes all slots
    may take together: the pieces per thread are ``max_pieces`` halved until the slots fit in it
    (a state is ~48 bytes a piece: 512 threads of 8192 pieces take 194 MiB; 64 slots used to be the
    limit, and a 65th thread failed the whole trace).
    """

    max_pieces: int = 8192
    max_segments: int = 64
    emit_segments: int = 64
    rec_emit_words: int = 1024
    slots: int = 512
    state_memory: int = 256 << 20
    ringbuf_pages: int = 4096  # 16 MB: a 100k-syscall burst of one context fits (112-byte hit records)
    #: the shared sampler's ring: process events, and with --retval a return record per syscall
    #: (64 bytes each: 2048 pages hold a 100k-syscall burst)
    sampler_ring: int = 64
    #: --scope: stack pages copied at each scope entry for the unwind of the prefix above it
    scope_pages: int = 8
    #: aggregate mode: contexts counted in the kernel (then new ones are sent one sample at a
    #: time), and the largest state a key holds (segments, recID words; both powers of two)
    agg_contexts: int = 16384
    agg_segments: int = 8
    agg_rec_words: int = 16

    def check(self) -> None:
        for name in ("max_pieces", "max_segments", "ringbuf_pages", "sampler_ring", "agg_segments",
                     "agg_rec_words"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise BPFError(f"{name} must be a power of two, not {v}")
        if not 1 <= self.emit_segments <= self.max_segments:
            raise BPFError("emit_segments must be between 1 and max_segments")
        if self.slots < 1 or self.rec_emit_words < 1 or self.agg_contexts < 1:
            raise BPFError("slots, rec_emit_words and agg_contexts must be positive")


#: Fewest pieces a thread's state is given when fitting ``Limits.slots`` into ``state_memory``.
MIN_PIECES = 256


def state_size(acyc_words: int, rec_bits: int, max_pieces: int, max_segments: int) -> tuple[int, int]:
    """``(bytes of struct cc_state, its recID words)`` for these parameters."""
    rec_words = _pow2_at_least(max(1, (max_pieces * rec_bits + 127) // 64))
    piece = 40 + 8 * acyc_words  # struct cc_piece
    header = 48 + 8 * acyc_words + 4 * max_segments
    return (header + 7) // 8 * 8 + 8 * rec_words + piece * max_pieces, rec_words


def fit_pieces(limits: Limits, acyc_words: int, rec_bits: int) -> int:
    """``limits.max_pieces``, halved until ``limits.slots`` states fit in ``limits.state_memory``
    (BPFError when not even :data:`MIN_PIECES` do: ask for fewer threads)."""
    pieces = limits.max_pieces
    while limits.slots * state_size(acyc_words, rec_bits, pieces, limits.max_segments)[0] > \
            limits.state_memory:
        if pieces <= MIN_PIECES:
            raise BPFError(f"{limits.slots} per-thread states do not fit in {limits.state_memory >> 20} MB "
                           f"even at {MIN_PIECES} pieces each: trace fewer threads (CCPROFD_THREADS)")
        pieces //= 2
    return pieces


@dataclass(frozen=True, slots=True)
class RawSegment:
    saved: tuple[int, ...]
    rec_height: int
    aux: int  # callsite id of the exit the segment was entered through, NONE32 if unknown
    probe: int  # entry (or anchoring) probe id
    seq: int = 0  # a --scope entry's per-thread sequence number (its ScopeEntry), else 0


@dataclass(frozen=True, slots=True)
class RawContext:
    """One sample as the BPF side reports it: where the thread is and its encoded context."""

    event: str  # "syscall" | "cpu"
    time_ns: int  # CLOCK_REALTIME
    pid: int
    tid: int
    syscall: int | None
    ip: int
    sp: int
    flags: int
    depth: int
    top_kind: int
    top_probe: int
    top_aux: int
    bias: int
    acyc: tuple[int, ...]
    rec: int
    rec_len: int
    rec_base: int
    segments: tuple[RawSegment, ...] = field(default=())
    arg: str | None = None  # the syscall's path argument (open*, exec*), when readable at entry
    #: PCCE's back-edge stack, (saved id words, back-edge code) innermost last; then ``rec`` is 0 and
    #: segment heights count pairs (as :class:`~ccprofd.encode.segments.Segment` expects).
    pairs: tuple[tuple[tuple[int, ...], int], ...] = field(default=())
    agg: int = AGG_NONE  # aggregate mode: AGG_NEW (counted in the kernel under ctx_id) or AGG_UNAGGREGATED
    ctx_id: int = 0
    #: The six argument registers at syscall entry (rdi, rsi, rdx, r10, r8, r9); None for CPU samples.
    sargs: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class RawHit:
    """Aggregate mode with every sample wanted: a sample of the context the kernel counts under
    ``ctx_id`` (sent before as an ``AGG_NEW`` :class:`RawContext`), without the context itself."""

    event: str
    time_ns: int
    pid: int
    tid: int
    syscall: int | None
    ctx_id: int
    arg: str | None = None
    sargs: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class SchemeParams:
    """What the C code is compiled for, from a plan: how edges change the id and how wide recID's
    records are.  ``id_bits``: bits an id may use (the plan's id width, at most the words'); an id
    above it is flagged as overflow.  PCCE records are ``pair_code_bits`` of back-edge code then
    ``pair_id_bits`` of saved id, ``rec_bits`` wide in all (at least 1, so the count is kept)."""

    scheme: str
    acyc_words: int
    add: bool
    pairs: bool
    id_bits: int
    rec_bits: int
    pair_code_bits: int = 0
    pair_id_bits: int = 0

    @staticmethod
    def of(plan: Mapping[str, Any]) -> SchemeParams:
        scheme = plan.get("scheme")
        op = plan.get("acyc_op")
        if scheme not in SCHEMES or op not in ("set", "add"):
            raise BPFError(f"instrumented mode implements {', '.join(SCHEMES)} plans, not {scheme!r}")
        w = int(plan["acyc_words"])
        code_bits = int(plan["rec_code_bits"])
        if op == "set":
            return SchemeParams(scheme, w, False, False, 64 * w, code_bits)
        id_bits = min(int(plan["acyc_bits"]), 64 * w)
        if scheme == "pcce":
            width = max(1, code_bits + id_bits)
            return SchemeParams(scheme, w, True, True, id_bits, width, code_bits, id_bits)
        return SchemeParams(scheme, w, True, False, id_bits, code_bits)

    def defines(self) -> dict[str, int]:
        return {"ACYC_OP_ADD": int(self.add), "PCCE_PAIRS": int(self.pairs), "ID_BITS": self.id_bits,
                "PAIR_CODE_BITS": self.pair_code_bits, "PAIR_ID_BITS": self.pair_id_bits}

    def split_pairs(self, rec: int, rec_len: int) -> tuple[tuple[tuple[int, ...], int], ...]:
        """PCCE records of a whole recID bit string -> (saved id words, code), outermost first."""
        out = []
        cmask = (1 << self.pair_code_bits) - 1
        imask = (1 << self.pair_id_bits) - 1
        for pos in range(0, rec_len - rec_len % self.rec_bits, self.rec_bits):
            r = rec >> pos
            ident = (r >> self.pair_code_bits) & imask
            out.append((tuple(_words(ident, self.acyc_words)), r & cmask))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class ScopeEntry:
    """A --scope function entered from outside the scope: registers and a copy of the stack pages
    from the one holding ``sp`` upwards (``base``: address of ``stack[0]``), for one unwind of the
    frames above it (ccprofd/tracing/instrumented/scopeprefix.py).  Samples under it carry ``seq`` in their
    outermost segment."""

    time_ns: int
    pid: int
    tid: int
    seq: int
    ip: int
    sp: int
    bp: int
    base: int
    stack: bytes

    HEADER = struct.Struct("<QIIIIQQQQ")

    @classmethod
    def parse(cls, raw: bytes, clock_offset: int) -> ScopeEntry:
        """``clock_offset``: the samples' CLOCK_MONOTONIC -> wall clock offset (SampleLayout's): an
        entry is joined to the samples after it by time, so both must be converted alike."""
        ktime, tgid, tid, seq, pages, ip, sp, bp, base = cls.HEADER.unpack_from(raw)
        data = bytes(raw[cls.HEADER.size:cls.HEADER.size + 4096 * pages])
        return cls(ktime + clock_offset, tgid, tid, seq, ip, sp, bp, base, data)


@dataclass(frozen=True, slots=True)
class ProcessEvent:
    """fork / exec / exit of a traced process (from the sampler)."""

    kind: str
    time_ns: int
    pid: int
    tid: int
    aux: int


class SampleLayout:
    """Byte layout of ``struct cc_record`` (header + ``struct cc_sample``) for given parameters, and
    of the compacted records cc_send makes of it: the header up to ``arg``, ``arg_len`` bytes of
    argument, the sample up to its segments, its emitted segments, then its recID words."""

    def __init__(self, acyc_words: int, emit_segs: int, rec_emit_words: int,
                 scheme: SchemeParams | None = None) -> None:
        self.w = acyc_words
        self.scheme = scheme
        self.emit_segs = emit_segs
        self.rec_words = rec_emit_words
        self._rec = struct.Struct("<QIIiIQQIIII6Q")  # up to arg
        self._head = struct.Struct("<8IQ")
        self._acyc = struct.Struct(f"<{acyc_words}Q")
        self._seg = struct.Struct(f"<{acyc_words}Q4I")
        self.fixed = self._rec.size + ARG_LEN + self._head.size + self._acyc.size + emit_segs * self._seg.size
        self.size = self.fixed + rec_emit_words * 8  # sizeof(struct cc_record): the largest record
        # CLOCK_MONOTONIC -> wall clock, measured once: every sample (and return record, joined
        # to its sample by time) is converted alike, as unwind mode does
        self.clock_offset = monotonic_to_realtime_ns(0)

    def parse(self, raw: bytes) -> RawContext | RawHit:
        ktime, tgid, tid, nr, event, ip, sp, agg, ctx_id, arg_len, _, *words = self._rec.unpack_from(raw)
        sargs = tuple(words) if event == 1 else None
        off = self._rec.size
        arg = bytes(raw[off:off + arg_len])
        off += arg_len
        arg_s = arg.split(b"\0", 1)[0].decode("utf-8", "surrogateescape") or None
        ev = "syscall" if event == 1 else "cpu"
        if agg == AGG_HIT:
            return RawHit(ev, ktime + self.clock_offset, tgid, tid, nr if nr >= 0 else None, ctx_id,
                          arg_s, sargs)
        flags, depth, top_kind, top_probe, top_aux, rec_len, nsegs, rec_base, bias = \
            self._head.unpack_from(raw, off)
        off += self._head.size
        acyc = self._acyc.unpack_from(raw, off)
        off += self._acyc.size
        segs: list[RawSegment] = []
        emitted = min(nsegs, self.emit_segs)
        for i in range(emitted):
            vals = self._seg.unpack_from(raw, off + i * self._seg.size)
            segs.append(RawSegment(tuple(vals[:self.w]), vals[self.w], vals[self.w + 1], vals[self.w + 2],
                                   vals[self.w + 3]))
        off += emitted * self._seg.size
        rec = int.from_bytes(raw[off:], "little")
        pairs: tuple[tuple[tuple[int, ...], int], ...] = ()
        if not flags & SF_REC_TRUNC:
            rec &= (1 << rec_len) - 1
            if self.scheme is not None and self.scheme.pairs:
                # PCCE: recID holds the pair stack; heights become pair counts.
                rb = self.scheme.rec_bits
                pairs = self.scheme.split_pairs(rec, rec_len)
                segs = [RawSegment(g.saved, g.rec_height // rb, g.aux, g.probe, g.seq) for g in segs]
                rec, rec_len = 0, 0
        return RawContext(ev, ktime + self.clock_offset, tgid, tid,
                          nr if nr >= 0 else None, ip, sp, flags, depth, top_kind, top_probe, top_aux, bias,
                          tuple(acyc), rec, rec_len, rec_base, tuple(segs), arg_s, pairs, agg, ctx_id,
                          sargs)


def _words(value: int, n: int) -> list[int]:
    if not value:
        return [0] * n  # most probes (exits, entries, zero codes): no shifting
    if n == 1:
        return [value & 0xFFFFFFFFFFFFFFFF]
    if n == 2:
        return [value & 0xFFFFFFFFFFFFFFFF, (value >> 64) & 0xFFFFFFFFFFFFFFFF]
    return [(value >> (64 * i)) & 0xFFFFFFFFFFFFFFFF for i in range(n)]


def site_table(probe_plan: ProbePlan, plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per probe id, what its BPF program does (plain values; the map rows are built from these).

    Valence: ``mask``/``val`` are the edge's bit range and bits.  PCCE/HCCE: ``val`` is the code to
    add (a PCCE back edge: the id after the push).  A code wider than the id's words is flagged
    ``F_OVERFLOW``: a hit freezes the thread (flagged) instead of wrapping.
    """
    params = SchemeParams.of(plan)
    rows = plan["sites"]
    w = probe_plan.acyc_words
    if w != params.acyc_words:
        raise BPFError(f"probe plan has {w} id words, the encoding plan {params.acyc_words}")
    dense = dense_nodes(probe_plan)
    out: list[dict[str, Any]] = []
    for p in probe_plan.probes:
        reasons = p[PCOL["reasons"]]
        sid = p[PCOL["plan_site"]]
        mask = val = 0
        rec_code = 0
        flags = 0
        if reasons & R_PLT_EXIT:
            flags |= F_EXIT
        row = rows[sid] if sid >= 0 else None
        if row is not None and not reasons & R_PLT_EXIT:
            lo, hi, code = row[COL["lo"]], row[COL["hi"]], row[COL["code"]]
            if row[COL["reasons"]] & R_CYCLIC:
                flags |= F_CYCLIC
                rec_code = int(row[COL["rec_code"]])
                if params.pairs:
                    val = int(code)  # PCCE back edge: the id after the push
            elif code and not params.add and lo is not None and hi is not None:
                flags |= F_ACYC
                mask = ((1 << (hi - lo)) - 1) << lo
                val = int(code) << lo
            elif code and params.add:
                flags |= F_ACYC
                val = int(code)
            if val >> (64 * w):
                flags |= F_OVERFLOW
                mask = val = 0
        flags |= reasons & (8 | 16 | R_SCOPE)
        if reasons & R_CUT:
            flags |= F_CUT  # a zero-code edge: the program cuts the state and pushes nothing
        if p[PCOL["kind"]] in ("site", "tail") and not flags & (F_ACYC | F_CYCLIC | F_EXIT | F_CUT):
            raise BPFError(f"probe at {p[PCOL['vaddr']]:#x} has nothing to do (reasons {reasons})")
        cs = p[PCOL["callsite"]]
        length = probe_plan.callsites[cs][CCOL["length"]] if cs >= 0 else 0
        out.append({"vaddr": p[PCOL["vaddr"]], "ret_vaddr": p[PCOL["vaddr"]] + length,
                    "mask": _words(mask, w), "val": _words(val, w), "flags": flags, "rec_code": rec_code,
                    "callsite": cs if cs >= 0 else NONE32, "cfa_reg": p[PCOL["cfa_reg"]],
                    "cfa_off": p[PCOL["cfa_off"]], "node": dense.get(p[PCOL["node"]], NONE32),
                    "cond": p[PCOL["cond"]]})
    return out


def cc_site_struct(acyc_words: int) -> struct.Struct:
    """``struct cc_site`` of instrumented.c (tests/test_warm_start.py checks it against bcc's type)."""
    return struct.Struct(f"<QQ{acyc_words}Q{acyc_words}QIIIiqIi")


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


class InstrumentedBPF:
    """Compile, fill and attach instrumented mode for one probe plan; drain its samples."""

    def __init__(self, probe_plan: ProbePlan, plan: Mapping[str, Any], *,
                 syscalls: Iterable[int] | None = None, limits: Limits = Limits(),
                 cache_dir: str | None = None, history: int | None = None) -> None:
        pages = os.environ.get("CCPROFD_SCOPE_STACK_PAGES")  # --scope prefix copy size (README)
        if pages is not None:
            if not pages.isdigit() or not 0 <= int(pages) <= 64:
                raise BPFError(f"CCPROFD_SCOPE_STACK_PAGES must be a number of pages from 0 to 64, "
                               f"not {pages!r}")
            limits = replace(limits, scope_pages=int(pages))
        contexts = os.environ.get("CCPROFD_AGG_CONTEXTS")  # aggregate mode's table size (README)
        if contexts is not None:
            if not contexts.isdigit() or not 1 <= int(contexts) <= 1 << 20:
                raise BPFError(f"CCPROFD_AGG_CONTEXTS must be a number of contexts from 1 to 1048576, "
                               f"not {contexts!r}")
            limits = replace(limits, agg_contexts=int(contexts))
        threads = os.environ.get("CCPROFD_THREADS")  # threads with per-thread state at once (README)
        if threads is not None:
            if not threads.isdigit() or not 1 <= int(threads) <= 1 << 16:
                raise BPFError(f"CCPROFD_THREADS must be a number of threads from 1 to 65536, "
                               f"not {threads!r}")
            limits = replace(limits, slots=int(threads))
        limits.check()
        self.scheme = SchemeParams.of(plan)
        limits = replace(limits, max_pieces=fit_pieces(limits, probe_plan.acyc_words, self.scheme.rec_bits))
        self.probe_plan = probe_plan
        self.limits = limits
        self.sites = site_table(probe_plan, plan)
        w = probe_plan.acyc_words
        rec_bits = self.scheme.rec_bits
        state_bytes, rec_words = state_size(w, rec_bits, limits.max_pieces, limits.max_segments)
        rec_emit = min(limits.rec_emit_words, rec_words)
        self.layout = SampleLayout(w, limits.emit_segments, rec_emit, self.scheme)
        agg_segs = min(limits.agg_segments, 1 << (limits.emit_segments.bit_length() - 1))
        agg_rec = min(limits.agg_rec_words, rec_emit)
        agg_key_bytes = 40 + 8 * w + agg_segs * (8 * w + 16) + 8 * agg_rec  # struct cc_agg_key
        log2 = limits.max_pieces.bit_length() - 1
        fork_off = tracepoint_field_offset("sched", "sched_process_fork", "child_pid")
        exec_off = tracepoint_field_offset("sched", "sched_process_exec", "old_pid")
        try:  # without them the program cannot tell a sigaltstack from the thread's stack
            sas = sigaltstack_offsets(cache_dir)
        except BTFError:
            sas = {}
        defines = {"ACYC_WORDS": w, "MAX_PIECES": limits.max_pieces, "LOG2_MAX_PIECES": log2,
                   "MAX_SEGS": limits.max_segments, "EMIT_SEGS": limits.emit_segments, "REC_BITS": rec_bits,
                   "REC_WORDS": rec_words, "REC_EMIT_WORDS": rec_emit, "NPROBES": max(1, len(self.sites)),
                   "NCALLSITES": max(1, len(probe_plan.callsites)), "NSLOTS": limits.slots,
                   "NTAILREACH": max(1, len(probe_plan.tail_entries)),
                   "CC_RINGBUF_PAGES": limits.ringbuf_pages, "CC_ARG_LEN": ARG_LEN,
                   "CC_STATE_BYTES": state_bytes, "CC_RECORD_BYTES": self.layout.size,
                   "CC_FORK_CHILD_PID_OFF": fork_off, "CC_EXEC_OLD_PID_OFF": exec_off,
                   "SCOPE_PAGES": limits.scope_pages if probe_plan.scope is not None else 0,
                   "SCOPE_RINGBUF_PAGES": _pow2_at_least(8 * (limits.scope_pages + 1)),
                   "AGG_CONTEXTS": limits.agg_contexts, "AGG_SEGS": agg_segs, "AGG_REC_WORDS": agg_rec,
                   "CC_AGG_KEY_BYTES": agg_key_bytes, **sas,
                   **self.scheme.defines()}
        prelude = "".join(f"#define {k} {v}\n" for k, v in defines.items())
        prelude += _program_text(history)
        self.sampler = SyscallSampler(syscalls=syscalls, max_tracked=max(4096, 2 * limits.slots),
                                      ringbuf_pages=limits.sampler_ring, prelude=prelude, cache_dir=cache_dir)
        self.module: RawModule = self.sampler.module
        self._contexts: list[RawContext | RawHit] = []
        self.returns: list[SamplerEvent] = []  # "ret" events (attach_returns), taken by the mode
        self.module.open_ring_buffer("cc_events", lambda raw: self._contexts.append(self.layout.parse(raw)))
        self._scope_entries: list[ScopeEntry] = []
        if probe_plan.scope is not None and limits.scope_pages > 0:
            self.module.open_ring_buffer("cc_scope_events", lambda raw: self._scope_entries.append(
                ScopeEntry.parse(raw, self.layout.clock_offset)))
        self._links: list[UprobeMultiLink] = []
        self._attached = False
        self.rec_words = rec_words
        self.state_bytes = state_bytes
        #: -p seeding (seed.py): per process, tid -> None (seeded, complete) or why not
        self.seed_report: dict[int, dict[int, str | None]] = {}
        #: threads userspace found no state slot for (traced without state: samples flagged)
        self.unslotted: set[int] = set()
        self._fill_maps()

    # ---------------------------------------------------------------------------------- set-up
    def _fill_maps(self) -> None:
        """Site, return-address, callee and tail tables, packed as C arrays and written with one
        batch update per map (building a ctypes object per site took ~0.5 s on python3.11)."""
        w = self.probe_plan.acyc_words
        site_s = cc_site_struct(w)
        m = self.module.map("cc_sites")
        leaf = getattr(m, "leaf_type", None)
        if leaf is not None and ctypes.sizeof(leaf) != site_s.size:
            raise BPFError(f"struct cc_site is {ctypes.sizeof(leaf)} bytes, packed as {site_s.size}")
        n = len(self.sites)
        values = b"".join(site_s.pack(s["vaddr"], s["ret_vaddr"], *s["mask"][:w], *s["val"][:w], s["flags"],
                                      s["rec_code"], s["callsite"], s["cfa_reg"], s["cfa_off"], s["node"],
                                      s["cond"]) for s in self.sites)
        map_update_batch(m.fd, array("I", range(n)).tobytes(), values, n, "cc_sites")
        rets = ret_table(self.probe_plan)
        map_update_batch(self.module.map("cc_ret_sites").fd, array("Q", [r for r, _ in rets]).tobytes(),
                         array("I", [v for _, v in rets]).tobytes(), len(rets), "cc_ret_sites")
        dense = dense_nodes(self.probe_plan)
        ti, ki = CCOL["target"], CCOL["kind"]
        callee = [dense[c[ti]] if c[ki] in ("direct", "tail") and c[ti] in dense else NONE32
                  for c in self.probe_plan.callsites]
        map_update_batch(self.module.map("cc_cs_callee").fd, array("I", range(len(callee))).tobytes(),
                         array("I", callee).tobytes(), len(callee), "cc_cs_callee")
        if self.probe_plan.tail_entries:
            keys = array("Q", [(dense[g] << 32) | dense[f] for g, f in self.probe_plan.tail_entries])
            map_update_batch(self.module.map("cc_tail_reach").fd, keys.tobytes(), bytes([1]) * len(keys),
                             len(keys), "cc_tail_reach")
        self._queue_fill("cc_free", range(self.limits.slots))
        if self.probe_plan.functions:  # aggregation keys: a sampled ip outside [lo, hi) is "outside"
            cfg = self.module.map("cc_config")
            cfg.set(CFG_TEXT_LO, min(int(f[0]) for f in self.probe_plan.functions))
            cfg.set(CFG_TEXT_HI, max(int(f[1]) for f in self.probe_plan.functions))

    def _queue_fill(self, name: str, values: Iterable[int]) -> None:
        """Push values onto a BPF queue map."""
        queue = self.module.map(name)
        for v in values:
            queue.push(v)

    def attach(self) -> None:
        """Attach the process tracepoints, the syscall sampler and every probe (uprobe_multi)."""
        if self._attached:
            return
        self.module.attach_tracepoint("sched:sched_process_fork", "cc_fork")
        self.module.attach_tracepoint("sched:sched_process_exit", "cc_exit")
        self.module.attach_tracepoint("sched:sched_process_exec", "cc_exec")
        self.sampler.attach()
        path = self.probe_plan.binary["path"]
        by_kind: dict[str, list[int]] = {}
        for i, p in enumerate(self.probe_plan.probes):
            by_kind.setdefault(p[PCOL["kind"]], []).append(i)
        for kind, ids in sorted(by_kind.items()):
            fd = self.module.load_func(PROGRAMS[kind], "kprobe", attach_type=48)
            offsets = [self.probe_plan.probes[i][PCOL["offset"]] for i in ids]
            self._links.append(attach_uprobe_multi(fd, path, offsets, ids))
        self._attached = True

    def attach_cpu_sampling(self, hz: int) -> None:
        """CPU-clock samples (``event: cpu``) of every traced thread at ``hz`` per CPU."""
        if hz <= 0:
            raise BPFError(f"sampling frequency must be positive, not {hz}")
        self.module.attach_perf_event("cc_cpu_sample", sample_freq=hz)

    def load_programs(self) -> None:
        """Verify the three probe programs without attaching (for compile-time measurements)."""
        for name in PROGRAMS.values():
            self.module.load_func(name, "kprobe", attach_type=48)

    # ------------------------------------------------------------------------------- threads
    def track_launch(self, pid: int) -> None:
        """Trace ``pid`` (a child of ours that will exec the target): its exec starts a fresh context."""
        cfg = self.module.map("cc_config")
        cfg.set(CFG_LAUNCH_TGID, pid)
        cfg.set(CFG_LAUNCHED, 0)
        self.add_thread(pid, incomplete=False)
        self.sampler.track(pid, execs=1)

    def track_running(self, pid: int, tids: Sequence[int], *, seed: bool = True,
                      cache_dir: str | None = None) -> None:
        """Trace an already running process: its threads' frames above the first event are unknown
        until each thread is seeded by one unwind at attach (``seed``, see seed.py; the probes are
        attached first, so what they record after the stop builds on the seeded state)."""
        tracked = False

        def start_tracking() -> None:
            # Called while every thread of the process is stopped (seeding) or without a stop: no
            # sample or probe event of the process can fall between its tracking and its seeding.
            nonlocal tracked
            tracked = True
            for tid in sorted(set(tids) | set(threads_of(pid))):
                self.add_thread(tid, incomplete=True)
            self.sampler.track(pid)

        if seed and self._attached:
            from ccprofd.tracing.instrumented.seed import seed_process

            self.seed_report[pid] = seed_process(self, pid, cache_dir=cache_dir,
                                                 start_tracking=start_tracking)
        if not tracked:
            start_tracking()

    def write_state(self, tid: int, blob: bytes) -> bool:
        """Overwrite thread ``tid``'s ``struct cc_state`` (False: the thread has no slot)."""
        try:
            slot = self.module.map("cc_slot_of").get(tid)
        except KeyError:
            return False
        if slot is None:
            return False
        states = self.module.map("cc_states")
        st = states.leaf_type()
        if len(blob) > ctypes.sizeof(st):
            raise BPFError("seeded state larger than a state slot")
        ctypes.memmove(ctypes.addressof(st), blob, len(blob))
        states.set(int(slot), st)
        return True

    def add_thread(self, tid: int, *, incomplete: bool) -> bool:
        """Give thread ``tid`` a state slot (userspace side of the slot allocator).  False when all
        are in use: the thread is traced without state (its samples say ``no per-thread state``),
        the rest of its process as usual -- one thread too many never fails the whole target."""
        slot = self.module.map("cc_free").pop()
        if slot is None:
            self.unslotted.add(tid)
            return False
        states = self.module.map("cc_states")
        st = states.leaf_type()  # an opaque blob (see instrumented.c): write the header by offset
        # n, rec_len, nsegs, flags
        header = struct.pack("<4I", 0, 0, 0, ST_INCOMPLETE_BASE if incomplete else 0)
        ctypes.memmove(ctypes.addressof(st), header, len(header))
        states.set(int(slot), st)
        self.module.map("cc_slot_of").set(tid, int(slot))
        return True

    # ---------------------------------------------------------------------------- aggregation
    def set_aggregate(self, on: bool) -> None:
        """Count syscall samples per context in the kernel (``cc_agg_counts``, read with
        :meth:`agg_counts`); only each context's first sample is sent whole (``AGG_NEW``)."""
        self.module.map("cc_config").set(CFG_AGGREGATE, 1 if on else 0)

    def set_emit_hits(self, on: bool) -> None:
        """Aggregating: also send a :class:`RawHit` per sample of a known context (its time,
        thread and path argument); the kernel counts the sample either way."""
        self.module.map("cc_config").set(CFG_EMIT_HITS, 1 if on else 0)

    def agg_counts(self) -> dict[int, int]:
        """Samples counted so far per context id (ids of the ``AGG_NEW`` records)."""
        return {int(v.id): int(v.count) for _, v in self.module.map("cc_agg_counts").items_batch()}

    # --------------------------------------------------------------------------------- events
    def poll(self, timeout_ms: int = 0) -> list[RawContext | RawHit | ProcessEvent | ScopeEntry]:
        """Samples and process events that arrived since the last call, in time order."""
        out: list[RawContext | RawHit | ProcessEvent | ScopeEntry] = []
        events = self.sampler.poll(timeout_ms)
        if self._scope_entries is not None and self.probe_plan.scope is not None:
            # A poll consumes only the rings that signalled, and at most RECORDS_PER_POLL: drain the
            # scope ring once more, without a budget (entries are rare), so every scope entry
            # submitted before a sample of this batch is in the batch (entry before its samples).
            self.module.ring_buffer_consume(rings=("cc_scope_events",))
        for ev in events:
            if ev.kind == "ret":
                self.returns.append(ev)
            elif ev.kind != "syscall":  # syscall contexts come through cc_events (the sampler sends none)
                t = ev.time_ns + self.layout.clock_offset  # ordered with the samples by time
                out.append(ProcessEvent(ev.kind, t, ev.tgid, ev.tid, ev.aux))
        out.extend(self._contexts)
        self._contexts = []
        out.extend(self._scope_entries)
        self._scope_entries = []
        out.sort(key=lambda e: e.time_ns)
        return out

    def drops(self) -> dict[str, int]:
        """What the kernel side could not do, by reason (api.DROPS): samples lost to a full ring,
        --scope entries lost, processes not followed, process events lost, and threads traced
        without per-thread state (at fork in BPF, or at attach here)."""
        m = self.module.map("cc_stats")
        sampler = self.sampler.stats()
        return {"ringbuf_full": int(m.get(STATS.index("ringbuf_full")) or 0),
                "scope_ringbuf_full": int(m.get(STATS.index("scope_lost")) or 0),
                "tracked_full": sampler["tracked_full"], "events_ringbuf_full": sampler["ringbuf_full"],
                "thread_state_full": int(m.get(STATS.index("no_slot")) or 0) + len(self.unslotted)}

    def stats(self) -> dict[str, int]:
        m = self.module.map("cc_stats")
        out = {name: int(m.get(i) or 0) for i, name in enumerate(STATS)}
        out.update({f"sampler_{k}": v for k, v in self.sampler.stats().items()})
        out["probes"] = len(self.probe_plan.probes)
        return out

    def detach(self) -> None:
        """Stop sampling, then remove every probe (the other order would let a sample be taken
        from a state the removed probes no longer keep right); the rings stay readable until
        :meth:`close`."""
        self.sampler.detach()
        for link in self._links:
            link.close()
        self._links.clear()

    def close(self) -> None:
        self.detach()
        self.sampler.close()

    def __enter__(self) -> InstrumentedBPF:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_state(self, tid: int) -> bytes | None:
        """Thread ``tid``'s ``struct cc_state`` as BPF holds it now, None when it has no slot (for
        GetThreadContexts: ccprofd/tracing/instrumented/livestate.py decodes it; nothing is written back)."""
        slot = self.module.map("cc_slot_of").get(tid)
        if slot is None:
            return None
        st = self.module.map("cc_states").get(int(slot))
        if st is None:
            return None
        return ctypes.string_at(ctypes.addressof(st), ctypes.sizeof(st))


__all__ = ["AGG_HIT", "AGG_NEW", "AGG_NONE", "AGG_UNAGGREGATED", "EXIT_KINDS", "INCOMPLETE_FLAGS", "K_CALL",
           "K_EXIT", "K_ROOT", "K_SEG", "K_TAIL", "K_TAILEXIT",
           "SF_OVERFLOW", "InstrumentedBPF", "Limits", "ProcessEvent", "RawContext", "RawHit", "RawSegment",
           "SampleLayout", "SchemeParams", "ScopeEntry", "site_table"]

