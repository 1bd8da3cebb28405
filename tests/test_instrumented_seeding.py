"""``ccprofd trace --mode instrumented -p PID``: threads already deep in recursion at attach are seeded
by one unwind (ccprofd/tracing/instrumented/seed.py), so their samples are complete from then on.

The program (tests/programs/seeding.c) parks every thread in ``read`` at the bottom of a mutual
recursion; ccprofd attaches (probes, then one ptrace stop per thread to seed its state), then
``strace -f -k -p PID`` attaches to the same process, then the test releases the threads: they make
``getppid`` calls at several depths while unwinding and while recursing again.  Every sample must
be complete and equal, frame by frame, to what strace unwound for the same syscall.  Control: with
strace attached *before* ccprofd, ptrace is refused, the attach line says why, and the samples are
flagged incomplete (and still a suffix of strace's stacks).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_bpf, require_tool, skip_or_fail
from fidelity import compare
from programs.build import build
from strace_oracle import AttachedStrace, attach_strace

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSCALLS = ["getppid"]


@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    require_bpf()
    require_tool("strace")


def _wait_line(stream: Any, needle: str, what: str) -> str:
    seen = []
    while True:
        line = stream.readline()
        if not line:
            raise AssertionError(f"{what} ended before printing {needle!r}: {''.join(seen)}")
        seen.append(line)
        if needle in line:
            return str(line)


def run_attached(binary: pathlib.Path, depth: int, threads: int, tmp_path: pathlib.Path, *,
                 strace_first: bool = False,
                 encoding: str = "valence") -> tuple[list[dict[str, Any]], Any, str]:
    """Park the program, attach ccprofd (and strace), release it; (samples, oracle, attach line)."""
    prog = subprocess.Popen([str(binary), str(depth), str(threads)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert prog.stdin is not None and prog.stdout is not None
    tracer: subprocess.Popen[str] | None = None
    oracle: AttachedStrace | None = None
    try:
        ready = _wait_line(prog.stdout, "ready", "the program")
        pid = int(ready.split()[1])
        assert pid == prog.pid
        if strace_first:
            oracle = attach_strace(pid, SYSCALLS, threads=threads + 1)
        out = tmp_path / "samples.jsonl"
        tracer = subprocess.Popen(
            [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented", "--format", "jsonl",
             "--syscalls", ",".join(SYSCALLS), "--encoding", encoding, "--output", str(out), "-p", str(pid)],
            cwd=REPO, stderr=subprocess.PIPE, text=True)
        assert tracer.stderr is not None
        attach_line = _wait_line(tracer.stderr, "attached to pid", "ccprofd trace")
        if oracle is None:
            oracle = attach_strace(pid, SYSCALLS, threads=threads + 1)
        prog.stdin.write("x" * (threads + 1))
        prog.stdin.close()
        assert prog.stdout.read().strip().endswith("done")
        assert prog.wait(timeout=300) == 0
        trace = oracle.finish(timeout=300)
        oracle = None
        err = tracer.stderr.read()
        assert tracer.wait(timeout=300) == 0, err
        samples = [json.loads(line) for line in out.read_text().splitlines()]
        return samples, trace, attach_line
    finally:
        for p in (prog, tracer, oracle.proc if oracle is not None else None):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


VARIANTS = [pytest.param({"opt": "O0", "pie": True}, id="O0-pie"),
            pytest.param({"opt": "O2", "pie": False}, id="O2-nopie")]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("depth", "threads"), [(60, 0), (45, 2)], ids=["single", "threads"])
def test_attach_seeds_every_thread(variant: dict[str, Any], depth: int, threads: int,
                                   tmp_path: pathlib.Path) -> None:
    binary = build("seeding", **variant)
    samples, oracle, line = run_attached(binary, depth, threads, tmp_path)
    n = threads + 1
    assert f"{n} of {n} threads seeded" in line, line
    getppid = [s for s in samples if s["syscall"] == "getppid"]
    # per thread: levels n % 5 == 0 of the dive on the way back up, climb's n % 3 == 0 and its bottom
    assert len({s["tid"] for s in getppid}) == n
    assert len(getppid) >= n * 15
    assert all(s["complete"] for s in getppid), [s for s in getppid if not s["complete"]][:1]
    deepest = max(len(s["frames"]) for s in getppid)
    assert deepest >= depth, deepest  # the seeded frames (above the attach point) are there
    result = compare(samples, oracle, binary, sample_task_order=[t.tid for t in oracle.tasks])
    assert result.ok, result.report()
    assert result.stats.samples_compared == len(getppid)
    assert result.stats.incomplete_samples == 0


@pytest.mark.parametrize("encoding", ["pcce", "hcce"])
def test_attach_seeds_pcce_and_hcce(encoding: str, tmp_path: pathlib.Path) -> None:
    """The seeded state follows the plan's scheme (PCCE back-edge pairs, HCCE additions)."""
    binary = build("seeding", opt="O0", pie=True)
    samples, oracle, line = run_attached(binary, 40, 1, tmp_path, encoding=encoding)
    assert "2 of 2 threads seeded" in line, line
    getppid = [s for s in samples if s["syscall"] == "getppid"]
    assert len(getppid) >= 30 and all(s["complete"] for s in getppid)
    result = compare(samples, oracle, binary, sample_task_order=[t.tid for t in oracle.tasks])
    assert result.ok, result.report()
    assert result.stats.incomplete_samples == 0


