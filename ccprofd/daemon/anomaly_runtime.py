"""The anomaly detector inside the daemon: ``[target.anomaly] action = "learn" | "detect" |
"enforce"`` applied to each target's sample stream.

Data flow (one way): the daemon's pump threads hand every decoded record to
:meth:`AnomalyMonitor.observe` (a sample observer) and, in aggregate mode, the kernel's per-context
counts to :meth:`AnomalyMonitor.observe_counts` (a count observer) -> per (target, build-id) a
:class:`~ccprofd.anomaly.model.Learner` (flushed into the target's model file every
``flush_seconds`` and at shutdown, so a SIGKILL loses at most one interval) or a
:class:`~ccprofd.anomaly.detector.Detector` -> alerts, each published on the daemon's alert bus
(gRPC ``StreamAlerts``), counted for ``ccprofd_alerts_total{target, syscall, kind}`` and logged as
one structured line. ``enforce`` also loads the kernel-side
:class:`~ccprofd.anomaly.enforce.Enforcer` for the binary and puts the target's processes under it
(checked every second: a process found by the daemon's rescan is unenforced until then, and its
threads' first hooked syscall before any PLT call is keyed as "no context in the binary").

A sample belongs to the binary of its process (``SampleSource.processes()``: pid -> build-id).  A
binary whose build-id has no model while the file has models of the same path under other build-ids
was upgraded: it is reported (log line + ``ccprofd_anomaly_needs_learning``) and nothing is applied
to it; the old models stay in the file.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccprofd.anomaly.detector import Detector, DetectorOptions
from ccprofd.anomaly.model import Learner, ModelSet, TargetModel, context_key
from ccprofd.anomaly.modelstore import ModelFileError, ModelStore, PeriodicFlusher, load_or_quarantine
from ccprofd.daemon.config import AnomalyConfig
from ccprofd.daemon.query import DaemonView, TargetView

log = logging.getLogger("ccprofd")
TICK_S = 1.0


@dataclass
class _Binary:
    """What one target does with one of its binaries (one build-id)."""

    build_id: str
    path: str
    learner: Learner | None = None
    flusher: PeriodicFlusher | None = None
    detector: Detector | None = None
    enforcer: Any = None
    enforced_pids: set[int] = field(default_factory=set)
    needs_learning: str = ""  # "" | "no_model" | "upgraded"
    #: samples seen as records that the kernel's counts also hold, by context, not yet taken off
    #: a count (:meth:`AnomalyMonitor.observe_counts`)
    pending: dict[Any, int] = field(default_factory=dict)


@dataclass
class _Target:
    name: str
    config: AnomalyConfig
    model_path: Path
    models: ModelSet
    binaries: dict[str, _Binary] = field(default_factory=dict)
    pid_build: dict[int, tuple[str, str]] = field(default_factory=dict)
    alerts: dict[tuple[str, str], int] = field(default_factory=dict)  # (syscall, kind) -> n
    denials: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: unwind mode: the tracer's unwinder enforces (TracerSource._options_for), not an Enforcer
    unwind: bool = False
    seen_denials: set[tuple[int, int, int]] = field(default_factory=set)


def model_path(state_dir: Path, target: str, config: AnomalyConfig) -> Path:
    """The model file of a target: ``[target.anomaly] model``, else under the state directory."""
    return Path(config.model) if config.model else ModelStore(state_dir).path_for(target)


class AnomalyMonitor:
    """Learn/detect/enforce for every target whose anomaly action is not "off"."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon
        self.targets: dict[str, _Target] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Flush and enforcement bookkeeping run on their own thread, off the sample path."""
        self._thread = threading.Thread(target=self._run, name="anomaly", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Final flush of every learner (SIGTERM, SIGINT) and detach of the enforcers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            targets, self.targets = list(self.targets.values()), {}
        for t in targets:
            self._retire(t)

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception as exc:  # the monitor must outlive one failing flush or poll
                log.error("anomaly: %s", _one_line(exc))

    def tick(self) -> None:
        """Flush learners that are due, retire targets that went away or changed, enforce on new
        processes, and collect the enforcers' denials."""
        running = {rt.name: rt for rt in self.daemon.runtimes()}
        for live in running.values():
            if live.config.anomaly.action != "off" and live.source is not None:
                self._prepare(live)
        with self._lock:
            items = list(self.targets.items())
        for name, t in items:
            rt = running.get(name)
            if rt is None or rt.config.anomaly != t.config:
                with self._lock:
                    if self.targets.get(name) is t:
                        del self.targets[name]
                self._retire(t)
                continue
            with t.lock:
                for b in t.binaries.values():
                    if b.flusher is not None:
                        self._flush(t, b, force=False)
                    if b.enforcer is not None:
                        _enforce_processes(t, b, rt)
                        _collect_denials(t, b)
                if t.unwind and t.config.action == "enforce":
                    _collect_unwind_denials(t, rt)

    def _prepare(self, rt: TargetView) -> None:
        """Set up every binary the target's processes run before their next sample arrives: an
        enforcer must be in place before the first offending syscall, not after it."""
        t = self._target(rt)
        assert rt.source is not None
        try:
            procs = rt.source.processes()
        except Exception:
            return
        with t.lock:
            for p in procs:
                t.pid_build[p.pid] = (p.build_id, p.binary)
                if p.build_id and p.build_id not in t.binaries:
                    t.binaries[p.build_id] = self._new_binary(t, p.build_id, p.binary)

    def _retire(self, t: _Target) -> None:
        with t.lock:
            for b in t.binaries.values():
                if b.flusher is not None:
                    self._flush(t, b, force=True)
                if b.enforcer is not None:
                    _collect_denials(t, b)
                    with contextlib.suppress(Exception):
                        b.enforcer.close()
                    b.enforcer = None

    def _flush(self, t: _Target, b: _Binary, *, force: bool) -> None:
        assert b.flusher is not None
        try:
            if force:
                b.flusher.flush()
            else:
                b.flusher.maybe_flush()
        except (ModelFileError, OSError) as exc:
            log.error("target %s: anomaly model %s not written: %s", t.name, t.model_path, _one_line(exc))

    # -------------------------------------------------------------------------------- samples
    def observe(self, rt: TargetView, sample: dict[str, Any], counted: bool = True) -> None:
        """The daemon's sample observer (called on the target's pump thread, also for the last
        read of a target that is detaching: judged under the configuration it ran with).
        ``counted`` False: the kernel also counts this sample under its context, and the count
        will reach :meth:`observe_counts`, which then takes it off (see there)."""
        with self._binary_for(rt, sample) as found:
            if found is None:
                return
            t, binary = found
            key = None
            if not counted:  # keyed once, for the pending count and for the learner or detector
                key = context_key(sample)
                pending = _pending_key(sample, key)
                binary.pending[pending] = binary.pending.get(pending, 0) + 1
            if binary.learner is not None:
                binary.learner.observe(sample, key)
            elif binary.detector is not None:
                for alert in binary.detector.check(sample, key):
                    self._publish(t, binary, alert.to_dict(), alert.log_line())

    def observe_counts(self, rt: TargetView, sample: dict[str, Any], n: int) -> None:
        """The daemon's count observer: the kernel counted ``n`` samples of ``sample``'s context
        since the previous read.  Those whose records reached :meth:`observe` (``counted`` False:
        the context's first sample, and every one while a consumer wants each sample) are taken
        off; the rest were never seen one by one (aggregate mode) and are learned or judged as
        repeats without identity (:meth:`Detector.check_repeats`).  A context's count is read
        after its record (BPF counts before it sends; the map is read after the ring is drained),
        so the records of a read's samples are in by then; one sent later is taken off the next
        read's count."""
        if n <= 0:
            return
        with self._binary_for(rt, sample) as found:
            if found is None:
                return
            t, binary = found
            key = _pending_key(sample, context_key(sample))
            seen = binary.pending.pop(key, 0)
            if seen > n:
                binary.pending[key] = seen - n
            repeats = n - seen
            if repeats <= 0:
                return
            now = time.time_ns()
            if binary.learner is not None:
                binary.learner.observe_repeats(sample, repeats, now)
            elif binary.detector is not None:
                for alert in binary.detector.check_repeats(sample, repeats, now):
                    self._publish(t, binary, alert.to_dict(), alert.log_line())

    @contextlib.contextmanager
    def _binary_for(self, rt: TargetView, sample: dict[str, Any]
                    ) -> Iterator[tuple[_Target, _Binary] | None]:
        """The sample's target and binary, under the target's lock (None: nothing to do -- anomaly
        off, or a process of no binary the source analysed)."""
        if rt.config.anomaly.action == "off":
            yield None
            return
        t = self._target(rt)
        with t.lock:
            binary = self._binary_of(t, rt, int(sample.get("pid", 0)), sample)
            yield None if binary is None else (t, binary)

    def _target(self, rt: TargetView) -> _Target:
        t = self.targets.get(rt.name)
        if t is not None and t.config == rt.config.anomaly:
            return t
        with self._lock:
            t = self.targets.get(rt.name)
            if t is not None and t.config == rt.config.anomaly:
                return t
            old = self.targets.pop(rt.name, None)
        if old is not None:
            self._retire(old)  # reconfigured: flushed before the new action reads the model
        path = model_path(self.daemon.config.daemon.state_dir, rt.name, rt.config.anomaly)
        path.parent.mkdir(parents=True, exist_ok=True)
        models = load_or_quarantine(path, lambda msg: log.error("target %s: anomaly %s", rt.name, msg))
        t = _Target(rt.name, rt.config.anomaly, path, models, unwind=rt.config.mode == "unwind")
        with self._lock:
            other = self.targets.get(rt.name)
            if other is not None and other.config == t.config:
                return other  # the pump thread and the tick thread raced: keep the first
            self.targets[rt.name] = t
        log.info("target %s: anomaly %s, model %s (%d build(s))", rt.name, t.config.action, path,
                 len(models.targets))
        return t

    def _binary_of(self, t: _Target, rt: TargetView, pid: int,
                   sample: dict[str, Any] | None = None) -> _Binary | None:
        known = t.pid_build.get(pid)
        if known is None and rt.source is not None:
            try:
                for p in rt.source.processes():
                    t.pid_build[p.pid] = (p.build_id, p.binary)
            except Exception as exc:
                log.debug("target %s: processes() failed: %s", t.name, exc)
            known = t.pid_build.get(pid)
        if known is None and sample is not None and rt.source is not None:
            known = _sample_binary(rt, sample)
        if known is None or not known[0]:
            return None
        bid, path = known
        b = t.binaries.get(bid)
        if b is None:
            b = t.binaries[bid] = self._new_binary(t, bid, path)
        return b

    def _new_binary(self, t: _Target, bid: str, path: str) -> _Binary:
        b = _Binary(bid, path)
        cfg = t.config
        if cfg.action == "learn":
            b.learner = Learner(TargetModel(bid, path), transitions=cfg.transitions)
            b.flusher = PeriodicFlusher(t.model_path, b.learner, cfg.flush_seconds)
            return b
        model = t.models.targets.get(bid)
        if model is None:
            stale = t.models.stale_for(path, bid)
            b.needs_learning = "upgraded" if stale else "no_model"
            if stale:
                log.warning("target %s: %s has build-id %s; its model is for %s: kept, not applied; "
                            "re-learn (action = \"learn\")", t.name, path, bid,
                            ", ".join(m.build_id for m in stale))
            else:
                log.warning("target %s: no anomaly model for %s (build-id %s) in %s: nothing is checked; "
                            "learn first (action = \"learn\")", t.name, path, bid, t.model_path)
            return b
        opts = DetectorOptions(collapse_recursion=cfg.collapse_recursion, transitions=cfg.transitions,
                               granularity=cfg.granularity, prefix_match=cfg.prefix_match,
                               alert_interval_seconds=cfg.alert_interval_seconds)
        try:
            b.detector = Detector(model, opts)
        except ValueError as exc:
            log.error("target %s: %s", t.name, exc)
            return b
        if cfg.action == "enforce" and not t.unwind:
            b.enforcer = _enforcer(t, path, model)
        return b

    def _publish(self, t: _Target, b: _Binary, alert: dict[str, Any], line: str) -> None:
        alert["target"] = t.name
        alert["action"] = t.config.action
        alert["history"] = [] if alert.get("counted") else self._history(t, alert)  # counted: no thread
        key = (str(alert["syscall"]), str(alert["kind"]))
        t.alerts[key] = t.alerts.get(key, 0) + 1
        self.daemon.alerts.publish(alert)
        log.warning("%s target=%s action=%s", line, t.name, t.config.action)

    def _history(self, t: _Target, alert: dict[str, Any]) -> list[dict[str, Any]]:
        """The flight recorder's events of the alert's thread before its syscall, decoded
        (``alert_history`` of them; [] when the recorder is off or holds none)."""
        rt = self.daemon.targets.get(t.name)
        if rt is None or rt.source is None or t.config.alert_history <= 0:
            return []
        try:
            return rt.source.history_before(int(alert["pid"]), int(alert["tid"]), int(alert["time_ns"]),
                                            t.config.alert_history)
        except OSError as exc:  # a BPF map read failed: the alert goes out without its history
            log.error("target %s: alert history not read: %s", t.name, _one_line(exc))
            return []

    # -------------------------------------------------------------------------------- reports
    def alert_counts(self) -> Iterator[tuple[str, str, str, int]]:
        """(target, syscall, kind, alerts) for ``ccprofd_alerts_total``."""
        with self._lock:
            items = list(self.targets.values())
        for t in items:
            for (syscall, kind), n in sorted(t.alerts.items()):
                yield t.name, syscall, kind, n

    def needs_learning(self) -> Iterator[tuple[str, str, str, str]]:
        """(target, binary path, build-id, reason) of binaries nothing is applied to."""
        with self._lock:
            items = list(self.targets.values())
        for t in items:
            for b in list(t.binaries.values()):
                if b.needs_learning:
                    yield t.name, b.path, b.build_id, b.needs_learning

    def learning(self) -> Iterator[tuple[str, str, int]]:
        """(target, build-id, samples learned since the last flush)."""
        with self._lock:
            items = list(self.targets.values())
        for t in items:
            for b in list(t.binaries.values()):
                if b.learner is not None:
                    yield t.name, b.build_id, b.learner.model.samples


