"""x86-64 unwind tables from ``.eh_frame`` / ``.debug_frame``: what a BPF unwinder needs per pc.

For every address range of one ELF object the table says how to find the caller's frame:

* the CFA (``rsp + k`` or ``rbp + k``; the PLT's well-known ``rsp + k + 8*((rip & 15) >= n)``
  expression; the signal trampoline, whose registers are in the ``ucontext`` at ``rsp``);
* where the return address is (``CFA + ra_off``, always ``CFA - 8`` from gcc/clang);
* where the caller's ``rbp`` was saved (``CFA + off``), or that ``rbp`` is unchanged;
* ``END`` where the return address is undefined (``_start``, thread entry: the outermost frame),
  ``NONE`` where no FDE covers the address, ``UNSUPPORTED`` for any other DWARF expression.

Built by the one CFI interpreter of ccprofd (:func:`_execute`) over the records
:mod:`ccprofd.elf.ehframe` reads from the raw section bytes (pyelftools decodes every instruction
into objects and takes ~1.7 s on python3.11; this takes a fraction of that).  The same interpreter
answers the two lighter questions other stages ask: where each FDE's range starts and whether it is
a function entry (:func:`fde_ranges`, for the call graph), and the CFA rule at given addresses
(:func:`cfa_rules`, for instrumented mode's probe plan).  Tables are plain data (sorted start
addresses, a rule index per start, a list of rule tuples), cached by build-id, and the same for
every process that maps the object: runtime addresses are translated by the caller (load bias),
never stored here.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple, TypeVar

from ccprofd.elf.compressed import CompressedSectionError
from ccprofd.elf.ehframe import MALFORMED, Cie, FdeHeader, cfi_errors, iter_fdes, read_encoded, sleb, uleb
from ccprofd.elf.errors import BinaryError, CfiError
from ccprofd.elf.gopclntab import FUNC_FLAG_SPWRITE, FUNC_FLAG_TOPFRAME, GoTableError, read_go_functions
from ccprofd.elf.gostack import (
    GoMorestack,
    GoSystemStack,
    GoVdsoSwitch,
    read_morestack,
    read_systemstack,
    read_vdso_switch,
    saved_sp_calls,
    switch_call_end,
)
from ccprofd.elf.image import ElfImage
from ccprofd.elf.x86dis import x86_64
from ccprofd.persist.cache import AnalysisCache

CACHE_KIND = "cfi"
TABLE_FORMAT = 12  # 2: code an FDE falls through into keeps its last row (_fallthrough_gaps); 3: RA_REG;
# 4: a compressed .debug_frame (.zdebug_frame) is read; 5: Go functions from .gopclntab; 6: their stack
# switches at the call's last byte; 7: and over the switched code; 8: mcall's and clone's child's code
# ends the chain; 9: systemstack's call on g0 is GO_SWITCH, asmcgocall's on the same stack CFA_DEREF,
# Go's sigreturn a signal frame, asyncPreempt's caller exact; 10: morestack's call on g0 is
# GO_MORESTACK, execute's and schedule's rows GO_CURG_SET; 11: the vDSO calls' code GO_VDSO, a switch
# back's own instruction runs on the other stack; 12: a clone's child window CLONE_CHILD

# Rule kinds.
NONE = 0  # no CFI covers the address: the unwinder may try frame pointers
CFA_RSP = 1  # CFA = rsp + cfa_off
CFA_RBP = 2  # CFA = rbp + cfa_off
PLT = 3  # CFA = rsp + cfa_off + (8 if (pc & 15) >= aux else 0)
SIGNAL = 4  # signal trampoline: rsp'=*(rsp+cfa_off), rip'=*(rsp+ra_off), rbp'=*(rsp+rbp_off)
END = 5  # return address undefined: outermost frame
UNSUPPORTED = 6  # anything else; aux says why
RA_REG = 7  # CFA = rsp + cfa_off, return address in register aux (rdi only: glibc's vfork)
# Go's systemstack, at its call on g0: the caller's frames go on from the goroutine's saved state,
# m.curg.sched (elf/gostack.py), through the thread's TLS slot of g.  The fields carry the binary's
# offsets: cfa_off g's slot from the fs base, aux g.m, rbp_off m.curg, rbp_kind g.sched.sp (pc at +8,
# bp at +48), ra_off the pc gosave_systemstack_switch stores in g.sched.pc (a vaddr: a sched holding
# another pc, or sp 0, is not this switch's, and the chain is flagged)
GO_SWITCH = 8
CFA_DEREF = 9  # CFA = *(rsp + cfa_off) + aux: an rsp kept in a slot (Go's asmcgocall on g0, callCgoMmap)
# Go's morestack, at its call of newstack on g0: the goroutine goes on *at* m.curg.sched -- pc (a
# return address into the function that called morestack), sp, bp -- as Go's traceback resumes
# there (elf/gostack.py).  cfa_off g's TLS slot, rbp_kind g.sched.sp, aux g.m | m.curg << 8 (the
# rule's 16-bit aux: both offsets below 256), rbp_off morestack's entry and ra_off morestack_noctxt's
# (vaddrs: the instruction before sched.pc must be a direct call of one of them, else the sched is
# not a morestack's and the chain is flagged)
GO_MORESTACK = 10
# Go's vDSO calls (nanotime1, time.now, walltime), over all their code that runs with m.vdsoPC and
# m.vdsoSP set (elf/gostack.read_vdso_switch): the caller goes on at pc = m.vdsoPC, rsp = m.vdsoSP (a
# return address, the slot below it holding that very value, else flagged), rbp lost.  cfa_off g's
# TLS slot, aux g.m, rbp_off m.vdsoSP, ra_off m.vdsoPC.
GO_VDSO = 11
#: CFA_RSP's aux flag: the return address is the caller's *interrupted* instruction, not a call's
#: return (Go's asyncPreempt, which a signal handler injects as if the function had called it): the
#: caller's pc is looked up as is, not at pc - 1
CALLER_EXACT = 1
#: CFA_RSP's aux flag: the function may set the thread's ``m.curg`` (Go's ``execute``, and
#: ``schedule``, which calls it): on a g0 chain through such a frame, the goroutine in m.curg may no
#: longer be the one that switched to g0, so a GO_SWITCH or GO_MORESTACK beyond it is not crossed
#: (GO_MORESTACK's chain ends there complete: the scheduler's g0 stack starts at that call)
GO_CURG_SET = 2
GO_CURG_SETTERS = frozenset({"runtime.execute", "runtime.schedule"})  # .gopclntab names
#: CFA_RSP's aux flag: the instructions right after a clone/clone3 ``syscall`` up to the parent's
#: ``ret`` (glibc's ``__clone``/``__clone3`` gap, Go's ``runtime.clone``), which the new thread runs
#: too, on its new stack, before it branches to its own code: there the row is the parent's only when
#: rax (the syscall's result) is not 0; in the child (rax 0) the thread has no caller, and a sample
#: of it at an interrupted instruction (a CPU sample) ends there, complete.  A syscall sample is
#: looked up inside the syscall instruction, which keeps the plain row.
CLONE_CHILD = 4
_CLONE_NRS = (0x38, 0x1B3)  # clone, clone3 (x86-64)
KIND_NAMES = {NONE: "none", CFA_RSP: "rsp", CFA_RBP: "rbp", PLT: "plt", SIGNAL: "signal", END: "end",
              UNSUPPORTED: "unsupported", RA_REG: "ra-in-reg", GO_SWITCH: "go-systemstack",
              CFA_DEREF: "deref-rsp", GO_MORESTACK: "go-morestack", GO_VDSO: "go-vdso"}

# rbp rules.
RBP_SAME = 0  # unchanged in the caller
RBP_AT_CFA = 1  # saved at CFA + rbp_off
RBP_UNDEF = 2  # not recoverable (undefined, in another register, an expression)
RBP_AT_SP = 3  # signal frames: saved at rsp + rbp_off

# Reasons for UNSUPPORTED (aux).
WHY_CFA_EXPR = 1
WHY_CFA_REG = 2
WHY_RA_RULE = 3
WHY_BAD_CFI = 4
WHY_STACK_SWITCH = 5  # a Go stack switch (go_fdes)

RSP, RBP, RDI, _RIP = 7, 6, 5, 16  # DWARF register numbers
T = TypeVar("T")


class Rule(NamedTuple):
    """One row of the table (see the module docstring for the meaning of each field)."""

    kind: int
    cfa_off: int = 0
    rbp_kind: int = RBP_SAME
    rbp_off: int = 0
    ra_off: int = -8
    aux: int = 0

    def describe(self) -> str:
        name = KIND_NAMES.get(self.kind, str(self.kind))
        if self.kind in (CFA_RSP, CFA_RBP):
            rbp = {RBP_SAME: "same", RBP_AT_CFA: f"c{self.rbp_off:+d}", RBP_UNDEF: "lost"}.get(
                self.rbp_kind, "?")
            return f"{name}{self.cfa_off:+d} ra=c{self.ra_off:+d} rbp={rbp}"
        return f"{name}(cfa_off={self.cfa_off}, rbp={self.rbp_kind}:{self.rbp_off}, ra={self.ra_off}, " \
               f"aux={self.aux})"


NO_CFI = Rule(NONE, 0, RBP_SAME, 0, 0, 0)


@dataclass(slots=True)
class UnwindTable:
    """Sorted rows of one ELF object: row i covers [starts[i], starts[i+1]) with rules[rule_ids[i]].

    Addresses are ELF virtual addresses.  The last row is always a NONE row (end of CFI)."""

    build_id: str | None
    path: str
    starts: array  # array('Q'), strictly increasing
    rule_ids: array  # array('H'), same length
    rules: list[Rule]
    fde_count: int = 0
    sources: tuple[str, ...] = ()

    def lookup(self, vaddr: int) -> Rule:
        i = bisect_right(self.starts, vaddr) - 1
        if i < 0:
            return NO_CFI
        return self.rules[self.rule_ids[i]]

    def __len__(self) -> int:
        return len(self.starts)

    def to_plain(self) -> dict[str, object]:
        return {"format": TABLE_FORMAT, "build_id": self.build_id, "path": self.path,
                "starts": self.starts.tobytes(), "rule_ids": self.rule_ids.tobytes(),
                "rules": [tuple(r) for r in self.rules], "fde_count": self.fde_count,
                "sources": list(self.sources)}

    @classmethod
    def from_plain(cls, d: dict[str, object]) -> UnwindTable:
        starts = array("Q")
        starts.frombytes(d["starts"])  # type: ignore[arg-type]
        rule_ids = array("H")
        rule_ids.frombytes(d["rule_ids"])  # type: ignore[arg-type]
        return cls(d["build_id"], str(d["path"]), starts, rule_ids,  # type: ignore[arg-type]
                   [Rule(*r) for r in d["rules"]],  # type: ignore[attr-defined]
                   int(d["fde_count"]), tuple(d["sources"]))  # type: ignore[call-overload,arg-type]


# ------------------------------------------------------------------------------------- parsing
class _State:
    """Register rules of the CFI interpreter that the table needs (CFA, rbp, return address)."""

    __slots__ = ("cfa_off", "cfa_reg", "cfa_special", "ra", "rbp")

    def __init__(self) -> None:
        self.cfa_reg = RSP
        self.cfa_off = 8
        self.cfa_special: tuple[int, ...] | None = None  # (PLT, k, n) | (SIGNAL, k) | (UNSUPPORTED,)
        # rules: ("same",) ("undef",) ("cfa", off) ("sp", off) ("reg", dwarf_reg; rip only) ("other",)
        self.rbp: tuple[str, int] = ("same", 0)
        self.ra: tuple[str, int] = ("cfa", -8)

    def copy(self) -> _State:
        s = _State()
        s.cfa_reg, s.cfa_off, s.cfa_special, s.rbp, s.ra = (self.cfa_reg, self.cfa_off, self.cfa_special,
                                                            self.rbp, self.ra)
        return s

    def rule(self, signal: bool) -> Rule:
        sp = self.cfa_special
        if sp is not None:
            if sp[0] == SIGNAL and self.ra[0] == "sp":
                rbp_kind, rbp_off = (RBP_AT_SP, self.rbp[1]) if self.rbp[0] == "sp" else (RBP_UNDEF, 0)
                return Rule(SIGNAL, sp[1], rbp_kind, rbp_off, self.ra[1], 0)
            if sp[0] == PLT and self.ra == ("cfa", -8):
                return Rule(PLT, sp[1], RBP_SAME if self.rbp[0] == "same" else RBP_UNDEF, 0, -8, sp[2])
            return Rule(UNSUPPORTED, aux=WHY_CFA_EXPR)
        if self.ra[0] == "undef":
            return Rule(END, 0, RBP_SAME, 0, 0, 0)
        if self.ra == ("reg", RDI) and self.cfa_reg == RSP and self.rbp[0] == "same":
            # glibc's vfork pops its return address into rdi before the syscall (the child must not
            # find it overwritten on the shared stack); the innermost frame of a syscall sample has rdi
            return Rule(RA_REG, self.cfa_off, RBP_SAME, 0, 0, RDI)
        if self.ra[0] != "cfa":
            return Rule(UNSUPPORTED, aux=WHY_RA_RULE)
        if self.cfa_reg == RSP:
            kind = CFA_RSP
        elif self.cfa_reg == RBP:
            kind = CFA_RBP
        else:
            return Rule(UNSUPPORTED, aux=WHY_CFA_REG)
        rk, ro = self.rbp
        if rk == "same":
            return Rule(kind, self.cfa_off, RBP_SAME, 0, self.ra[1], 0)
        if rk == "cfa":
            return Rule(kind, self.cfa_off, RBP_AT_CFA, ro, self.ra[1], 0)
        return Rule(kind, self.cfa_off, RBP_UNDEF, 0, self.ra[1], 0)


def _classify_cfa_expr(expr: bytes) -> tuple[int, ...]:
    """Recognise the two CFA expressions x86-64 code uses in practice."""
    try:
        if expr and expr[0] == 0x77:  # DW_OP_breg7 (rsp)
            k, pos = sleb(expr, 1)
            rest = expr[pos:]
            if rest == b"\x06":  # deref: signal frame, CFA = *(rsp + k)
                return (SIGNAL, k)
            # breg16 0; lit15; and; lit<n>; ge; lit3; shl; plus  -- the lazy-binding PLT
            if (len(rest) == 9 and rest[0] == 0x80 and rest[1] == 0x00 and rest[2] == 0x3F
                    and rest[3] == 0x1A and 0x30 <= rest[4] <= 0x4F and rest[5:] == b"\x2a\x33\x24\x22"):
                return (PLT, k, rest[4] - 0x30)
    except IndexError:
        pass
    return (UNSUPPORTED,)


def _sp_expr(expr: bytes) -> tuple[str, int]:
    """``DW_OP_breg7 k`` (register saved at rsp + k, as in signal frames), else 'other'."""
    if expr and expr[0] == 0x77:
        try:
            k, pos = sleb(expr, 1)
        except IndexError:
            return ("other", 0)
        if pos == len(expr):
            return ("sp", k)
    return ("other", 0)


class _StopAtAdvance(Exception):
    """Raised by an emit that wants the state at the first advance only."""


def _execute(buf: bytes, pos: int, end: int, st: _State, cie: Cie, init: _State | None, loc: int,
             emit_row: Callable[[int, _State], None] | None, sec_vaddr: int, is_eh: bool) -> int:
    """Run CFI instructions [pos, end) on ``st``; at each advance, ``emit_row(loc, st)`` with the
    state of the row that ends there.  Returns the final loc.  ValueError on an unknown opcode
    (``st`` then holds the state so far)."""
    stack: list[_State] = []
    ca, da = cie.code_align, cie.data_align
    enc = cie.fde_encoding

    def emit(_at: int) -> None:
        if emit_row is not None:
            emit_row(loc, st)

    while pos < end:
        op = buf[pos]
        pos += 1
        hi = op & 0xC0
        low = op & 0x3F
        if hi == 0x40:  # advance_loc
            emit(loc)
            loc += low * ca
            continue
        if hi == 0x80:  # offset(reg) uleb*da
            v, pos = uleb(buf, pos)
            _set_reg(st, low, ("cfa", v * da))
            continue
        if hi == 0xC0:  # restore(reg)
            if init is not None:
                _restore_reg(st, init, low)
            continue
        if op == 0x00:  # nop
            continue
        if op == 0x02:
            emit(loc)
            loc += buf[pos] * ca
            pos += 1
        elif op == 0x03:
            emit(loc)
            loc += struct.unpack_from("<H", buf, pos)[0] * ca
            pos += 2
        elif op == 0x04:
            emit(loc)
            loc += struct.unpack_from("<I", buf, pos)[0] * ca
            pos += 4
        elif op == 0x01:  # set_loc
            emit(loc)
            if is_eh:
                loc, pos = read_encoded(buf, pos, enc, sec_vaddr + pos)
            else:
                loc = struct.unpack_from("<Q", buf, pos)[0]
                pos += 8
        elif op == 0x0C:  # def_cfa
            st.cfa_reg, pos = uleb(buf, pos)
            st.cfa_off, pos = uleb(buf, pos)
            st.cfa_special = None
        elif op == 0x0D:  # def_cfa_register
            st.cfa_reg, pos = uleb(buf, pos)
            st.cfa_special = None
        elif op == 0x0E:  # def_cfa_offset
            st.cfa_off, pos = uleb(buf, pos)
        elif op == 0x12:  # def_cfa_sf
            st.cfa_reg, pos = uleb(buf, pos)
            v, pos = sleb(buf, pos)
            st.cfa_off = v * da
            st.cfa_special = None
        elif op == 0x13:  # def_cfa_offset_sf
            v, pos = sleb(buf, pos)
            st.cfa_off = v * da
        elif op == 0x0F:  # def_cfa_expression
            n, pos = uleb(buf, pos)
            st.cfa_special = _classify_cfa_expr(buf[pos:pos + n])
            pos += n
        elif op == 0x05:  # offset_extended reg, uleb
            r, pos = uleb(buf, pos)
            v, pos = uleb(buf, pos)
            _set_reg(st, r, ("cfa", v * da))
        elif op == 0x11:  # offset_extended_sf reg, sleb
            r, pos = uleb(buf, pos)
            v, pos = sleb(buf, pos)
            _set_reg(st, r, ("cfa", v * da))
        elif op == 0x2F:  # GNU_negative_offset_extended
            r, pos = uleb(buf, pos)
            v, pos = uleb(buf, pos)
            _set_reg(st, r, ("cfa", -v * da))
        elif op == 0x06:  # restore_extended
            r, pos = uleb(buf, pos)
            if init is not None:
                _restore_reg(st, init, r)
        elif op == 0x07:  # undefined
            r, pos = uleb(buf, pos)
            _set_reg(st, r, ("undef", 0))
        elif op == 0x08:  # same_value
            r, pos = uleb(buf, pos)
            _set_reg(st, r, ("same", 0))
        elif op == 0x09:  # register reg, reg2
            r, pos = uleb(buf, pos)
            r2, pos = uleb(buf, pos)
            _set_reg(st, r, ("same", 0) if r == r2 else ("reg", r2) if r == _RIP else ("other", 0))
        elif op == 0x0A:  # remember_state
            stack.append(st.copy())
        elif op == 0x0B:  # restore_state (the CFA is part of the saved state)
            if stack:
                s = stack.pop()
                st.cfa_reg, st.cfa_off, st.cfa_special, st.rbp, st.ra = (s.cfa_reg, s.cfa_off, s.cfa_special,
                                                                         s.rbp, s.ra)
        elif op == 0x10:  # expression reg, block
            r, pos = uleb(buf, pos)
            n, pos = uleb(buf, pos)
            _set_reg(st, r, _sp_expr(buf[pos:pos + n]))
            pos += n
        elif op == 0x16:  # val_expression reg, block
            r, pos = uleb(buf, pos)
            n, pos = uleb(buf, pos)
            _set_reg(st, r, ("other", 0))
            pos += n
        elif op in (0x14, 0x15):  # val_offset(_sf)
            r, pos = uleb(buf, pos)
            _, pos = (uleb if op == 0x14 else sleb)(buf, pos)
            _set_reg(st, r, ("other", 0))
        elif op == 0x2E:  # GNU_args_size
            _, pos = uleb(buf, pos)
        else:
            raise ValueError(f"unknown DW_CFA opcode {op:#x}")
    return loc


def _set_reg(st: _State, reg: int, rule: tuple[str, int]) -> None:
    if reg == RBP:
        st.rbp = rule
    elif reg == _RIP:
        st.ra = rule


def _restore_reg(st: _State, init: _State, reg: int) -> None:
    if reg == RBP:
        st.rbp = init.rbp
    elif reg == _RIP:
        st.ra = init.ra


Fde = tuple[int, int, list[tuple[int, Rule]]]


def _frames(buf: bytes, section_vaddr: int, is_eh: bool) -> Iterator[tuple[Cie, _State, FdeHeader]]:
    """Every FDE of one section with its CIE and the state after the CIE's initial instructions."""
    cies: dict[int, Cie] = {}
    inits: dict[int, _State] = {}
    for fde in iter_fdes(buf, section_vaddr, is_eh, cies):
        cie = cies[fde.cie_offset]
        init = inits.get(fde.cie_offset)
        if init is None:
            init = inits[fde.cie_offset] = _State()
            _execute(buf, cie.init_pos, cie.init_end, init, cie, None, 0, None, section_vaddr, is_eh)
        yield cie, init, fde


