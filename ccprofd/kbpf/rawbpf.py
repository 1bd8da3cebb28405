"""Minimal raw ``bpf(2)`` syscall access through ctypes.

bcc 0.26 has no wrapper for uprobe_multi links, and feature probes should not pay a clang compile
(~0.2 s each) or depend on bcc at all, so the few commands we need are issued directly.  The command
numbers and ``union bpf_attr`` layouts live in :mod:`ccprofd.kbpf.abi` (the tests check them against
the running kernel's BTF).  x86-64 only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Sequence

from ccprofd.kbpf.abi import (
    BPF_BTF_LOAD,
    BPF_MAP_CREATE,
    BPF_MAP_GET_FD_BY_ID,
    BPF_MAP_GET_NEXT_ID,
    BPF_MAP_LOOKUP_ELEM,
    BPF_MAP_UPDATE_BATCH,
    BPF_MAP_UPDATE_ELEM,
    BPF_OBJ_GET_INFO_BY_FD,
    BPF_PROG_LOAD,
    BtfLoadAttr,
    GetIdAttr,
    InfoByFdAttr,
    InfoHead,
    LinkInfoHead,
    MapBatchAttr,
    MapCreateAttr,
    MapElemAttr,
    MapInfo,
    ProgInfo,
    ProgLoadAttr,
)
from ccprofd.kbpf.errors import BPFError

SYS_BPF_X86_64 = 321

# enum bpf_prog_type
BPF_PROG_TYPE_SOCKET_FILTER = 1
BPF_PROG_TYPE_KPROBE = 2
BPF_PROG_TYPE_TRACEPOINT = 5

# enum bpf_map_type
BPF_MAP_TYPE_RINGBUF = 27
BPF_MAP_TYPE_TASK_STORAGE = 29

# enum bpf_attach_type
BPF_TRACE_UPROBE_MULTI = 48

BPF_F_NO_PREALLOC = 1
BPF_FUNC_LOOP = 181

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class BPFSyscallError(BPFError):
    """A raw bpf(2) command failed; ``errno`` is kept for callers that branch on it."""

    def __init__(self, what: str, err: int, log_reason: str = "") -> None:
        self.errno = err
        self.log_reason = log_reason  # BPF_PROG_LOAD: the verifier's reason, when known
        super().__init__(f"{what}: {os.strerror(err)} (errno {err})")


def _check_arch() -> None:
    if platform.machine() != "x86_64":
        raise BPFError(f"raw bpf syscalls are implemented for x86-64 only, not {platform.machine()}")


def bpf(cmd: int, attr: ctypes.Structure | ctypes.Array[ctypes.c_char], what: str) -> int:
    """Issue ``bpf(cmd, &attr, sizeof(attr))``; return the (non-negative) result or raise."""
    ret = bpf_or_errno(cmd, attr)
    if ret < 0:
        raise BPFSyscallError(what, -ret)
    return ret


def bpf_or_errno(cmd: int, attr: ctypes.Structure | ctypes.Array[ctypes.c_char]) -> int:
    """:func:`bpf` without the exception: the result, or ``-errno``.  Why: a map walk ends with
    ENOENT, and the daemon walks maps at every poll; an exception object per walk was ~4% of its
    poll thread under load."""
    _check_arch()
    ret = _syscall(
        ctypes.c_long(SYS_BPF_X86_64),
        ctypes.c_long(cmd),
        ctypes.byref(attr),
        ctypes.c_uint(ctypes.sizeof(attr)),
    )
    return int(ret) if ret >= 0 else -ctypes.get_errno()


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """Encode one ``struct bpf_insn`` (little-endian: dst_reg in the low nibble)."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


# A few opcodes for hand-assembled probe programs.
def mov64_imm(dst: int, imm: int) -> bytes:
    return insn(0xB7, dst=dst, imm=imm)


def call_helper(helper_id: int) -> bytes:
    return insn(0x85, imm=helper_id)


def exit_insn() -> bytes:
    return insn(0x95)


def ld_pseudo_func(dst: int, rel: int) -> bytes:
    """``ld_imm64 dst, <subprog>`` (BPF_PSEUDO_FUNC): target insn = this insn + rel + 1."""
    return insn(0x18, dst=dst, src=4, imm=rel) + insn(0)


#: BPF_PROG_LOAD attempts: the verifier gives up with EAGAIN when the loading process is stopped in
#: the middle of a load (SIGSTOP, Ctrl-Z's SIGTSTP, a debugger's or profiler's attach; a handled
#: signal or a PTRACE_INTERRUPT did not do it on this kernel), and a load of the unwinder verifies
#: tens of thousands of instructions.  libbpf retries the same way (PROG_LOAD_ATTEMPTS).
PROG_LOAD_ATTEMPTS = 5


