"""One pure computation in a forked worker while this process does other work: the analysis is a
pure function of the file's bytes, so a worker forked from this process computes what this process
would, and hands it back marshalled through a pipe."""

from __future__ import annotations

import marshal
import os
import threading
from collections.abc import Callable
from typing import Any

WORKERS_ENV = "CCPROFD_ANALYSIS_WORKERS"  # "1": never fork (e.g. to compare with a forked run)


def may_fork() -> bool:
    """Fork only a single-threaded process (a thread holding a lock at fork time would leave it
    held forever in the child) with a second CPU to run on."""
    if os.environ.get(WORKERS_ENV) == "1" or not hasattr(os, "fork"):
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return cpus >= 2 and threading.active_count() == 1


def start(compute: Callable[[], Any]) -> Callable[[], Any | None]:
    """Run ``compute()`` (which must return plain data marshal takes) in a forked worker; the
    returned function waits for it and gives its result, or None if the worker failed (then the
    caller computes it itself, raising its errors as if no worker had run).  Call the returned
    function exactly once, also when the caller fails meanwhile (it reaps the worker)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send, and leave without running any of the parent's exit code
        status = 1
        try:
            os.close(read_fd)
            payload = marshal.dumps(compute())
            with os.fdopen(write_fd, "wb") as out:
                out.write(payload)
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)

    def result() -> Any | None:
        try:
            with os.fdopen(read_fd, "rb") as inp:
                payload = inp.read()
        finally:
            _, wait_status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(wait_status) != 0:
            return None
        try:
            return marshal.loads(payload)
        except (ValueError, EOFError, TypeError):
            return None

    return result
