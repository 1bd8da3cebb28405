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

import errno
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, Protocol

from ccprofd.kbpf.syscalls import syscall_arg_kinds
from ccprofd.tracing.api import UNKNOWN_REASON, TraceSample

# The compiled batch formatter (cjsonl.c, built by scripts/build_ext.sh at set-up): the same bytes as
# JsonlWriter.sample(), ~10x faster for the common line.  CCPROFD_PURE_PYTHON=1 leaves it out
# (the tests compare both paths; the bench times the difference).
try:
    if os.environ.get("CCPROFD_PURE_PYTHON"):
        raise ImportError("CCPROFD_PURE_PYTHON is set")
    from ccprofd.export import cjsonl  # type: ignore[attr-defined, unused-ignore]
except ImportError:
    cjsonl = None
#: Whether JsonlWriter.samples() runs compiled (``ccprofd trace`` notes it on stderr when not).
COMPILED = cjsonl is not None
if cjsonl is not None and getattr(cjsonl, "TAIL_FIELDS", 0) != 6:  # built from an older cjsonl.c,
    cjsonl = None  # which would not compare a cached tail's reason: rebuild it
# a helper built from an older cjsonl.c (not rebuilt since) formats only cached contexts' lines
_TAIL_OF = getattr(cjsonl, "TAKES_TAIL_OF", 0) == 1
COMPILED_MISSING_NOTE = ("ccprofd: note: compiled helpers not built ({}); using their pure-Python code "
                         "(same output, fewer samples a second): run scripts/build_ext.sh "
                         "(scripts/setup.sh does)")

FORMATS = ("text", "jsonl")

# Calls whose result is an address, printed in hex as strace does.
_RETURNS_ADDRESS = frozenset({"mmap", "mremap", "brk", "shmat"})

AT_FDCWD = -100  # linux/fcntl.h: a dirfd meaning the current directory

# open(2) flags as strace names them (x86-64 values, asm-generic/fcntl.h, in octal), the access mode
# apart; bits not named here are printed as a hex remainder.
_O_ACCMODE = 0o3
_O_ACCESS = ("O_RDONLY", "O_WRONLY", "O_RDWR")
_O_FLAGS = (("O_CREAT", 0o100), ("O_EXCL", 0o200), ("O_NOCTTY", 0o400), ("O_TRUNC", 0o1000),
            ("O_APPEND", 0o2000), ("O_NONBLOCK", 0o4000), ("O_DSYNC", 0o10000), ("O_ASYNC", 0o20000),
            ("O_DIRECT", 0o40000), ("O_LARGEFILE", 0o100000), ("O_DIRECTORY", 0o200000),
            ("O_NOFOLLOW", 0o400000), ("O_NOATIME", 0o1000000), ("O_CLOEXEC", 0o2000000),
            ("O_PATH", 0o10000000))
_O_CREAT = 0o100
_O_TMPFILE = 0o20000000  # with O_DIRECTORY; creates too, so the mode is printed

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
    raw = sample.get("raw_args")
    call = call_args_text(what, sample.get("args"), raw) if raw is not None else args_text(sample.get("args"))
    if "ret" in sample:
        call += ret_text(what, sample["ret"])
    head = f"[pid {sample['pid']} tid {sample['tid']}] {what}{call}"
    if not sample.get("complete", True):
        head += " <incomplete>"
    return head + "\n" + format_frames_text(sample.get("frames") or [])


def args_text(args: Mapping[str, str] | None) -> str:
    """The arguments ccprofd knows, strace style: ``("/etc/passwd")`` (a path, C-escaped and quoted
    as strace prints it); empty when none is known."""
    if not args:
        return ""
    return "(" + ", ".join(_c_string(v) for v in args.values()) + ")"


