"""Every ctypes layout we hand to the kernel (:mod:`ccprofd.kbpf.abi`) against the running kernel's
own description of it: ``bpftool btf dump file /sys/kernel/btf/vmlinux format raw`` is the oracle
(independent of :mod:`ccprofd.kbpf.btf`).  Each field's bit offset and size must equal the kernel
member of the same name -- in the one member of ``union bpf_attr`` that has all our fields, or in
the named struct -- with anonymous structs/unions searched as the C compiler does, nested structs
compared member by member, and the bits of flag words compared with the kernel's bit-fields."""

from __future__ import annotations

import ctypes
import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import require_tool, skip_or_fail

from ccprofd.kbpf import abi

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")
REPO = Path(__file__).resolve().parent.parent
_TYPE = re.compile(r"^\[(\d+)\] (\w+) '([^']*)'(.*)$")
_MEMBER = re.compile(r"^\t'([^']*)' type_id=(\d+) bits_offset=(\d+)(?: bitfield_size=(\d+))?$")
_MODIFIERS = {"TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG"}


@dataclass
class KType:
    kind: str
    name: str
    attrs: dict[str, int]
    members: list[tuple[str, int, int, int | None]]  # (name, type id, bit offset, bit-field size)


@dataclass(frozen=True)
class KField:
    bit_offset: int
    bits: int
    type_id: int
    bitfield: bool


class KernelTypes:
    """The parsed raw dump: types by id, sizes, and member lookup through anonymous members."""

    def __init__(self, dump: str) -> None:
        self.types: dict[int, KType] = {}
        cur: KType | None = None
        for line in dump.splitlines():
            if m := _TYPE.match(line):
                attrs = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(4))}
                cur = self.types[int(m.group(1))] = KType(m.group(2), m.group(3), attrs, [])
            elif (mm := _MEMBER.match(line)) and cur is not None and cur.kind in ("STRUCT", "UNION"):
                bits = int(mm.group(4)) if mm.group(4) else None
                cur.members.append((mm.group(1), int(mm.group(2)), int(mm.group(3)), bits))

    def resolve(self, tid: int) -> KType:
        t = self.types[tid]
        while t.kind in _MODIFIERS:
            t = self.types[t.attrs["type_id"]]
        return t

    def size(self, tid: int) -> int:
        t = self.types[tid]
        if t.kind in _MODIFIERS:
            return self.size(t.attrs["type_id"])
        if t.kind == "PTR":
            return 8
        if t.kind == "ARRAY":
            return self.size(t.attrs["type_id"]) * t.attrs["nr_elems"]
        return t.attrs["size"]

    def named(self, kind: str, name: str) -> KType:
        hits = [t for t in self.types.values() if t.kind == kind and t.name == name]
        assert hits, f"kernel BTF has no {kind.lower()} {name}"
        return hits[0]

    def fields(self, t: KType) -> dict[str, KField]:
        """Named members of ``t`` (anonymous members' members included)."""
        out: dict[str, KField] = {}
        for name, tid, off, bits in t.members:
            if name == "(anon)":
                for sub, f in self.fields(self.resolve(tid)).items():
                    out[sub] = KField(off + f.bit_offset, f.bits, f.type_id, f.bitfield)
            else:
                size = bits if bits is not None else 8 * self.size(tid)
                out[name] = KField(off, size, tid, bits is not None)
        return out


