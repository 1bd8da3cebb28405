"""Independent checks of the encodings' arithmetic on generated graphs."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_encode_graphs import call_graphs, diamond_chain, edge_list, make_graph, weight_maps

from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.decode import decoder_for
from ccprofd.encode import Encoder, EncodingOverflow, build_plan, encoding_report
from ccprofd.encode.bits import ceil_log2
from ccprofd.encode.plan import COL

Key = tuple[int, int, int]


def rows_by_edge(plan: dict[str, Any]) -> dict[Key, list[Any]]:
    return {(r[COL["caller"]], r[COL["callee"]], r[COL["site"]]): r for r in plan["sites"]}


def count_paths(edges: list[Key], sources: set[int], nodes: set[int]) -> dict[int, int]:
    """Brute force: enumerate every edge path starting at a source (the graph must be acyclic)."""
    out: dict[int, list[int]] = defaultdict(list)
    for u, v, _ in edges:
        out[u].append(v)
    count = dict.fromkeys(nodes, 0)

    def walk(v: int) -> None:
        count[v] += 1
        for w in out[v]:
            walk(w)

    for s in sources:
        walk(s)
    return count


@pytest.mark.parametrize("shape", ["dag", "any", "cycles"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_pcce_numcc_equals_brute_force_path_count(shape: str, data: st.DataObject) -> None:
    g = data.draw(call_graphs(shape, max_nodes=6))
    plan = build_plan(g, "pcce")
    rows = rows_by_edge(plan)
    back = {k for k, r in rows.items() if r[COL["rec_code"]] is not None}
    fwd = [k for k in edge_list(g) if k not in back]
    nodes = set(g.graph.nodes)
    dag = nx.MultiDiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from(fwd)
    assert nx.is_directed_acyclic_graph(dag)
    # dummy root -> virtual root, every back-edge target, every other source
    targets = {ROOT} | {v for _, v, _ in back} | {v for v in nodes if dag.in_degree(v) == 0}
    expected = count_paths(fwd, targets, nodes)
    numcc = dict(zip(plan["nodes"], plan["tables"]["numcc"], strict=True))
    assert numcc == expected
    if shape == "dag":  # no back edges: root paths of the original graph
        assert not back
        from_root = count_paths(fwd, {ROOT}, nodes)
        from_others = count_paths(fwd, targets - {ROOT}, nodes)
        only_root = [v for v in nodes if not from_others[v]]
        assert ROOT in only_root
        assert all(numcc[v] == from_root[v] for v in only_root)
    table1 = count_paths(fwd, {ROOT}, nodes)
    assert plan["report"]["acyclic_bits"] == max(ceil_log2(k) for k in table1.values() if k)


@settings(max_examples=40, deadline=None)
@given(call_graphs("cycles", max_nodes=6))
def test_hcce_numcc_equals_paths_in_the_condensation(g: CallGraph) -> None:
    plan = build_plan(g, "hcce")
    dg = nx.DiGraph(g.graph)
    cond = nx.condensation(dg)
    comp = cond.graph["mapping"]
    acyc = [(comp[u], comp[v], k) for u, v, k in edge_list(g) if comp[u] != comp[v]]
    sources = {c for c in cond.nodes if cond.in_degree(c) == 0}
    paths = count_paths(acyc, sources, set(cond.nodes))
    numcc = dict(zip(plan["nodes"], [plan["tables"]["numcc"][c] for c in plan["tables"]["comp_of"]],
                     strict=True))
    assert all(numcc[v] == paths[comp[v]] for v in g.graph.nodes)


@pytest.mark.parametrize("scheme", ["valence", "pcce", "hcce"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_no_instrumentation_exactly_when_code_is_zero(scheme: str, data: st.DataObject) -> None:
    """An edge's probe changes the state iff the plan lists the site as probed; probe-less edges
    are exactly the non-cyclic ones with an all-zero code."""
    g = data.draw(call_graphs("cycles", max_nodes=6))
    plan = build_plan(g, scheme)
    for key, row in rows_by_edge(plan).items():
        enc = Encoder(plan)
        if key[0] != ROOT:
            enc.enter_from_outside(key[0])  # reach the caller with a clean state
        before = enc.state()
        enc.call(key)
        changed = enc.state() != before
        probed = row[COL["reasons"]] != 0
        assert changed == probed, (key, row)
        is_cyclic = row[COL["rec_code"]] is not None
        assert probed == (is_cyclic or row[COL["code"]] != 0)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_valence_codes_fit_in_acyclic_bits_and_one_zero_edge_per_component(data: st.DataObject) -> None:
    g = data.draw(call_graphs("any", max_nodes=7))
    w = data.draw(st.one_of(st.none(), weight_maps(g)))
    plan = build_plan(g, "valence", weights=w)
    bits = plan["report"]["acyclic_bits"]
    comp = dict(zip(plan["nodes"], plan["tables"]["comp_of"], strict=True))
    zero_per_comp: dict[int, int] = defaultdict(int)
    has_in: set[int] = set()
    for r in plan["sites"]:
        if r[COL["rec_code"]] is not None:
            continue
        lo, hi, code = r[COL["lo"]], r[COL["hi"]], r[COL["code"]]
        assert 0 <= lo <= hi <= bits and 0 <= code < (1 << (hi - lo))
        c = comp[r[COL["callee"]]]
        has_in.add(c)
        zero_per_comp[c] += code == 0
    assert all(zero_per_comp[c] == 1 for c in has_in)


@pytest.mark.parametrize("scheme", ["valence", "pcce", "hcce"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_heaviest_incoming_edge_gets_the_zero_code(scheme: str, data: st.DataObject) -> None:
    g = data.draw(call_graphs("cycles", max_nodes=6))
    w = data.draw(weight_maps(g))
    plan = build_plan(g, scheme, weights=w)
    rows = rows_by_edge(plan)
    group: dict[int, list[Key]] = defaultdict(list)  # by callee (PCCE) or callee's component
    comp = dict(zip(plan["nodes"], plan["tables"].get("comp_of", range(len(plan["nodes"]))), strict=True))
    for k, r in rows.items():
        if r[COL["rec_code"]] is None:
            group[comp[k[1]]].append(k)
    for ks in group.values():
        weights = sorted((w.get(k, 0) for k in ks), reverse=True)
        if len(weights) > 1 and weights[0] > weights[1]:
            heaviest = max(ks, key=lambda k: w.get(k, 0))
            assert rows[heaviest][COL["code"]] == 0
            assert rows[heaviest][COL["reasons"]] == 0


def test_weights_leave_hot_calls_unprobed_by_hand() -> None:
    # main calls f from two sites; the second is hot.  Without weights the first site (lower address)
    # gets code 0; with weights the hot one does, and its 100 calls need no probe.
    g = make_graph(2, [(0, 1), (0, 1)])
    s1, s2 = 0x1000 + 1, 0x1000 + 2
    cold, hot = (0x1000, 0x2000, s1), (0x1000, 0x2000, s2)
    for scheme in ("valence", "pcce", "hcce"):
        plain = rows_by_edge(build_plan(g, scheme))
        assert plain[cold][COL["code"]] == 0 and plain[hot][COL["code"]] == 1
        weighted = build_plan(g, scheme, weights={cold: 1, hot: 100})
        rows = rows_by_edge(weighted)
        assert rows[hot][COL["code"]] == 0 and rows[cold][COL["code"]] == 1
        assert weighted["report"]["dynamic_calls"] == 101
        assert weighted["report"]["unprobed_dynamic_calls"] == 100
    rep = encoding_report(g, "all", weights={cold: 1, hot: 100})
    assert set(rep) == {"valence", "pcce", "hcce"}
    for scheme, r in rep.items():
        for key in ("acyclic_bits", "rec_code_bits", "coded_edges", "instrumented_edges", "words_needed",
                    "overflow", "unprobed_dynamic_calls"):
            assert key in r, (scheme, key)
        assert ("max_numcc" in r) == (scheme != "valence")


def test_multiword_ids_and_pcce_overflow() -> None:
    """63 two-way diamonds then one four-way diamond: 2**63 * 4 = 2**65 root paths at the sink.
    Valence: X_k has level k, the sink's four parents sit at level 63 -> 2-bit codes in [63, 65)
    straddling words 0 and 1, 65 bits.  PCCE needs 65 bits: 2 words, overflow with 1."""
    g = diamond_chain(63, fan=[4])
    sink = max(g.functions())
    v = build_plan(g, "valence")
    assert v["report"]["acyclic_bits"] == 65 and v["acyc_words"] == 2
    into_sink = sorted((r[COL["site"]], r[COL["lo"]], r[COL["hi"]], r[COL["code"]]) for r in v["sites"]
                       if r[COL["callee"]] == sink)
    assert [x[1:] for x in into_sink] == [(63, 65, 0), (63, 65, 1), (63, 65, 2), (63, 65, 3)]
    p1 = build_plan(g, "pcce", pcce_words=1)
    assert p1["report"]["max_numcc"] == 2**65 and p1["report"]["acyclic_bits"] == 65
    assert p1["report"]["overflow"] is True and p1["report"]["words_needed"] == 2
    p2 = build_plan(g, "pcce", pcce_words=2)
    assert p2["report"]["overflow"] is False
    # The path through every second branch and the last of the four: id 2**63 - 1 + 3 * 2**63.
    out: dict[int, list[Key]] = defaultdict(list)
    for k in edge_list(g):
        out[k[0]].append(k)
    path: list[Key] = [(ROOT, 0x1000, 0)]
    while out[path[-1][1]]:
        path.append(out[path[-1][1]][-1])
    for plan in (v, p2, build_plan(g, "hcce", pcce_words=2)):
        enc = Encoder(plan)
        for k in path:
            enc.call(k)
        assert decoder_for(plan).decode(enc.state(), sink) == path
        if plan["scheme"] != "valence":
            assert enc.state().acyc == ((2**65 - 1) & (2**64 - 1), 1)
    enc = Encoder(p1)
    with pytest.raises(EncodingOverflow):
        for k in path:
            enc.call(k)
