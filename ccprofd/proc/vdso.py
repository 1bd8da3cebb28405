"""The vDSO as a module of a process's mappings, for the unwinders (BPF unwind mode's tables and the
ptrace walk of thread snapshots).

The kernel maps a complete ELF image at ``[vdso]`` -- with its own ``.eh_frame`` -- but no file, so
/proc/PID/maps lists it among the executable mappings without one and neither unwinder could walk
through (or name) a frame there.  The image is read from the process's memory and kept as a file
under its content hash (in the cache directory; a private temporary file when that is read-only),
so it is opened, analysed and cached by build-id like any other module.  One place for both
unwinders: they must agree on what a frame in the vDSO is.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from ccprofd.persist.atomicfile import atomic_write_bytes
from ccprofd.proc.maps import DEFAULT_PROC_ROOT, AddrSpaceOf, ModuleMapping, ProcessMaps

VDSO_PATH = "[vdso]"
MAX_VDSO_BYTES = 1 << 20  # a few pages in practice; anything larger is not a vDSO image


class VdsoImages:
    """Files holding the vDSO images seen so far, by content hash (one per kernel, in practice)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[str, str] = {}  # content hash -> file holding that image
        self._temp_files: list[str] = []

    def image(self, pid: int, start: int, end: int, proc_root: str = DEFAULT_PROC_ROOT) -> str | None:
        """A file holding the vDSO image mapped at [start, end) in ``pid`` (None: unreadable)."""
        if not 0 < end - start <= MAX_VDSO_BYTES:
            return None
        try:
            with open(os.path.join(proc_root, str(pid), "mem"), "rb", buffering=0) as fh:
                fh.seek(start)
                data = fh.read(end - start)
        except (OSError, OverflowError, ValueError):
            return None
        if len(data) != end - start or not data.startswith(b"\x7fELF"):
            return None
        digest = hashlib.sha256(data).hexdigest()[:32]
        known = self._files.get(digest)
        if known is not None:
            return known
        path = self.directory / f"vdso-{digest}.so"
        try:
            if not path.exists():
                atomic_write_bytes(path, data)
            where = str(path)
        except OSError:  # read-only cache directory: a private copy, removed by close()
            fd, where = tempfile.mkstemp(prefix="ccprofd-vdso-", suffix=".so")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            self._temp_files.append(where)
        self._files[digest] = where
        return where

    def with_vdso(self, maps: ProcessMaps, addrspace_of: AddrSpaceOf,
                  proc_root: str = DEFAULT_PROC_ROOT) -> ProcessMaps:
        """``maps`` with the process's ``[vdso]`` mapping as a module (path ``[vdso]``, opened from
        the image's file).  Unchanged when there is none or it cannot be read: a pc there then stays
        outside every module, and is flagged as such."""
        vdso = next((m for m in maps.other_exec if m.path == VDSO_PATH), None)
        if vdso is None:
            return maps
        path = self.image(maps.pid, vdso.start, vdso.end, proc_root)
        space = addrspace_of(path) if path is not None else None
        if path is None or space is None:
            return maps
        try:
            bias = space.load_bias(vdso.start, vdso.offset)
        except ValueError:
            return maps
        mapping = ModuleMapping(vdso.start, vdso.end, VDSO_PATH, path, bias, vdso.dev, vdso.inode)
        return ProcessMaps(maps.pid, [*maps.mappings, mapping], [m for m in maps.other_exec if m is not vdso])

    def close(self) -> None:
        """Remove the private copies (the cache directory's files stay: they are the cache)."""
        removed = set(self._temp_files)
        for tmp in removed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._temp_files.clear()
        self._files = {k: v for k, v in self._files.items() if v not in removed}
