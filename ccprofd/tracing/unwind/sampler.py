"""Stack unwinding in BPF from CFI tables: the user call stack of tracked processes at each sampled
syscall (and CPU-clock sample), to any depth, without frame pointers.

Layout of the BPF maps (filled from :mod:`ccprofd.elf.cfi` tables):

* ``uw_rules``: array of distinct unwind rules (kind, rbp rule, offsets), shared by all modules;
* ``uw_entries``: one array holding every loaded module's rows, each ``(u32 vaddr, u32 rule)``,
  sorted per module; ``uw_modules[id] = (first row, row count)`` is the module's slice, searched by
  binary search with a bounded loop.  A module's rows are loaded once (keyed by build-id) and shared
  by every process that maps it;
* ``uw_procs[tgid]``: the process's executable mappings ``(start, end, bias, module id)``, sorted,
  from /proc/PID/maps; re-read when a pc falls outside them, after exec-permission mmap/mprotect
  calls (reported by BPF at the process's next syscall), and at exec.  A forked child inherits
  its parent's entry on its first sample.  The vDSO is one of these modules: its ELF image is read
  from the process's memory (it has no file), kept in the cache directory, and its ``.eh_frame``
  table is built and cached like a file's.

The frame loop runs in ``bpf_loop`` (depth = ``max_depth``, default 4,096).  bcc 0.26 cannot
relocate a ``bpf_loop`` callback, so this module loads those two programs itself: it takes bcc's
compiled instructions of the program and of its callback, points the callback's ``ld_imm64`` at the
appended callback (``BPF_PSEUDO_FUNC``) and loads them with BTF FUNC info through raw ``bpf(2)``.

Output: :class:`UnwoundSample` (tgid, tid, syscall number, runtime pcs innermost first, complete
flag and reason).  With ``aggregate=True`` contexts are counted in the kernel under a 128-bit hash
of (pcs, tgid, syscall, completeness); the full pc list is stored once in an arena map and compared
on every hit, so a hash collision is counted and reported, never merged; only new contexts reach
userspace.  :meth:`UnwindSampler.symbolize` maps runtime pcs to (module, build-id, ELF vaddr).

With an ``encoding`` (:class:`ccprofd.tracing.unwind.plan.UnwindEncoding`, built from the analysed
binary's call graph and Valence plan) a second pass encodes each unwound stack in BPF, outermost
analysed frame first, into the plan's ``acycID``/``recID``/segments (the state instrumented mode
would hold), plus the unanalysed frames (module key, vaddr) inside the context; aggregation then
keys on a 128-bit hash of that encoded context and the syscall number, the context itself is the
arena entry compared on every hit, and each new context reaches userspace as an
:class:`EncodedRecord`.  ``emit_hits`` also sends a small record (time, thread, key) per repeated
context, for per-sample output such as ``ccprofd trace``.

Processes started by ccprofd (``track(pid, launched=True)``, before their exec), and processes
that exec a binary followed with :meth:`UnwindSampler.follow_exec` (found by BPF at their exec, see
exec_target.c), are stopped with SIGSTOP by BPF at exec and at each new executable mapping until
:meth:`poll` has loaded their mappings, then continued: their samples are never taken with stale
mappings.  Every stop is recorded in the ``uw_held`` map, and every entry there is released: by
:meth:`poll`, by :meth:`close`, and, should this process die without closing (SIGKILL), by the hold
guard (:mod:`ccprofd.kbpf.holdguard`), a small process that outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import struct
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccprofd.elf import cfi
from ccprofd.elf.addrspace import AddressSpace
from ccprofd.elf.errors import BinaryError
from ccprofd.elf.image import ElfImage
from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.attach import (
    attach_raw_tracepoint_fd,
    online_cpus,
    perf_event_open_cpu_clock,
    perf_event_set_bpf,
)
from ccprofd.kbpf.bpfmap import RawMap
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.objcache import cache_dir_under
from ccprofd.kbpf.rawmodule import load_module
from ccprofd.kbpf.tracefs import tracepoint_field_offset, tracepoint_has_field
from ccprofd.persist.cache import AnalysisCache
from ccprofd.proc.maps import DEFAULT_PROC_ROOT, ModuleMapping, ProcessMaps, module_mappings, start_stack
from ccprofd.proc.vdso import VDSO_PATH, VdsoImages
from ccprofd.tracing.syscall_sampler import (
    NR_SYSCALL_SLOTS,
    SamplerEvent,
    exe_matches,
    sampler_source,
    set_exec_target,
)
from ccprofd.tracing.unwind.plan import UNWIND_ENCODING_VERSION, UnwindEncoding

C_SOURCE = "unwind.c"
DEFAULT_MAX_DEPTH = 4096
NO_MODULE = 0xFFFFFFFF

REASONS = {0: None, 1: "max_depth", 2: "unknown_pc", 3: "no_maps", 4: "no_cfi", 5: "unsupported_cfi",
           6: "rbp_lost", 7: "read_fault", 8: "bad_frame", 9: "no_table", 10: "no_user_regs"}
FLAG_NEW, FLAG_COLLISION, FLAG_UNAGGREGATED = 1, 2, 4
FLAG_HIT = 0x100  # userspace only: a header-only record of a context sent before
EXACT_BIT = 1 << 63
UE_ANALYSED = 0x80000000
UNKNOWN_MODULE_KEY = 0xFFFF
# encoded-context flags (struct ue_rec)
UE_F_ANCHOR, UE_F_SEG_OVF, UE_F_REC_OVF, UE_F_UNAN_OVF, UE_F_INNER_EXACT = 1, 2, 4, 8, 16
UE_ROW_REC = 4
STATS = ("samples", "incomplete", "frames", "fp_frames", "collisions", "arena_full", "counts_full",
         "ringbuf_full", "new_contexts", "procs_inherited")

_EV_SAMPLE, _EV_MAPS, _EV_HIT = 16, 17, 18
_SAMPLE_HDR = struct.Struct("<QIIIiIIIIQQII")  # struct uw_sample up to arg
ARG_LEN = 4096  # UW_ARG_LEN: the path argument's buffer (PATH_MAX)
_BPF_PROG_TYPE_PERF_EVENT = 7
_BPF_PROG_TYPE_RAW_TRACEPOINT = 17
_BPF_CALL = 0x85
_LD_IMM64 = 0x18
_MOV64_IMM = 0xB7


@dataclass(frozen=True, slots=True)
class UnwoundSample:
    """One unwound stack.  ``pcs``: runtime addresses, innermost first (the interrupted pc, then
    return addresses; after a signal frame, the interrupted pc of the frame below it).  ``syscall``
    is None for CPU samples.  ``key``: the 128-bit context hash (aggregated mode)."""

    time_ns: int
    tgid: int
    tid: int
    syscall: int | None
    pcs: tuple[int, ...]
    reason: str | None
    fp_frames: int
    flags: int
    key: tuple[int, int]
    exact: tuple[bool, ...] = ()  # per pc: exact (innermost, interrupted by a signal), not a return address
    encoded: EncodedRecord | None = None
    #: The syscall's path argument (open*, creat, exec*) read at its entry; None when it has none
    #: or it was not readable then (this sample's own, also for a repeated context).
    arg: str | None = None

    @property
    def complete(self) -> bool:
        return self.reason is None

    @property
    def event(self) -> str:
        return "cpu" if self.syscall is None else "syscall"

    @classmethod
    def decode(cls, raw: bytes, layout: RecordLayout | None = None) -> UnwoundSample:
        t, kind, tgid, tid, nr, n, reason, fp, flags, h1, h2, arg_len, _ = _SAMPLE_HDR.unpack_from(raw)
        why = REASONS.get(reason, f"reason_{reason}")
        arg = None
        if 0 < arg_len <= ARG_LEN:
            text = raw[_SAMPLE_HDR.size:_SAMPLE_HDR.size + arg_len].split(b"\0", 1)[0]
            arg = text.decode("utf-8", "surrogateescape")
        if kind == _EV_HIT:
            return cls(t, tgid, tid, None if nr < 0 else nr, (), why, fp, flags | FLAG_HIT, (h1, h2), arg=arg)
        off = _SAMPLE_HDR.size + ARG_LEN
        enc = None
        if layout is not None:
            enc = layout.parse(raw, off)
            off += layout.size
        tagged = struct.unpack_from(f"<{n}Q", raw, off)
        pcs = tuple(p & ~EXACT_BIT for p in tagged)
        exact = tuple(bool(p & EXACT_BIT) for p in tagged)
        return cls(t, tgid, tid, None if nr < 0 else nr, pcs, why, fp, flags, (h1, h2), exact, enc, arg)


@dataclass(frozen=True, slots=True)
class EncodedSegment:
    """One segment of an encoded context (dense node indices; ``caller`` NO_NODE: unknown)."""

    saved: tuple[int, ...]
    rec_height: int
    callee: int
    caller: int
    site: int  # call-site vaddr, -1 OUTSIDE
    ret: int  # the caller frame's return address (vaddr), 0 when its pc was not one


@dataclass(frozen=True, slots=True)
class UnanalysedFrame:
    """A frame outside the analysed binary (or outside its functions) inside the context."""

    after: int  # index of the analysed frame (outermost = 0) it lies below
    module_key: int
    vaddr: int
    exact: bool


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """The context BPF encoded for one stack (struct ue_rec), dense node indices."""

    node: int  # innermost analysed frame, NO_NODE: none
    flags: int
    inner: int  # vaddr of the innermost analysed frame's pc
    nframes: int
    acyc: tuple[int, ...]
    rec: int
    rec_len: int
    segments: tuple[EncodedSegment, ...]
    unanalysed: tuple[UnanalysedFrame, ...]


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """Sizes of struct ue_rec (they follow the compile-time parameters)."""

    acyc_words: int
    max_segs: int
    rec_words: int
    max_unan: int

    @property
    def seg_words(self) -> int:
        return self.acyc_words + 4

    @property
    def hdr_words(self) -> int:
        return 4 + self.acyc_words

    @property
    def total_words(self) -> int:
        return self.hdr_words + self.max_segs * self.seg_words + self.rec_words + 2 * self.max_unan

    @property
    def size(self) -> int:
        return 8 * self.total_words

    def parse(self, raw: bytes, off: int) -> EncodedRecord:
        w = self.acyc_words
        node, flags, rec_len, nsegs, inner, nunan, nframes = struct.unpack_from("<IIIIQII", raw, off)
        acyc = struct.unpack_from(f"<{w}Q", raw, off + 32)
        segs = []
        base = off + 8 * self.hdr_words
        for i in range(min(nsegs, self.max_segs)):
            p = base + 8 * self.seg_words * i
            saved = struct.unpack_from(f"<{w}Q", raw, p)
            rh, callee, caller, _pad, site, ret = struct.unpack_from("<IIIIqQ", raw, p + 8 * w)
            segs.append(EncodedSegment(saved, rh, callee, caller, site, ret))
        rbase = base + 8 * self.seg_words * self.max_segs
        nwords = min((rec_len + 63) // 64, self.rec_words)
        rec = 0
        for i, word in enumerate(struct.unpack_from(f"<{nwords}Q", raw, rbase)):
            rec |= word << (64 * i)
        rec &= (1 << rec_len) - 1
        ubase = rbase + 8 * self.rec_words
        unan = []
        for i in range(min(nunan, self.max_unan)):
            a, v = struct.unpack_from("<QQ", raw, ubase + 16 * i)
            unan.append(UnanalysedFrame(a & 0xFFFFFFFF, (a >> 32) & 0xFFFF, v & ~EXACT_BIT,
                                        bool(v & EXACT_BIT)))
        return EncodedRecord(node, flags, inner, nframes, tuple(acyc), rec, rec_len, tuple(segs), tuple(unan))


@dataclass(frozen=True, slots=True)
class ResolvedPc:
    """A runtime pc as (module path, build-id, ELF virtual address)."""

    module: str
    build_id: str | None
    vaddr: int


@dataclass(slots=True)
class _Module:
    module_id: int  # index in uw_modules, NO_MODULE without a table
    path: str
    build_id: str | None
    addrspace: AddressSpace
    table: cfi.UnwindTable | None
    rows: int = 0
    key: int = UNKNOWN_MODULE_KEY  # module key (unanalysed frames name their module by it)
    analysed: bool = False
    view_path: str = ""  # the path as the process sees it (path is where we opened it)
    readable: str = ""  # where to read the file from here once the process is gone


@dataclass(slots=True)
class _Proc:
    maps: ProcessMaps
    modules: dict[int, _Module] = field(default_factory=dict)  # mapping start -> module


def _log2_ceil(n: int) -> int:
    return max(1, (n - 1).bit_length())


def unwind_source() -> str:
    return Path(__file__).with_name(C_SOURCE).read_text(encoding="utf-8")


def link_loop_callbacks(main: bytes, callbacks: dict[int, bytes]) -> tuple[bytes, list[int]]:
    """``main`` followed by the callbacks, with each ``bpf_loop`` call's callback argument (the
    ``ld_imm64`` into r2 before the call, left unrelocated by bcc) pointed at its callback, chosen
    by the call's loop count (the ``mov r1, imm`` before it): ``callbacks`` maps loop counts to
    callback code.  Returns the instructions and each callback's first instruction index."""
    insns = bytearray(main)
    starts: dict[int, int] = {}
    for nr_loops, code in callbacks.items():
        starts[nr_loops] = len(insns) // 8
        insns += code
    n_main = len(main) // 8
    patched = 0
    for j in range(n_main):
        code, _regs, _off, imm = struct.unpack_from("<BBhi", insns, j * 8)
        if code != _BPF_CALL or imm != rawbpf.BPF_FUNC_LOOP:
            continue
        ld = loops = None
        for k in range(j - 1, max(-1, j - 24), -1):
            kcode, kregs, _, kimm = struct.unpack_from("<BBhi", insns, k * 8)
            if kcode in (_BPF_CALL, 0x95):  # another call or an exit: out of this call's set-up
                break
            if ld is None and kcode == _LD_IMM64 and kregs & 0x0F == 2:
                ld = k
            elif loops is None and kcode == _MOV64_IMM and kregs & 0x0F == 1:
                loops = kimm
        if ld is None or loops is None or loops not in starts:
            raise BPFError(f"cannot link the callback of the bpf_loop call at instruction {j}")
        if struct.unpack_from("<B", insns, ld * 8 + 1)[0] >> 4 not in (0, 4):
            raise BPFError("bpf_loop callback argument is not a function address")
        struct.pack_into("<BBhi", insns, ld * 8, _LD_IMM64, (4 << 4) | 2, 0, starts[loops] - ld - 1)
        patched += 1
    if patched == 0:
        raise BPFError("program makes no bpf_loop call")
    return bytes(insns), list(starts.values())


