"""PCCE and HCCE decoding: find the incoming edge whose range ``[En(e), En(e) + numCC(p))`` holds
the id (binary search over the node's ascending ``En`` list), subtract, step to the caller.

PCCE: reaching the dummy edge ``D -> t`` means a back edge into ``t`` was taken: pop ``(saved id,
back-edge code)`` and continue at the back edge's caller with the saved id.
HCCE: as Valence's Algorithm 4, but acyclic steps use PCCE ranges on the consolidated graph.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from typing import Any

from ccprofd.decode.common import BaseDecoder, DecodeError, check_heights
from ccprofd.encode.bits import mask, words_to_int
from ccprofd.encode.pcce import NO_DUMMY
from ccprofd.encode.segments import Edge, EncodedState

Ranges = tuple[list[int], list[int]]  # (ascending En starts, edge ids; NO_DUMMY for the dummy edge)


def _ranges(incoming: list[list[list[int]]]) -> list[Ranges]:
    return [([en for en, _ in rows], [e for _, e in rows]) for rows in incoming]


class PcceDecoder(BaseDecoder):
    scheme = "pcce"

    def __init__(self, plan: Mapping[str, Any]) -> None:
        super().__init__(plan)
        t = plan["tables"]
        self.ranges = _ranges(t["incoming"])
        self.numcc: list[int] = list(t["numcc"])
        self.back_map: list[int] = list(t["back_map"])

    def _decode(self, state: EncodedState, node: int, out: list[Edge], marks: list[int]) -> list[Edge]:
        m = self.dense(node)
        ident = words_to_int(state.acyc)
        pairs = state.pairs
        ph = len(pairs)
        segs = state.segments
        si = len(segs) - 1
        floor = segs[si].rec_height if si >= 0 else 0
        check_heights(segs, ph)
        numcc, ranges, caller, callee, edge = self.numcc, self.ranges, self.caller, self.callee, self.edge
        if ident >= numcc[m]:
            raise DecodeError(f"id {ident} out of range for node {node} (numCC {numcc[m]})")
        while True:
            if si >= 0 and ph == floor and m == self.index.get(segs[si].callee):
                sg = segs[si]
                if ident:
                    raise DecodeError("id not back at 0 at a segment's start")
                p = self.segment_caller(sg, out)
                marks.append(len(out))
                out.append((self.nodes[p], sg.callee, sg.site))
                m = p
                ident = words_to_int(sg.saved)
                if ident >= numcc[m]:
                    raise DecodeError("saved id out of range for its node")
                si -= 1
                floor = segs[si].rec_height if si >= 0 else 0
                continue
            if m == self.root and si < 0:
                if ident or ph:
                    raise DecodeError("id or back-edge stack not empty at the root")
                break
            starts, eids = ranges[m]
            i = bisect_right(starts, ident) - 1
            e = eids[i]
            if e == NO_DUMMY:
                if ident != starts[i] or m == self.root:
                    raise DecodeError(f"id {ident} is not a context of node {self.nodes[m]}")
                if ph <= floor:
                    raise DecodeError(f"dummy edge into {self.nodes[m]} but no back-edge entry to pop")
                saved, code = pairs[ph - 1]
                ph -= 1
                if not 0 <= code < len(self.back_map):
                    raise DecodeError(f"back-edge code {code} unknown")
                e = self.back_map[code]
                if callee[e] != m:
                    raise DecodeError(f"back edge {edge[e]} does not end at {self.nodes[m]}")
                out.append(edge[e])
                m = caller[e]
                ident = words_to_int(saved)
                if ident >= numcc[m]:
                    raise DecodeError("saved id out of range for its node")
                continue
            ident -= starts[i]
            p = caller[e]
            if ident >= numcc[p]:
                raise DecodeError(f"id falls in no incoming edge's range at {self.nodes[m]}")
            out.append(edge[e])
            m = p
        out.reverse()
        return out


class HcceDecoder(BaseDecoder):
    scheme = "hcce"

    def __init__(self, plan: Mapping[str, Any]) -> None:
        super().__init__(plan)
        t = plan["tables"]
        comp_ranges = _ranges(t["incoming"])
        comp_numcc: list[int] = t["numcc"]
        comp_of: list[int] = t["comp_of"]
        self.ranges = [comp_ranges[c] for c in comp_of]
        self.numcc = [comp_numcc[c] for c in comp_of]
        self.rec_map: list[int] = list(t["rec_map"])
        self.rec_bits: int = t["rec_code_bits"]

    def _decode(self, state: EncodedState, node: int, out: list[Edge], marks: list[int]) -> list[Edge]:
        m = self.dense(node)
        ident = words_to_int(state.acyc)
        rec, rl = state.rec, state.rec_len
        segs = state.segments
        si = len(segs) - 1
        floor = segs[si].rec_height if si >= 0 else 0
        check_heights(segs, rl)
        rcl = self.rec_bits
        rmask = mask(rcl)
        numcc, ranges, caller, callee, edge, rec_map = (self.numcc, self.ranges, self.caller, self.callee,
                                                        self.edge, self.rec_map)
        if ident >= numcc[m]:
            raise DecodeError(f"id {ident} out of range for node {node}")
        while True:
            at_seg = si >= 0 and m == self.index.get(segs[si].callee)
            if at_seg and rl == floor:
                sg = segs[si]
                if ident:
                    raise DecodeError("id not back at 0 at a segment's start")
                p = self.segment_caller(sg, out)
                marks.append(len(out))
                out.append((self.nodes[p], sg.callee, sg.site))
                m = p
                ident = words_to_int(sg.saved)
                if ident >= numcc[m]:
                    raise DecodeError("saved id out of range for its node")
                si -= 1
                floor = segs[si].rec_height if si >= 0 else 0
                continue
            if m == self.root and si < 0:
                if ident or rl:
                    raise DecodeError("id or recID not empty at the root")
                break
            if rl > floor:
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
                if at_seg:
                    raise DecodeError("segment start reached with recID above the segment's height")
            starts, eids = ranges[m]
            i = bisect_right(starts, ident) - 1
            e = eids[i]
            if e == NO_DUMMY:
                raise DecodeError(f"id {ident} is not a context of node {self.nodes[m]}")
            ident -= starts[i]
            p = caller[e]
            if ident >= numcc[p] or callee[e] != m:
                raise DecodeError(f"id does not decode to an edge into {self.nodes[m]}")
            out.append(edge[e])
            m = p
        out.reverse()
        return out
