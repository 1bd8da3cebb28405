"""The kernel ABI ccprofd speaks directly, in one place: the ``bpf(2)`` command numbers, the
members of ``union bpf_attr`` it passes, the heads of the ``bpf_*_info`` structs it reads back, and
``struct perf_event_attr``.

The layouts are those of the UAPI headers (``include/uapi/linux/bpf.h``,
``include/uapi/linux/perf_event.h``) on x86-64.  Each struct may stop before the kernel's does (the
kernel treats missing trailing bytes as zero); fields named ``_...`` are padding or reserved words we
never set.  :data:`KERNEL_LAYOUTS` names the kernel type each struct mirrors, and
``tests/test_kbpf_abi.py`` compares every field's offset and size (and the bit positions of the flag
words) with the running kernel's BTF, so a wrong layout fails a test instead of passing garbage to
the kernel.  Nothing here issues a syscall: :mod:`ccprofd.kbpf.rawbpf` and
:mod:`ccprofd.kbpf.attach` do.
"""

from __future__ import annotations

import ctypes
from typing import ClassVar

# enum bpf_cmd
BPF_MAP_CREATE = 0
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_PROG_LOAD = 5
BPF_MAP_GET_NEXT_ID = 12
BPF_MAP_GET_FD_BY_ID = 14
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_BTF_LOAD = 18
BPF_MAP_LOOKUP_AND_DELETE_ELEM = 21
BPF_MAP_LOOKUP_BATCH = 24
BPF_MAP_UPDATE_BATCH = 26
BPF_LINK_CREATE = 28

_u8, _u16, _u32, _u64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64
_s32 = ctypes.c_int32


class MapCreateAttr(ctypes.Structure):
    """BPF_MAP_CREATE, up to ``btf_vmlinux_value_type_id``."""

    _fields_ = [
        ("map_type", _u32),
        ("key_size", _u32),
        ("value_size", _u32),
        ("max_entries", _u32),
        ("map_flags", _u32),
        ("inner_map_fd", _u32),
        ("numa_node", _u32),
        ("map_name", ctypes.c_char * 16),
        ("map_ifindex", _u32),
        ("btf_fd", _u32),
        ("btf_key_type_id", _u32),
        ("btf_value_type_id", _u32),
        ("btf_vmlinux_value_type_id", _u32),
    ]


class _ValueOrNextKey(ctypes.Union):
    _fields_ = [("value", _u64), ("next_key", _u64)]


class MapElemAttr(ctypes.Structure):
    """BPF_MAP_{LOOKUP,UPDATE,DELETE}_ELEM and BPF_MAP_GET_NEXT_KEY (``value`` and ``next_key``
    share one word, as in the kernel's anonymous union)."""

    _anonymous_ = ("_value_or_next_key",)
    _fields_ = [
        ("map_fd", _u32),
        ("_pad", _u32),
        ("key", _u64),
        ("_value_or_next_key", _ValueOrNextKey),
        ("flags", _u64),
    ]


class MapBatchAttr(ctypes.Structure):
    """BPF_MAP_*_BATCH (the ``batch`` member)."""

    _fields_ = [
        ("in_batch", _u64),
        ("out_batch", _u64),
        ("keys", _u64),
        ("values", _u64),
        ("count", _u32),
        ("map_fd", _u32),
        ("elem_flags", _u64),
        ("flags", _u64),
    ]


