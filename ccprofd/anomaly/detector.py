"""Detection: compare decoded samples with a learned :class:`TargetModel` and raise alerts.

Alert kinds:

* ``unseen_context`` — the (syscall, exact context) pair was never learned (or was seen fewer than
  ``min_count`` times), and no allow rule covers it.  With ``granularity="edges"``: some call edge
  of the context (caller function at a call site -> callee, see
  :func:`~ccprofd.anomaly.model.context_edges`) was never learned for that syscall; the alert names
  the first such edge (``unseen_edge``), because that edge, not the whole chain, is what is new.
  With ``granularity="routines"``: as ``edges``, but a context is also accepted when its one
  unseen part is a call into a routine shared for the syscall from a path learned for any syscall
  or seen running by CPU samples while learning (:func:`~ccprofd.anomaly.model.routine_junction`;
  with ``prefix_match="functions"`` a call on that path counts as seen when the same caller called
  the same callee at any call site); the alert names the first unseen edge too;
* ``unseen_transition`` — both contexts are known, but this thread never went from the previous
  one to this one (only when asked for and the model recorded transitions in every run);
* ``incomplete_context`` — the tracer flagged the sample ``complete: false``: the model cannot
  judge a context whose outer part is unknown, and says so instead of guessing.

Each alert carries the sample's identity, its decoded frames, cheap syscall arguments when the
sample carries them (``args``: e.g. the ``openat`` path, the ``execve`` filename), and the three known
contexts of the same syscall sharing the longest prefix with it, for comparison.  The same alert
(kind + context, + previous context for transitions) is emitted at most once per
``alert_interval_seconds`` of sample time; the next emission says how many were suppressed.

Samples the kernel only counted (the daemon's aggregate mode: a context's first sample is sent
whole, its repeats only counted per context) are judged by :meth:`Detector.check_repeats`: they
add to the suppressed count, and once the interval has passed they raise the alert again with
``counted`` set to how many samples it stands for and no identity (``pid``/``tid`` 0, no
arguments, the read's time): the kernel did not keep which thread made them, and the alert says
so instead of naming one.

Output is plain data: :meth:`Alert.to_dict` (one JSON object per line for ``ccprofd detect``, the
gRPC ``StreamAlerts`` message and the metric labels are built from it) and :meth:`Alert.log_line`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ccprofd.anomaly.model import (
    DEFAULT_MAX_CYCLE,
    GRANULARITIES,
    PREFIX_MATCHES,
    ContextKey,
    EdgeKey,
    FrameKey,
    TargetModel,
    collapse_cycles,
    common_prefix_len,
    context_edge_path,
    context_edges,
    context_key,
    function_edge,
    routine_junction,
    shared_routines,
    signal_handler_part,
)

KINDS = ("unseen_context", "unseen_transition", "incomplete_context")
_FRAME_OUT = ("function", "module", "build_id", "analysed", "call_site", "return_address", "tail_call")


@dataclass(frozen=True, slots=True)
class DetectorOptions:
    """Names match the daemon's ``[target.anomaly]`` keys where they overlap."""

    collapse_recursion: bool = False
    #: "exact": the whole context must have been learned; "edges": each of its call edges must have
    #: been learned for the syscall (generalises over prefixes and recursion depths); "routines":
    #: "edges" or one new call into a routine shared for the syscall from a known path.
    granularity: str = "exact"
    #: Granularity "routines": the edges before the shared-routine call must have been seen at their
    #: call sites ("sites"), or the same caller calling the same callee at any site ("functions":
    #: accepts a rarely run call site of a known call; gives away attacks that only change a site).
    prefix_match: str = "sites"
    max_cycle: int = DEFAULT_MAX_CYCLE
    transitions: bool = False
    #: Judge a syscall made under a signal handler by the handler's part of its context only (the
    #: interrupted part is wherever the signal landed: :func:`~ccprofd.anomaly.model.signal_handler_part`).
    split_signals: bool = True
    min_count: int = 1
    alert_interval_seconds: float = 60.0
    nearest: int = 3
    report_incomplete: bool = True


