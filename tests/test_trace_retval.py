"""``ccprofd trace`` prints syscall lines as strace does (issue 16): arguments (fds, sizes, flags,
the path) and return values, ``= ?`` for a call that never returns.

The BPF tests run one program under ``ccprofd trace`` (both modes) and under ``strace -f`` (the
independent oracle) and compare every traced line; only the buffer arguments differ (strace prints
their strings, ccprofd their addresses).  The joiner tests feed :class:`ReturnJoiner` by hand.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from bpf_helpers import compile_c
from conftest import require_bpf, require_tool

from ccprofd.tracing.api import TraceSample
from ccprofd.tracing.base import ReturnJoiner

REPO = pathlib.Path(__file__).resolve().parent.parent
TRACED = "write,openat,close,exit_group"

PROGRAM = r"""
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
__attribute__((noinline)) static void say(int fd, const char *m) { write(fd, m, strlen(m)); }
int main(void) {
    say(1, "first line\n");
    int missing = open("/nonexistent/ccprofd-test", O_RDONLY);            /* -1 ENOENT */
    int null = open("/dev/null", O_WRONLY | O_CLOEXEC | O_APPEND);
    say(null, "to null 123\n");
    say(99, "x");                                                          /* -1 EBADF */
    close(null);
    close(98);                                                             /* -1 EBADF */
    say(1, "last\n");
    return missing == -1 ? 0 : 1;                                          /* exit_group(0) = ? */
}
"""


def _normalised(call: str) -> str:
    """A syscall line without its buffer argument (write's second), which strace prints as a string."""
    return re.sub(r'^write\((\d+), (".*"|0x[0-9a-f]+|NULL), ', r"write(\1, BUF, ", call)


def _ccprofd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})


def _strace_lines(prog: pathlib.Path, tmp: pathlib.Path) -> list[str]:
    strace = require_tool("strace")
    log = tmp / "strace.txt"
    subprocess.run([strace, "-f", "-qq", "-e", f"trace={TRACED}", "-o", str(log), str(prog)], check=True,
                   stdout=subprocess.DEVNULL, timeout=120)
    lines = []
    for line in log.read_text().splitlines():
        line = re.sub(r"^\d+\s+", "", line)  # -f's pid column
        line = re.sub(r"\s+= ", " = ", line)  # strace aligns the return value
        lines.append(_normalised(line))
    return lines


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_text_lines_equal_strace(mode: str, tmp_path: pathlib.Path) -> None:
    require_bpf()
    prog = compile_c(tmp_path, "args", PROGRAM, "-O1")
    expected = _strace_lines(prog, tmp_path)
    assert any("ENOENT" in e for e in expected) and expected[-1] == "exit_group(0) = ?", expected
    out = tmp_path / "trace.txt"
    proc = _ccprofd("trace", "--mode", mode, "-e", f"trace={TRACED}", "-o", str(out), "--", str(prog))
    assert proc.returncode == 0, proc.stderr
    got = []
    for line in out.read_text().splitlines():
        if line.startswith(" > "):
            continue
        m = re.match(r"\[pid \d+ tid \d+\] (.*)$", line)
        assert m, line
        got.append(_normalised(m.group(1).removesuffix(" <incomplete>")))
    assert got == expected


@pytest.mark.bpf
def test_jsonl_has_raw_args_and_ret_with_retval(tmp_path: pathlib.Path) -> None:
    """JSONL: ``raw_args`` always (as many words as the call takes), ``ret`` with --retval (null:
    never returned); values as strace prints them for the same run."""
    require_bpf()
    prog = compile_c(tmp_path, "args", PROGRAM, "-O1")
    out = tmp_path / "trace.jsonl"
    proc = _ccprofd("trace", "-e", "trace=write,exit_group", "--format", "jsonl", "--retval", "-o", str(out),
                    "--", str(prog))
    assert proc.returncode == 0, proc.stderr
    got = [(s["syscall"], s["raw_args"][0], s["raw_args"][2] if len(s["raw_args"]) > 2 else None, s["ret"])
           for s in map(json.loads, out.read_text().splitlines())]
    assert [g[0] for g in got] == ["write"] * 4 + ["exit_group"]
    # write(1, "first line\n", 11) = 11; write(3, ..., 12) = 12; write(99, "x", 1) = -1 EBADF (-9);
    # write(1, "last\n", 5) = 5; exit_group(0) = ?
    assert got[0] == ("write", 1, 11, 11) and got[1][2:] == (12, 12) and got[2] == ("write", 99, 1, -9)
    assert got[3] == ("write", 1, 5, 5) and got[4] == ("exit_group", 0, None, None)
    no_ret = _ccprofd("trace", "-e", "trace=write", "--format", "jsonl", "--", str(prog))
    samples = [json.loads(line) for line in no_ret.stderr.splitlines() if line.startswith("{")]
    assert samples and all("ret" not in s and len(s["raw_args"]) == 3 for s in samples)