# ----------------------------------------------------------------------------- map contents
# The C layouts of unwind.c's map entries, packed with struct instead of one ctypes object per entry
# (a 200k-row table took ~1 s that way).  tests/test_warm_start.py checks them byte for byte against
# the ctypes types bcc derives from the C declarations.
RULE_STRUCT = struct.Struct("<BBBxiii")  # struct uw_rule
UE_FUNC_STRUCT = struct.Struct("<IIII")  # struct ue_func
UE_EDGE_KEY_STRUCT = struct.Struct("<QII")  # struct ue_edge_key
PACK_VERSION = 1  # bump when a layout above (or its packing) changes
assert array("I").itemsize == 4 and array("Q").itemsize == 8


def pack_rule(rule: cfi.Rule) -> bytes:
    return RULE_STRUCT.pack(rule.kind, rule.rbp_kind, rule.aux & 0xFF, rule.cfa_off, rule.rbp_off,
                            rule.ra_off)


def pack_entries(starts: Sequence[int], rules: Sequence[int]) -> bytes:
    """``struct uw_entry`` rows (u32 vaddr, u32 rule) of one module."""
    rows = array("I", bytes(8 * len(starts)))
    rows[0::2] = array("I", starts)
    rows[1::2] = array("I", rules)
    return rows.tobytes()


