"""Symbol -> file offset, for probes placed by symbol name."""

from __future__ import annotations

from ccprofd.elf.errors import BinaryError
from ccprofd.elf.image import ElfImage


def symbol_offset(path: str, sym: str, sym_off: int = 0) -> int:
    """File offset of ``sym`` (+ ``sym_off``) in ELF ``path``, from its symbol tables (BinaryError
    when the file is no usable ELF object or has no such function symbol)."""
    image = ElfImage(path)
    for s in image.symbols():
        if s.name == sym and s.defined and s.type in ("STT_FUNC", "STT_GNU_IFUNC"):
            try:
                return image.addrspace.vaddr_to_offset(s.value + sym_off)
            except ValueError as exc:
                raise BinaryError(path, f"symbol {sym}: {exc}") from None
    raise BinaryError(path, f"no function symbol {sym}")
