"""Flat, index-based view of a :class:`CallGraph` that every encoder works on.

Encoders touch each edge a handful of times; reading networkx attribute dicts each time would
dominate plan-build time on 400k-edge graphs, so the graph is read once into parallel lists.

Edge ids ("site ids" in the plan) are positions in the order ``(call-site address, caller, callee)``;
root edges (key 0) come first.  A node's incoming edges are kept in the order every encoder visits
them: weight descending (when weights are known), then call-site address.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from ccprofd.callgraph.model import ROOT, CallGraph

EdgeKey = tuple[int, int, int]  # (caller, callee, call-site key) as in the networkx MultiDiGraph


@dataclass(slots=True)
class EdgeArrays:
    """Nodes densely numbered ``0..N-1`` (``nodes[i]`` is the node id) and edges as parallel lists."""

    nodes: list[int]
    index: dict[int, int]
    caller: list[int]  # dense caller index per edge
    callee: list[int]  # dense callee index per edge
    site: list[int]  # call-site key (vaddr; 0 for root edges)
    kind: list[str]
    weight: list[int]
    weighted: bool
    incoming: list[list[int]]  # per dense node: edge ids in visiting order
    outgoing: list[list[int]]  # per dense node: edge ids in call-site address order
    root: int  # dense index of ROOT

    @property
    def n_edges(self) -> int:
        return len(self.caller)


EdgeRow = tuple[int, int, int, str, int]  # (site key, caller, callee, kind, weight attribute or 0)


def read_edges(graph: CallGraph) -> list[EdgeRow]:
    """One pass over the edges, sorted into edge-id order (from the serialised rows of a cached
    graph, so that a plan-cache hit builds no networkx graph)."""
    return sorted((k, u, v, str(kind), int(weight or 0)) for u, v, k, kind, weight in graph.edge_rows())


def effective_weights(graph: CallGraph, weights: Mapping[EdgeKey, int] | None,
                      rows: list[EdgeRow] | None = None) -> dict[EdgeKey, int] | None:
    """Explicit weights win; otherwise the graph's own ``weight`` attributes, if any edge has one."""
    if weights is not None:
        return {k: int(w) for k, w in weights.items() if w}
    if rows is None:  # no need to sort every edge (a warm start's cache key) for the few weighted ones
        if not graph.has_edge_weights():
            return None
        found = {(u, v, k): int(w) for u, v, k, _, w in graph.edge_rows() if w}
    else:
        found = {(u, v, k): w for k, u, v, _, w in rows if w}
    return found or None


def weights_hash(weights: Mapping[EdgeKey, int] | None) -> str | None:
    """Stable digest of a weight map (part of the plan's cache key)."""
    if not weights:
        return None
    h = hashlib.sha256()
    for (u, v, k), w in sorted(weights.items()):
        if w:
            h.update(f"{u},{v},{k},{w};".encode())
    return h.hexdigest()


def edge_arrays(graph: CallGraph, weights: Mapping[EdgeKey, int] | None = None,
                rows: list[EdgeRow] | None = None) -> EdgeArrays:
    """Flatten the graph; ``weights`` (already resolved by :func:`effective_weights`) may be None."""
    g = graph.graph
    nodes = sorted(g.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    if rows is None:
        rows = read_edges(graph)
    caller = [index[r[1]] for r in rows]
    callee = [index[r[2]] for r in rows]
    site = [r[0] for r in rows]
    kind = [r[3] for r in rows]
    weighted = bool(weights)
    weight = [weights.get((r[1], r[2], r[0]), 0) for r in rows] if weights else [0] * len(rows)
    n = len(nodes)
    incoming: list[list[int]] = [[] for _ in range(n)]
    outgoing: list[list[int]] = [[] for _ in range(n)]
    for e in range(len(rows)):
        incoming[callee[e]].append(e)
        outgoing[caller[e]].append(e)
    if weighted:
        for lst in incoming:
            if len(lst) > 1:
                lst.sort(key=lambda e: (-weight[e], e))
    return EdgeArrays(nodes=nodes, index=index, caller=caller, callee=callee, site=site, kind=kind,
                      weight=weight, weighted=weighted, incoming=incoming, outgoing=outgoing,
                      root=index[ROOT])