def ue_row_struct(acyc_words: int) -> struct.Struct:
    """``struct ue_row``: mask[W], val[W] (u64), nrec, rec[UE_ROW_REC] (u32), padded to 8 bytes."""
    return struct.Struct(f"<{acyc_words}Q{acyc_words}QI{UE_ROW_REC}I4x")


PackedMaps = dict[str, tuple[bytes, bytes, int]]  # map name -> (keys, values, entries)


def pack_encoding(enc: UnwindEncoding) -> PackedMaps:
    """The ``ue_funcs``/``ue_edges``/``ue_sites`` contents of ``enc`` as packed C arrays."""
    if enc.functions and max(f[1] for f in enc.functions) >= 1 << 32:
        raise BPFError("unwind mode cannot encode a binary with code above 4 GiB")
    nf = len(enc.functions)
    funcs = b"".join(UE_FUNC_STRUCT.pack(lo, hi, node, flags) for lo, hi, node, flags in enc.functions)
    row_s = ue_row_struct(enc.acyc_words)
    pad = [0] * UE_ROW_REC
    keys = bytearray()
    vals = bytearray()
    for (ret, callee), row in enc.edges.items():
        if len(row.rec) > UE_ROW_REC or any(not 0 <= c < 1 << 32 for c in row.rec):
            raise BPFError(f"edge row at return address {ret:#x} does not fit struct ue_row")
        keys += UE_EDGE_KEY_STRUCT.pack(ret, callee, 0)
        vals += row_s.pack(*row.mask[:enc.acyc_words], *row.val[:enc.acyc_words], len(row.rec),
                           *(row.rec + pad)[:UE_ROW_REC])
    site_keys = array("Q", list(enc.callsites.keys()))
    site_vals = array("Q", list(enc.callsites.values()))
    return {"ue_funcs": (array("I", range(nf)).tobytes(), funcs, nf),
            "ue_edges": (bytes(keys), bytes(vals), len(enc.edges)),
            "ue_sites": (site_keys.tobytes(), site_vals.tobytes(), len(site_keys))}


PACKED_CACHE_KIND = "unwind-maps"


def packed_encoding_key(enc: UnwindEncoding) -> str | None:
    """What the packed maps depend on: the encoding's plan (its key covers the binary's identity and
    content and the plan parameters), the encoding and packing format versions, and sizes."""
    if not enc.plan_key or not enc.binary.get("content_hash"):
        return None
    return (f"{enc.plan_key}-{str(enc.binary['content_hash'])[:16]}-f{len(enc.functions)}-e{len(enc.edges)}"
            f"-s{len(enc.callsites)}-w{enc.acyc_words}-u{UNWIND_ENCODING_VERSION}-p{PACK_VERSION}")


