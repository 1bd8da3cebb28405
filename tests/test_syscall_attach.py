"""Per-syscall attachment (issue 14's security-set target, kbpf/syscall_entry.py): a small syscall
set is sampled on its own ``syscalls:sys_enter_<name>`` events, so a syscall outside the set runs
no BPF program, with the same samples as on ``raw_syscalls:sys_enter``.

* the samples of ``openat`` and ``connect`` of a program that makes many other syscalls match
  ``strace -f -k`` (tests/fidelity.py), in both modes, on the default (per-syscall) path and on the
  raw path (``CCPROFD_SYSCALL_ATTACH=raw``);
* the sampler's syscall program runs (its ``run_cnt`` from BPF_ENABLE_STATS, a count the kernel
  keeps) about as often as the set's syscalls are made, not once per syscall: a tracked process's
  600,000 ``getppid`` calls add nothing.  On raw_syscalls it ran at least once per syscall.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from bpf_helpers import drain
from conftest import require_bpf, require_tool
from fidelity import compare
from programs.build import build
from strace_oracle import run_strace

from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.syscall_entry import MAX_ENTRY_SYSCALLS, entry_plan
from ccprofd.tracing.syscall_sampler import SYSCALL_NR_OFFSET, SYSCALL_RET_OFFSET, SyscallSampler
from ccprofd.tracing.unwind.sampler import UnwindSampler

REPO = pathlib.Path(__file__).resolve().parent.parent
SET = ["openat", "connect"]
NR_OPENAT, NR_CONNECT, NR_GETPPID, NR_MMAP, NR_MPROTECT = 257, 42, 110, 9, 10
BPF_ENABLE_STATS = 32
GETPPIDS = 300_000  # per loop; the program runs two


@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    require_bpf()


def test_plan_small_sets_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small set (plus the extra syscalls) gets one event per syscall; "all", a set over the
    bound and the raw switch stay on raw_syscalls."""
    offsets = {"nr_offset": SYSCALL_NR_OFFSET, "ret_offset": SYSCALL_RET_OFFSET}
    plan = entry_plan([NR_OPENAT, NR_CONNECT], extra=[NR_MMAP], **offsets)
    assert plan == {NR_MMAP: "syscalls:sys_enter_mmap", NR_CONNECT: "syscalls:sys_enter_connect",
                    NR_OPENAT: "syscalls:sys_enter_openat"}
    assert entry_plan(None, **offsets) is None
    assert entry_plan(range(MAX_ENTRY_SYSCALLS + 1), **offsets) is None
    # the offsets must be where the programs read them (the tracefs formats say 8 and 16 here)
    assert entry_plan([NR_OPENAT], nr_offset=SYSCALL_NR_OFFSET + 8, ret_offset=SYSCALL_RET_OFFSET) is None
    assert entry_plan([NR_OPENAT], nr_offset=SYSCALL_NR_OFFSET, ret_offset=SYSCALL_RET_OFFSET + 8) is None
    monkeypatch.setenv("CCPROFD_SYSCALL_ATTACH", "raw")
    assert entry_plan([NR_OPENAT], **offsets) is None


def _trace(mode: str, attach: str, cmd: list[str], tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    out = tmp_path / f"{mode}-{attach}.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--format", "jsonl",
            "--syscalls", ",".join(SET), "--output", str(out), "--", *cmd]
    env = dict(os.environ, CCPROFD_SYSCALL_ATTACH=attach)
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.bpf
@pytest.mark.parametrize("attach", ["auto", "raw"])
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_samples_match_strace(mode: str, attach: str, tmp_path: pathlib.Path) -> None:
    require_tool("strace")
    binary = pathlib.Path(build("attachset", opt="O2", pie=True))
    cmd = [str(binary), "2000"]
    oracle = run_strace(cmd, SET)
    samples = _trace(mode, attach, cmd, tmp_path)
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    names = [s["syscall"] for s in samples]
    assert "connect" in names and "openat" in names, names
    assert result.stats.frames_compared >= 4  # main>opener>open and main>connector>connect
    assert result.stats.incomplete_samples == 0


