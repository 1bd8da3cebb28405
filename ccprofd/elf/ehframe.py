"""The one reader of DWARF call frame information records (``.eh_frame`` and ``.debug_frame``): the
entry headers, CIEs (with their augmentation), FDE headers, and the LEB128 / pointer encodings they
use.  What the CFI *instructions* mean is :mod:`ccprofd.elf.cfi`'s (the one interpreter).

pyelftools decodes every CFI instruction into objects and takes ~1.7 s on python3.11's 10k FDEs;
reading the raw section bytes here keeps a pass over the headers well under 0.1 s for that binary.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from ccprofd.elf.errors import CfiError

DW_EH_PE_omit = 0xFF


#: What reading malformed CFI bytes raises below the public entry points of the CFI readers.
MALFORMED = (ValueError, IndexError, struct.error, OverflowError)


@contextlib.contextmanager
def cfi_errors(section: str) -> Iterator[None]:
    """Turn any error of reading a malformed ``section`` into one :class:`CfiError`."""
    try:
        yield
    except CfiError:
        raise
    except MALFORMED as exc:
        raise CfiError(f"corrupt {section} ({exc or type(exc).__name__})") from None


def uleb(buf: bytes, pos: int) -> tuple[int, int]:
    """Unsigned LEB128 at ``pos``: (value, position after it)."""
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return result, pos


def sleb(buf: bytes, pos: int) -> tuple[int, int]:
    """Signed LEB128 at ``pos``: (value, position after it)."""
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


def read_encoded(buf: bytes, pos: int, enc: int, field_vaddr: int, apply: bool = True) -> tuple[int, int]:
    """A DW_EH_PE-encoded pointer at ``pos`` (``field_vaddr``: where the field is, for pc-relative
    encodings; ``apply=False`` reads the value alone, as for a range)."""
    fmt = enc & 0x0F
    if fmt == 0x00:
        val, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
    elif fmt == 0x01:
        val, pos = uleb(buf, pos)
    elif fmt == 0x02:
        val, pos = struct.unpack_from("<H", buf, pos)[0], pos + 2
    elif fmt == 0x03:
        val, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
    elif fmt == 0x04:
        val, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
    elif fmt == 0x09:
        val, pos = sleb(buf, pos)
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


@dataclass(slots=True)
class Cie:
    """A Common Information Entry: alignment factors, encodings, and where its initial
    instructions are (``init_pos``..``init_end`` in the section)."""

    code_align: int
    data_align: int
    ra_reg: int
    fde_encoding: int
    lsda_encoding: int
    has_z: bool
    signal: bool  # augmentation 'S': the FDEs describe signal trampolines
    init_pos: int
    init_end: int
    addr_size: int


@dataclass(frozen=True, slots=True)
class FdeHeader:
    """A Frame Description Entry's header: its code range, its CIE (by offset), and where its
    instructions are (``insn_pos``..``end``)."""

    pc_begin: int
    pc_range: int
    cie_offset: int
    insn_pos: int
    end: int


def entry_header(buf: bytes, pos: int) -> tuple[int, int, bool]:
    """(body start, entry end, 64-bit DWARF) of the CIE/FDE entry at ``pos``."""
    length = struct.unpack_from("<I", buf, pos)[0]
    pos += 4
    is64 = False
    if length == 0xFFFFFFFF:
        length = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8
        is64 = True
    return pos, pos + length, is64


def parse_cie(buf: bytes, off: int, is_eh: bool) -> Cie:
    """The CIE whose entry starts at ``off``."""
    body, end, is64 = entry_header(buf, off)
    pos = body + (8 if is64 else 4)
    version = buf[pos]
    pos += 1
    aug_end = buf.index(b"\x00", pos)
    aug = buf[pos:aug_end].decode("ascii", "replace")
    pos = aug_end + 1
    addr_size = 8
    if "eh" in aug:
        pos += 8
    if not is_eh and version >= 4:
        addr_size = buf[pos]
        pos += 2  # address_size, segment_selector_size
    code_align, pos = uleb(buf, pos)
    data_align, pos = sleb(buf, pos)
    if version == 1:
        ra_reg = buf[pos]
        pos += 1
    else:
        ra_reg, pos = uleb(buf, pos)
    fde_enc = 0x00
    lsda_enc = DW_EH_PE_omit
    has_z = aug.startswith("z")
    if has_z:
        alen, pos = uleb(buf, pos)
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
                _, apos = read_encoded(buf, apos, penc & 0x7F, 0, apply=False)
            elif ch in "SB":
                continue
            else:
                break
        pos = aend
    return Cie(code_align, data_align, ra_reg, fde_enc, lsda_enc, has_z, "S" in aug, pos, end, addr_size)


def iter_fdes(buf: bytes, section_vaddr: int, is_eh: bool,
              cies: dict[int, Cie] | None = None) -> Iterator[FdeHeader]:
    """Every FDE of one section, in section order (CIEs are parsed into ``cies``, by offset, as the
    FDEs name them).  ValueError on a truncated entry or an unsupported pointer encoding."""
    cies = {} if cies is None else cies
    section = ".eh_frame" if is_eh else ".debug_frame"
    pos, n = 0, len(buf)
    while pos + 4 <= n:
        body, end, is64 = entry_header(buf, pos)
        if end == body and not is64:  # zero terminator
            if is_eh:
                break
            pos = end
            continue
        if end > n:
            raise ValueError(f"truncated {section} entry")
        if is64:
            cie_id = struct.unpack_from("<Q", buf, body)[0]
            after_id = body + 8
            is_cie = cie_id == 0 if is_eh else cie_id == 0xFFFFFFFFFFFFFFFF
        else:
            cie_id = struct.unpack_from("<I", buf, body)[0]
            after_id = body + 4
            is_cie = cie_id == 0 if is_eh else cie_id == 0xFFFFFFFF
        if is_cie:
            pos = end
            continue
        cie_off = body - cie_id if is_eh else cie_id
        if not 0 <= cie_off <= n - 8:  # a negative offset would read from the section's end
            raise ValueError(f"FDE at {pos:#x} names a CIE at {cie_off:#x}, outside the section")
        cie = cies.get(cie_off)
        if cie is None:
            cie = cies[cie_off] = parse_cie(buf, cie_off, is_eh)
        p = after_id
        if is_eh:
            pc_begin, p = read_encoded(buf, p, cie.fde_encoding, section_vaddr + p)
            pc_range, p = read_encoded(buf, p, cie.fde_encoding & 0x0F, 0, apply=False)
        else:
            pc_begin, pc_range = struct.unpack_from("<QQ", buf, p)
            p += 16
        if pc_begin + pc_range > 1 << 64:
            raise ValueError(f"FDE at {pos:#x} covers addresses past 2**64")
        if cie.has_z:
            alen, p = uleb(buf, p)
            p += alen
        yield FdeHeader(pc_begin, pc_range, cie_off, p, end)
        pos = end
