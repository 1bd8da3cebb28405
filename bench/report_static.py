"""Static statistics of the evaluation report (the Valence paper's Table 1, paper 001's Table 1).

Per binary: call-graph size and shape (nodes, edges, SCCs, complex SCCs, cyclic edges), the acyclic
encoding bits and instrumented edges of PCCE / Valence / HCCE (from each scheme's encoding plan), and
for stack tags the number of distinct *root paths* -- function sequences that start at a root
function (a successor of the virtual root) and follow call-graph edges, 1 to ``depth`` functions
long, parallel edges counted once -- and the collisions among their tags.

Counting is dynamic programming over the graph (``count[d][v]`` = sequences of length d ending at v),
exact in Python integers.  Collisions: the tag of a path is the stack-tags plan's chain
``T = MIX(T, id(f))`` from 0 (what the probes compute); when there are at most ``enumerate_limit``
paths every one is enumerated (numpy, level by level) and ``collisions = paths - distinct tags``;
otherwise ``samples`` paths are drawn uniformly from all of them (backwards through the DP counts)
and the number of colliding pairs among all paths is estimated from the colliding pairs among the
sampled ones (``pairs * P^2 / (N (N-1))``), marked as an estimate.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ccprofd.callgraph import analyze_binary
from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.encode import build_plan
from ccprofd.encode.plan import COL

SCHEMES = ("pcce", "valence", "hcce")
MIX_FACTOR = np.uint64(11)  # ccprofd.encode.stacktags.MIX_FACTOR, checked in tests


@dataclass
class PathStats:
    """Stack-tag root paths of one graph up to ``depth`` functions."""

    depth: int
    roots: int
    max_out_degree: int
    paths: int  # distinct root paths of length 1..depth
    paths_at_depth: int  # of exactly ``depth`` functions (paper 001's "Stacks (d = 10)")
    method: str  # "enumerated" | "sampled"
    examined: int  # paths whose tags were computed
    collisions: float  # enumerated: paths - distinct tags; sampled: estimated colliding pairs
    sample_colliding_pairs: int | None  # sampled only
    estimate: bool
    seconds: float


def _dense_graph(plan: dict[str, Any]) -> tuple[list[int], np.ndarray, list[tuple[int, int]]]:
    """Roots (dense), function ids (uint64 per dense node) and distinct (caller, callee) pairs."""
    nodes = plan["nodes"]
    index = {n: i for i, n in enumerate(nodes)}
    ids = np.array(plan["tables"]["ids"], dtype=np.uint64)
    roots: set[int] = set()
    pairs: set[tuple[int, int]] = set()
    ci, ki = COL["caller"], COL["callee"]
    for row in plan["sites"]:
        u, v = row[ci], row[ki]
        if u == ROOT:
            roots.add(index[v])
        else:
            pairs.add((index[u], index[v]))
    return sorted(roots), ids, sorted(pairs)


def count_paths(n: int, roots: list[int], pairs: list[tuple[int, int]], depth: int) -> list[list[int]]:
    """``counts[d-1][v]``: distinct function sequences of length d from a root ending at v (exact)."""
    level = [0] * n
    for r in roots:
        level[r] = 1
    counts = [level]
    for _ in range(depth - 1):
        nxt = [0] * n
        prev = counts[-1]
        for u, v in pairs:
            c = prev[u]
            if c:
                nxt[v] += c
        counts.append(nxt)
    return counts


def _csr(n: int, pairs: list[tuple[int, int]], by: int) -> tuple[np.ndarray, np.ndarray]:
    """Adjacency in CSR form keyed by ``pairs[i][by]``: (start offsets of length n+1, other ends)."""
    arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    order = np.lexsort((arr[:, 1 - by], arr[:, by]))
    arr = arr[order]
    start = np.zeros(n + 1, dtype=np.int64)
    np.add.at(start, arr[:, by] + 1, 1)
    return np.cumsum(start), arr[:, 1 - by].copy()


def _mix(tags: np.ndarray, ident: np.ndarray) -> np.ndarray:
    return (tags * MIX_FACTOR) ^ ident


def enumerate_tags(
    n: int, roots: list[int], ids: np.ndarray, pairs: list[tuple[int, int]], depth: int
) -> np.ndarray:
    """Tags of every root path of length 1..depth (numpy, one level at a time)."""
    start, succ = _csr(n, pairs, 0)
    deg = np.diff(start)
    nodes = np.array(roots, dtype=np.int64)
    tags = ids[nodes].copy()
    out = [tags]
    with np.errstate(over="ignore"):
        for _ in range(depth - 1):
            d = deg[nodes]
            total = int(d.sum())
            if total == 0:
                break
            parent = np.repeat(np.arange(len(nodes)), d)
            first = np.repeat(np.cumsum(d) - d, d)
            pos = start[nodes][parent] + (np.arange(total) - first)
            nodes = succ[pos]
            tags = _mix(tags[parent], ids[nodes])
            out.append(tags)
    return np.concatenate(out)


def sample_paths(
    n: int, counts: list[list[int]], pairs: list[tuple[int, int]], samples: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """``samples`` root paths drawn uniformly from all of them; returns per length d (1-based index
    d-1) an array of shape (k, d) of dense nodes, outermost first."""
    depth = len(counts)
    totals = np.array([float(sum(c)) for c in counts])
    lengths = rng.choice(depth, size=samples, p=totals / totals.sum()) + 1
    pstart, preds = _csr(n, pairs, 1)
    out: list[np.ndarray] = []
    for d in range(1, depth + 1):
        k = int((lengths == d).sum())
        if k == 0:
            out.append(np.zeros((0, d), dtype=np.int64))
            continue
        paths = np.zeros((k, d), dtype=np.int64)
        last = np.array(counts[d - 1], dtype=float)
        paths[:, d - 1] = rng.choice(n, size=k, p=last / last.sum())
        for lvl in range(d - 1, 0, -1):  # choose the node at position lvl-1 given position lvl
            w = np.array(counts[lvl - 1], dtype=float)[preds]  # weight of each CSR entry
            seg_sum = np.add.reduceat(np.append(w, 0.0), pstart[:-1]) if len(w) else np.zeros(n)
            seg_sum = np.where(np.diff(pstart) > 0, seg_sum, 0.0)
            owner = np.repeat(np.arange(n), np.diff(pstart))
            prob = np.divide(w, seg_sum[owner], out=np.zeros_like(w), where=seg_sum[owner] > 0)
            cum = np.cumsum(prob)
            cur = paths[:, lvl]
            lo, hi = pstart[cur], pstart[cur + 1]
            base = np.where(lo > 0, cum[np.maximum(lo - 1, 0)], 0.0)
            pos = np.searchsorted(cum, base + rng.random(k) * (cum[hi - 1] - base), side="right")
            paths[:, lvl - 1] = preds[np.clip(pos, lo, hi - 1)]
        out.append(paths)
    return out


def _distinct(values: np.ndarray) -> int:
    """Number of distinct values (sorts in place; np.unique is far slower on large uint64 arrays)."""
    if len(values) == 0:
        return 0
    values.sort(kind="stable")
    return int(np.count_nonzero(values[1:] != values[:-1])) + 1


def _colliding_pairs(tags: np.ndarray, ident: np.ndarray) -> int:
    """Pairs of sampled paths with equal tags but different paths (``ident``: a second, independent
    hash of the path, equal for repeated draws of the same path)."""
    order = np.lexsort((ident, tags))
    t, h = tags[order], ident[order]
    pairs = 0
    boundaries = np.flatnonzero(np.diff(t)) + 1
    for grp_t, grp_h in zip(np.split(t, boundaries), np.split(h, boundaries), strict=True):
        if len(grp_t) < 2:
            continue
        _, mult = np.unique(grp_h, return_counts=True)
        m = len(grp_h)
        pairs += m * (m - 1) // 2 - int((mult * (mult - 1) // 2).sum())
    return pairs


def root_path_stats(
    plan: dict[str, Any], depth: int = 10, enumerate_limit: int = 10**8, samples: int = 10**6, seed: int = 1
) -> PathStats:
    """Paper 001's Table 1 method on a stack-tags plan (see the module docstring)."""
    t0 = time.perf_counter()
    roots, ids, pairs = _dense_graph(plan)
    n = len(ids)
    counts = count_paths(n, roots, pairs, depth)
    total = sum(sum(c) for c in counts)
    outdeg: dict[int, int] = {}
    for u, _ in pairs:
        outdeg[u] = outdeg.get(u, 0) + 1
    common = {
        "depth": depth,
        "roots": len(roots),
        "max_out_degree": max(outdeg.values(), default=0),
        "paths": total,
        "paths_at_depth": sum(counts[-1]),
    }
    if total <= enumerate_limit:
        tags = enumerate_tags(n, roots, ids, pairs, depth)
        assert len(tags) == total, (len(tags), total)
        distinct = _distinct(tags)
        del tags
        return PathStats(
            **common,
            method="enumerated",
            examined=total,
            collisions=float(total - distinct),
            sample_colliding_pairs=None,
            estimate=False,
            seconds=time.perf_counter() - t0,
        )
    rng = np.random.default_rng(seed)
    rid = rng.integers(1, 2**63, size=n, dtype=np.uint64) | np.uint64(1)
    mult2 = np.uint64(0x9E3779B97F4A7C15)
    all_tags: list[np.ndarray] = []
    all_ident: list[np.ndarray] = []
    with np.errstate(over="ignore"):
        for paths in sample_paths(n, counts, pairs, samples, rng):
            if len(paths) == 0:
                continue
            tag = np.zeros(len(paths), dtype=np.uint64)
            ident = np.full(len(paths), np.uint64(paths.shape[1]), dtype=np.uint64)
            for col in range(paths.shape[1]):
                tag = _mix(tag, ids[paths[:, col]])
                ident = (ident * mult2) ^ rid[paths[:, col]]
                ident ^= ident >> np.uint64(29)
            all_tags.append(tag)
            all_ident.append(ident)
    tags = np.concatenate(all_tags)
    ident = np.concatenate(all_ident)
    pairs_found = _colliding_pairs(tags, ident)
    nsamp = len(tags)
    estimate = pairs_found * (total / nsamp) * (total / max(1, nsamp - 1))
    return PathStats(
        **common,
        method="sampled",
        examined=nsamp,
        collisions=estimate,
        sample_colliding_pairs=pairs_found,
        estimate=True,
        seconds=time.perf_counter() - t0,
    )


