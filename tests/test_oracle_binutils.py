"""Checks of the test programs and of the binutils oracle themselves (no ccprofd involved).

* The compiler kept every hand-written shape: the oracle's edges of each program's own functions
  equal the table in ``tests/programs/expected.py`` at -O0 and -O2, PIE and not, with and without
  CET.  When this fails after a compiler upgrade, fix the program, not the expectation.
* The oracle is self-consistent: ``strip`` changes no instruction; objdump's PLT labels agree with
  ``readelf -r``; ``nm -S`` agrees with ``readelf -s``; the programs exit 0.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from binutils_oracle import (
    Oracle,
    bare_name,
    cfi_fragment_starts,
    nm_defined_sizes,
    oracle,
    plt_slot_names_from_relocations,
)
from programs.build import PROGRAMS, build
from programs.expected import EXPECTED, summarize

VARIANTS = [("O0", True, False), ("O0", False, False), ("O2", True, False), ("O2", False, False),
            ("O2", True, True)]


def _vid(v: tuple[str, bool, bool]) -> str:
    return f"{v[0]}-{'pie' if v[1] else 'nopie'}{'-cet' if v[2] else ''}"


CASES = [pytest.param(name, *v, id=f"{name}-{_vid(v)}") for name in PROGRAMS for v in VARIANTS]


def _binary(name: str, opt: str, pie: bool, cet: bool, strip: bool = False) -> pathlib.Path:
    return build(name, opt=opt, pie=pie, cet=cet, strip=strip)  # type: ignore[arg-type]


def own_edges(o: Oracle, own: frozenset[str]) -> frozenset[tuple[str, str, int, str]]:
    return summarize([(o.name_of(s.function), s.target_name or f"?{s.target:#x}", s.kind) for s in o.sites
                      if s.kind in ("direct", "plt", "tail") and o.name_of(s.function) in own])


def test_every_program_has_expectations() -> None:
    assert set(EXPECTED) == set(PROGRAMS)


@pytest.mark.parametrize(("name", "opt", "pie", "cet"), CASES)
def test_compiler_kept_the_hand_written_shapes(name: str, opt: str, pie: bool, cet: bool) -> None:
    exp = EXPECTED[name]
    o = oracle(_binary(name, opt, pie, cet))
    names = {n for ns in o.functions.values() for n in ns}
    assert exp.functions <= names
    assert own_edges(o, exp.functions) == exp.edges(opt)
    indirect = {o.name_of(s.function): 0 for s in o.sites if s.kind == "indirect_call"}
    for s in o.sites:
        if s.kind == "indirect_call":
            indirect[o.name_of(s.function)] += 1
    assert {f: n for f, n in indirect.items() if f in exp.functions} == exp.indirect_calls
    odd = [s for s in o.sites if s.kind in ("self_jump", "conditional_tail", "other_call")]
    assert odd == [], "shapes the call-graph spec leaves ambiguous crept in"


@pytest.mark.parametrize(("name", "opt", "pie", "cet"), CASES)
def test_strip_changes_no_instruction(name: str, opt: str, pie: bool, cet: bool) -> None:
    full = oracle(_binary(name, opt, pie, cet))
    stripped = oracle(_binary(name, opt, pie, cet, strip=True))
    code = {s.name for s in full.code_sections()}
    assert [(i.address, i.raw) for i in full.insns if i.section in code] == \
        [(i.address, i.raw) for i in stripped.insns if i.section in code]
    assert stripped.plt_names == full.plt_names
    assert stripped.build_id == full.build_id and stripped.build_id
    assert stripped.fde_starts == full.fde_starts
    assert not any(s.table == ".symtab" for s in stripped.symbols)
    assert [(s.address, s.kind, s.target) for s in stripped.sites if s.kind == "plt"] == \
        [(s.address, s.kind, s.target) for s in full.sites if s.kind == "plt"]
    for count in ("direct_calls", "plt_calls", "indirect_calls", "indirect_jumps"):
        assert getattr(stripped, count) == getattr(full, count), count


@pytest.mark.parametrize(("name", "opt", "pie", "cet"), CASES)
def test_plt_labels_agree_with_relocations(name: str, opt: str, pie: bool, cet: bool) -> None:
    path = _binary(name, opt, pie, cet)
    o = oracle(path)
    lazy = {n for a, n in o.plt_names.items() if o.section_of(a).name in (".plt", ".plt.sec")}  # type: ignore[union-attr]
    assert lazy == set(plt_slot_names_from_relocations(path))
    # Every PLT call target is a labelled PLT entry.
    assert all(s.target_name for s in o.sites if s.kind == "plt")


@pytest.mark.parametrize(("name", "opt", "pie", "cet"), CASES)
def test_nm_agrees_with_readelf(name: str, opt: str, pie: bool, cet: bool) -> None:
    path = _binary(name, opt, pie, cet)
    o = oracle(path)
    nm = nm_defined_sizes(path)
    for entry, names in o.symbol_functions().items():
        for n in names:
            assert nm[n][0] == entry, n
    sizes = o.symbol_sizes()
    for f in EXPECTED[name].functions:
        entry = o.address_of(f)
        assert nm[f] == (entry, sizes[entry]) and sizes[entry] > 0


def test_pie_and_build_id_from_readelf() -> None:
    pie = oracle(build("calls", pie=True))
    exe = oracle(build("calls", pie=False))
    assert pie.pie and pie.elf_type == "DYN"
    assert not exe.pie and exe.elf_type == "EXEC"
    for o in (pie, exe):
        assert o.build_id and len(o.build_id) == 40
        assert o.name_of(o.entry) == "_start"
    assert pie.build_id != exe.build_id


def test_cet_build_has_plt_sec() -> None:
    o = oracle(build("tailcall", opt="O2", cet=True))
    assert any(s.name == ".plt.sec" for s in o.sections)
    tails = [s for s in o.sites if s.kind == "tail" and s.target_name == "getppid"]
    assert len(tails) == 1 and o.section_of(tails[0].target).name == ".plt.sec"  # type: ignore[arg-type,union-attr]


def test_fragments_are_recognised() -> None:
    o = oracle(build("exceptions", opt="O2", pie=False))
    catcher = o.address_of("catcher")
    assert list(o.fragments.values()) == [catcher]
    cold = next(iter(o.fragments))
    assert cold in o.fde_starts and cold not in o.functions
    assert "catcher.cold" not in {n for ns in o.functions.values() for n in ns}


def test_per_function_call_lists() -> None:
    o = oracle(build("calls", opt="O0"))
    helper = o.address_of("helper")
    sites = o.call_edges("twice")
    assert [(t, n) for _, t, n in sites] == [(helper, "helper"), (helper, "helper")]
    assert sites[0][0] < sites[1][0]
    say = [n for _, _, n in o.call_edges("say")]
    assert say == ["strlen", "write"]
    assert bare_name("puts@GLIBC_2.2.5") == "puts"


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("opt", ["O0", "O2"])
def test_programs_run_and_exit_0(name: str, opt: str) -> None:
    path = build(name, opt=opt)  # type: ignore[arg-type]
    proc = subprocess.run([str(path), "70"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{name}:" in proc.stdout


@pytest.mark.parametrize(("name", "opt", "pie", "cet"), CASES)
def test_cfi_and_name_rules_find_the_same_fragments(name: str, opt: str, pie: bool, cet: bool) -> None:
    path = _binary(name, opt, pie, cet)
    o = oracle(path)
    by_cfi = {a for a in cfi_fragment_starts(path) if any(s.contains(a) for s in o.code_sections())}
    assert by_cfi == set(o.fragments)
