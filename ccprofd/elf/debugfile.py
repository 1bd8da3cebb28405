"""Finding a module's separate debug file (the ``.debug`` object Debian's ``*-dbg`` packages and
``objcopy --only-keep-debug`` make): its ``.symtab`` names the local functions a stripped library
lacks (libc's ``msort_with_tmp``) and its DWARF gives source lines.

Lookup order, as gdb's: ``<root>/.build-id/xx/rest.debug`` (the debug file's build-id must match),
then the ``.gnu_debuglink`` name (its CRC-32 must match) in the module's directory, its ``.debug/``
subdirectory and ``<root>/<module's directory>/``; then, only when the caller passes URLs,
debuginfod (``GET <url>/buildid/<hex>/debuginfo``), kept in the ccprofd cache directory.  The
roots are parameters so tests need neither root nor the network.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ccprofd.elf.rawsections import OFFSET, SIZE, SectionHeader, section_headers
from ccprofd.persist.atomicfile import atomic_write_bytes
from ccprofd.persist.cache import default_cache_dir

log = logging.getLogger("ccprofd")

DEFAULT_DEBUG_ROOT = "/usr/lib/debug"
#: Opt-in switch for debuginfod: Debian's libdebuginfod-common sets DEBUGINFOD_URLS for every
#: login shell, which must not make a tracer fetch from the network unasked.
DEBUGINFOD_ENV = "CCPROFD_DEBUGINFOD"

_SHT_NOTE = 7
_NT_GNU_BUILD_ID = 3


@dataclass(frozen=True, slots=True)
class DebugLink:
    """A ``.gnu_debuglink`` section: the debug file's base name and the CRC-32 of its contents."""

    name: str
    crc: int


@dataclass(frozen=True, slots=True)
class ElfIds:
    """What identifies an ELF object's debug file: its GNU build-id (hex) and debug link."""

    build_id: str | None
    debuglink: DebugLink | None


def _build_id(data: bytes | mmap.mmap, sections: dict[str, SectionHeader]) -> str | None:
    for name, h in sections.items():
        if h[1] != _SHT_NOTE or not name.startswith(".note"):
            continue
        pos, end = h[OFFSET], min(h[OFFSET] + h[SIZE], len(data))
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
            name_at = pos + 12
            desc_at = name_at + ((namesz + 3) & ~3)
            if ntype == _NT_GNU_BUILD_ID and bytes(data[name_at:name_at + namesz]) == b"GNU\0":
                return bytes(data[desc_at:desc_at + descsz]).hex() or None
            pos = desc_at + ((descsz + 3) & ~3)
    return None


def read_ids(path: str) -> ElfIds:
    """The build-id and ``.gnu_debuglink`` of ELF ``path`` (None for what it lacks or cannot be read)."""
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            secs = section_headers(data)[1]
            bid = _build_id(data, secs)
            link = None
            got = secs.get(".gnu_debuglink")
            if got is not None and got[SIZE] >= 8:
                raw = bytes(data[got[OFFSET]:got[OFFSET] + got[SIZE]])
                nul = raw.find(b"\0")
                if nul > 0:
                    crc_at = (nul + 4) & ~3
                    if crc_at + 4 <= len(raw):
                        link = DebugLink(raw[:nul].decode("utf-8", "surrogateescape"),
                                         struct.unpack_from("<I", raw, crc_at)[0])
            return ElfIds(bid, link)
    except (OSError, ValueError, struct.error):
        return ElfIds(None, None)


def file_crc32(path: str) -> int | None:
    """CRC-32 of a file's contents, as ``.gnu_debuglink`` records it (zlib's polynomial)."""
    crc = 0
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
    except OSError:
        return None
    return crc & 0xFFFFFFFF


def debuginfod_urls_from_env() -> list[str]:
    """The debuginfod servers to ask: ``DEBUGINFOD_URLS`` (space-separated), but only when
    ``CCPROFD_DEBUGINFOD=1`` opts in (never on by default)."""
    if os.environ.get(DEBUGINFOD_ENV, "") not in ("1", "yes", "true"):
        return []
    return [u for u in os.environ.get("DEBUGINFOD_URLS", "").split() if u]


