"""A fast reader of ``.eh_frame`` FDE headers: code ranges and whether each range is a function entry.

pyelftools decodes every CFI instruction and takes ~1.7 s on python3.11's 10k FDEs; function
discovery only needs each FDE's [pc_begin, pc_begin + pc_range) and a look at the first CFI
instructions, so this reader parses the headers directly (DWARF pointer encodings, CIE
augmentation) and stays well under 0.1 s for that binary.

An FDE is an *entry* when, at its first address, the CFA is still ``rsp + 8`` (the return address
was just pushed by a call).  gcc's split-off cold parts (``foo.cold``) instead start mid-frame
with a ``DW_CFA_def_cfa_offset`` at location 0; they are *fragments* of another function.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

DW_EH_PE_omit = 0xFF
_RSP = 7


@dataclass(frozen=True, slots=True)
class FdeRange:
    start: int
    end: int
    entry: bool  # CFA == rsp+8 at start: a function entered by call (or a signal trampoline)
    signal_frame: bool  # CIE augmentation 'S'


@dataclass(slots=True)
class _Cie:
    fde_encoding: int
    lsda_encoding: int
    has_z: bool
    signal: bool
    data_align: int
    cfa_reg: int
    cfa_off: int


def _uleb(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return result, pos


def _sleb(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if b & 0x40:
                result -= 1 << shift
            return result, pos


def _read_encoded(buf: bytes, pos: int, enc: int, field_vaddr: int, apply: bool = True) -> tuple[int, int]:
    fmt = enc & 0x0F
    if fmt == 0x00:
        val, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
    elif fmt == 0x01:
        val, pos = _uleb(buf, pos)
    elif fmt == 0x02:
        val, pos = struct.unpack_from("<H", buf, pos)[0], pos + 2
    elif fmt == 0x03:
        val, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
    elif fmt == 0x04:
        val, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
    elif fmt == 0x09:
        val, pos = _sleb(buf, pos)
    elif fmt == 0x0A:
        val, pos = struct.unpack_from("<h", buf, pos)[0], pos + 2
    elif fmt == 0x0B:
        val, pos = struct.unpack_from("<i", buf, pos)[0], pos + 4
    elif fmt == 0x0C:
        val, pos = struct.unpack_from("<q", buf, pos)[0], pos + 8
    else:
        raise ValueError(f"unsupported DWARF pointer encoding {enc:#x}")
    if apply and (enc & 0x70) == 0x10:  # pcrel
        val += field_vaddr
    return val & 0xFFFFFFFFFFFFFFFF, pos


def _initial_cfa(buf: bytes, pos: int, end: int, cfa: tuple[int, int], data_align: int,
                 stop_at_advance: bool) -> tuple[int, int] | None:
    """Apply CFA-defining instructions at location 0; None when the CFA becomes an expression."""
    reg, off = cfa
    while pos < end:
        op = buf[pos]
        pos += 1
        hi = op & 0xC0
        if hi == 0x40:  # advance_loc
            if stop_at_advance:
                break
            continue
        if hi == 0x80:  # offset(reg), uleb
            _, pos = _uleb(buf, pos)
            continue
        if hi == 0xC0:  # restore(reg)
            continue
        if op == 0x00:  # nop
            continue
        if op in (0x02, 0x03, 0x04):  # advance_loc1/2/4
            if stop_at_advance:
                break
            pos += {0x02: 1, 0x03: 2, 0x04: 4}[op]
            continue
        if op == 0x01:  # set_loc: treat like an advance
            break
        if op == 0x0C:  # def_cfa reg, off
            reg, pos = _uleb(buf, pos)
            off, pos = _uleb(buf, pos)
        elif op == 0x0D:  # def_cfa_register
            reg, pos = _uleb(buf, pos)
        elif op == 0x0E:  # def_cfa_offset
            off, pos = _uleb(buf, pos)
        elif op == 0x12:  # def_cfa_sf
            reg, pos = _uleb(buf, pos)
            v, pos = _sleb(buf, pos)
            off = v * data_align
        elif op == 0x13:  # def_cfa_offset_sf
            v, pos = _sleb(buf, pos)
            off = v * data_align
        elif op == 0x0F:  # def_cfa_expression
            return None
        elif op in (0x05, 0x14):  # offset_extended(_sf) reg, off
            _, pos = _uleb(buf, pos)
            _, pos = (_uleb if op == 0x05 else _sleb)(buf, pos)
        elif op == 0x11:  # offset_extended_sf
            _, pos = _uleb(buf, pos)
            _, pos = _sleb(buf, pos)
        elif op in (0x06, 0x07, 0x08):  # restore_extended, undefined, same_value
            _, pos = _uleb(buf, pos)
        elif op == 0x09:  # register
            _, pos = _uleb(buf, pos)
            _, pos = _uleb(buf, pos)
        elif op in (0x0A, 0x0B):  # remember/restore_state
            continue
        elif op in (0x10, 0x16):  # expression, val_expression: reg, block
            _, pos = _uleb(buf, pos)
            n, pos = _uleb(buf, pos)
            pos += n
        elif op == 0x2E:  # GNU_args_size
            _, pos = _uleb(buf, pos)
        elif op == 0x2F:  # GNU_negative_offset_extended
            _, pos = _uleb(buf, pos)
            _, pos = _uleb(buf, pos)
        else:
            break
    return reg, off


def parse_eh_frame(buf: bytes, section_vaddr: int) -> list[FdeRange]:
    """All FDE ranges of one ``.eh_frame`` section (bytes and the section's vaddr)."""
    cies: dict[int, _Cie] = {}
    out: list[FdeRange] = []
    pos = 0
    n = len(buf)
    while pos + 4 <= n:
        start = pos
        length = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        if length == 0:  # terminator
            break
        if length == 0xFFFFFFFF:
            length = struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        body = pos
        end = body + length
        if end > n:
            raise ValueError("truncated .eh_frame entry")
        cie_id = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        if cie_id == 0:
            cies[start] = _parse_cie(buf, pos, end)
        else:
            cie_off = body - cie_id
            cie = cies.get(cie_off)
            if cie is None:
                cie = cies[cie_off] = _parse_cie_at(buf, cie_off)
            pc_begin, pos = _read_encoded(buf, pos, cie.fde_encoding, section_vaddr + pos)
            pc_range, pos = _read_encoded(buf, pos, cie.fde_encoding & 0x0F, 0, apply=False)
            if cie.has_z:
                alen, pos = _uleb(buf, pos)
                pos += alen
            cfa = _initial_cfa(buf, pos, end, (cie.cfa_reg, cie.cfa_off), cie.data_align, True)
            entry = cie.signal or (cfa is not None and cfa == (_RSP, 8))
            if pc_range > 0:
                out.append(FdeRange(pc_begin, pc_begin + pc_range, entry, cie.signal))
        pos = end
    return out


def _parse_cie_at(buf: bytes, off: int) -> _Cie:
    length = struct.unpack_from("<I", buf, off)[0]
    pos = off + 4
    if length == 0xFFFFFFFF:
        length = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8
    return _parse_cie(buf, pos + 4, pos + length)


def _parse_cie(buf: bytes, pos: int, end: int) -> _Cie:
    version = buf[pos]
    pos += 1
    aug_end = buf.index(b"\x00", pos)
    aug = buf[pos:aug_end].decode("ascii", "replace")
    pos = aug_end + 1
    if "eh" in aug:
        pos += 8
    _, pos = _uleb(buf, pos)  # code alignment
    data_align, pos = _sleb(buf, pos)
    if version == 1:
        pos += 1
    else:
        _, pos = _uleb(buf, pos)
    fde_enc = 0x00
    lsda_enc = DW_EH_PE_omit
    has_z = aug.startswith("z")
    signal = "S" in aug
    if has_z:
        alen, pos = _uleb(buf, pos)
        apos, aend = pos, pos + alen
        for ch in aug[1:]:
            if ch == "R":
                fde_enc = buf[apos]
                apos += 1
            elif ch == "L":
                lsda_enc = buf[apos]
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
    cfa = _initial_cfa(buf, pos, end, (_RSP, 8), data_align, False) or (-1, 0)
    return _Cie(fde_enc, lsda_enc, has_z, signal, data_align, cfa[0], cfa[1])
