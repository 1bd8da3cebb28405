"""Hot-context aggregation per target, with bounded memory and bounded metric cardinality.

Input: decoded samples (the tracer's JSONL dicts).  Each sample is counted under
``(event, syscall, context)`` where ``context`` is :func:`context_id` — a short hash of the
program's frames (build-id + call site per frame of the analysed binary), so it is the same
whatever the encoding scheme, the weights or the tracer mode that produced the frames.  Library
frames are left out of it because the modes do not report them alike: unwind mode shows the library
functions below the program's innermost frame (libc's ``write``) and every library frame between two
program frames; instrumented mode shows neither the leaf nor more than one placeholder frame for a
library in between.  The library leaf is kept beside the id (:func:`library_leaf`), not in it.

Bounds and how nothing is lost silently:

* at most ``max_contexts`` distinct contexts are kept per target; a sample of a new context when
  the table is full (and no stale, never-exported context can be evicted) is still counted — under
  ``context="other"`` — and additionally in ``dropped["context_table_full"]``;
* frames are interned, so contexts sharing frames share memory;
* per-context time buckets (``bucket_seconds`` wide, ``history_seconds`` deep) answer
  "counts since T" at bucket resolution; counts older than the history are in the totals only.

CPU samples are keyed by the chain of calls and the *function* the CPU was in, not by the sampled
instruction: the innermost frame of a CPU sample, when it is the program's, carries the sampled
address as its ``call_site`` and is hashed by its function instead (:meth:`TargetStore.context_of`),
so one busy function is one series, not one per instruction.

Metric series (:meth:`TargetStore.scrape`) follow a promotion rule that keeps counters monotonic:
at each scrape the top-K contexts of the recent window that are not yet exported are *promoted*
(up to ``max_series`` per family).  ``other`` counts exactly the samples taken while their context
was not promoted; samples a context received since the previous scrape move with it into its new
series (they were never exported in ``other``), so a context that becomes hot between two scrapes
is exported with its full count.  A promoted context not seen for ``retire_after_seconds`` is
*retired* at the next scrape: its series leaves the exposition (Prometheus marks it stale) and its
slot under ``max_series`` is free again; its later samples count under ``other`` until it is
promoted again, when its series resumes from the value it had (monotonic) unless the table
forgot the context meanwhile (a retired context can be evicted like any unexported one).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Sample = Mapping[str, Any]
FrameKey = tuple[Any, ...]
FRAME_FIELDS = ("function", "module", "build_id", "analysed", "call_site", "return_address", "tail_call",
                "file", "line", "inlined")
# Fields a frame dict has only when known (the tracer's JSON contract): left out of the frames read
# back rather than given as null.  ``inlined`` is interned as a tuple of (function, file, line).
_OPTIONAL = frozenset(("file", "line", "inlined"))
_INLINED = FRAME_FIELDS.index("inlined")
OTHER = "other"


def _address(value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, int):
        return value
    return int(str(value), 16) if str(value).lower().startswith("0x") else int(str(value), 0)


def is_program_frame(frame: Mapping[str, Any]) -> bool:
    """A frame of the analysed binary (frames without the ``analysed`` field count as such)."""
    return bool(frame.get("analysed", True))


def _keyed(frames: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """The frames a context id is made of: the program's; all of them when there is none (the
    dynamic loader before the entry point, a thread a library started: unwind mode reports those
    chains in library frames, instrumented mode with none)."""
    program = [f for f in frames if is_program_frame(f)]
    return program if program or not frames else frames


def context_id(frames: Sequence[Mapping[str, Any]], complete: bool = True) -> str:
    """Short stable hash of a decoded frame list's *program* frames (library frames are skipped:
    the tracer modes report them differently; a chain without a program frame is hashed from its
    library frames, a library frame's call known by its return address): per frame the object's
    build-id (module path when there is none) and the call site; the function name only for frames
    without a call site.  Incomplete contexts hash differently from complete ones with the same
    frames: they are a different statement (a known suffix, not the whole chain)."""
    h = hashlib.blake2b(digest_size=6)
    for f in _keyed(frames):
        site = _address(f.get("call_site"))
        if site is None and not is_program_frame(f):
            site = _address(f.get("return_address"))
        obj = f.get("build_id") or f.get("module") or ""
        name = "" if site is not None else (f.get("function") or "")
        h.update(f"{obj}\x1f{'' if site is None else format(site, 'x')}\x1f{name}\x1f"
                 f"{1 if f.get('tail_call') else 0}\x1e".encode())
    if not complete:
        h.update(b"\x00incomplete")
    return h.hexdigest()


def _memo_key(frames: Sequence[Mapping[str, Any]], complete: bool) -> tuple[Any, ...]:
    """Everything :func:`context_id` reads, as a dict key (several times cheaper than the hash)."""
    return (complete, *[(f.get("build_id") or f.get("module"), f.get("call_site"), f.get("function"),
                         bool(f.get("tail_call")),
                         None if is_program_frame(f) else f.get("return_address"))
                        for f in _keyed(frames)])


def _keyed_frames(sample: Sample) -> Sequence[Mapping[str, Any]]:
    """The frames a sample's context id is computed from: a CPU sample's innermost frame, when it
    is the program's, without its ``call_site`` (there the sampled instruction, not a call), so
    the id names the function the CPU was in."""
    frames: Sequence[Mapping[str, Any]] = sample.get("frames") or ()
    if sample.get("event") == "cpu" and frames and is_program_frame(frames[-1]) and \
            frames[-1].get("call_site") is not None:
        return [*frames[:-1], {**frames[-1], "call_site": None}]
    return frames


def sample_context_id(sample: Sample) -> str:
    """A decoded sample's context id, as the store counts it (CPU samples by function)."""
    return context_id(_keyed_frames(sample), bool(sample.get("complete", True)))


