"""The call graph value: the output of ``ccprofd/callgraph`` and the input of ``ccprofd/encode``.

A :class:`CallGraph` wraps a networkx ``MultiDiGraph`` whose nodes are integers:

* ``ROOT`` (-1): the virtual root (PCCE's dummy root); its out-edges go to every root function.
* internal functions: the function's entry ELF virtual address (>= 0);
* external functions (imported through the PLT): ``-2 - i`` for the i-th external name.

Node attributes (all nodes): ``name`` (str), ``kind`` ("function" | "external" | "root"),
``addr`` (int vaddr, 0 for external/root), ``size`` (int bytes), ``aliases`` (list[str]),
``address_taken`` (bool), ``is_root`` (bool: a root function, i.e. the virtual root calls it),
``fragments`` (list of [start, end) vaddr ranges of split-off parts such as gcc's ``foo.cold``,
which run in the function's own frame and are entered by jumps, not calls).

Edges are keyed by the call-site vaddr (``key``); a root edge (virtual root -> root function) has
key ``ROOT_EDGE_KEY`` (0), since a function is a root at most once.  Edge attributes: ``kind``
("direct" | "plt" | "tail" | "root"), ``site`` (vaddr of the call/jmp instruction; None for root
edges), ``ret`` (vaddr of the instruction after it; None for root edges), ``length`` (instruction
length in bytes), ``weight`` (optional dynamic call count; None when unknown).

Indirect call sites have no edge (the target is unknown statically); they are listed in
``CallGraph.sites`` with ``kind == "indirect"`` and their operand text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import networkx as nx

FORMAT_VERSION = 1
ROOT = -1
ROOT_EDGE_KEY = 0

SITE_KINDS = ("direct", "plt", "tail", "indirect")


_SITE_FIELDS = ("function", "address", "return_address", "length", "bytes_hex", "kind", "target", "operand",
                "is_jump")
_BINARY_FIELDS = ("path", "build_id", "content_hash", "pie", "elf_type", "entry", "text_bytes")

# CallSite and BinaryInfo are written out instead of declared with @dataclass: importing dataclasses
# (inspect, ast, dis, tokenize) was ~15 ms of a ~0.1 s `analyze` cache hit.  They behave as the
# dataclasses did: field order, keyword defaults, equality, repr; CallSite is frozen and hashable.


class CallSite:
    """One call or tail-jump instruction found by exact disassembly."""

    __slots__ = _SITE_FIELDS
    function: int  # entry vaddr of the containing function
    address: int  # vaddr of the call/jmp instruction
    return_address: int  # vaddr of the next instruction
    length: int
    bytes_hex: str
    kind: str  # one of SITE_KINDS
    target: int | None  # callee node id (internal vaddr or external id); None if indirect
    operand: str | None  # operand text for indirect sites ("rax", "qword ptr [rip + 0x..]")
    is_jump: bool  # a jmp (tail call or indirect jump), not a call: nothing returns to it

    def __init__(self, function: int, address: int, return_address: int, length: int, bytes_hex: str,
                 kind: str, target: int | None = None, operand: str | None = None,
                 is_jump: bool = False) -> None:
        put = object.__setattr__
        put(self, "function", function)
        put(self, "address", address)
        put(self, "return_address", return_address)
        put(self, "length", length)
        put(self, "bytes_hex", bytes_hex)
        put(self, "kind", kind)
        put(self, "target", target)
        put(self, "operand", operand)
        put(self, "is_jump", is_jump)

    def _values(self) -> tuple[Any, ...]:
        return (self.function, self.address, self.return_address, self.length, self.bytes_hex, self.kind,
                self.target, self.operand, self.is_jump)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r}: CallSite is frozen")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}: CallSite is frozen")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, CallSite)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return "CallSite(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in _SITE_FIELDS) + ")"


class BinaryInfo:
    """Identity of the analysed object (what the cache and every later stage key on)."""

    __slots__ = _BINARY_FIELDS
    path: str
    build_id: str | None
    content_hash: str
    pie: bool
    elf_type: str  # "EXEC" | "DYN"
    entry: int
    text_bytes: int

    def __init__(self, path: str, build_id: str | None, content_hash: str, pie: bool, elf_type: str,
                 entry: int, text_bytes: int) -> None:
        self.path = path
        self.build_id = build_id
        self.content_hash = content_hash
        self.pie = pie
        self.elf_type = elf_type
        self.entry = entry
        self.text_bytes = text_bytes

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, in order (what ``dataclasses.asdict`` gave)."""
        return {f: getattr(self, f) for f in _BINARY_FIELDS}

    def replace(self, **changes: Any) -> BinaryInfo:
        """A copy with ``changes`` (what ``dataclasses.replace`` gave; an unknown field is an error)."""
        return BinaryInfo(**{**self.as_dict(), **changes})

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, BinaryInfo)
        return self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was

    def __repr__(self) -> str:
        return "BinaryInfo(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in _BINARY_FIELDS) + ")"


