"""The warm start: what the daemon derives from immutable inputs comes from a cache, and the cached
value is exactly the value computed from scratch (byte for byte where it goes into BPF maps); a
changed input misses the cache; a damaged cache entry is recomputed, never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_encode_graphs import make_graph

from ccprofd.callgraph.model import CallGraph
from ccprofd.encode import build_plan, get_plan
from ccprofd.encode.edges import read_edges
from ccprofd.encode.plan import plan_path


def _weighted_graph() -> CallGraph:
    g = make_graph(6, [(0, 1), (1, 2), (2, 1), (1, 3), (0, 3), (3, 4), (4, 5), (0, 5)], roots=(0,))
    for i, (_u, _v, _k, d) in enumerate(g.graph.edges(keys=True, data=True)):
        d["weight"] = (i * 7) % 5 or None  # some edges weighted, some not
    return g


def test_plan_cache_hit_builds_no_networkx_graph_and_equals_the_built_plan(tmp_path: Path) -> None:
    g = _weighted_graph()
    # the edge rows read from the serialised graph (what a cache hit has) equal those of networkx
    lazy = CallGraph.from_dict(g.to_dict())
    assert read_edges(lazy) == read_edges(g)
    assert lazy._graph is None
    assert (lazy.number_of_nodes(), lazy.number_of_edges()) == \
        (g.graph.number_of_nodes(), g.graph.number_of_edges())
    assert lazy._graph is None
    first = get_plan(g, "valence", cache_dir=tmp_path)  # built (weights from the graph) and stored
    assert plan_path(tmp_path, first["key"]).exists()
    again = CallGraph.from_dict(g.to_dict())
    cached = get_plan(again, "valence", cache_dir=tmp_path)
    assert again._graph is None  # the hit never built the networkx graph
    fresh = build_plan(CallGraph.from_dict(g.to_dict()), "valence")
    fresh["report"]["build_seconds"] = cached["report"]["build_seconds"]
    assert cached == fresh
    assert cached["params"]["weights_hash"] is not None


def test_plan_cache_changed_weights_miss_and_corrupt_entry_rebuilds(tmp_path: Path) -> None:
    g = _weighted_graph()
    first = get_plan(g, "valence", cache_dir=tmp_path)
    other = _weighted_graph()
    d = next(iter(other.graph.edges(keys=True, data=True)))[3]
    d["weight"] = 1000  # a changed input: another key, not the stored plan
    changed = get_plan(CallGraph.from_dict(other.to_dict()), "valence", cache_dir=tmp_path)
    assert changed["key"] != first["key"]
    path = plan_path(tmp_path, first["key"])
    path.write_bytes(b"{not json")
    rebuilt = get_plan(CallGraph.from_dict(g.to_dict()), "valence", cache_dir=tmp_path)
    assert rebuilt["sites"] == first["sites"] and rebuilt["key"] == first["key"]


# ------------------------------------------------------------------------------- kernel BTF offsets
def _bpftool_offsets() -> dict[tuple[str, str], int]:
    """(struct, member) -> byte offset for EXE_INODE_CHAIN, read from bpftool's raw BTF dump
    (anonymous members followed by type id, as the compiler resolves them)."""
    import re
    import subprocess

    from conftest import require_tool

    from ccprofd.kbpf.btf import EXE_INODE_CHAIN, VMLINUX_BTF

    tool = require_tool("bpftool")
    if not Path(VMLINUX_BTF).exists():
        from conftest import skip_or_fail

        skip_or_fail(f"{VMLINUX_BTF} missing")
    out = subprocess.run([tool, "btf", "dump", "file", VMLINUX_BTF, "format", "raw"], check=True,
                         capture_output=True, text=True).stdout
    types: dict[int, tuple[str, str, list[tuple[str, int, int]]]] = {}
    first_struct: dict[str, int] = {}
    cur: list[tuple[str, int, int]] | None = None
    head = re.compile(r"^\[(\d+)\] (\w+) '([^']*)'(?: type_id=(\d+))?")
    mem = re.compile(r"^\s+'([^']*)' type_id=(\d+) bits_offset=(\d+)")
    for line in out.splitlines():
        m = head.match(line)
        if m:
            tid, kind, name = int(m.group(1)), m.group(2), m.group(3)
            cur = []
            types[tid] = (kind, name, cur)
            if m.group(4):
                cur.append(("", int(m.group(4)), -1))  # typedef/const...: the type it names
            if kind == "STRUCT" and name not in first_struct:
                first_struct[name] = tid
            continue
        m = mem.match(line)
        if m and cur is not None:
            cur.append((m.group(1), int(m.group(2)), int(m.group(3))))

    def resolve(tid: int) -> int:
        while types[tid][0] in ("TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG"):
            tid = types[tid][2][0][1]
        return tid

    def find(tid: int, member: str) -> int | None:
        for name, mtid, bits in types[tid][2]:
            if name == member:
                return bits
            if name == "(anon)":
                inner = resolve(mtid)
                if types[inner][0] in ("STRUCT", "UNION"):
                    sub = find(inner, member)
                    if sub is not None:
                        return bits + sub
        return None

    found = {}
    for s, m in EXE_INODE_CHAIN:
        bits = find(first_struct[s], m)
        assert bits is not None and bits % 8 == 0, (s, m)
        found[(s, m)] = bits // 8
    return found


def test_kbtf_offsets_cached_equal_parsed_and_bpftool(tmp_path: Path) -> None:
    from ccprofd.kbpf import btf as kbtf

    expected = _bpftool_offsets()
    data = Path(kbtf.VMLINUX_BTF).read_bytes()
    want = {n: expected[sm] for n, sm in zip(kbtf.EXE_INODE_NAMES, kbtf.EXE_INODE_CHAIN, strict=True)}
    cold = kbtf.offsets_via_cache(data, tmp_path)  # parsed, then stored
    files = list((tmp_path / kbtf.CACHE_KIND).iterdir())
    assert len(files) == 1 and not files[0].name.startswith(".")
    assert cold == want
    warm = kbtf.offsets_via_cache(data, tmp_path)
    assert warm == want
    assert kbtf.exe_inode_offsets(tmp_path) == want


def test_kbtf_offsets_come_from_the_prebuilt_directory(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh cache takes the offsets scripts/prebuild_bpf.sh kept beside its objects (the BTF is
    not walked) and keeps them; without a prebuilt directory it parses as before."""
    from ccprofd.kbpf import btf as kbtf
    from ccprofd.kbpf import objcache

    data = Path(kbtf.VMLINUX_BTF).read_bytes()
    pre = tmp_path / "prebuilt"
    want = kbtf.offsets_via_cache(data, pre)  # what set-up leaves there
    parsed: list[int] = []
    real = kbtf._offsets
    monkeypatch.setattr(kbtf, "_offsets", lambda *a: parsed.append(1) or real(*a))
    monkeypatch.setenv(objcache.ENV_PREBUILT_DIR, str(pre))
    assert kbtf.offsets_via_cache(data, tmp_path / "fresh") == want and parsed == []
    assert len(list((tmp_path / "fresh" / kbtf.CACHE_KIND).iterdir())) == 1  # kept in the cache
    monkeypatch.setenv(objcache.ENV_PREBUILT_DIR, "")
    assert kbtf.offsets_via_cache(data, tmp_path / "fresh2") == want and parsed == [1]