def call_args_text(syscall: str | None, args: Mapping[str, str] | None, raw: Sequence[int]) -> str:
    """Every argument, strace style: ``(1, 0x7ffd2c1e0a10, 22)``.  Each argument register is printed
    by its kind in kbpf/syscalls.SYSCALL_ARGS (ints and sizes in decimal, flags and pointers in hex,
    AT_FDCWD, NULL, octal modes, the path string when it was captured); a syscall not in the table
    has its words in hex."""
    kinds = syscall_arg_kinds(syscall)
    if kinds is None:
        return "(" + ", ".join(_hex(v) for v in raw) + ")"
    path = next(iter(args.values())) if args else None
    out = []
    for kind, v in zip(kinds, raw, strict=False):
        if kind == "s" and path is not None:
            out.append(_c_string(path))
        elif kind in "dD":
            i = (v & 0xFFFFFFFF) - ((v & 0x80000000) << 1)  # a C int: the low 32 bits, signed
            out.append("AT_FDCWD" if kind == "D" and i == AT_FDCWD else str(i))
        elif kind == "u":
            out.append(str(v))
        elif kind == "l":
            out.append(str(v - (1 << 64) if v >> 63 else v))
        elif kind == "f":
            out.append(open_flags_text(v))
        elif kind == "o":
            if "f" not in kinds or raw[kinds.index("f")] & (_O_CREAT | _O_TMPFILE):  # as strace
                out.append(f"0{v:o}" if v else "000")
        elif kind in "ps":
            out.append(f"0x{v:x}" if v else "NULL")
        else:
            out.append(_hex(v))
    return "(" + ", ".join(out) + ")"


def open_flags_text(v: int) -> str:
    """open(2) flags as strace prints them: ``O_RDONLY|O_CLOEXEC``."""
    v &= 0xFFFFFFFF
    names = [_O_ACCESS[v & _O_ACCMODE] if v & _O_ACCMODE < 3 else "0x3"]
    rest = v & ~_O_ACCMODE
    if rest & _O_TMPFILE and rest & 0o200000:
        names.append("O_TMPFILE")
        rest &= ~(_O_TMPFILE | 0o200000)
    for name, bit in _O_FLAGS:
        if rest & bit:
            names.append(name)
            rest &= ~bit
    if rest:
        names.append(f"0x{rest:x}")
    return "|".join(names)


def ret_text(syscall: str | None, ret: int | None) -> str:
    """`` = 22``, strace style: ``= ?`` when the call never returned, ``= -1 ENOENT (No such file or
    directory)`` for an error, an address in hex for the calls that return one."""
    if ret is None:
        return " = ?"
    if -4096 < ret < 0:
        name = errno.errorcode.get(-ret)
        return f" = -1 {name} ({os.strerror(-ret)})" if name else f" = -1 errno {-ret}"
    if syscall in _RETURNS_ADDRESS:
        return f" = 0x{ret & 0xFFFFFFFFFFFFFFFF:x}"
    return f" = {ret}"


def _hex(v: int) -> str:
    return f"0x{v:x}" if v else "0"


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


def _source(f: Mapping[str, Any]) -> str:
    """`` file.c:123`` for a frame (or inlined call) with a DWARF location, else nothing."""
    file = f.get("file")
    if not file:
        return ""
    line = f.get("line")
    return f" {file}:{line}" if line else f" {file}"


