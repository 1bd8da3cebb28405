"""perf still sees the tracepoint events ccprofd attaches to, while ccprofd runs.

The kernel records a tracepoint's event for its perf listeners only when every BPF program
attached to that tracepoint returns non-zero (``perf_trace_run_bpf_submit``).  ccprofd's
tracepoint programs returned 0, so while ``ccprofd trace`` or the daemon was attached, ``perf stat``
and ``perf record -e syscalls:sys_enter_<name>`` (or ``sched:sched_process_exec``, ...) counted
nothing of those events, on every process of the host: measured here, ``perf stat -e
syscalls:sys_enter_getppid`` of a program making 1,000 getppid counted 0 while another program was
traced with ``--syscalls getppid``.  Each case counts the same command under ``perf stat`` once
with nothing attached and once while ccprofd traces another program: the counts must be equal.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from bpf_helpers import compile_c
from conftest import require_bpf, require_tool
from daemon_fakes import wait_for

REPO = pathlib.Path(__file__).resolve().parent.parent

# Writes argv[1] once running (ccprofd attaches before a launched program's first instruction),
# makes a getppid every 10 ms until argv[2] exists.
WAITER_C = r"""
#include <stdio.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "w");
    fclose(f);
    struct timespec ts = {0, 10 * 1000 * 1000};
    while (access(argv[2], F_OK) != 0) {
        getppid();
        nanosleep(&ts, NULL);
    }
    return 0;
}
"""

# The command perf counts: a fork (the shell's), an exec, 1,000 getppid and their returns, exits.
COUNTED_C = r"""
#include <unistd.h>
int main(void) {
    for (int i = 0; i < 1000; i++)
        getppid();
    return 0;
}
"""

EVENTS = ["syscalls:sys_enter_getppid", "syscalls:sys_exit_getppid", "sched:sched_process_fork",
          "sched:sched_process_exec", "sched:sched_process_exit"]


def _perf_counts(perf: str, counted: pathlib.Path) -> dict[str, int]:
    argv = [perf, "stat", "-x", ",", "-e", ",".join(EVENTS), "--", "sh", "-c", f"{counted}; true"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    counts: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in EVENTS:
            counts[fields[2]] = int(fields[0]) if fields[0].isdigit() else -1
    assert set(counts) == set(EVENTS), proc.stderr
    return counts


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_perf_counts_the_events_ccprofd_is_attached_to(mode: str, tmp_path: pathlib.Path) -> None:
    require_bpf()
    perf = require_tool("perf")
    waiter = compile_c(tmp_path, "waiter", WAITER_C, "-O1")
    counted = compile_c(tmp_path, "counted", COUNTED_C, "-O1")
    before = _perf_counts(perf, counted)
    assert before["syscalls:sys_enter_getppid"] >= 1000 and before["sched:sched_process_exec"] >= 1, before

    ready, stop, out = tmp_path / "ready", tmp_path / "stop", tmp_path / "samples.jsonl"
    # getppid on its per-syscall events, with their exit events (--retval), and the sched events
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--syscalls", "getppid", "--retval",
            "--format", "jsonl", "--output", str(out), "--", str(waiter), str(ready), str(stop)]
    trace = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ready.exists() or trace.poll() is not None, timeout=300, what="the traced program")
        assert trace.poll() is None, trace.communicate()[1]
        during = _perf_counts(perf, counted)
    finally:
        stop.touch()
        _, err = trace.communicate(timeout=300)
    assert trace.returncode == 0, err
    assert during == before
    assert '"syscall":"getppid"' in out.read_text().replace(" ", "")  # and ccprofd sampled meanwhile
