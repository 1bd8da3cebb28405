"""The static call graph of the test programs, checked against binutils and against hand-written graphs.

Every program of ``tests/programs/`` is built at -O0 and -O2, PIE and non-PIE (and at -O2 PIE with CET,
which adds ``.plt.sec``), each also stripped.  For each binary:

* ``ccprofd analyze --json`` (the console script, as a subprocess) must agree with the binutils oracle
  (``tests/binutils_oracle.py``, whose rules are written down there): build_id, pie, direct_calls,
  plt_calls, tail_calls, indirect_calls, functions, edges, nodes, SCC statistics;
* ``analyze_binary`` must report exactly the oracle's call sites (address, kind, target, containing
  function, length, bytes, return address) and functions (entries, names, aliases, sizes);
* the edges leaving the program's own functions must equal the hand-written graph of
  ``tests/programs/expected.py`` (which ``test_oracle_binutils`` checks against objdump), as must
  address-taken functions, roots, indirect call sites and cyclic SCCs;
* a stripped binary's graph must equal its unstripped twin's, names aside.

For a stripped binary the oracle of its unstripped twin is used for functions and names (``strip``
changes no address and no instruction; ``test_oracle_binutils`` checks that).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

import networkx as nx
import pytest
from binutils_oracle import Oracle, Site, oracle
from programs.build import PROGRAMS, build
from programs.expected import EXPECTED, summarize

# (opt, pie, cet)
BASE_VARIANTS = [("O0", True, False), ("O0", False, False), ("O2", True, False), ("O2", False, False),
                 ("O2", True, True)]

JSON_KEYS = {"binary", "build_id", "pie", "functions", "external_functions", "direct_calls", "plt_calls",
             "tail_calls", "indirect_calls", "address_taken", "nodes", "edges", "sccs", "complex_sccs",
             "cyclic_edges", "analysis_seconds"}


def _vid(opt: str, pie: bool, cet: bool) -> str:
    return f"{opt}-{'pie' if pie else 'nopie'}{'-cet' if cet else ''}"


BINARIES = [pytest.param(name, opt, pie, cet, strip,
                         id=f"{name}-{_vid(opt, pie, cet)}{'-stripped' if strip else ''}")
            for name in PROGRAMS for opt, pie, cet in BASE_VARIANTS for strip in (False, True)]
PAIRS = [pytest.param(name, opt, pie, cet, id=f"{name}-{_vid(opt, pie, cet)}")
         for name in PROGRAMS for opt, pie, cet in BASE_VARIANTS]


def binary(name: str, opt: str, pie: bool, cet: bool, strip: bool) -> pathlib.Path:
    return build(name, opt=opt, pie=pie, cet=cet, strip=strip)  # type: ignore[arg-type]


def ccprofd_exe() -> str:
    here = pathlib.Path(sys.executable).parent / "ccprofd"
    found = str(here) if here.exists() else shutil.which("ccprofd")
    assert found, "the ccprofd console script is not installed (pip install -e .)"
    return found


_CACHE_HOME = tempfile.mkdtemp(prefix="ccprofd-test-cache-")
atexit.register(shutil.rmtree, _CACHE_HOME, True)


@functools.cache
def analyze_json(path: pathlib.Path) -> dict[str, Any]:
    """``ccprofd analyze --json PATH``, run with an empty private cache directory."""
    env = dict(os.environ, XDG_CACHE_HOME=_CACHE_HOME, HOME=_CACHE_HOME, CCPROFD_CACHE_DIR=_CACHE_HOME)
    proc = subprocess.run([ccprofd_exe(), "analyze", "--json", str(path)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}"
    data = json.loads(proc.stdout)
    assert isinstance(data, dict)
    return data


@functools.cache
def graph_of(path: pathlib.Path) -> Any:
    from ccprofd.callgraph import analyze_binary

    return analyze_binary(path, use_cache=False)


def twin_oracle(name: str, opt: str, pie: bool, cet: bool) -> Oracle:
    """The oracle of the unstripped build (functions, names, fragments: same addresses as stripped)."""
    return oracle(binary(name, opt, pie, cet, False))


def internal_nodes(cg: Any) -> dict[int, dict[str, Any]]:
    return {n: d for n, d in cg.graph.nodes(data=True) if d["kind"] == "function"}


def node_label(cg: Any, node: int, names: Oracle) -> str:
    """Name of a node for comparisons: externals by name, internal functions by the twin's symbol."""
    d = cg.graph.nodes[node]
    if d["kind"] == "function":
        return names.name_of(node) if node in names.functions else f"<not a function {node:#x}>"
    return str(d["name"])


def _fmt_site(s: Site) -> str:
    return f"{s.address:#x} {s.kind} {s.raw.hex()} -> {s.target_name or s.target}"


