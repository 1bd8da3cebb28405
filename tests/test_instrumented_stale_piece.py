"""Instrumented mode when the per-thread state still holds a piece whose frame has returned -- the
shape of ``find``'s predicate calls (``ccprofd trace --mode instrumented -- /usr/bin/find DIR``: the
samples under the fts traversal's ``pred->pred_func(...)`` came out flagged with no frames).

tests/programs/stalecall.c: main -> deep_a -> deep_b -> leaf (getppid) returns; then main -> wide
(a large frame it does not write) -> dispatch, whose call through a function pointer enters report
(an entry probe: a segment), which calls getppid.  No probe fires between the return and report's
entry (main -> wide -> dispatch are zero-code edges), and the dead leaf call's return-address word
survives inside wide's frame, so the dead pieces pass the liveness check and the segment saves their
bits as its caller's state.  That state is not a valid encoding above the segment (bits above
dispatch's level): the sample was flagged and reported no frames; then (a09ec86) flagged with the
frames inside the segment.  Now main -> wide and wide -> dispatch, zero-code edges, carry a cut-only
probe: the call main -> wide drops the dead pieces, and every sample is exact and complete (the
decoder's fallback is still tested in tests/test_decode_segments.py; a wrong-and-complete variant of
the shape is tests/test_instrumented_stale_path.py).

Checked against ``strace -f -k`` (tests/fidelity.py): every sample equal to strace's stack and
complete; every sample in report has frames, ending in report.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import require_bpf, require_tool
from fidelity import compare
from programs.build import build
from strace_oracle import run_strace

ROUNDS = 6


@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    require_bpf()
    require_tool("strace")


def trace(binary: str, encoding: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from ccprofd.tracing.api import TraceOptions
    from ccprofd.tracing.session import open_session

    session = open_session([binary, str(ROUNDS)], options=TraceOptions(
        mode="instrumented", syscalls="getppid", encoding=encoding))
    try:
        samples = list(session.samples())
        summary = session.mode.summary()
        assert session.wait() == 0
    finally:
        session.close()
    return samples, summary


@pytest.mark.parametrize("encoding", ["valence", "pcce", "hcce"])
def test_dead_pieces_above_a_segment_leave_the_segments_frames(encoding: str) -> None:
    binary = str(build("stalecall", opt="O0", pie=True))
    samples, summary = trace(binary, encoding)
    assert len(samples) == 2 * ROUNDS
    in_report = [s for s in samples if s["frames"] and s["frames"][-1]["function"] == "report"]
    in_leaf = [s for s in samples if s["frames"] and s["frames"][-1]["function"] == "leaf"]
    # every sample has its innermost frame: before, report's flagged samples had none
    assert len(in_report) == ROUNDS and len(in_leaf) == ROUNDS, [s["frames"] for s in samples]
    # before the cut-only probes on zero-code edges, some report samples (every encoding) were flagged
    # 'decode error above a segment'; the dead pieces are now dropped at main's call into wide
    assert summary["incomplete_reasons"] == {}, summary["incomplete_reasons"]
    assert all(s["complete"] for s in samples)
    whole = ["main", "wide", "dispatch", "report"]
    assert all([f["function"] for f in s["frames"]] == whole for s in in_report), in_report[:1]
    oracle = run_strace([binary, str(ROUNDS)], ["getppid"])
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    assert result.stats.samples_compared == len(samples)
    assert result.stats.incomplete_samples == 0
