"""The probe plan, the CFA rules and the output formats, checked without BPF against binutils.

* every exit probe is a ``call``/``jmp`` to a ``@plt`` stub per objdump (and every such call of a
  function that can make a syscall has one), pure library calls (``strlen``) have none;
* acyclic/cyclic probes sit exactly on the edges whose plan code is non-zero or cyclic, and only where
  a sample point is reachable;
* file offsets equal readelf's PT_LOAD translation; CFA rules equal ``readelf --debug-dump=frames-interp``.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
from typing import Any

import pytest
from bpf_helpers import compile_c, file_offset
from conftest import require_tool
from programs.build import build

from ccprofd.callgraph import analyze_binary
from ccprofd.elf.cfi import RBP, RSP, CfaRule, cfa_rules
from ccprofd.elf.image import ElfImage
from ccprofd.encode import build_plan
from ccprofd.encode.plan import COL
from ccprofd.export.jsonl import format_text, write_jsonl
from ccprofd.kbpf.syscalls import IA32_BIT, parse_syscalls, syscall_name, syscall_number
from ccprofd.tracing.instrumented.probeplan import (
    PCOL,
    R_ACYC,
    R_CYCLIC,
    R_OUTSIDE_ENTRY,
    R_PLT_EXIT,
    ProbePlan,
    build_probe_plan,
)


def objdump_calls(binary: pathlib.Path) -> dict[int, tuple[str, str, str]]:
    """vaddr -> (function, mnemonic, target symbol) for every direct call/jmp to a symbol."""
    require_tool("objdump")
    text = subprocess.run(["objdump", "-d", "-w", "--no-show-raw-insn", str(binary)], capture_output=True,
                          text=True, check=True).stdout
    out: dict[int, tuple[str, str, str]] = {}
    func = "?"
    for line in text.splitlines():
        fm = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if fm:
            func = fm.group(1)
            continue
        m = re.match(r"^\s*([0-9a-f]+):\s+(call|jmp)\s+[0-9a-f]+ <([^>+]+)>$", line)
        if m:
            out[int(m.group(1), 16)] = (func, m.group(2), m.group(3))
    return out


def plan_for(binary: pathlib.Path) -> tuple[Any, dict[str, Any], ProbePlan]:
    graph = analyze_binary(binary, use_cache=False)
    plan = build_plan(graph, "valence")
    return graph, plan, build_probe_plan(graph, plan, ElfImage(str(binary)))


@pytest.mark.parametrize("opt", ["O0", "O2"])
def test_exit_probes_are_the_plt_calls(opt: str) -> None:
    binary = pathlib.Path(build("calls", opt=opt, pie=True))
    _, _, pp = plan_for(binary)
    calls = objdump_calls(binary)
    exits = {p[PCOL["vaddr"]] for p in pp.probes if p[PCOL["reasons"]] & R_PLT_EXIT}
    # Every PLT call but the pure strlen and _start's start-up: from calls.c main -> puts,
    # opener -> open/getppid/close, say -> write; crtstuff's __do_global_dtors_aux -> __cxa_finalize.
    expected = {va for va, (fn, _m, tgt) in calls.items()
                if tgt.endswith("@plt") and fn != "_start" and tgt != "strlen@plt"}
    assert exits == expected
    assert {calls[va][2] for va in exits} - {"__cxa_finalize@plt"} == {
        "puts@plt", "open@plt", "getppid@plt", "close@plt", "write@plt"}
    assert not any(calls[va][2] == "strlen@plt" for va in exits)
    for p in pp.probes:
        assert p[PCOL["offset"]] == file_offset(binary, p[PCOL["vaddr"]])


def test_edge_probes_follow_the_plan_codes() -> None:
    binary = pathlib.Path(build("recursion", opt="O2", pie=False))
    graph, plan, pp = plan_for(binary)
    probed = {p[PCOL["plan_site"]]: p for p in pp.probes if p[PCOL["kind"]] in ("site", "tail")
              and p[PCOL["reasons"]] & (R_ACYC | R_CYCLIC)}
    calls = objdump_calls(binary)
    for sid, row in enumerate(plan["sites"]):
        if row[COL["caller"]] < 0 or graph.graph.nodes[row[COL["callee"]]]["kind"] != "function":
            continue
        coded = bool(row[COL["reasons"]] & R_CYCLIC) or bool(row[COL["code"]])
        assert (sid in probed) == coded, (hex(row[COL["site"]]), row)
        if sid in probed:
            _fn, mnem, tgt = calls[row[COL["site"]]]
            assert (mnem == "jmp") == (probed[sid][PCOL["kind"]] == "tail")
            assert tgt == graph.name(row[COL["callee"]])
    # Every recursive call site of recursion.c is a cyclic probe (6 cyclic edges in the source).
    cyclic = [p for p in pp.probes if p[PCOL["reasons"]] & R_CYCLIC]
    assert sorted(calls[p[PCOL["vaddr"]]][2] for p in cyclic) == sorted(
        ["fact", "is_odd", "is_even", "ring_b", "ring_c", "ring_a"])


def test_unreachable_callees_carry_no_probes(tmp_path: pathlib.Path) -> None:
    """A subtree that can make no syscall (no library call but pure ones, no syscall instruction, no
    indirect call) gets no probe even where its edges have non-zero codes."""
    prog = compile_c(tmp_path, "pure", r"""
        #include <string.h>
        #include <unistd.h>
        volatile long sink;
        __attribute__((noinline)) long leaf(const char *s) { return (long)strlen(s); }
        __attribute__((noinline)) long a(void) { return leaf("abc"); }
        __attribute__((noinline)) long b(void) { return leaf("de") + a(); }
        __attribute__((noinline)) void io(void) { sink = getppid(); }
        int main(void) { sink = a() + b(); io(); return 0; }""", "-O1")
    graph, _plan, pp = plan_for(prog)
    names = {n: graph.name(n) for n in graph.functions()}
    probed_callers = {names.get(p[PCOL["node"]]) for p in pp.probes if p[PCOL["kind"]] != "entry"}
    assert not probed_callers & {"a", "b", "leaf"}
    assert "io" in probed_callers  # io -> getppid@plt
    assert pp.stats["skipped_unreachable"] >= 1  # leaf has two callers: some edge into it is coded
    assert any(p[PCOL["reasons"]] & R_OUTSIDE_ENTRY and names.get(p[PCOL["node"]]) == "main"
               for p in pp.probes)


def readelf_cfa(binary: pathlib.Path) -> list[tuple[int, int, str]]:
    """(row start, row end, CFA text) from readelf's interpreted CFI tables."""
    require_tool("readelf")
    text = subprocess.run(["readelf", "--debug-dump=frames-interp", "-W", str(binary)], capture_output=True,
                          text=True, check=True).stdout
    rows: list[tuple[int, int, str]] = []
    for block in re.split(r"\n(?=[0-9a-f]{8} [0-9a-f]+ [0-9a-f]+ FDE )", text):
        m = re.match(r"[0-9a-f]{8} [0-9a-f]+ [0-9a-f]+ FDE cie=[0-9a-f]+ pc=([0-9a-f]+)\.\.([0-9a-f]+)",
                     block)
        if not m:
            continue
        end = int(m.group(2), 16)
        table = block.split("\n\n", 1)[0]  # this FDE's rows end at the first blank line
        locs = [(int(r.group(1), 16), r.group(2)) for r in
                re.finditer(r"^([0-9a-f]{16}) (\S+)", table, re.M)]
        for i, (loc, cfa) in enumerate(locs):
            rows.append((loc, locs[i + 1][0] if i + 1 < len(locs) else end, cfa))
    return rows