@lru_cache(maxsize=1)
def _kernel_dump() -> str:
    return subprocess.run([require_tool("bpftool"), "btf", "dump", "file", str(VMLINUX_BTF), "format", "raw"],
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def kernel() -> KernelTypes:
    if not VMLINUX_BTF.exists():
        skip_or_fail("no kernel BTF (/sys/kernel/btf/vmlinux)")
    return KernelTypes(_kernel_dump())


CType = type[ctypes.Structure] | type[ctypes.Union]


def _our_names(cls: CType) -> set[str]:
    """Kernel member names ``cls`` claims: its fields, those of its anonymous unions, flag bits."""
    names: set[str] = set()
    for name, ctype, *_ in cls._fields_:
        if name in getattr(cls, "_anonymous_", ()):
            names |= _our_names(ctype)
        elif name in getattr(cls, "_bitfields_", {}):
            names |= set(cls._bitfields_[name])
        elif not name.startswith("_"):
            names.add(name)
    return names


def mismatches(kt: KernelTypes, cls: CType, kfields: dict[str, KField], base: int = 0) -> list[str]:
    """Where ``cls`` (at bit ``base`` of the scope ``kfields`` describes) differs from the kernel."""
    out: list[str] = []
    for name, ctype, *bitfield in cls._fields_:
        cf = getattr(cls, name)
        if bitfield:  # ctypes packs (bit size << 16) | bit offset into .size
            at, bits = base + 8 * cf.offset + (cf.size & 0xFFFF), cf.size >> 16
        else:
            at, bits = base + 8 * cf.offset, 8 * ctypes.sizeof(ctype)
        where = f"{cls.__name__}.{name}"
        if name in getattr(cls, "_anonymous_", ()):
            out += mismatches(kt, ctype, kfields, at)
            continue
        if name in getattr(cls, "_bitfields_", {}):
            for flag, bit in cls._bitfields_[name].items():
                kf = kfields.get(flag)
                if kf is None or not kf.bitfield or (kf.bit_offset, kf.bits) != (at + bit, 1):
                    out.append(f"{where} bit {bit} ({flag}): kernel has {kf}")
            whole = [n for n, f in kfields.items()
                     if f.bit_offset < at + bits and f.bit_offset + f.bits > at and not f.bitfield]
            if whole:
                out.append(f"{where}: the flag word overlaps kernel non-bit-field member(s) {whole}")
            continue
        if name.startswith("_"):
            continue  # padding / reserved: never set
        kf = kfields.get(name)
        nested = issubclass(ctype, ctypes.Structure | ctypes.Union)
        if kf is None:
            out.append(f"{where}: the kernel has no such member")
        elif nested and (kf.bit_offset != at or bits > kf.bits):
            # a nested struct, like the outer one, may stop before the kernel's does
            out.append(f"{where}: ours at bit {at}, {bits} bits; kernel {kf}")
        elif nested:
            out += mismatches(kt, ctype, kt.fields(kt.resolve(kf.type_id)))
        elif (kf.bit_offset, kf.bits, kf.bitfield) != (at, bits, bool(bitfield)):
            out.append(f"{where}: ours at bit {at}, {bits} bits{' (bit-field)' * bool(bitfield)}; "
                       f"kernel {kf}")
    return out


def kernel_scopes(kt: KernelTypes, cls: CType, where: str) -> list[tuple[str, int]]:
    """(description, type id) of what ``cls`` mirrors in kernel type ``where``: for ``union
    bpf_attr``, its one member that has every field of ``cls``."""
    kind, name = where.split()
    t = kt.named(kind.upper(), name)
    tid = next(i for i, x in kt.types.items() if x is t)
    if where != "union bpf_attr":
        return [(where, tid)]
    want = _our_names(cls)
    hits = [(f"bpf_attr.{m}", mtid) for m, mtid, _, _ in t.members
            if want <= set(kt.fields(kt.resolve(mtid)))]
    assert len(hits) == 1, f"{cls.__name__}: {len(hits)} bpf_attr members have {sorted(want)}: {hits}"
    return hits


def check(kt: KernelTypes, cls: CType, where: str) -> list[str]:
    out = []
    for desc, tid in kernel_scopes(kt, cls, where):
        errs = mismatches(kt, cls, kt.fields(kt.resolve(tid)))
        if ctypes.sizeof(cls) > kt.size(tid):
            errs.append(f"{cls.__name__} is {ctypes.sizeof(cls)} bytes, {desc} only {kt.size(tid)}")
        out += [f"{e} (vs {desc})" for e in errs]
    return out


@pytest.mark.parametrize("cls", list(abi.KERNEL_LAYOUTS), ids=lambda c: c.__name__)
def test_layout_matches_running_kernel_btf(kernel: KernelTypes, cls: CType) -> None:
    assert _our_names(cls), "a layout with no field to check"
    errs = [e for where in abi.KERNEL_LAYOUTS[cls] for e in check(kernel, cls, where)]
    assert errs == [], "\n".join(errs)


def test_the_check_catches_a_wrong_offset_size_or_flag_bit(kernel: KernelTypes) -> None:
    """The comparison itself can fail: layouts that are wrong in one place each are reported."""

    class ShiftedInfo(ctypes.Structure):  # info one word too late
        _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("_x", ctypes.c_uint64),
                    ("info", ctypes.c_uint64)]

    class NarrowInfo(ctypes.Structure):  # info_len as u16
        _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint16), ("_x", ctypes.c_uint16),
                    ("info", ctypes.c_uint64)]

    class NestedWrong(ctypes.Structure):  # uprobe_multi.pid where flags is
        _fields_ = [("path", ctypes.c_uint64), ("offsets", ctypes.c_uint64),
                    ("ref_ctr_offsets", ctypes.c_uint64), ("cookies", ctypes.c_uint64),
                    ("cnt", ctypes.c_uint32), ("pid", ctypes.c_uint32)]

    class LinkWrong(ctypes.Structure):
        _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32),
                    ("attach_type", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                    ("uprobe_multi", NestedWrong)]

    class GplWrong(ctypes.Structure):  # the bit-field one bit off
        _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
                    ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
                    ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
                    ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32),
                    ("nr_map_ids", ctypes.c_uint32), ("map_ids", ctypes.c_uint64),
                    ("name", ctypes.c_char * 16), ("ifindex", ctypes.c_uint32), ("_b", ctypes.c_uint32, 1),
                    ("gpl_compatible", ctypes.c_uint32, 1)]

    class PerfWrongBit(ctypes.Structure):
        _bitfields_: ClassVar[dict[str, dict[str, int]]] = {"flags": {"disabled": 0, "freq": 9}}
        _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                    ("sample_freq", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                    ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64)]

    assert check(kernel, ShiftedInfo, "union bpf_attr")
    assert check(kernel, NarrowInfo, "union bpf_attr")
    assert any("NestedWrong.pid" in e for e in check(kernel, LinkWrong, "union bpf_attr"))
    assert any("gpl_compatible" in e for e in check(kernel, GplWrong, "struct bpf_prog_info"))
    assert any("freq" in e for e in check(kernel, PerfWrongBit, "struct perf_event_attr"))


