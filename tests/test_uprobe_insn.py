"""Entry probes on instructions x86 uprobes refuse (uprobe_insn.py).  The kernel refuses a
lock-prefixed instruction with ENOTSUPP (errno 524) and then the whole uprobe_multi link fails:
postgres' ``SetLatch`` (``lock addl $0,(%rsp)``) made every instrumented postgres plan with it
unattachable.  The probe moves past such an instruction when that is provably the same point."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_bpf
from programs.build import build

from ccprofd.tracing.instrumented.uprobe_insn import moved_entry, refused

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("hexcode", "why"), [
    ("f083042400", "lock-prefixed instruction"),      # lock addl $0,(%rsp) (postgres SetLatch)
    ("f0480fb111", "lock-prefixed instruction"),      # lock cmpxchg %rdx,(%rcx)
    ("3effe0", "ds-prefixed instruction"),           # notrack jmp *%rax
    ("cc", "opcode 0xcc"), ("f4", "opcode 0xf4"), ("cd80", "opcode 0xcd"),
    ("f30f1efa", None), ("55", None), ("4883ec08", None), ("4157", None), ("64488b042528000000", None),
])
def test_refused_follows_the_kernels_rules(hexcode: str, why: str | None) -> None:
    assert refused(bytes.fromhex(hexcode)) == why


def test_an_entry_probe_moves_only_to_the_same_point() -> None:
    base = 0x1000
    lock = bytes.fromhex("f083042400")                              # 5 bytes: next is 0x1005
    ok = lock + bytes.fromhex("4883ec08") + bytes.fromhex("c3")     # sub $8,%rsp; ret
    assert moved_entry(ok, base) == (0x1005, "")
    loop_back = lock + bytes.fromhex("ffc7") + bytes.fromhex("75fc") + bytes.fromhex("c3")  # jne 0x1005
    assert moved_entry(loop_back, base)[0] is None
    assert "lands on the next instruction" in moved_entry(loop_back, base)[1]
    indirect = lock + bytes.fromhex("ffe0")                          # jmp *%rax
    assert "indirect jump" in moved_entry(indirect, base)[1]
    writes_sp = bytes.fromhex("f0480fc12424") + bytes.fromhex("c3")  # lock xadd %rsp,(%rsp)
    assert "writes the stack pointer" in moved_entry(writes_sp, base)[1]


def _objdump_call(binary: str, caller: str, callee: str) -> int:
    """The address of ``caller``'s call of ``callee``, from binutils' objdump."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary], capture_output=True, text=True,
                         check=True).stdout
    body = out.split(f"<{caller}>:\n", 1)[1].split("\n\n", 1)[0]
    m = re.search(rf"^\s*([0-9a-f]+):\s+call\s+[0-9a-f]+ <{callee}[>@]", body, re.M)
    assert m, body
    return int(m.group(1), 16)


@pytest.mark.bpf
def test_instrumented_mode_attaches_past_a_lock_prefixed_entry(tmp_path: Path) -> None:
    """Before: `uprobe_multi link ... (errno 524)` and no trace at all."""
    require_bpf()
    binary = str(build("locked_entry", opt="O2"))
    head = subprocess.run(["objdump", "-d", binary], capture_output=True, text=True, check=True).stdout
    assert re.search(r"<cmp_locked>:\n\s*[0-9a-f]+:\s+f0 83 04 24 00\s+lock addl", head)
    out = tmp_path / "t.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented",
                           "--format", "jsonl", "--syscalls", "getppid", "--output", str(out), "--", binary],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    samples = [s for s in map(json.loads, out.read_text().splitlines()) if s.get("syscall") == "getppid"]
    assert len(samples) >= 2  # qsort of 3 values compares at least twice
    site = _objdump_call(binary, "cmp_locked", "cmp_inner")
    for s in samples:
        assert s["complete"], s
        ours = [f for f in s["frames"] if f["analysed"]]
        assert [f["function"] for f in ours] == ["main", "cmp_locked", "cmp_inner"], s["frames"]
        assert int(ours[1]["call_site"], 16) == site


def test_a_plan_with_a_refused_site_probe_is_refused_in_one_line(tmp_path: Path) -> None:
    """A call site the plan must probe, crafted with a cs prefix (2e e8 rel32, which the kernel
    refuses like ``notrack jmp *%rax``): before, the plan held the probe and the attach failed with
    errno 524; now the plan is refused naming the function and the address (objdump's)."""
    from bpf_helpers import compile_c

    from ccprofd.callgraph import analyze_binary
    from ccprofd.elf.image import ElfImage
    from ccprofd.encode import build_plan
    from ccprofd.tracing.instrumented.probeplan import ProbePlanError, build_probe_plan

    prog = compile_c(tmp_path, "prefixed_call", r"""
        #include <unistd.h>
        volatile long sink;
        __attribute__((noinline)) void io(void) { sink = getppid(); }
        void prefixed(void);
        __asm__(".text\n.globl prefixed\n.type prefixed, @function\nprefixed:\n .cfi_startproc\n"
                " subq $8, %rsp\n .cfi_def_cfa_offset 16\n .byte 0x2e\n call io\n addq $8, %rsp\n"
                " .cfi_def_cfa_offset 8\n ret\n .cfi_endproc\n.size prefixed, .-prefixed\n");
        int main(void) { prefixed(); io(); return 0; }""", "-O1")
    out = subprocess.run(["objdump", "-d", str(prog)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"^\s*([0-9a-f]+):\s+2e e8 [0-9a-f ]+\s+cs call\s+[0-9a-f]+ <io>", out, re.M)
    assert m, out
    graph = analyze_binary(prog, use_cache=False)
    with pytest.raises(ProbePlanError) as exc:
        build_probe_plan(graph, build_plan(graph, "valence"), ElfImage(str(prog)))
    msg = str(exc.value)
    assert "\n" not in msg
    assert f"of prefixed at {int(m.group(1), 16):#x} (cs-prefixed instruction)" in msg, msg
