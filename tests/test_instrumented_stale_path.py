"""Instrumented mode must not report a dead call's context as complete: the shape of ``find``'s wrong
samples (``ccprofd trace --mode instrumented -- /usr/bin/find DIR`` named ``sub_7890``'s call at
0x7c13, never executed, under the fts traversal).

tests/programs/stalepath.c: main -> pre -> mid -> target returns (no syscall there), then main ->
wide (a large frame it does not write) -> target calls getppid.  main -> wide and wide -> target
have the zero code (checked against the plan below), so before zero-code edges had a cut-only probe
no event fell between the return and the sample, the dead pieces (their return-address words intact
inside wide's frame) passed the liveness check, and every sample decoded to main -> pre -> mid ->
target, complete (all of them, for valence, pcce and hcce).  Now the call main -> wide cuts the state
at main's CFA: every sample equals ``strace -f -k``'s stack and is complete.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import require_bpf, require_tool
from fidelity import compare
from programs.build import build
from strace_oracle import run_strace

ROUNDS = 5


def _edges(binary: str, scheme: str) -> dict[tuple[str, str], list[list[Any]]]:
    from ccprofd.callgraph import analyze_binary
    from ccprofd.encode.plan import COL, build_plan

    graph = analyze_binary(binary, use_cache=False)
    names = {n: d["name"] for n, d in graph.graph.nodes(data=True)}
    out: dict[tuple[str, str], list[list[Any]]] = {}
    for row in build_plan(graph, scheme)["sites"]:
        out.setdefault((names[row[COL["caller"]]], names[row[COL["callee"]]]), []).append(row)
    return out


@pytest.mark.parametrize("encoding", ["valence", "pcce", "hcce"])
def test_the_true_path_has_only_zero_code_edges(encoding: str) -> None:
    """The precondition of the shape: the live path's edges have no bits, the dead path's have."""
    from ccprofd.encode.plan import COL

    edges = _edges(str(build("stalepath", opt="O0", pie=True)), encoding)
    assert [r[COL["code"]] for r in edges[("main", "wide")]] == [0]
    assert [r[COL["code"]] for r in edges[("wide", "target")]] == [0]
    assert len(edges[("mid", "target")]) == 3 and all(r[COL["code"]] for r in edges[("mid", "target")])


def test_zero_code_edges_get_a_cut_only_probe() -> None:
    from ccprofd.callgraph import analyze_binary
    from ccprofd.elf.image import ElfImage
    from ccprofd.encode.plan import build_plan
    from ccprofd.tracing.instrumented.loader import F_ACYC, F_CUT, F_CYCLIC, site_table
    from ccprofd.tracing.instrumented.probeplan import PCOL, R_CUT, build_probe_plan

    binary = str(build("stalepath", opt="O0", pie=True))
    graph = analyze_binary(binary, use_cache=False)
    plan = build_plan(graph, "valence")
    pp = build_probe_plan(graph, plan, ElfImage(binary))
    table = site_table(pp, plan)
    by_edge = {}
    for i, p in enumerate(pp.probes):
        if p[PCOL["kind"]] == "site" and p[PCOL["plan_site"]] >= 0:
            cs = pp.callsites[p[PCOL["callsite"]]]
            by_edge.setdefault((pp.names[cs[3]], pp.names[cs[4]]), []).append((p, table[i]))
    for edge in [("main", "wide"), ("wide", "target"), ("main", "pre"), ("pre", "mid")]:
        zero = [(p, t) for p, t in by_edge[edge] if p[PCOL["reasons"]] == R_CUT]
        assert zero, (edge, by_edge.get(edge))
        assert all(t["flags"] & F_CUT and not t["flags"] & (F_ACYC | F_CYCLIC) for _p, t in zero)
        assert all(t["val"] == [0] * len(t["val"]) for _p, t in zero)
    # memset is never a path to a sample point: still not probed
    assert ("wide", "memset") not in by_edge
    assert pp.stats["cut_only"] >= 4


@pytest.mark.parametrize("encoding", ["valence", "pcce", "hcce"])
def test_a_dead_calls_pieces_do_not_decode_as_the_context(encoding: str) -> None:
    require_bpf()
    require_tool("strace")
    from ccprofd.tracing.api import TraceOptions
    from ccprofd.tracing.session import open_session

    binary = str(build("stalepath", opt="O0", pie=True))
    session = open_session([binary, str(ROUNDS)], options=TraceOptions(
        mode="instrumented", syscalls="getppid", encoding=encoding))
    try:
        samples = list(session.samples())
        assert session.wait() == 0
    finally:
        session.close()
    assert len(samples) == ROUNDS
    stacks = [[f["function"] for f in s["frames"]] for s in samples]
    # before the cut-only probes: ['main', 'pre', 'mid', 'target'], complete, every round
    assert stacks == [["main", "wide", "target"]] * ROUNDS, stacks
    assert all(s["complete"] for s in samples)
    oracle = run_strace([binary, str(ROUNDS)], ["getppid"])
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    assert result.stats.samples_compared == ROUNDS
    assert result.stats.incomplete_samples == 0