def cached_packed_encoding(enc: UnwindEncoding, cache: AnalysisCache) -> PackedMaps:
    """:func:`pack_encoding` from ``cache`` when stored for this encoding, else packed and stored; a
    damaged entry is packed again."""
    key = packed_encoding_key(enc)
    if key is None:
        return pack_encoding(enc)
    got = cache.load(PACKED_CACHE_KIND, key)
    if isinstance(got, dict) and got.get("key") == key and _packed_ok(got.get("maps"), enc):
        return dict(got["maps"])
    packed = pack_encoding(enc)
    cache.store(PACKED_CACHE_KIND, key, {"key": key, "maps": packed})
    return packed


def _packed_ok(maps: Any, enc: UnwindEncoding) -> bool:
    sizes = {"ue_funcs": (4, UE_FUNC_STRUCT.size, len(enc.functions)),
             "ue_edges": (UE_EDGE_KEY_STRUCT.size, ue_row_struct(enc.acyc_words).size, len(enc.edges)),
             "ue_sites": (8, 8, len(enc.callsites))}
    if not isinstance(maps, dict) or set(maps) != set(sizes):
        return False
    for name, (ks, vs, n) in sizes.items():
        entry = maps[name]
        if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], bytes)
                and isinstance(entry[1], bytes) and entry[2] == n and len(entry[0]) == ks * n
                and len(entry[1]) == vs * n):
            return False
    return True


