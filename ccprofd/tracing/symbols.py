"""Function names of any mapped ELF object, from its .symtab/.dynsym, for frames outside the analysed
binary."""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

from ccprofd.persist.cache import file_identity

if TYPE_CHECKING:
    from ccprofd.persist.cache import AnalysisCache

CACHE_KIND = "symbols"


def _path_digest(path: str) -> str:
    """A short digest of the path (the identity already names the file; the path keeps two
    hard links' entries apart, as the cache entry records the path it was made for)."""
    import hashlib

    return hashlib.sha256(path.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------ ELF symbols
class ModuleSymbols:
    """Function symbols of one unanalysed object (``.symtab`` where present, else ``.dynsym``).
    With a ``cache``, the table is kept there by file identity: parsing libc's symbols with
    pyelftools takes ~0.3 s, paid at the first sample in libc of every trace otherwise."""

    def __init__(self, path: str, cache: AnalysisCache | None = None) -> None:
        self.path = path
        ident = file_identity(path) if cache is not None else None
        key = f"{ident}-{_path_digest(path)}" if ident is not None else None
        if cache is not None and key is not None:
            got = cache.load(CACHE_KIND, key)
            if isinstance(got, list) and got and isinstance(got[0], str) and got[0] == path:
                self._set_rows([(int(lo), int(hi), str(n)) for lo, hi, n in got[1:]])
                return
        rows = self._read(path)
        self._set_rows(rows)
        if cache is not None and key is not None and file_identity(path) == ident:
            cache.store(CACHE_KIND, key, [path, *self._rows])

    def _set_rows(self, rows: list[tuple[int, int, str]]) -> None:
        self._rows = sorted(rows)
        self._starts = [r[0] for r in self._rows]

    @staticmethod
    def _read(path: str) -> list[tuple[int, int, str]]:
        rows: dict[int, tuple[int, int, str]] = {}
        try:
            from elftools.elf.elffile import ELFFile

            with open(path, "rb") as fh:
                elf = ELFFile(fh)
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
        return list(rows.values())

    def name_at(self, vaddr: int) -> str | None:
        i = bisect_right(self._starts, vaddr) - 1
        if i >= 0:
            lo, hi, name = self._rows[i]
            if lo <= vaddr < hi:
                return name
        return None

