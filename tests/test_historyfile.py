"""The on-disk flight-recorder history (ccprofd/daemon/historyfile.py): the bidirectional codes
give back exactly what was appended, walking forward from the start and backward from the end
(one step at a time, in place), through a save and a load; the file stays under its bound by
dropping the oldest events; garbage is refused in one line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ccprofd.daemon.historyfile import HistoryFileError, HistoryStore

M64 = (1 << 64) - 1


def events(n: int, seed: int) -> list[tuple[int, int, int, int, int, int]]:
    rnd = random.Random(seed)
    t = 1_700_000_000_000_000_000
    out = []
    for _ in range(n):
        t += rnd.choice((1, 700, 15_000, 10**9))
        out.append((t, rnd.choice((0, 1, 3, 257, 435)), rnd.randrange(5), rnd.choice((3, M64, 0xFFFFFFFF)),
                    rnd.getrandbits(64), rnd.randrange(4096)))
    return out


def test_forward_backward_and_save_load(tmp_path: Path) -> None:
    store = HistoryStore()
    want = {7: events(3000, 1), 8: events(1, 2)}
    for tid, evs in want.items():
        for t, nr, ctx, *args in evs:
            assert store.append(42, tid, t, nr, ctx, args)
    assert not store.append(42, 7, want[7][-1][0], 0, 0, [])  # not newer: already there
    path = tmp_path / "h" / "app.wet"
    store.save(path, 1 << 30)
    for s in (store, HistoryStore.load(path)):
        for tid, evs in want.items():
            th = s.threads[tid]
            assert list(th.events()) == evs
            c = th.cursor(at_end=True)
            back = [c.value()]
            while c.prev():
                back.append(c.value())
            assert back == evs[::-1]
            assert not c.prev() and c.index == 0
            # and forward again from the middle of the walk
            for _ in range(min(10, len(evs) - 1)):
                assert c.next()
            assert c.value() == evs[min(10, len(evs) - 1)]


def test_bounded_by_dropping_the_oldest(tmp_path: Path) -> None:
    store = HistoryStore()
    evs = events(20000, 3)
    for i, (t, nr, ctx, *args) in enumerate(evs):
        store.append(1, 10 + i % 3, t, nr, ctx, args)
    path = tmp_path / "app.wet"
    size = store.save(path, 20_000)
    assert size == path.stat().st_size <= 20_000
    kept = sorted(ev for th in HistoryStore.load(path).threads.values() for ev in th.events())
    assert 0 < len(kept) < len(evs) and kept == evs[-len(kept):]  # the newest, all of them


def test_garbage_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.wet"
    bad.write_bytes(b"hello")
    with pytest.raises(HistoryFileError, match="not a ccprofd history file"):
        HistoryStore.load(bad)
    bad.write_bytes(b"CCPWET1\nxx")
    with pytest.raises(HistoryFileError, match="corrupt"):
        HistoryStore.load(bad)
