"""``ccprofd trace`` stops on Ctrl-C and keeps its memory bounded while a target floods it.

The target makes ``getppid`` in a tight loop (millions a second, far more than userspace decodes),
which is what used to make ``ccprofd trace -p`` ignore Ctrl-C: the ring buffer never ran empty,
so neither a poll nor the drain after the stop ever returned, and the records queued in Python
without bound.  Ctrl-C is typed into a pseudo-terminal, as a user would, so the terminal's line
discipline delivers SIGINT to ccprofd's foreground process group.

Expected frames come from the program's source (main -> outer -> inner, each ``noinline``).
The timeouts below are liveness bounds (a hang fails the test instead of blocking CI), not
performance assertions.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import subprocess
import sys
import termios
import threading
import time

import pytest
from bpf_helpers import compile_c
from conftest import require_bpf
from daemon_fakes import wait_for

REPO = pathlib.Path(__file__).resolve().parent.parent
MODES = ("unwind", "instrumented")
TRACE = (sys.executable, "-m", "ccprofd.cli", "trace", "--syscalls", "getppid", "--format", "jsonl")
RSS_LIMIT_KB = 200 * 1024  # issue 16: bounded memory at any syscall rate

BUSY_C = r"""
#include <unistd.h>
volatile long sink;
__attribute__((noinline)) void inner(void) { sink = getppid(); }
__attribute__((noinline)) void outer(void) { inner(); sink++; }
int main(void) { for (;;) outer(); }
"""


class PtyProcess:
    """A command whose controlling terminal is a fresh pty: ``ctrl_c`` types ^C into it."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()

        def controlling_tty() -> None:  # runs in the child after setsid (start_new_session)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                                     start_new_session=True, preexec_fn=controlling_tty)
        os.close(slave)
        self._out = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every holder of the slave side has closed it
                return
            if not data:
                return
            self._out += data

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def output(self) -> str:
        self._reader.join(timeout=30)
        return self._out.decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _samples(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines]


class RssWatch:
    """The largest VmRSS of ``pid`` seen while it runs (sampled every 50 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss_kb(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _check_samples(samples: list[dict]) -> None:
    syscalls = [s for s in samples if s["event"] == "syscall"]
    assert syscalls, samples[:3]
    complete = [s for s in syscalls if s["complete"]]
    assert len(complete) * 10 >= len(syscalls) * 9, [s for s in syscalls if not s["complete"]][:3]
    for s in complete:
        assert s["syscall"] == "getppid"
        assert [f["function"] for f in s["frames"] if f["analysed"]] == ["main", "outer", "inner"], s
    for lost in (s for s in samples if s["event"] == "lost"):
        assert lost["samples"] > 0 and lost["reason"] == "ringbuf_full"


@pytest.mark.bpf
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_detaches_from_a_flooding_process(mode: str, tmp_path: pathlib.Path) -> None:
    """-p PID on a process making millions of syscalls a second: memory stays bounded while it
    runs, ^C makes ccprofd detach and exit 0, the process runs on, the output is whole JSON lines
    with the true frames, and what was dropped is said (records and stderr agree)."""
    require_bpf()
    busy = compile_c(tmp_path, "busy", BUSY_C, "-O1")
    target = subprocess.Popen([str(busy)])
    out = tmp_path / "out.jsonl"
    tracer = PtyProcess([*TRACE, "--mode", mode, "-o", str(out), "-p", str(target.pid)])
    try:
        watch = RssWatch(tracer.proc.pid)
        wait_for(lambda: len(out.read_text().splitlines()) >= 2000 if out.exists() else False, timeout=300)
        time.sleep(2)  # a few more million syscalls while decoding lags behind
        tracer.ctrl_c()
        status = tracer.proc.wait(timeout=120)  # before the fix: never (SIGKILL needed)
        peak = watch.stop()
        err = tracer.output()
        assert target.poll() is None  # detaching left the process running
    finally:
        tracer.close()
        target.kill()
        target.wait()
    assert status == 0, err
    assert "Traceback" not in err, err
    assert 0 < peak <= RSS_LIMIT_KB, f"peak RSS {peak} kB"
    samples = _samples(out)
    _check_samples(samples)
    lost = sum(s["samples"] for s in samples if s["event"] == "lost")
    if lost:
        assert f"ccprofd: {lost} samples dropped" in err, err
    else:
        assert "samples dropped" not in err, err


@pytest.mark.bpf
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_ends_a_traced_command_that_floods(mode: str, tmp_path: pathlib.Path) -> None:
    """-- CMD: ^C reaches the command (same terminal, same process group) and kills it; ccprofd
    drains for at most a moment, then exits with the command's status (128 + SIGINT)."""
    require_bpf()
    busy = compile_c(tmp_path, "busy", BUSY_C, "-O1")
    out = tmp_path / "out.jsonl"
    tracer = PtyProcess([*TRACE, "--mode", mode, "-o", str(out), "--", str(busy)])
    try:
        watch = RssWatch(tracer.proc.pid)
        wait_for(lambda: len(out.read_text().splitlines()) >= 2000 if out.exists() else False, timeout=300)
        time.sleep(2)
        tracer.ctrl_c()
        status = tracer.proc.wait(timeout=120)
        peak = watch.stop()
        err = tracer.output()
    finally:
        tracer.close()
    assert status == 130, err
    assert "Traceback" not in err, err
    assert 0 < peak <= RSS_LIMIT_KB, f"peak RSS {peak} kB"
    _check_samples(_samples(out))