BURST = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((noinline)) static void put(int fd) { write(fd, "x", 1); }
int main(int argc, char **argv) {
    int fd = open("/dev/null", O_WRONLY), n = atoi(argv[1]);
    for (int i = 0; i < n; i++)
        put(fd);
    return 0;
}
"""


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_a_burst_gets_every_return(mode: str, tmp_path: pathlib.Path) -> None:
    """20,000 writes as fast as they go, text format (returns on by default): every line is
    ``write(3, ..., 1) = 1``.  Before: the return records lagged the samples by several polls and
    the samples of the exited thread were all written ``= ?``; in instrumented mode a few were
    ``= ?`` because samples and returns had their times converted with different clock offsets."""
    require_bpf()
    prog = compile_c(tmp_path, "burst", BURST, "-O1")
    out = tmp_path / "burst.txt"
    proc = _ccprofd("trace", "--mode", mode, "-e", "trace=write", "-o", str(out), "--", str(prog), "20000")
    assert proc.returncode == 0, proc.stderr
    heads = [line for line in out.read_text().splitlines() if not line.startswith(" > ")]
    calls = [re.sub(r"^\[pid \d+ tid \d+\] ", "", line) for line in heads]
    assert len(calls) == 20000 and all(re.fullmatch(r"write\(3, 0x[0-9a-f]+, 1\) = 1", c) for c in calls), \
        [c for c in calls if not c.endswith(" = 1")][:3]


def _s(t: int, name: str, tid: int = 1, pid: int = 1) -> TraceSample:
    return TraceSample(t, pid, tid, "syscall", name, True, [])


NR = {"read": 0, "write": 1, "close": 3, "brk": 12, "execve": 59, "openat": 257}  # x86-64, unistd_64.h


def test_joiner_pairs_each_thread_in_order() -> None:
    j = ReturnJoiner()
    a, b, c = _s(100, "write"), _s(200, "write"), _s(150, "write", tid=2)
    assert j.join([a, c, b], [(150, 1, NR["write"], 5)]) == [a]
    assert (a.returned, a.ret) == (True, 5) and b.returned is None
    assert j.join([], [(300, 1, NR["write"], 6), (160, 2, NR["write"], -9)]) == [c, b]
    assert (b.ret, c.ret) == (6, -9)


def test_joiner_never_returned() -> None:
    j = ReturnJoiner()
    ex, op = _s(50, "exit_group"), _s(100, "openat")
    assert j.join([ex, op], []) == [ex] and ex.returned is False
    # a later call of the thread returned first: the openat never will; the close's sample is late
    assert j.join([], [(300, 1, NR["close"], 0)]) == [op] and op.returned is False
    cl = _s(250, "close")
    assert j.join([cl], []) == [cl] and (cl.returned, cl.ret) == (True, 0)  # joined to the early return
    w = _s(400, "write")
    assert j.join([w], []) == [] and j.flush() == [w] and w.returned is False


def test_joiner_writes_an_exit_after_the_calls_still_waiting() -> None:
    """exit_group never returns, so it was written at once -- before the thread's last write, whose
    return came a poll later through the other ring (a CI run under load printed `exit_group(0) = ?`
    in the middle of the strace-style lines).  It waits behind the thread's waiting calls now."""
    j = ReturnJoiner()
    w, ex, other = _s(100, "write"), _s(300, "exit_group"), _s(200, "write", tid=2)
    assert j.join([w, ex, other], [(250, 2, NR["write"], 1)]) == [other]
    assert j.join([], [(150, 1, NR["write"], 11)]) == [w, ex]
    assert (w.returned, w.ret, ex.returned) == (True, 11, False)


def test_joiner_never_gives_a_lost_return_the_next_calls_value() -> None:
    """The return of a thread's first write was lost (full ring): the second write's return must not
    be taken for it, which would shift every later value by one call."""
    j = ReturnJoiner()
    first, second = _s(100, "write"), _s(200, "write")
    assert j.join([first, second], [(250, 1, NR["write"], 7)]) == [first, second]
    assert first.returned is False and (second.returned, second.ret) == (True, 7)


