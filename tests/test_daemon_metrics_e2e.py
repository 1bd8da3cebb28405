"""Issue 17, Prometheus series as a real daemon exports them: the real ``ccprofd run`` (real BPF,
both tracer modes) follows a program that burns CPU in one function and writes through libc;
``/metrics`` scraped over HTTP must carry one CPU series per function chain (not one per sampled
instruction), the program's function as ``leaf`` (not libc's ``write``), and pass
``promtool check metrics``."""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest
from bpf_helpers import compile_c
from conftest import require_tool
from daemon_fakes import config_text, wait_for
from daemon_harness import CONTEXT_SAMPLES, RunningDaemon, target_toml
from prometheus_client.parser import text_string_to_metric_families

N_WRITES = 23

# Waits for a line on stdin (the daemon has attached), burns CPU in burn() (a loop of several
# instructions, so CPU samples land on many addresses of it), makes N_WRITES write()s from emit()
# through libc's wrapper, reports "done" (two more writes, from main), waits for EOF.
PROGRAM = r"""
#include <stdio.h>
#include <unistd.h>
volatile unsigned long sink;
__attribute__((noinline)) void burn(unsigned long n) {
    for (unsigned long i = 0; i < n; i++) sink += i * i ^ (i >> 3);
}
__attribute__((noinline)) void emit(void) { write(2, "", 0); }
int main(void) {
    char line[64];
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    burn(400000000UL);
    for (int i = 0; i < N_WRITES; i++) emit();
    printf("done\n");
    while (fgets(line, sizeof line, stdin)) {}
    return 0;
}
""".replace("N_WRITES", str(N_WRITES))


@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_cpu_series_per_function_and_program_leaf(bpf: None, workdir: str, tmp_path: Path, mode: str) -> None:
    check_scrape(scrape_daemon(workdir, tmp_path, mode), mode)


def scrape_daemon(workdir: str, tmp_path: Path, mode: str, prefix: Sequence[str] = (),
                  env: dict[str, str] | None = None) -> str:
    """One /metrics text of a real daemon (started with ``prefix``) that followed PROGRAM."""
    binary = compile_c(tmp_path, "cpuprog", PROGRAM, "-O1", "-fno-omit-frame-pointer")
    target = target_toml("prog", f'path = "{binary}"', ["write"], mode, "perf_sample_hz = 499\n")
    prog = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert prog.stdout is not None and prog.stdin is not None
    assert prog.stdout.readline() == "ready\n"
    try:
        with RunningDaemon(workdir, config_text(workdir, target, daemon_extra="top_k = 50"), prefix=prefix,
                           env=env) as daemon:
            daemon.wait_tracked(prog.pid)
            prog.stdin.write("go\n")
            prog.stdin.flush()
            assert prog.stdout.readline() == "done\n"

            def written() -> bool:
                return sum(v for lb, v in daemon.metric_samples(CONTEXT_SAMPLES)
                           if lb["target"] == "prog" and lb["syscall"] == "write") >= N_WRITES + 2

            wait_for(written, timeout=60)
            with urllib.request.urlopen(daemon.metrics_url(), timeout=30) as resp:
                text = resp.read().decode()
            daemon.stop().assert_clean()
    finally:
        prog.kill()
        prog.wait()
    return text


def check_scrape(text: str, mode: str) -> None:
    """The series of PROGRAM's run, checked against what it did."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    stack = {lb["context"]: lb["stack"] for lb, _ in samples["ccprofd_context_info"]}
    # write: the program's emit() called libc's write N_WRITES times: one series, leaf emit.
    writes = [(lb["leaf"], stack.get(lb["context"], ""), v) for lb, v in samples[CONTEXT_SAMPLES]
              if lb["syscall"] == "write" and lb["context"] != "other"]
    # main's unbuffered printf of "done\n" makes two more writes ("done", "\n": strace shows them),
    # under leaf main: libc's frames are never the leaf.
    assert sorted((leaf, v) for leaf, st, v in writes) == [("emit", N_WRITES), ("main", 2)], writes
    assert all(st.endswith(f"main;{leaf}") or st == leaf for leaf, st, _ in writes), writes
    # CPU: the samples in burn() (hundreds, at many instructions) make one series.
    cpu = [(lb["leaf"], stack[lb["context"]], v) for lb, v in samples["ccprofd_cpu_samples_total"]
           if lb["context"] != "other"]
    in_burn = [row for row in cpu if row[1].endswith("main;burn")]
    assert len(in_burn) == 1 and in_burn[0][0] == "burn" and in_burn[0][2] >= 20, cpu
    assert len({(leaf, st) for leaf, st, _ in cpu}) == len(cpu) or mode == "instrumented", cpu
    proc = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
