"""An independent oracle for the static call graph, built only from binutils' text output.

Nothing here imports ccprofd: everything comes from ``objdump -d -w``, ``readelf`` and ``nm``, so a
disagreement with ``ccprofd analyze`` points at one of two independent readings of the same file.

The rules (what exactly is counted)
-----------------------------------
* **Code sections**: sections with the ``X`` flag in ``readelf -S``, minus the PLT sections ``.plt``,
  ``.plt.sec``, ``.plt.got`` (and ``.iplt``).  Instructions are objdump's linear sweep of those
  sections (``objdump -d -w``; gcc emits no data in code, so the sweep is exact for these binaries).
* **direct_calls**: instructions in code sections whose opcode, after legacy/REX prefixes, is ``e8``
  (``call rel32``) -- including calls whose target is a PLT stub.  This is "the number objdump -d shows".
* **plt_calls**: those direct calls whose target lies in a PLT section.
* **tail_calls**: ``jmp rel32``/``jmp rel8`` (``e9``/``eb``) in code sections whose target is the entry
  of a function other than the containing one, or lies in a PLT section.  (A jmp to the containing
  function's own entry is counted separately as ``self_jumps``; gcc does not emit one in the test
  programs.)  Conditional jumps to function entries are counted as ``conditional_tail_jumps``.
* **indirect_calls**: ``call *operand`` (opcode ``ff /2``) in code sections; **indirect_jumps**:
  ``jmp *operand`` (``ff /4``) in code sections (switch tables, crt's ``deregister_tm_clones``...).
* **functions** (entry addresses of internal functions): the distinct values of defined FUNC symbols
  of ``.symtab`` and ``.dynsym`` that lie in a code section, united with the start addresses of the
  ``.eh_frame`` FDEs that lie in a code section (``readelf --debug-dump=frames``), minus *fragments*.
  Symbols at the same address are aliases of one function.  An FDE start without a symbol is named
  ``sub_<hex vaddr>``.  ``fde_or_dynamic_functions`` is the subset a stripped copy still reveals by
  these sources alone (FDE starts, defined ``.dynsym`` FUNCs, and the ELF entry point).
* **fragments**: gcc's hot/cold split parts, recognised by name: a FUNC symbol ``<f>.cold`` or
  ``<f>.cold.<n>`` where ``<f>`` is a function of the same file.  A fragment runs in its owner's frame
  and is entered by jumps: it is not a function, its sites belong to the owner, and a jump into it is
  not a tail call.  (Name-based, so only the unstripped twin knows them; tests of stripped copies use
  the twin's oracle -- same addresses, same code.)
* A site's **containing function** is the function or fragment with the greatest start address <=
  the site in the same section (a fragment maps to its owner).
* **PLT entries -> names**: objdump's synthetic ``<name@plt>`` labels inside the PLT sections (objdump
  derives them from ``.rela.plt``/``.rela.dyn``; ``plt_slot_names_from_relocations`` cross-checks the
  ``JUMP_SLOT`` names from ``readelf -r``).  Names are bare (version suffixes removed).
* **build_id**: ``Build ID:`` of ``readelf -n``.  **pie**: ELF type ``DYN`` in ``readelf -h``.
"""

from __future__ import annotations

import bisect
import functools
import pathlib
import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field

PLT_SECTIONS = frozenset({".plt", ".plt.sec", ".plt.got", ".iplt"})

# Instruction prefixes objdump prints as separate words before the mnemonic.
_PREFIX_WORDS = frozenset({"bnd", "notrack", "data16", "addr32", "cs", "ds", "es", "ss", "fs", "gs",
                           "lock", "rep", "repz", "repnz", "repe", "repne", "rex", "rex.W", "rex.B",
                           "rex.X", "rex.R", "rex.WB", "rex.WX", "rex.WR"})
# Legacy prefix bytes (and REX 0x40-0x4f) skipped to find the opcode byte.
_PREFIX_BYTES = frozenset({0x66, 0x67, 0xF2, 0xF3, 0x2E, 0x3E, 0x26, 0x36, 0x64, 0x65, 0xF0}) | frozenset(
    range(0x40, 0x50))
