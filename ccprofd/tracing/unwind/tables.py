"""The unwind tables in the BPF maps: every mapped object's CFI rows and rules, module keys, and the
analysed binary's packed encoding.

The C layouts of unwind.c's map entries are packed with :mod:`struct` instead of one ctypes object
per entry (a 200k-row table took ~1 s that way); tests/test_warm_start.py checks them byte for byte
against the ctypes types bcc derives from the C declarations.
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ccprofd.elf import cfi
from ccprofd.elf.addrspace import AddressSpace, Segment
from ccprofd.elf.errors import BinaryError
from ccprofd.elf.image import ElfImage
from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.rawmodule import RawModule
from ccprofd.persist.cache import AnalysisCache, file_identity
from ccprofd.proc.maps import ModuleMapping, ProcessMaps
from ccprofd.proc.vdso import VDSO_PATH, VdsoImages
from ccprofd.tracing.unwind.plan import UNWIND_ENCODING_VERSION, UnwindEncoding

NO_MODULE = 0xFFFFFFFF
UNKNOWN_MODULE_KEY = 0xFFFF
UE_ROW_REC = 4

RULE_STRUCT = struct.Struct("<BBBBiii")  # struct uw_rule (aux's high byte in aux_hi)
UE_FUNC_STRUCT = struct.Struct("<IIII")  # struct ue_func
UE_EDGE_KEY_STRUCT = struct.Struct("<QII")  # struct ue_edge_key
PACK_VERSION = 1  # bump when a layout above (or its packing) changes
FACTS_KIND = "object-facts"  # ObjectFacts by file identity


@dataclass(frozen=True)
class ObjectFacts:
    """What the unwinder needs of a mapped object besides its table: kept by file identity so
    that a cached start-up parses no ELF header of libc or ld.so."""

    path: str
    build_id: str | None
    content_hash: str
    segments: list[tuple[int, int, int, int, int]]  # PT_LOAD (vaddr, memsz, offset, filesz, flags)

    def to_plain(self) -> dict[str, Any]:
        return {"path": self.path, "build_id": self.build_id, "hash": self.content_hash,
                "segments": [list(s) for s in self.segments]}

    @staticmethod
    def from_plain(d: Any) -> ObjectFacts | None:
        try:
            segs = [(int(a), int(b), int(c), int(e), int(f)) for a, b, c, e, f in d["segments"]]
            bid = d["build_id"]
            return ObjectFacts(str(d["path"]), None if bid is None else str(bid), str(d["hash"]), segs)
        except (TypeError, KeyError, ValueError):
            return None
assert array("I").itemsize == 4 and array("Q").itemsize == 8


def pack_rule(rule: cfi.Rule) -> bytes:
    return RULE_STRUCT.pack(rule.kind, rule.rbp_kind, rule.aux & 0xFF, (rule.aux >> 8) & 0xFF, rule.cfa_off,
                            rule.rbp_off, rule.ra_off)


def pack_entries(starts: Sequence[int], rules: Sequence[int]) -> bytes:
    """``struct uw_entry`` rows (u32 vaddr, u32 rule) of one module."""
    rows = array("I", bytes(8 * len(starts)))
    rows[0::2] = array("I", starts)
    rows[1::2] = array("I", rules)
    return rows.tobytes()


#: smallest bucket of the page index (16 bytes: about one instruction group)
MIN_PAGE_SHIFT = 4


def page_index(starts: Sequence[int]) -> tuple[int, int, array]:
    """The two-level index of one module's sorted row starts: ``(base, shift, bounds)`` where
    bucket ``b`` covers ELF vaddrs ``[base + (b << shift), base + ((b + 1) << shift))`` and
    ``bounds[b]`` is the number of rows starting at or before the bucket's first vaddr.  The row
    of a vaddr ``v`` in bucket ``b`` is then the last row of ``bounds[b] <= count <= bounds[b + 1]``
    (so BPF's binary search runs over a few rows, not the whole table: issue #18).  ``shift`` is
    the smallest power of two of at least the module's mean row length, so the buckets (plus one
    closing bound) never outnumber the rows by more than two."""
    n = len(starts)
    if n == 0:
        return 0, MIN_PAGE_SHIFT, array("I")
    span = starts[-1] - starts[0]
    shift = MIN_PAGE_SHIFT
    while (span >> shift) >= n:
        shift += 1
    base = starts[0] & ~((1 << shift) - 1)
    nbuckets = ((starts[-1] - base) >> shift) + 1
    bounds = array("I", bytes(4 * (nbuckets + 1)))
    i = 0
    for b in range(nbuckets + 1):
        edge = base + (b << shift)
        while i < n and starts[i] <= edge:
            i += 1
        bounds[b] = i
    return base, shift, bounds


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


@dataclass(slots=True)
class LoadedModule:
    """One ELF object whose unwind table is (or could not be) uploaded."""

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


def object_facts(path: str, cache: AnalysisCache) -> tuple[ObjectFacts | None, cfi.UnwindTable | None]:
    """(facts, table) of the object at ``path`` (None, None: not a usable ELF; a None table:
    its CFI cannot be read): from the cache by file identity when both its facts and its table
    are there (no byte of the object read: libc and ld.so at every start-up), else from one
    parse (and then cached)."""
    ident = file_identity(path)
    key = f"{ident}-{hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]}"
    if ident is not None:
        facts = ObjectFacts.from_plain(cache.load(FACTS_KIND, key))
        if facts is not None and facts.path == os.path.abspath(path):
            table = cfi.cached_table(facts.content_hash, facts.path, cache)
            if table is not None:
                return facts, table
    try:
        image = ElfImage(path)
    except BinaryError:
        return None, None
    segs = [(s.vaddr, s.memsz, s.offset, s.filesz, s.flags) for s in image.addrspace.segments]
    facts = ObjectFacts(image.path, image.build_id(), image.content_hash, segs)
    try:
        table = cfi.load_table(path, cache, image)
    except BinaryError:
        return facts, None  # corrupt CFI: unwinding through it is flagged no_table
    if ident is not None and file_identity(path) == ident:
        cache.store(FACTS_KIND, key, facts.to_plain())
    return facts, table


class ModuleTables:
    """The unwind tables of every object the tracked processes map, in the BPF maps: each file's
    CFI rows (cached by build-id, shared between files with the same build-id and rows), the rule
    table they index, module keys for unanalysed frames, and the analysed binary's encoding."""

    def __init__(self, module: RawModule, cache: AnalysisCache, *, proc_root: str,
                 encoding: UnwindEncoding | None, max_modules: int, max_entries: int, max_rules: int) -> None:
        self.module = module
        self.cache = cache
        self.proc_root = proc_root
        self.encoding = encoding
        self.max_modules = max_modules
        self.max_entries = max_entries
        self.max_rules = max_rules
        self.modules: dict[tuple[int, int, int, int], LoadedModule] = {}
        self.rule_ids: dict[cfi.Rule, int] = {}
        self.next_entry = 0
        self.next_module = 0
        self.module_keys: dict[int, LoadedModule] = {}
        self.vdso = VdsoImages(cache.directory / "vdso")
        self._rules, self._entries, self._modules, self._pages = (
            module.map(n) for n in ("uw_rules", "uw_entries", "uw_modules", "uw_pages"))
        self.max_pages = max_entries + max_modules  # page_index: at most rows + 1 buckets per module
        self.next_page = 0

    @staticmethod
    def identity(path: str) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def addrspace_of(self, path: str) -> AddressSpace | None:
        """The address space of the object at ``path``, its table loaded and uploaded on first use
        (None: not a usable ELF file)."""
        ident = self.identity(path)
        if ident is None:
            return None
        mod = self.modules.get(ident)
        if mod is None:
            mod = self._load(path, ident)
        return mod.addrspace if mod is not None else None

    def module_for(self, mm: ModuleMapping) -> LoadedModule:
        ident = self.identity(mm.open_path)
        mod = self.modules.get(ident) if ident else None
        if mod is None:
            raise BPFError(f"module {mm.path} changed while its mappings were read")
        return mod

    def with_vdso(self, maps: ProcessMaps) -> ProcessMaps:
        """``maps`` with the process's vDSO as a module (:mod:`ccprofd.proc.vdso`): its table is
        then built, cached by build-id and shared like any other module's."""
        maps = self.vdso.with_vdso(maps, self.addrspace_of, self.proc_root)
        vdso = next((m for m in maps.mappings if m.path == VDSO_PATH), None)
        mod = self.modules.get(self.identity(vdso.open_path) or (0, 0, 0, 0)) if vdso is not None else None
        if mod is not None:
            mod.view_path = VDSO_PATH  # how the process (and /proc/PID/maps) names it
        return maps

    def _load(self, path: str, ident: tuple[int, int, int, int]) -> LoadedModule | None:
        facts, table = object_facts(path, self.cache)
        if facts is None:
            return None
        mod = LoadedModule(NO_MODULE, facts.path, facts.build_id,
                           AddressSpace([Segment(*seg) for seg in facts.segments]), table)
        mod.view_path = process_view(path, self.proc_root)
        # read it later (symbols) from the path the process uses when that is the same file here
        mod.readable = mod.view_path if _same_file(mod.view_path, path) else path
        mod.key = min(len(self.module_keys), UNKNOWN_MODULE_KEY - 1)
        self.module_keys.setdefault(mod.key, mod)
        mod.analysed = self._is_analysed(mod)
        # Modules with the same build-id share one slice of rows.
        for other in self.modules.values():
            if other.build_id and other.build_id == mod.build_id and other.module_id != NO_MODULE \
                    and other.table is not None and table is not None and other.table.starts == table.starts:
                mod.module_id, mod.rows = other.module_id, other.rows
                break
        else:
            if table is not None:
                self.upload_table(mod, table)
        self.modules[ident] = mod
        return mod

    def _is_analysed(self, mod: LoadedModule) -> bool:
        if self.encoding is None:
            return False
        want = self.encoding.binary
        if want.get("build_id") and mod.build_id:
            return bool(want["build_id"] == mod.build_id)
        return os.path.realpath(mod.path) == os.path.realpath(str(want.get("path")))

    def module_of_key(self, key: int) -> tuple[str, str | None, str] | None:
        """(path as the process sees it, build-id, a path to read it from here) of the module an
        unanalysed frame names by its key."""
        mod = self.module_keys.get(key)
        if mod is None:
            return None
        return mod.view_path or mod.path, mod.build_id, mod.readable or mod.path

    def upload_encoding(self, enc: UnwindEncoding) -> None:
        """The analysed binary's function ranges, edge rows and call sites (plan.py), packed
        once (cached with the encoding's identity) and written with one batch update per map."""
        for name, (keys, values, count) in cached_packed_encoding(enc, self.cache).items():
            if count:
                rawbpf.map_update_batch(self.module.map(name).fd, keys, values, count, name)
        cfg = self.module.map("ue_config")
        cfg.set(0, len(enc.functions))
        cfg.set(1, enc.root_index)
        # the functions' page index: ue_function's search over a bucket's few functions (issue #18)
        base, shift, bounds = page_index([f[0] for f in enc.functions])
        nb = len(bounds) - 1
        if nb > 0:
            pages = array("I", bytes(8 * nb))
            pages[0::2] = bounds[:-1]
            pages[1::2] = bounds[1:]
            rawbpf.map_update_batch(self.module.map("ue_fpages").fd, array("I", range(nb)).tobytes(),
                                    pages.tobytes(), nb, "ue_fpages")
            cfg.set(2, base)
            cfg.set(3, nb << 8 | shift)

    def upload_table(self, mod: LoadedModule, table: cfi.UnwindTable) -> None:
        n = len(table)
        if n == 0 or table.starts[-1] >= 1 << 32:
            return  # nothing to search, or vaddrs beyond 4 GiB: flagged no_table when hit
        if self.next_module >= self.max_modules or self.next_entry + n > self.max_entries:
            return
        base, shift, bounds = page_index(table.starts)
        if self.next_page + len(bounds) - 1 > self.max_pages:
            return
        local_to_global: list[int] = []
        # Ids are handed out only once the whole table fits: a table that does not fit must not
        # leave ids behind that a later module would reuse without their rules ever uploaded.
        new_ids: dict[cfi.Rule, int] = {}
        for rule in table.rules:
            rid = self.rule_ids.get(rule, new_ids.get(rule))
            if rid is None:
                if len(self.rule_ids) + len(new_ids) >= self.max_rules:
                    return
                rid = new_ids[rule] = len(self.rule_ids) + len(new_ids)
            local_to_global.append(rid)
        new_rules = [(rid, rule) for rule, rid in new_ids.items()]
        if new_rules:
            rawbpf.map_update_batch(self._rules.fd, array("I", [r for r, _ in new_rules]).tobytes(),
                                    b"".join(pack_rule(rule) for _, rule in new_rules), len(new_rules),
                                    "uw_rules")
        self.rule_ids.update(new_ids)
        first = self.next_entry
        rawbpf.map_update_batch(self._entries.fd, array("I", range(first, first + n)).tobytes(),
                                pack_entries(table.starts, [local_to_global[r] for r in table.rule_ids]), n,
                                "uw_entries")
        pfirst, nb = self.next_page, len(bounds) - 1
        pages = array("I", bytes(8 * nb))  # struct uw_page (lo, hi): bucket b's bounds b and b + 1
        pages[0::2] = bounds[:-1]
        pages[1::2] = bounds[1:]
        rawbpf.map_update_batch(self._pages.fd, array("I", range(pfirst, pfirst + nb)).tobytes(),
                                pages.tobytes(), nb, "uw_pages")
        mv = self._modules.leaf_type()
        mv.first, mv.count = first, n
        mv.base, mv.shift, mv.pfirst, mv.pcount = base, shift, pfirst, nb
        self._modules.set(self.next_module, mv)
        mod.module_id, mod.rows = self.next_module, n
        self.next_module += 1
        self.next_entry += n
        self.next_page += nb

    def close(self) -> None:
        self.vdso.close()


def process_view(open_path: str, proc_root: str) -> str:
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
