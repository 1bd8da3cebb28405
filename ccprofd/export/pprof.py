"""Contexts as a gzipped pprof ``profile.proto`` — the format ``go tool pprof``, Parca and Pyroscope
load.

Input: rows in the JSON form of ``ccprofctl hot --json`` or of the daemon's samples
(``{"frames": [...], "count": N, "syscall": "write", "target": ..., "pid": ...}``, frames
outermost first).  One pprof Sample per row, leaf first.

Mappings and addresses: when the rows carry a ``pid`` and ``modules`` holds that process's
executable file mappings (:func:`process_modules`, read while it ran), each mapping is one pprof
Mapping with its real runtime range, file offset and build-id, and each Location's address is the
frame's runtime address (its ELF address + the module's load bias): the call instruction
(``call_site``), else the byte before the return address (inside the call).  Mappings of the
process's executable come first, so Mapping 1 is the main binary (``go tool pprof`` names the
profile's ``File:`` after it).  Without process maps (``ccprofctl hot --format pprof``: counts of
contexts that may come from processes long gone) each module is one Mapping of its ELF addresses,
the program's (the module of the analysed frames) first.  A frame without an address (the
innermost library frame of unwind mode: the tracer keeps no address for an exact pc) is at address
0 of its module's Mapping.

Functions: the frame's function name, its source ``file`` and ``line`` when the frame has them
(else empty / 0 — never the binary's path, which made ``go tool pprof -list`` print the ELF's
bytes).  Inlined calls: a frame's ``inlined`` list (outermost first, as the tracer writes it:
``[{"function", "file", "line"}, ...]``, the frame's own ``file``/``line`` being the outermost
call's site) becomes extra Lines of the frame's one Location, innermost first as profile.proto
wants: the innermost inlined function with the line the address is at, ..., the physical
function with the call site of the outermost inlined call last.

For syscall profiles the syscall is the innermost pseudo-frame ``syscall:NAME`` (no mapping; flame
graphs show it) and a ``syscall`` label; every sample has ``target`` and ``context`` labels (and
``pid`` when known).
"""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ccprofd.export.gen import profile_pb2


@dataclass(frozen=True, slots=True)
class ModuleRange:
    """One executable file mapping of a process: runtime ``[start, limit)`` maps the file from
    ``offset``; runtime address = ELF virtual address + ``bias``."""

    path: str
    start: int
    limit: int
    offset: int
    bias: int
    build_id: str
    main: bool  # the process's executable (/proc/PID/exe)


def _address(value: Any) -> int | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, int) else int(str(value), 16)


def frame_vaddr(frame: Mapping[str, Any]) -> int | None:
    """The ELF address a frame stands at: its call instruction, else inside the call (the return
    address - 1, as pprof wants for a caller's frame), None when the frame has no address."""
    site = _address(frame.get("call_site"))
    if site is not None:
        return site
    ret = _address(frame.get("return_address"))
    return ret - 1 if ret else None


# ------------------------------------------------------------------------------ process maps
_ELF_FACTS: dict[tuple[int, int, int, int], tuple[Any, str] | None] = {}
_ELF_FACTS_MAX = 512


def _elf_facts(path: str) -> tuple[Any, str] | None:
    """(AddressSpace, build-id) of an ELF file, cached per file identity; None when unreadable."""
    from ccprofd.elf.errors import BinaryError
    from ccprofd.elf.image import ElfImage

    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if ident in _ELF_FACTS:  # several request threads share the cache: read it once per call
        return _ELF_FACTS.get(ident)
    facts: tuple[Any, str] | None
    try:
        image = ElfImage(path)
        facts = (image.addrspace, image.build_id() or "")
    except (OSError, BinaryError, ValueError):
        facts = None
    if len(_ELF_FACTS) >= _ELF_FACTS_MAX:
        _ELF_FACTS.clear()
    _ELF_FACTS[ident] = facts
    return facts