def _rows(buf: bytes, section_vaddr: int, is_eh: bool, cie: Cie, init: _State, fde: FdeHeader,
          project: Callable[[_State], T]) -> list[tuple[int, T]]:
    """One FDE's rows (address, ``project(state)``) in order."""
    st = init.copy()
    rows: list[tuple[int, T]] = []
    loc = _execute(buf, fde.insn_pos, fde.end, st, cie, init, fde.pc_begin,
                   lambda at, state: rows.append((at, project(state))), section_vaddr, is_eh)
    rows.append((loc, project(st)))
    return rows


def _rule_of(signal: bool) -> Callable[[_State], Rule]:
    return lambda st: st.rule(signal)


def parse_frames(buf: bytes, section_vaddr: int, is_eh: bool) -> tuple[list[Fde], int]:
    """Every FDE of one section as (pc_begin, pc_end, rows); rows are (address, rule) in order.
    :class:`CfiError` if any record cannot be read (a table with holes would unwind wrongly)."""
    fdes: list[Fde] = []
    count = 0
    with cfi_errors(".eh_frame" if is_eh else ".debug_frame"):
        for cie, init, fde in _frames(buf, section_vaddr, is_eh):
            count += 1
            if fde.pc_range > 0:
                rows = _rows(buf, section_vaddr, is_eh, cie, init, fde, _rule_of(cie.signal))
                fdes.append((fde.pc_begin, fde.pc_begin + fde.pc_range, rows))
    return fdes, count


