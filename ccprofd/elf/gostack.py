"""How Go's ``runtime.systemstack`` switches stacks, read from the binary's own code.

``systemstack(fn)``, called on a goroutine, saves the goroutine's state in its ``g.sched`` (by
calling ``gosave_systemstack_switch``), moves rsp to the thread's g0 stack (``g0.sched.sp``) and
calls ``fn`` there.  While ``fn`` runs the goroutine is the thread's ``m.curg``, and its frames go on
from ``curg.sched``: ``sp`` points at systemstack's return address into its caller, ``bp`` is the
caller's rbp, and ``pc`` is the marker gosave stores (``runtime.systemstack_switch``).  Go's own
traceback crosses the switch that way (runtime/traceback.go: ``funcID_systemstack``, ``gp =
gp.m.curg``), and so can an unwinder that reads the thread's TLS slot of ``g``.

The offsets (g's TLS slot, ``g.m``, ``m.curg``, ``g.sched``'s fields) are Go's and may change
between versions; rather than a table per version they are read from the instructions of
systemstack and gosave_systemstack_switch themselves, and checked against systemstack's way back
(which loads rsp from ``m.curg.sched.sp`` too).  Any other instruction shape gives None: the switch
then stays flagged, never crossed on a guess.

``runtime.morestack`` (called from a function's prologue when its goroutine's stack is too small)
saves the goroutine's state in ``g.sched`` itself -- ``pc`` the return address into the function
that called it, ``sp`` that function's rsp at the call (pointing at its own return address) -- and
calls ``newstack`` on g0.  Go's traceback resumes there at ``m.curg.sched.pc`` (``funcID_morestack``);
:func:`read_morestack` reads that code's offsets the same way.

The vDSO calls (``nanotime1``, ``time.now``, ``walltime``) keep the goroutine's rsp only in r12 and
record where they were called from in ``m.vdsoPC``/``m.vdsoSP`` before moving to g0 and calling the
vDSO; Go's profiler resumes a traceback there (``sigprof``: ``mp.vdsoSP != 0``).
:func:`read_vdso_switch` reads those offsets and the code that runs with them set.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ccprofd.elf.errors import BinaryError
from ccprofd.elf.gopclntab import GoFunction
from ccprofd.elf.image import ElfImage
from ccprofd.elf.x86dis import x86_64

SYSTEMSTACK = "runtime.systemstack"
MORESTACK = "runtime.morestack"
MORESTACK_NOCTXT = "runtime.morestack_noctxt"
_SCHED_PC = 8  # gobuf: sp, pc, g, ctxt, ret, lr, bp
_SCHED_BP = 48

_MEM = r"qword ptr \[(\w+)(?: \+ (0x[0-9a-f]+|\d+))?\]"
_TLS_LOAD = re.compile(r"^(\w+), qword ptr fs:\[(0x[0-9a-f]+|[a-z]\w*)\]$")
_LOAD = re.compile(rf"^(\w+), {_MEM}$")
_STORE = re.compile(rf"^{_MEM}, (\w+)$")
_LEA_RIP = re.compile(r"^(\w+), \[rip \+ (0x[0-9a-f]+|\d+)\]$")
_LEA_RSP8 = re.compile(r"^(\w+), \[rsp \+ 8\]$")
_MOV_IMM = re.compile(r"^(\w+), (0x[0-9a-f]+|\d+)$")
_LOAD_RSP0 = re.compile(r"^(\w+), qword ptr \[rsp\]$")
_LEA_RSP = re.compile(r"^(\w+), \[rsp \+ (0x[0-9a-f]+|\d+)\]$")
_LOAD_MINUS8 = re.compile(r"^(\w+), qword ptr \[(\w+) - 8\]$")


@dataclass(frozen=True, slots=True)
class GoSystemStack:
    """What an unwinder needs to cross one binary's systemstack (byte offsets, and ELF vaddrs)."""

    tls_g: int  # g's slot relative to the fs base (signed)
    g_m: int  # offset of g.m
    m_curg: int  # offset of m.curg
    sched_sp: int  # offset of g.sched.sp (g.sched.pc at +8, g.sched.bp at +48)
    switch_pc: int  # the pc gosave_systemstack_switch stores in g.sched.pc
    gosave: int  # gosave_systemstack_switch's entry


