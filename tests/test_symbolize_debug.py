"""Symbolisation from separate debug files and DWARF lines (issue 17): library frames between
program frames get libc6-dbg's names (checked with nm on the debug file), and frames get DWARF
file:line and inlined calls (checked with addr2line -f -i).  Expected values come from binutils,
never from ccprofd's output."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from bisect import bisect_right
from typing import Any

import pytest
from conftest import require_bpf, require_tool, skip_or_fail
from library_oracle import debug_file
from programs.build import build

from ccprofd.elf.debugfile import DebugFileLocator
from ccprofd.elf.dwarflines import DwarfLines
from ccprofd.export.jsonl import format_frames_text
from ccprofd.tracing.symbols import ModuleSource, ModuleSymbols

REPO = pathlib.Path(__file__).resolve().parent.parent


def build_id_of(path: str) -> str:
    out = subprocess.run([require_tool("readelf"), "-n", path], check=True, capture_output=True,
                         text=True).stdout
    return next(line.split()[-1] for line in out.splitlines() if "Build ID" in line)


def system_debug_file(module: str) -> str:
    """The libc6-dbg file of ``module``, by the build-id readelf reports."""
    path = debug_file(module)
    if path is None:
        skip_or_fail(f"no debug file for {module} (libc6-dbg not installed?)")
    assert path is not None
    return path


class NmFunctions:
    """Function symbols of an object as ``nm -S --defined-only`` lists them (aliases together)."""

    def __init__(self, path: str, dynamic: bool = False) -> None:
        args = [require_tool("nm"), "-S", "--defined-only", *(["-D"] if dynamic else []), path]
        rows: dict[tuple[int, int], set[str]] = {}
        for line in subprocess.run(args, check=True, capture_output=True, text=True).stdout.splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[2] in "tTWi":
                lo, size = int(parts[0], 16), int(parts[1], 16)
                if size:
                    rows.setdefault((lo, lo + size), set()).add(parts[3].split("@")[0])
        self.rows = sorted(rows.items())
        self.starts = [r[0][0] for r in self.rows]

    def names_at(self, addr: int) -> set[str]:
        out: set[str] = set()
        i = bisect_right(self.starts, addr) - 1
        for (lo, hi), names in self.rows[max(0, i - 8):i + 1]:  # a few overlapping neighbours
            if lo <= addr < hi:
                out |= names
        return out


def addr2line(path: str, addr: int) -> list[tuple[str, str, int | None]]:
    """(function, file, line) per line of ``addr2line -f -i``, innermost first."""
    out = subprocess.run([require_tool("addr2line"), "-f", "-i", "-e", path, f"{addr:#x}"], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    rows = []
    for fn, where in zip(out[0::2], out[1::2], strict=True):
        file, _, line = where.rpartition(":")
        line = line.split()[0]
        rows.append((fn, file, int(line) if line.isdigit() else None))
    return rows


def same_file(ours: str | None, theirs: str) -> bool:
    """addr2line joins a DWARF 5 file's directory twice for libc (``./stdlib/./stdlib/msort.c``);
    a program's paths are absolute and must be equal."""
    if ours is None:
        return False
    if os.path.isabs(theirs):
        return ours == theirs
    return os.path.basename(ours) == os.path.basename(theirs)


def check_lines(frame: dict[str, Any], path: str, addr: int) -> None:
    """A frame's file/line/inlined against ``addr2line -f -i`` at ``addr``."""
    want = addr2line(path, addr)
    outer = want[-1]
    assert same_file(frame.get("file"), outer[1]) and frame.get("line") == outer[2], (frame, want)
    inlined = frame.get("inlined", [])
    assert len(inlined) == len(want) - 1, (frame, want)
    for got, (fn, file, line) in zip(inlined, reversed(want[:-1]), strict=True):
        assert got["function"] == fn and same_file(got["file"], file) and got["line"] == line, (frame, want)


def trace_jsonl(tmp_path: pathlib.Path, prog: pathlib.Path, *extra: str, mode: str = "unwind",
                env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode,
                           "--format", "jsonl", "--syscalls", "getppid,getpid", "-o", str(out), *extra,
                           "--", str(prog)],
                          capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    return [r for r in map(json.loads, out.read_text().splitlines()) if r.get("syscall")]


def test_unwind_library_frames_and_lines(tmp_path: pathlib.Path) -> None:
    """main > sort_all > qsort_r > msort_with_tmp.part.0 ... > cmp_sys > getppid: every libc frame
    named as nm names its address in libc6-dbg's file (msort_with_tmp.part.0 is in no table of
    libc.so.6 itself); every frame's file:line and inlined calls as addr2line -f -i gives them."""
    require_bpf()
    prog = build("libframes", opt="O2")
    samples = trace_jsonl(tmp_path, prog, "--source-lines")
    ppid = [s for s in samples if s["syscall"] == "getppid"]
    assert len(ppid) == 1 and ppid[0]["complete"], samples
    frames = ppid[0]["frames"]
    names = [f["function"] for f in frames]
    assert names[:2] == ["main", "sort_all"] and names[-2:] == ["cmp_sys", "getppid"], names
    libc = frames[-1]["module"]
    debug = system_debug_file(libc)
    by_nm, exported = NmFunctions(debug), NmFunctions(libc, dynamic=True)
    between = frames[2:-2]
    assert between and all(not f["analysed"] and f["module"] == libc for f in between), between
    local = 0
    for f in between:
        addr = int(f["return_address"], 16) - 1
        assert f["function"] in by_nm.names_at(addr), (f, by_nm.names_at(addr))
        local += not exported.names_at(addr)  # a function libc.so.6's own .dynsym does not name
    assert local >= 1 and "msort_with_tmp.part.0" in {f["function"] for f in between}
    for f in between:
        check_lines(f, debug, int(f["return_address"], 16) - 1)
    for f in frames:
        if f["analysed"]:
            check_lines(f, str(prog), int(f["call_site"], 16))


