"""A scripted :class:`ccprofd.daemon.source.SampleSource` for daemon/export unit tests.

It stands in for the tracer only; everything around it (store, gRPC over a real Unix socket,
HTTP scrapes, signals, notify) is real.  ``make_fake_source`` is also usable from a daemon
subprocess (``ccprofd run --source-factory daemon_fakes:make_fake_source`` with ``tests/`` on
PYTHONPATH): the samples then come from the JSONL file named by ``$CCPROFD_FAKE_SAMPLES``
(one sample per line; an optional ``"target"`` key selects the target) and every event the source
sees (start/close) is appended to ``$CCPROFD_FAKE_LOG``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ccprofd.daemon.config import DaemonConfig, TargetConfig
from ccprofd.daemon.source import BinaryInfo, ProcessInfo, SourceCounters, ThreadContext, UnknownProcess

if TYPE_CHECKING:
    from ccprofd.daemon.service import Daemon

BUILD_ID = "0123456789abcdef0123456789abcdef01234567"


def frame(
    function: str, site: int, *, module: str = "/opt/app/bin", build_id: str = BUILD_ID, analysed: bool = True
) -> dict[str, Any]:
    return {
        "function": function,
        "module": module,
        "build_id": build_id,
        "analysed": analysed,
        "call_site": hex(site),
        "return_address": hex(site + 5) if analysed else None,
    }


def sample(
    frames: list[dict[str, Any]],
    syscall: str = "write",
    *,
    pid: int = 4242,
    tid: int = 4242,
    event: str = "syscall",
    complete: bool = True,
    time_ns: int = 1_700_000_000_000_000_000,
) -> dict[str, Any]:
    return {
        "time_ns": time_ns,
        "pid": pid,
        "tid": tid,
        "event": event,
        "syscall": syscall if event == "syscall" else None,
        "complete": complete,
        "frames": frames,
    }


class FakeSource:
    """Samples pushed with :meth:`push` come out of :meth:`poll`; counters are settable."""

    def __init__(
        self,
        target: TargetConfig,
        samples: Iterable[dict[str, Any]] = (),
        *,
        fail_start: str | None = None,
        log_path: str | None = None,
    ) -> None:
        self.target = target
        self.queue: queue.Queue[dict[str, Any]] = queue.Queue()
        for s in samples:
            self.queue.put(s)
        self.fail_start = fail_start
        self.log_path = log_path
        self.started = False
        self.closed = False
        self.probe_hits = 0
        self.decode_errors = 0
        self.verify_mismatches = 0
        self.dropped: dict[str, int] = {}
        self.current_mode = target.mode
        self.pids = {
            4242: [
                ThreadContext(4242, True, (frame("main", 0x1100), frame("serve", 0x1200)), "app"),
                ThreadContext(4243, False, (frame("worker", 0x1300),), "app-worker"),
            ]
        }
        self.lock = threading.Lock()

    def _log(self, event: str) -> None:
        if self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(
                    json.dumps(
                        {
                            "event": event,
                            "target": self.target.name,
                            "mode": self.current_mode,
                            "pid": os.getpid(),
                        }
                    )
                    + "\n"
                )

    def push(self, *samples: dict[str, Any]) -> None:
        for s in samples:
            self.queue.put(s)

    def start(self) -> None:
        if self.fail_start:
            raise RuntimeError(self.fail_start)
        self.started = True
        self._log("start")

    def poll(self, timeout_ms: int) -> list[dict[str, Any]]:
        out = []
        try:
            out.append(self.queue.get(timeout=timeout_ms / 1000))
            while True:
                out.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return out

    def mode(self) -> str:
        return self.current_mode

    def processes(self) -> list[ProcessInfo]:
        return [
            ProcessInfo(pid, self.target.path or "/opt/app/bin", BUILD_ID, len(threads), "app", 77)
            for pid, threads in self.pids.items()
        ]

    def binaries(self) -> list[BinaryInfo]:
        return [BinaryInfo(self.target.path or "/opt/app/bin", BUILD_ID, 77, True)]

    def thread_contexts(self, pid: int) -> list[ThreadContext]:
        if pid not in self.pids:
            raise UnknownProcess(f"pid {pid} is not followed")
        return list(self.pids[pid])

    def history(self, pid: int, last: int) -> dict[str, Any]:
        raise UnknownProcess(f"pid {pid} is not followed")

    def history_before(self, pid: int, tid: int, time_ns: int, last: int) -> list[dict[str, Any]]:
        return []

    def callgraph_stats(self) -> dict[str, Any]:
        return {
            self.target.path or "/opt/app/bin": {
                "functions": 12,
                "direct_call_sites": 30,
                "build_id": BUILD_ID,
                "encodings": {"valence": {"acyclic_bits": 3}},
            }
        }

    def counters(self) -> SourceCounters:
        return SourceCounters(
            probe_hits=self.probe_hits,
            verify_mismatches=self.verify_mismatches,
            decode_errors=self.decode_errors,
            dropped=dict(self.dropped),
            map_entries={"thread_state": len(self.pids)},
        )

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._log("close")


class FakeFactory:
    """Records every source it builds (``sources[name]`` is the latest for that target)."""

    def __init__(self, fail: dict[str, str] | None = None) -> None:
        self.fail = fail or {}
        self.sources: dict[str, FakeSource] = {}
        self.built: list[FakeSource] = []

    def __call__(self, target: TargetConfig, daemon: DaemonConfig) -> FakeSource:
        src = FakeSource(target, fail_start=self.fail.get(target.name))
        self.sources[target.name] = src
        self.built.append(src)
        return src


def make_fake_source(target: TargetConfig, daemon: DaemonConfig) -> FakeSource:
    """Subprocess entry point: samples from ``$CCPROFD_FAKE_SAMPLES`` for this target."""
    samples = []
    path = os.environ.get("CCPROFD_FAKE_SAMPLES")
    if path:
        with open(path) as fh:
            for line in fh:
                if line.strip():
                    s = json.loads(line)
                    if s.pop("target", target.name) == target.name:
                        samples.append(s)
    return FakeSource(target, samples, log_path=os.environ.get("CCPROFD_FAKE_LOG"))


def short_tmpdir() -> str:
    """A fresh directory with a short path (Unix socket paths are limited to 107 bytes)."""
    import tempfile

    return tempfile.mkdtemp(prefix="ccp", dir="/tmp")


def config_text(
    workdir: str, targets: str = "", *, daemon_extra: str = "", grpc_listen: str | None = None
) -> str:
    """A daemon config for tests: state and socket under ``workdir``, metrics on a free port."""
    listen = grpc_listen or f"unix://{workdir}/ccprofd.sock"
    return (
        f'[daemon]\nstate_dir = "{workdir}/state"\ngrpc_listen = "{listen}"\n'
        f'metrics_listen = "127.0.0.1:0"\n{daemon_extra}\n{targets}'
    )


@dataclass
class Served:
    """An in-process daemon that :func:`started_daemon` started."""

    daemon: Daemon
    factory: Any  # what made its sources: a FakeFactory unless the test gave another
    workdir: str

    @property
    def socket(self) -> str:
        """Its gRPC Unix socket (``config_text``'s default ``grpc_listen``)."""
        return f"{self.workdir}/ccprofd.sock"


@contextlib.contextmanager
def started_daemon(targets: str = "", *, workdir: str | None = None, factory: Any = None,
                   daemon_extra: str = "", grpc_listen: str | None = None,
                   servers: bool = True) -> Iterator[Served]:
    """The set-up the daemon/export tests share: an in-process :class:`Daemon` configured by
    :func:`config_text` (``targets`` and the ``[daemon]`` extras), its sources made by ``factory``
    (a new :class:`FakeFactory` by default), with the standard gRPC and /metrics servers unless
    ``servers`` is False, started; stopped at the end, and its work directory removed when made
    here (``workdir`` None: a short one, Unix socket paths being limited)."""
    from ccprofd.daemon.config import parse_config
    from ccprofd.daemon.service import Daemon
    from ccprofd.export.servers import standard_servers

    made = workdir is None
    wd = short_tmpdir() if workdir is None else workdir
    fac = FakeFactory() if factory is None else factory
    try:
        config = parse_config(config_text(wd, targets, daemon_extra=daemon_extra, grpc_listen=grpc_listen))
        daemon = Daemon(config, fac, servers=standard_servers() if servers else None)
        daemon.start()
        try:
            yield Served(daemon, fac, wd)
        finally:
            daemon.stop()
    finally:
        if made:
            shutil.rmtree(wd, ignore_errors=True)


TARGET_APP = '[[target]]\nname = "app"\npath = "/opt/app/bin"\nsyscalls = ["write", "openat"]\n'
TARGET_DB = '[[target]]\nname = "db"\npid = 999999\nmode = "instrumented"\n'


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02, what: str | None = None) -> Any:
    """Poll ``predicate`` until truthy (returns its value) or fail after ``timeout`` seconds (the
    message names ``what`` was awaited, else the predicate).  A liveness bound for asynchronous
    hand-offs, not a performance assertion."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {what or predicate}")
        time.sleep(interval)
