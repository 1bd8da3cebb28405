"""Code mapped by hand, not by ld.so, and called at once: the first syscall the new code makes is
unwound with the new mappings.

A program maps the text segment of a small shared object itself -- with x86-64 ``mmap``
PROT_EXEC, ``mmap`` PROT_READ then ``pkey_mprotect`` PROT_EXEC, or, through ``int $0x80``, ia32
``mmap2``, ``old_mmap`` (its arguments in memory) or ``mprotect`` -- and calls the function there,
whose first act is ``getppid``.  Nothing else happens between the mapping and that syscall, so
unwind mode must have re-read the mappings when the mapping call returned (uw_maps_exit).  It used
to wait for the next syscall, which is this one: the sample came out ``unknown_pc``.  The ia32
calls are seen only under ``--watch-ia32``; without it the sample must be flagged, not wrong.
Oracles: nm (the function's name and address in the object), readelf (the segment mapped), objdump
(the indirect call the caller frame is at), and the program itself (it prints what getppid
returned).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import compile_c, nm_functions, pt_loads
from conftest import require_bpf, require_tool, skip_or_fail

REPO = Path(__file__).resolve().parent.parent

LIBRARY = r"""
long mapped_getppid(long spins) {
    for (volatile long i = 0; i < spins; i++) {}  /* CPU time in the mapped code first */
    long r;
    asm volatile("syscall" : "=a"(r) : "0"(110L) : "rcx", "r11", "memory");  /* getppid */
    return r;
}
"""

# argv: object, function vaddr, how ("x" mmap exec, "k" pkey_mprotect, "2" ia32 mmap2, "o" ia32
# old_mmap, "m" ia32 mprotect), segment file offset, segment length (hex), and optionally the spins
# the function makes before its syscall.  Every mapping is below 4 GiB (MAP_32BIT; an ia32 mmap2
# maps there anyway) so the ia32 calls can name it.
PROGRAM = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
__attribute__((noinline)) long ia32_mmap2(long len, long fd, long segoff) {
    long r;
    register long pgoff asm("rbp") = segoff >> 12;
    asm volatile("int $0x80" : "=a"(r) : "0"(192L), "b"(0L), "c"(len), "d"(5L), "S"(2L), "D"(fd), "r"(pgoff)
                 : "memory");
    return r;
}
__attribute__((noinline)) long ia32_old_mmap(unsigned *args) {
    long r;
    asm volatile("int $0x80" : "=a"(r) : "0"(90L), "b"(args) : "memory");  /* its arguments in memory */
    return r;
}
__attribute__((noinline)) long ia32_mprotect(long addr, long len) {
    long r;
    asm volatile("int $0x80" : "=a"(r) : "0"(125L), "b"(addr), "c"(len), "d"(5L) : "memory");
    return r;
}
__attribute__((noinline)) long call_mapped(long (*fn)(long), long spins) { return fn(spins) + 1; }
int main(int argc, char **argv) {
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0 || argc < 6) return 2;
    long off = strtol(argv[2], 0, 16), segoff = strtol(argv[4], 0, 16), seglen = strtol(argv[5], 0, 16);
    char how = argv[3][0], *base;
    if (how == '2') {
        base = (char *)ia32_mmap2(seglen, fd, segoff);
    } else if (how == 'o') {
        unsigned *a = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_32BIT, -1, 0);
        if (a == MAP_FAILED) return 3;
        a[0] = 0, a[1] = seglen, a[2] = PROT_READ | PROT_EXEC, a[3] = MAP_PRIVATE, a[4] = fd, a[5] = segoff;
        base = (char *)ia32_old_mmap(a);
    } else {
        int prot = how == 'x' ? PROT_READ | PROT_EXEC : PROT_READ;
        base = mmap(0, seglen, prot, MAP_PRIVATE | MAP_32BIT, fd, segoff);
        if (base == MAP_FAILED) return 3;
        long r = how == 'k' ? syscall(SYS_pkey_mprotect, base, seglen, PROT_READ | PROT_EXEC, -1)
               : how == 'm' ? ia32_mprotect((long)base, seglen) : 0;
        if (r != 0) return 4;
    }
    if ((unsigned long)base >= 0xfffff000UL) return 5;
    long r = call_mapped((long (*)(long))(base + off - segoff), argc > 6 ? atol(argv[6]) : 0);
    printf("%ld\n", r - 1);
    return 0;
}
"""


def segment_of(lib: Path, vaddr: int) -> tuple[int, int, int]:
    """(file offset, vaddr, file size) of the one PT_LOAD holding ``vaddr``, per readelf."""
    (seg,) = [(off, start, size) for start, size, off in pt_loads(lib) if start <= vaddr < start + size]
    return seg


