"""Exact decoders of encoded calling contexts (and the stack-tag candidate search).

``decoder_for(plan)`` compiles a plan's tables once; ``decoder.decode(state, node)`` returns the call
path ending at ``node`` as ``[(caller, callee, call site), ...]`` outermost first (root edges have
site 0, entries from outside code site ``OUTSIDE`` = -1), or raises :class:`DecodeError` when the
state is not a valid encoding.  Wrap in :class:`CachingDecoder` for repeated contexts, or call
:func:`decode`, which keeps a cached decoder per plan object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ccprofd.decode.common import BaseDecoder, CachingDecoder, DecodeError, StaleAboveSegment, UnknownCaller
from ccprofd.decode.valence import ValenceDecoder
from ccprofd.encode.segments import Edge, EncodedState

__all__ = ["BaseDecoder", "CachingDecoder", "DecodeError", "HcceDecoder", "PcceDecoder", "StackTagDecoder",
           "StaleAboveSegment", "TagCandidates", "UnknownCaller", "ValenceDecoder", "decode", "decoder_for"]

if TYPE_CHECKING:
    from ccprofd.decode.pcce import HcceDecoder, PcceDecoder
    from ccprofd.decode.stacktags import StackTagDecoder, TagCandidates

# The other schemes' decoders are imported at first use (module __getattr__, decoder_for): a
# trace (Valence) imports this package at every start-up.
_LAZY = {"HcceDecoder": "ccprofd.decode.pcce", "PcceDecoder": "ccprofd.decode.pcce",
         "StackTagDecoder": "ccprofd.decode.stacktags", "TagCandidates": "ccprofd.decode.stacktags"}
_SCHEME_CLASS = {"valence": "ValenceDecoder", "pcce": "PcceDecoder", "hcce": "HcceDecoder"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
_COMPILED: dict[int, CachingDecoder] = {}


def decoder_for(plan: Mapping[str, Any]) -> BaseDecoder:
    """The exact decoder of the plan's scheme (stack tags have :class:`StackTagDecoder` instead)."""
    name = _SCHEME_CLASS.get(plan.get("scheme", ""))
    if name is None:
        raise DecodeError(f"no exact decoder for scheme {plan.get('scheme')!r}")
    cls: type[BaseDecoder] = ValenceDecoder if name == "ValenceDecoder" else __getattr__(name)
    return cls(plan)


def decode(plan: Mapping[str, Any], state: EncodedState, node: int) -> list[Edge]:
    """Decode with a cached decoder for this plan object (compiled on first use)."""
    cached = _COMPILED.get(id(plan))
    if cached is None or cached.decoder.plan is not plan:
        if len(_COMPILED) > 8:
            _COMPILED.clear()
        cached = _COMPILED[id(plan)] = CachingDecoder(decoder_for(plan))
    return cached.decode(state, node)
