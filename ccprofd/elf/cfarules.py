"""The CFA rule (``register + offset``) at given instruction addresses, from ``.eh_frame``.

Why: a call-site probe decides which recorded pieces of a thread's context are dead by comparing
their recorded stack pointers with the *canonical frame address* of the function executing the
call (the raw ``rsp`` drops by stack-passed arguments, ``alloca`` or pushes between calls).  The
probe plan stores, per probed site, the CFA rule at that address so the BPF program can compute the
CFA from ``rsp`` or ``rbp`` in O(1).

Only the CFA column of the CFI table is evaluated (register rules are skipped), and only for FDEs
that contain a queried address, so python3.11's ~10k FDEs cost well under a second.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

from ccprofd.elf.ehframe import _read_encoded, _sleb, _uleb

RSP = 7
RBP = 6

_DW_EH_PE_omit = 0xFF


@dataclass(frozen=True, slots=True)
class CfaRule:
    """CFA = value of DWARF register ``reg`` (7 = rsp, 6 = rbp) + ``offset``."""

    reg: int
    offset: int


@dataclass(slots=True)
class _Cie:
    code_align: int
    data_align: int
    fde_enc: int
    has_z: bool
    insns: bytes


@dataclass(frozen=True, slots=True)
class _Fde:
    start: int
    end: int
    cie: _Cie
    insns: bytes


def _parse_cie(buf: bytes, pos: int, end: int) -> _Cie:
    version = buf[pos]
    pos += 1
    aug_end = buf.index(b"\x00", pos)
    aug = buf[pos:aug_end].decode("ascii", "replace")
    pos = aug_end + 1
    if "eh" in aug:
        pos += 8
    code_align, pos = _uleb(buf, pos)
    data_align, pos = _sleb(buf, pos)
    if version == 1:
        pos += 1
    else:
        _, pos = _uleb(buf, pos)
    fde_enc = 0x00
    has_z = aug.startswith("z")
    if has_z:
        alen, pos = _uleb(buf, pos)
        apos, aend = pos, pos + alen
        for ch in aug[1:]:
            if ch == "R":
                fde_enc = buf[apos]
                apos += 1
            elif ch == "L":
                apos += 1
            elif ch == "P":
                penc = buf[apos]
                apos += 1
                _, apos = _read_encoded(buf, apos, penc & 0x7F, 0, apply=False)
            elif ch in "SB":
                continue
            else:
                break
        pos = aend
    return _Cie(code_align, data_align, fde_enc, has_z, bytes(buf[pos:end]))


def _fdes(buf: bytes, section_vaddr: int) -> list[_Fde]:
    cies: dict[int, _Cie] = {}
    out: list[_Fde] = []
    pos, n = 0, len(buf)
    while pos + 4 <= n:
        start = pos
        length = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        if length == 0:
            break
        if length == 0xFFFFFFFF:
            length = struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        body = pos
        end = body + length
        if end > n:
            break
        cie_id = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        if cie_id == 0:
            cies[start] = _parse_cie(buf, pos, end)
        else:
            cie = cies.get(body - cie_id)
            if cie is not None:
                pc_begin, pos = _read_encoded(buf, pos, cie.fde_enc, section_vaddr + pos)
                pc_range, pos = _read_encoded(buf, pos, cie.fde_enc & 0x0F, 0, apply=False)
                if cie.has_z:
                    alen, pos = _uleb(buf, pos)
                    pos += alen
                if pc_range:
                    out.append(_Fde(pc_begin, pc_begin + pc_range, cie, bytes(buf[pos:end])))
        pos = end
    out.sort(key=lambda f: f.start)
    return out


Row = tuple[int, CfaRule | None]  # (first address, rule; None = not computable from registers)


def _rows(fde: _Fde) -> list[Row]:
    """The CFA column of one FDE's CFI table."""
    cie = fde.cie
    initial = _run(cie.insns, cie, CfaRule(RSP, 8), None, fde.start)[1]
    rows, _ = _run(fde.insns, cie, initial, initial, fde.start)
    return rows


