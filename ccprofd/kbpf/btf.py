"""Kernel struct member offsets from the running kernel's BTF (``/sys/kernel/btf/vmlinux``).

bcc compiles against whatever headers are installed (here Debian's 6.1 headers under a 6.18
kernel), so ``offsetof`` in BPF C can be wrong for structures whose layout changed.  Programs that
must follow a kernel pointer chain (``task->mm->exe_file->f_inode->i_ino``) take the offsets from
here instead and pass them as ``-D``/``#define`` values; reads go through ``bpf_probe_read_kernel``,
so even a wrong offset can only yield a wrong value (which userspace then confirms), never a fault.

Only what that needs is parsed: the type section's STRUCT/UNION members (anonymous members are
searched recursively, as the C compiler resolves them) and the string section.  Parsing the whole
blob in Python takes ~0.5 s, so the few offsets a start needs are cached (:func:`exe_inode_offsets`),
keyed by the blob's SHA-256 and the kernel release: another kernel is another key.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

VMLINUX_BTF = "/sys/kernel/btf/vmlinux"
BTF_MAGIC = 0xEB9F

_KIND_STRUCT, _KIND_UNION = 4, 5
_KIND_TYPEDEF, _KIND_VOLATILE, _KIND_CONST, _KIND_RESTRICT, _KIND_TYPE_TAG = 8, 9, 10, 11, 18
# bytes that follow the 12-byte common header, per kind: fixed, or per vlen entry
_FIXED = {1: 4, 14: 4, 17: 4, 3: 12}
_PER_ENTRY = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}


class BTFError(Exception):
    """The BTF blob is missing, malformed, or lacks the asked-for member (one line)."""


@dataclass(frozen=True, slots=True)
class _Type:
    kind: int
    name: str
    size_or_type: int
    members: tuple[tuple[str, int, int], ...]  # (name, type id, bit offset) for structs/unions


class KernelBTF:
    """Types of one BTF blob, looked up by struct name."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 24:
            raise BTFError("BTF blob too short")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            "<HBBIIIII", data, 0)
        if magic != BTF_MAGIC:
            raise BTFError("not a BTF blob (bad magic)")
        strings = data[hdr_len + str_off: hdr_len + str_off + str_len]
        self.types: list[_Type | None] = [None]  # type id 0 is void
        self.structs: dict[str, int] = {}
        pos, end = hdr_len + type_off, hdr_len + type_off + type_len

        def name_at(off: int) -> str:
            stop = strings.find(b"\0", off)
            return strings[off: stop if stop >= 0 else len(strings)].decode("ascii", "replace")

        while pos < end:
            name_off, info, size_or_type = struct.unpack_from("<III", data, pos)
            pos += 12
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            members: tuple[tuple[str, int, int], ...] = ()
            if kind in (_KIND_STRUCT, _KIND_UNION):
                rows = []
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", data, pos + 12 * i)
                    rows.append((name_at(m_name), m_type, m_off & 0xFFFFFF if kflag else m_off))
                members = tuple(rows)
            pos += _FIXED.get(kind, 0) + _PER_ENTRY.get(kind, 0) * vlen
            name = name_at(name_off) if name_off else ""
            self.types.append(_Type(kind, name, size_or_type, members))
            if kind == _KIND_STRUCT and name and name not in self.structs:
                self.structs[name] = len(self.types) - 1

    def _resolve(self, type_id: int) -> _Type | None:
        for _ in range(32):  # typedef/const/volatile chains are short
            t = self.types[type_id] if 0 < type_id < len(self.types) else None
            if t is None or t.kind not in (_KIND_TYPEDEF, _KIND_VOLATILE, _KIND_CONST, _KIND_RESTRICT,
                                           _KIND_TYPE_TAG):
                return t
            type_id = t.size_or_type
        return None

    def _find(self, t: _Type, member: str) -> int | None:
        for name, type_id, bit_off in t.members:
            if name == member:
                return bit_off
            if not name:  # anonymous struct/union: its members are the parent's
                inner = self._resolve(type_id)
                if inner is not None and inner.kind in (_KIND_STRUCT, _KIND_UNION):
                    sub = self._find(inner, member)
                    if sub is not None:
                        return bit_off + sub
        return None

    def member_offset(self, struct_name: str, member: str) -> int:
        """Byte offset of ``struct_name.member`` (anonymous members searched)."""
        tid = self.structs.get(struct_name)
        if tid is None:
            raise BTFError(f"kernel BTF has no struct {struct_name}")
        t = self.types[tid]
        assert t is not None
        bits = self._find(t, member)
        if bits is None:
            raise BTFError(f"kernel BTF: struct {struct_name} has no member {member}")
        if bits % 8:
            raise BTFError(f"kernel BTF: {struct_name}.{member} is a bit-field")
        return bits // 8


