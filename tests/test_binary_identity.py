"""A binary is what its bytes are, wherever it lies and whatever the cache remembers (issue 15).

* A copy of an analysed binary at another path is traced at *its* path: the cached plans must not
  carry the first path (the probes were attached to the first file, every sample of the copy came
  out ``frames: []``, ``complete: true``; unwind mode named the first path's module).
* Cache entries are checked, not trusted: a damaged entry is recomputed (a flipped byte in a CFI
  entry ended ``trace`` in an IndexError; flips in a call-graph entry changed ``analyze`` output
  silently), and an edited binary that keeps its build-id and size is analysed again.

Expected frames come from the test program's source (tests/programs/calls.c: write is reached by
main > say > write), never from ccprofd's output.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_bpf
from programs.build import build

REPO = pathlib.Path(__file__).resolve().parent.parent


def trace(cache: pathlib.Path, mode: str, exe: str, out: pathlib.Path) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--cache-dir", str(cache),
                           "--mode", mode, "-e", "trace=write", "--format", "jsonl", "-o", str(out),
                           "--", exe], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]


def analysed_chain(sample: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["function"], f["module"]) for f in sample["frames"] if f["analysed"]]


@pytest.mark.parametrize("mode", ["instrumented", "unwind"])
def test_copy_at_another_path_is_traced_at_its_own_path(tmp_path: pathlib.Path, mode: str) -> None:
    require_bpf()
    original = pathlib.Path(build("calls", opt="O2", pie=True, strip=False))
    copy = tmp_path / "copy-of-calls"
    shutil.copy2(original, copy)
    cache = tmp_path / "cache"
    for exe in (original, copy):  # the first run fills the cache, the copy's run reuses it
        samples = trace(cache, mode, str(exe), tmp_path / "out.jsonl")
        says = [s for s in samples if s["syscall"] == "write" and len(s["frames"]) > 0
                and any(f["function"] == "say" for f in s["frames"])]
        # calls.c: two write(2)s through main > say (puts' write goes through libc alone)
        assert len(says) >= 2, samples
        for s in says:
            assert s["complete"] is True
            assert analysed_chain(s)[:2] == [("main", str(exe)), ("say", str(exe))], s


# ------------------------------------------------------------------------------- cache integrity
def _flip(path: pathlib.Path, offset: int, bits: int = 0x03) -> None:
    """Flip ``bits`` of the byte at ``offset`` from the end of the file (the payload's tail)."""
    data = bytearray(path.read_bytes())
    data[len(data) - offset] ^= bits
    path.write_bytes(bytes(data))


def test_damaged_cache_entries_are_misses_never_other_values(tmp_path: pathlib.Path) -> None:
    from ccprofd.persist.cache import AnalysisCache

    cache = AnalysisCache(tmp_path)
    value = {"counts": list(range(100, 400)), "name": "x" * 50}
    cache.store("k", "entry", value)
    path = cache.path_for("k", "entry")
    pristine = path.read_bytes()
    for i in range(1, 31):  # 30 two-bit flips across the payload (marshal ints and text)
        path.write_bytes(pristine)
        _flip(path, i * 37)
        assert cache.load("k", "entry") is None, f"flip {i} read as a value"
    path.write_bytes(pristine)
    assert cache.load("k", "entry") == value


def stats(graph: Any) -> dict[str, Any]:
    """``analyze --json``'s statistics without the time they took."""
    from ccprofd.callgraph import graph_stats

    return {k: v for k, v in graph_stats(graph).items() if k != "analysis_seconds"}


def _cache_files(cache: pathlib.Path, kind: str) -> list[pathlib.Path]:
    return sorted((cache / kind).glob("*.marshal"))


def test_damaged_cfi_entry_is_rebuilt(tmp_path: pathlib.Path) -> None:
    from ccprofd.elf import cfi
    from ccprofd.elf.image import ElfImage
    from ccprofd.persist.cache import AnalysisCache

    exe = build("calls", opt="O2", pie=True, strip=False)
    cache = AnalysisCache(tmp_path)
    fresh = cfi.build_table(ElfImage(exe))
    cfi.load_table(exe, cache)
    (entry,) = _cache_files(tmp_path, cfi.CACHE_KIND)
    pristine = entry.read_bytes()
    for i in range(1, 31):
        entry.write_bytes(pristine)
        _flip(entry, i * 13)
        table = cfi.load_table(exe, cache)
        assert (list(table.starts), list(table.rule_ids), table.rules) == \
            (list(fresh.starts), list(fresh.rule_ids), fresh.rules), f"flip {i}"


def test_damaged_callgraph_entry_is_recomputed(tmp_path: pathlib.Path) -> None:
    from ccprofd.callgraph import SUMMARY_KIND, analyze_binary

    exe = build("calls", opt="O2", pie=True, strip=False)
    want = stats(analyze_binary(exe, use_cache=False))
    analyze_binary(exe, cache_dir=tmp_path)
    entries = _cache_files(tmp_path, "callgraph") + _cache_files(tmp_path, SUMMARY_KIND)
    pristine = {p: p.read_bytes() for p in entries}
    for p in entries:
        for i in range(1, 16):
            for q, data in pristine.items():
                q.write_bytes(data)
            _flip(p, i * 29)
            assert stats(analyze_binary(exe, cache_dir=tmp_path)) == want, (p.name, i)


def test_edited_binary_with_the_same_build_id_and_size_is_analysed_again(tmp_path: pathlib.Path) -> None:
    """NOP out main's call to twice (found with objdump): the build-id note and the size stay."""
    from conftest import require_tool

    from ccprofd.callgraph import analyze_binary
    from ccprofd.elf.image import ElfImage

    objdump = require_tool("objdump")
    exe = pathlib.Path(build("calls", opt="O2", pie=True, strip=False))
    edited = tmp_path / "calls-edited"
    shutil.copy2(exe, edited)
    dis = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(exe)], check=True,
                         capture_output=True, text=True).stdout
    main = dis[dis.index("<main>:"):]
    call = next(ln for ln in main.splitlines() if "call" in ln and "<twice>" in ln)
    vaddr = int(call.split(":")[0], 16)
    image = ElfImage(str(exe))
    off = image.addrspace.vaddr_to_offset(vaddr)
    data = bytearray(edited.read_bytes())
    assert data[off] == 0xE8  # a rel32 call: 5 bytes
    data[off:off + 5] = b"\x0f\x1f\x44\x00\x00"
    edited.write_bytes(bytes(data))
    assert ElfImage(str(edited)).build_id() == image.build_id() and edited.stat().st_size == len(image.data)

    cache = tmp_path / "cache"
    analyze_binary(exe, cache_dir=cache)  # the original's analysis is cached first
    want = stats(analyze_binary(edited, use_cache=False))
    assert want != stats(analyze_binary(exe, use_cache=False))  # the edit shows in the analysis
    got = analyze_binary(edited, cache_dir=cache)
    assert stats(got) == want
    import hashlib

    assert got.binary.content_hash == hashlib.sha256(bytes(data)).hexdigest()
