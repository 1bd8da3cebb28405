"""Unwinding through the vDSO (unwind mode): the kernel maps a complete ELF image, ``[vdso]``, into
every process, with no file behind it; ccprofd reads it from the process's memory and unwinds
through its own ``.eh_frame`` like any other module.

Two ways a sample's pc lies in the vDSO (tests/programs/vdso_loop.c):

* a syscall the vDSO makes itself: ``clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`` has no vDSO fast
  path, so the vDSO's fallback executes ``syscall`` (strace -k shows ``[vdso]`` as the innermost
  frame, checked first).  Every such sample must be complete and equal, frame by frame, to what gdb
  unwinds at the same syscall;
* a CPU-clock sample (``--sample-hz``) landing in ``clock_gettime``/``gettimeofday``, which answer
  inside the vDSO: every such sample must be complete, and the chain above the vDSO frame must be
  the program's known one, its return addresses those objdump shows after the calls.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
from binutils_oracle import oracle
from conftest import require_bpf, require_tool, skip_or_fail
from fidelity import compare
from programs.build import build
from strace_oracle import elf_layout

REPO = pathlib.Path(__file__).resolve().parent.parent
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


def trace(argv: list[str], tmp: pathlib.Path, syscalls: str, *extra: str,
          env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    out = tmp / "samples.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind",
                           "--format", "jsonl", "--syscalls", syscalls, "--output", str(out), *extra,
                           "--", *argv],
                          capture_output=True, text=True, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def hexint(v: Any) -> int | None:
    return None if v is None else int(v, 16) if isinstance(v, str) else int(v)


def vdso_syscall_is_observable(prog: str) -> bool:
    """strace -k's innermost frame of the vDSO's own clock_gettime syscall is ``[vdso]``."""
    proc = subprocess.run(["strace", "-qq", "-k", "-e", "trace=clock_gettime", "--", prog, "10"],
                          capture_output=True, text=True)
    lines = proc.stderr.splitlines()
    firsts = [lines[i + 1] for i, ln in enumerate(lines[:-1]) if ln.startswith("clock_gettime(")]
    return bool(firsts) and all(ln.strip().startswith("> [vdso]") for ln in firsts)


@pytest.mark.bpf
def test_syscall_made_by_the_vdso_matches_gdb(tmp_path: pathlib.Path) -> None:
    require_bpf()
    require_tool("strace")
    require_tool("gdb")
    from gdb_oracle import run_gdb

    binary = build("vdso_loop", opt="O2")
    cmd = [str(binary), "1000"]
    if not vdso_syscall_is_observable(str(binary)):
        skip_or_fail("this kernel's vDSO answers clock_gettime(CLOCK_PROCESS_CPUTIME_ID) without a syscall")
    samples = trace(cmd, tmp_path, "clock_gettime,write")
    clock = [s for s in samples if s["syscall"] == "clock_gettime"]
    assert len(clock) == 50 and all(s["complete"] for s in samples), [s for s in samples if not s["complete"]]

    gdb, _ = run_gdb(cmd, ["clock_gettime", "write"], timeout=600)
    # the binary's frames (function, call site, return address), sample by sample
    result = compare(samples, gdb, binary)
    assert result.ok, result.report()
    # and the frames below them: libc's clock_gettime, then the vDSO function that made the syscall
    [task] = gdb.tasks
    libc = elf_layout(LIBC)
    for sample, want in zip(clock, [s for s in task.syscalls if s.name == "clock_gettime"], strict=True):
        vdso, in_libc = want.frames[0], want.frames[1]
        assert vdso.module == "[vdso]" and in_libc.module == LIBC
        lib, inner = sample["frames"][-2:]
        assert (inner["module"], inner["function"], inner["analysed"]) == ("[vdso]", vdso.function, False)
        assert inner["return_address"] is None  # the innermost pc: the instruction after `syscall`
        assert (lib["module"], lib["analysed"]) == (LIBC, False)
        assert hexint(lib["return_address"]) == libc.vaddr_of_offset(in_libc.offset)
        assert [f["function"] for f in sample["frames"][:2]] == ["main", "cpu_clock_calls"]


def _call_ending_at(lib: str, ret: int) -> str:
    """objdump's text of the instruction that ends at ``ret`` in ``lib`` (a call, for a return address)."""
    out = subprocess.run(["objdump", "-d", "-w", f"--start-address={ret - 16:#x}", f"--stop-address={ret:#x}",
                          lib], capture_output=True, text=True, check=True).stdout
    insns = [ln for ln in out.splitlines() if re.match(r"^\s+[0-9a-f]+:\t", ln)]
    ends = {int(ln.split(":")[0], 16) + len(ln.split("\t")[1].split()): ln for ln in insns}
    return ends.get(ret, "")


