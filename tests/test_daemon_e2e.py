"""End to end with real BPF, in each tracer mode (unwind, the default, and instrumented): the real
``ccprofd run`` process (the tracer through :mod:`ccprofd.daemon.tracer_source`) on a config naming a
test program, the program running, every RPC through a real gRPC channel on the Unix socket,
``/metrics`` over HTTP with the hot-context counts checked against the syscalls the program made,
SIGHUP with a changed config, SIGTERM, and no BPF link or program of the daemon left afterwards
(its link and program ids, read from its own fds while it ran, absent from ``bpftool``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from bpf_helpers import compile_c
from conftest import require_tool
from daemon_fakes import short_tmpdir, wait_for
from prometheus_client.parser import text_string_to_metric_families

from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.export.gen import ccprofd_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
N_A, N_B = 37, 11

# Waits for a line on stdin (so the daemon has attached), then makes N_A getppid() from
# main > work_a > leaf and N_B from main > work_b > leaf, reports "done", waits for EOF.
PROGRAM = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) long leaf(void) { return getppid(); }
__attribute__((noinline)) long work_a(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += leaf();
    return s;
}
__attribute__((noinline)) long work_b(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += leaf();
    return s;
}
int main(int argc, char **argv) {
    char line[64];
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    long s = work_a(N_A) + work_b(N_B);
    printf("done %ld\n", s > 0);
    while (fgets(line, sizeof line, stdin)) {}
    return 0;
}
""".replace("N_A", str(N_A)).replace("N_B", str(N_B))


BPF_LINK_TYPE_UPROBE_MULTI = 12  # include/uapi/linux/bpf.h; older bpftool prints the number