class ProgLoadAttr(ctypes.Structure):
    """BPF_PROG_LOAD, up to ``func_info_cnt``."""

    _fields_ = [
        ("prog_type", _u32),
        ("insn_cnt", _u32),
        ("insns", _u64),
        ("license", _u64),
        ("log_level", _u32),
        ("log_size", _u32),
        ("log_buf", _u64),
        ("kern_version", _u32),
        ("prog_flags", _u32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", _u32),
        ("expected_attach_type", _u32),
        ("prog_btf_fd", _u32),
        ("func_info_rec_size", _u32),
        ("func_info", _u64),
        ("func_info_cnt", _u32),
        ("_pad", _u32),
    ]


class InfoByFdAttr(ctypes.Structure):
    """BPF_OBJ_GET_INFO_BY_FD (the ``info`` member)."""

    _fields_ = [("bpf_fd", _u32), ("info_len", _u32), ("info", _u64)]


class GetIdAttr(ctypes.Structure):
    """BPF_MAP_GET_NEXT_ID and BPF_MAP_GET_FD_BY_ID (``start_id`` shares its word with ``map_id``)."""

    _fields_ = [("start_id", _u32), ("next_id", _u32), ("open_flags", _u32)]


class RawTracepointAttr(ctypes.Structure):
    """BPF_RAW_TRACEPOINT_OPEN (the ``raw_tracepoint`` member)."""

    _fields_ = [("name", _u64), ("prog_fd", _u32), ("_pad", _u32), ("cookie", _u64)]


class BtfLoadAttr(ctypes.Structure):
    """BPF_BTF_LOAD, up to ``btf_log_level``."""

    _fields_ = [
        ("btf", _u64),
        ("btf_log_buf", _u64),
        ("btf_size", _u32),
        ("btf_log_size", _u32),
        ("btf_log_level", _u32),
    ]


class UprobeMultiOpts(ctypes.Structure):
    """``link_create.uprobe_multi``: the sites of a BPF_TRACE_UPROBE_MULTI link."""

    _fields_ = [
        ("path", _u64),  # pointer to the NUL-terminated path
        ("offsets", _u64),  # pointer to u64[cnt] file offsets
        ("ref_ctr_offsets", _u64),  # pointer to u64[cnt], or 0
        ("cookies", _u64),  # pointer to u64[cnt], or 0
        ("cnt", _u32),
        ("flags", _u32),  # BPF_F_UPROBE_MULTI_RETURN
        ("pid", _u32),  # 0: every process
    ]


class LinkCreateAttr(ctypes.Structure):
    """BPF_LINK_CREATE (the ``link_create`` member); ``uprobe_multi`` is the one variant used."""

    _fields_ = [
        ("prog_fd", _u32),
        ("target_fd", _u32),
        ("attach_type", _u32),
        ("flags", _u32),
        ("uprobe_multi", UprobeMultiOpts),
    ]


class InfoHead(ctypes.Structure):
    """The head ``struct bpf_prog_info``, ``bpf_map_info`` and ``bpf_link_info`` share."""

    _fields_ = [("type", _u32), ("id", _u32)]


class LinkInfoHead(ctypes.Structure):
    """The head of ``struct bpf_link_info`` (before its per-link-type union)."""

    _fields_ = [("type", _u32), ("id", _u32), ("prog_id", _u32)]


class MapInfo(ctypes.Structure):
    """``struct bpf_map_info`` up to ``name``."""

    _fields_ = [
        ("type", _u32),
        ("id", _u32),
        ("key_size", _u32),
        ("value_size", _u32),
        ("max_entries", _u32),
        ("map_flags", _u32),
        ("name", ctypes.c_char * 16),
    ]


class ProgInfo(ctypes.Structure):
    """``struct bpf_prog_info`` up to ``attach_btf_id`` (kernels before 5.16 report
    ``verified_insns`` as 0: they do not have it)."""

    _fields_ = [
        ("type", _u32),
        ("id", _u32),
        ("tag", _u8 * 8),
        ("jited_prog_len", _u32),
        ("xlated_prog_len", _u32),
        ("jited_prog_insns", _u64),
        ("xlated_prog_insns", _u64),
        ("load_time", _u64),
        ("created_by_uid", _u32),
        ("nr_map_ids", _u32),
        ("map_ids", _u64),
        ("name", ctypes.c_char * 16),
        ("ifindex", _u32),
        ("gpl_compatible", _u32, 1),
        ("netns_dev", _u64),
        ("netns_ino", _u64),
        ("nr_jited_ksyms", _u32),
        ("nr_jited_func_lens", _u32),
        ("jited_ksyms", _u64),
        ("jited_func_lens", _u64),
        ("btf_id", _u32),
        ("func_info_rec_size", _u32),
        ("func_info", _u64),
        ("nr_func_info", _u32),
        ("nr_line_info", _u32),
        ("line_info", _u64),
        ("jited_line_info", _u64),
        ("nr_jited_line_info", _u32),
        ("line_info_rec_size", _u32),
        ("jited_line_info_rec_size", _u32),
        ("nr_prog_tags", _u32),
        ("prog_tags", _u64),
        ("run_time_ns", _u64),
        ("run_cnt", _u64),
        ("recursion_misses", _u64),
        ("verified_insns", _u32),
        ("attach_btf_obj_id", _u32),
        ("attach_btf_id", _u32),
    ]


# struct perf_event_attr: the bits of the flag word (after read_format) that we set.
PERF_ATTR_FLAG_BITS = {"disabled": 0, "freq": 10}
PERF_ATTR_DISABLED = 1 << PERF_ATTR_FLAG_BITS["disabled"]
PERF_ATTR_FREQ = 1 << PERF_ATTR_FLAG_BITS["freq"]


class PerfEventAttr(ctypes.Structure):
    """``struct perf_event_attr`` (PERF_ATTR_SIZE_VER8).  ``flags`` is the word of 1-bit fields
    (``disabled``, ``inherit``, ...); ``_bitfields_`` says which bits of it we use, by kernel name."""

    _bitfields_: ClassVar[dict[str, dict[str, int]]] = {"flags": PERF_ATTR_FLAG_BITS}
    _fields_ = [
        ("type", _u32),
        ("size", _u32),
        ("config", _u64),
        ("sample_freq", _u64),
        ("sample_type", _u64),
        ("read_format", _u64),
        ("flags", _u64),
        ("wakeup_events", _u32),
        ("bp_type", _u32),
        ("config1", _u64),
        ("config2", _u64),
        ("branch_sample_type", _u64),
        ("sample_regs_user", _u64),
        ("sample_stack_user", _u32),
        ("clockid", _s32),
        ("sample_regs_intr", _u64),
        ("aux_watermark", _u32),
        ("sample_max_stack", _u16),
        ("_reserved2", _u16),
        ("aux_sample_size", _u32),
        ("_reserved3", _u32),
        ("sig_data", _u64),
        ("config3", _u64),
    ]


#: The kernel type each struct mirrors: ``union bpf_attr`` (its one member holding every field of
#: ours) or a named struct (several: a head they all share).
KERNEL_LAYOUTS: dict[type[ctypes.Structure], tuple[str, ...]] = {
    MapCreateAttr: ("union bpf_attr",),
    MapElemAttr: ("union bpf_attr",),
    MapBatchAttr: ("union bpf_attr",),
    ProgLoadAttr: ("union bpf_attr",),
    InfoByFdAttr: ("union bpf_attr",),
    GetIdAttr: ("union bpf_attr",),
    RawTracepointAttr: ("union bpf_attr",),
    BtfLoadAttr: ("union bpf_attr",),
    LinkCreateAttr: ("union bpf_attr",),
    InfoHead: ("struct bpf_prog_info", "struct bpf_map_info", "struct bpf_link_info"),
    LinkInfoHead: ("struct bpf_link_info",),
    MapInfo: ("struct bpf_map_info",),
    ProgInfo: ("struct bpf_prog_info",),
    PerfEventAttr: ("struct perf_event_attr",),
}
