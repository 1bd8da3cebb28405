"""Code without CFI: unwind mode falls back to frame pointers, and is exact or says it is not.

The frame-pointer rule (``CFA = rbp + 16``) is right only where the function has set rbp up.  Two
ways it goes wrong, both once reported as complete contexts with a frame missing:

* at an exact pc (a CPU sample) in a function that has not set rbp up -- a leaf gcc builds without
  a frame even under ``-fno-omit-frame-pointer``, or any prologue/epilogue -- rbp is the caller's,
  so the walk skipped the caller: now such a frame is never walked by frame pointer (``no_cfi``);
* at a return address in a function built without frame pointers, rbp is still its caller's:
  the walk skips the caller.  The decoder now checks each direct call of the chain reaches the
  next frame (``frame_skipped`` otherwise).

Oracle: objdump's direct call instructions (site -> target function) for every pair of frames a
complete context reports, and the source's call structure.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import direct_call_sites
from conftest import require_bpf, require_tool
from daemon_fakes import wait_for

REPO = Path(__file__).resolve().parent.parent
NO_CFI = ("-fno-asynchronous-unwind-tables", "-fno-unwind-tables")

LEAF_LOOP = r"""
#include <stdlib.h>
#include <unistd.h>
volatile long sink;
__attribute__((noinline)) long leaf(long n) { sink += n; return n ^ 3; }
__attribute__((noinline)) long mid(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += leaf(i);
    return s;
}
__attribute__((noinline)) long top(long n) { return mid(n) * 2 + getppid(); }
int main(int argc, char **argv) { return (int)(top(atol(argv[1])) & 1); }
"""

# f has no frame pointer and no CFI; g and main keep frame pointers (no CFI either)
WITHOUT_FP = r"""
#include <unistd.h>
__attribute__((noinline)) long f(long n) { long r = getppid(); return r * n + 1; }
"""
WITH_FP = r"""
long f(long n);
__attribute__((noinline)) long g(long n) { return f(n) + 1; }
int main(int argc, char **argv) { return (int)(g(argc + 1) & 1); }
"""


def gcc(tmp: Path, out: str, *units: tuple[str, str, tuple[str, ...]]) -> Path:
    objs = []
    for name, source, flags in units:
        (tmp / f"{name}.c").write_text(source)
        obj = tmp / f"{name}.o"
        subprocess.run([require_tool("gcc"), "-O2", *NO_CFI, *flags, "-c", "-o", str(obj),
                        str(tmp / f"{name}.c")], check=True)
        objs.append(str(obj))
    binary = tmp / out
    subprocess.run([require_tool("gcc"), "-o", str(binary), *objs], check=True)
    out_sections = subprocess.run([require_tool("readelf"), "-SW", str(binary)], capture_output=True,
                                  text=True, check=True).stdout
    # the binary's own functions have no FDE (crt files may bring a small .eh_frame of their own)
    assert ".debug_frame" not in out_sections
    return binary


def direct_calls(binary: Path) -> dict[int, str]:
    """Call-instruction address -> what it calls, per objdump (bpf_helpers.direct_call_sites)."""
    return {c.vaddr: c.target for c in direct_call_sites(binary)}


def trace(binary: Path, tmp: Path, *args: str, extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    out = tmp / f"{binary.name}.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--format", "jsonl", *extra,
            "--syscalls", "getppid", "--output", str(out), "--", str(binary), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600, env=dict(os.environ))
    assert proc.returncode in (0, 1), proc.stderr  # the programs' own status is 0 or 1
    return [json.loads(line) for line in out.read_text().splitlines()]


def chain_is_direct_calls(sample: dict[str, Any], binary: Path, calls: dict[int, str]) -> bool:
    """Each frame of the binary calls the next one at its call site (objdump), where that call is direct."""
    own = [f for f in sample["frames"] if f["module"] == str(binary)]
    for a, b in itertools.pairwise(own):
        site = int(a["call_site"], 16) if a["call_site"] else None
        if site in calls and calls[site] != b["function"]:
            return False
    return True


def test_cpu_samples_in_a_frameless_leaf_are_flagged_not_walked(tmp_path: Path) -> None:
    """leaf sets up no frame (objdump: no push %rbp), so rbp inside it is mid's: its CPU samples
    are ``no_cfi``; before, they came out complete as main > top > leaf, without mid."""
    require_bpf()
    binary = gcc(tmp_path, "leafloop", ("leafloop", LEAF_LOOP, ("-fno-omit-frame-pointer",)))
    dis = subprocess.run([require_tool("objdump"), "-d", "--no-show-raw-insn", str(binary)],
                         capture_output=True, text=True, check=True).stdout
    leaf_body = dis.split("<leaf>:\n", 1)[1].split("\n\n", 1)[0]
    assert "push" not in leaf_body, leaf_body  # the premise: a leaf without a frame
    samples = trace(binary, tmp_path, "200000000", extra=("--sample-hz", "499"))
    cpu = [s for s in samples if s["event"] == "cpu"]
    in_leaf = [s for s in cpu if s["frames"] and s["frames"][-1]["function"] == "leaf"]
    assert len(in_leaf) >= 10, len(cpu)
    assert all(not s["complete"] and s["reason"] == "no_cfi" for s in in_leaf), in_leaf[:3]
    calls = direct_calls(binary)
    complete = [s for s in cpu if s["complete"]]
    assert all(chain_is_direct_calls(s, binary, calls) for s in complete), complete[:3]
    # at a return address the frame-pointer rule still serves: the getppid call from top
    (sys,) = [s for s in samples if s["event"] == "syscall"]
    assert sys["complete"], sys
    assert [f["function"] for f in sys["frames"] if f["analysed"]] == ["main", "top"], sys["frames"]
    assert chain_is_direct_calls(sys, binary, calls)


def test_a_caller_skipped_by_the_frame_pointer_walk_is_flagged(tmp_path: Path) -> None:
    """f keeps no frame pointer, so at its call to getppid rbp is still g's: the walk from f goes
    to main's frame and g is missing.  main's call (objdump) is to g, which does not tail-jump to
    f, so the context is flagged ``frame_skipped``."""
    require_bpf()
    binary = gcc(tmp_path, "mixed", ("nofp", WITHOUT_FP, ("-fomit-frame-pointer",)),
                 ("fp", WITH_FP, ("-fno-omit-frame-pointer",)))
    calls = direct_calls(binary)
    samples = trace(binary, tmp_path)
    (s,) = [s for s in samples if s.get("syscall") == "getppid"]
    names = [f["function"] for f in s["frames"] if f["analysed"]]
    assert not s["complete"] and s["reason"] == "frame_skipped", s
    assert names == ["main", "f"], names  # what the walk found: main's call is to g, per objdump
    assert calls[int(s["frames"][0]["call_site"], 16)] == "g"


@pytest.mark.parametrize("opt", ["-O0", "-O2"])
def test_frame_pointers_without_cfi_give_whole_chains(tmp_path: Path, opt: str) -> None:
    """Every function keeps a frame pointer (-O0 even the leaves): syscall samples from libc are
    complete, each call in the chain a direct call to the next frame (objdump)."""
    require_bpf()
    source = LEAF_LOOP.replace("sink += n; return n ^ 3;", "sink += n; return n ^ getppid();")
    binary = gcc(tmp_path, "fpchain", ("fpchain", source, (opt, "-fno-omit-frame-pointer")))
    calls = direct_calls(binary)
    samples = [s for s in trace(binary, tmp_path, "3") if s.get("syscall") == "getppid"]
    assert len(samples) == 4
    assert all(s["complete"] and chain_is_direct_calls(s, binary, calls) for s in samples), samples
    chains = sorted(tuple(f["function"] for f in s["frames"] if f["analysed"]) for s in samples)
    assert chains == [("main", "top")] + [("main", "top", "mid", "leaf")] * 3, chains


BLOCKING_WITHOUT_FP = r"""
#include <unistd.h>
__attribute__((noinline)) long f(long n) { char c; long r = read(0, &c, 1); return r * n + 1; }
"""


def test_a_thread_snapshot_flags_the_same_skip(tmp_path: Path) -> None:
    """GetThreadContexts' snapshot (ptrace stop, the same rules in Python) of a thread blocked in
    f's read: the walk gives main > f, and main's call (objdump) is to g, so it is flagged too."""
    from ccprofd.tracing.threadcontexts import ContextReader

    binary = gcc(tmp_path, "blocking", ("nofp", BLOCKING_WITHOUT_FP, ("-fomit-frame-pointer",)),
                 ("fp", WITH_FP, ("-fno-omit-frame-pointer",)))
    calls = direct_calls(binary)
    proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE)
    try:
        def in_read() -> bool:  # blocked in read(2), syscall 0, on the pipe
            try:
                return Path(f"/proc/{proc.pid}/syscall").read_text().split()[0] == "0"
            except (OSError, IndexError):
                return False

        wait_for(in_read, timeout=60, what="the program blocked in read")
        snap = ContextReader(str(binary), cache_dir=str(tmp_path / "cache")).read(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert snap["error"] is None, snap
    (th,) = snap["threads"]
    names = [f["function"] for f in th["frames"] if f["analysed"]]
    assert names == ["main", "f"], th
    assert calls[int(th["frames"][0]["call_site"], 16)] == "g"
    assert not th["complete"] and th["reason"] == "frame_skipped", th
