"""The daemon's ``[target.anomaly]`` end to end with real BPF: the real ``ccprofd run`` process on
tests/programs/anomaly_server.c (each command on a new thread, so the daemon that attached to the
running process sees complete contexts).

* learn: contexts reach the model file within the flush interval; ``kill -9`` of the daemon leaves a
  valid model holding what was flushed; a restarted daemon merges into it (runs = 2).
* detect (SIGHUP to the new config): a normal command raises nothing; the hidden command's openat
  raises exactly one alert on ``StreamAlerts``, in ``ccprofd_alerts_total{target, syscall, kind}`` and
  as a structured log line; repeating it within the alert interval raises nothing more.
* upgrade: the binary at the target's path replaced by another build: reported as needing
  re-learning (log + ``ccprofd_anomaly_needs_learning``), nothing applied, the old model kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon_fakes import config_text
from daemon_harness import ROOT, AlertStream, RunningDaemon, target_toml
from programs.build import build

from ccprofd.anomaly.modelstore import load_models
from ccprofd.export import messages
from ccprofd.export.gen import ccprofd_pb2 as pb

SOURCE = ROOT / "tests" / "programs" / "anomaly_server.c"
HIDDEN = ("worker", "dispatch", "cmd_debug", "raw_open")


def compile_server(out: Path, variant: int, *flags: str) -> Path:
    subprocess.run(["gcc", "-O2", "-g", "-pthread", f"-DVARIANT={variant}", *flags, "-I", str(SOURCE.parent),
                    "-o", str(out), str(SOURCE)], check=True)
    return out


class Server:
    """The long-running target process, driven line by line."""

    def __init__(self, binary: Path) -> None:
        self.proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "ready\n"

    def run(self, cmd: str, arg: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{cmd} {arg}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Daemon(RunningDaemon):
    """The real daemon, as this test looks at it: its log, whether it follows a pid, Prometheus
    samples by their labels."""

    def logged(self, text: str) -> bool:
        return text in self.log()

    def follows(self, pid: int) -> bool:
        resp = self.targets()
        return resp is not None and any(p.pid == pid and t.state == "attached"
                                        for t in resp.targets for p in t.processes)

    def metrics(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted(labels.items())): value for labels, value in self.metric_samples(name)}

    def stop_clean(self) -> str:
        """SIGTERM: exit 0, nothing of it left in the kernel; its log."""
        stopped = self.stop()
        stopped.assert_clean()
        return stopped.log


def anomaly_config(workdir: str, binary: Path, model: Path | None, action: str,
                   mode: str = "instrumented", interval: int = 3600) -> str:
    model_line = f'model = "{model}"' if model is not None else ""
    target = target_toml("srv", f'path = "{binary}"', ["openat"], mode, f"""[target.anomaly]
