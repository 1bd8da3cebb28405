"""Benchmark: per-sample cost of ccprofd's CFI unwinder in BPF against bpf_get_stack(BPF_F_USER_STACK).

A test program built with frame pointers recurses until the stack at its getppid() has F frames
(F = 6, 32, 104, 127, 1,000, 4,000) and then calls getppid() N times.  Measured, side by side:

* BPF program time per sample (``kernel.bpf_stats_enabled``: run_time_ns / run_cnt of each
  program) with *both* programs attached to ``raw_syscalls:sys_enter`` in the same run, the
  unwinder with its per-thread memo of outer frames on (the default) and off (every frame unwound
  afresh); the program repeats one stack, the memo's best case;
* wall time per getppid() in the program: untraced, with only bpf_get_stack, with only the
  unwinder (in-kernel aggregation on: the production path, nothing sent to userspace per sample);
* frames each one reached (bpf_get_stack stops at ``kernel.perf_event_max_stack``, 127).

Also: unwind-table build time for libc + python3.11 (cold and cached) and BPF map memory.

Run as root: ``.venv/bin/python bench/unwind.py [--calls N]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    machine_line,
    median,
    report_main,
    run_time_stats,  # this process's programs only: the machine is shared
)
from bench.report_bpf import owned_prog_stats
from ccprofd.elf import cfi
from ccprofd.elf.image import ElfImage
from ccprofd.kbpf.rawmodule import load_module
from ccprofd.persist.cache import AnalysisCache
from ccprofd.tracing.unwind.sampler import UnwindSampler

# This bench measures the sample program on raw_syscalls:sys_enter (`uw_sys_enter`/`ccprof_sys_enter`),
# the path of `syscalls = "all"` and of large sets: its one-syscall sets would otherwise go on their
# own syscalls:sys_enter_<name> event (ccprofd/kbpf/syscall_entry.py), which bench/syscall_attach.py
# measures against the raw path.
os.environ.setdefault("CCPROFD_SYSCALL_ATTACH", "raw")

NR_GETPPID = 110
DEPTHS = (6, 32, 104, 127, 1000, 4000)
OUTSIDE_FRAMES = 5  # getppid wrapper, main, __libc_start_call_main, __libc_start_main, _start

PROG_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
volatile long sink;
static long calls;
__attribute__((noinline)) long rec(int d) {
    if (d == 0) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (long i = 0; i < calls; i++) sink = getppid();
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / calls);
        return 0;
    }
    long r = rec(d - 1);
    sink = r;
    return r + 1;
}
int main(int argc, char **argv) {
    char c;
    calls = atol(argv[2]);
    write(1, "ready\n", 6);
    if (read(0, &c, 1) != 1) return 3;
    return (int)rec(atoi(argv[1]));
}
"""

GET_STACK_C = r"""
#include <asm/ptrace.h>
#define MAXF 127
struct gs_buf { u64 ips[MAXF]; };
BPF_PERCPU_ARRAY(gs_scratch, struct gs_buf, 1);
BPF_ARRAY(gs_target, u32, 1);
BPF_ARRAY(gs_frames, u64, 1);
int gs_sys_enter(struct bpf_raw_tracepoint_args *ctx) {
    u32 z = 0;
    u32 *want = gs_target.lookup(&z);
    if (!want || (bpf_get_current_pid_tgid() >> 32) != *want || ctx->args[1] != 110)
        return 0;
    struct gs_buf *b = gs_scratch.lookup(&z);
    if (!b)
        return 0;
    long n = bpf_get_stack(ctx, b->ips, sizeof(b->ips), BPF_F_USER_STACK);
    u64 *f = gs_frames.lookup(&z);
    if (f && n > 0)
        *f = n / 8;
    return 0;
}
"""


def build_program(tmp: Path) -> Path:
    src = tmp / "depth.c"
    src.write_text(PROG_C)
    out = tmp / "depth"
    subprocess.run(["gcc", "-O2", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer",
                    "-o", str(out), str(src)], check=True)
    return out