def _load_attempts(attr: ctypes.Structure, what: str) -> int:
    """BPF_PROG_LOAD, again while the verifier was interrupted by a stop (EAGAIN)."""
    for attempt in range(PROG_LOAD_ATTEMPTS):
        try:
            return bpf(BPF_PROG_LOAD, attr, what)
        except BPFSyscallError as exc:
            if exc.errno != errno.EAGAIN or attempt == PROG_LOAD_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def prog_load(
    prog_type: int,
    insns: bytes,
    *,
    expected_attach_type: int = 0,
    name: str = "ccprofd_probe",
    license_: str = "GPL",
    btf_fd: int = 0,
    func_info: Sequence[tuple[int, int]] = (),
    log_size: int = 4096,
) -> int:
    """Load a hand-assembled program; return its fd (caller closes).  ``func_info`` lists
    (insn offset, BTF FUNC type id) per subprogram (needed for callbacks).  The verifier log's last
    line is attached to the error so a failed probe says why."""
    buf = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license_.encode())
    attr = ProgLoadAttr()
    attr.prog_type = prog_type
    attr.insn_cnt = len(insns) // 8
    attr.insns = ctypes.addressof(buf)
    attr.license = ctypes.addressof(lic)
    attr.prog_name = name.encode()[:15]
    attr.expected_attach_type = expected_attach_type
    finfo = (ctypes.c_uint32 * (2 * len(func_info)))(*(x for pair in func_info for x in pair))
    if func_info:
        attr.prog_btf_fd = btf_fd
        attr.func_info_rec_size = 8
        attr.func_info = ctypes.addressof(finfo)
        attr.func_info_cnt = len(func_info)
    try:
        # No log first: the verifier formats its log even past the buffer's end, which made the
        # unwinder's load 9 s instead of 2.5 s (and such a log overflows the buffer anyway).
        return _load_attempts(attr, f"loading probe program {name}")
    except BPFSyscallError as exc:
        # Load again with a log, only to say why it failed.
        log = ctypes.create_string_buffer(log_size)
        attr.log_level = 1
        attr.log_size = len(log)
        attr.log_buf = ctypes.addressof(log)
        try:
            return _load_attempts(attr, f"loading probe program {name}")
        except BPFSyscallError:
            lines = log.value.decode(errors="replace").strip().splitlines()
            # the verifier's reason, not the statistics lines it ends with
            stats = ("processed ", "verification time")
            why = next((ln for ln in reversed(lines) if not ln.startswith(stats)), lines[-1] if lines else "")
            raise BPFSyscallError(f"loading probe program {name} [{why}]", exc.errno, why) from None


def map_create(
    map_type: int,
    key_size: int,
    value_size: int,
    max_entries: int,
    *,
    flags: int = 0,
    btf_fd: int = 0,
    btf_key_type_id: int = 0,
    btf_value_type_id: int = 0,
    name: str = "ccprofd_probe",
) -> int:
    """Create a map; return its fd (caller closes)."""
    attr = MapCreateAttr()
    attr.map_type = map_type
    attr.key_size = key_size
    attr.value_size = value_size
    attr.max_entries = max_entries
    attr.map_flags = flags
    attr.map_name = name.encode()[:15]
    attr.btf_fd = btf_fd
    attr.btf_key_type_id = btf_key_type_id
    attr.btf_value_type_id = btf_value_type_id
    return bpf(BPF_MAP_CREATE, attr, f"creating map {name} (type {map_type})")


BTF_KIND_INT = 1
BTF_KIND_FUNC = 12
BTF_KIND_FUNC_PROTO = 13


def int_btf(funcs: Sequence[str] = ()) -> bytes:
    """A minimal BTF blob: type 1 is ``int`` (4 bytes, signed); with ``funcs``, type 2 is
    ``int (void)`` and types 3, 4, ... are static FUNCs of that prototype named ``funcs``.
    Local-storage maps need BTF for key and value; programs with callbacks need FUNC info."""
    strings = bytearray(b"\x00")

    def name(text: str) -> int:
        off = len(strings)
        strings.extend(text.encode() + b"\x00")
        return off

    types = struct.pack("<IIII", name("int"), BTF_KIND_INT << 24, 4, (1 << 24) | 32)
    if funcs:
        types += struct.pack("<III", 0, BTF_KIND_FUNC_PROTO << 24, 1)
        for fn in funcs:
            types += struct.pack("<III", name(fn), BTF_KIND_FUNC << 24, 2)
    hdr_len = 24
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, hdr_len, 0, len(types), len(types), len(strings))
    return header + types + bytes(strings)


def btf_load(blob: bytes) -> int:
    """Load a BTF blob; return its fd (caller closes)."""
    buf = ctypes.create_string_buffer(blob, len(blob))
    attr = BtfLoadAttr()
    attr.btf = ctypes.addressof(buf)
    attr.btf_size = len(blob)
    return bpf(BPF_BTF_LOAD, attr, "loading BTF")


