"""Compressed debug sections (ccprofd/elf/compressed.py): a ``.debug_frame`` written compressed by
``gcc -gz`` (SHF_COMPRESSED, zlib), ``-gz=zlib-gnu`` (``.zdebug_frame``) or ``objcopy
--compress-debug-sections=zstd`` gives the unwind table of its uncompressed twin, or (zstd, without
the Python module) the table without it.  Before, the compressed bytes were parsed as CFI and the
table was refused (``corrupt .debug_frame``): every Go binary, whose only CFI that is.  Oracles:
the uncompressed twin's table, and readelf's reading of the compressed file's FDEs."""

from __future__ import annotations

import pathlib
import shutil
import struct
import subprocess
import zlib

import pytest
from conftest import require_tool
from test_cfi_readelf import readelf_frames

from ccprofd.elf import cfi
from ccprofd.elf.compressed import SHF_COMPRESSED, CompressedSectionError, inflate
from ccprofd.elf.errors import BinaryError
from ccprofd.elf.image import ElfImage

SOURCE = r"""
#include <unistd.h>
__attribute__((noinline)) int leaf(int x) { return getppid() + x; }
__attribute__((noinline)) int mid(int x) { return leaf(x + 1) * 2; }
int main(void) { return mid(1) & 1; }
"""


def build(tmp: pathlib.Path, gz: str) -> pathlib.Path:
    """The program without .eh_frame for its own code (its CFI is .debug_frame only)."""
    require_tool("gcc")
    src = tmp / "p.c"
    src.write_text(SOURCE)
    out = tmp / f"p_{gz}"
    subprocess.run(["gcc", "-O1", "-g", "-fno-asynchronous-unwind-tables", f"-gz={gz}", "-o", str(out),
                    str(src)], check=True, capture_output=True)
    return out


def readelf_fde_ranges(binary: pathlib.Path) -> list[tuple[int, int]]:
    """The .debug_frame FDEs' pc ranges as readelf reads them (it inflates the section itself)."""
    return [(f.lo, f.hi) for f in readelf_frames(str(binary))
            if f.section in (".debug_frame", ".zdebug_frame")]


def rows(table: cfi.UnwindTable) -> list[tuple[int, cfi.Rule]]:
    return [(s, table.rules[i]) for s, i in zip(table.starts, table.rule_ids, strict=True)]


@pytest.mark.parametrize(("gz", "section"), [("zlib", ".debug_frame"), ("zlib-gnu", ".zdebug_frame")])
def test_compressed_debug_frame_gives_the_uncompressed_table(tmp_path: pathlib.Path, gz: str,
                                                             section: str) -> None:
    plain = build(tmp_path, "none")
    packed = build(tmp_path, gz)
    image = ElfImage(str(packed))
    sec = image.sections[section]
    assert (sec.flags & SHF_COMPRESSED) or gz == "zlib-gnu"
    want, got = cfi.build_table(ElfImage(str(plain))), cfi.build_table(image)
    assert ".debug_frame" in got.sources
    assert rows(got) == rows(want)
    fdes = readelf_fde_ranges(packed)
    assert len(fdes) == 3  # main, mid, leaf
    for lo, hi in fdes:
        assert got.lookup(lo) != cfi.NO_CFI and got.lookup(hi - 1) != cfi.NO_CFI, (hex(lo), hex(hi))


def test_zstd_without_the_module_leaves_the_section_out(tmp_path: pathlib.Path) -> None:
    plain = build(tmp_path, "none")
    packed = tmp_path / "p_zstd"
    got = subprocess.run(["objcopy", "--compress-debug-sections=zstd", str(plain), str(packed)],
                         capture_output=True, text=True)
    if got.returncode != 0:  # binutils built without zstd
        pytest.skip(f"objcopy cannot write zstd sections: {got.stderr.strip()}")
    try:
        import zstandard  # noqa: F401
        pytest.skip("the zstandard module is installed: the section is read")
    except ImportError:
        pass
    table = cfi.build_table(ElfImage(str(packed)))
    assert table.sources == (".eh_frame",)
    lo, _ = readelf_fde_ranges(packed)[0]  # readelf reads it
    assert table.lookup(lo) == cfi.NO_CFI  # not guessed: no CFI there


def test_a_corrupt_compressed_debug_frame_is_a_one_line_binary_error(tmp_path: pathlib.Path) -> None:
    packed = build(tmp_path, "zlib")
    image = ElfImage(str(packed))
    sec = image.sections[".debug_frame"]
    data = bytearray(packed.read_bytes())
    data[sec.offset + 24:sec.offset + sec.size] = b"\xff" * (sec.size - 24)  # the zlib stream
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(data))
    with pytest.raises(BinaryError) as err:
        cfi.build_table(ElfImage(str(bad)))
    assert "\n" not in str(err.value) and ".debug_frame" in str(err.value) and "zlib" in str(err.value)


def chdr(kind: int, size: int) -> bytes:
    return struct.pack("<IIQQ", kind, 0, size, 1)


def test_inflate_checks_the_header() -> None:
    body = b"\x01\x02" * 100
    assert inflate(".debug_x", SHF_COMPRESSED, chdr(1, len(body)) + zlib.compress(body)) == body
    assert inflate(".zdebug_x", 0, b"ZLIB" + len(body).to_bytes(8, "big") + zlib.compress(body)) == body
    assert inflate(".debug_x", 0, body) == body  # not compressed
    with pytest.raises(CompressedSectionError, match="its header says"):
        inflate(".debug_x", SHF_COMPRESSED, chdr(1, len(body) + 1) + zlib.compress(body))
    with pytest.raises(CompressedSectionError, match="its header says"):  # more than the header says
        inflate(".debug_x", SHF_COMPRESSED, chdr(1, 10) + zlib.compress(body))
    with pytest.raises(CompressedSectionError, match="over"):
        inflate(".debug_x", SHF_COMPRESSED, chdr(1, 1 << 40) + zlib.compress(body))
    with pytest.raises(CompressedSectionError, match="shorter than its header"):
        inflate(".debug_x", SHF_COMPRESSED, b"\x01")
    with pytest.raises(CompressedSectionError) as err:
        inflate(".debug_x", SHF_COMPRESSED, chdr(9, 4) + b"abcd")
    assert err.value.unsupported


def test_loaded_sections_are_never_inflated() -> None:
    """A loaded section's bytes are what the process maps: SHF_COMPRESSED is not honoured on it."""
    image = ElfImage(shutil.which("true") or "/bin/true")
    text = image.sections[".text"]
    assert image.section_bytes(text) == image.data[text.offset:text.offset + text.size]
