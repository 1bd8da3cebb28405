"""Valence (Zhou et al., CC 2019): Algorithm 1 on the consolidated DAG and Algorithm 3 for cyclic edges.

Conventions (issue 3, where the paper's pseudocode and Figure 2 disagree):

* choosing one of ``k`` alternatives takes ``ceil(log2 k)`` bits (0 bits for ``k == 1``), and all
  codes of one group share that width;
* a component's incoming edges are visited weight-descending, then by call-site address, so the
  first one visited (the heaviest) gets the all-zero code and needs no probe;
* the edge code sits at the low end of ``[p.level, n.level)`` and the level code at the high end
  (bits ``[n.level - lvCodeLen, n.level)``), with zero padding in between;
* every cyclic edge gets a distinct code of ``recCodeLen = max(1, ceil(log2 #cyclic))`` bits.

Codes in the plan are relative to ``lo``: bit 0 of ``code`` is bit ``lo`` of ``acycID``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ccprofd.encode.bits import ceil_log2
from ccprofd.encode.edges import EdgeArrays
from ccprofd.encode.scc import Sccs


@dataclass(slots=True)
class SchemeTables:
    """What one scheme contributes to a plan: per-edge probe data, decode tables and statistics."""

    lo: list[int | None]
    hi: list[int | None]
    code: list[int]
    rec_code: list[int | None]
    tables: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)


def rec_codes(ea: EdgeArrays, cyclic: bytearray) -> tuple[list[int | None], list[int], int]:
    """Algorithm 3, lines 5-10: distinct codes for the cyclic edges in call-site order."""
    rec: list[int | None] = [None] * ea.n_edges
    rec_map: list[int] = []
    for e in range(ea.n_edges):
        if cyclic[e]:
            rec[e] = len(rec_map)
            rec_map.append(e)
    rec_len = max(1, ceil_log2(len(rec_map))) if rec_map else 0
    return rec, rec_map, rec_len


Groups = list[tuple[int, list[int]]]  # [(parent level, [edge ids by edge code])] indexed by level code


def annotate_acyclic(ea: EdgeArrays,
                     sc: Sccs) -> tuple[list[int], list[int], list[Groups], list[int], list[int]]:
    """Algorithm 1 ``annotate`` over components in topological order.

    Returns ``(level, lvlen, groups, edge_code, lv_code)``: per component its level, level-code width
    and the groups ``[(parent level, [edge ids by edge code])]`` indexed by level code (the paper's
    ``c2lv`` and ``ccMap`` in one list); per edge its edge code and level code.
    """
    nc = len(sc.members)
    level = [0] * nc
    lvlen = [0] * nc
    groups: list[Groups] = [[] for _ in range(nc)]
    edge_code = [0] * ea.n_edges
    lv_code = [0] * ea.n_edges
    comp = sc.comp
    caller = ea.caller
    for c in range(nc):  # components are numbered in topological order
        ins = sc.acyc_in[c]
        if not ins:
            continue
        lv_index: dict[int, int] = {}
        grp: Groups = []
        for e in ins:
            plevel = level[comp[caller[e]]]
            gi = lv_index.get(plevel)
            if gi is None:
                gi = lv_index[plevel] = len(grp)
                grp.append((plevel, []))
            lst = grp[gi][1]
            edge_code[e] = len(lst)
            lv_code[e] = gi
            lst.append(e)
        width = ceil_log2(len(grp))
        max_len = max(plevel + ceil_log2(len(lst)) for plevel, lst in grp)
        level[c] = max_len + width
        lvlen[c] = width
        groups[c] = grp
    return level, lvlen, groups, edge_code, lv_code


def build_valence(ea: EdgeArrays, sc: Sccs) -> SchemeTables:
    level, lvlen, groups, edge_code, lv_code = annotate_acyclic(ea, sc)
    rec, rec_map, rec_len = rec_codes(ea, sc.cyclic)
    m = ea.n_edges
    lo: list[int | None] = [None] * m
    hi: list[int | None] = [None] * m
    code = [0] * m
    comp = sc.comp
    for e in range(m):
        if sc.cyclic[e]:
            continue
        c = comp[ea.callee[e]]
        p_level = level[comp[ea.caller[e]]]
        n_level = level[c]
        lo[e] = p_level
        hi[e] = n_level
        # instrument(): cc = edgeCode . lvCode, the level code right-aligned at n.level
        code[e] = edge_code[e] | (lv_code[e] << (n_level - lvlen[c] - p_level))
    acyc_bits = max(level) if level else 0
    tables = {
        "comp_of": comp,  # by dense node index (the plan's "nodes" list)
        "comps": [[level[c], lvlen[c], [[pl, lst] for pl, lst in groups[c]]] for c in range(len(level))],
        "rec_map": rec_map,
        "rec_code_bits": rec_len,
    }
    stats = {"acyclic_bits": acyc_bits, "rec_code_bits": rec_len, "max_level": acyc_bits}
    return SchemeTables(lo=lo, hi=hi, code=code, rec_code=rec, tables=tables, stats=stats)
