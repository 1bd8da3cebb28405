"""``ccprofctl`` as a user runs it (a subprocess) against a daemon serving a real Unix socket."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fakes import (
    TARGET_APP,
    FakeFactory,
    frame,
    sample,
    started_daemon,
    wait_for,
)

from ccprofd.daemon.service import Daemon
from ccprofd.daemon.store import context_id, sample_context_id

WRITE_CTX = [frame("main", 0x1139), frame("emit", 0x1180)]
OPEN_CTX = [frame("main", 0x1145), frame("load", 0x11A0)]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Daemon, FakeFactory, str]]:
    with started_daemon(TARGET_APP + '[[target]]\nname="cpuapp"\npid=77\nperf_sample_hz = 50\n') as s:
        daemon, factory = s.daemon, s.factory
        src = factory.sources["app"]
        src.push(*[sample(WRITE_CTX) for _ in range(5)], *[sample(OPEN_CTX, "openat") for _ in range(2)])
        factory.sources["cpuapp"].push(*[sample(WRITE_CTX, event="cpu") for _ in range(4)])
        wait_for(lambda: daemon.targets["app"].store.samples == 7
                 and daemon.targets["cpuapp"].store.samples == 4)
        yield daemon, factory, s.socket


def ctl(sock: str, *args: str, binary: bool = False) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "ccprofd.cli.ctl", "--socket", sock, *args], capture_output=True, timeout=60
    )


def test_targets_text_and_json(served: tuple[Daemon, FakeFactory, str]) -> None:
    _, _, sock = served
    text = ctl(sock, "targets")
    assert text.returncode == 0, text.stderr
    assert "app: path /opt/app/bin  mode unwind" in text.stdout.decode()
    assert "pid 4242" in text.stdout.decode()
    out = ctl(sock, "targets", "--json")
    targets = {t["name"]: t for t in json.loads(out.stdout)}
    assert targets["app"]["processes"][0]["pid"] == 4242 and targets["cpuapp"]["perf_sample_hz"] == 50
    assert json.loads(ctl(sock, "--format", "json", "targets").stdout) == json.loads(out.stdout)


def test_contexts_json_uses_the_tracer_frame_format(served: tuple[Daemon, FakeFactory, str]) -> None:
    _, _, sock = served
    out = ctl(sock, "contexts", "4242", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    t0 = next(t for t in doc["threads"] if t["tid"] == 4242)
    assert t0["frames"][0] == frame("main", 0x1100) and t0["complete"] is True
    assert "[incomplete" in ctl(sock, "contexts", "4242").stdout.decode()


def test_hot_text_json_folded_pprof(served: tuple[Daemon, FakeFactory, str], tmp_path: Path) -> None:
    _, _, sock = served
    doc = json.loads(ctl(sock, "hot", "--target", "app", "--json").stdout)
    assert doc["total_samples"] == 7
    assert [(c["syscall"], c["count"], c["context"], c["frames"]) for c in doc["contexts"]] == [
        ("write", 5, context_id(WRITE_CTX), WRITE_CTX),
        ("openat", 2, context_id(OPEN_CTX), OPEN_CTX),
    ]
    # the program's leaf; no library leaf below it in these (instrumented-mode-like) frames
    assert [(c["leaf"], c["leaf_library"]) for c in doc["contexts"]] == [("emit", ""), ("load", "")]
    top1 = json.loads(ctl(sock, "hot", "--target", "app", "--top", "1", "--json").stdout)
    assert [c["count"] for c in top1["contexts"]] == [5]
    folded = ctl(sock, "hot", "--target", "app", "--format", "folded").stdout.decode()
    assert folded.splitlines() == ["app;main;emit;syscall:write 5", "app;main;load;syscall:openat 2"]
    text = ctl(sock, "hot").stdout.decode()
    assert "syscall write" in text and "emit" in text
    out = ctl(
        sock,
        "hot",
        "--target",
        "cpuapp",
        "--by",
        "cpu",
        "--format",
        "pprof",
        "--output",
        str(tmp_path / "cpu.pb.gz"),
    )
    assert out.returncode == 0, out.stderr
    from ccprofd.export.gen import profile_pb2

    prof = profile_pb2.Profile.FromString(gzip.decompress((tmp_path / "cpu.pb.gz").read_bytes()))
    assert [list(s.value) for s in prof.sample] == [[4, 4 * 20_000_000]] and prof.period == 20_000_000
    piped = ctl(sock, "hot", "--format", "pprof")
    assert gzip.decompress(piped.stdout)  # to a pipe: allowed


def test_stats(served: tuple[Daemon, FakeFactory, str]) -> None:
    _, _, sock = served
    doc = json.loads(ctl(sock, "stats", "app", "--json").stdout)
    assert doc["binaries"][0]["stats"]["functions"] == 12  # integral again, not 12.0
    assert "functions" in ctl(sock, "stats", "app").stdout.decode()


def test_stream_json_lines(served: tuple[Daemon, FakeFactory, str]) -> None:
    daemon, factory, sock = served
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ccprofd.cli.ctl",
            "--socket",
            sock,
            "stream",
            "--json",
            "--count",
            "3",
            "--target",
            "app",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: daemon.samples.subscribers() >= 1, timeout=30)

    def push() -> None:
        while proc.poll() is None:
            factory.sources["app"].push(sample(OPEN_CTX, "openat"))
            time.sleep(0.05)

    threading.Thread(target=push, daemon=True).start()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert len(lines) == 3
    assert all(x["syscall"] == "openat" and x["frames"] == OPEN_CTX and x["target"] == "app" for x in lines)


def test_stream_says_what_the_daemon_dropped() -> None:
    """A client slower than the samples: every sample is printed or counted on stderr, none lost
    silently (the daemon's queue for it holds 4; ctl prints and flushes a line per sample)."""
    with started_daemon(TARGET_APP, daemon_extra="stream_queue = 4") as s:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ccprofd.cli.ctl", "--socket", s.socket, "stream", "--json",
             "--duration", "8", "--target", "app"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: s.daemon.samples.subscribers() >= 1, timeout=30)
        n = 3000
        deep = [frame(f"f{i}", 0x1000 + 16 * i) for i in range(40)]  # ctl's slow part: frames to JSON
        s.factory.sources["app"].push(*[sample(deep, "openat", tid=i) for i in range(n)])
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    tids = [json.loads(line)["tid"] for line in out.decode().splitlines()]
    said = [line for line in err.decode().splitlines() if "dropped" in line]
    dropped = sum(int(line.split("dropped ")[1].split()[0]) for line in said)
    assert len(tids) + dropped == n and tids == sorted(set(tids))
    assert dropped == s.daemon.samples.dropped > 0, err  # 3,000 at once cannot fit in 4


