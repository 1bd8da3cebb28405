"""Who builds the flight recorder (tracing/history.c): `ccprofd trace` and `ccprofd learn` read it
nowhere (only the daemon's GetHistory and alerts and `detect`'s alerts do), so they load their
programs without it: no 14 MB ``ccprof_history`` map, and about half the unwinder's verification
(issue 16's cached start-up).  The maps are seen as the kernel reports them for the running
process's file descriptors (/proc/PID/fdinfo), not as ccprofd says; the same scan finds the map in
a session opened with the default options (the library's and the daemon's), so it can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_fakes import wait_for
from programs.build import build

from ccprofd.tracing.api import TraceOptions
from ccprofd.tracing.history import DEFAULT_HISTORY_LEN, DEFAULT_HISTORY_THREADS, history_bytes
from ccprofd.tracing.session import open_session

ROOT = Path(__file__).resolve().parent.parent
BPF_MAP_TYPE_LRU_HASH = 9


def bpf_maps(pid: int) -> list[dict[str, int]]:
    """The BPF maps process ``pid`` holds, from the kernel's fdinfo of each of its map fds."""
    out: list[dict[str, int]] = []
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(fd_dir / fd) != "anon_inode:bpf-map":
                continue
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:  # closed meanwhile
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        out.append({k: int(fields[k].strip(), 0) for k in ("map_type", "value_size", "max_entries")})
    return out


def recorder_maps(pid: int) -> list[dict[str, int]]:
    """The flight recorder's ring maps: an LRU hash of one ring (header + 256 events) per thread."""
    return [m for m in bpf_maps(pid) if m["map_type"] == BPF_MAP_TYPE_LRU_HASH
            and m["value_size"] == history_bytes(DEFAULT_HISTORY_LEN)]


def traced_child(pid: int, exe: str) -> bool:
    """True once ``pid`` has a child running ``exe`` (probes are attached before it execs)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return any(os.path.realpath(f"/proc/{c}/exe") == os.path.realpath(exe) for c in children)
    except OSError:
        return False


@pytest.mark.bpf
def test_the_default_options_build_the_recorder(bpf: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan's control: the library's default (and the daemon's) has the map, at its size."""
    monkeypatch.delenv("CCPROFD_HISTORY", raising=False)
    session = open_session([str(build("history", opt="O0"))],
                           options=TraceOptions(mode="unwind", syscalls="write"))
    try:
        got = recorder_maps(os.getpid())
        assert [m["max_entries"] for m in got] == [DEFAULT_HISTORY_THREADS]
    finally:
        session.close()


@pytest.mark.bpf
@pytest.mark.parametrize("command", ["trace", "learn"])
def test_trace_and_learn_build_no_recorder(bpf: None, command: str, tmp_path: Path) -> None:
    prog = str(build("history", opt="O0"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CCPROFD_HISTORY", None)
    args = ["-o", "/dev/null"] if command == "trace" else ["--model", str(tmp_path / "m.model")]
    # with an argument the program waits for a line on stdin first: ccprofd is then attached
    proc = subprocess.Popen([sys.executable, "-m", "ccprofd.cli", command, *args, "--", prog, "wait"],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_for(lambda: traced_child(proc.pid, prog) or proc.poll() is not None, timeout=300)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        maps = bpf_maps(proc.pid)
        assert maps  # the tracer's own maps are there
        assert recorder_maps(proc.pid) == []
    finally:
        if proc.stdin:
            proc.stdin.write(b"go\n")
            proc.stdin.close()
        proc.wait(timeout=300)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
