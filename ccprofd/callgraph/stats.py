"""Table-1-style statistics of a call graph (the `ccprofd analyze --json` contract)."""

from __future__ import annotations

from typing import Any

from ccprofd.callgraph.model import ROOT, CallGraph


def graph_stats(graph: CallGraph) -> dict[str, Any]:
    if graph.cached_stats is not None:
        return dict(graph.cached_stats, binary=graph.binary.path)
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