def test_unwind_inlined_call(tmp_path: pathlib.Path) -> None:
    """note() is inlined into outer(): outer's frame is at note's call (line from addr2line), with
    note's own line as its inlined call."""
    require_bpf()
    prog = build("libframes", opt="O2")
    samples = trace_jsonl(tmp_path, prog, "--source-lines")
    pid = [s for s in samples if s["syscall"] == "getpid"]
    assert len(pid) == 1, samples
    frames = pid[0]["frames"]
    assert [f["function"] for f in frames] == ["main", "outer", "getpid"]
    outer = frames[1]
    assert [c["function"] for c in outer.get("inlined", [])] == ["note"], outer
    check_lines(outer, str(prog), int(outer["call_site"], 16))
    text = format_frames_text(frames)
    assert f"(note) {outer['inlined'][0]['file']}:{outer['inlined'][0]['line']} [inlined]\n" in text


def test_instrumented_program_lines(tmp_path: pathlib.Path) -> None:
    """Instrumented mode (library frames are the imports the binary called): the binary's frames
    get file:line and inlined calls as addr2line -f -i gives them at their call sites."""
    require_bpf()
    prog = build("libframes", opt="O2")
    samples = trace_jsonl(tmp_path, prog, "--source-lines", mode="instrumented")
    chains = {s["syscall"]: [f["function"] for f in s["frames"]] for s in samples}
    assert chains == {"getppid": ["main", "sort_all", "qsort", "cmp_sys"], "getpid": ["main", "outer"]}
    checked = 0
    for s in samples:
        for f in s["frames"]:
            if f["analysed"]:
                check_lines(f, str(prog), int(f["call_site"], 16))
                checked += 1
    assert checked == 5
    outer = samples[[s["syscall"] for s in samples].index("getpid")]["frames"][1]
    assert [c["function"] for c in outer["inlined"]] == ["note"]


def test_source_lines_off_by_default_in_jsonl(tmp_path: pathlib.Path) -> None:
    """JSONL (a machine's format, often of long runs) leaves DWARF alone unless asked: it costs
    ~40 ms per compile unit at a frame's first use; library names from debug files stay."""
    require_bpf()
    prog = build("libframes", opt="O2")
    samples = trace_jsonl(tmp_path, prog)
    assert samples and all("file" not in f and "line" not in f for s in samples for f in s["frames"])
    assert "msort_with_tmp.part.0" in {f["function"] for s in samples for f in s["frames"]}


