"""ElfImage.symbols() unpacks the symbol tables with struct (node's 185k symbols took ~9 s through
pyelftools): it must give exactly what pyelftools' iter_symbols gives (the reference), names, values,
sizes, types (STT_GNU_IFUNC in libc), bindings and definedness, on system objects and the test
programs (with .symtab), and leave a table it cannot read plainly to pyelftools."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
from programs.build import build

from ccprofd.elf.image import ElfImage, Symbol

SYSTEM = ["/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/bash", "/usr/bin/gzip"]


def _reference(image: ElfImage) -> list[Symbol]:
    out = []
    for table in (".symtab", ".dynsym"):
        sec = image.elf.get_section_by_name(table)
        if sec is None or not hasattr(sec, "iter_symbols"):
            continue
        for sym in sec.iter_symbols():
            info = sym["st_info"]
            out.append(Symbol(sym.name, sym["st_value"], sym["st_size"], info["type"], info["bind"],
                              sym["st_shndx"] != "SHN_UNDEF", table))
    return out


@pytest.mark.parametrize("path", [*SYSTEM, "calls", "switch", "exceptions"])
def test_struct_symbols_equal_pyelftools(path: str) -> None:
    if "/" not in path:
        path = str(build(path, opt="O2", pie=True, strip=False))
        assert any(s.table == ".symtab" for s in ElfImage(path).symbols())
    image = ElfImage(path)
    fast = image.symbols()
    assert fast == _reference(image)
    assert any(s.table == ".dynsym" for s in fast)
    if path.endswith("libc.so.6"):  # indirect functions (type 10; pyelftools' name for it)
        assert {s.type for s in fast} >= {"STT_FUNC", "STT_OBJECT", _reference_type_10(image)}


def _reference_type_10(image: ElfImage) -> str:
    return str(image.elf.structs.Elf_Sym.parse(struct.pack("<IBBHQQ", 0, 10, 0, 1, 0, 0))["st_info"]["type"])


def test_symbol_table_with_a_wider_entry_size_is_read_at_its_stride(tmp_path: Path) -> None:
    """An sh_entsize other than 24 (entries at wider strides): read at those strides, as pyelftools
    reads them."""
    src = Path(str(build("calls", opt="O2", pie=True, strip=False)))
    odd = tmp_path / "odd"
    shutil.copy(src, odd)
    image = ElfImage(str(odd))
    sec = image.elf.get_section_by_name(".dynsym")
    index = next(i for i, s in enumerate(image.elf.iter_sections()) if s.name == ".dynsym")
    shoff, shentsize = image.elf.header["e_shoff"], image.elf.header["e_shentsize"]
    data = bytearray(odd.read_bytes())
    entsize_at = shoff + index * shentsize + 56  # sh_entsize: the header's last field
    assert struct.unpack_from("<Q", data, entsize_at)[0] == 24
    size = sec["sh_size"]
    struct.pack_into("<Q", data, entsize_at, 32 if size % 32 == 0 else size)
    odd.write_bytes(bytes(data))
    image = ElfImage(str(odd))
    assert image.elf.get_section_by_name(".dynsym")["sh_entsize"] > 24
    assert image.symbols() == _reference(image)


@pytest.mark.parametrize("path", ["/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6",
                                  "/usr/bin/bash"])
def test_relocations_and_their_symbols_as_pyelftools_reads_them(path: str) -> None:
    """ElfImage.relocations and symbol_at (struct-unpacked) give each RELA entry and the symbol it
    names as pyelftools' iter_relocations and get_symbol do."""
    from elftools.elf.relocation import RelocationSection

    image = ElfImage(path)
    seen = 0
    for sec in image.elf.iter_sections():
        if not isinstance(sec, RelocationSection) or not sec.is_RELA():
            continue
        want = [(r["r_offset"], r["r_info_sym"], r["r_info_type"], r["r_addend"])
                for r in sec.iter_relocations()]
        assert image.relocations(sec) == want, sec.name
        link = sec["sh_link"]
        for _off, index, _type, _addend in want:
            if link and index:
                sym = image.elf.get_section(link).get_symbol(index)
                want_sym = (sym.name, sym["st_value"], sym["st_shndx"] != "SHN_UNDEF")
                assert image.symbol_at(link, index) == want_sym
                seen += 1
    assert seen
