"""The unwind-encoding plan: what the BPF unwinder needs to encode an unwound stack with a Valence plan.

Input: the call graph of the analysed binary and its encoding plan (``scheme == "valence"``).  Output:
a plain, JSON-able :class:`UnwindEncoding` -- the single input of the encoding tables loaded into BPF
maps by :mod:`ccprofd.tracing.unwind.sampler` and of userspace decoding in :mod:`ccprofd.tracing.unwind.mode`.

The unwound stack is walked from the outermost analysed frame inwards, doing exactly what
:class:`ccprofd.encode.Encoder` does for the calls that built that stack:

* ``functions``: sorted ``[start, end, dense node, flags]`` ELF vaddr ranges (gcc's ``.cold``
  fragments are extra ranges of their owner), so a frame's function is found from its pc (``ra - 1``
  for return addresses).  ``FN_SKIP`` marks the function holding the ELF entry point (``_start``):
  it only calls into libc's start-up code, which enters ``main`` from outside.
* ``edges``: ``(return-address vaddr, callee dense node) -> row``; a row is what the call does to
  the state: acycID ``mask``/``val`` words (Valence "set bits [lo, hi) to code") and the recID codes
  it pushes.  Return address 0 keys the root edges (virtual root -> the thread's first analysed
  function).  A call whose direct target reached the callee through a chain of tail jumps (only
  the last function is on the stack) gets the composite row of that chain, but only when the chain
  is the only one the graph allows and no function on it makes an indirect jump (else the edge is
  left to the segment rule below: the stack frames are still exact, only the tail-call frames are
  not reported).
* ``callsites``: return-address vaddr -> call-instruction vaddr (every ``call`` of the graph).  A
  frame pair the plan has no edge for becomes a segment: at that call site when the caller's
  return address follows a known call (an indirect call, a call into a library that called back),
  else at ``OUTSIDE`` (the caller was interrupted by a signal, or its call is not in the graph).

Dense node indices are positions in ``plan["nodes"]``; ``NO_NODE`` stands for "unknown".
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.encode.bits import word_ops
from ccprofd.encode.plan import COL, R_CYCLIC
from ccprofd.persist.cache import AnalysisCache

UNWIND_ENCODING_VERSION = 2  # 2: tables stored as packed arrays
NO_NODE = 0xFFFFFFFF
FN_SKIP = 1
MAX_TAIL_CHAIN = 4  # tail jumps followed from a call's direct target
MAX_ROW_REC = 4  # recID codes one row may push (a composite tail chain pushes one per cyclic edge)


class UnwindPlanError(ValueError):
    """The plan cannot be used to encode unwound stacks (wrong scheme, other binary)."""


@dataclass(slots=True)
class Row:
    """What one call (or one call + tail chain) does to the encoded state."""

    mask: list[int]
    val: list[int]
    rec: list[int] = field(default_factory=list)
    sites: list[int] = field(default_factory=list)  # plan site ids applied, in order (for tests)


def _array(code: str, data: bytes) -> array[int]:
    a = array(code)
    a.frombytes(data)
    return a


class LazyRows(Mapping[tuple[int, int], Row]):
    """``edges`` of an encoding loaded from the cache, kept as the packed arrays it was stored in;
    the key index is made on the first lookup and each :class:`Row` when looked up.  A warm start
    uploads the packed map contents and never looks at a row (only ``--verify`` and tests do), so
    it neither unmarshals nor builds 70k rows of lists."""

    def __init__(self, packed: Mapping[str, Any], words: int) -> None:
        self._p = {k: _array(code, packed[k]) for k, code in _EDGE_ARRAYS.items()}
        self._w = words
        n = len(self._p["ret"])
        p = self._p
        if not (len(p["callee"]) == n and len(p["mask"]) == len(p["val"]) == n * words
                and len(p["rec_off"]) == len(p["site_off"]) == n + 1
                and p["rec_off"][n] == len(p["rec"]) and p["site_off"][n] == len(p["sites"])):
            raise ValueError("packed edge rows of inconsistent sizes")
        self._index: dict[tuple[int, int], int] | None = None

    def _keys(self) -> dict[tuple[int, int], int]:
        if self._index is None:
            self._index = {k: i for i, k in enumerate(zip(self._p["ret"], self._p["callee"], strict=True))}
        return self._index

    def __getitem__(self, key: tuple[int, int]) -> Row:
        i = self._keys()[key]
        p, w = self._p, self._w
        return Row(list(p["mask"][i * w:(i + 1) * w]), list(p["val"][i * w:(i + 1) * w]),
                   list(p["rec"][p["rec_off"][i]:p["rec_off"][i + 1]]),
                   list(p["sites"][p["site_off"][i]:p["site_off"][i + 1]]))

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._p["ret"])


# packed edge arrays: name -> array type code
_EDGE_ARRAYS = {"ret": "Q", "callee": "I", "mask": "Q", "val": "Q", "rec_off": "I", "rec": "Q",
                "site_off": "I", "sites": "I"}


def pack_edges(edges: Mapping[tuple[int, int], Row], words: int) -> dict[str, bytes]:
    """``edges`` as flat arrays (the cached form: marshal loads bytes, not 70k tuples of lists)."""
    a = {k: array(code) for k, code in _EDGE_ARRAYS.items()}
    a["rec_off"].append(0)
    a["site_off"].append(0)
    for (ret, callee), row in edges.items():
        a["ret"].append(ret)
        a["callee"].append(callee)
        a["mask"].extend(row.mask[:words])
        a["val"].extend(row.val[:words])
        a["rec"].extend(row.rec)
        a["rec_off"].append(len(a["rec"]))
        a["sites"].extend(row.sites)
        a["site_off"].append(len(a["sites"]))
    return {k: v.tobytes() for k, v in a.items()}


class PackedIntMap(Mapping[int, int]):
    """An int -> int map kept as two packed ``array('Q')`` until first used (call sites, call
    lengths: needed by decoding, i.e. after the daemon is ready, not to start it)."""

    def __init__(self, keys: bytes, values: bytes) -> None:
        if len(keys) != len(values) or len(keys) % 8:
            raise ValueError("packed map of inconsistent sizes")
        self._k, self._v = keys, values
        self._d: dict[int, int] | None = None

    def _dict(self) -> dict[int, int]:
        if self._d is None:
            self._d = dict(zip(_array("Q", self._k), _array("Q", self._v), strict=True))
            self._k = self._v = b""
        return self._d

    def __getitem__(self, key: int) -> int:
        return self._dict()[key]

    def as_dict(self) -> dict[int, int]:
        """The map as a plain dict (shared, read-only): for loops that look up every frame."""
        return self._dict()

    def __contains__(self, key: object) -> bool:
        return key in self._dict()

    def __iter__(self) -> Iterator[int]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._d) if self._d is not None else len(self._k) // 8


def pack_int_map(m: Mapping[int, int]) -> tuple[bytes, bytes]:
    return array("Q", list(m.keys())).tobytes(), array("Q", list(m.values())).tobytes()


@dataclass
class UnwindEncoding:
    """See the module docstring.  ``edges`` keys are ``(ret vaddr, dense callee)``."""

    binary: dict[str, Any]
    plan_key: str | None
    acyc_words: int
    rec_code_bits: int
    nodes: list[int]
    root_index: int
    functions: list[list[int]]
    edges: Mapping[tuple[int, int], Row]
    callsites: Mapping[int, int]
    call_lengths: Mapping[int, int]  # call-instruction vaddr -> length (for return addresses)
    jump_sites: AbstractSet[int]  # vaddrs of tail-jump sites (their edges are tail calls)
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._starts = [f[0] for f in self.functions]

    def function_at(self, vaddr: int) -> tuple[int, int] | None:
        """(dense node, flags) of the function holding ``vaddr``, or None."""
        i = bisect_right(self._starts, vaddr) - 1
        if i >= 0:
            lo, hi, node, flags = self.functions[i]
            if lo <= vaddr < hi:
                return node, flags
        return None


def _row_of(plan_row: list[Any], words: int) -> Row:
    mask = [0] * words
    val = [0] * words
    rec: list[int] = []
    if plan_row[COL["reasons"]] & R_CYCLIC:
        rec.append(int(plan_row[COL["rec_code"]]))
    elif plan_row[COL["code"]]:
        _set_bits(mask, val, int(plan_row[COL["lo"]]), int(plan_row[COL["hi"]]), int(plan_row[COL["code"]]))
    return Row(mask, val, rec)


def _set_bits(mask: list[int], val: list[int], lo: int, hi: int, code: int) -> None:
    """Compose "set bits [lo, hi) to code" into a (mask, val) pair of 64-bit words (word by word,
    as BPF does: a bit loop was a fifth of a cold start's time on a 48 MB Go binary)."""
    for w, m, bits in word_ops(lo, hi, code):
        mask[w] |= m
        val[w] = (val[w] & ~m) | bits


def _compose(first: Row, then: Row) -> Row:
    mask = [a | b for a, b in zip(first.mask, then.mask, strict=True)]
    val = [(v1 & ~m2) | v2 for v1, m2, v2 in zip(first.val, then.mask, then.val, strict=True)]
    return Row(mask, val, first.rec + then.rec, first.sites + then.sites)


def _tail_paths(start: int, tails: Mapping[int, list[tuple[int, int]]],
                indirect_jumpers: set[int]) -> dict[int, list[list[int]]]:
    """Every simple chain of tail edges from ``start`` (at most MAX_TAIL_CHAIN long), by end node,
    as lists of plan site ids; chains do not continue through functions with indirect jumps."""
    paths: dict[int, list[list[int]]] = {}
    todo: list[tuple[int, list[int], frozenset[int]]] = [(start, [], frozenset({start}))]
    while todo:
        node, chain, seen = todo.pop()
        for nxt, sid in tails.get(node, []):
            if nxt in seen:
                continue
            path = [*chain, sid]
            paths.setdefault(nxt, []).append(path)
            if len(path) < MAX_TAIL_CHAIN and nxt not in indirect_jumpers:
                todo.append((nxt, path, seen | {nxt}))
    return paths


def build_unwind_encoding(graph: CallGraph, plan: Mapping[str, Any]) -> UnwindEncoding:
    """The encoding tables of ``plan`` (built from ``graph``) for unwound stacks."""
    if plan.get("scheme") != "valence":
        raise UnwindPlanError(f"unwind mode encodes with valence, not {plan.get('scheme')!r}")
    b = graph.binary
    if plan["binary"].get("content_hash") != b.content_hash:
        raise UnwindPlanError(f"encoding plan {plan.get('identity')} was not built for {b.path}")
    g = graph.graph
    nodes: list[int] = list(plan["nodes"])
    dense = {n: i for i, n in enumerate(nodes)}
    words = int(plan["acyc_words"])

    entry_fn = None
    for n in graph.functions():
        d = g.nodes[n]
        if d["addr"] <= b.entry < d["addr"] + d["size"]:
            entry_fn = n
    functions: list[list[int]] = []
    for n in graph.functions():
        d = g.nodes[n]
        if n not in dense:
            continue
        flags = FN_SKIP if n == entry_fn else 0
        ranges = ([(d["addr"], d["addr"] + d["size"])] if d["size"] > 0 else []) + \
            [tuple(r) for r in d.get("fragments") or []]
        for lo, hi in ranges:
            functions.append([int(lo), int(hi), dense[n], flags])
    functions.sort()
    # Overlapping ranges (aliases, bad symbol sizes) would make the lookup ambiguous: clip them.
    clipped: list[list[int]] = []
    for f in functions:
        if clipped and f[0] < clipped[-1][1]:
            if f[0] == clipped[-1][0]:
                continue
            clipped[-1][1] = f[0]
        clipped.append(f)
    functions = clipped

    ret_of: dict[int, int] = {}
    callsites: dict[int, int] = {}
    call_lengths: dict[int, int] = {}
    jump_sites: set[int] = set()
    indirect_jumpers: set[int] = set()
    for s in graph.sites:
        call_lengths[s.address] = s.length
        if s.is_jump:
            jump_sites.add(s.address)
            if s.kind == "indirect":
                indirect_jumpers.add(s.function)
            continue
        ret_of[s.address] = s.return_address
        callsites[s.return_address] = s.address

    rows = plan["sites"]
    ci, ki, si, kd = COL["caller"], COL["callee"], COL["site"], COL["kind"]
    edges: dict[tuple[int, int], Row] = {}
    tails: dict[int, list[tuple[int, int]]] = {}  # caller -> [(callee, plan site id)] over tail edges
    stats = {"edges": 0, "root_edges": 0, "tail_composites": 0, "tail_ambiguous": 0}
    for sid, r in enumerate(rows):
        caller, callee, site = r[ci], r[ki], r[si]
        if g.nodes[callee]["kind"] != "function":
            continue  # calls into the PLT: the library frames below are unanalysed
        if caller == ROOT:
            row = _row_of(r, words)
            row.sites = [sid]
            edges[(0, dense[callee])] = row
            stats["root_edges"] += 1
            continue
        if r[kd] == "tail" or site in jump_sites:
            tails.setdefault(caller, []).append((callee, sid))
            continue
        ret = ret_of.get(site)
        if ret is None:
            continue
        row = _row_of(r, words)
        row.sites = [sid]
        edges[(ret, dense[callee])] = row
        stats["edges"] += 1

    # Composite rows: a call whose direct target tail-jumped (possibly several times) to the callee.
    for (ret, _callee), base in list(edges.items()):
        if ret == 0:
            continue
        target = nodes[_callee]
        if target in indirect_jumpers or target not in tails:
            continue
        paths = _tail_paths(target, tails, indirect_jumpers)
        for end, found in paths.items():
            key = (ret, dense[end])
            if key in edges:
                continue
            if len(found) != 1:
                stats["tail_ambiguous"] += 1
                continue
            row = base
            for sid in found[0]:
                step = _row_of(rows[sid], words)
                step.sites = [sid]
                row = _compose(row, step)
            if len(row.rec) > MAX_ROW_REC:
                continue
            edges[key] = row
            stats["tail_composites"] += 1

    return UnwindEncoding(
        binary={"path": b.path, "build_id": b.build_id, "content_hash": b.content_hash},
        plan_key=plan.get("key"), acyc_words=words, rec_code_bits=int(plan["rec_code_bits"]), nodes=nodes,
        root_index=dense[ROOT], functions=functions, edges=edges, callsites=callsites,
        call_lengths=call_lengths, jump_sites=jump_sites, stats=stats)


CACHE_KIND = "unwind-encoding"


def encoding_to_plain(enc: UnwindEncoding) -> dict[str, Any]:
    """A plain (marshal-able) copy of ``enc``; the big tables as packed arrays (bytes)."""
    return {"version": UNWIND_ENCODING_VERSION, "binary": dict(enc.binary), "plan_key": enc.plan_key,
            "acyc_words": enc.acyc_words, "rec_code_bits": enc.rec_code_bits, "nodes": list(enc.nodes),
            "root_index": enc.root_index, "functions": [list(f) for f in enc.functions],
            "edges": pack_edges(enc.edges, enc.acyc_words), "callsites": pack_int_map(enc.callsites),
            "call_lengths": pack_int_map(enc.call_lengths),
            "jump_sites": array("Q", sorted(enc.jump_sites)).tobytes(), "stats": dict(enc.stats)}


def encoding_from_plain(d: Mapping[str, Any]) -> UnwindEncoding:
    words = int(d["acyc_words"])
    return UnwindEncoding(
        binary=dict(d["binary"]), plan_key=d["plan_key"], acyc_words=words,
        rec_code_bits=int(d["rec_code_bits"]), nodes=list(d["nodes"]), root_index=int(d["root_index"]),
        functions=[list(f) for f in d["functions"]], edges=LazyRows(d["edges"], words),
        callsites=PackedIntMap(*d["callsites"]), call_lengths=PackedIntMap(*d["call_lengths"]),
        jump_sites=frozenset(_array("Q", d["jump_sites"])), stats=dict(d["stats"]))


def cached_unwind_encoding(graph: CallGraph, plan: Mapping[str, Any], cache: AnalysisCache) -> UnwindEncoding:
    """:func:`build_unwind_encoding`, from ``cache`` when it holds the encoding of this plan (keyed by
    the plan's key -- binary identity, content hash, scheme, parameters -- the graph's size and the
    encoding format; the cache's own format version is in its file names), else built and stored
    (atomically)."""
    if plan.get("scheme") != "valence" or not plan.get("key") or \
            plan["binary"].get("content_hash") != graph.binary.content_hash:
        return build_unwind_encoding(graph, plan)  # refused there with the reason, or not cacheable
    key = f"{plan['key']}-n{graph.number_of_nodes()}-e{graph.number_of_edges()}-u{UNWIND_ENCODING_VERSION}"
    plain = cache.load(CACHE_KIND, key)
    if isinstance(plain, dict) and plain.get("version") == UNWIND_ENCODING_VERSION \
            and plain.get("plan_key") == plan["key"] \
            and plain.get("binary", {}).get("content_hash") == graph.binary.content_hash:
        try:
            enc = encoding_from_plain(plain)
            enc.binary["path"] = graph.binary.path  # keyed by content: maybe a copy's entry
            return enc
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry: rebuilt and replaced below
    enc = build_unwind_encoding(graph, plan)
    cache.store(CACHE_KIND, key, encoding_to_plain(enc))
    return enc