# --------------------------------------------------------------------------- the cost, counted
def _run_cnt(fd: int) -> int:
    """The program's run count, from /proc/self/fdinfo (kept while BPF_ENABLE_STATS is on)."""
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("run_cnt:"):
                return int(line.split()[1])
    raise AssertionError(f"fd {fd} is not a BPF program with run statistics")


@pytest.fixture()
def bpf_stats() -> Iterator[None]:
    attr = ctypes.c_uint32(0)  # BPF_STATS_RUN_TIME; counting lasts while the fd is open
    fd = rawbpf.bpf(BPF_ENABLE_STATS, attr, "BPF_ENABLE_STATS")
    try:
        yield
    finally:
        os.close(fd)


CHATTY = ("import os, socket, sys\nsys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read(1)\n"
          f"for _ in range({2 * GETPPIDS}): os.getppid()\n"
          "open('/dev/null').close()\n"
          "s = socket.socket(socket.AF_UNIX)\n"
          "try:\n    s.connect('/nonexistent/ccprofd-attachset')\nexcept OSError:\n    pass\n")


def _released(s: UnwindSampler | SyscallSampler) -> tuple[int, int, list[Any]]:
    """Run CHATTY tracked by ``s``: (its run count gained, the pid, its samples)."""
    p = subprocess.Popen([sys.executable, "-c", CHATTY], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None
    assert p.stdout.readline() == b"ready\n"
    s.track(p.pid)
    before = _run_cnt(s.syscall_program_fd())
    p.stdin.write(b"x")
    p.stdin.close()
    assert p.wait(timeout=300) == 0
    gained = _run_cnt(s.syscall_program_fd()) - before
    return gained, p.pid, [x for x in drain(s, p.pid) if x.syscall is not None]


@pytest.mark.bpf
@pytest.mark.parametrize("kind", ["unwind", "sampler"])
def test_syscalls_outside_the_set_run_no_program(kind: str, bpf_stats: None) -> None:
    """600,000 getppid() calls of a tracked process, then one openat and one connect: the syscall
    program's run count grows by the set's syscalls machine-wide (other processes' openat,
    connect, mmap and mprotect during the second or so: far fewer than 600,000), not by every
    syscall; and the openat and connect are sampled."""
    s: UnwindSampler | SyscallSampler
    s = UnwindSampler(syscalls=[NR_OPENAT, NR_CONNECT]) if kind == "unwind" \
        else SyscallSampler(syscalls=[NR_OPENAT, NR_CONNECT])
    try:
        s.attach()
        gained, _pid, samples = _released(s)
    finally:
        s.close()
    nrs = [x.syscall for x in samples]
    assert NR_CONNECT in nrs and NR_OPENAT in nrs, nrs
    assert NR_GETPPID not in nrs
    assert gained >= 2
    assert gained < GETPPIDS, f"{gained} program runs for {2 * GETPPIDS} getppid calls outside the set"


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_return_values_match_strace(mode: str, tmp_path: pathlib.Path) -> None:
    """Text format (``--retval`` on): the returns come from the set's own ``sys_exit_<name>``
    events and read as strace prints them (openat's fds, connect's -1 ENOENT), call by call."""
    strace = require_tool("strace")
    binary = pathlib.Path(build("attachset", opt="O2", pie=True))
    cmd = [str(binary), "2000"]
    log = tmp_path / "strace.txt"
    subprocess.run([strace, "-qq", "-e", "trace=" + ",".join(SET), "-o", str(log), *cmd], check=True,
                   capture_output=True)
    want = [line.split("(", 1)[0] + " = " + line.rsplit(" = ", 1)[1]
            for line in log.read_text().splitlines() if " = " in line]
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--syscalls",
                           ",".join(SET), "--", *cmd], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = [line.split("] ", 1)[1].split("(", 1)[0] + " = " + line.rsplit(" = ", 1)[1]
           for line in proc.stderr.splitlines() if line.startswith("[pid ") and " = " in line]
    assert got == want, proc.stderr
    assert "connect = -1 ENOENT (No such file or directory)" in got
