"""Seeding instrumented mode's per-thread state from one unwind of a thread already running at attach.

Why: with ``-p PID`` the probes see only what happens after attach, so every frame above the first
event would be unknown (``ST_INCOMPLETE_BASE``, samples ``complete: false``).  Instead each thread is
stopped once (:mod:`ccprofd.proc.threadsnap`), its stack walked with the CFI tables
(:mod:`ccprofd.proc.userstack`), and the probe events that *would* have fired for those frames had
the probes been attached from the start are replayed here, in the order they would have fired
(outermost frame first), through a model of ``instrumented.c``'s programs: the site probe on the
call instruction of each frame of the binary (edge / exit piece, anchor segment), and the entry
probe of each entered root function (root piece, outside-entry or indirect-call segment).  The
resulting piece stack -- recorded sps (the CFA as the probe computes it), return addresses, snapshots
of the encoded state -- is written into the thread's BPF slot while the thread is still stopped, so
it matches the stack at that instant; probes that fire after it resumes work from it.

Exact or flagged: a walk that did not reach the thread's outermost frame, a frame reached through
tail jumps (the stack does not say which probed tail edges were taken), an id that would not fit,
or more pieces than the BPF bound leave the thread unseeded (flagged incomplete, as without
seeding) with the reason in the summary.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ccprofd.proc.maps import ModuleMapping
from ccprofd.proc.userstack import UnwoundStack
from ccprofd.tracing.instrumented.constants import (
    F_ACYC,
    F_CYCLIC,
    F_EXIT,
    F_OVERFLOW,
    F_SCOPE,
    K_CALL,
    K_EXIT,
    K_ROOT,
    K_SEG,
    K_TAILEXIT,
    NO_STATE,
    NONE32,
    RS_IN_SCOPE,
    RS_INDEX,
    RS_INDIRECT,
    RS_VIA_PLT,
    ST_BIAS,
    ST_INCOMPLETE_BASE,
    STACK_SWITCH_GAP,
)
from ccprofd.tracing.instrumented.probeplan import CCOL, PCOL, FunctionIndex, ProbePlan
from ccprofd.tracing.instrumented.sitetables import dense_nodes, ret_table

M64 = (1 << 64) - 1

WordReader = Callable[[int], "int | None"]


class SeedError(Exception):
    """The thread cannot be seeded exactly (the message is the reason shown in the summary)."""


@dataclass(slots=True)
class Piece:
    sp: int
    ret: int
    probe: int
    aux: int
    kind: int
    rec_before: int
    nsegs_before: int
    acyc_before: tuple[int, ...]


@dataclass(slots=True)
class SeedState:
    """A thread's ``struct cc_state`` as the probes would have left it."""

    words: int
    flags: int = 0
    bias: int = 0
    acyc: list[int] = field(default_factory=list)
    rec: int = 0
    rec_len: int = 0
    segs: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SeedParams:
    """What the model needs of the compiled program (instrumented.py's compile-time values)."""

    acyc_words: int
    add: bool
    pairs: bool
    id_bits: int
    rec_bits: int
    pair_code_bits: int
    pair_id_bits: int
    max_pieces: int
    max_segs: int
    rec_words: int


