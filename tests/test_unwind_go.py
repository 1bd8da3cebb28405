"""Unwind mode on a Go binary (tests/programs/gocalls.go, built with Debian's Go): a Go binary has
no ``.eh_frame``; its only CFI is ``.debug_frame``, which the Go linker writes compressed
(``SHF_COMPRESSED``, zlib).  ccprofd read that section's compressed bytes as CFI, refused the
table, and every Go chain stopped at its first frame (``no_table``).  Now the section is inflated
(``ccprofd/elf/compressed.py``) and Go chains are whole.  The oracle is gdb's own ``.debug_frame``
unwinder at ``catch syscall`` stops (tests/gdb_oracle.py), frame by frame."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest
from binutils_oracle import Insn, nm_defined_sizes, parse_objdump, parse_sections
from conftest import require_bpf, require_tool
from fidelity import compare
from strace_oracle import OracleError, Trace

REPO = pathlib.Path(__file__).resolve().parent.parent
SOURCE = REPO / "tests" / "programs" / "gocalls.go"
SLEEP_SOURCE = REPO / "tests" / "programs" / "gosleep.go"
STW_SOURCE = REPO / "tests" / "programs" / "gostw.go"
CGO_SOURCE = REPO / "tests" / "programs" / "gocgo.go"
GROW_SOURCE = REPO / "tests" / "programs" / "gogrow.go"
TIME_SOURCE = REPO / "tests" / "programs" / "gotime.go"


def build_go(out_dir: pathlib.Path, *, pie: bool = False, source: pathlib.Path = SOURCE,
             cgo: bool = False) -> pathlib.Path:
    """A Go program (gocalls.go unless ``source``) built with ``go build`` (a single file outside
    any module); ``pie``: ``-buildmode=pie`` (its function table is then ``.data.rel.ro.gopclntab``);
    ``cgo``: with cgo (gcc; linked by the system linker, as Debian's Go packages are)."""
    go = require_tool("go")
    binary = out_dir / source.stem
    # its own build cache: go needs one, and a CI runner may have no $HOME to put the default in
    env = {**os.environ, "GO111MODULE": "off", "CGO_ENABLED": "1" if cgo else "0",
           "GOCACHE": str(out_dir / "gocache")}
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
    assert proc.stdout.endswith(f"{binary.name}: done\n"), proc.stdout  # (gostw says "gc" first)
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
    A chain through ``systemstack`` crosses from g0 onto the goroutine that called it (its
    ``m.curg.sched``; test_go_systemstack_crossing_as_delves): the goroutine's frame above it must
    be at a call of ``runtime.systemstack`` (objdump); one through ``morestack`` goes on at the
    goroutine that grew its stack (at a call of ``morestack`` or ``morestack_noctxt``), or, when
    it passed Go's scheduler (a preempted growth), starts complete at ``morestack``
    (test_go_stack_growth_crosses_morestack).  A chain through another stack switch (SPWRITE:
    ``asmcgocall``, ...) ends at it, flagged ``unsupported_cfi``, with nothing of the other stack
    above it.  Before, chains went on through whatever return address
    the system stack held (``runtime.newproc`` above ``systemstack``, as gdb shows it), and then
    stopped at every switch.  runtime.main starts sysmon through ``systemstack`` (its
    ``rt_sigprocmask`` and ``clone`` in ``newosproc``), so at least one crossing is certain, and
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
    calls = call_sites(binary)
    samples = [s for s in trace_go(binary, "all", tmp_path) if s.get("event") == "syscall"]
    crossed = flagged = children = clones = 0
    for s in samples:
        names = [f["function"].removesuffix(".abi0") for f in s["frames"]]
        if names[-1:] == ["runtime.clone"] and int(s["frames"][-1]["call_site"], 16) >= child_start:
            # a new thread's first syscall (gettid), made on its new stack: nothing above it
            children += 1
            assert names == ["runtime.clone"] and s["complete"] and s["syscall"] == "gettid", s
            continue
        clones += s["syscall"] == "clone"
        scheduler = names[:1] == ["runtime.morestack"] and bool({"runtime.schedule", "runtime.execute"} &
                                                                 set(names))
        if s["complete"]:
            assert names and (names[0] in tops or names[0] == "runtime.mcall" or scheduler), s
        for i, n in enumerate(names[:-1]):
            if n == "runtime.systemstack" and i > 0:
                crossed += 1
                ra = int(s["frames"][i - 1]["return_address"], 16)
                assert calls.get(ra) == "runtime.systemstack.abi0", s
            if n == "runtime.morestack" and i > 0:
                assert s["complete"], s
                ra = int(s["frames"][i - 1]["return_address"], 16)
                assert calls.get(ra) in ("runtime.morestack.abi0", "runtime.morestack_noctxt.abi0"), s
        crossing = {"runtime.systemstack", "runtime.morestack"}
        hit = [i for i, n in enumerate(names[:-1]) if n in switches - crossing]
        if hit and names[0] == "runtime.mcall":
            assert hit == [0] and s["complete"], s
        elif hit:
            flagged += 1
            assert hit == [0] and not s["complete"] and s["reason"] == "unsupported_cfi", s
        if names[:1] == ["runtime.systemstack"] or (names[:1] == ["runtime.morestack"] and not scheduler):
            flagged += 1
            assert not s["complete"] and s["reason"] == "unsupported_cfi", s
    assert crossed >= 1
    # the threads the runtime made, seen starting (one may be killed by exit_group before its first)
    assert 1 <= children <= clones, (children, clones)
    newm = [s for s in samples if s["syscall"] == "rt_sigprocmask"
            and [f["function"].removesuffix(".abi0") for f in s["frames"]][:5] ==
            ["runtime.goexit", "runtime.main", "runtime.systemstack", "runtime.main.func1", "runtime.newm"]]
    assert newm and all(s["complete"] for s in newm), "runtime.main's systemstack(newm(sysmon)) not crossed"


def clone_child_start(binary: pathlib.Path) -> int:
    """The address after ``runtime.clone``'s ``mov %rsi,%rsp`` (objdump: the child moving onto the
    stack newosproc gave it), where the child's code on the new stack starts."""
    insns = objdump_insns(binary, "--disassemble=runtime.clone.abi0")
    for insn, after in itertools.pairwise(insns):
        if insn.mnemonic == "mov" and insn.operands == "%rsi,%rsp":
            return after.address
    raise AssertionError(f"no mov %rsi,%rsp in runtime.clone: {insns}")


def objdump_insns(binary: pathlib.Path, *options: str) -> list[Insn]:
    """``objdump -d -w`` of the binary, parsed by tests/binutils_oracle.py."""
    text = subprocess.run(["objdump", "-d", "-w", *options, str(binary)], capture_output=True, text=True,
                          check=True).stdout
    return parse_objdump(text)[0]


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
    # that chain starts at morestack, complete: the scheduler's g0 stack)
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


@pytest.mark.bpf
def test_go_systemstack_crossing_as_delves(tmp_path: pathlib.Path) -> None:
    """A syscall made on g0 under ``systemstack`` (runtime.main's ``newm(sysmon)``: ``clone`` in
    ``newosproc``) goes on past ``systemstack`` on the goroutine that called it, from its
    ``m.curg.sched`` (read through the thread's TLS; the offsets from the binary's own code,
    ccprofd/elf/gostack.py), as Go's traceback crosses it.  The oracle is Delve's stack at
    ``runtime.newosproc`` (another run: the first clone is deterministic), whose goroutine part
    follows its ``systemstack_switch`` frame: every frame's function and return address."""
    require_bpf()
    binary = build_go(tmp_path)
    oracle = delve_stacks(binary, "runtime.newosproc", 1)[0]
    names = [fn for fn, _ in oracle]
    assert names[:2] == ["runtime.newosproc", "runtime.systemstack_switch"], oracle
    assert names[-1] == "runtime.goexit", oracle
    expect = [(fn, pc) for fn, pc in reversed(oracle[2:])]
    samples = [s for s in trace_go(binary, "clone", tmp_path) if s.get("event") == "syscall"]
    assert samples, "no clone"
    first = samples[0]
    frames = first["frames"]
    fns = [f["function"].removesuffix(".abi0") for f in frames]
    assert first["complete"] and "runtime.systemstack" in fns, json.dumps(first)
    k = fns.index("runtime.systemstack")
    got = [(fns[i], int(frames[i]["return_address"], 16)) for i in range(k)]
    assert got == expect, (got, expect)
    assert fns[k + 1:] == ["runtime.main.func1", "runtime.newm", "runtime.newm1", "runtime.newosproc",
                           "runtime.clone"], fns


def call_sites(binary: pathlib.Path) -> dict[int, str | None]:
    """Return address -> the function its call instruction calls (objdump; None: an indirect call)."""
    out: dict[int, str | None] = {}
    for insn in objdump_insns(binary):
        if insn.mnemonic == "call":
            target = re.search(r"<([^>+]+)>$", insn.operands)
            out[insn.address + len(insn.raw)] = target.group(1) if target and insn.direct_target else None
    return out


def test_go_thread_snapshot_crosses_systemstack(tmp_path: pathlib.Path) -> None:
    """The ptrace snapshot's walker (ccprofd/proc/userstack.py: GetThreadContexts, ``trace -p``'s
    first contexts) crosses systemstack as the BPF unwinder does, from the thread's ``fs_base``.
    gostw.go's runtime.GC waits for a stop-the-world on g0 under ``systemstack`` while another
    goroutine spins unpreemptibly (GODEBUG=asyncpreemptoff=1).  The stopped thread's stack: the
    goroutine's ``goexit > runtime.main > main.main > runtime.GC > runtime.gcStart``, then
    ``systemstack``, then ``stopTheWorldWithSema``'s waits; every frame's return address is checked
    with objdump to follow a call of the next frame's function (or an indirect call).  Before, the
    walk stopped at ``systemstack``, flagged."""
    from ccprofd.proc.modules import ModuleCache
    from ccprofd.proc.threadsnap import snapshot

    binary = build_go(tmp_path, source=STW_SOURCE)
    names = SymbolNames(binary)
    calls = call_sites(binary)
    proc = subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "GODEBUG": "asyncpreemptoff=1"})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "gc\n"
        time.sleep(0.3)  # the stop-the-world waits for the spinner (a second or two)
        snap = snapshot(proc.pid, ModuleCache())
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out == "gostw: done\n" and proc.returncode == 0
    assert snap.error is None, snap.error
    waiting = []
    for t in snap.threads:
        assert t.stack is not None, t.error
        fns = [names(f.vaddr if f.exact else f.vaddr - 1) if f.vaddr is not None else "?"
               for f in t.stack.frames]
        if "runtime.systemstack.abi0" in fns:
            waiting.append((t, fns))
    assert len(waiting) == 1, [fns for _, fns in waiting]
    thread, fns = waiting[0]
    assert thread.stack is not None and thread.stack.complete, (thread.stack.reason, fns)
    k = fns.index("runtime.systemstack.abi0")
    assert fns[:k] == ["runtime.goexit.abi0", "runtime.main", "main.main", "runtime.GC",
                       "runtime.gcStart"], fns
    assert fns[k + 1] == "runtime.stopTheWorldWithSema", fns
    frames = thread.stack.frames
    # (the outermost, goexit, "returns" to goexit+1: Go's newproc puts that there as its caller)
    assert frames[0].vaddr == min(a for a, n in names.table if n == "runtime.goexit.abi0") + 1
    for outer, callee in zip(frames[1:], fns[2:], strict=False):
        assert not outer.exact and outer.vaddr is not None
        assert outer.vaddr in calls, (hex(outer.vaddr), fns)  # a return address: after a call
        target = calls[outer.vaddr]
        assert target is None or target == callee, (hex(outer.vaddr), target, callee, fns)


