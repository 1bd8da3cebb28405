"""The flight recorder (issue #19) end to end with real BPF on tests/programs/history.c, whose
syscall sequence is known from its source (the expected lists below are built from that, not from
our output): in both modes the ring of each thread holds the last 256 of its write/getppid/lseek
syscalls in program order, with their argument words and the calling function's context; a thread
is found by its tid, a process by its pid; the history outlives the process; the recorder can be
compiled out (``CCPROFD_HISTORY=0``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon_fakes import config_text, wait_for
from daemon_harness import ROOT, RunningDaemon, target_toml
from programs.build import build

from ccprofd.cli.main import main as ccprofd_main
from ccprofd.daemon.historypersist import read_history
from ccprofd.export import messages
from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.tracing.api import TraceOptions
from ccprofd.tracing.history import DEFAULT_HISTORY_LEN
from ccprofd.tracing.session import open_session

SYSCALLS = "write,getppid,lseek"
# fds are C ints: the kernel reads the register's low 32 bits (the upper ones are the caller's)
MINUS = {-1: 0xFFFFFFFF, -2: 0xFFFFFFFE}


def main_sequence(worker_line: bytes, waits: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """history.c's main thread: (syscall, argument words checked, innermost analysed function)."""
    out: list[tuple[str, tuple[int, ...], str]] = []
    for i in range(1, 301):
        out.append(("write", (MINUS[-1], 0, i), "emit"))
        if i % 100 == 0:
            out.append(("getppid", (), "other"))
            out.append(("lseek", (MINUS[-1], i, 0), "other"))
    out.append(("write", (1, -1, len(worker_line)), "main"))  # printf: buffer address unknown (-1)
    if waits:  # run with an argument: then "done\n"
        out.append(("write", (1, -1, 5), "main"))
    return out


def worker_sequence() -> list[tuple[str, tuple[int, ...], str]]:
    return [("write", (MINUS[-2], 0, k), "twrite") for k in range(1, 21)]


def analysed(frames: list[dict[str, Any]]) -> list[str]:
    return [str(f["function"]) for f in frames if f.get("analysed")]


def check(events: list[dict[str, Any]], want: list[tuple[str, tuple[int, ...], str]], outer: str) -> None:
    assert [e["syscall"] for e in events] == [w[0] for w in want], \
        ([(e["syscall"], e["raw_args"]) for e in events[-4:]], want[-3:])
    for e, (_, args, fn) in zip(events, want, strict=True):
        got = e["raw_args"]
        assert len(got) == len(args), (e, args)
        masked = [got[0] & 0xFFFFFFFF, *got[1:]] if got else []
        assert all(a == -1 or a == g for a, g in zip(args, masked, strict=True)), (got, args)
        assert e["complete"] is True, e
        chain = analysed(e["frames"])
        assert chain[0] == outer and chain[-1] == fn, (chain, fn)
    times = [e["time_ns"] for e in events]
    assert times == sorted(times)


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_history_holds_the_last_256_syscalls_of_each_thread_in_program_order(bpf: None, mode: str) -> None:
    prog = str(build("history", opt="O0"))
    session = open_session([prog], options=TraceOptions(mode=mode, syscalls=SYSCALLS))
    try:
        samples = [s for batch in session.batches() for s in batch]
        pid = session.child
        assert pid is not None
        printed = [s for s in samples if s.tid == pid and s.raw_args and s.raw_args[0] == 1]
        assert len(printed) == 1
        line_len = printed[0].raw_args[2]  # type: ignore[index]
        worker_tid = next(s.tid for s in samples if s.tid != pid)
        assert line_len == len(f"worker {worker_tid}\n")
        # the process exited: its history is still there (an LRU map keyed by tid, not task storage)
        assert not os.path.exists(f"/proc/{pid}")
        got = session.mode.history(pid)
        assert got["error"] is None
        by_tid = {t["tid"]: t["events"] for t in got["threads"]}
        assert set(by_tid) == {pid, worker_tid}
        want_main = main_sequence(b"x" * (line_len - 1) + b"\n")
        assert len(want_main) > DEFAULT_HISTORY_LEN  # the ring wrapped
        check(by_tid[pid], want_main[-DEFAULT_HISTORY_LEN:], "main")
        check(by_tid[worker_tid], worker_sequence(), "worker")
        # a thread by its tid alone; --last
        one = session.mode.history(worker_tid, last=5)
        assert [t["tid"] for t in one["threads"]] == [worker_tid]
        check(one["threads"][0]["events"], worker_sequence()[-5:], "worker")
        # each recorded event is the very sample the tracer reported: same time, same frames
        reported = {(s.tid, s.time_ns): s for s in samples}
        for tid, events in by_tid.items():
            for e in events:
                s = reported[(tid, e["time_ns"])]
                assert (s.syscall, s.frames) == (e["syscall"], e["frames"])
        # an alert's history: the events strictly before a given sample
        tenth = by_tid[worker_tid][9]
        before = session.mode.history_before(worker_tid, tenth["time_ns"], 4)
        assert [e["raw_args"][2] for e in before] == [6, 7, 8, 9]
    finally:
        session.close()


