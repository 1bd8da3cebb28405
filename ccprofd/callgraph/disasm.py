"""Exact disassembly of code ranges with capstone, reduced to the facts the call graph needs.

Each range is swept from a known instruction boundary (a function start, or the first
non-padding byte of a gap) to its end, so every reported site is a real instruction boundary; bytes
capstone cannot decode are skipped one at a time (``skipdata``) instead of derailing the sweep.
"""

from __future__ import annotations

import ctypes
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from sys import intern
from typing import Any, NamedTuple

from ccprofd.elf.x86dis import CsInsn as _cs_insn
from ccprofd.elf.x86dis import entry_points, x86_64

try:  # sweep()'s compiled loop (csweep.c, built by scripts/build_ext.sh); the Python one is the reference
    import ccprofd.callgraph.csweep as csweep  # type: ignore[import-not-found, unused-ignore]
except ImportError:
    csweep = None

_IMM = re.compile(r"^(?:0x[0-9a-f]+|\d+)$")
_RIP = re.compile(r"\[rip(?: ([+-]) (0x[0-9a-f]+|\d+))?\]")  # "[rip]" when disp == 0
_TRAILING_IMM = re.compile(r", (0x[0-9a-f]+|\d+)$")
PADDING = frozenset({"nop", "int3", ".byte"})


class Branch(NamedTuple):
    """A call or jump instruction.  A tuple, so that csweep.c builds the ~10^5 (node: 10^6) of them
    as tuples, without a Python ``__init__`` call each."""

    address: int
    length: int
    raw: bytes
    is_call: bool
    conditional: bool
    target: int | None  # immediate target; None for indirect
    operand: str  # operand text (for indirect branches)


@dataclass(slots=True)
class SweepResult:
    branches: list[Branch]
    code_refs: list[int]  # addresses formed by lea [rip+d] or immediates (address-taken candidates)
    instructions: int


Cs = Any  # ccprofd.elf.x86dis.X86_64, or capstone.Cs where libcapstone cannot be loaded alone


def make_disassembler() -> Cs:
    return x86_64(skipdata=True)


@cache
def _insn_ids() -> tuple[int, int, int]:
    """capstone's X86_INS_CALL, X86_INS_JMP and X86_INS_ENDING (the first id without a name), read
    from the library: capstone.x86_const cannot be imported without all of capstone's bindings."""
    md = x86_64()
    names = {}
    i = 1
    while (name := md.insn_name(i)) is not None:
        names[name] = i
        i += 1
    return names["call"], names["jmp"], i


# capstone's cs_insn array is read straight from its memory: decoding every instruction's mnemonic and
# operand text into Python strings (what ``disasm_lite`` does) was most of the analysis time, and only
# calls, jumps, ``lea``, ``mov`` and ``push`` are looked at.  Their instruction ids and first bytes,
# read for all records at once with strided slices, pick the few records whose text is decoded.
_INSN = ctypes.sizeof(_cs_insn)
_MNEM = _cs_insn.mnemonic.offset
_OPS = _cs_insn.op_str.offset
_BYTES = _cs_insn.bytes.offset
_ADDR_SIZE = struct.Struct("<QH")  # cs_insn.address, cs_insn.size (adjacent)
assert _cs_insn.size.offset == _cs_insn.address.offset + 8 and _INSN % 4 == 0 and _cs_insn.id.offset == 0


@cache
def _looked_at_ids() -> tuple[frozenset[int], frozenset[int], frozenset[int], frozenset[int]]:
    """Ids of the instructions whose mnemonic the sweep may act on: (branches, of which conditional
    jumps, ``mov``/``movabs``, the rest).  A superset: the mnemonic (its first letter for the common
    branches) still decides; prefixed forms such as ``bnd jmp`` keep their instruction's id."""
    md = x86_64()
    _, x86_ins_jmp, x86_ins_ending = _insn_ids()
    assert x86_ins_ending < 1 << 16  # an id's two low bytes are the whole id
    branches, moves, other = set(), set(), set()
    for i in range(1, x86_ins_ending):
        name = md.insn_name(i) or ""
        if name[:1] == "j" or name.endswith(("call", "jmp")):
            branches.add(i)
        elif name in ("mov", "movabs"):
            moves.add(i)
        elif name in ("lea", "push"):
            other.add(i)
    jcc = {i for i in branches if (md.insn_name(i) or "")[:1] == "j" and i != x86_ins_jmp}
    return frozenset(branches), frozenset(jcc), frozenset(moves), frozenset(other)