class SymbolNames:
    """vaddr -> the function symbol (nm) containing it; ``table``: (address, name) in order."""

    def __init__(self, binary: pathlib.Path) -> None:
        self.table = sorted((addr, name) for name, (addr, _) in nm_defined_sizes(binary).items())
        self._starts = [a for a, _ in self.table]

    def __call__(self, vaddr: int) -> str:
        i = bisect.bisect_right(self._starts, vaddr) - 1
        return self.table[i][1] if i >= 0 else "?"


@pytest.mark.bpf
def test_go_cgo_call_crosses_asmcgocall_as_delves(tmp_path: pathlib.Path) -> None:
    """A cgo call runs its C function on the thread's g0 stack (``runtime.cgocall > asmcgocall``),
    which saves the goroutine's state as systemstack does (gosave_systemstack_switch): a syscall in
    the C code goes on past ``asmcgocall`` on the goroutine (before, it stopped there, flagged; gdb
    walks on into g0's stale words).  gocgo.go: ``main.parent`` calls C's ``c_parent``, which calls
    ``getppid``.  The oracle is Delve's stack at ``c_parent`` (another run): every frame at a return
    address, function and address (Delve also lists an extra frame at the cgo wrapper's entry
    where it switches stacks: an entry is no return address, so entries are left out)."""
    require_bpf()
    require_tool("gcc")
    binary = build_go(tmp_path, source=CGO_SOURCE, cgo=True)
    entries = {a for a, _ in SymbolNames(binary).table}
    oracle = [(fn.removeprefix("C."), pc) for fn, pc in delve_stacks(binary, "c_parent", 1)[0][1:]
              if pc not in entries]
    assert oracle[0][0].startswith("_cgo_") and oracle[1][0] == "runtime.asmcgocall", oracle
    assert oracle[-1][0] == "runtime.goexit", oracle
    samples = [s for s in trace_go(binary, "getppid", tmp_path) if s.get("event") == "syscall"]
    assert len(samples) == 1 and samples[0]["complete"], samples
    frames = samples[0]["frames"]
    got = [(f["function"].removesuffix(".abi0"), int(f["return_address"], 16)) for f in frames
           if f["return_address"] is not None]
    assert got == list(reversed(oracle)), (got, oracle)
    names = [f["function"].removesuffix(".abi0") for f in frames]
    assert names[-2:] == ["c_parent", "getppid"], names  # the C frames (libc's getppid: its own CFI)