class UnwindSampler:
    """Unwind the user stacks of tracked processes at selected syscalls.

    ``track(pid)`` loads the unwind tables of every module the process maps (cached by build-id)
    and starts sampling it and the children it forks; ``poll()`` returns :class:`UnwoundSample`s.
    """

    def __init__(
        self,
        *,
        syscalls: list[int] | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        aggregate: bool = False,
        max_procs: int = 256,
        max_maps: int = 256,
        max_entries: int = 1 << 20,
        max_modules: int = 1024,
        max_rules: int = 4096,
        max_contexts: int = 1 << 16,
        arena_words: int = 1 << 21,
        ringbuf_pages: int = 2048,
        cache: AnalysisCache | None = None,
        proc_root: str = DEFAULT_PROC_ROOT,
        encoding: UnwindEncoding | None = None,
        max_segments: int = 64,
        max_unanalysed: int = 128,
        emit_hits: bool = False,
        load_early: bool = False,
    ) -> None:
        if max_depth < 1 or max_depth & (max_depth - 1):
            raise BPFError(f"max_depth must be a power of two, not {max_depth}")
        if max_maps < 2 or max_maps & (max_maps - 1):
            raise BPFError(f"max_maps must be a power of two, not {max_maps}")
        self.encoding = encoding
        self.layout: RecordLayout | None = None
        if encoding is not None:
            for name, v in (("max_segments", max_segments), ("max_unanalysed", max_unanalysed)):
                if v < 1 or v & (v - 1):
                    raise BPFError(f"{name} must be a power of two, not {v}")
            rec_words = _pow2_at_least(max_depth * encoding.rec_code_bits // 64 + 2)
            self.layout = RecordLayout(encoding.acyc_words, max_segments, rec_words, max_unanalysed)
        record = _SAMPLE_HDR.size + ARG_LEN + (self.layout.size if self.layout else 0) + max_depth * 8
        if ringbuf_pages * 4096 < 2 * record:
            raise BPFError("ring buffer too small for one sample at max_depth")
        self.max_depth = max_depth
        self.max_maps = max_maps
        self.max_entries = max_entries
        self.max_modules = max_modules
        self.max_rules = max_rules
        self.proc_root = proc_root
        self.cache = cache if cache is not None else AnalysisCache()
        ncpu = os.cpu_count() or 1
        try:
            with open("/sys/devices/system/cpu/possible") as fh:
                ncpu = max(ncpu, _count_cpus(fh.read()))
        except OSError:
            pass
        defines = {
            "MAX_TRACKED": max_procs, "RINGBUF_PAGES": 16, "UW_MAX_DEPTH": max_depth, "UW_MAX_MAPS": max_maps,
            "UW_MAPS_LOG2": _log2_ceil(max_maps), "UW_MAX_PROCS": max_procs, "UW_MAX_ENTRIES": max_entries,
            "UW_ENTRIES_LOG2": _log2_ceil(max_entries), "UW_MAX_MODULES": max_modules,
            "UW_MAX_RULES": max_rules, "UW_NSLOTS": 2 * ncpu, "UW_ARENA_WORDS": arena_words,
            "UW_MAX_CONTEXTS": max_contexts, "UW_RINGBUF_PAGES": ringbuf_pages,
        }
        self._loops = {"unwind": max_depth + 1, "arena": max_depth}
        if encoding is not None and self.layout is not None:
            lay = self.layout
            nfuncs = max(1, len(encoding.functions))
            self._loops = {"unwind": max_depth + 1, "enc": max_depth + 2,
                           "hash": lay.total_words + max_depth + 3, "arena": lay.total_words + max_depth + 4}
            defines.update({
                "UE_ENABLED": 1, "UE_ACYC_WORDS": lay.acyc_words, "UE_REC_BITS": encoding.rec_code_bits,
                "UE_REC_WORDS": lay.rec_words, "UE_MAX_SEGS": lay.max_segs, "UE_MAX_UNAN": lay.max_unan,
                "UE_MAX_FUNCS": nfuncs, "UE_FUNCS_LOG2": _log2_ceil(nfuncs),
                "UE_MAX_EDGES": max(1, len(encoding.edges)), "UE_MAX_SITES": max(1, len(encoding.callsites)),
                "UE_ROW_REC": UE_ROW_REC, "UE_ENC_LOOPS": self._loops["enc"],
                "UE_HASH_LOOPS": self._loops["hash"]})
        defines["UW_ARENA_LOOPS"] = self._loops["arena"]
        text = "".join(f"#define {k} {v}\n" for k, v in defines.items())
        if tracepoint_has_field("sched", "sched_process_exit", "group_dead"):
            text += "#define HAVE_GROUP_DEAD 1\n"
            off = tracepoint_field_offset("sched", "sched_process_exit", "group_dead")
            text += f"#define UW_EXIT_GROUP_DEAD_OFF {off}\n"
        off = tracepoint_field_offset("sched", "sched_process_fork", "child_pid")
        text += f"#define UW_FORK_CHILD_PID_OFF {off}\n"
        bpf_cache = cache_dir_under(self.cache.directory) if cache is not None else None
        self.module = load_module(text + sampler_source(self.cache.directory) + "\n" + unwind_source(),
                                  cache_dir=bpf_cache)
        self._fds: list[int] = []
        self._loading: dict[str, tuple[threading.Thread, list[Any]]] = {}
        self._links: list[int] = []
        self._attached = False
        self._pending: list[UnwoundSample] = []
        self._stale: set[int] = set()
        self._procs: dict[int, _Proc] = {}
        # Mappings replaced by an exec, with the exec's time: samples taken before it (still queued
        # when the exec is seen) resolve against the image they were taken in.
        self._before_exec: dict[int, list[tuple[int, _Proc]]] = {}
        self._modules: dict[tuple[int, int, int, int], _Module] = {}
        self._rule_ids: dict[cfi.Rule, int] = {}
        self._next_entry = 0
        self._next_module = 0
        self.contexts: dict[tuple[int, int], UnwoundSample] = {}
        self._module_keys: dict[int, _Module] = {}
        self._vdso = VdsoImages(self.cache.directory / "vdso")
        self._stopping: set[int] = set()  # launched processes BPF stops until their maps are loaded
        self._exec_targets: dict[int, tuple[int, int]] = {}  # inode number -> (st_dev, st_ino)
        #: Processes BPF started tracking at their exec of a followed binary (confirmed through
        #: /proc/PID/exe), for the caller to register; it empties the list.
        self.new_processes: list[int] = []
        self.exec_mismatches = 0  # inode-number matches that /proc/PID/exe did not confirm
        self.refresh_failures = 0  # mapping re-reads that failed (samples flagged meanwhile)
        self._guard: Any = None
        self._perf_fds: list[int] = []
        self.process_events: list[SamplerEvent] = []
        self._m: dict[str, RawMap] = {name: self.module.map(name) for name in (
            "tracked", "syscall_set", "config", "uw_rules", "uw_entries", "uw_modules", "uw_procs",
            "uw_counts", "uw_config", "uw_stats", "uw_arena_top", "uw_stop", "uw_held", "exec_targets")}
        self.module.open_ring_buffer("uw_events", self._on_record)
        self.module.open_ring_buffer("events", self._on_process_event)
        self._m["uw_config"].set(0, 1 if aggregate else 0)
        self._m["uw_config"].set(2, 1 if emit_hits else 0)
        if load_early:  # the verifier runs while the maps are filled and the modules loaded
            self._start_loading("uw_sys_enter", self._callbacks("sys"), _BPF_PROG_TYPE_RAW_TRACEPOINT)
        if encoding is not None:
            try:
                self._upload_encoding(encoding)
            except BaseException:
                self._join_loads()
                for fd in self._fds:
                    os.close(fd)
                self._fds.clear()
                raise
        self.aggregate = aggregate
        self.set_syscalls(syscalls)

    # ---------------------------------------------------------------------------- configuration
    def set_syscalls(self, syscalls: list[int] | None) -> None:
        """Sample these syscall numbers (None: all)."""
        if syscalls is None:
            self._m["config"].set(0, 1)
            return
        nrs = sorted(set(syscalls))
        bad = [n for n in nrs if not 0 <= n < NR_SYSCALL_SLOTS]
        if bad:
            raise BPFError(f"syscall number out of range: {bad[0]}")
        self._m["config"].set(0, 0)
        self._m["syscall_set"].clear()
        self._m["syscall_set"].update_many([(n, 1) for n in nrs])

    def _load_with_callbacks(self, prog: str, callbacks: dict[int, str], prog_type: int) -> int:
        """Load ``prog`` with its bpf_loop callbacks (loop count -> callback function name); the load
        started by :meth:`_start_loading`, when there is one, is waited for instead."""
        if prog not in self._loading:
            self._start_loading(prog, callbacks, prog_type)
        thread, result = self._loading.pop(prog)
        thread.join()
        kind, value = result[0]
        if kind == "error":
            raise value
        self._fds.append(value)
        return int(value)

    def _join_loads(self) -> None:
        """Wait for loads started but never attached; their fds are closed with the others."""
        for thread, result in self._loading.values():
            thread.join()
            if result and result[0][0] == "ok":
                self._fds.append(result[0][1])
        self._loading.clear()

    def _start_loading(self, prog: str, callbacks: dict[int, str], prog_type: int) -> None:
        """Hand ``prog`` to the kernel verifier in a thread (~1-2 s for the unwinder, which cannot be
        cached): ctypes releases the GIL for the syscall, so the rest of the start-up overlaps it."""
        main = self.module.function_bytes(prog)
        insns, starts = link_loop_callbacks(main, {n: self.module.function_bytes(cb)
                                                   for n, cb in callbacks.items()})
        names = [prog, *callbacks.values()]
        func_info = [(0, 3)] + [(start, 4 + i) for i, start in enumerate(starts)]
        result: list[Any] = []

        def load() -> None:
            try:
                btf = rawbpf.btf_load(rawbpf.int_btf(names))
                try:
                    fd = rawbpf.prog_load(prog_type, insns, name=prog[:15], btf_fd=btf, func_info=func_info)
                finally:
                    os.close(btf)
                result.append(("ok", fd))
            except BaseException as exc:  # re-raised in the thread that waits for the load
                result.append(("error", exc))

        thread = threading.Thread(target=load, name=f"ccprofd-verify-{prog}", daemon=True)
        self._loading[prog] = (thread, result)
        thread.start()

    def attach(self) -> None:
        """Attach process tracking (fork/exec/exit) first, then the syscall unwinder."""
        if self._attached:
            return
        for tp, fn in (("sched:sched_process_fork", "uw_fork"), ("sched:sched_process_fork", "ccprof_fork"),
                       ("sched:sched_process_exec", "uw_exec"), ("sched:sched_process_exec", "ccprof_exec"),
                       ("sched:sched_process_exit", "uw_exit"), ("sched:sched_process_exit", "ccprof_exit")):
            self.module.attach_tracepoint(tp, fn)
        fd = self._load_with_callbacks("uw_sys_enter", self._callbacks("sys"), _BPF_PROG_TYPE_RAW_TRACEPOINT)
        self._links.append(attach_raw_tracepoint_fd(fd, "sys_enter"))
        self._attached = True

    def verified_insns(self) -> dict[str, int]:
        """Instructions the verifier processed for the syscall and CPU-sampling unwinders (loaded,
        not attached; :meth:`close` closes them): how far their loads are from the kernel's limit."""
        out = {}
        for prog, callbacks, prog_type in (
                ("uw_sys_enter", self._callbacks("sys"), _BPF_PROG_TYPE_RAW_TRACEPOINT),
                ("uw_cpu_sample", self._callbacks("cpu"), _BPF_PROG_TYPE_PERF_EVENT)):
            out[prog] = rawbpf.prog_verified_insns(self._load_with_callbacks(prog, callbacks, prog_type))
        return out

    def _callbacks(self, kind: str) -> dict[int, str]:
        """bpf_loop callbacks of the sys/cpu program, by loop count (the CPU sampler does not
        aggregate: no arena loop)."""
        names = {"unwind": f"uw_step_{kind}", "arena": f"uw_arena_{kind}", "enc": f"ue_enc_{kind}",
                 "hash": f"ue_hash_{kind}"}
        return {count: names[loop] for loop, count in self._loops.items() if kind == "sys" or loop != "arena"}

    def attach_cpu_sampling(self, hz: int) -> None:
        """CPU-clock samples of every tracked process (all threads, children included) at ``hz``:
        one software perf event per CPU runs the unwinder, which keeps only tracked processes."""
        if hz <= 0:
            raise BPFError(f"sampling frequency must be positive, not {hz}")
        fd = self._load_with_callbacks("uw_cpu_sample", self._callbacks("cpu"), _BPF_PROG_TYPE_PERF_EVENT)
        for cpu in online_cpus():
            pfd = perf_event_open_cpu_clock(cpu, hz)
            self._perf_fds.append(pfd)
            perf_event_set_bpf(pfd, fd)

    # ------------------------------------------------------------------------------- processes
    def track(self, tgid: int, *, launched: bool = False) -> None:
        """Load ``tgid``'s mappings and tables, then sample it (and the children it forks).

        ``launched``: ``tgid`` is a child of ours that has not exec'd the target yet; tracking
        survives that one exec, and BPF stops the process at it (and at each later executable
        mapping) until :meth:`poll` has loaded the new mappings."""
        if launched:
            self._start_guard()
            self._m["uw_stop"].set(tgid, 1)
            self._stopping.add(tgid)
        else:
            self.refresh_maps(tgid)
        value = self._m["tracked"].leaf_type()
        value.execs_left = 1 if launched else 0
        self._m["tracked"].set(tgid, value)

    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None:
        """Track every process that execs the file ``inode`` = (st_dev, st_ino), from its first
        instruction (only inside cgroup ``cgroup_id`` unless 0).  BPF holds each such process at its
        exec until :meth:`poll` has loaded its mappings; the process is then listed in
        :attr:`new_processes`."""
        self._start_guard()
        set_exec_target(self._m["exec_targets"], inode[1], cgroup_id)
        self._exec_targets[inode[1]] = inode

    def unfollow_exec(self, inode: tuple[int, int]) -> None:
        self._m["exec_targets"].delete(inode[1])
        self._exec_targets.pop(inode[1], None)

    def _start_guard(self) -> None:
        if self._guard is None:
            from ccprofd.kbpf.holdguard import HoldGuard

            self._guard = HoldGuard(self._m["uw_held"].fd)

    def preload(self, path: str) -> bool:
        """Load (and upload) the unwind table of an object a process will map, ahead of time, so
        the stop at its exec or dlopen is short; False when it is not a usable ELF file."""
        return self._addrspace_of(path) is not None

    def forget(self, tgid: int) -> None:
        """Drop the mappings kept for symbolising samples of a process that has exited."""
        self._procs.pop(tgid, None)
        self._before_exec.pop(tgid, None)

    def untrack(self, tgid: int) -> None:
        self._m["tracked"].delete(tgid)
        self._m["uw_procs"].delete(tgid)
        self._procs.pop(tgid, None)
        self._before_exec.pop(tgid, None)

    def refresh_maps(self, tgid: int) -> bool:
        """Re-read /proc/TGID/maps and update the BPF mapping table; False when the process is gone."""
        try:
            maps = module_mappings(tgid, self._addrspace_of, self.proc_root)
        except OSError:
            return False
        maps = self._with_vdso(maps)
        proc = _Proc(maps)
        entry = self._m["uw_procs"].leaf_type()
        mappings = maps.mappings[: self.max_maps]
        for i, mm in enumerate(mappings):
            try:
                mod = self._module_for(mm)
            except BPFError:
                if not os.path.exists(os.path.join(self.proc_root, str(tgid))):
                    return False  # it exited while its maps were read (its /proc paths went with it)
                raise
            proc.modules[mm.start] = mod
            slot = entry.m[i]
            slot.start, slot.end, slot.module = mm.start, mm.end, mod.module_id
            slot.bias = mm.bias & (2**64 - 1)
            slot.info = mod.key | (UE_ANALYSED if mod.analysed else 0)
        entry.n = len(mappings)
        entry.start_stack = start_stack(tgid, self.proc_root)
        self._m["uw_procs"].set(tgid, entry)
        self._procs[tgid] = proc
        return True

    def _with_vdso(self, maps: ProcessMaps) -> ProcessMaps:
        """``maps`` with the process's vDSO as a module (:mod:`ccprofd.proc.vdso`): its table is
        then built, cached by build-id and shared like any other module's."""
        maps = self._vdso.with_vdso(maps, self._addrspace_of, self.proc_root)
        vdso = next((m for m in maps.mappings if m.path == VDSO_PATH), None)
        mod = self._modules.get(self._identity(vdso.open_path) or (0, 0, 0, 0)) if vdso is not None else None
        if mod is not None:
            mod.view_path = VDSO_PATH  # how the process (and /proc/PID/maps) names it
        return maps

    def _identity(self, path: str) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _addrspace_of(self, path: str) -> AddressSpace | None:
        ident = self._identity(path)
        if ident is None:
            return None
        mod = self._modules.get(ident)
        if mod is None:
            mod = self._load_module(path, ident)
        return mod.addrspace if mod is not None else None

    def _module_for(self, mm: ModuleMapping) -> _Module:
        ident = self._identity(mm.open_path)
        mod = self._modules.get(ident) if ident else None
        if mod is None:
            raise BPFError(f"module {mm.path} changed while its mappings were read")
        return mod

    def _load_module(self, path: str, ident: tuple[int, int, int, int]) -> _Module | None:
        try:
            image = ElfImage(path)
        except BinaryError:
            return None
        table: cfi.UnwindTable | None
        try:
            table = cfi.load_table(path, self.cache, image)
        except (ValueError, IndexError, struct.error):
            table = None  # corrupt CFI: unwinding through it is flagged no_table
        mod = _Module(NO_MODULE, image.path, image.build_id(), image.addrspace, table)
        mod.view_path = _process_view(path, self.proc_root)
        # read it later (symbols) from the path the process uses when that is the same file here
        mod.readable = mod.view_path if _same_file(mod.view_path, path) else path
        mod.key = min(len(self._module_keys), UNKNOWN_MODULE_KEY - 1)
        self._module_keys.setdefault(mod.key, mod)
        mod.analysed = self._is_analysed(mod)
        # Modules with the same build-id share one slice of rows.
        for other in self._modules.values():
            if other.build_id and other.build_id == mod.build_id and other.module_id != NO_MODULE \
                    and other.table is not None and table is not None and other.table.starts == table.starts:
                mod.module_id, mod.rows = other.module_id, other.rows
                break
        else:
            if table is not None:
                self._upload_table(mod, table)
        self._modules[ident] = mod
        return mod

    def _is_analysed(self, mod: _Module) -> bool:
        if self.encoding is None:
            return False
        want = self.encoding.binary
        if want.get("build_id") and mod.build_id:
            return bool(want["build_id"] == mod.build_id)
        return os.path.realpath(mod.path) == os.path.realpath(str(want.get("path")))

    def module_of_key(self, key: int) -> tuple[str, str | None, str] | None:
        """(path as the process sees it, build-id, a path to read it from here) of the module an
        unanalysed frame names by its key."""
        mod = self._module_keys.get(key)
        if mod is None:
            return None
        return mod.view_path or mod.path, mod.build_id, mod.readable or mod.path

    def _upload_encoding(self, enc: UnwindEncoding) -> None:
        """The analysed binary's function ranges, edge rows and call sites (unwind_plan.py), packed
        once (cached with the encoding's identity) and written with one batch update per map."""
        for name, (keys, values, count) in cached_packed_encoding(enc, self.cache).items():
            if count:
                rawbpf.map_update_batch(self.module.map(name).fd, keys, values, count, name)
        cfg = self.module.map("ue_config")
        cfg.set(0, len(enc.functions))
        cfg.set(1, enc.root_index)

    def _upload_table(self, mod: _Module, table: cfi.UnwindTable) -> None:
        n = len(table)
        if n == 0 or table.starts[-1] >= 1 << 32:
            return  # nothing to search, or vaddrs beyond 4 GiB: flagged no_table when hit
        if self._next_module >= self.max_modules or self._next_entry + n > self.max_entries:
            return
        local_to_global: list[int] = []
        # Ids are handed out only once the whole table fits: a table that does not fit must not
        # leave ids behind that a later module would reuse without their rules ever uploaded.
        new_ids: dict[cfi.Rule, int] = {}
        for rule in table.rules:
            rid = self._rule_ids.get(rule, new_ids.get(rule))
            if rid is None:
                if len(self._rule_ids) + len(new_ids) >= self.max_rules:
                    return
                rid = new_ids[rule] = len(self._rule_ids) + len(new_ids)
            local_to_global.append(rid)
        new_rules = [(rid, rule) for rule, rid in new_ids.items()]
        if new_rules:
            rawbpf.map_update_batch(self._m["uw_rules"].fd, array("I", [r for r, _ in new_rules]).tobytes(),
                                    b"".join(pack_rule(rule) for _, rule in new_rules), len(new_rules),
                                    "uw_rules")
        self._rule_ids.update(new_ids)
        first = self._next_entry
        rawbpf.map_update_batch(self._m["uw_entries"].fd, array("I", range(first, first + n)).tobytes(),
                                pack_entries(table.starts, [local_to_global[r] for r in table.rule_ids]), n,
                                "uw_entries")
        mv = self._m["uw_modules"].leaf_type()
        mv.first, mv.count = first, n
        self._m["uw_modules"].set(self._next_module, mv)
        mod.module_id, mod.rows = self._next_module, n
        self._next_module += 1
        self._next_entry += n

    # ---------------------------------------------------------------------------------- events
    def _on_record(self, raw: bytes) -> None:
        kind = struct.unpack_from("<I", raw, 8)[0]
        if kind == _EV_MAPS:
            self._stale.add(struct.unpack_from("<I", raw, 12)[0])
            return
        sample = UnwoundSample.decode(raw, self.layout)
        if sample.reason in ("unknown_pc", "no_maps"):
            self._stale.add(sample.tgid)
        if sample.flags & FLAG_NEW:
            self.contexts[sample.key] = sample
        self._pending.append(sample)

    def _on_process_event(self, raw: bytes) -> None:
        ev = SamplerEvent.decode(raw)
        self.process_events.append(ev)
        if ev.exec_target:
            self._exec_found(ev.tgid)
        if ev.kind == "exec":
            old = self._procs.pop(ev.tgid, None)
            if old is not None:
                history = self._before_exec.setdefault(ev.tgid, [])
                history.append((ev.time_ns, old))
                del history[:-4]  # bounded: only samples still queued at an exec need these
            self._stale.add(ev.tgid)
        elif ev.kind == "fork":
            parent = self._procs.get(ev.tgid)
            if parent is not None and ev.aux not in self._procs:
                self._procs[ev.aux] = parent  # until it execs, a child has its parent's mappings

    def _exec_found(self, tgid: int) -> None:
        """BPF matched ``tgid``'s new image by inode number: confirm it is a followed file, else
        stop tracking it (it is released by the next :meth:`_release_held`)."""
        from ccprofd.kbpf.holdguard import is_guard

        ino = self._exe_ino(tgid)
        want = self._exec_targets.get(ino) if ino is not None and not is_guard(tgid) else None
        if want is not None and exe_matches(tgid, want):
            self._stale.add(tgid)
            if tgid not in self.new_processes:
                self.new_processes.append(tgid)
            return
        if ino is not None or os.path.exists(f"/proc/{tgid}"):
            self.exec_mismatches += 1
            with contextlib.suppress(BPFError):
                self._m["tracked"].delete(tgid)
            with contextlib.suppress(BPFError):
                self._m["uw_stop"].delete(tgid)

    @staticmethod
    def _exe_ino(tgid: int) -> int | None:
        try:
            return os.stat(f"/proc/{tgid}/exe").st_ino
        except OSError:
            return None

    def _refresh_or_count(self, tgid: int) -> None:
        """refresh_maps, a failure counted (``refresh_failures``) instead of raised: the process's
        samples are then flagged (no_maps / unknown_pc, which marks it stale again), and one
        process's unreadable mappings neither stop the others' sampling nor a release."""
        try:
            self.refresh_maps(tgid)
        except BPFError:
            self.refresh_failures += 1

    def _release_held(self, done: set[int], *, refresh: bool = True) -> None:
        """Continue every process BPF holds, after loading its mappings if it is tracked (those in
        ``done`` were loaded already in this poll)."""
        held = [int(k) for k, _ in self._m["uw_held"].items()]
        for tgid in held:
            if refresh and tgid not in done and self._m["tracked"].get(tgid) is not None:
                self._refresh_or_count(tgid)  # a failure must not keep it stopped
            with contextlib.suppress(BPFError):
                self._m["uw_held"].delete(tgid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(tgid, signal.SIGCONT)

    def poll(self, timeout_ms: int = 0) -> list[UnwoundSample]:
        """Samples that arrived since the last call (waits up to ``timeout_ms`` when there are none).
        Processes whose mappings changed are re-read here."""
        self.module.ring_buffer_consume()
        if not self._pending and timeout_ms != 0:
            self.module.ring_buffer_poll(timeout_ms)
        for tgid in sorted(self._stale):
            if self._m["tracked"].get(tgid) is not None:
                self._refresh_or_count(tgid)
        # BPF stopped these until their mappings were loaded (launched and exec-found processes):
        # continued only here, each after its entry is gone, so a hold right after is never lost
        self._release_held(self._stale)
        self._stale.clear()
        out, self._pending = self._pending, []
        return out

    def counts(self) -> dict[tuple[int, int], int]:
        """Aggregated mode: samples per context key (see :attr:`contexts` for each key's sample)."""
        return {(int(k.h1), int(k.h2)): int(v.count) for k, v in self._m["uw_counts"].items_batch()}

    def set_emit_hits(self, on: bool) -> None:
        """Runtime switch (``uw_config[UW_CFG_EMIT_HITS]``): send a header record per repeated
        context (every sample reaches userspace) or only new contexts (the kernel's per-context
        counts, read with :meth:`counts`, are then the only record of repeated samples).  The
        kernel count is incremented whether or not the record is sent."""
        self._m["uw_config"].set(2, 1 if on else 0)

    # ---------------------------------------------------------------------------- symbolisation
    def symbolize(self, tgid: int, pc: int) -> ResolvedPc | None:
        """(module, build-id, ELF vaddr) of a runtime pc in the process's current mappings."""
        proc = self._procs.get(tgid)
        if proc is None:
            return None
        mm = proc.maps.find(pc)
        if mm is None:
            return None
        mod = proc.modules.get(mm.start)
        return ResolvedPc(mm.path, mod.build_id if mod else None, mm.vaddr(pc))

    def _proc_at(self, tgid: int, time_ns: int | None) -> _Proc | None:
        """The process's mappings at ``time_ns`` (None: now)."""
        if time_ns is not None:
            for exec_time, before in self._before_exec.get(tgid, ()):
                if time_ns < exec_time:
                    return before
        return self._procs.get(tgid)

    def resolve(self, tgid: int, pc: int, time_ns: int | None = None) -> tuple[int, bool, int] | None:
        """(module key, in the analysed binary, ELF vaddr) of a runtime pc, as BPF saw it at
        ``time_ns`` (the sample's own time; default: the current mappings)."""
        proc = self._proc_at(tgid, time_ns)
        if proc is None:
            return None
        mm = proc.maps.find(pc)
        if mm is None:
            return None
        mod = proc.modules.get(mm.start)
        if mod is None:
            return None
        return mod.key, mod.analysed, mm.vaddr(pc)

    # ------------------------------------------------------------------------------- reporting
    def stats(self) -> dict[str, int]:
        out = {name: int(self._m["uw_stats"].get(i) or 0) for i, name in enumerate(STATS)}
        out["exec_mismatches"], out["refresh_failures"] = self.exec_mismatches, self.refresh_failures
        return out

    def table_rows(self) -> int:
        return self._next_entry

    def map_memory_bytes(self) -> dict[str, int]:
        """Allocated size of the big maps (preallocated arrays/hashes), for the memory report."""
        out: dict[str, int] = {}
        for name in ("uw_entries", "uw_procs", "uw_counts", "uw_rules", "uw_modules"):
            m = self._m[name]
            out[name] = m.max_entries * (ctypes.sizeof(m.leaf_type) + ctypes.sizeof(m.key_type))
        state = self.module.map("uw_state")
        out["uw_state"] = state.max_entries * ctypes.sizeof(state.leaf_type)
        arena = self.module.map("uw_arena")
        out["uw_arena"] = arena.max_entries * 8
        return out

    def close(self) -> None:
        for tgid in self._stopping:
            with contextlib.suppress(ProcessLookupError):
                os.kill(tgid, signal.SIGCONT)  # never leave a launched process stopped
        self._stopping.clear()
        self._join_loads()
        with contextlib.suppress(BPFError):
            self._m["exec_targets"].clear()  # no new holds at exec from here on
        for fd in self._perf_fds + self._links + self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._links.clear()
        self._fds.clear()
        self._perf_fds.clear()
        with contextlib.suppress(BPFError):
            self._release_held(set(), refresh=False)
        self.module.cleanup()
        self._vdso.close()
        if self._guard is not None:
            self._guard.close()  # its last sweep runs with every program detached
            self._guard = None

    def __enter__(self) -> UnwindSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _count_cpus(text: str) -> int:
    """Number of CPUs in a kernel cpu list such as ``0-3,8``."""
    n = 0
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def _process_view(open_path: str, proc_root: str) -> str:
    """``/proc/PID/root/usr/lib/x.so`` -> ``/usr/lib/x.so`` (how the process names its file)."""
    prefix = proc_root.rstrip("/") + "/"
    if open_path.startswith(prefix):
        rest = open_path[len(prefix):]
        pid, sep, tail = rest.partition("/root/")
        if sep and pid.isdigit():
            return "/" + tail
    return open_path


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