class StateModel:
    """``instrumented.c``'s probe programs over a :class:`SeedState` (same rules, same order)."""

    def __init__(self, sites: Sequence[Mapping[str, Any]], rets: Mapping[int, int], cs_callee: Sequence[int],
                 tail_reach: set[tuple[int, int]], params: SeedParams, read_word: WordReader) -> None:
        self.sites = sites
        self.rets = rets
        self.cs_callee = cs_callee
        self.tail_reach = tail_reach
        self.p = params
        self.read = read_word
        self.s = SeedState(params.acyc_words, acyc=[0] * params.acyc_words)

    # -------------------------------------------------------------------------- primitives
    def word(self, addr: int) -> int:
        v = self.read(addr)
        if v is None:
            raise SeedError(f"stack word at {addr:#x} unreadable")
        return v

    def truncate(self, m: int) -> None:
        s = self.s
        if m >= len(s.pieces):
            return
        p = s.pieces[m]
        s.rec_len = p.rec_before
        s.rec &= (1 << s.rec_len) - 1
        del s.segs[p.nsegs_before:]
        s.acyc = list(p.acyc_before)
        del s.pieces[m:]

    def cut(self, limit: int) -> None:
        s = self.s
        pos = 0
        while pos < len(s.pieces) and s.pieces[pos].sp >= limit:
            pos += 1
        if pos == 0 and s.pieces and (limit - s.pieces[0].sp) & M64 > STACK_SWITCH_GAP:
            s.flags |= ST_INCOMPLETE_BASE
        self.truncate(pos)
        while s.pieces and self.word(s.pieces[-1].sp - 8) != s.pieces[-1].ret:
            self.truncate(len(s.pieces) - 1)

    def push(self, sp: int, ret: int, probe: int, kind: int, aux: int) -> None:
        s = self.s
        if len(s.pieces) >= self.p.max_pieces:
            raise SeedError(f"more than {self.p.max_pieces} pieces")
        s.pieces.append(Piece(sp, ret, probe, aux, kind, s.rec_len, len(s.segs), tuple(s.acyc)))

    def push_bits(self, v: int, nbits: int) -> None:
        s = self.s
        s.rec |= (v & ((1 << nbits) - 1)) << s.rec_len
        s.rec_len += nbits
        if s.rec_len > 64 * self.p.rec_words:
            raise SeedError("recID longer than its BPF words")

    def apply_acyc(self, si: Mapping[str, Any]) -> None:
        if si["flags"] & F_OVERFLOW:
            raise SeedError("an id does not fit its words")
        s = self.s
        w = self.p.acyc_words
        if self.p.add:
            total = sum(a << (64 * i) for i, a in enumerate(s.acyc)) + sum(
                v << (64 * i) for i, v in enumerate(si["val"]))
            if total >> min(self.p.id_bits, 64 * w):
                raise SeedError("an id does not fit its words")
            s.acyc = [(total >> (64 * i)) & M64 for i in range(w)]
        else:
            s.acyc = [(a & ~m & M64) | v for a, m, v in zip(s.acyc, si["mask"], si["val"], strict=True)]

    def apply_cyclic(self, si: Mapping[str, Any]) -> None:
        if si["flags"] & F_OVERFLOW:
            raise SeedError("an id does not fit its words")
        s = self.s
        if self.p.pairs:
            if self.p.pair_code_bits:
                self.push_bits(si["rec_code"], self.p.pair_code_bits)
            for w in range(self.p.acyc_words):
                if self.p.pair_id_bits > 64 * w:
                    self.push_bits(s.acyc[w], min(64, self.p.pair_id_bits - 64 * w))
            if self.p.pair_code_bits + self.p.pair_id_bits == 0:
                self.push_bits(0, 1)
            s.acyc = list(si["val"])
        elif self.p.rec_bits > 0:
            self.push_bits(si["rec_code"], self.p.rec_bits)

    def edge(self, si: Mapping[str, Any], sp: int, ret: int, probe: int, kind: int) -> None:
        if not si["flags"] & (F_CYCLIC | F_ACYC):
            return
        self.push(sp, ret, probe, kind, si["callsite"])
        if si["flags"] & F_CYCLIC:
            self.apply_cyclic(si)
        else:
            self.apply_acyc(si)

    def push_segment(self, sp: int, ret: int, probe: int, aux: int) -> None:
        s = self.s
        if len(s.segs) >= self.p.max_segs:
            raise SeedError(f"more than {self.p.max_segs} segments")
        idx = len(s.pieces)
        self.push(sp, ret, probe, K_SEG, aux)
        s.segs.append(idx)
        s.acyc = [0] * self.p.acyc_words

    def anchor_if_empty(self, cfa: int, probe: int) -> None:
        s = self.s
        unknown = not s.pieces and bool(s.flags & ST_INCOMPLETE_BASE)
        if s.pieces:
            unknown = s.pieces[-1].kind in (K_EXIT, K_TAILEXIT)
        if unknown:
            self.push_segment(cfa, self.word(cfa - 8), probe, NONE32)

    # ---------------------------------------------------------------------------- programs
    def site_probe(self, probe: int, cfa: int, sp: int) -> None:
        """``cc_site_probe`` on a call instruction: ``cfa`` the caller's CFA as the site's rule gives
        it, ``sp`` the stack pointer at the call (the callee's CFA)."""
        si = self.sites[probe]
        self.cut(cfa)
        self.anchor_if_empty(cfa, probe)
        ret = (si["ret_vaddr"] + self.s.bias) & M64
        if si["flags"] & F_EXIT:
            self.push(sp, ret, probe, K_EXIT, si["callsite"])
        else:
            self.edge(si, sp, ret, probe, K_CALL)

    def entry_probe(self, probe: int, cfa: int) -> None:
        """``cc_entry_probe`` at a root function's entry (``cfa`` = sp + 8 there)."""
        si = self.sites[probe]
        s = self.s
        ra = self.word(cfa - 8)
        rs = self.rets.get((ra - s.bias) & M64)
        site_cs = NONE32
        if rs is not None:
            cs = rs & RS_INDEX
            if rs & (RS_INDIRECT | RS_VIA_PLT):
                site_cs = cs
            else:
                g = self.cs_callee[cs] if cs < len(self.cs_callee) else NONE32
                if g != NONE32 and (g == si["node"] or (g, si["node"]) in self.tail_reach):
                    if (rs & RS_IN_SCOPE) or not si["flags"] & F_SCOPE:
                        return
                else:
                    site_cs = cs
        self.cut(cfa)
        aux = NONE32
        if s.pieces:
            top = s.pieces[-1]
            if top.probe == probe and top.sp == cfa and top.ret == ra and top.kind in (K_ROOT, K_SEG):
                return
            if top.kind in (K_EXIT, K_TAILEXIT) and (top.sp - cfa) & M64 < STACK_SWITCH_GAP:
                aux = top.aux
        self.cut(cfa + 1)
        n = len(s.pieces)
        if site_cs != NONE32:
            aux = site_cs if (n > 0 or not s.flags & ST_INCOMPLETE_BASE) else NONE32
        elif si["flags"] & F_SCOPE:
            aux = NONE32
        elif n == 0 and not s.flags & ST_INCOMPLETE_BASE:
            self.push(cfa, ra, probe, K_ROOT, NONE32)
            self.apply_acyc(si)
            return
        self.push_segment(cfa, ra, probe, aux)


