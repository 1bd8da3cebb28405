"""Issue 15 item 7, with real BPF and the real tracer source: an instrumented target's probe hits
are counted (``ccprofd_probe_hits_total``), ``max_probe_hits_per_sec`` is enforced from them (the
target switches to unwind mode, with the reason in ``ccprofd_mode_switches_total``), and
``ccprofd_bpf_map_entries`` reports the daemon's BPF hash maps (checked against bpftool)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bpf_helpers import compile_c
from conftest import require_tool
from daemon_fakes import started_daemon, wait_for
from daemon_harness import target_toml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ccprofd.daemon.service import Daemon
from ccprofd.daemon.tracer_source import TracerSource, make_source
from ccprofd.export.metrics import build_registry

CALLS = 3000

# Waits for a line on stdin (so the daemon has attached), then calls leaf() CALLS times; each call
# reaches a syscall, so each is a probe event of instrumented mode (a call site hit at least).
PROGRAM = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) long leaf(void) { return getppid(); }
int main(void) {
    char line[64];
    long s = 0;
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (int i = 0; i < CALLS; i++) s += leaf();
    printf("done %ld\n", s > 0);
    while (fgets(line, sizeof line, stdin)) {}
    return 0;
}
""".replace("CALLS", str(CALLS))


def metrics(daemon: Daemon) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = generate_latest(build_registry(daemon)).decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def bpftool_entries(map_id: int) -> int:
    out = subprocess.run([require_tool("bpftool"), "-j", "map", "dump", "id", str(map_id)],
                         capture_output=True, text=True, check=True).stdout
    return len(json.loads(out or "[]"))


def test_probe_hits_counted_and_budget_enforced(bpf: None, workdir: str, tmp_path: Path) -> None:
    binary = compile_c(tmp_path, "budget", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    prog = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert prog.stdout is not None and prog.stdin is not None
    assert prog.stdout.readline() == "ready\n"
    target = target_toml("prog", f'path = "{binary}"', ["getppid"], "instrumented",
                         "max_probe_hits_per_sec = 100\n")
    try:
        with started_daemon(target, workdir=workdir, factory=make_source, servers=False) as served:
            daemon = served.daemon
            rt = daemon.targets["prog"]
            assert rt.state == "attached", rt.error
            source = rt.source
            assert isinstance(source, TracerSource)
            wait_for(lambda: prog.pid in source.tracked, timeout=60)
            daemon.check_budgets(now=100.0)  # the rate's starting point: nothing over budget yet
            assert rt.mode() == "instrumented"
            # the syscall sampler's map of tracked threads, as the kernel lists it
            (binary_state,) = source.binaries_by_inode.values()
            tracked_id = binary_state.mode._bpf.module.map("tracked").id  # type: ignore[attr-defined]
            m = metrics(daemon)
            assert m["ccprofd_bpf_map_entries"][(("map", "tracked"),)] == bpftool_entries(tracked_id) >= 1
            prog.stdin.write("go\n")
            prog.stdin.flush()
            assert prog.stdout.readline() == "done 1\n"
            wait_for(lambda: rt.store.samples >= CALLS, timeout=120)
            hits = rt.counters().probe_hits
            assert hits >= CALLS, hits  # every call of leaf() was a probe event
            assert metrics(daemon)["ccprofd_probe_hits_total"][(("target", "prog"),)] == hits
            # CALLS hits within one (stated) second exceed 100/s: the target switches to unwind mode
            daemon.check_budgets(now=101.0)
            assert rt.state == "attached" and rt.mode() == "unwind", rt.error
            assert rt.error.startswith("switched to unwind mode: ") and rt.error.endswith(
                " probe hits/s exceeded max_probe_hits_per_sec = 100"), rt.error
            assert rt.mode_switches == {"probe_hit_budget": 1}
            m = metrics(daemon)
            assert m["ccprofd_mode_switches_total"][(("reason", "probe_hit_budget"), ("target", "prog"))] == 1
            assert m["ccprofd_mode"][(("mode", "unwind"), ("target", "prog"))] == 1
            assert m["ccprofd_probe_hits_total"][(("target", "prog"),)] >= hits  # carried: monotonic
            assert any(name.startswith("uw_") for _, name in {k[0] for k in m["ccprofd_bpf_map_entries"]})
    finally:
        prog.stdin.close()
        prog.wait(timeout=60)
