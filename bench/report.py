"""The evaluation report of issue 8: the Valence paper's measurements (section 6: Table 1, Figures
4-7) redone live with ccprofd on installed binaries, in one command.

    .venv/bin/python bench/report.py [--reduced] [--out DIR]      (as root: BPF)
    make bench          full report into docs/ (results.md, results-summary.md, results.json, *.png)
    make bench-ci       reduced report into a temporary directory (what CI runs)

Sections (each one degrades to "not measured: <reason>" instead of failing the report):

1. static statistics per binary (report_static.py);
2. per workload (report_workloads.py): untraced runs; every direct call site probed (call counts,
   edge weights, cost); ``bpf_get_stack`` at every syscall; ccprofd instrumented mode (default Valence
   plan, PCCE and HCCE plans maintained live, hot-edge zero codes from the counted weights,
   ``--scope``) and unwind mode (with CPU-clock
   samples); ``strace -f -k`` of the same command, which is also the correctness oracle; encoding
   lengths of every sample re-encoded under PCCE/Valence/HCCE (report_encode.py); userspace decode
   cost;
3. query cost in BPF against stack depth (bench/unwind.py's getppid program at several depths).

All numbers in the written files come from this run (results.json holds them raw); nothing is typed
by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(REPO))

from report_bpf import (  # noqa: E402
    Baselines,
    bpf_stats_enabled,
    jsonable,
    owned_prog_stats,
    run_untraced,
    stats_delta,
)
from report_encode import decode_cost, encoding_lengths, plans_for  # noqa: E402
from report_fidelity import fidelity, strace_oracle  # noqa: E402
from report_static import binary_stats  # noqa: E402
from report_trace import NotMeasured, Tracer, TraceRun  # noqa: E402
from report_workloads import Workload, table1_binaries, workloads  # noqa: E402

from ccprofd.callgraph import analyze_binary  # noqa: E402

# This bench measures the sample program on raw_syscalls:sys_enter (`uw_sys_enter`/`ccprof_sys_enter`),
# the path of `syscalls = "all"` and of large sets: its one-syscall sets would otherwise go on their
# own syscalls:sys_enter_<name> event (ccprofd/kbpf/syscall_entry.py), which bench/syscall_attach.py
# measures against the raw path.
os.environ.setdefault("CCPROFD_SYSCALL_ATTACH", "raw")

SCHEMES = ("pcce", "valence", "hcce")
CPU_SAMPLE_HZ = 499


def log(msg: str) -> None:
    print(f"[report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def not_measured(exc: BaseException) -> dict[str, str]:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return {"not_measured": text[:300]}


@contextlib.contextmanager
def section(name: str, sink: dict[str, Any], key: str) -> Iterator[None]:
    """Run a part of the report; an exception becomes ``{"not_measured": reason}`` under ``key``."""
    t0 = time.perf_counter()
    try:
        yield
    except (NotMeasured, OSError, RuntimeError, ValueError, KeyError, TimeoutError, ImportError) as exc:
        log(f"{name}: not measured: {exc}")
        if os.environ.get("CCPROFD_REPORT_DEBUG"):
            traceback.print_exc()
        sink[key] = not_measured(exc)
    finally:
        log(f"{name}: {time.perf_counter() - t0:.1f} s")


def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, IndexError):
        mem = f"{int(Path('/proc/meminfo').read_text().split()[1]) / 2**20:.0f} GiB"
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    return {
        "host": platform.node() or "host",
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_start": os.getloadavg()[0],
        "commit": commit + ("+dirty" if dirty else ""),
    }


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


# ------------------------------------------------------------------------------------- static
def run_static(reduced: bool) -> list[dict[str, Any]]:
    rows = []
    for label, path in table1_binaries(reduced):
        out: dict[str, Any] = {"binary": label, "path": path}
        with section(f"static {label}", out, "result"):
            out = binary_stats(
                path,
                name=label,
                enumerate_limit=10**6 if reduced else 10**8,
                samples=10**5 if reduced else 10**6,
            )
            log(
                f"static {label}: {out['nodes']} nodes, {out['stacktags']['paths']} root paths "
                f"({out['stacktags']['method']})"
            )
        rows.append(out)
    return rows


# ------------------------------------------------------------------------------------- workloads
def _timed_runs(fn: Callable[[], tuple[float, float]], repeat: int) -> dict[str, Any]:
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = fn()
        walls.append(w)
        cpus.append(c)
    return {"seconds": median(walls), "cpu": median(cpus), "runs": walls, "cpu_runs": cpus}


def _traced(w: Workload, tracer: Tracer, repeat: int) -> tuple[dict[str, Any], list[TraceRun]]:
    """Run every invocation ``repeat`` times under one prepared tracer; samples of the first round."""
    rounds: list[list[TraceRun]] = []
    for _ in range(repeat):
        rounds.append(
            [tracer.run(argv, stdin=w.stdin, env=w.env, keep_samples=not rounds) for argv in w.invocations]
        )
    for runs in rounds:
        for r in runs:
            if r.exit_code != 0:
                raise RuntimeError(f"{w.name}: traced command exited with {r.exit_code}")
    walls = [sum(r.seconds for r in runs) for runs in rounds]
    cpus = [sum(r.cpu for r in runs) for runs in rounds]
    first = rounds[0]
    counters: dict[str, int] = {}
    for r in first:
        for k, v in r.counters.items():
            counters[k] = counters.get(k, 0) + v
    bpf: dict[str, list[int]] = {}
    for r in first:
        for k, (t, c) in r.bpf.items():
            acc = bpf.setdefault(k, [0, 0])
            acc[0] += t
            acc[1] += c
    return (
        {
            "seconds": median(walls),
            "cpu": median(cpus),
            "runs": walls,
            "cpu_runs": cpus,
            "prepare_seconds": tracer.prepare_seconds,
            "probe_hits": sum(r.probe_hits for r in first),
            "samples": sum(len(r.samples) for r in first),
            "incomplete": counters.get("incomplete", 0),
            "counters": counters,
            "bpf": bpf,
        },
        first,
    )


def run_workload(
    w: Workload, baselines: Baselines | None, repeat: int, untraced_repeat: int
) -> dict[str, Any]:
    res: dict[str, Any] = {
        "name": w.name,
        "binary": w.binary,
        "description": w.description,
        "recursive": w.recursive,
        "group": w.group,
        "scope": w.scope,
        "invocations": [
            " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv)) for argv in w.invocations
        ],
        "variants": {},
    }
    variants: dict[str, Any] = res["variants"]
    graph = analyze_binary(w.binary)
    plans = plans_for(graph)

    def untraced_once() -> tuple[float, float]:
        ts = [run_untraced(argv, stdin=w.stdin, env=w.env) for argv in w.invocations]
        return sum(t.seconds for t in ts), sum(t.cpu for t in ts)

    with section(f"{w.name}: untraced", variants, "untraced"):
        variants["untraced"] = _timed_runs(untraced_once, untraced_repeat)

    weights: dict[tuple[int, int, int], int] | None = None
    if baselines is None:
        variants["every_call"] = variants["get_stack"] = {
            "not_measured": "baseline BPF programs did not load"
        }
    else:
        with section(f"{w.name}: every call site", variants, "every_call"):
            baselines.set_binary(w.binary, graph)
            results = []

            def count_once() -> tuple[float, float]:
                rs = [baselines.count_calls(argv, stdin=w.stdin, env=w.env) for argv in w.invocations]
                results.append(rs)
                return sum(r.seconds for r in rs), sum(r.cpu for r in rs)

            variants["every_call"] = _timed_runs(count_once, repeat)
            counted = results[0]
            weights = {}
            for r in counted:
                for k, v in (r.weights or {}).items():
                    weights[k] = weights.get(k, 0) + v
            res["calls"] = sum(r.calls or 0 for r in counted)
            res["syscalls"] = sum(r.syscalls for r in counted)
            res["calls_per_syscall"] = res["calls"] / res["syscalls"] if res["syscalls"] else None
            res["call_sites_probed"] = len(baselines.sites)
            variants["every_call"]["probe_hits"] = res["calls"]
        with section(f"{w.name}: bpf_get_stack", variants, "get_stack"):
            stacks: list[Any] = []

            def stack_once() -> tuple[float, float]:
                rs = [baselines.get_stack(argv, stdin=w.stdin, env=w.env) for argv in w.invocations]
                stacks.append(rs)
                return sum(r.seconds for r in rs), sum(r.cpu for r in rs)

            variants["get_stack"] = _timed_runs(stack_once, repeat)
            n = sum(r.stacks or 0 for r in stacks[0])
            variants["get_stack"]["frames_per_stack"] = (
                (sum(r.frames or 0 for r in stacks[0]) / n) if n else None
            )
            variants["get_stack"]["ringbuf_full"] = sum(r.ringbuf_full or 0 for r in stacks[0])

    samples: dict[str, list[list[dict[str, Any]]]] = {}
    specs: list[tuple[str, dict[str, Any]]] = [
        ("instrumented", {}),
        # Per-scheme instrumentation cost (Figure 6's PCCE/HCCE bars): the same mode, other plans.
        ("instrumented_pcce", {"encoding": "pcce"}),
        ("instrumented_hcce", {"encoding": "hcce"}),
        ("instrumented_hot", {"weights": weights} if weights else {}),
        ("instrumented_scope", {}),
        ("unwind", {"variant": "unwind", "sample_hz": CPU_SAMPLE_HZ}),
    ]
    for name, kw in specs:
        if name == "instrumented_hot" and not weights:
            variants[name] = {"not_measured": "no edge weights (the every-call-site run did not complete)"}
            continue
        if name == "instrumented_scope":
            scope = w.scope or pick_scope([s for lst in samples.get("instrumented", []) for s in lst])
            res["scope"] = scope
            if scope is None:
                variants[name] = {"not_measured": "no function to scope to (no samples with frames)"}
                continue
            kw = {"scope": scope}
        with section(f"{w.name}: {name}", variants, name):
            with Tracer(w.binary, **kw) as tracer:
                summary, first = _traced(w, tracer, repeat)
            variants[name] = summary
            if name in ("instrumented", "instrumented_pcce", "instrumented_hcce", "unwind"):
                samples[name] = [r.samples for r in first]  # per invocation

    untraced = variants.get("untraced", {})
    calls = res.get("calls")
    for name, v in variants.items():
        if "seconds" in v and "seconds" in untraced and untraced["seconds"] > 0:
            v["ratio_wall"] = v["seconds"] / untraced["seconds"]
            v["ratio_cpu"] = v["cpu"] / untraced["cpu"] if untraced["cpu"] > 0 else None
        if calls and "probe_hits" in v and name.startswith("instrumented"):
            v["hits_per_1000_calls"] = 1000 * v["probe_hits"] / calls

    # strace -f -k: cost and correctness oracle in one run per invocation.
    res["fidelity"] = {}
    if samples:
        with section(f"{w.name}: strace -f -k", variants, "strace"):
            names = sorted(
                {
                    str(s["syscall"])
                    for runs in samples.values()
                    for lst in runs
                    for s in lst
                    if s.get("syscall")
                }
            )
            oracles = [strace_oracle(argv, names, stdin=w.stdin, env=w.env) for argv in w.invocations]
            variants["strace"] = {
                "seconds": sum(o.timing.seconds for o in oracles),
                "cpu": sum(o.timing.cpu for o in oracles),
                "runs": 1,
                "note": "strace and target CPU together; one run",
            }
            if "seconds" in untraced:
                variants["strace"]["ratio_wall"] = variants["strace"]["seconds"] / untraced["seconds"]
                variants["strace"]["ratio_cpu"] = variants["strace"]["cpu"] / untraced["cpu"]
            for mode, runs in samples.items():
                fids = [fidelity(sub, o.trace, w.binary) for sub, o in zip(runs, oracles, strict=True)]
                res["fidelity"][mode] = _merge_fidelity(fids)
    else:
        variants["strace"] = {"not_measured": "no ccprofd samples to compare against"}

    # Encoding lengths under every scheme, at the syscalls (instrumented run) and CPU samples (unwind).
    with section(f"{w.name}: encoding lengths", res, "lengths"):
        lens = encoding_lengths([s for lst in samples.get("instrumented", []) for s in lst], graph, plans)
        cpu = [s for lst in samples.get("unwind", []) for s in lst if s.get("event") == "cpu"]
        cpu_lens = encoding_lengths(cpu, graph, plans)
        res["lengths"] = _lengths_json(lens, "syscall")
        res["lengths_cpu"] = _lengths_json(cpu_lens, "cpu")
        res["decode_ns"] = decode_cost(plans, lens.contexts)
        res["plan_words"] = {s: plans[s]["acyc_words"] for s in SCHEMES}
        res["rec_code_bits"] = {s: plans[s]["rec_code_bits"] for s in SCHEMES}
    return res


def pick_scope(samples: Sequence[dict[str, Any]]) -> str | None:
    """A ``--scope`` for the workload chosen from its own samples: the analysed function (not the
    outermost frame) on the stack of the share of samples closest to one half -- a part of the
    program that makes syscalls, below which only the call graph is instrumented."""
    counts: dict[str, int] = {}
    n = 0
    for s in samples:
        names = {f["function"] for f in s.get("frames", [])[1:] if f.get("analysed") and f.get("function")}
        if s.get("complete") and names:
            n += 1
            for name in names:
                counts[name] = counts.get(name, 0) + 1
    if not counts:
        return None
    best = min(sorted(counts), key=lambda k: abs(counts[k] / n - 0.5))
    return "^" + re.escape(best) + "$"


def _merge_fidelity(fids: Sequence[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fids:
        for k, v in f.to_json().items():
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
            elif k == "examples":
                out.setdefault(k, []).extend(v)
    out["fraction_equal"] = out["equal"] / out["compared"] if out.get("compared") else None
    out["examples"] = out.get("examples", [])[:3]
    return out


def _lengths_json(lens: Any, event: str) -> dict[str, Any]:
    d = lens.to_json()
    d["average"] = {k: lens.average(event, k) for k in ("plain", "segments", *SCHEMES)}
    d["max"] = {k: lens.maximum(event, k) for k in ("plain", "segments", *SCHEMES)}
    return d


# -------------------------------------------------------------------------------- query cost
def idle_cost(prog: str, seconds: float = 1.0) -> float | None:
    """ns per run of a syscall program while it tracks nothing: the filter cost every other process's
    syscalls pay (and add to its run time)."""
    before = owned_prog_stats()
    time.sleep(seconds)
    t, c = stats_delta(before, owned_prog_stats(), prog)
    return t / c if c else None


def per_sample(run_ns: int, runs: int, samples: int, idle: float | None) -> float | None:
    """BPF ns per sample: the program's run time over the samples, less the filter-only runs."""
    if not samples:
        return None
    others = max(0, runs - samples) * (idle or 0.0)
    return max(0.0, run_ns - others) / samples