@pytest.mark.bpf
def test_recorder_compiled_out(bpf: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CCPROFD_HISTORY", "0")
    prog = str(build("history", opt="O0"))
    session = open_session([prog], options=TraceOptions(mode="unwind", syscalls=SYSCALLS))
    try:
        assert sum(len(b) for b in session.batches()) > 300
        got = session.mode.history(session.child or 0)
        assert got["threads"] == [] and "off" in got["error"]
    finally:
        session.close()


def ctl(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli.ctl", "--socket", sock, *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_ccprofctl_history_from_the_daemon(bpf: None, workdir: str, mode: str) -> None:
    binary = Path(workdir) / "hist"
    shutil.copy(build("history", opt="O0"), binary)
    target = target_toml("hist", f'path = "{binary}"', SYSCALLS.split(","), mode,
                         "persist_history_seconds = 1\n")
    with RunningDaemon(workdir, config_text(workdir, target)) as d:
        d.wait_attached()
        proc = subprocess.Popen([str(binary), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            d.wait_tracked(proc.pid)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            worker_line = proc.stdout.readline()
            worker_tid = int(worker_line.split()[1])
            assert proc.stdout.readline() == "done\n"
            pid = proc.pid

            def decoded() -> dict[str, Any] | None:
                out = ctl(d.socket_path, "history", str(pid), "--format", "json")
                assert out.returncode == 0, out.stderr
                got = json.loads(out.stdout)
                events = [e for t in got["threads"] for e in t["events"]]
                return got if events and all(e["complete"] for e in events) else None

            got = wait_for(decoded, timeout=60)
            assert got["target"] == "hist" and got["mode"] == mode
            by_tid = {t["tid"]: t["events"] for t in got["threads"]}
            assert set(by_tid) == {pid, worker_tid}
            for events in by_tid.values():
                for e in events:
                    e["raw_args"] = e.pop("args")  # the JSON of ccprofctl names them args
            check(by_tid[pid], main_sequence(worker_line.encode(), True)[-DEFAULT_HISTORY_LEN:], "main")
            check(by_tid[worker_tid], worker_sequence(), "worker")
            # one thread, the last 3, as text
            out = ctl(d.socket_path, "history", str(worker_tid), "--last", "3")
            assert out.returncode == 0, out.stderr
            lines = [ln.strip() for ln in out.stdout.splitlines()]
            assert lines[0] == f"pid {worker_tid} (target hist, {mode} mode, live): 1 threads"
            assert lines[1] == f"tid {worker_tid}: 3 syscalls, oldest first"
            for line, k in zip(lines[2:], (18, 19, 20), strict=True):
                assert f" write(0xfffffffe, 0x0, {k:#x}): " in line and ": worker > twrite" in line, line
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
        # the process is gone: its history is still kept
        out = ctl(d.socket_path, "history", str(pid), "--last", "1", "--format", "json")
        assert out.returncode == 0, out.stderr
        assert {t["tid"] for t in json.loads(out.stdout)["threads"]} == {pid, worker_tid}
        out = ctl(d.socket_path, "history", "4000000")
        assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
        assert "no target recorded pid 4000000" in out.stderr
        d.stop().assert_clean()  # the target's last save: at its close
    # the saved history (state_dir/history/hist.wet): the same events, decoded without the daemon,
    # at least the ring's last 256 of the main thread (more when a save fell inside the run)
    saved = {t["tid"]: t for t in read_history(Path(workdir) / "state" / "history" / "hist.wet")["threads"]}
    assert set(saved) == {pid, worker_tid} and saved[worker_tid]["pid"] == pid
    main_saved = saved[pid]["events"]
    assert len(main_saved) >= DEFAULT_HISTORY_LEN
    check(main_saved, main_sequence(worker_line.encode(), True)[-len(main_saved):], "main")
    check(saved[worker_tid]["events"], worker_sequence(), "worker")
    assert [(e["time_ns"], e["frames"]) for e in main_saved[-DEFAULT_HISTORY_LEN:]] == \
        [(e["time_ns"], e["frames"]) for e in by_tid[pid]]
    # read back by `ccprofd history FILE` (no daemon): forward, and backward with the cursor
    wet = str(Path(workdir) / "state" / "history" / "hist.wet")
    for reverse in ((), ("--reverse",)):
        for tid, want in ((pid, main_sequence(worker_line.encode(), True)[-len(main_saved):]),
                          (worker_tid, worker_sequence())):
            out = ccprofd_history(wet, "--tid", str(tid), "--format", "json", *reverse)
            assert out.returncode == 0, out.stderr
            got = json.loads(out.stdout)
            assert got["source"] == "persisted" and got["target"] == "hist"
            [thread] = got["threads"]
            events = thread["events"][::-1] if reverse else thread["events"]
            for e in events:
                e["raw_args"] = e.pop("args")
            check(events, want, "main" if tid == pid else "worker")
    out = ccprofd_history(wet, "--tid", str(worker_tid), "--last", "3", "--reverse")
    assert out.returncode == 0, out.stderr
    lines = [ln.strip() for ln in out.stdout.splitlines()]
    assert lines[0] == f"pid {pid} (target hist, persisted): 1 threads"
    assert lines[1] == f"tid {worker_tid}: 3 syscalls, newest first"
    for line, k in zip(lines[2:], (20, 19, 18), strict=True):
        assert f" write(0xfffffffe, 0x0, {k:#x}): " in line and ": worker > twrite" in line, line
    out = ccprofd_history(wet, "--tid", "4000000")
    assert out.returncode == 2 and out.stdout == "" and "no thread 4000000" in out.stderr
    # the real file cut at random offsets: refused in one line (exit 2), never a traceback
    data = Path(wet).read_bytes()
    cut = Path(workdir) / "cut.wet"
    for n in sorted(random.Random(pid).sample(range(len(data)), min(40, len(data)))):
        cut.write_bytes(data[:n])
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = ccprofd_main(["history", str(cut), "--reverse"])
        assert status == 2 and len(err.getvalue().splitlines()) == 1, (n, err.getvalue())
    # a restarted daemon's rings no longer hold the exited process: GetHistory / ccprofctl history
    # fall back to the saved file and say so
    with RunningDaemon(workdir, config_text(workdir, target)) as d:
        d.wait_attached()
        out = ctl(d.socket_path, "history", str(pid), "--format", "json")
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert (got["source"], got["target"], got["mode"]) == ("persisted", "hist", mode)
        fell = {t["tid"]: t["events"] for t in got["threads"]}
        assert set(fell) == {pid, worker_tid}
        for events in fell.values():
            for e in events:
                e["raw_args"] = e.pop("args")
        check(fell[pid], main_sequence(worker_line.encode(), True)[-len(main_saved):], "main")
        check(fell[worker_tid], worker_sequence(), "worker")
        out = ctl(d.socket_path, "history", str(worker_tid), "--last", "2")
        assert out.returncode == 0, out.stderr
        lines = [ln.strip() for ln in out.stdout.splitlines()]
        assert lines[0] == f"pid {worker_tid} (target hist, {mode} mode, persisted): 1 threads"
        assert lines[1] == f"tid {worker_tid}: 2 syscalls, oldest first"
        assert " write(0xfffffffe, 0x0, 0x14): " in lines[3] and ": worker > twrite" in lines[3]
        out = ctl(d.socket_path, "history", "4000000")
        assert out.returncode == 2 and "no target recorded pid 4000000" in out.stderr
        d.stop().assert_clean()


def ccprofd_history(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli", "history", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_a_daemon_alert_carries_the_threads_history(bpf: None, workdir: str, mode: str) -> None:
    """Learned (``ccprofd learn``) on a run without the argument, the daemon detects the run with
    it: its one unseen context is main's direct write of "done\\n"; the alert carries the main
    thread's 16 syscalls before it, the known sequence's."""
    binary = Path(workdir) / "hist"
    shutil.copy(build("history", opt="O0"), binary)
    model = Path(workdir) / "hist.model.json"
    r = subprocess.run([sys.executable, "-m", "ccprofd.cli", "learn", "--model", str(model), "--mode", mode,
                        "--syscalls", SYSCALLS, "--", str(binary)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    target = target_toml("hist", f'path = "{binary}"', SYSCALLS.split(","), mode,
                         f'[target.anomaly]\naction = "detect"\nmodel = "{model}"\n')
    with RunningDaemon(workdir, config_text(workdir, target)) as d:
        d.wait_attached()
        alerts: list[dict[str, Any]] = []
        subscribed = threading.Event()

        def collect() -> None:
            stream = d.stub.StreamAlerts(pb.AlertFilter(target="hist"), timeout=300)
            assert dict(stream.initial_metadata()).get("ccprofd-subscribed") == "1"
            subscribed.set()
            with contextlib.suppress(grpc.RpcError):
                for msg in stream:
                    alerts.append(messages.alert_from_pb(msg))

        reader = threading.Thread(target=collect, daemon=True)
        reader.start()
        assert subscribed.wait(60)
        proc = subprocess.Popen([str(binary), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            d.wait_tracked(proc.pid)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            worker_line = proc.stdout.readline()
            assert proc.stdout.readline() == "done\n"
            wait_for(lambda: alerts, timeout=60)
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
    [alert] = alerts
    assert (alert["kind"], alert["syscall"]) == ("unseen_context", "write")
    assert alert["pid"] == alert["tid"] == proc.pid
    history = alert["history"]
    for e in history:
        e["raw_args"] = e.pop("args")
    check(history, main_sequence(worker_line.encode())[-16:], "main")
