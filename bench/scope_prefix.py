"""Instrumented mode's helpers from unwinding: the cost of a ``--scope`` entry that copies the stack
for the prefix unwind, and the time to seed the threads of a process at ``-p`` attach.

Scope entry: a program calls a scope function (which makes no syscall) through a 20-deep chain in a
loop and times the loop itself (CLOCK_MONOTONIC); runs: untraced, and ``--scope`` with 0 (no
prefix), 1 and 8 stack pages copied per entry.  Seeding: tests/programs/seeding.c parked at depth
``D`` with ``T`` threads; the time of ``track_running`` (stop, unwind, replay, write, resume) and of
the whole attach.  Medians of ``--runs``; the machine is shared, treat them as orders of magnitude.

    sudo .venv/bin/python bench/scope_prefix.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from programs.build import build  # noqa: E402

from ccprofd.tracing.api import TraceOptions  # noqa: E402
from ccprofd.tracing.instrumented.mode import InstrumentedMode  # noqa: E402
from ccprofd.tracing.session import open_session  # noqa: E402

LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
volatile long sink;
__attribute__((noinline)) void scope_fn(long i) { sink += i; }
__attribute__((noinline)) void chain(long n, long i) { if (n) chain(n - 1, i); else scope_fn(i); sink++; }
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 20000;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) chain(20, i);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
"""
CALLS = 20000


def ns_per_iteration(binary: str, pages: str | None) -> float:
    if pages is None:
        out = subprocess.run([binary, str(CALLS)], capture_output=True, text=True, check=True).stdout
        return float(out)
    os.environ["CCPROFD_SCOPE_STACK_PAGES"] = pages
    with tempfile.TemporaryDirectory() as d:
        r, w = os.pipe()
        saved = os.dup(1)
        os.dup2(w, 1)
        try:
            opts = TraceOptions(mode="instrumented", syscalls="getppid", scope="^scope_fn$")
            s = open_session([binary, str(CALLS)], options=opts)
            for _ in s.samples():
                pass
            s.wait()
        finally:
            os.dup2(saved, 1)
            os.close(w)
        out = os.read(r, 4096).decode()
        os.close(r)
        del d
    return float(out.split()[-1])


def seed_time(depth: int, threads: int) -> tuple[float, float]:
    binary = str(build("seeding", opt="O2", pie=True))
    prog = subprocess.Popen([binary, str(depth), str(threads)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert prog.stdout is not None and prog.stdin is not None
    prog.stdout.readline()
    mode = InstrumentedMode(binary, TraceOptions(mode="instrumented", syscalls="getppid"))
    try:
        mode.prepare()
        tids = sorted(int(t) for t in os.listdir(f"/proc/{prog.pid}/task"))
        t0 = time.monotonic()
        mode.track_running(prog.pid, tids)
        took = time.monotonic() - t0
        seeded = sum(1 for r in mode.summary()["seeding"][str(prog.pid)].values() if r is None)
    finally:
        mode.close()
        prog.stdin.write("x" * (threads + 1))
        prog.stdin.close()
        prog.wait()
    return took * 1000, seeded


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "loop.c"
        src.write_text(LOOP)
        binary = str(Path(d) / "loop")
        subprocess.run(["gcc", "-O2", "-g", "-fcf-protection=none", "-o", binary, str(src)], check=True)
        rows = []
        base = None
        for label, pages in (("untraced", None), ("--scope, no prefix copy", "0"),
                             ("--scope, 1 page", "1"), ("--scope, 8 pages (default)", "8")):
            v = statistics.median(ns_per_iteration(binary, pages) for _ in range(args.runs))
            base = v if base is None else base
            rows.append(f"| {label} | {v:,.0f} | {v - base:+,.0f} |")
    lines = ["| loop iteration (20-deep chain, one scope entry) | ns | vs untraced |", "|---|---|---|", *rows,
             ""]
    lines += ["| -p attach: threads x depth | seeded | track_running (stop, unwind, replay, write) |",
              "|---|---|---|"]
    for threads, depth in ((0, 50), (3, 50), (0, 2000)):
        ms, seeded = zip(*(seed_time(depth, threads) for _ in range(args.runs)), strict=True)
        lines.append(f"| {threads + 1} x {depth} | {min(seeded)} of {threads + 1} | "
                     f"{statistics.median(ms):,.0f} ms |")
    note = ["(The loop's stack ends within two pages of `sp`, so 1 and 8 pages copy about the same; "
            "the entry", "probe itself is single-stepped here, hence the 10 µs.)"]
    body = "\n".join(["Measured by `bench/scope_prefix.py` (medians of 3, shared 2-core VM):", "", *lines, "",
                      *note])
    print(body)
    from common import update_readme_section

    update_readme_section("scope_prefix", body)


if __name__ == "__main__":
    main()