def binary_stats(
    path: str,
    *,
    name: str | None = None,
    depth: int = 10,
    enumerate_limit: int = 10**8,
    samples: int = 10**6,
    graph: CallGraph | None = None,
) -> dict[str, Any]:
    """One Table 1 row (a plain dict; numbers only, formatting is the renderer's)."""
    t0 = time.perf_counter()
    g = graph if graph is not None else analyze_binary(path)
    analysis_s = time.perf_counter() - t0
    reports = {s: build_plan(g, s)["report"] for s in SCHEMES}
    tags_plan = build_plan(g, "stacktags")
    v = reports["valence"]
    row: dict[str, Any] = {
        "binary": name or path,
        "path": path,
        "build_id": g.binary.build_id,
        "nodes": v["nodes"],
        "edges": v["edges"],
        "sccs": v["sccs"],
        "complex_sccs": v["complex_sccs"],
        "cyclic_edges": v["cyclic_edges"],
        "analysis_seconds": round(analysis_s, 3),
    }
    for s in SCHEMES:
        r = reports[s]
        row[f"acyclic_bits_{s}"] = r["acyclic_bits"]
        row[f"instrumented_{s}"] = r["instrumented_edges"]
        row[f"words_needed_{s}"] = r.get("words_needed")
        row[f"overflow_{s}"] = bool(r.get("overflow"))
        row[f"rec_code_bits_{s}"] = r.get("rec_code_bits")
    row["instrumented_stacktags"] = tags_plan["report"]["instrumented_edges"]
    row["stacktags"] = asdict(root_path_stats(tags_plan, depth, enumerate_limit, samples))
    return row
