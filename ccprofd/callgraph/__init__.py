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
from typing import TYPE_CHECKING

from .cache import AnalysisCache
from .elfimage import ElfImage
from .errors import BinaryError
from .model import ROOT, BinaryInfo, CallGraph, CallSite
from .stats import graph_stats

if TYPE_CHECKING:
    from .analysis import Progress

__all__ = ["ROOT", "AnalysisCache", "BinaryError", "BinaryInfo", "CallGraph", "CallSite", "analyze_binary",
           "cache_key", "graph_stats"]


def cache_key(image: ElfImage) -> str:
    ident = image.build_id() or f"sha256-{image.content_hash}"
    return f"{ident}-{len(image.data)}-{'sym' if image.has_symtab else 'nosym'}"


def analyze_binary(path: str | os.PathLike[str], *, cache_dir: Path | None = None, use_cache: bool = True,
                   progress: Progress | None = None) -> CallGraph:
    """Analyse one x86-64 ELF object; reuse the cached result for the same build."""
    image = ElfImage(os.fspath(path))
    cache = AnalysisCache(cache_dir) if use_cache else None
    key = cache_key(image)
    if cache is not None:
        cached = cache.load("callgraph", key)
        if isinstance(cached, dict):
            graph = CallGraph.from_dict(cached["graph"])
            graph.binary.path = image.path
            graph.cached_stats = cached["stats"]
            graph.from_cache = True
            return graph
    from .analysis import analyze_image  # capstone & co.: not needed when the cache has the graph

    graph = analyze_image(image, progress)
    if cache is not None:
        stats = graph_stats(graph)
        cache.store("callgraph", key, {"graph": graph.to_dict(), "stats": stats})
        graph.cached_stats = stats  # computed once, whether the caller reads them or not
    return graph