def run_program(binary: Path, frames: int, calls: int, on_pid=None) -> float:  # type: ignore[no-untyped-def]
    p = subprocess.Popen([str(binary), str(frames - OUTSIDE_FRAMES), str(calls)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline() == b"ready\n"
    if on_pid is not None:
        on_pid(p.pid)
    p.stdin.write(b"x")
    p.stdin.close()
    out = p.stdout.read()
    p.wait()
    return float(out.split()[-1])


def table_build_times() -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        cache = AnalysisCache(Path(d))
        total_cold = total_warm = 0.0
        for path in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/python3.11"):
            t0 = time.perf_counter()
            image = ElfImage(path)
            table = cfi.load_table(path, cache, image)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            cfi.load_table(path, cache, ElfImage(path))
            warm = time.perf_counter() - t0
            total_cold += cold
            total_warm += warm
            rows.append(f"| {path} | {table.fde_count} | {len(table)} | {len(table.rules)} | {cold:.2f} s | "
                        f"{warm:.2f} s | {len(table) * 8 / 1024:.0f} KiB |")
        rows.append(f"| **libc + python3.11** | | | | **{total_cold:.2f} s** | **{total_warm:.2f} s** | |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="getppid() calls per measurement")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--update-readme", action="store_true",
                    help="also write the tables into README.md's bench:unwind section")
    args = ap.parse_args()
    return report_main("unwind", measure, args, update_readme=args.update_readme)


def measure(args: argparse.Namespace) -> int:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{machine_line()}, load average {load} at the start")
    print("\nUnwind tables (cold = parse CFI; cached = load from the build-id cache):\n")
    print("| object | FDEs | rows | rules | cold | cached | BPF rows |")
    print("|---|---|---|---|---|---|---|")
    for row in table_build_times():
        print(row)

    tmp = Path(tempfile.mkdtemp(prefix="ccprofd-bench-unwind-"))
    binary = build_program(tmp)
    gs = load_module(GET_STACK_C)
    uw = UnwindSampler(syscalls=[NR_GETPPID], aggregate=True, max_depth=4096)
    t0 = time.perf_counter()
    uw.attach()
    attach_s = time.perf_counter() - t0
    gs_target = gs.map("gs_target")
    gs_frames = gs.map("gs_frames")
    results: dict[int, dict[str, float]] = {}
    stats_on = run_time_stats()
    stats_on.__enter__()
    try:
        gs_attached = False
        for frames in DEPTHS:
            r: dict[str, float] = {}
            r["untraced"] = median([run_program(binary, frames, args.calls) for _ in range(args.repeat)])
            if not gs_attached:
                gs.attach_raw_tracepoint("sys_enter", "gs_sys_enter")
                gs_attached = True

            # both at once: BPF time per sample of each program
            pids: list[int] = []

            def track_both(pid: int, pids: list[int] = pids) -> None:
                gs_target.set(0, pid)
                uw.track(pid)
                pids.append(pid)

            for memo in ("off", "on"):  # memo on last: its run's new contexts are read below
                uw.set_memo(memo)
                before = owned_prog_stats()
                run_program(binary, frames, args.calls, track_both)
                after = owned_prog_stats()
                for name, key in (("uw_sys_enter", f"bpf_unwind_{memo}_ns"),
                                  ("gs_sys_enter", f"bpf_get_stack_{memo}_ns")):
                    dt = after[name][0] - before.get(name, (0, 0))[0]
                    dn = after[name][1] - before.get(name, (0, 0))[1]
                    r[key] = dt / max(1, dn) if name == "gs_sys_enter" else dt / max(1, args.calls)
                if memo == "off":
                    uw.poll(0)
            r["bpf_unwind_ns"] = r["bpf_unwind_on_ns"]
            r["bpf_get_stack_ns"] = r["bpf_get_stack_on_ns"]
            r["get_stack_frames"] = float(gs_frames.get(0) or 0)
            got = uw.poll(0)  # the new contexts (aggregation sends each one once)
            deepest = [len(s.pcs) for s in got if s.tgid in pids and s.syscall == NR_GETPPID]
            r["unwind_frames"] = float(max(deepest) if deepest else 0)
            r["unwind_incomplete"] = float(uw.stats()["incomplete"])

            # one at a time: wall time per getppid
            def track_gs(pid: int) -> None:
                gs_target.set(0, pid)

            r["wall_get_stack"] = median([run_program(binary, frames, args.calls, track_gs)
                                          for _ in range(args.repeat)])
            gs_target.set(0, 0)
            r["wall_unwind"] = median([run_program(binary, frames, args.calls, uw.track)
                                       for _ in range(args.repeat)])
            uw.poll(0)
            results[frames] = r
    finally:
        stats_on.__exit__(None, None, None)
        stats = uw.stats()
        mem = uw.map_memory_bytes()
        uw.close()
        gs.cleanup()

    print(f"\nPer sample at getppid() (N = {args.calls}, median of {args.repeat}; BPF ns from bpf_stats, "
          "both programs attached in the same run):\n")
    print("| frames | untraced ns/call | bpf_get_stack: frames, BPF ns, wall ns/call | "
          "unwind: frames, BPF ns, wall ns/call | unwind / get_stack (BPF ns) | "
          "memo off: get_stack BPF ns, unwind BPF ns, ratio |")
    print("|---|---|---|---|---|---|")
    for frames, r in results.items():
        ratio = r["bpf_unwind_ns"] / r["bpf_get_stack_ns"] if r["bpf_get_stack_ns"] else float("nan")
        gs_off = r["bpf_get_stack_off_ns"]
        off = r["bpf_unwind_off_ns"] / gs_off if gs_off else float("nan")
        print(f"| {frames} | {r['untraced']:.0f} | {r['get_stack_frames']:.0f}, {r['bpf_get_stack_ns']:.0f}, "
              f"{r['wall_get_stack']:.0f} | {r['unwind_frames']:.0f}, {r['bpf_unwind_ns']:.0f}, "
              f"{r['wall_unwind']:.0f} | {ratio:.2f}x | {r['bpf_get_stack_off_ns']:.0f}, "
              f"{r['bpf_unwind_off_ns']:.0f}, {off:.2f}x |")
    print("\nbpf_get_stack stops at kernel.perf_event_max_stack (127) and, like any frame-pointer walk, "
          "skips frames of code without frame pointers (libc's getppid wrapper, _start); the unwinder "
          "reports every frame (CFI), so its frame count is higher at the same depth.")
    print(f"\nUnwinder attach (BPF verification of the bpf_loop programs): {attach_s:.1f} s; stats: {stats}")
    print("BPF map memory (preallocated): " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items())
          + f"; total {sum(mem.values()) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
