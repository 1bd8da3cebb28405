"""The sweep split across a forked worker must give exactly the single-process result, and a worker
that fails must cost time, not correctness."""

from __future__ import annotations

import os

import pytest

from ccprofd.callgraph import analyze_binary, parallel

BINARY = "/usr/bin/bash"  # ~1 MB of code: above the size from which the sweep forks


@pytest.fixture(scope="module")
def single() -> dict:
    old = os.environ.get(parallel.WORKERS_ENV)
    os.environ[parallel.WORKERS_ENV] = "1"
    try:
        return analyze_binary(BINARY, use_cache=False).to_dict()
    finally:
        if old is None:
            del os.environ[parallel.WORKERS_ENV]
        else:
            os.environ[parallel.WORKERS_ENV] = old


def _without_timing(rows: dict) -> dict:
    return {k: v for k, v in rows.items() if k != "analysis_seconds"}


def test_forked_sweep_equals_single_process(single: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    forks = []
    real_fork = os.fork

    def counting_fork() -> int:
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(parallel.os, "fork", counting_fork)
    monkeypatch.setattr(parallel, "_may_fork", lambda: True)
    forked = analyze_binary(BINARY, use_cache=False).to_dict()
    assert forks, "the sweep did not fork"
    assert _without_timing(forked) == _without_timing(single)


def test_failed_worker_falls_back_to_this_process(single: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_result: object) -> object:
        raise RuntimeError("worker dies")  # runs in the child only: the parent never marshals

    monkeypatch.setattr(parallel, "_plain", broken)
    monkeypatch.setattr(parallel, "_may_fork", lambda: True)
    again = analyze_binary(BINARY, use_cache=False).to_dict()
    assert _without_timing(again) == _without_timing(single)


def test_no_fork_with_other_threads_running() -> None:
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not parallel._may_fork()
    finally:
        stop.set()
        t.join()


def test_references_are_looked_up_region_by_region() -> None:
    """analysis._refs_in: the sorted references inside any of the regions (gaps and weak functions,
    which may lie inside a gap), each once and in order, as a one-by-one test would find them."""
    import random

    from ccprofd.callgraph.analysis import _refs_in

    rng = random.Random(18)
    for _ in range(200):
        refs = sorted(set(rng.randrange(0, 400) for _ in range(rng.randrange(0, 60))))
        regions = []
        for _ in range(rng.randrange(0, 8)):
            lo = rng.randrange(0, 400)
            hi = lo + rng.randrange(0, 60)
            regions.append((lo, hi))
            if rng.random() < 0.5 and hi - lo > 2:  # a weak function found inside that gap
                a = rng.randrange(lo, hi - 1)
                regions.append((a, rng.randrange(a + 1, hi + 1)))
        want = [r for r in refs if any(lo <= r < hi for lo, hi in regions)]
        assert _refs_in(refs, regions) == want, (refs, regions)
