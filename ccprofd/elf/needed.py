"""The objects a binary loads at exec: its interpreter and DT_NEEDED libraries, searched as ld.so does."""

from __future__ import annotations

import os

LIBRARY_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib",
                "/usr/lib")



def load_set(binary: str, limit: int = 64) -> list[str]:
    """The binary, its interpreter and the shared objects it needs (DT_NEEDED, searched in its
    RPATH/RUNPATH and the standard directories): what the process will map at exec, so their
    tables can be loaded before it runs.  Objects not found here are loaded when they are mapped."""
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
        try:
            with open(path, "rb") as fh:
                elf = ELFFile(fh)
                out.append(path)
                needed: list[str] = []
                dirs: list[str] = []
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
                            dirs += [d.replace("$ORIGIN", os.path.dirname(path))
                                     for d in value.split(":") if d]
        except Exception:  # not an ELF file we can read: it is loaded (or flagged) when mapped
            continue
        for name in needed:
            for d in (*dirs, *LIBRARY_DIRS):
                cand = os.path.join(d, name)
                if os.path.exists(cand):
                    todo.append(cand)
                    break
    return out

