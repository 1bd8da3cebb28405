"""The constants Python shares with the BPF C programs come from the C (ccprofd/kbpf/cdefs.py), and
every value Python uses equals what gcc makes of the same C file: the file's preprocessor lines
are compiled with gcc into a program that prints each macro (an independent preprocessor and
integer evaluator), and the Python values are compared with its output."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import require_tool

from ccprofd.anomaly import enforce
from ccprofd.elf import cfi
from ccprofd.kbpf.cdefs import parse_defines
from ccprofd.tracing import syscall_sampler
from ccprofd.tracing.instrumented import constants as inst
from ccprofd.tracing.unwind import constants as uw
from ccprofd.tracing.unwind import sampler as uw_sampler

PKG = Path(__file__).resolve().parents[1] / "ccprofd"
_PP = re.compile(r"^\s*#\s*(define|undef|if|ifdef|ifndef|elif|else|endif)\b")


def gcc_values(c_file: Path, names: list[str], tmp: Path, predefine: str = "") -> dict[str, int]:
    """Each macro's value as gcc preprocesses and evaluates it (unsigned 64-bit); ``predefine``:
    the configuration macros the loader's prelude sets."""
    require_tool("gcc")
    joined = c_file.read_text().replace("\\\n", " ")  # backslash-continued macros as one line
    lines = [predefine, *(ln for ln in joined.splitlines() if _PP.match(ln))]
    prints = "".join(f'    printf("{n}=%llu\\n", (unsigned long long)({n}));\n' for n in names)
    src = tmp / "macros.c"
    main = f"int main(void) {{\n{prints}    return 0;\n}}\n"
    src.write_text("#include <stdio.h>\n" + "\n".join(lines) + "\n" + main)
    exe = tmp / "macros"
    subprocess.run(["gcc", "-w", "-o", str(exe), str(src)], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split("=") for line in out.split())}


def _same_named(module: object, c_file: Path) -> dict[str, int]:
    """Module constants named like a macro of ``c_file``."""
    macros = set(parse_defines(c_file.read_text()))
    return {n: getattr(module, n) for n in dir(module) if n in macros and isinstance(getattr(module, n), int)}


M64 = (1 << 64) - 1
#: what the loaders' preludes define that decides which of the file's constants exist
PREDEFINE = {"unwind": "#define UE_ENABLED 1\n#define UE_REC_BITS 8"}
#: unwind mode's reason strings -> the UW_WHY_ macro names
WHY = {"max_depth": "MAX_DEPTH", "unknown_pc": "UNKNOWN_PC", "no_maps": "NO_MAPS", "no_cfi": "NO_CFI",
       "unsupported_cfi": "UNSUPPORTED", "rbp_lost": "RBP_LOST", "read_fault": "READ_FAULT",
       "bad_frame": "BAD_FRAME", "no_table": "NO_TABLE", "no_user_regs": "NO_REGS"}

#: unwind.c's rule kind macros (UW_KIND_...) -> ccprofd/elf/cfi.py's names
UW_KINDS = {"NONE": "NONE", "RSP": "CFA_RSP", "RBP": "CFA_RBP", "PLT": "PLT", "SIGNAL": "SIGNAL",
            "END": "END", "UNSUPPORTED": "UNSUPPORTED", "RA_REG": "RA_REG", "GO_SWITCH": "GO_SWITCH",
            "CFA_DEREF": "CFA_DEREF", "GO_MORESTACK": "GO_MORESTACK", "GO_VDSO": "GO_VDSO"}

