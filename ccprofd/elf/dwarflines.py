"""Source file:line of an address from DWARF, with the chain of inlined calls there (what
``addr2line -f -i`` prints), read with pyelftools from a module or its separate debug file.

Cheap by construction: only the compile unit holding the address is read (found through
``.debug_aranges``, else an index of the units' ranges made once), its line table decoded once
into sorted rows and its DIE tree walked only down the scopes that contain the address; results
are kept per address.
"""

from __future__ import annotations

import logging
import os
import struct
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from elftools.common.exceptions import DWARFError, ELFError
from elftools.construct.core import ConstructError
from elftools.elf.elffile import ELFFile

from ccprofd.persist.cache import AnalysisCache, file_identity

log = logging.getLogger("ccprofd")

_ERRORS = (DWARFError, ELFError, ConstructError, KeyError, IndexError, ValueError, AssertionError,
           AttributeError, TypeError, OSError, UnicodeDecodeError, RecursionError, OverflowError,
           NotImplementedError, struct.error)
CACHE_UNITS, CACHE_UNIT = "dwarf-units", "dwarf-unit"
_SCOPES = ("DW_TAG_subprogram", "DW_TAG_lexical_block", "DW_TAG_inlined_subroutine", "DW_TAG_try_block",
           "DW_TAG_catch_block")


@dataclass(frozen=True, slots=True)
class InlinedCall:
    """One function inlined at a frame's address: its name and where in it the address is."""

    function: str | None
    file: str | None
    line: int | None

    def to_json(self) -> dict[str, Any]:
        return {"function": self.function, "file": self.file, "line": self.line}


@dataclass(frozen=True, slots=True)
class SourceLocation:
    """Where an address is in the source: ``file``/``line`` in the frame's own (physical)
    function -- the call site of the outermost inlined call when there are any -- and
    ``inlined``, outermost first, the functions inlined there, each with its own location (the
    last one's is the line table's row for the address)."""

    file: str | None
    line: int | None
    inlined: tuple[InlinedCall, ...] = ()


#: one inlined call's range in a unit table: (lo, hi, depth, function, call file, call line)
Inlined = tuple[int, int, int, str | None, str | None, int | None]


def _unit_table(dwarf: Any, cu: Any) -> dict[str, Any]:
    """One compile unit as a plain (marshal-able) value: its line table as sorted, disjoint spans
    ``starts``/``ends``/``files``/``lines`` (file names resolved) and every inlined call's ranges
    with its nesting depth, name and call site."""
    top = cu.get_top_DIE()
    table: dict[str, Any] = {"starts": [], "ends": [], "files": [], "lines": [], "inlined": []}
    lp = dwarf.line_program_for_CU(cu)
    if lp is None:
        return table
    v5 = lp.header.version >= 5
    names = _file_table(lp, top, v5)

    def file_of(index: int | None) -> str | None:
        if index is None:
            return None
        i = index if v5 else index - 1
        return names[i] if 0 <= i < len(names) else None

    spans: list[tuple[int, int, int, int]] = []
    prev = None
    for entry in lp.get_entries():
        st = entry.state
        if st is None:
            continue
        if prev is not None and st.address > prev.address:
            spans.append((prev.address, st.address, prev.file, prev.line))
        prev = None if st.end_sequence else st
    spans.sort()
    table["starts"] = [sp[0] for sp in spans]
    table["ends"] = [sp[1] for sp in spans]
    table["files"] = [file_of(sp[2]) for sp in spans]
    table["lines"] = [sp[3] or None for sp in spans]

    base = _int(top.attributes.get("DW_AT_low_pc")) or 0
    inlined: list[Inlined] = []

    def walk(die: Any, depth: int) -> None:
        for child in die.iter_children():
            if child.tag == "DW_TAG_inlined_subroutine":
                a = child.attributes
                call = (file_of(_int(a.get("DW_AT_call_file"))), _int(a.get("DW_AT_call_line")))
                for lo, hi in _ranges(dwarf, cu, child, base):
                    inlined.append((lo, hi, depth, _name(child), *call))
                walk(child, depth + 1)
            elif child.tag in _SCOPES:
                walk(child, depth)

    walk(top, 0)
    table["inlined"] = inlined
    return table


