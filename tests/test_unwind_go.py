"""Unwind mode on a Go binary (tests/programs/gocalls.go, built with Debian's Go): a Go binary has
no ``.eh_frame``; its only CFI is ``.debug_frame``, which the Go linker writes compressed
(``SHF_COMPRESSED``, zlib).  ccprofd read that section's compressed bytes as CFI, refused the
table, and every Go chain stopped at its first frame (``no_table``).  Now the section is inflated
(``ccprofd/elf/compressed.py``) and Go chains are whole.  The oracle is gdb's own ``.debug_frame``
unwinder at ``catch syscall`` stops (tests/gdb_oracle.py), frame by frame."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any

import pytest
from binutils_oracle import parse_sections
from conftest import require_bpf, require_tool
from fidelity import compare
from strace_oracle import OracleError, Trace

REPO = pathlib.Path(__file__).resolve().parent.parent
SOURCE = REPO / "tests" / "programs" / "gocalls.go"
SLEEP_SOURCE = REPO / "tests" / "programs" / "gosleep.go"


def build_go(out_dir: pathlib.Path, *, pie: bool = False, source: pathlib.Path = SOURCE) -> pathlib.Path:
    """A Go program (gocalls.go unless ``source``) built with ``go build`` (a single file outside
    any module); ``pie``: ``-buildmode=pie`` (its function table is then ``.data.rel.ro.gopclntab``)."""
    go = require_tool("go")
    binary = out_dir / source.stem
    # its own build cache: go needs one, and a CI runner may have no $HOME to put the default in
    env = {**os.environ, "GO111MODULE": "off", "CGO_ENABLED": "0", "GOCACHE": str(out_dir / "gocache")}
    mode = ["-buildmode=pie"] if pie else []
    got = subprocess.run([go, "build", *mode, "-o", str(binary), str(source)], capture_output=True,
                         text=True, cwd=out_dir, env=env, timeout=600)
    assert got.returncode == 0, got.stderr
    return binary


def section_flags(binary: pathlib.Path) -> dict[str, str]:
    """Section name -> readelf's flag letters (independent of ccprofd's ELF reader)."""
    text = subprocess.run(["readelf", "-SW", str(binary)], capture_output=True, text=True, check=True).stdout
    return {s.name: s.flags for s in parse_sections(text)}


def gdb_trace(binary: pathlib.Path) -> Trace:
    """gdb's stacks of the program's getppid and write calls.  gdb sometimes fails its last
    ``continue`` with "Couldn't get registers: No such process" when the Go runtime's threads die
    in ``exit_group`` (1 run in 4 here): such a run is repeated.  (A run that lost syscalls another
    way would fail the comparison, never pass it.)"""
    from gdb_oracle import run_gdb

    for attempt in range(8):
        try:
            return run_gdb([str(binary)], ["getppid", "write"], timeout=600)[0]
        except OracleError as exc:
            if "No such process" not in str(exc) or attempt == 7:
                raise
    raise AssertionError("unreachable")


def trace_go(binary: pathlib.Path, syscalls: str, out_dir: pathlib.Path) -> list[dict[str, Any]]:
    """``ccprofd trace --mode unwind`` of the program: its JSONL records (the program's own output
    checked: it ran to its end)."""
    out = out_dir / "samples.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--format", "jsonl",
            "--syscalls", syscalls, "--output", str(out), "--", str(binary)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{binary.name}: done\n"
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.bpf
@pytest.mark.parametrize("variant", ["as-built", "stripped", "pie-stripped"])
def test_go_binary_chains_are_whole_and_gdbs(tmp_path: pathlib.Path, variant: str) -> None:
    """``stripped``: gdb runs the binary as built; then ``strip`` (as Debian strips its Go
    packages: no ``.symtab``, no ``.debug_frame``; the same addresses) and ccprofd traces that. The
    rows and names come from ``.gopclntab``; before, such a binary stopped after its first frame.
    ``pie-stripped``: the same for ``-buildmode=pie``, loaded at a random base."""
    require_bpf()
    require_tool("gdb")
    binary = build_go(tmp_path, pie=variant.startswith("pie"))
    flags = section_flags(binary)
    assert ".eh_frame" not in flags and "C" in flags[".debug_frame"], flags  # the case this test is about
    oracle = gdb_trace(binary)
    twin = None
    if variant.endswith("stripped"):
        twin = tmp_path / "gocalls.full"
        shutil.copy2(binary, twin)
        subprocess.run(["strip", str(binary)], check=True)
        assert ".debug_frame" not in section_flags(binary) and ".symtab" not in section_flags(binary)
    samples = trace_go(binary, "getppid,write", tmp_path)
    mine = [s for s in samples if s.get("syscall") == "getppid"]
    assert len(mine) == 4, samples
    assert all(s["complete"] for s in mine), mine
    # the program's design: main > mid > leaf x4 (3 recursions) > syscall.Getppid's stub, under
    # Go's runtime.main, from runtime.goexit (the goroutine's outermost frame); names from .symtab
    # (the linker's, with ".abi0" on assembly functions) or, stripped, from Go's own table
    names = [f["function"].removesuffix(".abi0") for f in mine[0]["frames"]]
    assert names == ["runtime.goexit", "runtime.main", "main.main", "main.mid", *["main.leaf"] * 4,
                     "syscall.rawSyscallNoError"], names
    # and gdb's: every frame's return address and function (gdb names Go's assembly functions
    # without the linker's ".abi0" suffix, so names are checked above, addresses here)
    result = compare(samples, oracle, binary, check_names=False, symbols_path=twin)
    assert result.ok, result.report()
    assert result.stats.incomplete_samples == 0


@pytest.mark.bpf
def test_go_runtime_chains_end_where_go_says_a_stack_ends(tmp_path: pathlib.Path) -> None:
    """Every syscall of the program, the Go runtime's threads included: a complete chain starts at
    a function Go marks as a stack's top (TOPFRAME in .gopclntab: ``runtime.goexit``, ``mstart``,
    ``rt0_go``), at ``runtime.mcall`` (the scheduler on g0: test_go_scheduler_chains_end_at_mcall_
    as_delves), or is a new thread's first syscall in ``runtime.clone``'s child, on the new stack.
    A chain through another stack switch (SPWRITE: ``systemstack``, ``morestack``, ...) ends at
    it, flagged ``unsupported_cfi``, with nothing of the other stack above it.  Before, such chains
    went on through whatever return address the system stack held (``runtime.newproc`` above
    ``systemstack``, as gdb shows it).  runtime.main starts sysmon through ``systemstack`` (its
    ``rt_sigprocmask`` and ``clone`` in ``newosproc``), so at least one such chain is certain, and
    sysmon's thread is a clone child."""
    require_bpf()
    from ccprofd.elf.gopclntab import FUNC_FLAG_SPWRITE, FUNC_FLAG_TOPFRAME, read_go_functions
    from ccprofd.elf.image import ElfImage

    binary = build_go(tmp_path)
    funcs = read_go_functions(ElfImage(str(binary)))
    tops = {f.name for f in funcs if f.flag & FUNC_FLAG_TOPFRAME}
    switches = {f.name for f in funcs if f.flag & FUNC_FLAG_SPWRITE} - tops
    assert {"runtime.goexit", "runtime.mstart"} <= tops
    assert {"runtime.systemstack", "runtime.mcall", "runtime.clone"} <= switches
    child_start = clone_child_start(binary)
    samples = [s for s in trace_go(binary, "all", tmp_path) if s.get("event") == "syscall"]
    through_switch = children = clones = 0
    for s in samples:
        names = [f["function"].removesuffix(".abi0") for f in s["frames"]]
        if names[-1:] == ["runtime.clone"] and int(s["frames"][-1]["call_site"], 16) >= child_start:
            # a new thread's first syscall (gettid), made on its new stack: nothing above it
            children += 1
            assert names == ["runtime.clone"] and s["complete"] and s["syscall"] == "gettid", s
            continue
        clones += s["syscall"] == "clone"
        if s["complete"]:
            assert names and (names[0] in tops or names[0] == "runtime.mcall"), s
        hit = [i for i, n in enumerate(names[:-1]) if n in switches]  # a switch below the innermost frame
        if hit and names[0] == "runtime.mcall":
            assert hit == [0] and s["complete"], s
        elif hit:
            through_switch += 1
            assert hit == [0] and not s["complete"] and s["reason"] == "unsupported_cfi", s
    assert through_switch >= 1
    # the threads the runtime made, seen starting (one may be killed by exit_group before its first)
    assert 1 <= children <= clones, (children, clones)
    newm = [s for s in samples if s["syscall"] == "rt_sigprocmask"
            and [f["function"].removesuffix(".abi0") for f in s["frames"]][:3] ==
            ["runtime.systemstack", "runtime.main.func1", "runtime.newm"]]
    assert newm, "runtime.main's systemstack(newm(sysmon)) was not seen ending at the switch"