@pytest.mark.bpf
def test_go_cgo_runtime_calls_on_a_realigned_stack_unwind(tmp_path: pathlib.Path) -> None:
    """In a cgo binary the runtime also calls C on the stack it runs on, after realigning rsp:
    ``asmcgocall`` on g0 (``newm1 > asmcgocall > _cgo_thread_start``: every new thread) and
    ``callCgoMmap`` (every mmap of the heap).  Each keeps the rsp from before in a slot (``mov rdx,
    rsp`` ... ``and rsp, -16``, ``mov [rsp + 40], rdx``), so the caller's frame is found through it
    (CFA_DEREF, ccprofd/elf/gostack.py); before, such chains stopped there, flagged.  Every chain
    through them must be complete, start where Go says a stack starts, and each of its return
    addresses in the binary must follow a call of the next frame's function (objdump; an indirect
    call: any).  gdb is no oracle here: Go's ``.debug_frame`` there says CFA = rsp + 32."""
    require_bpf()
    require_tool("gcc")
    binary = build_go(tmp_path, source=CGO_SOURCE, cgo=True)
    calls = call_sites(binary)
    samples = [s for s in trace_go(binary, "clone3,mmap", tmp_path) if s.get("event") == "syscall"]
    seen = {"runtime.asmcgocall": 0, "runtime.callCgoMmap": 0}
    for s in samples:
        # (a library frame may have no name: a C thread's, reported since library-only chains are)
        names = [(f["function"] or "?").removesuffix(".abi0") for f in s["frames"]]
        hit = [n for n in names[:-1] if n in seen]
        if not hit:
            continue
        for n in hit:
            seen[n] += 1
        assert s["complete"], json.dumps(s)
        assert starts_where_a_go_stack_starts(names), names
        frames = s["frames"]
        for outer, inner in itertools.pairwise(frames):
            if outer["module"] != str(binary) or outer["return_address"] is None:
                continue
            ra = int(outer["return_address"], 16)
            if outer["function"] == "runtime.goexit.abi0":
                continue  # (goexit "returns" to goexit+1: Go's newproc puts that there)
            assert ra in calls, (hex(ra), names)
            # (systemstack called on g0 already jumps to its function: no frame of its own; a call
            # through the PLT reaches another object's function)
            plt = (calls[ra] or "").endswith("@plt") and inner["module"] != str(binary)
            assert plt or calls[ra] in (None, inner["function"], "runtime.systemstack.abi0"), \
                (hex(ra), calls[ra], inner["function"], names)
    assert seen["runtime.asmcgocall"] >= 1 and seen["runtime.callCgoMmap"] >= 1, seen


