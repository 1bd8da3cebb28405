"""Worked examples computed by hand from the paper's definitions (Valence sections 2.1, 3.1-3.3).

The figures did not survive the text conversion, so the graphs are rebuilt from what the text
states: in the acyclic graph (Figures 1/2) numCC(F) = 3, numCC(G) = 4, En(JI) = 7, F and G are at
level 2, I's parents are F, G (level 2) and J (level 0), D calls F from two sites; in the recursive
graph (Figure 3) the complex SCCs are EFH and DGJ with seven cyclic edges and the path AJD¹FHEF
exists.  Every expected number below was derived on paper from the issue's conventions
(ceil(log2 k) bits, 0 for k = 1; incoming edges visited by call-site address; level code at the
high end of [p.level, n.level)), not taken from program output.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from ccprofd.callgraph.model import ROOT, CallGraph, CallSite
from ccprofd.decode import CachingDecoder, DecodeError, decoder_for
from ccprofd.encode import EncodedState, Encoder, build_plan
from ccprofd.encode.plan import COL

from test_encode_graphs import BIN  # isort: skip

NODE = {c: 0x1000 * (i + 1) for i, c in enumerate("ABCDEFGHIJ")}

FIG1_EDGES = [("A", "B", 0x10), ("A", "C", 0x11), ("A", "J", 0x12), ("B", "D", 0x20), ("B", "G", 0x21),
              ("C", "E", 0x30), ("C", "G", 0x31), ("C", "H", 0x32), ("D", "F", 0x40), ("D", "F", 0x41),
              ("E", "F", 0x50), ("E", "G", 0x51), ("F", "I", 0x60), ("G", "I", 0x70), ("J", "I", 0x80),
              ("H", "G", 0x90)]
FIG3_EDGES = [("A", "B", 0x10), ("A", "C", 0x11), ("A", "J", 0x12), ("B", "D", 0x20), ("B", "G", 0x21),
              ("C", "E", 0x30), ("C", "G", 0x31), ("C", "H", 0x32), ("D", "F", 0x40), ("D", "F", 0x41),
              ("D", "G", 0x42), ("E", "F", 0x50), ("F", "I", 0x60), ("F", "H", 0x61), ("G", "I", 0x70),
              ("G", "J", 0x71), ("G", "D", 0x72), ("J", "I", 0x80), ("J", "D", 0x81), ("H", "E", 0x91)]


def paper_graph(edges: list[tuple[str, str, int]]) -> CallGraph:
    g = CallGraph.empty(BIN)
    for name, a in NODE.items():
        g.add_function(a, name, addr=a, size=0x10)
    g.add_root(NODE["A"])
    for u, v, s in edges:
        g.add_call(CallSite(NODE[u], s, s + 5, 5, "e8", "direct", NODE[v]))
    return g


def e(u: str, v: str, site: int) -> tuple[int, int, int]:
    return (NODE[u], NODE[v], site)


ROOT_A = (ROOT, NODE["A"], 0)


def site_row(plan: dict[str, Any], u: str, v: str, site: int) -> list[Any]:
    rows = [r for r in plan["sites"] if (r[COL["caller"]], r[COL["callee"]], r[COL["site"]]) == e(u, v, site)]
    assert len(rows) == 1
    return rows[0]


def acyc(plan: dict[str, Any], u: str, v: str, site: int) -> tuple[int, int, int]:
    r = site_row(plan, u, v, site)
    return (r[COL["lo"]], r[COL["hi"]], r[COL["code"]])


# ------------------------------------------------------------------------- Figures 1 and 2
def test_figure2_valence_levels_and_codes() -> None:
    plan = build_plan(paper_graph(FIG1_EDGES), "valence")
    # F: three incoming edges from level 0 -> one group, 2-bit edge codes, level 2
    assert [acyc(plan, *x) for x in (("D", "F", 0x40), ("D", "F", 0x41), ("E", "F", 0x50))] == \
        [(0, 2, 0), (0, 2, 1), (0, 2, 2)]
    # G: four parents at level 0 -> codes 0..3 in call-site order, level 2
    into_g = (("B", "G", 0x21), ("C", "G", 0x31), ("E", "G", 0x51), ("H", "G", 0x90))
    assert [acyc(plan, *x)[2] for x in into_g] == [0, 1, 2, 3]
    # I: parents at levels 2 (F, G) and 0 (J): level codes 0 and 1 (1 bit), edge codes 1 bit for level
    # 2, 0 bits for level 0; maxLen = 2 + 1 = 3, level = 3 + 1 = 4.
    assert acyc(plan, "F", "I", 0x60) == (2, 4, 0b00)  # edge code 0, level code 0
    assert acyc(plan, "G", "I", 0x70) == (2, 4, 0b01)  # edge code 1 at bit 2, level code 0 at bit 3
    assert acyc(plan, "J", "I", 0x80) == (0, 4, 0b1000)  # level code 1 at bit 3, bits 0-2 padding
    rep = plan["report"]
    assert rep["acyclic_bits"] == 4
    assert rep["rec_code_bits"] == 0 and rep["cyclic_edges"] == 0
    # non-zero codes: D2F, EF, CG, EG, HG, GI, JI
    assert rep["coded_edges"] == 7 and rep["instrumented_edges"] == 7
    # FI carries no instrumentation (all-zero code), GI does
    assert site_row(plan, "F", "I", 0x60)[COL["reasons"]] == 0
    assert site_row(plan, "G", "I", 0x70)[COL["reasons"]] != 0


def test_figure2_decoding_path_acegi() -> None:
    plan = build_plan(paper_graph(FIG1_EDGES), "valence")
    path = [ROOT_A, e("A", "C", 0x11), e("C", "E", 0x30), e("E", "G", 0x51), e("G", "I", 0x70)]
    enc = Encoder(plan)
    for x in path:
        enc.call(x)
    # EG sets bits [0,2) to 2, GI sets bits [2,4) to 0b01 -> acycID = 0b0110
    assert enc.state().acyc == (0b0110,)
    assert decoder_for(plan).decode(EncodedState(acyc=(0b0110,)), NODE["I"]) == path


def test_figure1_pcce_numcc_and_en() -> None:
    plan = build_plan(paper_graph(FIG1_EDGES), "pcce")
    numcc = dict(zip(plan["nodes"], plan["tables"]["numcc"], strict=True))
    assert {c: numcc[NODE[c]] for c in "FGI"} == {"F": 3, "G": 4, "I": 8}
    assert all(numcc[NODE[c]] == 1 for c in "ABCDEHJ")
    assert [acyc(plan, *x)[2] for x in (("F", "I", 0x60), ("G", "I", 0x70), ("J", "I", 0x80))] == [0, 3, 7]
    assert [acyc(plan, *x)[2] for x in (("D", "F", 0x40), ("D", "F", 0x41), ("E", "F", 0x50))] == [0, 1, 2]
    rep = plan["report"]
    assert rep["acyclic_bits"] == 3  # ceil(log2 8): "PCCE ... in only three bits"
    assert rep["max_numcc"] == 8 and rep["overflow"] is False and rep["words_needed"] == 1
    # id 5 at I: 5 is in GI's range [3, 7) -> 2 at G: EG's range [2, 3) -> 0 at E -> CE -> AC -> root
    dec = decoder_for(plan)
    assert dec.decode(EncodedState(acyc=(5,)), NODE["I"]) == \
        [ROOT_A, e("A", "C", 0x11), e("C", "E", 0x30), e("E", "G", 0x51), e("G", "I", 0x70)]
    assert dec.decode(EncodedState(acyc=(7,)), NODE["I"])[-2:] == [e("A", "J", 0x12), e("J", "I", 0x80)]
    with pytest.raises(DecodeError):
        dec.decode(EncodedState(acyc=(8,)), NODE["I"])  # numCC(I) = 8: ids are 0..7


def test_figure1_hcce_equals_pcce_on_an_acyclic_graph() -> None:
    g = paper_graph(FIG1_EDGES)
    h, p = build_plan(g, "hcce"), build_plan(g, "pcce")
    assert [r[COL["code"]] for r in h["sites"]] == [r[COL["code"]] for r in p["sites"]]
    assert h["report"]["acyclic_bits"] == 3


# -------------------------------------------------------------------------------- Figure 3
AJD1FHEF = [ROOT_A, e("A", "J", 0x12), e("J", "D", 0x81), e("D", "F", 0x40), e("F", "H", 0x61),
            e("H", "E", 0x91), e("E", "F", 0x50)]


def test_figure3_sccs_and_cyclic_codes() -> None:
    plan = build_plan(paper_graph(FIG3_EDGES), "valence")
    rep = plan["report"]
    assert rep["complex_sccs"] == 2 and rep["cyclic_edges"] == 7
    assert rep["rec_code_bits"] == 3  # ceil(log2 7)
    rec = {(r[COL["caller"]], r[COL["callee"]], r[COL["site"]]): r[COL["rec_code"]] for r in plan["sites"]
           if r[COL["rec_code"]] is not None}
    # cyclic edges numbered in call-site order
    assert rec == {e("D", "G", 0x42): 0, e("E", "F", 0x50): 1, e("F", "H", 0x61): 2, e("G", "J", 0x71): 3,
                   e("G", "D", 0x72): 4, e("J", "D", 0x81): 5, e("H", "E", 0x91): 6}
    # consolidated graph: {D,G,J} gets AJ, BD, BG, CG (one level-0 group) -> level 2;
    # {E,F,H} gets CE, CH (level 0) and D1F, D2F (level 2) -> lvCodeLen 1, maxLen 3, level 4;
    # I gets FI (level 4) then GI, JI (level 2) -> lvCodeLen 1, maxLen 4, level 5.
    into_dgj = (("A", "J", 0x12), ("B", "D", 0x20), ("B", "G", 0x21), ("C", "G", 0x31))
    assert [acyc(plan, *x) for x in into_dgj] == [(0, 2, 0), (0, 2, 1), (0, 2, 2), (0, 2, 3)]
    into_efh = (("C", "E", 0x30), ("C", "H", 0x32), ("D", "F", 0x40), ("D", "F", 0x41))
    assert [acyc(plan, *x) for x in into_efh] == [(0, 4, 0), (0, 4, 1), (2, 4, 0b10), (2, 4, 0b11)]
    assert [acyc(plan, *x) for x in (("F", "I", 0x60), ("G", "I", 0x70), ("J", "I", 0x80))] == \
        [(4, 5, 0), (2, 5, 0b100), (2, 5, 0b101)]
    assert rep["acyclic_bits"] == 5
    # non-zero acyclic codes: BD BG CG CH D1F D2F GI JI (8); non-zero cyclic codes: 6 of 7
    assert rep["coded_edges"] == 14 and rep["instrumented_edges"] == 15


def test_section_3_2_path_ajd1fhef_unwinds_recid_first() -> None:
    plan = build_plan(paper_graph(FIG3_EDGES), "valence")
    enc = Encoder(plan)
    for x in AJD1FHEF:
        enc.call(x)
    state = enc.state()
    # acycID: AJ has code 0, D1F sets [2,4) to 0b10 -> bit 3.  recID pushes JD=5, FH=2, HE=6, EF=1.
    assert state.acyc == (0b1000,)
    assert state.rec_len == 12 and state.rec == 5 | 2 << 3 | 6 << 6 | 1 << 9
    dec = decoder_for(plan)
    # Both candidates end at F: recID's top is EF, and acycID's last part is D1F.
    top = state.rec >> 9
    assert top == 1
    # Algorithm 2 at F (level 4, lvCodeLen 1): level code = bit 3 = 1 -> parents at level 2; edge code
    # = bit 2 = 0 -> D1F, whose code (2, 4, 0b10) is exactly what the state holds.
    assert (state.acyc[0] >> 3) & 1 == 1 and (state.acyc[0] >> 2) & 1 == 0
    assert acyc(plan, "D", "F", 0x40) == (2, 4, 0b10)
    # Algorithm 4 unwinds recID first and recovers the whole path.
    assert dec.decode(state, NODE["F"]) == AJD1FHEF


def test_section_3_2_path_in_hcce_and_pcce() -> None:
    g = paper_graph(FIG3_EDGES)
    h = build_plan(g, "hcce")
    # HCCE numCC on the consolidated graph: {DGJ} 4 (AJ 0, BD 1, BG 2, CG 3), {EFH} 10 (CE 0, CH 1,
    # D1F 2, D2F 6), I 18 (FI 0, GI 10, JI 14)
    assert h["report"]["max_numcc"] == 18 and h["report"]["acyclic_bits"] == 5
    enc = Encoder(h)
    for x in AJD1FHEF:
        enc.call(x)
    assert enc.state().acyc == (2,)  # En(AJ) + En(D1F) = 0 + 2
    assert decoder_for(h).decode(enc.state(), NODE["F"]) == AJD1FHEF
    # PCCE: the DFS in call-site order finds back edges EF, GD, JD (codes 0, 1, 2).
    p = build_plan(g, "pcce")
    backs = {(r[COL["caller"]], r[COL["callee"]], r[COL["site"]]): r[COL["rec_code"]] for r in p["sites"]
             if r[COL["rec_code"]] is not None}
    assert backs == {e("E", "F", 0x50): 0, e("G", "D", 0x72): 1, e("J", "D", 0x81): 2}
    # numCC with dummy edges to D and F: D 2, F 5, G 4, H 6, E 7, J 5, I 14; without them I has 9.
    numcc = dict(zip(p["nodes"], p["tables"]["numcc"], strict=True))
    assert {c: numcc[NODE[c]] for c in "DFGHEJI"} == {"D": 2, "F": 5, "G": 4, "H": 6, "E": 7, "J": 5, "I": 14}
    assert p["report"]["acyclic_bits"] == 4 and p["report"]["max_numcc"] == 14
    enc = Encoder(p)
    for x in AJD1FHEF:
        enc.call(x)
    # JD pushes (0, 2) and sets id = En(dummy->D) = 1; D1F +0; FH +1; HE +1; EF pushes (3, 0), id = 4
    st = enc.state()
    assert st.acyc == (4,) and st.pairs == (((0,), 2), ((3,), 0))
    assert decoder_for(p).decode(st, NODE["F"]) == AJD1FHEF


def test_every_acyclic_id_decodes_to_the_path_that_encodes_it_or_is_refused() -> None:
    """Valence decoding of an acyclic graph, for every acycID below 2^6 at every node of Figure 1:
    either a path from the root that encodes to exactly that id, or DecodeError (codes past a
    node's groups or edges, bits above its level) -- never another exception, never a wrong path.
    The decodable ids at a node are as many as its paths from the root."""
    plan = build_plan(paper_graph(FIG1_EDGES), "valence")
    dec = decoder_for(plan)
    succ: dict[str, list[tuple[int, int, int]]] = {}
    for u, v, s in FIG1_EDGES:
        succ.setdefault(u, []).append(e(u, v, s))

    def paths(node: str) -> int:
        return 1 if node == "A" else sum(paths(u) for u, v, _ in FIG1_EDGES if v == node)

    for node in NODE:
        decoded = 0
        for value in range(1 << 6):
            try:
                path = dec.decode(EncodedState(acyc=(value,)), NODE[node])
            except DecodeError:
                continue
            enc = Encoder(plan)
            for x in path:
                enc.call(x)
            assert path[0] == ROOT_A and path[-1][1] == NODE[node] and enc.state().acyc == (value,)
            decoded += 1
        assert decoded == paths(node), node


def test_compiled_acyclic_decode_agrees_with_the_python_loop(monkeypatch) -> None:
    """decode/cvalence.c against valence.py's loop (the reference) on every acycID below 2^8 (and
    ids past 64 bits, which the C loop leaves to Python) at every node of Figures 1 and 3: the same
    path, or the same DecodeError message."""
    from conftest import skip_or_fail

    from ccprofd.decode import valence

    if valence.cvalence is None:
        skip_or_fail("ccprofd/decode/cvalence.c is not built (bash scripts/build_ext.sh)")
    compiled = valence.cvalence
    calls = []

    def counted(*args: object) -> object:
        got = compiled.acyclic(*args)
        calls.append(got is not None)
        return got

    for edges in (FIG1_EDGES, FIG3_EDGES):
        plan = build_plan(paper_graph(edges), "valence")
        nodes = {u for u, _, _ in edges} | {v for _, v, _ in edges}
        for name in sorted(nodes):
            for value in [*range(1 << 8), 1 << 64, (1 << 70) | 5, 2**64 - 1]:
                got = []
                for c in (types.SimpleNamespace(acyclic=counted), None):
                    monkeypatch.setattr(valence, "cvalence", c)
                    try:
                        got.append(decoder_for(plan).decode(EncodedState(acyc=(value,)), NODE[name]))
                    except DecodeError as exc:
                        got.append(f"DecodeError: {exc}")
                assert got[0] == got[1], (name, value)
    assert any(calls) and not all(calls)  # the compiled loop decoded some, left others to Python


def test_acyclic_shortcut_decodes_as_the_state_does() -> None:
    """decode_acyclic (unwind mode's way for a record with no segment and no recID: no
    EncodedState made, no cache) against decode(EncodedState(acyc)) -- the reference -- at every node
    of Figures 1 and 3 and a node not in the plan, for every acycID below 2^8, ids past 64 bits and
    two-word ids: the same path, or the same DecodeError message; the caching decoder's shortcut too."""
    for edges in (FIG1_EDGES, FIG3_EDGES):
        plan = build_plan(paper_graph(edges), "valence")
        nodes = {u for u, _, _ in edges} | {v for _, v, _ in edges}
        for node in [*(NODE[n] for n in sorted(nodes)), 987654]:
            for acyc in [*((v,) for v in range(1 << 8)), (1 << 64,), ((1 << 70) | 5,), (3, 1), (0, 0)]:
                got = []
                for way in ("state", "shortcut", "cached"):
                    try:
                        if way == "state":
                            got.append(decoder_for(plan).decode(EncodedState(acyc=acyc), node))
                        elif way == "shortcut":
                            got.append(decoder_for(plan).decode_acyclic(acyc, node))
                        else:
                            got.append(CachingDecoder(decoder_for(plan)).decode_acyclic(acyc, node))
                    except DecodeError as exc:
                        got.append(f"DecodeError: {exc}")
                assert got[0] == got[1] == got[2], (node, acyc, got)