def test_kbtf_cache_is_keyed_by_the_blob_and_a_corrupt_entry_reparses(tmp_path: Path) -> None:
    from ccprofd.kbpf import btf as kbtf
    from ccprofd.persist.cache import AnalysisCache

    if not Path(kbtf.VMLINUX_BTF).exists():
        from conftest import skip_or_fail

        skip_or_fail(f"{kbtf.VMLINUX_BTF} missing")
    data = Path(kbtf.VMLINUX_BTF).read_bytes()
    want = kbtf._offsets(kbtf.KernelBTF(data))
    cache = AnalysisCache(tmp_path)
    ident = kbtf.btf_identity(data)
    bogus = {n: 8 for n in kbtf.EXE_INODE_NAMES}
    cache.store(kbtf.CACHE_KIND, ident, {"identity": ident, "offsets": bogus})
    assert kbtf.offsets_via_cache(data, tmp_path) == bogus  # the entry is what is used ...
    other = data + b"\0"  # ... for this blob only: another blob (kernel) has another key
    assert kbtf.btf_identity(other) != ident
    assert kbtf.offsets_via_cache(other, tmp_path) == want
    cache.path_for(kbtf.CACHE_KIND, ident).write_bytes(b"\x00garbage")
    assert kbtf.offsets_via_cache(data, tmp_path) == want  # damaged: parsed again
    assert kbtf.offsets_via_cache(data, tmp_path) == want  # and replaced


