"""Instrumented mode when the per-thread state still holds a piece whose frame has returned -- the
shape of ``find``'s predicate calls (``ccprofd trace --mode instrumented -- /usr/bin/find DIR``: the
samples under the fts traversal's ``pred->pred_func(...)`` came out flagged with no frames).

tests/programs/stalecall.c: main -> deep_a -> deep_b -> leaf (getppid) returns; then main -> wide
(a large frame it does not write) -> dispatch, whose call through a function pointer enters report
(an entry probe: a segment), which calls getppid.  No probe fires between the return and report's
entry (main -> wide -> dispatch are zero-code edges), and the dead leaf call's return-address word
survives inside wide's frame, so the dead pieces pass the liveness check and the segment saves their
bits as its caller's state.  That state is not a valid encoding above the segment (bits above
dispatch's level): the sample is flagged, and -- the fix -- reports the frames inside the segment
(report, from the state set after its entry) instead of none.

Checked against ``strace -f -k`` (tests/fidelity.py): every sample equal to strace's stack or flagged
and a suffix of it; every sample in report has frames, ending in report.
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
    from ccprofd.daemon.tracer import TraceOptions, open_session

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
    assert all(s["complete"] for s in in_leaf)
    # the shape under test happened: a state not valid above report's segment, flagged (the rounds
    # whose dead calls took only zero-code edges left no bits behind and decode whole)
    stale = summary["incomplete_reasons"].get("decode error above a segment", 0)
    assert stale >= 1, summary["incomplete_reasons"]
    flagged = [s for s in in_report if not s["complete"]]
    assert len(flagged) == stale
    assert all([f["function"] for f in s["frames"]] == ["report"] for s in flagged), flagged[:1]
    oracle = run_strace([binary, str(ROUNDS)], ["getppid"])
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    assert result.stats.samples_compared == len(samples)
    assert result.stats.incomplete_samples == stale
