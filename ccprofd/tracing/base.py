"""What both tracer modes do the same way once their BPF side has produced records: the poll loop
(new contexts decoded first, hits resolved through the kernel's context table), aggregate-mode
counting, the incomplete-sample tally, the common summary, and the lazily made thread-context
reader.  A mode supplies how to receive, classify and decode its own records
(:class:`ModeBase`'s abstract methods); everything here is mode-agnostic.
"""

from __future__ import annotations

import functools
import gc
import os
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from ccprofd.kbpf.bpfmap import RawMap
from ccprofd.kbpf.syscalls import syscall_arg_kinds, syscall_name
from ccprofd.tracing.api import RECORDS_PER_POLL, TraceOptions, TraceSample, path_args
from ccprofd.tracing.frames import Decoded
from ccprofd.tracing.history import HistoryEvent, read_thread
from ccprofd.tracing.history import threads as history_threads
from ccprofd.tracing.kernelcounts import KernelCounts
from ccprofd.tracing.patharg import file_inode

Record = TypeVar("Record")
Key = TypeVar("Key", bound=Hashable)

LOST_CONTEXT = "context record lost"

# A hit whose context's record never came (counted in KernelCounts.lost).
LOST_DECODED = Decoded([], False, LOST_CONTEXT)

# A recorded event whose context the tracer never decoded (or no longer holds).
HISTORY_UNKNOWN = Decoded([], False, "context not known: its sample record was lost or is too old")
RECENT_PLAIN = 8192  # samples sent on their own remembered for the flight recorder (~1 kB each)
# Decoded contexts a Session's mode keeps for the hits that name them (~1 kB each); past it the
# oldest is forgotten and its later hits are counted as lost (issue 16: bounded memory).
TRACE_MAX_CONTEXTS = 65536

# Record kinds (ModeBase._kind).
SIDE, PLAIN, NEW, HIT = range(4)


@functools.cache
def _arg_count(name: str | None) -> int:
    """How many argument words a sample of syscall ``name`` keeps (all six when it is unknown)."""
    kinds = syscall_arg_kinds(name)
    return 6 if kinds is None else len(kinds)


# (name, argument words kept) by syscall number (None: a CPU sample), filled as numbers are seen.
SYSCALL_INFO: dict[int | None, tuple[str | None, int]] = {}


def syscall_info(nr: int | None) -> tuple[str | None, int]:
    """(name, argument words kept) of syscall ``nr``, remembered in :data:`SYSCALL_INFO`."""
    name = syscall_name(nr)
    got = SYSCALL_INFO[nr] = (name, _arg_count(name))
    return got


# Syscalls that never return to their caller: their samples are written at once, with strace's ``= ?``.
NO_RETURN = frozenset({"exit", "exit_group"})
# How much earlier than its sample a return may be stamped: none, as both modes convert a sample's
# and a return's CLOCK_MONOTONIC times with the same offset (a sample is stamped at entry).
RET_SLACK_NS = 0
# The shared sampler's ring (process events) with --retval, which adds a 64-byte record per traced
# syscall: 8 MB, so a 100k-syscall burst fits as the samples' own ring does (64 pages without).
RET_RINGBUF_PAGES = 2048