@dataclass(frozen=True, slots=True)
class GoMorestack:
    """Where one binary's morestack calls newstack on g0 (the offsets are its :class:`GoSystemStack`'s),
    and the entries a function's call of morestack may target (ELF vaddrs)."""

    call_end: int  # the last byte of morestack's call of newstack
    morestack: int  # morestack's entry (closures call it directly)
    noctxt: int  # morestack_noctxt's entry (``mov edx, 0; jmp morestack``), 0 if the binary has none


def _num(text: str | None) -> int:
    return int(text, 0) if text else 0


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _tls_slot(where: str, consts: Mapping[str, int]) -> int | None:
    """The fs-relative slot of a ``mov R, fs:[where]`` (``where`` a constant, or a register a
    constant was moved into, as -buildmode=pie builds have it); None when not known."""
    if where.startswith("0x"):
        return _signed64(int(where, 16))
    return _signed64(consts[where]) if where in consts else None


Insn = tuple[int, int, str, str]  # address, size, mnemonic, operands (capstone, Intel syntax)


def _insns(image: ElfImage, fn: GoFunction) -> list[Insn]:
    return list(x86_64().disasm_lite(image.bytes_at(fn.entry, fn.end - fn.entry), fn.entry))


def read_systemstack(image: ElfImage, funcs: Mapping[str, GoFunction],
                     by_entry: Mapping[int, GoFunction]) -> GoSystemStack | None:
    """The switch of ``funcs[SYSTEMSTACK]`` (None when the binary has none, or its code is not the
    shape this reader knows)."""
    fn = funcs.get(SYSTEMSTACK)
    if fn is None:
        return None
    try:
        got = _parse_systemstack(_insns(image, fn))
        if got is None:
            return None
        tls_g, g_m, m_curg, sched_sp, gosave_at = got
        gosave = by_entry.get(gosave_at)
        if gosave is None:
            return None
        switch_pc = _parse_gosave(_insns(image, gosave), sched_sp)
    except (OSError, BinaryError, ValueError, KeyError, IndexError):
        return None
    if switch_pc is None or not 0 < switch_pc < 1 << 31:
        return None
    if not (0 <= g_m < 256 and 0 <= sched_sp < 256 and 0 <= m_curg < 1 << 31
            and -(1 << 31) <= tls_g < 1 << 31):
        return None  # (what the packed rule can carry; Go's offsets are far smaller)
    return GoSystemStack(tls_g, g_m, m_curg, sched_sp, switch_pc, gosave_at)


def _call_on_g0(insns: list[Insn], after: int) -> tuple[int, int] | None:
    """(the displacement rsp is loaded from, the index of the call) for the code after a call of
    gosave_systemstack_switch (``insns[after:]``): rsp loaded from ``[X + disp]`` (g0's
    ``sched.sp``), directly or through a register, then a call through a register, with no branch
    before it; None for any other shape."""
    loaded: dict[str, int] = {}  # register -> the [base + disp] displacement it was last loaded from
    disp = None
    for i in range(after, len(insns)):
        _, _, mnem, ops = insns[i]
        if disp is None:
            if mnem == "mov" and (m := _LOAD.match(ops)):
                if m.group(1) == "rsp":
                    disp = _num(m.group(3))
                else:
                    loaded[m.group(1)] = _num(m.group(3))
            elif mnem == "mov" and ops.startswith("rsp, "):
                if ops[5:] not in loaded:
                    return None
                disp = loaded[ops[5:]]
            elif mnem in ("call", "ret") or mnem.startswith("j"):
                return None
            continue
        if mnem == "call":
            return None if ops.startswith("0x") or ops.startswith("qword") else (disp, i)
        if mnem == "ret" or mnem.startswith("j") or (mnem == "mov" and ops.startswith("rsp,")):
            return None
    return None