# ------------------------------------------------------------------------- unwind map contents
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


def _synthetic_encoding() -> Any:
    """Two acycID words, rows pushing up to four recID codes (the widest codes u32 holds)."""
    from ccprofd.tracing.unwind.plan import Row, UnwindEncoding

    edges = {}
    for i in range(300):
        mask = [(0xFFFF << (i % 48)) & (2**64 - 1), (i * 0x9E3779B97F4A7C15) & (2**64 - 1)]
        val = [(i * 0x1234567) & mask[0], (i * 0xDEADBEEF) & mask[1]]
        rec = [(i * 7919 + j) & 0xFFFFFFFF for j in range(i % 5)]
        if i % 50 == 0:
            rec = [0xFFFFFFFF] * 4
        edges[(0x1000 + 16 * i if i else 0, i % 37)] = Row(mask, val, rec, [i])
    return UnwindEncoding(
        binary={"path": "/nonexistent/synthetic", "build_id": None, "content_hash": "ab" * 32},
        plan_key="synthetic-plan", acyc_words=2, rec_code_bits=20, nodes=list(range(-1, 40)), root_index=0,
        functions=[[0x1000 + 0x100 * i, 0x1000 + 0x100 * (i + 1), i, 1 if i == 3 else 0] for i in range(40)],
        edges=edges, callsites={0x1000 + 16 * i + 5: 0x1000 + 16 * i for i in range(1, 300)},
        call_lengths={}, jump_sites=set())


def _ctypes_encoding(sampler: Any, enc: Any) -> dict[str, dict[bytes, bytes]]:
    """The maps' contents as the element-by-element ctypes code (before packing) built them."""
    import ctypes

    out: dict[str, dict[bytes, bytes]] = {}
    funcs = sampler.module.map("ue_funcs")
    rows = {}
    for i, (lo, hi, node, flags) in enumerate(enc.functions):
        f = funcs.leaf_type()
        f.start, f.end, f.node, f.flags = lo, hi, node, flags
        rows[bytes(ctypes.c_uint32(i))] = bytes(f)
    out["ue_funcs"] = rows
    edges = sampler.module.map("ue_edges")
    rows = {}
    for (ret, callee), row in enc.edges.items():
        k = edges.key_type()
        k.ret, k.callee, k.pad = ret, callee, 0
        v = edges.leaf_type()
        for w in range(enc.acyc_words):
            v.mask[w], v.val[w] = row.mask[w], row.val[w]
        v.nrec = len(row.rec)
        for i, code in enumerate(row.rec):
            v.rec[i] = code
        rows[bytes(k)] = bytes(v)
    out["ue_edges"] = rows
    out["ue_sites"] = {bytes(ctypes.c_uint64(k)): bytes(ctypes.c_uint64(v)) for k, v in enc.callsites.items()}
    return out


def _read_back(sampler: Any, name: str, keys: list[bytes]) -> dict[bytes, bytes]:
    """Map contents read back from the kernel (BPF_MAP_LOOKUP_ELEM per key)."""
    import ctypes

    from ccprofd.kbpf import rawbpf
    from ccprofd.kbpf.abi import BPF_MAP_LOOKUP_ELEM, MapElemAttr

    m = sampler.module.map(name)
    vsize = ctypes.sizeof(m.leaf_type)
    out = {}
    for k in keys:
        kb = ctypes.create_string_buffer(k, len(k))
        vb = ctypes.create_string_buffer(vsize)
        attr = MapElemAttr(map_fd=m.fd, key=ctypes.addressof(kb), value=ctypes.addressof(vb))
        rawbpf.bpf(BPF_MAP_LOOKUP_ELEM, attr, f"lookup in {name}")
        out[k] = vb.raw
    return out


def _check_sampler_maps(sampler: Any, enc: Any) -> None:
    want = _ctypes_encoding(sampler, enc)
    for name, rows in want.items():
        assert rows, name
        assert _read_back(sampler, name, list(rows)) == rows, name


