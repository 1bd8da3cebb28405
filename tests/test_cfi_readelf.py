"""The unwind tables (ccprofd.elf.cfi) against binutils: every row of
``readelf --debug-dump=frames-interp`` must be the rule our table gives over the row's whole
address span, for python3.11, libc, the dynamic loader and test programs (frame pointers, none,
-O2, and a ``.debug_frame``-only build).  readelf is an independent CFI interpreter, so a wrong
opcode, a missed remember/restore_state or a wrong merge shows up as a row mismatch."""

from __future__ import annotations

import re
import subprocess
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import pytest
from bpf_helpers import compile_c
from conftest import require_tool

from ccprofd.elf import cfi
from ccprofd.elf.image import ElfImage
from ccprofd.persist.cache import AnalysisCache

SYSTEM_OBJECTS = ["/usr/bin/python3.11", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"]

_FDE_RE = re.compile(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ FDE cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+)$")
_CIE_RE = re.compile(r"^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ CIE")
_PLT_EXPR = ("DW_OP_breg7 (rsp): 8; DW_OP_breg16 (rip): 0; DW_OP_lit15; DW_OP_and; DW_OP_lit{n}; DW_OP_ge; "
             "DW_OP_lit3; DW_OP_shl; DW_OP_plus")


@dataclass
class Fde:
    section: str
    cie: str
    lo: int
    hi: int
    rows: list[tuple[int, dict[str, str]]]


def readelf_frames(path: str) -> list[Fde]:
    """FDEs with their interpreted rows as readelf prints them (CIE's row when the FDE has none)."""
    readelf = require_tool("readelf")
    # readelf exits 1 on some system objects (e.g. libc) while printing the full dump: check output
    text = subprocess.run([readelf, "--debug-dump=frames-interp", "-W", path],
                          capture_output=True, text=True).stdout
    assert "FDE cie=" in text, f"readelf printed no FDEs for {path}"
    fdes: list[Fde] = []
    cie_rows: dict[tuple[str, str], dict[str, str]] = {}
    section = ""
    cur: Fde | None = None
    cur_cie: str | None = None
    header: list[str] = []
    for line in text.splitlines():
        if line.startswith("Contents of the "):
            section = line.split()[3]
            continue
        m = _FDE_RE.match(line)
        if m:
            cur = Fde(section, m.group(1), int(m.group(2), 16), int(m.group(3), 16), [])
            fdes.append(cur)
            cur_cie = None
            continue
        m = _CIE_RE.match(line)
        if m:
            cur, cur_cie = None, m.group(1)
            continue
        parts = re.sub(r"(\S+) \((\w+)\)", r"\1(\2)", line).split()  # "r9 (r9)": one value
        if parts and parts[0] == "LOC":
            header = parts
            continue
        if parts and re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            assert len(parts) == len(header), f"unparsed readelf row: {line!r}"
            row = dict(zip(header[1:], parts[1:], strict=True))
            if cur is not None:
                cur.rows.append((int(parts[0], 16), row))
            elif cur_cie is not None:
                cie_rows[(section, cur_cie)] = row
    for f in fdes:
        if not f.rows:
            f.rows.append((f.lo, cie_rows.get((f.section, f.cie), {"CFA": "rsp+8", "ra": "c-8"})))
    return fdes


def expected_matches(row: dict[str, str], rule: cfi.Rule) -> str | None:
    """None when our rule says what readelf's row says, else why not."""
    cfa, ra, rbp = row.get("CFA", "?"), row.get("ra", "u"), row.get("rbp", "u")
    if ra == "u":
        return None if rule.kind == cfi.END else f"ra undefined but rule {rule.describe()}"
    if cfa == "exp":
        if rule.kind == cfi.PLT:
            ok = ra == "c-8" and rbp in ("u", "s")
        elif rule.kind == cfi.SIGNAL:
            ok = ra == "exp" and (rbp == "exp") == (rule.rbp_kind == cfi.RBP_AT_SP)
        else:
            ok = rule.kind == cfi.UNSUPPORTED and rule.aux == cfi.WHY_CFA_EXPR
        return None if ok else f"CFA exp vs {rule.describe()}"
    m = re.fullmatch(r"(r\w+)\+(-?\d+)", cfa)
    if not m:
        return f"unparsed CFA {cfa}"
    reg, off = m.group(1), int(m.group(2))
    if reg not in ("rsp", "rbp"):
        # unsupported either way (the return-address rule may be what was noticed first)
        ok = rule.kind == cfi.UNSUPPORTED and rule.aux in (cfi.WHY_CFA_REG, cfi.WHY_RA_RULE)
        return None if ok else f"CFA {cfa} vs {rule.describe()}"
    if re.fullmatch(r"r5\s*\(rdi\)", ra) and reg == "rsp":  # glibc's vfork: ra kept in rdi
        ok = (rule.kind, rule.cfa_off, rule.aux) == (cfi.RA_REG, off, 5)
        return None if ok else f"CFA {cfa} ra {ra} vs {rule.describe()}"
    mra = re.fullmatch(r"c(-?\+?\d+)", ra)
    if not mra:
        return None if (rule.kind == cfi.UNSUPPORTED and rule.aux == cfi.WHY_RA_RULE) else \
            f"ra {ra} vs {rule.describe()}"
    want_kind = cfi.CFA_RSP if reg == "rsp" else cfi.CFA_RBP
    if (rule.kind, rule.cfa_off, rule.ra_off) != (want_kind, off, int(mra.group(1))):
        return f"CFA {cfa} ra {ra} vs {rule.describe()}"
    mrbp = re.fullmatch(r"c(-?\+?\d+)", rbp)
    if mrbp:
        ok = rule.rbp_kind == cfi.RBP_AT_CFA and rule.rbp_off == int(mrbp.group(1))
    elif rbp in ("u", "s"):
        ok = rule.rbp_kind in (cfi.RBP_SAME, cfi.RBP_UNDEF)
    else:
        ok = rule.rbp_kind == cfi.RBP_UNDEF
    return None if ok else f"rbp {rbp} vs {rule.describe()}"


def row_mismatches(path: str, table: cfi.UnwindTable) -> tuple[int, list[str]]:
    """(rows compared, one message per mismatching row)."""
    fdes = readelf_frames(path)
    eh = [f for f in fdes if f.section == ".eh_frame"]
    dbg = [f for f in fdes if f.section == ".debug_frame"]
    eh_ranges = sorted((f.lo, f.hi) for f in eh)
    checked = 0
    errors: list[str] = []
    starts = table.starts
    image = ElfImage(path)
    for f in eh + [d for d in dbg if not cfi._overlaps(eh_ranges, d.lo, d.hi)]:
        if f.hi <= f.lo:
            continue
        for i, (loc, row) in enumerate(f.rows):
            nxt = f.rows[i + 1][0] if i + 1 < len(f.rows) else f.hi
            if nxt <= loc:
                continue
            rule = table.lookup(loc)
            why = expected_matches(row, rule)
            # the rule must hold over the whole span [loc, nxt): no table row starts inside it
            # with a different rule
            a, b = bisect_right(starts, loc) - 1, bisect_right(starts, nxt - 1) - 1
            if why is None and any(table.rule_ids[j] != table.rule_ids[a] for j in range(a, b + 1)):
                why = f"table changes rule inside readelf row [{loc:#x}, {nxt:#x})"
            if why is not None:
                errors.append(f"{path} {f.section} FDE {f.lo:#x}..{f.hi:#x} row {loc:#x}: {why}")
            checked += 1
        end_rule = table.lookup(f.hi)
        if end_rule.kind == cfi.NONE:
            continue
        # the one exception: glibc's clone/clone3 end their FDE just before the parent's `syscall`
        # (cfi_endproc), and the code falling through keeps the FDE's last readelf row
        # (cfi._fallthrough_gaps; tests/test_unwind_spawns.py)
        syscall_next = image.bytes_at(f.hi, 2) == b"\x0f\x05"
        if f.rows and syscall_next and expected_matches(f.rows[-1][1], end_rule) is None:
            continue
        if not any(g.lo <= f.hi < g.hi for g in fdes):
            errors.append(f"{path}: {f.hi:#x} (end of FDE {f.lo:#x}) has rule {end_rule.describe()}, "
                          "but no FDE covers it")
    return checked, errors


def compare_all_rows(path: str) -> int:
    checked, errors = row_mismatches(path, cfi.build_table(ElfImage(path)))
    assert not errors, f"{len(errors)} mismatches, first: " + "\n".join(errors[:10])
    assert checked > 0
    return checked


@pytest.mark.parametrize("path", SYSTEM_OBJECTS)
def test_system_objects_match_readelf_row_by_row(path: str) -> None:
    if not Path(path).exists():
        pytest.skip(f"{path} not present")
    checked = compare_all_rows(path)
    assert checked > 1000, f"only {checked} rows compared"


PROG = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <alloca.h>
__attribute__((noinline)) long leaf(long x) { return x * 3 + 1; }
__attribute__((noinline)) long with_alloca(int n) {
    char *p = alloca(n); memset(p, n, n); return p[n / 2] + leaf(n);
}
__attribute__((noinline)) long branchy(long n) {
    if (n > 10) { long s = 0; for (int i = 0; i < n; i++) s += with_alloca(i + 1); return s; }
    if (n < 0) return -1;
    return leaf(n) + branchy(n + 5);
}
int main(int argc, char **argv) { printf("%ld\n", branchy(argc > 1 ? atol(argv[1]) : 3)); return 0; }
"""


@pytest.mark.parametrize("flags", [
    ("-O0", "-fno-omit-frame-pointer"),
    ("-O2", "-fomit-frame-pointer"),
    ("-O2", "-fno-omit-frame-pointer", "-fpie", "-pie"),
    ("-O2", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"),  # .debug_frame only (-g)
])
def test_test_programs_match_readelf_row_by_row(tmp_path: Path, flags: tuple[str, ...]) -> None:
    binary = compile_c(tmp_path, "cfiprog", PROG, *flags)
    compare_all_rows(str(binary))
    table = cfi.build_table(ElfImage(str(binary)))
    if "-fno-unwind-tables" in flags:
        assert ".debug_frame" in table.sources
    # the function with alloca must use an rbp-based CFA somewhere (either build)
    nm = subprocess.run(["nm", str(binary)], check=True, capture_output=True, text=True).stdout
    addr = next(int(line.split()[0], 16) for line in nm.splitlines() if line.endswith(" with_alloca"))
    kinds = {table.lookup(a).kind for a in range(addr, addr + 64)}
    assert cfi.CFA_RBP in kinds, kinds


def test_comparison_catches_a_wrong_row(tmp_path: Path) -> None:
    """The oracle check can fail: one corrupted rule (CFA offset off by 8) is reported."""
    binary = str(compile_c(tmp_path, "cfiprog", PROG, "-O2", "-fomit-frame-pointer"))
    table = cfi.build_table(ElfImage(binary))
    victim = next(i for i, rid in enumerate(table.rule_ids) if table.rules[rid].kind == cfi.CFA_RSP
                  and table.rules[rid].cfa_off > 8)
    good = table.rules[table.rule_ids[victim]]
    table.rules.append(good._replace(cfa_off=good.cfa_off + 8))
    table.rule_ids[victim] = len(table.rules) - 1
    _, errors = row_mismatches(binary, table)
    assert len(errors) >= 1 and f"{table.starts[victim]:#x}" in errors[0], errors


def test_special_rules_match_raw_cfi_expressions() -> None:
    """PLT and signal-trampoline rules are claimed only where readelf shows those exact expressions."""
    readelf = require_tool("readelf")
    path = "/lib/x86_64-linux-gnu/libc.so.6"
    raw = subprocess.run([readelf, "--debug-dump=frames", "-W", path], capture_output=True, text=True).stdout
    blocks: dict[tuple[int, int], str] = {}
    for block in raw.split("\n\n"):
        m = re.search(r"FDE cie=[0-9a-f]+ pc=([0-9a-f]+)\.\.([0-9a-f]+)", block)
        if m:
            blocks[(int(m.group(1), 16), int(m.group(2), 16))] = block
    table = cfi.build_table(ElfImage(path))
    seen = {cfi.PLT: 0, cfi.SIGNAL: 0}
    for i, rid in enumerate(table.rule_ids):
        rule = table.rules[rid]
        if rule.kind not in seen:
            continue
        addr = table.starts[i]
        block = next(b for (lo, hi), b in blocks.items() if lo <= addr < hi)
        if rule.kind == cfi.PLT:
            assert _PLT_EXPR.format(n=rule.aux) in block
        else:
            assert f"DW_OP_breg7 (rsp): {rule.cfa_off}; DW_OP_deref" in block
            assert f"r16 (rip) (DW_OP_breg7 (rsp): {rule.ra_off})" in block
            assert f"r6 (rbp) (DW_OP_breg7 (rsp): {rule.rbp_off})" in block
            assert '"zRS"' in raw
        seen[rule.kind] += 1
    assert seen[cfi.PLT] >= 1 and seen[cfi.SIGNAL] >= 1, seen


def test_cache_roundtrip(tmp_path: Path) -> None:
    cache = AnalysisCache(tmp_path)
    path = "/lib64/ld-linux-x86-64.so.2"
    first = cfi.load_table(path, cache)
    assert list((tmp_path / cfi.CACHE_KIND).iterdir()), "table not written to the cache"
    second = cfi.load_table(path, cache)
    assert second.starts == first.starts and second.rule_ids == first.rule_ids and second.rules == first.rules
    assert second.build_id == ElfImage(path).build_id()


@pytest.mark.parametrize("path", ["/usr/bin/python3.11", "/lib/x86_64-linux-gnu/libc.so.6"])
def test_cfa_rules_agree_with_the_unwind_table(path: str) -> None:
    """One interpreter, two projections: the probe plan's CFA rule at an address equals the CFA of
    the unwind table's row there (where that row is a plain rsp/rbp rule), and no rule where the
    table has no CFI."""
    image = ElfImage(path)
    eh = image.sections[".eh_frame"]
    table = cfi.build_table(image)
    addrs = list(range(table.starts[0], table.starts[-1], 89))
    rules = cfi.cfa_rules(image.section_bytes(eh), eh.vaddr, addrs)
    checked = 0
    for a in addrs:
        row = table.lookup(a)
        if row.kind in (cfi.CFA_RSP, cfi.CFA_RBP):
            reg = cfi.RSP if row.kind == cfi.CFA_RSP else cfi.RBP
            assert rules[a] == cfi.CfaRule(reg, row.cfa_off), (hex(a), row, rules[a])
            checked += 1
        elif row.kind == cfi.NONE:
            assert rules[a] is None, (hex(a), rules[a])
    assert checked > len(addrs) // 2
