"""Instrumented mode: probe hits per 1,000 executed calls and per sampled syscall, wall time, and
the BPF compile / map-fill time, for a few workloads.

Calls are counted independently of ccprofd's probe plan: one uprobe_multi counter on *every*
``call`` instruction of the binary (direct and PLT calls from the call graph; indirect calls are not
counted), in a separate run of the same command.  Probe hits come from instrumented mode's own BPF
statistics.  Numbers are medians of ``--runs`` runs; the machine is shared, so treat them as orders
of magnitude.

    sudo .venv/bin/python bench/instrumented_hits.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from programs.build import build  # noqa: E402

from ccprofd.callgraph import analyze_binary  # noqa: E402
from ccprofd.elf.image import ElfImage  # noqa: E402
from ccprofd.kbpf.rawmodule import load_module  # noqa: E402
from ccprofd.kbpf.uprobe_multi import attach_uprobe_multi  # noqa: E402
from ccprofd.tracing.api import TraceOptions  # noqa: E402
from ccprofd.tracing.session import open_session  # noqa: E402

COUNTER = r"""
BPF_PERCPU_ARRAY(calls, u64, 1);
int count_call(struct pt_regs *ctx) {
    u32 k = 0;
    u64 *v = calls.lookup(&k);
    if (v)
        (*v)++;
    return 0;
}
"""


def count_calls(cmd: list[str]) -> int:
    """Executed call instructions of the binary (direct + PLT), counted by uprobes on all of them."""
    path = os.path.realpath(cmd[0])
    graph = analyze_binary(path)
    image = ElfImage(path)
    sites = sorted({s.address for s in graph.sites if s.kind in ("direct", "plt") and not s.is_jump})
    offsets = [image.addrspace.vaddr_to_offset(a) for a in sites]
    mod = load_module(COUNTER)
    try:
        fd = mod.load_func("count_call", "kprobe", attach_type=48)
        child = subprocess.Popen(["sh", "-c", 'read _ ; exec "$@"', "sh", *cmd], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        link = attach_uprobe_multi(fd, path, offsets, pid=None)
        try:
            assert child.stdin is not None
            child.stdin.write(b"\n")
            child.stdin.close()
            child.wait()
        finally:
            link.close()
        return int(mod.map("calls").get(0) or 0)
    finally:
        mod.cleanup()


def untraced(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def traced(cmd: list[str], syscalls: str) -> tuple[float, dict[str, int], int]:
    with open(os.devnull, "w") as devnull:
        saved = os.dup(1)
        os.dup2(devnull.fileno(), 1)
        try:
            session = open_session(cmd, options=TraceOptions(syscalls=syscalls))
            t0 = time.perf_counter()
            n = sum(1 for _ in session.samples())
            wall = time.perf_counter() - t0
            stats = session.mode._bpf.stats()  # type: ignore[attr-defined]
            session.wait()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    return wall, stats, n


def compile_times(path: str) -> dict[str, float]:
    from ccprofd.encode import get_plan
    from ccprofd.tracing.instrumented.loader import InstrumentedBPF
    from ccprofd.tracing.instrumented.probeplan import build_probe_plan

    graph = analyze_binary(path)
    plan = get_plan(graph, "valence")
    t0 = time.perf_counter()
    pp = build_probe_plan(graph, plan, ElfImage(path))
    t1 = time.perf_counter()
    import ccprofd.tracing.instrumented.loader as inst

    real_fill = inst.InstrumentedBPF._fill_maps
    fill: list[float] = []

    def timed_fill(self: InstrumentedBPF) -> None:
        f0 = time.perf_counter()
        real_fill(self)
        fill.append(time.perf_counter() - f0)

    inst.InstrumentedBPF._fill_maps = timed_fill  # type: ignore[method-assign]
    try:
        t2 = time.perf_counter()
        b = InstrumentedBPF(pp, plan)
        t3 = time.perf_counter()
        b.load_programs()
        t4 = time.perf_counter()
        b.close()
    finally:
        inst.InstrumentedBPF._fill_maps = real_fill  # type: ignore[method-assign]
    return {"probes": len(pp.probes), "probe_plan_s": t1 - t0, "compile_s": t3 - t2 - fill[0],
            "fill_maps_s": fill[0], "verify_load_s": t4 - t3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    workloads = [
        ("calls (test program)", [str(build("calls", opt="O2"))], "all"),
        ("recursion 1000 (test program)", [str(build("recursion", opt="O2")), "1000"], "all"),
        ("python3.11 json round trips",
         ["/usr/bin/python3.11", "-c",
          "import json\nfor i in range(2000): json.loads(json.dumps({'a': [i]}))"],
         "all"),
    ]
    print("| workload | calls | probe hits | hits / 1,000 calls | syscalls sampled | hits / syscall "
          "| untraced s | traced s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cmd, sc in workloads:
        calls = statistics.median(count_calls(cmd) for _ in range(args.runs))
        base = statistics.median(untraced(cmd) for _ in range(args.runs))
        runs = [traced(cmd, sc) for _ in range(args.runs)]
        wall = statistics.median(r[0] for r in runs)
        hits = statistics.median(r[1]["site_hits"] + r[1]["tail_hits"] + r[1]["entry_hits"] for r in runs)
        nsys = statistics.median(r[2] for r in runs)
        print(f"| {name} | {calls:,.0f} | {hits:,.0f} | {1000 * hits / max(calls, 1):.0f} | {nsys:,.0f} "
              f"| {hits / max(nsys, 1):.1f} | {base:.3f} | {wall:.3f} |")
    print()
    for path in (str(build("recursion", opt="O2")), "/usr/bin/python3.11"):
        t = compile_times(path)
        print(f"{path}: {t['probes']} probes; probe plan {t['probe_plan_s']:.2f} s, BPF compile "
              f"{t['compile_s']:.2f} s, map fill {t['fill_maps_s']:.2f} s, "
              f"verify+load {t['verify_load_s']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
