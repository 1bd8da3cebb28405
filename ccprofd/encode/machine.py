"""The encoder state machine: the reference semantics of the probes, driven by a plan alone.

The BPF programs (a later issue) must behave exactly like this class: ``call`` applies the probe
before a call site, ``ret`` undoes it after the site the way the paper's instrumentation does
(reset the bit range / subtract / pop), segments save and clear the acyclic state, and ``unwind``
restores a state saved at an earlier frame, as setjmp/longjmp and exception unwinding need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ccprofd.callgraph.model import ROOT
from ccprofd.encode.bits import int_to_words, mask, set_bits, words_to_int
from ccprofd.encode.plan import COL, R_CYCLIC, check_plan
from ccprofd.encode.segments import OUTSIDE, Edge, EncodedState, Segment
from ccprofd.encode.stacktags import mix


class EncodingOverflow(OverflowError):
    """A PCCE/HCCE id outgrew ``pcce_words``: reported, never wrapped."""


@dataclass(frozen=True, slots=True)
class _Checkpoint:
    acyc: tuple[int, ...]
    rec: int
    rec_len: int
    pairs: int
    segments: int
    tag: int


@dataclass(frozen=True, slots=True)
class _Frame:
    site_id: int  # -1 for a segment frame
    callee: int
    before: _Checkpoint


class Encoder:
    """One thread's encoding state under a plan."""

    def __init__(self, plan: Mapping[str, Any]) -> None:
        check_plan(plan)
        self.scheme: str = plan["scheme"]
        self.plan = plan
        rows = plan["sites"]
        self._site_of: dict[Edge, int] = {(r[COL["caller"]], r[COL["callee"]], r[COL["site"]]): i
                                          for i, r in enumerate(rows)}
        self._rows = rows
        self._rec_bits: int = plan["rec_code_bits"]
        self._words: int = plan["acyc_words"]
        self._ids: dict[int, int] = (dict(zip(plan["nodes"], plan["tables"]["ids"], strict=True))
                                     if self.scheme == "stacktags" else {})
        self.acyc: list[int] = [0] * self._words
        self.rec = 0
        self.rec_len = 0
        self.pairs: list[tuple[tuple[int, ...], int]] = []
        self.segments: list[Segment] = []
        self.tag = 0
        self.frames: list[_Frame] = []

    # -------------------------------------------------------------------------------- queries
    @property
    def node(self) -> int:
        """The function executing now (ROOT before the first call)."""
        return self.frames[-1].callee if self.frames else ROOT

    @property
    def depth(self) -> int:
        return len(self.frames)

    def state(self) -> EncodedState:
        return EncodedState(acyc=tuple(self.acyc), rec=self.rec, rec_len=self.rec_len,
                            pairs=tuple(self.pairs), segments=tuple(self.segments), tag=self.tag)

    def site_id(self, edge: Edge) -> int:
        try:
            return self._site_of[edge]
        except KeyError:
            raise KeyError(f"edge {edge} is not in the plan") from None

    # ----------------------------------------------------------------------------- operations
    def call(self, edge: Edge) -> None:
        """Take the graph edge ``(caller, callee, site)``; the caller must be the current node."""
        caller, callee, _ = edge
        if caller != self.node:
            raise ValueError(f"call from {caller} while executing {self.node}")
        sid = self.site_id(edge)
        row = self._rows[sid]
        before = self._checkpoint()
        s = self.scheme
        if s == "stacktags":
            self.tag = mix(self.tag, self._ids[callee])
        elif s == "valence":
            if row[COL["reasons"]] & R_CYCLIC:
                self._push_rec(row[COL["rec_code"]])
            elif row[COL["code"]]:
                set_bits(self.acyc, row[COL["lo"]], row[COL["hi"]], row[COL["code"]])
        elif s == "pcce" and row[COL["rec_code"]] is not None:
            new = self._fit(row[COL["code"]])
            self.pairs.append((tuple(self.acyc), row[COL["rec_code"]]))
            self.acyc = new
        elif s == "hcce" and row[COL["reasons"]] & R_CYCLIC:
            self._push_rec(row[COL["rec_code"]])
        elif row[COL["code"]]:  # pcce / hcce forward edge
            self.acyc = self._fit(words_to_int(self.acyc) + row[COL["code"]])
        self.frames.append(_Frame(sid, callee, before))

    def enter_from_outside(self, callee: int) -> None:
        """``callee`` is entered from code ccprofd did not analyse: push a segment."""
        self._segment(OUTSIDE, callee)

    def unencoded_call(self, site: int, callee: int) -> None:
        """A call the plan has no edge for (e.g. an indirect call): push a segment."""
        if site < 0:
            raise ValueError("an unencoded call needs its call-site address")
        self._segment(site, callee)

    def ret(self) -> None:
        """Return from the innermost frame, undoing its probe as the instrumentation after the site does."""
        if not self.frames:
            raise IndexError("return with no active frame")
        fr = self.frames.pop()
        s = self.scheme
        if s == "stacktags":
            self.tag = fr.before.tag  # the tag saved in the callee's frame
            return
        if fr.site_id < 0:
            seg = self.segments.pop()
            self.acyc = list(seg.saved)
            return
        row = self._rows[fr.site_id]
        if s == "valence":
            if row[COL["reasons"]] & R_CYCLIC:
                self._pop_rec()
            elif row[COL["code"]]:
                set_bits(self.acyc, row[COL["lo"]], row[COL["hi"]], 0)
        elif s == "pcce" and row[COL["rec_code"]] is not None:
            saved, _ = self.pairs.pop()
            self.acyc = list(saved)
        elif s == "hcce" and row[COL["reasons"]] & R_CYCLIC:
            self._pop_rec()
        elif row[COL["code"]]:
            self.acyc = self._fit(words_to_int(self.acyc) - row[COL["code"]])

    def unwind(self, frames: int) -> None:
        """Discard ``frames`` frames at once (longjmp, exception) and restore the state saved there."""
        if not 1 <= frames <= len(self.frames):
            raise IndexError(f"cannot unwind {frames} of {len(self.frames)} frames")
        cp = self.frames[-frames].before
        del self.frames[-frames:]
        self.acyc = list(cp.acyc)
        self.rec, self.rec_len = cp.rec, cp.rec_len
        del self.pairs[cp.pairs:]
        del self.segments[cp.segments:]
        self.tag = cp.tag

    # ------------------------------------------------------------------------------ internals
    def _checkpoint(self) -> _Checkpoint:
        return _Checkpoint(tuple(self.acyc), self.rec, self.rec_len, len(self.pairs), len(self.segments),
                           self.tag)

    def _segment(self, site: int, callee: int) -> None:
        before = self._checkpoint()
        if self.scheme == "stacktags":
            self.tag = mix(self.tag, self._ids[callee])
        else:
            height = len(self.pairs) if self.scheme == "pcce" else self.rec_len
            self.segments.append(Segment(saved=tuple(self.acyc), rec_height=height, site=site, callee=callee,
                                         caller=self.node))
            self.acyc = [0] * self._words
        self.frames.append(_Frame(-1, callee, before))

    def _fit(self, value: int) -> list[int]:
        try:
            return list(int_to_words(value, self._words))
        except OverflowError as exc:
            need = self.plan["report"].get("words_needed")
            raise EncodingOverflow(f"{self.scheme} id {value:#x} does not fit in {self._words} words; "
                                   f"the plan reports words_needed={need}") from exc

    def _push_rec(self, code: int) -> None:
        self.rec |= code << self.rec_len
        self.rec_len += self._rec_bits

    def _pop_rec(self) -> None:
        self.rec_len -= self._rec_bits
        self.rec &= mask(self.rec_len)