#: First bytes of a ``mov`` between a register and a register or memory (88-8B, after at most one REX
#: prefix): its operand text never ends in an immediate, so it is not decoded.
_MOV_RM = bytes(0xFF if 0x88 <= b <= 0x8B else 0 for b in range(256))
_REX = bytes(0xFF if 0x40 <= b <= 0x4F else 0 for b in range(256))
_BRANCH, _MOVE, _OTHER = 1, 2, 4  # record classes
_LOOKED_AT = re.compile(rb"[^\x00]")


@cache
def _class_tables() -> list[tuple[bytes, bytes]]:
    """Per value of an id's high byte: (low byte -> class, high byte -> 0xFF if it is that value)."""
    branch, _jcc, moves, other = _looked_at_ids()
    out = []
    for hi in sorted({i >> 8 for i in branch | moves | other}):
        classes = bytearray(256)
        for lo in range(256):
            i = hi << 8 | lo
            classes[lo] = _BRANCH if i in branch else _MOVE if i in moves else _OTHER if i in other else 0
        out.append((bytes(classes), bytes(0xFF if b == hi else 0 for b in range(256))))
    return out


@cache
def _scan_tables() -> tuple[bytes, bytes, tuple[int, ...]]:
    """csweep.scan's tables: each id's record class, whether it is a jcc, and cs_insn's layout."""
    branch, jcc, moves, other = _looked_at_ids()
    classes = bytes(_BRANCH if i in branch else _MOVE if i in moves else _OTHER if i in other else 0
                    for i in range(_insn_ids()[2]))
    jccs = bytes(1 if i in jcc else 0 for i in range(_insn_ids()[2]))
    layout = (_INSN, _MNEM, _OPS, _BYTES, _cs_insn.mnemonic.size, _cs_insn.op_str.size, *_insn_ids()[:2])
    return classes, jccs, layout


def _classes(buf: bytes, n: int) -> bytes:
    """Each record's class (0: not looked at), computed for all records at once: one byte per record
    from strided slices, combined as big integers (bitwise AND/OR run in C over the whole function)."""
    lo = buf[0::_INSN]
    hi = buf[1::_INSN]
    mask = 0
    for classes, is_hi in _class_tables():
        mask |= (int.from_bytes(lo.translate(classes), "little")
                 & int.from_bytes(hi.translate(is_hi), "little"))
    b0 = buf[_BYTES::_INSN]
    b1 = buf[_BYTES + 1::_INSN]
    reg_mov = int.from_bytes(b0.translate(_MOV_RM), "little") | (
        int.from_bytes(b0.translate(_REX), "little") & int.from_bytes(b1.translate(_MOV_RM), "little"))
    mask &= ~(reg_mov & int.from_bytes(bytes((_MOVE,)) * n, "little"))
    return mask.to_bytes(n, "little")


def _raw_insns(md: Cs, code: bytes, base: int) -> tuple[bytes, int]:
    """The cs_insn records of ``code`` as one bytes object, and their count."""
    from capstone import CS_ERR_OK, CsError, _cs, _cs_insn  # the fall-back without csweep.sweep only

    insns = ctypes.POINTER(_cs_insn)()
    n = _cs.cs_disasm(md.csh, code, len(code), base, 0, ctypes.byref(insns))
    if n <= 0:
        status = _cs.cs_errno(md.csh)
        if status != CS_ERR_OK:
            raise CsError(status)
        return b"", 0
    try:
        return ctypes.string_at(insns, n * _INSN), n
    finally:
        _cs.cs_free(insns, n)