def switch_call_end(image: ElfImage, fn: GoFunction, switch: GoSystemStack) -> int | None:
    """The last byte of ``fn``'s call on g0 that ``switch`` crosses, if ``fn`` makes one as
    systemstack does: a call of gosave_systemstack_switch (the goroutine's state saved in
    ``g.sched``), rsp then loaded from g0's ``sched.sp`` (directly or through a register), and the
    next call through a register (``systemstack``'s ``fn``; ``asmcgocall``'s C function, whose
    goroutine is ``m.curg`` too: it has excluded g0 and gsignal).  None for any other shape."""
    try:
        insns = _insns(image, fn)
    except (OSError, BinaryError, ValueError, KeyError, IndexError):
        return None
    saved = next((i for i, (_, _, mnem, ops) in enumerate(insns)
                  if mnem == "call" and ops.startswith("0x") and int(ops, 16) == switch.gosave), None)
    got = None if saved is None else _call_on_g0(insns, saved + 1)
    if got is None or got[0] != switch.sched_sp:
        return None
    addr, size, _, _ = insns[got[1]]
    return addr + size - 1


def _parse_systemstack(ss: list[Insn]) -> tuple[int, int, int, int, int] | None:
    """(g's TLS slot, g.m, m.curg, g.sched.sp, gosave's entry) from systemstack's instructions, in
    order: ``mov G, fs:[tls]`` (or ``mov R, tls; mov G, fs:[R]``, as -buildmode=pie builds have it);
    ``mov M, [G + g_m]``; ``cmp G, [M + m_curg]`` (the last compare before the call: "is this
    goroutine m.curg?"); ``call gosave``; its call on g0 (:func:`_call_on_g0`, which gives
    ``sched_sp``); and on the way back ``mov rsp, [C + sched_sp]`` after a load of ``[.. +
    m_curg]``."""
    g_reg = m_reg = None
    tls_g = g_m = m_curg = -1
    consts: dict[str, int] = {}  # register -> the constant moved into it (-buildmode=pie: the TLS offset)
    for i, (_, _, mnem, ops) in enumerate(ss):
        if g_reg is None:
            if mnem == "mov" and (m := _MOV_IMM.match(ops)):
                consts[m.group(1)] = int(m.group(2), 0)
            elif mnem == "mov" and (m := _TLS_LOAD.match(ops)):
                slot = _tls_slot(m.group(2), consts)
                if slot is None:
                    return None
                tls_g, g_reg = slot, m.group(1)
        elif mnem == "mov" and m_reg is None and (m := _LOAD.match(ops)) and m.group(2) == g_reg:
            m_reg, g_m = m.group(1), _num(m.group(3))
        elif mnem == "cmp" and m_reg and (m := _LOAD.match(ops)) and m.group(1) == g_reg \
                and m.group(2) == m_reg:
            m_curg = _num(m.group(3))
        elif mnem == "call" and ops.startswith("0x"):
            gosave, after = int(ops, 16), i + 1
            break
    else:
        return None
    got = _call_on_g0(ss, after)
    if got is None or min(g_m, m_curg) < 0:
        return None
    sched_sp, call = got
    back_curg = False
    for _, _, mnem, ops in ss[call + 1:]:
        if mnem == "mov" and (m := _LOAD.match(ops)):
            if m.group(1) != "rsp" and _num(m.group(3)) == m_curg:
                back_curg = True
            elif m.group(1) == "rsp":
                return (tls_g, g_m, m_curg, sched_sp, gosave) if back_curg and _num(m.group(3)) == sched_sp \
                    else None
    return None


def _parse_gosave(gs: list[Insn], sched_sp: int) -> int | None:
    """The pc gosave_systemstack_switch stores in g.sched.pc, when it also stores ``rsp + 8`` (its
    caller's rsp: systemstack's return address slot) in g.sched.sp and rbp in g.sched.bp at the
    offsets the unwinder uses; else None."""
    consts: dict[str, int] = {}
    sp_regs: set[str] = set()
    pc = None
    sp_ok = bp_ok = False
    for addr, size, mnem, ops in gs:
        if mnem == "lea" and (m := _LEA_RIP.match(ops)):
            consts[m.group(1)] = addr + size + _num(m.group(2))
            sp_regs.discard(m.group(1))
        elif mnem == "lea" and (m := _LEA_RSP8.match(ops)):
            sp_regs.add(m.group(1))
            consts.pop(m.group(1), None)
        elif mnem == "mov" and (m := _MOV_IMM.match(ops)):
            consts[m.group(1)] = _num(m.group(2))
            sp_regs.discard(m.group(1))
        elif mnem == "mov" and (m := _STORE.match(ops)):
            off, src = _num(m.group(2)), m.group(3)
            if off == sched_sp + _SCHED_PC and src in consts:
                pc = consts[src]
            elif off == sched_sp and src in sp_regs:
                sp_ok = True
            elif off == sched_sp + _SCHED_BP and src == "rbp":
                bp_ok = True
        elif mnem in ("ret", "call"):
            break
    return pc if pc is not None and sp_ok and bp_ok else None


