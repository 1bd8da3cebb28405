"""Benchmark of the encodings: a Table-1-style comparison, plan build time, decode throughput.

For each binary: nodes, edges, SCCs, complex SCCs, cyclic edges, acyclic bits (PCCE / Valence /
HCCE), instrumented edges per scheme, and the time to build each plan (PCCE is the baseline the
issue names).  Decode throughput is measured on python3.11's Valence plan with contexts produced by
random call walks of depth ~20 through the Encoder (the probes' reference semantics): distinct
contexts decoded once each, and the same contexts decoded again through the cache.

Usage: .venv/bin/python bench/encode.py [--update-readme] [--decode-contexts N] [BINARY ...]
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from pathlib import Path
from typing import Any

from common import machine_line, update_readme_section

from ccprofd.callgraph import analyze_binary
from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.decode import CachingDecoder, decoder_for
from ccprofd.encode import Encoder, build_plan

DEFAULT = ["/usr/bin/python3.11", "/bin/bash", "/usr/bin/gzip", "/usr/bin/xz", "/usr/bin/sqlite3",
           "/usr/bin/lua5.4", "/usr/bin/node"]
SCHEMES = ("pcce", "valence", "hcce")


def table_row(path: str) -> tuple[list[str], dict[str, float]]:
    graph = analyze_binary(path)
    reports: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    for scheme in SCHEMES:
        t0 = time.perf_counter()
        plan = build_plan(graph, scheme)
        seconds[scheme] = time.perf_counter() - t0
        reports[scheme] = plan["report"]
    v = reports["valence"]
    row = [f"`{Path(path).name}`", str(v["nodes"]), str(v["edges"]), str(v["sccs"]), str(v["complex_sccs"]),
           str(v["cyclic_edges"])]
    for scheme in SCHEMES:
        r = reports[scheme]
        row.append(f"{r['acyclic_bits']}" + (" (overflow)" if r.get("overflow") else ""))
    row += [str(reports[s]["instrumented_edges"]) for s in SCHEMES]
    row += [f"{seconds[s]:.2f}" for s in SCHEMES]
    return row, seconds


def random_contexts(graph: CallGraph, plan: dict[str, Any], n: int, depth: int,
                    seed: int = 1) -> list[tuple[Any, int]]:
    """States and current nodes after random call walks from the virtual root."""
    rng = random.Random(seed)
    g = graph.graph
    out_edges = {u: [(u, v, k) for _, v, k in g.out_edges(u, keys=True)] for u in g.nodes}
    contexts: list[tuple[Any, int]] = []
    seen: set[tuple[Any, int]] = set()
    attempts = 0
    enc = Encoder(plan)  # one encoder, unwound to the root between walks (building one indexes every site)
    while len(contexts) < n and attempts < n * 20:
        attempts += 1
        if enc.depth:
            enc.unwind(enc.depth)
        node = ROOT
        for _ in range(depth):
            choices = [e for e in out_edges.get(node, []) if g.nodes[e[1]]["kind"] == "function"]
            if not choices:
                break
            # Prefer callees that call further, so walks reach the target depth instead of a leaf.
            deeper = [e for e in choices
                      if any(g.nodes[c[1]]["kind"] == "function" for c in out_edges[e[1]])]
            edge = rng.choice(deeper or choices)
            enc.call(edge)
            node = edge[1]
        key = (enc.state(), node)
        if enc.depth >= depth - 2 and key not in seen:
            seen.add(key)
            contexts.append(key)
    return contexts


def decode_throughput(path: str, n: int) -> str:
    graph = analyze_binary(path)
    plan = build_plan(graph, "valence")
    contexts = random_contexts(graph, plan, n, depth=20)
    depths = [len(decoder_for(plan).decode(s, node)) for s, node in contexts[:200]]
    plain = decoder_for(plan)
    t0 = time.perf_counter()
    for state, node in contexts:
        plain.decode(state, node)
    distinct = len(contexts) / (time.perf_counter() - t0)
    cached = CachingDecoder(decoder_for(plan))
    for state, node in contexts:
        cached.decode(state, node)
    repeats = 10
    t0 = time.perf_counter()
    for _ in range(repeats):
        for state, node in contexts:
            cached.decode(state, node)
    repeated = repeats * len(contexts) / (time.perf_counter() - t0)
    avg_depth = sum(depths) / max(1, len(depths))
    return (f"Valence decoding on `{path}` ({len(contexts)} distinct contexts from random call walks, "
            f"average depth {avg_depth:.1f}): **{distinct:,.0f} distinct contexts/s** (target ≥ 20k/s), "
            f"**{repeated:,.0f} repeated contexts/s** through the decode cache (target ≥ 100k/s).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("binaries", nargs="*")
    ap.add_argument("--update-readme", action="store_true")
    ap.add_argument("--decode-contexts", type=int, default=5000)
    args = ap.parse_args()
    binaries = args.binaries or [b for b in DEFAULT if shutil.which(b) or Path(b).exists()]
    header = ("| binary | nodes | edges | SCCs | complex SCCs | cyclic edges "
              "| acyclic bits PCCE | Valence | HCCE "
              "| instrumented PCCE | Valence | HCCE | plan s PCCE | Valence | HCCE |")
    lines = [f"Measured on {machine_line()}.", "", header, "|" + "---|" * 15]
    for b in binaries:
        row, _ = table_row(b)
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    lines += ["", decode_throughput("/usr/bin/python3.11", args.decode_contexts), "",
              "Targets (issue #3): plan for python3.11 ≤ 2 s, for a node-sized graph (~430k call sites) "
              "≤ 30 s; "
              "PCCE's plan is the baseline in the same run. `acyclic bits` counts virtual-root edges; "
              "`(overflow)` marks a PCCE/HCCE id wider than the plan's `pcce_words` (64 bits by default), "
              "reported instead of wrapped."]
    table = "\n".join(lines)
    print(table)
    if args.update_readme and not update_readme_section("encode", table):
        print("(README.md has no <!-- bench:encode --> section; not updated)")


if __name__ == "__main__":
    main()
