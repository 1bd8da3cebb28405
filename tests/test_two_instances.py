"""Two ccprofd instances on one binary: the daemon following it (a ``path`` target) and ``ccprofd
trace -- BINARY``.  In unwind mode both stop each new process of the binary at exec (and at each new
executable mapping) until their own mappings are loaded, and a SIGCONT is not counted: the first
instance to continue the process used to release the other's hold too, whose samples then ran
ahead of its mappings (``complete: false, frames: []``, no reason: every sample of the trace, in 4
of 5 runs here).  Now an instance continues a process only when no other instance's hold map
(``uw_held``) still has it."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import require_bpf
from daemon_fakes import config_text, wait_for
from programs.build import build

REPO = pathlib.Path(__file__).resolve().parent.parent
BPF_MAP_TYPE_HASH = 1


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return fh.read().rpartition(b")")[2].split()[0].decode()


def _hold_map() -> int:
    from ccprofd.kbpf.rawbpf import map_create

    return map_create(BPF_MAP_TYPE_HASH, 4, 4, 64, name="uw_held")


def _hold(map_fd: int, tgid: int) -> None:
    from ccprofd.kbpf.abi import BPF_MAP_UPDATE_ELEM, MapElemAttr
    from ccprofd.kbpf.rawbpf import bpf

    k = ctypes.c_uint32(tgid)
    v = ctypes.c_uint32(1)
    bpf(BPF_MAP_UPDATE_ELEM, MapElemAttr(map_fd=map_fd, key=ctypes.addressof(k), value=ctypes.addressof(v)),
        "holding")


def test_a_process_two_instances_hold_runs_when_both_released() -> None:
    """The release protocol on its own: two hold maps (as two instances' ``uw_held``) hold one
    stopped process; the first release leaves it stopped, the second continues it."""
    require_bpf()
    from ccprofd.kbpf.holdguard import held_elsewhere, release

    child = subprocess.Popen(["sleep", "600"])
    a, b = _hold_map(), _hold_map()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: _state(child.pid) == "T", timeout=30)
        _hold(a, child.pid)
        _hold(b, child.pid)
        assert held_elsewhere(child.pid, a) and held_elsewhere(child.pid, b)
        assert release(a, child.pid) is False  # b still holds it
        time.sleep(0.2)
        assert _state(child.pid) == "T"
        assert not held_elsewhere(child.pid, b)
        assert release(b, child.pid) is True  # the last holder continues it
        wait_for(lambda: _state(child.pid) in ("S", "R"), timeout=30)
    finally:
        os.close(a)
        os.close(b)
        child.kill()
        child.wait()


LOOP_C = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) { printf("ready\n"); fflush(stdout); for (;;) { getppid(); usleep(1000); } }
"""


@pytest.mark.bpf
def test_a_held_process_continued_by_a_sigcont_not_ours_stops_again(bpf: None,
                                                                    tmp_path: pathlib.Path) -> None:
    """The residual race of the two-instance protocol: an instance that dropped its entry, checked
    the other's map (slowly, under load) and then sent its SIGCONT can continue the process after it
    ran into a new hold (its next executable mapping) of both instances: the trace's samples then
    ran ahead of its mappings (``unknown_pc`` on every sample of a run, 2-5 runs in 30 with other
    instances running).  A SIGCONT cannot be refused, so BPF stops a process it still holds again at
    its next syscall; the poll that has loaded its mappings releases it as any hold."""
    from bpf_helpers import compile_c

    from ccprofd.kbpf.syscalls import syscall_numbers
    from ccprofd.tracing.unwind.sampler import UnwindSampler

    binary = compile_c(tmp_path, "loop", LOOP_C, "-O2")
    with UnwindSampler(syscalls=[syscall_numbers()["getppid"]]) as s:
        s.attach()
        child = subprocess.Popen([str(binary)], stdout=subprocess.PIPE)
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            s.track(child.pid)
            s.poll(0)
            assert _state(child.pid) in ("S", "R")
            s.module.map("uw_held").set(child.pid, 1)  # held by us, yet running: continued by another
            wait_for(lambda: _state(child.pid) == "T", timeout=30)  # stopped at its next syscall
            assert s.stats()["restopped"] >= 1
            time.sleep(0.2)
            assert _state(child.pid) == "T"  # and it stays stopped until we release it
            s.poll(0)  # our release: its mappings are current, the entry goes, it is continued
            wait_for(lambda: _state(child.pid) in ("S", "R"), timeout=30)
            assert s.module.map("uw_held").get(child.pid) is None
        finally:
            child.kill()
            child.wait()


def _trace(binary: str, out: pathlib.Path) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--format", "jsonl", "--syscalls",
            "write,getppid,openat", "--output", str(out), "--", binary]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.bpf
def test_trace_beside_a_daemon_following_the_binary(bpf: None, workdir: str, tmp_path: pathlib.Path) -> None:
    from daemon_harness import RunningDaemon, target_toml

    binary = build("calls", opt="O2", pie=True)
    target = target_toml("prog", f'path = "{binary}"', ["write", "getppid", "openat"], "unwind")
    cfg = config_text(workdir, target)
    with RunningDaemon(workdir, cfg) as daemon:
        daemon.wait_attached()
        for i in range(3):
            samples = _trace(binary, tmp_path / f"run{i}.jsonl")
            # calls: the loader's two openat (ld.so's frames only: no frame of the binary yet), then
            # main's openat, getppid and writes (see tests/programs/calls.c)
            assert len(samples) >= 6
            # never wrong: a complete sample with a frame of the binary has main outermost, one
            # without has ld.so's or libc's frames only
            program = [s for s in samples if any(f["analysed"] for f in s["frames"])]
            assert all(s["frames"][0]["function"] == "main" for s in program if s["complete"])
            assert all(".so" in f["module"] for s in samples if s not in program for f in s["frames"])
            # and none flagged (a late SIGCONT of the other instance used to release a new hold:
            # test_a_held_process_continued_by_a_sigcont_not_ours_stops_again)
            assert all(s["complete"] for s in samples), (i, [(s["syscall"], s["frames"]) for s in samples])
            assert len(program) >= 4
