"""Start-up and exit costs of ``ccprofd trace`` (issue #16): what the command imports, what it
re-parses at every start, and what it waits for at exit.  No timings here (shared machine):
each test checks the mechanism that removes a cost (bench/startup.py measures the time)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import select
import subprocess
import sys

import pytest

from ccprofd.persist.cache import AnalysisCache
from ccprofd.tracing.symbols import ModuleSymbols
from tests.conftest import require_tool, skip_or_fail

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_trace_arguments_parse_without_the_other_commands_modules() -> None:
    """learn/detect/model/run register through modules that import the anomaly model and the
    daemon's configuration (~0.1 s): `ccprofd trace` must not pay for them; the full parser
    (`ccprofd --help`) still lists them."""
    code = ("import sys\n"
            "from ccprofd.cli.main import build_parser\n"
            "a = build_parser('trace').parse_args(['trace', '--', '/bin/true'])\n"
            "assert a.func.__name__ == 'cmd_trace'\n"
            "heavy = {'ccprofd.cli.daemon', 'ccprofd.cli.anomaly', 'ccprofd.daemon.config',\n"
            "         'ccprofd.anomaly.detector'} & set(sys.modules)\n"
            "print(sorted(heavy))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    helptext = subprocess.run([sys.executable, "-m", "ccprofd.cli", "--help"], env=env, capture_output=True,
                              text=True, check=True).stdout
    for command in ("trace", "learn", "detect", "model", "run", "install-service"):
        assert command in helptext



def test_trace_start_up_imports_no_http_client() -> None:
    """The debug-file locator fetches from debuginfod with urllib.request, which imports
    http.client, email and ssl (~25-70 ms here): only a configured server needs them, so the
    modules a trace loads (the CLI, both modes, the symbolizers) must not import them."""
    code = ("import sys\n"
            "import ccprofd.cli.main, ccprofd.tracing.unwind.mode, ccprofd.tracing.unwind.symbolize\n"
            "import ccprofd.tracing.instrumented.mode, ccprofd.tracing.symbols, ccprofd.elf.debugfile\n"
            "print(sorted({'urllib.request', 'http.client', 'ssl', 'email'} & set(sys.modules)))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

SYMS_C = ("int helper_fn(int x) { return x * 3; }\n"
          "int main(int argc, char **argv) { return helper_fn(argc); }\n")


def _nm_functions(path: pathlib.Path) -> dict[str, int]:
    nm = require_tool("nm")
    out = subprocess.run([nm, "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {parts[2]: int(parts[0], 16) for parts in (line.split() for line in out.splitlines())
            if len(parts) == 3 and parts[1] in "Tt"}


def test_module_symbols_are_cached_by_file_identity(tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The symbol table of an unanalysed object (libc at the first sample in it) is parsed once
    and then read from the checksummed cache while the file's (dev, inode, size, mtime) stay the
    same; a rewritten file is parsed again.  Names are checked against nm."""
    cc = require_tool("cc")
    src = tmp_path / "s.c"
    src.write_text(SYMS_C)
    exe = tmp_path / "s"
    subprocess.run([cc, "-O0", "-o", str(exe), str(src)], check=True)
    want = _nm_functions(exe)
    cache = AnalysisCache(tmp_path / "cache")

    reads: list[str] = []
    real_read = ModuleSymbols._read

    def counting(path: str) -> list[tuple[int, int, str]]:
        reads.append(path)
        return real_read(path)

    monkeypatch.setattr(ModuleSymbols, "_read", staticmethod(counting))
    first = ModuleSymbols(str(exe), cache)
    assert reads == [str(exe)]
    second = ModuleSymbols(str(exe), cache)
    assert reads == [str(exe)]  # from the cache: not parsed again
    for name in ("main", "helper_fn"):
        assert first.name_at(want[name]) == name
        assert second.name_at(want[name]) == name
    # Rewritten in place (same inode): the mtime/size change makes it a miss.
    src.write_text(SYMS_C.replace("helper_fn", "other_fn"))
    subprocess.run([cc, "-O0", "-o", str(tmp_path / "s2"), str(src)], check=True)
    exe.write_bytes((tmp_path / "s2").read_bytes())
    os.utime(exe, ns=(1, 1))
    third = ModuleSymbols(str(exe), cache)
    assert len(reads) == 2
    assert third.name_at(_nm_functions(exe)["other_fn"]) == "other_fn"
    # Without a cache nothing is stored or read.
    ModuleSymbols(str(exe))
    assert len(reads) == 3


def _eof_within(fd: int, seconds: float) -> bool:
    ready, _, _ = select.select([fd], [], [], seconds)
    return bool(ready) and os.read(fd, 1) == b""


