"""The long-running daemon: targets' sample sources, aggregation, gRPC and Prometheus, lifecycle.

Data flow: each target's :class:`~ccprofd.daemon.source.SampleSource` (the tracer) yields decoded
samples on a pump thread -> the target's :class:`~ccprofd.daemon.store.TargetStore` (hot contexts)
and the live sample bus (``StreamSamples``) and sample observers (the anomaly detector, which
publishes on the alert bus) -> the exporters read stores and buses; nothing flows back.

Lifecycle (:func:`run_daemon`): validate the config (bad -> exit 2, nothing started), start every
target (a target that fails to attach is reported in ``ListTargets`` and the log, and retried
with backoff (:func:`retry_failed`) or at the next ``SIGHUP``; one whose path or cgroup does not
exist yet is ``waiting`` and attached once it exists and has not changed for a main-loop tick),
serve gRPC and metrics, send ``READY=1``.
``SIGHUP`` reloads: a bad new config is logged and the old one keeps running; changed or removed
targets are stopped, new ones started, unchanged ones untouched.  ``SIGTERM``/``SIGINT`` send
``STOPPING=1``, stop serving, close every source (which detaches its probes) and exit 0.  An
instrumented target whose probe hit rate exceeds ``max_probe_hits_per_sec`` is switched to unwind
mode (log line + metric).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

from ccprofd.daemon.bus import Bus, Subscription
from ccprofd.daemon.config import Config, ConfigError, DaemonConfig, TargetConfig, load_config
from ccprofd.daemon.historyfile import HistoryFileError
from ccprofd.daemon.historypersist import history_path
from ccprofd.daemon.historyread import load as load_history
from ccprofd.daemon.notify import Notifier
from ccprofd.daemon.query import Server, ServerFactories
from ccprofd.daemon.source import SampleSource, SourceCounters, SourceFactory, TargetWaiting, UnknownProcess
from ccprofd.daemon.store import TargetStore

log = logging.getLogger("ccprofd")

#: Called with the runtime the sample came from (not its name: a sample read while its target
#: detaches is judged under the configuration it was taken under), the sample, and whether it is
#: counted on its own (False: the kernel's per-context counts, given to the count observers, hold
#: it too).
SampleObserver = Callable[["TargetRuntime", dict[str, Any], bool], None]
#: Called with the kernel's per-context counts (aggregate mode): the runtime, the context's sample
#: (no time), and how many samples of it the kernel counted since the previous read -- records of
#: some of them may have reached the sample observers (``counted`` False).
CountObserver = Callable[["TargetRuntime", dict[str, Any], int], None]
POLL_MS = 200
#: How long a detach waits for the target's pump thread to return from its poll.
PUMP_STOP_SECONDS = 5
#: A failed target (analysis or BPF error, a source that failed) is retried after 10 s, then after
#: twice the previous wait, at most 10 minutes apart; a reload retries it at once.
RETRY_FIRST_SECONDS = 10.0
RETRY_MAX_SECONDS = 600.0


@dataclass
class Carried:
    """Counters of sources a target already closed (mode switches), so exported totals stay monotonic."""

    probe_hits: int = 0
    verify_mismatches: int = 0
    decode_errors: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def add(self, c: SourceCounters) -> None:
        self.probe_hits += c.probe_hits
        self.verify_mismatches += c.verify_mismatches
        self.decode_errors += c.decode_errors
        for reason, n in c.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + n


class TargetRuntime:
    """One configured target while the daemon runs it: its source, pump thread, store and state."""

    def __init__(self, config: TargetConfig, store: TargetStore) -> None:
        self.config = config
        self.store = store
        self.source: SampleSource | None = None
        self.state = "starting"
        self.error = ""
        self.mode_override: str | None = None
        self.mode_switches: dict[str, int] = {}
        self.note = ""  # why it runs otherwise than configured: its ``error`` while attached
        self.carried = Carried()
        self.stream_dropped = 0
        self.observer_errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rate: tuple[float, int] | None = None
        self._seen: tuple[int, int, int] | None = None  # the waited-for path's last (inode, size, mtime)
        self.lock = threading.RLock()
        self.retries = 0  # automatic retries after failures (backoff: :func:`retry_failed`)
        self.retry_at: float | None = None  # monotonic time of the next one, once scheduled

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def effective_config(self) -> TargetConfig:
        return replace(self.config, mode=self.mode_override) if self.mode_override else self.config

    def mode(self) -> str:
        src = self.source
        if src is not None:
            try:
                return src.mode()
            except Exception:  # a broken source must not break ListTargets or a scrape
                pass
        return self.effective_config.mode

    def attach_failed(self, exc: Exception) -> None:
        """Record why the daemon could not attach: ``waiting`` (:class:`TargetWaiting`, retried by
        :func:`attach_waiting`; logged when its reason changes) or ``failed`` (one log line)."""
        reason = _one_line(exc)
        if isinstance(exc, TargetWaiting):
            if (self.state, self.error) != ("waiting", reason):
                log.warning("target %s: waiting: %s", self.name, reason)
            self.state, self.error = "waiting", reason
            return
        self.state, self.error = "failed", reason
        log.error("target %s: cannot attach (%s mode): %s", self.name, self.effective_config.mode, reason)

    def over_budget(self, rate: float) -> None:
        self.note = (f"switched to unwind mode: {rate:.0f} probe hits/s exceeded max_probe_hits_per_sec = "
                     f"{self.config.max_probe_hits_per_sec}")
        log.warning("target %s: %s", self.name, self.note)

    def settled(self) -> bool:
        """Whether the path (or cgroup) a waiting target names exists and is unchanged since the
        previous call: a binary still being copied in is not analysed half-written."""
        try:
            st = os.stat(self.config.path or self.config.cgroup or "")
            seen: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            seen = None
        previous, self._seen = self._seen, seen
        return seen is not None and seen == previous

    def probe_hit_rate_over_budget(self, now: float) -> float | None:
        """The probe hits per second since the last call at least 1 s ago, when that exceeds
        ``max_probe_hits_per_sec`` of an attached instrumented target; else None."""
        ceiling = self.config.max_probe_hits_per_sec
        if not ceiling or self.source is None or self.mode() != "instrumented":
            self._rate = None
            return None
        hits = self.counters().probe_hits
        if self._rate is None:
            self._rate = (now, hits)
            return None
        t0, h0 = self._rate
        if now - t0 < 1.0:
            return None
        rate = (hits - h0) / (now - t0)
        self._rate = (now, hits)
        return rate if rate > ceiling else None

    def counters(self) -> SourceCounters:
        """Cumulative over every source this target had (carried + live)."""
        live = SourceCounters()
        src = self.source
        if src is not None:
            try:
                live = src.counters()
            except Exception as exc:
                log.debug("target %s: counters failed: %s", self.name, exc)
        dropped = dict(self.carried.dropped)
        for reason, n in live.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
        return SourceCounters(probe_hits=self.carried.probe_hits + live.probe_hits,
                              verify_mismatches=self.carried.verify_mismatches + live.verify_mismatches,
                              decode_errors=self.carried.decode_errors + live.decode_errors,
                              dropped=dropped, map_entries=dict(live.map_entries))


def daemon_history(daemon: Daemon, pid: int, last: int) -> tuple[TargetRuntime, dict[str, Any]]:
    """``Daemon.history``, GetHistory: the target whose source recorded ``pid`` (a process or one
    thread), and the history; the process's own target first, then every other (a thread, an
    exited process).  UnknownProcess when none has it (saying so when the recorder is off)."""
    first = daemon.runtime_of_pid(pid)
    order = ([first] if first is not None else []) + [rt for rt in daemon.runtimes() if rt is not first]
    why = f"no target recorded pid {pid}"
    for rt in order:
        if rt.source is None:
            continue
        try:
            return rt, {**rt.source.history(pid, last), "source": "live"}
        except UnknownProcess as exc:
            if "off" in str(exc):
                why = str(exc).strip("'\"")
    for rt in order:  # no longer in the live rings (evicted, a restarted daemon): the saved file
        got = persisted_history(history_path(daemon.config.daemon.state_dir, rt.name), pid, last)
        if got is not None:
            return rt, got
    raise UnknownProcess(why)


def persisted_history(path: Path, pid: int, last: int) -> dict[str, Any] | None:
    """GetHistory's answer for ``pid`` (a process, or a thread's tid as in ModeBase.history) from a
    saved history file, ``source: persisted``; None when the file is absent, unreadable (logged) or
    does not hold it."""
    from ccprofd.daemon.historyread import Selection, thread_events

    if not path.exists():
        return None
    try:
        store = load_history(path)
        th = store.threads.get(pid)
        threads = [th] if th is not None and th.pid != pid else \
            sorted((t for t in store.threads.values() if t.pid == pid), key=lambda t: t.tid)
        out = [{"tid": t.tid, "events": [{**e, "raw_args": e.pop("args")}
                                         for e in thread_events(store, t, Selection(last=last))]}
               for t in threads if t.count]
    except HistoryFileError as exc:
        log.warning("history file %s not read: %s", path, exc)
        return None
    return {"pid": pid, "error": None, "threads": out, "source": "persisted"} if out else None


def runtime_following(runtimes: list[TargetRuntime], pid: int) -> TargetRuntime | None:
    """The target whose source follows ``pid`` (a source that cannot list its processes is skipped)."""
    for rt in runtimes:
        src = rt.source
        if src is None:
            continue
        try:
            if any(p.pid == pid for p in src.processes()):
                return rt
        except Exception:
            continue
    return None


class Daemon:
    """Everything the daemon runs; its servers (built by the caller, see :class:`ServerFactories`)
    read from it through :class:`~ccprofd.daemon.query.DaemonView`."""

    def __init__(self, config: Config, factory: SourceFactory, notifier: Notifier | None = None,
                 servers: ServerFactories | None = None) -> None:
        self.config = config
        self.factory = factory
        self.notifier = notifier or Notifier({})
        self.servers = servers
        self.targets: dict[str, TargetRuntime] = {}
        self._switch_lock = threading.Lock()
        self.samples: Bus = _SampleBus(config.daemon.stream_queue, self._every_sample_now)
        self.alerts = Bus(config.daemon.stream_queue)
        self.observers: list[SampleObserver] = []
        self.count_observers: list[CountObserver] = []
        self.started_ns = time.time_ns()
        self.reloads = {"ok": 0, "failed": 0}
        self._lock = threading.RLock()
        self._grpc: Server | None = None
        self._metrics: Server | None = None
        self.stopping = False
        # Issue 7: [target.anomaly] learn/detect/enforce, fed as a sample observer.
        from ccprofd.daemon.anomaly_runtime import AnomalyMonitor

        self.anomaly = AnomalyMonitor(self)
        self.observers.append(self.anomaly.observe)
        self.count_observers.append(self.anomaly.observe_counts)

    # ------------------------------------------------------------------------------ targets
    def _new_store(self, d: DaemonConfig) -> TargetStore:
        return TargetStore(max_contexts=d.max_contexts, top_k=d.top_k, max_series=d.max_series,
                           bucket_seconds=d.bucket_seconds, history_seconds=d.history_seconds,
                           promotion_window_seconds=d.promotion_window_seconds,
                           retire_after_seconds=d.retire_after_seconds)

    def start_target(self, tc: TargetConfig, store: TargetStore | None = None) -> TargetRuntime:
        rt = TargetRuntime(tc, store or self._new_store(self.config.daemon))
        with self._lock:
            self.targets[tc.name] = rt
        self._attach(rt)
        return rt

    def _attach(self, rt: TargetRuntime) -> None:
        tc = rt.effective_config
        try:
            source = self.factory(tc, self.config.daemon)
            source.start()
        except Exception as exc:  # BPFError, OSError, analysis errors, TargetWaiting
            rt.attach_failed(exc)
            return
        with rt.lock:
            rt.source = source
            rt.state, rt.error = "attached", rt.note
            rt._stop = threading.Event()
            rt._thread = threading.Thread(target=self._pump, args=(rt, source, rt._stop),
                                          name=f"pump-{tc.name}", daemon=True)
            rt._thread.start()
        log.info("target %s: attached (%s mode, %s %s)", tc.name, source.mode(), tc.kind, tc.spec)

    def _detach(self, rt: TargetRuntime) -> None:
        with rt.lock:
            rt._stop.set()
            thread, source = rt._thread, rt.source
            rt._thread, rt.source = None, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=PUMP_STOP_SECONDS)
            if thread.is_alive() and source is not None:
                # Closing a source its pump is still polling frees buffers under it: the pump's
                # thread closes it once it returns, and this detach goes on without waiting.
                log.warning("target %s: its sample pump did not stop within %d s; the source is "
                            "closed when it does", rt.name, PUMP_STOP_SECONDS)
                threading.Thread(target=close_source, args=(rt, source, thread),
                                 name=f"close-{rt.name}", daemon=True).start()
                return
        if source is not None:
            close_source(rt, source)

    def stop_target(self, name: str) -> None:
        with self._lock:
            rt = self.targets.pop(name, None)
        if rt is not None:
            self._detach(rt)
            rt.state = "stopped"
            log.info("target %s: detached", name)

    def needs_every_sample(self, rt: TargetRuntime) -> bool:
        """Whether some consumer of ``rt``'s samples needs a record per sample, not only counts:
        a ``StreamSamples`` subscriber (it streams each sample, with time, thread and arguments),
        or ``[target.anomaly]`` with ``transitions`` (a thread's consecutive contexts, in order).
        Otherwise (Prometheus, ``GetHotContexts``, anomaly learn/detect/enforce of contexts) counts
        suffice, and the target runs in aggregate mode: each context's first sample is sent as a
        record (learned or judged with its thread, time and arguments) and the kernel's
        per-context counts go to the store and the count observers.  That is what lets detection
        keep up with a busy service: its records are new contexts, not every syscall."""
        anomaly = rt.config.anomaly
        return bool(self.samples.subscribers()) or (anomaly.action != "off" and anomaly.transitions)

    def _every_sample_now(self) -> None:
        """A ``StreamSamples`` subscription was just added: every target sends a record per sample
        from now on (before the subscriber waits for its first item), not from the next poll."""
        for rt in self.runtimes():
            switch = getattr(rt.source, "set_per_sample", None)
            if switch is not None:
                with self._switch_lock, contextlib.suppress(Exception):
                    switch(True)

    def _pump(self, rt: TargetRuntime, source: SampleSource, stop: threading.Event) -> None:
        polled = False
        while not stop.is_set():
            if polled and rt.retries:
                # It attached and a poll succeeded: the failures it was retried for are over, so a
                # later failure starts the backoff at RETRY_FIRST_SECONDS again.  Not at attach
                # itself: a source that fails at its first poll keeps backing off, not flapping.
                rt.retries = 0
            polled = True
            try:
                pump_once(self, rt, source, POLL_MS)
            except Exception as exc:
                if stop.is_set():
                    return
                rt.state, rt.error = "failed", _one_line(exc)
                log.error("target %s: sample source failed: %s", rt.name, rt.error)
                # detach now: nobody polls it any more, and a source that holds new processes
                # (unwind mode) must release them, not leave them stopped
                with contextlib.suppress(Exception):
                    source.close()
                return
        # Detaching: what the kernel buffered before the stop is still read, once and without
        # waiting, so a sample taken just before a SIGTERM or a reload (e.g. the one of a process
        # the enforcer killed) still reaches the store and the detector.
        try:
            pump_once(self, rt, source, 0)
        except Exception as exc:
            log.error("target %s: last read before detaching failed: %s", rt.name, _one_line(exc))

    def ingest(self, rt: TargetRuntime, sample: dict[str, Any], counted: bool = True) -> None:
        """One decoded sample: count it (unless the kernel counts it), stream it, show it to the
        observers."""
        ctx = rt.store.add(sample) if counted else rt.store.context_of(sample)
        if self.samples.subscribers():
            item = dict(sample)
            item["target"], item["context"] = rt.name, ctx
            rt.stream_dropped += self.samples.publish(item)
        _notify(rt, "sample", self.observers, sample, counted)

    def ingest_counts(self, rt: TargetRuntime, sample: dict[str, Any], n: int) -> None:
        """``n`` samples of a context the kernel counted: into the store and the count observers."""
        rt.store.add(sample, count=n)
        _notify(rt, "count", self.count_observers, sample, n)

    def check_budgets(self, now: float | None = None) -> None:
        """Switch instrumented targets whose probe hit rate exceeds their ceiling to unwind mode."""
        now = time.monotonic() if now is None else now
        for rt in list(self.targets.values()):
            rate = rt.probe_hit_rate_over_budget(now)
            if rate is not None:
                rt.over_budget(rate)
                self.switch_mode(rt, "unwind", reason="probe_hit_budget")

    def switch_mode(self, rt: TargetRuntime, mode: str, reason: str) -> None:
        previous = rt.mode()
        self._detach(rt)
        rt.mode_override = mode
        rt.mode_switches[reason] = rt.mode_switches.get(reason, 0) + 1
        rt._rate = None
        self._attach(rt)
        if rt.state != "attached":
            log.error("target %s: %s mode failed, back to %s mode", rt.name, mode, previous)
            rt.mode_override = previous
            self._attach(rt)

    # -------------------------------------------------------------------------- lookups
    def runtime_of_pid(self, pid: int) -> TargetRuntime | None:
        return runtime_following(list(self.targets.values()), pid)

    def thread_contexts(self, pid: int) -> tuple[TargetRuntime, list[Any]]:
        rt = self.runtime_of_pid(pid)
        if rt is None or rt.source is None:
            raise UnknownProcess(f"no target follows pid {pid}")
        return rt, rt.source.thread_contexts(pid)

    history = daemon_history  # GetHistory (the flight recorder)
    def runtimes(self) -> Iterator[TargetRuntime]:
        with self._lock:
            items = list(self.targets.values())
        yield from items

    def alert_counts(self) -> list[tuple[str, str, str, int]]:
        """(target, syscall, kind, alerts published) of the anomaly monitor."""
        return list(self.anomaly.alert_counts())

    def needs_learning(self) -> list[tuple[str, str, str, str]]:
        """(target, binary, build-id, reason) for binaries no anomaly model applies to."""
        return list(self.anomaly.needs_learning())

    # ------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        d = self.config.daemon
        os.makedirs(d.state_dir, mode=0o750, exist_ok=True)
        if self.servers is not None and self.servers.preimport is not None:
            threading.Thread(target=self.servers.preimport, name="ccprofd-preimport", daemon=True).start()
        for tc in self.config.targets:
            self.start_target(tc)
        self.anomaly.start()
        self._start_servers(d)
        attached = sum(rt.state == "attached" for rt in self.targets.values())
        status = f"{attached}/{len(self.targets)} targets attached"
        self.notifier.ready(status)
        metrics = f"{d.metrics_listen[0]}:{d.metrics_listen[1]}" if d.metrics_listen else "(off)"
        log.info("ready: %s; gRPC on %s; metrics on %s", status, d.grpc_listen, metrics)

    def _start_servers(self, d: DaemonConfig) -> None:
        if self.servers is None:
            return
        self._grpc = self.servers.grpc(self, d)
        self._grpc.start()
        if d.metrics_listen is not None:
            self._metrics = self.servers.metrics(self, *d.metrics_listen)
            self._metrics.start()

    def _stop_servers(self) -> None:
        if self._grpc is not None:
            self._grpc.stop()
            self._grpc = None
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None

    @property
    def grpc_address(self) -> str:
        return "" if self._grpc is None else str(self._grpc.address)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        return None if self._metrics is None else self._metrics.address

    def apply(self, new: Config) -> None:
        """Move to ``new``: restart servers whose settings changed; stop removed or changed targets;
        start added ones and retry failed ones; leave unchanged attached targets alone."""
        old, self.config = self.config, new
        if (new.daemon.grpc_listen, new.daemon.metrics_listen, new.daemon.tls_cert, new.daemon.tls_key,
                new.daemon.tls_client_ca, new.daemon.grpc_socket_mode, new.daemon.grpc_socket_group) != (
                old.daemon.grpc_listen, old.daemon.metrics_listen, old.daemon.tls_cert, old.daemon.tls_key,
                old.daemon.tls_client_ca, old.daemon.grpc_socket_mode, old.daemon.grpc_socket_group):
            log.info("listen settings changed: restarting the gRPC and metrics servers")
            self._stop_servers()
            self._start_servers(new.daemon)
        wanted = {t.name: t for t in new.targets}
        kept: dict[str, TargetStore] = {}  # contexts do not depend on mode or scheme: keep counting
        for name, running in list(self.targets.items()):
            if name not in wanted:
                self.stop_target(name)
            elif wanted[name] != running.config:
                log.info("target %s: configuration changed: re-attaching", name)
                self.stop_target(name)
                kept[name] = running.store
        _retune([*kept.values(), *(rt.store for rt in self.targets.values())], new.daemon)
        for tc in new.targets:
            rt = self.targets.get(tc.name)
            if rt is None:
                self.start_target(tc, kept.get(tc.name))
            elif rt.state == "failed":  # retried at once, its backoff starts over
                _restart(self, rt, retries=0)

    def reload(self, path: str) -> bool:
        """``SIGHUP``: a bad new config is rejected with one log line; the old one keeps running."""
        self.notifier.reloading()
        try:
            new = load_config(path)
        except ConfigError as exc:
            self.reloads["failed"] += 1
            log.error("reload rejected, keeping the running configuration: %s", exc)
            self.notifier.ready("reload rejected; running the previous configuration")
            return False
        _log_warnings(new)
        self.apply(new)
        self.reloads["ok"] += 1
        attached = sum(rt.state == "attached" for rt in self.targets.values())
        log.info("reloaded %s: %d targets, %d attached", path, len(self.targets), attached)
        self.notifier.ready(f"{attached}/{len(self.targets)} targets attached")
        return True

    def stop(self) -> None:
        self.stopping = True
        self.notifier.stopping()
        if self._grpc is not None:
            self._grpc.begin_shutdown()
        if self._metrics is not None:
            self._metrics.begin_shutdown()  # its poll-interval wait overlaps the detaching below
        for name in list(self.targets):
            self.stop_target(name)
        self.anomaly.close()  # after the pumps stopped: the final flush has every sample
        self._stop_servers()
        log.info("stopped: every probe detached")


def _notify(rt: TargetRuntime, what: str, observers: list[Any], sample: dict[str, Any], arg: Any) -> None:
    """Call each observer; one that fails is counted and logged, and the others still run."""
    for observe in observers:
        try:
            observe(rt, sample, arg)
        except Exception as exc:
            rt.observer_errors += 1
            log.error("target %s: %s observer failed: %s", rt.name, what, _one_line(exc))


def pump_once(daemon: Daemon, rt: TargetRuntime, source: SampleSource, timeout_ms: int) -> None:
    """One poll of a target's source (waiting at most ``timeout_ms``), its samples ingested."""
    split = getattr(source, "poll_counted", None)
    if split is None:
        for sample in source.poll(timeout_ms):
            daemon.ingest(rt, sample)
        return
    switch = getattr(source, "set_per_sample", None)
    if switch is not None:
        with daemon._switch_lock:  # decided and applied as one step (see _every_sample_now)
            switch(daemon.needs_every_sample(rt))
    # The store counts each sample once: records that are samples of their own, and the kernel's
    # per-context counts (which include the samples of new and repeated contexts whether or not
    # their records were sent), never both.
    records, counts = split(timeout_ms)
    for sample, counted in records:
        daemon.ingest(rt, sample, counted=counted)
    for sample, n in counts:
        daemon.ingest_counts(rt, sample, n)


def close_source(rt: TargetRuntime, source: SampleSource, after: threading.Thread | None = None) -> None:
    """Close a detached target's source (after its pump thread ``after`` returned), keeping its
    counters in the target's totals."""
    if after is not None:
        after.join()
    with contextlib.suppress(Exception):
        rt.carried.add(source.counters())
    try:
        source.close()
    except Exception as exc:
        log.error("target %s: detach failed: %s", rt.name, _one_line(exc))


def _retune(stores: list[TargetStore], d: DaemonConfig) -> None:
    """A reload's daemon-level bounds apply to the stores of targets kept running too."""
    for store in stores:
        store.retune(max_contexts=d.max_contexts, top_k=d.top_k, max_series=d.max_series,
                     promotion_window_seconds=d.promotion_window_seconds,
                     retire_after_seconds=d.retire_after_seconds)


def retry_failed(daemon: Daemon, now: float | None = None) -> None:
    """Retry failed targets with exponential backoff (run every main-loop tick): a transient
    failure (a BPF map limit, a busy kernel, a binary replaced mid-analysis) heals without a
    ``SIGHUP``; a permanent one costs one attempt per ``RETRY_MAX_SECONDS``."""
    now = time.monotonic() if now is None else now
    for rt in daemon.runtimes():
        if rt.state == "failed" and rt.retry_at is not None and now >= rt.retry_at:
            log.info("target %s: retry %d after: %s", rt.name, rt.retries + 1, rt.error)
            _restart(daemon, rt, retries=rt.retries + 1)
        if rt.state == "failed" and rt.retry_at is None:
            wait = min(RETRY_MAX_SECONDS, RETRY_FIRST_SECONDS * 2 ** min(rt.retries, 32))
            rt.retry_at = now + wait
            log.info("target %s: retrying in %.0f s", rt.name, wait)


def _restart(daemon: Daemon, rt: TargetRuntime, *, retries: int) -> None:
    rt.retries, rt.retry_at = retries, None
    daemon._detach(rt)
    daemon._attach(rt)


def attach_waiting(daemon: Daemon) -> None:
    """Attach waiting targets whose path or cgroup now exists and did not change since the previous
    call (run every main-loop tick: one ``stat`` per waiting target)."""
    for rt in daemon.runtimes():
        if rt.state == "waiting" and rt.settled():
            daemon._attach(rt)


class _SampleBus(Bus):
    """The live-sample bus: a new subscription first turns per-sample records on everywhere."""

    def __init__(self, maxsize: int, on_subscribe: Callable[[], None]) -> None:
        super().__init__(maxsize)
        self._on_subscribe = on_subscribe

    def subscribe(self, accept: Callable[[dict[str, Any]], bool] | None = None) -> Subscription:
        sub = super().subscribe(accept)
        self._on_subscribe()
        return sub


def _log_warnings(config: Config) -> None:
    for warning in config.warnings:
        log.warning("%s", warning)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__).removeprefix("ccprofd: ")


