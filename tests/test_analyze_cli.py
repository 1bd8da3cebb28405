"""`ccprofd analyze`: bad input gets one line and exit 2 (no traceback); JSON keys; the cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ccprofd.callgraph import analyze_binary, graph_stats
from ccprofd.persist.cache import AnalysisCache

CCPROFD = [sys.executable, "-m", "ccprofd.cli"]
JSON_KEYS = {"binary", "build_id", "pie", "functions", "external_functions", "direct_calls", "plt_calls",
             "tail_calls", "indirect_calls", "address_taken", "nodes", "edges", "sccs", "complex_sccs",
             "cyclic_edges", "analysis_seconds"}


def run(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [*CCPROFD, *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})


def assert_bad_input(proc: subprocess.CompletedProcess[str], path: Path | str, reason: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(path) in lines[0] and reason in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.fixture
def true_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "true"
    shutil.copy("/bin/true", dst)
    return dst


def test_missing_file(tmp_path: Path) -> None:
    assert_bad_input(run("analyze", str(tmp_path / "nope")), tmp_path / "nope", "no such file")


def test_directory(tmp_path: Path) -> None:
    assert_bad_input(run("analyze", str(tmp_path)), tmp_path, "is a directory")


def test_not_elf(tmp_path: Path) -> None:
    p = tmp_path / "script.sh"
    p.write_text("#!/bin/sh\necho hi\n")
    assert_bad_input(run("analyze", str(p)), p, "not an ELF file")


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty"
    p.write_bytes(b"")
    assert_bad_input(run("analyze", str(p)), p, "not an ELF file")


@pytest.mark.parametrize("keep", [40, 2000, 0.5])
def test_truncated_elf(true_copy: Path, keep: float) -> None:
    data = true_copy.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    true_copy.write_bytes(data[:n])
    assert_bad_input(run("analyze", str(true_copy)), true_copy, "truncated")


def test_32bit_elf(true_copy: Path) -> None:
    data = bytearray(true_copy.read_bytes())
    data[4] = 1  # EI_CLASS = ELFCLASS32
    true_copy.write_bytes(bytes(data))
    assert_bad_input(run("analyze", str(true_copy)), true_copy, "32-bit")


def test_arm_elf(true_copy: Path) -> None:
    data = bytearray(true_copy.read_bytes())
    data[18:20] = (183).to_bytes(2, "little")  # e_machine = EM_AARCH64
    true_copy.write_bytes(bytes(data))
    assert_bad_input(run("analyze", str(true_copy)), true_copy, "AArch64")


def test_no_executable_code(tmp_path: Path) -> None:
    src = tmp_path / "data.c"
    src.write_text("int table[16] = {1, 2, 3};\n")
    lib = tmp_path / "libdata.so"
    subprocess.run(["gcc", "-shared", "-nostdlib", "-o", str(lib), str(src)], check=True)
    stripped = tmp_path / "libdata-nox.so"
    # Remove every executable section gcc may have emitted, whichever it was.
    out = subprocess.run(["readelf", "-SW", str(lib)], capture_output=True, text=True, check=True).stdout
    execs = [ln.split("]", 1)[1].split()[0] for ln in out.splitlines() if "]" in ln and " AX " in ln]
    args = [a for name in execs for a in ("--remove-section", name)]
    subprocess.run(["objcopy", *args, str(lib), str(stripped)], check=True)
    assert_bad_input(run("analyze", str(stripped)), stripped, "no executable code")


def test_no_read_permission(true_copy: Path, tmp_path: Path) -> None:
    true_copy.chmod(0o000)
    tmp_path.chmod(0o755)
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed: cannot drop root to test permissions")
    proc = run("analyze", "--no-cache", str(true_copy), user="65534")
    assert_bad_input(proc, true_copy, "permission denied")


def test_usage_error_exit_2() -> None:
    proc = run("analyze")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_json_keys_and_types(tmp_path: Path) -> None:
    proc = run("analyze", "--json", "--cache-dir", str(tmp_path), "/bin/true")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data.keys() >= JSON_KEYS
    assert isinstance(data["pie"], bool)
    for key in JSON_KEYS - {"binary", "build_id", "pie", "analysis_seconds"}:
        assert isinstance(data[key], int) and data[key] >= 0, key
    # nodes = internal functions + external functions + the virtual root
    assert data["nodes"] == data["functions"] + data["external_functions"] + 1


def test_text_table(tmp_path: Path) -> None:
    proc = run("analyze", "--cache-dir", str(tmp_path), "/bin/true")
    assert proc.returncode == 0
    assert "direct calls" in proc.stdout and "build id" in proc.stdout


def test_cache_hit_equals_cold_analysis(tmp_path: Path) -> None:
    cold = analyze_binary("/bin/true", cache_dir=tmp_path)
    files = list((tmp_path / "callgraph").iterdir())
    assert len(files) == 1
    warm = analyze_binary("/bin/true", cache_dir=tmp_path)
    assert warm.from_cache and not cold.from_cache
    assert sorted(cold.graph.edges(keys=True, data=True)) == sorted(warm.graph.edges(keys=True, data=True))
    assert dict(cold.graph.nodes(data=True)) == dict(warm.graph.nodes(data=True))
    assert cold.sites == warm.sites
    fresh = graph_stats(cold)
    cached = graph_stats(warm)
    fresh.pop("analysis_seconds")
    cached.pop("analysis_seconds")
    assert fresh == cached


def test_corrupt_cache_entry_is_a_miss(tmp_path: Path) -> None:
    analyze_binary("/bin/true", cache_dir=tmp_path)
    (entry,) = (tmp_path / "callgraph").iterdir()
    entry.write_bytes(b"garbage")
    again = analyze_binary("/bin/true", cache_dir=tmp_path)
    assert not again.from_cache  # re-analysed, not loaded
    assert AnalysisCache(tmp_path).load("callgraph", entry.name.split(".v")[0]) is not None  # rewritten


def test_stripped_copy_gets_its_own_cache_entry(tmp_path: Path, true_copy: Path) -> None:
    unstripped = tmp_path / "calls"
    src = Path(__file__).parent / "programs" / "calls.c"
    subprocess.run(["gcc", "-O0", "-o", str(unstripped), str(src)], check=True)
    stripped = tmp_path / "calls.stripped"
    subprocess.run(["strip", "-o", str(stripped), str(unstripped)], check=True)
    a = analyze_binary(unstripped, cache_dir=tmp_path / "c")
    b = analyze_binary(stripped, cache_dir=tmp_path / "c")
    assert a.binary.build_id == b.binary.build_id
    assert "main" in {a.name(n) for n in a.functions()}
    assert "main" not in {b.name(n) for n in b.functions()}


def _modules_of_a_cache_hit(tmp_path: Path) -> set[str]:
    """Every module loaded by ``ccprofd analyze --json /bin/true`` answered from the cache, in a fresh
    interpreter (the first run fills the cache)."""
    assert run("analyze", "--json", "--cache-dir", str(tmp_path), "/bin/true").returncode == 0
    probe = ("import json, sys, runpy\n"
             "sys.argv = ['ccprofd', 'analyze', '--json', '--cache-dir', sys.argv[1], '/bin/true']\n"
             "try:\n    runpy.run_module('ccprofd.cli', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print(json.dumps(sorted(sys.modules)), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert json.loads(proc.stdout)["functions"] > 0
    return set(json.loads(proc.stderr.strip().splitlines()[-1]))


def test_cache_hit_imports_no_elf_disassembler_or_graph_library(tmp_path: Path) -> None:
    """A cache hit reads the file and the summary only: pyelftools, capstone and networkx, whose
    imports cost more than the whole hit, stay unloaded (checked in a fresh interpreter)."""
    loaded = {m.split(".")[0] for m in _modules_of_a_cache_hit(tmp_path)}
    assert loaded & {"elftools", "capstone", "networkx"} == set()


def test_cache_hit_imports_only_what_it_uses(tmp_path: Path) -> None:
    """The rest of a hit's cost was imports it never used: the trace parser's tracing.api (with
    dataclasses, inspect, ast), logging for a warning never printed, tempfile for a write never
    made.  None of them may be loaded by the time the JSON is printed."""
    unused = {"dataclasses", "inspect", "logging", "tempfile", "ccprofd.tracing.api"}
    assert _modules_of_a_cache_hit(tmp_path) & unused == set()


def test_build_id_without_pyelftools_matches_readelf(tmp_path: Path, true_copy: Path) -> None:
    """The build-id read with struct (what a cache hit keys on) is what `readelf -n` prints."""
    from ccprofd.elf.identity import build_id_of

    for path in ("/bin/true", "/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6"):
        out = subprocess.run(["readelf", "-n", path], capture_output=True, text=True, check=True).stdout
        ids = [line.split(":", 1)[1].strip() for line in out.splitlines() if "Build ID:" in line]
        assert build_id_of(Path(path).read_bytes()) == ids[0]
    no_notes = tmp_path / "no-notes"
    subprocess.run(["objcopy", "--remove-section=.note.gnu.build-id", str(true_copy), str(no_notes)],
                   check=True)
    assert build_id_of(no_notes.read_bytes()) is None


# ------------------------------------------------------------------ remembered file identities
def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import ccprofd.callgraph as callgraph

    reads: list[str] = []
    real = callgraph.read_elf_file

    def counting(path: str) -> bytes:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(callgraph, "read_elf_file", counting)
    return reads


def test_cache_hit_of_an_unchanged_file_neither_reads_nor_hashes_it(tmp_path: Path, true_copy: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading and hashing the file was most of a hit (node: 99 MB).  A file left alone long enough
    before it was read (here: the racy window set to "always") is known by its stat afterwards."""
    import ccprofd.callgraph as callgraph

    monkeypatch.setattr(callgraph, "RACY_NS", -(1 << 62), raising=False)
    reads = _count_reads(monkeypatch)
    cold = graph_stats(analyze_binary(true_copy, cache_dir=tmp_path))
    assert reads == [str(true_copy)]
    warm = analyze_binary(true_copy, cache_dir=tmp_path)
    assert reads == [str(true_copy)]  # not read again
    assert warm.from_cache
    assert warm.binary.content_hash == hashlib.sha256(true_copy.read_bytes()).hexdigest()
    assert {**graph_stats(warm), "analysis_seconds": 0} == {**cold, "analysis_seconds": 0}