def _show(x: Any, names: Oracle | None) -> Any:
    if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
        if names is not None and x in names.functions:
            return f"{x:#x}<{names.name_of(x)}>"
        return f"{x:#x}" if x > 0xFF else x
    if isinstance(x, tuple):
        return tuple(_show(v, names) for v in x)
    return x


def _diff(label: str, got: set[Any] | frozenset[Any], want: set[Any] | frozenset[Any],
          limit: int = 12, names: Oracle | None = None) -> str:
    extra = [_show(x, names) for x in sorted(got - want, key=repr)[:limit]]
    missing = [_show(x, names) for x in sorted(want - got, key=repr)[:limit]]
    return f"{label}: analysis has extra {extra}; analysis misses {missing}"


def oracle_scc_stats(o: Oracle) -> tuple[int, int, int]:
    """(sccs, complex_sccs, cyclic_edges) over internal functions from the oracle's direct/tail edges."""
    g: nx.MultiDiGraph = nx.MultiDiGraph()
    g.add_nodes_from(o.functions)
    for s in o.sites:
        if s.kind in ("direct", "tail") and s.target in o.functions:
            g.add_edge(s.function, s.target, key=s.address)
    comps = list(nx.strongly_connected_components(g))
    comp_of = {n: i for i, c in enumerate(comps) for n in c}
    cyclic = [(u, v) for u, v, _ in g.edges(keys=True) if comp_of[u] == comp_of[v]]
    return len(comps), len({comp_of[u] for u, _ in cyclic}), len(cyclic)


# ---------------------------------------------------------------------------------- CLI vs objdump
@pytest.mark.parametrize(("name", "opt", "pie", "cet", "strip"), BINARIES)
def test_analyze_json_agrees_with_binutils(name: str, opt: str, pie: bool, cet: bool, strip: bool) -> None:
    path = binary(name, opt, pie, cet, strip)
    own = oracle(path)  # code, PLT and build-id of the file itself
    twin = twin_oracle(name, opt, pie, cet)  # functions (a stripped copy has the same ones)
    data = analyze_json(path)
    assert set(data) >= JSON_KEYS, f"missing keys {JSON_KEYS - set(data)}"
    assert pathlib.Path(data["binary"]).resolve() == path.resolve()
    assert data["build_id"] == own.build_id
    assert data["pie"] is own.pie
    got = {k: data[k] for k in ("direct_calls", "plt_calls", "tail_calls", "indirect_calls", "functions")}
    # Tail calls depend on where functions start, which only the twin knows in full (fragments, crt code).
    want = {"direct_calls": own.direct_calls, "plt_calls": own.plt_calls, "tail_calls": twin.tail_calls,
            "indirect_calls": own.indirect_calls, "functions": len(twin.functions)}
    assert got == want, f"{path.name}: analyze --json {got} != binutils {want}"
    if "indirect_jumps" in data:
        assert data["indirect_jumps"] == own.indirect_jumps
    assert data["edges"] == own.direct_calls + twin.tail_calls  # one edge per direct/plt/tail site
    assert data["nodes"] == data["functions"] + data["external_functions"] + 1  # + the virtual root
    assert data["external_functions"] >= len({s.target_name for s in own.sites if s.target in own.plt_names})
    sccs, complex_sccs, cyclic_edges = oracle_scc_stats(twin)
    assert (data["sccs"], data["complex_sccs"], data["cyclic_edges"]) == (sccs, complex_sccs, cyclic_edges)
    assert data["complex_sccs"] == len(EXPECTED[name].cycles)
    assert isinstance(data["analysis_seconds"], int | float) and data["analysis_seconds"] >= 0
    assert data["address_taken"] >= len(EXPECTED[name].address_taken)