@dataclass(slots=True)
class Alert:
    kind: str
    time_ns: int
    pid: int
    tid: int
    syscall: str
    build_id: str
    complete: bool
    frames: list[dict[str, Any]]
    args: dict[str, Any] = field(default_factory=dict)
    nearest: list[dict[str, Any]] = field(default_factory=list)
    previous: dict[str, Any] | None = None
    suppressed: int = 0
    #: granularity "edges": the first edge of the context never learned for the syscall.
    unseen_edge: dict[str, Any] | None = None
    #: > 0: the alert stands for this many samples the kernel counted (aggregate mode), whose
    #: thread, time and arguments are unknown (pid, tid 0; time: when the count was read).
    counted: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind, "time_ns": self.time_ns, "pid": self.pid, "tid": self.tid,
            "syscall": self.syscall, "build_id": self.build_id, "complete": self.complete,
            "args": self.args, "frames": self.frames, "nearest": self.nearest,
            "suppressed": self.suppressed}
        if self.kind == "unseen_transition":
            out["previous"] = self.previous  # null: the thread's first sample
        if self.unseen_edge is not None:
            out["unseen_edge"] = self.unseen_edge
        if self.counted:
            out["counted"] = self.counted
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def log_line(self) -> str:
        """One structured line (key=value, journald-friendly); the context as ``a>b>c``."""
        chain = ">".join(str(f.get("function") or "?") for f in self.frames) or "-"
        args = "".join(f" {k}={json.dumps(v)}" for k, v in sorted(self.args.items()))
        edge = "" if self.unseen_edge is None else f" unseen_edge={edge_text(self.unseen_edge)}"
        who = f"pid={self.pid} tid={self.tid}" if not self.counted else f"counted={self.counted} pid=? tid=?"
        return (f"ccprofd alert kind={self.kind} syscall={self.syscall} {who} "
                f"build_id={self.build_id} complete={str(self.complete).lower()}{args} "
                f"suppressed={self.suppressed}{edge} context={chain}")


def edge_text(edge: Mapping[str, Any]) -> str:
    """``caller@site>callee`` (``-`` for the entry; the syscall name for the syscall itself)."""
    caller, callee = edge.get("caller"), edge.get("callee")
    left = "-" if not caller else f"{caller.get('function')}@{caller.get('call_site') or '?'}"
    right = edge.get("syscall", "?") if not callee else str(callee.get("function"))
    return f"{left}>{right}"


class RateLimiter:
    """Emit a given alert key at most once per interval (of sample time)."""

    def __init__(self, interval_seconds: float) -> None:
        self.interval_ns = int(interval_seconds * 1e9)
        self._last: dict[Any, int] = {}
        self._held: dict[Any, int] = {}

    def admit(self, key: Any, time_ns: int, n: int = 1) -> int | None:
        """None when suppressed (``n`` samples held); else how many were suppressed since the last
        emission."""
        last = self._last.get(key)
        if last is not None and self.interval_ns > 0 and time_ns - last < self.interval_ns:
            self._held[key] = self._held.get(key, 0) + n
            return None
        self._last[key] = time_ns
        return self._held.pop(key, 0)


_UNKNOWN = object()  # a thread's previous context was not judged (unseen or incomplete)