@pytest.mark.parametrize("which", ["recursion", "synthetic"])
def test_unwind_maps_packed_and_cached_equal_the_ctypes_rows(which: str, tmp_path: Path) -> None:
    """ue_funcs/ue_edges/ue_sites uploaded from the packed cache entry hold exactly the bytes the
    ctypes path wrote; uw_rules/uw_entries of the binary and of libc likewise."""
    import ctypes

    from conftest import require_bpf
    from programs.build import build

    from ccprofd.callgraph import analyze_binary
    from ccprofd.elf import cfi as ccfi
    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.tracing.unwind import sampler as unwind
    from ccprofd.tracing.unwind import tables
    from ccprofd.tracing.unwind.plan import cached_unwind_encoding

    require_bpf()
    cache = AnalysisCache(tmp_path / "cache")
    binary = None
    if which == "synthetic":
        enc = _synthetic_encoding()
    else:
        binary = str(build("recursion", opt="O2"))
        graph = analyze_binary(binary, cache_dir=tmp_path / "cache")
        plan = get_plan(graph, "valence", cache_dir=tmp_path / "cache")
        cached_unwind_encoding(graph, plan, cache)  # stored ...
        enc = cached_unwind_encoding(CallGraph.from_dict(graph.to_dict()), plan, cache)  # ... and loaded
        assert any(r.rec for r in enc.edges.values()) and any(any(r.mask) for r in enc.edges.values())
    cold = tables.cached_packed_encoding(enc, cache)  # packed and stored
    assert tables.cached_packed_encoding(enc, cache) == cold == tables.pack_encoding(enc)
    with unwind.UnwindSampler(syscalls=[1], encoding=enc, cache=cache, max_depth=64) as s:  # from the cache
        _check_sampler_maps(s, enc)
        if binary is None:
            return
        for path in (binary, LIBC):
            assert s.preload(path)
        rules = s.module.map("uw_rules")
        entries = s.module.map("uw_entries")
        for rule, rid in s.tables.rule_ids.items():
            v = rules.leaf_type()
            v.kind, v.rbp_kind, v.aux = rule.kind, rule.rbp_kind, rule.aux & 0xFF
            v.cfa_off, v.rbp_off, v.ra_off = rule.cfa_off, rule.rbp_off, rule.ra_off
            key = bytes(ctypes.c_uint32(rid))
            assert _read_back(s, "uw_rules", [key]) == {key: bytes(v)}
        for path in (binary, LIBC):
            table = ccfi.load_table(path, cache)
            mod = next(m for m in s.tables.modules.values() if m.path == table.path)
            first, count = s.module.map("uw_modules").get(mod.module_id).first, mod.rows
            assert count == len(table)
            picks = sorted({*range(min(count, 64)), *range(0, count, 97), *range(max(0, count - 64), count)})
            want = {}
            for i in picks:
                e = entries.leaf_type()
                e.vaddr, e.rule = table.starts[i], s.tables.rule_ids[table.rules[table.rule_ids[i]]]
                want[bytes(ctypes.c_uint32(first + i))] = bytes(e)
            assert _read_back(s, "uw_entries", list(want)) == want


def test_packed_encoding_cache_key_and_corrupt_entry(tmp_path: Path) -> None:
    from dataclasses import replace as dc_replace

    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.tracing.unwind import tables

    cache = AnalysisCache(tmp_path)
    enc = _synthetic_encoding()
    packed = tables.cached_packed_encoding(enc, cache)
    key = tables.packed_encoding_key(enc)
    assert key is not None
    path = cache.path_for(tables.PACKED_CACHE_KIND, key)
    assert path.exists()
    # another plan (or binary content) is another entry, never this one
    other = dc_replace(enc, plan_key="another-plan")
    assert tables.packed_encoding_key(other) != key
    assert tables.packed_encoding_key(dc_replace(enc, binary={**enc.binary, "content_hash": "cd" * 32})) \
        != key
    # a poisoned entry under the key is what is used (so the key is all that selects it) ...
    bogus = dict(packed)
    k, v, n = bogus["ue_sites"]
    bogus["ue_sites"] = (k, bytes(len(v)), n)
    cache.store(tables.PACKED_CACHE_KIND, key, {"key": key, "maps": bogus})
    assert tables.cached_packed_encoding(enc, cache)["ue_sites"][1] == bytes(len(v))
    # ... a torn or mis-sized one is packed again
    cache.store(tables.PACKED_CACHE_KIND, key, {"key": key, "maps": {**packed, "ue_sites": (k, v[:-8], n)}})
    assert tables.cached_packed_encoding(enc, cache) == packed
    path.write_bytes(b"torn")
    assert tables.cached_packed_encoding(enc, cache) == packed
    assert tables.pack_encoding(enc) == packed