_COND_JUMPS = frozenset({"jo", "jno", "jb", "jc", "jnae", "jae", "jnb", "jnc", "je", "jz", "jne", "jnz",
                         "jbe", "jna", "ja", "jnbe", "js", "jns", "jp", "jpe", "jnp", "jpo", "jl", "jnge",
                         "jge", "jnl", "jle", "jng", "jg", "jnle"})


_COLD_RE = re.compile(r"^(.+)\.cold(?:\.\d+)?$")


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True,
                          env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}).stdout


def bare_name(name: str) -> str:
    """``puts@GLIBC_2.2.5`` / ``puts@@GLIBC_2.2.5`` / ``puts@plt`` -> ``puts``."""
    return name.split("@", 1)[0]


@dataclass(frozen=True, slots=True)
class Section:
    index: int
    name: str
    type: str
    addr: int
    size: int
    flags: str

    @property
    def executable(self) -> bool:
        return "X" in self.flags

    def contains(self, addr: int) -> bool:
        return self.addr <= addr < self.addr + self.size


@dataclass(frozen=True, slots=True)
class Symbol:
    table: str  # ".symtab" | ".dynsym"
    name: str  # bare name (version suffix removed)
    value: int
    size: int
    type: str  # FUNC, OBJECT, NOTYPE, ...
    bind: str
    ndx: str  # section index as text, or UND/ABS/COM


@dataclass(frozen=True, slots=True)
class Insn:
    address: int
    raw: bytes
    section: str
    prefixes: tuple[str, ...]
    mnemonic: str
    operands: str  # without objdump's trailing "# ..." comment

    @property
    def opcode(self) -> int:
        for b in self.raw:
            if b not in _PREFIX_BYTES:
                return b
        return -1

    def _after_prefixes(self) -> bytes:
        i = 0
        while i < len(self.raw) and self.raw[i] in _PREFIX_BYTES:
            i += 1
        return self.raw[i:]

    @property
    def modrm_reg(self) -> int | None:
        rest = self._after_prefixes()
        return (rest[1] >> 3) & 7 if len(rest) > 1 else None

    @property
    def direct_target(self) -> int | None:
        m = re.match(r"([0-9a-f]+)\b", self.operands)
        return int(m.group(1), 16) if m and not self.operands.startswith("*") else None


@dataclass(frozen=True, slots=True)
class Site:
    """One call or jump the oracle classifies, with its containing function."""

    function: int  # entry address of the containing function
    address: int
    length: int
    raw: bytes
    # direct | plt | tail | indirect_call | indirect_jump | self_jump | conditional_tail | other_call
    kind: str
    target: int | None  # target address (None for indirect)
    target_name: str | None  # function name, bare PLT symbol name, or None

    @property
    def return_address(self) -> int:
        return self.address + self.length


