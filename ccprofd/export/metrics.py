"""Prometheus ``/metrics``: a custom collector that builds every family at scrape time from the
daemon's live state (no per-sample metric updates on the hot path), plus the standard process and
platform collectors, served over HTTP by prometheus-client.

Hot-context series follow the promotion and retirement rules of :mod:`ccprofd.daemon.store`
(bounded cardinality, monotonic counters, ``context="other"`` for samples of contexts not promoted;
CPU series keyed by function, not instruction).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from ccprofd.daemon.query import DaemonView, TargetView
from ccprofd.daemon.store import OTHER
from ccprofd.export import pprof_http
from ccprofd.export.folded import INCOMPLETE
from ccprofd.tracing.api import MODES

TARGET_STATES = ("starting", "attached", "waiting", "failed")


class DaemonCollector(Collector):
    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon
        self._lock = threading.Lock()  # one promotion round at a time

    def describe(self) -> list[Metric]:
        return []  # built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield from self._collect()

    def _collect(self) -> Iterator[Metric]:
        ctx = CounterMetricFamily("ccprofd_context_samples", "Syscall samples per hot calling context "
                                  "(top-K promoted; context=\"other\" = never-promoted contexts)",
                                  labels=["target", "syscall", "context", "leaf"])
        cpu = CounterMetricFamily("ccprofd_cpu_samples", "CPU-clock samples per hot calling context",
                                  labels=["target", "context", "leaf"])
        hits = CounterMetricFamily("ccprofd_probe_hits", "Uprobe hits", labels=["target"])
        verify = CounterMetricFamily("ccprofd_verify_mismatches",
                                     "Samples whose decoded context differed from a frame-pointer unwind",
                                     labels=["target"])
        mode = GaugeMetricFamily("ccprofd_mode", "1 for the tracer mode in effect", labels=["target", "mode"])
        switches = CounterMetricFamily("ccprofd_mode_switches", "Automatic tracer mode switches",
                                       labels=["target", "reason"])
        dropped = CounterMetricFamily("ccprofd_samples_dropped", "Samples lost or not stored, by reason",
                                      labels=["target", "reason"])
        incomplete = CounterMetricFamily("ccprofd_contexts_incomplete",
                                         "Samples whose context is flagged incomplete", labels=["target"])
        decode_err = CounterMetricFamily("ccprofd_decode_errors", "Samples that could not be decoded",
                                         labels=["target"])
        attached = GaugeMetricFamily("ccprofd_attached_processes", "Processes followed", labels=["target"])
        up = GaugeMetricFamily("ccprofd_target_up", "1 when the target's probes are attached",
                               labels=["target"])
        state = GaugeMetricFamily("ccprofd_target_state", "1 for the target's state (waiting: its path "
                                  "or cgroup does not exist yet)", labels=["target", "state"])
        retired = CounterMetricFamily("ccprofd_series_retired", "Context series no longer exported "
                                      "because their context was not seen for retire_after_seconds",
                                      labels=["target"])
        contexts = GaugeMetricFamily("ccprofd_contexts", "Distinct contexts held in memory",
                                     labels=["target"])
        maps = GaugeMetricFamily("ccprofd_bpf_map_entries", "Entries in the daemon's BPF maps",
                                 labels=["map"])
        info = GaugeMetricFamily("ccprofd_context_info", "1 per exported context: the program's "
                                 "functions the context id stands for, outermost first (join on "
                                 "context with group_left)", labels=["target", "context", "stack"])
        map_totals: dict[str, int] = {}
        for rt in self.daemon.runtimes():
            name = rt.name
            described: set[str] = set()
            for s in rt.store.scrape():
                if s.context != OTHER and s.context not in described:
                    described.add(s.context)
                    info.add_metric([name, s.context, context_stack(s.functions, s.complete)], 1.0)
                if s.event == "cpu":
                    cpu.add_metric([name, s.context, s.leaf], s.value)
                else:
                    ctx.add_metric([name, s.syscall, s.context, s.leaf], s.value)
            counters = rt.counters()
            hits.add_metric([name], counters.probe_hits)
            verify.add_metric([name], counters.verify_mismatches)
            decode_err.add_metric([name], counters.decode_errors)
            current = rt.mode()
            for m in MODES:
                mode.add_metric([name, m], 1.0 if m == current else 0.0)
            for reason, n in sorted(rt.mode_switches.items()):
                switches.add_metric([name, reason], n)
            store = rt.store.counters()
            reasons: dict[str, int] = dict(counters.dropped)
            for reason, n in store["dropped"].items():
                reasons[reason] = reasons.get(reason, 0) + n
            if rt.stream_dropped:
                reasons["stream_subscriber_slow"] = rt.stream_dropped
            for reason, n in sorted(reasons.items()):
                dropped.add_metric([name, reason], n)
            incomplete.add_metric([name], store["incomplete"])
            contexts.add_metric([name], store["contexts"])
            retired.add_metric([name], store["retired"])
            up.add_metric([name], 1.0 if rt.state == "attached" else 0.0)
            for st in TARGET_STATES:
                state.add_metric([name, st], 1.0 if rt.state == st else 0.0)
            attached.add_metric([name], _count_processes(rt))
            for m, n in counters.map_entries.items():
                map_totals[m] = map_totals.get(m, 0) + n
        for m, n in sorted(map_totals.items()):
            maps.add_metric([m], n)
        yield from _anomaly_families(self.daemon)
        reloads = CounterMetricFamily("ccprofd_reloads", "Configuration reloads (SIGHUP)", labels=["result"])
        for result, n in sorted(self.daemon.reloads.items()):
            reloads.add_metric([result], n)
        yield from (ctx, cpu, info, hits, verify, mode, switches, dropped, incomplete, decode_err, attached,
                    up, state, contexts, retired, maps, reloads)


def context_stack(functions: Iterable[str], complete: bool = True) -> str:
    """The ``stack`` label: function names joined by ``;`` as in folded stacks (a ``;`` inside a
    name becomes ``:``); an incomplete context starts with ``[incomplete]``, its prefix unknown."""
    names = [f.replace(";", ":") for f in functions]
    return ";".join(names if complete else [INCOMPLETE, *names])


def _anomaly_families(daemon: DaemonView) -> Iterator[Metric]:
    """Issue 7: alerts per target, syscall and kind; binaries whose model is missing or outdated."""
    alerts = CounterMetricFamily("ccprofd_alerts", "Anomaly alerts published (after rate limiting)",
                                 labels=["target", "syscall", "kind"])
    relearn = GaugeMetricFamily("ccprofd_anomaly_needs_learning",
                                "1 per binary of a detect/enforce target that no model applies to "
                                "(reason=upgraded: models of older build-ids are kept, not applied)",
                                labels=["target", "binary", "build_id", "reason"])
    for target, syscall, kind, n in daemon.alert_counts():
        alerts.add_metric([target, syscall, kind], n)
    for target, binary, build_id, reason in daemon.needs_learning():
        relearn.add_metric([target, binary, build_id, reason], 1.0)
    yield from (alerts, relearn)


def _count_processes(rt: TargetView) -> int:
    src = rt.source
    if src is None:
        return 0
    try:
        return len(src.processes())
    except Exception:
        return 0


def build_registry(daemon: DaemonView) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def metrics_app(daemon: DaemonView, registry: CollectorRegistry) -> WsgiApp:
    """``/metrics`` (prometheus-client's app), ``/healthz``, the pprof endpoints
    (:mod:`ccprofd.export.pprof_http`) and 404 for every other path: prometheus-client alone answers
    any path with the metrics, so a probe of ``/healthz`` or a mistyped URL looked like a working
    endpoint."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == METRICS_PATH:
            return metrics(environ, start_response)
        if path in pprof_http.PATHS:
            return pprof_http.serve(daemon, environ, start_response)
        text = [("Content-Type", "text/plain; charset=utf-8")]
        if path == HEALTH_PATH:
            # Served by the daemon's own thread, so an answer means the process runs and is not
            # shutting down; per-target health is in ccprofd_target_state / ccprofd_target_up.
            if daemon.stopping:
                start_response("503 Service Unavailable", text)
                return [b"stopping\n"]
            start_response("200 OK", text)
            return [b"ok\n"]
        start_response("404 Not Found", text)
        paths = ", ".join((METRICS_PATH, HEALTH_PATH, *pprof_http.PATHS))
        return [f"404 not found: {path} (paths: {paths})\n".encode()]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on stderr (the journal would get a line per scrape)."""


class MetricsServer:
    """``GET /metrics``, ``/healthz`` and the pprof endpoints on ``host:port`` (port 0 picks a free one; see
    :attr:`address`)."""

    def __init__(self, daemon: DaemonView, host: str, port: int) -> None:
        self.daemon = daemon
        self.registry = build_registry(daemon)
        self.host, self.port = host, port
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._stopper: threading.Thread | None = None

    def start(self) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]

        class Server(ThreadingWSGIServer):
            address_family = family  # IPv6 listen addresses need AF_INET6 (as prometheus-client does)

        self._server = make_server(str(sockaddr[0]), self.port, metrics_app(self.daemon, self.registry),
                                   Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="ccprofd-metrics",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def begin_shutdown(self) -> None:
        """Ask the serving thread to stop without waiting: ``shutdown()`` takes up to the server's
        0.5 s poll interval, which the daemon overlaps with detaching its targets."""
        if self._server is not None and self._stopper is None:
            self._stopper = threading.Thread(target=self._server.shutdown, name="ccprofd-metrics-stop",
                                             daemon=True)
            self._stopper.start()

    def stop(self) -> None:
        if self._server is not None:
            self.begin_shutdown()
            assert self._stopper is not None
            self._stopper.join()
            self._stopper = None
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