# ----------------------------------------------------------------------------- enforcement
def _collect_unwind_denials(t: _Target, rt: TargetView) -> None:
    """Log each new denial of the target's unwinders (unwind.c ``UW_ENFORCE``) once."""
    from ccprofd.kbpf.syscalls import syscall_name

    get = getattr(rt.source, "enforcement_denials", None)
    if get is None:
        return
    for d in get():
        ident = (d.tgid, d.tid, d.ktime_ns)
        if ident in t.seen_denials:
            continue
        t.seen_denials.add(ident)
        t.denials += 1
        log.warning("ccprofd enforcement target=%s verdict=%s syscall=%s pid=%d tid=%d hook=unwind "
                    "key=%#x incomplete=%s", t.name, d.verdict, syscall_name(d.syscall_nr), d.tgid, d.tid,
                    d.key, str(d.incomplete).lower())


def _enforcer(t: _Target, path: str, model: TargetModel) -> Any:
    from ccprofd.anomaly.enforce import Enforcer

    try:
        enf = Enforcer(path, model, enforce=True)
    except Exception as exc:
        log.error("target %s: cannot enforce (detecting only): %s", t.name, _one_line(exc))
        return None
    how = ("BPF LSM (-EPERM)" if enf.mode == "lsm"
           else f"SIGKILL at syscall entry, the syscall may complete ({enf.lsm_error})")
    log.warning("target %s: enforcing the model of %s by %s", t.name, path, how)
    return enf


