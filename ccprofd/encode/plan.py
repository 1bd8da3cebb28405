"""The encoding plan: the single input of the BPF code generator and of the decoders.

A plan is a plain JSON-able dict, versioned, tied to the binary's identity (build-id, else content
hash) and to the encoding parameters.  Its schema (``PLAN_VERSION`` 1):

``format``/``version``  ``"ccprofd-encoding-plan"`` / 1.
``scheme``              ``"valence" | "pcce" | "hcce" | "stacktags"``.
``binary``              ``{path, build_id, content_hash}``; ``identity`` is ``build-id:<hex>`` or
                        ``sha256:<hex>``.
``params``              ``{pcce_words, weights_hash}`` (``pcce_words`` is None for schemes without
                        a PCCE id).  ``key`` is the cache key derived from identity+scheme+params.
``nodes``/``names``     dense node index -> node id / function name.  Decode tables use dense
                        indices; sites and decoded paths use node ids.
``acyc_op``             what an acyclic probe does: ``"set"`` bits ``[lo, hi)`` of acycID to
                        ``code`` (Valence), ``"add"`` ``code`` to the id (PCCE, HCCE; subtract on
                        return), ``"mix"`` (stack tags).
``acyc_bits``           width of acycID / id in bits; ``acyc_words`` its storage in 64-bit words.
``rec_code_bits``       width of one recID code (PCCE: of a back-edge code).
``reason_bits``         legend of the ``reasons`` bit mask: acyc=1, cyclic=2, plt_exit=4,
                        outside_entry=8, indirect=16 (the last three are set by later stages).
``site_columns``        names of the columns of ``sites``.
``sites``               one row per call-graph edge, indexed by *site id*:
                        ``[site vaddr (0 for root edges), caller, callee, kind, reasons, lo, hi,
                        code, rec_code]``.  ``reasons == 0`` means no probe.  ``lo``/``hi``: bit
                        range (Valence) or id width (PCCE/HCCE), None for cyclic edges.  ``code``:
                        Valence: value of bits [lo, hi) (bit 0 = bit lo); PCCE/HCCE: En(e) to add;
                        PCCE back edge: the id value after the push.  ``rec_code``: code pushed on
                        recID (PCCE: back-edge code pushed with the saved id) or None.
                        Root edges (virtual root -> root function, site 0) have no call
                        instruction: their probe belongs at the root function's entry when the
                        thread has no context yet (the tracer issues wire that up).
``probed``              site ids with a non-zero ``reasons`` mask.
``tables``              scheme-specific decode tables (see the ``decode`` package).
``report``              the statistics of :mod:`ccprofd.encode.report`.

Plans are cached as ``<cache_dir>/plans/<key>.json``, written atomically.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ccprofd.callgraph.model import BinaryInfo, CallGraph
from ccprofd.encode.bits import words_for_bits
from ccprofd.encode.edges import EdgeArrays, EdgeKey, edge_arrays, effective_weights, read_edges, weights_hash
from ccprofd.encode.scc import Sccs, sccs
from ccprofd.encode.valence import SchemeTables, build_valence
from ccprofd.persist.atomicfile import atomic_write_bytes

PLAN_FORMAT = "ccprofd-encoding-plan"
PLAN_VERSION = 1
SCHEMES = ("valence", "pcce", "hcce", "stacktags")

REASON_BITS = {"acyc": 1, "cyclic": 2, "plt_exit": 4, "outside_entry": 8, "indirect": 16}
R_ACYC = REASON_BITS["acyc"]
R_CYCLIC = REASON_BITS["cyclic"]

SITE_COLUMNS = ["site", "caller", "callee", "kind", "reasons", "lo", "hi", "code", "rec_code"]
COL = {name: i for i, name in enumerate(SITE_COLUMNS)}


class PlanError(ValueError):
    """A plan that cannot be used: wrong format/version, or built for another graph."""


def binary_identity(binary: BinaryInfo) -> str:
    return f"build-id:{binary.build_id}" if binary.build_id else f"sha256:{binary.content_hash}"


def plan_key(binary: BinaryInfo, scheme: str, params: Mapping[str, Any]) -> str:
    """Cache key: (identity, content, scheme, parameters incl. weights hash, plan format version).

    The content hash is part of the key because a stripped copy shares its twin's build-id but not
    its symbols, hence not its function names or boundaries: one must never get the other's plan."""
    blob = json.dumps({"v": PLAN_VERSION, "id": binary_identity(binary), "content": binary.content_hash,
                       "scheme": scheme, "params": dict(params)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _params(scheme: str, pcce_words: int, wh: str | None) -> dict[str, Any]:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown encoding scheme {scheme!r}; expected one of {SCHEMES}")
    if pcce_words < 1:
        raise ValueError("pcce_words must be >= 1")
    return {"pcce_words": pcce_words if scheme in ("pcce", "hcce") else None, "weights_hash": wh}


def build_plan(graph: CallGraph, scheme: str, *, pcce_words: int = 1,
               weights: Mapping[EdgeKey, int] | None = None) -> dict[str, Any]:
    """Compute the plan of one scheme for ``graph``.

    ``weights`` maps ``(caller, callee, site key)`` to a call count; without it the graph's own
    ``weight`` attributes are used when present.  The heaviest incoming edge of each node (Valence,
    HCCE: of each component) gets the all-zero code, hence no probe.
    """
    t0 = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of small, long-lived containers: collection passes only cost time here
    try:
        rows = read_edges(graph)
        w = effective_weights(graph, weights, rows)
        params = _params(scheme, pcce_words, weights_hash(w))
        ea = edge_arrays(graph, w, rows)
        del rows
        sc = sccs(ea, graph.graph) if scheme != "stacktags" else None
        names = [graph.name(n) for n in ea.nodes]
        plan = _assemble(graph, ea, sc, scheme, pcce_words, names)
    finally:
        if gc_was_enabled:
            gc.enable()
    plan["params"] = params
    plan["key"] = plan_key(graph.binary, scheme, params)
    plan["report"]["build_seconds"] = round(time.perf_counter() - t0, 4)
    return plan


def _assemble(graph: CallGraph, ea: EdgeArrays, sc: Sccs | None, scheme: str, pcce_words: int,
              names: list[str]) -> dict[str, Any]:
    m = ea.n_edges
    stats: dict[str, Any] = {"nodes": len(ea.nodes), "edges": m}
    if sc is not None:
        stats.update(sccs=len(sc.members), complex_sccs=sc.n_complex, cyclic_edges=sc.n_cyclic)
    tables: dict[str, Any]
    # The other schemes' builders are imported when used: a trace loads its plan from the cache and
    # imports this module at every start-up.
    if scheme == "stacktags":
        from ccprofd.encode.stacktags import build_stacktags

        tables = {"ids": build_stacktags(ea, names)}
        st = SchemeTables(lo=[None] * m, hi=[None] * m, code=[0] * m, rec_code=[None] * m, tables=tables,
                          stats={"acyclic_bits": 64, "rec_code_bits": 0, "words_needed": 1,
                                 "overflow": False})
        acyc_op, acyc_bits, acyc_words = "mix", 64, 1
        cyclic = bytearray(m)
        reasons = [R_ACYC] * m  # every call mixes the callee into the tag
    else:
        assert sc is not None
        if scheme == "valence":
            st = build_valence(ea, sc)
            acyc_op = "set"
            acyc_bits = st.stats["acyclic_bits"]
            acyc_words = max(1, words_for_bits(acyc_bits))
            st.stats.update(words_needed=acyc_words, overflow=False)
            cyclic = sc.cyclic
        elif scheme == "pcce":
            from ccprofd.encode.pcce import build_pcce

            st = build_pcce(ea, pcce_words)
            acyc_op = "add"
            acyc_bits = st.stats["id_bits"]
            acyc_words = pcce_words
            cyclic = bytearray(1 if r is not None else 0 for r in st.rec_code)
        else:
            from ccprofd.encode.hcce import build_hcce

            st = build_hcce(ea, sc, pcce_words)
            acyc_op = "add"
            acyc_bits = st.stats["id_bits"]
            acyc_words = pcce_words
            cyclic = sc.cyclic
        reasons = [R_CYCLIC if cyclic[e] else (R_ACYC if st.code[e] else 0) for e in range(m)]
    nodes = ea.nodes
    rows = [[ea.site[e], nodes[ea.caller[e]], nodes[ea.callee[e]], ea.kind[e], reasons[e], st.lo[e], st.hi[e],
             st.code[e], st.rec_code[e]] for e in range(m)]
    probed = [e for e in range(m) if reasons[e]]
    report = dict(stats)
    report.update(st.stats)
    if scheme != "stacktags":
        n_cyc = sum(cyclic)
        acyc_coded = sum(1 for e in range(m) if not cyclic[e] and st.code[e])
        rec_coded = sum(1 for e in range(m) if cyclic[e] and st.rec_code[e])
        report["coded_edges"] = acyc_coded + rec_coded
        report["instrumented_edges"] = acyc_coded + n_cyc
    else:
        report["coded_edges"] = report["instrumented_edges"] = m
    if ea.weighted:
        report["dynamic_calls"] = sum(ea.weight)
        report["unprobed_dynamic_calls"] = sum(ea.weight[e] for e in range(m) if not reasons[e])
    b = graph.binary
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "scheme": scheme,
        "binary": {"path": b.path, "build_id": b.build_id, "content_hash": b.content_hash},
        "identity": binary_identity(b),
        "nodes": nodes,
        "names": names,
        "acyc_op": acyc_op,
        "acyc_bits": acyc_bits,
        "acyc_words": acyc_words,
        "rec_code_bits": st.stats.get("rec_code_bits", 0),
        "reason_bits": dict(REASON_BITS),
        "site_columns": list(SITE_COLUMNS),
        "sites": rows,
        "probed": probed,
        "tables": st.tables,
        "report": report,
    }


# ---------------------------------------------------------------------------------------- cache
def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ccprofd"


def plan_path(cache_dir: str | os.PathLike[str], key: str) -> Path:
    return Path(cache_dir) / "plans" / f"{key}.json"


def save_plan(plan: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write atomically: a reader sees either the old file or the complete new one."""
    atomic_write_bytes(path, json.dumps(plan, separators=(",", ":")).encode())


def check_plan(plan: Mapping[str, Any]) -> None:
    if plan.get("format") != PLAN_FORMAT or plan.get("version") != PLAN_VERSION:
        raise PlanError(f"plan format {plan.get('format')!r} v{plan.get('version')!r}, "
                        f"expected {PLAN_FORMAT!r} v{PLAN_VERSION}")
    if plan.get("scheme") not in SCHEMES:
        raise PlanError(f"unknown scheme {plan.get('scheme')!r}")


def load_plan(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        plan = json.load(fh)
    check_plan(plan)
    return dict(plan)


MARSHAL_KIND = "plan-marshal"


SUM_KIND = "plan-sum"


def _load_cached(path: Path, key: str, base: str | os.PathLike[str]) -> dict[str, Any]:
    """The plan in ``path``; the JSON file is the cache entry, but parsing 4 MB of JSON is 2-3x
    slower than marshal, so a marshal copy of what was parsed is kept beside it in the analysis
    cache, used only while the JSON file is the very one it was made from (inode, size, mtime).
    The JSON file itself is read only when its SHA-256 is the one stored when it was written (a
    flipped digit still parses, as another plan): otherwise ValueError, and the plan is rebuilt."""
    from ccprofd.persist.cache import AnalysisCache

    st = os.stat(path)
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    side = AnalysisCache(Path(base))
    fast = side.load(MARSHAL_KIND, key)
    if isinstance(fast, dict) and fast.get("stamp") == stamp and isinstance(fast.get("plan"), dict):
        plan = dict(fast["plan"])
        check_plan(plan)
        return plan
    data = path.read_bytes()
    want = side.load(SUM_KIND, key)
    if not isinstance(want, dict) or want.get("sha256") != hashlib.sha256(data).hexdigest():
        raise ValueError(f"cached plan {path} does not match its checksum")
    plan = json.loads(data)
    check_plan(plan)
    plan = dict(plan)
    side.store(MARSHAL_KIND, key, {"stamp": stamp, "plan": plan})
    return plan


def store_plan(plan: Mapping[str, Any], base: str | os.PathLike[str]) -> None:
    """Put ``plan`` in the cache under ``base``: its JSON file (atomically) and, beside it in the
    analysis cache, the file's checksum (a file written without it is not trusted)."""
    from ccprofd.persist.cache import AnalysisCache

    data = json.dumps(plan, separators=(",", ":")).encode()
    atomic_write_bytes(plan_path(base, plan["key"]), data)
    AnalysisCache(Path(base)).store(SUM_KIND, plan["key"], {"sha256": hashlib.sha256(data).hexdigest()})


def at_path(plan: dict[str, Any], path: str) -> dict[str, Any]:
    """``plan`` naming the file at ``path``: a cached plan is shared by every copy of the same bytes
    (its key is their content), so the path it was first made for says nothing about this one."""
    plan["binary"] = {**plan["binary"], "path": path}
    return plan


def get_plan(graph: CallGraph, scheme: str, *, pcce_words: int = 1,
             weights: Mapping[EdgeKey, int] | None = None,
             cache_dir: str | os.PathLike[str] | None = None, use_cache: bool = True) -> dict[str, Any]:
    """The plan from the cache when one with the same key exists for a same-sized graph, else built
    and stored."""
    w = effective_weights(graph, weights)
    key = plan_key(graph.binary, scheme, _params(scheme, pcce_words, weights_hash(w)))
    base = cache_dir if cache_dir is not None else default_cache_dir()
    path = plan_path(base, key)
    if use_cache and path.exists():
        try:
            plan = _load_cached(path, key, base)
            rep = plan["report"]
            if (plan.get("key") == key and rep.get("nodes") == graph.number_of_nodes()
                    and rep.get("edges") == graph.number_of_edges()):
                return at_path(plan, graph.binary.path)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or stale: rebuild below
    plan = build_plan(graph, scheme, pcce_words=pcce_words, weights=w)
    if use_cache:
        with contextlib.suppress(OSError):  # a read-only cache directory: the plan is only not kept
            store_plan(plan, base)
    return plan
