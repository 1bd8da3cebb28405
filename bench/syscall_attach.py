"""Benchmark: what attaching to syscalls costs a service whose syscalls are mostly *outside* the
sampled set (issue 14's security-set target), by attach mechanism.

redis-server (started as bench/services.py does) under ``redis-benchmark -t set,get``, one
configuration after another, rotating the order every round:

* ``untraced``;
* ``empty-raw``: a two-instruction BPF program (``r0 = 0; exit``) on ``raw_syscalls:sys_enter``:
  what every syscall of every task pays for the raw tracepoint alone (the slow entry path and
  one program run);
* ``empty-tp``: the same program on the per-syscall ``syscalls:sys_enter_<name>`` events of the
  security set (the syscall-tracing slow path stays on for every task, but a syscall outside the
  set runs no program: the kernel tests a bitmap and returns);
* ``empty-tp-in``: the empty program on ``syscalls:sys_enter_getppid`` (``--loop``: what a syscall
  *in* the set pays on the events path for the dispatch, against ``empty-raw``);
* ``trace-raw`` / ``trace-tp``: the unwinder (``UnwindSampler``, no encoding: the programs
  ``ccprofd trace``/``run`` use) in this process with the security set, tracking the service, on
  ``raw_syscalls:sys_enter`` or on the per-syscall events (the default for a set this small);
* ``trace-tp-ia32``: ``trace-tp`` with the compat watch (``--watch-ia32``, daemon ``watch_ia32``):
  the unwinder's raw_syscalls program beside the events, returning at its TS_COMPAT test for every
  syscall that is not an ia32 one -- what the watch costs every syscall of the machine.

Prints per configuration the median change against the same round's untraced run and the spread
(min..max) of those changes, per test.  ``--loop``: instead of redis, a C loop of ``getppid()``
calls (outside the set) in bursts of ``--requests`` calls, reporting the process CPU time per call
(CLOCK_PROCESS_CPUTIME_ID); short bursts alternate quickly, so a loaded machine's drift hits every
configuration alike.  Usage (root):
``.venv/bin/python bench/syscall_attach.py [--rounds 5] [--requests 100000] [--configs ...] [--loop]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from common import ROOT

sys.path.insert(0, str(ROOT))
from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.attach import attach_raw_tracepoint_fd, attach_tracepoint_fd

SECURITY_SET = ("execve", "openat", "connect", "accept4", "mprotect", "mmap", "clone3", "unlinkat",
                "renameat2")
CONFIGS = ("untraced", "empty-raw", "empty-tp", "empty-tp-in", "trace-raw", "trace-tp", "trace-tp-ia32")
_EMPTY = rawbpf.mov64_imm(0, 0) + rawbpf.exit_insn()


@contextlib.contextmanager
def empty_program(where: str) -> Iterator[None]:
    """The empty program on raw_syscalls:sys_enter ("raw") or the security set's events ("tp")."""
    fds: list[int] = []
    try:
        if where == "raw":
            prog = rawbpf.prog_load(17, _EMPTY, name="empty_raw")
            fds.append(prog)
            fds.append(attach_raw_tracepoint_fd(prog, "sys_enter"))
        else:
            prog = rawbpf.prog_load(5, _EMPTY, name="empty_tp")
            fds.append(prog)
            names = ("getppid",) if where == "tp-in" else SECURITY_SET
            fds += [attach_tracepoint_fd(prog, f"syscalls:sys_enter_{n}") for n in names]
        yield
    finally:
        for fd in fds:
            os.close(fd)