class CallGraph:
    """The static call graph of one ELF object plus everything later stages need from it.

    A graph loaded from the cache keeps its compact serialised form and builds the networkx graph
    and the CallSite objects only when first used, so a cache hit costs a file read, not a rebuild.
    """

    def __init__(self, binary: BinaryInfo, graph: nx.MultiDiGraph | None = None,
                 sites: list[CallSite] | None = None, analysis_seconds: float = 0.0) -> None:
        self.binary = binary
        self._graph = graph
        self._sites = sites
        self._rows: dict[str, Any] | None = None
        # A cache hit may defer even reading the rows: ``_summary`` (counts, weights present) answers
        # what a warm start asks, ``_loader`` reads the rows when something needs the graph itself.
        self._loader: Callable[[], dict[str, Any]] | None = None
        self._summary: dict[str, Any] | None = None
        self.analysis_seconds = analysis_seconds
        self.cached_stats: dict[str, Any] | None = None  # statistics already computed (see graph_stats)
        self.from_cache = False  # loaded from the analysis cache rather than analysed now

    @property
    def graph(self) -> nx.MultiDiGraph:
        if self._graph is None:
            import networkx as nx  # imported on first use: a cache hit for stats needs no graph

            rows = self._serial()
            assert rows is not None
            g = nx.MultiDiGraph()
            g.add_nodes_from((n, {"name": name, "kind": kind, "addr": addr, "size": size, "aliases": aliases,
                                  "address_taken": taken, "is_root": is_root, "fragments": fragments})
                             for n, name, kind, addr, size, aliases, taken, is_root, fragments
                             in rows["nodes"])
            g.add_edges_from((u, v, k, {"kind": kind, "site": site, "ret": ret, "length": length,
                                        "weight": weight})
                             for u, v, k, kind, site, ret, length, weight in rows["edges"])
            self._graph = g
        return self._graph

    @property
    def sites(self) -> list[CallSite]:
        if self._sites is None:
            rows = self._serial()
            self._sites = [CallSite(*row) for row in rows["sites"]] if rows else []
        return self._sites

    def _serial(self) -> dict[str, Any] | None:
        """The serialised rows of a graph from the cache (read now if deferred), else None."""
        if self._rows is None and self._loader is not None:
            self._rows = self._loader()
            self._loader = None
        return self._rows

    def unbuilt_rows(self) -> dict[str, Any] | None:
        """The serialised rows while the networkx graph is not built (read now if deferred), else None:
        what can be answered from them needs no graph."""
        return self._serial() if self._lazy() else None

    def _lazy(self) -> bool:
        """True while the networkx graph is not built and the serialised rows stand for it."""
        return self._graph is None and (self._rows is not None or self._loader is not None)

    # ----------------------------------------------------------------- construction helpers
    @staticmethod
    def empty(binary: BinaryInfo) -> CallGraph:
        import networkx as nx

        g = nx.MultiDiGraph()
        g.add_node(ROOT, name="<root>", kind="root", addr=0, size=0, aliases=[], address_taken=False,
                   is_root=False, fragments=[])
        return CallGraph(binary=binary, graph=g, sites=[])

    def add_function(self, node: int, name: str, *, kind: str = "function", addr: int = 0, size: int = 0,
                     aliases: Iterable[str] = (), address_taken: bool = False,
                     fragments: Iterable[tuple[int, int]] = ()) -> None:
        self.graph.add_node(node, name=name, kind=kind, addr=addr, size=size, aliases=list(aliases),
                            address_taken=address_taken, is_root=False,
                            fragments=[list(r) for r in fragments])

    def add_root(self, node: int) -> None:
        """Connect the virtual root to ``node`` (entry from outside code)."""
        self.graph.nodes[node]["is_root"] = True
        if not self.graph.has_edge(ROOT, node, ROOT_EDGE_KEY):
            self.graph.add_edge(ROOT, node, key=ROOT_EDGE_KEY, kind="root", site=None, ret=None, length=0,
                                weight=None)

    def add_call(self, site: CallSite) -> None:
        self.sites.append(site)
        if site.target is None:
            return
        self.graph.add_edge(site.function, site.target, key=site.address, kind=site.kind, site=site.address,
                            ret=site.return_address, length=site.length, weight=None)

    # ------------------------------------------------------------------------------ queries
    def number_of_nodes(self) -> int:
        """Node count, from the serialised rows when the networkx graph was not built (cache hit)."""
        if self._lazy():
            if self._rows is None and self._summary is not None:
                return int(self._summary["nodes"])
            return len(self._serial()["nodes"])  # type: ignore[index]
        return int(self.graph.number_of_nodes())

    def number_of_edges(self) -> int:
        if self._lazy():
            if self._rows is None and self._summary is not None:
                return int(self._summary["edges"])
            return len(self._serial()["edges"])  # type: ignore[index]
        return int(self.graph.number_of_edges())

    def has_edge_weights(self) -> bool:
        """Whether any edge carries a dynamic call count (answered by a cache summary unread)."""
        if self._lazy() and self._rows is None and self._summary is not None:
            return bool(self._summary["weighted"])
        return any(w for *_, w in self.edge_rows())

    def edge_rows(self) -> Iterator[tuple[int, int, int, Any, Any]]:
        """``(caller, callee, key, kind, weight)`` of every edge, without building the networkx graph
        when it is not built yet (a warm start reads the plan from the cache and needs no graph)."""
        if self._lazy():
            rows = self._serial()
            assert rows is not None
            return ((u, v, k, kind, weight) for u, v, k, kind, _s, _r, _l, weight in rows["edges"])
        return ((u, v, k, d.get("kind"), d.get("weight"))
                for u, v, k, d in self.graph.edges(keys=True, data=True))

    def functions(self) -> Iterator[int]:
        """Internal function nodes."""
        return (n for n, k in self.graph.nodes(data="kind") if k == "function")

    def externals(self) -> Iterator[int]:
        return (n for n, k in self.graph.nodes(data="kind") if k == "external")

    def name(self, node: int) -> str:
        return str(self.graph.nodes[node]["name"])

    def roots(self) -> list[int]:
        return sorted(v for _, v in self.graph.out_edges(ROOT))

    def call_edges(self) -> Iterator[tuple[int, int, int]]:
        """(caller, callee, site) for every non-root edge."""
        return ((u, v, k) for u, v, k in self.graph.edges(keys=True) if u != ROOT)

    # ------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        if self._lazy():  # the rows already are the serialised form: no networkx graph is built
            rows = self._serial()
            assert rows is not None
            return {"format": FORMAT_VERSION, "binary": self.binary.as_dict(),
                    "analysis_seconds": self.analysis_seconds, "nodes": rows["nodes"], "edges": rows["edges"],
                    "sites": rows["sites"]}
        nodes = [[n, d["name"], d["kind"], d["addr"], d["size"], d["aliases"], d["address_taken"],
                  d["is_root"], d.get("fragments", [])] for n, d in self.graph.nodes(data=True)]
        edges = [[u, v, k, d["kind"], d["site"], d["ret"], d["length"], d["weight"]]
                 for u, v, k, d in self.graph.edges(keys=True, data=True)]
        return {
            "format": FORMAT_VERSION,
            "binary": self.binary.as_dict(),
            "analysis_seconds": self.analysis_seconds,
            "nodes": nodes,
            "edges": edges,
            "sites": [[s.function, s.address, s.return_address, s.length, s.bytes_hex, s.kind, s.target,
                       s.operand, s.is_jump] for s in self.sites],
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> CallGraph:
        """Inverse of :meth:`to_dict`; the networkx graph is built on first access."""
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"call graph format {data.get('format')!r}, expected {FORMAT_VERSION}")
        cg = CallGraph(binary=BinaryInfo(**data["binary"]),
                       analysis_seconds=data.get("analysis_seconds", 0.0))
        cg._rows = data
        return cg

    def summary(self) -> dict[str, Any]:
        """What a warm start needs without the rows: identity, counts, whether edges are weighted."""
        return {"format": FORMAT_VERSION, "binary": self.binary.as_dict(),
                "analysis_seconds": self.analysis_seconds, "nodes": self.number_of_nodes(),
                "edges": self.number_of_edges(),
                "weighted": any(w for *_, w in self.edge_rows())}

    @staticmethod
    def deferred(summary: dict[str, Any], load: Callable[[], dict[str, Any]]) -> CallGraph:
        """A graph known by its :meth:`summary`, whose rows ``load`` returns (as :meth:`to_dict`) when
        first needed."""
        if summary.get("format") != FORMAT_VERSION:
            raise ValueError(f"call graph format {summary.get('format')!r}, expected {FORMAT_VERSION}")
        cg = CallGraph(binary=BinaryInfo(**summary["binary"]),
                       analysis_seconds=summary.get("analysis_seconds", 0.0))
        cg._summary = {"nodes": int(summary["nodes"]), "edges": int(summary["edges"]),
                       "weighted": bool(summary["weighted"])}
        cg._loader = load
        return cg

    @staticmethod
    def from_rows(binary: BinaryInfo, rows: GraphRows, analysis_seconds: float = 0.0) -> CallGraph:
        """The graph :class:`GraphRows` built, kept in its serialised form (networkx only on first use)."""
        cg = CallGraph(binary=binary, analysis_seconds=analysis_seconds)
        cg._rows = rows.serial()
        return cg

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> CallGraph:
        return CallGraph.from_dict(json.loads(text))