# ----------------------------------------------------------------------------- API vs objdump
@pytest.mark.parametrize(("name", "opt", "pie", "cet", "strip"), BINARIES)
def test_call_sites_agree_with_objdump(name: str, opt: str, pie: bool, cet: bool, strip: bool) -> None:
    path = binary(name, opt, pie, cet, strip)
    twin = twin_oracle(name, opt, pie, cet)
    cg = graph_of(path)
    kinds = {"direct": "direct", "plt": "plt", "tail": "tail", "indirect_call": "indirect",
             "indirect_jump": "indirect"}
    want = {s.address: s for s in twin.sites if s.kind in kinds}
    got = {s.address: s for s in cg.sites}
    assert len(got) == len(cg.sites), "a call site is reported twice"
    missing = [_fmt_site(want[a]) for a in sorted(set(want) - set(got))]
    extra = [f"{s.address:#x} {s.kind} {s.bytes_hex}" for a, s in sorted(got.items()) if a not in want]
    assert not missing and not extra, f"sites objdump has but the analysis lacks: {missing[:12]}; " \
                                      f"sites the analysis has but objdump does not: {extra[:12]}"
    wrong = []
    for a, w in want.items():
        s = got[a]
        problems = []
        if s.kind != kinds[w.kind]:
            problems.append(f"kind {s.kind} != {kinds[w.kind]}")
        if bool(s.is_jump) != (w.kind in ("tail", "indirect_jump")):
            problems.append(f"is_jump {s.is_jump}")
        if s.function != w.function:
            problems.append(f"in function {s.function:#x} != {w.function:#x} ({twin.name_of(w.function)})")
        if (s.length, s.return_address, s.bytes_hex) != (w.length, w.return_address, w.raw.hex()):
            problems.append(f"length/ret/bytes {s.length}/{s.return_address:#x}/{s.bytes_hex}")
        if w.kind in ("direct", "plt", "tail"):
            target = None if s.target is None else node_label(cg, s.target, twin)
            if target != w.target_name:
                problems.append(f"target {target} != {w.target_name}")
            elif not cg.graph.has_edge(s.function, s.target, key=a):
                problems.append("no graph edge keyed by the site")
            else:
                e = cg.graph.edges[s.function, s.target, a]
                want_attrs = (kinds[w.kind], a, w.return_address, w.length)
                if (e["kind"], e["site"], e["ret"], e["length"]) != want_attrs:
                    problems.append(f"edge attributes {e}")
        elif s.target is not None:
            problems.append(f"indirect site with a target {s.target}")
        if problems:
            wrong.append(f"{_fmt_site(w)}: {'; '.join(problems)}")
    assert not wrong, "\n".join(wrong[:20])
    n_edges = sum(1 for _ in cg.call_edges())
    assert n_edges == sum(1 for s in want.values() if s.kind in ("direct", "plt", "tail"))


@pytest.mark.parametrize(("name", "opt", "pie", "cet", "strip"), BINARIES)
def test_functions_agree_with_symbols_and_fdes(name: str, opt: str, pie: bool, cet: bool,
                                               strip: bool) -> None:
    path = binary(name, opt, pie, cet, strip)
    twin = twin_oracle(name, opt, pie, cet)
    cg = graph_of(path)
    nodes = internal_nodes(cg)
    # Every function a stripped copy can see from .eh_frame, .dynsym and the entry point must be found.
    assert set(nodes) >= twin.fde_or_dynamic_functions(), \
        _diff("FDE/.dynsym/entry functions", set(nodes), twin.fde_or_dynamic_functions(),
              names=twin)
    # ... and the oracle's whole set (symbols and FDEs, fragments folded).
    assert set(nodes) == set(twin.functions), _diff("functions", set(nodes), set(twin.functions), names=twin)
    sizes = twin.symbol_sizes()
    dynamic = {s.value: s.name for s in oracle(path).symbols if s.table == ".dynsym" and s.type == "FUNC"
               and s.ndx.isdigit()}
    bad = []
    for addr, d in nodes.items():
        if d["addr"] != addr:
            bad.append(f"{addr:#x}: addr attribute {d['addr']:#x}")
        names = {d["name"], *d["aliases"]}
        if not strip:
            want = set(twin.functions.get(addr, []))
        elif addr in dynamic:
            want = {n for a, n in dynamic.items() if a == addr}
        else:
            want = {f"sub_{addr:x}"}
        if want and names != want:
            bad.append(f"{addr:#x}: names {sorted(names)} != {sorted(want)}")
        if not strip and sizes.get(addr, 0) > 0 and d["size"] != sizes[addr]:
            bad.append(f"{addr:#x} {d['name']}: size {d['size']} != symbol size {sizes[addr]}")
    assert not bad, "\n".join(bad)
    externals = {d["name"] for _, d in cg.graph.nodes(data=True) if d["kind"] == "external"}
    assert all("@" not in n for n in externals), sorted(externals)