# --------------------------------------------------------------------- function entries (callgraph)
@dataclass(frozen=True, slots=True)
class FdeRange:
    start: int
    end: int
    entry: bool  # CFA == rsp+8 at start: a function entered by call (or a signal trampoline)
    signal_frame: bool  # CIE augmentation 'S'


def fde_ranges(buf: bytes, section_vaddr: int) -> list[FdeRange]:
    """Every FDE range of one ``.eh_frame`` section, each with whether it is a function *entry*: at
    its first address (before the first advance) the CFA is still ``rsp + 8``, the return address
    just pushed by a call.  gcc's split-off cold parts (``foo.cold``) instead start mid-frame with a
    ``DW_CFA_def_cfa_offset`` at location 0: they are *fragments* of another function.
    :class:`CfiError` if the entries themselves cannot be read."""

    def stop(_at: int, _st: _State) -> None:
        raise _StopAtAdvance

    out: list[FdeRange] = []
    with cfi_errors(".eh_frame"):
        for cie, init, fde in _frames(buf, section_vaddr, True):
            if fde.pc_range <= 0:
                continue
            st = init.copy()
            with contextlib.suppress(_StopAtAdvance, *MALFORMED):  # bad instructions: the state read so far
                _execute(buf, fde.insn_pos, fde.end, st, cie, init, fde.pc_begin, stop, section_vaddr, True)
            entry = cie.signal or (st.cfa_special is None and (st.cfa_reg, st.cfa_off) == (RSP, 8))
            out.append(FdeRange(fde.pc_begin, fde.pc_begin + fde.pc_range, entry, cie.signal))
    return out


