"""Prometheus /metrics scraped over real HTTP and parsed with prometheus-client's text parser."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_tool
from daemon_fakes import (
    TARGET_APP,
    TARGET_DB,
    FakeFactory,
    frame,
    sample,
    started_daemon,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

from ccprofd.daemon.service import Daemon
from ccprofd.daemon.store import context_id, sample_context_id

Labels = tuple[tuple[str, str], ...]


@pytest.fixture
def served() -> Iterator[tuple[Daemon, FakeFactory]]:
    with started_daemon(TARGET_APP + TARGET_DB, daemon_extra="top_k = 2\n") as s:
        yield s.daemon, s.factory


def scrape(daemon: Daemon) -> dict[str, dict[Labels, float]]:
    address = daemon.metrics_address
    assert address is not None
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def ctx_series(m: dict[str, dict[Labels, float]], target: str) -> dict[tuple[str, str, str], float]:
    return {
        (d["syscall"], d["context"], d["leaf"]): v
        for labels, v in m["ccprofd_context_samples_total"].items()
        if (d := dict(labels))["target"] == target
    }


def test_hot_context_series_count_every_sample(served: tuple[Daemon, FakeFactory]) -> None:
    daemon, factory = served
    a = [frame("main", 0x10), frame("a", 0x20)]
    b = [frame("main", 0x10), frame("b", 0x30)]
    c = [frame("main", 0x10), frame("c", 0x40)]
    src = factory.sources["app"]
    src.push(*[sample(a) for _ in range(9)], *[sample(b, "openat") for _ in range(4)], sample(c))
    src.push(*[sample(b, event="cpu") for _ in range(3)], sample(c, complete=False))
    src.probe_hits, src.decode_errors, src.dropped = 123, 2, {"ringbuf_full": 5}
    wait_for(lambda: daemon.targets["app"].store.samples == 18)
    m = scrape(daemon)
    # top_k = 2: the two hottest contexts get series with their full counts, the rest is "other".
    assert ctx_series(m, "app") == {
        ("write", context_id(a), "a"): 9,
        ("openat", context_id(b), "b"): 4,
        ("write", "other", ""): 2,
        ("openat", "other", ""): 0,
    }
    cpu = {dict(k)["context"]: v for k, v in m["ccprofd_cpu_samples_total"].items()}
    assert cpu == {sample_context_id(sample(b, event="cpu")): 3, "other": 0}
    assert m["ccprofd_probe_hits_total"][(("target", "app"),)] == 123
    assert m["ccprofd_decode_errors_total"][(("target", "app"),)] == 2
    assert m["ccprofd_contexts_incomplete_total"][(("target", "app"),)] == 1
    assert m["ccprofd_samples_dropped_total"][(("reason", "ringbuf_full"), ("target", "app"))] == 5
    assert m["ccprofd_mode"][(("mode", "unwind"), ("target", "app"))] == 1
    assert m["ccprofd_mode"][(("mode", "instrumented"), ("target", "app"))] == 0
    assert m["ccprofd_mode"][(("mode", "instrumented"), ("target", "db"))] == 1
    assert m["ccprofd_attached_processes"][(("target", "app"),)] == 1
    assert m["ccprofd_bpf_map_entries"][(("map", "thread_state"),)] == 2  # summed over both targets
    assert m["ccprofd_verify_mismatches_total"][(("target", "db"),)] == 0
    assert "process_resident_memory_bytes" in m and "process_cpu_seconds_total" in m

    # More samples: series stay, stay monotonic, the cold context keeps counting under "other".
    src.push(*[sample(c) for _ in range(20)])
    wait_for(lambda: daemon.targets["app"].store.samples == 38)
    m2 = scrape(daemon)
    after = ctx_series(m2, "app")
    assert after[("write", context_id(a), "a")] == 9 and after[("openat", context_id(b), "b")] == 4
    # c became one of the top 2 since the last scrape: the 20 samples never exported move with it.
    assert after[("write", context_id(c), "c")] == 20 and after[("write", "other", "")] == 2
    assert sum(after.values()) == 35  # every syscall sample exactly once


def test_failed_target_is_down_and_says_why(served: tuple[Daemon, FakeFactory]) -> None:
    _daemon, _ = served
    with started_daemon(TARGET_APP, factory=FakeFactory(fail={"app": "cannot attach: no such binary"})) as s:
        d2 = s.daemon
        m = scrape(d2)
        assert m["ccprofd_target_up"][(("target", "app"),)] == 0
        assert d2.targets["app"].error == "cannot attach: no such binary"


def get(daemon: Daemon, path: str) -> tuple[int, str, str]:
    """Status, Content-Type and body of one GET on the metrics port (HTTP errors included)."""
    address = daemon.metrics_address
    assert address is not None
    try:
        with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def test_only_metrics_and_healthz_are_served(served: tuple[Daemon, FakeFactory]) -> None:
    """Issue 17: every path used to answer with the metrics, so a mistyped URL or a probe of a
    path the daemon does not serve looked like a working endpoint."""
    daemon, _ = served
    status, ctype, body = get(daemon, "/metrics")
    assert status == 200 and ctype.startswith("text/plain") and "ccprofd_target_up" in body
    assert get(daemon, "/healthz")[::2] == (200, "ok\n")
    for path in ("/", "/debug/pprof/heap", "/metrics/extra", "/healthzz", "/favicon.ico"):
        status, _, body = get(daemon, path)
        assert status == 404, path
        assert "ccprofd_" not in body, path
    # /healthz says the daemon is shutting down (the server is stopped just after).
    daemon.stopping = True
    try:
        status, _, body = get(daemon, "/healthz")
        assert (status, body) == (503, "stopping\n")
    finally:
        daemon.stopping = False


def scrape_text(daemon: Daemon) -> str:
    status, _, body = get(daemon, "/metrics")
    assert status == 200
    return body


def test_context_info_names_each_exported_context(served: tuple[Daemon, FakeFactory]) -> None:
    """Issue 17: ``ccprofd_context_info{target, context, stack}`` says which functions a context id
    stands for (program frames, outermost first), one series per exported context and no more."""
    daemon, factory = served
    libc = {"module": "/usr/lib/x86_64-linux-gnu/libc.so.6", "build_id": "cc", "analysed": False}
    a = [frame("main", 0x10), frame("handle_request", 0x20), frame("log_error", 0x30),
         frame("write", 0x900, **libc)]
    b = [frame("main", 0x10), frame("handle_request", 0x24), frame("qsort", 0x910, **libc),
         frame("parse;v2", 0x40)]
    c = [frame("main", 0x10), frame("cold", 0x50)]
    d = [frame("worker", 0x60), frame("flush", 0x70)]
    src = factory.sources["app"]
    src.push(*[sample(a) for _ in range(9)], *[sample(b, "openat") for _ in range(4)], sample(c))
    src.push(*[sample(b, event="cpu") for _ in range(3)], *[sample(d, event="cpu", complete=False)] * 2)
    wait_for(lambda: daemon.targets["app"].store.samples == 19)
    text = scrape_text(daemon)
    m = scrape(daemon)
    info = {(dict(k)["target"], dict(k)["context"]): (dict(k)["stack"], v)
            for k, v in m["ccprofd_context_info"].items()}
    # top_k = 2 per family: a and b (syscalls), b and d (cpu); c is only in context="other".
    assert info == {
        ("app", context_id(a)): ("main;handle_request;log_error", 1),
        ("app", context_id(b)): ("main;handle_request;parse:v2", 1),
        # CPU contexts: the innermost program frame is keyed by its function, not the sampled address
        ("app", sample_context_id(sample(b, event="cpu"))): ("main;handle_request;parse:v2", 1),
        ("app", sample_context_id(sample(d, event="cpu", complete=False))): ("[incomplete];worker;flush", 1),
    }
    # group_left join: every exported context series finds exactly one info series.
    for family in ("ccprofd_context_samples_total", "ccprofd_cpu_samples_total"):
        for labels in m[family]:
            d_ = dict(labels)
            if d_["context"] != "other":
                assert (d_["target"], d_["context"]) in info
    assert text.count("# TYPE ccprofd_context_info ") == 1
    assert sum(line.startswith("ccprofd_context_info{") for line in text.splitlines()) == 4

    promtool = require_tool("promtool")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_series_of_contexts_not_seen_are_retired() -> None:
    """Issue 17: promoted series never retired.  Over real HTTP with the store's clock injected
    (nothing sleeps): a context not seen for retire_after_seconds leaves /metrics, its info series
    with it, and the freed slot under max_series goes to another context; promtool accepts it."""
    extra = "top_k = 1\nmax_series = 1\npromotion_window_seconds = 60\nretire_after_seconds = 120\n"
    with started_daemon(TARGET_APP, daemon_extra=extra) as served_:
        daemon, factory = served_.daemon, served_.factory
        now = [1_700_000_000 * 10**9]
        store = daemon.targets["app"].store
        store.clock = lambda: now[0]
        a, b = [frame("main", 0x10), frame("a", 0x20)], [frame("main", 0x10), frame("b", 0x30)]
        src = factory.sources["app"]
        src.push(*[sample(a) for _ in range(3)])
        wait_for(lambda: store.samples == 3)
        m = scrape(daemon)
        assert ctx_series(m, "app") == {("write", context_id(a), "a"): 3, ("write", "other", ""): 0}
        now[0] += 100 * 10**9
        src.push(sample(b), sample(b))
        wait_for(lambda: store.samples == 5)
        # max_series = 1: b waits in "other" while a is exported (a last seen 100 s ago < 120 s).
        assert ctx_series(scrape(daemon), "app") == {("write", context_id(a), "a"): 3,
                                                     ("write", "other", ""): 2}
        now[0] += 21 * 10**9
        src.push(sample(b))
        wait_for(lambda: store.samples == 6)
        text = scrape_text(daemon)
        m = scrape(daemon)
        # a retired (121 s unseen): gone from the samples and the info; b exported from now on.
        assert ctx_series(m, "app") == {("write", context_id(b), "b"): 1, ("write", "other", ""): 2}
        assert {dict(k)["context"] for k in m["ccprofd_context_info"]} == {context_id(b)}
        assert m["ccprofd_series_retired_total"][(("target", "app"),)] == 1
        proc = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text,
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_metric_family_is_documented_in_the_readme() -> None:
    """Operators find metrics in the README: every family the collectors build is named there
    (counters with their exposed ``_total`` suffix)."""
    import re

    root = Path(__file__).resolve().parents[1]
    source = (root / "ccprofd" / "export" / "metrics.py").read_text()
    readme = (root / "README.md").read_text()
    families = re.findall(r'(Counter|Gauge)MetricFamily\(\s*"(ccprofd_[a-z_]+)"', source)
    assert len(families) >= 15
    exposed = [name + ("_total" if kind == "Counter" else "") for kind, name in families]
    missing = [name for name in exposed if not re.search(rf"`{name}[`{{]", readme)]
    assert missing == []
