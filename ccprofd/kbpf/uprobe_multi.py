"""uprobe_multi links: one program on many sites of one binary, through a raw ``BPF_LINK_CREATE``.

Why not classic uprobes (``RawModule.attach_uprobe``, bcc's ``attach_uprobe``): one perf event per
site (bcc caps them at 1,000) and ~0.1 s per probe to detach on this kernel.  A uprobe_multi link
(Linux >= 6.6) attaches tens of thousands of sites in one syscall and detaches them all by closing
one fd.

The program must have been loaded as ``BPF_PROG_TYPE_KPROBE`` with ``expected_attach_type =
BPF_TRACE_UPROBE_MULTI`` (48) — e.g. ``RawModule.load_func(name, "kprobe", attach_type=48)`` — and
reads each hit's site id with ``bpf_get_attach_cookie(ctx)``.

Offsets are **file offsets** of instruction starts (not virtual addresses); a mid-instruction offset
is accepted silently by the kernel and corrupts the target.

``union bpf_attr`` member used (x86-64; :class:`ccprofd.kbpf.abi.LinkCreateAttr`, which the tests
check against the running kernel's BTF):

====== ==== =====================================================
offset size field
====== ==== =====================================================
0      4    link_create.prog_fd
4      4    link_create.target_fd (0: unused by uprobe_multi)
8      4    link_create.attach_type (48 = BPF_TRACE_UPROBE_MULTI)
12     4    link_create.flags (0)
16     8    uprobe_multi.path (pointer to NUL-terminated path)
24     8    uprobe_multi.offsets (pointer to u64[cnt])
32     8    uprobe_multi.ref_ctr_offsets (pointer to u64[cnt] or 0)
40     8    uprobe_multi.cookies (pointer to u64[cnt] or 0)
48     4    uprobe_multi.cnt
52     4    uprobe_multi.flags (1 = BPF_F_UPROBE_MULTI_RETURN)
56     4    uprobe_multi.pid (0 = every process)
====== ==== =====================================================
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from types import TracebackType

from ccprofd.kbpf.abi import BPF_LINK_CREATE, LinkCreateAttr
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.rawbpf import BPF_TRACE_UPROBE_MULTI, BPFSyscallError, bpf, link_info

BPF_F_UPROBE_MULTI_RETURN = 1
# Kernel limit (MAX_UPROBE_MULTI_CNT in kernel/trace/bpf_trace.c).
MAX_UPROBE_MULTI_CNT = 1 << 20


class UprobeMultiLink:
    """Owns the link fd: the probes live exactly as long as the fd is open.  ``close()`` detaches
    all sites at once; also a context manager."""

    def __init__(self, fd: int, path: str, count: int, pid: int | None, retprobe: bool) -> None:
        self._fd: int | None = fd
        self.path = path
        self.count = count
        self.pid = pid
        self.retprobe = retprobe

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise BPFError(f"uprobe_multi link on {self.path} is closed")
        return self._fd

    @property
    def link_id(self) -> int:
        """Kernel-wide link id (as ``bpftool link show`` lists it)."""
        return link_info(self.fd)[1]

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Detach every site of this link (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> UprobeMultiLink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Last resort only; owners should close explicitly.
        with contextlib.suppress(OSError):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._fd is None else f"fd={self._fd}"
        return f"UprobeMultiLink({self.path!r}, {self.count} sites, pid={self.pid}, {state})"


def attach_uprobe_multi(
    prog_fd: int,
    path: str | os.PathLike[str],
    offsets: Sequence[int],
    cookies: Sequence[int] | None = None,
    *,
    pid: int | None = None,
    retprobe: bool = False,
    ref_ctr_offsets: Sequence[int] | None = None,
) -> UprobeMultiLink:
    """Attach ``prog_fd`` to every file offset of ``path`` in one syscall.

    ``cookies[i]`` (64-bit, e.g. a site id) is what ``bpf_get_attach_cookie(ctx)`` returns for a
    hit at ``offsets[i]``.  ``pid`` restricts the probes to one process (its threads); None = every
    process mapping the file.  ``retprobe`` makes them return probes.
    """
    spath = os.fspath(path)
    n = len(offsets)
    if n == 0:
        raise BPFError(f"uprobe_multi on {spath}: no sites given")
    if n > MAX_UPROBE_MULTI_CNT:
        raise BPFError(f"uprobe_multi on {spath}: {n} sites exceed the kernel limit {MAX_UPROBE_MULTI_CNT}")
    if cookies is not None and len(cookies) != n:
        raise BPFError(f"uprobe_multi on {spath}: {len(cookies)} cookies for {n} offsets")
    if ref_ctr_offsets is not None and len(ref_ctr_offsets) != n:
        raise BPFError(f"uprobe_multi on {spath}: {len(ref_ctr_offsets)} ref_ctr_offsets for {n} offsets")
    if not os.path.isfile(spath):
        raise BPFError(f"uprobe_multi: {spath}: not a regular file")
    if any(o < 0 for o in offsets):
        raise BPFError(f"uprobe_multi on {spath}: negative file offset")

    c_path = ctypes.create_string_buffer(os.fsencode(os.path.abspath(spath)))
    c_offsets = (ctypes.c_uint64 * n)(*offsets)
    c_cookies = (ctypes.c_uint64 * n)(*(c & 0xFFFFFFFFFFFFFFFF for c in cookies)) if cookies else None
    c_refs = (ctypes.c_uint64 * n)(*ref_ctr_offsets) if ref_ctr_offsets else None

    attr = LinkCreateAttr()
    attr.prog_fd = prog_fd
    attr.attach_type = BPF_TRACE_UPROBE_MULTI
    um = attr.uprobe_multi
    um.path = ctypes.addressof(c_path)
    um.offsets = ctypes.addressof(c_offsets)
    um.ref_ctr_offsets = ctypes.addressof(c_refs) if c_refs is not None else 0
    um.cookies = ctypes.addressof(c_cookies) if c_cookies is not None else 0
    um.cnt = n
    um.flags = BPF_F_UPROBE_MULTI_RETURN if retprobe else 0
    um.pid = pid or 0
    what = f"uprobe_multi link on {spath} ({n} sites{f', pid {pid}' if pid else ''})"
    try:
        fd = bpf(BPF_LINK_CREATE, attr, what)
    except BPFSyscallError as exc:
        raise BPFSyscallError(what, exc.errno) from None
    return UprobeMultiLink(fd, spath, n, pid, retprobe)