class ReturnJoiner:
    """``--retval``: each syscall sample waits here for its thread's return record (the shared
    sampler's sys_exit program) and is written with it.  A thread's returns come in order, so a
    return that is not the oldest waiting sample's (another syscall, or one made after the thread's
    next call entered: the oldest's return was lost) ends that sample as never returned (``= ?``),
    as do exit/exit_group (at once, or after the thread's calls still waiting), the thread's exit
    (see :meth:`_ended_threads`) and the end of the trace (:meth:`flush`).  Returns and samples
    come through different rings, read in batches, so a return may arrive polls before its sample:
    it waits for it, until a later sample of its thread shows that its own never came.

    Nothing waits forever when records are dropped (full rings): a poll that read the rings dry
    ends what can no longer be joined (:meth:`_expire`), and at most :data:`MAX_EARLY_RETURNS`
    returns wait for their samples.  What is given up is counted in :attr:`returns_lost` (samples
    written ``= ?`` though their call returned: its record was lost) and
    :attr:`returns_unjoined` (return records whose sample never came), reported as drops."""

    # Returns kept waiting for their samples at most (~100 bytes each); a later one is given up
    # (counted) until a poll reads the rings dry.
    MAX_EARLY_RETURNS = 65536

    def __init__(self) -> None:
        self.open: dict[int, deque[TraceSample]] = {}  # tid -> samples waiting, oldest first
        # tid -> (time, nr, ret, poll received) come early
        self.orphans: dict[int, deque[tuple[int, int, int, int]]] = {}
        self._early = 0  # returns in self.orphans
        self._gone: set[int] = set()  # tids with waiting samples whose thread was gone at the last poll
        self._poll = 0  # join() calls so far
        self._arrived: dict[int, int] = {}  # id(sample) waiting -> the poll it came in
        self.returns_lost = 0
        self.returns_unjoined = 0
        # tid -> time of its first syscall sample: a return before it belongs to a call entered
        # before tracing began (the traced command's execve, a -p thread blocked in a read), whose
        # sample was never to be taken, not to a dropped one (cleared past MAX_EARLY_RETURNS tids)
        self._first: dict[int, int] = {}

    def drops(self) -> dict[str, int]:
        """What could not be joined so far, by reason (api.DROPS)."""
        return {"return_lost": self.returns_lost, "return_unjoined": self.returns_unjoined}

    def join(self, samples: list[TraceSample], rets: list[tuple[int, int, int, int]],
             drained: bool = True) -> list[TraceSample]:
        """The samples ready to write: those of ``samples`` that are not syscalls or never return,
        and every waiting sample whose return came in ``rets`` (time, tid, nr, ret) or never will.
        ``drained``: this poll read every record the rings held (it did not stop at its budget)."""
        self._poll += 1
        ready: list[TraceSample] = []
        for s in samples:
            if s.event == "syscall" and s.time_ns < self._first.get(s.tid, s.time_ns + 1):
                if len(self._first) >= self.MAX_EARLY_RETURNS:
                    self._first.clear()
                self._first[s.tid] = s.time_ns
            if s.event != "syscall":
                ready.append(s)
            elif s.syscall in NO_RETURN:
                s.returned = False
                q = self.open.get(s.tid)
                if q:  # behind the thread's earlier calls still waiting for their returns
                    self._wait(q, s)
                else:
                    ready.append(s)
            elif not self._take_orphan(s):
                self._wait(self.open.setdefault(s.tid, deque()), s)
            else:
                ready.append(s)
        for t, tid, nr, ret in rets:
            name = syscall_name(nr)
            q = self.open.get(tid)
            matched = False
            while q and q[0].time_ns <= t + RET_SLACK_NS:
                head = self._pop(q)
                if head.syscall == name and not (q and q[0].time_ns < t):  # (the thread's next call
                    # entered before this return: the head's own return was lost, this is a later one)
                    head.returned, head.ret = True, ret
                    ready.append(head)
                    matched = True
                    break
                self._lost(head)  # a later syscall of its thread returned first: this one never will
                ready.append(head)
            while q and q[0].syscall in NO_RETURN:  # an exit that waited behind the call just ended
                ready.append(self._pop(q))
            if q is not None and not q:
                del self.open[tid]
            if not matched:
                if self._early < self.MAX_EARLY_RETURNS:
                    self.orphans.setdefault(tid, deque()).append((t, nr, ret, self._poll))
                    self._early += 1
                else:
                    self._unjoined(tid, t)
        ready.extend(self._ended_threads(drained))
        if drained:
            ready.extend(self._expire())
        ready.sort(key=lambda s: s.time_ns)  # written in the order they were made, within a poll
        return ready

    def _wait(self, q: deque[TraceSample], s: TraceSample) -> None:
        q.append(s)
        self._arrived[id(s)] = self._poll

    def _pop(self, q: deque[TraceSample]) -> TraceSample:
        s = q.popleft()
        self._arrived.pop(id(s), None)
        return s

    def _lost(self, s: TraceSample) -> None:
        """``s``'s call returned (a later call of its thread came), but its return record was lost."""
        if s.syscall not in NO_RETURN:
            s.returned = False
            self.returns_lost += 1

    def _expire(self) -> list[TraceSample]:
        """At a poll that read the rings dry, what can no longer be joined.  A record is in its
        ring before anything its thread does later is recorded, so every record made before one
        that an earlier poll received has been read by now: a return received at an earlier poll
        whose sample is still not here lost it (the sample was dropped), and a waiting sample
        followed by a later sample of its thread received at an earlier poll lost its return.
        Only a thread's last call may still be running (a blocking read can wait for hours)."""
        for tid, early in list(self.orphans.items()):
            while early and early[0][3] < self._poll:
                self._unjoined(tid, early.popleft()[0])
                self._early -= 1
            if not early:
                del self.orphans[tid]
        out: list[TraceSample] = []
        for tid, q in list(self.open.items()):
            while len(q) > 1 and self._arrived.get(id(q[1]), self._poll) < self._poll:
                head = self._pop(q)
                self._lost(head)
                out.append(head)
            while q and q[0].syscall in NO_RETURN:  # an exit that waited behind the calls ended
                out.append(self._pop(q))
            if not q:
                del self.open[tid]
        return out

    def _take_orphan(self, s: TraceSample) -> bool:
        """Join ``s`` to a return that came before it; returns older than ``s`` are dropped (their
        own samples would have come before ``s``: they never will)."""
        early = self.orphans.get(s.tid)
        if early is None:
            return False
        while early and early[0][0] + RET_SLACK_NS < s.time_ns:
            self._unjoined(s.tid, early.popleft()[0])
            self._early -= 1
        took = bool(early) and syscall_name(early[0][1]) == s.syscall
        if took:
            s.returned, s.ret = True, early.popleft()[2]
            self._early -= 1
        if not early:
            del self.orphans[s.tid]
        return took

    def _ended_threads(self, drained: bool) -> list[TraceSample]:
        """Waiting samples of threads seen gone at an earlier poll, once a poll has read the rings
        dry: every record such a thread made was in them before, so its returns are all read (the
        return records may lag its samples by many polls)."""
        out: list[TraceSample] = []
        gone = set()
        for tid, q in list(self.open.items()):
            if os.path.exists(f"/proc/{q[0].pid}/task/{tid}"):
                continue
            if tid in self._gone and drained:
                out.extend(self._never_returned(self.open.pop(tid)))
                self._drop_orphans(tid)
            else:
                gone.add(tid)
        self._gone = gone
        return out

    def _drop_orphans(self, tid: int) -> None:
        early = self.orphans.pop(tid, None)
        if early:
            self._early -= len(early)
            for t, _nr, _ret, _poll in early:
                self._unjoined(tid, t)

    def _unjoined(self, tid: int, t: int) -> None:
        """A return given up: counted as a drop when its thread had a sample made before it."""
        if self._first.get(tid, t) < t:
            self.returns_unjoined += 1

    def _never_returned(self, q: deque[TraceSample]) -> list[TraceSample]:
        for s in q:
            s.returned = False
            self._arrived.pop(id(s), None)
        return list(q)

    def flush(self) -> list[TraceSample]:
        """Every waiting sample, as never returned (the trace ends), oldest first."""
        out = [s for q in self.open.values() for s in self._never_returned(q)]
        self.open.clear()
        for tid in list(self.orphans):
            self._drop_orphans(tid)
        return sorted(out, key=lambda s: s.time_ns)


