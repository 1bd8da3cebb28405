"""KernelCounts' bound for tracers that never take counts (issue 16: bounded memory), and when the
daemon reads the kernel's counts map."""

from __future__ import annotations

from typing import Any

from ccprofd.tracing import kernelcounts
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


def test_the_map_is_read_at_every_poll_but_at_most_every_interval_under_a_flood(monkeypatch: Any) -> None:
    """A flood (records came, the poll may wait) reads the map at most every COUNTS_READ_S; an idle
    poll or a last read always reads it, so counts are never left in the kernel at the end."""
    now = [1000.0]
    monkeypatch.setattr(kernelcounts.time, "monotonic", lambda: now[0])
    k: KernelCounts[int] = KernelCounts()
    assert k.read_due(flooding=True)  # the first read
    assert not k.read_due(flooding=True)
    now[0] += kernelcounts.COUNTS_READ_S / 2
    assert not k.read_due(flooding=True)
    assert k.read_due(flooding=False) and k.read_due(flooding=False)  # idle or last: always
    assert not k.read_due(flooding=True)  # (the idle read above counts as the last read)
    now[0] += kernelcounts.COUNTS_READ_S
    assert k.read_due(flooding=True) and not k.read_due(flooding=True)
