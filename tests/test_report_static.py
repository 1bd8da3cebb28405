"""bench/report_static.py: root-path counting, tag enumeration, uniform sampling and collision counts
checked against brute force on small hand-made graphs (no BPF, no binaries)."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import report_static as rs

from ccprofd.callgraph.model import ROOT
from ccprofd.encode.plan import SITE_COLUMNS

MASK = (1 << 64) - 1


def plan_of(roots: list[int], edges: list[tuple[int, int]], ids: dict[int, int]) -> dict[str, Any]:
    """A minimal stack-tags plan: the fields root_path_stats reads."""
    nodes = sorted({ROOT, *ids})
    rows = []
    for r in roots:
        rows.append([0, ROOT, r, "root", 1, None, None, 0, None])
    for i, (u, v) in enumerate(edges):
        rows.append([0x1000 + i, u, v, "direct", 1, None, None, 0, None])
    assert len(rows[0]) == len(SITE_COLUMNS)
    return {"nodes": nodes, "sites": rows, "tables": {"ids": [ids.get(n, 0) for n in nodes]}}


def brute_paths(roots: list[int], edges: list[tuple[int, int]], depth: int) -> list[tuple[int, ...]]:
    succ: dict[int, set[int]] = {}
    for u, v in edges:
        succ.setdefault(u, set()).add(v)
    out = []
    frontier = [(r,) for r in roots]
    for _ in range(depth):
        out += frontier
        frontier = [(*p, v) for p in frontier for v in sorted(succ.get(p[-1], ()))]
    return out


def tag_of(path: tuple[int, ...], ids: dict[int, int]) -> int:
    t = 0
    for f in path:
        t = ((t * 11) & MASK) ^ ids[f]
    return t


GRAPH_ROOTS = [1, 2]
# a cycle (3 <-> 4), a self loop (5), parallel edges (1 -> 3 twice) and a diamond
GRAPH_EDGES = [(1, 3), (1, 3), (1, 4), (2, 4), (3, 4), (4, 3), (4, 5), (5, 5), (3, 6), (4, 6)]
IDS = {n: (0x9E3779B97F4A7C15 * (n + 7)) & MASK for n in range(1, 7)}


def test_counts_and_tags_match_brute_force() -> None:
    plan = plan_of(GRAPH_ROOTS, GRAPH_EDGES, IDS)
    for depth in (1, 3, 6):
        st = rs.root_path_stats(plan, depth=depth)
        paths = brute_paths(GRAPH_ROOTS, GRAPH_EDGES, depth)
        assert st.paths == len(paths)
        assert st.paths_at_depth == sum(1 for p in paths if len(p) == depth)
        assert st.method == "enumerated" and not st.estimate
        assert st.collisions == len(paths) - len({tag_of(p, IDS) for p in paths})
    roots, ids, pairs = rs._dense_graph(plan)
    tags = rs.enumerate_tags(len(ids), roots, ids, pairs, 5)
    index = {n: i for i, n in enumerate(plan["nodes"])}
    truth = brute_paths(GRAPH_ROOTS, GRAPH_EDGES, 5)
    assert sorted(int(t) for t in tags) == sorted(tag_of(p, IDS) for p in truth)
    assert all(int(ids[index[n]]) == IDS[n] for n in IDS)


def test_collisions_are_counted() -> None:
    # Paths (1) and (2) collide when the two roots share an id; (1,3) and (2,3) then collide too.
    ids = dict(IDS)
    ids[2] = ids[1]
    plan = plan_of([1, 2], [(1, 3), (2, 3)], ids)
    st = rs.root_path_stats(plan, depth=2)
    assert (st.paths, st.collisions) == (4, 2.0)
    sampled = rs.root_path_stats(plan, depth=2, enumerate_limit=0, samples=20000)
    assert sampled.method == "sampled" and sampled.estimate
    # 2 of the C(4, 2) unordered pairs of paths collide: the estimate scales the sampled pairs back
    assert sampled.sample_colliding_pairs and sampled.sample_colliding_pairs > 0
    assert sampled.collisions == pytest.approx(2.0, rel=0.15)


def test_sampling_is_uniform_over_paths() -> None:
    plan = plan_of(GRAPH_ROOTS, GRAPH_EDGES, IDS)
    roots, ids, pairs = rs._dense_graph(plan)
    counts = rs.count_paths(len(ids), roots, pairs, 4)
    rng = np.random.default_rng(3)
    n = 40000
    drawn: Counter[tuple[int, ...]] = Counter()
    for arr in rs.sample_paths(len(ids), counts, pairs, n, rng):
        for row in arr:
            drawn[tuple(plan["nodes"][i] for i in row)] += 1
    truth = brute_paths(GRAPH_ROOTS, GRAPH_EDGES, 4)
    assert set(drawn) == set(truth)  # only real paths, every one of them
    expected = n / len(truth)
    chi2 = sum((drawn[p] - expected) ** 2 / expected for p in truth)
    dof = len(truth) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ~5 standard deviations of chi2(dof)
    biased = sum((c - expected) ** 2 / expected for c in [n // 2] + [0] * (len(truth) - 1))
    assert biased > dof + 5 * (2 * dof) ** 0.5  # the bound does reject a non-uniform draw


def test_mix_factor_is_the_encoders() -> None:
    from ccprofd.encode.stacktags import MIX_FACTOR, mix

    assert int(rs.MIX_FACTOR) == MIX_FACTOR
    assert all(mix(a, b) == ((a * 11) & MASK) ^ b for a, b in itertools.product([0, 5, MASK], [1, MASK]))