@cache
def _iter_entry_points() -> tuple[int, int, int]:
    """Addresses of cs_disasm_iter, cs_malloc and cs_free in libcapstone (csweep.sweep calls them: one
    reused record per instruction instead of cs_disasm's array)."""
    return entry_points()


def sweep(md: Cs, code: bytes, base: int, result: SweepResult, *, local_jumps: bool = True) -> None:
    """Disassemble ``code`` (mapped at ``base``) and append its branches and references.

    ``local_jumps=False`` leaves out direct jumps that land inside ``code`` itself: when ``code`` is
    one function, those say nothing about the call graph (most of a function's branches are such).
    """
    branches = result.branches
    refs = result.code_refs
    if csweep is not None and hasattr(csweep, "sweep"):
        classes, jccs, layout = _scan_tables()
        swept = csweep.sweep(md.csh.value, *_iter_entry_points(), code, base, local_jumps, classes, jccs,
                             layout, Branch)
        if swept is not None:
            branches += swept[0]
            refs += swept[1]
            result.instructions += swept[2]
            return
    buf, n = _raw_insns(md, code, base)
    if not n:
        return
    result.instructions += n
    if csweep is not None:
        classes, jccs, layout = _scan_tables()
        got = csweep.scan(buf, n, code, base, local_jumps, classes, jccs, layout, Branch)
        if got is not None:
            branches += got[0]
            refs += got[1]
            return
    jcc_ids = _looked_at_ids()[1]
    x86_ins_call, x86_ins_jmp, _ = _insn_ids()
    cls = _classes(buf, n)
    unpack = _ADDR_SIZE.unpack_from
    find = buf.index
    end = base + len(code)
    first = buf[_MNEM::_INSN]  # each mnemonic's first letter
    b0 = buf[_BYTES::_INSN]  # each instruction's first two bytes
    b1 = buf[_BYTES + 1::_INSN]
    for hit in _LOOKED_AT.finditer(cls):
        i = hit.start()
        rec = i * _INSN
        c = cls[i]
        if c == _BRANCH:
            x = buf[rec] | buf[rec + 1] << 8
            if x in (x86_ins_call, x86_ins_jmp):
                if first[i] not in b"jcbn":  # a prefix capstone spells out other than bnd/notrack
                    continue
                is_call = x == x86_ins_call
                is_jmp = not is_call
            elif x in jcc_ids:
                if first[i] != 0x6A:  # "j"
                    continue
                is_call = is_jmp = False
            else:  # lcall, ljmp, syscall, vmcall...: what the mnemonic says, as in sweep_lite
                m0 = rec + _MNEM
                mnem = buf[m0:find(b"\0", m0)].decode("ascii")
                c0 = mnem[0]
                is_call = mnem.endswith("call")
                is_jmp = mnem.endswith("jmp")
                if c0 not in "jcbn" or not (is_call or is_jmp or c0 == "j"):
                    continue
            addr, size = unpack(buf, rec + 8)
            if not local_jumps and not is_call:
                # rel8/rel32 jumps without prefixes: the target from the bytes, the text not decoded
                op = b0[i]
                if size == 2 and (0x70 <= op <= 0x7F or op == 0xEB):
                    if base <= addr + 2 + ((b1[i] ^ 0x80) - 0x80) < end:
                        continue
                elif (size == 5 and op == 0xE9) or (size == 6 and op == 0x0F and 0x80 <= b1[i] <= 0x8F):
                    rel = int.from_bytes(buf[rec + _BYTES + size - 4:rec + _BYTES + size], "little",
                                         signed=True)
                    if base <= addr + size + rel < end:
                        continue
            o0 = rec + _OPS
            ops = buf[o0:find(b"\0", o0)].decode("ascii")
            off = addr - base
            if _IMM.match(ops):
                target = int(ops, 0)
                if not local_jumps and not is_call and base <= target < end:
                    continue
                # interned: the many calls to one function share their operand text
                branches.append(Branch(addr, size, code[off:off + size], is_call, not (is_call or is_jmp),
                                       target, intern(ops)))
            else:
                branches.append(Branch(addr, size, code[off:off + size], is_call, False, None, ops))
            continue
        m0 = rec + _MNEM
        name = buf[m0:find(b"\0", m0)]
        o0 = rec + _OPS
        e = find(b"\0", o0)
        if c == _MOVE:
            if (name != b"mov" and name != b"movabs") or buf.find(b", 0x", o0, e) < 0:
                continue
            m = _TRAILING_IMM.search(buf[o0:e].decode("ascii"))
            if m:
                val = int(m.group(1), 0)
                if val > 0x1000:
                    refs.append(val)
        elif name == b"lea":
            if buf.find(b"rip", o0, e) < 0:
                continue
            m = _RIP.search(buf[o0:e].decode("ascii"))
            if m:
                addr, size = unpack(buf, rec + 8)
                disp = int(m.group(2), 0) if m.group(2) else 0
                refs.append(addr + size + (disp if m.group(1) != "-" else -disp))
        elif name == b"push":
            ops = buf[o0:e].decode("ascii")
            if _IMM.match(ops):
                val = int(ops, 0)
                if val > 0x1000:
                    refs.append(val)


