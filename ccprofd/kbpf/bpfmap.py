"""BPF maps through raw ``bpf(2)``: create a map from a :class:`~ccprofd.kbpf.objcache.MapSpec` and
read/write it with ctypes keys and values rebuilt from the compiler's type descriptions.

:class:`RawMap` has the API of the bcc adapter's ``BpfMap`` (what the tracers were written
against): keys and values are ints when the C type is a scalar, else ctypes structures with the C
field names (``key_type`` / ``leaf_type``); per-CPU maps are summed by ``get``.  Queue maps add
:meth:`RawMap.push` / :meth:`RawMap.pop`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Sequence
from errno import ENOENT
from typing import Any

from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.abi import (
    BPF_MAP_DELETE_ELEM,
    BPF_MAP_GET_NEXT_KEY,
    BPF_MAP_LOOKUP_AND_DELETE_ELEM,
    BPF_MAP_LOOKUP_BATCH,
    BPF_MAP_LOOKUP_ELEM,
    BPF_MAP_UPDATE_ELEM,
    MapBatchAttr,
    MapElemAttr,
)
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.objcache import MapSpec

# enum bpf_map_type
MAP_HASH, MAP_ARRAY, MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_HASH = 1, 2, 5, 6, 9
MAP_LRU_PERCPU_HASH = 10
MAP_QUEUE, MAP_STACK, MAP_RINGBUF = 22, 23, 27
_ARRAYS = (MAP_ARRAY, MAP_PERCPU_ARRAY)
_PERCPU = (MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_PERCPU_HASH)

_C_SCALARS: dict[str, Any] = {
    "_Bool": ctypes.c_bool, "char": ctypes.c_char, "signed char": ctypes.c_byte,
    "unsigned char": ctypes.c_ubyte, "short": ctypes.c_short, "unsigned short": ctypes.c_ushort,
    "int": ctypes.c_int, "unsigned int": ctypes.c_uint, "long": ctypes.c_long,
    "unsigned long": ctypes.c_ulong,
    "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float,
    "double": ctypes.c_double, "long double": ctypes.c_longdouble, "__int128": ctypes.c_int64 * 2,
    "unsigned __int128": ctypes.c_uint64 * 2, "wchar_t": ctypes.c_wchar,
}


def ctype_from_desc(desc: Any) -> Any:
    """A ctypes type from bcc's JSON description of a C type: a scalar name, or
    ``[name, [[field, type(, [count] | bits)], ...], "struct"|"struct_packed"|"union"]``."""
    if isinstance(desc, str):
        try:
            return _C_SCALARS[desc]
        except KeyError:
            raise BPFError(f"unknown C type {desc!r} in a map description") from None
    if not isinstance(desc, list) or len(desc) < 2 or not isinstance(desc[1], list):
        raise BPFError(f"bad C type description {desc!r}")
    fields: list[tuple[Any, ...]] = []
    anonymous: list[str] = []
    for f in desc[1]:
        if len(f) == 2:
            fields.append((f[0], ctype_from_desc(f[1])))
        elif len(f) == 3 and isinstance(f[2], list):
            fields.append((f[0], ctype_from_desc(f[1]) * int(f[2][0])))
        elif len(f) == 3 and isinstance(f[2], int):
            fields.append((f[0], ctype_from_desc(f[1]), f[2]))
        elif len(f) == 3 and f[2] in ("struct", "struct_packed", "union"):
            name = f[0] or f"__anon{len(anonymous)}"
            if not f[0]:
                anonymous.append(name)
            fields.append((name, ctype_from_desc(f)))
        else:
            raise BPFError(f"bad C field description {f!r}")
    kind = desc[2] if len(desc) > 2 else "struct"
    base: type = ctypes.Union if kind == "union" else ctypes.Structure
    ns: dict[str, Any] = {"_anonymous_": anonymous, "_fields_": fields}
    if kind == "struct_packed":
        ns["_pack_"] = 1
    return type(str(desc[0]) or "anon", (base,), ns)


@functools.cache
def possible_cpus() -> int:
    """Number of possible CPUs: the stride of per-CPU map values."""
    try:
        with open("/sys/devices/system/cpu/possible", encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return os.cpu_count() or 1
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def create_map(spec: MapSpec) -> int:
    """BPF_MAP_CREATE for ``spec``; returns the fd (caller closes)."""
    try:
        return rawbpf.map_create(spec.map_type, spec.key_size, spec.value_size, spec.max_entries,
                                 flags=spec.flags, name=spec.name)
    except BPFError as exc:
        raise BPFError(f"creating BPF map {spec.name} failed: {exc}") from None


def _copy(ctype: Any, item: Any) -> Any:
    """An element of a ctypes array as an owned value (scalars index as Python values already)."""
    return item if isinstance(item, (int, float, bytes, str)) else ctype.from_buffer_copy(item)


def _addr(obj: Any) -> int:
    return ctypes.addressof(obj) if obj is not None else 0


class MapValues:
    """Key/value conversions and per-CPU summing shared by both map implementations (this module's
    raw maps and bcc_adapter's, which the compile worker and the two-path tests use): ints become
    the map's scalar ctypes, per-CPU values are set per CPU and read summed."""

    name: str
    key_type: Any
    leaf_type: Any

    @property
    def percpu(self) -> bool:
        raise NotImplementedError

    def get_percpu(self, key: Any) -> list[Any]:
        raise NotImplementedError

    def _key(self, key: Any) -> Any:
        return self.key_type(key) if isinstance(key, int) else key

    def _leaf(self, value: Any) -> Any:
        if isinstance(value, int):
            if self.percpu:
                raise BPFError(f"map {self.name}: per-CPU values must be set per CPU")
            return self.leaf_type(value)
        return value

    @staticmethod
    def _out(value: Any) -> Any:
        return value.value if isinstance(value, ctypes._SimpleCData) else value

    def sum_percpu(self, key: Any) -> Any:
        vals = self.get_percpu(key)
        if vals and all(isinstance(v, int) for v in vals):
            return sum(vals)
        return vals


class RawMap(MapValues):
    """One map, owned by its module (which closes the fd)."""

    def __init__(self, spec: MapSpec, fd: int) -> None:
        self.name = spec.name
        self.spec = spec
        self._fd = fd
        self.map_type = spec.map_type
        self.key_type: Any = ctype_from_desc(spec.key_desc) if spec.key_desc is not None else None
        self.leaf_type: Any = ctype_from_desc(spec.leaf_desc) if spec.leaf_desc is not None else None
        self._batch_buffers: tuple[Any, Any] | None = None  # items_batch's key and value arrays
        self._batch_lock = threading.Lock()
        if self.key_type is not None and ctypes.sizeof(self.key_type) != spec.key_size:
            raise BPFError(f"map {self.name}: key type is {ctypes.sizeof(self.key_type)} bytes, "
                           f"the map's keys {spec.key_size}")

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def max_entries(self) -> int:
        return self.spec.max_entries

    @property
    def id(self) -> int:
        """The kernel's id of this map (what ``bpftool map`` shows)."""
        return rawbpf.obj_id(self._fd)

    @property
    def percpu(self) -> bool:
        return self.map_type in _PERCPU

    # ----------------------------------------------------------------------------- conversions
    def _value_buffer(self) -> Any:
        """A buffer for one lookup result: a leaf, or per-CPU an array of 8-byte-aligned leaves."""
        if self.percpu:
            stride = (ctypes.sizeof(self.leaf_type) + 7) // 8 * 8
            return ctypes.create_string_buffer(stride * possible_cpus())
        return self.leaf_type()

    def _elem_or_errno(self, cmd: int, key: Any, value: Any, flags: int = 0) -> int:
        """One element command: its result, or ``-errno`` (a lookup's or walk's ENOENT is no error)."""
        attr = MapElemAttr(map_fd=self._fd, key=_addr(key), value=_addr(value), flags=flags)
        return rawbpf.bpf_or_errno(cmd, attr)

    def _elem(self, cmd: int, key: Any, value: Any, flags: int, what: str) -> None:
        ret = self._elem_or_errno(cmd, key, value, flags)
        if ret < 0:
            raise rawbpf.BPFSyscallError(f"map {self.name}: {what}", -ret)

    def _lookup(self, key: Any) -> Any | None:
        buf = self._value_buffer()
        ret = self._elem_or_errno(BPF_MAP_LOOKUP_ELEM, self._key(key), buf)
        if ret == -ENOENT:
            return None
        if ret < 0:
            raise rawbpf.BPFSyscallError(f"map {self.name}: lookup", -ret)
        return buf

    # ---------------------------------------------------------------------------------- access
    def get(self, key: Any, default: Any = None) -> Any:
        """Value at ``key`` (summed over CPUs for per-CPU maps), or ``default`` when absent."""
        if self.percpu:
            vals = self.get_percpu(key)
            if not vals:
                return default
            return sum(vals) if all(isinstance(v, int) for v in vals) else vals
        buf = self._lookup(key)
        return default if buf is None else self._out(buf)

    def get_percpu(self, key: Any) -> list[Any]:
        """Per-CPU values of a per-CPU map ([] when absent)."""
        buf = self._lookup(key)
        if buf is None:
            return []
        stride = (ctypes.sizeof(self.leaf_type) + 7) // 8 * 8
        out = []
        for cpu in range(possible_cpus()):
            v = self.leaf_type.from_buffer_copy(buf, cpu * stride)
            out.append(self._out(v))
        return out

    def set(self, key: Any, value: Any) -> None:
        """Insert or overwrite.  Raises BPFError when the kernel refuses (e.g. hash map full)."""
        try:
            self._elem(BPF_MAP_UPDATE_ELEM, self._key(key), self._leaf(value), 0, "update")
        except rawbpf.BPFSyscallError as exc:
            raise BPFError(f"map {self.name}: update failed: {os.strerror(exc.errno)}") from None

    def update_many(self, items: Sequence[tuple[Any, Any]]) -> None:
        """Set many entries with one BPF_MAP_UPDATE_BATCH (element by element where the kernel or
        the map type lacks it; :func:`ccprofd.kbpf.rawbpf.map_update_batch` for packed bytes)."""
        if not items:
            return
        n = len(items)
        keys = (self.key_type * n)(*(self._key(k) for k, _ in items))
        vals = (self.leaf_type * n)(*(self._leaf(v) for _, v in items))
        try:
            rawbpf.map_update_batch(self._fd, bytes(keys), bytes(vals), n, f"map {self.name}")
        except rawbpf.BPFSyscallError as exc:
            raise BPFError(f"map {self.name}: update failed: {os.strerror(exc.errno)}") from None

    def delete(self, key: Any) -> bool:
        """Remove ``key``; False when it was absent (array maps: zero the slot)."""
        if self.map_type in _ARRAYS:
            if not 0 <= int(self._out(self._key(key))) < self.max_entries:
                return False
            self._zero(key)
            return True
        try:
            self._elem(BPF_MAP_DELETE_ELEM, self._key(key), None, 0, "delete")
        except rawbpf.BPFSyscallError as exc:
            if exc.errno == 2:
                return False
            raise BPFError(str(exc)) from None
        return True

    def _zero(self, key: Any) -> None:
        if self.percpu:
            stride = (ctypes.sizeof(self.leaf_type) + 7) // 8 * 8
            buf = ctypes.create_string_buffer(stride * possible_cpus())
        else:
            buf = self.leaf_type()
        self._elem(BPF_MAP_UPDATE_ELEM, self._key(key), buf, 0, "clear")

    def clear(self) -> None:
        """Delete all entries (arrays: zero all slots)."""
        if self.map_type in _ARRAYS:
            if not self.percpu:
                zero = self.leaf_type()
                self.update_many([(i, zero) for i in range(self.max_entries)])
            else:
                for i in range(self.max_entries):
                    self._zero(i)
            return
        for k in self.keys():
            self.delete(k)

    def keys(self) -> list[Any]:
        """Every key (BPF_MAP_GET_NEXT_KEY from the start)."""
        out: list[Any] = []
        prev: Any = None
        while True:
            nxt = self.key_type()
            ret = self._elem_or_errno(BPF_MAP_GET_NEXT_KEY, prev, nxt)
            if ret == -ENOENT:
                return out
            if ret < 0:
                raise BPFError(str(rawbpf.BPFSyscallError(f"map {self.name}: next key", -ret)))
            out.append(nxt)
            prev = nxt

    def items(self) -> list[tuple[Any, Any]]:
        """All entries as (key, value); per-CPU values summed."""
        out: list[tuple[Any, Any]] = []
        for k in self.keys():
            v = self.get(k)
            if v is not None:
                out.append((self._out(k), v))
        return out

    def items_batch(self) -> list[tuple[Any, Any]]:
        """All entries of a (non-per-CPU) hash map through BPF_MAP_LOOKUP_BATCH: a few syscalls for
        the whole map instead of two per entry; :meth:`items` where the kernel or map type lacks it."""
        if self.percpu or self.map_type in _ARRAYS:
            return self.items()
        with self._batch_lock:
            return self._items_batch()

    def _items_batch(self) -> list[tuple[Any, Any]]:
        if self._batch_buffers is None:  # kept: the daemon reads its counts map at every poll
            chunk = max(1, min(self.max_entries, 4096))
            self._batch_buffers = ((self.key_type * chunk)(), (self.leaf_type * chunk)())
        keys, vals = self._batch_buffers
        chunk = len(keys)
        in_batch = ctypes.c_uint32(0)  # an opaque bucket cursor, 4 bytes for hash maps
        out_batch = ctypes.c_uint32(0)
        out: list[tuple[Any, Any]] = []
        first = True
        while True:
            attr = MapBatchAttr(in_batch=0 if first else ctypes.addressof(in_batch),
                                out_batch=ctypes.addressof(out_batch), keys=ctypes.addressof(keys),
                                values=ctypes.addressof(vals), count=chunk, map_fd=self._fd)
            done = False
            ret = rawbpf.bpf_or_errno(BPF_MAP_LOOKUP_BATCH, attr)
            if ret < 0:
                if ret != -ENOENT:  # ENOENT: this was the last batch
                    return self.items()
                done = True
            for i in range(attr.count):
                out.append((_copy(self.key_type, keys[i]), _copy(self.leaf_type, vals[i])))
            if done:
                return out
            in_batch.value = out_batch.value
            first = False

    def __len__(self) -> int:
        return len(self.keys())

    def entries(self) -> int:
        """How many entries a hash map holds now (the metric ``ccprofd_bpf_map_entries``): counted
        with BPF_MAP_LOOKUP_BATCH, a few syscalls for the whole map, without converting them
        (``len`` where the kernel or map type lacks it).  Arrays: their fixed size."""
        if self.map_type in _ARRAYS:
            return self.max_entries
        if self.percpu or self.key_type is None or self.leaf_type is None:
            return len(self)
        chunk = max(1, min(self.max_entries, 1024))  # buffers of at most 1024 entries per scrape
        keys = (self.key_type * chunk)()
        vals = (self.leaf_type * chunk)()
        in_batch, out_batch = ctypes.c_uint32(0), ctypes.c_uint32(0)
        total, first = 0, True
        while True:
            attr = MapBatchAttr(in_batch=0 if first else ctypes.addressof(in_batch),
                                out_batch=ctypes.addressof(out_batch), keys=ctypes.addressof(keys),
                                values=ctypes.addressof(vals), count=chunk, map_fd=self._fd)
            try:
                rawbpf.bpf(BPF_MAP_LOOKUP_BATCH, attr, f"map {self.name}: batch lookup")
            except rawbpf.BPFSyscallError as exc:
                if exc.errno != 2:  # ENOENT: this was the last batch
                    return len(self)
                return total + attr.count
            total += attr.count
            in_batch.value = out_batch.value
            first = False

    # ---------------------------------------------------------------------------------- queues
    def push(self, value: Any) -> None:
        """Push onto a queue/stack map (BPF_MAP_UPDATE_ELEM with no key)."""
        try:
            self._elem(BPF_MAP_UPDATE_ELEM, None, self._leaf(value), 0, "push")
        except rawbpf.BPFSyscallError as exc:
            raise BPFError(f"map {self.name}: push failed: {os.strerror(exc.errno)}") from None

    def pop(self) -> Any | None:
        """Pop from a queue/stack map; None when it is empty."""
        buf = self.leaf_type()
        try:
            self._elem(BPF_MAP_LOOKUP_AND_DELETE_ELEM, None, buf, 0, "pop")
        except rawbpf.BPFSyscallError as exc:
            if exc.errno == 2:
                return None
            raise BPFError(f"map {self.name}: pop failed: {os.strerror(exc.errno)}") from None
        return self._out(buf)


__all__ = ["RawMap", "create_map", "ctype_from_desc", "possible_cpus"]