_JCC = re.compile(r"^j(?!mp)\w+$")
_NO_WRITE = frozenset({"cmp", "test", "push", "call", "bt", "jmp"})


def saved_sp_calls(image: ElfImage, fn: GoFunction, max_steps: int = 4096) -> dict[int, tuple[int, int]]:
    """Calls ``fn`` makes after realigning rsp, with its rsp from before kept in a stack slot:
    {the call's last byte: (the slot's offset from rsp, what to add to the slot's value for the
    CFA)}.  ``asmcgocall`` called on g0 or gsignal runs its C function on the same stack (no switch),
    but first does ``mov rdx, rsp`` (at the entry: the CFA is rsp + 8), ``sub rsp, 64; and rsp,
    -16`` and ``mov [rsp + 40], rdx``; ``callCgoMmap`` keeps rsp after its prologue (``pcsp``: 24,
    the CFA rsp + 32) at ``[rsp]``.  At such a call the CFA is ``*(rsp + slot) + addend`` -- a row no
    pc-offset table can hold.  Found on every path from the entry (a conditional branch forks the
    scan): the register must still hold that rsp when stored, rsp must have changed before only as
    ``pcsp`` describes it (``sub``/``add`` of a constant, push, pop), and not at all between the
    store and the call.  (Only calls after rsp was realigned are reported.)"""
    try:
        insns = _insns(image, fn)
    except (OSError, BinaryError, ValueError, KeyError, IndexError):
        return {}
    at = {addr: i for i, (addr, _, _, _) in enumerate(insns)}

    def sp_offset(pc: int) -> int | None:
        return next((d for lo, hi, d in fn.sp_offsets if lo <= pc < hi), None)

    found: dict[int, tuple[int, int]] = {}
    refuted: set[int] = set()
    # state: (register holding a known rsp, its CFA addend, the slot it is kept in, rsp changed unknowably)
    State = tuple[int, str | None, int, int | None, bool]
    work: list[State] = [(0, None, 0, None, False)]
    seen: set[State] = set()
    steps = 0
    while work and steps < max_steps:
        i, reg, addend, slot, moved = work.pop()
        while 0 <= i < len(insns) and steps < max_steps:
            steps += 1
            if (i, reg, addend, slot, moved) in seen:
                break
            seen.add((i, reg, addend, slot, moved))
            addr, size, mnem, ops = insns[i]
            dst = ops.split(",", 1)[0].strip()
            if mnem == "mov" and ops.endswith(", rsp") and " " not in dst:
                d = None if moved else sp_offset(addr)
                reg, addend = (dst, d + 8) if d is not None and d >= 0 else (None, 0)
            elif mnem == "mov" and reg and ops.endswith(f", {reg}") and (m := _STORE.match(ops)) \
                    and m.group(1) == "rsp":
                slot = _num(m.group(2))
            elif mnem == "call":
                end = addr + size - 1
                # (a call before rsp was realigned needs no slot: pcsp's row holds there)
                if moved and (slot is None or found.setdefault(end, (slot, addend)) != (slot, addend)):
                    refuted.add(end)
            elif mnem in ("push", "pop") or (dst == "rsp" and mnem in ("sub", "add") and _MOV_IMM.match(ops)):
                slot = None  # (pcsp follows these)
            elif dst == "rsp":
                moved, slot = True, None
            if reg and dst == reg and mnem not in _NO_WRITE and not ops.endswith(", rsp"):
                reg = None
            if mnem in ("ret", "int3", "ud2", "hlt") or (mnem == "jmp" and not ops.startswith("0x")):
                break
            if mnem == "jmp" or _JCC.match(mnem):
                target = int(ops, 16) if ops.startswith("0x") else -1
                if target not in at:
                    break
                if mnem == "jmp":
                    i = at[target]
                    continue
                work.append((at[target], reg, addend, slot, moved))
            i += 1
    if steps >= max_steps:
        return {}
    return {end: v for end, v in found.items() if end not in refuted}


