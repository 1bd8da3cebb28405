"""The pprof endpoints of the metrics port (``/debug/pprof/profile``, ``/debug/pprof/syscalls``)
over real HTTP on an in-process daemon with fake sample sources; the body is decoded with the
independent wire decoder of test_export_pprof.  The real daemon, real BPF and ``go tool pprof``
are in test_pprof_e2e."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from daemon_fakes import (
    TARGET_APP,
    TARGET_DB,
    FakeFactory,
    frame,
    sample,
    started_daemon,
    wait_for,
)
from test_export_pprof import decode_profile

from ccprofd.daemon.service import Daemon


@pytest.fixture
def served() -> Iterator[tuple[Daemon, FakeFactory]]:
    with started_daemon(TARGET_APP + "perf_sample_hz = 50\n" + TARGET_DB) as s:
        yield s.daemon, s.factory


def get(daemon: Daemon, path: str) -> tuple[int, dict[str, str], bytes]:
    address = daemon.metrics_address
    assert address is not None
    try:
        with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/debug/pprof/syscalls?seconds=abc", "seconds='abc' is not a number"),
        ("/debug/pprof/syscalls?seconds=0", "seconds=0 is out of range"),
        ("/debug/pprof/syscalls?seconds=-3", "seconds=-3 is out of range"),
        ("/debug/pprof/syscalls?seconds=nan", "seconds=nan is out of range"),
        ("/debug/pprof/profile?seconds=100000", "seconds=100000 is out of range"),
        ("/debug/pprof/syscalls?seconds=1&target=nope", "no target 'nope' (targets: app, db)"),
        ("/debug/pprof/profile?seconds=1&target=db", "no selected target samples CPU time"),
    ],
)
def test_bad_requests_get_400_with_the_reason(served: tuple[Daemon, FakeFactory], path: str,
                                              message: str) -> None:
    daemon, _ = served
    status, headers, body = get(daemon, path)
    assert status == 400 and headers["Content-Type"].startswith("text/plain")
    assert body.decode().startswith(message) and body.count(b"\n") == 1


def fetch_while_pushing(daemon: Daemon, path: str, push: list[dict[str, object]],
                        factory: FakeFactory) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` on a thread; once its subscription is live, push the samples to target app."""
    out: list[tuple[int, dict[str, str], bytes]] = []
    thread = threading.Thread(target=lambda: out.append(get(daemon, path)))
    thread.start()
    wait_for(lambda: daemon.samples.subscribers() == 1, timeout=30)
    factory.sources["app"].push(*push)
    thread.join(timeout=120)
    assert out, "no answer"
    return out[0]


def test_syscall_profile_holds_the_samples_of_its_window(served: tuple[Daemon, FakeFactory]) -> None:
    daemon, factory = served
    a = [frame("main", 0x1139), frame("emit", 0x1180)]
    b = [frame("main", 0x1145), frame("load", 0x11A0)]
    push = [*[sample(a) for _ in range(5)], *[sample(b, "openat") for _ in range(2)],
            sample(b, event="cpu")]
    status, headers, body = fetch_while_pushing(daemon, "/debug/pprof/syscalls?seconds=2&target=app",
                                                push, factory)
    assert status == 200, body
    assert headers["Content-Type"] == "application/octet-stream"
    assert int(headers["Content-Length"]) == len(body) and body[:2] == b"\x1f\x8b"
    prof = decode_profile(body)
    assert prof["sample_types"] == [("syscalls", "count")]
    got = sorted(([loc["functions"][0] for loc in s["locations"]], s["values"]) for s in prof["samples"])
    assert got == [(["syscall:openat", "load", "main"], [2]), (["syscall:write", "emit", "main"], [5])]
    assert daemon.samples.subscribers() == 0  # the window's subscription is gone


def test_cpu_profile_counts_cpu_samples_with_the_sampling_period(served: tuple[Daemon, FakeFactory]) -> None:
    daemon, factory = served
    spin = [frame("main", 0x1139), frame("spin", 0x11C0)]
    push = [*[sample(spin, event="cpu") for _ in range(3)], sample(spin)]
    status, _, body = fetch_while_pushing(daemon, "/debug/pprof/profile?seconds=2", push, factory)
    assert status == 200, body
    prof = decode_profile(body)
    assert prof["sample_types"] == [("samples", "count"), ("cpu", "nanoseconds")]
    assert [([loc["functions"][0] for loc in s["locations"]], s["values"]) for s in prof["samples"]] == [
        (["spin", "main"], [3, 3 * 20_000_000])]


def test_an_open_window_ends_when_the_daemon_stops(served: tuple[Daemon, FakeFactory]) -> None:
    """A 600 s window does not hold the daemon's shutdown: it answers with what it has."""
    daemon, factory = served
    out: list[tuple[int, dict[str, str], bytes]] = []
    thread = threading.Thread(target=lambda: out.append(get(daemon, "/debug/pprof/syscalls?seconds=600")))
    thread.start()
    wait_for(lambda: daemon.samples.subscribers() == 1, timeout=30)
    factory.sources["app"].push(sample([frame("main", 0x1139)]))
    wait_for(lambda: daemon.targets["app"].store.samples == 1, timeout=30)
    daemon.stopping = True
    try:
        thread.join(timeout=60)
        assert out and out[0][0] == 200
        assert [s["values"] for s in decode_profile(out[0][2])["samples"]] == [[1]]
    finally:
        daemon.stopping = False
