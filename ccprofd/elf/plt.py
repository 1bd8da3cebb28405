"""PLT stubs -> imported symbol names, through the GOT slot each stub jumps through.

Works for lazy ``.plt``, IBT ``.plt.sec`` and ``.plt.got`` alike: a stub's first indirect jump
``jmp qword ptr [rip + d]`` names its GOT slot, and the dynamic relocation at that slot
(``R_X86_64_JUMP_SLOT`` in ``.rela.plt``, ``R_X86_64_GLOB_DAT`` in ``.rela.dyn``) names the symbol.
"""

from __future__ import annotations

import re

from elftools.elf.relocation import RelocationSection

from ccprofd.elf.image import ElfImage, Section
from ccprofd.elf.x86dis import x86_64

_RIP_MEM = re.compile(r"\[rip(?: ([+-]) (0x[0-9a-f]+|\d+))?\]")  # "[rip]" when disp == 0


class PltResolver:
    def __init__(self, image: ElfImage) -> None:
        self.image = image
        self.sections: list[Section] = image.plt_sections()
        self._slot_names = self._read_slots()
        self._cache: dict[int, str | None] = {}
        self._md = x86_64()
        self._ranges = [(s.vaddr, s.vaddr + s.size) for s in self.sections]
        # the span of all PLT sections: most addresses asked about (every call target) lie outside it
        self._lo = min((lo for lo, _ in self._ranges), default=0)
        self._hi = max((hi for _, hi in self._ranges), default=0)

    def _read_slots(self) -> dict[int, str]:
        with self.image.parsing("dynamic relocations"):
            return self._relocated_slots()

    def _relocated_slots(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for sec in self.image.elf.iter_sections():
            if not isinstance(sec, RelocationSection) or not sec.is_RELA():
                continue
            symtab_index = sec["sh_link"]
            if not symtab_index:
                continue
            symtab = self.image.elf.get_section(symtab_index)
            if not hasattr(symtab, "get_symbol"):
                continue
            for r_offset, idx, _type, _addend in self.image.relocations(sec):
                if idx == 0:
                    continue
                name = self.image.symbol_at(symtab_index, idx)[0]
                if name:
                    out.setdefault(r_offset, name)
        return out

    def ranges(self) -> list[tuple[int, int]]:
        """The [lo, hi) vaddr ranges of the PLT sections."""
        return list(self._ranges)

    def in_plt(self, addr: int) -> bool:
        if not self._lo <= addr < self._hi:
            return False
        return any(lo <= addr < hi for lo, hi in self._ranges)

    def resolve(self, stub: int) -> str | None:
        """Imported symbol name of the stub at ``stub`` (None if it cannot be resolved)."""
        if stub in self._cache:
            return self._cache[stub]
        name = None
        try:
            code = self.image.bytes_at(stub, 32)
        except ValueError:  # a PLT section outside the loaded segments (a corrupt file): unresolved
            code = b""
        for addr, size, mnem, ops in self._md.disasm_lite(code, stub):
            if mnem.endswith("jmp"):
                m = _RIP_MEM.search(ops)
                if m:
                    disp = (int(m.group(2), 0) if m.group(2) else 0) * (-1 if m.group(1) == "-" else 1)
                    name = self._slot_names.get(addr + size + disp)
                break
        self._cache[stub] = name
        return name