class Seeder:
    """Replays a thread's unwound stack as the probe events of one probe plan (see module doc)."""

    def __init__(self, probe_plan: ProbePlan, sites: Sequence[Mapping[str, Any]], rets: Mapping[int, int],
                 cs_callee: Sequence[int], tail_reach: set[tuple[int, int]], params: SeedParams) -> None:
        self.pp = probe_plan
        self.sites = sites
        self.rets = rets
        self.cs_callee = cs_callee
        self.tail_reach = tail_reach
        self.params = params
        self._functions = FunctionIndex(probe_plan.functions)
        self._site_probe: dict[int, int] = {}  # call instruction vaddr -> site probe id
        self._entry_probe: dict[int, int] = {}  # node -> entry probe id
        self._tail_sites = False
        for i, p in enumerate(probe_plan.probes):
            if p[PCOL["kind"]] == "site":
                self._site_probe[p[PCOL["vaddr"]]] = i
            elif p[PCOL["kind"]] == "entry":
                self._entry_probe[p[PCOL["node"]]] = i
        self._call_at_ret: dict[int, int] = {}  # return address vaddr -> callsite id
        tail_into: dict[int, set[int]] = {}
        for i, c in enumerate(probe_plan.callsites):
            if c[CCOL["is_jump"]]:
                if c[CCOL["target"]] is not None:
                    tail_into.setdefault(int(c[CCOL["target"]]), set()).add(int(c[CCOL["caller"]]))
                continue
            self._call_at_ret[c[CCOL["vaddr"]] + c[CCOL["length"]]] = i
        self._tail_into = tail_into
        self._preds: dict[int, set[int]] = {}
        self._probed_nodes = {p[PCOL["node"]] for p in probe_plan.probes
                              if p[PCOL["kind"]] in ("tail", "entry")}
        st = os.stat(probe_plan.binary["path"])
        self.identity = (st.st_dev, st.st_ino)

    def function_at(self, vaddr: int) -> int | None:
        return self._functions.at(vaddr)

    def _tail_predecessors(self, node: int) -> set[int]:
        got = self._preds.get(node)
        if got is None:
            got = self._preds[node] = self._walk_tail_predecessors(node)
        return got

    def _walk_tail_predecessors(self, node: int) -> set[int]:
        seen: set[int] = set()
        todo = [node]
        while todo:
            for u in self._tail_into.get(todo.pop(), ()):
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
        return seen

    def in_binary(self, m: ModuleMapping | None, cache: dict[str, bool]) -> bool:
        if m is None:
            return False
        got = cache.get(m.open_path)
        if got is None:
            try:
                st = os.stat(m.open_path)
                got = (st.st_dev, st.st_ino) == self.identity
            except OSError:
                got = False
            cache[m.open_path] = got
        return got

    def seed(self, stack: UnwoundStack, read_word: WordReader) -> SeedState:
        """The state the probes would hold for ``stack`` (raises :class:`SeedError` when unknown)."""
        if not stack.complete:
            raise SeedError(f"unwind incomplete ({stack.reason})")
        frames = stack.frames
        cache: dict[str, bool] = {}
        binary = [self.in_binary(f.module, cache) for f in frames]
        model = StateModel(self.sites, self.rets, self.cs_callee, self.tail_reach, self.params, read_word)
        bias = next((f.module.bias for f, b in zip(frames, binary, strict=True) if b and f.module), None)
        if bias is None:
            return model.s  # no frame of the binary: nothing recorded, complete
        model.s.bias = bias
        model.s.flags |= ST_BIAS
        for k in range(len(frames) - 1):
            caller, callee = frames[k], frames[k + 1]
            direct_target: int | None = None
            if binary[k] and not caller.exact and caller.vaddr is not None:
                cs = self._call_at_ret.get(caller.vaddr)
                if cs is None:
                    raise SeedError(f"no call instruction before {caller.vaddr:#x}")
                c = self.pp.callsites[cs]
                probe = self._site_probe.get(c[CCOL["vaddr"]])
                if c[CCOL["kind"]] == "direct" and c[CCOL["target"]] is not None:
                    direct_target = int(c[CCOL["target"]])
                if probe is not None:
                    if caller.cfa is None or callee.cfa is None:
                        raise SeedError("frame without a CFA")
                    si = self.sites[probe]
                    sp = callee.cfa
                    if si["cfa_reg"] == 7:
                        cfa = sp + si["cfa_off"]
                    elif si["cfa_reg"] == 6:
                        cfa = caller.cfa  # rbp + k at the call: the frame's CFA
                    else:
                        cfa = sp + 8
                    model.site_probe(probe, cfa, sp)
            if not binary[k + 1] or callee.vaddr is None:
                if direct_target is not None:
                    raise SeedError("a direct call of the binary continued outside it (tail jump)")
                continue
            node = self.function_at(callee.vaddr if callee.exact else callee.vaddr - 1)
            if node is None:
                continue  # PLT stubs and code outside analysed functions carry no probe
            if direct_target is not None and direct_target != node:
                raise SeedError(f"frame of {self.pp.names.get(node, node)} reached by tail jumps")
            preds = self._tail_predecessors(node)
            # A direct call of this very function took no tail jump unless one can lead back to it;
            # an indirect call or an entry from outside may have landed in any tail predecessor.
            maybe_tail = node in preds if direct_target is not None else bool(preds)
            if maybe_tail and preds & self._probed_nodes:
                raise SeedError(f"{self.pp.names.get(node, node)} may have been reached by probed tail jumps")
            probe = self._entry_probe.get(node)
            if probe is None:
                continue
            if callee.exact and callee.vaddr <= self.pp.probes[probe][PCOL["vaddr"]]:
                continue  # stopped before its entry probe's instruction ran
            if callee.cfa is None:
                raise SeedError("frame without a CFA")
            model.entry_probe(probe, callee.cfa)
        return model.s


