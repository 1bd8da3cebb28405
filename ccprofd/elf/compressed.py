"""Compressed ELF sections: a section's bytes as they were before the linker or objcopy compressed
them.

Toolchains compress only sections that are not loaded (debug sections): ``gcc -gz``, ``objcopy
--compress-debug-sections`` (Debian's ``-dbgsym`` files) and every Go binary's ``.debug_*``, whose
``.debug_frame`` is the only CFI a Go binary has (it has no ``.eh_frame``).  Two forms exist:
``SHF_COMPRESSED`` (the gABI's: an ``Elf64_Chdr`` before the compressed stream) and GNU's older
``.zdebug_*`` sections (``"ZLIB"`` and the size, big-endian, before a zlib stream).  zlib is read
with the standard library; zstd (``ELFCOMPRESS_ZSTD``, binutils 2.40's optional kind) only when the
``zstandard`` module is importable, else :class:`CompressedSectionError` says so.
"""

from __future__ import annotations

import struct
import zlib

SHF_COMPRESSED = 0x800
ELFCOMPRESS_ZLIB = 1
ELFCOMPRESS_ZSTD = 2
_CHDR = struct.Struct("<IIQQ")  # Elf64_Chdr: ch_type, ch_reserved, ch_size, ch_addralign
_GNU_MAGIC = b"ZLIB"
#: the largest section this reader inflates (a corrupt or hostile size field must not exhaust memory)
MAX_SECTION_BYTES = 1 << 30


class CompressedSectionError(ValueError):
    """A compressed section that cannot be inflated: corrupt, larger than
    :data:`MAX_SECTION_BYTES`, or of a kind this Python cannot read (``unsupported``: the section is
    well formed, the reader may go on without it)."""

    def __init__(self, name: str, reason: str, *, unsupported: bool = False) -> None:
        super().__init__(f"section {name}: {reason}")
        self.unsupported = unsupported


def inflate(name: str, flags: int, data: bytes) -> bytes:
    """The uncompressed bytes of the section ``name`` (``data``: its bytes in the file); ``data``
    itself when it is not compressed."""
    if flags & SHF_COMPRESSED:
        if len(data) < _CHDR.size:
            raise CompressedSectionError(name, "compressed section shorter than its header")
        kind, _, size, _ = _CHDR.unpack_from(data, 0)
        return _inflate(name, kind, size, data[_CHDR.size:])
    if name.startswith(".zdebug") and data[:4] == _GNU_MAGIC and len(data) >= 12:
        return _inflate(name, ELFCOMPRESS_ZLIB, int.from_bytes(data[4:12], "big"), data[12:])
    return data


def _inflate(name: str, kind: int, size: int, stream: bytes) -> bytes:
    if size > MAX_SECTION_BYTES:
        raise CompressedSectionError(name, f"uncompressed size {size} bytes is over {MAX_SECTION_BYTES}")
    if kind == ELFCOMPRESS_ZLIB:
        try:
            d = zlib.decompressobj()
            out = d.decompress(stream, size + 1)
        except zlib.error as exc:
            raise CompressedSectionError(name, f"corrupt zlib stream ({exc})") from None
    elif kind == ELFCOMPRESS_ZSTD:
        try:
            import zstandard
        except ImportError:
            raise CompressedSectionError(name, "compressed with zstd, which needs the Python module "
                                         "zstandard (not installed)", unsupported=True) from None
        try:
            out = zstandard.ZstdDecompressor().decompress(stream, max_output_size=size + 1)
        except zstandard.ZstdError as exc:
            raise CompressedSectionError(name, f"corrupt zstd stream ({exc})") from None
    else:
        raise CompressedSectionError(name, f"unknown compression type {kind}", unsupported=True)
    if len(out) != size:
        raise CompressedSectionError(name, f"inflates to {len(out)} bytes, its header says {size}")
    return bytes(out)
