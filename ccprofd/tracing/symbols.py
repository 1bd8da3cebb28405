"""Function names of any mapped ELF object, from its .symtab/.dynsym, for frames outside the analysed
binary."""

from __future__ import annotations

import struct
from bisect import bisect_right
from typing import TYPE_CHECKING

from ccprofd.elf.debugfile import DebugFileLocator, default_locator
from ccprofd.elf.dwarflines import DwarfLines, SourceLocation
from ccprofd.elf.rawsections import ENTSIZE, OFFSET, section_headers
from ccprofd.persist.cache import file_identity

if TYPE_CHECKING:
    from ccprofd.persist.cache import AnalysisCache

CACHE_KIND = "symbols"


def _path_digest(path: str) -> str:
    """A short digest of the path (the identity already names the file; the path keeps two
    hard links' entries apart, as the cache entry records the path it was made for)."""
    import hashlib

    return hashlib.sha256(path.encode()).hexdigest()[:16]


_SYM = struct.Struct("<IBBHQQ")
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_STT_FUNC, _STT_GNU_IFUNC = 2, 10


def _function_symbols(data: bytes) -> list[tuple[int, int, str]]:
    """(start, end, name) of the defined, sized function symbols of an ELF64 little-endian
    object's ``.dynsym`` then ``.symtab``, one row per address: among aliases the first public
    name (no leading underscore), else the first name."""
    shdrs, by_name = section_headers(data)
    shnum = len(shdrs)

    def cstr(table: int, off: int) -> str:
        base = shdrs[table][OFFSET] + off
        end = data.index(b"\0", base)
        return data[base:end].decode("utf-8", "replace")

    rows: dict[int, tuple[int, int, str]] = {}
    for sec_name in (".dynsym", ".symtab"):
        h = by_name.get(sec_name)
        if h is None or h[1] not in (_SHT_SYMTAB, _SHT_DYNSYM) or h[ENTSIZE] < _SYM.size:
            continue
        _, _, _, _, offset, size, link, _, _, entsize = h
        if offset + size > len(data) or link >= shnum:
            continue
        for i in range(size // entsize):
            st_name, st_info, _, st_shndx, lo, sym_size = _SYM.unpack_from(data, offset + i * entsize)
            if st_info & 0xF not in (_STT_FUNC, _STT_GNU_IFUNC) or not st_name or sym_size <= 0:
                continue
            if st_shndx == 0:  # SHN_UNDEF
                continue
            name = cstr(link, st_name)
            if not name:
                continue
            old = rows.get(lo)
            if old is None or (old[2].startswith("_") and not name.startswith("_")):
                rows[lo] = (lo, lo + sym_size, name)
    return list(rows.values())


Row = tuple[int, int, str]


def merge_rows(own: list[Row], debug: list[Row]) -> list[Row]:
    """The object's own rows, plus the debug file's rows that start at an address no own row covers
    (its own names win: the exported name a user knows, where the debug file has aliases)."""
    out = sorted(own)
    starts = [r[0] for r in out]
    extra = []
    for row in debug:
        i = bisect_right(starts, row[0]) - 1
        if i >= 0 and out[i][0] <= row[0] < out[i][1]:
            continue
        extra.append(row)
    return out + extra


# ------------------------------------------------------------------------------ ELF symbols
class ModuleSymbols:
    """Function symbols of one unanalysed object (``.symtab`` where present, else ``.dynsym``), with
    those of its separate debug file (:mod:`ccprofd.elf.debugfile`) for the addresses the object's
    own tables leave unnamed: a stripped libc's local functions (``msort_with_tmp.part.0``, what
    perf prints) come from libc6-dbg's ``.symtab``.
    With a ``cache``, the table is kept there by file identity (the debug file's included): parsing
    libc's symbols with pyelftools takes ~0.3 s, paid at the first sample in libc of every trace
    otherwise."""

    def __init__(self, path: str, cache: AnalysisCache | None = None,
                 locator: DebugFileLocator | None = None, build_id: str | None = None) -> None:
        self.path = path
        self.debug_file = (locator if locator is not None else default_locator()).find(path, build_id)
        ident = file_identity(path) if cache is not None else None
        debug_ident = file_identity(self.debug_file) if self.debug_file is not None else None
        key = None
        if ident is not None:
            key = f"{ident}-{_path_digest(path)}"
            if debug_ident is not None:
                key += f"-{_path_digest(debug_ident)}"
        if cache is not None and key is not None:
            got = cache.load(CACHE_KIND, key)
            if isinstance(got, list) and got and isinstance(got[0], str) and got[0] == path:
                self._set_rows([(int(lo), int(hi), str(n)) for lo, hi, n in got[1:]])
                return
        rows = self._read(path)
        if self.debug_file is not None:
            rows = merge_rows(rows, self._read(self.debug_file))
        self._set_rows(rows)
        if cache is not None and key is not None and file_identity(path) == ident:
            cache.store(CACHE_KIND, key, [path, *self._rows])

    def _set_rows(self, rows: list[tuple[int, int, str]]) -> None:
        self._rows = sorted(rows)
        self._starts = [r[0] for r in self._rows]

    @staticmethod
    def _read(path: str) -> list[tuple[int, int, str]]:
        """Function symbols, read with struct from the section headers (pyelftools took ~0.3 s
        for libc's 3,000 .dynsym entries: this is the first sample in libc of a cold trace)."""
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            return _function_symbols(data)
        except (OSError, ValueError, struct.error, IndexError, UnicodeDecodeError):
            return []  # malformed ELF: no names, never a crash

    def name_at(self, vaddr: int) -> str | None:
        i = bisect_right(self._starts, vaddr) - 1
        if i >= 0:
            lo, hi, name = self._rows[i]
            if lo <= vaddr < hi:
                return name
        return None



# ------------------------------------------------------------------------------ DWARF lines
class ModuleSource:
    """Source file:line (and inlined calls) of one module's addresses, from the DWARF of its
    separate debug file, else of the module itself; nothing is opened before the first lookup
    (a trace whose samples never reach a module pays nothing for it)."""

    def __init__(self, path: str, build_id: str | None = None, locator: DebugFileLocator | None = None,
                 cache: AnalysisCache | None = None) -> None:
        """``cache``: where each compile unit's table is kept (a later trace reads no DWARF for it)."""
        self.path = path
        self.build_id = build_id
        self.locator = locator
        self.cache = cache
        self._lines: list[DwarfLines] | None = None

    def _sources(self) -> list[DwarfLines]:
        if self._lines is None:
            loc = self.locator if self.locator is not None else default_locator()
            debug = loc.find(self.path, self.build_id)
            self._lines = [DwarfLines(p, self.cache) for p in (debug, self.path) if p is not None]
        return self._lines

    def at(self, vaddr: int) -> SourceLocation | None:
        """The location of link-time address ``vaddr`` (an outer frame's: its call instruction, or
        return address - 1)."""
        for lines in self._sources():
            got = lines.lookup(vaddr)
            if got is not None:
                return got
        return None
