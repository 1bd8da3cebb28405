"""Malformed ELF input never crashes `analyze` or the unwind-table builder: seeded mutants of a real
binary (bit flips and byte overwrites in the ELF/program/section headers and in .eh_frame, .plt,
.rela.*, .dynsym, .dynamic, notes and .text; truncations) end either in a result or in the domain
error (BinaryError, one line; CfiError from the CFI readers on raw section bytes), and the CLI
answers them with exit status 2 and one line on stderr.  Kernel pseudo-files that block on read
are refused without being read.

Deterministic: the seeds are fixed, so a failure names a mutant that can be rebuilt.
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from ccprofd.callgraph import analyze_binary, graph_stats
from ccprofd.elf.cfi import build_table, cfa_rules, fde_ranges, parse_frames
from ccprofd.elf.errors import BinaryError, CfiError
from ccprofd.elf.image import ElfImage

REAL_BINARY = "/usr/bin/gzip"  # the binary of the report (3 of 60 mutants crashed)
SEED = 15
MUTANTS = 240
CFI_MUTANTS = 400
TARGET_SECTIONS = (".eh_frame", ".eh_frame_hdr", ".plt", ".plt.sec", ".plt.got", ".rela.plt", ".rela.dyn",
                   ".dynsym", ".dynstr", ".dynamic", ".symtab", ".strtab", ".note.gnu.build-id", ".text",
                   ".debug_frame")
SPECIAL = (b"\x00", b"\xff", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff",
           b"\x00\x00\x00\x80", b"\xff\xff\xff\xff\xff\xff\xff\xff")
CCPROFD = [sys.executable, "-m", "ccprofd.cli"]
#: Kinds of rejection (words of BinaryError's reason): the CLI is run on one mutant of each.
REJECTIONS = (".eh_frame", "dynamic relocations", "notes", "PT_LOAD", "symbol", "truncated", "only x86-64",
              "not an ELF")


@pytest.fixture(scope="module")
def real_binary() -> bytes:
    if not os.path.exists(REAL_BINARY):
        pytest.skip(f"{REAL_BINARY} not installed")
    with open(REAL_BINARY, "rb") as fh:
        return fh.read()


def regions(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of the ELF header, both header tables and the sections a reader parses."""
    from io import BytesIO

    elf = ELFFile(BytesIO(data))
    h = elf.header
    out = [(0, 64), (h["e_phoff"], h["e_phnum"] * h["e_phentsize"]),
           (h["e_shoff"], h["e_shnum"] * h["e_shentsize"])]
    for sec in elf.iter_sections():
        if sec.name in TARGET_SECTIONS and sec["sh_type"] != "SHT_NOBITS" and sec["sh_size"]:
            out.append((sec["sh_offset"], sec["sh_size"]))
    return out


def mutate(rng: random.Random, data: bytes, where: list[tuple[int, int]]) -> tuple[bytes, str]:
    """One mutant and what was done to it."""
    kind = rng.choice(("flip", "flip", "overwrite", "overwrite", "truncate"))
    if kind == "truncate":
        n = rng.randrange(len(data))
        return data[:n], f"truncate to {n}"
    buf = bytearray(data)
    edits = []
    for _ in range(rng.randint(1, 8)):
        off, size = rng.choice(where)
        pos = off + rng.randrange(size)
        if kind == "flip":
            buf[pos] ^= 1 << rng.randrange(8)
            edits.append(f"flip@{pos:#x}")
        else:
            val = rng.choice((*SPECIAL, rng.randbytes(rng.randint(1, 8))))
            buf[pos:pos + len(val)] = val
            edits.append(f"{val.hex()}@{pos:#x}")
    return bytes(buf[:len(data)]), f"{kind} {' '.join(edits)}"


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ccprofd" in f.filename] or \
        traceback.extract_tb(exc.__traceback__)
    f = frames[-1]
    return f"{type(exc).__name__} at {os.path.basename(f.filename)}:{f.lineno}: {exc}"