@dataclass
class Oracle:
    """Everything the tests need to know about one ELF file, read with binutils."""

    path: pathlib.Path
    elf_type: str
    entry: int
    build_id: str | None
    sections: list[Section]
    symbols: list[Symbol]
    fde_starts: list[int]
    plt_names: dict[int, str]  # PLT entry address -> bare imported name
    insns: list[Insn]
    functions: dict[int, list[str]] = field(default_factory=dict)  # entry -> names (sorted)
    fragments: dict[int, int] = field(default_factory=dict)  # fragment start -> owner entry
    sites: list[Site] = field(default_factory=list)

    # ------------------------------------------------------------------ derived quantities
    @property
    def pie(self) -> bool:
        return self.elf_type == "DYN"

    def section_of(self, addr: int) -> Section | None:
        for s in self.sections:
            if s.addr and s.contains(addr) and s.flags and "A" in s.flags:
                return s
        return None

    def in_plt(self, addr: int) -> bool:
        s = self.section_of(addr)
        return s is not None and s.name in PLT_SECTIONS

    def code_sections(self) -> list[Section]:
        return [s for s in self.sections if s.executable and s.name not in PLT_SECTIONS]

    def count(self, kind: str) -> int:
        return sum(1 for s in self.sites if s.kind == kind)

    @property
    def direct_calls(self) -> int:
        """All ``call rel32`` in code sections, including calls to PLT stubs."""
        return self.count("direct") + self.count("plt") + self.count("other_call")

    @property
    def plt_calls(self) -> int:
        return self.count("plt")

    @property
    def tail_calls(self) -> int:
        return self.count("tail")

    @property
    def indirect_calls(self) -> int:
        return self.count("indirect_call")

    @property
    def indirect_jumps(self) -> int:
        return self.count("indirect_jump")

    def symbol_functions(self) -> dict[int, list[str]]:
        """Entries of defined FUNC symbols in code sections -> their (bare, sorted) names."""
        code = {s.index for s in self.code_sections()}
        out: dict[int, set[str]] = {}
        for sym in self.symbols:
            if sym.type == "FUNC" and sym.ndx.isdigit() and int(sym.ndx) in code:
                out.setdefault(sym.value, set()).add(sym.name)
        return {a: sorted(n) for a, n in out.items()}

    def symbol_sizes(self) -> dict[int, int]:
        """Largest FUNC symbol size at each entry (0 when every symbol there has size 0)."""
        sizes: dict[int, int] = {}
        for a in self.symbol_functions():
            sizes[a] = max(s.size for s in self.symbols if s.type == "FUNC" and s.value == a)
        return sizes

    def fde_or_dynamic_functions(self) -> set[int]:
        """The function entries a stripped copy still reveals: FDEs, .dynsym FUNCs, the entry point."""
        code = self.code_sections()
        out = {a for a in self.fde_starts if any(s.contains(a) for s in code) and a not in self.fragments}
        out |= {s.value for s in self.symbols if s.table == ".dynsym" and s.type == "FUNC" and s.ndx.isdigit()
                and any(c.contains(s.value) for c in code)}
        if any(s.contains(self.entry) for s in code):
            out.add(self.entry)
        return out

    def name_of(self, addr: int) -> str:
        names = self.functions.get(addr)
        if names:
            return names[0]
        return f"sub_{addr:x}"

    def address_of(self, name: str) -> int:
        hits = [a for a, names in self.functions.items() if name in names]
        if len(hits) != 1:
            raise KeyError(f"{name!r}: {len(hits)} functions of that name in {self.path}")
        return hits[0]

    def sites_of(self, function: str | int) -> list[Site]:
        """Per-function list of sites (address order)."""
        entry = self.address_of(function) if isinstance(function, str) else function
        return [s for s in self.sites if s.function == entry]

    def call_edges(self, function: str | int) -> list[tuple[int, int | None, str | None]]:
        """(call-site address, target address, target name) for every site of one function."""
        return [(s.address, s.target, s.target_name) for s in self.sites_of(function)]

    def edge_summary(self) -> Counter[tuple[str, str, str]]:
        """(caller name, callee name, kind) -> number of sites, for direct/plt/tail sites."""
        c: Counter[tuple[str, str, str]] = Counter()
        for s in self.sites:
            if s.kind in ("direct", "plt", "tail"):
                c[(self.name_of(s.function), s.target_name or "?", s.kind)] += 1
        return c


# ------------------------------------------------------------------------------------ parsing
_SECTION_RE = re.compile(r"^\s*\[\s*(\d+)\]\s+(\S*)\s+(\S+)\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)\s+"
                         r"[0-9a-f]+\s+([A-Za-z]*)\s+\d+\s+\d+\s+\d+\s*$")


def parse_sections(text: str) -> list[Section]:
    out = []
    for line in text.splitlines():
        m = _SECTION_RE.match(line)
        if m:
            out.append(Section(int(m.group(1)), m.group(2), m.group(3), int(m.group(4), 16),
                               int(m.group(5), 16), m.group(6)))
    return out


_SYM_RE = re.compile(r"^\s*\d+:\s+([0-9a-f]+)\s+(0x[0-9a-f]+|\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*(.*)$")


def parse_symbols(text: str) -> list[Symbol]:
    out = []
    table = ""
    for line in text.splitlines():
        h = re.match(r"^Symbol table '([^']+)'", line)
        if h:
            table = h.group(1)
            continue
        m = _SYM_RE.match(line)
        if not m or not table:
            continue
        name = re.sub(r"\s+\(\d+\)$", "", m.group(7).strip())
        if not name:
            continue
        size = int(m.group(2), 0)
        out.append(Symbol(table, bare_name(name), int(m.group(1), 16), size, m.group(3), m.group(4),
                          m.group(6)))
    return out


