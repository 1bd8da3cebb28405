"""Function names of any mapped ELF object, from its .symtab/.dynsym, for frames outside the analysed
binary."""

from __future__ import annotations

from bisect import bisect_right


# ------------------------------------------------------------------------------ ELF symbols
class ModuleSymbols:
    """Function symbols of one unanalysed object (``.symtab`` where present, else ``.dynsym``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._starts: list[int] = []
        self._rows: list[tuple[int, int, str]] = []
        try:
            from elftools.elf.elffile import ELFFile

            with open(path, "rb") as fh:
                elf = ELFFile(fh)
                rows: dict[int, tuple[int, int, str]] = {}
                for name in (".dynsym", ".symtab"):
                    sec = elf.get_section_by_name(name)
                    if sec is None or not hasattr(sec, "iter_symbols"):
                        continue
                    for sym in sec.iter_symbols():
                        if sym["st_info"]["type"] not in ("STT_FUNC", "STT_GNU_IFUNC") or not sym.name:
                            continue
                        lo, size = int(sym["st_value"]), int(sym["st_size"])
                        if size <= 0 or sym["st_shndx"] == "SHN_UNDEF":
                            continue
                        old = rows.get(lo)
                        # prefer the public name (no leading underscore) among aliases
                        if old is None or (old[2].startswith("_") and not sym.name.startswith("_")):
                            rows[lo] = (lo, lo + size, sym.name)
        except (OSError, ValueError, ImportError):
            rows = {}
        except Exception:  # malformed ELF: no names, never a crash
            rows = {}
        self._rows = sorted(rows.values())
        self._starts = [r[0] for r in self._rows]

    def name_at(self, vaddr: int) -> str | None:
        i = bisect_right(self._starts, vaddr) - 1
        if i >= 0:
            lo, hi, name = self._rows[i]
            if lo <= vaddr < hi:
                return name
        return None