def test_alerts_duration_ends_cleanly(served: tuple[Daemon, FakeFactory, str]) -> None:
    _, _, sock = served
    out = ctl(sock, "alerts", "--duration", "0.5")
    assert out.returncode == 0 and out.stdout == b"", out.stderr


def test_errors_and_exit_codes(served: tuple[Daemon, FakeFactory, str]) -> None:
    _, _, sock = served
    unknown_pid = ctl(sock, "contexts", "1")
    assert (
        unknown_pid.returncode == 2
        and unknown_pid.stderr.decode().strip() == "ccprofctl: no target follows pid 1"
    )
    unknown_target = ctl(sock, "stats", "nope")
    assert unknown_target.returncode == 2 and b"no target 'nope'" in unknown_target.stderr
    unreachable = ctl("/nonexistent/ccprofd.sock", "--timeout", "2", "targets")
    assert unreachable.returncode == 1
    assert unreachable.stderr.decode().startswith("ccprofctl: cannot reach ccprofd at unix:///nonexistent/")
    assert len(unreachable.stderr.decode().strip().splitlines()) == 1
    bad_format = ctl(sock, "targets", "--format", "pprof")
    assert bad_format.returncode == 2 and b"applies to 'hot' only" in bad_format.stderr
    usage = ctl(sock, "contexts", "abc")
    assert usage.returncode == 2 and b"Traceback" not in usage.stderr
    tls_on_unix = ctl(sock, "--tls-ca", "/x", "targets")
    assert tls_on_unix.returncode == 2


def test_out_of_range_numbers_are_usage_errors(served: tuple[Daemon, FakeFactory, str]) -> None:
    """Issue 15: no ValueError traceback from protobuf for numbers its fields cannot hold."""
    _, _, sock = served
    for argv, needle in (
        (("contexts", "99999999999"), b"expected a process id (1 to 4194303), got '99999999999'"),
        (("contexts", "4194304"), b"expected a process id"),
        (("stream", "--pid", "99999999999"), b"expected a process id"),
        (("hot", "--since", "-10"), b"expected a positive number of seconds, got '-10'"),
        (("hot", "--since", "0"), b"expected a positive number of seconds"),
        (("hot", "--since", "nan"), b"expected a positive number of seconds"),
        (("hot", "--since", "inf"), b"expected a positive number of seconds"),
        (("alerts", "--duration", "-1"), b"expected a positive number of seconds"),
        (("--timeout", "-1", "targets"), b"expected a positive number of seconds"),
    ):
        out = ctl(sock, *argv)
        assert out.returncode == 2 and b"Traceback" not in out.stderr, (argv, out.stderr)
        assert needle in out.stderr.splitlines()[-1], (argv, out.stderr)
    # longer ago than the epoch: everything the daemon holds (as without --since), not an error
    huge = ctl(sock, "hot", "--since", "99999999999", "--json")
    assert huge.returncode == 0, huge.stderr
    everything = json.loads(ctl(sock, "hot", "--json").stdout)
    assert json.loads(huge.stdout)["total_samples"] == everything["total_samples"] >= 7
    many = ctl(sock, "hot", "--top", "99999999999", "--json")
    assert many.returncode == 0, many.stderr
    thousand = ctl(sock, "hot", "--top", "1000", "--json")
    assert json.loads(many.stdout)["contexts"] == json.loads(thousand.stdout)["contexts"]


