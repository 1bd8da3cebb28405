"""Benchmark: whole-program slowdown with every syscall sampled, unwind mode against the others.

Workloads (skipped when the tool is missing; nothing is installed): ``bash`` running a recursive
shell function, ``python3.11`` json round trips, ``gzip`` of a generated text file, ``sqlite3``
running a query script.  Each runs, in the same run and interleaved (median of ``--repeat``):

* untraced;
* ``ccprofd trace --mode unwind --syscalls all`` (the Mode in-process: the target's wall time from
  its release to its exit, measured on a pidfd; samples are decoded and counted, not written);
* ``ccprofd trace --mode instrumented`` (same measurement; capped at ``--cap`` seconds);
* ``strace -f -k`` (every syscall, output to /dev/null).

The unwind-mode time includes the stops at exec and at each new executable mapping while ccprofd
loads the process's mappings (a real cost of the mode, large only for very short runs).

Also: cold build time and peak Python memory of the unwind tables of libc + python3.11 and of
python3.11's unwind encoding (from its cached call graph and plan), and the BPF map memory.

Run as root: ``.venv/bin/python bench/overhead.py [--repeat 3]``; prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_line

BASH_SCRIPT = ("f(){ local n=$1; if (( n > 0 )); then f $((n-1)); fi; }; "
               "for ((i=0;i<200;i++)); do f 20; : > /dev/null; done")
PY_SCRIPT = ("import json\nd={'a':[1,2,3],'b':'x'*20,'c':{'d':None}}\n"
             "for i in range(20000):\n    json.loads(json.dumps(d))\n    "
             "if i % 200 == 0: open('/dev/null','w').close()\n")
SQL_SCRIPT = ("create table t(a integer, b text);\n"
              "with recursive c(x) as (select 1 union all select x+1 from c where x < 20000) "
              "insert into t select x, 'v' || (x % 97) from c;\n"
              "select b, count(*), sum(a) from t group by b order by 2 desc limit 3;\n")


def workloads(tmp: Path) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    if shutil.which("bash"):
        out.append(("bash recursive function (200 x depth 20)",
                    [shutil.which("bash") or "bash", "-c", BASH_SCRIPT]))
    py = "/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else shutil.which("python3.11")
    if py:
        out.append(("python3.11 20,000 json round trips", [py, "-c", PY_SCRIPT]))
    if shutil.which("gzip"):
        data = tmp / "text.txt"
        with open(data, "w") as fh:
            for i in range(250_000):
                fh.write(f"line {i} of some text that compresses {i % 97} {'abc' * (i % 7)}\n")
        out.append((f"gzip {data.stat().st_size >> 20} MB of text", [shutil.which("gzip") or "gzip", "-c",
                                                                      str(data)]))
    if shutil.which("sqlite3"):
        script = tmp / "q.sql"
        script.write_text(SQL_SCRIPT)
        out.append(("sqlite3 20k inserts + GROUP BY", [shutil.which("sqlite3") or "sqlite3", ":memory:",
                                                        f".read {script}"]))
    return out


def _wait_exit(pid: int, done: dict[str, float]) -> None:
    fd = os.pidfd_open(pid)
    try:
        select.select([fd], [], [])
        done["t1"] = time.perf_counter()
    finally:
        os.close(fd)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Children forked inside inherit /dev/null as stdout (the benchmark's own output is kept)."""
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        yield None
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def untraced(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def with_strace(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["strace", "-f", "-k", "-qq", "-o", os.devnull, "--", *argv], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def with_ccprofd(argv: list[str], mode: str, cap: float) -> tuple[float | None, int, dict[str, object]]:
    """The target's wall time under ccprofd (None: over the cap), samples, mode summary."""
    from ccprofd.tracing.api import TraceOptions
    from ccprofd.tracing.session import open_session

    opts = TraceOptions(mode=mode, syscalls="all")
    with _quiet_stdout():
        session = open_session(argv, options=opts)
    t0 = time.perf_counter()
    done: dict[str, float] = {}
    waiter = threading.Thread(target=_wait_exit, args=(session.child, done), daemon=True)
    waiter.start()
    n = 0
    over = False
    for batch in session.batches():
        n += len(batch)
        if time.perf_counter() - t0 > cap and "t1" not in done:
            over = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(session.child or 0, 9)
    waiter.join(timeout=10)
    summary = session.summary()
    session.wait()
    return (None if over else done.get("t1", time.perf_counter()) - t0), n, summary


def table_build() -> list[str]:
    """Cold unwind tables (libc, python3.11) and unwind encoding (python3.11): time and peak memory."""
    from ccprofd.callgraph import analyze_binary
    from ccprofd.elf import cfi
    from ccprofd.elf.image import ElfImage
    from ccprofd.encode import get_plan
    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.tracing.unwind.plan import build_unwind_encoding

    rows = []
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    py = "/usr/bin/python3.11"
    total = 0.0
    with tempfile.TemporaryDirectory() as d:
        cache = AnalysisCache(Path(d))
        for path in (libc, py):
            if not os.path.exists(path):
                continue
            t0 = time.perf_counter()
            table = cfi.load_table(path, cache, ElfImage(path))
            dt = time.perf_counter() - t0
            with tempfile.TemporaryDirectory() as d2:  # memory in a second cold build (tracemalloc is slow)
                tracemalloc.start()
                cfi.load_table(path, AnalysisCache(Path(d2)), ElfImage(path))
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            total += dt
            rows.append(f"| CFI table {path} ({len(table)} rows) | {dt:.2f} s | {peak / 2**20:.0f} MiB |")
    rows.append(f"| **CFI tables, libc + python3.11** | **{total:.2f} s** | |")
    if os.path.exists(py):
        graph = analyze_binary(py)
        plan = get_plan(graph, "valence")
        t0 = time.perf_counter()
        enc = build_unwind_encoding(graph, plan)
        dt = time.perf_counter() - t0
        tracemalloc.start()
        build_unwind_encoding(graph, plan)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows.append(f"| unwind encoding python3.11 ({len(enc.edges)} rows, {len(enc.functions)} ranges; "
                    f"graph + plan cached) | {dt:.2f} s | {peak / 2**20:.0f} MiB |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cap", type=float, default=60.0, help="seconds before a traced run is given up")
    ap.add_argument("--no-instrumented", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/overhead.py needs root (BPF)", file=sys.stderr)
        return 2
    print(f"Machine: {machine_line()}\n")
    with tempfile.TemporaryDirectory() as d:
        loads = workloads(Path(d))
        modes = ["untraced", "unwind"] + ([] if args.no_instrumented else ["instrumented"]) + \
            (["strace -f -k"] if shutil.which("strace") else [])
        times: dict[tuple[str, str], list[float | None]] = {}
        samples: dict[tuple[str, str], int] = {}
        extra: dict[str, dict[str, object]] = {}
        for name, argv in loads:
            with_ccprofd(argv, "unwind", args.cap)  # warm the analysis and table caches
            for _ in range(args.repeat):
                for mode in modes:
                    if mode == "untraced":
                        t: float | None = untraced(argv)
                    elif mode == "strace -f -k":
                        t = with_strace(argv)
                    else:
                        t, n, summary = with_ccprofd(argv, mode, args.cap)
                        samples[(name, mode)] = n
                        if mode == "unwind":
                            extra[name] = summary
                    times.setdefault((name, mode), []).append(t)
                    print(f"  {name}: {mode}: {t if t is None else round(t, 3)}", file=sys.stderr)

    print("| workload | " + " | ".join(modes) + " | samples (unwind) | incomplete |")
    print("|---|" + "---|" * (len(modes) + 2))
    for name, _ in loads:
        base = statistics.median(x for x in times[(name, "untraced")] if x is not None)
        cells = []
        for mode in modes:
            vals = times[(name, mode)]
            if any(v is None for v in vals):
                cells.append(f"> {args.cap:.0f} s")
                continue
            med = statistics.median(v for v in vals if v is not None)
            cells.append(f"{med * 1000:.0f} ms" if mode == "untraced"
                         else f"{med * 1000:.0f} ms ({med / base:.2f}x)")
        s = extra.get(name, {})
        print(f"| {name} | " + " | ".join(cells) + f" | {samples.get((name, 'unwind'), 0)} | "
              f"{s.get('incomplete', '?')} |")
    mem = [s.get("map_bytes") for s in extra.values() if s.get("map_bytes")]
    if mem:
        biggest = max(int(str(m)) for m in mem)
        print(f"\nBPF map memory (unwind mode, preallocated): {biggest / 2**20:.0f} MiB")
    print("\n| unwind tables (cold) | time | peak Python memory |\n|---|---|---|")
    for row in table_build():
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
