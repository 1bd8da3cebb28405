"""bench/services.py's issue 14 verdicts: the change against the same round's untraced run, the
median over rounds, and met / not met (expected values worked out by hand below)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import services


def run(rps: float, load: float = 1.0) -> dict[str, Any]:
    return {"tests": {"GET": {"rps": rps, "p50": 0.1, "p99": 0.2}}, "load1": load}


def test_paired_change_is_the_median_of_same_round_ratios() -> None:
    # rounds: untraced 100, 200, 50; traced 95, 150, 50 -> -5%, -25%, 0% -> median -5%
    results = {"untraced": [run(100), run(200), run(50)], "unwind-all": [run(95), run(150), run(50)]}
    assert services.paired_change(results, "unwind-all", "GET") == pytest.approx(-5.0)


def test_targets_met_and_not_met() -> None:
    # every syscall -5% (met: <= 10% and better than perf's -40%); security set -3% (not met: > 2%)
    results = {"untraced": [run(100, 2.0), run(100, 4.0)], "unwind-all": [run(95), run(95)],
               "perf-dwarf": [run(60), run(60)], "unwind-security": [run(97), run(97)]}
    text = "\n".join(services.targets(results))
    assert "| GET | -5.0% | -40.0% | -3.0% | met | **not met** |" in text
    assert "median 1.00, 1.00-4.00" in text  # loads: 2, 4 and six 1.0s


def test_loss_smaller_than_perf_is_required() -> None:
    # -8% is within 10% but perf lost only 5%: not met
    results = {"untraced": [run(100)], "unwind-all": [run(92)], "perf-dwarf": [run(95)]}
    assert "| GET | -8.0% | -5.0% | – | **not met** | – |" in "\n".join(services.targets(results))
