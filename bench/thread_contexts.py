"""What a ``GetThreadContexts`` costs the profiled process: how long its threads are held stopped.

The workload is tests/programs/blocked.c (4 threads blocked at a given recursion depth, built
-O2 -fomit-frame-pointer, so every frame is unwound through ``.eh_frame``).  For each depth the
snapshot (``ccprofd.proc.threadsnap.snapshot``, unwind tables already cached, as in the daemon
after its first call) is taken ``--runs`` times; reported: the time the process was held (first
``PTRACE_SEIZE`` to last ``PTRACE_DETACH``, which includes the stack walks), and the whole call
with decoding into JSON frames (``ContextReader.read``).  Baseline: ``gdb -p PID -batch -ex
"thread apply all bt"``, which holds the process from its attach to its detach (its whole run,
measured as wall time: an upper bound of its stop).

``python bench/thread_contexts.py [--runs N] [--update-readme]`` (the README's
bench:thread-contexts section).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "programs"))
import build as programs
from common import machine_line, update_readme_section

from ccprofd.proc.modules import ModuleCache
from ccprofd.proc.threadsnap import snapshot
from ccprofd.tracing.threadcontexts import ContextReader


def _blocked(pid: int) -> bool:
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            if Path(f"/proc/{pid}/task/{t}/stat").read_text().rpartition(")")[2].split()[0] != "S":
                return False
        return len(os.listdir(f"/proc/{pid}/task")) == 4
    except OSError:
        return False


def measure(depth: int, runs: int, gdb_runs: int) -> dict[str, float]:
    exe = programs.build("blocked", opt="O2", frame_pointer=False)
    proc = subprocess.Popen([str(exe), str(depth)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        while not _blocked(proc.pid):
            time.sleep(0.01)
        modules = ModuleCache()
        snapshot(proc.pid, modules)  # warm: tables loaded once, as in the daemon
        held: list[float] = []
        frames = 0
        for _ in range(runs):
            snap = snapshot(proc.pid, modules)
            assert snap.error is None
            held.append(snap.stopped_ns / 1e6)
            frames = sum(len(t.stack.frames) for t in snap.threads if t.stack)
        reader = ContextReader(str(exe))
        reader.read(proc.pid)
        calls: list[float] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            got = reader.read(proc.pid)
            calls.append((time.perf_counter() - t0) * 1e3)
            assert got["error"] is None
        gdb = shutil.which("gdb")
        gdb_ms: list[float] = []
        for _ in range(gdb_runs if gdb else 0):
            assert gdb is not None
            t0 = time.perf_counter()
            subprocess.run([gdb, "-q", "-batch", "-nx", "-p", str(proc.pid), "-ex", "set pagination off",
                            "-ex", "thread apply all bt"], capture_output=True, check=False)
            gdb_ms.append((time.perf_counter() - t0) * 1e3)
        proc.communicate("go\n")
        return {"frames": frames, "held_median": statistics.median(held), "held_max": max(held),
                "call_median": statistics.median(calls),
                "gdb_median": statistics.median(gdb_ms) if gdb_ms else float("nan")}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--gdb-runs", type=int, default=3)
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args(argv)
    rows = ["| depth per thread | frames (4 threads) | held, median | held, max | whole RPC work, median "
            "| gdb `thread apply all bt`, median |", "|---|---|---|---|---|---|"]
    for depth in (8, 1000, 3000):
        r = measure(depth, args.runs, args.gdb_runs)
        rows.append(f"| {depth} | {int(r['frames'])} | {r['held_median']:.2f} ms | {r['held_max']:.2f} ms | "
                    f"{r['call_median']:.1f} ms | {r['gdb_median']:.0f} ms |")
        print(rows[-1], flush=True)
    head = f"{machine_line()}; {args.runs} snapshots per depth (tables cached), gdb {args.gdb_runs} runs."
    body = head + "\n\n" + "\n".join(rows) + "\n"
    if args.update_readme and not update_readme_section("thread-contexts", body):
        print("README has no bench:thread-contexts section", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