def read_morestack(image: ElfImage, funcs: Mapping[str, GoFunction],
                   switch: GoSystemStack) -> GoMorestack | None:
    """morestack's call on g0, when its code is the shape Go's assembly gives it (runtime/asm_amd64.s)
    with ``switch``'s offsets: g loaded from its TLS slot, g.m from it; ``g.sched.pc`` stored from
    ``[rsp]`` (the return address into the function that called morestack), ``g.sched.sp`` from
    ``rsp + 8`` and ``g.sched.bp`` from rbp, all into the g from the TLS slot; then rsp loaded from
    ``[X + sched.sp]`` (g0's) and a direct call at once.  None for any other shape."""
    fn = funcs.get(MORESTACK)
    if fn is None or not (switch.g_m < 256 and switch.m_curg < 256):
        return None  # (GO_MORESTACK's rule carries both in its 16-bit aux)
    try:
        call_end = _parse_morestack(_insns(image, fn), switch)
        noctxt = _parse_noctxt(image, funcs.get(MORESTACK_NOCTXT), fn.entry)
    except (OSError, BinaryError, ValueError, KeyError, IndexError):
        return None
    return None if call_end is None else GoMorestack(call_end, fn.entry, noctxt)


def _parse_morestack(insns: list[Insn], switch: GoSystemStack) -> int | None:
    """The last byte of morestack's call on g0 (:func:`read_morestack` says what must come before)."""
    consts: dict[str, int] = {}
    g_regs: set[str] = set()  # registers holding g (from the TLS slot)
    f_pc: set[str] = set()  # registers holding [rsp]
    f_sp: set[str] = set()  # registers holding rsp + 8
    pc_ok = sp_ok = bp_ok = m_ok = False
    for i, (_, _, mnem, ops) in enumerate(insns):
        g_now = set(g_regs)  # (the sources below are read before the destination is written)
        dst = ops.split(",", 1)[0]
        for held in (g_regs, f_pc, f_sp):
            if mnem in ("mov", "lea") and dst in held:
                held.discard(dst)  # overwritten (a match below adds it back)
        if mnem == "mov" and (m := _MOV_IMM.match(ops)):
            consts[m.group(1)] = int(m.group(2), 0)
        elif mnem == "mov" and (m := _TLS_LOAD.match(ops)):
            if _tls_slot(m.group(2), consts) == switch.tls_g:
                g_regs.add(m.group(1))
        elif mnem == "mov" and (m := _LOAD_RSP0.match(ops)):
            f_pc.add(m.group(1))
        elif mnem == "lea" and (m := _LEA_RSP8.match(ops)):
            f_sp.add(m.group(1))
        elif mnem == "mov" and (m := _LOAD.match(ops)) and m.group(1) == "rsp":
            if not (pc_ok and sp_ok and bp_ok and m_ok) or _num(m.group(3)) != switch.sched_sp \
                    or i + 1 >= len(insns):
                return None
            addr, size, nmnem, nops = insns[i + 1]
            return addr + size - 1 if nmnem == "call" and nops.startswith("0x") else None
        elif mnem == "mov" and (m := _LOAD.match(ops)) and m.group(2) in g_now \
                and _num(m.group(3)) == switch.g_m:
            m_ok = True
        elif mnem == "mov" and (m := _STORE.match(ops)) and m.group(1) in g_now:
            off, src = _num(m.group(2)), m.group(3)
            if off == switch.sched_sp + _SCHED_PC and src in f_pc:
                pc_ok = True
            elif off == switch.sched_sp and src in f_sp:
                sp_ok = True
            elif off == switch.sched_sp + _SCHED_BP and src == "rbp":
                bp_ok = True
        elif mnem in ("ret", "jmp") or (mnem == "mov" and ops.startswith("rsp,")):
            return None
    return None


def _parse_noctxt(image: ElfImage, fn: GoFunction | None, morestack: int) -> int:
    """morestack_noctxt's entry when it is ``mov edx, 0; jmp morestack``, else 0."""
    if fn is None:
        return 0
    insns = _insns(image, fn)
    if len(insns) >= 2 and insns[0][2:] == ("mov", "edx, 0") and insns[1][2] == "jmp" \
            and insns[1][3].startswith("0x") and int(insns[1][3], 16) == morestack:
        return fn.entry
    return 0