# ----------------------------------------------------------------------- instrumented mode
def _program_plan(tmp_path: Path, name: str = "calls", scheme: str = "valence", words: int = 1) -> Any:
    from programs.build import build

    from ccprofd.callgraph import analyze_binary

    binary = str(build(name, opt="O2"))
    graph = analyze_binary(binary, cache_dir=tmp_path / "cache")
    plan = get_plan(graph, scheme, pcce_words=words, cache_dir=tmp_path / "cache")
    return binary, graph, plan


@pytest.mark.parametrize("scope", [None, "^handler$"])
def test_probe_plan_cache_equals_built_plan_and_misses_on_changed_inputs(tmp_path: Path,
                                                                          scope: str | None) -> None:
    from ccprofd.elf.image import ElfImage
    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.tracing.instrumented.probeplan import (
        PROBE_PLAN_CACHE_KIND,
        build_probe_plan,
        cached_probe_plan,
        probe_plan_cache_key,
    )

    binary, graph, plan = _program_plan(tmp_path, "scoped" if scope else "calls")
    cache = AnalysisCache(tmp_path / "cache")
    opened: list[str] = []

    def image() -> ElfImage:
        opened.append(binary)
        return ElfImage(binary)

    built = build_probe_plan(graph, plan, ElfImage(binary), scope=scope)
    cold = cached_probe_plan(graph, plan, image, cache, scope=scope)
    assert opened == [binary] and cold == built
    lazy = CallGraph.from_dict(graph.to_dict())
    warm = cached_probe_plan(lazy, plan, image, cache, scope=scope)
    assert opened == [binary]  # the hit opened no ELF image ...
    assert lazy._graph is None  # ... and built no networkx graph
    assert warm == built and warm.to_dict() == built.to_dict()
    key = probe_plan_cache_key(graph, plan, "syscalls", scope)
    assert key is not None
    assert probe_plan_cache_key(graph, plan, "all", scope) != key
    assert probe_plan_cache_key(graph, plan, "syscalls", "other") != key
    other_plan = get_plan(graph, "pcce", cache_dir=tmp_path / "cache")
    assert probe_plan_cache_key(graph, other_plan, "syscalls", scope) != key
    every = cached_probe_plan(graph, plan, image, cache, sample_points="all", scope=scope)
    assert every == build_probe_plan(graph, plan, ElfImage(binary), sample_points="all", scope=scope)
    # a damaged entry is rebuilt, equal
    cache.path_for(PROBE_PLAN_CACHE_KIND, key).write_bytes(b"\xffdamaged")
    assert cached_probe_plan(graph, plan, image, cache, scope=scope) == built
    assert len(opened) == 3


def _ctypes_instrumented_rows(bpf: Any) -> dict[str, dict[bytes, bytes]]:
    """The maps' contents as the element-by-element ctypes code (before packing) built them."""
    import ctypes

    from ccprofd.tracing.instrumented.loader import NONE32
    from ccprofd.tracing.instrumented.probeplan import CCOL
    from ccprofd.tracing.instrumented.sitetables import dense_nodes, ret_table

    out: dict[str, dict[bytes, bytes]] = {}
    m = bpf.module.map("cc_sites")
    rows = {}
    for i, s in enumerate(bpf.sites):
        v = m.leaf_type()
        v.vaddr = s["vaddr"]
        v.ret_vaddr = s["ret_vaddr"]
        for j in range(bpf.probe_plan.acyc_words):
            v.mask[j] = s["mask"][j]
            v.val[j] = s["val"][j]
        v.flags = s["flags"]
        v.rec_code = s["rec_code"]
        v.callsite = s["callsite"]
        v.cfa_reg = s["cfa_reg"]
        v.cfa_off = s["cfa_off"]
        v.node = s["node"]
        v.cond = s["cond"]
        rows[bytes(ctypes.c_uint32(i))] = bytes(v)
    out["cc_sites"] = rows
    out["cc_ret_sites"] = {bytes(ctypes.c_uint64(k)): bytes(ctypes.c_uint32(v))
                           for k, v in ret_table(bpf.probe_plan)}
    dense = dense_nodes(bpf.probe_plan)
    out["cc_cs_callee"] = {
        bytes(ctypes.c_uint32(i)): bytes(ctypes.c_uint32(
            dense[c[CCOL["target"]]] if c[CCOL["kind"]] in ("direct", "tail") and c[CCOL["target"]] in dense
            else NONE32))
        for i, c in enumerate(bpf.probe_plan.callsites)}
    out["cc_tail_reach"] = {bytes(ctypes.c_uint64((dense[g] << 32) | dense[f])): b"\x01"
                            for g, f in bpf.probe_plan.tail_entries}
    return out