action = "{action}"
{model_line}
flush_seconds = 1
alert_interval_seconds = {interval}
""")
    return config_text(workdir, target)


def runs_through(chain: tuple[str, ...], part: tuple[str, ...]) -> bool:
    """Whether ``part`` is a run of consecutive frames of ``chain`` (unwind mode adds libc's)."""
    return any(chain[i:i + len(part)] == part for i in range(len(chain) - len(part) + 1))


def openat_chains(model: Path) -> set[tuple[str, ...]]:
    out = set()
    for m in load_models(model).targets.values():
        for (syscall, frames) in m.contexts:
            if syscall == "openat":
                out.add(tuple(f[1] for f in frames))
    return out


@pytest.mark.bpf
def test_daemon_learn_kill_restart_detect_upgrade(bpf: None, workdir: str, tmp_path: Path) -> None:
    binary = compile_server(Path(workdir) / "srv", 0)
    data = tmp_path / "data.txt"
    data.write_text("data\n")
    model = Path(workdir) / "srv.model.json"
    cat_chain = ("worker", "dispatch", "cmd_cat", "load_file", "open_file")
    count_chain = ("worker", "dispatch", "cmd_count", "load_file", "open_file")
    server = Server(binary)
    daemons: list[Daemon] = []
    try:
        # -- learn, then kill -9 while learning ---------------------------------------------
        d = Daemon(workdir, anomaly_config(workdir, binary, model, "learn"))
        daemons.append(d)
        d.wait(lambda: d.follows(server.proc.pid), 300, "following the server")
        assert server.run("cat", str(data)) == "done 5\n"
        d.wait(lambda: model.exists() and cat_chain in openat_chains(model), 60, "cat chain learned")
        os.kill(d.proc.pid, signal.SIGKILL)
        d.kill()
        models = load_models(model)  # valid after the kill
        [learned] = models.targets.values()
        assert learned.runs == 1 and cat_chain in openat_chains(model)
        assert learned.path == str(binary)

        # -- a new daemon continues learning into the same file ------------------------------
        d = Daemon(workdir, anomaly_config(workdir, binary, model, "learn"))
        daemons.append(d)
        d.wait(lambda: d.follows(server.proc.pid), 300, "following the server")
        assert server.run("count", str(data)) == "done 1005\n"
        d.wait(lambda: count_chain in openat_chains(model), 60, "count chain learned")

        # -- SIGHUP into detect ------------------------------------------------------------
        d.write_config(anomaly_config(workdir, binary, model, "detect"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait(lambda: d.logged("reloaded"), 300, "reloaded")
        d.wait(lambda: d.follows(server.proc.pid), 300, "following the server")
        assert load_models(model).targets[learned.build_id].runs == 2
        assert openat_chains(model) == {cat_chain, count_chain}
        alerts: list[dict[str, Any]] = []
        subscribed = threading.Event()

        def collect() -> None:
            stream = d.stub.StreamAlerts(pb.AlertFilter(target="srv"), timeout=600)
            # the call returns before the server subscribed; its initial metadata says it has
            assert dict(stream.initial_metadata()).get("ccprofd-subscribed") == "1"
            subscribed.set()
            try:
                for msg in stream:
                    alerts.append(messages.alert_from_pb(msg))
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=collect, daemon=True)
        reader.start()
        assert subscribed.wait(60)
        assert server.run("cat", str(data)) == "done 5\n"
        assert server.run("debug", str(data)) == "done 7\n"
        d.wait(lambda: alerts, 60, "an alert")
        assert server.run("count", str(data)) == "done 1005\n"
        assert server.run("debug", str(data)) == "done 7\n"  # the same alert again: rate-limited
        assert server.run("cat", str(data)) == "done 5\n"

        def counted() -> float:
            return sum(d.metrics("ccprofd_alerts_total").values())

        d.wait(counted, 30, "alert counted")
        [alert] = alerts
        assert alert["kind"] == "unseen_context" and alert["syscall"] == "openat" and alert["target"] == "srv"
        assert tuple(f["function"] for f in alert["frames"]) == HIDDEN
        assert alert["args"] == {"path": str(data)} and alert["action"] == "detect"
        # worker at the same call site; dispatch calls cmd_debug from another call site than cmd_cat
        assert alert["nearest"] and alert["nearest"][0]["common_prefix"] == 1
        assert d.metrics("ccprofd_alerts_total") == {
            (("kind", "unseen_context"), ("syscall", "openat"), ("target", "srv")): 1.0}
        assert d.metrics("ccprofd_anomaly_needs_learning") == {}
        listed = d.stub.ListTargets(pb.ListTargetsRequest(), timeout=5).targets
        assert not any(t.needs_learning for t in listed)

        # -- upgrade: another build at the same path ---------------------------------------
        new = compile_server(Path(workdir) / "srv.new", 1)
        os.replace(new, binary)
        upgraded = Server(binary)
        try:
            d.wait(lambda: d.follows(upgraded.proc.pid), 300, "following the upgraded server")
            assert upgraded.run("debug", str(data)) == "done 7\n"  # not checked: no model applies

            def reported() -> dict[Any, float]:
                return d.metrics("ccprofd_anomaly_needs_learning")

            [labels] = d.wait(reported, 60, "needs_learning reported")
            assert dict(labels)["reason"] == "upgraded" and dict(labels)["build_id"] != learned.build_id
            # ListTargets says the same through the real gRPC channel, with the running build's id
            # as readelf reads it, and ccprofctl targets prints it
            notes = subprocess.run(["readelf", "-n", str(binary)], capture_output=True, text=True,
                                   check=True).stdout
            new_build_id = notes.split("Build ID:")[1].split()[0]
            [srv] = [t for t in d.stub.ListTargets(pb.ListTargetsRequest(), timeout=5).targets
                     if t.name == "srv"]
            assert [(n.binary, n.build_id, n.reason) for n in srv.needs_learning] == [
                (dict(labels)["binary"], new_build_id, "upgraded")]
            text = subprocess.run([sys.executable, "-m", "ccprofd.cli.ctl", "--socket",
                                   f"{workdir}/ccprofd.sock", "targets"],
                                  capture_output=True, text=True, timeout=60).stdout
            assert f"needs re-learning: {dict(labels)['binary']}  build-id {new_build_id}  (upgraded" in text
        finally:
            upgraded.close()
        err = d.stop_clean()
        assert len(alerts) == 1
        assert "ccprofd alert kind=unseen_context syscall=openat" in err and "target=srv" in err
        assert "kept, not applied; re-learn" in err
        assert "Traceback" not in err
        assert set(load_models(model).targets) == {learned.build_id}  # old model kept, nothing added
        json.loads(model.read_text())
    finally:
        for d in daemons:
            d.kill()
        server.close()


@pytest.mark.bpf
def test_daemon_learns_and_detects_in_aggregate_mode(bpf: None, workdir: str, tmp_path: Path) -> None:
    """Unwind mode, no transitions, no sample subscriber: the daemon learns and detects without a
    record per sample (``per_sample_records`` false throughout).  Learning counts every sample
    (cat x 30: 30 in the model).  In detection the hidden command's first openat is alerted with
    its process, thread and path; its repeats, which only the kernel counted, are alerted too once
    the interval (1 s) has passed, as ``counted`` alerts without a thread; the alerts' samples
    (1 or ``counted``) and ``suppressed`` counts add up to exactly the hidden openats made; normal
    commands raise nothing."""
    binary = compile_server(Path(workdir) / "srv", 0, "-fomit-frame-pointer")
    data = tmp_path / "data.txt"
    data.write_text("data\n")
    model = Path(workdir) / "srv.model.json"
    cat_chain = ("worker", "dispatch", "cmd_cat", "load_file", "open_file")
    server = Server(binary)
    d: Daemon | None = None

    def tracer() -> dict[str, Any]:
        assert d is not None
        stats = d.stub.GetCallGraphStats(pb.GetCallGraphStatsRequest(target="srv"), timeout=120)
        [srv] = [b for b in stats.binaries if b.path == str(binary)]
        return dict(srv.stats["tracer"])

    def learned_cats() -> int:
        if not model.exists():
            return 0
        return sum(st.count for m in load_models(model).targets.values()
                   for (sc, frames), st in m.contexts.items()
                   if sc == "openat" and runs_through(tuple(f[1] for f in frames), cat_chain))

    try:
        d = Daemon(workdir, anomaly_config(workdir, binary, model, "learn", "unwind", interval=1))
        d.wait(lambda: d is not None and d.follows(server.proc.pid), 300, "following the server")
        for _ in range(30):
            assert server.run("cat", str(data)) == "done 5\n"
        d.wait(lambda: learned_cats() >= 30, 60, "30 cat samples learned")
        assert not tracer()["per_sample_records"]
        d.write_config(anomaly_config(workdir, binary, model, "detect", "unwind", interval=1))
        d.proc.send_signal(signal.SIGHUP)
        d.wait(lambda: d is not None and d.logged("reloaded"), 300, "reloaded")
        d.wait(lambda: d is not None and d.follows(server.proc.pid), 300, "following the server")
        assert learned_cats() == 30
        alerts = AlertStream(d.stub, "srv").alerts
        for _ in range(20):
            assert server.run("cat", str(data)) == "done 5\n"
        assert server.run("debug", str(data)) == "done 7\n"
        d.wait(lambda: alerts, 60, "the first alert")
        made = 1
        for _ in range(20):
            assert server.run("debug", str(data)) == "done 7\n"
            assert server.run("cat", str(data)) == "done 5\n"
            made += 1

        def represented() -> int:
            return sum((a.get("counted") or 1) + a["suppressed"] for a in alerts)

        # The samples held since the last emission are said by the next one: a hidden openat
        # made more than an interval after the others is emitted, saying everything held.  (Its
        # count is read within a poll, 0.2 s; a machine too busy for that gets another try.)
        for _ in range(10):
            time.sleep(1.5)
            assert server.run("debug", str(data)) == "done 7\n"
            made += 1
            deadline = time.monotonic() + 10
            while represented() < made and time.monotonic() < deadline:
                time.sleep(0.1)
            if represented() >= made:
                break
        d.wait(lambda: represented() >= made, 60, "every hidden openat alerted or held")
        assert not tracer()["per_sample_records"]
        err = d.stop_clean()
        first, *repeats = alerts
        assert (first["kind"], first["pid"], first["args"], first.get("counted")) == (
            "unseen_context", server.proc.pid, {"path": str(data)}, None)
        assert first["tid"] not in (0, server.proc.pid)  # the command's own thread
        assert runs_through(tuple(f["function"] for f in first["frames"]), HIDDEN)
        assert repeats and all(a["pid"] == a["tid"] == 0 and a["args"] == {} and a["counted"] > 0
                               and a["frames"] == first["frames"] for a in repeats)
        assert represented() == made, alerts
        assert "counted=" in err and "pid=? tid=?" in err and "Traceback" not in err
    finally:
        if d is not None:
            d.kill()
        server.close()


@pytest.mark.bpf
def test_daemon_enforce_kills_at_the_hidden_open(bpf: None, workdir: str, tmp_path: Path) -> None:
    """action = "enforce" on a running process (frame pointers: the enforcer keys contexts by a
    frame-pointer walk): normal commands run on; the hidden openat kills the process before its
    result reaches the program ("done 7" never appears).  The model file is the default one under
    the state directory."""
    binary = compile_server(Path(workdir) / "srv", 0, "-fno-omit-frame-pointer")
    data = tmp_path / "data.txt"
    data.write_text("data\n")
    model = Path(workdir) / "state" / "anomaly" / "srv.model.json"
    server = Server(binary)
    d: Daemon | None = None
    try:
        d = Daemon(workdir, anomaly_config(workdir, binary, None, "learn"))
        d.wait(lambda: d is not None and d.follows(server.proc.pid), 300, "following the server")
        assert server.run("cat", str(data)) == "done 5\n"
        assert server.run("count", str(data)) == "done 1005\n"
        d.wait(lambda: model.exists() and len(openat_chains(model)) == 2, 60, "two chains learned")
        d.write_config(anomaly_config(workdir, binary, None, "enforce"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait(lambda: d is not None and d.logged("reloaded"), 300, "reloaded")
        d.wait(lambda: d is not None and d.logged("enforcing the model"), 120, "enforcing")
        assert server.run("count", str(data)) == "done 1005\n"
        assert server.run("cat", str(data)) == "done 5\n"
        assert server.run("debug", str(data)) == ""  # killed: EOF on its stdout
        assert server.proc.wait(timeout=30) == -signal.SIGKILL
        d.wait(lambda: d is not None and d.logged("verdict=killed syscall=openat"), 60, "killed at openat")
        err = d.stop_clean()
        assert "ccprofd alert kind=unseen_context syscall=openat" in err and "action=enforce" in err
        assert "Traceback" not in err
    finally:
        if d is not None:
            d.kill()
        if server.proc.poll() is None:
            server.close()


@pytest.mark.bpf
def test_daemon_unwind_enforce_without_frame_pointers(bpf: None, workdir: str, tmp_path: Path) -> None:
    """Issue 19: action = "enforce" on an unwind-mode target built with -fomit-frame-pointer: the
    daemon's own unwinder enforces the model learned in unwind mode (no frame-pointer enforcer is
    loaded); normal commands run on, the hidden openat kills the process ("done 7" never appears)."""
    binary = compile_server(Path(workdir) / "srv", 0, "-fomit-frame-pointer")
    data = tmp_path / "data.txt"
    data.write_text("data\n")
    model = Path(workdir) / "state" / "anomaly" / "srv.model.json"
    server = Server(binary)
    d: Daemon | None = None
    try:
        d = Daemon(workdir, anomaly_config(workdir, binary, None, "learn", "unwind"))
        d.wait(lambda: d is not None and d.follows(server.proc.pid), 300, "following the server")
        assert server.run("cat", str(data)) == "done 5\n"
        assert server.run("count", str(data)) == "done 1005\n"
        d.wait(lambda: model.exists() and len(openat_chains(model)) == 2, 60, "two chains learned")
        d.write_config(anomaly_config(workdir, binary, None, "enforce", "unwind"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait(lambda: d is not None and d.logged("reloaded"), 300, "reloaded")
        d.wait(lambda: d is not None and d.logged("from the unwinder"), 120, "enforcing from the unwinder")
        d.wait(lambda: d is not None and d.follows(server.proc.pid), 300, "following the server")
        assert server.run("count", str(data)) == "done 1005\n"
        assert server.run("cat", str(data)) == "done 5\n"
        assert server.run("debug", str(data)) == ""  # killed: EOF on its stdout
        assert server.proc.wait(timeout=30) == -signal.SIGKILL
        d.wait(lambda: d is not None and d.logged("verdict=killed syscall=openat"), 60, "killed at openat")
        err = d.stop_clean()
        assert "enforcing the model of" in err and "frame-pointer" not in err
        assert "ccprofd alert kind=unseen_context syscall=openat" in err and "action=enforce" in err
        assert "Traceback" not in err
    finally:
        if d is not None:
            d.kill()
        if server.proc.poll() is None:
            server.close()


@pytest.mark.bpf
def test_daemon_learns_calls_from_cpu_samples_for_routines(bpf: None, workdir: str) -> None:
    """Issue 14: a learning target with ``perf_sample_hz`` adds the calls its CPU samples show running
    to the model; detection with granularity "routines" then accepts a write through a shared routine
    from a path that only ran in training (tests/programs/anomaly_cpu.c: main > crunch computes, then,
    held out, writes through say), and still alerts on one that never ran (main > evil > say).  With
    ``prefix_match = "functions"`` it also accepts main's call of cmd_a at the call site that never
    ran (``again``; by call site it alerts: tests/test_anomaly_e2e.py)."""
    prog = build("anomaly_cpu", opt="O2")
    model = Path(workdir) / "cpu.model.json"

    def config(action: str) -> str:
        extra = f"""perf_sample_hz = 997
[target.anomaly]
action = "{action}"
model = "{model}"
granularity = "routines"
prefix_match = "functions"
flush_seconds = 1
alert_interval_seconds = 3600
"""
        return config_text(workdir, target_toml("cpu", f'path = "{prog}"', ["write"], "unwind", extra))

    def run(*argv: str) -> str:
        done = subprocess.run([str(prog), *argv], capture_output=True, text=True, timeout=120, check=True)
        return done.stdout

    def crunch_calls() -> int:
        if not model.exists():
            return 0
        [m] = load_models(model).targets.values()
        return sum(n for (caller, callee), n in m.calls.items()
                   if caller is not None and caller[1] == "main" and callee == (caller[0], "crunch"))

    d = Daemon(workdir, config("learn"))
    try:
        d.wait_attached()
        assert run("train") == "a\nb\n"  # a new process of the target's path: followed from exec
        d.wait(lambda: crunch_calls() >= 10, 120, "main -> crunch learned from CPU samples")
        d.write_config(config("detect"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait(lambda: d.logged("reloaded"), 300, "reloaded")
        d.wait_attached()
        assert run("held", "1000") == "crunched\n"
        assert run("again") == "a\n"
        assert run("evil") == "evil\n"
        d.wait(lambda: d.logged("context=main>evil>say"), 60, "the alert on evil's write")
        err = d.stop_clean()
        alerts = [line for line in err.splitlines() if "ccprofd alert" in line]
        assert len(alerts) == 1 and "kind=unseen_context syscall=write" in alerts[0], alerts
        assert "unseen_edge=main@" in alerts[0] and ">evil " in alerts[0]
    finally:
        d.kill()




@pytest.mark.bpf
def test_daemon_watch_ia32_alerts_and_enforces_under_a_set(bpf: None, workdir: str) -> None:
    """``watch_ia32 = true`` on a target with a syscall set (getpid, write: on the per-syscall
    events): learned from the program's x86-64 getpid path, its ``int $0x80`` path is alerted as
    ``ia32:getpid`` with the chain main > work > ia32_getpid, then killed under "enforce"; the
    x86-64 path keeps running."""
    from bpf_helpers import IA32_SWITCHED, compile_c

    prog = compile_c(Path(workdir), "switched", IA32_SWITCHED, "-O1")
    model = Path(workdir) / "switched.model.json"

    def config(action: str) -> str:
        extra = f"""watch_ia32 = true
[target.anomaly]
action = "{action}"
model = "{model}"
flush_seconds = 1
alert_interval_seconds = 3600
"""
        return config_text(workdir, target_toml("switched", f'path = "{prog}"', ["getpid", "write"], "unwind",
                                                extra))

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(prog), *argv], capture_output=True, text=True, timeout=120)

    d = Daemon(workdir, config("learn"))
    try:
        d.wait_attached()
        assert run("0").returncode == 0
        d.wait(lambda: model.exists() and len(next(iter(load_models(model).targets.values())).contexts) >= 2,
               120, "getpid and write learned")
        d.write_config(config("detect"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait(lambda: d.logged("reloaded"), 300, "reloaded")
        d.wait_attached()
        assert run("0").returncode == 0
        evil = run("1")
        assert evil.returncode == 0 and evil.stdout.strip().isdigit()
        d.wait(lambda: d.logged("syscall=ia32:getpid"), 60, "the alert on the int $0x80 getpid")
        d.write_config(config("enforce"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait(lambda: d.log().count("reloaded") >= 2, 300, "reloaded again")
        d.wait(lambda: d.logged("from the unwinder"), 120, "enforcing from the unwinder")
        d.wait_attached()
        assert run("0").returncode == 0
        assert run("1").returncode == -signal.SIGKILL
        err = d.stop_clean()
        alerts = [line for line in err.splitlines() if "ccprofd alert" in line]
        assert alerts and all("kind=unseen_context syscall=ia32:getpid" in a for a in alerts), alerts
        assert "context=main>work>ia32_getpid" in alerts[0], alerts[0]
        assert any("action=enforce" in a for a in alerts), alerts
        assert "Traceback" not in err
    finally:
        d.kill()