@dataclass(frozen=True, slots=True)
class GoVdsoSwitch:
    """A function that calls the vDSO as Go's ``nanotime1`` does: the offsets of ``m.vdsoPC`` and
    ``m.vdsoSP``, and the byte ranges [lo, hi) of its code that runs with them set to its own return
    address and the rsp above it (from their stores to the move of rsp back, that included)."""

    vdso_pc: int
    vdso_sp: int
    ranges: tuple[tuple[int, int], ...]


def read_vdso_switch(image: ElfImage, fn: GoFunction, switch: GoSystemStack) -> GoVdsoSwitch | None:
    """``fn``'s vDSO switch when its code has this shape (runtime/sys_linux_amd64.s, time/time_linux_amd64.s),
    else None: ``mov M, [G + g.m]``; ``lea D, [rsp + k]`` (the caller's rsp: ``ret+0(FP)``); ``mov C,
    [D - 8]`` (the return address); ``mov [M + pc], C`` and ``mov [M + sp], D``; then, on every path
    from there, a ``mov rsp, [..]`` or not (already on g0), calls through a register, and ``mov rsp,
    R`` back before any ``ret``.  The ranges are the code reachable from the stores up to that move
    back, followed along branches (the syscall fallback lies after the ``ret`` in address order)."""
    try:
        insns = _insns(image, fn)
    except (OSError, BinaryError, ValueError, KeyError, IndexError):
        return None
    m_regs: set[str] = set()
    caller_sp: set[str] = set()
    ret_addr: set[str] = set()
    pc_off = sp_off = None
    start = None
    for i, (_, _, mnem, ops) in enumerate(insns):
        m = _LOAD.match(ops) if mnem == "mov" else None
        if m and m.group(2) != "rsp" and _num(m.group(3)) == switch.g_m:
            m_regs.add(m.group(1))
        elif mnem == "lea" and (m := _LEA_RSP.match(ops)):
            caller_sp.add(m.group(1))
        elif mnem == "mov" and (m := _LOAD_MINUS8.match(ops)) and m.group(2) in caller_sp:
            ret_addr.add(m.group(1))
        elif mnem == "mov" and (m := _STORE.match(ops)) and m.group(1) in m_regs:
            if m.group(3) in ret_addr:
                pc_off = _num(m.group(2))
            elif m.group(3) in caller_sp:
                sp_off = _num(m.group(2))
            if pc_off is not None and sp_off is not None:
                start = i + 1
                break
        elif mnem in ("call", "ret", "jmp") or mnem.startswith("j") or \
                (ops.startswith("rsp,") and not (mnem in ("sub", "add") and _MOV_IMM.match(ops))):
            return None  # (the prologue's sub of a constant from rsp is pcsp's)
    if start is None or pc_off is None or sp_off is None or pc_off == sp_off:
        return None
    at = {addr: k for k, (addr, _, _, _) in enumerate(insns)}
    seen: set[int] = set()
    work = [start]
    switched = called = False
    while work:
        k = work.pop()
        while k < len(insns) and k not in seen:
            seen.add(k)
            addr, _, mnem, ops = insns[k]
            if mnem == "mov" and ops.startswith("rsp, "):
                if _LOAD.match(ops):
                    switched = True  # onto g0
                else:
                    break  # back: the last instruction that runs with the fields set (included)
            elif mnem == "call":
                if ops.startswith("0x") or ops.startswith("qword"):
                    return None
                called = True
            elif mnem in ("ret", "int3", "ud2", "hlt") or (mnem == "jmp" and not ops.startswith("0x")) \
                    or (ops.startswith("rsp,") and mnem not in ("sub", "and", "add")):
                return None  # (rsp is realigned on g0 by sub and and)
            if mnem == "jmp" or _JCC.match(mnem):
                target = int(ops, 16) if ops.startswith("0x") else -1
                if target not in at:
                    return None
                if mnem == "jmp":
                    k = at[target]
                    continue
                work.append(at[target])
            k += 1
        else:
            if k >= len(insns):
                return None  # ran off the function's end
    if not (switched and called):
        return None
    ranges: list[tuple[int, int]] = []
    for k in sorted(seen):
        addr, size, _, _ = insns[k]
        if ranges and ranges[-1][1] == addr:
            ranges[-1] = (ranges[-1][0], addr + size)
        else:
            ranges.append((addr, addr + size))
    return GoVdsoSwitch(pc_off, sp_off, tuple(ranges))