@pytest.mark.parametrize(("name", "scheme", "words"), [("recursion", "valence", 1), ("tailcall", "pcce", 2)])
def test_instrumented_maps_packed_equal_the_ctypes_rows(tmp_path: Path, name: str, scheme: str,
                                                        words: int) -> None:
    from conftest import require_bpf

    from ccprofd.elf.image import ElfImage
    from ccprofd.tracing.instrumented.loader import InstrumentedBPF
    from ccprofd.tracing.instrumented.probeplan import build_probe_plan

    require_bpf()
    binary, graph, plan = _program_plan(tmp_path, name, scheme, words)
    assert plan["acyc_words"] == words
    pp = build_probe_plan(graph, plan, ElfImage(binary))
    bpf = InstrumentedBPF(pp, plan, syscalls=[1], cache_dir=str(tmp_path / "cache"))
    try:
        want = _ctypes_instrumented_rows(bpf)
        assert want["cc_sites"] and want["cc_ret_sites"] and want["cc_cs_callee"]
        for mapname, rows in want.items():
            got = _read_back(bpf, mapname, list(rows))
            assert got == rows, mapname
    finally:
        bpf.close()


def test_plan_marshal_copy_equals_the_json_file_and_follows_it(tmp_path: Path) -> None:
    import json

    from ccprofd.encode.plan import MARSHAL_KIND, load_plan, store_plan
    from ccprofd.persist.cache import AnalysisCache

    g = _weighted_graph()
    key = get_plan(g, "valence", cache_dir=tmp_path)["key"]
    path = plan_path(tmp_path, key)
    from_json = get_plan(g, "valence", cache_dir=tmp_path)  # parses the JSON, keeps a marshal copy
    side = AnalysisCache(tmp_path)
    assert side.path_for(MARSHAL_KIND, key).exists()
    assert from_json == load_plan(path)
    again = get_plan(g, "valence", cache_dir=tmp_path)  # from the marshal copy
    assert again == from_json and json.dumps(again, sort_keys=True) == json.dumps(from_json, sort_keys=True)
    # the JSON file is the entry: replaced, the copy is stale and not used
    stored = json.loads(path.read_text())
    stored["report"]["marker"] = 7
    store_plan(stored, tmp_path)
    assert get_plan(g, "valence", cache_dir=tmp_path)["report"]["marker"] == 7
    assert get_plan(g, "valence", cache_dir=tmp_path)["report"]["marker"] == 7
    side.path_for(MARSHAL_KIND, key).write_bytes(b"torn")
    assert get_plan(g, "valence", cache_dir=tmp_path)["report"]["marker"] == 7


def test_encoding_round_trips_through_its_packed_cache_form() -> None:
    import marshal

    from ccprofd.tracing.unwind.plan import encoding_from_plain, encoding_to_plain

    enc = _synthetic_encoding()
    enc.call_lengths.update({0x1000 + 16 * i: 5 for i in range(1, 300)})
    enc.jump_sites.update({0x2000, 0x2010})
    plain = marshal.loads(marshal.dumps(encoding_to_plain(enc)))
    back = encoding_from_plain(plain)
    assert len(back.edges) == len(enc.edges) and list(back.edges) == list(enc.edges)
    for key, row in enc.edges.items():
        assert key in back.edges
        got = back.edges[key]
        assert (got.mask, got.val, got.rec, got.sites) == (row.mask, row.val, row.rec, row.sites)
    assert (0x999, 0) not in back.edges
    assert len(back.callsites) == len(enc.callsites) and dict(back.callsites) == enc.callsites
    assert dict(back.call_lengths) == enc.call_lengths and set(back.jump_sites) == enc.jump_sites
    assert back.functions == enc.functions and back.function_at(0x1105) == enc.function_at(0x1105)
    torn = dict(plain)
    torn["edges"] = {**plain["edges"], "mask": plain["edges"]["mask"][:-8]}
    with pytest.raises(ValueError):
        encoding_from_plain(torn)


