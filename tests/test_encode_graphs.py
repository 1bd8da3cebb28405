"""Synthetic call graphs for the encoding tests (hypothesis strategies and builders).

Other encode/decode test modules import the helpers from here; the tests at the bottom check that
the generators really produce the shapes the property tests claim to cover.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from ccprofd.callgraph.model import ROOT, BinaryInfo, CallGraph, CallSite

BIN = BinaryInfo(path="synthetic", build_id=None, content_hash="0" * 64, pie=False, elf_type="EXEC",
                 entry=0x1000, text_bytes=0)
EXTERNAL = -2  # one imported function, like qsort@plt


def addr(i: int) -> int:
    return 0x1000 * (i + 1)


def make_graph(n: int, edges: Iterable[tuple[int, int]], roots: Iterable[int] = (0,),
               with_external: bool = False, binary: BinaryInfo = BIN) -> CallGraph:
    """Functions ``0..n-1`` at ``addr(i)``; edge ``j`` from ``u`` gets call site ``addr(u) + 1 + j``,
    so parallel edges between one pair are distinct call sites.  Each function also has one
    indirect call site at ``addr(u) + 0xF00`` (no edge)."""
    g = CallGraph.empty(binary)
    for i in range(n):
        g.add_function(addr(i), f"f{i}", addr=addr(i), size=0x1000, address_taken=i in set(roots))
    if with_external:
        g.add_function(EXTERNAL, "qsort", kind="external")
    for r in sorted(set(roots)):
        g.add_root(addr(r))
    for j, (u, v) in enumerate(edges):
        site = addr(u) + 1 + j
        target = EXTERNAL if v == EXTERNAL else addr(v)
        kind = "plt" if v == EXTERNAL else "direct"
        g.add_call(CallSite(addr(u), site, site + 5, 5, "e8", kind, target))
    for i in range(n):
        s = addr(i) + 0xF00
        g.add_call(CallSite(addr(i), s, s + 2, 2, "ffd0", "indirect", None, "rax"))
    return g


def edge_list(g: CallGraph) -> list[tuple[int, int, int]]:
    return sorted(g.graph.edges(keys=True))


@st.composite
def call_graphs(draw: st.DrawFn, shape: str = "any", max_nodes: int = 8) -> CallGraph:
    """``shape``: "dag" (u < v only), "cycles" (explicit overlapping/nested cycles plus random
    edges), or "any" (random edges, self-loops and parallel edges allowed)."""
    n = draw(st.integers(2, max_nodes))
    node = st.integers(0, n - 1)
    edges: list[tuple[int, int]] = []
    if shape == "dag":
        pairs = draw(st.lists(st.tuples(node, node).filter(lambda p: p[0] != p[1]), max_size=3 * n))
        edges = [(min(p), max(p)) for p in pairs]
    else:
        if shape == "cycles":
            for cyc in draw(st.lists(st.lists(node, min_size=1, max_size=4, unique=True), min_size=1,
                                     max_size=3)):
                edges += list(zip(cyc, cyc[1:] + cyc[:1], strict=True))
        edges += draw(st.lists(st.tuples(node, node), max_size=3 * n))
    # parallel edges: repeat a few edges at new call sites
    if edges:
        for i in draw(st.lists(st.integers(0, len(edges) - 1), max_size=3)):
            edges.append(edges[i])
    roots = {0} | set(draw(st.lists(node, max_size=2)))
    with_ext = draw(st.booleans())
    if with_ext:
        edges += [(u, EXTERNAL) for u in draw(st.lists(node, min_size=1, max_size=2, unique=True))]
    return make_graph(n, edges, roots, with_external=with_ext)


@st.composite
def weight_maps(draw: st.DrawFn, g: CallGraph) -> dict[tuple[int, int, int], int]:
    es = edge_list(g)
    ws = draw(st.lists(st.integers(0, 1000), min_size=len(es), max_size=len(es)))
    return {e: w for e, w in zip(es, ws, strict=True) if w}


def diamond_chain(k: int, fan: Sequence[int] = ()) -> CallGraph:
    """``k`` two-way diamonds in a row, then one diamond of each width in ``fan``: root-path counts
    multiply (2**k * prod(fan)), which is how tests reach ids wider than one word."""
    edges: list[tuple[int, int]] = []
    nxt = 1
    top = 0
    for width in [2] * k + list(fan):
        mids = list(range(nxt, nxt + width))
        bottom = nxt + width
        edges += [(top, m) for m in mids] + [(m, bottom) for m in mids]
        top = bottom
        nxt = bottom + 1
    return make_graph(nxt, edges, roots=(0,))


# ------------------------------------------------------------------------------ generator checks
@settings(max_examples=40, deadline=None)
@given(call_graphs("dag"))
def test_dag_graphs_are_acyclic(g: CallGraph) -> None:
    assert nx.is_directed_acyclic_graph(nx.DiGraph(g.graph))
    assert g.roots() and all(g.graph.has_edge(ROOT, r) for r in g.roots())


@settings(max_examples=40, deadline=None)
@given(call_graphs("cycles"))
def test_cycle_graphs_have_a_cycle(g: CallGraph) -> None:
    assert not nx.is_directed_acyclic_graph(nx.DiGraph(g.graph))


def test_parallel_edges_get_distinct_sites() -> None:
    g = make_graph(2, [(0, 1), (0, 1), (1, 1)])
    assert [k for u, v, k in edge_list(g) if u == addr(0)] == [addr(0) + 1, addr(0) + 2]
    assert g.graph.has_edge(addr(1), addr(1))


def test_diamond_chain_path_count() -> None:
    g = diamond_chain(3, fan=[3])
    sink = max(g.functions())
    # count root paths by brute force: 2 * 2 * 2 * 3
    dg = g.graph
    memo: dict[int, int] = {}

    def paths(v: int) -> int:
        if v == ROOT:
            return 1
        if v not in memo:
            memo[v] = sum(paths(u) for u, _, _ in dg.in_edges(v, keys=True))
        return memo[v]

    assert paths(sink) == 24