# ---------------------------------------------------------------- CFA at addresses (probe plans)
@dataclass(frozen=True, slots=True)
class CfaRule:
    """CFA = value of DWARF register ``reg`` (7 = rsp, 6 = rbp) + ``offset``."""

    reg: int
    offset: int


def _cfa(st: _State) -> CfaRule | None:
    return CfaRule(st.cfa_reg, st.cfa_off) if st.cfa_special is None else None


def cfa_rules(eh_frame: bytes, section_vaddr: int, addresses: Iterable[int]) -> dict[int, CfaRule | None]:
    """CFA rule at each address; None where no FDE covers it or the CFA is a DWARF expression.
    Only the FDEs that contain a queried address are interpreted; :class:`CfiError` if the entries
    themselves cannot be read."""
    with cfi_errors(".eh_frame"):
        frames = sorted(((f.pc_begin, f.pc_begin + f.pc_range, cie, init, f)
                         for cie, init, f in _frames(eh_frame, section_vaddr, True) if f.pc_range > 0),
                        key=lambda x: x[0])
    starts = [f[0] for f in frames]
    out: dict[int, CfaRule | None] = {}
    tables: dict[int, tuple[list[int], list[CfaRule | None]]] = {}
    for addr in addresses:
        i = bisect_right(starts, addr) - 1
        if i < 0 or addr >= frames[i][1]:
            out[addr] = None
            continue
        table = tables.get(i)
        if table is None:
            _, _, cie, init, fde = frames[i]
            try:
                rows = _rows(eh_frame, section_vaddr, True, cie, init, fde, _cfa)
            except MALFORMED:
                rows = []  # undecodable CFI: no rule (the site is probed without a CFA)
            table = tables[i] = ([r[0] for r in rows], [r[1] for r in rows])
        j = bisect_right(table[0], addr) - 1
        out[addr] = table[1][j] if j >= 0 else None
    return out


