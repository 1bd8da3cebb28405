"""What every exact decoder shares: plan loading into flat tables, segment handling, errors, cache.

Decoders read only the plan (never the call graph).  Everything a step needs is precomputed here
at load time into lists indexed by dense node index or site id, so that one step is a few list
lookups and shifts.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

from ccprofd.callgraph.model import ROOT
from ccprofd.encode.plan import COL, check_plan
from ccprofd.encode.segments import Edge, EncodedState, Segment


class DecodeError(ValueError):
    """The state cannot be the encoding of any context at that node: flagged, never guessed."""


class UnknownCaller(DecodeError):
    """A segment entered from outside code did not record the node its saved state belongs to.

    ``partial`` holds the decoded part of the path above that segment, outermost first.
    """

    def __init__(self, message: str, partial: list[Edge]) -> None:
        super().__init__(message)
        self.partial = partial


class StaleAboveSegment(DecodeError):
    """The state above a segment is not a valid encoding, though the path inside the innermost
    segment decoded.

    Why it happens: instrumented mode (no return probes) keeps a piece until a later event's frame
    lies above it or its return-address word is overwritten; code that runs after a return through
    unprobed edges, in frames that leave that word as it was, finds the dead piece still counted,
    and a segment saves the state with its bits.  The path inside the innermost segment was decoded
    from what was set after that segment started, so it stands; what is above is not known.
    ``partial`` is that inner path, outermost first.
    """

    def __init__(self, message: str, partial: list[Edge]) -> None:
        super().__init__(message)
        self.partial = partial


class BaseDecoder:
    """Flat site and node tables common to all schemes."""

    scheme = ""

    def __init__(self, plan: Mapping[str, Any]) -> None:
        check_plan(plan)
        if plan["scheme"] != self.scheme:
            raise DecodeError(f"{type(self).__name__} cannot decode a {plan['scheme']!r} plan")
        self.plan = plan
        self.nodes: list[int] = list(plan["nodes"])
        self.index: dict[int, int] = {n: i for i, n in enumerate(self.nodes)}
        self.root = self.index[ROOT]
        self._site_caller: dict[int, int] | None = None

    # Per-site tables, made at the first decode rather than when the daemon starts (62k sites of
    # python3.11: a tenth of a second of a warm start for nothing until a sample arrives).
    @cached_property
    def caller(self) -> list[int]:
        index, ci = self.index, COL["caller"]
        return [index[r[ci]] for r in self.plan["sites"]]

    @cached_property
    def callee(self) -> list[int]:
        index, ki = self.index, COL["callee"]
        return [index[r[ki]] for r in self.plan["sites"]]

    @cached_property
    def edge(self) -> list[Edge]:
        ci, ki, si = COL["caller"], COL["callee"], COL["site"]
        return [(r[ci], r[ki], r[si]) for r in self.plan["sites"]]

    # -------------------------------------------------------------------------------- helpers
    def dense(self, node: int) -> int:
        try:
            return self.index[node]
        except KeyError:
            raise DecodeError(f"node {node} is not in the plan") from None

    def segment_caller(self, seg: Segment, partial_rev: list[Edge]) -> int:
        """Dense index of the node below a segment: recorded, or the function holding its site."""
        if seg.caller is not None:
            return self.dense(seg.caller)
        if seg.site != -1:
            if self._site_caller is None:
                self._site_caller = {r[COL["site"]]: r[COL["caller"]] for r in self.plan["sites"]
                                     if r[COL["site"]]}
            node = self._site_caller.get(seg.site)
            if node is not None:
                return self.index[node]
        raise UnknownCaller(f"segment at site {seg.site:#x} into {seg.callee} has no known caller",
                            partial_rev[::-1])

    def decode(self, state: EncodedState, node: int) -> list[Edge]:
        """The call path ending at ``node``, outermost edge first.  A state that stops decoding above
        a segment raises :class:`StaleAboveSegment` with the path inside the innermost one."""
        out: list[Edge] = []  # innermost first, filled by _decode as it goes
        marks: list[int] = []  # len(out) before each segment's caller edge
        try:
            return self._decode(state, node, out, marks)
        except UnknownCaller:
            raise
        except DecodeError as exc:
            if not marks:
                raise
            raise StaleAboveSegment(str(exc), out[:marks[0]][::-1]) from None

    def _decode(self, state: EncodedState, node: int, out: list[Edge], marks: list[int]) -> list[Edge]:
        """The scheme's decoding: edges innermost first into ``out`` (returned outermost first)."""
        raise NotImplementedError

    def decode_acyclic(self, acyc: tuple[int, ...], node: int) -> list[Edge] | None:
        """``decode(EncodedState(acyc), node)`` for a state with no segment and no recID (the
        common, acyclic context) without making the state; None: the scheme has no such shortcut
        (the caller decodes the state)."""
        return None


def check_heights(segments: tuple[Segment, ...], height: int) -> None:
    """Segment heights must grow inwards and not exceed the live recID / stack height."""
    prev = 0
    for seg in segments:
        if seg.rec_height < prev:
            raise DecodeError("segment heights decrease inwards")
        prev = seg.rec_height
    if prev > height:
        raise DecodeError(f"segment height {prev} above the live height {height}")


class CachingDecoder:
    """Memoises decoded paths per (state, node); repeated contexts are the common case in profiles."""

    def __init__(self, decoder: BaseDecoder, max_entries: int = 1 << 16) -> None:
        self.decoder = decoder
        self.max_entries = max_entries
        self._cache: dict[tuple[EncodedState, int], tuple[Edge, ...]] = {}
        self.hits = 0
        self.misses = 0

    def decode_acyclic(self, acyc: tuple[int, ...], node: int) -> list[Edge] | None:
        """The decoder's own shortcut for an acyclic-only state, not cached: the walk costs less
        than making, hashing and keeping the state (None: no shortcut, use :meth:`decode`)."""
        return self.decoder.decode_acyclic(acyc, node)

    def decode(self, state: EncodedState, node: int) -> list[Edge]:
        key = (state, node)
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            return list(hit)
        self.misses += 1
        path = self.decoder.decode(state, node)
        if len(self._cache) >= self.max_entries:
            self._cache.clear()  # cheap bound; profiles re-warm it in one sampling period
        self._cache[key] = tuple(path)
        return path
