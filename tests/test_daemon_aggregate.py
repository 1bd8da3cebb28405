"""The daemon's aggregate mode (unwind and instrumented targets): with no consumer of every sample,
BPF sends only records of new contexts and the daemon adds the kernel's per-context counts to its
store; a ``StreamSamples`` subscriber switches the target to a record per sample while it is
connected.  When the kernel's context table is full (instrumented: ``CCPROFD_AGG_CONTEXTS``), new
contexts are sent one sample at a time, counted as such, and the counts stay exact.

Real ``ccprofd run`` process, real BPF, real gRPC on the Unix socket and a real /metrics scrape.
The program's syscalls are known by construction (it makes exactly the getppid() calls it is told
to, from two call chains), so every count is checked against those numbers, not against our own
output: in aggregate mode (few records, exact counts), with a subscriber (every one of a round's
samples streamed, counts still exact) and across switches flipped while the program makes calls
(nothing lost or counted twice)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import compile_c
from daemon_fakes import config_text, wait_for
from daemon_harness import CONTEXT_SAMPLES, RunningDaemon, SampleStream, target_toml

from ccprofd.export.gen import ccprofd_pb2 as pb

# Commands on stdin: "a N" / "b N": N getppid() through main > run > work_a|work_b > leaf;
# "s N": N calls alternating work_a/work_b, 200 us apart (a stream of calls to flip switches in).
PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((noinline)) long leaf(void) { return getppid(); }
__attribute__((noinline)) long work_a(void) { return leaf(); }
__attribute__((noinline)) long work_b(void) { return leaf(); }
__attribute__((noinline)) void run(char what, long n) {
    for (long i = 0; i < n; i++) {
        if (what == 'a' || (what == 's' && i % 2 == 0)) work_a(); else work_b();
        if (what == 's') usleep(200);
    }
}
int main(void) {
    char line[64];
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        run(line[0], atol(line + 2));
        printf("done\n");
    }
    return 0;
}
"""


def chain(frames: Any) -> tuple[str, ...]:
    return tuple(f.function for f in frames if f.analysed)


A = ("main", "run", "work_a", "leaf")
B = ("main", "run", "work_b", "leaf")