# ------------------------------------------------------------------------- without BPF
@pytest.fixture
def split_prog(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """(stripped program, debug root holding its debug file by build-id, the debug file)."""
    gcc, objcopy = require_tool("gcc"), require_tool("objcopy")
    src = tmp_path / "p.c"
    src.write_text("__attribute__((noinline)) static int helper(int x) { return x * 3 + 1; }\n"
                   "int main(int c, char **v) { (void)v; return helper(c); }\n")
    prog = tmp_path / "prog"
    subprocess.run([gcc, "-g", "-O2", "-Wl,--build-id", "-o", str(prog), str(src)], check=True)
    bid = build_id_of(str(prog))
    root = tmp_path / "root"
    dbg = root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    dbg.parent.mkdir(parents=True)
    subprocess.run([objcopy, "--only-keep-debug", str(prog), str(dbg)], check=True)
    subprocess.run([objcopy, "--strip-all", str(prog)], check=True)
    return prog, root, dbg


def test_local_function_from_debug_file(split_prog: tuple[pathlib.Path, pathlib.Path, pathlib.Path]) -> None:
    prog, root, dbg = split_prog
    (lo, hi), _ = next(r for r in NmFunctions(str(dbg)).rows if "helper" in r[1])
    syms = ModuleSymbols(str(prog), locator=DebugFileLocator(str(root)))
    assert syms.debug_file == str(dbg)
    assert syms.name_at(lo) == "helper" and syms.name_at(hi - 1) == "helper"
    assert ModuleSymbols(str(prog), locator=DebugFileLocator(str(root / "none"))).name_at(lo) is None
    src = ModuleSource(str(prog), locator=DebugFileLocator(str(root)))
    got = src.at(lo)
    want = addr2line(str(dbg), lo)
    assert got is not None and (got.file, got.line) == want[-1][1:]


def test_dwarf_lines_malformed_is_none(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x7fELF" + b"\0" * 100)
    assert DwarfLines(str(bad)).lookup(0x1000) is None
    assert DwarfLines(str(tmp_path / "missing")).lookup(0x1000) is None


def test_unit_tables_cached(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later DwarfLines (a later trace) answers from the cache without opening the DWARF: the
    same locations, checked against addr2line."""
    from ccprofd.persist.cache import AnalysisCache

    prog = str(build("libframes", opt="O2"))
    nm = subprocess.run([require_tool("nm"), "--defined-only", prog], check=True, capture_output=True,
                        text=True).stdout.split("\n")
    wanted = ("cmp_sys", "sort_all", "outer", "main")
    addrs = [int(line.split()[0], 16) for line in nm
             if line and line.split()[1] in "tT" and line.split()[2] in wanted]
    assert len(addrs) == 4
    cache = AnalysisCache(tmp_path / "c")
    first = [DwarfLines(prog, cache).lookup(a + 4) for a in addrs]
    monkeypatch.setattr(DwarfLines, "_open", lambda self: pytest.fail("DWARF opened despite the cache"))
    again = [DwarfLines(prog, cache).lookup(a + 4) for a in addrs]
    assert again == first
    for a, got in zip(addrs, again, strict=True):
        assert got is not None
        want = addr2line(prog, a + 4)
        assert (got.file, got.line) == want[-1][1:]
        assert [c.function for c in got.inlined] == [w[0] for w in reversed(want[:-1])]


def test_debuginfod_end_to_end(tmp_path: pathlib.Path) -> None:
    """A program whose DWARF was split off and is served only by a (local) debuginfod server: with
    CCPROFD_DEBUGINFOD=1 the trace fetches it into --cache-dir and its frames get addr2line's
    lines; without the opt-in the server is never asked (DEBUGINFOD_URLS alone is not enough)."""
    require_bpf()
    import shutil

    from test_debugfile import _Server

    objcopy = require_tool("objcopy")
    prog = tmp_path / "libframes"
    shutil.copy(build("libframes", opt="O2"), prog)
    dbg = tmp_path / "libframes.debug"
    subprocess.run([objcopy, "--only-keep-debug", str(prog), str(dbg)], check=True)
    subprocess.run([objcopy, "--strip-debug", str(prog)], check=True)  # names stay, DWARF goes
    bid = build_id_of(str(prog))
    srv = _Server({f"/buildid/{bid}/debuginfo": dbg.read_bytes()})
    cache = tmp_path / "cache"
    try:
        env = {**os.environ, "DEBUGINFOD_URLS": srv.url}
        env.pop("CCPROFD_DEBUGINFOD", None)
        samples = trace_jsonl(tmp_path, prog, "--source-lines", "--cache-dir", str(cache), env=env)
        assert srv.hits == []
        assert all("file" not in f for s in samples for f in s["frames"] if f["analysed"])
        env["CCPROFD_DEBUGINFOD"] = "1"
        samples = trace_jsonl(tmp_path, prog, "--source-lines", "--cache-dir", str(cache), env=env)
    finally:
        srv.close()
    assert f"/buildid/{bid}/debuginfo" in srv.hits
    assert (cache / "debuginfod" / bid / "debuginfo").read_bytes() == dbg.read_bytes()
    program = [f for s in samples for f in s["frames"] if f["analysed"]]
    assert len(program) == 5
    for f in program:
        check_lines(f, str(dbg), int(f["call_site"], 16))


MUTANTS = int(os.environ.get("CCPROFD_DWARF_MUTANTS", "60"))


def test_dwarf_lines_fuzz(tmp_path: pathlib.Path) -> None:
    """Seeded byte flips and overwrites in a program's DWARF sections: lookups answer a location or
    None, never raise (malformed debug files must not end a trace)."""
    import random

    from ccprofd.elf.rawsections import OFFSET, SIZE, section_headers  # to aim at DWARF bytes

    prog = build("libframes", opt="O2")
    data = prog.read_bytes()
    secs = {n: (h[OFFSET], h[SIZE]) for n, h in section_headers(data)[1].items() if n.startswith(".debug_")}
    assert {".debug_info", ".debug_line"} <= set(secs)
    nm = subprocess.run([require_tool("nm"), "--defined-only", str(prog)], check=True, capture_output=True,
                        text=True).stdout.split("\n")
    addrs = [int(ln.split()[0], 16) + 4 for ln in nm if ln and ln.split()[1] in "tT"]
    rng = random.Random(17)
    names = sorted(secs)
    answered = 0
    for i in range(MUTANTS):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            off, size = secs[rng.choice(names)]
            if size:
                at = off + rng.randrange(size)
                buf[at] = rng.randrange(256) if i % 2 else buf[at] ^ (1 << rng.randrange(8))
        path = tmp_path / f"m{i}"
        path.write_bytes(bytes(buf))
        lines = DwarfLines(str(path))
        for a in addrs:
            got = lines.lookup(a)
            assert got is None or isinstance(got.line, (int, type(None)))
            answered += got is not None
        lines.close()
    assert answered  # most mutants still have usable DWARF: the lookups were exercised