@pytest.mark.bpf
def test_go_async_preemption_unwinds_through_the_signal_frame(tmp_path: pathlib.Path) -> None:
    """Go preempts a goroutine that runs without preemption points (gostw.go's ``main.spin``, when
    runtime.GC stops the world) with a signal whose handler makes the goroutine "call"
    ``runtime.asyncPreempt`` at the interrupted instruction.  The handler returns through
    ``runtime.sigreturn`` (``rt_sigreturn``), whose code is byte for byte glibc's ``__restore_rt``: a
    signal frame, the ucontext at rsp.  Its chains now go on through the ucontext to
    ``asyncPreempt`` and the interrupted ``main.spin`` (both exact pcs: looked up as they are, not
    as return addresses) and on to ``runtime.goexit`` (code interrupted under ``morestack`` too,
    through its crossing; a sched there that fails its check would stop flagged at morestack);
    before, they stopped at
    sigreturn (its "return address" was the ucontext's first word: ``unknown_pc``).  The return address above
    ``main.spin`` must follow a call of it (objdump)."""
    require_bpf()
    binary = build_go(tmp_path, source=STW_SOURCE)
    calls = call_sites(binary)
    samples = [s for s in trace_go(binary, "rt_sigreturn", tmp_path) if s.get("event") == "syscall"]
    injected = 0
    for s in samples:
        names = [f["function"].removesuffix(".abi0") for f in s["frames"]]
        assert names[-1] == "runtime.sigreturn", json.dumps(s)
        # complete; or, where the interrupted code ran under morestack and its crossing's check
        # failed, stopped flagged at morestack: through the signal frame either way
        assert s["complete"] or (names[0] == "runtime.morestack" and s["reason"] == "unsupported_cfi"), \
            json.dumps(s)
        if "main.spin" in names:
            k = names.index("main.spin")
            assert names[:k + 1] == ["runtime.goexit", "main.main.func1", "main.spin"], names
            assert names[k + 1:] in (["runtime.asyncPreempt", "runtime.sigreturn"],
                                     ["runtime.sigreturn"]), names
            injected += names[k + 1] == "runtime.asyncPreempt"
            ra = int(s["frames"][k - 1]["return_address"], 16)
            assert calls.get(ra) == "main.spin", (hex(ra), calls.get(ra))
    assert injected >= 1, [s["frames"] for s in samples]