def test_cached_graph_is_read_only_when_needed_and_equals_the_analysis(tmp_path: Path) -> None:
    from programs.build import build

    from ccprofd.callgraph import SUMMARY_KIND, analyze_binary
    binary = str(build("recursion", opt="O2"))
    fresh = analyze_binary(binary, cache_dir=tmp_path, use_cache=False)
    first = analyze_binary(binary, cache_dir=tmp_path)  # analysed, stored with its summary
    assert not first.from_cache
    warm = analyze_binary(binary, cache_dir=tmp_path)
    assert warm.from_cache and warm._rows is None  # only the summary was read
    assert (warm.number_of_nodes(), warm.number_of_edges(), warm.has_edge_weights()) == \
        (fresh.graph.number_of_nodes(), fresh.graph.number_of_edges(), False)
    built = get_plan(first, "valence", cache_dir=tmp_path)  # built from the graph and stored
    assert get_plan(warm, "valence", cache_dir=tmp_path)["sites"] == built["sites"]
    assert warm._rows is None  # a plan-cache hit needs the counts, not the rows
    # once something needs the graph, the rows are read and equal the analysis
    assert warm.to_dict()["edges"] == fresh.to_dict()["edges"] and warm._rows is not None
    assert [s.address for s in warm.sites] == [s.address for s in fresh.sites]
    # a damaged or rewritten graph entry is found out at once (the summary names the file it was
    # made with), re-analysed and rewritten, never a traceback
    (entry,) = (tmp_path / "callgraph").iterdir()
    entry.write_bytes(b"garbage")
    again = analyze_binary(binary, cache_dir=tmp_path)
    assert not again.from_cache and again.to_dict()["edges"] == fresh.to_dict()["edges"]
    warm2 = analyze_binary(binary, cache_dir=tmp_path)  # the rewritten entry and summary
    assert warm2.from_cache and warm2._rows is None
    (summary,) = (tmp_path / SUMMARY_KIND).iterdir()
    summary.write_bytes(b"torn")
    warm3 = analyze_binary(binary, cache_dir=tmp_path)  # a torn summary: the full entry is read
    assert warm3.from_cache and warm3._rows is not None
    assert warm3.to_dict()["edges"] == fresh.to_dict()["edges"]


def _bpf_prog_fds() -> int:
    import contextlib
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-prog"
    return n


@pytest.mark.parametrize(("entry_attach", "prog"), [(False, "uw_sys_enter"), (True, "uw_sys_tp")])
def test_early_verifier_load_is_attached_or_closed(tmp_path: Path, entry_attach: bool, prog: str) -> None:
    """load_early hands the unwinder to the verifier in a thread at construction (the program of
    the attach path the set takes: raw_syscalls, or the per-syscall events); attach() uses that
    load, and a sampler closed without attaching leaves no program fd behind."""
    from conftest import require_bpf

    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.tracing.unwind.sampler import UnwindSampler

    require_bpf()
    before = _bpf_prog_fds()
    s = UnwindSampler(syscalls=[1], max_depth=64, cache=AnalysisCache(tmp_path), load_early=True,
                      entry_attach=entry_attach)
    try:
        assert list(s.programs.loading) == [prog]
    finally:
        s.close()
    assert not s.programs.loading and _bpf_prog_fds() == before
    with UnwindSampler(syscalls=[1], max_depth=64, cache=AnalysisCache(tmp_path), load_early=True,
                       entry_attach=entry_attach) as s:
        s.attach()
        assert not s.programs.loading and s.syscall_program_fd() >= 0 and _bpf_prog_fds() > before
        assert len(s._links) == (0 if entry_attach else 1)  # the events' attachments are the module's
    assert _bpf_prog_fds() == before