def _run(insns: bytes, cie: _Cie, rule: CfaRule | None, initial: CfaRule | None,
         loc: int) -> tuple[list[Row], CfaRule | None]:
    rows: list[Row] = [(loc, rule)]
    stack: list[CfaRule | None] = []
    ca, da = cie.code_align, cie.data_align
    pos, n = 0, len(insns)

    def advance(delta: int) -> None:
        nonlocal loc
        loc += delta * ca
        if rows[-1][0] == loc:
            rows[-1] = (loc, rule)
        else:
            rows.append((loc, rule))

    def setrule(new: CfaRule | None) -> None:
        nonlocal rule
        rule = new
        rows[-1] = (rows[-1][0], rule)

    while pos < n:
        op = insns[pos]
        pos += 1
        hi = op & 0xC0
        if hi == 0x40:
            advance(op & 0x3F)
            continue
        if hi == 0x80:
            _, pos = _uleb(insns, pos)
            continue
        if hi == 0xC0:
            continue
        if op == 0x00:
            continue
        if op == 0x01:  # set_loc (pointer-sized, absolute): rare in .eh_frame
            new = struct.unpack_from("<Q", insns, pos)[0]
            pos += 8
            advance((new - loc) // ca)
        elif op == 0x02:
            advance(insns[pos])
            pos += 1
        elif op == 0x03:
            advance(struct.unpack_from("<H", insns, pos)[0])
            pos += 2
        elif op == 0x04:
            advance(struct.unpack_from("<I", insns, pos)[0])
            pos += 4
        elif op == 0x0C:
            reg, pos = _uleb(insns, pos)
            off, pos = _uleb(insns, pos)
            setrule(CfaRule(reg, off))
        elif op == 0x12:
            reg, pos = _uleb(insns, pos)
            v, pos = _sleb(insns, pos)
            setrule(CfaRule(reg, v * da))
        elif op == 0x0D:
            reg, pos = _uleb(insns, pos)
            setrule(CfaRule(reg, rule.offset) if rule is not None else None)
        elif op == 0x0E:
            off, pos = _uleb(insns, pos)
            setrule(CfaRule(rule.reg, off) if rule is not None else None)
        elif op == 0x13:
            v, pos = _sleb(insns, pos)
            setrule(CfaRule(rule.reg, v * da) if rule is not None else None)
        elif op == 0x0F:  # def_cfa_expression
            blen, pos = _uleb(insns, pos)
            pos += blen
            setrule(None)
        elif op == 0x0A:
            stack.append(rule)
        elif op == 0x0B:
            setrule(stack.pop() if stack else initial)
        elif op in (0x05, 0x09):  # offset_extended, register
            _, pos = _uleb(insns, pos)
            _, pos = _uleb(insns, pos)
        elif op in (0x11, 0x14, 0x15):  # offset_extended_sf, val_offset, val_offset_sf
            _, pos = _uleb(insns, pos)
            _, pos = (_uleb if op == 0x14 else _sleb)(insns, pos)
        elif op in (0x06, 0x07, 0x08, 0x2E):  # restore_extended, undefined, same_value, args_size
            _, pos = _uleb(insns, pos)
        elif op in (0x10, 0x16):  # expression, val_expression
            _, pos = _uleb(insns, pos)
            blen, pos = _uleb(insns, pos)
            pos += blen
        elif op == 0x2F:
            _, pos = _uleb(insns, pos)
            _, pos = _uleb(insns, pos)
        else:
            break  # unknown opcode: keep what we have (rows so far are right)
    return rows, rule


def cfa_rules(eh_frame: bytes, section_vaddr: int, addresses: Iterable[int]) -> dict[int, CfaRule | None]:
    """CFA rule at each address; None where no FDE covers it or the CFA is a DWARF expression."""
    fdes = _fdes(eh_frame, section_vaddr)
    starts = [f.start for f in fdes]
    out: dict[int, CfaRule | None] = {}
    cache: dict[int, tuple[list[int], list[CfaRule | None]]] = {}
    for addr in addresses:
        i = bisect_right(starts, addr) - 1
        if i < 0 or addr >= fdes[i].end:
            out[addr] = None
            continue
        table = cache.get(i)
        if table is None:
            rows = _rows(fdes[i])
            table = cache[i] = ([r[0] for r in rows], [r[1] for r in rows])
        j = bisect_right(table[0], addr) - 1
        out[addr] = table[1][j] if j >= 0 else None
    return out
