"""A NUL-terminated string of an ELF object's read-only image, read from the file itself.

A syscall's path argument is read by BPF at syscall entry with ``bpf_probe_read_user_str``, which
cannot fault a page in: a string literal on a ``.rodata`` page the process has not touched yet
(file-backed, not yet in its page tables) reads as -EFAULT, and the kernel faults the page in only
during the syscall.  Such a page's bytes are the file's bytes, so the string can be read from the
file instead -- also after the process has exited.  Only where that is certain: a PT_LOAD segment
that is never writable (no PF_W, outside PT_GNU_RELRO, no text relocations), within its file bytes,
in the file the mapping was made of (same inode).  Anything else is None (the caller keeps the
pointer): writable memory may differ from the file.
"""

from __future__ import annotations

import os
import stat
import struct

PT_LOAD = 1
PT_DYNAMIC = 2
PT_GNU_RELRO = 0x6474E552
PF_W = 2
DT_NULL = 0
DT_TEXTREL = 22
DT_FLAGS = 30
DF_TEXTREL = 4

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")  # type, flags, offset, vaddr, paddr, filesz, memsz, align
_DYN = struct.Struct("<qQ")
_MAX_PHNUM = 4096
_MAX_DYN = 4096


def _text_relocations(fd: int, dynamic: tuple[int, int] | None) -> bool:
    """Whether the object asks the loader to write into its read-only segments (DT_TEXTREL)."""
    if dynamic is None:
        return False
    offset, size = dynamic
    data = os.pread(fd, min(size, _MAX_DYN * _DYN.size), offset)
    for pos in range(0, len(data) - _DYN.size + 1, _DYN.size):
        tag, val = _DYN.unpack_from(data, pos)
        if tag == DT_NULL:
            break
        if tag == DT_TEXTREL or (tag == DT_FLAGS and val & DF_TEXTREL):
            return True
    return False


def read_only_string(path: str, vaddr: int, limit: int, inode: int | None = None) -> bytes | None:
    """The string at ELF virtual address ``vaddr`` of the object at ``path`` (without its NUL), cut
    to ``limit - 1`` bytes as ``bpf_probe_read_user_str`` into a ``limit``-byte buffer cuts it;
    None unless the bytes are certainly what a process mapping the object sees there (see the
    module docstring) and the file is the one mapped (``inode``, when given, must match)."""
    if limit <= 1 or vaddr < 0:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (inode is not None and st.st_ino != inode):
            return None
        head = os.pread(fd, _EHDR.size, 0)
        if len(head) < _EHDR.size or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return None  # only ELF64 little-endian (x86-64, what ccprofd traces)
        ehdr = _EHDR.unpack(head)
        phoff, phentsize, phnum = ehdr[5], ehdr[9], ehdr[10]
        if phentsize < _PHDR.size or not 0 < phnum <= _MAX_PHNUM:
            return None
        table = os.pread(fd, phentsize * phnum, phoff)
        if len(table) < phentsize * phnum:
            return None
        phdrs = [_PHDR.unpack_from(table, i * phentsize) for i in range(phnum)]
        seg = next((p for p in phdrs if p[0] == PT_LOAD and p[3] <= vaddr < p[3] + p[5]), None)
        if seg is None or seg[1] & PF_W:
            return None
        if any(p[0] == PT_GNU_RELRO and p[3] <= vaddr < p[3] + p[6] for p in phdrs):
            return None  # written by the loader (relocations), then made read-only
        dynamic = next(((p[2], p[5]) for p in phdrs if p[0] == PT_DYNAMIC), None)
        if _text_relocations(fd, dynamic):
            return None
        room = seg[3] + seg[5] - vaddr  # file bytes left in the segment from vaddr
        data = os.pread(fd, min(room, limit - 1), seg[2] + (vaddr - seg[3]))
    except (OSError, struct.error):
        return None
    finally:
        os.close(fd)
    end = data.find(b"\0")
    if end >= 0:
        return data[:end]
    if len(data) == limit - 1:
        return data  # cut where BPF's read would have cut it
    return None  # the segment's file bytes end before the string does
