"""Table-1-style statistics of a call graph (the `ccprofd analyze --json` contract)."""

from __future__ import annotations

import gc
from typing import Any

from ccprofd.callgraph.model import ROOT, CallGraph


def graph_stats(graph: CallGraph) -> dict[str, Any]:
    if graph.cached_stats is not None:
        return dict(graph.cached_stats, binary=graph.binary.path)
    rows = graph.unbuilt_rows()
    if rows is not None:
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a few 10^5 short-lived tuples beside millions of live rows: GC passes are pure cost
        try:
            return _stats_of_rows(graph, rows)
        finally:
            if gc_was_enabled:
                gc.enable()
    import networkx as nx

    g = graph.graph
    internal = [n for n, k in g.nodes(data="kind") if k == "function"]
    sites = graph.sites
    direct_calls = sum(1 for s in sites if s.kind in ("direct", "plt") and s.length >= 5
                       and s.bytes_hex[-10:-8] == "e8")
    # The virtual root has no in-edges and externals no out-edges: both are singleton SCCs, so the
    # SCCs of internal functions are those of the whole graph (cheaper than on a subgraph view).
    internal_set = set(internal)
    sccs = [c for c in nx.strongly_connected_components(g) if not c.isdisjoint(internal_set)]
    scc_of = {n: i for i, c in enumerate(sccs) for n in c}
    cyclic = [(u, v, k) for u, v, k in graph.call_edges()
              if u in scc_of and v in scc_of and scc_of[u] == scc_of[v]]
    complex_ids = {scc_of[u] for u, _, _ in cyclic}
    return {
        "binary": graph.binary.path,
        "build_id": graph.binary.build_id,
        "pie": graph.binary.pie,
        "elf_type": graph.binary.elf_type,
        "functions": len(internal),
        "external_functions": sum(1 for _ in graph.externals()),
        "direct_calls": direct_calls,
        "plt_calls": sum(1 for s in sites if s.kind == "plt"),
        "tail_calls": sum(1 for s in sites if s.kind == "tail"),
        "indirect_calls": sum(1 for s in sites if s.kind == "indirect" and not s.is_jump),
        "indirect_jumps": sum(1 for s in sites if s.kind == "indirect" and s.is_jump),
        "address_taken": sum(1 for n in internal if g.nodes[n]["address_taken"]),
        "roots": g.out_degree(ROOT),
        "nodes": g.number_of_nodes(),
        "edges": sum(1 for _ in graph.call_edges()),
        "sccs": len(sccs),
        "complex_sccs": len(complex_ids),
        "cyclic_edges": len(cyclic),
        "text_bytes": graph.binary.text_bytes,
        "analysis_seconds": round(graph.analysis_seconds, 4),
    }


def _stats_of_rows(graph: CallGraph, rows: dict[str, Any]) -> dict[str, Any]:
    """:func:`graph_stats` from the serialised rows, without building the networkx graph (a fresh
    analysis is in that form; building the graph for a few counts cost more than the counts)."""
    nodes = rows["nodes"]
    edges = rows["edges"]
    sites = rows["sites"]
    try:  # the compiled counts (csweep.c), the loops below being their reference
        import ccprofd.callgraph.csweep as csweep  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        csweep = None
    if csweep is not None:
        sccs, complex_sccs, cyclic_edges, call_edges = csweep.scc_counts(nodes, edges, ROOT)
        direct, plt, tail, indirect_calls, indirect_jumps = csweep.site_counts(sites)
        return {
            "binary": graph.binary.path,
            "build_id": graph.binary.build_id,
            "pie": graph.binary.pie,
            "elf_type": graph.binary.elf_type,
            "functions": sum(1 for n in nodes if n[2] == "function"),
            "external_functions": sum(1 for n in nodes if n[2] == "external"),
            "direct_calls": direct,
            "plt_calls": plt,
            "tail_calls": tail,
            "indirect_calls": indirect_calls,
            "indirect_jumps": indirect_jumps,
            "address_taken": sum(1 for n in nodes if n[2] == "function" and n[6]),
            "roots": len(edges) - call_edges,
            "nodes": len(nodes),
            "edges": call_edges,
            "sccs": sccs,
            "complex_sccs": complex_sccs,
            "cyclic_edges": cyclic_edges,
            "text_bytes": graph.binary.text_bytes,
            "analysis_seconds": round(graph.analysis_seconds, 4),
        }
    internal = {n for n, _name, kind, *_ in nodes if kind == "function"}
    succ: dict[int, set[int]] = {}
    for u, v, *_ in edges:
        succ.setdefault(u, set()).add(v)
    comp = _scc_ids([n for n, *_ in nodes], succ)
    calls = [(u, v) for u, v, *_ in edges if u != ROOT]
    cyclic = [u for u, v in calls if comp[u] == comp[v]]
    return {
        "binary": graph.binary.path,
        "build_id": graph.binary.build_id,
        "pie": graph.binary.pie,
        "elf_type": graph.binary.elf_type,
        "functions": len(internal),
        "external_functions": sum(1 for n in nodes if n[2] == "external"),
        "direct_calls": sum(1 for s in sites
                            if s[5] in ("direct", "plt") and s[3] >= 5 and s[4][-10:-8] == "e8"),
        "plt_calls": sum(1 for s in sites if s[5] == "plt"),
        "tail_calls": sum(1 for s in sites if s[5] == "tail"),
        "indirect_calls": sum(1 for s in sites if s[5] == "indirect" and not s[8]),
        "indirect_jumps": sum(1 for s in sites if s[5] == "indirect" and s[8]),
        "address_taken": sum(1 for n in nodes if n[2] == "function" and n[6]),
        "roots": len(edges) - len(calls),
        "nodes": len(nodes),
        "edges": len(calls),
        "sccs": len({comp[n] for n in internal}),
        "complex_sccs": len({comp[u] for u in cyclic}),
        "cyclic_edges": len(cyclic),
        "text_bytes": graph.binary.text_bytes,
        "analysis_seconds": round(graph.analysis_seconds, 4),
    }


def _scc_ids(nodes: list[int], succ: dict[int, set[int]]) -> dict[int, int]:
    """Strongly connected component of every node (Tarjan's algorithm, iterative)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    comp: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    for root in nodes:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(succ.get(root, ())))]
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                    break
                if w in on_stack and index[w] < low[v]:
                    low[v] = index[w]
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    if low[v] < low[parent]:
                        low[parent] = low[v]
                if low[v] == index[v]:
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp[w] = v  # the component's root names it
                        if w == v:
                            break
    return comp