def test_aggregate_table_full_sends_samples_alone(bpf: None, workdir: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Instrumented mode with room for one context: the first chain is counted in the kernel, every
    sample of the second is sent on its own (and counted as such: ``counts_full``), and the
    daemon's counts are exact for both."""
    monkeypatch.setenv("CCPROFD_AGG_CONTEXTS", "1")  # the daemon's environment (RunningDaemon)
    binary = compile_c(tmp_path, "aggprog", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    target = target_toml("prog", f'path = "{binary}"', ["getppid"], "instrumented")
    daemon = RunningDaemon(workdir, config_text(workdir, target, daemon_extra="top_k = 5"))
    prog: subprocess.Popen[str] | None = None

    def tracer() -> dict[str, Any]:
        daemon.check_running()
        stats = daemon.stub.GetCallGraphStats(pb.GetCallGraphStatsRequest(target="prog"), timeout=120)
        return dict(stats.binaries[0].stats["tracer"])

    def command(what: str, n: int) -> None:
        assert prog is not None and prog.stdin is not None and prog.stdout is not None
        prog.stdin.write(f"{what} {n}\n")
        prog.stdin.flush()
        assert prog.stdout.readline() == "done\n"

    def hot() -> dict[tuple[str, ...], int]:
        resp = daemon.stub.GetHotContexts(pb.GetHotContextsRequest(target="prog", top_k=10), timeout=5)
        assert all(h.complete and h.syscall == "getppid" for h in resp.contexts), resp
        return {chain(h.frames): int(h.count) for h in resp.contexts}

    try:
        daemon.wait_attached()
        prog = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert prog.stdout is not None and prog.stdout.readline() == "ready\n"
        wait_for(lambda: not tracer()["per_sample_records"], timeout=60)
        records0 = int(tracer()["records"])
        command("a", 2000)  # the first context: takes the table's one entry
        command("b", 500)
        wait_for(lambda: sum(hot().values()) >= 2500, timeout=60)
        assert hot() == {A: 2000, B: 500}
        t = tracer()
        assert int(t["bpf"]["counts_full"]) == 500, t["bpf"]
        assert int(t["bpf"]["agg_new"]) == 1, t["bpf"]
        assert 500 <= int(t["records"]) - records0 <= 504, t
        daemon.stop().assert_clean()
    finally:
        daemon.kill()
        if prog is not None:
            if prog.stdin is not None:
                prog.stdin.close()
            prog.wait(timeout=30)


@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_aggregate_mode_counts_and_switch(bpf: None, workdir: str, tmp_path: Path, mode: str) -> None:
    binary = compile_c(tmp_path, "aggprog", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    target = target_toml("prog", f'path = "{binary}"', ["getppid"], mode)
    daemon = RunningDaemon(workdir, config_text(workdir, target, daemon_extra="top_k = 5"))
    prog: subprocess.Popen[str] | None = None
    stub = daemon.stub
    made = {A: 0, B: 0}

    def tracer() -> dict[str, Any]:
        daemon.check_running()
        stats = stub.GetCallGraphStats(pb.GetCallGraphStatsRequest(target="prog"), timeout=120)
        return dict(stats.binaries[0].stats["tracer"])

    def per_sample(on: bool) -> bool:
        return bool(tracer()["per_sample_records"]) == on

    def command(what: str, n: int) -> None:
        assert prog is not None and prog.stdin is not None and prog.stdout is not None
        prog.stdin.write(f"{what} {n}\n")
        prog.stdin.flush()
        assert prog.stdout.readline() == "done\n"
        made[A] += n if what == "a" else (n + 1) // 2 if what == "s" else 0
        made[B] += n if what == "b" else n // 2 if what == "s" else 0

    def hot() -> dict[tuple[str, ...], int]:
        resp = stub.GetHotContexts(pb.GetHotContextsRequest(target="prog", top_k=10), timeout=5)
        assert all(h.complete and h.syscall == "getppid" for h in resp.contexts), resp
        return {chain(h.frames): int(h.count) for h in resp.contexts}

    def counts_reach_made() -> bool:
        got = hot()
        return sum(got.values()) >= sum(made.values())

    try:
        daemon.wait_attached()
        # started after the daemon: followed from its exec, every sample complete
        prog = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert prog.stdout is not None and prog.stdout.readline() == "ready\n"

        # 1. no consumer of every sample: aggregate mode -- a handful of records, exact counts
        wait_for(lambda: per_sample(False), timeout=60)
        records0 = int(tracer()["records"])
        command("a", 3000)
        command("b", 1000)
        wait_for(counts_reach_made, timeout=60)
        assert hot() == {A: 3000, B: 1000}
        # one record per new context (the two chains; the loader/libc start-up made no getppid)
        assert int(tracer()["records"]) - records0 <= 4, tracer()

        # 2. a subscriber: a record per sample while it is connected; the store still counts once
        # (StreamSamples, one message per sample, here; the other streams of the tests are batched)
        stream = SampleStream(stub, "prog", batched=False)
        wait_for(lambda: per_sample(True), timeout=60)
        records1 = int(tracer()["records"])
        command("a", 700)
        command("b", 300)
        wait_for(lambda: sum(1 for s in stream.samples if s.pid == prog.pid) >= 1000, timeout=60)
        wait_for(counts_reach_made, timeout=60)
        assert hot() == {A: 3700, B: 1300}
        got = [chain(s.frames) for s in stream.samples if s.pid == prog.pid]
        assert sorted(got) == sorted([A] * 700 + [B] * 300)
        assert int(tracer()["records"]) - records1 >= 1000
        stream.close()
        wait_for(lambda: per_sample(False), timeout=60)

        # 3. switches flipped back and forth while the program makes calls: nothing lost or
        # counted twice across them
        worker = threading.Thread(target=command, args=("s", 20000))
        worker.start()
        flips = 0
        while worker.is_alive() and flips < 6:
            stream = SampleStream(stub, "prog")
            wait_for(lambda: per_sample(True), timeout=60)
            time.sleep(0.3)
            stream.close()
            wait_for(lambda: per_sample(False), timeout=60)
            flips += 1
        worker.join(timeout=300)
        assert flips >= 2, "the calls ended before the switch was flipped twice"
        wait_for(counts_reach_made, timeout=60)
        time.sleep(1)  # a late duplicate would show up by now
        assert hot() == made == {A: 3700 + 10000, B: 1300 + 10000}

        # Prometheus: the two series carry the same counts, nothing under "other"
        series = [value for labels, value in daemon.metric_samples(CONTEXT_SAMPLES)
                  if labels.get("target") == "prog"]
        assert sorted(value for value in series if value) == sorted(made.values())
        bpf_stats = tracer()["bpf"]
        assert int(bpf_stats["ringbuf_full"]) == 0
        # unwind keys on a hash and compares the stored context; instrumented keys on the state itself
        assert int(bpf_stats["collisions" if mode == "unwind" else "counts_full"]) == 0
        daemon.stop().assert_clean()
    finally:
        daemon.kill()
        if prog is not None:
            if prog.stdin is not None:
                prog.stdin.close()
            prog.wait(timeout=30)
