"""The ``ccprofd.v1.Profiler`` gRPC service, with the standard health service and reflection.

Default endpoint: a Unix socket with mode 0660 and group ``ccprofd`` (when that group exists) — the
service exposes other processes' internals, so it must not be reachable by every local user.  The
permissions are set after bind and before listen, so no connection is possible with the default
umask's mode.  A live socket at the path (another daemon) is an error; a stale one is replaced.
TCP is used only when configured, with optional TLS (server certificate; a client CA makes client
certificates mandatory).
"""

from __future__ import annotations

import grp
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ccprofd.daemon.config import DaemonConfig
from ccprofd.daemon.query import DaemonView, TargetView
from ccprofd.daemon.source import UnknownProcess
from ccprofd.daemon.store import leaf_name
from ccprofd.export import messages
from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.export.gen import ccprofd_pb2_grpc as pb_grpc

log = logging.getLogger("ccprofd")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Profiler"].full_name
STREAM_POLL_S = 0.25
#: StreamSampleBatches: samples per message at most (and messages.BATCH_MAX_BYTES).
BATCH_MAX_SAMPLES = 1000
# Sent as a stream's initial metadata once its subscription is live: a client that waits for it
# (``call.initial_metadata()``) knows every item published from then on reaches it. Without it a
# client cannot tell, since gRPC returns the call before the server's handler has run.
SUBSCRIBED = (("ccprofd-subscribed", "1"),)


class ServerError(RuntimeError):
    """The gRPC endpoint cannot be served (address in use, bad certificate...): one line."""


