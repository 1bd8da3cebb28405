"""HCCE (Valence section 3.3): PCCE numbering on the consolidated acyclic graph, Valence codes for
cyclic edges.

Components play the role of PCCE's nodes, so no back edges exist; the dummy root only reaches the
virtual root's component and every other source component (needed when a segment restarts
encoding at a node the root does not reach).
"""

from __future__ import annotations

from ccprofd.encode.bits import words_for_bits
from ccprofd.encode.edges import EdgeArrays
from ccprofd.encode.pcce import NO_DUMMY, id_width, number_contexts, table1_bits
from ccprofd.encode.scc import Sccs
from ccprofd.encode.valence import SchemeTables, rec_codes


def build_hcce(ea: EdgeArrays, sc: Sccs, pcce_words: int) -> SchemeTables:
    nc = len(sc.members)
    m = ea.n_edges
    parent = [sc.comp[u] for u in ea.caller]
    root_comp = sc.comp[ea.root]
    dummy = bytearray(nc)
    for c in range(nc):
        if not sc.acyc_in[c]:
            dummy[c] = 1
    numcc, en, en_dummy, table1 = number_contexts(range(nc), sc.acyc_in, parent, dummy, root_comp, m)
    max_numcc, bits = id_width(numcc)
    words_needed = max(1, words_for_bits(bits))
    rec, rec_map, rec_len = rec_codes(ea, sc.cyclic)
    lo: list[int | None] = [None] * m
    hi: list[int | None] = [None] * m
    code = [0] * m
    for e in range(m):
        if not sc.cyclic[e]:
            code[e] = en[e]
            lo[e] = 0
            hi[e] = bits
    tables = {
        "comp_of": sc.comp,
        "incoming": [[[en[e], e] for e in sc.acyc_in[c]] + ([[en_dummy[c], NO_DUMMY]] if dummy[c] else [])
                     for c in range(nc)],
        "numcc": numcc,
        "rec_map": rec_map,
        "rec_code_bits": rec_len,
    }
    stats = {
        "acyclic_bits": table1_bits(table1),
        "rec_code_bits": rec_len,
        "max_numcc": max_numcc,
        "id_bits": bits,
        "words_needed": words_needed,
        "overflow": words_needed > pcce_words,
    }
    return SchemeTables(lo=lo, hi=hi, code=code, rec_code=rec, tables=tables, stats=stats)
