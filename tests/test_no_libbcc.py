"""Neither the daemon (``ccprofd run``) nor the tracer (``ccprofd trace``) maps libbcc (and with it
LLVM/clang): BPF C is compiled once in a short-lived worker process and loaded with raw bpf(2).
Checked in the kernel's own record of each process's mappings, /proc/PID/maps, while its probes are
attached (both modes), and the probes are checked to work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from bpf_helpers import compile_c
from daemon_fakes import short_tmpdir, wait_for
from test_daemon_e2e import PROGRAM, daemon_bpf_objects, write_config

from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.export.gen import ccprofd_pb2_grpc as pb_grpc

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
    with open(f"/proc/{pid}/maps") as fh:
        return sorted({line.split()[-1] for line in fh if any(lib in line for lib in COMPILER_LIBS)})


@pytest.fixture
def workdir() -> Iterator[str]:
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


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
        links, progs = daemon_bpf_objects(trace.pid)
        assert progs, "the tracer holds no BPF programs while its target runs"
        assert compiler_mappings(trace.pid) == []
        go.touch()
        out, err = trace.communicate(timeout=600)
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


def test_daemon_maps_no_libbcc(bpf: None, workdir: str, tmp_path: Path) -> None:
    binary = compile_c(tmp_path, "e2eprog", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    prog = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert prog.stdout is not None and prog.stdin is not None
    assert prog.stdout.readline() == "ready\n"
    config = Path(workdir) / "ccprofd.toml"
    write_config(config, workdir, binary, '["getppid"]', "unwind")
    daemon = subprocess.Popen([sys.executable, "-m", "ccprofd.cli", "run", "--config", str(config)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stub = pb_grpc.ProfilerStub(grpc.insecure_channel(f"unix:{workdir}/ccprofd.sock"))

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
        assert progs and any("raw_tracepoint" in kind for kind in links.values()), links
        assert compiler_mappings(daemon.pid) == []
        # the compiled objects were cached under the daemon's state directory
        assert list((Path(workdir) / "state" / "cache" / "bpf").glob("*.json"))
        prog.stdin.write("go\n")
        prog.stdin.flush()
        assert prog.stdout.readline() == "done 1\n"
        assert compiler_mappings(daemon.pid) == []
    finally:
        prog.kill()
        prog.wait()
        daemon.terminate()
        try:
            daemon.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.communicate()
