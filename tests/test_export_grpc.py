"""The ccprofd.v1 gRPC service through a real channel on a real Unix socket (and TCP + mutual TLS),
with the standard health service and server reflection.  The tracer is replaced by a scripted
source (tests/daemon_fakes.py); everything from the store to the wire is real."""

from __future__ import annotations

import grp
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import require_tool
from daemon_fakes import (
    TARGET_APP,
    TARGET_DB,
    FakeFactory,
    config_text,
    frame,
    sample,
    short_tmpdir,
    started_daemon,
    wait_for,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ccprofd.daemon.config import parse_config
from ccprofd.daemon.service import Daemon
from ccprofd.daemon.store import context_id
from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.export.gen import ccprofd_pb2_grpc as pb_grpc
from ccprofd.export.servers import standard_servers

WRITE_CTX = [frame("main", 0x1139), frame("emit", 0x1180)]
OPEN_CTX = [frame("main", 0x1145), frame("load", 0x11A0), frame("read_cfg", 0x11C4)]


@pytest.fixture
def served() -> Iterator[tuple[Daemon, FakeFactory, str]]:
    with started_daemon(TARGET_APP + TARGET_DB) as s:
        yield s.daemon, s.factory, s.socket


def stub(path: str) -> pb_grpc.ProfilerStub:
    return pb_grpc.ProfilerStub(grpc.insecure_channel(f"unix:{path}"))


def feed(daemon: Daemon, factory: FakeFactory) -> None:
    src = factory.sources["app"]
    src.push(*[sample(WRITE_CTX, "write") for _ in range(6)], *[sample(OPEN_CTX, "openat") for _ in range(2)])
    src.push(sample([frame("main", 0x1139), frame("spin", 0x1190)], event="cpu"))
    wait_for(lambda: daemon.targets["app"].store.samples == 9)


def test_socket_is_0660_and_owned_by_the_ccprofd_group_when_it_exists(
    served: tuple[Daemon, FakeFactory, str],
) -> None:
    _, _, path = served
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    try:
        assert st.st_gid == grp.getgrnam("ccprofd").gr_gid
    except KeyError:
        assert st.st_gid == os.getgid()


def test_list_targets(served: tuple[Daemon, FakeFactory, str]) -> None:
    daemon, factory, path = served
    feed(daemon, factory)
    resp = stub(path).ListTargets(pb.ListTargetsRequest(), timeout=10)
    by_name = {t.name: t for t in resp.targets}
    app, db = by_name["app"], by_name["db"]
    assert (app.kind, app.spec, app.mode, app.state, list(app.syscalls), app.samples) == (
        "path",
        "/opt/app/bin",
        "unwind",
        "attached",
        ["write", "openat"],
        9,
    )
    assert [(b.path, b.build_id) for b in app.binaries] == [("/opt/app/bin", frame("x", 0)["build_id"])]
    assert [(p.pid, p.threads) for p in app.processes] == [(4242, 2)]
    assert (db.kind, db.spec, db.mode, db.configured_mode) == (
        "pid",
        "999999",
        "instrumented",
        "instrumented",
    )


def test_get_thread_contexts(served: tuple[Daemon, FakeFactory, str]) -> None:
    _, _, path = served
    resp = stub(path).GetThreadContexts(pb.GetThreadContextsRequest(pid=4242), timeout=10)
    assert resp.pid == 4242 and resp.target in ("app", "db")
    threads = {t.tid: t for t in resp.threads}
    assert [f.function for f in threads[4242].frames] == ["main", "serve"] and threads[4242].complete
    assert threads[4242].frames[0].call_site == 0x1100 and threads[4242].frames[0].return_address == 0x1105
    assert not threads[4243].complete
    with pytest.raises(grpc.RpcError) as info:
        stub(path).GetThreadContexts(pb.GetThreadContextsRequest(pid=1), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "pid 1" in (info.value.details() or "")


def test_get_hot_contexts(served: tuple[Daemon, FakeFactory, str]) -> None:
    daemon, factory, path = served
    feed(daemon, factory)
    resp = stub(path).GetHotContexts(pb.GetHotContextsRequest(target="app", top_k=5), timeout=10)
    assert resp.total_samples == 8
    got = [(h.syscall, h.count, h.leaf, h.context, [f.function for f in h.frames]) for h in resp.contexts]
    assert got == [
        ("write", 6, "emit", context_id(WRITE_CTX), ["main", "emit"]),
        ("openat", 2, "read_cfg", context_id(OPEN_CTX), ["main", "load", "read_cfg"]),
    ]
    one = stub(path).GetHotContexts(pb.GetHotContextsRequest(top_k=1), timeout=10)
    assert [h.count for h in one.contexts] == [6] and one.total_samples == 8
    cpu = stub(path).GetHotContexts(pb.GetHotContextsRequest(target="app", by=pb.HOT_BY_CPU), timeout=10)
    assert [(h.event, h.leaf, h.count) for h in cpu.contexts] == [("cpu", "spin", 1)]
    with pytest.raises(grpc.RpcError) as info:
        stub(path).GetHotContexts(pb.GetHotContextsRequest(target="nope"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_hot_by_has_an_unspecified_zero_that_means_syscall(served: tuple[Daemon, FakeFactory, str]) -> None:
    """Issue 17: HotBy's zero value was HOT_BY_SYSCALL (no way to tell 'not set'); now it is
    HOT_BY_UNSPECIFIED, read as the default (syscall samples), as is the explicit HOT_BY_SYSCALL; the
    wire value 1 stays CPU, so requests of older clients keep their meaning; an unknown value is
    INVALID_ARGUMENT."""
    daemon, factory, path = served
    feed(daemon, factory)
    assert pb.HotBy.Name(0) == "HOT_BY_UNSPECIFIED" and pb.HotBy.Value("HOT_BY_CPU") == 1

    def ranked(by: int | None) -> list[tuple[str, int]]:
        req = pb.GetHotContextsRequest(target="app")
        if by is not None:
            req.by = by  # type: ignore[assignment]
        return [(h.event, h.count) for h in stub(path).GetHotContexts(req, timeout=10).contexts]

    assert ranked(None) == ranked(pb.HOT_BY_UNSPECIFIED) == ranked(pb.HOT_BY_SYSCALL) == [
        ("syscall", 6), ("syscall", 2)]
    # an old client's bytes: field 2 (by) = varint 1, i.e. its HOT_BY_CPU
    old = pb.GetHotContextsRequest.FromString(pb.GetHotContextsRequest(target="app").SerializeToString()
                                              + bytes([2 << 3, 1]))
    assert [(h.event, h.count) for h in stub(path).GetHotContexts(old, timeout=10).contexts] == [("cpu", 1)]
    with pytest.raises(grpc.RpcError) as info:
        ranked(7)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "by=7" in (info.value.details() or "")


def test_every_proto_message_field_and_enum_value_is_commented(tmp_path: Path) -> None:
    """Issue 17: the proto had messages and fields without a word on what they mean.  protoc's own
    source info (leading or trailing comments per element) is the judge."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    root = Path(__file__).resolve().parents[1] / "proto"
    include = Path(protoc.__file__).parent / "_proto"
    assert protoc.main(["protoc", f"-I{root}", f"-I{include}", "--include_source_info",
                        f"--descriptor_set_out={out}", "ccprofd.proto"]) == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (f,) = fds.file
    commented = {tuple(loc.path) for loc in f.source_code_info.location
                 if loc.leading_comments.strip() or loc.trailing_comments.strip()}
    missing = []
    for i, m in enumerate(f.message_type):  # FileDescriptorProto.message_type = 4, field = 2
        if (4, i) not in commented:
            missing.append(m.name)
        missing += [f"{m.name}.{fd.name}" for j, fd in enumerate(m.field) if (4, i, 2, j) not in commented]
    for i, e in enumerate(f.enum_type):  # enum_type = 5, value = 2
        if (5, i) not in commented:
            missing.append(e.name)
        missing += [f"{e.name}.{v.name}" for j, v in enumerate(e.value) if (5, i, 2, j) not in commented]
    if (6, 0) not in commented:
        missing.append(f.service[0].name)
    for j, r in enumerate(f.service[0].method):  # service = 6, method = 2
        if (6, 0, 2, j) not in commented:
            missing.append(r.name)
    assert not missing, missing
    assert f.message_type and f.enum_type


def test_get_call_graph_stats(served: tuple[Daemon, FakeFactory, str]) -> None:
    _, _, path = served
    resp = stub(path).GetCallGraphStats(pb.GetCallGraphStatsRequest(target="app"), timeout=10)
    (b,) = resp.binaries
    assert b.path == "/opt/app/bin" and b.stats["functions"] == 12
    assert b.stats["encodings"]["valence"]["acyclic_bits"] == 3


def test_stream_samples_live_with_filter(served: tuple[Daemon, FakeFactory, str]) -> None:
    daemon, factory, path = served
    call = stub(path).StreamSamples(pb.SampleFilter(target="app", syscalls=["openat"]), timeout=30)
    assert dict(call.initial_metadata()).get("ccprofd-subscribed") == "1"
    assert daemon.samples.subscribers() == 1  # the metadata arrives only once the server subscribed
    received: list[pb.Sample] = []

    def consume() -> None:
        for msg in call:
            received.append(msg)
            if len(received) == 2:
                call.cancel()
                return

    t = threading.Thread(target=consume)
    t.start()
    wait_for(lambda: daemon.samples.subscribers() == 1)
    feed(daemon, factory)
    t.join(timeout=30)
    assert [(m.syscall, m.target, m.context, m.pid) for m in received] == [
        ("openat", "app", context_id(OPEN_CTX), 4242)
    ] * 2
    assert [f.function for f in received[0].frames] == ["main", "load", "read_cfg"]
    wait_for(lambda: daemon.samples.subscribers() == 0)


def test_stream_alerts(served: tuple[Daemon, FakeFactory, str]) -> None:
    daemon, _, path = served
    call = stub(path).StreamAlerts(pb.AlertFilter(kinds=["unseen_context"]), timeout=30)
    assert dict(call.initial_metadata()).get("ccprofd-subscribed") == "1"
    assert daemon.alerts.subscribers() == 1  # the metadata arrives only once the server subscribed
    received: list[pb.Alert] = []

    def consume() -> None:
        for msg in call:
            received.append(msg)
            call.cancel()
            return

    t = threading.Thread(target=consume)
    t.start()
    wait_for(lambda: daemon.alerts.subscribers() == 1)
    daemon.alerts.publish({"kind": "incomplete_context", "target": "app", "syscall": "openat"})
    daemon.alerts.publish(
        {
            "kind": "unseen_context",
            "target": "app",
            "syscall": "openat",
            "pid": 7,
            "tid": 8,
            "time_ns": 5,
            "args": {"path": "/etc/shadow"},
            "frames": OPEN_CTX,
            "nearest": [{"frames": WRITE_CTX, "count": 4, "common_prefix": 1}],
        }
    )
    t.join(timeout=30)
    (alert,) = received
    assert (alert.kind, alert.pid, alert.tid, dict(alert.args)) == (
        "unseen_context",
        7,
        8,
        {"path": "/etc/shadow"},
    )
    assert [f.function for f in alert.frames] == ["main", "load", "read_cfg"]
    assert alert.nearest[0].count == 4 and alert.nearest[0].common_prefix == 1


def test_health_and_reflection(served: tuple[Daemon, FakeFactory, str]) -> None:
    _, _, path = served
    channel = grpc.insecure_channel(f"unix:{path}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "ccprofd.v1.Profiler"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = list(
        refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
    )
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"ccprofd.v1.Profiler", "grpc.health.v1.Health"} <= names


def test_stale_socket_is_replaced_and_a_live_one_refused(tmp_path: Path) -> None:
    from ccprofd.export.grpc_server import ServerError

    workdir = short_tmpdir()
    sock = f"{workdir}/ccprofd.sock"
    import socket as socketmod

    s = socketmod.socket(socketmod.AF_UNIX)
    s.bind(sock)
    s.close()  # bound, never listening: what a SIGKILLed daemon leaves behind
    with started_daemon(workdir=workdir):
        assert stub(sock).ListTargets(pb.ListTargetsRequest(), timeout=10).targets == []
        d2 = Daemon(parse_config(config_text(workdir)), FakeFactory(), servers=standard_servers())
        with pytest.raises(ServerError, match="another process is serving it"):
            d2.start()
        d2.stop()
        assert stub(sock).ListTargets(pb.ListTargetsRequest(), timeout=10).targets == []
    assert not os.path.exists(sock)
    shutil.rmtree(workdir, ignore_errors=True)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
        "-days",
        "2",
        "-subj",
        "/CN=ccprofd-test-ca",
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
            "-subj",
            f"/CN=ccprofd-{name}",
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-out",
            str(d / f"{name}.pem"),
            "-days",
            "2",
            "-extfile",
            str(d / f"{name}.ext"),
        )


def test_tcp_with_mutual_tls(tmp_path: Path) -> None:
    require_tool("openssl")
    make_pki(tmp_path)
    extra = (
        f'tls_cert = "{tmp_path}/server.pem"\ntls_key = "{tmp_path}/server.key"\n'
        f'tls_client_ca = "{tmp_path}/ca.pem"\n'
    )
    with started_daemon(TARGET_APP, workdir=str(tmp_path), daemon_extra=extra,
                        grpc_listen="tcp://127.0.0.1:0") as served_tls:
        daemon = served_tls.daemon
        address = daemon.grpc_address.removeprefix("tcp://")
        ca = (tmp_path / "ca.pem").read_bytes()
        creds = grpc.ssl_channel_credentials(
            ca, (tmp_path / "client.key").read_bytes(), (tmp_path / "client.pem").read_bytes()
        )
        with grpc.secure_channel(address, creds) as ch:
            resp = pb_grpc.ProfilerStub(ch).ListTargets(pb.ListTargetsRequest(), timeout=10)
            assert [t.name for t in resp.targets] == ["app"]
        with (
            grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as ch,
            pytest.raises(grpc.RpcError) as info,
        ):
            pb_grpc.ProfilerStub(ch).ListTargets(pb.ListTargetsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no client certificate: handshake refused
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError):
            pb_grpc.ProfilerStub(ch).ListTargets(pb.ListTargetsRequest(), timeout=5)


def test_get_context_resolves_an_id_to_its_frames(served: tuple[Daemon, FakeFactory, str]) -> None:
    """Issue 17: the id of a metric series or a sample, resolved to the frames it stands for."""
    daemon, factory, path = served
    feed(daemon, factory)
    ctx = context_id(OPEN_CTX)
    resp = stub(path).GetContext(pb.GetContextRequest(context=ctx.upper()), timeout=10)
    assert [(c.target, c.context, c.complete, c.leaf) for c in resp.contexts] == [
        ("app", ctx, True, "read_cfg")]
    assert [(f.function, f.call_site, f.module) for f in resp.contexts[0].frames] == [
        ("main", 0x1145, "/opt/app/bin"), ("load", 0x11A0, "/opt/app/bin"),
        ("read_cfg", 0x11C4, "/opt/app/bin")]
    one = stub(path).GetContext(pb.GetContextRequest(context=ctx, target="app"), timeout=10)
    assert len(one.contexts) == 1
    not_found, invalid = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT
    for req, code, needle in (
        (pb.GetContextRequest(context=ctx, target="db"), not_found, "not held by target 'db'"),
        (pb.GetContextRequest(context="0123456789ab"), not_found, "not held by any target"),
        (pb.GetContextRequest(context=ctx, target="nope"), not_found, "no target 'nope'"),
        (pb.GetContextRequest(context="other"), invalid, "not a context id"),
        (pb.GetContextRequest(context=""), invalid, "not a context id"),
    ):
        with pytest.raises(grpc.RpcError) as exc:
            stub(path).GetContext(req, timeout=10)
        assert exc.value.code() == code and needle in (exc.value.details() or ""), req


def _collect_batches(call: Any, until: Callable[[list[Any]], bool]) -> tuple[threading.Thread, list[Any]]:
    messages: list[Any] = []

    def consume() -> None:
        for msg in call:
            messages.append(msg)
            if until(messages):
                call.cancel()
                return

    t = threading.Thread(target=consume)
    t.start()
    return t, messages


def test_stream_sample_batches_carry_the_samples_in_order(served: tuple[Daemon, FakeFactory, str]) -> None:
    """The batched stream gives what StreamSamples gives, sample for sample, in publishing order."""
    _, factory, path = served
    single = stub(path).StreamSamples(pb.SampleFilter(target="app"), timeout=60)
    batched = stub(path).StreamSampleBatches(pb.SampleFilter(target="app"), timeout=60)
    for call in (single, batched):
        assert dict(call.initial_metadata()).get("ccprofd-subscribed") == "1"
    n = 300
    t1, one_by_one = _collect_batches(single, lambda got: len(got) == n)
    t2, batches = _collect_batches(batched, lambda got: sum(len(b.samples) for b in got) == n)
    src = factory.sources["app"]
    src.push(*[sample(WRITE_CTX if i % 3 else OPEN_CTX, "write" if i % 3 else "openat", tid=1000 + i)
               for i in range(n)])
    t1.join(timeout=60)
    t2.join(timeout=60)
    flat = [s for b in batches for s in b.samples]
    assert [s.tid for s in flat] == list(range(1000, 1000 + n))
    assert flat == one_by_one  # every field, frames included
    assert flat[1].context == context_id(WRITE_CTX) and [f.function for f in flat[0].frames] == [
        "main", "load", "read_cfg"]
    assert all(b.dropped == 0 for b in batches)


def test_a_slow_batch_subscriber_is_told_what_it_lost() -> None:
    """Whatever the timing, every sample of the stream either arrives or is counted as dropped in
    the messages themselves (and in the daemon's counter): nothing is lost silently."""
    with started_daemon(TARGET_APP, daemon_extra="stream_queue = 8") as s:
        call = stub(s.socket).StreamSampleBatches(pb.SampleFilter(target="app"), timeout=60)
        assert dict(call.initial_metadata()).get("ccprofd-subscribed") == "1"
        n = 3000
        t, batches = _collect_batches(
            call, lambda got: sum(len(b.samples) + b.dropped for b in got) >= n)
        s.factory.sources["app"].push(*[sample(WRITE_CTX, tid=i) for i in range(n)])
        t.join(timeout=60)
        received = [m.tid for b in batches for m in b.samples]
        dropped = sum(b.dropped for b in batches)
        assert len(received) + dropped == n
        assert received == sorted(received) and len(set(received)) == len(received)  # in order, once
        assert dropped == s.daemon.samples.dropped
        # no more than the queue held: the first item taken, then the (at most 8) queued after it
        assert all(len(b.samples) <= 8 + 1 for b in batches)