def format_frames_text(frames: list[dict[str, Any]]) -> str:
    """The frame lines of a text sample, innermost first, each ending in a newline."""
    lines = []
    for f in reversed(frames):
        name = f.get("function") or "?"
        module = f.get("module") or "?"
        for c in reversed(f.get("inlined") or ()):  # innermost first, above their frame, as perf does
            lines.append(f" > {module}({c.get('function') or '?'}){_source(c)} [inlined]\n")
        parts = [f" > {module}({name}){_source(f)}"]
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
    def samples(self, batch: Sequence[TraceSample]) -> None: ...
    def record(self, r: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...


class _FrameCache:
    """Serialised frames (a frames list, or one frame's dict) by the object's identity.  The object
    is held while its entry is, so no other live object can have its id: an entry found by
    ``id(obj)`` is ``obj``'s."""

    def __init__(self) -> None:
        self.known: dict[int, str] = {}  # id -> text
        self._held: dict[int, Any] = {}  # id -> the object, kept alive

    def text(self, obj: Any, render: Any) -> str:
        got = self.known.get(id(obj))
        if got is not None:
            return got
        if len(self.known) >= FRAME_CACHE_ENTRIES:
            self.known.clear()
            self._held.clear()
        text = self.known[id(obj)] = render(obj)
        self._held[id(obj)] = obj
        return text


class JsonlWriter:
    """``--format jsonl``: each line equals ``json.dumps(sample.to_json(), separators=(",", ":"))``.
    Everything after ``tid`` but the arguments is the same for every sample of one context and
    syscall: it is serialised once per frames list and reused while the event, syscall,
    completeness and incomplete reason stay the same (cjsonl.c compares the same four)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self._tails: dict[int, tuple[list[dict[str, Any]], str, str | None, bool, str | None, str]] = {}
        self._frame_texts = _FrameCache()
        self._lines: list[str] = []  # this batch's output (pieces of lines), written at flush()
        # the tail's text before "frames", by (event, syscall, complete, reason)
        self._heads: dict[tuple[str, str | None, bool, str | None], str] = {}

    def _frames_text(self, frames: list[dict[str, Any]]) -> str:
        """The JSON of a frames list, each frame dict serialised once (the modes share equal
        frames' dicts between contexts, so a new context mostly costs a join)."""
        texts = self._frame_texts
        try:  # every frame seen before (the common case for a new context): one join at C speed
            return "[" + ",".join(map(texts.known.__getitem__, map(id, frames))) + "]"
        except KeyError:
            text = texts.text
            return "[" + ",".join(text(f, _dumps) for f in frames) + "]"

    def _tail(self, s: TraceSample) -> str:
        frames = s.frames
        if len(self._tails) >= FRAME_CACHE_ENTRIES:
            self._tails.clear()
        key = (s.event, s.syscall, s.complete, s.reason)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= FRAME_CACHE_ENTRIES:  # reasons with details ("decode error: ...")
                self._heads.clear()
            head = self._heads[key] = (
                f'"event":{_dumps(s.event)},"syscall":{_dumps(s.syscall)},' + (
                    '"complete":true,"frames":' if s.complete else
                    f'"complete":false,"reason":{_dumps(s.reason or UNKNOWN_REASON)},"frames":'))
        tail = head + self._frames_text(frames)
        self._tails[id(frames)] = (frames, s.event, s.syscall, s.complete, s.reason, tail)
        return tail

    def sample(self, s: TraceSample) -> None:
        frames = s.frames
        got = self._tails.get(id(frames))
        if got is None or got[0] is not frames or got[1] != s.event or got[2] != s.syscall \
                or got[3] != s.complete or got[4] != s.reason:
            tail = self._tail(s)
        else:
            tail = got[5]
        # The line goes out as three pieces (flush joins them): the context's tail, kilobytes of
        # frames, is copied once, by that join, not also into a line of its own.
        raw = s.raw_args
        if not s.args and s.returned is None:  # the common line: no path argument, no return
            self._lines += (f'{{"time_ns":{s.time_ns},"pid":{s.pid},"tid":{s.tid},', tail,
                            "}\n" if raw is None else f',"raw_args":[{",".join(map(str, raw))}]}}\n')
            return
        extra = ""
        if s.args:
            extra = f',"args":{_dumps(s.args)}'
        if raw is not None:
            extra += ',"raw_args":[' + ",".join(map(str, raw)) + "]"
        if s.returned is not None:
            extra += f',"ret":{s.ret if s.returned else "null"}'
        self._lines += (f'{{"time_ns":{s.time_ns},"pid":{s.pid},"tid":{s.tid},', tail, f"{extra}}}\n")

    def samples(self, batch: Sequence[TraceSample]) -> None:
        """:meth:`sample` for each of ``batch``, the common lines formatted by the compiled
        helper when it is built (every other line, and every line without it, by :meth:`sample`)."""
        if cjsonl is not None:
            if _TAIL_OF:
                cjsonl.format_samples(batch, self._tails, self._line, self._lines, self._tail)
            else:
                cjsonl.format_samples(batch, self._tails, self._line, self._lines)
            return
        sample = self.sample
        for s in batch:
            sample(s)

    def _line(self, s: TraceSample) -> str:
        """One sample's line (the compiled helper's way back for the lines it leaves to Python)."""
        n = len(self._lines)
        self.sample(s)
        line = "".join(self._lines[n:])
        del self._lines[n:]
        return line

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

    def samples(self, batch: Sequence[TraceSample]) -> None:
        sample = self.sample
        for s in batch:
            sample(s)

    def sample(self, s: TraceSample) -> None:
        what = s.syscall if s.event == "syscall" else s.event
        if s.raw_args is not None:
            what = f"{what}{call_args_text(what, s.args, s.raw_args)}"
        elif s.args:
            what = f"{what}{args_text(s.args)}"
        if s.returned is not None:
            what = f"{what}{ret_text(s.syscall, s.ret if s.returned else None)}"
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
