"""Section headers of an ELF64 little-endian object read with ``struct`` straight from its bytes.

Why not pyelftools here: the readers that use this (a module's function symbols, the build-id and
``.gnu_debuglink`` that find its debug file) run on large system objects at the first sample in
them, where pyelftools took ~0.3 s for libc; they need only the header table and a few sections.
"""

from __future__ import annotations

import mmap
import struct

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")

#: One section header: (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info,
#: sh_addralign, sh_entsize).
SectionHeader = tuple[int, int, int, int, int, int, int, int, int, int]
OFFSET, SIZE, LINK, ENTSIZE = 4, 5, 6, 9  # indexes into a SectionHeader


def section_headers(data: bytes | mmap.mmap) -> tuple[list[SectionHeader], dict[str, SectionHeader]]:
    """Every section header in table order, and by name (the first of a name; a header whose name
    has no terminating NUL is left out of the names); ([], {}) for anything but a well-formed
    ELF64 little-endian header table."""
    if len(data) < _EHDR.size:
        return [], {}
    ident, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, shstrndx = _EHDR.unpack_from(data, 0)
    if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1 or shentsize < _SHDR.size:
        return [], {}
    if shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        return [], {}
    shdrs: list[SectionHeader] = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    strtab = shdrs[shstrndx][OFFSET]
    by_name: dict[str, SectionHeader] = {}
    for h in shdrs:
        base = strtab + h[0]
        end = data.find(b"\0", base)
        if end >= 0:
            by_name.setdefault(bytes(data[base:end]).decode("utf-8", "replace"), h)
    return shdrs, by_name
