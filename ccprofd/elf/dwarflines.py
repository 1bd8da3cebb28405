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
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from elftools.common.exceptions import DWARFError, ELFError
from elftools.construct.core import ConstructError
from elftools.elf.elffile import ELFFile

log = logging.getLogger("ccprofd")

_ERRORS = (DWARFError, ELFError, ConstructError, KeyError, IndexError, ValueError, AssertionError,
           AttributeError, TypeError, OSError, UnicodeDecodeError)
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


class _Unit:
    """One compile unit: its line rows and file table, made at first use."""

    def __init__(self, dwarf: Any, cu: Any) -> None:
        self.cu = cu
        self.starts: list[int] = []
        self.rows: list[tuple[int, int, int]] = []  # (start, file index, line), sorted by start
        self.ends: list[int] = []
        self.files: list[str | None] = []
        self.v5 = False
        lp = dwarf.line_program_for_CU(cu)
        if lp is None:
            return
        self.v5 = lp.header.version >= 5
        self.files = self._file_table(lp, cu)
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
        self.starts = [s[0] for s in spans]
        self.ends = [s[1] for s in spans]
        self.rows = [(s[0], s[2], s[3]) for s in spans]

    def _file_table(self, lp: Any, cu: Any) -> list[str | None]:
        comp_dir = _text(cu.get_top_DIE().attributes.get("DW_AT_comp_dir"))
        dirs = [_decode(d) for d in lp.header.include_directory]
        if not self.v5:
            dirs = [comp_dir or "", *dirs]
        out: list[str | None] = []
        for fe in lp.header.file_entry:
            name = _decode(fe.name)
            d = dirs[fe.dir_index] if 0 <= fe.dir_index < len(dirs) else ""
            if not os.path.isabs(name) and d:
                name = os.path.join(d, name)
            out.append(name)
        return out

    def file(self, index: int | None) -> str | None:
        if index is None:
            return None
        i = index if self.v5 else index - 1
        return self.files[i] if 0 <= i < len(self.files) else None

    def line_at(self, addr: int) -> tuple[str | None, int | None] | None:
        i = bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.ends[i]:
            return None
        _, f, line = self.rows[i]
        return self.file(f), line or None


def _decode(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _text(attr: Any) -> str | None:
    return None if attr is None else _decode(attr.value)


class DwarfLines:
    """Source locations of addresses of one ELF file with DWARF (the module or its debug file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: Any = None
        self._dwarf: Any = None
        self._opened = False
        self._units: dict[int, _Unit] = {}
        self._aranges: Any = None
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
                    self._aranges = self._dwarf.get_aranges()
            except _ERRORS as exc:
                log.debug("no DWARF from %s: %s", self.path, exc)
                self._dwarf = None
        return self._dwarf

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

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

    def _unit_for(self, dwarf: Any, addr: int) -> _Unit | None:
        off = None
        if self._aranges is not None:
            off = self._aranges.cu_offset_at_addr(addr)
        if off is None:
            off = self._offset_from_index(dwarf, addr)
        if off is None:
            return None
        unit = self._units.get(off)
        if unit is None:
            unit = self._units[off] = _Unit(dwarf, dwarf.get_CU_at(off))
        return unit

    def _offset_from_index(self, dwarf: Any, addr: int) -> int | None:
        if self._index is None:
            spans = []
            for cu in dwarf.iter_CUs():
                for lo, hi in _ranges(dwarf, cu, cu.get_top_DIE(), 0):
                    spans.append((lo, hi, cu.cu_offset))
            spans.sort()
            self._index = ([s[0] for s in spans], spans)
        starts, spans = self._index
        i = bisect_right(starts, addr) - 1
        while i >= 0:
            lo, hi, off = spans[i]
            if lo <= addr < hi:
                return off
            i -= 1
            if i >= 0 and spans[i][0] != lo:
                break
        return None

    def _lookup(self, addr: int) -> SourceLocation | None:
        dwarf = self._open()
        if dwarf is None:
            return None
        unit = self._unit_for(dwarf, addr)
        if unit is None:
            return None
        row = unit.line_at(addr)
        chain = self._inlined_chain(dwarf, unit, addr)
        file, line = row if row is not None else (None, None)
        if not chain:
            return None if row is None else SourceLocation(file, line)
        calls = []
        for k, die in enumerate(chain):
            if k + 1 < len(chain):
                nxt = chain[k + 1].attributes
                where = (unit.file(_int(nxt.get("DW_AT_call_file"))), _int(nxt.get("DW_AT_call_line")))
            else:
                where = (file, line)
            calls.append(InlinedCall(_name(die), *where))
        top = chain[0].attributes
        return SourceLocation(unit.file(_int(top.get("DW_AT_call_file"))), _int(top.get("DW_AT_call_line")),
                              tuple(calls))

    def _inlined_chain(self, dwarf: Any, unit: _Unit, addr: int) -> list[Any]:
        """The DW_TAG_inlined_subroutine DIEs containing ``addr``, outermost first."""
        top = unit.cu.get_top_DIE()
        base = _int(top.attributes.get("DW_AT_low_pc")) or 0
        chain: list[Any] = []
        scope = top
        while True:
            inner = None
            for child in scope.iter_children():
                if child.tag not in _SCOPES:
                    continue
                if any(lo <= addr < hi for lo, hi in _ranges(dwarf, unit.cu, child, base)):
                    inner = child
                    break
            if inner is None:
                return chain
            if inner.tag == "DW_TAG_inlined_subroutine":
                chain.append(inner)
            scope = inner


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