def state_blob(s: SeedState, params: SeedParams, size: int) -> bytes:
    """``struct cc_state`` bytes (layout of instrumented.c / instrumented.py's size computation)."""
    w = params.acyc_words
    head = struct.pack(f"<4IQQIIQ{w}Q", len(s.pieces), s.rec_len, len(s.segs), s.flags, 0, s.bias, 0, 0, 0,
                       *s.acyc)
    segs = struct.pack(f"<{params.max_segs}I", *(s.segs + [0] * (params.max_segs - len(s.segs))))
    out = bytearray(size)
    out[:len(head)] = head
    out[len(head):len(head) + len(segs)] = segs
    rec_off = (len(head) + len(segs) + 7) // 8 * 8
    rec = s.rec.to_bytes(8 * params.rec_words, "little")
    out[rec_off:rec_off + len(rec)] = rec
    off = rec_off + len(rec)
    piece = struct.Struct(f"<QQ6I{w}Q")
    for p in s.pieces:
        piece.pack_into(out, off, p.sp, p.ret, p.probe, p.aux, p.kind, p.rec_before, p.nsegs_before, 0,
                        *p.acyc_before)
        off += piece.size
    if off > size:
        raise SeedError("state larger than its BPF slot")
    return bytes(out)


def seeder_for(bpf: Any) -> tuple[Seeder, SeedParams]:
    """A :class:`Seeder` over a loaded :class:`~ccprofd.tracing.instrumented.loader.InstrumentedBPF`'s
    tables."""
    pp: ProbePlan = bpf.probe_plan
    sc = bpf.scheme
    params = SeedParams(pp.acyc_words, sc.add, sc.pairs, sc.id_bits, sc.rec_bits, sc.pair_code_bits,
                        sc.pair_id_bits, bpf.limits.max_pieces, bpf.limits.max_segments, bpf.rec_words)
    dense = dense_nodes(pp)
    cs_callee = [dense[c[CCOL["target"]]]
                 if c[CCOL["kind"]] in ("direct", "tail") and c[CCOL["target"]] in dense else NONE32
                 for c in pp.callsites]
    tail_reach = {(dense[g], dense[f]) for g, f in pp.tail_entries}
    return Seeder(pp, bpf.sites, dict(ret_table(pp)), cs_callee, tail_reach, params), params


