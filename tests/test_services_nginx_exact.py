"""Real nginx (Debian's stock build, no frame pointers): ``ccprofd trace --mode unwind`` against gdb,
syscall by syscall, on a handful of requests (the reduced CI form of bench/services.py's nginx
exactness check, issue 14).

nginx runs with a master and one worker.  ccprofd attaches to the worker (its samples of a first
request show it traces), then gdb attaches to it
(``catch syscall`` on the request path's syscalls, the whole stack walked at every entry stop:
tests/gdb_oracle.py), then the test sends a few HTTP/1.0 requests (a 4 KB file, a 64 KB file, a
missing file: a 404 through the error path) on new connections.  Every syscall gdb stopped at must
be one of our samples of the worker, in the same order, with the same frames of nginx, return
address by return address (tests/fidelity.py).  gdb unwinds independently of ccprofd (its own
``.eh_frame`` reader, and ptrace, not BPF).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from conftest import require_bpf, require_tool
from daemon_fakes import wait_for
from fidelity import compare
from gdb_oracle import AttachedGdb, attach_gdb
from nginx_conf import nginx_conf
from ports import free_port

REPO = pathlib.Path(__file__).resolve().parent.parent
NGINX = "/usr/sbin/nginx"
#: the request path of a static file (sendfile off, nginx's default: pread64 + writev)
SYSCALLS = ["accept4", "recvfrom", "openat", "pread64", "writev", "close"]  # gdb 13 lacks newfstatat



@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    require_bpf()
    require_tool("gdb")
    if not os.access(NGINX, os.X_OK):
        require_tool("nginx")  # skips (fails under CI=true): nginx-light is not installed


def _get(port: int, path: str) -> bytes:
    """One HTTP/1.0 request on a new connection; the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        chunks = []
        while True:
            got = s.recv(65536)
            if not got:
                return b"".join(chunks)
            chunks.append(got)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _worker(master: int) -> int | None:
    kids = pathlib.Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return int(kids[0]) if kids else None


@pytest.fixture
def www_root() -> Iterator[pathlib.Path]:
    """A directory the worker (www-data) can read: pytest's tmp_path is under a 0700 directory."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="ccprofd-nginx-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_nginx_frames_equal_gdb(www_root: pathlib.Path, tmp_path: pathlib.Path) -> None:
    root = www_root
    (root / "www").mkdir()
    (root / "www").chmod(0o755)
    files = {"small.html": 4096, "large.bin": 65536}
    for name, size in files.items():
        (root / "www" / name).write_bytes(b"x" * size)
        (root / "www" / name).chmod(0o644)
    port = free_port()
    (root / "nginx.conf").write_text(nginx_conf(root, port, workers=1, connections=64))
    master = subprocess.Popen([NGINX, "-c", str(root / "nginx.conf"), "-p", str(root)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tracer: subprocess.Popen[str] | None = None
    oracle: AttachedGdb | None = None
    try:
        wait_for(lambda: _worker(master.pid) is not None, 60, 0.05, what="nginx's worker")
        wait_for(lambda: _answers(port), 60, 0.05, what="nginx to answer")
        first = _get(port, "/small.html").split(b"\r\n")[0]
        assert b" 200 " in first, first
        worker = _worker(master.pid)
        assert worker is not None
        out = tmp_path / "samples.jsonl"
        tracer = subprocess.Popen(
            [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--format", "jsonl",
             "--syscalls", ",".join(SYSCALLS), "--output", str(out), "-p", str(worker)],
            cwd=REPO, stderr=subprocess.PIPE, text=True)
        assert tracer.stderr is not None

        def tracing() -> bool:
            """ccprofd's samples of a request arrive (unwind mode prints no attach line)."""
            assert tracer is not None and tracer.poll() is None, tracer.stderr.read() if tracer else ""
            _get(port, "/small.html")
            return out.exists() and bool(out.read_text().strip())

        wait_for(tracing, 600, 0.05, what="ccprofd trace's first samples")
        oracle = attach_gdb(worker, SYSCALLS)
        attached_ns = time.time_ns()  # the worker sleeps in epoll_wait until the next request
        answers = [_get(port, p) for p in ("/small.html", "/large.bin", "/missing", "/small.html")]
        assert [a.split(b"\r\n")[0].split()[1] for a in answers] == [b"200", b"200", b"404", b"200"]
        assert len(answers[1].split(b"\r\n\r\n", 1)[1]) == files["large.bin"]
        oracle.request_stop()
        _get(port, "/small.html")  # its accept4 makes gdb detach (not recorded)
        trace, run = oracle.finish(timeout=300)
        oracle = None
        tracer.send_signal(signal.SIGINT)
        err = tracer.stderr.read()
        assert tracer.wait(timeout=300) == 0, err
    finally:
        for p in (tracer, oracle.proc if oracle is not None else None):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        master.send_signal(signal.SIGQUIT)
        master.wait(timeout=60)

    assert run.entry_check_failures == 0
    [task] = trace.tasks
    got = [s.name for s in task.syscalls]
    # each request: accept4, recvfrom, a file's openat/pread64/close, writev, close
    for name in SYSCALLS:
        assert name in got, (name, got)
    samples = sorted((json.loads(line) for line in out.read_text().splitlines()),
                     key=lambda s: int(s["time_ns"]))
    ours = [s for s in samples if s.get("event") == "syscall" and s["tid"] == worker
            and s["syscall"] in SYSCALLS and int(s["time_ns"]) > attached_ns]
    # ccprofd also saw the trigger request after gdb detached: compare what gdb saw
    assert [s["syscall"] for s in ours[:len(got)]] == got
    result = compare(ours[:len(got)], trace, NGINX, sample_task_order=[worker])
    result.assert_ok()
    assert result.stats.samples_compared == len(got)
    assert result.stats.frames_compared >= 4 * len(got)  # main > ngx_master_process_cycle > ... > worker