class Detector:
    """Judges samples of one target against its model.  Not thread-safe: one per sample stream."""

    def __init__(self, model: TargetModel, options: DetectorOptions | None = None) -> None:
        self.model = model
        self.options = options or DetectorOptions()
        if self.options.granularity not in GRANULARITIES:
            raise ValueError(f"granularity {self.options.granularity!r}: expected one of "
                             f"{', '.join(GRANULARITIES)}")
        if self.options.prefix_match not in PREFIX_MATCHES:
            raise ValueError(f"prefix_match {self.options.prefix_match!r}: expected one of "
                             f"{', '.join(PREFIX_MATCHES)}")
        if self.options.prefix_match != "sites" and self.options.granularity != "routines":
            raise ValueError(f"prefix_match \"{self.options.prefix_match}\" applies to granularity "
                             "\"routines\" only")
        if self.options.transitions and self.options.granularity != "exact":
            # Transitions are learned between exact contexts: an edge-accepted context has none.
            raise ValueError("transitions are checked between exact contexts: use granularity \"exact\" "
                             "with transitions")
        if self.options.transitions and not model.transitions_usable():
            raise ValueError(
                f"model of build-id {model.build_id} has transitions from {model.runs_with_transitions} of "
                f"{model.runs} learning runs; learn every run with transitions to detect unseen transitions")
        self._limiter = RateLimiter(self.options.alert_interval_seconds)
        self._last: dict[int, Any] = {}
        self.counts: dict[str, int] = dict.fromkeys(
            (*KINDS, "samples", "suppressed", "allowed_by_rule", "unmodelled_syscall"), 0)
        self._index()

    def _signal_view(self, syscall: str, frames: Sequence[FrameKey]) -> tuple[FrameKey, ...]:
        return signal_handler_part(syscall, frames) if self.options.split_signals else tuple(frames)

    def _view(self, syscall: str, frames: Sequence[FrameKey]) -> tuple[FrameKey, ...]:
        frames = self._signal_view(syscall, frames)
        if self.options.collapse_recursion:
            return collapse_cycles(frames, self.options.max_cycle)
        return tuple(frames)

    def _index(self) -> None:
        self._known: dict[ContextKey, int] = {}
        self._by_syscall: dict[str, list[tuple[ContextKey, int]]] = {}
        by_edges = self.options.granularity in ("edges", "routines")
        self._edges = self.model.edges(self._signal_view) if by_edges else {}
        need = max(1, self.options.min_count)
        self._any_edge: dict[EdgeKey, int] = {}
        self._shared: set[tuple[str, tuple[str, str]]] = set()
        if self.options.granularity == "routines":
            for (_, e), n in self._edges.items():
                self._any_edge[e] = self._any_edge.get(e, 0) + n
            for e, n in self.model.calls.items():  # calls CPU samples saw executing
                self._any_edge[e] = self._any_edge.get(e, 0) + n
            self._shared = shared_routines(self._edges, need)
        self._any_function_edge: dict[tuple[Any, Any], int] = {}
        if self.options.prefix_match == "functions":
            for e, n in self._any_edge.items():
                fe = function_edge(e)
                self._any_function_edge[fe] = self._any_function_edge.get(fe, 0) + n
        for key, st in self.model.contexts.items():
            view = (key[0], self._view(*key))
            self._known[view] = self._known.get(view, 0) + st.count
            self._by_syscall.setdefault(key[0], []).append((key, st.count))
        self._transitions: set[tuple[ContextKey | None, ContextKey]] = set()
        for a, b in self.model.transitions:
            va = None if a is None else (a[0], self._view(*a))
            self._transitions.add((va, (b[0], self._view(*b))))

    def known(self, key: ContextKey) -> bool:
        if self.options.granularity == "edges":
            return self.unseen_edge(key) is None
        if self.options.granularity == "routines":
            return self.unseen_edge(key) is None or self.junction(key) is not None
        view = (key[0], self._view(*key))
        return self._known.get(view, 0) >= max(1, self.options.min_count)

    def unseen_edge(self, key: ContextKey) -> EdgeKey | None:
        """The first (outermost) call edge of ``key`` learned fewer than ``min_count`` times for its
        syscall; None when every edge was learned (granularity "edges")."""
        need = max(1, self.options.min_count)
        for e in context_edges(self._signal_view(*key)):
            if self._edges.get((key[0], e), 0) < need:
                return e
        return None

    def junction(self, key: ContextKey) -> EdgeKey | None:
        """Granularity "routines": the call into a shared routine that makes ``key`` acceptable
        although some of its edges were not learned for its syscall (None: no such call)."""
        syscall = key[0]
        need = max(1, self.options.min_count)
        path = context_edge_path(self._signal_view(*key))

        by_function = self._any_function_edge  # empty unless prefix_match = "functions"

        def learned_any(e: EdgeKey) -> bool:  # seen for any syscall or running; by site, else by function
            if self._any_edge.get(e, 0) >= need:
                return True
            return bool(by_function) and by_function.get(function_edge(e), 0) >= need

        j = routine_junction(syscall, path, lambda e: self._edges.get((syscall, e), 0) >= need, learned_any,
                             lambda sc, fn: (sc, fn) in self._shared)
        return None if j is None else path[j]

    def _edge_out(self, syscall: str, edge: EdgeKey) -> dict[str, Any]:
        caller, callee = edge
        return {"syscall": syscall, "caller": None if caller is None else self._frame_out(caller),
                "callee": None if callee is None else {
                    "function": callee[1], "module": self.model.modules.get(callee[0], ""),
                    "build_id": callee[0]}}

    def nearest(self, key: ContextKey) -> list[dict[str, Any]]:
        """The known contexts of the same syscall sharing the longest prefix with ``key``."""
        syscall, frames = key
        candidates = self._by_syscall.get(syscall, [])
        scored = sorted(((common_prefix_len(frames, k[1]), n, k) for k, n in candidates),
                        key=lambda t: (-t[0], -t[1]))
        return [{"common_prefix": lcp, "count": n, "frames": [self._frame_out(f) for f in k[1]]}
                for lcp, n, k in scored[: self.options.nearest]]

    def _frame_out(self, f: FrameKey) -> dict[str, Any]:
        mid, fn, site = f
        return {"function": fn, "module": self.model.modules.get(mid, ""), "build_id": mid, "call_site": site}

    def check(self, sample: Mapping[str, Any], key: ContextKey | None = None) -> list[Alert]:
        """Alerts for one sample (after rate limiting); ``key``: its ``context_key``, if the caller
        has it already."""
        if sample.get("event", "syscall") != "syscall":
            return []
        self.counts["samples"] += 1
        tid = int(sample.get("tid", 0))
        key = context_key(sample) if key is None else key
        verdict = self._verdict(sample, key, 1)
        if verdict in ("unmodelled", "incomplete"):
            self._last[tid] = _UNKNOWN
            return self._emit_verdict(verdict, sample, key)
        prev = self._last.get(tid)
        view = (key[0], self._view(*key))
        if verdict == "unseen":
            self._last[tid] = _UNKNOWN
            return self._emit_verdict(verdict, sample, key)
        self._last[tid] = view
        if verdict == "allowed" or not self.options.transitions or prev is _UNKNOWN:
            return []
        prev_view: ContextKey | None = prev if isinstance(prev, tuple) else None
        if (prev_view, view) in self._transitions:
            return []
        return self._emit("unseen_transition", ("unseen_transition", prev_view, view), sample, key,
                          previous=prev_view)

    def check_repeats(self, sample: Mapping[str, Any], n: int, time_ns: int) -> list[Alert]:
        """Alerts for ``n`` more samples of ``sample``'s context that only the kernel counted, read
        at ``time_ns`` (aggregate mode).  Judged as :meth:`check` judges the context; an alert for
        them carries ``counted = n`` and no thread, time or arguments of its own.  Transitions are
        not judged (they need every sample in order: the daemon keeps per-sample records then)."""
        if n <= 0 or sample.get("event", "syscall") != "syscall":
            return []
        self.counts["samples"] += n
        key = context_key(sample)
        return self._emit_verdict(self._verdict(sample, key, n), sample, key, counted=n, time_ns=time_ns)

    def _verdict(self, sample: Mapping[str, Any], key: ContextKey, n: int) -> str:
        """What the model says of ``n`` samples of a context, the counters updated: "unmodelled"
        (a syscall the model did not learn), "incomplete", "allowed" (by a rule), "known" or
        "unseen"."""
        if not self.model.learned_syscall(key[0]):
            self.counts["unmodelled_syscall"] += n
            return "unmodelled"
        if not sample.get("complete", True):
            return "incomplete"
        if self.model.allowed_by_rule(key) is not None:
            self.counts["allowed_by_rule"] += n
            return "allowed"
        return "known" if self.known(key) else "unseen"

    def _emit_verdict(self, verdict: str, sample: Mapping[str, Any], key: ContextKey, counted: int = 0,
                      time_ns: int | None = None) -> list[Alert]:
        """The alert a verdict raises, if any (transitions aside: :meth:`check` judges those)."""
        if verdict == "incomplete" and self.options.report_incomplete:
            return self._emit("incomplete_context", ("incomplete_context", key), sample, key,
                              counted=counted, time_ns=time_ns)
        if verdict == "unseen":
            view = (key[0], self._view(*key))
            return self._emit("unseen_context", ("unseen_context", view), sample, key,
                              counted=counted, time_ns=time_ns)
        return []

    def thread_exited(self, tid: int) -> None:
        self._last.pop(tid, None)

    def _emit(self, kind: str, rkey: Any, sample: Mapping[str, Any], key: ContextKey,
              previous: ContextKey | None = None, counted: int = 0,
              time_ns: int | None = None) -> list[Alert]:
        """One alert for the sample (``counted`` = 0), or for ``counted`` samples the kernel only
        counted (no identity: see :meth:`check_repeats`), unless the rate limit holds it."""
        if time_ns is None:
            time_ns = int(sample.get("time_ns", 0))
        held = self._limiter.admit(rkey, time_ns, max(1, counted))
        if held is None:
            self.counts["suppressed"] += max(1, counted)
            return []
        self.counts[kind] += 1
        args = sample.get("args") if not counted else None
        alert = Alert(
            kind=kind, time_ns=time_ns, pid=0 if counted else int(sample.get("pid", 0)),
            tid=0 if counted else int(sample.get("tid", 0)),
            syscall=key[0], build_id=self.model.build_id, complete=bool(sample.get("complete", True)),
            frames=[{k: f[k] for k in _FRAME_OUT if k in f} for f in sample.get("frames", [])],
            args=dict(args) if isinstance(args, Mapping) else {},
            nearest=self.nearest(key), suppressed=held, counted=counted)
        if kind == "unseen_context" and self.options.granularity in ("edges", "routines"):
            edge = self.unseen_edge(key)
            alert.unseen_edge = None if edge is None else self._edge_out(key[0], edge)
        if kind == "unseen_transition":
            alert.previous = None if previous is None else {
                "syscall": previous[0], "frames": [self._frame_out(f) for f in previous[1]]}
        return [alert]


class AlertWriter:
    """JSON lines to a stream, flushed per alert (a tail -f or a log shipper sees each at once)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.written = 0

    def write(self, alert: Alert) -> None:
        self.stream.write(alert.to_json() + "\n")
        self.stream.flush()
        self.written += 1