# ------------------------------------------------------------------------------ table building
def _compact(fdes: list[Fde]) -> tuple[array, array, list[Rule]]:
    """Merge FDE rows into one sorted table; NONE rows cover the gaps between FDEs."""
    fdes.sort(key=lambda f: (f[0], -f[1]))
    rule_index: dict[Rule, int] = {NO_CFI: 0}
    rules: list[Rule] = [NO_CFI]
    starts = array("Q")
    ids = array("H")
    covered_to = 0

    def put(addr: int, rule: Rule) -> None:
        rid = rule_index.get(rule)
        if rid is None:
            rid = rule_index[rule] = len(rules)
            rules.append(rule)
            if rid > 0xFFFF:
                raise ValueError("more than 65535 distinct unwind rules")
        if starts and starts[-1] == addr:
            ids[-1] = rid
            if len(ids) > 1 and ids[-2] == rid:
                starts.pop()
                ids.pop()
            return
        if ids and ids[-1] == rid:
            return
        starts.append(addr)
        ids.append(rid)

    for lo, hi, rows in fdes:
        if hi <= covered_to:
            continue  # entirely inside an earlier FDE (duplicate); the first one wins
        lo = max(lo, covered_to)
        if starts and lo > covered_to:
            put(covered_to, NO_CFI)
        for i, (loc, rule) in enumerate(rows):
            nxt = rows[i + 1][0] if i + 1 < len(rows) else hi
            if nxt <= lo or loc >= hi:
                continue
            put(max(loc, lo), rule)
        covered_to = hi
    if starts:
        put(covered_to, NO_CFI)
    return starts, ids, rules


def build_table(image: ElfImage) -> UnwindTable:
    """Parse ``.eh_frame`` (and ``.debug_frame`` for ranges it does not cover) of one object;
    :class:`BinaryError` if either cannot be read."""
    try:
        return _build_table(image)
    except CfiError as exc:
        raise BinaryError(image.path, str(exc)) from None


def _build_table(image: ElfImage) -> UnwindTable:
    fdes: list[Fde] = []
    sources: list[str] = []
    count = 0
    eh = image.sections.get(".eh_frame")
    if eh is not None and eh.type != "SHT_NOBITS" and eh.size:
        got, c = parse_frames(image.section_bytes(eh), eh.vaddr, True)
        fdes.extend(got)
        count += c
        sources.append(".eh_frame")
    # Go's functions from .gopclntab (the tables its linker derives .debug_frame from, present even
    # in stripped binaries) before .debug_frame, which for Go code says rbp is unchanged where it is not
    eh_ranges = sorted((lo, hi) for lo, hi, _ in fdes)
    go = [f for f in go_fdes(image) if not _overlaps(eh_ranges, f[0], f[1])]
    if go:
        fdes.extend(go)
        count += len(go)
        sources.append(".gopclntab")
    dbg = image.sections.get(".debug_frame") or image.sections.get(".zdebug_frame")
    dbg_bytes = b""
    if dbg is not None and dbg.type != "SHT_NOBITS" and dbg.size:
        try:
            dbg_bytes = image.section_bytes(dbg)  # compressed in Go binaries and -gz builds
        except CompressedSectionError as exc:
            if not exc.unsupported:
                raise BinaryError(image.path, str(exc)) from None
            # (a zstd section without the module: its code unwinds as if it had no CFI, flagged)
    if dbg_bytes:
        got, c = parse_frames(dbg_bytes, 0, False)
        # .eh_frame (and .gopclntab) win where both describe an address: append after, and _compact
        # keeps the first.
        known = sorted((lo, hi) for lo, hi, _ in fdes)
        fdes.extend(f for f in got if not _overlaps(known, f[0], f[1]))
        count += c
        sources.append(".debug_frame")
    fdes.extend(_fallthrough_gaps(image, fdes))
    starts, ids, rules = _compact(fdes)
    return UnwindTable(image.build_id(), image.path, starts, ids, rules, count, tuple(sources))


