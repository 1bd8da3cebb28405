"""The objects a binary loads at exec: its interpreter and DT_NEEDED libraries, searched as ld.so does."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from ccprofd.persist.cache import file_identity

if TYPE_CHECKING:
    from ccprofd.persist.cache import AnalysisCache

CACHE_KIND = "load-set"
LIBRARY_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib",
                "/usr/lib")



def load_set(binary: str, limit: int = 64, cache: AnalysisCache | None = None) -> list[str]:
    """The binary, its interpreter and the shared objects it needs (DT_NEEDED, searched in its
    RPATH/RUNPATH and the standard directories): what the process will map at exec, so their
    tables can be loaded before it runs.  Objects not found here are loaded when they are mapped.

    With a ``cache`` the answer is kept by the binary's file identity, with the identity of every
    object it parsed and the mtime of every directory it searched: any of them changing (a library
    replaced, a new one installed earlier in the search) makes it a miss.  Parsing the closure
    with pyelftools costs ~0.1 s of every start-up otherwise."""
    real = os.path.realpath(binary)
    key = None
    if cache is not None:
        ident = file_identity(real)
        if ident is not None:
            key = f"{ident}-{hashlib.sha256(real.encode()).hexdigest()[:16]}-{limit}"
            got = cache.load(CACHE_KIND, key)
            if got is not None and _still_valid(got, real):
                return [str(p) for p in got["out"]]
    files: dict[str, str | None] = {}
    dirs: dict[str, int | None] = {}
    out = _load_set(binary, limit, files, dirs)
    if cache is not None and key is not None and all(file_identity(p) == i for p, i in files.items()):
        cache.store(CACHE_KIND, key, {"binary": real, "out": out, "files": files, "dirs": dirs})
    return out


def _dir_mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _still_valid(entry: Any, binary: str) -> bool:
    if not isinstance(entry, dict) or entry.get("binary") != binary:
        return False
    try:
        return (all(file_identity(p) == i for p, i in entry["files"].items())
                and all(_dir_mtime(d) == m for d, m in entry["dirs"].items())
                and isinstance(entry["out"], list))
    except (KeyError, AttributeError, TypeError):
        return False


def _load_set(binary: str, limit: int, files: dict[str, str | None],
              dirs: dict[str, int | None]) -> list[str]:
    """load_set's search; records the identity of each file it parsed in ``files`` and the mtime
    of each directory it looked into in ``dirs`` (what the answer depends on)."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    out: list[str] = []
    todo = [binary]
    seen: set[str] = set()
    while todo and len(out) < limit:
        path = os.path.realpath(todo.pop(0))
        if path in seen:
            continue
        seen.add(path)
        files[path] = file_identity(path)
        try:
            with open(path, "rb") as fh:
                elf = ELFFile(fh)
                out.append(path)
                needed: list[str] = []
                rpaths: list[str] = []
                for seg in elf.iter_segments():
                    if seg["p_type"] == "PT_INTERP":
                        todo.append(str(seg.get_interp_name()))  # type: ignore[attr-defined]
                for sec in elf.iter_sections():
                    if not isinstance(sec, DynamicSection):
                        continue
                    for tag in sec.iter_tags():
                        if tag.entry.d_tag == "DT_NEEDED":
                            needed.append(str(getattr(tag, "needed", "")))
                        elif tag.entry.d_tag in ("DT_RPATH", "DT_RUNPATH"):
                            value = str(getattr(tag, "rpath", None) or getattr(tag, "runpath", ""))
                            rpaths += [d.replace("$ORIGIN", os.path.dirname(path))
                                       for d in value.split(":") if d]
        except Exception:  # not an ELF file we can read: it is loaded (or flagged) when mapped
            continue
        for name in needed:
            for d in (*rpaths, *LIBRARY_DIRS):
                if d not in dirs:
                    dirs[d] = _dir_mtime(d)
                cand = os.path.join(d, name)
                if os.path.exists(cand):
                    todo.append(cand)
                    break
    return out