def parse_fde_ranges(text: str) -> list[tuple[int, int]]:
    """FDE pc ranges ``(start, end)`` of ``.eh_frame`` from ``readelf --debug-dump=frames``, sorted."""
    out = []
    in_eh = False
    for line in text.splitlines():
        h = re.match(r"^Contents of the (\S+) section", line)
        if h:
            in_eh = h.group(1).rstrip(":") == ".eh_frame"
            continue
        m = re.search(r"\bFDE cie=[0-9a-f]+ pc=([0-9a-f]+)\.\.([0-9a-f]+)", line)
        if m and in_eh:
            out.append((int(m.group(1), 16), int(m.group(2), 16)))
    return sorted(set(out))


def parse_fdes(text: str) -> list[int]:
    """FDE start addresses of ``.eh_frame`` from ``readelf --debug-dump=frames``."""
    return sorted({start for start, _end in parse_fde_ranges(text)})


def cfi_fragment_starts(path: str | pathlib.Path) -> set[int]:
    """FDE starts whose first CFA rule is not ``rsp+8`` (``readelf --debug-dump=frames-interp``).

    A function entered by ``call`` starts with CFA = rsp+8; a code range whose FDE starts with another
    CFA runs inside someone else's frame (gcc's ``.cold`` parts; also the PLT).  This is the only way
    to see fragments in a stripped file without symbols -- a second, CFI-based rule next to the
    name-based one of :func:`oracle`, used for system binaries that come stripped.
    """
    out: set[int] = set()
    start: int | None = None
    in_eh = False
    for line in _run("readelf", "--debug-dump=frames-interp", "-W", str(path)).splitlines():
        h = re.match(r"^Contents of the (\S+) section", line)
        if h:
            in_eh = h.group(1).rstrip(":") == ".eh_frame"
            continue
        m = re.search(r"\bFDE cie=[0-9a-f]+ pc=([0-9a-f]+)\.\.", line)
        if m:
            start = int(m.group(1), 16) if in_eh else None
            continue
        row = re.match(r"^([0-9a-f]+) +(\S+)", line)
        if start is not None and row and int(row.group(1), 16) == start:
            if row.group(2) != "rsp+8":
                out.add(start)
            start = None
    return out


_INSN_RE = re.compile(r"^\s*([0-9a-f]+):\t([0-9a-f]{2}(?: [0-9a-f]{2})*)\s*(?:\t(.*))?$")
_LABEL_RE = re.compile(r"^([0-9a-f]+) <(.+)>:$")


def parse_objdump(text: str) -> tuple[list[Insn], dict[int, str]]:
    """Instructions of every disassembled section, and the PLT labels (address -> bare name)."""
    insns: list[Insn] = []
    plt: dict[int, str] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("Disassembly of section "):
            section = line[len("Disassembly of section "):].rstrip(":")
            continue
        lm = _LABEL_RE.match(line)
        if lm:
            label = lm.group(2)
            if section in PLT_SECTIONS and label.endswith("@plt") and "+" not in label and "-" not in label:
                plt[int(lm.group(1), 16)] = bare_name(label)
            continue
        m = _INSN_RE.match(line)
        if not m:
            continue
        raw = bytes.fromhex(m.group(2).replace(" ", ""))
        text_part = (m.group(3) or "").split("#", 1)[0].strip()
        words = text_part.split()
        prefixes = []
        while words and words[0] in _PREFIX_WORDS:
            prefixes.append(words.pop(0))
        mnemonic = words[0] if words else ""
        operands = " ".join(words[1:])
        insns.append(Insn(int(m.group(1), 16), raw, section, tuple(prefixes), mnemonic, operands))
    return insns, plt


def plt_slot_names_from_relocations(path: str | pathlib.Path) -> list[str]:
    """Bare names of the ``R_X86_64_JUMP_SLOT`` relocations (``readelf -r``), in table order."""
    out = []
    for line in _run("readelf", "-r", "-W", str(path)).splitlines():
        if "JUMP_SLOT" in line:
            parts = line.split()
            # offset info type value name+addend
            name = parts[4] if len(parts) > 4 else ""
            out.append(bare_name(name))
    return out


def nm_defined_sizes(path: str | pathlib.Path) -> dict[str, tuple[int, int]]:
    """``nm -S --defined-only`` text-section symbols: name -> (address, size)."""
    out = {}
    for line in _run("nm", "-S", "--defined-only", str(path)).splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in ("T", "t", "W", "w", "i"):
            out[bare_name(parts[3])] = (int(parts[0], 16), int(parts[1], 16))
        elif len(parts) == 3 and parts[1] in ("T", "t", "W", "w", "i"):
            out[bare_name(parts[2])] = (int(parts[0], 16), 0)
    return out


