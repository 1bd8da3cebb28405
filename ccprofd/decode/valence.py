"""Valence decoding: Algorithm 4 (recID first when its top edge ends at the current node) with
Algorithm 2 for the acyclic steps, each step O(1) through the per-component ``ccMap`` lists."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cached_property
from typing import Any

from ccprofd.decode.common import BaseDecoder, DecodeError, check_heights
from ccprofd.encode.bits import mask, words_to_int
from ccprofd.encode.segments import Edge, EncodedState

# The compiled acyclic loop (cvalence.c, built by scripts/build_ext.sh at set-up): the same steps in
# 64-bit words; whatever it cannot decode exactly it leaves to _acyclic's Python loop (the
# reference, which raises the errors).  CCPROFD_PURE_PYTHON=1 leaves it out.
try:
    if os.environ.get("CCPROFD_PURE_PYTHON"):
        raise ImportError("CCPROFD_PURE_PYTHON is set")
    import ccprofd.decode.cvalence as cvalence  # type: ignore[import-not-found, unused-ignore]
except ImportError:
    cvalence = None

# per component: (level, lvLow, lvMask, groups) with groups[lvCode] = (parent level, edge-code mask,
# edge ids by edge code)
CompTable = tuple[int, int, int, list[tuple[int, int, list[int]]]]


class ValenceDecoder(BaseDecoder):
    scheme = "valence"

    def __init__(self, plan: Mapping[str, Any]) -> None:
        super().__init__(plan)
        t = plan["tables"]
        self.rec_map: list[int] = list(t["rec_map"])
        self.rec_bits: int = t["rec_code_bits"]

    @cached_property
    def node_table(self) -> list[CompTable]:
        """Per dense node, its component's decode table (made at the first decode, not at start-up)."""
        comps: list[CompTable] = []
        for level, lvlen, groups in self.plan["tables"]["comps"]:
            lv_low = level - lvlen
            comps.append((level, lv_low, mask(lvlen),
                          [(pl, mask(lv_low - pl), list(edges)) for pl, edges in groups]))
        comp_of: list[int] = self.plan["tables"]["comp_of"]
        return [comps[c] for c in comp_of]

    def _decode(self, state: EncodedState, node: int, out: list[Edge], marks: list[int]) -> list[Edge]:
        m = self.dense(node)
        acyc = words_to_int(state.acyc)
        rec, rl = state.rec, state.rec_len
        segs = state.segments
        si = len(segs) - 1
        floor = segs[si].rec_height if si >= 0 else 0
        check_heights(segs, rl)
        rcl = self.rec_bits
        rmask = mask(rcl)
        rec_map, callee, caller, edge = self.rec_map, self.callee, self.caller, self.edge
        table = self.node_table
        root = self.root
        if acyc >> table[m][0]:
            raise DecodeError(f"acycID has bits above level {table[m][0]} of node {node}")
        if si < 0 and not rl:  # no segment, no recID (an acyclic chain): Algorithm 2 steps only
            return self._acyclic(m, acyc, out)
        while True:
            if si >= 0 and m == self.index.get(segs[si].callee):
                if rl == floor:
                    sg = segs[si]
                    if acyc & mask(table[m][0]):
                        raise DecodeError("acycID not cleared at a segment's start")
                    p = self.segment_caller(sg, out)
                    marks.append(len(out))
                    out.append((self.nodes[p], sg.callee, sg.site))
                    m = p
                    acyc = words_to_int(sg.saved)
                    if acyc >> table[m][0]:
                        raise DecodeError("saved acycID has bits above its node's level")
                    si -= 1
                    floor = segs[si].rec_height if si >= 0 else 0
                    continue
            elif m == root and si < 0:
                if rl:
                    raise DecodeError(f"{rl} recID bits left at the root")
                break
            if rl > floor:  # Algorithm 4: unwind recID first when its top edge ends at m
                if rl - floor < rcl:
                    raise DecodeError("recID height is not a multiple of the code length")
                code = (rec >> (rl - rcl)) & rmask
                if code >= len(rec_map):
                    raise DecodeError(f"recID code {code} is not a cyclic edge")
                e = rec_map[code]
                if callee[e] == m:
                    rl -= rcl
                    out.append(edge[e])
                    m = caller[e]
                    continue
                if si >= 0 and m == self.index.get(segs[si].callee):
                    raise DecodeError("segment start reached with recID above the segment's height")
            # Algorithm 2 step
            _, lv_low, lv_mask, groups = table[m]
            if not groups:
                raise DecodeError(f"no incoming acyclic edge at node {self.nodes[m]}")
            lv_code = (acyc >> lv_low) & lv_mask
            if lv_code >= len(groups):
                raise DecodeError(f"level code {lv_code} unknown at node {self.nodes[m]}")
            pl, e_mask, edges = groups[lv_code]
            e_code = (acyc >> pl) & e_mask
            if e_code >= len(edges):
                raise DecodeError(f"edge code {e_code} unknown at node {self.nodes[m]}")
            e = edges[e_code]
            if callee[e] != m:
                raise DecodeError(f"acyclic code names an edge into {self.nodes[callee[e]]}, "
                                  f"not {self.nodes[m]}")
            out.append(edge[e])
            m = caller[e]
        out.reverse()
        return out

    def decode_acyclic(self, acyc: tuple[int, ...], node: int) -> list[Edge] | None:
        """:meth:`_decode`'s first steps for a state without segments and recID, then its acyclic
        loop: the same path and the same errors, without an EncodedState (a new context's
        record is decoded once, so building and hashing one for a cache is pure cost)."""
        m = self.dense(node)
        a = words_to_int(acyc)
        level = self.node_table[m][0]
        if a >> level:
            raise DecodeError(f"acycID has bits above level {level} of node {node}")
        return self._acyclic(m, a, [])

    def _acyclic(self, m: int, acyc: int, out: list[Edge]) -> list[Edge]:
        """The main loop of :meth:`_decode` once nothing but acyclic steps remain (no segment left,
        recID empty): the same steps and checks, without the segment and recID tests."""
        if cvalence is not None:
            got: list[Edge] | None = cvalence.acyclic(m, acyc, out, self.node_table, self.callee, self.caller,
                                                      self.edge, self.root)
            if got is not None:
                return got
        callee, caller, edge = self.callee, self.caller, self.edge
        table = self.node_table
        root = self.root
        while m != root:
            _, lv_low, lv_mask, groups = table[m]
            lv_code = (acyc >> lv_low) & lv_mask  # codes are masked, never negative: an index past
            try:  # the end is the only bad one, and IndexError says so without a len() per step
                pl, e_mask, edges = groups[lv_code]
            except IndexError:
                if not groups:
                    raise DecodeError(f"no incoming acyclic edge at node {self.nodes[m]}") from None
                raise DecodeError(f"level code {lv_code} unknown at node {self.nodes[m]}") from None
            e_code = (acyc >> pl) & e_mask
            try:
                e = edges[e_code]
            except IndexError:
                raise DecodeError(f"edge code {e_code} unknown at node {self.nodes[m]}") from None
            if callee[e] != m:
                raise DecodeError(f"acyclic code names an edge into {self.nodes[callee[e]]}, "
                                  f"not {self.nodes[m]}")
            out.append(edge[e])
            m = caller[e]
        out.reverse()
        return out