def test_context_resolves_a_hash(served: tuple[Daemon, FakeFactory, str]) -> None:
    """Issue 17: ``ccprofctl context HASH`` prints the frames behind a metrics label."""
    _, _, sock = served
    ctx = context_id(WRITE_CTX)
    text = ctl(sock, "context", ctx)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.decode().splitlines()
    # app's write samples; cpuapp's CPU samples with the same frames have another id: a CPU
    # sample's innermost frame is the function the CPU was in, keyed by name, not by address.
    cpu = sample_context_id(sample(WRITE_CTX, event="cpu"))
    assert cpu != ctx
    assert [ln for ln in lines if ln.startswith("context ")] == [f"context {ctx}  target app"]
    assert [ln.split()[1] for ln in lines if ln.lstrip().startswith("#")] == ["main", "emit"]
    cpu_lines = ctl(sock, "context", cpu).stdout.decode().splitlines()
    assert [ln for ln in cpu_lines if ln.startswith("context ")] == [f"context {cpu}  target cpuapp"]
    assert [ln.split()[1] for ln in cpu_lines if ln.lstrip().startswith("#")] == ["main", "emit"]
    one = ctl(sock, "context", ctx, "--target", "app", "--json")
    assert one.returncode == 0, one.stderr
    rows = json.loads(one.stdout)
    assert [(r["target"], r["context"], r["complete"], r["leaf"]) for r in rows] == [
        ("app", ctx, True, "emit")]
    assert [(f["function"], f["call_site"]) for f in rows[0]["frames"]] == [
        ("main", "0x1139"), ("emit", "0x1180")]
    unknown = ctl(sock, "context", "0123456789ab")
    assert unknown.returncode == 2
    assert unknown.stderr.decode().splitlines() == [
        "ccprofctl: context 0123456789ab is not held by any target"]
    bad = ctl(sock, "context", "not-a-hash")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and b"not a context id" in bad.stderr


def test_version_of_both_commands() -> None:
    """Issue 17: ``--version`` prints the package version (pyproject.toml's, read independently)."""
    with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as fh:
        version = tomllib.load(fh)["project"]["version"]
    for module, name in (("ccprofd.cli.ctl", "ccprofctl"), ("ccprofd.cli", "ccprofd")):
        out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
        assert (out.returncode, out.stdout, out.stderr) == (0, f"{name} {version}\n", ""), module


def test_source_lines_travel_through_the_store_grpc_and_ctl(served: tuple[Daemon, FakeFactory, str]) -> None:
    """A context whose frames have DWARF ``file``/``line`` and ``inlined`` calls (the tracer's form)
    comes back from the daemon's store over gRPC with them, in JSON as the tracer wrote them and in
    text as ``func ... file:line`` with the inlined calls below their frame.  Its id is the one of
    the same frames without source positions (the id covers call sites only)."""
    daemon, factory, sock = served
    plain = [frame("main", 0x1139), frame("dispatch", 0x11F0)]
    lined = [dict(plain[0], file="/src/app.c", line=40),
             dict(plain[1], file="/src/app.c", line=33,
                  inlined=[{"function": "note", "file": "/src/app.c", "line": 29},
                           {"function": "put", "file": "/src/put.h", "line": 4}])]
    before = daemon.targets["app"].store.samples
    factory.sources["app"].push(sample(lined, "read"))
    wait_for(lambda: daemon.targets["app"].store.samples == before + 1)
    ctx = context_id(plain)
    out = ctl(sock, "context", ctx, "--target", "app", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["frames"] == lined
    hot = json.loads(ctl(sock, "hot", "--target", "app", "--syscall", "read", "--json").stdout)
    assert [c["frames"] for c in hot["contexts"]] == [lined]
    text = ctl(sock, "context", ctx, "--target", "app").stdout.decode().splitlines()
    frames = [ln.split() for ln in text if ln.strip().startswith(("#", ">"))]
    assert frames == [
        ["#0", "main", "0x1139", "/opt/app/bin", "/src/app.c:40"],
        ["#1", "dispatch", "0x11f0", "/opt/app/bin", "/src/app.c:33"],
        [">", "note", "/src/app.c:29", "(inlined)"],
        [">", "put", "/src/put.h:4", "(inlined)"]], text
    folded = ctl(sock, "hot", "--target", "app", "--syscall", "read", "--format", "folded", "--folded-marks")
    assert folded.returncode == 0, folded.stderr
    assert folded.stdout.decode().splitlines() == ["app;main;dispatch;note_[i];put_[i];syscall:read 1"]
    plain = ctl(sock, "hot", "--target", "app", "--syscall", "read", "--format", "folded")
    assert plain.stdout.decode().splitlines() == ["app;main;dispatch;note;put;syscall:read 1"]
    wrong = ctl(sock, "hot", "--json", "--folded-marks")
    assert wrong.returncode == 2 and wrong.stderr.decode().splitlines() == [
        "ccprofctl: --folded-marks applies to --format folded only"]