@pytest.mark.parametrize("variant", [{"opt": "O0", "pie": True}, {"opt": "O2", "pie": False}])
@pytest.mark.parametrize("name", ["exceptions", "recursion", "switch"])
def test_cfa_rules_match_readelf(name: str, variant: dict[str, Any]) -> None:
    binary = pathlib.Path(build(name, **variant))
    rows = readelf_cfa(binary)
    assert rows
    image = ElfImage(str(binary))
    eh = image.sections[".eh_frame"]
    addrs = [a for lo, hi, _ in rows for a in {lo, hi - 1}]
    got = cfa_rules(image.section_bytes(eh), eh.vaddr, addrs)
    regs = {RSP: "rsp", RBP: "rbp"}
    for lo, hi, cfa in rows:
        for a in {lo, hi - 1}:
            rule = got[a]
            text = "exp" if rule is None else f"{regs.get(rule.reg, rule.reg)}+{rule.offset}"
            assert text == cfa or (cfa == "exp" and rule is None), (hex(a), text, cfa)
    assert any(r == CfaRule(RBP, 16) for r in got.values()) == (variant["opt"] == "O0")


def test_output_formats() -> None:
    sample = {"time_ns": 1, "pid": 7, "tid": 8, "event": "syscall", "syscall": "write", "complete": False,
              "frames": [
                  {"function": "main", "module": "/b", "build_id": "ab", "analysed": True,
                   "call_site": "0x10", "return_address": "0x15"},
                  {"function": "chain", "module": "/b", "build_id": "ab", "analysed": True,
                   "call_site": "0x20", "return_address": None, "tail_call": True},
                  {"function": "qsort", "module": None, "build_id": None, "analysed": False,
                   "call_site": None, "return_address": None},
                  {"function": "cmp", "module": "/b", "build_id": "ab", "analysed": True,
                   "call_site": "0x30", "return_address": "0x35"}]}
    assert format_text(sample).splitlines() == [
        "[pid 7 tid 8] write <incomplete>",
        " > /b(cmp) call_site=0x30 return_address=0x35",
        " > ?(qsort) [not analysed]",
        " > /b(chain) call_site=0x20 [tail call]",
        " > /b(main) call_site=0x10 return_address=0x15",
    ]

    class Sink:
        text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

    out = Sink()
    write_jsonl(out, sample)  # type: ignore[arg-type]
    assert out.text.endswith("\n") and json.loads(out.text) == sample


def test_syscall_names() -> None:
    assert parse_syscalls("write,openat") == [1, 257]  # the x86-64 ABI numbers
    assert parse_syscalls("all") is None and parse_syscalls(None) is None
    assert syscall_name(59) == "execve" and syscall_name(None) is None
    with pytest.raises(ValueError, match="unknown syscall 'nope'"):
        parse_syscalls("write,nope")
    # syscall_number inverts syscall_name, compat calls too (the ia32 numbers of asm/unistd_32.h:
    # getpid 20, execve 11; the samplers mark them with IA32_BIT)
    assert syscall_number("execve") == 59 and syscall_number("syscall_999") == 999
    assert syscall_number("ia32:getpid") == IA32_BIT | 20 and syscall_name(IA32_BIT | 11) == "ia32:execve"
    assert syscall_number("ia32:execve") == IA32_BIT | 11 and syscall_number("nope") is None


def test_probe_plan_round_trips_through_json() -> None:
    binary = pathlib.Path(build("fptr", opt="O2", pie=True))
    _, _, pp = plan_for(binary)
    again = ProbePlan.from_dict(json.loads(json.dumps(pp.to_dict())))
    assert again == pp