class GraphRows:
    """Builds a call graph straight into :meth:`CallGraph.to_dict`'s rows, in the order a networkx
    ``MultiDiGraph`` built by the same calls would list them (nodes in insertion order; edges by
    source node, then by first edge to each target, then by key), without building one: for node
    (~520k edges) the networkx graph was most of the analysis's memory and a good part of its time.
    """

    def __init__(self) -> None:
        self.nodes: dict[int, list[Any]] = {}
        self._out: dict[int, list[list[Any]]] = {}  # source -> its edge rows, as added
        self._root_targets: set[int] = set()
        self.sites: list[list[Any]] = []
        self.add_function(ROOT, "<root>", kind="root")

    def add_function(self, node: int, name: str, *, kind: str = "function", addr: int = 0, size: int = 0,
                     aliases: Iterable[str] = (), fragments: Iterable[tuple[int, int]] = ()) -> None:
        self.nodes[node] = [node, name, kind, addr, size, list(aliases), False, False,
                            [list(r) for r in fragments]]

    def set_address_taken(self, node: int) -> None:
        self.nodes[node][6] = True

    def add_call(self, site: list[Any]) -> None:
        """``site``: a row of ``CallGraph.to_dict()["sites"]``."""
        self.sites.append(site)
        function, address, ret, length, _hex, kind, target = site[:7]
        if target is not None:
            self._out.setdefault(function, []).append([function, target, address, kind, address, ret, length,
                                                       None])

    def sinks(self) -> tuple[list[list[Any]], dict[int, list[list[Any]]]]:
        """The site rows and the edge rows by source, for a builder that appends to them exactly as
        :meth:`add_call` does (csweep.site_rows)."""
        return self.sites, self._out

    def add_root(self, node: int) -> None:
        self.nodes[node][7] = True
        if node not in self._root_targets:
            self._root_targets.add(node)
            self._out.setdefault(ROOT, []).append([ROOT, node, ROOT_EDGE_KEY, "root", None, None, 0, None])

    def serial(self) -> dict[str, Any]:
        try:  # the compiled grouping of short lists (csweep.c); the loop below is its reference
            from ccprofd.callgraph.csweep import group_edges  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            group_edges = None
        edges: list[list[Any]] = []
        for n in self.nodes:
            rows = self._out.get(n)
            if not rows:
                continue
            if len(rows) == 1:
                edges.append(rows[0])
                continue
            grouped = group_edges(rows) if group_edges is not None else None
            if grouped is not None:
                edges += grouped
                continue
            # networkx's order: by target (first edge to it first), then by key (a key added again
            # replaces its edge in place); kept as nested dicts only for one source at a time.
            by_target: dict[int, dict[int, list[Any]]] = {}
            for row in rows:
                by_target.setdefault(row[1], {})[row[2]] = row
            edges += [row for by_key in by_target.values() for row in by_key.values()]
        return {"format": FORMAT_VERSION, "nodes": list(self.nodes.values()), "edges": edges,
                "sites": self.sites}
