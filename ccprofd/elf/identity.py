"""A file's identity as the analysis cache keys it, read without pyelftools.

A cache hit must not pay for importing pyelftools (~60 ms, more than the rest of the hit): the file
is read with the same checks :class:`~ccprofd.elf.image.ElfImage` makes first, and its build-id is
taken from the SHT_NOTE sections with ``struct`` (:mod:`ccprofd.elf.rawsections`).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct

from ccprofd.elf.errors import BinaryError
from ccprofd.elf.rawsections import OFFSET, SIZE, section_headers

SHT_NOTE = 7
NT_GNU_BUILD_ID = 3
_NHDR = struct.Struct("<III")  # namesz, descsz, type


def build_id_of(data: bytes) -> str | None:
    """The GNU build-id (hex) of the first SHT_NOTE section that has one, as pyelftools reads notes
    (name and descriptor each padded to 4 bytes); None if there is none or the table is malformed."""
    headers, _ = section_headers(data)
    for h in headers:
        if h[1] != SHT_NOTE:
            continue
        pos, end = h[OFFSET], min(h[OFFSET] + h[SIZE], len(data))
        while pos + _NHDR.size < end:
            namesz, descsz, ntype = _NHDR.unpack_from(data, pos)
            name_at = pos + _NHDR.size
            desc_at = name_at + ((namesz + 3) & ~3)
            name = data[name_at:desc_at].split(b"\0", 1)[0]
            if ntype == NT_GNU_BUILD_ID and name == b"GNU":
                return data[desc_at:desc_at + descsz].hex()
            pos = desc_at + ((descsz + 3) & ~3)
    return None


def cache_key_of(data: bytes, content_hash: str | None = None) -> str:
    """The analysis cache key of an ELF file's bytes: its content hash (an edited binary may keep its
    build-id and size; a stripped copy keeps the build-id), after the build-id for whoever lists
    the cache.  ``content_hash``: the bytes' SHA-256 (hex), if the caller computed it already."""
    return f"{build_id_of(data) or 'nobuildid'}-{content_hash or hashlib.sha256(data).hexdigest()}"


def read_elf_file(path: str) -> bytes:
    """The bytes of the regular file at ``path``.  Only regular files are opened, and never in a way
    that can block or consume anything: a kernel pseudo-file such as ``/proc/kmsg`` or tracefs'
    ``trace_pipe`` is a "regular file" of size 0 whose read blocks until there is data and takes it
    away from its other readers, so files are read up to their stat size (0: not read at all) and
    opened with O_NONBLOCK."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BinaryError(path, "no such file") from None
    except PermissionError:
        raise BinaryError(path, "permission denied") from None
    except OSError as exc:
        raise BinaryError(path, exc.strerror or str(exc)) from None
    if stat.S_ISDIR(st.st_mode):
        raise BinaryError(path, "is a directory, not an ELF file")
    if not stat.S_ISREG(st.st_mode):
        raise BinaryError(path, "not a regular file")
    if st.st_size == 0:
        raise BinaryError(path, "not an ELF file (size 0)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except PermissionError:
        raise BinaryError(path, "permission denied (cannot read the file)") from None
    except OSError as exc:
        raise BinaryError(path, exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)  # the file opened, which may not be the one stat() saw
        if not stat.S_ISREG(st.st_mode):
            raise BinaryError(path, "not a regular file")
        chunks: list[bytes] = []
        left = st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except BlockingIOError:
        raise BinaryError(path, "not an ELF file (a read would block)") from None
    except OSError as exc:
        raise BinaryError(path, exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(data) < 4 or data[:4] != b"\x7fELF":
        raise BinaryError(path, "not an ELF file" + (" (empty)" if not data else ""))
    if len(data) < 64:
        raise BinaryError(path, "truncated ELF (shorter than an ELF header)")
    if data[4] == 1:
        raise BinaryError(path, "32-bit ELF (ELFCLASS32); only x86-64 ELF64 objects are supported")
    if data[4] != 2:
        raise BinaryError(path, f"corrupt ELF (EI_CLASS={data[4]})")
    return data