def test_fuzzed_binaries_end_in_a_result_or_one_domain_error(real_binary: bytes, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    where = regions(real_binary)
    crashes: list[str] = []
    analysed = rejected = 0
    reasons: dict[str, Path] = {}  # one mutant per kind of rejection, for the CLI below
    for i in range(MUTANTS):
        data, how = mutate(rng, real_binary, where)
        path = tmp_path / f"mutant{i}"
        path.write_bytes(data)
        for stage in ("analyze", "unwind table"):
            try:
                if stage == "analyze":
                    graph_stats(analyze_binary(path, use_cache=False))
                else:
                    build_table(ElfImage(str(path)))
            except BinaryError as exc:
                assert "\n" not in str(exc), (how, str(exc))
                if stage == "analyze":
                    rejected += 1
                    kind = next((m for m in REJECTIONS if m in exc.reason), "other")
                    reasons.setdefault(kind, path)
            except Exception as exc:  # what the test is about
                crashes.append(f"mutant {i} ({how}), {stage}: {_where(exc)}")
            else:
                analysed += stage == "analyze"
        if path not in reasons.values():
            path.unlink()
    crashed = len({c.split(" (")[0] for c in crashes})
    assert not crashes, f"{crashed} of {MUTANTS} mutants crashed:\n" + "\n".join(crashes)
    # The mutants reach the deep readers, not only the header checks.
    assert analysed >= MUTANTS // 5 and rejected >= MUTANTS // 5, (analysed, rejected)

    # The CLI: exit 2, one line naming the file, no traceback (one mutant per kind of rejection:
    # header checks, corrupt tables found lazily, .eh_frame, code outside the segments, ...).
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    assert len(reasons) >= 4, reasons
    for path in reasons.values():
        proc = subprocess.run([*CCPROFD, "analyze", "--no-cache", str(path)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and str(path) in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_fuzzed_eh_frame_bytes_end_in_rows_or_cfi_error(real_binary: bytes) -> None:
    """The CFI readers alone, on mutated .eh_frame bytes (many more mutants: no ELF to parse), read
    as .eh_frame and as .debug_frame, by all three entry points (unwind rows, function entries, CFA
    rules at addresses)."""
    from io import BytesIO

    sec = ELFFile(BytesIO(real_binary)).get_section_by_name(".eh_frame")
    assert sec is not None
    base, vaddr = sec.data(), sec["sh_addr"]
    rng = random.Random(SEED)
    crashes: list[str] = []
    read = 0
    for i in range(CFI_MUTANTS):
        data, how = mutate(rng, base, [(0, len(base))] + [(0, 64)] * 3)  # the first CIE and FDEs more often
        addrs = [vaddr - 0x1000 + rng.randrange(0x8000) for _ in range(8)]
        for stage, call in (("rows", lambda d=data: parse_frames(d, vaddr, True)),
                            ("debug_frame rows", lambda d=data: parse_frames(d, 0, False)),
                            ("entries", lambda d=data: fde_ranges(d, vaddr)),
                            ("cfa rules", lambda d=data, a=addrs: cfa_rules(d, vaddr, a))):
            try:
                call()
                read += stage == "rows"
            except CfiError as exc:
                assert "\n" not in str(exc), (how, str(exc))
            except Exception as exc:  # what the test is about
                crashes.append(f"mutant {i} ({how}), {stage}: {_where(exc)}")
    assert not crashes, f"{len(crashes)} crashes:\n" + "\n".join(crashes[:40])
    assert CFI_MUTANTS // 10 <= read <= CFI_MUTANTS - CFI_MUTANTS // 10, read


def test_cie_offset_before_the_section_is_an_error(real_binary: bytes) -> None:
    """An FDE whose CIE pointer points before the section: Python's negative offsets would read
    from the section's end and build a table from garbage; it is an error instead."""
    from io import BytesIO

    sec = ELFFile(BytesIO(real_binary)).get_section_by_name(".eh_frame")
    assert sec is not None
    buf = bytearray(sec.data())
    first_len = struct.unpack_from("<I", buf, 0)[0]
    fde = 4 + first_len  # the entry after the first CIE is an FDE
    struct.pack_into("<I", buf, fde + 4, fde + 4 + 16)  # CIE pointer 16 bytes before offset 0
    with pytest.raises(CfiError, match="outside the section"):
        parse_frames(bytes(buf), sec["sh_addr"], True)


@pytest.mark.parametrize("pseudo", ["/sys/kernel/tracing/trace_pipe", "/sys/kernel/debug/tracing/trace_pipe",
                                    "/proc/kmsg"])
def test_blocking_pseudo_files_are_not_read(pseudo: str) -> None:
    """trace_pipe and /proc/kmsg are "regular files" of size 0 whose read blocks until there is
    data and consumes it: analyze refuses them from their stat, without reading."""
    if not os.path.exists(pseudo):
        pytest.skip(f"{pseudo} not present")
    proc = subprocess.run([*CCPROFD, "analyze", "--no-cache", pseudo], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"ccprofd: {pseudo}: not an ELF file (size 0)"]


def test_fifo_is_not_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BinaryError, match="not a regular file"):
        ElfImage(str(fifo))