def test_close_in_background_closes_here_and_drops_the_last_reference_soon() -> None:
    """The fds are closed in this process at once; their last copy (the grandchild's) goes
    soon after (EOF on a pipe's read end); the grandchild keeps no other descriptor of ours
    (EOF on another pipe once we close its write end) and leaves no child to reap."""
    from ccprofd.kbpf.attach import close_in_background

    r, w = os.pipe()
    r2, w2 = os.pipe()
    before = _children()
    try:
        close_in_background([w])
        with pytest.raises(OSError):
            os.fstat(w)
        assert _eof_within(r, 60)
        os.close(w2)
        assert _eof_within(r2, 60)  # before: the grandchild held our pipe open until it exited
        # no child of ours is left (reaped); children other tests of this process left are not ours
        assert _children() - before == set()
    finally:
        os.close(r)
        os.close(r2)


def _children() -> set[int]:
    """This process's children (running or zombie), from every thread's children list."""
    out: set[int] = set()
    for task in pathlib.Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            out |= {int(p) for p in (task / "children").read_text().split()}
    return out


def _ldd_path(exe: pathlib.Path, lib: str) -> str:
    ldd = require_tool("ldd")
    out = subprocess.run([ldd, str(exe)], capture_output=True, text=True, check=True).stdout
    return next(os.path.realpath(line.split("=>")[1].split("(")[0].strip())
                for line in out.splitlines() if line.strip().startswith(lib))


