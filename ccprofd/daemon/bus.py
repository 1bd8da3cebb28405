"""Fan-out of live items (decoded samples, alerts) to streaming subscribers.

Each subscriber gets a bounded queue; a subscriber that does not keep up loses items, and the loss
is counted (per subscription and in total) instead of slowing down the producer — the daemon's
sample path must never block on a gRPC client.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

Item = dict[str, Any]


class Subscription:
    """A bounded queue of items accepted by ``accept``; iterate with :meth:`get`."""

    def __init__(self, bus: Bus, accept: Callable[[Item], bool], maxsize: int) -> None:
        self._bus = bus
        self.accept = accept
        self.queue: queue.Queue[Item] = queue.Queue(maxsize)
        self.dropped = 0
        self._reported = 0
        self.closed = False

    def get(self, timeout: float) -> Item | None:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_batch(self, timeout: float, limit: int) -> list[Item]:
        """Every queued item (at most ``limit``), waiting up to ``timeout`` for the first: a
        consumer that sends many items per message returns at once with what there is."""
        first = self.get(timeout)
        if first is None:
            return []
        items = [first]
        q = self.queue
        with q.mutex:  # one lock for the lot, not one per item: the producer takes it at every put
            while q.queue and len(items) < limit:
                items.append(q.queue.popleft())
            q.not_full.notify(len(items) - 1)
        return items

    def take_dropped(self) -> int:
        """Items dropped (queue full) since the previous call."""
        dropped, self._reported = self.dropped - self._reported, self.dropped
        return dropped

    def close(self) -> None:
        self.closed = True
        self._bus.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Bus:
    def __init__(self, maxsize: int = 10000) -> None:
        self.maxsize = maxsize
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()
        self.published = 0
        self.dropped = 0

    def subscribe(self, accept: Callable[[Item], bool] | None = None) -> Subscription:
        sub = Subscription(self, accept or (lambda _item: True), self.maxsize)
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def subscribers(self) -> int:
        # No lock: asked for every sample, and a list's length is read atomically; a subscriber
        # added meanwhile is seen at the next sample, as it would be right after the lock.
        return len(self._subs)

    def publish(self, item: Item) -> int:
        """Offer ``item`` to every accepting subscriber; returns how many queues were full."""
        lost = 0
        with self._lock:
            subs = list(self._subs)
            self.published += 1
        for sub in subs:
            if not sub.accept(item):
                continue
            try:
                sub.queue.put_nowait(item)
            except queue.Full:
                sub.dropped += 1
                lost += 1
        if lost:
            with self._lock:
                self.dropped += lost
        return lost