class DebugFileLocator:
    """Finds (and remembers, per build-id or path) the separate debug file of a module."""

    def __init__(self, debug_root: str = DEFAULT_DEBUG_ROOT, debuginfod_urls: Sequence[str] = (),
                 cache_dir: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> None:
        self.debug_root = debug_root
        self.urls = [u.rstrip("/") for u in debuginfod_urls]
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.timeout = timeout
        self._found: dict[tuple[str, str | None], str | None] = {}
        self._warned: set[str] = set()

    @property
    def debuginfod_dir(self) -> Path:
        return (self._cache_dir if self._cache_dir is not None else default_cache_dir()) / "debuginfod"

    @classmethod
    def from_env(cls, cache_dir: str | os.PathLike[str] | None = None) -> DebugFileLocator:
        """The system debug root, and debuginfod only when opted in (:func:`debuginfod_urls_from_env`),
        its files kept under ``cache_dir``."""
        return cls(debuginfod_urls=debuginfod_urls_from_env(), cache_dir=cache_dir)

    def find(self, path: str, build_id: str | None = None) -> str | None:
        """The debug file of ELF ``path`` (``build_id``: its build-id when the caller knows it),
        or None.  ``path`` itself is never returned."""
        key = (os.path.realpath(path), build_id)
        if key not in self._found:
            self._found[key] = self._find(key[0], build_id)
        return self._found[key]

    def _find(self, path: str, build_id: str | None) -> str | None:
        ids = read_ids(path)
        bid = (build_id or ids.build_id or "").lower() or None
        if bid is not None and len(bid) > 2:
            cand = os.path.join(self.debug_root, ".build-id", bid[:2], bid[2:] + ".debug")
            if self._same_build_id(cand, bid, path):
                return cand
        link = ids.debuglink
        if link is not None and "/" not in link.name:
            d = os.path.dirname(path)
            for cand in (os.path.join(d, link.name), os.path.join(d, ".debug", link.name),
                         os.path.join(self.debug_root, d.lstrip("/"), link.name)):
                if os.path.isfile(cand) and not _same_file(cand, path) and file_crc32(cand) == link.crc:
                    return cand
        if bid is not None and self.urls:
            return self._debuginfod(bid)
        return None

    @staticmethod
    def _same_build_id(cand: str, bid: str, path: str) -> bool:
        if not os.path.isfile(cand) or _same_file(cand, path):
            return False
        return read_ids(cand).build_id == bid

    def _debuginfod(self, bid: str) -> str | None:
        target = self.debuginfod_dir / bid / "debuginfo"
        if target.is_file() and read_ids(str(target)).build_id == bid:
            return str(target)
        if not self.urls:
            return None
        # imported here: urllib.request pulls in http.client, email and ssl (~25-70 ms), which every
        # `ccprofd trace` start-up paid while only a configured debuginfod server uses them
        import urllib.error
        import urllib.request

        for url in self.urls:
            try:
                with urllib.request.urlopen(f"{url}/buildid/{bid}/debuginfo", timeout=self.timeout) as r:
                    data = r.read()
            except (OSError, ValueError, urllib.error.URLError) as exc:
                self._warn(url, f"debuginfod {url}: no debug file for {bid}: {exc}")
                continue
            if _build_id(data, section_headers(data)[1]) != bid:
                self._warn(url, f"debuginfod {url}: the file served for {bid} has another build-id")
                continue
            try:
                atomic_write_bytes(target, data)
            except OSError as exc:
                self._warn(str(target), f"debuginfod: cannot keep {target}: {exc}")
                return None
            return str(target)
        return None

    def _warn(self, key: str, message: str) -> None:
        """One line per server (a trace of many modules must not print one per module)."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)


def _same_file(a: str, b: str) -> bool:
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


_DEFAULT: DebugFileLocator | None = None


def default_locator() -> DebugFileLocator:
    """The process's locator: the system debug root, debuginfod only when opted in (see
    :func:`debuginfod_urls_from_env`)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = DebugFileLocator.from_env()
    return _DEFAULT