# ------------------------------------------------------------------------ hand-written graphs
@pytest.mark.parametrize(("name", "opt", "pie", "cet", "strip"), BINARIES)
def test_hand_written_graph(name: str, opt: str, pie: bool, cet: bool, strip: bool) -> None:
    exp = EXPECTED[name]
    twin = twin_oracle(name, opt, pie, cet)
    cg = graph_of(binary(name, opt, pie, cet, strip))
    own = {twin.address_of(f): f for f in exp.functions}
    for addr in own:
        assert cg.graph.has_node(addr), f"{own[addr]} at {addr:#x} is not a node"

    edges = summarize([(own[u], node_label(cg, v, twin), d["kind"])
                       for u, v, d in cg.graph.edges(data=True) if u in own])
    assert edges == exp.edges(opt), _diff("edges of own functions", edges, exp.edges(opt))

    indirect: Counter[str] = Counter(own[s.function] for s in cg.sites
                                     if s.kind == "indirect" and not s.is_jump and s.function in own)
    assert dict(indirect) == exp.indirect_calls

    taken = {own[a] for a in own if cg.graph.nodes[a]["address_taken"]}
    assert taken == exp.address_taken, _diff("address-taken own functions", taken, exp.address_taken)
    roots = set(cg.roots())
    own_roots = {own[a] for a in own if a in roots}
    assert own_roots == exp.roots, _diff("own roots", own_roots, exp.roots)
    assert all(cg.graph.nodes[a]["is_root"] == (a in roots) for a in own)
    assert twin.entry in roots and twin.name_of(twin.entry) == "_start"

    sub = cg.graph.subgraph(own)
    cycles = {frozenset(own[n] for n in c) for c in nx.strongly_connected_components(sub)
              if len(c) > 1 or any(sub.has_edge(n, n) for n in c)}
    assert cycles == exp.cycles


# ------------------------------------------------------------------------ stripped == unstripped
def canonical(cg: Any) -> dict[str, Any]:
    """The graph with names removed: internal nodes by address, externals by imported name."""
    def ident(n: int) -> object:
        d = cg.graph.nodes[n]
        return n if d["kind"] == "function" else (d["kind"], d["name"])

    nodes = {ident(n): (d["kind"], d.get("address_taken"), d.get("is_root"))
             for n, d in cg.graph.nodes(data=True)}
    edges = {(ident(u), ident(v), k, d["kind"], d["site"], d["ret"], d["length"])
             for u, v, k, d in cg.graph.edges(keys=True, data=True)}
    sites = {(s.function, s.address, s.return_address, s.length, s.bytes_hex, s.kind,
              None if s.target is None else ident(s.target), s.is_jump) for s in cg.sites}
    return {"nodes": nodes, "edges": edges, "sites": sites}


@pytest.mark.parametrize(("name", "opt", "pie", "cet"), PAIRS)
def test_stripped_graph_equals_unstripped(name: str, opt: str, pie: bool, cet: bool) -> None:
    twin = twin_oracle(name, opt, pie, cet)
    full = canonical(graph_of(binary(name, opt, pie, cet, False)))
    bare = canonical(graph_of(binary(name, opt, pie, cet, True)))
    full_fn = {n: v for n, v in full["nodes"].items() if isinstance(n, int)}
    bare_fn = {n: v for n, v in bare["nodes"].items() if isinstance(n, int)}
    assert set(bare_fn) == set(full_fn), _diff("stripped function nodes vs unstripped", set(bare_fn),
                                               set(full_fn), names=twin)
    assert bare_fn == full_fn, "address_taken/is_root differ: " + str(
        sorted((hex(n), full_fn[n], bare_fn[n]) for n in full_fn if full_fn[n] != bare_fn.get(n))[:12])
    assert bare["edges"] == full["edges"], _diff("stripped edges vs unstripped", bare["edges"], full["edges"],
                                                names=twin)
    assert bare["sites"] == full["sites"], _diff("stripped sites vs unstripped", bare["sites"], full["sites"],
                                                names=twin)


@pytest.mark.parametrize(("name", "opt", "pie", "cet"), PAIRS)
def test_stripped_graph_equals_unstripped_where_fdes_reach(name: str, opt: str, pie: bool, cet: bool) -> None:
    """The part of the graph a stripped copy can find from .eh_frame/.dynsym/entry alone is identical.

    Weaker than the test above (crt code without FDEs -- _init, _fini, frame_dummy,
    __do_global_dtors_aux, register/deregister_tm_clones -- is left out), so a failure here is in the
    analysis of the program's own code.
    """
    twin = twin_oracle(name, opt, pie, cet)
    reach = twin.fde_or_dynamic_functions()
    full = canonical(graph_of(binary(name, opt, pie, cet, False)))
    bare = canonical(graph_of(binary(name, opt, pie, cet, True)))

    def part(c: dict[str, Any]) -> tuple[set[Any], set[Any], set[Any]]:
        nodes = {(n, v) for n, v in c["nodes"].items() if n in reach}
        edges = {e for e in c["edges"] if e[0] in reach}
        sites = {s for s in c["sites"] if s[0] in reach}
        return nodes, edges, sites

    fn, fe, fs = part(full)
    bn, be, bs = part(bare)
    assert bn == fn, _diff("nodes", bn, fn)
    assert be == fe, _diff("edges", be, fe)
    assert bs == fs, _diff("sites", bs, fs)
