"""Benchmark: the flight recorder's added cost per syscall sample (issue #19; target <= 50 ns).

Two measurements, both with ``kernel.bpf_stats_enabled`` (run_time_ns / run_cnt of the programs
this process holds), on a program that calls getppid() N times:

* isolated, side by side in one run: two programs attached to ``raw_syscalls:sys_enter`` at once,
  identical (tracked-process filter, the argument registers read into per-CPU scratch as a sample
  reads them) except that one also appends the event to the thread's ring with the recorder's own
  ``ccprof_history_put`` (tracing/history.c): their difference per call is the recorder's cost;
* in each tracer mode, the mode's syscall program per sample with the recorder compiled out
  (``CCPROFD_HISTORY=0``) and in (256 events), rounds interleaved; the difference is within the
  noise of a program that costs microseconds, so it is a sanity check, not the measurement.

And the saved history's compression and costs (:func:`persistence`).

Run as root: ``.venv/bin/python bench/history.py [--calls N] [--repeat R] [--update-readme]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_line, update_readme_section
from bench.report_bpf import bpf_stats_enabled, owned_prog_stats, stats_delta
from ccprofd.kbpf.rawmodule import load_module
from ccprofd.tracing.api import TraceOptions
from ccprofd.tracing.history import DEFAULT_HISTORY_LEN, ENV_LENGTH, history_source
from ccprofd.tracing.session import open_session

# This bench measures the sample program on raw_syscalls:sys_enter (`uw_sys_enter`/`ccprof_sys_enter`),
# the path of `syscalls = "all"` and of large sets: its one-syscall sets would otherwise go on their
# own syscalls:sys_enter_<name> event (ccprofd/kbpf/syscall_entry.py), which bench/syscall_attach.py
# measures against the raw path.
os.environ.setdefault("CCPROFD_SYSCALL_ATTACH", "raw")

PROG_C = r"""
#include <stdlib.h>
#include <unistd.h>
volatile long sink;
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000;
    for (long i = 0; i < n; i++) sink = getppid();
    return 0;
}
"""

ISOLATED_C = r"""
#include <asm/ptrace.h>
BPF_ARRAY(hb_target, u32, 1);
struct hb_words { u64 w[4]; };
BPF_PERCPU_ARRAY(hb_args, struct hb_words, 1);
static __always_inline const u64 *hb_sample(struct bpf_raw_tracepoint_args *ctx) {
    u32 zero = 0;
    u32 *t = hb_target.lookup(&zero);
    if (!t || *t != (u32)(bpf_get_current_pid_tgid() >> 32) || ctx->args[1] != 110)
        return 0;
    struct hb_words *hw = hb_args.lookup(&zero);
    if (!hw)
        return 0;
    u64 *a = hw->w;
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
    bpf_probe_read_kernel(&a[0], 8, &regs->di);
    bpf_probe_read_kernel(&a[1], 8, &regs->si);
    bpf_probe_read_kernel(&a[2], 8, &regs->dx);
    a[3] = bpf_ktime_get_ns();
    return a;
}
int hb_plain(struct bpf_raw_tracepoint_args *ctx) {
    const u64 *a = hb_sample(ctx);
    if (a)
        asm volatile("" : : "r"(a) : "memory");
    return 0;
}
int hb_recorder(struct bpf_raw_tracepoint_args *ctx) {
    const u64 *a = hb_sample(ctx);
    if (a)
        ccprof_history_put(bpf_get_current_pid_tgid(), a[3], 110, 1, 0x1234, 0x5678, a);
    return 0;
}
"""

MODE_PROGS = {"unwind": "uw_sys_enter", "instrumented": "ccprof_sys_enter"}


def build_program(tmp: Path) -> Path:
    src = tmp / "getppid_loop.c"
    src.write_text(PROG_C)
    out = tmp / "getppid_loop"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(out), str(src)], check=True)
    return out


def isolated(binary: Path, calls: int, repeat: int) -> dict[str, float]:
    """Median ns per call of the two identical programs, with and without the recorder."""
    mod = load_module(history_source(DEFAULT_HISTORY_LEN) + ISOLATED_C)
    try:
        mod.attach_raw_tracepoint("sys_enter", "hb_plain")
        mod.attach_raw_tracepoint("sys_enter", "hb_recorder")
        target = mod.map("hb_target")
        without: list[float] = []
        with_: list[float] = []
        cost: list[float] = []
        for _ in range(repeat):
            proc = subprocess.Popen([str(binary), str(calls)], stdin=subprocess.PIPE)
            target.set(0, proc.pid)
            before = owned_prog_stats()
            proc.communicate()
            after = owned_prog_stats()
            # both run at every syscall of the machine (the filter is the same in both): their
            # difference over the target's getppid() calls is what recording one sample costs
            tp, _ = stats_delta(before, after, "hb_plain")
            tr, _ = stats_delta(before, after, "hb_recorder")
            without.append(tp / calls)
            with_.append(tr / calls)
            cost.append((tr - tp) / calls)
        return {"without": statistics.median(without), "with": statistics.median(with_),
                "cost": statistics.median(cost)}
    finally:
        mod.cleanup()


def in_mode(binary: Path, mode: str, calls: int, repeat: int) -> dict[int, float]:
    """Median ns per sample of the mode's syscall program, recorder off (0) and on (256)."""
    got: dict[int, list[float]] = {0: [], DEFAULT_HISTORY_LEN: []}
    for _ in range(repeat):
        for length in got:
            os.environ[ENV_LENGTH] = str(length)
            before = owned_prog_stats()
            session = open_session([str(binary), str(calls)],
                                   options=TraceOptions(mode=mode, syscalls="getppid"))
            try:
                for _batch in session.batches():
                    pass
                after = owned_prog_stats()
            finally:
                session.close()
            t, _ = stats_delta(before, after, MODE_PROGS[mode])
            got[length].append(t / calls)
    os.environ.pop(ENV_LENGTH, None)
    return {k: statistics.median(v) for k, v in got.items()}


