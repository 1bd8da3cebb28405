"""Daemon lifecycle: the real ``ccprofd run`` process (scripted sample source in place of the tracer)
speaking the notify protocol to a NOTIFY_SOCKET this test owns, SIGHUP reloads (good and bad),
SIGTERM shutdown; and in-process: target retry, config changes, the probe-hit budget switch."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from daemon_fakes import (
    TARGET_APP,
    FakeFactory,
    FakeSource,
    config_text,
    frame,
    sample,
    started_daemon,
    wait_for,
)

from ccprofd.daemon.config import DaemonConfig, TargetConfig, parse_config
from ccprofd.daemon.notify import Notifier
from ccprofd.daemon.service import Daemon, retry_failed
from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.export.gen import ccprofd_pb2_grpc as pb_grpc
from ccprofd.export.servers import standard_servers

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


class NotifyListener:
    """The systemd side of sd_notify: a datagram socket collecting what the daemon sends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)
        self.messages: list[dict[str, str]] = []

    def drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def wait(self, key: str, count: int = 1, timeout: float = 60) -> list[dict[str, str]]:
        def enough() -> bool:
            self.drain()
            return sum(key in m for m in self.messages) >= count

        wait_for(enough, timeout=timeout)
        return [m for m in self.messages if key in m]


def test_notifier_protocol_against_a_test_socket(workdir: str) -> None:
    listener = NotifyListener(f"{workdir}/notify")
    n = Notifier(
        {"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    )
    assert n.enabled and n.watchdog_interval == 1.0
    assert n.watchdog_due(now=100.0)
    assert n.ready("2/2 targets attached") and n.watchdog(now=100.0) and n.stopping()
    assert not n.watchdog_due(now=100.5) and n.watchdog_due(now=101.0)
    listener.drain()
    assert listener.messages == [
        {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "2/2 targets attached"},
        {"WATCHDOG": "1"},
        {"STOPPING": "1"},
    ]
    other_pid = Notifier({"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"})
    assert other_pid.watchdog_interval is None  # the watchdog is meant for another process
    off = Notifier({})
    assert not off.enabled and not off.ready() and off.watchdog_interval is None


def test_notifier_abstract_socket() -> None:
    name = f"ccprofd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    assert Notifier({"NOTIFY_SOCKET": "@" + name}).notify("READY=1")
    assert sock.recv(100) == b"READY=1"
    sock.close()


def grpc_targets(sock: str) -> dict[str, str]:
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        resp = pb_grpc.ProfilerStub(ch).ListTargets(pb.ListTargetsRequest(), timeout=10)
    return {t.name: t.state for t in resp.targets}


def test_daemon_process_notify_reload_and_shutdown(workdir: str) -> None:
    config = Path(workdir) / "ccprofd.toml"
    config.write_text(config_text(workdir, TARGET_APP))
    samples = Path(workdir) / "samples.jsonl"
    samples.write_text(
        "".join(
            json.dumps(dict(sample([frame("main", 0x10), frame("w", 0x20)]), target="app")) + "\n"
            for _ in range(3)
        )
    )
    events = Path(workdir) / "events.jsonl"
    listener = NotifyListener(f"{workdir}/notify")
    env = dict(
        os.environ,
        NOTIFY_SOCKET=listener.path,
        WATCHDOG_USEC="300000",
        PYTHONPATH=str(TESTS),
        CCPROFD_FAKE_SAMPLES=str(samples),
        CCPROFD_FAKE_LOG=str(events),
    )
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ccprofd.cli",
            "run",
            "--config",
            str(config),
            "--source-factory",
            "daemon_fakes:make_fake_source",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = listener.wait("READY")
        assert ready[0]["MAINPID"] == str(proc.pid) and ready[0]["STATUS"] == "1/1 targets attached"
        assert len(listener.wait("WATCHDOG", count=3)) >= 3  # keep-alives from the main loop
        sock = f"{workdir}/ccprofd.sock"
        assert grpc_targets(sock) == {"app": "attached"}

        # SIGHUP with an added target: app untouched, db started.
        config.write_text(config_text(workdir, TARGET_APP + '[[target]]\nname = "db"\npid = 31337\n'))
        proc.send_signal(signal.SIGHUP)
        listener.wait("RELOADING")
        wait_for(lambda: grpc_targets(sock) == {"app": "attached", "db": "attached"})
        # SIGHUP with a bad config: rejected with file:line:key, the running config stays.
        config.write_text(
            config_text(workdir, TARGET_APP + '[[target]]\nname = "db"\npid = 31337\nmode = "x"\n')
        )
        proc.send_signal(signal.SIGHUP)
        listener.wait("RELOADING", count=2)
        listener.wait("READY", count=3)
        assert grpc_targets(sock) == {"app": "attached", "db": "attached"}
        # SIGUSR1: every thread's stack to the log (the main loop's too); the daemon runs on.
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: grpc_targets(sock) == {"app": "attached", "db": "attached"})

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert f"{config}:" in err and "target[1].mode" in err and "keeping the running configuration" in err
    dump = err[err.index("(most recent call first)"):]
    assert re.search(r'File ".*/ccprofd/daemon/service\.py", line \d+ in run_daemon', dump), err
    assert "Traceback" not in err
    listener.drain()
    assert "STOPPING" in listener.messages[-1]
    log = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["event"], e["target"]) for e in log] == [
        ("start", "app"),
        ("start", "db"),
        ("close", "app"),
        ("close", "db"),
    ]
    assert not os.path.exists(f"{workdir}/ccprofd.sock")


