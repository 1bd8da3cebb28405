"""Reading a saved flight-recorder history (``state_dir/history/TARGET.wet``) for a user, offline:
``ccprofd history FILE`` and ``ccprofctl history``'s fallback for a thread the live rings no longer
hold.  Each thread is walked with its :class:`~ccprofd.daemon.historyfile.Cursor`, forward from the
oldest event or backward from the newest (``reverse``; and for ``last``/``until``, which are found
from the newest end), so nothing but the selected events is decoded."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccprofd.daemon.historyfile import Cursor, HistoryFileError, HistoryStore, ThreadHistory
from ccprofd.tracing.base import syscall_info


@dataclass(frozen=True, slots=True)
class Selection:
    """Which events of a thread: ``last`` N latest (0: all), times within [since, until] (ns,
    None: unbounded), newest first when ``reverse``."""

    last: int = 0
    since: int | None = None
    until: int | None = None
    reverse: bool = False


def load(path: str | Path) -> HistoryStore:
    """The file's store; a missing or unreadable file is a :class:`HistoryFileError` too (one line)."""
    try:
        return HistoryStore.load(path)
    except OSError as exc:
        raise HistoryFileError(f"cannot read {path}: {exc.strerror or exc}") from None


def walk(th: ThreadHistory, sel: Selection) -> Iterator[tuple[int, ...]]:
    """The thread's selected raw events (time_ns, syscall, context index, arg0..2) in ``sel``'s
    order, stepping its cursor one event at a time."""
    if not th.count:
        return
    since = -1 if sel.since is None else sel.since
    until = sel.until
    if sel.reverse:
        back = th.cursor(at_end=True)
        n = 0
        while True:
            t = back.value()[0]
            if t < since:
                return
            if until is None or t <= until:
                yield back.value()
                n += 1
                if sel.last and n >= sel.last:
                    return
            if not back.prev():
                return
    c = _first(th, sel, since)
    if c is None:
        return
    while True:
        t = c.value()[0]
        if until is not None and t > until:
            return
        if t >= since:
            yield c.value()
        if not c.next():
            return


def _first(th: ThreadHistory, sel: Selection, since: int) -> Cursor | None:
    """A cursor on the oldest event a forward walk starts from: the first one without ``last`` or
    ``until``; else found backward from the newest (past those after ``until``, then ``last`` - 1
    further back, not before ``since``)."""
    if not sel.last and sel.until is None:
        return th.cursor()
    c = th.cursor(at_end=True)
    while sel.until is not None and c.value()[0] > sel.until:
        if not c.prev():
            return None
    for _ in range(sel.last - 1 if sel.last else th.count):
        if not c.prev():
            break
        if c.value()[0] < since:
            c.next()
            break
    return c


def thread_events(store: HistoryStore, th: ThreadHistory, sel: Selection) -> list[dict[str, Any]]:
    """The selected events in ``ccprofctl history``'s JSON form (``args``: the syscall's words)."""
    out = []
    for t, nr, ctx, a0, a1, a2 in walk(th, sel):
        if not 0 <= ctx < len(store.contexts):
            raise HistoryFileError(f"corrupt history file: context {ctx} of thread {th.tid} not in its table")
        c = store.contexts[ctx]
        name, nargs = syscall_info(nr)
        out.append({"time_ns": t, "pid": th.pid, "tid": th.tid, "syscall": name,
                    "complete": bool(c["complete"]), "frames": list(c["frames"]),
                    "args": [a0, a1, a2][:nargs]})
    return out


def select_threads(store: HistoryStore, *, tid: int = 0, pid: int = 0) -> list[ThreadHistory]:
    """Thread ``tid`` (or every thread of process ``pid``, or of the whole file), by pid then tid;
    a tid or pid the file does not hold is a :class:`LookupError`."""
    threads = sorted(store.threads.values(), key=lambda th: (th.pid, th.tid))
    if tid:
        threads = [th for th in threads if th.tid == tid]
        if not threads:
            raise LookupError(f"no thread {tid} in the history file")
    if pid:
        threads = [th for th in threads if th.pid == pid]
        if not threads:
            raise LookupError(f"no process {pid} in the history file")
    return threads