# Where a complete Go chain may start: the functions Go's runtime marks TOPFRAME (runtime/asm_amd64.s;
# runtime/symtab.go: "a function that appears at the top of its stack", where Go's own traceback
# stops), and runtime.mcall, under which the scheduler runs on g0 (Delve ends such a stack there:
# test_go_scheduler_chains_end_at_mcall_as_delves).
GO_STACK_TOPS = ("runtime.goexit", "runtime.mstart", "runtime.rt0_go", "runtime.mcall")


def starts_where_a_go_stack_starts(fns: list[str]) -> bool:
    """Whether a complete chain (outermost first, names without ``.abi0``) starts at a stack's top:
    :data:`GO_STACK_TOPS`, or ``morestack`` when the growth went on into the scheduler on g0 (a
    preempted growth: README, "runtime.morestack")."""
    return fns[0] in GO_STACK_TOPS or (
        fns[0] == "runtime.morestack" and ("runtime.schedule" in fns or "runtime.execute" in fns))


def check_go_chain(fns: list[str], ras: list[int | None], calls: dict[int, str | None]) -> None:
    """A Go chain through a stack switch (outermost first: function names without ``.abi0``, and each
    frame's return address, None where it has none or is outside the binary): it starts where a Go
    stack starts (:func:`starts_where_a_go_stack_starts`: a goroutine's at goexit, a thread that
    never ran one, such as ``sysmon``'s, at mstart), and every return address follows a call of the
    next frame's function (objdump; an indirect call: any) -- the function that called morestack
    called it through ``morestack_noctxt``'s jump, or directly; systemstack called on g0 jumps to
    its function, leaving no frame of its own."""
    assert starts_where_a_go_stack_starts(fns), fns
    for k in range(1, len(fns) - 1):
        ra = ras[k]
        if ra is None:
            continue
        assert ra in calls, (hex(ra), fns)
        target = (calls[ra] or "").removesuffix(".abi0")
        if fns[k + 1] == "runtime.morestack":
            assert target in ("runtime.morestack", "runtime.morestack_noctxt"), (hex(ra), target, fns)
        else:
            # (systemstack called on g0 jumps to its function: no frame of its own)
            assert calls[ra] is None or target in (fns[k + 1], "runtime.systemstack"), \
                (hex(ra), target, fns[k + 1], fns)


