"""Symbolisation: an instrumented-mode sample -> decoded path -> JSON frames (outermost first).

Input: a :class:`~ccprofd.tracing.instrumented.loader.RawContext` (where the thread is and its
encoded context),
the probe plan (call sites, function ranges, names) and the encoding plan (for the decoder).  Output:
:class:`Frame` values in the issue-4 format.  Nothing here reads the binary or the call graph.

How a sample becomes a path:

* the *current node* is the function holding the sampled instruction pointer when it is in the
  binary, else the function that left the binary through the innermost recorded exit (a PLT call,
  a call through an import's GOT slot, a tail jump into the PLT); otherwise the node is not known and
  only the context of the innermost recorded piece is reported (``complete: false``);
* segments become :class:`~ccprofd.encode.segments.Segment` records whose ``site`` is the call site
  the binary left through (so the frame below a callback names it, and an ``analysed: false`` frame
  for the library function in between is inserted) or ``OUTSIDE`` when unknown (then the decoder
  stops there and the sample is incomplete);
* the decoder (``decoder_for(plan)``) returns ``[(caller, callee, site), ...]``; each edge's site
  gives the caller frame's ``call_site``/``return_address`` (``tail_call`` for jumps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ccprofd.callgraph.model import ROOT
from ccprofd.decode import CachingDecoder, DecodeError, StaleAboveSegment, UnknownCaller, decoder_for
from ccprofd.elf.debugfile import DebugFileLocator
from ccprofd.encode.segments import OUTSIDE, Edge, EncodedState, Segment
from ccprofd.persist.cache import AnalysisCache
from ccprofd.tracing.frames import Decoded, Frame, demangle
from ccprofd.tracing.instrumented.constants import NO_STATE, SF_BIAS, SF_FROZEN, SF_NOSTATE, SF_SEGS_TRUNC
from ccprofd.tracing.instrumented.loader import (
    EXIT_KINDS,
    INCOMPLETE_FLAGS,
    NONE32,
    SF_OVERFLOW,
    SF_REC_TRUNC,
    RawContext,
)
from ccprofd.tracing.instrumented.probeplan import CCOL, PCOL, R_SCOPE, FunctionIndex, ProbePlan
from ccprofd.tracing.symbols import ModuleSource

#: Reason of a sample whose state is not a valid encoding above a segment (a dead call's piece kept,
#: ccprofd/decode/common.py StaleAboveSegment): the frames inside the innermost segment are reported.
STALE_ABOVE_SEGMENT = "decode error above a segment"








class Symbolizer:
    """Decodes and symbolises samples of one probe plan (compiled once, cached per context)."""

    def __init__(self, probe_plan: ProbePlan, plan: Mapping[str, Any], source_lines: bool = False,
                 cache: AnalysisCache | None = None, shown_as: str | None = None) -> None:
        """``source_lines``: give the binary's frames their DWARF file/line/inlined calls (kept in
        ``cache``).  ``shown_as``: the module name of the binary's frames (base.shown_path), if not
        the plan's path."""
        self.pp = probe_plan
        self.plan = plan
        self.decoder = CachingDecoder(decoder_for(plan))
        self.module: str = shown_as or probe_plan.binary["path"]
        self.build_id: str | None = probe_plan.binary.get("build_id")
        pretty = demangle(probe_plan.names.values())
        self.names = {n: pretty.get(name, name) for n, name in probe_plan.names.items()}
        self._functions = FunctionIndex(probe_plan.functions)
        self._cs_index = {c[CCOL["vaddr"]]: i for i, c in enumerate(probe_plan.callsites)}
        self._rows = plan["sites"]
        self.errors = 0
        self._source = None
        if source_lines:
            locator = DebugFileLocator.from_env(cache.directory if cache is not None else None)
            self._source = ModuleSource(probe_plan.binary["path"], self.build_id, locator, cache)

    # ------------------------------------------------------------------------------- helpers
    def function_at(self, vaddr: int) -> int | None:
        return self._functions.at(vaddr)

    def _frame(self, node: int) -> Frame:
        return Frame(self.names.get(node, f"node_{node}"), self.module, self.build_id, True)

    def _outside(self, name: str | None) -> Frame:
        return Frame(name, None, None, False)

    def _callsite_name(self, index: int) -> str | None:
        """The library function a call site enters (PLT target or GOT import), if known."""
        tgt = self.pp.callsites[index][CCOL["target"]]
        if tgt is not None and tgt < 0 and tgt != ROOT:
            return self.names.get(tgt)
        return self.pp.imports.get(index)

    def _link(self, frames: list[Frame], site: int, into_binary: bool, callee: int | None = None) -> None:
        """Set the innermost frame's call site; when the callee was entered from library code the
        binary called at ``site``, add that library function's (unanalysed) frame."""
        prev = frames[-1]
        index = self._cs_index.get(site)
        if index is None:
            return
        cs = self.pp.callsites[index]
        prev.call_site = site
        if cs[CCOL["is_jump"]]:
            prev.tail_call = True
        else:
            prev.return_address = site + cs[CCOL["length"]]
        if into_binary:
            ext = self._callsite_name(index)
            if ext is not None and callee is not None and ext == self.pp.names.get(callee):
                return  # a PLT call of the binary's own exported function: no library frame between
            if ext is not None or cs[CCOL["kind"]] == "plt":
                frames.append(self._outside(ext))

    # -------------------------------------------------------------------------------- decode
    def state_of(self, s: RawContext) -> EncodedState:
        segs: list[Segment] = []
        probes, callsites = self.pp.probes, self.pp.callsites
        for i, seg in enumerate(s.segments):
            callee = probes[seg.probe][PCOL["node"]]
            unknown = seg.aux == NONE32 or (i == 0 and s.flags & SF_SEGS_TRUNC)
            if unknown:
                segs.append(Segment(seg.saved, seg.rec_height, OUTSIDE, callee, None))
            else:
                cs = callsites[seg.aux]
                segs.append(Segment(seg.saved, seg.rec_height, cs[CCOL["vaddr"]], callee, cs[CCOL["caller"]]))
        return EncodedState(acyc=s.acyc, rec=s.rec, rec_len=s.rec_len, pairs=s.pairs, segments=tuple(segs))

    def decode(self, s: RawContext) -> Decoded:
        got = self._decode(s)
        if self._source is not None:
            for f in got.frames:
                if f.analysed and f.call_site is not None:
                    f.set_source(self._source.at(f.call_site))
        return got

    def _decode(self, s: RawContext) -> Decoded:
        complete = not s.flags & INCOMPLETE_FLAGS
        reason = None if complete else f"flags={s.flags:#x}"
        if s.flags & SF_NOSTATE:  # every state slot was in use when the thread was created or attached
            return Decoded([], False, NO_STATE)
        if s.flags & SF_OVERFLOW:  # a PCCE/HCCE id outgrew its words: nothing below it is known
            return Decoded([], False, "id overflow")
        if self.pp.scope is not None and s.depth == 0:
            # --scope: nothing recorded means the thread is outside the scope, where calls carry no
            # probes -- its frames are not known (not "no analysed frame on the stack").
            return Decoded([], False, "outside the --scope functions")
        ipv = s.ip - s.bias if s.flags & SF_BIAS else None
        node = self.function_at(ipv) if ipv is not None else None
        exit_site: int | None = None
        if node is None:
            if s.top_kind in EXIT_KINDS and s.top_aux != NONE32:
                exit_cs = self.pp.callsites[s.top_aux]
                node = int(exit_cs[CCOL["caller"]])
                exit_site = exit_cs[CCOL["vaddr"]]
            elif s.depth == 0:
                return Decoded([], complete, reason)  # no analysed frame on the stack
            else:
                # The thread left the binary through a path with no probe: the recorded context is
                # only a prefix of the truth, and an incomplete sample reports innermost frames.
                return Decoded([], False, "left the binary through an unprobed path")
        if self.pp.scope is not None and not self._from_scope_entry(s):
            # --scope: the outermost thing recorded is not a scope function's entry, so the sample
            # is outside the scope (e.g. a function below the scope also called from outside it):
            # the calls that led here carry no probes, and decoding the state as if they had all
            # taken zero-code edges would name call sites that were not taken.  Only the current
            # function is known.
            frames = [self._frame(node)]
            if exit_site is not None:
                self._link(frames, exit_site, into_binary=False)
            elif ipv is not None and self.function_at(ipv) is not None:
                frames[-1].call_site = ipv
            return Decoded(frames, False, "outside the --scope functions")
        if s.flags & SF_FROZEN:
            # Deeper than the per-thread bound: only the outermost frames are recorded (a prefix).
            return Decoded([], False, "per-thread state full")
        if s.flags & SF_REC_TRUNC:
            path = self._innermost_recursion(s, node)
            frames = self.frames_of(path, node)
            if exit_site is not None:
                self._link(frames, exit_site, into_binary=False)
            return Decoded(frames, False, "recID larger than a sample carries")
        try:
            path = self.decoder.decode(self.state_of(s), node)
        except UnknownCaller as exc:
            path, complete, reason = exc.partial, False, "caller of a segment unknown"
        except StaleAboveSegment as exc:
            # counted as a decode error, reported as what is known: the frames inside the segment
            self.errors += 1
            path, complete, reason = exc.partial, False, f"{STALE_ABOVE_SEGMENT}: {exc}"
        except DecodeError as exc:
            self.errors += 1
            return Decoded([], False, f"decode error: {exc}")
        frames = self.frames_of(path, node)
        inner = frames[-1]
        if exit_site is not None:
            self._link(frames, exit_site, into_binary=False)
        elif ipv is not None and self.function_at(ipv) is not None:
            inner.call_site = ipv  # the syscall (or sampled) instruction itself
        return Decoded(frames, complete, reason)

    def _from_scope_entry(self, s: RawContext) -> bool:
        """The sample's outermost recorded segment is the entry of a --scope function."""
        if not s.segments or s.flags & SF_SEGS_TRUNC:
            return False
        return bool(self.pp.probes[s.segments[0].probe][PCOL["reasons"]] & R_SCOPE)

    def _innermost_recursion(self, s: RawContext, node: int) -> list[Edge]:
        """When only the top of recID was sent: the innermost cyclic edges it names, as long as each
        ends at the current node (Algorithm 4's recID step); the rest of the path is unknown."""
        dec = self.decoder.decoder
        rec_map: list[int] = self.plan["tables"].get("rec_map", [])
        bits = int(self.plan["rec_code_bits"])
        if not bits or node not in dec.index:
            return []
        floor = max([seg.rec_height for seg in s.segments] + [s.rec_base * 64])
        m = dec.index[node]
        out: list[Edge] = []
        pos = s.rec_len
        while pos - bits >= floor:
            code = (s.rec >> (pos - bits - s.rec_base * 64)) & ((1 << bits) - 1)
            if code >= len(rec_map) or dec.callee[rec_map[code]] != m:
                break
            e = rec_map[code]
            out.append(dec.edge[e])
            m = dec.caller[e]
            pos -= bits
        out.reverse()
        return out

    def frames_of(self, path: list[Edge], node: int) -> list[Frame]:
        """Frames for a decoded path ending at ``node`` (outermost first)."""
        if not path:
            return [self._frame(node)]
        start = 0
        if path[0][0] == ROOT:
            first = path[0][1]
            start = 1
        else:
            first = path[0][0]
        frames = [self._frame(first)]
        for _caller, callee, site in path[start:]:
            if site == OUTSIDE:
                frames.append(self._outside(None))
            elif site:
                self._link(frames, site, into_binary=True, callee=callee)
            frames.append(self._frame(callee))
        return frames
