"""rbp known again after an inner frame lost it (tests/programs/rbp_restored.c): leaf's CFI keeps
rbp in r12 (not followed: rbp lost below it), mid's CFI restores main's rbp from its stack slot,
and outer's and main's CFAs are rbp-based.  Both unwinders -- BPF's ``uw_unwind_step`` (unwind.c)
and the ptrace snapshot walker (proc/userstack.py) -- kept rbp "lost" once lost, so every sample
through leaf ended at outer flagged ``rbp_lost`` (main missing) where gdb walks on to ``_start``.
Expected frames come from gdb."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest
from conftest import require_bpf, require_tool
from fidelity import compare
from gdb_threads import gdb_threads
from programs.build import build

from ccprofd.proc.modules import ModuleCache
from ccprofd.proc.threadsnap import snapshot

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.bpf
def test_unwind_mode_walks_on_once_rbp_is_restored(tmp_path: pathlib.Path) -> None:
    """Before: the read from leaf was ``complete: false, reason: rbp_lost`` with frames outer > mid >
    leaf; now main > outer > mid > leaf, complete, every frame as gdb's (fidelity.compare)."""
    require_bpf()
    require_tool("gdb")
    from gdb_oracle import run_gdb

    binary = pathlib.Path(build("rbp_restored", opt="O0"))
    oracle, _ = run_gdb([str(binary)], ["read"], timeout=600)
    out = tmp_path / "samples.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--verify", "--format", "jsonl",
            "--syscalls", "read", "--output", str(out), "--", str(binary)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    ours = [s for s in samples if s.get("syscall") == "read" and s.get("raw_args", [None])[0] == 0]
    assert len(ours) == 1, samples
    assert ours[0]["complete"], ours[0]
    assert [f["function"] for f in ours[0]["frames"]] == ["main", "outer", "mid", "leaf"]
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    assert result.stats.incomplete_samples == 0


def test_snapshot_walks_on_once_rbp_is_restored() -> None:
    """The ptrace snapshot of the thread blocked in leaf's read: every pc gdb's, complete (before:
    ``rbp_lost`` after outer's frame)."""
    require_tool("gdb")
    binary = build("rbp_restored", opt="O0")
    proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        syscall = pathlib.Path(f"/proc/{proc.pid}/syscall")
        while syscall.read_text().split()[:2] != ["0", "0x0"]:  # read(0, ...) in leaf
            time.sleep(0.01)
        snap = snapshot(proc.pid, ModuleCache())
        want = gdb_threads(proc.pid)
        assert snap.error is None and len(snap.threads) == 1
        th = snap.threads[0]
        assert th.stack is not None, th.error
        assert th.stack.complete, th.stack.reason
        g = want[th.tid]
        assert not g.truncated, g.stop_reason
        assert [f.pc for f in reversed(th.stack.frames)] == [f.pc for f in g.frames]
        names = [f.name for f in g.frames]
        assert names[:4] == ["leaf", "mid", "outer", "main"], names
        out, _ = proc.communicate("x")
        assert (out, proc.returncode) == ("rbp_restored: x\n", 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
