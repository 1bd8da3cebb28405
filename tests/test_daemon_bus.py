"""The daemon's fan-out of live items to subscribers (ccprofd/daemon/bus.py): order, bounded queues
whose losses are counted per subscription and in total, filters applied before the queue (a
subscriber of one process is not crowded out by a busy target's other samples), waits."""

from __future__ import annotations

import threading
import time
from typing import Any

from ccprofd.daemon.bus import Bus, Subscription


def _items(n: int, pid: int = 1) -> list[dict[str, int]]:
    return [{"pid": pid, "n": i} for i in range(n)]


def _publish(bus: Bus, items: list[dict[str, int]]) -> int:
    return sum(bus.publish(item) for item in items)


def _drain(sub: Subscription) -> list[dict[str, Any]]:
    out = []
    while (item := sub.get(0)) is not None:
        out.append(item)
    return out


def test_items_reach_every_subscriber_in_order() -> None:
    bus = Bus(maxsize=100)
    a, b = bus.subscribe(), bus.subscribe()
    assert _publish(bus, _items(5)) == 0
    assert bus.publish({"pid": 1, "n": 5}) == 0
    assert [i["n"] for i in _drain(a)] == [0, 1, 2, 3, 4, 5]
    assert [i["n"] for i in _drain(b)] == [0, 1, 2, 3, 4, 5]
    assert bus.published == 6 and bus.dropped == 0


def test_a_full_queue_keeps_the_oldest_and_counts_the_rest() -> None:
    bus = Bus(maxsize=4)
    slow, fast = bus.subscribe(), bus.subscribe()
    assert _publish(bus, _items(3)) == 0
    assert [i["n"] for i in _drain(fast)] == [0, 1, 2]
    # slow still holds 3, so of the next 3 only one fits there; fast has room for all
    assert _publish(bus, [{"pid": 1, "n": n} for n in (3, 4, 5)]) == 2
    assert [i["n"] for i in _drain(slow)] == [0, 1, 2, 3]
    assert [i["n"] for i in _drain(fast)] == [3, 4, 5]
    assert (slow.dropped, fast.dropped, bus.dropped) == (2, 0, 2)


def test_a_filter_is_applied_before_the_queue() -> None:
    """A subscriber of one process is not crowded out by the others' items."""
    bus = Bus(maxsize=3)
    everything = bus.subscribe()
    mine = bus.subscribe(lambda item: item["pid"] == 7)
    lost = _publish(bus, [*_items(10, pid=1), {"pid": 7, "n": 99}, *_items(10, pid=1)])
    assert lost == 18  # all of everything's items past its 3
    assert [i["n"] for i in _drain(mine)] == [99] and mine.dropped == 0
    assert len(_drain(everything)) == 3 and everything.dropped == 18


def test_get_waits_for_an_item_and_times_out_without_one() -> None:
    bus = Bus()
    sub = bus.subscribe()
    t0 = time.monotonic()
    assert sub.get(0.05) is None
    assert time.monotonic() - t0 >= 0.04  # it waited (a lower bound, not a speed limit)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(sub.get(30)))
    waiter.start()
    time.sleep(0.05)
    _publish(bus, _items(2))
    waiter.join(timeout=30)
    assert got == [{"pid": 1, "n": 0}]
    assert sub.get(0) == {"pid": 1, "n": 1}


def test_a_closed_subscription_gets_nothing_more() -> None:
    bus = Bus()
    with bus.subscribe() as sub:
        assert bus.subscribers() == 1
    assert bus.subscribers() == 0 and sub.closed
    _publish(bus, _items(3))
    assert sub.get(0) is None and bus.dropped == 0




def test_get_batch_takes_what_is_queued_in_order_up_to_the_limit() -> None:
    bus = Bus(maxsize=100)
    sub = bus.subscribe()
    assert sub.get_batch(0.01, 10) == []  # nothing queued: waits, then none
    _publish(bus, _items(25))
    assert [i["n"] for i in sub.get_batch(0, 10)] == list(range(10))
    assert [i["n"] for i in sub.get_batch(0, 10)] == list(range(10, 20))
    assert [i["n"] for i in sub.get_batch(0, 10)] == list(range(20, 25))  # no wait for more
    assert sub.get_batch(0, 10) == []
    # the queue has room again for what a batch took
    assert _publish(bus, _items(100)) == 0 and sub.dropped == 0


def test_get_batch_returns_as_soon_as_one_item_comes() -> None:
    bus = Bus(maxsize=100)
    sub = bus.subscribe()
    threading.Timer(0.1, bus.publish, args=({"pid": 1, "n": 0},)).start()
    assert [i["n"] for i in sub.get_batch(30, 1000)] == [0]


def test_take_dropped_counts_each_loss_once() -> None:
    bus = Bus(maxsize=2)
    sub = bus.subscribe()
    assert _publish(bus, _items(5)) == 3
    assert sub.take_dropped() == 3 and sub.take_dropped() == 0
    assert len(sub.get_batch(0, 10)) == 2
    assert _publish(bus, _items(4)) == 2
    assert sub.take_dropped() == 2 and sub.dropped == 5