def _info_by_fd(fd: int, info: ctypes.Structure, what: str) -> None:
    """BPF_OBJ_GET_INFO_BY_FD into ``info`` (the kernel fills at most ``sizeof(info)`` bytes)."""
    attr = InfoByFdAttr()
    attr.bpf_fd = fd
    attr.info_len = ctypes.sizeof(info)
    attr.info = ctypes.addressof(info)
    bpf(BPF_OBJ_GET_INFO_BY_FD, attr, what)


def obj_id(fd: int) -> int:
    """The kernel id of a program, map or link fd (``struct bpf_{prog,map,link}_info`` all start
    with u32 type, u32 id), as ``bpftool`` lists it."""
    head = InfoHead()
    _info_by_fd(fd, head, f"querying BPF object fd {fd}")
    return int(head.id)


def map_ids() -> list[int]:
    """Ids of every BPF map in the kernel now (any process's), in increasing order."""
    out: list[int] = []
    attr = GetIdAttr()
    for _ in range(1 << 20):
        try:
            bpf(BPF_MAP_GET_NEXT_ID, attr, "listing BPF maps")
        except BPFSyscallError:
            break  # ENOENT: no more
        out.append(int(attr.next_id))
        attr.start_id = attr.next_id
    return out


def map_fd_by_id(map_id: int) -> int:
    """A new fd of map ``map_id`` (the caller closes it); raises when it is gone or not ours to open."""
    attr = GetIdAttr()
    attr.start_id = map_id
    return bpf(BPF_MAP_GET_FD_BY_ID, attr, f"opening BPF map id {map_id}")


def map_info(fd: int) -> MapInfo:
    """The head of ``struct bpf_map_info`` of map ``fd`` (type, id, sizes, name)."""
    info = MapInfo()
    _info_by_fd(fd, info, f"querying map fd {fd}")
    return info


def map_has_key(fd: int, key: bytes, value_size: int) -> bool:
    """Whether map ``fd`` holds ``key`` now (one BPF_MAP_LOOKUP_ELEM)."""
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(max(1, value_size))
    attr = MapElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(v))
    try:
        bpf(BPF_MAP_LOOKUP_ELEM, attr, "looking up a key")
    except BPFSyscallError:
        return False
    return True


def prog_verified_insns(fd: int) -> int:
    """How many instructions the verifier processed to load program ``fd`` (``verified_insns`` of
    ``struct bpf_prog_info``; kernels before 5.16 report 0): the work that grows with the paths it
    explores, and that fails the load past its limit of 1,000,000."""
    info = ProgInfo()
    _info_by_fd(fd, info, f"querying program fd {fd}")
    return int(info.verified_insns)


def link_info(fd: int) -> tuple[int, int, int]:
    """(link type, link id, prog id) of a link fd — the head of ``struct bpf_link_info``."""
    head = LinkInfoHead()
    _info_by_fd(fd, head, f"querying link fd {fd}")
    return int(head.type), int(head.id), int(head.prog_id)


_EINVAL, _ENOTSUPP, _EOPNOTSUPP = 22, 524, 95


def map_update_batch(fd: int, keys: bytes, values: bytes, count: int, what: str = "map") -> None:
    """Write ``count`` entries to the map ``fd`` with ONE ``BPF_MAP_UPDATE_BATCH``: ``keys`` and
    ``values`` are the packed C arrays (``count`` keys, ``count`` values, back to back, each the map's
    key/value size).  Packing bytes once (or loading them packed from a cache) instead of building a
    ctypes object per entry is what makes filling a 200k-row table cost milliseconds.  Kernels or
    map types without batch updates get one ``BPF_MAP_UPDATE_ELEM`` per entry."""
    if count <= 0:
        return
    if len(keys) % count or len(values) % count:
        raise BPFError(f"{what}: {len(keys)} key bytes / {len(values)} value bytes are not {count} entries")
    kbuf = ctypes.create_string_buffer(keys, len(keys))
    vbuf = ctypes.create_string_buffer(values, len(values))
    attr = MapBatchAttr()
    attr.keys = ctypes.addressof(kbuf)
    attr.values = ctypes.addressof(vbuf)
    attr.count = count
    attr.map_fd = fd
    try:
        bpf(BPF_MAP_UPDATE_BATCH, attr, f"{what}: batch update of {count} entries")
        if attr.count == count:
            return
    except BPFSyscallError as exc:
        if exc.errno not in (_EINVAL, _ENOTSUPP, _EOPNOTSUPP):
            raise
    # No batch support (or a partial batch): element by element, from the start (idempotent).
    ks, vs = len(keys) // count, len(values) // count
    elem = MapElemAttr()
    elem.map_fd = fd
    base_k, base_v = ctypes.addressof(kbuf), ctypes.addressof(vbuf)
    for i in range(count):
        elem.key = base_k + i * ks
        elem.value = base_v + i * vs
        bpf(BPF_MAP_UPDATE_ELEM, elem, f"{what}: update of entry {i}")