#: the signal return trampoline's code, ``mov $15, %rax; syscall`` (rt_sigreturn): Go's
#: runtime.sigreturn is written to look exactly like glibc's __restore_rt, which gdb and libgcc
#: recognise by these bytes; at it, rsp points at the kernel's ucontext
SIGRETURN_CODE = bytes.fromhex("48c7c00f0000000f05")
#: the kernel's x86-64 rt_sigframe, ucontext at rsp: uc_mcontext at +40, its rbp +80, rsp +120, rip
#: +128 (what glibc's __restore_rt's CFI says, tests/test_elf_gopclntab.py)
KERNEL_SIGFRAME = Rule(SIGNAL, 160, RBP_AT_SP, 120, 168, 0)
GO_ASYNC_PREEMPT = "runtime.asyncPreempt"

#: a return address in a Go function that switches stacks (SPWRITE): what the stack holds above it
#: is not its caller's (Go's own traceback stops there too)
STACK_SWITCH = Rule(UNSUPPORTED, aux=WHY_STACK_SWITCH)
GO_CLONE = "runtime.clone"  # .gopclntab name
#: Go functions whose code on the other stack is that stack's outermost frame, so a chain that
#: reaches it there ends, complete (:func:`_with_stack_switches`' ``ends_stack``):
#: * ``mcall`` switches to g0 at ``g0.sched.sp`` (the base mstart1 left) and calls a function that
#:   never returns (``park_m``, ``goexit0``, ...: the scheduler).  Delve, Go's debugger, ends a g0
#:   stack there, as at ``goexit`` and ``rt0_go`` ("top of stack" functions);
#: * ``clone``'s child: after the syscall returns 0 it moves rsp to the new thread's stack top
#:   (``newosproc`` passes ``g0.stack.hi``), makes its first syscall (``gettid``) there and calls
#:   ``mstart``: the new thread has no frame above it, as glibc's clone child (whose CFI says
#:   "return address undefined").
#: Other switches (``systemstack``, ``morestack``, ``asmcgocall``, the vDSO calls) return to, or
#: resume, a goroutine whose frames are the chain's outer part: crossed where their code is
#: understood (GO_SWITCH, GO_MORESTACK, GO_VDSO, CFA_DEREF), else flagged.
GO_STACK_TOP_SWITCHERS = frozenset({"runtime.mcall", GO_CLONE})
_GO_END = Rule(END, 0, RBP_SAME, 0, 0, 0)


def go_fdes(image: ElfImage) -> list[Fde]:
    """One FDE per Go function of ``.gopclntab`` (none when the object has no readable one).

    Per pc, from its ``pcsp`` offset d: CFA = rsp + d + 8, the return address at CFA - 8 -- what
    the Go linker writes into ``.debug_frame`` -- and rbp unchanged while d is 0 but *lost* once the
    function has a frame (Go saves and re-points rbp in its frames, which its ``.debug_frame`` does
    not say: only a C frame above Go frames needs rbp, and it is then flagged, not walked wrongly).
    A function Go marks as a stack's outermost (TOPFRAME: ``runtime.goexit``, ``mstart``,
    ``rt0_go``, ``sigtramp``) ends the chain there, as Go's tracebacks do.  A return address in a
    function that switches stacks (SPWRITE: ``systemstack``, ``mcall``, ``morestack``,
    ``asmcgocall``, ...) is :data:`STACK_SWITCH` (at the call's last byte, where the unwinders look
    a return address up): beyond it is another stack -- except in ``mcall`` and ``clone``, whose
    code on the other stack is that stack's outermost frame (:data:`GO_STACK_TOP_SWITCHERS`)."""
    try:
        funcs = read_go_functions(image)
    except (GoTableError, struct.error, BinaryError, ValueError):
        return []
    by_name = {f.name: f for f in funcs}
    switch = read_systemstack(image, by_name, {f.entry: f for f in funcs})
    morestack = None if switch is None else read_morestack(image, by_name, switch)
    out: list[Fde] = []
    for fn in funcs:
        if not fn.sp_offsets or fn.end <= fn.entry:
            continue
        if fn.flag & FUNC_FLAG_TOPFRAME:
            out.append((fn.entry, fn.end, [(fn.entry, _GO_END)]))
            continue
        if image.bytes_at(fn.entry, len(SIGRETURN_CODE)) == SIGRETURN_CODE:
            out.append((fn.entry, fn.end, [(fn.entry, KERNEL_SIGFRAME)]))
            continue
        flags = (CALLER_EXACT if fn.name == GO_ASYNC_PREEMPT else 0) | \
            (GO_CURG_SET if fn.name in GO_CURG_SETTERS else 0)
        rows = {lo: (Rule(CFA_RSP, d + 8, RBP_SAME if d == 0 else RBP_UNDEF, 0, -8, flags) if d >= 0
                     else Rule(UNSUPPORTED, aux=WHY_BAD_CFI)) for lo, _, d in fn.sp_offsets}
        if fn.flag & FUNC_FLAG_SPWRITE:
            call_end = None if switch is None else switch_call_end(image, fn, switch)
            calls = {end: Rule(CFA_DEREF, k, RBP_SAME if addend == 8 else RBP_UNDEF, 0, -8, addend)
                     for end, (k, addend) in saved_sp_calls(image, fn).items() if addend < 256}
            if switch is not None and call_end is not None:
                calls[call_end] = go_switch_rule(switch)
            if switch is not None and morestack is not None and fn.entry == morestack.morestack:
                calls[morestack.call_end] = go_morestack_rule(switch, morestack)
            rows = _with_stack_switches(image, fn.entry, fn.end, rows,
                                        ends_stack=fn.name in GO_STACK_TOP_SWITCHERS, calls=calls)
            vdso = None if switch is None else read_vdso_switch(image, fn, switch)
            if switch is not None and vdso is not None:
                rows = _overlay(rows, fn.entry, fn.end, vdso.ranges, go_vdso_rule(switch, vdso))
            if fn.name == GO_CLONE:
                rows = _flag_clone_child(image, fn.entry, fn.end, rows)
        out.append((fn.entry, fn.end, sorted(rows.items())))
    return out


def go_switch_rule(switch: GoSystemStack) -> Rule:
    """The :data:`GO_SWITCH` row of systemstack's call on g0 (see there for the fields)."""
    return Rule(GO_SWITCH, switch.tls_g, switch.sched_sp, switch.m_curg, switch.switch_pc, switch.g_m)


