"""ELF -> call graph.

Public API::

    analyze_binary(path, *, cache_dir=None, use_cache=True, progress=None) -> CallGraph
    graph_stats(graph) -> dict            # the `ccprofd analyze --json` statistics
    BinaryError                           # bad input (exit status 2)

See :mod:`ccprofd.callgraph.model` for the graph's node and edge attributes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ccprofd.callgraph.model import ROOT, BinaryInfo, CallGraph, CallSite
from ccprofd.callgraph.stats import graph_stats
from ccprofd.elf.errors import BinaryError
from ccprofd.elf.identity import cache_key_of, read_elf_file
from ccprofd.persist.cache import AnalysisCache

if TYPE_CHECKING:
    from ccprofd.callgraph.analysis import Progress
    from ccprofd.elf.image import ElfImage

__all__ = ["ROOT", "AnalysisCache", "BinaryError", "BinaryInfo", "CallGraph", "CallSite", "analyze_binary",
           "cache_key", "graph_stats"]


def cache_key(image: ElfImage) -> str:
    """The analysis cache key of ``image`` (see :func:`ccprofd.elf.identity.cache_key_of`)."""
    return cache_key_of(image.data)


def analyze_binary(path: str | os.PathLike[str], *, cache_dir: Path | None = None, use_cache: bool = True,
                   progress: Progress | None = None) -> CallGraph:
    """Analyse one x86-64 ELF object; reuse the cached result for the same build.

    A cache hit reads the file and its summary entry only: neither pyelftools nor capstone nor
    networkx is imported (the file's bytes equal those of a file analysed, so checked, before)."""
    data = read_elf_file(os.fspath(path))
    abspath = os.path.abspath(path)
    cache = AnalysisCache(cache_dir) if use_cache else None
    key = cache_key_of(data) if cache is not None else ""
    if cache is not None:
        summary = cache.load(SUMMARY_KIND, key)
        if isinstance(summary, dict) and summary.get("stamp") == _stamp(cache, key):
            try:
                graph = CallGraph.deferred(summary["graph"], lambda: _rows_of(cache, key, abspath, summary))
                graph.binary.path = abspath
                graph.cached_stats = summary["stats"]
                graph.from_cache = True
                return graph
            except (KeyError, TypeError, ValueError):
                pass  # a damaged summary: the full entry below, which rewrites it
        cached = cache.load("callgraph", key)
        if isinstance(cached, dict):
            graph = CallGraph.from_dict(cached["graph"])
            graph.binary.path = abspath
            graph.cached_stats = cached["stats"]
            graph.from_cache = True
            _store_summary(cache, key, graph, cached["stats"])
            return graph
    from ccprofd.callgraph.analysis import analyze_image
    from ccprofd.elf.image import ElfImage

    graph = analyze_image(ElfImage(os.fspath(path), data), progress)
    del data
    if cache is not None:
        stats = graph_stats(graph)
        cache.store("callgraph", key, {"graph": graph.to_dict(), "stats": stats})
        _store_summary(cache, key, graph, stats)
        graph.cached_stats = stats  # computed once, whether the caller reads them or not
    return graph


#: A small entry beside each cached graph: identity, node/edge counts, whether edges are weighted.
#: A warm daemon start takes its plans from the cache keyed by these alone, so the graph's rows
#: (5-6 MB for python3.11) are read only if a later stage asks for the graph itself.
SUMMARY_KIND = "callgraph-summary"


def _stamp(cache: AnalysisCache, key: str) -> tuple[int, int, int] | None:
    """The graph entry's (inode, size, mtime): a summary only stands for the very file it was made
    with (a rewritten or damaged entry is read in full again, and so found out at once)."""
    try:
        st = os.stat(cache.path_for("callgraph", key))
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _store_summary(cache: AnalysisCache, key: str, graph: CallGraph, stats: Any) -> None:
    stamp = _stamp(cache, key)
    if stamp is not None:
        cache.store(SUMMARY_KIND, key, {"graph": graph.summary(), "stats": stats, "stamp": stamp})


def _rows_of(cache: AnalysisCache, key: str, path: str, summary: dict[str, Any]) -> dict[str, Any]:
    """The rows of a deferred cached graph: from the cache, or analysed again if the entry went
    missing or was damaged since (the analysis is deterministic, so the counts must agree)."""
    cached = cache.load("callgraph", key)
    rows = cached.get("graph") if isinstance(cached, dict) else None
    if not isinstance(rows, dict) or rows.get("format") != summary["graph"]["format"]:
        from ccprofd.callgraph.analysis import analyze_image
        from ccprofd.elf.image import ElfImage

        rows = analyze_image(ElfImage(path)).to_dict()
    if (len(rows["nodes"]), len(rows["edges"])) != (summary["graph"]["nodes"], summary["graph"]["edges"]):
        raise ValueError(f"cached call graph of {path} does not match its summary; clear the cache")
    return rows
