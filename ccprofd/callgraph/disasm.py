"""Exact disassembly of code ranges with capstone, reduced to the facts the call graph needs.

Each range is swept from a known instruction boundary (a function start, or the first
non-padding byte of a gap) to its end, so every reported site is a real instruction boundary; bytes
capstone cannot decode are skipped one at a time (``skipdata``) instead of derailing the sweep.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from capstone import CS_ARCH_X86, CS_MODE_64, Cs

_IMM = re.compile(r"^(?:0x[0-9a-f]+|\d+)$")
_RIP = re.compile(r"\[rip(?: ([+-]) (0x[0-9a-f]+|\d+))?\]")  # "[rip]" when disp == 0
_TRAILING_IMM = re.compile(r", (0x[0-9a-f]+|\d+)$")
PADDING = frozenset({"nop", "int3", ".byte"})


@dataclass(frozen=True, slots=True)
class Branch:
    """A call or jump instruction."""

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


def make_disassembler() -> Cs:
    md = Cs(CS_ARCH_X86, CS_MODE_64)
    md.skipdata = True
    return md


def sweep(md: Cs, code: bytes, base: int, result: SweepResult) -> None:
    """Disassemble ``code`` (mapped at ``base``) and append its branches and references."""
    branches = result.branches
    refs = result.code_refs
    n = 0
    for addr, size, mnem, ops in md.disasm_lite(code, base):
        n += 1
        c0 = mnem[0]
        if c0 in "jcbn":  # jmp/jcc, call, and their "bnd "/"notrack " prefixed forms
            is_call = mnem.endswith("call")
            is_jmp = mnem.endswith("jmp")
            if not (is_call or is_jmp or c0 == "j"):
                continue  # cmp, cmov, cdq, bt, neg, not, ...
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
    for addr, _size, mnem, ops in md.disasm_lite(code, base):
        if mnem in PADDING or (mnem == "xchg" and ops == "ax, ax") or mnem.endswith(" nop"):
            continue
        if mnem == "add" and ops == "byte ptr [rax], al" and code[addr - base:addr - base + 2] == b"\0\0":
            continue  # zero fill
        return addr
    return None


def iter_calls(branches: list[Branch]) -> Iterator[Branch]:
    return (b for b in branches if b.is_call)