def test_joiner_ends_a_gone_thread_once_the_rings_are_read_dry() -> None:
    """A thread gone with a sample waiting: its return may still be in a ring (returns lagged the
    samples by 8 polls in a 20k-write burst, and every sample was '= ?'), so the sample waits until
    a poll after the thread was seen gone has read everything."""
    j = ReturnJoiner()
    gone = _s(100, "write", tid=2**22 + 7, pid=2**22 + 7)  # above pid_max: no such thread
    assert j.join([gone], [], drained=True) == []  # seen gone now: its return may be in the ring
    assert j.join([], [], drained=False) == []  # a full batch: the ring may hold more
    assert j.join([], [(150, gone.tid, NR["write"], 1)], drained=False) == [gone] and gone.ret == 1
    late = _s(100, "write", tid=2**22 + 8, pid=2**22 + 8)
    assert j.join([late], [], drained=False) == [] and j.join([], [], drained=False) == []
    assert j.join([], [], drained=True) == [late] and late.returned is False


def test_joiner_gives_up_returns_whose_sample_was_dropped() -> None:
    """A return whose sample the full ring dropped waited for it forever (one entry per such
    return of a thread that made no later sample: unbounded under drops).  Once a poll has read
    the rings dry after the one that brought it, its sample cannot come any more: it is counted."""
    j = ReturnJoiner()
    tid = 2**22 + 9  # no such thread: nothing else of it comes
    first = _s(10, "write", tid=tid)  # the thread's first sample, joined: it was traced from here on
    assert j.join([first], [(11, tid, NR["write"], 1)]) == [first]
    for i in range(1000):
        assert j.join([], [(100 + i, tid, NR["write"], 1)], drained=True) == []
    assert sum(len(q) for q in j.orphans.values()) <= 1
    assert j.drops() == {"return_lost": 0, "return_unjoined": 999}
    early = _s(50_000, "write", tid=tid)  # a return may still come a poll before its sample
    assert j.join([], [(50_001, tid, NR["write"], 3)]) == [] and j.join([early], []) == [early]
    assert (early.returned, early.ret) == (True, 3)


def test_joiner_bounds_the_returns_waiting_while_the_rings_are_never_read_dry() -> None:
    j = ReturnJoiner()
    j.MAX_EARLY_RETURNS = 10
    first = _s(-10, "write", tid=7)
    assert j.join([first], [(-9, 7, NR["write"], 1)], drained=False) == [first]
    assert j.join([], [(i, 7, NR["write"], 1) for i in range(25)], drained=False) == []
    assert sum(len(q) for q in j.orphans.values()) == 10 and j.returns_unjoined == 15
    assert j.flush() == [] and not j.orphans and j.returns_unjoined == 25


def test_a_return_before_the_threads_first_sample_is_not_a_drop() -> None:
    """The traced command's execve returns in the new image, whose first sample comes after it,
    and a -p thread blocked in a read returns before its first sample: neither call's sample was
    ever to be taken, so neither is a dropped sample (every trace of a command reported one)."""
    j = ReturnJoiner()
    assert j.join([], [(100, 5, NR["execve"], 0)]) == []
    brk = _s(200, "brk", tid=5)
    assert j.join([brk], [(201, 5, NR["brk"], 0)]) == [brk]
    assert j.join([], [(150, 6, NR["read"], 4)]) == [] and j.join([], []) == []
    assert j.flush() == [] and j.drops() == {"return_lost": 0, "return_unjoined": 0}
    # a return after the thread's first sample whose own sample never came is one
    assert j.join([], [(300, 5, NR["write"], 1)]) == [] and j.join([], []) == []
    assert j.drops()["return_unjoined"] == 1


@pytest.mark.bpf
def test_tracing_a_command_reports_no_dropped_return() -> None:
    """End to end: `ccprofd trace -- true` (text format: returns joined) says nothing was dropped."""
    require_bpf()
    true = shutil.which("true") or "/bin/true"
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--format", "text",
                           "-o", "/dev/null", "--", true], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "without their sample" not in proc.stderr and "lost" not in proc.stderr, proc.stderr


def test_joiner_ends_a_sample_whose_return_was_lost_when_its_thread_blocks() -> None:
    """A write's return was lost and the thread then blocked in a read: the write waited (unwritten)
    for as long as the read did.  The read's sample came at an earlier poll than one that read
    the rings dry, so the write's return, recorded before the read began, was read if it ever
    will be: the write is written `= ?` and counted; the read, maybe still running, waits."""
    me = os.getpid()
    j = ReturnJoiner()
    w, r = _s(100, "write", tid=me, pid=me), _s(200, "read", tid=me, pid=me)
    assert j.join([w, r], [], drained=True) == []  # the write's return may be in the ring still
    assert j.join([], [], drained=False) == []  # not read dry: it may still
    assert j.join([], [], drained=True) == [w] and w.returned is False
    assert j.drops() == {"return_lost": 1, "return_unjoined": 0}
    assert j.join([], [(300, me, 0, 5)]) == [r] and (r.returned, r.ret) == (True, 5)
    assert not j.open and not j._arrived
