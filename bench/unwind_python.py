"""Benchmark: the unwinder's added cost per sample on a real interpreter stack (issue #18).

``python3.11`` runs a loop of N ``os.write`` calls to /dev/null from two Python functions
(~20-40 native frames through the interpreter and libc at each write).  Measured in one run, side
by side:

* untraced wall time;
* unwind-mode sampling of ``write`` (in-kernel aggregation, the production path) with *this*
  tree's unwinder and, with ``--base-repo DIR`` (a checkout of an older commit), with that tree's:
  wall time, BPF ns per sample (``kernel.bpf_stats_enabled``), frames per sample;
* ``perf record --call-graph dwarf`` of the same syscall tracepoint (when perf is installed).

Each traced configuration runs in its own child interpreter whose ``sys.path`` starts at that
repository, so the two unwinders never share a process.

Run as root: ``.venv/bin/python bench/unwind_python.py [--calls N] [--base-repo /tmp/ccprofd-d2220d0]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_line, median, report_main, run_time_stats

# This bench (and its child interpreters) measures the sample program on raw_syscalls:sys_enter
# (`uw_sys_enter`), the path of `syscalls = "all"` and of large sets: its one-syscall set would
# otherwise go on its own syscalls:sys_enter_<name> event (ccprofd/kbpf/syscall_entry.py), which
# bench/syscall_attach.py measures against the raw path.
os.environ.setdefault("CCPROFD_SYSCALL_ATTACH", "raw")

PYTHON = "/usr/bin/python3.11"
NR_WRITE = 1

WORKLOAD = r"""
import os, sys, time
fd = os.open("/dev/null", os.O_WRONLY)
def inner(n):
    for _ in range(n):
        os.write(fd, b"x")
def outer(n):
    inner(n)
n = int(sys.argv[1])
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.read(1)
t0 = time.perf_counter()
outer(n)
print(time.perf_counter() - t0)
"""

# Runs in a child interpreter with the measured repository first on sys.path: only the
# UnwindSampler API that both old and new trees have (constructor, attach, track, stats, close).
CHILD = r"""
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
from ccprofd.tracing.unwind.sampler import UnwindSampler
from bench.report_bpf import owned_prog_stats

calls, repeat, python, workload = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
enc = None
# as `ccprofd trace`/the daemon run it: python3.11 analysed, encoded in BPF
if sys.argv[6].startswith("encoded"):
    from ccprofd.callgraph import analyze_binary
    from ccprofd.encode import get_plan
    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.tracing.unwind.plan import cached_unwind_encoding
    graph = analyze_binary(python)
    enc = cached_unwind_encoding(graph, get_plan(graph, "valence"), AnalysisCache())
uw = UnwindSampler(syscalls=[1], aggregate=True, max_depth=4096, encoding=enc)
uw.attach()
if sys.argv[6].endswith("memo off"):  # this tree's per-thread memo of outer frames switched off
    uw.set_memo("off")