@pytest.mark.bpf
def test_go_stack_growth_crosses_morestack(tmp_path: pathlib.Path) -> None:
    """CPU samples of gogrow.go, whose goroutines' stacks grow again and again: in ``morestack >
    newstack > copystack > ...`` on g0, the chain goes on at the goroutine's ``m.curg.sched`` -- the
    function that called morestack from its prologue, then its callers -- as Go's traceback resumes
    there (``funcID_morestack``).  Every such chain must be complete and pass :func:`check_go_chain`
    (objdump); before, each stopped at morestack, flagged (``unsupported_cfi``), a third or more of a
    Go service's CPU samples when its goroutines grow.  A chain that passed Go's ``execute`` or
    ``schedule`` on g0 below morestack (a growth preempted: m.curg may be another goroutine by then)
    ends at morestack, complete: the scheduler's g0 stack starts at that call, as under mcall."""
    require_bpf()
    binary = build_go(tmp_path, source=GROW_SOURCE)
    calls = call_sites(binary)
    out = tmp_path / "samples.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--format", "jsonl",
            "--syscalls", "getppid", "--sample-hz", "997", "--output", str(out), "--", str(binary), "3000"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout == "gogrow: done\n", proc.stderr
    crossed = 0
    for s in (json.loads(line) for line in out.read_text().splitlines()):
        if s.get("event") != "cpu":
            continue
        fns = [f["function"].removesuffix(".abi0") for f in s["frames"]]
        if "runtime.morestack" not in fns[:-1]:
            continue
        below = fns[fns.index("runtime.morestack") + 1:]
        assert s["complete"], json.dumps(s)
        if "runtime.execute" in below or "runtime.schedule" in below:
            assert fns[0] == "runtime.morestack", fns  # the scheduler's g0 stack starts there
            continue
        ras = [int(f["return_address"], 16) if f["return_address"] and f["module"] == str(binary) else None
               for f in s["frames"]]
        check_go_chain(fns, ras, calls)
        above = fns[:fns.index("runtime.morestack")]
        if "main.deep" not in above:
            # Package initialisation grows the main goroutine's stack too; and the closure, after
            # deep returned, enters morestack in its channel send (a preemption request also fails
            # the prologue's stack check: stackguard0 = stackPreempt).  Both chains were checked
            # above like the others; only main.deep's are the growth this test is about.
            assert "runtime.doInit" in above or "main.worker.func1" in above, fns
            continue
        crossed += 1
    assert crossed >= 20, crossed


