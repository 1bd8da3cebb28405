"""``ccprofd trace --mode instrumented --scope``: the frames above a scope function come from one unwind
of the stack copied at its entry (instrumented.c cc_scope_prefix +
ccprofd/tracing/instrumented/scopeprefix.py).

tests/programs/scoped.c reaches ``handler`` through a mutual recursion whose depth and shape change
every round, amid call-heavy code outside the scope.  With ``--scope '^handler$'`` every sample
inside the scope must be complete and equal, frame by frame, to what ``strace -f -k`` unwinds over
the whole stack; samples outside the scope stay flagged (``complete: false``); and the scoped run
hits far fewer probes than the unscoped one.  Control: with a stack copy of one page, the prefix
walks run off the copy and the samples stay flagged (never guessed).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import require_bpf, require_tool
from fidelity import compare
from programs.build import build
from strace_oracle import run_strace

REPO = pathlib.Path(__file__).resolve().parent.parent
ROUNDS = 10
PER_ROUND = 4  # getppid: step (busy), handler, h_inner's bottom, main


@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    require_bpf()
    require_tool("strace")


def trace_scoped(binary: pathlib.Path, tmp_path: pathlib.Path, args: list[str], *extra: str,
                 env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run the CLI on the program; keep it alive (blocked on stdin) until every sample is written,
    so its maps can still be read when the last scope entry is processed."""
    out = tmp_path / "samples.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented", "--format", "jsonl",
         "--syscalls", "getppid", "--output", str(out), *extra, "--", str(binary), *args],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})})
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "rounds done\n"
        deadline = time.monotonic() + 300  # a hang guard, not a performance limit
        while time.monotonic() < deadline:
            if out.exists() and out.read_text().count("\n") >= ROUNDS * PER_ROUND:
                break
            time.sleep(0.1)
        proc.stdin.close()
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.read_text().splitlines()]


def in_scope(sample: dict[str, Any]) -> bool:
    return any(f["function"] == "handler" for f in sample["frames"])


VARIANTS = [pytest.param({"opt": "O0", "pie": True}, id="O0-pie"),
            pytest.param({"opt": "O2", "pie": False}, id="O2-nopie")]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("depth", [0, 150], ids=["chains-4-40", "chains-154-190"])
def test_scope_samples_get_the_prefix(variant: dict[str, Any], depth: int, tmp_path: pathlib.Path) -> None:
    binary = build("scoped", **variant)
    samples = trace_scoped(binary, tmp_path, [str(ROUNDS), str(depth)], "--scope", "^handler$")
    assert len(samples) == ROUNDS * PER_ROUND
    inside = [s for s in samples if in_scope(s)]
    outside = [s for s in samples if not in_scope(s)]
    assert len(inside) == 2 * ROUNDS and len(outside) == 2 * ROUNDS
    assert all(s["complete"] for s in inside), [[f["function"] for f in s["frames"]] for s in inside
                                                 if not s["complete"]]
    assert all(not s["complete"] and not s["frames"] for s in outside), outside[:1]
    # the chains above the scope differ from round to round (depth 4 + 7i mod 37, a/b shape)
    chains = {tuple(f["function"] for f in s["frames"][:-1]) for s in inside if s["frames"][-1]["function"]
              == "handler"}
    assert len(chains) == ROUNDS
    oracle = run_strace([str(binary), str(ROUNDS), str(depth)], ["getppid"])
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    assert result.stats.samples_compared == len(samples)
    assert result.stats.incomplete_samples == len(outside)


def test_scope_probes_far_fewer_sites() -> None:
    """Probe hits (BPF counters) with and without --scope on the same program."""
    from ccprofd.tracing.api import TraceOptions
    from ccprofd.tracing.session import open_session

    binary = build("scoped", opt="O0", pie=True)
    hits = {}
    for scope in (None, "^handler$"):
        s = open_session([str(binary), str(ROUNDS)], options=TraceOptions(
            mode="instrumented", syscalls="getppid", scope=scope))
        n = sum(1 for _ in s.samples())
        bpf = s.mode.summary()["bpf"]
        s.wait()
        assert n == ROUNDS * PER_ROUND
        hits[scope] = bpf["site_hits"] + bpf["tail_hits"] + bpf["entry_hits"]
    # unscoped: every round's 1,000 step calls through the coded call site, plus the route chain
    assert hits[None] >= ROUNDS * 1000
    # scoped: per round the handler entry, its getppid exit, h_inner's calls (i % 4) and their exit
    assert hits["^handler$"] <= ROUNDS * 8, hits
    assert hits["^handler$"] * 50 < hits[None], hits


def test_prefix_copy_too_small_stays_flagged(tmp_path: pathlib.Path) -> None:
    """One page of stack per entry: chains of 150+ frames (32 bytes each at -O0) do not fit, the walk
    stops at the copy's end and the samples inside the scope stay flagged -- each a suffix of
    strace's stack."""
    binary = build("scoped", opt="O0", pie=True)
    args = [str(ROUNDS), "150"]
    samples = trace_scoped(binary, tmp_path, args, "--scope", "^handler$",
                           env={"CCPROFD_SCOPE_STACK_PAGES": "1"})
    inside = [s for s in samples if in_scope(s)]
    assert len(inside) == 2 * ROUNDS and all(not s["complete"] for s in inside), inside[:1]
    oracle = run_strace([str(binary), *args], ["getppid"])
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()


@pytest.mark.parametrize("variant", VARIANTS)
def test_callee_of_the_scope_called_from_outside(variant: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """``report`` is below the scope ``is_even`` and also called from ``main`` (three call sites),
    outside it.  Those calls carry no probes, so a sample there must not be decoded as if they had
    taken zero-code edges (it was: ``main`` at the first call site for all three, complete).  Every
    sample is compared with strace -f -k; outside the scope only the current function is known."""
    binary = pathlib.Path(build("recursion", **variant))
    syscalls = ["write", "openat", "getppid", "close"]
    cmd = [str(binary), "10"]
    oracle = run_strace(cmd, syscalls)
    out = tmp_path / "scoped.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented",
                           "--scope", "^is_even$", "--format", "jsonl", "--syscalls", ",".join(syscalls),
                           "--output", str(out), "--", *cmd],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    from_main = [s for s in samples if [f["function"] for f in s["frames"]] == ["report"]]
    assert len(from_main) >= 3, samples  # report's writes made for main: flagged, innermost frame only
    assert all(not s["complete"] for s in from_main)