def process_modules(pid: int, proc_root: str = "/proc") -> list[ModuleRange]:
    """The executable file mappings of ``pid`` now, with load bias and build-id (from the files).
    OSError when the process is gone."""
    from ccprofd.proc.maps import module_mappings

    def addrspace_of(path: str) -> Any:
        facts = _elf_facts(path)
        return facts[0] if facts is not None else None

    maps = module_mappings(pid, addrspace_of, proc_root)
    try:
        exe = os.readlink(os.path.join(proc_root, str(pid), "exe"))
    except OSError:
        exe = ""
    out = []
    for m in maps.mappings:
        facts = _elf_facts(m.open_path)  # cached: read by module_mappings just now
        if facts is not None:
            out.append(ModuleRange(m.path, m.start, m.end, m.offset, m.bias, facts[1], m.path == exe))
    return out


# ------------------------------------------------------------------------------------ builder
@dataclass(frozen=True, slots=True)
class _MapKey:
    """A pprof Mapping before it has an id: a process's range, or a module without maps."""

    path: str
    build_id: str
    start: int
    limit: int
    offset: int
    main: bool


class _Builder:
    def __init__(self, modules: Mapping[int, Sequence[ModuleRange]]) -> None:
        self.profile = profile_pb2.Profile()
        self.modules = modules
        self.strings: dict[str, int] = {}
        self.functions: dict[tuple[str, str], int] = {}
        self.mapping_ids: dict[_MapKey, int] = {}
        self.locations: dict[tuple[int, int, tuple[tuple[int, int], ...]], int] = {}
        self.string("")

    def string(self, text: str) -> int:
        index = self.strings.get(text)
        if index is None:
            index = self.strings[text] = len(self.profile.string_table)
            self.profile.string_table.append(text)
        return index

    def function(self, name: str, filename: str) -> int:
        key = (name, filename)
        fid = self.functions.get(key)
        if fid is None:
            fid = self.functions[key] = len(self.profile.function) + 1
            self.profile.function.add(id=fid, name=self.string(name), system_name=self.string(name),
                                      filename=self.string(filename))
        return fid

    def place(self, frame: Mapping[str, Any], pid: int | None,
              program: set[str]) -> tuple[_MapKey | None, int]:
        """The Mapping and runtime address of one frame."""
        module = str(frame.get("module") or "")
        if not module:
            return None, 0
        build_id = str(frame.get("build_id") or "")
        vaddr = frame_vaddr(frame)
        ranges = self.modules.get(pid, ()) if pid is not None else ()
        mine = [r for r in ranges if r.path == module or (build_id and r.build_id == build_id)]
        for r in mine:
            if vaddr is not None and r.start <= vaddr + r.bias < r.limit:
                return _MapKey(r.path, r.build_id, r.start, r.limit, r.offset, r.main), vaddr + r.bias
        if mine and vaddr is None:
            r = mine[0]
            return _MapKey(r.path, r.build_id, r.start, r.limit, r.offset, r.main), 0
        return _MapKey(module, build_id, 0, 0, 0, module in program), vaddr or 0

    def assign_mappings(self, keys: Iterable[_MapKey], elf_limits: Mapping[_MapKey, int]) -> None:
        """Mapping ids: the main binary's mappings first (Mapping 1), then the libraries', each in
        order of first use."""
        ordered = sorted(dict.fromkeys(keys), key=lambda k: not k.main)  # stable
        for key in ordered:
            mid = self.mapping_ids[key] = len(self.profile.mapping) + 1
            limit = key.limit or elf_limits.get(key, 0) + 1
            self.profile.mapping.add(id=mid, memory_start=key.start, memory_limit=limit,
                                     file_offset=key.offset, filename=self.string(key.path),
                                     build_id=self.string(key.build_id), has_functions=True)

    def location(self, key: _MapKey | None, address: int, lines: list[tuple[int, int]]) -> int:
        mid = self.mapping_ids[key] if key is not None else 0
        lkey = (mid, address, tuple(lines))
        lid = self.locations.get(lkey)
        if lid is None:
            lid = self.locations[lkey] = len(self.profile.location) + 1
            loc = self.profile.location.add(id=lid, mapping_id=mid, address=address)
            for fid, line in lines:
                loc.line.add(function_id=fid, line=line)
            if mid:
                m = self.profile.mapping[mid - 1]
                m.has_filenames |= any(self.profile.string_table[self.profile.function[fid - 1].filename]
                                       for fid, _ in lines)
                m.has_line_numbers |= any(line > 0 for _, line in lines)
                m.has_inline_frames |= len(lines) > 1
        return lid


