"""The threads of a process, from ``/proc/PID/task`` (root injectable, so tests need no real pid)."""

from __future__ import annotations

import os

from ccprofd.proc.maps import DEFAULT_PROC_ROOT


def list_threads(pid: int, proc_root: str = DEFAULT_PROC_ROOT) -> list[int]:
    """Thread ids of ``pid``, sorted; OSError as listing the directory raised it (FileNotFoundError:
    no such process, PermissionError: not ours to inspect)."""
    return sorted(int(t) for t in os.listdir(os.path.join(proc_root, str(pid), "task")) if t.isdigit())


def threads_of(pid: int, proc_root: str = DEFAULT_PROC_ROOT) -> list[int]:
    """Thread ids of ``pid``, sorted; empty when the process is gone or cannot be listed."""
    try:
        return list_threads(pid, proc_root)
    except OSError:
        return []


def tgid_of(tid: int, proc_root: str = DEFAULT_PROC_ROOT) -> int | None:
    """The process (``Tgid:`` of ``/proc/TID/status``) of thread ``tid``; None when it is gone."""
    try:
        with open(os.path.join(proc_root, str(tid), "status"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
