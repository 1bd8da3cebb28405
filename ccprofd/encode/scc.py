"""Strongly connected components, cyclic edges and the consolidated DAG (Valence section 3.2).

An edge whose caller and callee lie in one SCC is *cyclic* (it can repeat, so it goes to ``recID``);
every other edge joins two different SCCs and is encoded in the fixed-width ``acycID`` on the graph
that has each SCC consolidated to a single node.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ccprofd.encode.edges import EdgeArrays

if TYPE_CHECKING:
    import networkx as nx


@dataclass(slots=True)
class Sccs:
    """``comp[i]`` is the SCC of dense node ``i``; components are numbered in topological order."""

    comp: list[int]
    members: list[list[int]]
    cyclic: bytearray  # per edge: 1 when caller and callee share an SCC
    complex: bytearray  # per component: 1 when it holds at least one cyclic edge
    acyc_in: list[list[int]]  # per component: incoming non-cyclic edges in visiting order

    @property
    def n_cyclic(self) -> int:
        return sum(self.cyclic)

    @property
    def n_complex(self) -> int:
        return sum(self.complex)


def sccs(ea: EdgeArrays, graph: nx.MultiDiGraph) -> Sccs:
    """Tarjan's SCCs (networkx, run on the graph ``ea`` was read from, which saves building a copy),
    then a topological numbering of the components."""
    import networkx as nx  # here, not at import: a warm start takes its plan from the cache

    n = len(ea.nodes)
    index = ea.index
    raw = [[index[v] for v in comp] for comp in nx.strongly_connected_components(graph)]
    raw_comp = [0] * n
    for ci, raw_members in enumerate(raw):
        for v in raw_members:
            raw_comp[v] = ci
    # Kahn's algorithm over the component graph; sources seeded by smallest member for determinism.
    nc = len(raw)
    indeg = [0] * nc
    succ: list[list[int]] = [[] for _ in range(nc)]
    for u, v in zip(ea.caller, ea.callee, strict=True):
        cu, cv = raw_comp[u], raw_comp[v]
        if cu != cv:
            succ[cu].append(cv)
            indeg[cv] += 1
    order_key = [min(m) for m in raw]
    queue = deque(sorted((c for c in range(nc) if indeg[c] == 0), key=order_key.__getitem__))
    topo: list[int] = []
    while queue:
        c = queue.popleft()
        topo.append(c)
        for d in succ[c]:
            indeg[d] -= 1
            if indeg[d] == 0:
                queue.append(d)
    if len(topo) != nc:  # pragma: no cover - networkx guarantees a DAG of components
        raise RuntimeError("component graph is not acyclic")
    renum = [0] * nc
    for new, old in enumerate(topo):
        renum[old] = new
    comp = [renum[raw_comp[v]] for v in range(n)]
    members: list[list[int]] = [[] for _ in range(nc)]
    for v in range(n):
        members[comp[v]].append(v)
    m = ea.n_edges
    cyclic = bytearray(m)
    cplx = bytearray(nc)
    acyc_in: list[list[int]] = [[] for _ in range(nc)]
    for e in range(m):
        cu, cv = comp[ea.caller[e]], comp[ea.callee[e]]
        if cu == cv:
            cyclic[e] = 1
            cplx[cu] = 1
        else:
            acyc_in[cv].append(e)
    # Same visiting order as for single nodes: weight descending, then call-site address (edge id).
    # Unweighted lists are already in edge-id order because edges were scanned in id order.
    for lst in acyc_in:
        if len(lst) > 1 and ea.weighted:
            lst.sort(key=lambda e: (-ea.weight[e], e))
    return Sccs(comp=comp, members=members, cyclic=cyclic, complex=cplx, acyc_in=acyc_in)