def test_load_set_is_cached_and_a_new_library_earlier_in_the_search_is_seen(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DT_NEEDED closure is kept by file identity; installing a library into a directory
    searched before the one it was found in (RUNPATH lib1:lib2) is a miss, and the answer then
    agrees with ldd again."""
    from ccprofd.elf import needed

    cc = require_tool("cc")
    (tmp_path / "foo.c").write_text("int foo(void) { return 7; }\n")
    (tmp_path / "main.c").write_text("int foo(void);\nint main(void) { return foo(); }\n")
    for d in ("lib1", "lib2"):
        (tmp_path / d).mkdir()
    lib2 = tmp_path / "lib2" / "libfoo.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib2), str(tmp_path / "foo.c")], check=True)
    exe = tmp_path / "prog"
    subprocess.run([cc, "-o", str(exe), str(tmp_path / "main.c"), f"-L{tmp_path / 'lib2'}", "-lfoo",
                    "-Wl,--enable-new-dtags,-rpath,$ORIGIN/lib1:$ORIGIN/lib2"], check=True)
    cache = AnalysisCache(tmp_path / "cache")
    calls: list[str] = []
    real = needed._load_set

    def counting(*args: object) -> list[str]:
        calls.append(str(args[0]))
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(needed, "_load_set", counting)
    first = needed.load_set(str(exe), cache=cache)
    assert os.path.realpath(tmp_path / "lib2" / "libfoo.so") in first
    assert _ldd_path(exe, "libfoo.so") in first
    assert needed.load_set(str(exe), cache=cache) == first
    assert len(calls) == 1  # the second answer came from the cache
    (tmp_path / "lib1" / "libfoo.so").write_bytes((tmp_path / "lib2" / "libfoo.so").read_bytes())
    third = needed.load_set(str(exe), cache=cache)
    assert len(calls) == 2
    assert os.path.realpath(tmp_path / "lib1" / "libfoo.so") in third
    assert _ldd_path(exe, "libfoo.so") in third
    assert os.path.realpath(tmp_path / "lib2" / "libfoo.so") not in third


def _readelf_loads(path: pathlib.Path) -> list[tuple[int, int, int, int]]:
    readelf = require_tool("readelf")
    out = subprocess.run([readelf, "-lW", str(path)], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if parts[:1] == ["LOAD"]:  # Type Offset VirtAddr PhysAddr FileSiz MemSiz Flg Align
            rows.append((int(parts[2], 16), int(parts[5], 16), int(parts[1], 16), int(parts[4], 16)))
    return rows


def test_object_facts_and_table_are_cached_by_file_identity(tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A mapped object's PT_LOAD segments, build-id and unwind table come from the cache without
    parsing the object while its (dev, inode, size, mtime) stay the same (libc and ld.so at every
    start-up); a rewritten object is parsed again.  Segments checked against readelf."""
    from ccprofd.tracing.unwind import tables

    cc = require_tool("cc")
    src = tmp_path / "f.c"
    src.write_text(SYMS_C)
    exe = tmp_path / "f"
    subprocess.run([cc, "-O1", "-Wl,--build-id", "-o", str(exe), str(src)], check=True)
    cache = AnalysisCache(tmp_path / "cache")
    parsed: list[str] = []
    real_image = tables.ElfImage

    def counting(path: str) -> object:
        parsed.append(path)
        return real_image(path)

    monkeypatch.setattr(tables, "ElfImage", counting)
    facts, table = tables.object_facts(str(exe), cache)
    assert parsed == [str(exe)] and facts is not None and table is not None
    again, table2 = tables.object_facts(str(exe), cache)
    assert parsed == [str(exe)]  # from the cache: not parsed
    assert again == facts and table2 is not None and table2.starts == table.starts
    assert [s[:4] for s in facts.segments] == _readelf_loads(exe)
    notes = subprocess.run([require_tool("readelf"), "-n", str(exe)], capture_output=True, text=True,
                           check=True).stdout
    assert facts.build_id is not None and f"Build ID: {facts.build_id}" in notes
    exe.write_bytes(exe.read_bytes() + b"\0" * 16)  # same inode, new size and mtime
    third, _ = tables.object_facts(str(exe), cache)
    assert len(parsed) == 2 and third is not None and third.content_hash != facts.content_hash


def _elftools_function_symbols(path: str) -> list[tuple[int, int, str]]:
    """The same rows read with pyelftools (what ModuleSymbols used before, except that pyelftools
    names STT_GNU_IFUNC (10) STT_LOOS, so the old reader missed libc's IFUNCs such as memchr)."""
    from elftools.elf.elffile import ELFFile

    rows: dict[int, tuple[int, int, str]] = {}
    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        for name in (".dynsym", ".symtab"):
            sec = elf.get_section_by_name(name)
            if sec is None or not hasattr(sec, "iter_symbols"):
                continue
            for sym in sec.iter_symbols():
                if sym["st_info"]["type"] not in ("STT_FUNC", "STT_GNU_IFUNC", "STT_LOOS") or not sym.name:
                    continue
                lo, size = int(sym["st_value"]), int(sym["st_size"])
                if size <= 0 or sym["st_shndx"] == "SHN_UNDEF":
                    continue
                old = rows.get(lo)
                if old is None or (old[2].startswith("_") and not sym.name.startswith("_")):
                    rows[lo] = (lo, lo + size, sym.name)
    return sorted(rows.values())


@pytest.mark.parametrize("path", ["/usr/lib/x86_64-linux-gnu/libc.so.6",
                                  "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
                                  "/usr/bin/python3.11", "/bin/bash", "self"])
def test_struct_symbol_reader_agrees_with_pyelftools(path: str, tmp_path: pathlib.Path) -> None:
    """ModuleSymbols' struct reader (fast enough for a cold trace's first sample in libc) gives
    the rows pyelftools gives, on system objects (.dynsym only or .symtab too) and a fresh -O0
    build with a full .symtab; a truncated copy gives no rows and no exception."""
    from ccprofd.tracing.symbols import ModuleSymbols

    if path == "self":
        src = tmp_path / "s.c"
        src.write_text(SYMS_C)
        path = str(tmp_path / "s")
        subprocess.run([require_tool("cc"), "-O0", "-o", path, str(src)], check=True)
    if not os.path.exists(path):
        skip_or_fail(f"{path} not on this system (Debian 12 has it)")
    want = _elftools_function_symbols(path)
    assert want, path
    assert sorted(ModuleSymbols._read(path)) == want
    if path.endswith("libc.so.6"):  # an IFUNC by nm (type "i") is named
        nm = subprocess.run([require_tool("nm"), "-D", "--defined-only", path], capture_output=True,
                            text=True, check=True).stdout
        ifunc = {p[2].split("@")[0]: int(p[0], 16) for p in (line.split() for line in nm.splitlines())
                 if len(p) == 3 and p[1] == "i"}
        assert "memchr" in ifunc and (ifunc["memchr"], "memchr") in {(r[0], r[2]) for r in want}
    cut = tmp_path / "cut"
    cut.write_bytes(pathlib.Path(path).read_bytes()[:100])
    assert ModuleSymbols._read(str(cut)) == []


def test_kernel_btf_offsets_are_kept_beside_the_bpf_objects(tmp_path: pathlib.Path) -> None:
    """The exec-target offsets from the kernel's BTF are an input of the BPF text (the object
    cache key needs them) and depend on the kernel only: they are kept in ``<cache>/bpf`` with
    the compiled objects, so an emptied analysis cache with the objects kept does not walk the
    BTF again; the defines are those of the blob (bpftool-checked in test_warm_start)."""
    from ccprofd.kbpf import btf as kbtf
    from ccprofd.tracing.syscall_sampler import exec_target_source

    if not os.path.exists(kbtf.VMLINUX_BTF):
        skip_or_fail("no kernel BTF (/sys/kernel/btf/vmlinux)")
    kbtf._cached_offsets.cache_clear()
    text = exec_target_source(tmp_path / "analysis")
    assert list((tmp_path / "analysis" / "bpf" / kbtf.CACHE_KIND).iterdir())
    assert not (tmp_path / "analysis" / kbtf.CACHE_KIND).exists()
    want = kbtf.offsets_via_cache(pathlib.Path(kbtf.VMLINUX_BTF).read_bytes(), tmp_path / "other")
    for name, value in want.items():
        assert f"#define {name} {value}\n" in text
