"""A syscall's path argument that BPF could not read at entry, read from the mapped file instead.

BPF reads the path with ``bpf_probe_read_user_str``, which fails (-EFAULT) on a page not yet in
the process's page tables: typically a string literal on a ``.rodata`` page the program had not
touched before the syscall (the kernel faults it in during the call).  When the pointer lies in a
read-only segment of an ELF object the mode knows is mapped there (the object, its inode and its
load bias), the string is that file's bytes (:mod:`ccprofd.elf.rostring`).  Writable or anonymous
memory (stack, heap, ``.data``) keeps its pointer: its bytes may differ from any file, and a
program that wrote a string there has the page resident anyway.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ccprofd.elf.rostring import read_only_string

#: Which argument register holds the path BPF reads at entry (uw_path_arg in unwind.c, cc_path_arg
#: in instrumented.c): open, creat and execve take it in rdi, openat, openat2 and execveat in rsi.
PATH_ARG_REGISTER: dict[int, int] = {2: 0, 85: 0, 59: 0, 257: 1, 437: 1, 322: 1}


def path_pointer(nr: int | None, sargs: tuple[int, ...] | None) -> int:
    """The user pointer of the path argument BPF tried to read (0: none, or NULL)."""
    reg = PATH_ARG_REGISTER.get(nr) if nr is not None else None
    if reg is None or sargs is None or len(sargs) <= reg:
        return 0
    return sargs[reg]


def path_from_file(places: Iterable[str], inode: int | None, vaddr: int, limit: int) -> str | None:
    """The string at ELF vaddr ``vaddr`` of the mapped object, read from the first of ``places``
    (where the file can be opened from here) that is the mapped file (``inode``), decoded as BPF's
    reads are; None when no place gives it certainly."""
    for where in dict.fromkeys(p for p in places if p):
        got = read_only_string(where, vaddr, limit, inode)
        if got is not None:
            return got.decode("utf-8", "surrogateescape") or None
    return None


def file_inode(path: str) -> int | None:
    """The inode of the file at ``path`` now (None: unreadable), to know it later for the same file."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def binary_path_arg(path: str, inode: int | None, nr: int | None, sargs: tuple[int, ...] | None,
                    bias: int, limit: int) -> str | None:
    """Instrumented mode's case: a path argument BPF could not read, from the analysed binary's file
    (``inode`` as it was when analysed) whose load bias in the process is ``bias``.  A path in a
    library is not found here (only the binary's bias is known): it keeps its pointer."""
    ptr = path_pointer(nr, sargs)
    if not ptr or inode is None:
        return None
    return path_from_file((path,), inode, ptr - bias, limit)