LOOP_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
/* one burst of argv[1] getppid() calls per byte read from stdin; prints the CPU ns per call */
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    struct timespec a, b;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (getchar() == 'x') {
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
        for (long i = 0; i < n; i++)
            syscall(SYS_getppid);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
        printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    }
    return 0;
}
"""


class Loop:
    """The getppid() loop, waiting for bursts."""

    def __init__(self, exe: str, calls: int) -> None:
        self.proc = subprocess.Popen([exe, str(calls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def burst(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("x")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("q")
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def unwind_sampler(pid: int, per_syscall: bool, watch_ia32: bool = False) -> Iterator[None]:
    """The unwinder (no encoding) with the security set, tracking ``pid``, on raw_syscalls or on
    the per-syscall events (with the compat watch: also raw_syscalls, for ia32 calls only)."""
    from ccprofd.kbpf.syscalls import syscall_numbers
    from ccprofd.tracing.unwind.sampler import UnwindSampler

    nrs = [syscall_numbers()[n] for n in SECURITY_SET]
    with UnwindSampler(syscalls=nrs, entry_attach=per_syscall, compat_watch=watch_ia32) as s:
        assert (s.entry_plan is not None) == per_syscall
        s.attach()
        s.track(pid)
        yield
        s.poll(0)


def load(port: int, requests: int) -> dict[str, float]:
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-t", "set,get", "-n", str(requests),
                          "-c", "50",
                          "--csv"], capture_output=True, text=True, check=True).stdout
    rps: dict[str, float] = {}
    for row in out.splitlines()[1:]:
        cells = [c.strip('"') for c in row.split(",")]
        rps[cells[0]] = float(cells[1])
    return rps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=100000)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--loop", action="store_true", help="a getppid() loop instead of redis")
    ap.add_argument("--bursts", type=int, default=5, help="--loop: bursts per configuration and round")
    args = ap.parse_args()
    if args.loop:
        run_loop(args)
        return
    configs = [c for c in args.configs.split(",") if c != "untraced"]
    sys.path.insert(0, str(Path(__file__).parent))
    from services import Redis

    results: dict[str, list[dict[str, float]]] = {c: [] for c in ["untraced", *configs]}
    with tempfile.TemporaryDirectory(prefix="ccprofd-attach-") as tmp:
        redis = Redis(Path(tmp))
        try:
            load(redis.port, 20000)  # warm up
            for rnd in range(args.rounds):
                order = ["untraced", *configs]
                order = order[rnd % len(order):] + order[:rnd % len(order)]
                for cfg in order:
                    if cfg == "untraced":
                        ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                    elif cfg.startswith("empty-"):
                        ctx = empty_program(cfg.split("-", 1)[1])
                    else:
                        ctx = unwind_sampler(redis.proc.pid, cfg != "trace-raw", cfg == "trace-tp-ia32")
                    with ctx:
                        got = load(redis.port, args.requests)
                    results[cfg].append(got)
                    print(f"round {rnd} {cfg:10} " + " ".join(f"{t} {v:,.0f}" for t, v in got.items())
                          + f"  load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            redis.stop()
    report(results, "req/s")


def run_loop(args: argparse.Namespace) -> None:
    """Each configuration in turn, rotating the order every round; per configuration and round the
    median of ``--bursts`` bursts (the unwinder configurations verify their program each round)."""
    configs = [c for c in args.configs.split(",") if c != "untraced"]
    results: dict[str, list[dict[str, float]]] = {c: [] for c in ["untraced", *configs]}
    with tempfile.TemporaryDirectory(prefix="ccprofd-attach-") as tmp:
        src = Path(tmp) / "loop.c"
        src.write_text(LOOP_C)
        exe = str(Path(tmp) / "loop")
        subprocess.run(["gcc", "-O2", "-o", exe, str(src)], check=True)
        loop = Loop(exe, args.requests)
        try:
            for rnd in range(args.rounds):
                order = ["untraced", *configs]
                order = order[rnd % len(order):] + order[:rnd % len(order)]
                for cfg in order:
                    ctx: contextlib.AbstractContextManager[None]
                    if cfg == "untraced":
                        ctx = contextlib.nullcontext()
                    elif cfg.startswith("empty-"):
                        ctx = empty_program(cfg.split("-", 1)[1])
                    else:
                        ctx = unwind_sampler(loop.proc.pid, cfg != "trace-raw", cfg == "trace-tp-ia32")
                    with ctx:
                        got = {"getppid ns": statistics.median(loop.burst() for _ in range(args.bursts))}
                    results[cfg].append(got)
                    print(f"round {rnd} {cfg:10} {got['getppid ns']:.1f} ns  load {os.getloadavg()[0]:.1f}",
                          flush=True)
        finally:
            loop.stop()
    report(results, "ns")


#: pairs compared round by round (the configurations measured next to each other in time)
PAIRS = (("trace-raw", "trace-tp"), ("empty-raw", "empty-tp"), ("empty-tp-in", "empty-raw"),
         ("empty-raw", "untraced"),
         ("empty-tp", "untraced"), ("trace-raw", "untraced"), ("trace-tp", "untraced"),
         ("trace-tp-ia32", "trace-tp"), ("trace-tp-ia32", "untraced"))


def paired(results: dict[str, list[dict[str, float]]]) -> None:
    """Per pair, the median over rounds of the difference A - B, and in how many rounds A > B (the
    rounds' levels drift by a factor of ten on a loaded machine; a difference within a round less)."""
    print("\nA | B | test | median of A - B per round | rounds with A > B")
    for a, b in PAIRS:
        if not results.get(a) or not results.get(b):
            continue
        for test in results[a][0]:
            diffs = [x[test] - y[test] for x, y in zip(results[a], results[b], strict=True)]
            print(f"{a} | {b} | {test} | {statistics.median(diffs):+,.0f} | "
                  f"{sum(d > 0 for d in diffs)}/{len(diffs)}")


def report(results: dict[str, list[dict[str, float]]], unit: str) -> None:
    configs = [c for c in results if c != "untraced"]
    print(f"\nconfiguration | test | median {unit} | median change vs same round's untraced | spread")
    for cfg in ["untraced", *configs]:
        for test in results["untraced"][0]:
            vals = [r[test] for r in results[cfg]]
            changes = [100 * (r[test] / u[test] - 1)
                       for r, u in zip(results[cfg], results["untraced"], strict=True)]
            print(f"{cfg} | {test} | {statistics.median(vals):,.0f} | {statistics.median(changes):+.1f}% | "
                  f"{min(changes):+.1f}%..{max(changes):+.1f}%")
    paired(results)


if __name__ == "__main__":
    main()
