"""Sweeping many functions, in two processes when that pays: the sweep is a pure function of the
file's bytes, so a forked child sweeps the upper half of the code while this process sweeps the
lower half, and hands its results back marshalled through a pipe."""

from __future__ import annotations

import marshal
import os
import threading
from collections.abc import Callable

from capstone import Cs

from ccprofd.callgraph.disasm import Branch, SweepResult, sweep

Progress = Callable[[str, int, int], None]
#: Below this much code a fork, and marshalling the results back, costs more than it saves.
PARALLEL_MIN_BYTES = 512 * 1024
WORKERS_ENV = "CCPROFD_ANALYSIS_WORKERS"  # "1": never fork (e.g. to compare with a forked run)


def sweep_functions(code_of: Callable[[int, int], bytes], md: Cs, ranges: list[tuple[int, int]],
                    progress: Progress | None = None) -> list[SweepResult]:
    """The sweep (``local_jumps=False``) of each [start, end) of ``ranges``, in their order."""
    total = sum(end - start for start, end in ranges)
    if total < PARALLEL_MIN_BYTES or not _may_fork():
        return _sweep_range(code_of, md, ranges, progress)
    half, acc = len(ranges), 0
    for i, (start, end) in enumerate(ranges):
        acc += end - start
        if acc * 2 >= total:
            half = i + 1
            break
    mine, theirs = ranges[:half], ranges[half:]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: sweep, send, and leave without running any of the parent's exit code
        status = 1
        try:
            os.close(read_fd)
            payload = marshal.dumps([_plain(r) for r in _sweep_range(code_of, md, theirs, None)])
            with os.fdopen(write_fd, "wb") as out:
                out.write(payload)
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    try:
        results = _sweep_range(code_of, md, mine, progress)
        with os.fdopen(read_fd, "rb") as inp:
            payload = inp.read()
    finally:
        _, wait_status = os.waitpid(pid, 0)
    try:
        if os.waitstatus_to_exitcode(wait_status) != 0:
            raise ValueError("worker failed")
        theirs_results = [_from_plain(p) for p in marshal.loads(payload)]
        if len(theirs_results) != len(theirs):
            raise ValueError("worker result count")
    except (ValueError, EOFError, TypeError):
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


def _plain(r: SweepResult) -> tuple[list[tuple[object, ...]], list[int], int]:
    return ([tuple(b) for b in r.branches],  # plain tuples: marshal takes no tuple subclass
            r.code_refs, r.instructions)


def _from_plain(p: tuple[list[tuple[object, ...]], list[int], int]) -> SweepResult:
    branches, refs, n = p
    return SweepResult([Branch._make(b) for b in branches], list(refs), n)
