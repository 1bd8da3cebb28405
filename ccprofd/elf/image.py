"""Opening and validating one x86-64 ELF object, and the facts later modules read from it.

Every way an input can be wrong is turned into a :class:`BinaryError` with a one-line reason here,
so that the rest of the analysis can assume a well-formed ELF64 x86-64 object.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.construct.core import ConstructError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import StringTableSection

from ccprofd.elf.addrspace import AddressSpace, Segment
from ccprofd.elf.compressed import inflate
from ccprofd.elf.errors import BinaryError
from ccprofd.elf.identity import read_elf_file

GO_BUILDID_NOTE = 4  # the Go linker's build ID note type (owner "Go", section .note.go.buildid)

SHF_EXECINSTR = 0x4
SHF_ALLOC = 0x2
PLT_SECTIONS = (".plt", ".plt.sec", ".plt.got")
#: What pyelftools (and reading the bytes it points at) raises on a malformed object.  pyelftools
#: parses lazily, so this can come from any later read of the ELF, not only from opening it.
PARSE_ERRORS = (ELFError, ConstructError, struct.error, ValueError, KeyError, IndexError, OverflowError)
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym: st_name, st_info, st_other, st_shndx, st_value, st_size
_RELA = struct.Struct("<QQq")  # Elf64_Rela: r_offset, r_info, r_addend
_MACHINES = {3: "x86 (EM_386)", 40: "ARM (EM_ARM)", 183: "AArch64 (EM_AARCH64)", 243: "RISC-V (EM_RISCV)",
             8: "MIPS (EM_MIPS)", 20: "PowerPC (EM_PPC)", 21: "PowerPC64 (EM_PPC64)", 22: "s390 (EM_S390)"}


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    vaddr: int
    offset: int
    size: int
    flags: int
    type: str

    @property
    def executable(self) -> bool:
        return bool(self.flags & SHF_EXECINSTR) and bool(self.flags & SHF_ALLOC)

    def contains(self, vaddr: int) -> bool:
        return self.vaddr <= vaddr < self.vaddr + self.size


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    value: int
    size: int
    type: str  # STT_FUNC, STT_GNU_IFUNC, STT_OBJECT, ...
    bind: str
    defined: bool
    table: str  # ".symtab" | ".dynsym"


class ElfImage:
    """A validated ELF64 x86-64 object held in memory."""

    def __init__(self, path: str, data: bytes | None = None, content_hash: str | None = None) -> None:
        """``data``: the file's bytes as :func:`read_elf_file` returned them, if already read;
        ``content_hash``: their SHA-256 (hex), if already computed (node: 99 MB, ~0.2 s to hash)."""
        self.path = os.path.abspath(path)
        self.data = read_elf_file(path) if data is None else data
        try:
            self.elf = ELFFile(BytesIO(self.data))
            self._validate_header(path)
            self.sections = self._read_sections(path)
            self.addrspace = AddressSpace([
                Segment(s["p_vaddr"], s["p_memsz"], s["p_offset"], s["p_filesz"], s["p_flags"])
                for s in self.elf.iter_segments() if s["p_type"] == "PT_LOAD"])
        except PARSE_ERRORS as exc:
            raise BinaryError(path, f"truncated or corrupt ELF ({_short(exc)})") from None
        if not any(s.executable and s.size > 0 and s.type != "SHT_NOBITS" for s in self.sections.values()):
            raise BinaryError(path, "ELF has no executable code (no allocated SHF_EXECINSTR section)")
        for sec in self.code_sections():
            seg = self.addrspace.segment_of(sec.vaddr)
            if seg is None or sec.vaddr + sec.size > seg.vaddr + seg.filesz:
                raise BinaryError(path, f"corrupt ELF (code section {sec.name} at {sec.vaddr:#x} is not "
                                        "inside the file bytes of a PT_LOAD segment)")
        self.content_hash = content_hash if data is not None and content_hash else \
            hashlib.sha256(self.data).hexdigest()
        self._relocations: dict[tuple[int, int], list[tuple[int, int, int, int]] | None] = {}
        self._symbols_of: dict[int, list[Symbol] | None] = {}

    @contextlib.contextmanager
    def parsing(self, what: str) -> Iterator[None]:
        """Turn a pyelftools error met while reading ``what`` of this object into a
        :class:`BinaryError` (a corrupt table is found only when it is read)."""
        try:
            yield
        except PARSE_ERRORS as exc:
            raise BinaryError(self.path, f"corrupt ELF ({what}: {_short(exc)})") from None

    # --------------------------------------------------------------------------- validation
    def _validate_header(self, path: str) -> None:
        if self.elf.elfclass != 64:
            raise BinaryError(path, "32-bit ELF (ELFCLASS32); only x86-64 ELF64 objects are supported")
        machine = self.elf.header["e_machine"]
        if machine != "EM_X86_64":
            raw = struct.unpack_from("<H", self.data, 18)[0]
            desc = _MACHINES.get(raw, str(machine))
            raise BinaryError(path, f"ELF for {desc}; only x86-64 is supported")
        if not self.elf.little_endian:
            raise BinaryError(path, "big-endian ELF; only x86-64 is supported")
        if self.elf.header["e_type"] not in ("ET_EXEC", "ET_DYN"):
            etype = self.elf.header["e_type"]
            raise BinaryError(path, f"ELF type {etype} is not an executable or shared object")
        shoff, shnum, shentsize = (self.elf.header[k] for k in ("e_shoff", "e_shnum", "e_shentsize"))
        if shoff + shnum * shentsize > len(self.data):
            raise BinaryError(path, "truncated ELF (section header table past end of file)")

    def _read_sections(self, path: str) -> dict[str, Section]:
        out: dict[str, Section] = {}
        for sec in self.elf.iter_sections():
            if sec["sh_type"] != "SHT_NOBITS" and sec["sh_offset"] + sec["sh_size"] > len(self.data):
                raise BinaryError(path, f"truncated ELF (section {sec.name} past end of file)")
            out.setdefault(sec.name, Section(sec.name, sec["sh_addr"], sec["sh_offset"], sec["sh_size"],
                                             sec["sh_flags"], sec["sh_type"]))
        return out

    # -------------------------------------------------------------------------------- facts
    @property
    def elf_type(self) -> str:
        return "DYN" if self.elf.header["e_type"] == "ET_DYN" else "EXEC"

    @property
    def pie(self) -> bool:
        """True for position-independent executables (ET_DYN with PT_INTERP or DF_1_PIE)."""
        if self.elf_type != "DYN":
            return False
        with self.parsing("program headers"):
            if any(seg["p_type"] == "PT_INTERP" for seg in self.elf.iter_segments()):
                return True
        return bool(self.dynamic_tags().get("DT_FLAGS_1", 0) & 0x08000000)

    @property
    def entry(self) -> int:
        return int(self.elf.header["e_entry"])

    def build_id(self) -> str | None:
        """The GNU build-id (hex), or for a Go binary linked without one (Go's own linker, as every
        ``CGO_ENABLED=0`` build) the SHA-1 of its Go build ID (``go tool buildid``): like a GNU
        build-id, a hash of what was built, so the models, caches and frames keyed by build-id hold
        for such binaries too.  None when the object has neither."""
        if not hasattr(self, "_build_id"):
            with self.parsing("notes"):
                self._build_id = self._read_build_id()
        return self._build_id

    def _read_build_id(self) -> str | None:
        go_id: bytes | None = None
        for sec in self.elf.iter_sections():
            if sec["sh_type"] != "SHT_NOTE":
                continue
            for note in sec.iter_notes():  # type: ignore[attr-defined]
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return str(note["n_desc"])
                # Go's note: owner "Go", type 4 (which pyelftools names after GNU's type 4)
                if note["n_name"] == "Go" and note["n_type"] in (GO_BUILDID_NOTE, "NT_GNU_GOLD_VERSION"):
                    desc = note["n_desc"]
                    go_id = desc if isinstance(desc, bytes) else str(desc).encode()
        return hashlib.sha1(go_id.rstrip(b"\0")).hexdigest() if go_id else None

    def code_sections(self) -> list[Section]:
        """Executable sections with file bytes, in address order (what objdump -d disassembles)."""
        return sorted((s for s in self.sections.values()
                       if s.executable and s.type != "SHT_NOBITS" and s.size > 0), key=lambda s: s.vaddr)

    def plt_sections(self) -> list[Section]:
        return [self.sections[n] for n in PLT_SECTIONS if n in self.sections]

    def bytes_at(self, vaddr: int, size: int) -> bytes:
        off = self.addrspace.vaddr_to_offset(vaddr)
        return self.data[off:off + size]

    def section_bytes(self, section: Section) -> bytes:
        """The section's bytes, inflated when it is compressed (debug sections only; see
        :mod:`ccprofd.elf.compressed`, whose :class:`CompressedSectionError` this may raise)."""
        raw = self.data[section.offset:section.offset + section.size]
        if section.flags & SHF_ALLOC:
            return raw  # a loaded section is never compressed: its bytes are what the process maps
        return inflate(section.name, section.flags, raw)

    def dynamic_tags(self) -> dict[str, int]:
        tags: dict[str, int] = {}
        with self.parsing(".dynamic"):
            dyn = self.elf.get_section_by_name(".dynamic")
            if dyn is None:
                return tags
            for tag in dyn.iter_tags():  # type: ignore[attr-defined]
                if isinstance(tag.entry.d_val, int):
                    tags.setdefault(str(tag.entry.d_tag), tag.entry.d_val)
        return tags

    def symbols(self) -> list[Symbol]:
        out: list[Symbol] = []
        for table in (".symtab", ".dynsym"):
            with self.parsing(table):
                sec = self.elf.get_section_by_name(table)
                if sec is None or not hasattr(sec, "iter_symbols"):
                    continue
                fast = self._raw_symbols(sec, table)
                if fast is not None:
                    out += fast
                    continue
                for sym in sec.iter_symbols():
                    info = sym["st_info"]
                    out.append(Symbol(sym.name, sym["st_value"], sym["st_size"], info["type"], info["bind"],
                                      sym["st_shndx"] != "SHN_UNDEF", table))
        return out

    def _raw_symbols(self, sec: Any, table: str) -> list[Symbol] | None:
        """The symbols pyelftools' ``iter_symbols`` gives, unpacked with ``struct`` from the same
        bytes (node's 185k symbols took ~9 s through pyelftools, most of its function discovery):
        entries at ``sh_offset + i * sh_entsize``, names read from the linked string table up to
        their NUL as ``get_string`` reads them (not bounded by the section; none without a NUL),
        type and binding named by pyelftools' own parser.  None for a table out of the ordinary
        (an entry or the string table past the file, an odd entry size): pyelftools reads it, and
        reports its errors, as before."""
        entsize, size, off = sec["sh_entsize"], sec["sh_size"], sec["sh_offset"]
        data = self.data
        strtab = getattr(sec, "stringtable", None)
        if (sec["sh_type"] == "SHT_NOBITS" or entsize < _SYM.size or size % entsize
                or not isinstance(strtab, StringTableSection)):
            return None
        n = size // entsize
        if n and off + (n - 1) * entsize + _SYM.size > len(data):
            return None
        types, binds = self._st_info_names()
        names = strtab["sh_offset"]
        find = data.find
        out: list[Symbol] = []
        append = out.append
        rows = (_SYM.iter_unpack(data[off:off + size]) if entsize == _SYM.size
                else (_SYM.unpack_from(data, off + i * entsize) for i in range(n)))
        for st_name, info, _other, shndx, value, sym_size in rows:
            at = names + st_name
            nul = find(b"\0", at)
            name = data[at:nul].decode("utf-8", errors="replace") if nul > at else ""
            append(Symbol(name, value, sym_size, types[info & 0xF], binds[info >> 4], shndx != 0, table))
        return out

    def relocations(self, sec: Any) -> list[tuple[int, int, int, int]]:
        """``(r_offset, r_info_sym, r_info_type, r_addend)`` of each entry of the RELA section ``sec``
        (a pyelftools section), as its ``iter_relocations`` gives them, unpacked with ``struct``
        (pyelftools parses each entry with construct; the analysis reads the relocations three
        times).  A table out of the ordinary (an odd entry size, entries past the file) is read by
        pyelftools, which reports its errors, as before."""
        key = (sec["sh_offset"], sec["sh_size"])
        if key not in self._relocations:
            entsize, size, off = sec["sh_entsize"], sec["sh_size"], sec["sh_offset"]
            rows = None
            if entsize == _RELA.size and sec["sh_type"] != "SHT_NOBITS" and off + size <= len(self.data):
                n = size // entsize
                rows = [(r_offset, info >> 32, info & 0xFFFFFFFF, addend)
                        for r_offset, info, addend in _RELA.iter_unpack(self.data[off:off + n * entsize])]
            self._relocations[key] = rows
        rows = self._relocations[key]
        if rows is not None:
            return rows
        return [(r["r_offset"], r["r_info_sym"], r["r_info_type"], r["r_addend"])
                for r in sec.iter_relocations()]

    def symbol_at(self, symtab_index: int, index: int) -> tuple[str, int, bool]:
        """``(name, st_value, defined)`` of symbol ``index`` of the symbol table in section
        ``symtab_index``, from the same struct-unpacked table as :meth:`symbols` (pyelftools'
        ``get_symbol`` when that table is out of the ordinary)."""
        if symtab_index not in self._symbols_of:
            sec = self.elf.get_section(symtab_index)
            self._symbols_of[symtab_index] = (self._raw_symbols(sec, sec.name) if hasattr(sec, "iter_symbols")
                                              else None)
        table = self._symbols_of[symtab_index]
        if table is not None and 0 <= index < len(table):
            sym = table[index]
            return sym.name, sym.value, sym.defined
        raw = self.elf.get_section(symtab_index).get_symbol(index)  # type: ignore[attr-defined]
        return raw.name, raw["st_value"], raw["st_shndx"] != "SHN_UNDEF"

    def _st_info_names(self) -> tuple[list[Any], list[Any]]:
        """pyelftools' names of each symbol type and binding value (its parser decides, e.g. STT_LOOS
        vs STT_GNU_IFUNC for 10), and a check that only section index 0 reads as SHN_UNDEF."""
        parse = self.elf.structs.Elf_Sym.parse
        types = [parse(_SYM.pack(0, t, 0, 1, 0, 0))["st_info"]["type"] for t in range(16)]
        binds = [parse(_SYM.pack(0, b << 4, 0, 1, 0, 0))["st_info"]["bind"] for b in range(16)]
        if parse(_SYM.pack(0, 0, 0, 0, 0, 0))["st_shndx"] != "SHN_UNDEF":
            raise ValueError("pyelftools names section index 0 otherwise")
        return types, binds

    @property
    def has_symtab(self) -> bool:
        return ".symtab" in self.sections


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:120]