def seed_process(bpf: Any, pid: int, *, cache_dir: str | None = None,
                 start_tracking: Callable[[], None] | None = None) -> dict[int, str | None]:
    """Stop each thread of ``pid`` once, unwind it and write the state the probes would hold into its
    slot; tid -> None when seeded (its contexts complete from now on), else why not (left flagged).

    ``start_tracking`` (give the threads their slots, let the sampler follow the process) runs once
    every thread is stopped, before the first is seeded: no event falls between the two."""
    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.proc.modules import ModuleCache
    from ccprofd.proc.threadsnap import ThreadSnapshot, snapshot

    seeder, params = seeder_for(bpf)
    out: dict[int, str | None] = {}

    started = False

    def write(th: ThreadSnapshot, read_word: WordReader) -> None:
        nonlocal started
        if not started:
            started = True
            if start_tracking is not None:
                start_tracking()
        if th.stack is None:
            out[th.tid] = th.error or "no registers"
            return
        try:
            state = seeder.seed(th.stack, read_word)
            ok = bpf.write_state(th.tid, state_blob(state, params, bpf.state_bytes))
            out[th.tid] = None if ok else NO_STATE
        except SeedError as exc:
            out[th.tid] = str(exc)
        except (KeyError, IndexError, ValueError, OSError) as exc:  # a table the model did not expect
            out[th.tid] = f"seeding failed: {type(exc).__name__}: {exc}"

    from pathlib import Path

    with ModuleCache(AnalysisCache(Path(cache_dir)) if cache_dir else None) as modules:
        snap = snapshot(pid, modules, while_stopped=write)
    if snap.error is not None:
        return {0: snap.error}
    return out


__all__ = ["SeedError", "SeedParams", "SeedState", "Seeder", "StateModel", "state_blob"]
