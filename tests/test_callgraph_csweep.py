"""ccprofd/callgraph/csweep.c against disasm.sweep's Python loop (the reference): the same branches
(address, length, bytes, kind, target, operand text) and code references, in the same order, for
every function of several binaries, both as the analysis sweeps functions (local jumps left out)
and as a whole code section is swept (local jumps kept).  Byte-for-byte: the call graph's digest
must not depend on which loop ran."""

from __future__ import annotations

import re

import pytest
from conftest import skip_or_fail
from programs.build import build

from ccprofd.callgraph import disasm
from ccprofd.callgraph.disasm import SweepResult, make_disassembler, sweep
from ccprofd.callgraph.functions import FunctionTable
from ccprofd.elf.image import ElfImage

SYSTEM = ["/usr/bin/bash", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/python3.11"]


def _both(monkeypatch: pytest.MonkeyPatch, code: bytes, base: int,
          local_jumps: bool) -> tuple[SweepResult, ...]:
    md = make_disassembler()
    compiled = SweepResult([], [], 0)
    sweep(md, code, base, compiled, local_jumps=local_jumps)
    with monkeypatch.context() as m:
        m.setattr(disasm, "csweep", None)
        reference = SweepResult([], [], 0)
        sweep(md, code, base, reference, local_jumps=local_jumps)
    return compiled, reference


def _facts(r: SweepResult) -> tuple[object, ...]:
    return r.branches, r.code_refs, r.instructions


@pytest.fixture
def compiled() -> None:
    if disasm.csweep is None:
        skip_or_fail("ccprofd/callgraph/csweep.c is not built (bash scripts/build_ext.sh)")


@pytest.mark.parametrize("path", [*SYSTEM, "calls", "switch", "fptr", "tailcall"])
def test_compiled_sweep_equals_python_sweep(path: str, compiled: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if "/" not in path:
        path = build(path, opt="O2", pie=True, strip=False)
    image = ElfImage(path)
    table = FunctionTable(image)
    ranges = [(s, table.by_start[s].end) for s in table.starts]
    if path == "/usr/bin/python3.11":
        ranges = ranges[::7]  # a seventh of its ~7,000 functions keeps the test short
    branches = refs = 0
    for start, end in ranges:
        c, p = _both(monkeypatch, image.bytes_at(start, end - start), start, False)
        assert _facts(c) == _facts(p), hex(start)
        assert [type(b.target) for b in c.branches] == [type(b.target) for b in p.branches]
        assert all(type(b) is disasm.Branch for b in c.branches)
        branches += len(c.branches)
        refs += len(c.code_refs)
    assert branches and refs
    for sec in image.code_sections():
        code = image.bytes_at(sec.vaddr, min(sec.size, 1 << 18))
        c, p = _both(monkeypatch, code, sec.vaddr, True)
        assert _facts(c) == _facts(p), sec.name


def test_operand_texts_python_would_parse_otherwise_fall_back(compiled: None) -> None:
    """A decimal with a leading zero (int("012", 0) raises) is not parsed in C: scan returns None
    and the Python loop decides (hand-made records: a push of "012")."""
    import ctypes

    from capstone import _cs_insn

    classes, jccs, layout = disasm._scan_tables()
    from capstone.x86_const import X86_INS_PUSH

    rec = _cs_insn()
    rec.id = X86_INS_PUSH
    rec.address = 0x1000
    rec.size = 2
    rec.mnemonic = b"push"
    for text, want in ((b"012", None), (b"0x12345", ([], [0x12345])), (b"12345", ([], [12345])),
                       (b"0x" + b"1" * 17, None), (b"rax", ([], []))):
        rec.op_str = text
        buf = ctypes.string_at(ctypes.addressof(rec), ctypes.sizeof(rec))
        got = disasm.csweep.scan(buf, 1, b"\x6a\x00", 0x1000, False, classes, jccs, layout, disasm.Branch)
        assert (got if got is None else (list(got[0]), list(got[1]))) == want, text


@pytest.mark.parametrize("byte", [b"\xcc", b"\x90", b"\x00"])
def test_gaps_of_one_padding_byte_are_all_padding_to_capstone(byte: bytes) -> None:
    """analysis._first_non_padding answers None for such a gap without disassembling it: capstone
    must say the same of every length (zero fill: pairs of `add byte ptr [rax], al`, a lone .byte)."""
    from ccprofd.callgraph.analysis import _first_non_padding
    from ccprofd.callgraph.disasm import first_non_padding

    md = make_disassembler()
    for n in range(1, 40):
        assert first_non_padding(md, byte * n, 0x1000) is None, n
        assert _first_non_padding(md, byte * n, 0x1000) is None
    ret = byte * 6 + b"\xc3"
    assert _first_non_padding(md, ret, 0x1000) == first_non_padding(md, ret, 0x1000) == 0x1006


def test_iterated_sweep_equals_array_sweep(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """csweep.sweep (capstone's cs_disasm_iter, one reused record) and csweep.scan (cs_disasm's array of
    records) see the same records: whole code sections of python3.11 (invalid bytes skipped as data
    included), and the skipdata records of bytes capstone cannot decode."""
    image = ElfImage("/usr/bin/python3.11")
    md = make_disassembler()
    samples = [(image.bytes_at(s.vaddr, s.size), s.vaddr) for s in image.code_sections()]
    samples.append((b"\x0f\xff\xd6\x06\xc3\xe8\x00\x00\x00\x00\x62\x62\xd7", 0x4000))  # undefined and invalid
    for code, base in samples:
        iterated = SweepResult([], [], 0)
        sweep(md, code, base, iterated)
        with monkeypatch.context() as m:
            m.delattr(disasm.csweep, "sweep")
            arrayed = SweepResult([], [], 0)
            sweep(md, code, base, arrayed)
        assert _facts(iterated) == _facts(arrayed), hex(base)
        assert iterated.instructions


@pytest.mark.parametrize("path", ["/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6", "tailcall",
                                  "calls"])
def test_compiled_site_rows_equal_python_site_rows(path: str, compiled: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """csweep.site_rows builds the rows analysis._site_rows (the reference) builds: every node, edge
    and site, in order, with the externals numbered alike."""
    from ccprofd.callgraph import analysis, analyze_binary

    if "/" not in path:
        path = build(path, opt="O2", pie=True, strip=False)
    compiled_rows = analyze_binary(path, use_cache=False).to_dict()
    with monkeypatch.context() as m:
        m.setattr(analysis, "csweep", None)
        reference = analyze_binary(path, use_cache=False).to_dict()
    for key in ("nodes", "edges", "sites"):
        assert compiled_rows[key] == reference[key], key
    assert any(s[5] == "plt" for s in reference["sites"]) and any(s[5] == "tail" for s in reference["sites"])
    if str(path).startswith("/usr/"):  # gcc's .cold fragments, folded by csweep.fragment_entries' jumps
        assert any(n[8] for n in reference["nodes"])
    def types(rows: list[list[object]]) -> list[type]:
        return [type(x) for s in rows for x in s]

    assert types(compiled_rows["sites"]) == types(reference["sites"])


@pytest.mark.parametrize("path", [*SYSTEM, "recursion", "calls"])
def test_compiled_statistics_equal_python_statistics(path: str, compiled: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """csweep.scc_counts and csweep.site_counts give `analyze --json` the statistics the Python loops
    (the reference) give, key for key and in the same order."""
    import json
    import sys

    from ccprofd.callgraph import analyze_binary, graph_stats

    if "/" not in path:
        path = build(path, opt="O2", pie=True, strip=False)
    graph = analyze_binary(path, use_cache=False)
    compiled_stats = graph_stats(graph)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ccprofd.callgraph.csweep", None)  # the import in stats fails: Python loops
        reference = graph_stats(graph)
    assert json.dumps(compiled_stats) == json.dumps(reference)
    assert reference["sccs"] and reference["direct_calls"]
    if str(path).startswith("/usr/"):
        assert reference["cyclic_edges"] and reference["complex_sccs"] and reference["tail_calls"]


@pytest.mark.parametrize("path", SYSTEM)
def test_compiled_first_non_padding_equals_disasm_lite(path: str, compiled: None) -> None:
    """csweep.first_non_padding (cs_disasm_iter) finds in every gap of a system binary, and in slices
    of it starting mid-instruction, the address disasm_lite's loop (the reference) finds."""
    from ccprofd.callgraph.disasm import first_non_padding, first_non_padding_lite

    image = ElfImage(path)
    md = make_disassembler()
    found = 0
    for lo, hi in FunctionTable(image).gaps():
        code = image.bytes_at(lo, hi - lo)
        for skip in (0, 1, 3):
            want = first_non_padding_lite(md, code[skip:], lo + skip)
            assert first_non_padding(md, code[skip:], lo + skip) == want, hex(lo)
            found += want is not None
    assert found
    for code in (b"\x66\x2e\x0f\x1f\x84\x00\x00\x00\x00\x00\x90\xcc\x00\x00\x55", b"\x06\x90",
                 b"\x00\x00\x00\x01", b"\x87\xc0\x66\x90\xc3", b"\x0f\xff\x90", b""):
        assert first_non_padding(md, code, 0x1000) == first_non_padding_lite(md, code, 0x1000), code.hex()


@pytest.mark.parametrize("path", SYSTEM)
def test_compiled_jump_table_words_equal_python(path: str, compiled: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """csweep.table_words reads the jump tables analysis._table_words's Python loop (the reference)
    reads: at every address a function of the binary refers to (4-byte relative entries) and at
    every data address (8-byte absolute ones), up to the first entry that is no code address."""
    from ccprofd.callgraph import analysis

    image = ElfImage(path)
    table = FunctionTable(image)
    md = make_disassembler()
    bases: set[int] = set()
    for start in table.starts[::3]:
        part = SweepResult([], [], 0)
        sweep(md, image.bytes_at(start, table.by_start[start].end - start), start, part, local_jumps=False)
        bases.update(part.code_refs)
        bases.update(int(m.group(1), 16) for b in part.branches
                     if (m := analysis._ABS_TABLE.search(b.operand)))  # jmp [reg*8 + table]
    assert len(bases) > 100
    long_tables = 0
    for width in (4, 8):
        for base in sorted(bases):
            got = analysis._table_words(image, base, width, {})
            with monkeypatch.context() as m:
                m.setattr(analysis, "csweep", None)
                assert got == analysis._table_words(image, base, width, {}), (hex(base), width)
            long_tables += len(got) > 8
    assert long_tables


def test_compiled_edge_grouping_equals_networkx_order(compiled: None) -> None:
    """csweep.group_edges orders one source's edge rows as GraphRows.serial's dicts (and networkx)
    do: targets in order of their first edge, keys in order within each, a repeated key's row
    replacing the earlier one in place; more than 64 rows are left to Python (None)."""
    import random

    import networkx as nx

    rng = random.Random(18)
    for _ in range(300):
        k = rng.randrange(2, 70)
        rows = [[1, rng.randrange(0, 6), rng.randrange(0, 12), "direct", i, 0, 5, None] for i in range(k)]
        g = nx.MultiDiGraph()
        for row in rows:
            g.add_edge(row[0], row[1], key=row[2], row=row)
        want = [d["row"] for _u, _v, _k, d in g.edges(keys=True, data=True)]
        got = disasm.csweep.group_edges(rows)
        assert got == (want if k <= 64 else None), rows


@pytest.mark.parametrize("path", SYSTEM)
def test_section_lookup_by_bisection_equals_the_loop(path: str) -> None:
    """FunctionTable.section_of's bisection finds, for every symbol and FDE start and the bytes
    around each section's bounds, the section the loop over the code sections finds."""
    table = FunctionTable(ElfImage(path))
    assert table._sections is not None  # the bisection is what is tested

    def by_loop(addr: int) -> object:
        return next((s for s in table.code if s.contains(addr)), None)

    probes = set(table.starts) | {a for s in table.code for a in (s.vaddr - 1, s.vaddr, s.vaddr + s.size - 1,
                                                                   s.vaddr + s.size)}
    probes |= {sym.value for sym in table.image.symbols()}
    for addr in probes:
        assert table.section_of(addr) is by_loop(addr), hex(addr)


def _eh_frame(path: str) -> tuple[bytes, int]:
    image = ElfImage(path)
    eh = image.sections[".eh_frame"]
    return image.section_bytes(eh), eh.vaddr


def _python_ranges(data: bytes, vaddr: int) -> list[tuple[int, int, bool, bool]]:
    from ccprofd.elf.cfi import fde_ranges

    return [(r.start, r.end, r.entry, r.signal_frame) for r in fde_ranges(data, vaddr)]


@pytest.mark.parametrize("path", [*SYSTEM, "/usr/bin/node", "calls", "tailcall", "recursion"])
def test_compiled_fde_ranges_equal_python_fde_ranges(path: str, compiled: None) -> None:
    """csweep.fde_ranges reads real .eh_frame sections whole (no fall-back to Python) and finds every
    FDE's range, entry flag and signal flag as cfi.fde_ranges (the reference) does, in order."""
    from ccprofd.callgraph import functions

    if "/" not in path:
        path = build(path, opt="O2", pie=True, strip=False)
    data, vaddr = _eh_frame(path)
    got = functions.csweep.fde_ranges(data, vaddr)
    assert got is not None
    reference = _python_ranges(data, vaddr)
    assert got == reference
    assert any(not r[2] for r in reference) or "/" not in path  # system binaries have .cold fragments
    assert [type(x) for r in got[:50] for x in r] == [type(x) for r in reference[:50] for x in r]


def _section(cie_insns: bytes, fde_insns: bytes, data_align: int = 0x78, aug: bytes = b"zR") -> bytes:
    """A one-CIE, one-FDE .eh_frame (pc-relative sdata4 pointers) with the given instructions: its
    FDE covers [x, x + 0x40) where x = 0x1000 + where the FDE's pc_begin field is."""
    import struct

    cie_body = b"\x00\x00\x00\x00\x01" + aug + b"\x00\x01" + bytes([data_align]) + b"\x10"
    if aug.startswith(b"z"):
        cie_body += b"\x01\x1b"
    cie_body += cie_insns
    cie_body += b"\x00" * (-len(cie_body) % 4)
    cie = struct.pack("<I", len(cie_body)) + cie_body
    fde_id_at = len(cie) + 4
    fde_body = struct.pack("<Ii", fde_id_at, 0x1000) + struct.pack("<I", 0x40)
    if aug.startswith(b"z"):
        fde_body += b"\x00"
    fde_body += fde_insns
    fde_body += b"\x00" * (-len(fde_body) % 4)
    return cie + struct.pack("<I", len(fde_body)) + fde_body + b"\x00" * 4


@pytest.mark.parametrize(("cie_insns", "fde_insns", "entry"), [
    (b"\x0c\x07\x08\x90\x01", b"", True),  # def_cfa rsp+8, offset rip: an entry
    (b"\x0c\x07\x08\x90\x01", b"\x0e\x10", False),  # def_cfa_offset 16 before any advance: a fragment
    (b"\x0c\x07\x08\x90\x01", b"\x41\x0e\x10", True),  # advance first: an entry
    (b"\x0c\x07\x08", b"\x13\x7f", True),  # def_cfa_offset_sf -1 * data_align(-8) = 8: an entry
    (b"\x0c\x07\x08", b"\x13\x7e", False),  # ... -2 * -8 = 16: a fragment
    (b"\x0c\x07\x08", b"\x0a\x0e\x20\x0b", True),  # remember, cfa 32, restore: rsp+8 again
    (b"\x0c\x07\x10", b"\x0f\x02\x77\x08\x0e\x08", False),  # an expression outlives def_cfa_offset
    (b"\x0c\x07\x10", b"\x0f\x02\x77\x08\x0c\x07\x08", True),  # def_cfa ends it
    (b"\x0c\x06\x08", b"\x2e\x10\x05\x06\x02", False),  # CFA from rbp; args_size, offset_ext skipped
    (b"\x0c\x06\x08", b"\x2e\x10\x05\x06\x02\x0d\x07", True),  # ... then rsp: rsp+8
])
def test_compiled_fde_ranges_on_hand_made_sections(cie_insns: bytes, fde_insns: bytes, entry: bool,
                                                   compiled: None) -> None:
    """Hand-made CFI (the opcodes that decide an entry): the compiled walk finds the entry flag worked
    out by hand, as the reference does."""
    from ccprofd.callgraph import functions

    data = _section(cie_insns, fde_insns)
    got = functions.csweep.fde_ranges(data, 0x2000)
    assert got is not None
    assert got == _python_ranges(data, 0x2000)
    assert got[0][2:] == (entry, False)
    field = 0x2000 + 4 + int.from_bytes(data[:4], "little") + 8  # vaddr + CIE + FDE length and CIE id
    assert got[0][:2] == (field + 0x1000, field + 0x1040)


@pytest.mark.parametrize(("cie_insns", "fde_insns", "aug"), [
    (b"\x0c\x07\x08", b"\x3f", b"zR"),  # an unknown opcode: Python keeps the state read so far
    (b"\x0c\x07\x08\x3f", b"", b"zR"),  # ... in the CIE: Python reports the corrupt section
    (b"\x0c\x07\x08", b"", b"zRB"),  # an augmentation the compiled walk does not know
])
def test_compiled_fde_ranges_leave_the_unusual_to_python(cie_insns: bytes, fde_insns: bytes, aug: bytes,
                                                         compiled: None) -> None:
    """What the compiled walk does not cover returns None, and eh_frame_ranges then answers as
    cfi.fde_ranges does (its ranges, or its error as a BinaryError)."""
    from ccprofd.callgraph import functions
    from ccprofd.elf.errors import BinaryError, CfiError

    data = _section(cie_insns, fde_insns, aug=aug)
    assert functions.csweep.fde_ranges(data, 0x2000) is None
    try:
        reference = _python_ranges(data, 0x2000)
    except CfiError as exc:
        with pytest.raises(BinaryError, match=re.escape(str(exc))):
            functions.eh_frame_ranges(data, 0x2000, "x")
    else:
        assert functions.eh_frame_ranges(data, 0x2000, "x") == reference
