"""The on-disk flight-recorder history (ccprofd/daemon/historyfile.py): the bidirectional codes
give back exactly what was appended, walking forward from the start and backward from the end
(one step at a time, in place), through a save and a load; the file stays under its bound by
dropping the oldest events; garbage is refused in one line."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ccprofd.daemon.historyfile import MAGIC, HistoryFileError, HistoryStore

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


# ------------------------------------------------------------------ reading it: ccprofd history FILE
def saved(tmp_path: Path) -> tuple[Path, dict[int, list[tuple[int, int, int, int, int, int]]]]:
    """A file with two threads of pid 42 (contexts 0..4 in its table) and what they hold."""
    store = HistoryStore()
    for k in range(5):
        store.context_index(k % 2 == 0, [{"function": "main", "analysed": True},
                                         {"function": f"f{k}", "analysed": True}])
    want = {7: events(400, 11), 8: events(30, 12)}
    for tid, evs in want.items():
        for t, nr, ctx, *args in evs:
            store.append(42, tid, t, nr, ctx, args)
    path = tmp_path / "app.wet"
    store.save(path, 1 << 30)
    return path, want


def test_walk_selects_in_both_directions(tmp_path: Path) -> None:
    from ccprofd.daemon.historyread import Selection, walk

    path, want = saved(tmp_path)
    th = HistoryStore.load(path).threads[7]
    evs = want[7]
    assert list(walk(th, Selection())) == evs
    assert list(walk(th, Selection(reverse=True))) == evs[::-1]
    assert list(walk(th, Selection(last=5))) == evs[-5:]
    assert list(walk(th, Selection(last=5, reverse=True))) == evs[::-1][:5]
    lo, hi = evs[100][0], evs[199][0]
    assert list(walk(th, Selection(since=lo, until=hi))) == evs[100:200]
    assert list(walk(th, Selection(since=lo, until=hi, reverse=True))) == evs[100:200][::-1]
    assert list(walk(th, Selection(until=hi, last=3))) == evs[197:200]
    assert list(walk(th, Selection(since=lo, until=hi, last=500))) == evs[100:200]
    assert list(walk(th, Selection(since=lo, until=hi, last=3, reverse=True))) == evs[197:200][::-1]
    assert list(walk(th, Selection(until=evs[0][0] - 1))) == []
    assert list(walk(th, Selection(since=evs[-1][0] + 1, reverse=True))) == []


def run_history(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli", "history", *args], capture_output=True,
                          text=True, timeout=120)


def test_ccprofd_history_text_and_json(tmp_path: Path) -> None:
    path, want = saved(tmp_path)
    out = run_history(str(path), "--tid", "8", "--last", "2", "--reverse")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["pid 42 (target app, persisted): 1 threads", "  tid 8: 2 syscalls, newest first"]
    for line, (t, _nr, ctx, *_args) in zip(lines[2:], want[8][::-1][:2], strict=True):
        assert line.startswith(f"    {t} ") and line.endswith(f": main > f{ctx}"), line
        assert ("[incomplete]" in line) == (ctx % 2 == 1)
    out = run_history(str(path), "--format", "json", "--pid", "42")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["source"] == "persisted" and got["target"] == "app"
    assert {t["tid"]: [e["time_ns"] for e in t["events"]] for t in got["threads"]} == \
        {tid: [e[0] for e in evs] for tid, evs in want.items()}


@pytest.mark.parametrize("args, message", [
    (["--tid", "9"], "no thread 9"), (["--pid", "43"], "no process 43"),
    (["--since", "yesterday"], "expected epoch seconds"), (["--last", "0"], "positive integer")])
def test_ccprofd_history_bad_input(tmp_path: Path, args: list[str], message: str) -> None:
    path, _ = saved(tmp_path)
    out = run_history(str(path), *args)
    assert out.returncode == 2 and out.stdout == "" and message in out.stderr
    assert "Traceback" not in out.stderr


def test_ccprofd_history_not_a_file_or_missing(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("hello\n")
    for name, message in (("x", "not a ccprofd history file"), ("missing.wet", "cannot read")):
        out = run_history(str(tmp_path / name))
        assert out.returncode == 2 and out.stdout == "", out
        assert len(out.stderr.splitlines()) == 1 and message in out.stderr


def test_truncated_or_corrupt_files_are_refused_in_one_line(tmp_path: Path) -> None:
    """Property: a real file cut at any offset, or with a byte changed, either loads and walks
    (both ways) or is a HistoryFileError -- never another exception."""
    from ccprofd.daemon.historyread import Selection, select_threads, thread_events

    path, _ = saved(tmp_path)
    data = path.read_bytes()
    rnd = random.Random(5)
    cuts = sorted({*rnd.sample(range(len(data)), min(300, len(data))), 0, 1, 8, 9, len(data) - 1})
    bad = tmp_path / "bad.wet"
    variants = [data[:n] for n in cuts]
    for _ in range(300):
        i = rnd.randrange(len(data))
        variants.append(data[:i] + bytes([data[i] ^ (1 << rnd.randrange(8))]) + data[i + 1:])
    refused = 0
    for v in variants:
        bad.write_bytes(v)
        try:
            store = HistoryStore.load(bad)
            for th in select_threads(store):
                thread_events(store, th, Selection())
                thread_events(store, th, Selection(reverse=True))
        except HistoryFileError:
            refused += 1
    assert refused >= len(cuts)  # every truncation is refused (zlib's stream end and checksum)
    # and through the command: exit 2 with one line
    bad.write_bytes(data[:len(data) // 2])
    out = run_history(str(bad))
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and "corrupt" in out.stderr


def test_a_decompressed_body_with_wrong_counts_is_refused(tmp_path: Path) -> None:
    """A body zlib accepts but whose header promises more codes than the streams hold (or leaves
    bytes over) would make a cursor read past its stream: refused at load."""
    path, _ = saved(tmp_path)
    body = bytearray(zlib.decompress(path.read_bytes()[len(MAGIC):]))
    for change in (lambda b: b + b"\x00", lambda b: b[:-1]):
        path.write_bytes(MAGIC + zlib.compress(bytes(change(body))))
        with pytest.raises(HistoryFileError, match="corrupt"):
            HistoryStore.load(path)


def test_get_history_fallback_reads_the_file(tmp_path: Path) -> None:
    """The daemon's fallback (service.persisted_history): a pid is its threads, a tid its thread,
    ``last`` the latest; a pid the file lacks, an absent or a corrupt file: None (not an error)."""
    from ccprofd.daemon.service import persisted_history

    path, want = saved(tmp_path)
    got = persisted_history(path, 42, 0)
    assert got is not None and got["source"] == "persisted"
    assert {t["tid"]: [e["time_ns"] for e in t["events"]] for t in got["threads"]} == \
        {tid: [e[0] for e in evs] for tid, evs in want.items()}
    one = persisted_history(path, 8, 3)
    assert one is not None and [t["tid"] for t in one["threads"]] == [8]
    assert [e["time_ns"] for e in one["threads"][0]["events"]] == [e[0] for e in want[8][-3:]]
    assert persisted_history(path, 43, 0) is None
    assert persisted_history(tmp_path / "absent.wet", 42, 0) is None
    path.write_bytes(path.read_bytes()[:100])
    assert persisted_history(path, 42, 0) is None


def test_time_arguments() -> None:
    """--since/--until TIME: epoch seconds (2025-11-25T23:12:25Z is 1764112345 by `date -u -d`),
    nanoseconds as printed, ISO 8601 (UTC unless it says); anything else is a usage error."""
    import argparse

    from ccprofd.cli.history import _time

    ns = 1764112345 * 10**9
    assert _time("1764112345") == _time(str(ns)) == _time("2025-11-25T23:12:25") == ns
    assert _time("1764112345.000000123") == ns + 123
    assert _time("2025-11-26T00:12:25+01:00") == ns
    for bad in ("yesterday", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            _time(bad)