def _file_table(lp: Any, top: Any, v5: bool) -> list[str | None]:
    comp_dir = _text(top.attributes.get("DW_AT_comp_dir"))
    dirs = [_decode(d) for d in lp.header.include_directory]
    if not v5:
        dirs = [comp_dir or "", *dirs]
    out: list[str | None] = []
    for fe in lp.header.file_entry:
        name = _decode(fe.name)
        d = dirs[fe.dir_index] if 0 <= fe.dir_index < len(dirs) else ""
        out.append(os.path.join(d, name) if d and not os.path.isabs(name) else name)
    return out


def _decode(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _text(attr: Any) -> str | None:
    return None if attr is None else _decode(attr.value)


def locate(table: dict[str, Any], addr: int) -> SourceLocation | None:
    """``addr``'s location in a unit table (see :func:`_unit_table`)."""
    starts = table["starts"]
    i = bisect_right(starts, addr) - 1
    file: str | None = None
    line: int | None = None
    found = i >= 0 and addr < table["ends"][i]
    if found:
        file, line = table["files"][i], table["lines"][i]
    chain = sorted((e for e in table["inlined"] if e[0] <= addr < e[1]), key=lambda e: e[2])
    if not chain:
        return SourceLocation(file, line) if found else None
    calls = []
    for k, e in enumerate(chain):
        where = (chain[k + 1][4], chain[k + 1][5]) if k + 1 < len(chain) else (file, line)
        calls.append(InlinedCall(e[3], *where))
    return SourceLocation(chain[0][4], chain[0][5], tuple(calls))


class DwarfLines:
    """Source locations of addresses of one ELF file with DWARF (the module or its debug file).

    With a ``cache``, the unit index and each unit's table are kept there by file identity, so
    a later trace opens no DWARF for a unit it has seen (pyelftools takes ~70 ms per libc unit)."""

    def __init__(self, path: str, cache: AnalysisCache | None = None) -> None:
        self.path = path
        self.cache = cache
        self._ident = file_identity(path) if cache is not None else None
        self._fh: Any = None
        self._dwarf: Any = None
        self._opened = False
        self._units: dict[int, dict[str, Any]] = {}
        self._index: tuple[list[int], list[tuple[int, int, int]]] | None = None
        self._memo: dict[int, SourceLocation | None] = {}

    def _open(self) -> Any:
        if not self._opened:
            self._opened = True
            try:
                self._fh = open(self.path, "rb")  # noqa: SIM115 - kept open for pyelftools' lazy reads
                elf = ELFFile(self._fh)
                if elf.has_dwarf_info() and elf.get_section_by_name(".debug_info") is not None:
                    self._dwarf = elf.get_dwarf_info(relocate_dwarf_sections=False)
            except _ERRORS as exc:
                log.debug("no DWARF from %s: %s", self.path, exc)
                self._dwarf = None
        return self._dwarf

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _cached(self, kind: str, key: str, make: Any) -> Any:
        if self.cache is not None and self._ident is not None:
            got = self.cache.load(kind, f"{self._ident}-{key}")
            if got is not None:
                return got
        value = make()
        if value is not None and self.cache is not None and self._ident is not None \
                and file_identity(self.path) == self._ident:
            self.cache.store(kind, f"{self._ident}-{key}", value)
        return value

    def lookup(self, addr: int) -> SourceLocation | None:
        """The source location of link-time address ``addr`` (None when DWARF does not cover it)."""
        if addr in self._memo:
            return self._memo[addr]
        try:
            got = self._lookup(addr)
        except _ERRORS as exc:  # malformed DWARF: no line, never a crash
            log.debug("DWARF of %s at %#x: %s", self.path, addr, exc)
            got = None
        if len(self._memo) > 1 << 16:
            self._memo.clear()
        self._memo[addr] = got
        return got

    def _unit_index(self) -> tuple[list[int], list[tuple[int, int, int]]]:
        """(starts, [(lo, hi, unit offset)]) sorted: from .debug_aranges, else the units' ranges."""
        if self._index is None:
            spans = self._cached(CACHE_UNITS, "index", self._make_index) or []
            spans = sorted((int(a), int(b), int(c)) for a, b, c in spans)
            self._index = ([sp[0] for sp in spans], spans)
        return self._index

    def _make_index(self) -> list[tuple[int, int, int]] | None:
        dwarf = self._open()
        if dwarf is None:
            return []
        aranges = dwarf.get_aranges()
        if aranges is not None:
            return [(e.begin_addr, e.begin_addr + e.length, e.info_offset) for e in aranges.entries
                    if e.length]
        return [(lo, hi, cu.cu_offset) for cu in dwarf.iter_CUs()
                for lo, hi in _ranges(dwarf, cu, cu.get_top_DIE(), 0)]

    def _unit_offset(self, addr: int) -> int | None:
        starts, spans = self._unit_index()
        i = bisect_right(starts, addr) - 1
        for lo, hi, off in reversed(spans[max(0, i - 4):i + 1]):  # a few overlapping neighbours
            if lo <= addr < hi:
                return off
        return None

    def _make_unit(self, off: int) -> dict[str, Any] | None:
        dwarf = self._open()
        return None if dwarf is None else _unit_table(dwarf, dwarf.get_CU_at(off))

    def _lookup(self, addr: int) -> SourceLocation | None:
        off = self._unit_offset(addr)
        if off is None:
            return None
        table = self._units.get(off)
        if table is None:
            table = self._cached(CACHE_UNIT, f"{off:x}", lambda: self._make_unit(off))
            if table is None:
                return None
            self._units[off] = table
        return locate(table, addr)


def _int(attr: Any) -> int | None:
    return None if attr is None or not isinstance(attr.value, int) else int(attr.value)


def _ranges(dwarf: Any, cu: Any, die: Any, base: int) -> list[tuple[int, int]]:
    """[lo, hi) address ranges of a DIE (low/high pc or DW_AT_ranges)."""
    attrs = die.attributes
    lo_attr = attrs.get("DW_AT_low_pc")
    hi_attr = attrs.get("DW_AT_high_pc")
    if lo_attr is not None and hi_attr is not None:
        lo = int(lo_attr.value)
        hi = int(hi_attr.value)
        if hi_attr.form != "DW_FORM_addr":
            hi += lo
        return [(lo, hi)]
    r = attrs.get("DW_AT_ranges")
    if r is None:
        return []
    rl = dwarf.range_lists()
    if rl is None:
        return []
    if die.tag == "DW_TAG_compile_unit":
        base = _int(attrs.get("DW_AT_low_pc")) or 0
    out = []
    for e in rl.get_range_list_at_offset(r.value, cu=cu):
        if hasattr(e, "base_address"):
            base = e.base_address
        elif e.is_absolute:
            out.append((e.begin_offset, e.end_offset))
        else:
            out.append((base + e.begin_offset, base + e.end_offset))
    return out


def _name(die: Any) -> str | None:
    """A DIE's function name, through DW_AT_abstract_origin / DW_AT_specification."""
    seen = 0
    while die is not None and seen < 8:
        attrs = die.attributes
        if "DW_AT_name" in attrs:
            return _decode(attrs["DW_AT_name"].value)
        nxt = None
        for ref in ("DW_AT_abstract_origin", "DW_AT_specification"):
            if ref in attrs:
                nxt = die.get_DIE_from_attribute(ref)
                break
        die = nxt
        seen += 1
    return None
