"""``ccprofd trace`` output: one JSON object per sample (``--format jsonl``) or ``strace -k``-like text.

Both take the sample dicts of the issue-4 format (``time_ns, pid, tid, event, syscall, complete,
frames``; frames outermost first) and write to a text stream.

:class:`JsonlWriter` and :class:`TextWriter` are the fast path ``ccprofd trace`` uses: they take
:class:`~ccprofd.tracing.api.TraceSample` values and serialise each context's frames once -- the
modes give every sample of one context the same frames list -- so a repeated context costs one
string format per sample instead of a JSON encoding of its whole stack.  They write without
flushing; the caller flushes once per batch, so a reader of the file or pipe still sees samples
within one poll of their arrival.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import IO, Any, Protocol

from ccprofd.tracing.api import TraceSample

FORMATS = ("text", "jsonl")

# Serialised contexts kept per writer (each a few KB of JSON): enough for the hot contexts of a
# trace; past it the cache starts over (a context is then serialised once more, nothing else
# changes).  A flood of distinct contexts would otherwise hold them all: 65,536 were 160 MB.
FRAME_CACHE_ENTRIES = 4096

_dumps = json.JSONEncoder(separators=(",", ":")).encode


def write_jsonl(out: IO[str], sample: Mapping[str, Any]) -> None:
    out.write(_dumps(sample) + "\n")
    out.flush()


def format_text(sample: Mapping[str, Any]) -> str:
    """``[pid P tid T] syscall`` (plus ``<incomplete>``), then the frames innermost first as strace -k
    prints them: `` > module(function) call_site=... return_address=...``."""
    if sample.get("event") in ("lost", "degraded"):  # session.lost_record
        unit = next(k for k in sample if k not in ("time_ns", "event", "reason"))
        gone = "lost" if sample["event"] == "lost" else "without per-thread state"
        return f"--- {sample[unit]} {unit.replace('_', ' ')} {gone} ({sample['reason']}) ---\n"
    what = sample.get("syscall") if sample.get("event") == "syscall" else sample.get("event")
    head = f"[pid {sample['pid']} tid {sample['tid']}] {what}{args_text(sample.get('args'))}"
    if not sample.get("complete", True):
        head += " <incomplete>"
    return head + "\n" + format_frames_text(sample.get("frames") or [])


def args_text(args: Mapping[str, str] | None) -> str:
    """The arguments ccprofd knows, strace style: ``("/etc/passwd")`` (a path, C-escaped and quoted
    as strace prints it); empty when none is known."""
    if not args:
        return ""
    return "(" + ", ".join(_c_string(v) for v in args.values()) + ")"


def _c_string(value: str) -> str:
    raw = value.encode("utf-8", "surrogateescape")
    out = []
    for b in raw:
        ch = chr(b)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 32 <= b < 127:
            out.append(ch)
        else:
            out.append({9: "\\t", 10: "\\n", 13: "\\r"}.get(b, f"\\{b:o}"))
    return '"' + "".join(out) + '"'


def format_frames_text(frames: list[dict[str, Any]]) -> str:
    """The frame lines of a text sample, innermost first, each ending in a newline."""
    lines = []
    for f in reversed(frames):
        name = f.get("function") or "?"
        parts = [f" > {f.get('module') or '?'}({name})"]
        if f.get("call_site"):
            parts.append(f"call_site={f['call_site']}")
        if f.get("return_address"):
            parts.append(f"return_address={f['return_address']}")
        if f.get("tail_call"):
            parts.append("[tail call]")
        if not f.get("analysed", True):
            parts.append("[not analysed]")
        lines.append(" ".join(parts) + "\n")
    return "".join(lines)


class SampleWriter(Protocol):
    """Where ``ccprofd trace`` puts its output: samples, side records (``lost``), a flush per batch."""

    def sample(self, s: TraceSample) -> None: ...
    def record(self, r: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...


class _FrameCache:
    """Serialised frames (a frames list, or one frame's dict) by the object's identity; the object is
    held, so its identity stays valid."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, str]] = {}

    def text(self, obj: Any, render: Any) -> str:
        got = self._by_id.get(id(obj))
        if got is not None and got[0] is obj:
            return got[1]
        if len(self._by_id) >= FRAME_CACHE_ENTRIES:
            self._by_id.clear()
        text = render(obj)
        self._by_id[id(obj)] = (obj, text)
        return text


class JsonlWriter:
    """``--format jsonl``: each line equals ``json.dumps(sample.to_json(), separators=(",", ":"))``.
    Everything after ``tid`` but the arguments is the same for every sample of one context and
    syscall: it is serialised once per frames list and reused while the event, syscall and
    completeness stay the same."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self._tails: dict[int, tuple[list[dict[str, Any]], str, str | None, bool, str]] = {}
        self._frame_texts = _FrameCache()
        self._lines: list[str] = []  # this batch's output, written at flush()

    def _frames_text(self, frames: list[dict[str, Any]]) -> str:
        """The JSON of a frames list, each frame dict serialised once (the modes share equal
        frames' dicts between contexts, so a new context mostly costs a join)."""
        text = self._frame_texts.text
        return "[" + ",".join(text(f, _dumps) for f in frames) + "]"

    def _tail(self, s: TraceSample) -> str:
        frames = s.frames
        if len(self._tails) >= FRAME_CACHE_ENTRIES:
            self._tails.clear()
        tail = (f'"event":{_dumps(s.event)},"syscall":{_dumps(s.syscall)},'
                f'"complete":{"true" if s.complete else "false"},"frames":{self._frames_text(frames)}')
        self._tails[id(frames)] = (frames, s.event, s.syscall, s.complete, tail)
        return tail

    def sample(self, s: TraceSample) -> None:
        frames = s.frames
        got = self._tails.get(id(frames))
        if got is None or got[0] is not frames or got[1] != s.event or got[2] != s.syscall \
                or got[3] != s.complete:
            tail = self._tail(s)
        else:
            tail = got[4]
        if s.args:
            self._lines.append(f'{{"time_ns":{s.time_ns},"pid":{s.pid},"tid":{s.tid},{tail},'
                               f'"args":{_dumps(s.args)}}}\n')
        else:
            self._lines.append(f'{{"time_ns":{s.time_ns},"pid":{s.pid},"tid":{s.tid},{tail}}}\n')

    def record(self, r: Mapping[str, Any]) -> None:
        self._lines.append(_dumps(r) + "\n")

    def flush(self) -> None:
        """Write the lines of this batch (one write call) and flush the stream."""
        if self._lines:
            self.out.write("".join(self._lines))
            self._lines.clear()
        self.out.flush()


def timestamp(time_ns: int, style: str | None) -> str:
    """strace's ``-tt`` (local ``HH:MM:SS.uuuuuu``) or ``-ttt`` (``seconds.uuuuuu``) prefix, with
    its trailing space; empty for no style."""
    if style is None:
        return ""
    sec, us = divmod(time_ns // 1000, 1_000_000)
    if style == "ttt":
        return f"{sec}.{us:06d} "
    return time.strftime("%H:%M:%S", time.localtime(sec)) + f".{us:06d} "


class TextWriter:
    """``--format text``: :func:`format_text` lines, the frame lines of each context rendered once;
    ``timestamps`` ("tt"/"ttt") prefixes each sample's first line with its time as strace does."""

    def __init__(self, out: IO[str], timestamps: str | None = None) -> None:
        self.out = out
        self.timestamps = timestamps
        self._frames = _FrameCache()

    def sample(self, s: TraceSample) -> None:
        what = s.syscall if s.event == "syscall" else s.event
        if s.args:
            what = f"{what}{args_text(s.args)}"
        head = f"[pid {s.pid} tid {s.tid}] {what}\n" if s.complete else \
            f"[pid {s.pid} tid {s.tid}] {what} <incomplete>\n"
        if self.timestamps:
            head = timestamp(s.time_ns, self.timestamps) + head
        self.out.write(head + self._frames.text(s.frames, format_frames_text))

    def record(self, r: Mapping[str, Any]) -> None:
        self.out.write(format_text(r))

    def flush(self) -> None:
        self.out.flush()


def writer_for(fmt: str, out: IO[str], *, timestamps: str | None = None) -> SampleWriter:
    """The writer of ``--format fmt`` (``timestamps``: text only; JSONL always has ``time_ns``)."""
    if fmt == "jsonl":
        return JsonlWriter(out)
    if fmt == "text":
        return TextWriter(out, timestamps)
    raise ValueError(f"unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
