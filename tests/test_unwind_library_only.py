"""Unwind mode's contexts without a frame of the binary: the dynamic loader's syscalls before the
entry point, the library constructors it runs, and the exit flush after ``main`` returned.  Their
frames are the library frames (before: ``frames: []``, ``complete: true``, where a debugger shows
``_dl_start`` ... ``openat``), checked frame by frame against ``strace -f -k`` of the same command:
the same modules in the same order, every return address equal, the syscall's own function the
one holding strace's pc (nm of the object and of its libc6-dbg debug file; binutils only).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_bpf
from fidelity import same_file
from library_oracle import object_symbols, strace_vaddrs
from programs.build import build
from strace_oracle import Syscall, run_strace

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSCALLS = ["openat", "mmap", "write", "close"]


def _trace(argv: list[str], out: pathlib.Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--verify", "--format", "jsonl",
           "--syscalls", ",".join(SYSCALLS), "--output", str(out), "--", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "0 mismatches" in proc.stderr, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def _oracle_frames(sc: Syscall) -> list[tuple[str, int]]:
    """(module, vaddr) innermost first: the syscall's pc, then return addresses."""
    out = []
    for module, vaddr in strace_vaddrs(sc.frames):
        assert module is not None and vaddr is not None, sc
        out.append((module, vaddr))
    return out


@pytest.mark.bpf
def test_library_only_contexts_are_the_library_frames_strace_sees(tmp_path: pathlib.Path) -> None:
    require_bpf()
    binary = str(build("calls", opt="O2"))
    samples = [s for s in _trace([binary], tmp_path / "out.jsonl") if s.get("event") == "syscall"]
    oracle = run_strace([binary], SYSCALLS)
    theirs = [sc for sc in oracle.tasks[0].syscalls if sc.name in oracle.requested]
    samples.sort(key=lambda s: int(s["time_ns"]))
    assert [s["syscall"] for s in samples] == [sc.name for sc in theirs]
    library_only = 0
    for ordinal, (mine, sc) in enumerate(zip(samples, theirs, strict=True)):
        if any(f["analysed"] for f in mine["frames"]):
            continue  # a context of the binary's own code: the other unwind tests' subject
        want = _oracle_frames(sc)
        where = f"syscall #{ordinal} {sc.name}"
        # strace's stack holds no frame of the binary but its entry function (`_start`, under exit's
        # flush), which is above a context's root: not reported, here as in every context
        while want and same_file(want[-1][0], binary):
            want.pop()
        assert all(not same_file(m, binary) for m, _ in want), where
        assert mine["complete"] and not sc.truncated, where
        got = list(reversed(mine["frames"]))  # innermost first, as strace
        assert not any(f["analysed"] for f in got), where
        assert [os.path.realpath(f["module"]) for f in got] == [m for m, _ in want], where
        # the syscall's own frame: its pc, which strace prints and the JSON does not; its function
        inner_module, inner_pc = want[0]
        assert got[0]["return_address"] is None, where
        verdict = object_symbols(inner_module).agrees(inner_pc, str(got[0]["function"]))
        assert verdict is not False, (where, got[0]["function"], hex(inner_pc))
        # every outer frame: the return address strace unwound to, exactly
        assert [int(f["return_address"], 16) for f in got[1:]] == [v for _, v in want[1:]], where
        library_only += 1
    # the loader's opens and maps of ld.so.cache and libc, and exit's flush of "calls: start"
    assert library_only >= 5, library_only
    first = samples[0]
    assert first["syscall"] in ("mmap", "openat") and "ld-linux" in first["frames"][0]["module"]
    last = samples[-1]["frames"]
    assert samples[-1]["syscall"] == "write" and last[-2]["function"] == "_IO_file_write"
    assert last[0]["function"] == "__libc_start_main" and "libc.so" in last[0]["module"]
