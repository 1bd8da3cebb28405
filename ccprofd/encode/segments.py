"""Encoded calling-context state, including segments (DACCE's ccStack idea).

A *segment* is pushed where encoding cannot follow the static graph: entry from code ccprofd did
not analyse (callbacks, thread starts, signal handlers) or an edge the graph does not have (an
indirect call whose target was not known, possibly closing a cycle the graph does not know).  It
saves the current ``acycID``/id words and the ``recID`` height, then encoding restarts at the
callee as if it were a root.  Decoding never pops ``recID`` below a segment's height and continues
below the segment from the saved state.  DACCE pushes ``<id, callsite, target>`` and resets ``id``;
here the record also keeps the ``recID`` height because Valence's recID is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

from ccprofd.encode.bits import words_for_bits

OUTSIDE = -1  # the call-site value of a segment entered from outside code (and of its path edge)

# A call-path step: (caller node, callee node, call-site vaddr).  Root edges have site 0, segments
# entered from outside code have site OUTSIDE.
Edge = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Segment:
    """One ccStack entry."""

    saved: tuple[int, ...]  # acycID (Valence) / id (PCCE, HCCE) words before the entry
    rec_height: int  # recID length in bits (Valence, HCCE) or PCCE back-edge stack depth
    site: int  # call-site vaddr, or OUTSIDE
    callee: int  # node where encoding restarted
    caller: int | None = None  # node the saved state belongs to; None: derive from ``site``


@dataclass(slots=True, unsafe_hash=True)  # immutable by use; a frozen __init__ costs 3x (one per new context)
class EncodedState:
    """Everything the probes maintain for one thread; hashable so decoders can cache on it.

    ``acyc``: acycID (Valence) or id (PCCE, HCCE) as little-endian 64-bit words.
    ``rec``/``rec_len``: recID as a bit string; the most recent code occupies the highest bits.
    ``pairs``: PCCE's back-edge stack of (saved id words, back-edge code), innermost last.
    ``segments``: ccStack, innermost last.  ``tag``: stack-tags value.
    """

    acyc: tuple[int, ...] = ()
    rec: int = 0
    rec_len: int = 0
    pairs: tuple[tuple[tuple[int, ...], int], ...] = ()
    segments: tuple[Segment, ...] = ()
    tag: int = 0

    def context_words(self) -> int:
        """Context length in 64-bit words as every report counts it: acycID words + recID bits
        rounded up to words + 2 words per segment (PCCE's stack counts its saved id words plus one
        word of back-edge code per entry)."""
        pcce = sum(len(saved) + 1 for saved, _ in self.pairs)
        return len(self.acyc) + words_for_bits(self.rec_len) + pcce + 2 * len(self.segments)
