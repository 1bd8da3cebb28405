"""Durable anomaly-model files: atomic writes, locked merges, periodic flushes, and a refusal to
overwrite anything it cannot read.

* A write goes to a temporary file in the same directory, is fsync'ed, renamed over the model and
  the directory is fsync'ed: a crash leaves either the old or the new file, never a torn one.
* Learning merges into the file under an exclusive ``flock`` on ``FILE.lock`` (re-read, merge, write),
  so several learners — runs, processes, a daemon and a CLI — can share one file without losing
  each other's counts.
* :class:`PeriodicFlusher` merges what a learner saw since its last flush every ``interval``
  seconds, so a kill during learning loses at most one interval.
* A file that is not JSON, not a model, or of another format version is never silently replaced:
  :func:`load_models` raises :class:`ModelFileError`; :func:`quarantine` moves it aside (for the
  daemon, which must keep running) and says where.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ccprofd.anomaly.model import Learner, ModelError, ModelSet, TargetModel
from ccprofd.persist.atomicfile import atomic_write_bytes


class ModelFileError(Exception):
    """A model file that cannot be used as it is (bad input: exit status 2)."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"model file {os.fspath(path)}: {reason}")
        self.path = Path(path)
        self.reason = reason


def load_models(path: str | os.PathLike[str], *, missing_ok: bool = True) -> ModelSet:
    """Read a model file.  A missing file is an empty model set (unless ``missing_ok`` is False)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return ModelSet()
        raise ModelFileError(p, "does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(p, f"cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFileError(p, f"corrupt (not JSON: {exc.msg} at line {exc.lineno})") from None
    try:
        return ModelSet.from_dict(data)
    except ModelError as exc:
        raise ModelFileError(p, str(exc)) from None


def save_models(path: str | os.PathLike[str], models: ModelSet) -> None:
    """Write atomically: temp file in the same directory, fsync, rename, fsync the directory."""
    text = json.dumps(models.to_dict(), separators=(",", ":"), sort_keys=True) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def locked(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock for a read-merge-write of ``path`` (on ``path.lock``, so the model
    file itself can be replaced by rename while the lock is held)."""
    lock_path = f"{os.fspath(path)}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def merge_into(path: str | os.PathLike[str], delta: ModelSet) -> ModelSet:
    """Merge ``delta`` into the file under the lock; returns the merged set.  Raises
    ModelFileError (and leaves the file alone) when the file is unreadable."""
    with locked(path):
        models = load_models(path)
        models.merge(delta)
        save_models(path, models)
    return models


def quarantine(path: str | os.PathLike[str]) -> Path:
    """Move an unusable model file aside (``FILE.corrupt-YYYYmmddTHHMMSS[-N]``); returns the new path."""
    p = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest = p.with_name(f"{p.name}.corrupt-{stamp}")
    n = 1
    while dest.exists():
        dest = p.with_name(f"{p.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(p, dest)
    return dest


def load_or_quarantine(path: str | os.PathLike[str], report: Callable[[str], None]) -> ModelSet:
    """For long-running learners (the daemon): an unusable file is reported, moved aside, and
    learning starts from an empty model — never by overwriting the file in place."""
    try:
        return load_models(path)
    except ModelFileError as exc:
        dest = quarantine(path)
        report(f"{exc}; moved aside to {dest}; starting a new model")
        return ModelSet()


class PeriodicFlusher:
    """Merges a :class:`Learner`'s observations into the model file at most every ``interval``
    seconds (and on :meth:`flush`).  A crash loses at most what arrived since the last flush."""

    def __init__(self, path: str | os.PathLike[str], learner: Learner, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval <= 0:
            raise ValueError(f"flush interval must be > 0, not {interval}")
        self.path = Path(path)
        self.learner = learner
        self.interval = interval
        self._clock = clock
        self._last = clock()
        self.flushes = 0

    def maybe_flush(self) -> bool:
        if self._clock() - self._last < self.interval:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        delta = self.learner.take_delta()
        self._last = self._clock()
        merge_into(self.path, ModelSet({delta.build_id: delta}))
        self.flushes += 1


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class ModelStore:
    """Model files of the daemon's targets under ``STATE_DIR/anomaly/``, one file per target name
    (each file keeps a model per build-id the target has had)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.directory = Path(state_dir) / "anomaly"

    def path_for(self, target: str) -> Path:
        name = _SAFE.sub("_", target) or "_"
        return self.directory / f"{name}.model.json"

    def open(self, target: str, report: Callable[[str], None]) -> ModelSet:
        """Load a target's models (moving an unusable file aside, reported)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return load_or_quarantine(self.path_for(target), report)

    def needs_relearning(self, target: str, path: str, build_id: str,
                         report: Callable[[str], None]) -> list[TargetModel]:
        """Old-build models of a target whose binary now has ``build_id``: kept, not applied, and
        the reason the daemon tells the operator to learn again."""
        models = self.open(target, report)
        if build_id in models.targets:
            return []
        return models.stale_for(path, build_id)
