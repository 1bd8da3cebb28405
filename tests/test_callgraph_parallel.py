"""The sweep split across a forked worker must give exactly the single-process result, and a worker
that fails must cost time, not correctness."""

from __future__ import annotations

import os

import pytest
from conftest import skip_or_fail

from ccprofd.callgraph import analyze_binary, parallel

BINARY = "/usr/bin/bash"  # ~1 MB of code: above the size from which the sweep forks
LARGER = ["/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6"]


def _single_process(path: str) -> dict:
    old = os.environ.get(parallel.WORKERS_ENV)
    os.environ[parallel.WORKERS_ENV] = "1"
    try:
        return analyze_binary(path, use_cache=False).to_dict()
    finally:
        if old is None:
            del os.environ[parallel.WORKERS_ENV]
        else:
            os.environ[parallel.WORKERS_ENV] = old


@pytest.fixture(scope="module")
def single() -> dict:
    return _single_process(BINARY)


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


@pytest.mark.parametrize("compiled", [True, False])
def test_references_are_looked_up_region_by_region(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """analysis._refs_in (csweep.refs_in, and its Python loop): the sorted references inside any of
    the regions (gaps and weak functions, which may lie inside a gap), each once and in order, as a
    one-by-one test would find them."""
    import random

    from ccprofd.callgraph import analysis
    from ccprofd.callgraph.analysis import _refs_in

    if compiled and analysis.csweep is None:
        skip_or_fail("ccprofd/callgraph/csweep.c is not built (bash scripts/build_ext.sh)")
    if not compiled:
        monkeypatch.setattr(analysis, "csweep", None)

    rng = random.Random(18)
    for _ in range(200):
        # a lea can form a negative address, an immediate one past 64 bits: in no region
        refs = sorted(set(rng.randrange(0, 400) for _ in range(rng.randrange(0, 60))) | {-7, 2**64 + 5})
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


@pytest.mark.parametrize("path", LARGER)
def test_forked_sweep_equals_single_process_on_larger_binaries(path: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """python3.11 (2.8 MB of code) and libc: the forked sweep's graph is the single process's, row for
    row; and the comparison would see a worker's results merged in the wrong order."""
    forks = []
    real_fork = os.fork

    def counting_fork() -> int:
        forks.append(1)
        return real_fork()

    reference = _without_timing(_single_process(path))
    with monkeypatch.context() as m:
        m.setattr(parallel.os, "fork", counting_fork)
        m.setattr(parallel, "_may_fork", lambda: True)
        forked = analyze_binary(path, use_cache=False).to_dict()
        assert forks, "the sweep did not fork"
        assert _without_timing(forked) == reference
        real_from_plain = parallel._from_plain
        m.setattr(parallel, "_from_plain", lambda plain: real_from_plain(plain)[::-1])  # a wrong merge
        misordered = analyze_binary(path, use_cache=False).to_dict()
    assert _without_timing(misordered) != reference
