"""The real ``ccprofd run`` daemon as a child process, for the end-to-end tests and bench/daemon.py.

One place for what every such test needs: a config under a short work directory, ``ccprofd run``
started with a ``NOTIFY_SOCKET`` this process binds (the daemon is up when ``READY=1`` arrives,
as under systemd), a gRPC stub on its Unix socket, its ``/metrics`` URL (port 0 in the config: the
kernel picks it, found through /proc), a collected ``StreamSamples`` subscription, and a SIGTERM
stop that reports whether every BPF link and program the daemon ever held (read from its own
``/proc/PID/fdinfo``: the kernel's record, whatever library made them) is gone from the kernel.

bench/daemon.py imports it with tests/ on ``sys.path`` (as bench/report_fidelity.py does for the
oracles).  Waits are liveness bounds that fail with a message, never timing assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from conftest import require_tool
from daemon_fakes import wait_for

from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.export.gen import ccprofd_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
#: the Prometheus samples of the per-context counters (labels target, context, ...)
CONTEXT_SAMPLES = "ccprofd_context_samples_total"


def target_toml(name: str, spec: str, syscalls: Sequence[str] | str, mode: str, extra: str = "") -> str:
    """One ``[[target]]`` table; ``spec`` is its selector line (``path = "..."``, ``pid = N``,
    ``cgroup = "..."``), ``syscalls`` a list of names or ``"all"``."""
    calls = json.dumps(syscalls if isinstance(syscalls, str) else list(syscalls))
    return f'[[target]]\nname = "{name}"\n{spec}\nsyscalls = {calls}\nmode = "{mode}"\n{extra}'


# ------------------------------------------------------------------------------ kernel objects
@dataclass
class BpfObjects:
    """BPF objects a process holds fds of: links (id -> link type), programs held directly, and the
    programs its links run (a link's fdinfo names its program)."""

    links: dict[int, str] = field(default_factory=dict)
    progs: set[int] = field(default_factory=set)
    link_progs: set[int] = field(default_factory=set)

    @property
    def all_progs(self) -> set[int]:
        return self.progs | self.link_progs

    def update(self, other: BpfObjects) -> None:
        self.links.update(other.links)
        self.progs |= other.progs
        self.link_progs |= other.link_progs


def bpf_objects(pid: int) -> BpfObjects:
    """The BPF links and programs ``pid`` holds fds of, per ``/proc/PID/fdinfo``."""
    out = BpfObjects()
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        info = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in text.splitlines()) if v}
        if "link_id" in info:
            out.links[int(info["link_id"])] = info.get("link_type", "?")
            if "prog_id" in info:
                out.link_progs.add(int(info["prog_id"]))
        elif "prog_id" in info:
            out.progs.add(int(info["prog_id"]))
    return out


def kernel_ids(kind: str) -> set[int]:
    """Ids of every BPF ``kind`` ("link" or "prog") in the kernel now, per bpftool (the BPF syscall)."""
    out = subprocess.run([require_tool("bpftool"), "-j", kind, "show"], capture_output=True, text=True,
                         check=True).stdout
    return {int(x["id"]) for x in json.loads(out or "[]")}


