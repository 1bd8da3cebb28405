"""KernelCounts' bound for tracers that never take counts (issue 16: bounded memory)."""

from __future__ import annotations

from ccprofd.tracing.base import _remember
from ccprofd.tracing.frames import Decoded
from ccprofd.tracing.kernelcounts import KernelCounts


def test_learn_bounded_keeps_the_newest_contexts_and_counts_hits_of_forgotten_ones_as_lost() -> None:
    counts: KernelCounts[int] = KernelCounts()
    for key in range(5):
        counts.learn_bounded(key, f"d{key}", 3)
    counts.learn_bounded(3, "again", 3)  # known: the first decoded stands, nothing forgotten
    assert counts.forgotten == 2
    assert [counts.hit(k) for k in (2, 3, 4)] == ["d2", "d3", "d4"]
    assert counts.lost == 0
    assert counts.hit(0) is None and counts.hit(1) is None
    assert counts.lost == 2


def test_remember_keeps_the_last_samples_sent_on_their_own() -> None:
    from collections import deque

    from ccprofd.tracing import base

    recent: dict[tuple[int, int], Decoded] = {}
    order: deque[tuple[int, int]] = deque()
    d = Decoded([], True)
    n = base.RECENT_PLAIN + 10
    for t in range(n):
        _remember(recent, order, (1, t), d)
    assert len(recent) == len(order) == base.RECENT_PLAIN
    assert min(k[1] for k in recent) == 10 and max(k[1] for k in recent) == n - 1