def test_ptrace_refused_leaves_threads_flagged(tmp_path: pathlib.Path) -> None:
    """strace holds the process first: no seeding, the attach line names the tracer, samples
    reached from frames above the attach point are flagged and a suffix of the truth."""
    binary = build("seeding", opt="O0", pie=True)
    samples, oracle, line = run_attached(binary, 30, 0, tmp_path, strace_first=True)
    assert "0 of 1 threads seeded" in line and "ptrace refused" in line and "strace" in line, line
    getppid = [s for s in samples if s["syscall"] == "getppid"]
    assert getppid and any(not s["complete"] for s in getppid)
    result = compare(samples, oracle, binary, sample_task_order=[t.tid for t in oracle.tasks])
    assert result.ok, result.report()
    assert result.stats.incomplete_samples > 0


BASH_SCRIPT = ('f(){ if [ $1 -gt 0 ]; then f $(($1-1)); echo "d$1"; else read -r x; echo bottom; fi; }; '
               'echo "ready $$"; f 40')


def test_attach_seeds_bash_deep_in_a_shell_function(tmp_path: pathlib.Path) -> None:
    """A real -O2 binary with tail calls and no symbols (/usr/bin/bash), parked in `read` 40 shell
    calls deep (~160 native frames): seeded, and every `write` of the unwinding echoes complete and
    equal, return address by return address, to strace -f -k -p."""
    bash = "/usr/bin/bash"
    if not pathlib.Path(bash).exists():
        skip_or_fail("no /usr/bin/bash")
    prog = subprocess.Popen([bash, "-c", BASH_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert prog.stdin is not None and prog.stdout is not None
    tracer: subprocess.Popen[str] | None = None
    oracle: AttachedStrace | None = None
    try:
        pid = int(_wait_line(prog.stdout, "ready", "bash").split()[1])
        out = tmp_path / "samples.jsonl"
        tracer = subprocess.Popen(
            [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented", "--format", "jsonl",
             "--syscalls", "write", "--output", str(out), "-p", str(pid)],
            cwd=REPO, stderr=subprocess.PIPE, text=True)
        assert tracer.stderr is not None
        line = _wait_line(tracer.stderr, "attached to pid", "ccprofd trace")
        assert "1 of 1 threads seeded" in line, line
        oracle = attach_strace(pid, ["write"])
        prog.stdin.write("x\n")
        prog.stdin.close()
        assert prog.stdout.read().split()[-1] == "d40"
        assert prog.wait(timeout=300) == 0
        trace = oracle.finish(timeout=300)
        oracle = None
        assert tracer.wait(timeout=300) == 0
    finally:
        for p in (prog, tracer, oracle.proc if oracle is not None else None):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) == 41 and all(s["complete"] for s in samples)
    assert max(len(s["frames"]) for s in samples) > 100  # the echoes near the bottom
    result = compare(samples, trace, bash, check_names=False, sample_task_order=[t.tid for t in trace.tasks])
    assert result.ok, result.report()
    assert result.stats.samples_compared == 41 and result.stats.incomplete_samples == 0
