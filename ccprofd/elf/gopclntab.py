"""Go's function table (``.gopclntab``): each Go function's range, name, flags and the stack
pointer's offset at each of its pcs (its ``pcsp`` table).

Why: a Go binary has no ``.eh_frame``, and its ``.debug_frame`` (which the Go linker generates
from these same ``pcsp`` tables) is gone when the binary is stripped or built with ``-ldflags=-w``
-- Debian strips its Go packages (``/usr/bin/prometheus``).  ``.gopclntab`` is always there: the
Go runtime's own tracebacks need it.  Layouts read: Go 1.18-1.19 (magic ``0xfffffff0``) and
1.20 onward (``0xfffffff1``, whose function record has a start line), 64-bit little-endian only;
anything else is :class:`GoTableError` (the caller goes on without the table).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ccprofd.elf.image import ElfImage

MAGIC_GO118 = 0xFFFFFFF0
MAGIC_GO120 = 0xFFFFFFF1
FUNC_FLAG_TOPFRAME = 1  # the outermost frame of a stack (runtime.goexit, mstart, rt0_go)
FUNC_FLAG_SPWRITE = 2  # writes rsp other than by a known offset (stack switches)
_HEADER = struct.Struct("<IBBBB8Q")  # magic, pad, pad, minLC, ptrSize, then 8 words (see read_go_functions)


class GoTableError(ValueError):
    """A ``.gopclntab`` this reader does not know (older Go, other word size) or cannot read."""


@dataclass(frozen=True, slots=True)
class GoFunction:
    """One Go function: [entry, end) in ELF vaddrs (``end``: where its ``pcsp`` table ends, before
    any padding), and the stack pointer's offset below the return address' slot over its pcs as
    (lo, hi, offset) ranges (offset 0 at the entry, where rsp points at the return address)."""

    entry: int
    end: int
    name: str
    flag: int
    sp_offsets: tuple[tuple[int, int, int], ...]


def _uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise GoTableError("truncated varint in a pc-value table")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 35:
            raise GoTableError("varint too long in a pc-value table")


def pc_values(table: bytes, pos: int, entry: int, quantum: int) -> list[tuple[int, int, int]]:
    """A pc-value table (runtime/symtab.go's ``step``) from ``pos``: (lo, hi, value) ranges from
    the function's entry, value starting at -1, each step a zigzag value delta and a pc delta."""
    out: list[tuple[int, int, int]] = []
    pc, value, first = entry, -1, True
    while True:
        if pos >= len(table):
            raise GoTableError("pc-value table runs past its section")
        if table[pos] == 0 and not first:
            return out
        uvdelta, pos = _uvarint(table, pos)
        value += -(uvdelta & 1) ^ (uvdelta >> 1)
        pcdelta, pos = _uvarint(table, pos)
        if pcdelta == 0 and not first:
            raise GoTableError("empty pc range in a pc-value table")
        out.append((pc, pc + pcdelta * quantum, value))
        pc += pcdelta * quantum
        first = False
        if len(out) > 1 << 20:
            raise GoTableError("pc-value table without an end")


#: where the table lives: its own section, or (position-independent builds) inside .data.rel.ro
SECTIONS = (".gopclntab", ".data.rel.ro.gopclntab")


def read_go_functions(image: ElfImage) -> list[GoFunction]:
    """Every function of the image's Go function table (empty when it has none)."""
    sec = next((image.sections[n] for n in SECTIONS if n in image.sections), None)
    if sec is None or sec.type == "SHT_NOBITS" or not sec.size:
        return []
    text = image.sections.get(".text")
    try:
        funcs = parse_go_functions(image.section_bytes(sec), text.vaddr if text is not None else 0)
    except struct.error as exc:
        raise GoTableError(f".gopclntab cannot be read ({exc})") from None
    if funcs and not any(s.executable and s.contains(funcs[0].entry) for s in image.sections.values()):
        raise GoTableError(f".gopclntab's first function {funcs[0].entry:#x} is in no code section")
    return funcs


def parse_go_functions(data: bytes, text_vaddr: int = 0) -> list[GoFunction]:
    """Every function of a ``.gopclntab`` section's bytes.  The header's text start is a link-time
    address a position-independent binary relocates at load; ``text_vaddr`` (the ``.text``
    section's) stands in when the file holds 0 there (the value left to the relocation)."""
    if len(data) < _HEADER.size:
        raise GoTableError(".gopclntab shorter than its header")
    magic, _, _, quantum, ptr_size, *words = _HEADER.unpack_from(data, 0)
    if magic not in (MAGIC_GO118, MAGIC_GO120):
        raise GoTableError(f".gopclntab magic {magic:#x}: only Go 1.18 and later are read")
    if ptr_size != 8 or quantum not in (1, 2, 4):
        raise GoTableError(f".gopclntab for {ptr_size}-byte pointers, pc quantum {quantum}")
    nfunc, _nfiles, text_start, name_off, _cu_off, _file_off, pctab_off, func_off = words
    text_start = text_start or text_vaddr
    # runtime/symtab.go's _func: entryOff, nameOff, args, deferreturn, pcsp, pcfile, pcln, npcdata,
    # cuOffset, [startLine (1.20+)], funcID, flag, _, nfuncdata
    rec = struct.Struct("<IiiIIIIII" + ("i" if magic == MAGIC_GO120 else "") + "BBBB")
    functab = data[func_off:]
    if nfunc <= 0 or len(functab) < (nfunc + 1) * 8:
        raise GoTableError(".gopclntab function table past its section")
    pctab, names = data[pctab_off:], data[name_off:]
    out: list[GoFunction] = []
    for i in range(nfunc):
        entry_off, rec_off = struct.unpack_from("<II", functab, 8 * i)
        next_off = struct.unpack_from("<I", functab, 8 * (i + 1))[0]
        if func_off + rec_off + rec.size > len(data):
            raise GoTableError(".gopclntab function record past its section")
        fields = rec.unpack_from(functab, rec_off)
        if fields[0] != entry_off:
            raise GoTableError(f".gopclntab function {i}: record and table disagree on its entry")
        flag = fields[-3]
        name_end = names.find(b"\0", fields[1])
        name = names[fields[1]:name_end].decode("utf-8", "replace") if name_end >= 0 else "?"
        entry = text_start + entry_off
        ranges: tuple[tuple[int, int, int], ...] = ()
        if fields[4]:  # pcsp
            got = pc_values(pctab, fields[4], entry, quantum)
            if got and got[-1][1] > text_start + next_off:
                raise GoTableError(f".gopclntab function {name}: its pcsp table runs past the next one")
            ranges = tuple(got)
        end = ranges[-1][1] if ranges else entry
        out.append(GoFunction(entry, end, name, flag, ranges))
    return out