PERSIST_CMD = ["/usr/bin/tar", "cf", "/dev/null", "/usr/include"]


def persistence(tmp: Path) -> dict[str, float]:
    """The on-disk history (daemon/historyfile.py) of a real syscall stream: every syscall sample of
    ``tar cf /dev/null /usr/include`` (unwind mode), appended as the daemon appends recorded events.
    Sizes against the raw BPF records (56 bytes an event) and the decoded JSON; costs per event."""
    import time

    from ccprofd.daemon.historyfile import HistoryStore
    from ccprofd.daemon.historypersist import HistoryPersister

    session = open_session(PERSIST_CMD, options=TraceOptions(mode="unwind", syscalls="all"))
    try:
        events = [s.to_json() for batch in session.batches() for s in batch if s.event == "syscall"]
    finally:
        session.close()
    json_bytes = sum(len(json.dumps(e, separators=(",", ":"))) for e in events)
    path = tmp / "bench.wet"
    p = HistoryPersister(path, 3600.0, max_bytes=1 << 40)
    t0 = time.perf_counter()
    for e in events:
        p.append(int(e["tid"]), e)
    t1 = time.perf_counter()
    size = p.store.save(path, 1 << 40)
    t2 = time.perf_counter()
    store = HistoryStore.load(path)
    t3 = time.perf_counter()
    steps = 0
    for th in store.threads.values():
        c = th.cursor(at_end=True)
        while c.prev():
            steps += 1
        while c.next():
            steps += 1
    t4 = time.perf_counter()
    n = len(events)
    codes = sum(th.code_bytes() for th in store.threads.values())
    return {"events": n, "contexts": len(store.contexts), "raw": 56 * n, "json": json_bytes, "codes": codes,
            "file": size, "append_us": (t1 - t0) / n * 1e6, "save_us": (t2 - t1) / n * 1e6,
            "load_us": (t3 - t2) / n * 1e6, "step_ns": (t4 - t3) / max(1, steps) * 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ccprofd-bench-history-"))
    binary = build_program(tmp)
    with bpf_stats_enabled():
        iso = isolated(binary, args.calls, args.repeat)
        modes = {m: in_mode(binary, m, args.calls // 4, max(3, args.repeat // 2)) for m in MODE_PROGS}
    lines = [f"Measured on {machine_line()}: getppid() x {args.calls:,} (x {args.calls // 4:,} in the "
             f"modes), median of {args.repeat} runs (modes: {max(3, args.repeat // 2)} interleaved rounds), "
             "BPF ns per sample from `kernel.bpf_stats_enabled` (program time over the run / the target's "
             "getppid() calls).", "",
             "| what | without the recorder | with it (256 events/thread) | recorder's cost |",
             "|---|---|---|---|",
             f"| isolated: same program twice, side by side in one run | {iso['without']:.1f} ns | "
             f"{iso['with']:.1f} ns | **{iso['cost']:.1f} ns** |"]
    for m, r in modes.items():
        off, on = r[0], r[DEFAULT_HISTORY_LEN]
        lines.append(f"| {m} mode, `{MODE_PROGS[m]}` | {off:.0f} ns | {on:.0f} ns | {on - off:+.0f} ns "
                     "(sequential runs: noisy) |")
    per = persistence(tmp)
    lines += ["", "The daemon's saved history (`persist_history_seconds`; daemon/historyfile.py) of every "
              f"syscall sample of `{' '.join(PERSIST_CMD)}` (unwind mode): {per['events']:,.0f} events, "
              f"{per['contexts']:,.0f} distinct contexts.", "",
              "| form | bytes | bytes/event | ratio to the raw records |", "|---|---|---|---|"]
    for label, key in (("raw BPF records (56 bytes each, contexts not decoded)", "raw"),
                       ("decoded events as JSON lines (frames inline)", "json"),
                       ("bidirectional codes in memory (per-field streams, no context table)", "codes"),
                       ("the file: codes + context table, zlib", "file")):
        lines.append(f"| {label} | {per[key]:,.0f} | {per[key] / per['events']:.1f} | "
                     f"{per['raw'] / per[key]:.1f}x |")
    lines += ["", f"Cost per event (Python, this machine): append {per['append_us']:.2f} µs, save (encode + "
              f"zlib + atomic write) {per['save_us']:.2f} µs, load {per['load_us']:.2f} µs; a cursor step "
              f"(forward or backward, in place) {per['step_ns']:.0f} ns."]
    table = "\n".join(lines)
    print(table)
    if args.update_readme and not update_readme_section("history", table):
        print("README.md has no <!-- bench:history --> section", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