CASES = {
    "instrumented": (PKG / "tracing/instrumented/instrumented.c", lambda: {
        **_same_named(inst, PKG / "tracing/instrumented/instrumented.c"), "CC_ARG_LEN": inst.ARG_LEN}),
    "unwind": (PKG / "tracing/unwind/unwind.c", lambda: {
        "UW_F_NEW": uw.FLAG_NEW, "UW_F_COLLISION": uw.FLAG_COLLISION,
        "UW_F_UNAGGREGATED": uw.FLAG_UNAGGREGATED,
        "UW_EXACT_BIT": uw.EXACT_BIT, "UE_ANALYSED": uw.UE_ANALYSED, "UW_ARG_LEN": uw.ARG_LEN,
        "UW_SAMPLE_HDR_BYTES": uw_sampler._SAMPLE_HDR.size,
        "UW_EV_SAMPLE": uw.EV_SAMPLE, "UW_EV_MAPS": uw.EV_MAPS, "UW_EV_HIT": uw.EV_HIT,
        "UW_CFG_AGGREGATE": uw.CFG_AGGREGATE, "UW_CFG_EMIT_HITS": uw.CFG_EMIT_HITS,
        **_same_named(uw, PKG / "tracing/unwind/unwind.c"),
        **{f"UW_STAT_{n}": i for i, n in enumerate(uw.STAT_NAMES)},
        **{f"UW_WHY_{WHY[v]}": k for k, v in uw.REASONS.items() if v is not None},
        # the unwind table's rule kinds (ccprofd/elf/cfi.py writes them, unwind.c reads them)
        **{f"UW_KIND_{n}": getattr(cfi, k) for n, k in UW_KINDS.items()},
        "UW_AUX_CALLER_EXACT": cfi.CALLER_EXACT, "UW_AUX_GO_CURG_SET": cfi.GO_CURG_SET,
        "UW_AUX_CLONE_CHILD": cfi.CLONE_CHILD}),
    "syscall_sampler": (PKG / "tracing/syscall_sampler.c", lambda: {
        "CCPROF_EXEC_TARGET": syscall_sampler.EXEC_TARGET_FLAG,
        "NR_SYSCALL_SLOTS": syscall_sampler.NR_SYSCALL_SLOTS,
        "SYSCALL_NR_OFFSET": syscall_sampler.SYSCALL_NR_OFFSET,
        "SYSCALL_RET_OFFSET": syscall_sampler.SYSCALL_RET_OFFSET,
        "CFG_SYSCALL_PATH": syscall_sampler.CFG_SYSCALL_PATH, "PATH_RAW": syscall_sampler.PATH_RAW,
        "PATH_EVENTS": syscall_sampler.PATH_EVENTS, "PATH_OFF": syscall_sampler.PATH_OFF,
        **{f"EV_{kind.upper()}": nr for nr, kind in syscall_sampler.KINDS.items()},
        **{f"STAT_{name.upper()}": i for i, name in enumerate(syscall_sampler.STATS)}}),
    "lsm_enforce": (PKG / "anomaly/lsm_enforce.c", lambda: {
        **_same_named(enforce, PKG / "anomaly/lsm_enforce.c"),
        **{f"VERDICT_{v.upper()}": k for k, v in enforce.VERDICTS.items()}}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_python_constants_equal_gcc_values(case: str, tmp_path: Path) -> None:
    c_file, python_values = CASES[case]
    want = python_values()
    assert len(want) >= 5, f"{case}: too few constants compared ({sorted(want)})"
    got = gcc_values(c_file, sorted(want), tmp_path, PREDEFINE.get(case, ""))
    assert {n: v & M64 for n, v in want.items()} == got


def test_instrumented_constants_cover_what_python_mirrored() -> None:
    """The flags and kinds the Python side used to copy by hand are all read from the C now."""
    names = set(_same_named(inst, PKG / "tracing/instrumented/instrumented.c"))
    for prefix, count in (("K_", 6), ("SF_", 8), ("ST_", 6), ("RS_", 4), ("CFG_", 6), ("AGG_", 4)):
        assert sum(n.startswith(prefix) for n in names) >= count, prefix


def test_parse_defines() -> None:
    text = "\n".join([
        "#define A 0x10u", "#define B (A << 2) // comment", "#define C (64ULL << 20)", "#define D 017",
        "#define F(x) (x)", '#define S "str"', "#define E (B | 1) /* c */", "#ifndef A", "#define A 99",
        "#endif", "#define G (~0u & 0xff)", "#define H (10 / 3)", "#define CAST ((u32)1)",
    ])
    assert parse_defines(text) == {"A": 16, "B": 64, "C": 64 << 20, "D": 15, "E": 65, "G": 255, "H": 3}


@pytest.mark.parametrize(("c_file", "function"), [("tracing/unwind/unwind.c", "uw_path_arg"),
                                                  ("tracing/instrumented/instrumented.c", "cc_path_arg")])
def test_path_argument_registers_equal_the_bpf_readers(c_file: str, function: str, tmp_path: Path) -> None:
    """tracing/patharg.PATH_ARG_REGISTER (which register holds the path userspace re-reads from the
    file) is a copy of the BPF readers' syscall choice: gcc runs each reader, on registers rdi = 1
    and rsi = 2, for every syscall number, and the copy must say the same."""
    from ccprofd.tracing.patharg import PATH_ARG_REGISTER

    require_tool("gcc")
    text = (PKG / c_file).read_text()
    m = re.search(rf"^static __always_inline u64 {function}\(.*?^}}\n", text, re.M | re.S)
    assert m, function
    src = tmp_path / "reader.c"
    # a reader takes the tracepoint's pt_regs, or (uw_path_arg) the words uw_read_regs read from it
    arg = "(u64 *)&r" if "const u64 *rw" in m.group(0).split("\n")[0] else "&r"
    src.write_text(
        "#include <stdio.h>\n#include <string.h>\ntypedef unsigned long long u64;\n"
        "struct pt_regs { u64 di, si; };\n#define __always_inline inline\n"
        "#define UW_RW(r) (__builtin_offsetof(struct pt_regs, r) / 8)\n"
        "static long bpf_probe_read_kernel(void *dst, unsigned n, const void *src) "
        "{ memcpy(dst, src, n); return 0; }\n" + m.group(0) +
        f"int main(void) {{\n    struct pt_regs r = {{1, 2}};\n    for (long nr = 0; nr < 1024; nr++)\n"
        f'        if ({function}({arg}, nr))\n            printf("%ld %llu\\n", nr, {function}({arg}, nr));\n'
        "    return 0;\n}\n")
    exe = tmp_path / "reader"
    subprocess.run(["gcc", "-w", "-o", str(exe), str(src)], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    from_c = {int(nr): int(v) - 1 for nr, v in (line.split() for line in out.splitlines())}
    assert from_c == PATH_ARG_REGISTER
