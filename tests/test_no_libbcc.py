"""Neither the daemon (``ccprofd run``) nor the tracer (``ccprofd trace``) maps libbcc (and with it
LLVM/clang): BPF C is compiled once in a short-lived worker process and loaded with raw bpf(2).
Checked in the kernel's own record of each process's mappings, /proc/PID/maps, while its probes are
attached (both modes), and the probes are checked to work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bpf_helpers import compile_c
from daemon_fakes import wait_for
from daemon_harness import RunningDaemon, bpf_objects
from test_daemon_e2e import PROGRAM, config, prog_names

ROOT = Path(__file__).resolve().parents[1]
COMPILER_LIBS = ("libbcc", "libLLVM", "libclang")

# Writes argv[1] once running (ccprofd trace has attached before it exec'd the program), then waits
# for argv[2] to exist before its getppid() calls.
WAITER = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) long leaf(void) { return getppid(); }
int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "w");
    fputs("ready\n", f);
    fclose(f);
    while (access(argv[2], F_OK) != 0) usleep(10000);
    long s = 0;
    for (int i = 0; i < 5; i++) s += leaf();
    return s > 0 ? 0 : 1;
}
"""


def compiler_mappings(pid: int) -> list[str]:
    """Mapped files whose *name* is a compiler library's (a test directory named after this file,
    e.g. .../test_daemon_maps_no_libbcc_ins0/e2eprog -- mapped by the daemon since it reads the
    target's DWARF lines -- is not libbcc)."""
    with open(f"/proc/{pid}/maps") as fh:
        paths = {line.split()[-1] for line in fh if len(line.split()) >= 6}
    return sorted(p for p in paths if os.path.basename(p).startswith(COMPILER_LIBS))


@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_trace_process_maps_no_libbcc(bpf: None, tmp_path: Path, mode: str) -> None:
    binary = compile_c(tmp_path, "waiter", WAITER, "-O0", "-fno-omit-frame-pointer")
    ready, go = tmp_path / "ready", tmp_path / "go"
    trace = subprocess.Popen(
        [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--syscalls", "getppid", "--format",
         "jsonl", "--output", str(tmp_path / "samples.jsonl"), "--", str(binary), str(ready), str(go)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ready.exists() or trace.poll() is not None, timeout=600)
        assert trace.poll() is None, trace.communicate()[1]
        assert bpf_objects(trace.pid).all_progs, "the tracer holds no BPF programs while its target runs"
        assert compiler_mappings(trace.pid) == []
        go.touch()
        _, err = trace.communicate(timeout=600)
    finally:
        if trace.poll() is None:
            trace.kill()
            trace.wait()
    assert trace.returncode == 0, err
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines if line.startswith("{")]
    getppid = [s for s in samples if s.get("syscall") == "getppid"]
    assert len(getppid) == 5, (lines[-5:], err[-2000:])
    assert all(any(f["function"] == "leaf" for f in s["frames"]) for s in getppid)


@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_daemon_maps_no_libbcc(bpf: None, workdir: str, tmp_path: Path, mode: str) -> None:
    binary = compile_c(tmp_path, "e2eprog", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    prog = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert prog.stdout is not None and prog.stdin is not None
    assert prog.stdout.readline() == "ready\n"
    try:
        with RunningDaemon(workdir, config(workdir, binary, ["getppid"], mode)) as daemon:
            daemon.wait_tracked(prog.pid)
            objs = daemon.bpf_objects()
            # unwind mode's one-syscall set samples on its syscalls:sys_enter_getppid event (a perf
            # event, no BPF link); instrumented mode's uprobes are links
            assert objs.progs and (objs.links or "uw_sys_tp" in prog_names(objs.progs))
            assert compiler_mappings(daemon.proc.pid) == []
            # the compiled objects are cached under the daemon's state directory
            assert list((Path(workdir) / "state" / "cache" / "bpf").glob("*.json"))
            prog.stdin.write("go\n")
            prog.stdin.flush()
            assert prog.stdout.readline() == "done 1\n"
            assert compiler_mappings(daemon.proc.pid) == []
            stopped = daemon.stop()
            stopped.assert_clean()
    finally:
        prog.kill()
        prog.wait()