def run_query(baselines: Baselines | None, reduced: bool, work: Path) -> dict[str, Any]:
    """BPF time per sample at getppid() against stack depth: instrumented mode's context read, unwind
    mode's CFI walk + encoding, bpf_get_stack's frame-pointer walk (same program, same depths)."""
    from unwind import OUTSIDE_FRAMES, build_program  # bench/unwind.py

    depths = (6, 32, 104, 1000) if reduced else (6, 32, 104, 1000, 4000)
    calls = 2000 if reduced else 20000

    def calls_at(depth: int) -> int:
        """Fewer calls on deep stacks: the tracer decodes every sample, thousands of frames each."""
        return max(200, min(calls, 2_000_000 // depth))

    binary = build_program(work)
    go = work / "go.txt"
    go.write_text("x")
    graph = analyze_binary(str(binary))
    plans = plans_for(graph)
    out: dict[str, Any] = {"depths": list(depths), "calls": calls, "rows": {}}
    rows: dict[int, dict[str, Any]] = {d: {} for d in depths}
    variant_args: list[tuple[str, dict[str, Any]]] = [("instrumented", {}), ("unwind", {"variant": "unwind"})]
    for variant, kw in variant_args:
        prog = "ccprof_sys_enter" if variant == "instrumented" else "uw_sys_enter"
        try:
            with Tracer(str(binary), syscalls="getppid", **kw) as tracer:
                idle = idle_cost(prog)
                out[f"{variant}_filter_ns"] = idle
                for d in depths:
                    argv = [str(binary), str(d - OUTSIDE_FRAMES), str(calls_at(d))]
                    r = tracer.run(argv, stdin=str(go), keep_samples=50)
                    t, c = r.bpf.get(prog, (0, 0))
                    n = r.counters.get("samples", 0)
                    row = rows[d]
                    row["calls"] = calls_at(d)
                    row[f"{variant}_bpf_ns"] = per_sample(t, c, n, idle)
                    row[f"{variant}_wall_ns_per_call"] = 1e9 * r.seconds / calls_at(d)
                    if variant == "instrumented":
                        lens = encoding_lengths(r.samples, graph, plans)
                        row["valence_words"] = lens.average("syscall", "valence")
                        row["pcce_words"] = lens.average("syscall", "pcce")
                        row["frames"] = lens.average("syscall", "plain")
                    r.samples.clear()
        except (NotMeasured, RuntimeError, OSError) as exc:
            out[f"{variant}_not_measured"] = not_measured(exc)["not_measured"]
    if baselines is not None:
        baselines.module.attach_raw_tracepoint("sys_enter", "bl_sys_stack")
        try:
            idle = idle_cost("bl_sys_stack")
        finally:
            baselines.module.detach_raw_tracepoint("sys_enter")
        out["get_stack_filter_ns"] = idle
        for d in depths:
            argv = [str(binary), str(d - OUTSIDE_FRAMES), str(calls_at(d))]
            before = owned_prog_stats()
            gs = baselines.get_stack(argv, stdin=str(go))
            t, c = stats_delta(before, owned_prog_stats(), "bl_sys_stack")
            rows[d]["get_stack_bpf_ns"] = per_sample(t, c, gs.stacks or 0, idle)
            rows[d]["get_stack_frames"] = (gs.frames or 0) / gs.stacks if gs.stacks else None
            rows[d]["get_stack_wall_ns_per_call"] = 1e9 * gs.seconds / calls_at(d)
    for d in depths:
        rows[d]["untraced_wall_ns_per_call"] = (
            1e9
            * run_untraced(
                [str(binary), str(d - OUTSIDE_FRAMES), str(calls_at(d))], stdin=str(go), check=False
            ).seconds
            / calls_at(d)
        )
    out["rows"] = {str(d): r for d, r in rows.items()}
    return out


# ------------------------------------------------------------------------------------------ main
def save(results: dict[str, Any], out: Path) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(jsonable(results), indent=1, default=str) + "\n")
    tmp.replace(out / "results.json")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reduced", action="store_true", help="small inputs, fewer repeats (CI)")
    ap.add_argument("--out", default=str(REPO / "docs"), help="output directory (default: docs/)")
    ap.add_argument("--work", default=None, help="directory for generated inputs (default: a temp dir)")
    ap.add_argument("--only", default=None, help="comma-separated workload names (default: all)")
    ap.add_argument("--no-static", action="store_true", help="skip Table 1")
    ap.add_argument("--no-query", action="store_true", help="skip the query-cost runs")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/report.py: needs root (BPF)", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work_ctx = (
        contextlib.nullcontext(args.work)
        if args.work
        else tempfile.TemporaryDirectory(prefix="ccprofd-report-")
    )
    results: dict[str, Any] = {"meta": machine_info()}
    meta = results["meta"]
    meta["reduced"] = args.reduced
    meta["command"] = "make bench-ci" if args.reduced else "make bench"
    repeat, untraced_repeat = (1, 2) if args.reduced else (2, 5)
    meta["repeat"] = repeat
    meta["untraced_repeat"] = untraced_repeat
    meta["cpu_sample_hz"] = CPU_SAMPLE_HZ
    meta["tools"] = {t: shutil.which(t) for t in ("strace", "bpftool", "sqlite3", "lua5.4", "gzip", "xz")}
    with work_ctx as work_dir:
        work = Path(work_dir)
        if not args.no_static:
            results["static"] = run_static(args.reduced)
        wls = workloads(work / "inputs", args.reduced)
        if args.only:
            keep = set(args.only.split(","))
            wls = [w for w in wls if w.name in keep]
        with bpf_stats_enabled():
            baselines: Baselines | None
            try:
                baselines = Baselines()
            except Exception as exc:
                log(f"baseline BPF programs: {exc}")
                baselines = None
            results["workloads"] = []
            for w in wls:
                log(f"workload {w.name}")
                entry: dict[str, Any] = {"name": w.name}
                with section(f"workload {w.name}", entry, "error"):
                    entry = run_workload(w, baselines, repeat, untraced_repeat)
                results["workloads"].append(entry)
                save(results, out)  # a killed run still leaves what it measured
            if not args.no_query:
                q: dict[str, Any] = {}
                with section("query cost", q, "result"):
                    q = run_query(baselines, args.reduced, work)
                results["query"] = q
            if baselines is not None:
                baselines.close()
    meta["load_end"] = os.getloadavg()[0]
    meta["duration_seconds"] = time.perf_counter() - t_start
    save(results, out)
    from report_render import render

    render(results, out)
    log(f"report written to {out} in {meta['duration_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