def _documented_target_keys() -> set[str]:
    """The ``[[target]]`` keys the schema in config.py's docstring documents (the user's reference).

    Read from the documentation rather than from the parser's key table, so a key the parser
    accepts but the schema does not document (or the reverse) fails the test.
    """
    import ccprofd.daemon.config as config_module

    doc = config_module.__doc__ or ""
    block = doc.split("[[target]]", 1)[1].split("[target.anomaly]", 1)[0]
    first, _, rest = block.partition("\n")
    keys = set(re.findall(r"[a-z_][a-z0-9_]*", first.split("one of", 1)[1]))
    keys |= {m.group(1) for m in re.finditer(r"^ {4}([a-z_][a-z0-9_]*) = ", rest, re.M)}
    return keys | {"anomaly"}


def test_bad_config_exits_2_with_one_line(workdir: str) -> None:
    config = Path(workdir) / "bad.toml"
    config.write_text('[daemon]\nstate_dir = "/x"\n\n[[target]]\npath = "/a"\ncolour = "red"\n')
    out = subprocess.run(
        [sys.executable, "-m", "ccprofd.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 2
    known = ", ".join(sorted(_documented_target_keys()))
    assert out.stderr.strip().splitlines() == [
        f"ccprofd: {config}:6: target[0].colour: unknown key (known keys: {known})"
    ]
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "ccprofd.cli",
            "run",
            "--check",
            "--config",
            str(ROOT / "systemd" / "ccprofd.toml"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert ok.returncode == 0 and "OK (0 targets)" in ok.stdout


def test_missing_tracer_is_a_one_line_failure(workdir: str) -> None:
    config = Path(workdir) / "c.toml"
    config.write_text(config_text(workdir, TARGET_APP))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ccprofd.cli",
            "run",
            "--config",
            str(config),
            "--source-factory",
            "no_such_module:make",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 1 and out.stderr.startswith(
        "ccprofd: sample source 'no_such_module:make' is not"
    )
    assert len(out.stderr.strip().splitlines()) == 1


def test_failed_target_is_retried_on_reload_and_changed_targets_restart(workdir: str) -> None:
    factory = FakeFactory(fail={"app": "binary not found"})
    with started_daemon(TARGET_APP, workdir=workdir, factory=factory) as served:
        daemon = served.daemon
        assert daemon.targets["app"].state == "failed" and daemon.targets["app"].error == "binary not found"
        factory.fail.clear()
        daemon.apply(parse_config(config_text(workdir, TARGET_APP)))
        assert daemon.targets["app"].state == "attached"
        first = factory.sources["app"]
        first.push(sample([frame("main", 0x10)]))
        wait_for(lambda: daemon.targets["app"].store.samples == 1)
        # Same config: nothing restarts.
        daemon.apply(parse_config(config_text(workdir, TARGET_APP)))
        assert factory.sources["app"] is first and not first.closed
        # Changed config: re-attached with the new settings; counts carry on (same store).
        daemon.apply(parse_config(config_text(workdir, TARGET_APP + "perf_sample_hz = 99\n")))
        assert first.closed and factory.sources["app"] is not first
        assert factory.sources["app"].target.perf_sample_hz == 99
        assert daemon.targets["app"].store.samples == 1
        # Removed: detached.
        second = factory.sources["app"]
        daemon.apply(parse_config(config_text(workdir)))
        assert second.closed and daemon.targets == {}


def test_reload_applies_daemon_bounds_to_targets_that_keep_running(workdir: str) -> None:
    """top_k / max_series / retire_after_seconds applied only to targets started after a reload."""
    factory = FakeFactory()
    daemon = Daemon(parse_config(config_text(workdir, TARGET_APP)), factory, servers=standard_servers())
    daemon.start()
    try:
        source = factory.sources["app"]
        daemon.apply(parse_config(config_text(
            workdir, TARGET_APP, daemon_extra="top_k = 3\nmax_series = 5\nretire_after_seconds = 7200\n")))
        assert factory.sources["app"] is source and not source.closed  # not restarted
        store = daemon.targets["app"].store
        assert (store.top_k, store.max_series, store.retire_ns) == (3, 5, 7200 * 1_000_000_000)
    finally:
        daemon.stop()


def test_failed_target_is_retried_with_backoff_without_a_sighup(workdir: str) -> None:
    """A failed target used to wait for a SIGHUP; now it is retried after 10 s, 20 s, 40 s, ...
    (at most 600 s apart; the clock is injected, nothing sleeps) and attaches once it can."""
    factory = FakeFactory(fail={"app": "BPF map limit"})
    daemon = Daemon(parse_config(config_text(workdir, TARGET_APP)), factory, servers=standard_servers())
    daemon.start()
    try:
        rt = daemon.targets["app"]
        assert rt.state == "failed" and len(factory.built) == 1
        attempts = []
        for now in range(0, 5000):  # one main-loop tick per second
            retry_failed(daemon, now=float(now))
            attempts.append(len(factory.built))
        # 10 s after the failure, then each wait twice the previous one, capped at 600 s
        assert [t for t in range(1, 5000) if attempts[t] != attempts[t - 1]] == [
            10, 30, 70, 150, 310, 630, 1230, 1830, 2430, 3030, 3630, 4230, 4830]
        assert rt.state == "failed" and rt.retries == 13 and rt.error == "BPF map limit"
        factory.fail.clear()
        retry_failed(daemon, now=1e9)
        assert rt.state == "attached" and rt.error == ""
        # a reload retries a failed target at once and its backoff starts over
        factory.fail["app"] = "again"
        daemon._detach(rt)
        daemon._attach(rt)
        assert rt.state == "failed"
        daemon.apply(parse_config(config_text(workdir, TARGET_APP)))
        assert rt.retries == 0 and rt.retry_at is None
    finally:
        daemon.stop()


def test_probe_hit_budget_switches_to_unwind_mode(workdir: str) -> None:
    factory = FakeFactory()
    target = (
        '[[target]]\nname = "hot"\npath = "/opt/hot"\nmode = "instrumented"\nmax_probe_hits_per_sec = 1000\n'
    )
    with started_daemon(target, workdir=workdir, factory=factory) as served:
        daemon = served.daemon
        src = factory.sources["hot"]
        daemon.check_budgets(now=10.0)
        src.probe_hits = 500
        daemon.check_budgets(now=11.0)  # 500/s: within budget
        assert factory.sources["hot"] is src and daemon.targets["hot"].mode() == "instrumented"
        src.probe_hits = 5000
        daemon.check_budgets(now=12.0)  # 4500/s: over
        rt = daemon.targets["hot"]
        assert src.closed and factory.sources["hot"].target.mode == "unwind" and rt.mode() == "unwind"
        assert rt.mode_switches == {"probe_hit_budget": 1}
        assert rt.counters().probe_hits == 5000  # carried over: the exported counter stays monotonic
        # the reason is the target's status (issue 15): ListTargets and ccprofctl targets
        note = "switched to unwind mode: 4500 probe hits/s exceeded max_probe_hits_per_sec = 1000"
        assert (rt.state, rt.error) == ("attached", note)
        out = subprocess.run([sys.executable, "-m", "ccprofd.cli.ctl", "--socket", f"{workdir}/ccprofd.sock",
                              "targets"], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert "mode unwind (configured instrumented)" in lines[0] and lines[1] == f"  note: {note}", lines


def test_stop_closes_every_source_even_after_a_source_failure(workdir: str) -> None:
    factory = FakeFactory()
    daemon = Daemon(
        parse_config(config_text(workdir, TARGET_APP + '[[target]]\nname = "b"\npid = 5\n')), factory,
        servers=standard_servers(),
    )
    daemon.start()

    def broken(timeout_ms: int) -> list[dict[str, object]]:
        raise OSError("ring buffer gone")

    factory.sources["b"].poll = broken  # type: ignore[method-assign]
    wait_for(lambda: daemon.targets["b"].state == "failed")
    assert daemon.targets["b"].error == "ring buffer gone"
    daemon.stop()
    assert all(s.closed for s in factory.built)
    time.sleep(0)  # no background thread left to touch the sources


def test_detach_never_closes_a_source_its_pump_still_polls(workdir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A pump stuck in its poll past the detach's wait: the source is closed by the pump's
    return, not under it (closing frees the buffers the poll reads); the detach goes on."""
    import ccprofd.daemon.service as service

    monkeypatch.setattr(service, "PUMP_STOP_SECONDS", 0.2)
    factory = FakeFactory()
    daemon = Daemon(parse_config(config_text(workdir, TARGET_APP)), factory, servers=standard_servers())
    daemon.start()
    source = factory.sources["app"]
    in_poll, release = threading.Event(), threading.Event()
    closed_in_poll: list[bool] = []
    close = source.close

    def stuck(timeout_ms: int) -> list[dict[str, object]]:
        in_poll.set()
        release.wait(60)
        return []

    def recording_close() -> None:
        closed_in_poll.append(in_poll.is_set() and not release.is_set())
        close()

    source.poll = stuck  # type: ignore[method-assign]
    source.close = recording_close  # type: ignore[method-assign]
    assert in_poll.wait(30)
    daemon.stop_target("app")  # returns after PUMP_STOP_SECONDS with the pump still in its poll
    assert not source.closed and "app" not in daemon.targets
    release.set()
    wait_for(lambda: source.closed)
    assert closed_in_poll == [False]
    daemon.stop()


def test_samples_buffered_when_a_target_detaches_are_still_read(workdir: str) -> None:
    """A sample that reached the kernel's buffer as the stop came (the pump between two polls,
    its next one never made): the detach reads it once more, so the store counts it and the
    observers see it with the runtime it was taken under (the target is no longer listed)."""
    factory = FakeFactory()
    daemon = Daemon(parse_config(config_text(workdir, TARGET_APP)), factory, servers=None)
    seen: list[tuple[str, str, str]] = []
    daemon.observers.append(lambda rt, s, counted: seen.append((rt.name, rt.config.path or "", s["syscall"])))
    daemon.start()
    rt = daemon.targets["app"]
    source = factory.sources["app"]
    buffered = [sample([frame("main", 0x1100), frame("flush", 0x1400)], "fsync")]
    polls_after_stop: list[int] = []

    def buffer_visible_only_after_the_stop(timeout_ms: int) -> list[dict[str, object]]:
        stop = rt._stop
        if not stop.is_set():
            stop.wait(timeout_ms / 1000)
            return []
        polls_after_stop.append(timeout_ms)
        out, buffered[:] = list(buffered), []
        return out

    source.poll = buffer_visible_only_after_the_stop  # type: ignore[method-assign]
    daemon.stop_target("app")
    assert polls_after_stop == [0], polls_after_stop  # one read, not a wait
    assert seen == [("app", "/opt/app/bin", "fsync")]
    assert rt.store.total() == 1
    assert source.closed
    daemon.stop()


def test_started_daemon_serves_then_stops_and_cleans_up(tmp_path: Path) -> None:
    """The shared in-process set-up (daemon_fakes.started_daemon): the daemon answers on its socket
    while the block runs, is stopped after it (its socket gone, its sources closed) even when the
    block fails, and the work directory it made is removed (one given to it is kept)."""
    with started_daemon(TARGET_APP) as served:
        assert grpc_targets(served.socket) == {"app": "attached"}
        made = served.workdir
    assert not os.path.exists(made) and all(s.closed for s in served.factory.built)
    given = tmp_path / "d"
    given.mkdir()
    with pytest.raises(RuntimeError, match="the block failed"), \
            started_daemon(TARGET_APP, workdir=str(given)) as served:
        raise RuntimeError("the block failed")
    assert given.is_dir() and not os.path.exists(served.socket)
    assert all(s.closed for s in served.factory.built)


def test_backoff_starts_over_after_a_successful_attach(workdir: str) -> None:
    """Before: a target that failed 3 times, then attached and ran, and then failed again waited
    80 s (its last retry's wait doubled), and after days of running still up to 600 s; now a
    source that attached and was polled starts the next backoff at 10 s again."""
    factory = FakeFactory(fail={"app": "BPF map limit"})
    daemon = Daemon(parse_config(config_text(workdir, TARGET_APP)), factory, servers=standard_servers())
    daemon.start()
    try:
        rt = daemon.targets["app"]
        for now in range(0, 80):
            retry_failed(daemon, now=float(now))
        assert rt.state == "failed" and rt.retries == 3  # retried at 10, 30 and 70 s
        factory.fail.clear()
        retry_failed(daemon, now=1000.0)
        assert rt.state == "attached"
        source = factory.sources["app"]
        wait_for(lambda: rt.retries == 0, what="the backoff reset after a successful poll")

        def broken(timeout_ms: int) -> list[dict[str, object]]:
            raise OSError("ring buffer gone")

        source.poll = broken  # type: ignore[method-assign]
        wait_for(lambda: rt.state == "failed", what="the source's failure")
        retry_failed(daemon, now=5000.0)
        assert rt.retry_at == 5000.0 + 10.0
    finally:
        daemon.stop()


def test_a_source_failing_at_its_first_poll_keeps_backing_off(workdir: str) -> None:
    """The reset needs a successful poll: a source that attaches and fails at once each time is
    not re-attached every 10 s."""
    factory = FakeFactory()
    daemon = Daemon(parse_config(config_text(workdir, TARGET_APP)), factory, servers=standard_servers())
    daemon.start()
    try:
        rt = daemon.targets["app"]
        rt.retries = 3

        def broken(timeout_ms: int) -> list[dict[str, object]]:
            raise OSError("ring buffer gone")

        def failing_source(target: TargetConfig, d: DaemonConfig) -> FakeSource:
            src = factory(target, d)
            src.poll = broken  # type: ignore[method-assign]
            return src

        daemon.factory = failing_source
        daemon._detach(rt)
        daemon._attach(rt)
        wait_for(lambda: rt.state == "failed", what="the source's failure at its first poll")
        assert rt.retries == 3
        retry_failed(daemon, now=0.0)
        assert rt.retry_at == 80.0
    finally:
        daemon.stop()
