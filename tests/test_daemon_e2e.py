"""End to end with real BPF, in each tracer mode (unwind, the default, and instrumented): the real
``ccprofd run`` process (the tracer through :mod:`ccprofd.daemon.tracer_source`) on a config naming a
test program, the program running, every RPC through a real gRPC channel on the Unix socket,
``/metrics`` over HTTP with the hot-context counts checked against the syscalls the program made,
SIGHUP with a changed config, SIGTERM, and no BPF link or program of the daemon left afterwards
(its link and program ids, read from its own fds while it ran, absent from ``bpftool``)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from bpf_helpers import compile_c
from conftest import require_tool
from daemon_fakes import config_text, wait_for
from daemon_harness import CONTEXT_SAMPLES, RunningDaemon, target_toml

from ccprofd.export.gen import ccprofd_pb2 as pb

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


def prog_names(ids: set[int]) -> set[str]:
    """Names of the BPF programs with these ids, as bpftool lists them."""
    out = subprocess.run([require_tool("bpftool"), "-j", "prog", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {p.get("name", "") for p in json.loads(out or "[]") if p["id"] in ids}


def config(workdir: str, binary: Path, syscalls: list[str], mode: str) -> str:
    target = target_toml("prog", f'path = "{binary}"', syscalls, mode)
    return config_text(workdir, target, daemon_extra="top_k = 5")


@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_daemon_end_to_end(bpf: None, workdir: str, tmp_path: Path, mode: str) -> None:
    binary = compile_c(tmp_path, "e2eprog", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    prog = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert prog.stdout is not None and prog.stdin is not None
    assert prog.stdout.readline() == "ready\n"
    try:
        with RunningDaemon(workdir, config(workdir, binary, ["getppid"], mode)) as daemon:
            stub = daemon.stub
            daemon.wait_tracked(prog.pid)
            objs = daemon.bpf_objects()
            # instrumented mode: uprobe_multi links on the program (ids of the daemon's own links:
            # other processes' come and go); unwind mode: the unwinder on getppid's own
            # syscalls:sys_enter_getppid event (a one-syscall set: a perf event, no link), not on
            # raw_syscalls:sys_enter (a raw tracepoint link)
            assert objs.progs
            if mode == "instrumented":
                assert any("uprobe" in kind for kind in objs.links.values()), objs.links
            else:
                assert not any("raw_tracepoint" in kind for kind in objs.links.values()), objs.links
                assert "uw_sys_tp" in prog_names(objs.progs)
            if mode == "instrumented":
                assert uprobe_links() & set(objs.links), "bpftool lists none of the daemon's links as uprobes"
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
            # `leaf` is the program's innermost function in both modes (unwind mode also reports
            # libc's getppid below it, in the frames: not in the leaf or the context id)
            assert sorted((c, lf, sc) for c, lf, sc, _ in rows) == [
                (N_B, "leaf", "getppid"),
                (N_A, "leaf", "getppid"),
            ], hot
            chains = {h.count: [f.function for f in h.frames if f.analysed] for h in hot.contexts}
            if mode == "unwind":  # a whole stack unwound at each sample: complete although attached late
                assert chains == {N_A: ["main", "work_a", "leaf"], N_B: ["main", "work_b", "leaf"]}, hot
                assert all(h.complete and h.frames[-1].module.endswith("libc.so.6") for h in hot.contexts)
                assert all(h.frames[-1].function == "getppid" and not h.frames[-1].analysed
                           for h in hot.contexts)
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
            series = {labels["context"]: value for labels, value in daemon.metric_samples(CONTEXT_SAMPLES)
                      if labels.get("target") == "prog"}
            assert {ctx: series[ctx] for ctx in counts} == counts
            assert sum(series.values()) == N_A + N_B

            # SIGHUP with a changed config (another syscall set): re-attached, still serving.
            daemon.write_config(config(workdir, binary, ["getppid", "write"], mode))
            daemon.proc.send_signal(signal.SIGHUP)

            def reloaded() -> bool:
                resp = stub.ListTargets(pb.ListTargetsRequest(), timeout=5)
                return any(
                    list(t.syscalls) == ["getppid", "write"] and t.state == "attached" for t in resp.targets
                )

            wait_for(reloaded, timeout=300)
            daemon.wait_tracked(prog.pid)
            daemon.bpf_objects()  # the links and programs of the reload, checked at stop too
            # SIGTERM: exit 0, no link or program the daemon ever held left, its socket removed
            daemon.stop().assert_clean()
    finally:
        prog.stdin.close()
        prog.wait(timeout=30)
