"""Executable module mappings of one process, with each module's load bias, from /proc/PID/maps.

The unwinder needs, for any runtime pc of a process, which ELF object it is in and the ELF virtual
address it corresponds to.  The load bias of a mapping comes from the object's program headers
(:meth:`ccprofd.elf.addrspace.AddressSpace.load_bias`), never from ad-hoc arithmetic here.
The ``/proc`` root is a parameter so tests can point it at a fixture directory.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

from ccprofd.elf.addrspace import AddressSpace

DEFAULT_PROC_ROOT = "/proc"


@dataclass(frozen=True, slots=True)
class MapEntry:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str
    offset: int
    dev: str
    inode: int
    path: str  # "" for anonymous mappings; "[vdso]", "[stack]", ... for special ones

    @property
    def executable(self) -> bool:
        return "x" in self.perms

    @property
    def file_backed(self) -> bool:
        return self.inode != 0 and self.path.startswith("/") and not self.path.endswith(" (deleted)")


def parse_maps(text: str) -> list[MapEntry]:
    """Parse the text of a maps file (malformed lines are skipped: the kernel does not write any)."""
    out: list[MapEntry] = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        try:
            lo, hi = (int(x, 16) for x in parts[0].split("-", 1))
            offset = int(parts[2], 16)
            inode = int(parts[4])
        except ValueError:
            continue
        path = parts[5].strip() if len(parts) > 5 else ""
        out.append(MapEntry(lo, hi, parts[1], offset, parts[3], inode, path))
    return out


def read_maps(pid: int, proc_root: str = DEFAULT_PROC_ROOT) -> list[MapEntry]:
    """The process's mappings; OSError (e.g. ProcessLookupError/FileNotFoundError) when it is gone."""
    with open(os.path.join(proc_root, str(pid), "maps"), encoding="utf-8", errors="replace") as fh:
        return parse_maps(fh.read())


def start_stack(pid: int, proc_root: str = DEFAULT_PROC_ROOT) -> int:
    """The main thread's initial stack pointer (``startstack``, field 28 of /proc/PID/stat): where a
    walk of the main thread's stack has reached its outermost frame.  0 when it cannot be read."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), encoding="ascii", errors="replace") as fh:
            fields = fh.read().rpartition(")")[2].split()
        return int(fields[25])
    except (OSError, IndexError, ValueError):
        return 0


def object_path(pid: int, path: str, proc_root: str = DEFAULT_PROC_ROOT) -> str:
    """Where this process's file ``path`` can be opened from here (its own root: containers)."""
    via_root = os.path.join(proc_root, str(pid), "root") + path
    return via_root if os.path.exists(via_root) else path


@dataclass(frozen=True, slots=True)
class ModuleMapping:
    """An executable file mapping: runtime [start, end) holds ELF vaddrs [start - bias, end - bias)."""

    start: int
    end: int
    path: str  # as the process sees it
    open_path: str  # where to read it from here
    bias: int
    dev: str
    inode: int
    offset: int = 0  # the mapping's file offset, as /proc/PID/maps has it

    def vaddr(self, address: int) -> int:
        return address - self.bias


class ProcessMaps:
    """A snapshot of one process's executable module mappings, sorted by address."""

    def __init__(self, pid: int, mappings: list[ModuleMapping], other_exec: list[MapEntry]) -> None:
        self.pid = pid
        self.mappings = sorted(mappings, key=lambda m: m.start)
        self.other_exec = other_exec  # executable mappings without an ELF file ([vdso], JIT, deleted)
        self._starts = [m.start for m in self.mappings]

    def find(self, address: int) -> ModuleMapping | None:
        i = bisect_right(self._starts, address) - 1
        if i >= 0 and address < self.mappings[i].end:
            return self.mappings[i]
        return None


AddrSpaceOf = Callable[[str], AddressSpace | None]


def module_mappings(pid: int, addrspace_of: AddrSpaceOf, proc_root: str = DEFAULT_PROC_ROOT) -> ProcessMaps:
    """Executable file mappings of ``pid`` with their load bias.  ``addrspace_of(open_path)`` gives
    the object's PT_LOAD segments (None when it is not a usable ELF: then the mapping is listed in
    ``other_exec``)."""
    mods: list[ModuleMapping] = []
    other: list[MapEntry] = []
    for m in read_maps(pid, proc_root):
        if not m.executable:
            continue
        if not m.file_backed:
            other.append(m)
            continue
        opened = object_path(pid, m.path, proc_root)
        space = addrspace_of(opened)
        if space is None:
            other.append(m)
            continue
        try:
            bias = space.load_bias(m.start, m.offset)
        except ValueError:
            other.append(m)
            continue
        mods.append(ModuleMapping(m.start, m.end, m.path, opened, bias, m.dev, m.inode, m.offset))
    return ProcessMaps(pid, mods, other)
