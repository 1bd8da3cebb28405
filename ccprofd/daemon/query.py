"""What the daemon's servers may ask of it: a narrow, read-mostly interface, and how servers are
handed to the daemon.

The gRPC servicer, the Prometheus collector and the anomaly monitor see the daemon only through
:class:`DaemonView` and :class:`TargetView` (structural protocols that
:class:`~ccprofd.daemon.service.Daemon` and its target runtimes satisfy), so ``export/`` depends on
this module and never on the service's internals, and the daemon never imports ``export/``: the
command line builds the servers (:class:`ServerFactories`) and passes them in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ccprofd.daemon.bus import Bus
from ccprofd.daemon.config import Config, DaemonConfig, TargetConfig
from ccprofd.daemon.source import SampleSource, SourceCounters
from ccprofd.daemon.store import TargetStore


class TargetView(Protocol):
    """One running target as the servers see it."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> TargetConfig: ...
    @property
    def store(self) -> TargetStore: ...
    @property
    def source(self) -> SampleSource | None: ...
    @property
    def state(self) -> str: ...
    @property
    def error(self) -> str: ...
    @property
    def mode_switches(self) -> Mapping[str, int]: ...
    @property
    def stream_dropped(self) -> int: ...

    def mode(self) -> str: ...
    def counters(self) -> SourceCounters: ...


class DaemonView(Protocol):
    """The daemon as its servers see it: configuration, targets, live buses, anomaly state."""

    @property
    def config(self) -> Config: ...
    @property
    def targets(self) -> Mapping[str, TargetView]: ...
    @property
    def started_ns(self) -> int: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def reloads(self) -> Mapping[str, int]: ...
    @property
    def samples(self) -> Bus: ...
    @property
    def alerts(self) -> Bus: ...

    def runtimes(self) -> Iterator[TargetView]: ...
    def thread_contexts(self, pid: int) -> tuple[TargetView, list[Any]]: ...
    def history(self, pid: int, last: int) -> tuple[TargetView, dict[str, Any]]: ...
    def alert_counts(self) -> list[tuple[str, str, str, int]]: ...
    def needs_learning(self) -> list[tuple[str, str, str, str]]: ...


class Server(Protocol):
    """A server the daemon starts after its targets and stops before detaching them."""

    @property
    def address(self) -> Any: ...

    def start(self) -> None: ...
    def begin_shutdown(self) -> None: ...
    def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ServerFactories:
    """How to build the daemon's servers.  ``grpc(daemon, config)`` always; ``metrics(daemon, host,
    port)`` when ``metrics_listen`` is set; ``preimport`` runs on a thread while the targets attach
    (the servers' imports overlap the BPF verifier and compile time)."""

    grpc: Callable[[DaemonView, DaemonConfig], Server]
    metrics: Callable[[DaemonView, str, int], Server]
    preimport: Callable[[], None] | None = None
