"""The analysis builds its graph as rows (no networkx): they must equal the rows of the networkx graph
the same calls build, and the statistics computed from them (their own SCC search) must equal those
networkx computes on the built graph."""

from __future__ import annotations

from pathlib import Path

import pytest
from programs.build import build

from ccprofd.callgraph import analyze_binary, graph_stats
from ccprofd.callgraph.model import ROOT, BinaryInfo, CallGraph, CallSite, GraphRows

BIN = BinaryInfo(path="/x", build_id=None, content_hash="0", pie=False, elf_type="EXEC", entry=0,
                 text_bytes=0)
PROGRAMS = ["recursion", "tailcall", "fptr", "switch", "exceptions"]


def _both(build: list[tuple[str, tuple]]) -> tuple[CallGraph, CallGraph]:
    rows = GraphRows()
    nx_graph = CallGraph.empty(BIN)
    for op, args in build:
        if op == "fn":
            rows.add_function(*args[:2], kind=args[2], addr=args[3], fragments=args[4])
            nx_graph.add_function(*args[:2], kind=args[2], addr=args[3], fragments=args[4])
        elif op == "call":
            site = CallSite(*args)
            rows.add_call([site.function, site.address, site.return_address, site.length, site.bytes_hex,
                           site.kind, site.target, site.operand, site.is_jump])
            nx_graph.add_call(site)
        elif op == "root":
            rows.add_root(args[0])
            nx_graph.add_root(args[0])
        else:
            rows.set_address_taken(args[0])
            nx_graph.graph.nodes[args[0]]["address_taken"] = True
    return CallGraph.from_rows(BIN, rows), nx_graph


def test_rows_equal_networkx_rows_on_a_hand_built_graph() -> None:
    """Edges listed by source in node order, targets in first-edge order, keys in insertion order;
    a second root edge to the same node is not added; a repeated key replaces the edge in place."""
    build = [("fn", (0x30, "c", "function", 0x30, [(0x90, 0x98)])), ("fn", (0x10, "a", "function", 0x10, [])),
             ("fn", (0x20, "b", "function", 0x20, [])), ("fn", (-2, "puts", "external", 0, [])),
             ("call", (0x10, 0x15, 0x1a, 5, "e8", "direct", 0x30)),
             ("call", (0x20, 0x21, 0x26, 5, "e8", "direct", 0x10)),
             ("call", (0x10, 0x11, 0x16, 5, "e8", "direct", 0x20)),
             ("call", (0x10, 0x17, 0x1c, 5, "e8", "direct", 0x30)),
             ("call", (0x30, 0x31, 0x36, 5, "e8", "plt", -2)),
             ("call", (0x30, 0x33, 0x35, 2, "ffd0", "indirect", None, "rax")),
             ("call", (0x30, 0x38, 0x3d, 5, "e9", "tail", 0x30, None, True)),
             ("root", (0x20,)), ("root", (0x10,)), ("root", (0x20,)), ("taken", (0x20,))]
    rows, nx_graph = _both(build)
    assert rows.to_dict() == nx_graph.to_dict()
    assert graph_stats(rows) == graph_stats(nx_graph)
    assert graph_stats(rows)["complex_sccs"] == 2 and graph_stats(rows)["roots"] == 2  # {a, b}, {c}


@pytest.mark.parametrize("name", [*PROGRAMS, "/usr/bin/bash"])
def test_stats_from_rows_equal_networkx_stats(name: str) -> None:
    path = Path(name) if name.startswith("/") else build(name, opt="O2", pie=True)
    graph = analyze_binary(path, use_cache=False)
    assert graph.unbuilt_rows() is not None
    from_rows = graph_stats(graph)
    rows = graph.to_dict()
    assert graph.unbuilt_rows() is not None  # neither call built the networkx graph
    assert graph.graph.number_of_nodes() == len(rows["nodes"]) and graph.unbuilt_rows() is None
    assert graph_stats(graph) == from_rows  # now computed by networkx on the built graph
    assert graph.to_dict() == rows
    assert ROOT in graph.graph