def uprobe_links() -> set[int]:
    """Ids of the uprobe links that exist now, as bpftool lists them (via the BPF syscall)."""
    bpftool = require_tool("bpftool")
    out = subprocess.run([bpftool, "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {
        link["id"]
        for link in json.loads(out or "[]")
        if "uprobe" in str(link.get("type", "")) or link.get("type") == BPF_LINK_TYPE_UPROBE_MULTI
    }


def daemon_bpf_objects(pid: int) -> tuple[dict[int, str], set[int]]:
    """(link id -> link type, program ids) of the BPF links and programs ``pid`` holds fds of
    (``/proc/PID/fdinfo``: the kernel's own record, whatever library made them)."""
    links: dict[int, str] = {}
    progs: set[int] = set()
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as fh:
                info = dict(line.split(":", 1) for line in fh.read().splitlines() if ":" in line)
        except OSError:
            continue
        info = {k.strip(): v.strip() for k, v in info.items()}
        if "link_id" in info:
            links[int(info["link_id"])] = info.get("link_type", "?")
        if "prog_id" in info and "link_id" not in info:
            progs.add(int(info["prog_id"]))
    return links, progs


def bpftool_ids(kind: str) -> set[int]:
    bpftool = require_tool("bpftool")
    out = subprocess.run([bpftool, "-j", kind, "show"], capture_output=True, text=True, check=True).stdout
    return {int(obj["id"]) for obj in json.loads(out or "[]")}


@pytest.fixture
def workdir() -> Iterator[str]:
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def write_config(path: Path, workdir: str, binary: Path, syscalls: str, mode: str) -> None:
    path.write_text(f"""
[daemon]
state_dir = "{workdir}/state"
grpc_listen = "unix://{workdir}/ccprofd.sock"
metrics_listen = "127.0.0.1:0"
top_k = 5

[[target]]
name = "prog"
path = "{binary}"
syscalls = {syscalls}
mode = "{mode}"
""")


@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_daemon_end_to_end(bpf: None, workdir: str, tmp_path: Path, mode: str) -> None:
    binary = compile_c(tmp_path, "e2eprog", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    prog = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert prog.stdout is not None and prog.stdin is not None
    assert prog.stdout.readline() == "ready\n"
    config = Path(workdir) / "ccprofd.toml"
    write_config(config, workdir, binary, '["getppid"]', mode)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "ccprofd.cli", "run", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sock = f"{workdir}/ccprofd.sock"
    try:
        channel = grpc.insecure_channel(f"unix:{sock}")
        stub = pb_grpc.ProfilerStub(channel)

        def tracked() -> bool:
            if daemon.poll() is not None:
                raise AssertionError(f"daemon exited: {daemon.communicate()[1]}")
            try:
                resp = stub.ListTargets(pb.ListTargetsRequest(), timeout=5)
            except grpc.RpcError:
                return False
            return any(p.pid == prog.pid for t in resp.targets for p in t.processes)

        wait_for(tracked, timeout=300)
        links, progs = daemon_bpf_objects(daemon.pid)
        # instrumented mode: uprobe_multi links on the program; unwind mode: the unwinder at
        # raw_syscalls:sys_enter (ids of the daemon's own links: other processes' come and go)
        want = "uprobe" if mode == "instrumented" else "raw_tracepoint"
        assert any(want in kind for kind in links.values()), links
        assert progs
        if mode == "instrumented":
            assert uprobe_links() & set(links), "bpftool lists none of the daemon's links as uprobe links"
        prog.stdin.write("go\n")
        prog.stdin.flush()
        assert prog.stdout.readline() == "done 1\n"

        def counted() -> int:
            resp = stub.GetHotContexts(pb.GetHotContextsRequest(target="prog", top_k=10), timeout=5)
            return int(resp.total_samples) if resp.total_samples >= N_A + N_B else 0

        wait_for(counted, timeout=60)
        hot = stub.GetHotContexts(pb.GetHotContextsRequest(target="prog", top_k=10), timeout=5)
        # The program made exactly N_A getppid() through work_a and N_B through work_b: two contexts
        # (the process was running at attach, so the tracer may flag them incomplete and report only
        # the suffix it knows — but never merge or split them).
        rows = [(h.count, h.leaf, h.syscall, h.context) for h in hot.contexts]
        # unwind mode also reports the frames inward of the program's: libc's getppid is the leaf
        leaf = "getppid" if mode == "unwind" else "leaf"
        assert sorted((c, lf, sc) for c, lf, sc, _ in rows) == [
            (N_B, leaf, "getppid"),
            (N_A, leaf, "getppid"),
        ], hot
        chains = {h.count: [f.function for f in h.frames if f.analysed] for h in hot.contexts}
        if mode == "unwind":  # a whole stack unwound at each sample: complete although attached late
            assert chains == {N_A: ["main", "work_a", "leaf"], N_B: ["main", "work_b", "leaf"]}, hot
            assert all(h.complete and h.frames[-1].module.endswith("libc.so.6") for h in hot.contexts)
        else:
            assert all(chain[-1:] == ["leaf"] for chain in chains.values()), hot
        assert hot.total_samples == N_A + N_B
        counts = {ctx: c for c, _, _, ctx in rows}

        targets = stub.ListTargets(pb.ListTargetsRequest(), timeout=5)
        (t,) = targets.targets
        assert t.state == "attached" and t.binaries[0].build_id and t.processes[0].pid == prog.pid
        stats = stub.GetCallGraphStats(pb.GetCallGraphStatsRequest(target="prog"), timeout=120)
        assert stats.binaries[0].stats["functions"] >= 4
        # the program waits in fgets (read) under main: its one thread's context, taken now
        (thread,) = stub.GetThreadContexts(pb.GetThreadContextsRequest(pid=prog.pid), timeout=60).threads
        assert thread.tid == prog.pid and thread.complete
        assert [f.function for f in thread.frames if f.analysed] == ["main"]
        assert thread.frames[-1].module.endswith("libc.so.6") and thread.frames[0].function == "main"

        # Prometheus: the hot-context series of work_a/work_b carry the same counts.
        metrics = scrape_metrics(daemon)
        series = {labels["context"]: value for labels, value in metrics if labels.get("target") == "prog"}
        assert {ctx: series[ctx] for ctx in counts} == counts
        assert sum(series.values()) == N_A + N_B

        # SIGHUP with a changed config (another syscall set): re-attached, still serving.
        write_config(config, workdir, binary, '["getppid", "write"]', mode)
        daemon.send_signal(signal.SIGHUP)

        def reloaded() -> bool:
            resp = stub.ListTargets(pb.ListTargetsRequest(), timeout=5)
            return any(
                list(t.syscalls) == ["getppid", "write"] and t.state == "attached" for t in resp.targets
            )

        wait_for(reloaded, timeout=300)
        wait_for(tracked, timeout=300)
        reloaded_links, reloaded_progs = daemon_bpf_objects(daemon.pid)
        links.update(reloaded_links)
        progs |= reloaded_progs

        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=120)
        assert daemon.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        prog.stdin.close()
        prog.wait(timeout=30)
    assert not set(links) & bpftool_ids("link"), "links of the daemon left after SIGTERM"
    assert not progs & bpftool_ids("prog"), "programs of the daemon left loaded after SIGTERM"
    assert not os.path.exists(sock)


def scrape_metrics(daemon: subprocess.Popen[str]) -> list[tuple[dict[str, str], float]]:
    """Scrape /metrics; the port was chosen by the kernel (metrics_listen port 0), found via /proc."""
    port = _listening_port(daemon.pid)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = []
    for family in text_string_to_metric_families(text):
        if family.name == "ccprofd_context_samples":
            out.extend((dict(s.labels), s.value) for s in family.samples if s.name.endswith("_total"))
    return out


def _listening_port(pid: int) -> int:
    """The TCP port ``pid`` listens on (from /proc/net/tcp and its socket inodes)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # LISTEN
                return int(parts[1].split(":")[1], 16)
    raise AssertionError("the daemon listens on no TCP port")
