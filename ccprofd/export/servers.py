"""The daemon's standard servers (gRPC, Prometheus), as the factories ``ccprofd run`` hands it.

The server modules are imported when a server is built (or by ``preimport`` on a thread while the
targets attach): gRPC, protobuf and prometheus-client take ~0.3-0.5 s to import, which the
daemon's start-up overlaps with the BPF verifier and compile time (GIL-free calls).
"""

from __future__ import annotations

import contextlib
import importlib

from ccprofd.daemon.config import DaemonConfig
from ccprofd.daemon.query import DaemonView, Server, ServerFactories

SERVER_MODULES = ("ccprofd.export.grpc_server", "ccprofd.export.metrics")


def grpc_server(daemon: DaemonView, config: DaemonConfig) -> Server:
    from ccprofd.export.grpc_server import GrpcServer

    return GrpcServer(daemon, config)


def metrics_server(daemon: DaemonView, host: str, port: int) -> Server:
    from ccprofd.export.metrics import MetricsServer

    return MetricsServer(daemon, host, port)


def preimport() -> None:
    """Import the server modules ahead of use; a failure is left to the real import to report."""
    for name in SERVER_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def standard_servers() -> ServerFactories:
    return ServerFactories(grpc=grpc_server, metrics=metrics_server, preimport=preimport)