def _enforce_processes(t: _Target, b: _Binary, rt: TargetView) -> None:
    src = rt.source
    if src is None:
        return
    try:
        pids = {p.pid for p in src.processes() if p.build_id == b.build_id}
    except Exception:
        return
    for pid in pids - b.enforced_pids:
        try:
            b.enforcer.track_running(pid)
            b.enforced_pids.add(pid)
        except Exception as exc:
            log.error("target %s: cannot enforce on pid %d: %s", t.name, pid, _one_line(exc))
    for pid in b.enforced_pids - pids:
        b.enforcer.untrack(pid)
        b.enforced_pids.discard(pid)


def _collect_denials(t: _Target, b: _Binary) -> None:
    from ccprofd.kbpf.syscalls import syscall_name

    for d in b.enforcer.poll(0):
        t.denials += 1
        log.warning("ccprofd enforcement target=%s verdict=%s syscall=%s pid=%d tid=%d hook=%s "
                    "build_id=%s", t.name, d.verdict, syscall_name(d.syscall_nr), d.pid, d.tid, d.hook,
                    b.build_id)


def _pending_key(sample: dict[str, Any], key: Any) -> tuple[Any, ...]:
    """A sample's context (``key``: its ``context_key``) as records and counts of it both name it
    (CPU samples included)."""
    return (sample.get("event", "syscall"), bool(sample.get("complete", True)), key)


def _sample_binary(rt: TargetView, sample: dict[str, Any]) -> tuple[str, str] | None:
    """(build-id, path) of the target's binary a sample of a process the source does not list was
    decoded against (its analysed frames'), or None.  A short-lived forked child (redis's BGSAVE
    child) is sampled, and checked by the unwinder's enforcement, under its parent's mappings,
    but exits before any rescan lists it: without this its contexts were never learned, and the
    enforced model then killed it (issue 14)."""
    bids = {str(f.get("build_id")) for f in sample.get("frames") or ()
            if f.get("analysed") and f.get("build_id")}
    if len(bids) != 1:
        return None
    try:
        binaries = rt.source.binaries() if rt.source is not None else []
    except Exception as exc:
        log.debug("target %s: binaries() failed: %s", rt.name, exc)
        return None
    bid = bids.pop()
    for b in binaries:
        if b.build_id == bid:
            return (b.build_id, b.path)
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