class _Signals:
    """Signal flags set by handlers, acted on by the main loop (handlers do no work themselves)."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.reload = False
        self.stop: int | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        # SIGUSR1: every thread's Python stack to stderr (the journal), written by faulthandler's
        # C handler, so a daemon whose main loop is stuck still answers it.
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        self.stop = signum
        self.wake.set()

    def _on_hup(self, _signum: int, _frame: FrameType | None) -> None:
        self.reload = True
        self.wake.set()


def setup_logging(level: str) -> None:
    """One line per event on stderr; with syslog priority prefixes when journald reads it."""
    journald = bool(os.environ.get("JOURNAL_STREAM"))

    class _Fmt(logging.Formatter):
        PRIO: ClassVar[dict[str, int]] = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}

        def format(self, record: logging.LogRecord) -> str:
            text = f"{record.levelname.lower()}: {record.getMessage()}"
            return f"<{self.PRIO.get(record.levelname, 6)}>{text}" if journald else f"ccprofd: {text}"

    handler = logging.StreamHandler()
    handler.setFormatter(_Fmt())
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


def run_daemon(config_path: str, factory: SourceFactory | None = None,
               notifier: Notifier | None = None, servers: ServerFactories | None = None) -> int:
    """``ccprofd run``: foreground daemon until SIGTERM/SIGINT, serving with ``servers``.  Exit 2 on
    a bad config, 1 when the servers cannot start, 0 after a clean shutdown."""
    from ccprofd.daemon.source import load_factory

    config = load_config(config_path)  # ConfigError -> the CLI prints it and exits 2
    setup_logging(config.daemon.log_level)
    _log_warnings(config)
    if factory is None:
        factory = load_factory()
    signals = _Signals()
    signals.install()
    daemon = Daemon(config, factory, notifier or Notifier(), servers)
    try:
        daemon.start()
    except Exception:
        daemon.stop()
        raise
    interval = daemon.notifier.watchdog_interval
    try:
        while signals.stop is None:
            signals.wake.wait(timeout=min(interval, 1.0) if interval else 1.0)
            signals.wake.clear()
            if signals.stop is not None:
                break
            if signals.reload:
                signals.reload = False
                daemon.reload(config_path)
            attach_waiting(daemon)
            retry_failed(daemon)
            daemon.check_budgets()
            if daemon.notifier.watchdog_due():
                daemon.notifier.watchdog()
    finally:
        log.info("signal %s: shutting down", signals.stop)
        daemon.stop()
    return 0

