"""Function bounds from every source an ELF has: symbols, ``.eh_frame`` FDEs, dynamic tags.

Stripped binaries keep their FDEs, so every function compiled with CFI still gets exact bounds
(named ``sub_<vaddr>``).  FDEs that start mid-frame (CFA != rsp+8) are *fragments* of another
function (gcc's ``foo.cold``): they are kept apart here and folded into their owner by the
disassembly pass, which sees the jump that enters them.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import pairwise

from ccprofd.elf.cfi import fde_ranges
from ccprofd.elf.errors import BinaryError, CfiError
from ccprofd.elf.gopclntab import GoTableError, read_go_functions
from ccprofd.elf.image import PLT_SECTIONS, ElfImage, Section

try:  # csweep.fde_ranges: the compiled walk of common .eh_frame sections (None: cfi.fde_ranges reads it)
    import ccprofd.callgraph.csweep as csweep  # type: ignore[import-not-found, unused-ignore]
except ImportError:
    csweep = None

_FUNC_TYPES = ("STT_FUNC", "STT_GNU_IFUNC")


@dataclass(slots=True)
class FunctionInfo:
    start: int
    end: int
    name: str
    aliases: list[str] = field(default_factory=list)
    fragment: bool = False  # CFI says it starts mid-frame: part of another function
    exported: bool = False  # defined in .dynsym: callable from other objects
    signal_trampoline: bool = False
    weak: bool = False  # found only by sweeping uncovered code: references may split it


def eh_frame_ranges(data: bytes, vaddr: int, path: str) -> list[tuple[int, int, bool, bool]]:
    """:func:`ccprofd.elf.cfi.fde_ranges` as (start, end, entry, signal frame) tuples: from csweep.c
    when it reads the whole section (~30x faster: node's 76k FDEs took ~1.3 s in Python), else from
    the Python walk, which also names what is wrong with a corrupt section (:class:`BinaryError`)."""
    if csweep is not None and hasattr(csweep, "fde_ranges"):
        got: list[tuple[int, int, bool, bool]] | None = csweep.fde_ranges(data, vaddr)
        if got is not None:
            return got
    try:
        return [(r.start, r.end, r.entry, r.signal_frame) for r in fde_ranges(data, vaddr)]
    except CfiError as exc:
        raise BinaryError(path, str(exc)) from None


def sub_name(addr: int) -> str:
    return f"sub_{addr:x}"


class FunctionTable:
    """Sorted, non-overlapping function ranges inside the non-PLT code sections."""

    def __init__(self, image: ElfImage) -> None:
        self.image = image
        self.code = [s for s in image.code_sections() if s.name not in PLT_SECTIONS]
        self.by_start: dict[int, FunctionInfo] = {}
        self.starts: list[int] = []
        self.weak_starts: set[int] = set()  # the starts of the weak functions
        # Starts whose end was (re)computed since the caller last cleared it: a sweep round re-sweeps
        # these only, not every function again to find the few whose range changed.
        self.touched: set[int] = set()
        # section_of by bisection when the code sections do not overlap (they never do in a sane
        # file; then the first in file order wins, as the loop finds it); empty ones contain nothing
        ordered = sorted((s for s in self.code if s.size > 0), key=lambda s: s.vaddr)
        disjoint = all(a.vaddr + a.size <= b.vaddr for a, b in pairwise(ordered))
        self._sections = ordered if disjoint else None
        self._section_starts = [s.vaddr for s in ordered]
        self._discover()
        self._reindex()

    # ---------------------------------------------------------------------------- discovery
    def section_of(self, addr: int) -> Section | None:
        if self._sections is not None:
            i = bisect_right(self._section_starts, addr) - 1
            if i >= 0:
                s = self._sections[i]
                if s.contains(addr):
                    return s
            return None
        for s in self.code:
            if s.contains(addr):
                return s
        return None

    def _discover(self) -> None:
        names: dict[int, list[tuple[int, str, int, bool]]] = {}
        for sym in self.image.symbols():
            if (not sym.defined or sym.type not in _FUNC_TYPES or not sym.name
                    or self.section_of(sym.value) is None):
                continue
            # Rank: .symtab GLOBAL first, then .symtab others, then .dynsym.
            rank = (0 if sym.table == ".symtab" else 2) + (0 if sym.bind == "STB_GLOBAL" else 1)
            names.setdefault(sym.value, []).append((rank, sym.name, sym.size, sym.table == ".dynsym"))
        # Go's own function table names every Go function, also in a stripped binary (Debian's):
        # ranked after both symbol tables (its names lack the linker's ".abi0" suffixes)
        try:
            go_functions = read_go_functions(self.image)
        except (GoTableError, ValueError):
            go_functions = []
        for fn in go_functions:
            if fn.name and fn.end > fn.entry and self.section_of(fn.entry) is not None:
                names.setdefault(fn.entry, []).append((4, fn.name, fn.end - fn.entry, False))
        fdes: dict[int, tuple[int, bool, bool]] = {}
        eh = self.image.sections.get(".eh_frame")
        if eh is not None and eh.type != "SHT_NOBITS" and eh.size:
            for start, end, entry, signal in eh_frame_ranges(self.image.section_bytes(eh), eh.vaddr,
                                                             self.image.path):
                if self.section_of(start) is not None:
                    fdes.setdefault(start, (end, entry, signal))
        extra = {self.image.entry}
        tags = self.image.dynamic_tags()
        for t in ("DT_INIT", "DT_FINI"):
            if t in tags:
                extra.add(tags[t])
        starts = set(names) | set(fdes) | {a for a in extra if self.section_of(a) is not None}
        by_start = self.by_start
        for start in starts:
            fde = fdes.get(start)
            entries = names.get(start)
            if entries is None:  # known by its FDE alone (node: most of its 185k functions)
                by_start[start] = FunctionInfo(
                    start=start, end=fde[0] if fde else 0, name=sub_name(start), aliases=[],
                    fragment=bool(fde and not fde[1]) and start not in extra, exported=False,
                    signal_trampoline=bool(fde and fde[2]))
                continue
            if len(entries) > 1:
                entries.sort()
            sym_size = max(e[2] for e in entries)
            end = start + sym_size if sym_size else (fde[0] if fde else 0)
            uniq: list[str] = []
            for e in entries:
                if e[1] not in uniq:
                    uniq.append(e[1])
            by_start[start] = FunctionInfo(
                start=start, end=end, name=uniq[0], aliases=uniq[1:],
                fragment=bool(fde and not fde[1]) and start not in extra,
                exported=any(e[3] for e in entries), signal_trampoline=bool(fde and fde[2]))

    def add_start(self, addr: int, weak: bool = False) -> bool:
        """Add a function found by a call, a reference or a gap sweep; False if known or not code."""
        if addr in self.by_start or self.section_of(addr) is None:
            return False
        self.by_start[addr] = FunctionInfo(start=addr, end=0, name=sub_name(addr), weak=weak)
        if weak:
            self.weak_starts.add(addr)
        self._reindex(addr)
        return True

    def _reindex(self, added: int | None = None) -> None:
        """Fix unknown ends (up to the next start or section end) and build the lookup index."""
        if added is not None:
            i = bisect_right(self.starts, added)
            self.starts.insert(i, added)
            ordered = self.starts
            todo = range(max(0, i - 1), min(len(ordered), i + 1))
        else:
            ordered = sorted(self.by_start)
            todo = range(len(ordered))
        for i in todo:
            start = ordered[i]
            fn = self.by_start[start]
            sec = self.section_of(start)
            assert sec is not None
            limit = sec.vaddr + sec.size
            nxt = ordered[i + 1] if i + 1 < len(ordered) else limit
            if fn.end <= start or fn.end > limit:
                fn.end = limit
            fn.end = min(fn.end, nxt)  # never overlap: each instruction is swept exactly once
        self.touched.update(ordered[i] for i in todo)
        self.starts = ordered

    def containing(self, addr: int) -> FunctionInfo | None:
        i = bisect_right(self.starts, addr) - 1
        if i >= 0:
            fn = self.by_start[self.starts[i]]
            if addr < fn.end:
                return fn
        return None

    def gaps(self) -> list[tuple[int, int]]:
        """Code not covered by any function range (padding, or code with neither symbol nor CFI)."""
        out: list[tuple[int, int]] = []
        for sec in self.code:
            cur = sec.vaddr
            end = sec.vaddr + sec.size
            # the starts inside this section (the list is sorted): not a pass over all of them per section
            for start in self.starts[bisect_left(self.starts, sec.vaddr):bisect_left(self.starts, end)]:
                if start > cur:
                    out.append((cur, start))
                cur = max(cur, self.by_start[start].end)
            if cur < end:
                out.append((cur, end))
        return out
