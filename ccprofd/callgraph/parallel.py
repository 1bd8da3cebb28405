"""Sweeping many functions, in two processes when that pays: the sweep is a pure function of the
file's bytes, so a forked child sweeps the upper half of the code while this process sweeps the
lower half, and hands its results back marshalled through a pipe."""

from __future__ import annotations

import marshal
import os
import threading
from collections.abc import Callable

from ccprofd.callgraph.disasm import Branch, Cs, SweepResult, csweep, sweep

Progress = Callable[[str, int, int], None]
#: Below this much code a fork, and marshalling the results back, costs more than it saves.
PARALLEL_MIN_BYTES = 512 * 1024
WORKERS_ENV = "CCPROFD_ANALYSIS_WORKERS"  # "1": never fork (e.g. to compare with a forked run)


#: The share of the code this process sweeps when it forks: less than half, as it also runs the
#: caller's ``meanwhile`` work while the worker sweeps.
OWN_SHARE = 0.45


def sweep_functions(code_of: Callable[[int, int], bytes], md: Cs, ranges: list[tuple[int, int]],
                    progress: Progress | None = None,
                    meanwhile: Callable[[], None] | None = None) -> list[SweepResult]:
    """The sweep (``local_jumps=False``) of each [start, end) of ``ranges``, in their order.

    ``meanwhile``: work of the caller's that needs no sweep result, run by this process while a
    forked worker sweeps (else after the sweep)."""
    total = sum(end - start for start, end in ranges)
    if total < PARALLEL_MIN_BYTES or not _may_fork():
        results = _sweep_range(code_of, md, ranges, progress)
        if meanwhile is not None:
            meanwhile()
        return results
    half, acc = len(ranges), 0
    for i, (start, end) in enumerate(ranges):
        acc += end - start
        if acc >= total * OWN_SHARE:
            half = i + 1
            break
    mine, theirs = ranges[:half], ranges[half:]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: sweep, send, and leave without running any of the parent's exit code
        status = 1
        try:
            os.close(read_fd)
            payload = marshal.dumps(_plain(_sweep_range(code_of, md, theirs, None)))
            with os.fdopen(write_fd, "wb") as out:
                out.write(payload)
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    try:
        results = _sweep_range(code_of, md, mine, progress)
        if meanwhile is not None:
            meanwhile()
        with os.fdopen(read_fd, "rb") as inp:
            payload = inp.read()
    finally:
        _, wait_status = os.waitpid(pid, 0)
    try:
        if os.waitstatus_to_exitcode(wait_status) != 0:
            raise ValueError("worker failed")
        theirs_results = _from_plain(marshal.loads(payload))
        if len(theirs_results) != len(theirs):
            raise ValueError("worker result count")
    except (ValueError, EOFError, TypeError, IndexError):
        theirs_results = _sweep_range(code_of, md, theirs, None)  # the worker's half, here
    return results + theirs_results


def _may_fork() -> bool:
    """Fork only a single-threaded process (a thread holding a lock at fork time would leave it
    held forever in the child) with a second CPU to run on."""
    if os.environ.get(WORKERS_ENV) == "1" or not hasattr(os, "fork"):
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return cpus >= 2 and threading.active_count() == 1


def _sweep_range(code_of: Callable[[int, int], bytes], md: Cs, ranges: list[tuple[int, int]],
                 progress: Progress | None) -> list[SweepResult]:
    out = []
    for i, (start, end) in enumerate(ranges):
        part = SweepResult([], [], 0)
        sweep(md, code_of(start, end - start), start, part, local_jumps=False)
        out.append(part)
        if progress is not None and i % 2000 == 0:
            progress("disassembling", i, len(ranges))
    return out


Plain = tuple[list[list[tuple[object, ...]]], list[list[int]], list[int]]


def _plain(results: list[SweepResult]) -> Plain:
    """The results as marshal takes them: plain tuples for the branches (no tuple subclass)."""
    lists = [r.branches for r in results]
    branches: list[list[tuple[object, ...]]] = (csweep.retype(lists, tuple) if csweep is not None
                                                 else [[tuple(b) for b in bs] for bs in lists])
    return branches, [r.code_refs for r in results], [r.instructions for r in results]


def _from_plain(plain: Plain) -> list[SweepResult]:
    lists, refs, counts = plain
    branches = (csweep.retype(lists, Branch) if csweep is not None
                else [[Branch._make(b) for b in bs] for bs in lists])
    return [SweepResult(bs, list(rs), n) for bs, rs, n in zip(branches, refs, counts, strict=True)]