def clone_child_start(binary: pathlib.Path) -> int:
    """The address after ``runtime.clone``'s ``mov %rsi,%rsp`` (objdump: the child moving onto the
    stack newosproc gave it), where the child's code on the new stack starts."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "--disassemble=runtime.clone.abi0",
                           str(binary)], capture_output=True, text=True, check=True).stdout
    insns = [line.split("\t") for line in text.splitlines() if line.startswith("  ") and ":\t" in line]
    for i, insn in enumerate(insns[:-1]):
        if len(insn) >= 2 and insn[1].split() == ["mov", "%rsi,%rsp"]:
            return int(insns[i + 1][0].strip().rstrip(":"), 16)
    raise AssertionError(f"no mov %rsi,%rsp in runtime.clone:\n{text}")


def delve_stacks(binary: pathlib.Path, function: str, hits: int) -> list[list[tuple[str, int]]]:
    """Delve's stacks (function, pc) at the first ``hits`` calls of ``function``, innermost first
    (Delve, Go's debugger, unwinds with the binary's DWARF and Go's own rules for its stacks)."""
    dlv = require_tool("dlv")
    script = binary.parent / "dlv.init"
    script.write_text(f"break {function}\n" + "continue\nstack 64\n" * hits + "exit\n")
    proc = subprocess.run([dlv, "exec", str(binary), "--init", str(script),
                           "--allow-non-terminal-interactive=true"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600, cwd=binary.parent)
    stacks: list[list[tuple[str, int]]] = []
    for line in proc.stdout.splitlines():
        m = re.match(r"^\s*(\d+)\s+0x([0-9a-f]+) in (\S+)$", line)
        if m:
            if m.group(1) == "0":
                stacks.append([])
            stacks[-1].append((m.group(3), int(m.group(2), 16)))
    assert stacks, proc.stdout + proc.stderr
    return stacks


@pytest.mark.bpf
def test_go_scheduler_chains_end_at_mcall_as_delves(tmp_path: pathlib.Path) -> None:
    """The Go scheduler's waits are made on a thread's g0 stack, below ``runtime.mcall``: a parked
    goroutine's ``mcall(park_m)`` moved onto g0 at its base, where nothing of the thread's lies
    above.  Delve, Go's debugger, ends such a stack at ``mcall`` as at ``goexit`` (its "top of stack"
    functions), and so does ccprofd now, complete.  Before, the chain was flagged there
    (``unsupported_cfi``), so anomaly detection on a Go service raised ``incomplete_context`` on
    every scheduler wait.  gosleep.go locks main to its thread and sleeps five times: a sleep
    waits in ``stoplockedm``.  The oracle is Delve's stack at ``runtime.stoplockedm`` (another run:
    the program is deterministic there), frame by frame: function and return address."""
    require_bpf()
    binary = build_go(tmp_path, source=SLEEP_SOURCE)
    oracle = [st for st in delve_stacks(binary, "runtime.stoplockedm", 3)
              if "runtime.park_m" in [fn for fn, _ in st]]
    assert oracle, "Delve never stopped in stoplockedm under park_m"
    for st in oracle:  # Delve's stack ends at mcall, the frames below it on g0
        assert [fn for fn, _ in st] == ["runtime.stoplockedm", "runtime.schedule", "runtime.park_m",
                                        "runtime.mcall"], st
    expect = [(fn, pc) for fn, pc in reversed(oracle[0][1:])]  # mcall, park_m, schedule: return addresses
    samples = [s for s in trace_go(binary, "futex", tmp_path) if s.get("event") == "syscall"]
    # (a wait can also come from a preemption, morestack > newstack > gopreempt_m > ... > stoplockedm:
    # that chain goes on above morestack on the goroutine's stack, and is flagged at the switch)
    waits = [s for s in samples if [f["function"] for f in s["frames"][1:4]] ==
             ["runtime.park_m", "runtime.schedule", "runtime.stoplockedm"]]
    # a sleep whose timer already fired finds its note woken and makes no futex call: not every sleep
    assert waits, samples
    assert all(s["complete"] for s in samples if "runtime.park_m" in [f["function"] for f in s["frames"]])
    for s in waits:
        assert s["complete"], json.dumps(s)
        frames = s["frames"]
        got = [(f["function"], int(f["return_address"], 16)) for f in frames[:3]]
        assert got == expect and frames[3]["function"] == "runtime.stoplockedm", (got, expect, s)


def ccprofd_anomaly(verb: str, model: pathlib.Path, binary: pathlib.Path, *extra: str,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ccprofd learn`` or ``detect`` of the program's getppid and write calls, checked: it ran."""
    argv = [sys.executable, "-m", "ccprofd.cli", verb, "--model", str(model), "--syscalls",
            "getppid,write", *extra, "--", str(binary)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL,
                          timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == 0 and proc.stdout == f"{binary.name}: done\n", proc.stderr
    return proc


@pytest.mark.bpf
def test_anomaly_models_key_a_go_binary_by_its_go_build_id(tmp_path: pathlib.Path) -> None:
    """Go's own linker (every ``CGO_ENABLED=0`` build, as most Go release binaries) writes no GNU
    build-id note, only a Go build ID, and ``ccprofd learn``/``detect`` refused such a binary (models
    are keyed by build-id).  Its build-id is now the SHA-1 of that Go build ID; the oracle is ``go
    tool buildid``.  Learned once, a second run raises nothing, and a run that takes a path the model
    never saw (``GOCALLS_EXTRA``: getppid from ``main.extra``) raises exactly that."""
    require_bpf()
    go = require_tool("go")
    binary = build_go(tmp_path)
    notes = subprocess.run(["readelf", "-n", str(binary)], capture_output=True, text=True, check=True).stdout
    assert "NT_GNU_BUILD_ID" not in notes and "GO BUILDID" in notes, notes  # the case this test is about
    go_id = subprocess.run([go, "tool", "buildid", str(binary)], capture_output=True, text=True,
                           check=True).stdout.strip()
    expect = hashlib.sha1(go_id.encode()).hexdigest()
    model = tmp_path / "model.json"
    ccprofd_anomaly("learn", model, binary)
    targets = json.loads(model.read_text())["targets"]
    assert [t["build_id"] for t in targets] == [expect]
    assert sum(c["count"] for c in targets[0]["contexts"]) == 5  # 4 getppid, 1 write
    quiet, extra = tmp_path / "quiet.jsonl", tmp_path / "extra.jsonl"
    ccprofd_anomaly("detect", model, binary, "--output", str(quiet))
    assert quiet.read_text() == ""
    ccprofd_anomaly("detect", model, binary, "--output", str(extra), env={"GOCALLS_EXTRA": "1"})
    alerts = [json.loads(line) for line in extra.read_text().splitlines()]
    got = [(a["kind"], a["syscall"], a["build_id"]) for a in alerts]
    assert got == [("unseen_context", "getppid", expect)], alerts
    names = [f["function"].removesuffix(".abi0") for f in alerts[0]["frames"]]
    assert names == ["runtime.goexit", "runtime.main", "main.main", "main.extra", "syscall.rawSyscallNoError"]
