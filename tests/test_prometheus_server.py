"""A real Prometheus server (Debian's ``prometheus``) scrapes the daemon's /metrics and answers the
queries an operator writes: the hot-context series joined with ``ccprofd_context_info`` through
``group_left`` to get each context's stack, and a rate over the counters.  Issue 17 asked for the
real clients; promtool only checks the text, this checks that a server ingests and joins it."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require_tool
from daemon_fakes import (
    TARGET_APP,
    FakeFactory,
    frame,
    sample,
    started_daemon,
    wait_for,
)
from ports import free_port

from ccprofd.daemon.service import Daemon
from ccprofd.daemon.store import context_id


@pytest.fixture
def daemon() -> Iterator[tuple[Daemon, FakeFactory]]:
    with started_daemon(TARGET_APP, daemon_extra="top_k = 2\n") as s:
        yield s.daemon, s.factory


@pytest.fixture
def prometheus(daemon: tuple[Daemon, FakeFactory], tmp_path: Path) -> Iterator[str]:
    binary = require_tool("prometheus")
    address = daemon[0].metrics_address
    assert address is not None
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                   "scrape_configs:\n  - job_name: ccprofd\n    static_configs:\n"
                   f"      - targets: ['{address[0]}:{address[1]}']\n")
    proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(server: str, promql: str) -> list[dict[str, Any]]:
    url = f"{server}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
    except OSError:
        return []  # not up yet
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_a_prometheus_server_scrapes_and_joins_contexts_with_their_stacks(
        daemon: tuple[Daemon, FakeFactory], prometheus: str) -> None:
    d, factory = daemon
    a = [frame("main", 0x10), frame("handle_request", 0x20), frame("log_error", 0x30)]
    b = [frame("main", 0x10), frame("flush", 0x40)]
    factory.sources["app"].push(*[sample(a) for _ in range(7)], *[sample(b, "openat") for _ in range(3)])
    wait_for(lambda: d.targets["app"].store.samples == 10)
    # the scrape target is healthy (Prometheus parsed the exposition)
    up = wait_for(lambda: query(prometheus, 'up{job="ccprofd"} == 1'), timeout=120)
    assert len(up) == 1
    joined = 'ccprofd_context_samples_total * on(target, context) group_left(stack) ccprofd_context_info'
    rows = wait_for(lambda: [r for r in query(prometheus, joined)], timeout=120)
    got = {(r["metric"]["syscall"], r["metric"]["context"], r["metric"]["stack"]): float(r["value"][1])
           for r in rows}
    assert got == {("write", context_id(a), "main;handle_request;log_error"): 7.0,
                   ("openat", context_id(b), "main;flush"): 3.0}
    # a per-stack sum across syscalls, as a dashboard would chart it
    per_stack = query(prometheus, f'sum by (stack) ({joined})')
    assert {r["metric"]["stack"]: float(r["value"][1]) for r in per_stack} == {
        "main;handle_request;log_error": 7.0, "main;flush": 3.0}