def _distinct_c(levels: int) -> str:
    """Function pairs l<k>a/l<k>b per level, the path picked by bit k of the loop counter: every
    call reaches getppid through a context not seen before (2**levels of them)."""
    out = ["#include <stdlib.h>", "#include <unistd.h>", "volatile unsigned long sink;",
           "__attribute__((noinline)) void leaf(unsigned long v) { sink = getppid() + v; }"]
    for k in reversed(range(levels)):
        nxt = "leaf(v)" if k == levels - 1 else f"((v >> {k + 1}) & 1 ? l{k + 1}b(v) : l{k + 1}a(v))"
        out += [f"__attribute__((noinline)) void l{k}{s}(unsigned long v) {{ {nxt}; sink++; }}" for s in "ab"]
    out.append("int main(int argc, char **argv) { long n = atol(argv[1]);"
               " for (long i = 0; i < n; i++) { if (i & 1) l0b(i); else l0a(i); } return 0; }")
    return "\n".join(out) + "\n"


@pytest.mark.bpf
def test_a_flood_of_distinct_contexts_keeps_memory_bounded(tmp_path: pathlib.Path) -> None:
    """1M getppid calls, each through a new context (17 levels of a/b choices): ccprofd decodes
    what it can, drops and reports the rest, and its RSS stays under the bound (the caches of
    decoded paths and serialised contexts are bounded; before they were, 350 MB).  Every complete
    sample is main > l0? > ... > l16? > leaf, as the source says."""
    require_bpf()
    levels = 17
    prog = compile_c(tmp_path, "distinct", _distinct_c(levels), "-O1")
    out = tmp_path / "out.jsonl"
    tracer = subprocess.Popen([*TRACE, "-o", str(out), "--", str(prog), "1000000"], cwd=REPO,
                              stderr=subprocess.PIPE, text=True)
    watch = RssWatch(tracer.pid)
    _, err = tracer.communicate(timeout=600)
    peak = watch.stop()
    assert tracer.returncode == 0, err
    assert 0 < peak <= RSS_LIMIT_KB, f"peak RSS {peak} kB"
    samples = _samples(out)
    syscalls = [s for s in samples if s["event"] == "syscall"]
    lost = sum(s["samples"] for s in samples if s["event"] == "lost")
    assert len(syscalls) + lost == 1_000_000, (len(syscalls), lost)
    shapes = set()
    for s in syscalls:
        if not s["complete"]:
            continue
        names = [f["function"] for f in s["frames"] if f["analysed"]]
        assert names[0] == "main" and names[-1] == "leaf" and len(names) == levels + 2, names
        assert all(n[:-1] == f"l{k}" and n[-1] in "ab" for k, n in enumerate(names[1:-1])), names
        shapes.add(tuple(names))
    assert len(shapes) > 1000  # distinct contexts indeed