class ProfilerServicer(pb_grpc.ProfilerServicer):
    """Answers from the daemon's live state; never blocks the sample path."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon

    def _target(self, name: str, context: grpc.ServicerContext) -> TargetView:
        rt = self.daemon.targets.get(name)
        if rt is None:
            known = ", ".join(sorted(self.daemon.targets)) or "none"
            context.abort(grpc.StatusCode.NOT_FOUND, f"no target {name!r} (targets: {known})")
        assert rt is not None
        return rt

    def ListTargets(self, request: Any, context: grpc.ServicerContext) -> Any:
        out = pb.ListTargetsResponse()
        for rt in self.daemon.runtimes():
            tc = rt.config
            t = out.targets.add(name=tc.name, kind=tc.kind, spec=tc.spec, mode=rt.mode(),
                                configured_mode=tc.mode, encoding=tc.encoding,
                                syscalls=list(tc.syscalls or ()),
                                perf_sample_hz=tc.perf_sample_hz, state=rt.state, error=rt.error,
                                samples=rt.store.samples)
            src = rt.source
            if src is None:
                continue
            try:
                for b in src.binaries():
                    t.binaries.add(path=b.path, build_id=b.build_id, inode=b.inode, attached=b.attached)
                for p in src.processes():
                    t.processes.add(pid=p.pid, binary=p.binary, build_id=p.build_id, threads=p.threads,
                                    comm=p.comm)
            except Exception as exc:
                t.error = f"cannot list processes: {exc}"
        self._needs_learning(out)
        return out

    def _needs_learning(self, out: Any) -> None:
        """Issue 7: binaries no anomaly model applies to (upgraded: the old model is kept, unused)."""
        by_name = {t.name: t for t in out.targets}
        for target, binary, build_id, reason in self.daemon.needs_learning():
            t = by_name.get(target)
            if t is not None:
                t.needs_learning.add(binary=binary, build_id=build_id, reason=reason)

    def GetThreadContexts(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            rt, threads = self.daemon.thread_contexts(request.pid)
        except UnknownProcess as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc).strip("'\""))
            raise  # unreachable: abort raises
        except NotImplementedError as exc:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
            raise
        except PermissionError as exc:  # ptrace refused (already traced, no CAP_SYS_PTRACE): say so
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise
        except (OSError, RuntimeError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"cannot read the contexts of pid {request.pid}: {exc}")
            raise
        out = pb.GetThreadContextsResponse(pid=request.pid, target=rt.name, mode=rt.mode())
        for th in threads:
            out.threads.add(tid=th.tid, comm=th.comm, complete=th.complete,
                            frames=messages.frames_to_pb(th.frames), reason=th.reason or "")
        return out

    def GetHistory(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            rt, got = self.daemon.history(request.pid, request.last)
        except UnknownProcess as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc).strip("'\""))
            raise  # unreachable: abort raises
        except OSError as exc:  # a BPF map read failed
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the history of pid {request.pid}: {exc}")
            raise
        out = pb.GetHistoryResponse(pid=request.pid, target=rt.name, mode=rt.mode(),
                                    source=str(got.get("source") or "live"))
        for th in got["threads"]:
            out.threads.add(tid=th["tid"], events=[messages.history_event_to_pb(ev) for ev in th["events"]])
        return out

    def GetHotContexts(self, request: Any, context: grpc.ServicerContext) -> Any:
        event = HOT_BY_EVENT.get(request.by)
        if event is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"by={request.by} is not a HotBy value (known: {', '.join(pb.HotBy.keys())})")
        assert event is not None
        top_k = request.top_k or self.daemon.config.daemon.top_k
        selected = [self._target(request.target, context)] if request.target else list(self.daemon.runtimes())
        rows: list[tuple[str, Any]] = []
        total = 0
        for rt in selected:
            hot = rt.store.hot(event, top_k, request.since_ns, request.syscall or None)
            rows.extend((rt.name, h) for h in hot)
            total += rt.store.total(event, request.since_ns, request.syscall or None)
        rows.sort(key=lambda r: (-r[1].count, r[0], r[1].context))
        out = pb.GetHotContextsResponse(total_samples=total, until_ns=time.time_ns(),
                                        since_ns=request.since_ns or self.daemon.started_ns)
        periods = {rt.config.perf_sample_hz for rt in selected}
        if event == "cpu" and len(periods) == 1 and 0 not in periods:
            out.sample_period_ns = 1_000_000_000 // periods.pop()
        for target, h in rows[:top_k]:
            out.contexts.add(target=target, context=h.context, event=h.event, syscall=h.syscall,
                             count=h.count, complete=h.complete, frames=messages.frames_to_pb(h.frames),
                             leaf=h.leaf,
                             first_seen_ns=h.first_seen_ns, last_seen_ns=h.last_seen_ns)
        return out

    def GetContext(self, request: Any, context: grpc.ServicerContext) -> Any:
        wanted = request.context.strip().lower()
        if not CONTEXT_ID.fullmatch(wanted):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"not a context id: {request.context!r} (a hex hash such as 3f2a9c01b7e4)")
        selected = [self._target(request.target, context)] if request.target else list(self.daemon.runtimes())
        out = pb.GetContextResponse()
        for rt in selected:
            found = rt.store.resolve(wanted)
            if found is not None:
                complete, frames = found
                out.contexts.add(target=rt.name, context=wanted, complete=complete,
                                 frames=messages.frames_to_pb(frames), leaf=leaf_name(frames))
        if not out.contexts:
            where = f"target {request.target!r}" if request.target else "any target"
            context.abort(grpc.StatusCode.NOT_FOUND, f"context {wanted} is not held by {where}")
        return out

    def _sample_filter(self, request: Any, context: grpc.ServicerContext) -> Callable[[dict[str, Any]], bool]:
        if request.target:
            self._target(request.target, context)
        syscalls = set(request.syscalls)

        def accept(item: dict[str, Any]) -> bool:
            return ((not request.target or item.get("target") == request.target)
                    and (not request.pid or item.get("pid") == request.pid)
                    and (not request.event or item.get("event") == request.event)
                    and (not syscalls or item.get("syscall") in syscalls))

        return accept

    def StreamSamples(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        encoder = messages.SampleEncoder()
        with self.daemon.samples.subscribe(self._sample_filter(request, context)) as sub:
            context.send_initial_metadata(SUBSCRIBED)
            while context.is_active() and not self.daemon.stopping:
                item = sub.get(STREAM_POLL_S)
                if item is not None:
                    yield encoder.sample(item)

    def StreamSampleBatches(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        encoder = messages.SampleEncoder()
        with self.daemon.samples.subscribe(self._sample_filter(request, context)) as sub:
            context.send_initial_metadata(SUBSCRIBED)
            while context.is_active() and not self.daemon.stopping:
                items = sub.get_batch(STREAM_POLL_S, BATCH_MAX_SAMPLES)
                dropped = sub.take_dropped()
                yield from encoder.batches(items, dropped)

    def GetCallGraphStats(self, request: Any, context: grpc.ServicerContext) -> Any:
        rt = self._target(request.target, context)
        out = pb.GetCallGraphStatsResponse(target=rt.name)
        if rt.source is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"target {rt.name!r} is not attached: {rt.error or rt.state}")
        assert rt.source is not None
        build_ids = {b.path: b.build_id for b in rt.source.binaries()}
        for path, stats in sorted(rt.source.callgraph_stats().items()):
            s = struct_pb2.Struct()
            s.update(_jsonable(stats))
            out.binaries.add(path=path, build_id=build_ids.get(path, str(stats.get("build_id", ""))), stats=s)
        return out

    def StreamAlerts(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if request.target:
            self._target(request.target, context)
        kinds, syscalls = set(request.kinds), set(request.syscalls)

        def accept(item: dict[str, Any]) -> bool:
            return ((not request.target or item.get("target") == request.target)
                    and (not kinds or item.get("kind") in kinds)
                    and (not syscalls or item.get("syscall") in syscalls))

        with self.daemon.alerts.subscribe(accept) as sub:
            context.send_initial_metadata(SUBSCRIBED)
            while context.is_active() and not self.daemon.stopping:
                item = sub.get(STREAM_POLL_S)
                if item is not None:
                    yield messages.alert_to_pb(item)


CONTEXT_ID = re.compile(r"[0-9a-f]{1,64}")
# GetHotContextsRequest.by: unset (HOT_BY_UNSPECIFIED, the wire value HOT_BY_SYSCALL had before it
# got its own number) counts syscall samples, the documented default.
HOT_BY_EVENT = {pb.HOT_BY_UNSPECIFIED: "syscall", pb.HOT_BY_SYSCALL: "syscall", pb.HOT_BY_CPU: "cpu"}


def _jsonable(value: Any) -> Any:
    """Struct takes JSON values only: tuples become lists, keys strings, ints floats (Struct's number)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return float(value)
    return str(value)


class GrpcServer:
    def __init__(self, daemon: DaemonView, config: DaemonConfig, max_workers: int = 16) -> None:
        self.daemon = daemon
        self.config = config
        self.max_workers = max_workers
        self.server: grpc.Server | None = None
        self.health = health.HealthServicer()
        self.address = ""

    def start(self) -> None:
        ep = self.config.grpc_listen
        pool = futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="grpc")
        server = grpc.server(pool, options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ProfilerServicer_to_server(ProfilerServicer(self.daemon), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        if ep.kind == "unix":
            self._bind_unix(server, ep.path)
            self.address = f"unix://{ep.path}"
        else:
            port = self._bind_tcp(server, ep.grpc_address())
            self.address = f"tcp://{ep.grpc_address().rsplit(':', 1)[0]}:{port}"
        server.start()
        self.server = server
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def _bind_unix(self, server: grpc.Server, path: str) -> None:
        os.makedirs(os.path.dirname(path) or "/", mode=0o755, exist_ok=True)
        _remove_stale_socket(path)
        old_umask = os.umask(0o177)  # created 0600; widened to the configured mode below
        try:
            server.add_insecure_port(f"unix:{path}")
        except RuntimeError as exc:
            raise ServerError(f"cannot listen on unix://{path}: {exc}") from None
        finally:
            os.umask(old_umask)
        gid = -1
        try:
            gid = grp.getgrnam(self.config.grpc_socket_group).gr_gid
        except KeyError:
            log.info("group %r does not exist: %s is root-only (mode %o, owner's group)",
                     self.config.grpc_socket_group, path, self.config.grpc_socket_mode)
        if gid != -1:
            os.chown(path, -1, gid)
        os.chmod(path, self.config.grpc_socket_mode)

    def _bind_tcp(self, server: grpc.Server, address: str) -> int:
        c = self.config
        try:
            if c.tls_cert is not None and c.tls_key is not None:
                ca = c.tls_client_ca.read_bytes() if c.tls_client_ca else None
                creds = grpc.ssl_server_credentials([(c.tls_key.read_bytes(), c.tls_cert.read_bytes())],
                                                    root_certificates=ca, require_client_auth=ca is not None)
                port = server.add_secure_port(address, creds)
            else:
                port = server.add_insecure_port(address)
        except (RuntimeError, OSError) as exc:
            raise ServerError(f"cannot listen on tcp://{address}: {exc}") from None
        if port == 0:
            raise ServerError(f"cannot listen on tcp://{address} (address in use?)")
        return port

    def begin_shutdown(self) -> None:
        self.health.enter_graceful_shutdown()

    def stop(self, grace: float = 0.5) -> None:
        if self.server is None:
            return
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1.0)
        self.server = None
        ep = self.config.grpc_listen
        if ep.kind == "unix":
            try:
                if stat.S_ISSOCK(os.lstat(ep.path).st_mode):
                    os.unlink(ep.path)
            except FileNotFoundError:
                pass


def _remove_stale_socket(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ServerError(f"cannot listen on unix://{path}: the path exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listening: left over from a killed daemon
        return
    finally:
        probe.close()
    raise ServerError(f"cannot listen on unix://{path}: another process is serving it (is ccprofd running?)")