MEMO_MAX = 65536  # context ids remembered per store (cleared when full: a memo, not state)


_FUNCTION, _ANALYSED = FRAME_FIELDS.index("function"), FRAME_FIELDS.index("analysed")


def _inlined_key(calls: Any) -> tuple[tuple[Any, Any, Any], ...] | None:
    """A frame's ``inlined`` list as a hashable value (None when it has none)."""
    if not calls:
        return None
    return tuple((c.get("function"), c.get("file"), c.get("line")) for c in calls if isinstance(c, Mapping))


def frame_dict(key: FrameKey) -> dict[str, Any]:
    """An interned frame as the tracer's JSON dict (``file``/``line``/``inlined`` only when known)."""
    out = {name: value for name, value in zip(FRAME_FIELDS, key, strict=True)
           if value is not None or name not in _OPTIONAL}
    if key[_INLINED]:
        out["inlined"] = [{"function": fn, "file": file, "line": line} for fn, file, line in key[_INLINED]]
    return out


def _program_functions(frames: Iterable[FrameKey]) -> tuple[str, ...]:
    """Function names of the interned *program* frames (the ones :func:`context_id` hashes)."""
    return tuple(str(f[_FUNCTION] or "[unknown]") for f in frames
                 if f[_ANALYSED] is None or f[_ANALYSED])


def leaf_name(frames: Sequence[Mapping[str, Any]]) -> str:
    """The innermost *program* function's name, the same in both tracer modes ("" when there is no
    program frame, "[unknown]" when unnamed); the metrics' ``leaf`` label."""
    for f in reversed(frames):
        if is_program_frame(f):
            return str(f.get("function") or "[unknown]")
    return ""


def library_leaf(frames: Sequence[Mapping[str, Any]]) -> str:
    """The innermost function when it is a library's, below the program's innermost frame (libc's
    ``write`` under the program's call of it): "" when the leaf is the program's, or when the tracer
    mode does not report library leaves (instrumented mode)."""
    if not frames or is_program_frame(frames[-1]):
        return ""
    return str(frames[-1].get("function") or "[unknown]")


@dataclass(frozen=True, slots=True)
class HotContext:
    """One row of ``GetHotContexts``: a context and how often it was seen."""

    context: str
    event: str
    syscall: str
    count: int
    complete: bool
    frames: tuple[dict[str, Any], ...]
    first_seen_ns: int
    last_seen_ns: int

    @property
    def leaf(self) -> str:
        return leaf_name(self.frames)

    @property
    def leaf_library(self) -> str:
        return library_leaf(self.frames)


