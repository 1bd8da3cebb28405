"""The ELF objects a process maps, as the stack walks over its memory need them: PT_LOAD segments
(load bias), build-id (symbols) and CFI unwind table, per file.

Why here: both the ptrace walk of thread snapshots (:mod:`ccprofd.proc.threadsnap`) and the walk
of a ``--scope`` entry's copied stack (:mod:`ccprofd.tracing.instrumented.scopeprefix`) read the
same facts of the same files.

A :class:`ModuleCache` owns the vDSO images it adds to maps (:mod:`ccprofd.proc.vdso`): when the
cache directory is read-only they are private temporary files, removed by :meth:`ModuleCache.close`,
so whoever creates a ModuleCache closes it when its last walk is done (a ``with`` block, or the
owner's own ``close``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import TracebackType

from ccprofd.elf import cfi
from ccprofd.elf.addrspace import AddressSpace
from ccprofd.persist.cache import AnalysisCache
from ccprofd.proc.maps import ModuleMapping, ProcessMaps
from ccprofd.proc.vdso import VdsoImages


@dataclass(slots=True)
class _Module:
    addrspace: AddressSpace
    build_id: str | None
    table: cfi.UnwindTable | None


class ModuleCache:
    """ELF facts of the objects processes map -- PT_LOAD segments, build-id, unwind table -- kept
    per file identity (dev, inode, size, mtime) so a repeated walk reads nothing again; tables
    come from :func:`ccprofd.elf.cfi.load_table` (the analysis cache, by content hash)."""

    def __init__(self, cache: AnalysisCache | None = None) -> None:
        self.cache = cache
        self._mods: dict[tuple[int, int, int, int], _Module | None] = {}
        # the vDSO image kept as a file under the cache directory, as unwind mode keeps it
        self._vdso = VdsoImages((cache if cache is not None else AnalysisCache()).directory / "vdso")

    def _get(self, path: str) -> _Module | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if ident not in self._mods:
            self._mods[ident] = self._load(path)
        return self._mods[ident]

    def _load(self, path: str) -> _Module | None:
        from ccprofd.elf.errors import BinaryError
        from ccprofd.elf.image import ElfImage

        try:
            image = ElfImage(path)
        except (OSError, BinaryError, ValueError):
            return None
        try:
            table: cfi.UnwindTable | None = cfi.load_table(path, self.cache, image)
        except BinaryError:
            table = None  # corrupt CFI: a walk reaching it stops with no_table
        return _Module(image.addrspace, image.build_id(), table)

    def with_vdso(self, maps: ProcessMaps, proc_root: str) -> ProcessMaps:
        """``maps`` with the [vdso] mapping as a module (:mod:`ccprofd.proc.vdso`; unchanged when it
        cannot be read)."""
        return self._vdso.with_vdso(maps, self.addrspace_of, proc_root)

    def addrspace_of(self, path: str) -> AddressSpace | None:
        mod = self._get(path)
        return mod.addrspace if mod is not None else None

    def table_of(self, mapping: ModuleMapping) -> cfi.UnwindTable | None:
        mod = self._get(mapping.open_path)
        return mod.table if mod is not None else None

    def build_id_of(self, mapping: ModuleMapping) -> str | None:
        mod = self._get(mapping.open_path)
        return mod.build_id if mod is not None else None

    def close(self) -> None:
        """Remove the private vDSO copies (see the module docstring); maps made before stay valid
        as values, but a module read through them afterwards is no longer found."""
        self._vdso.close()

    def __enter__(self) -> ModuleCache:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