def sweep_lite(md: Cs, code: bytes, base: int, result: SweepResult) -> None:
    """:func:`sweep` written over capstone's ``disasm_lite`` (the reference it must agree with)."""
    branches = result.branches
    refs = result.code_refs
    n = 0
    for addr, size, mnem, ops in md.disasm_lite(code, base):
        n += 1
        c0 = mnem[0]
        if c0 in "jcbn":
            is_call = mnem.endswith("call")
            is_jmp = mnem.endswith("jmp")
            if not (is_call or is_jmp or c0 == "j"):
                continue
            off = addr - base
            raw = code[off:off + size]
            if _IMM.match(ops):
                branches.append(Branch(addr, size, raw, is_call, not (is_call or is_jmp), int(ops, 0), ops))
            else:
                branches.append(Branch(addr, size, raw, is_call, False, None, ops))
        elif c0 == "l" and mnem == "lea" and "rip" in ops:
            m = _RIP.search(ops)
            if m:
                disp = int(m.group(2), 0) if m.group(2) else 0
                refs.append(addr + size + (disp if m.group(1) != "-" else -disp))
        elif ((c0 == "m" and (mnem == "mov" or mnem == "movabs") and ", 0x" in ops)
              or (c0 == "p" and mnem == "push")):
            m = _TRAILING_IMM.search(ops) if c0 == "m" else (_IMM.match(ops) and ops)
            if m:
                val = int(m.group(1), 0) if c0 == "m" else int(ops, 0)
                if val > 0x1000:
                    refs.append(val)
    result.instructions += n


def first_non_padding(md: Cs, code: bytes, base: int) -> int | None:
    """Address of the first instruction in ``code`` that is not padding (None: all padding)."""
    if csweep is not None and hasattr(csweep, "first_non_padding"):
        found: int | None = csweep.first_non_padding(md.csh.value, *_iter_entry_points(), code, base,
                                                     _scan_tables()[2])
        return found
    return first_non_padding_lite(md, code, base)


def first_non_padding_lite(md: Cs, code: bytes, base: int) -> int | None:
    """:func:`first_non_padding` over capstone's ``disasm_lite`` (the reference of csweep's)."""
    for addr, _size, mnem, ops in md.disasm_lite(code, base):
        if mnem in PADDING or (mnem == "xchg" and ops == "ax, ax") or mnem.endswith(" nop"):
            continue
        if mnem == "add" and ops == "byte ptr [rax], al" and code[addr - base:addr - base + 2] == b"\0\0":
            continue  # zero fill
        return addr
    return None


def iter_calls(branches: list[Branch]) -> Iterator[Branch]:
    return (b for b in branches if b.is_call)
