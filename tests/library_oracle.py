"""Which function holds an address of a shared object, from binutils alone (no ccprofd imports).

Used to check the names ccprofd gives unanalysed (library) frames against ``strace -k``, which
prints each frame as a module and a file offset. The rules:

* **file offset -> ELF vaddr**: the ``PT_LOAD`` segment of ``readelf -lW`` whose file bytes hold
  the offset.
* **function of a vaddr**: the ``nm -S`` text symbol whose ``[start, start + size)`` holds it,
  from the object's ``.symtab`` and ``.dynsym`` and from its separate debug file
  (``/usr/lib/debug/.build-id/xx/yyyy.debug``, by the build-id of ``readelf -n``; libc6-dbg's),
  symbols at one address being aliases of one function; where no symbol holds it, the
  ``.eh_frame`` FDE whose pc range holds it (a stripped local function, named ``sub_<hex start>``).
  gcc's ``<f>.cold`` parts run in ``<f>``'s frame, so they stand for ``<f>``.
* Return addresses are looked up at ``ra - 1`` (the call instruction), the innermost frame's pc as
  itself.
"""

from __future__ import annotations

import bisect
import functools
import os
import re
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from binutils_oracle import parse_fde_ranges

_COLD = re.compile(r"^(.+)\.cold(?:\.\d+)?$")


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True,
                          env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}).stdout


def build_id(path: str) -> str | None:
    m = re.search(r"Build ID: ([0-9a-f]+)", _run("readelf", "-n", path))
    return m.group(1) if m else None


def debug_file(path: str) -> str | None:
    """The separate debug file of ``path`` under /usr/lib/debug/.build-id, if installed."""
    bid = build_id(path)
    if not bid:
        return None
    candidate = f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug"
    return candidate if os.path.exists(candidate) else None


@dataclass
class ObjectSymbols:
    """Function starts of one ELF object, by the rules of the module docstring."""

    path: str
    loads: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, vaddr, filesz)
    starts: list[int] = field(default_factory=list)  # sorted symbol starts
    sizes: dict[int, int] = field(default_factory=dict)
    names: dict[int, set[str]] = field(default_factory=dict)
    fdes: list[tuple[int, int]] = field(default_factory=list)  # sorted (start, end)
    has_debug_file: bool = False

    def vaddr(self, file_offset: int) -> int | None:
        for off, va, filesz in self.loads:
            if off <= file_offset < off + filesz:
                return file_offset - off + va
        return None

    def function_at(self, vaddr: int) -> tuple[int, set[str]] | None:
        """(start, names) of the function holding ``vaddr``; names empty for an FDE-only one."""
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i >= 0 and vaddr < self.starts[i] + max(self.sizes[self.starts[i]], 1):
            start = self.starts[i]
            names = self.names[start]
            owners = {m.group(1) for n in names if (m := _COLD.match(n))}
            if owners:
                return self._start_of_owner(owners), owners
            return start, names
        j = bisect.bisect_right(self.fdes, (vaddr, 1 << 64)) - 1
        if j >= 0 and self.fdes[j][0] <= vaddr < self.fdes[j][1]:
            return self.fdes[j][0], set()
        return None

    def _start_of_owner(self, owners: set[str]) -> int:
        for start in self.starts:
            if self.names[start] & owners:
                return start
        return -1

    def agrees(self, vaddr: int, name: str) -> bool | None:
        """Whether ``name`` is the function holding ``vaddr`` (None: no rule names it)."""
        found = self.function_at(vaddr)
        if found is None:
            return None
        start, names = found
        if name.startswith("sub_"):
            try:
                return int(name[4:], 16) == start
            except ValueError:
                return False
        if not names:
            return None  # a function known only by its .eh_frame FDE: no symbol names it
        return name in names or any(n.split("@", 1)[0] == name for n in names)


def _symbols(text: str, obj: ObjectSymbols) -> None:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 4 or parts[2] not in ("T", "t", "W", "w", "i"):
            continue
        start, size = int(parts[0], 16), int(parts[1], 16)
        obj.sizes[start] = max(obj.sizes.get(start, 0), size)
        obj.names.setdefault(start, set()).add(parts[3].split("@", 1)[0])


@functools.cache
def object_symbols(path: str) -> ObjectSymbols:
    obj = ObjectSymbols(path)
    for line in _run("readelf", "-lW", path).splitlines():
        f = line.split()
        if f and f[0] == "LOAD":
            obj.loads.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
    dbg = debug_file(path)
    obj.has_debug_file = dbg is not None
    _symbols(_run("nm", "-S", "--defined-only", path), obj)
    _symbols(_run("nm", "-D", "-S", "--defined-only", path), obj)
    if dbg:
        _symbols(_run("nm", "-S", "--defined-only", dbg), obj)
    obj.starts = sorted(obj.sizes)
    obj.fdes = parse_fde_ranges(_run("readelf", "--debug-dump=frames", path))
    return obj


class _StraceFrame(Protocol):
    module: str | None
    offset: int


def strace_vaddrs(frames: Iterable[_StraceFrame]) -> Iterator[tuple[str | None, int | None]]:
    """``strace -k`` frames (module, file offset), innermost first, as (the module's real path, ELF
    vaddr): the syscall's pc, then return addresses.  None where strace names no module or the
    offset is in no segment of it.  Lazily: a caller that stops early reads no further object."""
    for rf in frames:
        module = os.path.realpath(rf.module) if rf.module else None
        yield module, object_symbols(module).vaddr(rf.offset) if module else None
