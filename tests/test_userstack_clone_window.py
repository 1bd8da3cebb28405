"""The snapshot walker in a clone's child window (cfi.CLONE_CHILD), on a synthetic process: one
module whose table says ``clone3`` 0x1000-0x1010 (its rows after the syscall marked CLONE_CHILD, the
parent's CFA = rsp + 8), ``caller`` 0x2000 (CFA = rsp + 8) and ``top`` 0x3000 (END).  The new
thread's stack top holds a code address (as ``__clone``'s child has the thread function's pointer
there): with the parent's row the walk would take it for a return address.  unwind.c makes the same
decision from the CPU sample's rax; no test program can put a CPU sample into those three
instructions on purpose, so this and tests/test_cfi_clone_window.py are what check it."""

from __future__ import annotations

from array import array

import pytest

from ccprofd.elf import cfi
from ccprofd.proc.maps import ModuleMapping, ProcessMaps
from ccprofd.proc.userstack import UserRegs, unwind

STEP = cfi.Rule(cfi.CFA_RSP, 8)
CHILD = cfi.Rule(cfi.CFA_RSP, 8, aux=cfi.CLONE_CHILD)
AFTER_SYSCALL = 0x1009  # the instruction after the syscall (test rax, rax)
STACK = 0x80000


def walk(rax: int | None, memory: dict[int, int]) -> tuple[list[int], str | None]:
    rows = [(0x1000, STEP), (AFTER_SYSCALL, CHILD), (0x1010, cfi.Rule(cfi.END)), (0x2000, STEP),
            (0x3000, cfi.Rule(cfi.END)), (0x4000, cfi.NO_CFI)]
    rules = sorted({r for _, r in rows})
    table = cfi.UnwindTable(None, "synthetic", array("Q", [a for a, _ in rows]),
                            array("H", [rules.index(r) for _, r in rows]), rules)
    mod = ModuleMapping(0x1000, 0x4000, "synthetic", "synthetic", 0, "00:00", 1)
    got = unwind(UserRegs(AFTER_SYSCALL, STACK, 0, 0, rax), memory.get, ProcessMaps(1, [mod], []),
                 lambda _m: table)
    return [f.pc for f in reversed(got.frames)], got.reason


def test_the_child_ends_at_its_first_instruction() -> None:
    """rax 0: the new thread, whose stack top holds a code address (0x2040): not followed."""
    assert walk(0, {STACK: 0x2040}) == ([AFTER_SYSCALL], None)


@pytest.mark.parametrize("rax", [4242, -11 & (2**64 - 1)], ids=["child-tid", "error"])
def test_the_parent_walks_on_with_its_row(rax: int) -> None:
    """rax the child's tid (or an error): the parent, whose return address is on its stack."""
    memory = {STACK: 0x2010, STACK + 8: 0x3001}
    assert walk(rax, memory) == ([AFTER_SYSCALL, 0x2010, 0x3001], None)


def test_unknown_rax_is_flagged() -> None:
    assert walk(None, {STACK: 0x2010}) == ([AFTER_SYSCALL], "unsupported_cfi")