@pytest.mark.bpf
def test_go_vdso_calls_go_on_at_their_callers(tmp_path: pathlib.Path) -> None:
    """CPU samples of gotime.go, whose goroutines read the clock in a loop: in the vDSO's
    clock_gettime, called by Go's time.now on the thread's g0 stack, the chain goes on at the
    caller time.now recorded in ``m.vdsoPC``/``m.vdsoSP`` (its rsp is only in r12), as Go's profiler
    resumes there.  Every such chain must be complete, end in the vDSO under ``time.now``, and pass
    :func:`check_go_chain` (objdump); before, each stopped at time.now, flagged."""
    require_bpf()
    binary = build_go(tmp_path, source=TIME_SOURCE)
    calls = call_sites(binary)
    out = tmp_path / "samples.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--format", "jsonl",
            "--syscalls", "getppid", "--sample-hz", "997", "--output", str(out), "--", str(binary),
            "20000000"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout == "gotime: done\n", proc.stderr
    crossed = 0
    for s in (json.loads(line) for line in out.read_text().splitlines()):
        if s.get("event") != "cpu" or not any(f["module"] == "[vdso]" for f in s["frames"]):
            continue
        fns = [f["function"].removesuffix(".abi0") for f in s["frames"]]
        assert s["complete"], json.dumps(s)
        k = next(i for i, f in enumerate(s["frames"]) if f["module"] == "[vdso]")
        assert fns[k - 1] in ("time.now", "runtime.nanotime1"), fns
        ras = [int(f["return_address"], 16) if f["return_address"] and f["module"] == str(binary) else None
               for f in s["frames"]]
        check_go_chain(fns[:k], ras[:k], calls)
        crossed += 1
    assert crossed >= 20, crossed


@pytest.mark.parametrize(("source", "arg", "switcher"), [(GROW_SOURCE, "100000", "runtime.morestack"),
                                                         (TIME_SOURCE, "500000000", "time.now")],
                         ids=["morestack", "vdso"])
def test_go_thread_snapshot_crosses_stack_switches(tmp_path: pathlib.Path, source: pathlib.Path,
                                                   arg: str, switcher: str) -> None:
    """The ptrace snapshot's walker crosses morestack and the vDSO calls as the BPF unwinder does:
    snapshots of gogrow / gotime while it runs, until three threads were caught under the switch
    (morestack's call of newstack; time.now's code with m.vdsoPC set); each such stack must be
    complete and pass :func:`check_go_chain` up to the switch's frame."""
    from ccprofd.proc.modules import ModuleCache
    from ccprofd.proc.threadsnap import snapshot

    binary = build_go(tmp_path, source=source)
    names = SymbolNames(binary)
    calls = call_sites(binary)
    proc = subprocess.Popen([str(binary), arg], stdout=subprocess.DEVNULL)
    caught = 0
    try:
        for _ in range(400):
            snap = snapshot(proc.pid, ModuleCache())
            assert snap.error is None, snap.error
            for t in snap.threads:
                if t.stack is None:
                    continue
                fns = [names(f.vaddr if f.exact else f.vaddr - 1).removesuffix(".abi0")
                       if f.vaddr is not None and f.module is not None and f.module.path == str(binary)
                       else "?" for f in t.stack.frames]
                if switcher not in fns[:-1]:
                    continue
                k = fns.index(switcher)
                below = fns[k + 1:]
                assert t.stack.complete, (t.stack.reason, fns)
                if "runtime.execute" in below or "runtime.schedule" in below:
                    assert fns[0] == "runtime.morestack", fns
                    continue
                ras = [None if f.exact else f.vaddr for f in t.stack.frames]
                check_go_chain(fns[:k + 2], ras[:k + 2], calls)
                caught += 1
            if caught >= 3:
                break
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    assert caught >= 3, caught