def _lines(f: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """(function, file, line) of one frame's pprof Lines, innermost first: its inlined calls
    (innermost first), then the frame's own function."""
    out = [(str(c.get("function") or "[unknown inlined]"), str(c.get("file") or ""), int(c.get("line") or 0))
           for c in reversed(f.get("inlined") or ()) if isinstance(c, Mapping)]
    out.append((_name(f), str(f.get("file") or ""), int(f.get("line") or 0)))
    return out


def _name(f: Mapping[str, Any]) -> str:
    return str(f.get("function") or f"[unknown {f.get('module') or ''}]".replace(" ]", "]"))


def build_profile(rows: Iterable[Mapping[str, Any]], *, event: str = "syscall", period_ns: int = 0,
                  time_ns: int | None = None, duration_ns: int = 0,
                  modules: Mapping[int, Sequence[ModuleRange]] | None = None,
                  comments: Sequence[str] = ()) -> Any:
    """The ``perftools.profiles.Profile`` message of ``rows``; ``modules`` are the executable
    mappings of the processes (by pid) the rows' samples were taken in."""
    b = _Builder(modules or {})
    p = b.profile
    if event == "cpu":
        p.sample_type.add(type=b.string("samples"), unit=b.string("count"))
        if period_ns:
            p.sample_type.add(type=b.string("cpu"), unit=b.string("nanoseconds"))
            p.period_type.type = b.string("cpu")
            p.period_type.unit = b.string("nanoseconds")
            p.period = period_ns
    else:
        p.sample_type.add(type=b.string("syscalls"), unit=b.string("count"))
        p.period_type.type = b.string("syscalls")
        p.period_type.unit = b.string("count")
        p.period = 1
    p.time_nanos = time.time_ns() if time_ns is None else time_ns
    p.duration_nanos = duration_ns
    for c in comments:
        p.comment.append(b.string(c))
    rows = list(rows)
    # Pass 1: where every physical frame is (mapping, runtime address), so the mappings get their
    # ids (main binary first) before any location refers to them.
    placed: list[list[tuple[_MapKey | None, int, Mapping[str, Any]]]] = []
    elf_limits: dict[_MapKey, int] = {}
    for row in rows:
        frames = list(row.get("frames") or [])
        program = {str(f.get("module")) for f in frames if f.get("analysed") and f.get("module")}
        pid = row.get("pid")
        pid = int(pid) if pid else None
        out = []
        for f in frames:
            key, address = b.place(f, pid, program)
            if key is not None and not key.limit:
                elf_limits[key] = max(elf_limits.get(key, 0), address)
            out.append((key, address, f))
        placed.append(out)
    b.assign_mappings((k for out in placed for k, _, _ in out if k is not None), elf_limits)
    # Pass 2: locations and samples, leaf first.
    for row, out in zip(rows, placed, strict=True):
        count = int(row.get("count", 1))
        ids: list[int] = []
        if event == "syscall" and row.get("syscall"):
            ids.append(b.location(None, 0, [(b.function(f"syscall:{row['syscall']}", ""), 0)]))
        for key, address, f in reversed(out):
            lines = [(b.function(name, file), line) for name, file, line in _lines(f)]
            ids.append(b.location(key, address, lines))
        sample = p.sample.add(location_id=ids, value=[count, count * period_ns] if len(p.sample_type) == 2
                              else [count])
        for label in ("target", "syscall", "context"):
            if row.get(label):
                sample.label.add(key=b.string(label), str=b.string(str(row[label])))
        if row.get("pid"):
            sample.label.add(key=b.string("pid"), num=int(row["pid"]))
        if row.get("complete") is False:
            sample.label.add(key=b.string("complete"), str=b.string("false"))
    return p


def write_pprof(rows: Iterable[Mapping[str, Any]], *, event: str = "syscall", period_ns: int = 0,
                time_ns: int | None = None, duration_ns: int = 0,
                modules: Mapping[int, Sequence[ModuleRange]] | None = None,
                comments: Sequence[str] = ()) -> bytes:
    """Gzipped serialized profile (the on-disk and HTTP pprof format)."""
    profile = build_profile(rows, event=event, period_ns=period_ns, time_ns=time_ns,
                            duration_ns=duration_ns, modules=modules, comments=comments)
    return gzip.compress(profile.SerializeToString(), mtime=0)
