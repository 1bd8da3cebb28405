"""Calling-context encodings: Valence, PCCE, HCCE and the stack-tags baseline.

Input: a :class:`ccprofd.callgraph.model.CallGraph`.  Output: an *encoding plan* (a JSON-able dict,
see :mod:`ccprofd.encode.plan` for its schema), the single input of the BPF code generator and of
the decoders in :mod:`ccprofd.decode`.

Public API::

    build_plan(graph, scheme, *, pcce_words=1, weights=None) -> dict
        scheme in SCHEMES = ("valence", "pcce", "hcce", "stacktags"); weights maps
        (caller, callee, site key) -> call count (hot edges get the all-zero code).
    get_plan(graph, scheme, *, pcce_words=1, weights=None, cache_dir=None, use_cache=True) -> dict
        the same through the on-disk cache <cache_dir or ~/.cache/ccprofd>/plans/<key>.json,
        keyed by (build-id or content hash, scheme, parameters, weights hash, format version).
    save_plan(plan, path) / load_plan(path) / plan_key(binary, scheme, params)
    encoding_report(graph, schemes="all", weights=None, *, pcce_words=1, cache_dir=None)
        -> {scheme: {acyclic_bits, rec_code_bits, coded_edges, instrumented_edges, max_numcc
            (PCCE, HCCE), words_needed, overflow, nodes, edges, sccs, complex_sccs, cyclic_edges,
            id_bits, build_seconds, [dynamic_calls, unprobed_dynamic_calls]}}
    Encoder(plan)                     the probes' reference semantics for one thread:
        .call((caller, callee, site)), .ret(), .enter_from_outside(callee),
        .unencoded_call(site, callee), .unwind(frames), .state() -> EncodedState, .node, .depth
        (raises EncodingOverflow instead of wrapping a PCCE/HCCE id)
    EncodedState, Segment, OUTSIDE   the encoded state and ccStack records (segments.py)
    bits: ceil_log2, words_for_bits, get_bits, set_bits, word_ops, words_to_int, int_to_words
    stacktags: mix(tag, ident), unmix(tag, ident), function_id(node, name)

Decoding: ``ccprofd.decode.decoder_for(plan).decode(state, node) -> [(caller, callee, site), ...]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ccprofd.encode.plan import (
    PLAN_VERSION,
    SCHEMES,
    PlanError,
    build_plan,
    default_cache_dir,
    get_plan,
    load_plan,
    plan_key,
    save_plan,
)
from ccprofd.encode.segments import OUTSIDE, Edge, EncodedState, Segment

__all__ = [
    "OUTSIDE",
    "PLAN_VERSION",
    "SCHEMES",
    "Edge",
    "EncodedState",
    "Encoder",
    "EncodingOverflow",
    "PlanError",
    "Segment",
    "build_plan",
    "default_cache_dir",
    "encoding_report",
    "get_plan",
    "load_plan",
    "plan_key",
    "save_plan",
]

if TYPE_CHECKING:
    from ccprofd.encode.machine import Encoder, EncodingOverflow
    from ccprofd.encode.report import encoding_report

# Imported at first use (module __getattr__): the encoder and the report are not needed to load a
# cached plan, which every trace start-up does.
_LAZY = {"Encoder": "ccprofd.encode.machine", "EncodingOverflow": "ccprofd.encode.machine",
         "encoding_report": "ccprofd.encode.report"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
