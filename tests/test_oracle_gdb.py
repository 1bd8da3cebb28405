"""Checks of the gdb oracle (``tests/gdb_oracle.py``): it agrees with strace where strace can see,
and goes on where strace stops (256 frames).  No ccprofd here.

* Same programs, same syscalls: gdb and strace give the same tasks in the same creation order and,
  syscall by syscall, the same frames of the binary (functions, vaddrs, kinds) -- threads, signal
  handlers interrupting the binary on the normal stack and on a sigaltstack, C++ exceptions, longjmp,
  callbacks from qsort, tail calls at -O2 (gdb's synthesised tail-call frames are dropped).
* Deep recursion (depth 1,000: 1,001 ``fact`` frames, 2,001 is_even/is_odd, 3,003 ring frames):
  gdb's stacks are complete and have exactly the hand-derived shape; strace's are cut at 256 frames
  and flagged truncated, and what it has is the innermost part of gdb's stack.  ``compare`` against
  strace cannot tell a sample that lost an outer recursion frame from a correct one; against gdb it can.
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
from conftest import require_tool
from fidelity import compare, samples_from_oracle
from gdb_oracle import run_gdb
from programs.build import build as build_program
from strace_oracle import STRACE_MAX_FRAMES, TargetFrame, analysed_syscalls, run_strace, target_frames


def _build(name: str, **variant: Any) -> pathlib.Path:
    """tests/programs/build.py's build(), typed for this file."""
    return pathlib.Path(build_program(name, **variant))


@pytest.fixture(autouse=True)
def _tools() -> None:
    require_tool("gdb")
    require_tool("strace")


def chain(frames: list[TargetFrame]) -> list[str | None]:
    return [f.function for f in reversed(frames) if f.function != "_start"]


CASES = [
    ("calls", [], ["write", "getppid", "openat"]),
    ("threads", ["4"], ["write", "getppid"]),
    ("sigframes", [], ["write", "getppid"]),
    ("sighandler", [], ["write", "getppid"]),
    ("exceptions", ["4"], ["write", "getppid"]),
    ("longjmp", ["4"], ["write", "getppid"]),
    ("fptr", [], ["write", "getppid"]),
    ("tailcall", [], ["write", "getppid"]),
]


@pytest.mark.parametrize("pie", [True, False], ids=["pie", "nopie"])
@pytest.mark.parametrize("name,args,syscalls", CASES, ids=[c[0] for c in CASES])
def test_gdb_agrees_with_strace(name: str, args: list[str], syscalls: list[str], pie: bool) -> None:
    binary = _build(name, opt="O2", pie=pie)
    s = run_strace([str(binary), *args], syscalls)
    g, run = run_gdb([str(binary), *args], syscalls, timeout=300)
    assert g.exit_status == s.exit_status == 0
    assert run.entry_check_failures == 0
    assert len(g.tasks) == len(s.tasks)
    compared = 0
    for gt, st in zip(g.tasks, s.tasks, strict=True):
        assert (gt.pid == g.tasks[0].pid) == (st.pid == s.tasks[0].pid)  # same process structure
        gs, ss = analysed_syscalls(gt, binary), analysed_syscalls(st, binary)
        assert [x.name for x in gs] == [x.name for x in ss]
        for a, b in zip(gs, ss, strict=True):
            fa, fb = target_frames(a.frames, binary), target_frames(b.frames, binary)
            assert [(f.function, f.pc, f.kind) for f in fa] == [(f.function, f.pc, f.kind) for f in fb]
            assert not a.truncated and not b.truncated
            compared += len(fa)
    assert compared > 0


@pytest.mark.parametrize("opt", ["O0", "O2"])
def test_deep_recursion_beyond_strace(opt: str) -> None:
    n = 1000
    binary = _build("recursion", opt=opt, pie=True)
    syscalls = ["getppid", "openat", "write"]
    g, _ = run_gdb([str(binary), str(n)], syscalls, timeout=600)
    s = run_strace([str(binary), str(n)], syscalls)
    gs = [x for x in analysed_syscalls(g.tasks[0], binary) if target_frames(x.frames, binary)]
    ss = [x for x in analysed_syscalls(s.tasks[0], binary) if target_frames(x.frames, binary)]
    assert [x.name for x in gs] == [x.name for x in ss]
    shapes = {
        "getppid": ["main"] + ["fact"] * (n + 1),
        "openat": ["main"] + ["ring_a", "ring_b", "ring_c"] * (n + 1),
    }
    deep = 0
    for a, b in zip(gs, ss, strict=True):
        fa, fb = target_frames(a.frames, binary), target_frames(b.frames, binary)
        assert not a.truncated
        if a.name in shapes:
            assert chain(fa) == shapes[a.name]
        if a.name == "write" and "even" in a.args:
            assert chain(fa) == ["main"] + ["is_even", "is_odd"] * n + ["is_even", "report"]
        if len(a.frames) > STRACE_MAX_FRAMES:
            deep += 1
            assert b.truncated and len(b.frames) == STRACE_MAX_FRAMES
        # strace's frames are the innermost part of gdb's
        assert [(f.function, f.pc) for f in fa[:len(fb)]] == [(f.function, f.pc) for f in fb]
    assert deep == 3  # fact, is_even (write), ring (openat)

    samples = samples_from_oracle(g, binary)
    compare(samples, g, binary).assert_ok()
    ok_vs_strace = compare(samples, s, binary)
    ok_vs_strace.assert_ok()
    assert ok_vs_strace.stats.oracle_truncated == 3
    # One outer recursion frame lost: strace (256 innermost frames) cannot see it, gdb can.
    lost = copy.deepcopy(samples)
    deep_sample = next(x for x in lost if x["syscall"] == "getppid")
    del deep_sample["frames"][1]
    compare(lost, s, binary).assert_ok()
    bad = compare(lost, g, binary)
    assert not bad.ok and {m.kind for m in bad.mismatches} == {"frames"}


def test_gdb_oracle_on_a_stripped_binary() -> None:
    twin = _build("threads", opt="O2", pie=False)
    stripped = _build("threads", opt="O2", pie=False, strip=True)
    g, _ = run_gdb([str(stripped), "3"], ["getppid", "write"], timeout=300)
    a = analysed_syscalls(g.tasks[1], stripped)
    assert [x.name for x in a] == ["getppid"]
    assert chain(target_frames(a[0].frames, stripped, symbols_path=twin)) == ["worker_a"] + ["down_a"] * 4
    assert pathlib.Path(a[0].frames[1].module or "").name == stripped.name
