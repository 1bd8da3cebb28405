"""The warm start: what the daemon derives from immutable inputs comes from a cache, and the cached
value is exactly the value computed from scratch (byte for byte where it goes into BPF maps); a
changed input misses the cache; a damaged cache entry is recomputed, never a traceback."""

from __future__ import annotations

from pathlib import Path

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

    from ccprofd.bpf.kbtf import EXE_INODE_CHAIN, VMLINUX_BTF

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
    from ccprofd.bpf import kbtf

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


def test_kbtf_cache_is_keyed_by_the_blob_and_a_corrupt_entry_reparses(tmp_path: Path) -> None:
    from ccprofd.bpf import kbtf
    from ccprofd.callgraph.cache import AnalysisCache

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
