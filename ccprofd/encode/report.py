"""Per-scheme statistics for ``ccprofd analyze --encoding {valence,pcce,hcce,all}``.

The keys follow the issue's "Reports" section and the paper's Table 1:

``acyclic_bits``        Table 1 "Acyclic Encoding Bits": PCCE: max ``ceil(log2 numCC(n))`` over the
                        graph without back edges; Valence/HCCE: max acycID length on the consolidated
                        graph (virtual-root edges count, dummy-root edges do not).
``rec_code_bits``       bits of one recID code (PCCE: of a back-edge code).
``coded_edges``         edges with a non-zero code.
``instrumented_edges``  edges probed for the encoding's own sake: non-zero acyclic codes plus every
                        cyclic (PCCE: back) edge.
``max_numcc``           PCCE/HCCE: the largest numCC including dummy-root edges (the id range).
``words_needed``        64-bit words the acyclic id needs; ``overflow``: more than ``pcce_words``.
Also: ``nodes``, ``edges``, ``sccs``, ``complex_sccs``, ``cyclic_edges``, ``back_edges`` (PCCE),
``id_bits``, ``build_seconds`` and, with weights, ``dynamic_calls`` / ``unprobed_dynamic_calls``
(calls the weights say would run through a site without a probe).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ccprofd.callgraph.model import CallGraph
from ccprofd.encode.edges import EdgeKey
from ccprofd.encode.plan import build_plan, get_plan

REPORT_SCHEMES = ("valence", "pcce", "hcce")
REPORT_KEYS = ("acyclic_bits", "rec_code_bits", "coded_edges", "instrumented_edges", "words_needed",
               "overflow")


def _expand(schemes: str | Iterable[str]) -> list[str]:
    names = [schemes] if isinstance(schemes, str) else list(schemes)
    out: list[str] = []
    for name in names:
        for s in (REPORT_SCHEMES if name == "all" else (name,)):
            if s not in out:
                out.append(s)
    return out


def encoding_report(graph: CallGraph, schemes: str | Iterable[str] = "all",
                    weights: Mapping[EdgeKey, int] | None = None, *, pcce_words: int = 1,
                    cache_dir: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{scheme: statistics}``; plans come from ``cache_dir`` when given, else are built fresh."""
    result: dict[str, dict[str, Any]] = {}
    for scheme in _expand(schemes):
        if cache_dir is None:
            plan = build_plan(graph, scheme, pcce_words=pcce_words, weights=weights)
        else:
            plan = get_plan(graph, scheme, pcce_words=pcce_words, weights=weights, cache_dir=cache_dir)
        result[scheme] = dict(plan["report"])
    return result
