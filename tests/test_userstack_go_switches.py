"""The snapshot walker's Go stack switches on a synthetic process (ccprofd/proc/userstack.py): one
module whose unwind table is written here row by row, and memory given word by word, so each case
says exactly what the walk must find.  The real-program checks are tests/test_unwind_go.py's; this
covers what a real program shows only by chance: the goroutine in ``m.curg`` that is *not* the one
that switched to g0 (after Go's ``execute``), and a ``sched.pc`` that follows no call of morestack.

The module (ELF vaddr = runtime address, bias 0), every function's frame CFA = rsp + 8:
``inner`` 0x1000, ``execute`` 0x2000 (its rows flagged GO_CURG_SET), ``morestack`` 0x3000 (the last
byte of its call of newstack, 0x3050, is the GO_MORESTACK row), ``f`` 0x4000 (a 5-byte call at
0x4010), ``top`` 0x5000 (END: a goroutine's outermost frame), ``now`` 0x5800 (a vDSO call's code:
GO_VDSO).
"""

from __future__ import annotations

from array import array

import pytest

from ccprofd.elf import cfi
from ccprofd.proc.maps import ModuleMapping, ProcessMaps
from ccprofd.proc.userstack import UserRegs, unwind

TLS_G, G_M, M_CURG, SCHED_SP = -8, 0x30, 0xC0, 0x38
FS_BASE, G0, M, CURG = 0x70000, 0x71000, 0x72000, 0x73000
G0_STACK, GOROUTINE_STACK = 0x80000, 0x90000
MORESTACK, NOCTXT, CALL_END = 0x3000, 0x3100, 0x3050
STEP = cfi.Rule(cfi.CFA_RSP, 8)
MORESTACK_ROW = cfi.Rule(cfi.GO_MORESTACK, TLS_G, SCHED_SP, MORESTACK, NOCTXT, G_M | M_CURG << 8)
VDSO_SP, VDSO_PC = 0x320, 0x328
VDSO_ROW = cfi.Rule(cfi.GO_VDSO, TLS_G, cfi.RBP_UNDEF, VDSO_SP, VDSO_PC, G_M)


def table() -> cfi.UnwindTable:
    rows = [(0x1000, STEP), (0x2000, cfi.Rule(cfi.CFA_RSP, 8, aux=cfi.GO_CURG_SET)), (0x3000, STEP),
            (CALL_END, MORESTACK_ROW), (CALL_END + 1, STEP), (0x4000, STEP), (0x5000, cfi.Rule(cfi.END)),
            (0x5800, VDSO_ROW), (0x6000, cfi.NO_CFI)]
    rules = sorted({r for _, r in rows})
    return cfi.UnwindTable(None, "synthetic", array("Q", [a for a, _ in rows]),
                           array("H", [rules.index(r) for _, r in rows]), rules)


def walk(memory: dict[int, int], rip: int, rsp: int) -> tuple[list[int], str | None]:
    mod = ModuleMapping(0x1000, 0x6000, "synthetic", "synthetic", 0, "00:00", 1)
    maps = ProcessMaps(1, [mod], [])
    got = unwind(UserRegs(rip, rsp, 0, FS_BASE), memory.get, maps, lambda _m: table())
    return [f.pc for f in reversed(got.frames)], got.reason


def goroutine(call_target: int) -> dict[int, int]:
    """A thread on g0 whose m.curg is a goroutine that called ``call_target`` from f (5 bytes before
    sched.pc = 0x4015: e8 and the displacement) with its rsp at GOROUTINE_STACK, where f's return
    address into ``top`` lies."""
    spc = 0x4015
    rel = (call_target - spc) & 0xFFFFFFFF
    code = (0xE8 << 24) | (rel << 32)  # the word at spc - 8: three other bytes, then the call
    return {FS_BASE + TLS_G: G0, G0 + G_M: M, M + M_CURG: CURG, CURG + SCHED_SP: GOROUTINE_STACK,
            CURG + SCHED_SP + 8: spc, CURG + SCHED_SP + 48: 0, spc - 8: code,
            GOROUTINE_STACK: 0x5001}


@pytest.mark.parametrize("target", [MORESTACK, NOCTXT], ids=["morestack", "morestack_noctxt"])
def test_morestack_goes_on_at_the_goroutines_sched(target: int) -> None:
    """inner <- morestack (on g0) <- f at sched.pc, f's sp sched.sp <- top: complete."""
    memory = {**goroutine(target), G0_STACK: CALL_END + 1}
    pcs, reason = walk(memory, 0x1010, G0_STACK)
    assert reason is None
    assert pcs == [0x1010, CALL_END + 1, 0x4015, 0x5001]


def test_a_sched_pc_after_another_call_is_not_crossed() -> None:
    memory = {**goroutine(0x2000), G0_STACK: CALL_END + 1}
    pcs, reason = walk(memory, 0x1010, G0_STACK)
    assert reason == "unsupported_cfi" and pcs == [0x1010, CALL_END + 1]


def test_morestack_ends_complete_past_a_frame_that_may_set_curg() -> None:
    """The same goroutine, but the walk passed ``execute`` on g0 first: m.curg may be a goroutine
    execute is starting, not the one that called morestack.  The scheduler then runs on g0 from
    morestack's call, the g0 stack's start: the chain ends there, complete (as under mcall)."""
    memory = {**goroutine(MORESTACK), G0_STACK: 0x2021, G0_STACK + 8: CALL_END + 1}
    pcs, reason = walk(memory, 0x1010, G0_STACK)
    assert reason is None and pcs == [0x1010, 0x2021, CALL_END + 1]
    # (the same walk with a frame of `inner` there instead crosses: only execute's rows stop it)
    memory[G0_STACK] = 0x1021
    pcs, reason = walk(memory, 0x1010, G0_STACK)
    assert reason is None and pcs == [0x1010, 0x1021, CALL_END + 1, 0x4015, 0x5001]


def test_morestack_ends_complete_when_the_goroutine_was_dropped() -> None:
    """m.curg nil: the scheduler dropped the goroutine (a preempted growth) and runs on g0."""
    memory = {**goroutine(MORESTACK), G0_STACK: CALL_END + 1, M + M_CURG: 0}
    pcs, reason = walk(memory, 0x1010, G0_STACK)
    assert reason is None and pcs == [0x1010, CALL_END + 1]


@pytest.mark.parametrize("slot_holds_pc", [True, False], ids=["crossed", "stale-fields"])
def test_vdso_call_goes_on_at_vdso_pc(slot_holds_pc: bool) -> None:
    """A sample in a vDSO call's code (exact pc 0x5810, on g0): the caller goes on at m.vdsoPC with
    rsp m.vdsoSP when the slot below that rsp holds that pc (the call's own return address), rbp
    unknown; fields that do not agree with the stack are flagged, not followed."""
    vsp = GOROUTINE_STACK + 8
    memory = {FS_BASE + TLS_G: G0, G0 + G_M: M, M + VDSO_SP: vsp, M + VDSO_PC: 0x4015,
              GOROUTINE_STACK: 0x4015 if slot_holds_pc else 0x4099, vsp: 0x5001}
    pcs, reason = walk(memory, 0x5810, G0_STACK)
    if slot_holds_pc:
        assert reason is None and pcs == [0x5810, 0x4015, 0x5001]
    else:
        assert reason == "unsupported_cfi" and pcs == [0x5810]