def go_morestack_rule(switch: GoSystemStack, morestack: GoMorestack) -> Rule:
    """The :data:`GO_MORESTACK` row of morestack's call of newstack on g0 (see there for the fields)."""
    return Rule(GO_MORESTACK, switch.tls_g, switch.sched_sp, morestack.morestack, morestack.noctxt,
                switch.g_m | switch.m_curg << 8)


def go_vdso_rule(switch: GoSystemStack, vdso: GoVdsoSwitch) -> Rule:
    """The :data:`GO_VDSO` row of a vDSO call's code (see there for the fields)."""
    return Rule(GO_VDSO, switch.tls_g, RBP_UNDEF, vdso.vdso_sp, vdso.vdso_pc, switch.g_m)


def _bytewise(rows: dict[int, Rule], lo: int, hi: int) -> list[Rule]:
    """The rule of each byte of [lo, hi) (``rows``: start -> rule, the first at ``lo``)."""
    starts = sorted(rows)
    return [rows[starts[bisect_right(starts, pc) - 1]] for pc in range(lo, hi)]


def _rows_of(per_byte: list[Rule], lo: int) -> dict[int, Rule]:
    """:func:`_bytewise`'s inverse: a row where the rule changes."""
    return {lo + i: r for i, r in enumerate(per_byte) if i == 0 or r != per_byte[i - 1]}


def _flag_clone_child(image: ElfImage, lo: int, hi: int, rows: dict[int, Rule]) -> dict[int, Rule]:
    """``rows`` of Go's runtime.clone [lo, hi) with :data:`CLONE_CHILD` on the CFA_RSP rows of its
    child window (:func:`_clone_child_window`), if its code has one."""
    try:
        md = x86_64()
        insns = list(md.disasm_lite(image.bytes_at(lo, hi - lo), lo))
        windows = (_clone_child_window(md, image.bytes_at(insns[i][0], hi - insns[i][0]), insns[i][0],
                                       insns[i - 1])
                   for i in range(1, len(insns)) if insns[i][2] == "syscall")
        window = next((w for w in windows if w is not None), None)
    except (OSError, BinaryError, ValueError, KeyError, IndexError):
        return rows
    if window is None:
        return rows
    per_byte = _bytewise(rows, lo, hi)
    for pc in range(window[0], window[1]):
        r = per_byte[pc - lo]
        if r.kind == CFA_RSP:
            per_byte[pc - lo] = r._replace(aux=r.aux | CLONE_CHILD)
    # the child's own code starts after the parent's ret, with its move of rsp to the stack it
    # already has (the kernel set it): that instruction is the child's too, and ends the chain
    child = next((i for i in insns if i[0] == window[1]), None)
    if child is not None and child[2] == "mov" and child[3].startswith("rsp,"):
        per_byte[child[0] - lo:child[0] + child[1] - lo] = [_GO_END] * child[1]
    return _rows_of(per_byte, lo)


def _overlay(rows: dict[int, Rule], lo: int, hi: int, ranges: tuple[tuple[int, int], ...],
             rule: Rule) -> dict[int, Rule]:
    """``rows`` of [lo, hi) with ``rule`` over ``ranges`` (within it)."""
    per_byte = _bytewise(rows, lo, hi)
    for a, b in ranges:
        per_byte[max(a, lo) - lo:min(b, hi) - lo] = [rule] * (min(b, hi) - max(a, lo))
    return _rows_of(per_byte, lo)


def _with_stack_switches(image: ElfImage, lo: int, hi: int, rows: dict[int, Rule], *,
                         ends_stack: bool = False, calls: dict[int, Rule] | None = None) -> dict[int, Rule]:
    """The rows of a stack-switching Go function [lo, hi) with :data:`STACK_SWITCH` where pcsp's
    rows do not hold: every byte after an instruction that loads rsp from elsewhere (``mov rsp,
    ...``: onto the other stack) up to the next one (back) included -- until that one has run, rsp is
    still the other stack's -- in address order (Go's assembly places a
    branch's other path after it: ``clone``'s child after the parent's ``ret``); and the last byte of
    every call, where the unwinders look its return address up (the call's target runs on the other
    stack, or is a helper such as ``gosave_systemstack_switch``: flagged, never walked past).
    ``ends_stack``: the code on the other stack, and its calls, end the chain there instead (END:
    ``mcall``, ``clone``'s child).  ``calls``: a call's last byte -> its rule, where the call is
    understood: systemstack's (and asmcgocall's) call on g0, which :data:`GO_SWITCH` crosses, and
    asmcgocall's call on the same stack after realigning it (:data:`CFA_DEREF`).
    The decoding is linear (capstone): Go's assembly holds no data in its code."""
    per_byte = _bytewise(rows, lo, hi)
    switched = False
    try:
        code = image.bytes_at(lo, hi - lo)
        for addr, size, mnemonic, ops in x86_64().disasm_lite(code, lo):
            if mnemonic == "mov" and ops.startswith("rsp,"):
                if switched:  # back: until it has run, rsp is still the other stack's
                    per_byte[addr - lo:addr - lo + size] = [_GO_END if ends_stack else STACK_SWITCH] * size
                switched = not switched
            elif switched:
                per_byte[addr - lo:addr - lo + size] = [_GO_END if ends_stack else STACK_SWITCH] * size
            if mnemonic == "call":
                last = addr + size - 1
                per_byte[last - lo] = calls[last] if calls and last in calls else \
                    _GO_END if switched and ends_stack else STACK_SWITCH
    except (OSError, BinaryError, ValueError, KeyError, IndexError):
        return {lo: STACK_SWITCH}  # not decodable: nothing of it is trusted
    return _rows_of(per_byte, lo)


_GAP_MAX = 256  # bytes of code without an FDE that _fallthrough_gaps considers
_PREV_MAX = 4096  # bytes of the preceding FDE it decodes to find that FDE's last instruction
_FRAME_REGS = frozenset({"rsp", "esp", "sp", "spl", "rbp", "ebp", "bp", "bpl"})
_PADDING = frozenset({"nop", "int3", "xchg"})
_NO_FALLTHROUGH = frozenset({"ret", "jmp", "call", "ud2", "hlt", "int3", "iretq", "sysret", "ljmp"})


