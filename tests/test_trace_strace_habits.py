"""strace's spellings in ``ccprofd trace`` (issue 16): ``-e trace=LIST`` with the %file/%network/
%process/%memory classes, ``-f``, several ``-p``, ``-tt``/``-ttt`` and ``--duration``.

Expected syscall numbers are the x86-64 ABI's (arch/x86/entry/syscalls/syscall_64.tbl); expected
frames come from the test program's source; the class contents are strace's own documented
classes.  Timeouts are liveness bounds, not performance assertions.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import time
from typing import Any

import pytest
from bpf_helpers import compile_c
from conftest import require_bpf

from ccprofd.kbpf.syscalls import parse_syscalls

REPO = pathlib.Path(__file__).resolve().parent.parent

LOOP_C = r"""
#include <unistd.h>
volatile long sink;
__attribute__((noinline)) void tick(void) { sink = getppid(); usleep(20000); }
int main(void) { for (;;) tick(); }
"""


def ccprofd(*args: str, timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, **kw)


def test_syscall_classes_expand_as_strace_defines_them() -> None:
    network = set(parse_syscalls("%network") or [])
    assert {41, 42, 43, 49, 50, 288} <= network  # socket connect accept bind listen accept4
    assert 1 not in network and 257 not in network  # write, openat
    file_ = set(parse_syscalls("%file") or [])
    # open stat execve unlink openat newfstatat renameat2 statx
    assert {2, 4, 59, 87, 257, 262, 316, 332} <= file_
    assert 0 not in file_ and 1 not in file_  # read/write take an fd, not a file name
    process = set(parse_syscalls("%process") or [])
    # clone fork vfork execve exit wait4 kill exit_group clone3
    assert {56, 57, 58, 59, 60, 61, 62, 231, 435} <= process
    assert set(parse_syscalls("write,%process") or []) == process | {1}
    with pytest.raises(ValueError, match="unknown syscall class '%bogus'"):
        parse_syscalls("%bogus")


@pytest.mark.parametrize(("argv", "message"), [
    (["trace", "-e", "signal=all", "--", "/bin/true"], "only -e trace=LIST is supported"),
    (["trace", "-e", "trace=write", "--syscalls", "write", "--", "/bin/true"], "give the syscalls once"),
    (["trace", "-e", "trace=%bogus", "--", "/bin/true"], "unknown syscall class"),
    (["trace", "--duration", "0", "--", "/bin/true"], "--duration must be a positive"),
])
def test_bad_strace_spellings_are_one_line_and_exit_2(argv: list[str], message: str) -> None:
    proc = ccprofd(*argv)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and message in proc.stderr.strip().splitlines()[-1]


@pytest.mark.bpf
@pytest.mark.parametrize("style", ["-tt", "-ttt"])
def test_e_trace_class_follows_forks_with_timestamps(style: str, tmp_path: pathlib.Path) -> None:
    """``-e trace=%process -f -tt``: the shell's fork/exec of ``ls`` is traced (a %process call),
    no read/write is, and every sample line starts with its time as strace prints it."""
    require_bpf()
    out = tmp_path / "t.txt"
    before = time.time()
    proc = ccprofd("trace", "-e", "trace=%process", "-f", style, "-o", str(out), "--",
                   "/bin/sh", "-c", "ls / >/dev/null; exit 3")
    after = time.time()
    assert proc.returncode == 3, proc.stderr
    heads = [line for line in out.read_text().splitlines() if not line.startswith(" > ")]
    assert heads, proc.stderr
    stamp = r"(\d+)\.(\d{6}) " if style == "-ttt" else r"(\d\d):(\d\d):(\d\d)\.(\d{6}) "
    names = []
    for line in heads:
        m = re.match(stamp + r"\[pid \d+ tid \d+\] (\w+)", line)
        assert m, line
        names.append(m.group(m.lastindex))
        if style == "-ttt":
            assert before - 1 <= int(m.group(1)) + int(m.group(2)) / 1e6 <= after + 1, line
    assert "execve" in names and "exit_group" in names, names  # sh execs ls; both exit
    process = {"clone", "clone3", "fork", "vfork", "execve", "exit", "exit_group", "wait4", "kill", "waitid"}
    assert set(names) <= process | {"tkill", "tgkill", "rt_sigqueueinfo", "execveat"}, names


@pytest.mark.bpf
def test_several_p_with_duration_trace_both_and_leave_them_running(tmp_path: pathlib.Path) -> None:
    require_bpf()
    prog = compile_c(tmp_path, "loop", LOOP_C, "-O1")
    targets = [subprocess.Popen([str(prog)]) for _ in range(2)]
    other = subprocess.Popen(["sleep", "60"])
    out = tmp_path / "p.jsonl"
    try:
        proc = ccprofd("trace", "-e", "trace=getppid", "--format", "jsonl", "-o", str(out), "--duration", "2",
                       "-p", str(targets[0].pid), "-p", str(targets[1].pid))
        assert proc.returncode == 0, proc.stderr
        assert all(t.poll() is None for t in targets)  # detached, still running
        mixed = ccprofd("trace", "-p", str(targets[0].pid), "-p", str(other.pid), "--duration", "1")
        assert mixed.returncode == 2 and "different executables" in mixed.stderr, mixed.stderr
    finally:
        for p in (*targets, other):
            p.kill()
            p.wait()
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert {s["pid"] for s in samples} == {t.pid for t in targets}
    for s in samples:
        assert s["syscall"] == "getppid"
        if s["complete"]:
            assert [f["function"] for f in s["frames"] if f["analysed"]] == ["main", "tick"], s


@pytest.mark.bpf
def test_duration_ends_a_traced_command_with_sigterm(tmp_path: pathlib.Path) -> None:
    require_bpf()
    prog = compile_c(tmp_path, "loop", LOOP_C, "-O1")
    out = tmp_path / "d.jsonl"
    proc = ccprofd("trace", "--duration", "1.5", "-e", "getppid", "--format", "jsonl", "-o", str(out), "--",
                   str(prog), timeout=300)
    assert proc.returncode == 128 + 15, proc.stderr  # killed by SIGTERM, as timeout(1) would
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert samples and all(s["syscall"] == "getppid" for s in samples)