@dataclass(frozen=True, slots=True)
class Series:
    """One exported counter: ``context`` is a context id or ``"other"``; ``leaf`` is "" for other.
    ``functions``: the names of the program frames the id is a hash of, outermost first (empty for
    other), for the metrics' ``ccprofd_context_info`` that says what an id stands for."""

    event: str
    syscall: str
    context: str
    leaf: str
    value: int
    functions: tuple[str, ...] = ()
    complete: bool = True


class _Entry:
    __slots__ = ("buckets", "complete", "context", "count", "event", "first_ns", "frames", "last_ns",
                 "leaf", "pending", "promoted", "series", "syscall")

    def __init__(self, event: str, syscall: str, context: str, frames: tuple[FrameKey, ...],
                 complete: bool, leaf: str, now_ns: int) -> None:
        self.event = event
        self.syscall = syscall
        self.context = context
        self.frames = frames
        self.complete = complete
        self.leaf = leaf
        self.count = 0
        self.series = 0      # samples counted in its own series (promoted)
        self.pending = 0     # samples counted in "other" since the previous scrape
        self.promoted = False
        self.first_ns = now_ns
        self.last_ns = now_ns
        self.buckets: deque[list[int]] = deque()  # [bucket start (ns), count]


class TargetStore:
    """The context table of one target; thread-safe (one writer, many readers)."""

    def __init__(self, *, max_contexts: int = 10000, top_k: int = 20, max_series: int = 200,
                 bucket_seconds: int = 10, history_seconds: int = 3600,
                 promotion_window_seconds: int = 300, retire_after_seconds: int = 0,
                 clock: Callable[[], int] = time.time_ns) -> None:
        """``retire_after_seconds``: 0 keeps promoted series for the life of the store; ``clock``:
        nanoseconds of the wall clock, used when a call passes no time (tests inject one)."""
        self.max_contexts = max_contexts
        self.top_k = top_k
        self.max_series = max_series
        self.bucket_ns = bucket_seconds * 1_000_000_000
        self.history_ns = history_seconds * 1_000_000_000
        self.window_ns = promotion_window_seconds * 1_000_000_000
        self.retire_ns = retire_after_seconds * 1_000_000_000
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str, str], _Entry] = {}
        self._frames: dict[FrameKey, FrameKey] = {}
        self._frame_refs: dict[FrameKey, int] = {}
        self._other: dict[tuple[str, str], int] = {}
        self._promoted_count: dict[str, int] = {}
        self._context_ids: dict[tuple[Any, ...], str] = {}  # the daemon's hot path: 10k samples/s
        # The same, by the identity of the sample's frames list, which a tracer shares between every
        # sample of one context (tracing/api.py TraceSample): id -> (frames, complete, event, id).
        # The entry holds the list, so its id cannot be reused while the entry exists.
        self._by_frames: dict[int, tuple[Any, bool, Any, str]] = {}
        self.samples = 0
        self.incomplete = 0
        self.retired = 0
        self.dropped: dict[str, int] = {}

    # ------------------------------------------------------------------------------ writing
    def context_of(self, sample: Sample) -> str:
        """The sample's context id (memoised), without counting it."""
        shared = sample.get("frames") or ()
        complete = bool(sample.get("complete", True))
        event = sample.get("event")
        known = self._by_frames.get(id(shared))
        if known is not None and known[0] is shared and known[1] == complete and known[2] == event:
            return known[3]
        frames = _keyed_frames(sample)
        memo = _memo_key(frames, complete)
        ctx = self._context_ids.get(memo)
        if ctx is None:
            ctx = context_id(frames, complete)
            if len(self._context_ids) >= MEMO_MAX:
                self._context_ids.clear()
            self._context_ids[memo] = ctx
        if len(self._by_frames) >= MEMO_MAX:
            self._by_frames.clear()
        self._by_frames[id(shared)] = (shared, complete, event, ctx)
        return ctx

    def add(self, sample: Sample, now_ns: int | None = None, count: int = 1) -> str:
        """Count ``count`` samples of one decoded context (several: counted in the kernel since
        the last read); returns its context id."""
        now = self.clock() if now_ns is None else now_ns
        frames = sample.get("frames") or ()
        complete = bool(sample.get("complete", True))
        event = str(sample.get("event") or "syscall")
        syscall = str(sample.get("syscall") or "") if event == "syscall" else ""
        ctx = self.context_of(sample)
        key = (event, syscall, ctx)
        with self._lock:
            self.samples += count
            if not complete:
                self.incomplete += count
            entry = self._entries.get(key)
            if entry is None:
                if len(self._entries) >= self.max_contexts and not self._evict_stale(now):
                    self._other[(event, syscall)] = self._other.get((event, syscall), 0) + count
                    self.dropped["context_table_full"] = self.dropped.get("context_table_full", 0) + count
                    return ctx
                entry = _Entry(event, syscall, ctx, self._intern(frames), complete, leaf_name(frames), now)
                self._entries[key] = entry
            entry.count += count
            entry.last_ns = max(entry.last_ns, now)
            if entry.promoted:
                entry.series += count
            else:
                entry.pending += count
                self._other[(event, syscall)] = self._other.get((event, syscall), 0) + count
            start = now - now % self.bucket_ns
            if entry.buckets and entry.buckets[-1][0] == start:
                entry.buckets[-1][1] += count
            else:
                entry.buckets.append([start, count])
                while entry.buckets and entry.buckets[0][0] < now - self.history_ns:
                    entry.buckets.popleft()
        return ctx

    def note_dropped(self, reason: str, count: int = 1) -> None:
        """Samples lost before reaching the store (ring buffer full, decode failure...)."""
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + count

    def _intern(self, frames: Iterable[Mapping[str, Any]]) -> tuple[FrameKey, ...]:
        out = []
        for f in frames:
            key = (*(f.get(name) for name in FRAME_FIELDS[:_INLINED]), _inlined_key(f.get("inlined")))
            shared = self._frames.setdefault(key, key)
            self._frame_refs[shared] = self._frame_refs.get(shared, 0) + 1
            out.append(shared)
        return tuple(out)

    def _evict_stale(self, now: int) -> bool:
        """Free one slot by forgetting a never-promoted context not seen within the history
        (its samples stay counted in ``other`` and the totals); False when there is none."""
        victim = None
        for entry in self._entries.values():
            if not entry.promoted and entry.last_ns < now - self.history_ns and (
                    victim is None or entry.last_ns < victim.last_ns):
                victim = entry
        if victim is None:
            return False
        del self._entries[(victim.event, victim.syscall, victim.context)]
        for f in victim.frames:
            left = self._frame_refs[f] - 1
            if left:
                self._frame_refs[f] = left
            else:
                del self._frame_refs[f]
                del self._frames[f]
        self.dropped["context_evicted"] = self.dropped.get("context_evicted", 0) + 1
        return True

    # ------------------------------------------------------------------------------ reading
    def hot(self, event: str = "syscall", top_k: int = 20, since_ns: int = 0,
            syscall: str | None = None) -> list[HotContext]:
        """The ``top_k`` most frequent contexts of ``event`` (counts since ``since_ns`` at bucket
        resolution; all-time totals when 0)."""
        with self._lock:
            rows = []
            for e in self._entries.values():
                if e.event != event or (syscall and e.syscall != syscall):
                    continue
                if since_ns > 0:
                    cutoff = since_ns - since_ns % self.bucket_ns
                    count = sum(c for start, c in e.buckets if start >= cutoff)
                else:
                    count = e.count
                if count:
                    rows.append((count, e))
            rows.sort(key=lambda r: (-r[0], r[1].context, r[1].syscall))
            return [HotContext(e.context, e.event, e.syscall, count, e.complete,
                               tuple(frame_dict(f) for f in e.frames),
                               e.first_ns, e.last_ns) for count, e in rows[:max(0, top_k)]]

    def total(self, event: str = "syscall", since_ns: int = 0, syscall: str | None = None) -> int:
        """Samples of ``event`` held in the table (since ``since_ns`` at bucket resolution)."""
        cutoff = since_ns - since_ns % self.bucket_ns if since_ns > 0 else 0
        with self._lock:
            return sum((sum(c for start, c in e.buckets if start >= cutoff) if since_ns > 0 else e.count)
                       for e in self._entries.values()
                       if e.event == event and (not syscall or e.syscall == syscall))

    def resolve(self, context: str) -> tuple[bool, tuple[dict[str, Any], ...]] | None:
        """Completeness and frames of a context id the table holds (None when it does not): what
        an id of the metrics or of a sample stands for."""
        with self._lock:
            for e in self._entries.values():
                if e.context == context:
                    return e.complete, tuple(frame_dict(f) for f in e.frames)
        return None

    def context_count(self) -> int:
        with self._lock:
            return len(self._entries)

    def scrape(self, now_ns: int | None = None) -> list[Series]:
        """Retire, promote, then return every exported series (promoted contexts and ``other``)."""
        now = self.clock() if now_ns is None else now_ns
        with self._lock:
            if self.retire_ns:
                self._retire(now)
            for event in {e.event for e in self._entries.values()}:
                self._promote(event, now)
            out = []
            for e in self._entries.values():
                if e.promoted:
                    out.append(Series(e.event, e.syscall, e.context, e.leaf, e.series,
                                      _program_functions(e.frames), e.complete))
                e.pending = 0
            for (event, syscall), value in self._other.items():
                out.append(Series(event, syscall, OTHER, "", value))
            out.sort(key=lambda s: (s.event, s.syscall, s.context == OTHER, s.context))
            return out

    def _promote(self, event: str, now: int) -> None:
        cutoff = now - self.window_ns
        ranked = []
        for e in self._entries.values():
            if e.event != event:
                continue
            recent = sum(c for start, c in e.buckets if start + self.bucket_ns > cutoff)
            if recent:
                ranked.append((recent, e))
        ranked.sort(key=lambda r: (-r[0], r[1].context, r[1].syscall))
        for _, e in ranked[:self.top_k]:
            if e.promoted or self._promoted_count.get(event, 0) >= self.max_series:
                continue
            e.promoted = True
            self._promoted_count[event] = self._promoted_count.get(event, 0) + 1
            # Samples since the previous scrape were never exported under "other": move them (a
            # retired series promoted again resumes from its last value: still monotonic).
            e.series += e.pending
            self._other[(event, e.syscall)] -= e.pending
            e.pending = 0

    def retune(self, *, max_contexts: int, top_k: int, max_series: int, promotion_window_seconds: int,
               retire_after_seconds: int) -> None:
        """A reloaded ``[daemon]``'s bounds for this running store (counts kept).  A lower
        ``max_series`` retires the series seen longest ago (as :meth:`_retire` does); bucket width
        and depth stay: existing buckets were cut at the old width."""
        with self._lock:
            self.max_contexts, self.top_k, self.max_series = max_contexts, top_k, max_series
            self.window_ns = promotion_window_seconds * 1_000_000_000
            self.retire_ns = retire_after_seconds * 1_000_000_000
            for event in list(self._promoted_count):
                ranked = sorted((e for e in self._entries.values() if e.promoted and e.event == event),
                                key=lambda e: (e.last_ns, e.context, e.syscall))
                for e in ranked[:max(0, len(ranked) - max_series)]:
                    e.promoted = False
                    self._promoted_count[event] -= 1
                    self.retired += 1

    def _retire(self, now: int) -> None:
        """Stop exporting promoted contexts not seen for ``retire_ns``: frees their ``max_series``
        slots (the bound on exported series holds at every scrape)."""
        cutoff = now - self.retire_ns
        for e in self._entries.values():
            if e.promoted and e.last_ns < cutoff:
                e.promoted = False
                self._promoted_count[e.event] -= 1
                self.retired += 1

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return {"samples": self.samples, "incomplete": self.incomplete, "dropped": dict(self.dropped),
                    "retired": self.retired,
                    "contexts": len(self._entries), "frames": len(self._frames)}
