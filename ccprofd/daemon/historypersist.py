"""Saving a target's flight recorder to ``state_dir/history/TARGET.wet`` (``[[target]]
persist_history_seconds``): every interval, and when the target stops, the rings of every recorded
thread are read from each of its binaries' modes, their new events (newer than what the file holds
for the thread) appended to the target's :class:`~ccprofd.daemon.historyfile.HistoryStore`, and
the file rewritten atomically within :data:`MAX_BYTES` (the oldest events go first).  Events are
stored decoded: a context's frames once in the file's table, so the file is readable without the
tracer, after the daemon and the processes are gone."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ccprofd.daemon.historyfile import HistoryFileError, HistoryStore
from ccprofd.kbpf.syscalls import syscall_numbers
from ccprofd.tracing.api import Mode

log = logging.getLogger("ccprofd")
MAX_BYTES = 16 << 20  # per target file
# An event whose context is not known yet (its new-context record not yet polled) waits this long
# before it is saved as unknown: a thread's events are appended in order, so it holds back the rest.
GRACE_NS = 5_000_000_000


def history_path(state_dir: Path, target: str) -> Path:
    return state_dir / "history" / f"{target}.wet"


class HistoryPersister:
    """One target's history file and the store it is written from (loaded at start: a restarted
    daemon appends to what the previous one saved)."""

    def __init__(self, path: Path, interval_s: float, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self.store = HistoryStore()
        if path.exists():
            try:
                self.store = HistoryStore.load(path)
            except (OSError, HistoryFileError) as exc:
                log.error("history file %s not loaded, starting a new one: %s", path, exc)
        self._last = time.monotonic()
        self._frames: dict[int, tuple[list[dict[str, Any]], int]] = {}  # id(frames) -> (frames, index)

    def maybe_save(self, modes: Iterable[Mode]) -> None:
        if time.monotonic() - self._last >= self.interval_s:
            self.save(modes)

    def save(self, modes: Iterable[Mode], *, final: bool = False) -> None:
        """Append the rings' new events and rewrite the file (errors logged, never raised: the
        tracing goes on without it).  ``final``: the target stops, nothing is held back."""
        self._last = time.monotonic()
        try:
            young = time.time_ns() - (0 if final else GRACE_NS)
            for mode in modes:
                for tid, events in mode.history_threads().items():
                    for e in events:
                        if not e["frames"] and not e["complete"] and e["time_ns"] > young:
                            break  # its context's record is not decoded yet: from here on next time
                        self.append(tid, e)
            self.store.save(self.path, self.max_bytes)
        except (OSError, ValueError) as exc:
            log.error("history file %s not written: %s", self.path, exc)

    def append(self, tid: int, e: dict[str, Any]) -> None:
        """One decoded event (ModeBase.history_sample JSON) of thread ``tid``, if newer than the file's."""
        frames = e["frames"]
        got = self._frames.get(id(frames))
        if got is None or got[0] is not frames:  # frames lists are shared per context: one key each
            got = self._frames[id(frames)] = (frames, self.store.context_index(bool(e["complete"]), frames))
        self.store.append(int(e["pid"]), tid, int(e["time_ns"]), _number(str(e["syscall"])), got[1],
                          e.get("raw_args") or ())


def _number(name: str) -> int:
    """A syscall's number from its name (``syscall_N`` for one the table does not name)."""
    nr = syscall_numbers().get(name)
    if nr is None and name.startswith("syscall_") and name[8:].isdigit():
        nr = int(name[8:])
    return -1 if nr is None else nr


def read_history(path: Path) -> dict[str, Any]:
    """The saved history as JSON: ``{"threads": [{"pid", "tid", "events": [...]}]}`` (for tests and
    tools; the file format is in historyfile.py)."""
    from ccprofd.tracing.base import syscall_info

    store = HistoryStore.load(path)
    out = []
    for th in store.threads.values():
        evs = []
        for t, nr, ctx, a0, a1, a2 in th.events():
            c = store.contexts[ctx]
            name, nargs = syscall_info(nr)
            evs.append({"time_ns": t, "syscall": name, "complete": c["complete"],
                        "frames": c["frames"], "raw_args": [a0, a1, a2][:nargs]})
        out.append({"pid": th.pid, "tid": th.tid, "events": evs})
    return json.loads(json.dumps({"threads": out}))