def test_file_changed_just_before_it_was_read_is_not_remembered(tmp_path: Path, true_copy: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """git's racy rule: a file written in the clock tick it was read in could be written again
    without its stat changing, so a file copied just now is read and hashed at every hit.  (The
    window is widened to an hour here so that a stalled test machine cannot outlast it.)"""
    import ccprofd.callgraph as callgraph

    assert callgraph.RACY_NS >= 1_000_000_000  # at least a second: coarser than any file timestamp tick
    monkeypatch.setattr(callgraph, "RACY_NS", 3600 * 1_000_000_000)
    reads = _count_reads(monkeypatch)
    analyze_binary(true_copy, cache_dir=tmp_path)
    warm = analyze_binary(true_copy, cache_dir=tmp_path)
    assert warm.from_cache
    assert reads == [str(true_copy)] * 2


def test_file_edited_in_place_with_its_size_and_mtime_kept_is_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit that keeps the size and sets the mtime back (touch -r) still changes the ctime,
    which no caller can set: the new bytes are read, hashed and analysed."""
    import ccprofd.callgraph as callgraph

    monkeypatch.setattr(callgraph, "RACY_NS", -(1 << 62), raising=False)
    true_copy = tmp_path / "calls"
    subprocess.run(["gcc", "-O0", "-o", str(true_copy), str(Path(__file__).parent / "programs" / "calls.c")],
                   check=True)
    analyze_binary(true_copy, cache_dir=tmp_path)
    before = true_copy.stat()
    from elftools.elf.elffile import ELFFile

    with open(true_copy, "rb") as fh:
        comment = ELFFile(fh).get_section_by_name(".comment")["sh_offset"]
    data = bytearray(true_copy.read_bytes())
    data[comment] ^= 0x20  # "GCC: ..." -> "gCC: ...": a byte no analysis reads
    with open(true_copy, "r+b") as fh:
        fh.write(bytes(data))
    os.utime(true_copy, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = true_copy.stat()
    kept = (before.st_ino, before.st_size, before.st_mtime_ns)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == kept
    reads = _count_reads(monkeypatch)
    graph = analyze_binary(true_copy, cache_dir=tmp_path)
    assert reads == [str(true_copy)]
    assert graph.binary.content_hash == hashlib.sha256(bytes(data)).hexdigest()