def indirect_call(binary: Path, function: str) -> int:
    """The address of the one indirect call in ``function``, per objdump."""
    out = subprocess.run([require_tool("objdump"), "-d", "--no-show-raw-insn", str(binary)],
                         capture_output=True, text=True, check=True).stdout
    body = out.split(f"<{function}>:\n", 1)[1].split("\n\n", 1)[0]
    (addr,) = [int(m.group(1), 16) for m in re.finditer(r"^\s*([0-9a-f]+):\s+call\s+\*%", body, re.M)]
    return addr


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    tmp = tmp_path_factory.mktemp("codemap")
    (tmp / "lib.c").write_text(LIBRARY)
    lib = tmp / "libmapped.so"
    subprocess.run([require_tool("gcc"), "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", str(lib),
                    str(tmp / "lib.c")], check=True)
    program = compile_c(tmp, "mapper", PROGRAM, "-O1", "-fomit-frame-pointer")
    func = nm_functions(lib)["mapped_getppid"][0]
    offset, vaddr, size = segment_of(lib, func)
    assert offset <= func - vaddr + offset < offset + size
    # the function's file offset (the program maps file offsets); the segment is page aligned
    args = [str(lib), hex(func - vaddr + offset), "", hex(offset), hex(size)]
    assert offset % 4096 == 0
    return lib, program, args


def run(program: Path, args: list[str], how: str) -> subprocess.CompletedProcess[str]:
    argv = [str(program), *args]
    argv[3] = how
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def trace_all(program: Path, args: list[str], how: str, tmp_path: Path,
              *extra: str) -> tuple[list[dict[str, Any]], str]:
    """The samples of one traced run, and what the program printed."""
    out = tmp_path / f"{how}.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--format", "jsonl", *extra,
            "--syscalls", "getppid", "--output", str(out), "--", str(program), *args]
    argv[argv.index("")] = how
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stdout


def trace(program: Path, args: list[str], how: str, tmp_path: Path,
          *extra: str) -> tuple[dict[str, Any], str]:
    """The getppid sample of one traced run, and what the program printed."""
    samples, stdout = trace_all(program, args, how, tmp_path, *extra)
    (sample,) = [s for s in samples if s.get("syscall") == "getppid"]
    return sample, stdout


@pytest.mark.parametrize("how, watch", [("x", False), ("k", False), ("2", True), ("o", True), ("m", True)])
def test_first_syscall_of_code_just_mapped_is_unwound(built: tuple[Path, Path, list[str]], how: str,
                                                     watch: bool, tmp_path: Path) -> None:
    require_bpf()
    lib, program, args = built
    plain = run(program, args, how)
    if plain.returncode != 0 and how in "2om":
        skip_or_fail(f"this kernel runs no int $0x80 syscalls (ia32 emulation off): {plain.returncode}")
    assert plain.returncode == 0 and plain.stdout.strip().isdigit(), plain
    sample, stdout = trace(program, args, how, tmp_path, *(["--watch-ia32"] if watch else []))
    assert stdout.strip().isdigit()
    assert sample["complete"], sample
    names = [(f["function"], f["module"]) for f in sample["frames"]]
    assert names == [("main", str(program)), ("call_mapped", str(program)),
                     ("mapped_getppid", str(lib))], names
    caller = sample["frames"][1]
    call = indirect_call(program, "call_mapped")
    assert int(caller["call_site"], 16) == call and int(caller["return_address"], 16) == call + 2, caller


def test_without_the_watch_an_ia32_mapping_is_flagged_not_guessed(built: tuple[Path, Path, list[str]],
                                                                 tmp_path: Path) -> None:
    """The per-syscall events leave ia32 calls out, so without the compat watch the mmap2 is not
    seen: the sample from the new code says it could not be unwound."""
    require_bpf()
    _lib, program, args = built
    if run(program, args, "2").returncode != 0:
        skip_or_fail("this kernel runs no int $0x80 syscalls (ia32 emulation off)")
    sample, _ = trace(program, args, "2", tmp_path)
    assert not sample["complete"] and sample["reason"] == "unknown_pc", sample


def test_cpu_samples_in_code_just_mapped_are_unwound(built: tuple[Path, Path, list[str]],
                                                    tmp_path: Path) -> None:
    """``--sample-hz`` with a syscall set (the per-syscall events): the mapped function spins before
    any syscall, so its CPU samples need the mappings reloaded at mmap's return -- every one of
    them is complete, with the chain main > call_mapped > mapped_getppid."""
    require_bpf()
    lib, program, args = built
    samples, stdout = trace_all(program, [*args, "400000000"], "x", tmp_path, "--sample-hz", "499")
    assert stdout.strip().isdigit()
    cpu = [s for s in samples if s["event"] == "cpu"]
    mapped = [s for s in cpu if any(f["module"] == str(lib) for f in s["frames"])]
    assert len(mapped) >= 10, [(s["complete"], s.get("reason")) for s in cpu]
    bad = [s for s in mapped if not s["complete"] or [(f["function"], f["module"]) for f in s["frames"]] != [
        ("main", str(program)), ("call_mapped", str(program)), ("mapped_getppid", str(lib))]]
    assert not bad, bad[:3]
    # and no CPU sample at all is lost to a pc the mappings did not have
    assert not [s for s in cpu if s.get("reason") == "unknown_pc"]