def _read_vmlinux() -> bytes:
    try:
        with open(VMLINUX_BTF, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise BTFError(f"cannot read {VMLINUX_BTF}: {exc.strerror}") from None


@lru_cache(maxsize=1)
def vmlinux_btf() -> KernelBTF:
    return KernelBTF(_read_vmlinux())


#: The pointer chain from the current task to its executable's inode number, as (struct, member).
EXE_INODE_CHAIN = (("task_struct", "mm"), ("mm_struct", "exe_file"), ("file", "f_inode"), ("inode", "i_ino"))


EXE_INODE_NAMES = ("CCPROF_OFF_TASK_MM", "CCPROF_OFF_MM_EXE_FILE", "CCPROF_OFF_FILE_INODE",
                   "CCPROF_OFF_INODE_INO")
CACHE_KIND = "kbtf"
KBTF_CACHE_VERSION = 1


def btf_identity(data: bytes) -> str:
    """What the offsets depend on: the BTF blob itself (its SHA-256) and the kernel release."""
    try:
        with open("/proc/sys/kernel/osrelease") as fh:
            release = fh.read().strip()
    except OSError:
        release = "?"
    return f"{hashlib.sha256(data).hexdigest()[:40]}-{release}-k{KBTF_CACHE_VERSION}"


def _offsets(btf: KernelBTF, names: tuple[str, ...] = EXE_INODE_NAMES,
             members: tuple[tuple[str, str], ...] = EXE_INODE_CHAIN) -> dict[str, int]:
    return {n: btf.member_offset(s, m) for n, (s, m) in zip(names, members, strict=True)}


#: The current task's alternate signal stack (what the kernel's on_sig_stack() tests): instrumented
#: mode compares a stack pointer with recorded ones only when both are on the same stack.
SIGALTSTACK_FIELDS = (("task_struct", "sas_ss_sp"), ("task_struct", "sas_ss_size"))
SIGALTSTACK_NAMES = ("CCPROF_OFF_TASK_SAS_SS_SP", "CCPROF_OFF_TASK_SAS_SS_SIZE")


#: The current task's thread_info.status (its TS_COMPAT bit is the kernel's in_ia32_syscall()): the
#: raw-path syscall programs mark a compat syscall's number (kbpf/syscalls.py, IA32_BIT).
COMPAT_FIELDS = (("task_struct", "thread_info"), ("thread_info", "status"))
COMPAT_NAMES = ("CCPROF_OFF_TASK_THREAD_INFO", "CCPROF_OFF_THREAD_INFO_STATUS")

#: The current task's fs base (x86-64 thread_struct.fsbase: user TLS): the unwinder crosses Go's
#: systemstack through the thread's TLS slot of g (unwind.c, uw_go_switch).
FSBASE_FIELDS = (("task_struct", "thread"), ("thread_struct", "fsbase"))
FSBASE_NAMES = ("CCPROF_OFF_TASK_THREAD", "CCPROF_OFF_THREAD_FSBASE")

#: Everything the shared sampler's text reads (exec_target.c's inode chain, syscall_sampler.c's
#: compat flag) and the fs base, kept as one cache entry: a start reads and hashes the BTF blob once.
SAMPLER_NAMES = EXE_INODE_NAMES + COMPAT_NAMES + FSBASE_NAMES
SAMPLER_FIELDS = EXE_INODE_CHAIN + COMPAT_FIELDS + FSBASE_FIELDS


def sampler_offsets(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, int]:
    """``#define`` values for reading the current executable's inode number and the current task's
    thread_info.status in BPF: from the analysis cache under ``cache_dir`` (default: the user's
    cache directory) when this very BTF blob was parsed before, else parsed and stored.  A damaged
    entry is parsed again."""
    return dict(_cached_offsets(os.fspath(cache_dir) if cache_dir is not None else None))


def exe_inode_offsets(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, int]:
    """The inode chain's part of :func:`sampler_offsets`."""
    return {n: v for n, v in sampler_offsets(cache_dir).items() if n in EXE_INODE_NAMES}


def sigaltstack_offsets(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, int]:
    """``#define`` values for reading the current task's sigaltstack range in BPF (cached as
    :func:`sampler_offsets` are, under an identity of its own)."""
    return dict(_cached_sas_offsets(os.fspath(cache_dir) if cache_dir is not None else None))


@lru_cache(maxsize=4)
def _cached_offsets(cache_dir: str | None) -> tuple[tuple[str, int], ...]:
    return tuple(offsets_via_cache(_read_vmlinux(), cache_dir, SAMPLER_NAMES, SAMPLER_FIELDS,
                                   "-sampler").items())


@lru_cache(maxsize=4)
def _cached_sas_offsets(cache_dir: str | None) -> tuple[tuple[str, int], ...]:
    return tuple(offsets_via_cache(_read_vmlinux(), cache_dir, SIGALTSTACK_NAMES, SIGALTSTACK_FIELDS,
                                   "-sas").items())


def offsets_via_cache(data: bytes, cache_dir: str | os.PathLike[str] | None,
                      names: tuple[str, ...] = EXE_INODE_NAMES,
                      members: tuple[tuple[str, str], ...] = EXE_INODE_CHAIN,
                      tag: str = "") -> dict[str, int]:
    """The offsets of ``members`` (as ``names``) in BTF blob ``data``: cached under its identity
    (plus ``tag``: each set of members has an entry of its own), else parsed and stored."""
    from ccprofd.kbpf.objcache import prebuilt_dir
    from ccprofd.persist.cache import AnalysisCache

    cache = AnalysisCache(Path(cache_dir) if cache_dir is not None else None)
    ident = btf_identity(data) + tag

    def valid(got: Any) -> bool:
        return isinstance(got, dict) and got.get("identity") == ident \
            and isinstance(got.get("offsets"), dict) and set(got["offsets"]) == set(names) \
            and all(isinstance(v, int) and 0 <= v < 1 << 20 for v in got["offsets"].values())

    got = cache.load(CACHE_KIND, ident)
    if not valid(got):
        pre = prebuilt_dir()  # kept there beside the objects set-up compiled (they need this text)
        got = AnalysisCache(pre).load(CACHE_KIND, ident) if pre is not None and pre.is_dir() else None
        if valid(got):
            cache.store(CACHE_KIND, ident, got)
    if valid(got):
        assert got is not None
        return {n: int(got["offsets"][n]) for n in names}
    offsets = _offsets(KernelBTF(data), names, members)
    cache.store(CACHE_KIND, ident, {"identity": ident, "offsets": offsets})
    return offsets
