"""persist/cache.py: an entry is written as a stream of bounded marshal pieces (issue #18: one
marshal.dumps of node's ~50 MB call graph doubled its buffer on top of the rows and pushed the
peak RSS of `ccprofd analyze /usr/bin/node` past 500 MB), read back exactly, and checked: any
flipped byte or a truncation is a miss with one warning line."""

from __future__ import annotations

import logging
import marshal
from pathlib import Path
from typing import Any

import pytest

from ccprofd.persist import cache as cache_mod
from ccprofd.persist.cache import MAGIC, AnalysisCache


def same(a: Any, b: Any) -> bool:
    """Equal *and* of the same types all the way down: ``==`` alone accepts True for 1 and 1.0
    for 1; dict key order is compared too."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) and type(k) is type(kb)
                                          for k, kb in zip(a, b, strict=True))
    return bool(a == b)


def sample(n: int) -> dict[str, Any]:
    rows = [[i, f"f{i}", "func", 0x1000 + i, 16, (f"a{i}",), i % 2 == 0, None, [i, 1.5]] for i in range(n)]
    return {
        "graph": {"format": 3, "nodes": rows, "edges": tuple((i, i + 1, b"\x00\xff" * 3) for i in range(n)),
                  "sites": [], "small": (1, 2.5, None, True, b"x")},
        "stats": {"n": n, "names": {f"k{i}": (i, [i]) for i in range(n)}},
        "pairs": [list(range(n)), tuple(range(n)), "tail"],
        "deep": {"a": {"b": {"c": {"d": list(range(n))}}}},
        "empty": [[], (), {}, b""],
        7: frozenset({1, 2}),
    }


@pytest.mark.parametrize("chunk", [1, 3, 8, 4096])
def test_round_trip_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(cache_mod, "CHUNK", chunk)
    for value in (sample(50), sample(0), [], (), {}, 5, None, b"raw", list(range(chunk * 3 + 1)),
                  tuple(range(chunk + 1)), [tuple(range(chunk + 1))], {"x": list(range(chunk + 2))}):
        c = AnalysisCache(tmp_path)
        c.store("k", "key", value)
        got = c.load("k", "key")
        assert same(got, value), value


def test_store_never_marshals_the_whole_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of the stream: the largest single marshal output stays a small part of the entry
    (before, the whole value was one marshal.dumps, so the largest output was all of it)."""
    value = sample(40000)
    whole = len(marshal.dumps(value))
    sizes: list[int] = []
    real = marshal.dumps

    def spy(obj: Any, *args: Any) -> bytes:
        out = real(obj, *args)
        sizes.append(len(out))
        return out

    monkeypatch.setattr(cache_mod.marshal, "dumps", spy)
    c = AnalysisCache(tmp_path)
    c.store("k", "key", value)
    monkeypatch.setattr(cache_mod.marshal, "dumps", real)
    assert sizes and max(sizes) < whole / 8, (max(sizes), whole)
    assert same(c.load("k", "key"), value)


def frames(raw: bytes) -> list[tuple[int, int]]:
    """(start, end) of each frame (length field + piece) in an entry, parsed here independently."""
    out, pos, end = [], len(MAGIC), len(raw) - 32
    while pos < end:
        size = int.from_bytes(raw[pos:pos + 8], "little")
        out.append((pos, pos + 8 + size))
        pos += 8 + size
    assert pos == end
    return out


def test_any_flipped_byte_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cache_mod, "CHUNK", 4)
    c = AnalysisCache(tmp_path)
    value = sample(20)
    c.store("k", "key", value)
    path = c.path_for("k", "key")
    raw = path.read_bytes()
    fr = frames(raw)
    assert len(fr) > 20  # really split
    positions = {0, len(MAGIC) - 1, len(raw) - 1, len(raw) - 32}
    for start, end in fr:
        positions |= {start, start + 3, start + 8, (start + 8 + end) // 2, end - 1}
    for pos in sorted(positions):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        path.write_bytes(bytes(bad))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ccprofd"):
            assert c.load("k", "key") is None, pos
        assert len(caplog.records) == 1 and "damaged" in caplog.records[0].getMessage(), pos
    path.write_bytes(raw)
    assert same(c.load("k", "key"), value)


def test_truncated_or_extended_file_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cache_mod, "CHUNK", 4)
    c = AnalysisCache(tmp_path)
    c.store("k", "key", sample(20))
    path = c.path_for("k", "key")
    raw = path.read_bytes()
    cuts = {0, 1, len(MAGIC), len(MAGIC) + 5, len(raw) - 33, len(raw) - 32, len(raw) - 1}
    cuts |= {end for _, end in frames(raw)}
    for cut in sorted(cuts):
        path.write_bytes(raw[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ccprofd"):
            assert c.load("k", "key") is None, cut
        assert len(caplog.records) == 1, cut
    path.write_bytes(raw + b"\x00")
    assert c.load("k", "key") is None


def test_missing_entry_is_a_quiet_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ccprofd"):
        assert AnalysisCache(tmp_path).load("k", "nope") is None
    assert not caplog.records