# ------------------------------------------------------------------------------ classification
def _classify(o: Oracle) -> None:
    code = o.code_sections()
    code_names = {s.name for s in code}
    owner = {a: a for a in o.functions} | o.fragments
    entries_by_section: dict[str, list[int]] = {}
    for a in owner:
        s = o.section_of(a)
        if s is not None:
            entries_by_section.setdefault(s.name, []).append(a)
    for v in entries_by_section.values():
        v.sort()
    entry_set = set(o.functions)

    def containing(insn: Insn) -> int:
        starts = entries_by_section.get(insn.section, [])
        i = bisect.bisect_right(starts, insn.address) - 1
        return owner[starts[i]] if i >= 0 else -1

    def target_name(t: int) -> str | None:
        if t in o.plt_names:
            return o.plt_names[t]
        if t in entry_set:
            return o.name_of(t)
        return None

    sites = []
    for insn in o.insns:
        if insn.section not in code_names:
            continue
        mn = insn.mnemonic
        kind: str | None = None
        target = None
        if mn in ("call", "callq"):
            if insn.opcode == 0xE8:
                target = insn.direct_target
                assert target is not None, insn
                kind = "plt" if o.in_plt(target) else ("direct" if target in entry_set else "other_call")
            elif insn.opcode == 0xFF and insn.modrm_reg in (2, 3):
                kind = "indirect_call"
        elif mn in ("jmp", "jmpq"):
            if insn.opcode in (0xE9, 0xEB):
                target = insn.direct_target
                assert target is not None, insn
                here = containing(insn)
                if o.in_plt(target):
                    kind = "tail"
                elif target in entry_set:
                    kind = "self_jump" if target == here else "tail"
            elif insn.opcode == 0xFF and insn.modrm_reg in (4, 5):
                kind = "indirect_jump"
        elif mn in _COND_JUMPS:
            target = insn.direct_target
            to_entry = target is not None and (target in entry_set or o.in_plt(target))
            if to_entry and target != containing(insn):
                kind = "conditional_tail"
        if kind is None:
            continue
        sites.append(Site(containing(insn), insn.address, len(insn.raw), insn.raw, kind,
                          target if kind not in ("indirect_call", "indirect_jump") else None,
                          target_name(target) if target is not None else None))
    o.sites = sites


@functools.cache
def oracle(path: str | pathlib.Path) -> Oracle:
    """Read one ELF file with binutils (cached per path)."""
    p = pathlib.Path(path)
    header = _run("readelf", "-h", "-W", str(p))
    mt = re.search(r"^\s*Type:\s+(\S+)", header, re.M)
    me = re.search(r"^\s*Entry point address:\s+(0x[0-9a-f]+)", header, re.M)
    assert mt and me, header
    notes = _run("readelf", "-n", "-W", str(p))
    mb = re.search(r"Build ID:\s*([0-9a-f]+)", notes)
    sections = parse_sections(_run("readelf", "-S", "-W", str(p)))
    symbols = parse_symbols(_run("readelf", "-s", "-W", str(p)))
    fdes = parse_fdes(_run("readelf", "--debug-dump=frames", "-W", str(p)))
    insns, plt = parse_objdump(_run("objdump", "-d", "-w", str(p)))
    o = Oracle(p, mt.group(1), int(me.group(1), 16), mb.group(1) if mb else None, sections, symbols, fdes,
               plt, insns)
    code = o.code_sections()
    funcs = {a: list(n) for a, n in o.symbol_functions().items()}
    by_name = {n: a for a, names in funcs.items() for n in names}
    for a, names in list(funcs.items()):
        for n in names:
            m = _COLD_RE.match(n)
            if m and by_name.get(m.group(1), a) != a:
                o.fragments[a] = by_name[m.group(1)]
    for a in o.fragments:
        del funcs[a]
    for a in fdes:
        if any(s.contains(a) for s in code) and a not in funcs and a not in o.fragments:
            funcs[a] = []
    o.functions = {a: (n or [f"sub_{a:x}"]) for a, n in sorted(funcs.items())}
    _classify(o)
    return o