@pytest.mark.bpf
def test_cpu_samples_in_the_vdso_are_complete_and_exact(tmp_path: pathlib.Path) -> None:
    require_bpf()
    require_tool("objdump")
    require_tool("readelf")
    binary = build("vdso_loop", opt="O2")
    cache = tmp_path / "cache"  # cold: the vDSO image is read, its table built and cached
    env = {**os.environ, "CCPROFD_CACHE_DIR": str(cache)}
    samples = trace([str(binary), "3000000"], tmp_path, "write", "--sample-hz", "997", env=env)
    cpu = [s for s in samples if s["event"] == "cpu"]
    assert all("args" not in s for s in cpu)
    in_vdso = [s for s in cpu if s["frames"] and s["frames"][-1]["module"] == "[vdso]"]
    assert len(in_vdso) >= 20, f"{len(in_vdso)} of {len(cpu)} CPU samples in the vDSO"
    assert all(s["complete"] for s in in_vdso), [s for s in in_vdso if not s["complete"]]

    orc = oracle(binary)
    by_name = {sym.value: sym.name for sym in orc.symbols if sym.type == "FUNC"}

    def ret_after(caller: str, callee: str) -> set[int]:
        return {s.return_address for s in orc.sites
                if by_name.get(s.function) == caller and s.target_name == callee}

    libc_calls = set()
    images = list((cache / "vdso").glob("*.so"))
    assert len(images) == 1
    build_id = re.search(r"Build ID: ([0-9a-f]+)", subprocess.run(
        ["readelf", "-n", str(images[0])], capture_output=True, text=True, check=True).stdout)
    assert build_id
    for s in in_vdso:
        frames = s["frames"]
        analysed = [f for f in frames if f["analysed"]]
        loop = analysed[1]["function"]
        # cpu_clock_calls' clock_gettime runs in the vDSO too (then makes the syscall from there):
        # rarer, but a CPU sample may land in it
        assert [f["function"] for f in analysed] == ["main", loop]
        assert loop in ("spin_monotonic", "spin_tod", "cpu_clock_calls")
        assert frames[: len(analysed)] == analysed  # the program's frames, then the libraries'
        assert hexint(analysed[0]["return_address"]) in ret_after("main", loop)
        vdso = frames[-1]
        assert vdso["build_id"] == build_id.group(1) and vdso["return_address"] is None
        if loop == "spin_tod":
            # glibc's gettimeofday is an IFUNC resolved to the vDSO's: the PLT jumps straight in
            assert len(frames) == 3 and vdso["function"] == "gettimeofday"
            assert hexint(analysed[1]["return_address"]) in ret_after("spin_tod", "gettimeofday")
        else:
            lib = frames[2]
            assert len(frames) == 4 and vdso["function"] == "clock_gettime"
            assert (lib["module"], lib["function"]) == (LIBC, "clock_gettime")
            assert hexint(analysed[1]["return_address"]) in ret_after(loop, "clock_gettime")
            libc_calls.add(hexint(lib["return_address"]))
    # libc's frame returns right after its (indirect) call into the vDSO
    for ret in libc_calls:
        assert ret is not None and "call" in _call_ending_at(LIBC, ret), hex(ret or 0)
    loops = {s["frames"][1]["function"] for s in in_vdso}
    assert loops - {"cpu_clock_calls"} == {"spin_monotonic", "spin_tod"}