def test_every_abi_struct_is_checked() -> None:
    """A struct added to abi.py without an entry in KERNEL_LAYOUTS (or a nesting one) would go
    unchecked."""
    covered: set[type] = set()

    def walk(cls: type) -> None:
        covered.add(cls)
        for _name, ctype, *_ in cls._fields_:  # type: ignore[attr-defined]
            if isinstance(ctype, type) and issubclass(ctype, ctypes.Structure | ctypes.Union):
                walk(ctype)

    for cls in abi.KERNEL_LAYOUTS:
        walk(cls)
    defined = {v for v in vars(abi).values()
               if isinstance(v, type) and issubclass(v, ctypes.Structure | ctypes.Union)
               and v.__module__ == abi.__name__}
    assert defined - covered == set()


def test_kernel_structs_are_defined_only_in_abi() -> None:
    """bpf(2)/perf_event_open(2) layouts live in kbpf/abi.py alone (the other ctypes struct in the
    package are ptrace's ``user_regs_struct`` and capstone's ``cs_insn`` in elf/x86dis.py, neither a
    bpf nor a perf one)."""
    elsewhere = []
    for path in sorted((REPO / "ccprofd").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel in ("ccprofd/kbpf/abi.py", "ccprofd/proc/threadsnap.py", "ccprofd/elf/x86dis.py"):
            continue
        if re.search(r"^\s*class \w+\(\s*ctypes\.(Structure|Union)\s*\)", path.read_text(), re.MULTILINE):
            elsewhere.append(rel)
    assert elsewhere == []
