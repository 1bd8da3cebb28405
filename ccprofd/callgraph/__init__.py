"""ELF -> call graph.

Public API::

    analyze_binary(path, *, cache_dir=None, use_cache=True, progress=None) -> CallGraph
    graph_stats(graph) -> dict            # the `ccprofd analyze --json` statistics
    BinaryError                           # bad input (exit status 2)

See :mod:`ccprofd.callgraph.model` for the graph's node and edge attributes.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
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

    A cache hit reads the summary entry only: neither pyelftools nor capstone nor networkx is
    imported (the file's bytes equal those of a file analysed, so checked, before), and a file
    whose identity is remembered (:func:`_known_key`) is not even read or hashed again."""
    abspath = os.path.abspath(path)
    cache = AnalysisCache(cache_dir) if use_cache else None
    if cache is not None:
        known = _known_key(cache, os.fspath(path))
        if known is not None:
            graph = _summary_hit(cache, known, abspath)
            if graph is not None:
                return graph
    before = _stat_or_none(os.fspath(path))
    data = read_elf_file(os.fspath(path))
    digest = hashlib.sha256(data).hexdigest()  # the cache key's and the image's: hashed once
    key = cache_key_of(data, digest) if cache is not None else ""
    if cache is not None:
        _remember_key(cache, os.fspath(path), before, key)
        graph = _summary_hit(cache, key, abspath)
        if graph is not None:
            return graph
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

    graph = analyze_image(ElfImage(os.fspath(path), data, digest), progress)
    del data
    if cache is not None:
        stats = graph_stats(graph)
        cache.store("callgraph", key, {"graph": graph.to_dict(), "stats": stats})
        _store_summary(cache, key, graph, stats)
        graph.cached_stats = stats  # computed once, whether the caller reads them or not
    return graph


def _summary_hit(cache: AnalysisCache, key: str, abspath: str) -> CallGraph | None:
    """The graph of ``key`` from its summary entry (rows read only when asked for); None: no valid one."""
    summary = cache.load(SUMMARY_KIND, key)
    if isinstance(summary, dict) and summary.get("stamp") == _stamp(cache, key):
        try:
            graph = CallGraph.deferred(summary["graph"], lambda: _rows_of(cache, key, abspath, summary))
            graph.binary.path = abspath
            graph.cached_stats = summary["stats"]
            graph.from_cache = True
            return graph
        except (KeyError, TypeError, ValueError):
            pass  # a damaged summary: the caller reads the full entry, which rewrites it
    return None


# ---------------------------------------------------------------------------- remembered identities
# Reading and hashing the file was most of a cache hit (node: 99 MB read and SHA-256'd, ~0.2 s).
# So the content key is remembered per file, as git's index and ccache's direct mode do, under the
# file's (device, inode) with its (size, mtime, ctime): any write to the file, chmod, rename over it
# or a new file at a reused inode sets ctime to the current time, which no caller can set back
# (utimensat sets mtime, never ctime).  A file changed in the same clock tick as it was read could
# keep its stat, so a file is only remembered once it had been left alone for RACY_NS before it was
# read (git's "racy" rule); a file changed since is read and hashed as before.
IDENTITY_KIND = "file-identity"
RACY_NS = 2_000_000_000


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _identity(st: os.stat_result) -> tuple[str, list[int]]:
    return f"{st.st_dev:x}-{st.st_ino:x}", [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _known_key(cache: AnalysisCache, path: str) -> str | None:
    """The content key remembered for the file at ``path`` if its stat is the remembered one."""
    st = _stat_or_none(path)
    if st is None:
        return None
    where, what = _identity(st)
    entry = cache.load(IDENTITY_KIND, where)
    if isinstance(entry, dict) and entry.get("stat") == what and isinstance(entry.get("key"), str):
        return str(entry["key"])
    return None


def _remember_key(cache: AnalysisCache, path: str, before: os.stat_result | None, key: str) -> None:
    """Remember ``key`` for the file read between ``before`` and now, if it was left alone for
    :data:`RACY_NS` before being read and did not change while it was read."""
    after = _stat_or_none(path)
    if before is None or after is None:
        return
    where, what = _identity(before)
    if _identity(after) != (where, what):
        return
    if time.time_ns() - max(before.st_mtime_ns, before.st_ctime_ns) <= RACY_NS:
        return
    if cache.load(IDENTITY_KIND, where) != {"stat": what, "key": key}:
        cache.store(IDENTITY_KIND, where, {"stat": what, "key": key})


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
