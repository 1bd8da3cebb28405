"""``GetThreadContexts`` in instrumented mode: every thread's context read from its live BPF state.

Why: instrumented mode keeps each thread's encoded context in ``cc_states`` (instrumented.c) at every
moment, with no unwind tables and no frame pointers; answering from it is exact where a CFI walk of a
binary without tables cannot be.  But the state is only *current* once the pieces of frames that are
gone are dropped, and BPF drops them lazily, at the thread's next probe event or sample (``cc_cut``).
So the process is stopped briefly (:func:`ccprofd.proc.threadsnap.snapshot`, its ``while_stopped``
hook: every thread of the process stopped at once), and for each thread, with its stack as it is:

* its ``struct cc_state`` is read through :meth:`InstrumentedBPF.read_state` (the bcc adapter);
* the cut rules of ``cc_fill_sample`` are applied to a copy in userspace, stack words read from
  ``/proc/PID/mem`` (seed.py's :class:`StateModel`, the Python model of the same programs): pieces
  recorded below ``sp + 8``, top pieces whose return-address word changed (all of them, where BPF
  checks four per event), everything when the outermost piece's return address is gone; a freeze
  below the current frame is lifted, a fork-pending copy resolved as the thread's first event would;
* a thread stopped *on* a root function's entry-probe instruction (entered, its probe not yet run)
  gets that probe's event replayed through the same model;
* the result becomes a :class:`RawContext` exactly as a sample at that moment would carry it (``ip``
  = the thread's pc, ``sp`` = its sp) and is decoded by the plan's decoder through the mode's
  :class:`~ccprofd.tracing.instrumented.symbolize.Symbolizer`.  The BPF state itself is never written.

What the innermost frame means: the pc may be anywhere, not at a syscall.  When it is in an analysed
function of the binary, the innermost frame is that function with ``call_site`` = the pc (the
instruction the thread executes next; after a ``syscall`` instruction when blocked in one made from
the binary) and ``return_address`` null, as in a CFI snapshot.  Elsewhere (a library) the innermost
binary frame is the caller of the innermost recorded exit (a PLT / GOT call), and the library frames
below it come from the snapshot's CFI walk of the *library* (``analysed: false``, each at gdb's pc),
spliced in only where the walk reaches that very return address of the binary; where it does not,
one ``analysed: false`` frame named after the import stands for them, as in a sample.  The frames of
library code between a call out of the binary and a callback into it are spliced the same way.

Flagged (``complete: false``, ``reason`` starting ``bpf-state:``): a thread attached mid-run and not
seeded (frames above its first probe event unknown), a state frozen (deeper than the per-thread bound,
or an id that did not fit), a stack word that could not be read, an innermost exit unknown.  A
thread without a state slot is answered by the CFI walk (``reason`` ``unwind: ...`` when incomplete).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ccprofd.proc.threadsnap import ThreadSnapshot, snapshot
from ccprofd.tracing.frames import Decoded, Frame
from ccprofd.tracing.instrumented.constants import (
    ST_BIAS,
    ST_FORK_PENDING,
    ST_FROZEN,
    ST_INCOMPLETE_BASE,
    ST_OVERFLOW,
    ST_READFAIL,
)
from ccprofd.tracing.instrumented.loader import NONE32, RawContext, RawSegment
from ccprofd.tracing.instrumented.probeplan import PCOL
from ccprofd.tracing.instrumented.seed import Piece, SeedError, SeedParams, SeedState, StateModel, seeder_for
from ccprofd.tracing.threadcontexts import ContextReader

# thread state flags (instrumented.c ST_*) and the sample flags a sample would carry (SF_*)
_SF_OF_ST = {ST_FROZEN: 2, ST_INCOMPLETE_BASE: 4, ST_READFAIL: 32, ST_BIAS: 64, ST_OVERFLOW: 128}

WordReader = Callable[[int], "int | None"]


@dataclass(slots=True)
class LiveState:
    """One thread's ``struct cc_state`` as read from BPF (``pads``: each piece's pad word, the
    --scope entry sequence of a segment)."""

    state: SeedState
    pads: list[int]
    frozen_sp: int
    parent_tgid: int


def parse_state(blob: bytes, params: SeedParams) -> LiveState:
    """``struct cc_state`` bytes -> :class:`LiveState` (the layout :func:`seed.state_blob` writes)."""
    w = params.acyc_words
    head = struct.Struct(f"<4IQQIIQ{w}Q")
    n, rec_len, nsegs, flags, frozen_sp, bias, parent_tgid, _scope_seq, _pos, *acyc = head.unpack_from(blob)
    if n > params.max_pieces or nsegs > params.max_segs or rec_len > 64 * params.rec_words:
        raise ValueError(f"state out of bounds (pieces {n}, segments {nsegs}, recID bits {rec_len})")
    segs = list(struct.unpack_from(f"<{nsegs}I", blob, head.size))
    rec_off = (head.size + 4 * params.max_segs + 7) // 8 * 8
    rec = int.from_bytes(blob[rec_off:rec_off + 8 * params.rec_words], "little") & ((1 << rec_len) - 1)
    piece = struct.Struct(f"<QQ6I{w}Q")
    off = rec_off + 8 * params.rec_words
    pieces: list[Piece] = []
    pads: list[int] = []
    for i in range(n):
        sp, ret, probe, aux, kind, rec_before, nsegs_before, pad, *before = piece.unpack_from(
            blob, off + i * piece.size)
        pieces.append(Piece(sp, ret, probe, aux, kind, rec_before, nsegs_before, tuple(before)))
        pads.append(pad)
    if any(s >= n for s in segs):
        raise ValueError("a segment names no live piece")
    state = SeedState(w, flags=flags, bias=bias, acyc=list(acyc), rec=rec, rec_len=rec_len, segs=segs,
                      pieces=pieces)
    return LiveState(state, pads, frozen_sp, parent_tgid)


def current(live: LiveState, model: StateModel, *, tgid: int, sp: int,
            entry_probe: int | None = None) -> None:
    """Drop from ``live`` (in place) what a sample at stack pointer ``sp`` would drop first (cc_fill_sample:
    ``cc_cut(sp + 8)``, ``cc_cut_base``), reading stack words through ``model``; then replay
    ``entry_probe`` (the thread stands on that probe's instruction, entered but not yet probed)."""
    s = live.state
    if s.flags & ST_FORK_PENDING:  # cc_state_of_current at the thread's first event
        if tgid == live.parent_tgid:
            s.flags, s.rec, s.rec_len, s.acyc = 0, 0, 0, [0] * s.words
            s.pieces.clear()
            s.segs.clear()
            live.frozen_sp = 0
        else:
            s.flags &= ~ST_FORK_PENDING
    model.s = s
    limit = sp + 8
    try:
        model.cut(limit)
    except SeedError:
        s.flags |= ST_READFAIL  # BPF assumes the piece alive and flags the sample the same way
    if s.flags & ST_FROZEN and live.frozen_sp < limit:
        s.flags &= ~(ST_FROZEN | ST_OVERFLOW)
    if s.pieces:  # cc_cut_base: the outermost recorded frame returned -> everything recorded is gone
        base = s.pieces[0]
        word = model.read(base.sp - 8)
        if word is None:
            s.flags |= ST_READFAIL
        elif word != base.ret:
            model.truncate(0)
            s.flags &= ~ST_FROZEN
    del live.pads[len(s.pieces):]
    if entry_probe is not None and not s.flags & ST_FROZEN:
        n = len(s.pieces)
        try:
            model.entry_probe(entry_probe, sp + 8)
        except SeedError:
            s.flags |= ST_READFAIL
        live.pads.extend([0] * (len(s.pieces) - n))


def raw_context(live: LiveState, *, pid: int, tid: int, ip: int, sp: int, bias: int | None,
                scheme: Any) -> RawContext:
    """The sample a syscall at this moment would carry (whole: nothing truncated for transport)."""
    s = live.state
    flags = 0
    for st, sf in _SF_OF_ST.items():
        if s.flags & st:
            flags |= sf
    if not s.flags & ST_BIAS and bias is not None:
        flags |= _SF_OF_ST[ST_BIAS]
    state_bias = s.bias if s.flags & ST_BIAS else (bias or 0)
    top = s.pieces[-1] if s.pieces else None
    segs = [RawSegment(tuple(s.pieces[i].acyc_before), s.pieces[i].rec_before, s.pieces[i].aux,
                       s.pieces[i].probe, live.pads[i]) for i in s.segs]
    rec, rec_len = s.rec, s.rec_len
    pairs: tuple[tuple[tuple[int, ...], int], ...] = ()
    if scheme is not None and scheme.pairs:  # PCCE: recID holds the pair stack (SampleLayout.parse)
        pairs = scheme.split_pairs(rec, rec_len)
        segs = [RawSegment(g.saved, g.rec_height // scheme.rec_bits, g.aux, g.probe, g.seq) for g in segs]
        rec, rec_len = 0, 0
    return RawContext("thread", time.time_ns(), pid, tid, None, ip, sp, flags, len(s.pieces),
                      top.kind if top else 0, top.probe if top else NONE32, top.aux if top else NONE32,
                      state_bias, tuple(s.acyc), rec, rec_len, 0, tuple(segs), None, pairs)


def reason_of(flags: int, decoded: Decoded) -> str | None:
    """Why a context is incomplete, in words (None when complete)."""
    if decoded.complete:
        return None
    why = []
    if flags & 4:
        why.append("frames above the thread's first probe event are unknown (attached mid-run, not seeded)")
    if flags & 128:
        why.append("frozen: an id did not fit its words")
    elif flags & 2:
        why.append("frozen: deeper than the per-thread state holds")
    if flags & 32:
        why.append("a stack word could not be read")
    if not why or (decoded.reason and not decoded.reason.startswith("flags=")):
        why.append(decoded.reason or "incomplete")
    return "bpf-state: " + "; ".join(why)


def splice_library_frames(frames: list[Frame], walked: Sequence[Frame]) -> list[Frame]:
    """Replace each ``analysed: false`` stand-in frame of a decoded context (a library function the
    binary called and that called back into it, named after its import) by the library frames a CFI
    walk found between the same two frames of the binary: from the walk's binary frame with the
    caller's return address up to the next analysed frame (the callee: same name).  Below an
    innermost frame that called out of the binary (a sample's exit), the walk's frames below that
    return address are appended when none of them is analysed.  Where the walk does not line up,
    the decoded frames stay as they are."""
    out: list[Frame] = []
    cursor = 0
    for j, f in enumerate(frames):
        caller = frames[j - 1] if j > 0 else None
        if f.analysed or f.module is not None or caller is None or not caller.analysed \
                or caller.return_address is None:
            out.append(f)
            continue
        a = next((i for i in range(cursor, len(walked)) if walked[i].analysed
                  and walked[i].return_address == caller.return_address), None)
        if a is None:
            out.append(f)
            continue
        b = next((i for i in range(a + 1, len(walked)) if walked[i].analysed), len(walked))
        callee = frames[j + 1] if j + 1 < len(frames) else None
        lined_up = walked[b].function == callee.function if callee is not None and b < len(walked) \
            else callee is None and b == len(walked)
        run = list(walked[a + 1:b])
        if not lined_up or not run or any(g.analysed for g in run):
            out.append(f)
            continue
        out.extend(run)
        cursor = b
    inner = out[-1] if out else None
    if inner is not None and inner.analysed and inner.return_address is not None:
        # the innermost binary frame called out (the exit a sample names): the library frames below it
        a = next((i for i in range(cursor, len(walked)) if walked[i].analysed
                  and walked[i].return_address == inner.return_address), None)
        if a is not None and a + 1 < len(walked) and not any(g.analysed for g in walked[a + 1:]):
            out.extend(walked[a + 1:])
    return out


class LiveContextReader(ContextReader):
    """``GetThreadContexts`` of an instrumented-mode binary (see the module docstring).  The CFI
    snapshot machinery (module cache, symbols, one snapshot at a time) is ContextReader's."""

    def __init__(self, bpf: Any, symbolizer: Any, binary_path: str, cache_dir: str | None = None, *,
                 scope: Any = None, shown_as: str | None = None) -> None:
        super().__init__(binary_path, cache_dir, shown_as)
        self.bpf = bpf
        self.sym = symbolizer
        self.scope = scope  # --scope: scopeprefix.py's prefixes, joined as to samples
        self._seeder, self.params = seeder_for(bpf)
        pp = bpf.probe_plan
        self._entry_at = {p[PCOL["vaddr"]]: i for i, p in enumerate(pp.probes) if p[PCOL["kind"]] == "entry"}
        self._decode_lock = threading.Lock()

    def _model(self, read_word: WordReader) -> StateModel:
        sd = self._seeder
        return StateModel(sd.sites, sd.rets, sd.cs_callee, sd.tail_reach, self.params, read_word)

    def _bias(self, pid: int) -> int | None:
        from ccprofd.proc.maps import module_mappings

        try:
            maps = module_mappings(pid, self.modules.addrspace_of)
        except OSError:
            return None
        cache: dict[str, bool] = {}
        return next((m.bias for m in maps.mappings if self._seeder.in_binary(m, cache)), None)

    def read(self, pid: int) -> dict[str, Any]:
        decoder = self._frame_decoder()
        bias = self._bias(pid)
        got: dict[int, tuple[RawContext | None, str | None]] = {}

        def at_stop(th: ThreadSnapshot, read_word: WordReader) -> None:
            # every thread of the process is stopped: the stack is the one the state must match
            if th.regs is None:
                got[th.tid] = (None, th.error or "no registers")
                return
            try:
                blob = self.bpf.read_state(th.tid)
            except (OSError, ValueError, KeyError) as exc:
                got[th.tid] = (None, f"state unreadable: {exc}")
                return
            if blob is None:
                got[th.tid] = (None, None)  # no slot: the CFI walk answers
                return
            try:
                live = parse_state(blob, self.params)
            except (ValueError, struct.error) as exc:
                got[th.tid] = (None, f"state unreadable: {exc}")
                return
            pc, sp = th.regs.rip, th.regs.rsp
            b = live.state.bias if live.state.flags & ST_BIAS else bias
            entry = self._entry_at.get(pc - b) if b is not None else None
            if entry is not None and b is not None and not live.state.flags & ST_BIAS:
                live.state.bias, live.state.flags = b, live.state.flags | ST_BIAS  # as the probe sets it
            current(live, self._model(read_word), tgid=pid, sp=sp, entry_probe=entry)
            got[th.tid] = (raw_context(live, pid=pid, tid=th.tid, ip=pc, sp=sp, bias=bias,
                                       scheme=self.bpf.scheme), None)

        with self._lock:
            snap = snapshot(pid, self.modules, while_stopped=at_stop)
        threads: list[dict[str, Any]] = []
        for th in snap.threads:
            walked = [decoder.frame(f) for f in th.stack.frames] if th.stack is not None else []
            raw, err = got.get(th.tid, (None, th.error))
            if raw is None and err is None and th.stack is not None:
                frames = [f.to_json() for f in decoder.frames(th.stack.frames)]
                reason = None if th.stack.complete else f"unwind: {th.stack.reason}"
                threads.append({"tid": th.tid, "comm": th.comm, "complete": th.stack.complete,
                                "reason": reason, "frames": frames, "source": "unwind"})
                continue
            if raw is None:
                threads.append({"tid": th.tid, "comm": th.comm, "complete": False,
                                "reason": f"bpf-state: {err or 'no registers'}", "frames": [],
                                "source": "bpf-state"})
                continue
            with self._decode_lock:
                d = self.sym.decode(raw)
                if self.scope is not None:  # the frames above the thread's latest scope entry
                    d = self.scope.join(raw, d)
            frames_out = splice_library_frames(d.frames, walked)
            threads.append({"tid": th.tid, "comm": th.comm, "complete": d.complete,
                            "reason": reason_of(raw.flags, d), "frames": [f.to_json() for f in frames_out],
                            "source": "bpf-state"})
        return {"pid": pid, "error": snap.error, "threads": threads}


__all__ = ["LiveContextReader", "LiveState", "current", "parse_state", "raw_context", "reason_of",
           "splice_library_frames"]