def _fallthrough_gaps(image: ElfImage, fdes: list[Fde]) -> list[Fde]:
    """Rows for code that an FDE *falls through* into and that no FDE covers.

    glibc's ``clone``/``clone3`` close their FDE just before the ``syscall`` (``cfi_endproc``: in the
    child the parent's CFI would be wrong) and open the child's FDE after the parent's ``ret``, so the
    parent's pc at that syscall -- every ``pthread_create`` and ``posix_spawn`` -- lies in no FDE
    (libunwind stops there; gdb unwinds it by prologue analysis).  The state there is the preceding
    FDE's last row, as long as the code in between changes neither rsp nor rbp nor a stack slot: so
    a gap gets that row when (1) the preceding FDE's last instruction falls through into it, (2) the
    gap's instructions, decoded exactly up to a ``ret``/``jmp`` or the next FDE, write no rsp/rbp and
    address no memory through them, and (3) that row is a plain rsp/rbp rule.  Padding-only gaps
    (between functions) and anything else stay NONE."""
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs, CsError

    md = Cs(CS_ARCH_X86, CS_MODE_64)
    md.detail = True
    out: list[Fde] = []
    ordered = sorted(fdes, key=lambda f: (f[0], -f[1]))
    for (lo, hi, rows), nxt in pairwise(ordered):
        gap_end = nxt[0]
        if not rows or not hi < gap_end <= hi + _GAP_MAX or hi - lo > _PREV_MAX:
            continue
        # the state after the FDE's last instruction: its last row at or before hi (a row *at* hi,
        # outside the range, is the effect of that instruction)
        last = next((rule for loc, rule in reversed(rows) if loc <= hi), NO_CFI)
        if last.kind not in (CFA_RSP, CFA_RBP):
            continue
        try:
            code = image.bytes_at(hi, gap_end - hi)
            first = next(md.disasm_lite(code, hi, 1), None)
            if first is None or first[2] in _PADDING:
                continue  # padding between functions (most gaps): never executed
            end = _gap_code_end(md, code, hi)
            if end is None or end == hi:
                continue
            prev = list(md.disasm_lite(image.bytes_at(lo, hi - lo), lo))
        except (CsError, BinaryError, ValueError, KeyError):
            continue
        if not prev or prev[-1][0] + prev[-1][1] != hi or prev[-1][2] in _NO_FALLTHROUGH | _PADDING:
            continue
        rows = [(hi, last)]
        window = _clone_child_window(md, code, hi, prev[-1])
        if window is not None:
            rows.append((window[0], last._replace(aux=last.aux | CLONE_CHILD)))
            if window[1] < end:
                rows.append((window[1], last))
        out.append((hi, end, rows))
    return out


def _clone_child_window(md: object, code: bytes, at: int,
                        before: tuple[int, int, str, str]) -> tuple[int, int] | None:
    """[lo, hi) of the instructions a clone's child runs with the parent's row, when the code at
    ``at`` is a ``syscall`` that ``before`` (the instruction preceding it) made a clone or clone3:
    from after the syscall up to and including the parent's ``ret``, none of them writing rsp or
    calling (:data:`CLONE_CHILD`); else None."""
    m = re.fullmatch(r"eax, (0x[0-9a-f]+|\d+)", before[3]) if before[2] == "mov" else None
    if m is None or int(m.group(1), 0) not in _CLONE_NRS:
        return None
    insns = list(md.disasm_lite(code, at))  # type: ignore[attr-defined]
    if not insns or insns[0][2] != "syscall":
        return None
    lo = insns[0][0] + insns[0][1]
    for addr, size, mnem, ops in insns[1:]:
        if mnem in ("call", "jmp") or ops.startswith("rsp") or ops.startswith("rbp"):
            return None
        if mnem == "ret":
            return lo, addr + size
    return None


def _gap_code_end(md: object, code: bytes, at: int) -> int | None:
    """Where the gap's code that keeps the frame ends (after its ``ret``/``jmp``, or the gap's end);
    None if an instruction changes the frame or the bytes do not decode exactly."""
    end = at
    for insn in md.disasm(code, at):  # type: ignore[attr-defined]
        if insn.mnemonic in _PADDING:
            return end if end > at else None  # padding after the code
        _, written = insn.regs_access()
        terminator = insn.mnemonic in ("ret", "jmp")
        frame_mem = "[rsp" in insn.op_str or "[rbp" in insn.op_str
        if frame_mem or (insn.mnemonic in _NO_FALLTHROUGH and not terminator):
            return None
        if not terminator and any(insn.reg_name(r) in _FRAME_REGS for r in written):
            return None
        end = insn.address + insn.size
        if terminator:
            return end
    return end if end == at + len(code) else None


def _overlaps(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    i = bisect_right(ranges, (lo, 1 << 64)) - 1
    if i >= 0 and ranges[i][1] > lo:
        return True
    return i + 1 < len(ranges) and ranges[i + 1][0] < hi


def cache_key(image: ElfImage) -> str:
    """The content hash (shared by every copy of the object, at any path; an edited object may keep
    its build-id and size but not its hash)."""
    return f"h{image.content_hash}"


def cached_table(content_hash: str, path: str, cache: AnalysisCache) -> UnwindTable | None:
    """The cached unwind table of the object whose content hash is ``content_hash`` (None: not
    cached), without reading the object: a caller that knows the hash (kept by file identity)
    skips parsing it at all."""
    plain = cache.load(CACHE_KIND, f"h{content_hash}")
    if isinstance(plain, dict) and plain.get("format") == TABLE_FORMAT:
        try:
            table = UnwindTable.from_plain(plain)
            table.path = path
            return table
        except (KeyError, TypeError, ValueError, IndexError):
            pass  # an entry of the right format but not a table: a miss
    return None


def load_table(path: str | os.PathLike[str], cache: AnalysisCache | None = None,
               image: ElfImage | None = None) -> UnwindTable:
    """The unwind table of the ELF at ``path``, from the cache when it has it (:class:`BinaryError`
    for a file or CFI that cannot be read)."""
    img = image if image is not None else ElfImage(os.fspath(path))
    cache = cache if cache is not None else AnalysisCache()
    key = cache_key(img)
    hit = cached_table(img.content_hash, img.path, cache)
    if hit is not None:
        return hit
    table = build_table(img)
    cache.store(CACHE_KIND, key, table.to_plain())
    return table
