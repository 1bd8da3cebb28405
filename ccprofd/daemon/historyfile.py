"""A target's flight-recorder history on disk (``state_dir/history/TARGET.wet``): long per-thread
event streams kept compressed and traversable both ways, in the spirit of WET (Zhang and Gupta,
"Whole Execution Traces and Their Applications", /work/shared/papers/002).

WET's two tiers, simplified:

* first tier, per kind of value: each thread's events are split into one stream per field (time,
  syscall, context, three argument words), and a context -- a list of frames, hundreds of bytes --
  is stored once per file in a table, events naming it by index;
* second tier, a *bidirectional* predictor code per stream: each value is stored as its difference
  from the previous one (time: subtraction; the others: XOR), as an LEB128 varint.  From a value
  and the code after it one gets the next value, from a value and its own code the previous one;
  and LEB128 can be parsed backwards (a varint's last byte is the only one with the high bit clear),
  so a cursor steps forward and backward in place, without decompressing anything
  (:class:`Cursor`).  WET's FCM / last-n predictors are replaced by the last value: equal
  successive values cost one byte.

On disk the whole file is zlib-compressed once more and written atomically
(ccprofd/persist/atomicfile.py); :meth:`HistoryStore.save` first drops the oldest events (oldest
threads' first) until the file fits in ``max_bytes``.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccprofd.persist.atomicfile import atomic_write_bytes

MAGIC = b"CCPWET1\n"
FIELDS = 6  # time, syscall, context index, three argument words
M64 = (1 << 64) - 1


class HistoryFileError(Exception):
    """The file is not a history file (or is corrupt)."""


def _put(out: bytearray, v: int) -> None:
    """LEB128 of ``v`` (unsigned)."""
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _get(buf: bytes | bytearray, pos: int) -> tuple[int, int]:
    """The varint starting at ``pos``: (value, position after it)."""
    v = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


def _start_before(buf: bytes | bytearray, end: int) -> int:
    """Where the varint that ends at ``end`` (exclusive) starts: back over its continuation bytes."""
    pos = end - 1
    while pos > 0 and buf[pos - 1] >= 0x80:
        pos -= 1
    return pos


def _ends(data: bytes | bytearray) -> int:
    """How many varints ``data`` holds: its bytes with the high bit clear (each ends one)."""
    return len(data) - len(bytes(data).translate(None, _LOW))


_LOW = bytes(range(0x80))


@dataclass(slots=True)
class Stream:
    """One field's values as bidirectional codes: time as differences (non-negative: times of
    one thread only grow), the rest as XOR with the previous value."""

    additive: bool
    data: bytearray = field(default_factory=bytearray)
    count: int = 0
    first: int = 0  # the first value (for a cursor at the start)
    last: int = 0   # the last value (for a cursor at the end)

    def append(self, v: int) -> None:
        code = v - self.last if self.additive else v ^ self.last
        if self.count == 0:
            self.first = v
            code = v
        _put(self.data, code)
        self.last = v
        self.count += 1


class Cursor:
    """A position in one thread's streams: :meth:`value` the event there, :meth:`next` and
    :meth:`prev` one step, each in place (O(1) per step, nothing decompressed)."""

    def __init__(self, streams: Sequence[Stream], at_end: bool) -> None:
        self.streams = streams
        n = streams[0].count
        self.index = n - 1 if at_end else 0
        # per stream: the value at `index` and the byte range of its code [start, end)
        self._vals: list[int] = []
        self._spans: list[tuple[int, int]] = []
        for s in streams:
            if at_end:
                end = len(s.data)
                self._vals.append(s.last)
                self._spans.append((_start_before(s.data, end), end))
            else:
                _, end = _get(s.data, 0)
                self._vals.append(s.first)
                self._spans.append((0, end))

    def value(self) -> tuple[int, ...]:
        return tuple(self._vals)

    def next(self) -> bool:
        """Step to the next event; False (and stay) at the last."""
        if self.index + 1 >= self.streams[0].count:
            return False
        for k, s in enumerate(self.streams):
            _, end = self._spans[k]
            code, after = _get(s.data, end)
            self._vals[k] = (self._vals[k] + code) & M64 if s.additive else self._vals[k] ^ code
            self._spans[k] = (end, after)
        self.index += 1
        return True

    def prev(self) -> bool:
        """Step to the previous event; False (and stay) at the first."""
        if self.index == 0:
            return False
        for k, s in enumerate(self.streams):
            start, _ = self._spans[k]
            code, _ = _get(s.data, start)
            self._vals[k] = (self._vals[k] - code) & M64 if s.additive else self._vals[k] ^ code
            self._spans[k] = (_start_before(s.data, start), start)
        self.index -= 1
        return True


@dataclass(slots=True)
class ThreadHistory:
    pid: int
    tid: int
    streams: list[Stream] = field(default_factory=lambda: [Stream(additive=(k == 0)) for k in range(FIELDS)])

    @property
    def count(self) -> int:
        return self.streams[0].count

    @property
    def last_time(self) -> int:
        return self.streams[0].last if self.count else 0

    def cursor(self, at_end: bool = False) -> Cursor:
        if not self.count:
            raise IndexError("empty history")
        return Cursor(self.streams, at_end)

    def events(self) -> Iterator[tuple[int, ...]]:
        """Every event, oldest first: (time_ns, syscall, context index, arg0, arg1, arg2)."""
        if not self.count:
            return
        c = self.cursor()
        yield c.value()
        while c.next():
            yield c.value()

    def code_bytes(self) -> int:
        return sum(len(s.data) for s in self.streams)


class HistoryStore:
    """The persisted histories of one target: threads (by tid) and the context table.

    Why the codes are kept in memory as they are on disk: appending and saving cost no re-encoding,
    and a cursor walks them in place."""

    def __init__(self) -> None:
        self.threads: dict[int, ThreadHistory] = {}
        self.contexts: list[dict[str, Any]] = []  # {"complete", "frames"} by index
        self._context_ids: dict[str, int] = {}
        self.raw_events = 0  # events appended since creation or load (for the compression ratio)

    def context_index(self, complete: bool, frames: list[dict[str, Any]]) -> int:
        key = json.dumps([complete, frames], sort_keys=True, separators=(",", ":"))
        idx = self._context_ids.get(key)
        if idx is None:
            idx = self._context_ids[key] = len(self.contexts)
            self.contexts.append({"complete": complete, "frames": frames})
        return idx

    def append(self, pid: int, tid: int, time_ns: int, syscall: int, context: int,
               args: Sequence[int]) -> bool:
        """Add one event; False (ignored) when it is not newer than the thread's last one (already
        persisted), or when another process now uses the tid (that thread starts over)."""
        th = self.threads.get(tid)
        if th is not None and th.pid != pid:
            th = None
        if th is None:
            th = self.threads[tid] = ThreadHistory(pid, tid)
        elif time_ns <= th.last_time:
            return False
        a = [*args, 0, 0, 0][:3]
        for s, v in zip(th.streams, (time_ns, syscall & M64, context, a[0] & M64, a[1] & M64, a[2] & M64),
                        strict=True):
            s.append(v)
        self.raw_events += 1
        return True

    # ---------------------------------------------------------------------------- on disk
    def encode(self) -> bytes:
        header = {"contexts": self.contexts,
                  "threads": [{"pid": th.pid, "tid": th.tid, "count": th.count,
                               "fields": [[s.first, s.last, len(s.data)] for s in th.streams]}
                              for th in self.threads.values()]}
        body = bytearray()
        hjson = json.dumps(header, separators=(",", ":")).encode()
        _put(body, len(hjson))
        body += hjson
        for th in self.threads.values():
            for s in th.streams:
                body += s.data
        return MAGIC + zlib.compress(bytes(body), 6)

    def save(self, path: str | os.PathLike[str], max_bytes: int) -> int:
        """Write atomically, dropping the oldest events first until the file fits ``max_bytes``;
        the file's size."""
        data = self.encode()
        while len(data) > max_bytes and self.threads:
            self._drop_oldest(max(1, (len(data) - max_bytes) * self.events() // max(1, len(data))))
            data = self.encode()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        return len(data)

    def events(self) -> int:
        return sum(th.count for th in self.threads.values())

    def _drop_oldest(self, n: int) -> None:
        """Drop about ``n`` events, the oldest first (across threads, by time)."""
        cut_times = sorted(ev[0] for th in self.threads.values() for ev in th.events())
        cut = cut_times[min(n, len(cut_times)) - 1]
        for tid in list(self.threads):
            th = self.threads[tid]
            kept = [ev for ev in th.events() if ev[0] > cut]
            if not kept:
                del self.threads[tid]
                continue
            fresh = ThreadHistory(th.pid, tid)
            for ev in kept:
                for s, v in zip(fresh.streams, ev, strict=True):
                    s.append(v)
            self.threads[tid] = fresh

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HistoryStore:
        raw = Path(path).read_bytes()
        if not raw.startswith(MAGIC):
            raise HistoryFileError(f"{path}: not a ccprofd history file")
        try:
            body = zlib.decompress(raw[len(MAGIC):])
            n, pos = _get(body, 0)
            header = json.loads(body[pos:pos + n])
            pos += n
            store = cls()
            for ctx in header["contexts"]:
                store.context_index(bool(ctx["complete"]), list(ctx["frames"]))
            for t in header["threads"]:
                th = ThreadHistory(int(t["pid"]), int(t["tid"]))
                for s, (first, last, size) in zip(th.streams, t["fields"], strict=True):
                    s.data = bytearray(body[pos:pos + size])
                    s.first, s.last, s.count = int(first), int(last), int(t["count"])
                    pos += size
                    if s.count < 0 or _ends(s.data) != s.count or (s.data and s.data[-1] >= 0x80):
                        raise ValueError(f"thread {th.tid}: its streams do not hold {s.count} codes")
                store.threads[th.tid] = th
            if pos != len(body):
                raise ValueError(f"{len(body) - pos} bytes beyond the streams")
        except (zlib.error, ValueError, KeyError, TypeError, IndexError) as exc:
            raise HistoryFileError(f"{path}: corrupt history file: {exc}") from None
        return store