def listening_port(pid: int) -> int:
    """The TCP port ``pid`` listens on (from /proc/net/tcp and its socket inodes)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # LISTEN
                return int(parts[1].split(":")[1], 16)
    raise AssertionError(f"process {pid} listens on no TCP port")


# ------------------------------------------------------------------------------------ daemon
@dataclass
class Stopped:
    """How a daemon ended: exit status, seconds from SIGTERM to exit (None: it was not running),
    its log, every BPF object it was seen holding and those of them the kernel still has."""

    returncode: int
    stop_s: float | None
    log: str
    held: BpfObjects
    left_links: set[int]
    left_progs: set[int]
    socket_left: bool

    def assert_clean(self) -> None:
        """Exit 0 without a traceback, nothing of it left in the kernel, its socket removed."""
        assert self.returncode == 0, self.log
        assert "Traceback" not in self.log, self.log
        assert not self.left_links, f"links of the daemon left after it stopped: {sorted(self.left_links)}"
        assert not self.left_progs, f"programs of the daemon left after it stopped: {sorted(self.left_progs)}"
        assert not self.socket_left, "the daemon left its gRPC socket behind"


class RunningDaemon:
    """``ccprofd run --config WORKDIR/ccprofd.toml``, returned once it sent ``READY=1``."""

    def __init__(self, workdir: str, config: str, *, ready_timeout: float = 600.0,
                 prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        """``prefix``: argv run before the daemon's, exec'ing it (a sandbox: the pid stays the
        daemon's); ``env``: extra environment variables."""
        self.workdir = workdir
        self.config_path = Path(workdir) / "ccprofd.toml"
        self.log_path = Path(workdir) / "daemon.log"
        self.socket_path = f"{workdir}/ccprofd.sock"
        self.held = BpfObjects()
        self.write_config(config)
        notify_path = f"{workdir}/notify.sock"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(notify_path)
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(notify_path)
        environ = dict(os.environ, NOTIFY_SOCKET=notify_path, **(env or {}))
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "ccprofd.cli", "run", "--config",
                                          str(self.config_path)], cwd=ROOT, env=environ,
                                         stdout=subprocess.DEVNULL, stderr=log, text=True)
        self.channel = grpc.insecure_channel(f"unix:{self.socket_path}")
        self.stub = pb_grpc.ProfilerStub(self.channel)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.kill()
            raise
        #: seconds from the exec to READY=1
        self.ready_s = time.perf_counter() - t0

    def _wait_ready(self, timeout: float) -> None:
        self._notify.settimeout(1.0)
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._notify.recv(4096).decode()
            except TimeoutError:
                self.check_running()
                if time.monotonic() > deadline:
                    raise AssertionError(f"no READY=1 within {timeout:.0f} s: {self.log()[-2000:]}") from None
                continue
            if "READY=1" in msg.splitlines():
                return

    def __enter__(self) -> RunningDaemon:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill()

    def write_config(self, config: str) -> None:
        """(Re)write the config file (a SIGHUP then reloads it)."""
        self.config_path.write_text(config)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def check_running(self) -> None:
        """Fail with the daemon's log if it has exited."""
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited ({self.proc.returncode}): {self.log()}")

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        """:func:`wait_for` ``predicate`` while the daemon runs (its exit fails at once, with its
        log).  On timeout the failure shows the end of the log after the daemon's SIGUSR1 stack
        dump of every thread, so a hang in CI says where it hung."""

        def running_and() -> Any:
            self.check_running()
            return predicate()

        try:
            return wait_for(running_and, timeout=timeout, interval=0.1, what=what)
        except AssertionError as exc:
            if self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    self.proc.send_signal(signal.SIGUSR1)
                time.sleep(2)
            raise AssertionError(f"{exc}\n--- daemon log (end) ---\n{self.log()[-12000:]}") from None

    def targets(self) -> Any:
        """ListTargets, or None while the socket does not answer (yet)."""
        self.check_running()
        try:
            return self.stub.ListTargets(pb.ListTargetsRequest(), timeout=5)
        except grpc.RpcError:
            return None

    def processes(self) -> dict[int, Any]:
        resp = self.targets()
        return {} if resp is None else {p.pid: p for t in resp.targets for p in t.processes}

    def wait_attached(self, timeout: float = 300) -> None:
        """Until every target is attached."""

        def attached() -> bool:
            resp = self.targets()
            return resp is not None and bool(resp.targets) and all(t.state == "attached"
                                                                   for t in resp.targets)

        try:
            wait_for(attached, timeout=timeout, interval=0.2)
        except AssertionError:
            raise AssertionError(f"targets not attached: {self.targets()}\n{self.log()}") from None

    def wait_tracked(self, pid: int, build_id: str | None = None, timeout: float = 300) -> Any:
        """Until ``pid`` is one of a target's processes (with ``build_id``, when given); fails at once
        if a target failed.  Returns its ``ProcessInfo``."""

        def tracked() -> Any:
            resp = self.targets()
            failed = [f"{t.name}: {t.error}" for t in resp.targets if t.state == "failed"] if resp else []
            assert not failed, f"target failed: {failed}\n{self.log()}"
            p = self.processes().get(pid)
            return p if p is not None and (build_id is None or p.build_id == build_id) else None

        try:
            return wait_for(tracked, timeout=timeout, interval=0.2)
        except AssertionError as exc:
            if "target failed" in str(exc):
                raise
            raise AssertionError(f"pid {pid} not tracked (build-id {build_id}): {self.targets()}\n"
                                 f"{self.log()}") from None

    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{listening_port(self.proc.pid)}/metrics"

    def metric_samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of every sample called ``name`` (e.g. ``ccprofd_context_samples_total``)
        in one scrape of /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url(), timeout=30) as resp:
            text = resp.read().decode()
        return [(dict(s.labels), s.value) for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == name]

    def bpf_objects(self) -> BpfObjects:
        """The BPF objects the daemon holds now (also remembered for the check at stop)."""
        now = bpf_objects(self.proc.pid)
        self.held.update(now)
        return now

    def stop(self, timeout: float = 120) -> Stopped:
        """SIGTERM (if still running) and wait; then which of the BPF objects it was ever seen holding
        the kernel still has (polled for a while: the kernel frees them after the last fd closes)."""
        stop_s = None
        if self.proc.poll() is None:
            self.bpf_objects()
            t0 = time.perf_counter()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"daemon still running {timeout:.0f} s after SIGTERM: {self.log()}"
                                     ) from None
            stop_s = time.perf_counter() - t0
        self._close()
        links, progs = set(self.held.links), self.held.all_progs

        def left() -> tuple[set[int], set[int]]:
            return (links & kernel_ids("link") if links else set(),
                    progs & kernel_ids("prog") if progs else set())

        left_links, left_progs = left()
        deadline = time.monotonic() + 10
        while (left_links or left_progs) and time.monotonic() < deadline:
            time.sleep(0.2)
            left_links, left_progs = left()
        return Stopped(self.proc.returncode, stop_s, self.log(), self.held, left_links, left_progs,
                       os.path.exists(self.socket_path))

    def kill(self) -> None:
        """SIGKILL if still running (the abnormal path: a test that failed half-way)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        self.channel.close()
        self._notify.close()


# --------------------------------------------------------------------------------- sampling
class SampleStream:
    """``StreamSampleBatches`` of one target (of one process of it, if ``pid``), collected by a
    thread (``dropped`` adds up its messages' drop counts); ``batched`` False: ``StreamSamples``,
    one message per sample (a busy target's subscriber of that loses most: README, STATUS)."""

    def __init__(self, stub: Any, target: str, pid: int = 0, batched: bool = True) -> None:
        self._samples: list[Any] = []
        self._lock = threading.Lock()
        self.batched = batched
        self.messages = 0
        self.dropped = 0
        rpc = stub.StreamSampleBatches if batched else stub.StreamSamples
        self._call = rpc(pb.SampleFilter(target=target, pid=pid))
        # live once the server says so: samples published before that would not reach the stream
        assert dict(self._call.initial_metadata()).get("ccprofd-subscribed") == "1"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self._call:
                with self._lock:
                    self.messages += 1
                    if self.batched:
                        self._samples.extend(msg.samples)
                        self.dropped += msg.dropped
                    else:
                        self._samples.append(msg)
        except grpc.RpcError:
            pass

    @property
    def samples(self) -> list[Any]:
        """Every sample received so far (a copy)."""
        with self._lock:
            return list(self._samples)

    def of(self, pid: int) -> list[Any]:
        return [s for s in self.samples if s.pid == pid]

    def pids(self) -> set[int]:
        return {s.pid for s in self.samples}

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=10)


class AlertStream:
    """``StreamAlerts`` of one target, each alert collected as a dict (``messages.alert_from_pb``)
    by a thread; live (the server has subscribed) when the constructor returns."""

    def __init__(self, stub: Any, target: str) -> None:
        from ccprofd.export import messages

        self.alerts: list[dict[str, Any]] = []
        self._call = stub.StreamAlerts(pb.AlertFilter(target=target))
        assert dict(self._call.initial_metadata()).get("ccprofd-subscribed") == "1"

        def run() -> None:
            with contextlib.suppress(grpc.RpcError):
                for msg in self._call:
                    self.alerts.append(messages.alert_from_pb(msg))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=10)