walls, ns, frames, others = [], [], [], []
extra = {}
try:
    for _ in range(repeat):
        s0 = uw.stats()
        p = subprocess.Popen([python, "-c", workload, str(calls)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"ready\n"
        uw.track(p.pid)
        before = owned_prog_stats()
        p.stdin.write(b"x"); p.stdin.close()
        out = p.stdout.read(); p.wait()
        after = owned_prog_stats()
        uw.poll(0)
        s1 = uw.stats()
        samples = s1["samples"] - s0["samples"]
        dt = after["uw_sys_enter"][0] - before["uw_sys_enter"][0]
        walls.append(float(out.split()[-1]))
        ns.append(dt / max(1, samples))
        # the other programs of the sampler (sys_exit, sched tracepoints...) over the same run
        others.append(sum(t - before.get(k, (0, 0))[0] for k, (t, _) in after.items() if k != "uw_sys_enter")
                      / max(1, samples))
        frames.append((s1["frames"] - s0["frames"]) / max(1, samples))
        incomplete = s1["incomplete"] - s0["incomplete"]
        for k in ("lookup_steps", "stack_copies", "map_searches", "memo_frames"):  # absent in older trees
            if k in s1:
                extra.setdefault(k, []).append((s1[k] - s0[k]) / max(1, samples))
finally:
    uw.close()
print(json.dumps({"wall": walls, "ns": ns, "others": others, "frames": frames, "incomplete": incomplete,
                  "samples": samples, "extra": extra}))
"""


def run_workload(calls: int, prefix: list[str] | None = None) -> float:
    """Wall seconds of the loop (measured inside the workload, after start-up)."""
    p = subprocess.Popen([*(prefix or []), PYTHON, "-c", WORKLOAD, str(calls)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline() == b"ready\n"
    p.stdin.write(b"x")
    p.stdin.close()
    out = p.stdout.read()
    p.wait()
    return float(out.split()[-1])


def traced(repo: Path, calls: int, repeat: int, mode: str = "plain") -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(repo))
    argv = [sys.executable, "-c", CHILD, str(repo), str(calls), str(repeat), PYTHON, WORKLOAD, mode]
    out = subprocess.run(argv,
                         check=True, capture_output=True, text=True, env=env, cwd=str(repo)).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"wall": median(r["wall"]), "ns": median(r["ns"]), "others": median(r["others"]),
            "frames": median(r["frames"]),
            "incomplete": r["incomplete"], "samples": r["samples"],
            **{k: median(v) for k, v in r.get("extra", {}).items()}}


def perf_dwarf(calls: int, repeat: int) -> float | None:
    if shutil.which("perf") is None:
        return None
    walls = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(repeat):
            walls.append(run_workload(calls, ["perf", "record", "-q", "-o", f"{d}/perf.data", "-e",
                                              "syscalls:sys_enter_write", "--call-graph", "dwarf", "--"]))
    return median(walls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200000, help="os.write calls per run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base-repo", type=Path,
                    help="a checkout of the commit to compare against (e.g. d2220d0)")
    ap.add_argument("--base-label", default="d2220d0")
    ap.add_argument("--modes", default="plain,encoded",
                    help="comma-separated: plain, encoded, and 'plain memo off', 'encoded memo off' "
                         "(this tree with its per-thread memo of outer frames off)")
    ap.add_argument("--update-readme", action="store_true",
                    help="also write the tables into README.md's bench:unwind_python section")
    args = ap.parse_args()
    if args.base_repo is not None and not (args.base_repo / "ccprofd").is_dir():
        print(f"bench/unwind_python.py: {args.base_repo} is not a ccprofd checkout", file=sys.stderr)
        return 2
    return report_main("unwind_python", measure, args, update_readme=args.update_readme)


def measure(args: argparse.Namespace) -> int:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{machine_line()}, load average {load} at the start")
    here = Path(__file__).resolve().parent.parent
    configs: list[tuple[str, Path]] = [("this tree", here)]
    if args.base_repo is not None:
        configs.append((args.base_label, args.base_repo.resolve()))
    untraced = median([run_workload(args.calls) for _ in range(args.repeat)])
    with run_time_stats():
        results = [(f"{label}, {mode}", traced(repo, args.calls, args.repeat, mode))
                   for mode in args.modes.split(",") for label, repo in configs
                   if "memo" not in mode or repo == here]
    perf = perf_dwarf(args.calls, args.repeat)
    print(f"\n{PYTHON}: {args.calls} os.write() calls from two Python functions, median of {args.repeat} "
          "(wall = the loop's own time; added = (wall - untraced) / calls; BPF ns from bpf_stats run_time_ns "
          "over the samples taken):\n")
    print("| configuration | wall s | added µs/sample | BPF ns/sample | other programs' BPF ns/sample | "
          "frames/sample | "
          "search steps, stack copies, mapping searches /sample | memo frames/sample | incomplete |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| untraced | {untraced:.3f} | | | | | | | |")
    for label, r in results:
        added = (r["wall"] - untraced) / args.calls * 1e6
        work = ", ".join(f"{r[k]:.1f}" for k in ("lookup_steps", "stack_copies", "map_searches") if k in r)
        memo = f"{r['memo_frames']:.1f}" if "memo_frames" in r else "n/a"
        print(f"| unwind ({label}) | {r['wall']:.3f} | {added:.2f} | {r['ns']:.0f} | {r['others']:.0f} | "
              f"{r['frames']:.1f} | "
              f"{work or 'n/a'} | {memo} | {r['incomplete']:.0f} of {r['samples']:.0f} |")
    if perf is not None:
        added = (perf - untraced) / args.calls * 1e6
        print(f"| perf record --call-graph dwarf | {perf:.3f} | {added:.2f} | | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
