"""The instructions a clone's child runs with its parent's row (ccprofd/elf/cfi.py: CLONE_CHILD).

glibc's ``__clone``/``__clone3`` end their FDE before the ``syscall`` and open the child's after the
parent's ``ret`` (``cfi_undefined rip``); the code between gets the preceding row (the fall-through
gap rule), which is the parent's.  The child runs the first instructions of it too (``test rax,
rax; jl; je``) on its new stack, where that row would read a return address from whatever lies
above the stack's top (``__clone``'s child: the thread function's pointer it pushed there, a code
address).  Those instructions carry CLONE_CHILD: a CPU sample there with rax 0 (the child) ends
its chain.  The oracle is objdump's reading of the system's libc and of a Go binary's
runtime.clone; ``_Fork``'s clone syscall (a C function with its own FDE: the child returns through
the same frames, as fork's child does) must not be marked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from binutils_oracle import parse_objdump
from conftest import require_tool

from ccprofd.elf import cfi
from ccprofd.elf.image import ElfImage

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6").resolve()


def objdump_lines(path: Path) -> list[tuple[int, int, str]]:
    """(address, size, instruction text) of every instruction, in order (Intel syntax; parsed by
    tests/binutils_oracle.py)."""
    text = subprocess.run(["objdump", "-d", "-w", "-M", "intel", str(path)], capture_output=True, text=True,
                          check=True).stdout
    return [(i.address, len(i.raw), f"{i.mnemonic} {i.operands}".strip()) for i in parse_objdump(text)[0]]


def test_glibc_clone_windows_are_marked_and_fork_is_not() -> None:
    require_tool("objdump")
    lines = objdump_lines(LIBC)
    table = cfi.build_table(ElfImage(str(LIBC)))
    windows = 0
    fork_like = 0
    for i in range(1, len(lines) - 6):
        before, sc = lines[i - 1], lines[i]
        if sc[2] != "syscall" or not re.fullmatch(r"mov\s+eax,0x(38|1b3)", before[2]):
            continue
        after = [t for _, _, t in lines[i + 1:i + 5]]
        thread_shape = re.fullmatch(r"test\s+rax,rax", after[0]) and after[1].startswith("jl ") \
            and after[2].startswith("je ") and after[3] == "ret"
        syscall_rule = table.lookup(sc[0])
        assert not syscall_rule.aux & cfi.CLONE_CHILD, hex(sc[0])  # a syscall sample's lookup
        if thread_shape:
            windows += 1
            for a, size, _ in lines[i + 1:i + 5]:
                for pc in range(a, a + size):
                    r = table.lookup(pc)
                    assert r.kind == cfi.CFA_RSP and r.aux & cfi.CLONE_CHILD, (hex(pc), r)
            child = lines[i + 5][0]
            assert table.lookup(child).kind == cfi.END, hex(child)  # glibc's cfi_undefined rip
        else:
            fork_like += 1
            r = table.lookup(lines[i + 1][0])
            assert not r.aux & cfi.CLONE_CHILD, (hex(lines[i + 1][0]), r)
    assert windows == 2, windows  # __clone and __clone3
    assert fork_like >= 1, fork_like  # _Fork


def test_go_clone_window_is_marked(tmp_path: Path) -> None:
    """Go's runtime.clone: ``mov eax,0x38; syscall; cmp rax,0x0; je CHILD; mov ...,eax; ret`` --
    the four instructions after the syscall are marked; the child's ``mov rsp,rsi`` at CHILD, its
    first instruction of its own, ends the chain (as the child code after it does)."""
    from test_unwind_go import build_go

    require_tool("objdump")
    binary = build_go(tmp_path)
    lines = objdump_lines(binary)
    table = cfi.build_table(ElfImage(str(binary)))
    starts = [i for i in range(1, len(lines)) if lines[i][2] == "syscall"
              and re.fullmatch(r"mov\s+eax,0x38", lines[i - 1][2])]
    assert len(starts) == 1, starts
    i = starts[0]
    shape = lines[i:i + 6]
    assert re.fullmatch(r"cmp\s+rax,0x0", lines[i + 1][2]) and lines[i + 2][2].startswith("je "), shape
    ret = next(k for k in range(i + 1, i + 6) if lines[k][2] == "ret")
    for a, size, _ in lines[i + 1:ret + 1]:
        for pc in range(a, a + size):
            r = table.lookup(pc)
            assert r.kind == cfi.CFA_RSP and r.aux & cfi.CLONE_CHILD, (hex(pc), r)
    child = lines[ret + 1]
    assert child[0] == int(lines[i + 2][2].split()[1], 16) and re.fullmatch(r"mov\s+rsp,rsi", child[2])
    assert table.lookup(child[0]).kind == cfi.END
    assert not table.lookup(lines[i][0]).aux & cfi.CLONE_CHILD
