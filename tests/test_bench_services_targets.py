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


def test_service_cpu_per_request_is_paired_like_throughput() -> None:
    # redis-style load: 1 test of 1,000 requests per round.  untraced 1.0 s and 2.0 s of the
    # service's CPU (1,000 and 2,000 µs per request); traced 1.1 s and 2.0 s -> +10%, 0% -> median
    # +5%; per-request medians: untraced (1000, 2000) -> 1,500.0, traced (1100, 2000) -> 1,550.0.
    def cpu(rps: float, s: float) -> dict[str, Any]:
        return {**run(rps), "service_cpu_s": s}

    results = {"untraced": [cpu(100, 1.0), cpu(100, 2.0)], "unwind-all": [cpu(90, 1.1), cpu(90, 2.0)],
               "perf-dwarf": []}
    text = "\n".join(services.cpu_table("redis", results, 1000, 0))
    assert "| untraced | 1,500.0 |  |" in text
    assert "| unwind-all | 1,550.0 | +5.0% |" in text
    assert "perf-dwarf" not in text  # not measured: no row


def test_postgres_work_is_its_transaction_rate_times_the_duration() -> None:
    # two scripts at 100 and 50 transactions/s for 10 s each: 1,500 transactions
    tests = {"a": {"rps": 100.0, "p50": 1, "p99": 2}, "b": {"rps": 50.0, "p50": 1, "p99": 2}}
    assert services.work_units("postgres", tests, 0, 10) == 1500
    assert services.work_units("redis", tests, 1000, 10) == 2000  # a fixed count per test


def test_postgres_checkpoint_times_come_from_its_log(tmp_path: Path) -> None:
    # the server logs with log_line_prefix "%n [%p] " (epoch seconds, milliseconds); other lines,
    # continuation lines (no timestamp) and other checkpoint messages are not a checkpoint's end
    pg = object.__new__(services.Postgres)  # no server: only the log is read
    pg.dir = tmp_path
    (tmp_path / "postgres.log").write_text(
        "1795737506.560 [14720] LOG:  database system is ready to accept connections\n"
        "1795737506.797 [14722] LOG:  checkpoint starting: time\n"
        "1795737506.806 [14722] LOG:  checkpoint complete: wrote 2115 buffers (12.9%); 0 WAL file(s) added\n"
        "\tcheckpoint complete: (a continuation line of another message)\n"
        "1795737807.010 [14722] LOG:  checkpoint starting: immediate force wait\n"
        "1795737807.5 [14722] LOG:  checkpoint complete: wrote 3 buffers\n")
    assert pg.checkpoints() == [1_795_737_506_806_000_000, 1_795_737_807_500_000_000]
    assert pg.checkpoints("starting") == [1_795_737_506_797_000_000, 1_795_737_807_010_000_000]
