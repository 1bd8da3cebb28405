"""The warm start: what the daemon derives from immutable inputs comes from a cache, and the cached
value is exactly the value computed from scratch (byte for byte where it goes into BPF maps); a
changed input misses the cache; a damaged cache entry is recomputed, never a traceback."""

from __future__ import annotations

from pathlib import Path

from test_encode_graphs import make_graph

from ccprofd.callgraph.model import CallGraph
from ccprofd.encode import build_plan, get_plan
from ccprofd.encode.edges import read_edges
from ccprofd.encode.plan import plan_path


def _weighted_graph() -> CallGraph:
    g = make_graph(6, [(0, 1), (1, 2), (2, 1), (1, 3), (0, 3), (3, 4), (4, 5), (0, 5)], roots=(0,))
    for i, (_u, _v, _k, d) in enumerate(g.graph.edges(keys=True, data=True)):
        d["weight"] = (i * 7) % 5 or None  # some edges weighted, some not
    return g


def test_plan_cache_hit_builds_no_networkx_graph_and_equals_the_built_plan(tmp_path: Path) -> None:
    g = _weighted_graph()
    # the edge rows read from the serialised graph (what a cache hit has) equal those of networkx
    lazy = CallGraph.from_dict(g.to_dict())
    assert read_edges(lazy) == read_edges(g)
    assert lazy._graph is None
    assert (lazy.number_of_nodes(), lazy.number_of_edges()) == \
        (g.graph.number_of_nodes(), g.graph.number_of_edges())
    assert lazy._graph is None
    first = get_plan(g, "valence", cache_dir=tmp_path)  # built (weights from the graph) and stored
    assert plan_path(tmp_path, first["key"]).exists()
    again = CallGraph.from_dict(g.to_dict())
    cached = get_plan(again, "valence", cache_dir=tmp_path)
    assert again._graph is None  # the hit never built the networkx graph
    fresh = build_plan(CallGraph.from_dict(g.to_dict()), "valence")
    fresh["report"]["build_seconds"] = cached["report"]["build_seconds"]
    assert cached == fresh
    assert cached["params"]["weights_hash"] is not None


def test_plan_cache_changed_weights_miss_and_corrupt_entry_rebuilds(tmp_path: Path) -> None:
    g = _weighted_graph()
    first = get_plan(g, "valence", cache_dir=tmp_path)
    other = _weighted_graph()
    d = next(iter(other.graph.edges(keys=True, data=True)))[3]
    d["weight"] = 1000  # a changed input: another key, not the stored plan
    changed = get_plan(CallGraph.from_dict(other.to_dict()), "valence", cache_dir=tmp_path)
    assert changed["key"] != first["key"]
    path = plan_path(tmp_path, first["key"])
    path.write_bytes(b"{not json")
    rebuilt = get_plan(CallGraph.from_dict(g.to_dict()), "valence", cache_dir=tmp_path)
    assert rebuilt["sites"] == first["sites"] and rebuilt["key"] == first["key"]
