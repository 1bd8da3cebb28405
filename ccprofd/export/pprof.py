"""Hot contexts as a gzipped pprof ``profile.proto`` — the format ``go tool pprof`` and its
ecosystem load.

Input: rows in the JSON form of ``ccprofctl hot --json`` (``{"frames": [...], "count": N,
"syscall": "write", "event": "syscall"|"cpu", "target": ...}``, frames outermost first).  One pprof
Sample per row, leaf first; one Location per (module, call site, function) with the call-site
address (an ELF virtual address of its module, so each module is one Mapping starting at 0);
``has_functions`` is set because every location already carries its function name.  For syscall
profiles the syscall is the innermost pseudo-frame ``syscall:NAME`` (flame graphs show it) and a
``syscall`` label; every sample also has ``target`` and ``context`` labels.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ccprofd.export.gen import profile_pb2

_NO_MODULE = 0


def _address(value: Any) -> int:
    if value in (None, ""):
        return 0
    return value if isinstance(value, int) else int(str(value), 16)


class _Builder:
    def __init__(self) -> None:
        self.profile = profile_pb2.Profile()
        self.strings: dict[str, int] = {}
        self.functions: dict[tuple[str, str], int] = {}
        self.mappings: dict[str, int] = {}
        self.mapping_limit: dict[int, int] = {}
        self.locations: dict[tuple[int, int, int], int] = {}
        self.string("")

    def string(self, text: str) -> int:
        index = self.strings.get(text)
        if index is None:
            index = self.strings[text] = len(self.profile.string_table)
            self.profile.string_table.append(text)
        return index

    def function(self, name: str, module: str) -> int:
        key = (name, module)
        fid = self.functions.get(key)
        if fid is None:
            fid = self.functions[key] = len(self.profile.function) + 1
            self.profile.function.add(id=fid, name=self.string(name), system_name=self.string(name),
                                      filename=self.string(module))
        return fid

    def mapping(self, module: str, build_id: str) -> int:
        if not module:
            return _NO_MODULE
        mid = self.mappings.get(module)
        if mid is None:
            mid = self.mappings[module] = len(self.profile.mapping) + 1
            self.profile.mapping.add(id=mid, memory_start=0, memory_limit=0, file_offset=0,
                                     filename=self.string(module), build_id=self.string(build_id or ""),
                                     has_functions=True)
        return mid

    def location(self, name: str, module: str, build_id: str, address: int) -> int:
        mid = self.mapping(module, build_id)
        fid = self.function(name, module)
        key = (mid, address, fid)
        lid = self.locations.get(key)
        if lid is None:
            lid = self.locations[key] = len(self.profile.location) + 1
            loc = self.profile.location.add(id=lid, mapping_id=mid, address=address)
            loc.line.add(function_id=fid)
            if mid:
                self.mapping_limit[mid] = max(self.mapping_limit.get(mid, 0), address + 1)
        return lid

    def finish(self) -> None:
        for m in self.profile.mapping:
            m.memory_limit = self.mapping_limit.get(m.id, 1)


def build_profile(rows: Iterable[Mapping[str, Any]], *, event: str = "syscall", period_ns: int = 0,
                  time_ns: int | None = None, duration_ns: int = 0) -> Any:
    """The ``perftools.profiles.Profile`` message of ``rows``."""
    b = _Builder()
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
    for row in rows:
        count = int(row.get("count", 0))
        frames = list(row.get("frames") or [])
        ids: list[int] = []
        if event == "syscall" and row.get("syscall"):
            ids.append(b.location(f"syscall:{row['syscall']}", "", "", 0))
        for f in reversed(frames):  # pprof wants the leaf first
            name = f.get("function") or f"[unknown {f.get('module') or ''}]".replace(" ]", "]")
            ids.append(b.location(str(name), str(f.get("module") or ""), str(f.get("build_id") or ""),
                                  _address(f.get("call_site"))))
        sample = p.sample.add(location_id=ids, value=[count, count * period_ns] if len(p.sample_type) == 2
                              else [count])
        for key in ("target", "syscall", "context"):
            if row.get(key):
                sample.label.add(key=b.string(key), str=b.string(str(row[key])))
        if row.get("complete") is False:
            sample.label.add(key=b.string("complete"), str=b.string("false"))
    b.finish()
    return p


def write_pprof(rows: Iterable[Mapping[str, Any]], *, event: str = "syscall", period_ns: int = 0,
                time_ns: int | None = None, duration_ns: int = 0) -> bytes:
    """Gzipped serialized profile (the on-disk pprof format)."""
    profile = build_profile(rows, event=event, period_ns=period_ns, time_ns=time_ns, duration_ns=duration_ns)
    return gzip.compress(profile.SerializeToString(), mtime=0)