class ContextReader(Protocol):
    """GetThreadContexts for one mode: every thread's context of a process, now."""

    def read(self, pid: int) -> dict[str, Any]: ...
    def close(self) -> None: ...


def _remember(recent: dict[tuple[int, int], Decoded], order: deque[tuple[int, int]],
              key: tuple[int, int], d: Decoded) -> None:
    """Keep a sample sent on its own for the flight recorder, the last :data:`RECENT_PLAIN` of
    them (oldest dropped by ``order``: a dict's first key is found past the holes its deletions
    leave, O(n) each)."""
    if key not in recent:
        order.append(key)
    recent[key] = d
    if len(order) > RECENT_PLAIN:
        recent.pop(order.popleft(), None)


def shown_path(given: str, real: str) -> str:
    """The name frames give the traced binary: the path the user configured or executed when it is
    another name of the same file, else ``real``.  Debian's /usr/bin/redis-server is a symlink to
    redis-check-rdb, and whoever started redis-server looks for that name.  Only a name: the file's
    identity (its inode, its mappings in /proc/PID/maps, which name the real file) stays ``real``."""
    if given.startswith("/proc/"):
        return real
    shown = os.path.abspath(given)
    if shown == real:
        return real
    try:
        return shown if os.path.samefile(shown, real) else real
    except OSError:
        return real


def rings_shown(rings: dict[int, list[HistoryEvent]], pid: int) -> list[int]:
    """The recorder's rings a history query for ``pid`` shows: its own when ``pid`` is a thread's tid
    with a ring of its own, else those of every thread of process ``pid``."""
    if pid in rings and (not rings[pid] or rings[pid][0].tgid != pid):
        return [pid]
    return sorted(t for t, evs in rings.items() if evs and evs[0].tgid == pid)


class ModeBase(ABC, Generic[Record, Key]):
    """The shared half of :class:`~ccprofd.tracing.api.Mode` implementations."""

    name = ""

    def __init__(self, binary: str, options: TraceOptions) -> None:
        # /proc/PID/root/...: a binary in another mount namespace; resolving it would leave that namespace.
        self.path = binary if binary.startswith("/proc/") else os.path.realpath(binary)
        self.shown_path = shown_path(binary, self.path)  # the module name of the binary's frames
        self.options = options
        # its inode now: a path argument is read from this file later only if it is still that file
        self.binary_inode = file_inode(self.path)
        self.build_id: str | None = None
        self._kernel: KernelCounts[Key] = KernelCounts()
        self._per_sample = True
        self.context_samples = True  # keep what poll_counted() needs (a Session turns it off)
        self.records = 0  # sample records received (new contexts only, in aggregate mode)
        self.samples_seen = 0
        self.incomplete = 0
        self.reasons: dict[str, int] = {}
        self._contexts: ContextReader | None = None  # GetThreadContexts: made at first use
        self._returns = ReturnJoiner()  # options.retval
        self._received = 0  # records the last poll read
        # (tid, time_ns) -> Decoded of the latest samples sent on their own (no kernel key), for
        # the flight recorder's events (history)
        self._recent_plain: dict[tuple[int, int], Decoded] = {}
        self._recent_order: deque[tuple[int, int]] = deque()  # its keys, oldest first

    # ------------------------------------------------------------------------ a mode's own part
    @abstractmethod
    def _receive(self, timeout_ms: int) -> list[Record]:
        """The records that arrived, in order (samples and the mode's side events)."""

    @abstractmethod
    def _kind(self, r: Record) -> int:
        """What a record is: :data:`SIDE` (an exec, a scope entry...: given to
        :meth:`_on_side_event` in order), :data:`PLAIN` (a sample of its own), :data:`NEW` (a new
        context's first record in aggregate mode: its key names it in later hits) or :data:`HIT`
        (a repeated sample sent as its context's key only).  One call per record: it is the hot
        path when a flood of repeated samples is decoded."""

    def _kinds(self, raw: list[Record]) -> list[int]:
        """:meth:`_kind` of every record (a mode may compute them in one comprehension)."""
        kind = self._kind
        return [kind(r) for r in raw]

    def _on_side_event(self, r: Record) -> None:
        """A side event, seen between the samples it arrived among."""

    @abstractmethod
    def _key(self, r: Record) -> Key: ...

    @abstractmethod
    def _decode(self, r: Record) -> Decoded: ...

    @abstractmethod
    def _sample(self, r: Record, d: Decoded, *, timed: bool = True) -> TraceSample:
        """The TraceSample of a record (``timed=False``: the context's representative, no time)."""

    @abstractmethod
    def _kernel_counts(self) -> Mapping[Key, int]:
        """The kernel's per-context sample counts (empty while not aggregating)."""

    @abstractmethod
    def _new_context_reader(self) -> ContextReader: ...

    def _history_map(self) -> RawMap | None:
        """The flight recorder's map (tracing/history.c), None when it is compiled out."""
        return None

    def _history_key(self, ev: HistoryEvent) -> Key | None:
        """The kernel key a recorded event's context was counted under (None: the sample was sent
        on its own, found by its thread and time instead)."""
        return None

    def _history_clock_offset(self) -> int:
        """What turns a recorded CLOCK_MONOTONIC time into the samples' wall-clock time."""
        return 0

    def _after_poll(self) -> None:
        """Work after each poll's records (e.g. --verify joins its stack walks)."""

    # --------------------------------------------------------------------------- shared part
    @staticmethod
    def trace_sample(r_time: int, pid: int, tid: int, event: str, nr: int | None, d: Decoded,
                     arg: str | None = None, sargs: tuple[int, ...] | None = None) -> TraceSample:
        name, nargs = SYSCALL_INFO.get(nr) or syscall_info(nr)  # once per sample: one lookup, not two calls
        return TraceSample(r_time, pid, tid, event, name, d.complete, d.json_frames(),
                           path_args(name, arg) if arg is not None else None,
                           None if sargs is None or nr is None else sargs[:nargs], None, None,
                           None if d.complete else d.reason)

    def _later_context(self, r: Record, d: Decoded) -> Any:
        """What :meth:`_representative` makes a new context's sample from, kept until then (a
        mode keeps less than the whole record where it can)."""
        return (r, d)

    def _representative(self, arg: Any) -> TraceSample:
        """A new context's sample without its time (what the daemon's store keeps for it), from
        :meth:`_later_context`'s value."""
        return self._sample(arg[0], arg[1], timed=False)

    def poll(self, timeout_ms: int) -> list[TraceSample]:
        # The cyclic GC waits while a poll's records are read and decoded: they, their samples and
        # the decoding's temporaries (tens of containers per record, all alive till the batch is
        # done) are no garbage, yet every 700 of them a collection ran and moved them towards the
        # oldest generation, whose full passes then walked every context kept (~20% of a new
        # context's cost).  After the poll the first allocation starts one young collection.
        enabled = gc.isenabled()
        gc.disable()
        try:
            out = self._poll_decoded(timeout_ms, in_kernel=False)[0]
        finally:
            if enabled:
                gc.enable()
        if not self.options.retval:
            return out
        rets = self._take_returns()
        return self._returns.join(out, rets, self._received + len(rets) < RECORDS_PER_POLL)

    def _take_returns(self) -> list[tuple[int, int, int, int]]:
        """The return records received since the last call: (wall-clock time, tid, nr, ret)."""
        return []

    def unfinished(self) -> list[TraceSample]:
        """At the end of a trace: the samples still waiting for their return (``= ?``)."""
        return self._returns.flush()

    def _poll_decoded(self, timeout_ms: int, *, in_kernel: bool) -> tuple[list[TraceSample], list[bool]]:
        """Every sample record as a TraceSample, and for each whether it is one sample counted here
        (False with ``in_kernel`` for new and repeated contexts: the kernel's count has them).
        Written for speed: a repeated context costs a key lookup and one TraceSample."""
        raw = self._receive(timeout_ms)
        self._received = len(raw)
        fast = None if in_kernel else self._hits_only(raw)
        if fast is not None:  # a batch of hits only (a flood of repeated contexts), compiled
            made, seen, lost, incomplete = fast
            self._kernel.lost += lost
            for d in incomplete:
                self._count(False, d.reason, 1)
            self.samples_seen += seen
            self.records += len(made)
            self._after_poll()
            return made, [True] * len(made)
        kinds = self._kinds(raw)
        fresh: dict[int, Decoded] = {}  # by id(record): the records are held in ``raw``
        key = self._key
        sample = self._sample
        if NEW in kinds:  # new contexts first: a hit (another CPU) may overtake its context's record
            learn, make, later = self._kernel.learn_later, self._representative, self._later_context
            bounded, keep = self._kernel.learn_bounded, self.context_samples
            for r, k in zip(raw, kinds, strict=True):
                if k == NEW:
                    d = fresh[id(r)] = self._decode(r)
                    if keep:  # the daemon's context sample (no time), made only if poll_counted() needs it
                        learn(key(r), make, later(r, d), d)
                    else:
                        bounded(key(r), d, TRACE_MAX_CONTEXTS)
        out: list[TraceSample] = []
        counted: list[bool] = []
        append = out.append
        hit = self._kernel.hit
        seen, recorder = 0, self.options.history != 0  # history 0: no recorder to find samples for
        for r, k in zip(raw, kinds, strict=True):
            if k == HIT:
                d = hit(key(r)) or LOST_DECODED
            elif k == NEW:
                d = fresh[id(r)]
            elif k == PLAIN:
                d = self._decode(r)
            else:
                self._on_side_event(r)
                continue
            append(sample(r, d))
            if k == PLAIN and recorder:  # the recorder finds a sample sent on its own by thread and time
                _remember(self._recent_plain, self._recent_order, (out[-1].tid, out[-1].time_ns), d)
            if in_kernel:
                counted.append(k == PLAIN)
                if k != PLAIN:
                    continue
            if d.complete:
                seen += 1
            else:
                self._count(False, d.reason, 1)
        if not in_kernel:
            counted = [True] * len(out)
        self.samples_seen += seen
        self.records += len(out)
        self._after_poll()
        return out, counted

    def _hits_only(self, raw: list[Record]) -> tuple[list[TraceSample], int, int, list[Decoded]] | None:
        """What :meth:`_poll_decoded` makes of ``raw`` when every record is a hit and the mode has a
        compiled loop for that: (samples, complete ones, hits of unknown contexts, the Decoded of
        each incomplete sample); None: the Python loop (the reference) does it."""
        return None

    def poll_counted(self, timeout_ms: int) -> tuple[list[tuple[TraceSample, bool]],
                                                     list[tuple[TraceSample, int]]]:
        """The daemon's poll: ``(records, counts)``.  ``records``: every record received, each with
        whether it is itself one sample to count (without aggregation, CPU samples, states too big
        to key, contexts the full kernel table could not take); ``counts``: ``(context, n)``, the
        samples the kernel counted under each context since the previous call, whether or not
        per-sample records were sent for them (BPF increments a context's count before it sends
        its record, so counting from the map alone neither loses nor repeats a sample when the
        per-sample switch flips).

        The map is read after the ring buffer is drained: a context whose first record is not in
        yet (still being sent by another CPU) is left for the next call, its count not yet taken,
        so nothing is lost (see kernelcounts.py); under a flood, not at every poll (``read_due``)."""
        assert self.context_samples, "poll_counted() on a mode that keeps no context samples"
        samples, counted = self._poll_decoded(timeout_ms, in_kernel=True)
        records = list(zip(samples, counted, strict=True))
        counts: list[tuple[TraceSample, int]] = []
        if not self._kernel.read_due(flooding=bool(samples) and timeout_ms != 0):
            return records, counts
        for ctx, d, n in self._kernel.deltas(self._kernel_counts()):
            counts.append((ctx, n))
            self._count(d.complete, d.reason, n)
        return records, counts

    def _count(self, complete: bool, reason: str | None, n: int) -> None:
        """Tally ``n`` samples (complete or not, with the reason's first word)."""
        self.samples_seen += n
        if not complete:
            self.incomplete += n
            key = (reason or "?").split(":")[0]
            self.reasons[key] = self.reasons.get(key, 0) + n

    def _summary(self, per_sample_records: bool) -> dict[str, Any]:
        return {"mode": self.name, "samples": self.samples_seen, "incomplete": self.incomplete,
                "incomplete_reasons": dict(self.reasons), "records": self.records,
                "per_sample_records": per_sample_records, "lost_contexts": self._kernel.lost}

    def thread_contexts(self, pid: int) -> dict[str, Any]:
        """Every thread's context now: ``{"pid", "error", "threads": [...]}``."""
        if self._contexts is None:
            self._contexts = self._new_context_reader()
        return self._contexts.read(pid)

    def history(self, pid: int, last: int = 0) -> dict[str, Any]:
        """The flight recorder (tracing/history.c): the last recorded syscall samples of each
        thread of process ``pid`` -- or of thread ``pid`` alone when it is a tid with a ring of
        its own -- decoded, oldest first (``last``: at most that many per thread; 0: all kept).
        ``{"pid", "error", "threads": [{"tid", "events": [sample JSON...]}]}``; a context the
        tracer has not decoded (its record lost) is ``complete: false`` with a reason."""
        hmap = self._history_map()
        out: dict[str, Any] = {"pid": pid, "error": None, "threads": []}
        if hmap is None:
            out["error"] = "the flight recorder is off (CCPROFD_HISTORY=0)"
            return out
        rings = {tid: read_thread(hmap, tid) for tid in history_threads(hmap)}
        chosen = rings_shown(rings, pid)
        for tid in chosen:
            evs = rings[tid][-last:] if last > 0 else rings[tid]
            out["threads"].append({"tid": tid, "events": [self.history_sample(ev).to_json() for ev in evs]})
        if not chosen:
            out["error"] = f"no recorded syscalls of pid {pid}"
        return out

    def history_threads(self) -> dict[int, list[dict[str, Any]]]:
        """Every recorded thread's events, decoded, oldest first: ``{tid: [sample JSON...]}`` (what
        the daemon persists); empty when the recorder is off."""
        hmap = self._history_map()
        if hmap is None:
            return {}
        return {tid: [self.history_sample(ev).to_json() for ev in read_thread(hmap, tid)]
                for tid in history_threads(hmap)}

    def history_before(self, tid: int, time_ns: int, last: int) -> list[dict[str, Any]]:
        """Thread ``tid``'s recorded samples before wall-clock ``time_ns`` (an alert's
        sample), the ``last`` latest, oldest first: what an alert carries as ``history``."""
        hmap = self._history_map()
        if hmap is None or last <= 0:
            return []
        off = self._history_clock_offset()
        evs = [ev for ev in read_thread(hmap, tid) if ev.time_ns + off < time_ns]
        return [self.history_sample(ev).to_json() for ev in evs[-last:]]

    def history_sample(self, ev: HistoryEvent) -> TraceSample:
        """A recorded event as a TraceSample, its context decoded from the tracer's caches."""
        t = ev.time_ns + self._history_clock_offset()
        key = self._history_key(ev)
        d: Decoded | None = None
        if key is not None:
            got = self._kernel.known(key)
            d = got[1] if got is not None else None
        if d is None:
            d = self._recent_plain.get((ev.tid, t))
        if d is None:
            d = HISTORY_UNKNOWN
        name, nargs = SYSCALL_INFO.get(ev.syscall) or syscall_info(ev.syscall)
        return TraceSample(t, ev.tgid, ev.tid, "syscall", name, d.complete, d.json_frames(), None,
                           ev.args[:nargs], None, None, None if d.complete else d.reason)

    def _close_contexts(self) -> None:
        """Thread snapshots' private vDSO copies go with the reader (ccprofd/proc/modules.py)."""
        reader, self._contexts = self._contexts, None
        if reader is not None:
            reader.close()

