"""Benchmark of the daemon (issue 6): cost of tracking a syscall-heavy process, start-up and stop.

Workload (bench/daemon_workload.c): write(2) to /dev/null at --rate calls/s for --seconds from three
calling contexts, gated on stdin so the tracer is attached first.  Cases, in one run:

* untraced;
* under the real ``ccprofd run --config`` daemon (a ``path`` target on the workload binary), once per
  tracer mode (unwind = default, instrumented): daemon CPU (utime+stime from /proc/PID/stat over the
  workload's run plus the drain of its samples, as % of one core), RSS (VmRSS sampled every 0.5-1 s,
  VmHWM at the end), ``ccprofd_samples_dropped_total``, /metrics scrape latency (one GET every 2 s
  during the run; those scrapes are part of the CPU figure), and per-context counts from
  ``GetHotContexts`` against the counts the workload itself made;
* under bcc's ``syscount-bpfcc -p PID`` (the baseline the issue names), measured the same way.

Start-up: ``ccprofd run`` exec to READY=1 on a ``NOTIFY_SOCKET`` the bench binds, for a
``/usr/bin/python3.11`` path target, cold (empty state_dir) and warm (the cache the cold run filled).
Stop: SIGTERM to process exit, then every BPF link and program id the daemon held (read from
/proc/PID/fdinfo before the signal) is checked to be gone from the kernel (``bpftool``).

Usage: .venv/bin/python bench/daemon.py [--seconds 60] [--rate 10000] [--update-readme]
Needs root (BPF), gcc, bpftool, and bpfcc-tools for the baseline (skipped with a note if absent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import ROOT, cpu_seconds, machine_line, status_mb, update_readme_section

sys.path.insert(0, str(ROOT / "tests"))  # the daemon harness the end-to-end tests use
from daemon_fakes import config_text, wait_for
from daemon_harness import RunningDaemon, target_toml

WORKLOAD_SRC = Path(__file__).resolve().parent / "daemon_workload.c"
SYSCOUNT = "/usr/sbin/syscount-bpfcc"
TARGETS = {"cpu_pct": 5.0, "rss_mb": 200.0, "scrape_ms": 100.0, "startup_s": 1.0, "stop_s": 2.0}
SCRAPE_EVERY_S = 2.0


# ------------------------------------------------------------------------------------ /proc
# ---------------------------------------------------------------------------------- daemon
DAEMON_SETTINGS = 'top_k = 20\nlog_level = "info"'


def start_daemon(workdir: str, name: str, path: str, mode: str) -> RunningDaemon:
    """``ccprofd run`` on one ``path`` target tracing write(2); returns once READY=1 arrived
    (``ready_s``: exec to READY=1)."""
    target = target_toml(name, f'path = "{path}"', ["write"], mode)
    return RunningDaemon(workdir, config_text(workdir, target, daemon_extra=DAEMON_SETTINGS))


def stop_daemon(daemon: RunningDaemon) -> dict[str, Any]:
    """SIGTERM; seconds to exit; how many links/programs it held and how many the kernel still has."""
    stopped = daemon.stop()
    return {
        "stop_s": stopped.stop_s,
        "returncode": stopped.returncode,
        "links": len(stopped.held.links),
        "progs": len(stopped.held.all_progs),
        "left": len(stopped.left_links) + len(stopped.left_progs),
    }


# -------------------------------------------------------------------------------- workload
@dataclass
class WorkloadResult:
    made: int
    per_context: dict[str, int]
    wall_s: float
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.made / self.wall_s


def build_workload(out_dir: str) -> Path:
    binary = Path(out_dir) / "daemon_workload"
    # No sibling-call optimisation: every frame (emit > phase_* > main) stays on the stack.
    subprocess.run(
        ["gcc", "-O2", "-g", "-fno-optimize-sibling-calls", "-o", str(binary), str(WORKLOAD_SRC)], check=True
    )
    return binary


def launch_workload(binary: Path, rate: int, seconds: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [str(binary), str(rate), str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if line[:1] != ["ready"]:
        raise RuntimeError(f"workload did not start: {line}")
    return proc, int(line[1])


def finish_workload(proc: subprocess.Popen[str]) -> WorkloadResult:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    proc.wait(timeout=60)
    if line[:1] != ["done"]:
        raise RuntimeError(f"workload failed: {line}")
    kv = dict(item.split("=") for item in line[1:])
    return WorkloadResult(
        int(kv["made"]),
        {k: int(kv[k]) for k in "abc"},
        float(kv["wall"]),
        float(kv["utime"]) + float(kv["stime"]),
    )


class Monitor(threading.Thread):
    """Samples a tracer's RSS (every 0.5 s, or 1 s without scrapes); scrapes /metrics every 2 s."""

    def __init__(self, pid: int, metrics_url: str | None) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.metrics_url = metrics_url
        self.rss: list[float] = []
        self.scrape_ms: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        next_scrape = time.monotonic()
        while not self.stop.wait(1.0 if self.metrics_url is None else 0.5):
            try:
                self.rss.append(status_mb(self.pid, "VmRSS"))
            except OSError:
                return
            if self.metrics_url is not None and time.monotonic() >= next_scrape:
                next_scrape += SCRAPE_EVERY_S
                t0 = time.perf_counter()
                with urllib.request.urlopen(self.metrics_url, timeout=30) as resp:
                    resp.read()
                self.scrape_ms.append((time.perf_counter() - t0) * 1000)


@dataclass
class Case:
    name: str
    workload: WorkloadResult
    tracer_cpu_pct: float | None = None
    rss_steady_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_anon_mb: float | None = None  # of the RSS, anonymous memory (the rest is mapped files: bcc/LLVM)
    dropped: dict[str, int] | None = None  # by reason
    scrape_ms: list[float] = field(default_factory=list)
    counted: dict[str, int] | None = None
    counts_ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def classify(frames: list[str]) -> str | None:
    """Which workload context a decoded frame list is (None: the workload's printf or something else)."""
    if "emit" not in frames:
        return None
    if "helper_c" in frames:
        return "c"
    if "phase_b" in frames:
        return "b"
    if "phase_a" in frames:
        return "a"
    return None


def hot_counts(daemon: RunningDaemon, target: str) -> tuple[dict[str, int], int, int]:
    """(per-context write counts, contexts incomplete, total) from GetHotContexts."""
    from ccprofd.export.gen import ccprofd_pb2 as pb

    resp = daemon.stub.GetHotContexts(
        pb.GetHotContextsRequest(target=target, top_k=50, syscall="write"), timeout=30
    )
    out = {"a": 0, "b": 0, "c": 0}
    incomplete = 0
    for h in resp.contexts:
        kind = classify([f.function for f in h.frames])
        if kind is not None:
            out[kind] += int(h.count)
        if not h.complete:
            incomplete += int(h.count)
    return out, incomplete, int(resp.total_samples)


def dropped_samples(daemon: RunningDaemon, target: str) -> dict[str, int]:
    """``ccprofd_samples_dropped_total`` of ``target`` by reason (non-zero ones)."""
    out: dict[str, int] = {}
    for labels, value in daemon.metric_samples("ccprofd_samples_dropped_total"):
        if labels.get("target") == target and value:
            reason = labels.get("reason", "?")
            out[reason] = out.get(reason, 0) + int(value)
    return out


def run_untraced(binary: Path, rate: int, seconds: float) -> Case:
    proc, _ = launch_workload(binary, rate, seconds)
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return Case("untraced", finish_workload(proc))


@dataclass
class DaemonRun:
    """One workload run under a daemon (:func:`run_under_daemon`)."""

    result: WorkloadResult
    pid: int
    daemon_cpu_s: float  # the daemon's CPU over the workload's run and the drain


def run_under_daemon(daemon: RunningDaemon, target: str, binary: Path, rate: int, seconds: float, *,
                     before: Callable[[int], None] | None = None,
                     started: Callable[[], None] | None = None,
                     drain_timeout: float = 60) -> DaemonRun:
    """Launch the workload held at its start, wait until ``daemon`` tracks it, call ``before(pid)``,
    release it (then ``started()``), and wait until the daemon's counts of ``target`` reach the
    writes made (or ``drain_timeout``, said on stderr): the part every daemon bench shares."""
    proc, pid = launch_workload(binary, rate, seconds)
    daemon.wait_tracked(pid, timeout=60)
    if before is not None:
        before(pid)
    cpu0 = cpu_seconds(daemon.proc.pid)
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    if started is not None:
        started()
    result = finish_workload(proc)

    def drained() -> bool:
        return all(hot_counts(daemon, target)[0][k] >= result.per_context[k] for k in "abc")

    try:
        wait_for(drained, timeout=drain_timeout, interval=0.1)
    except AssertionError:
        print(f"  the daemon did not count every sample within {drain_timeout:g} s", file=sys.stderr)
    return DaemonRun(result, pid, cpu_seconds(daemon.proc.pid) - cpu0)


def run_daemon_case(binary: Path, rate: int, seconds: float, mode: str) -> Case:
    workdir = tempfile.mkdtemp(prefix="ccd-bench-", dir="/tmp")
    try:
        daemon = start_daemon(workdir, "wl", str(binary), mode)
        monitor = Monitor(daemon.proc.pid, daemon.metrics_url())
        run = run_under_daemon(daemon, "wl", binary, rate, seconds, started=monitor.start)
        result = run.result
        monitor.stop.set()
        monitor.join()
        counted, incomplete, total = hot_counts(daemon, "wl")
        case = Case(
            f"ccprofd run ({mode})",
            result,
            tracer_cpu_pct=100 * run.daemon_cpu_s / result.wall_s,
            rss_steady_mb=statistics.median(monitor.rss) if monitor.rss else None,
            rss_peak_mb=status_mb(daemon.proc.pid, "VmHWM"),
            rss_anon_mb=status_mb(daemon.proc.pid, "RssAnon"),
            dropped=dropped_samples(daemon, "wl"),
            scrape_ms=monitor.scrape_ms,
            counted=counted,
            counts_ok=counted == result.per_context,
            extra={"incomplete": incomplete, "total_writes": total, "ready_s": daemon.ready_s},
        )
        case.extra.update(stop_daemon(daemon))
        return case
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_syscount(binary: Path, rate: int, seconds: float) -> Case | None:
    if not os.access(SYSCOUNT, os.X_OK):
        return None
    proc, pid = launch_workload(binary, rate, seconds)
    tool = subprocess.Popen(
        [SYSCOUNT, "-p", str(pid)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        # A bench started in the background by a non-interactive shell inherits SIGINT ignored, and
        # syscount (Python) then never sees the Ctrl-C it stops and prints its counts on.
        preexec_fn=_default_sigint,
    )
    assert tool.stdout is not None and proc.stdin is not None
    banner = tool.stdout.readline()
    if "Tracing" not in banner:
        raise RuntimeError(f"syscount did not start: {banner}")
    monitor = Monitor(tool.pid, None)
    cpu0 = cpu_seconds(tool.pid)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    monitor.start()
    result = finish_workload(proc)
    cpu1 = cpu_seconds(tool.pid)
    peak = status_mb(tool.pid, "VmHWM")
    anon = status_mb(tool.pid, "RssAnon")
    monitor.stop.set()
    monitor.join()
    tool.send_signal(signal.SIGINT)
    out = tool.communicate(timeout=60)[0]
    writes = next((int(line.split()[-1]) for line in out.splitlines() if line.split()[:1] == ["write"]), 0)
    # syscount counts every write, the workload's final printf included; contexts are not its business.
    return Case(
        "bcc syscount -p PID",
        result,
        tracer_cpu_pct=100 * (cpu1 - cpu0) / result.wall_s,
        rss_steady_mb=statistics.median(monitor.rss) if monitor.rss else None,
        rss_peak_mb=peak,
        rss_anon_mb=anon,
        counts_ok=writes == result.made + 1,
        extra={"writes": writes},
    )


# --------------------------------------------------------------------------------- start-up
def run_startup(mode: str, warm_repeat: int) -> dict[str, Any]:
    """READY=1 time for a python3.11 path target: cold (empty state_dir), then warm runs."""
    workdir = tempfile.mkdtemp(prefix="ccd-bench-", dir="/tmp")
    try:
        cold = start_daemon(workdir, "py", "/usr/bin/python3.11", mode)
        cold_stop = stop_daemon(cold)
        warm: list[float] = []
        stops = [cold_stop]
        for _ in range(warm_repeat):
            d = start_daemon(workdir, "py", "/usr/bin/python3.11", mode)
            warm.append(d.ready_s)
            stops.append(stop_daemon(d))
        return {"cold_s": cold.ready_s, "warm_s": statistics.median(warm), "stops": stops}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------- report
def mark(ok: bool | None) -> str:
    return "" if ok is None else " ✓" if ok else " ✗"


def render(cases: list[Case], startup: dict[str, dict[str, Any]], rate: int, seconds: float) -> str:
    def fmt(v: float | None, spec: str, unit: str = "") -> str:
        return "—" if v is None else f"{v:{spec}}{unit}"

    base = cases[0].workload
    head = "| | " + " | ".join(c.name for c in cases) + " | target |"
    rows = [head, "|" + "---|" * (len(cases) + 2)]

    def row(label: str, cells: list[str], target: str = "") -> None:
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {target} |")

    row("workload writes made", [f"{c.workload.made:,}" for c in cases])
    row("workload rate achieved", [f"{c.workload.rate:,.0f}/s" for c in cases], f"{rate:,}/s")
    row("workload CPU (own)", [f"{100 * c.workload.cpu_s / c.workload.wall_s:.1f}%" for c in cases])
    row("workload wall vs untraced", [f"{c.workload.wall_s / base.wall_s:.3f}×" for c in cases])
    row(
        "tracer CPU, % of one core",
        [
            "—"
            if c.tracer_cpu_pct is None
            else fmt(c.tracer_cpu_pct, ".2f", "%")
            + (mark(c.tracer_cpu_pct <= TARGETS["cpu_pct"]) if "ccprofd" in c.name else "")
            for c in cases
        ],
        f"≤ {TARGETS['cpu_pct']:.0f}%",
    )
    row(
        "tracer RSS steady (median VmRSS)",
        [
            fmt(c.rss_steady_mb, ".0f", " MB")
            + (mark((c.rss_steady_mb or 0) <= TARGETS["rss_mb"]) if "ccprofd" in c.name else "")
            for c in cases
        ],
        f"≤ {TARGETS['rss_mb']:.0f} MB",
    )
    row(
        "tracer RSS peak (VmHWM)",
        [
            fmt(c.rss_peak_mb, ".0f", " MB")
            + (mark((c.rss_peak_mb or 0) <= TARGETS["rss_mb"]) if "ccprofd" in c.name else "")
            for c in cases
        ],
        f"≤ {TARGETS['rss_mb']:.0f} MB",
    )
    row("of which anonymous (RssAnon, at the end)", [fmt(c.rss_anon_mb, ".0f", " MB") for c in cases])
    row(
        "samples dropped",
        [
            "—"
            if c.dropped is None
            else f"{sum(c.dropped.values()):,}"
            + "".join(f" ({reason})" for reason in sorted(c.dropped))
            + mark(not c.dropped)
            for c in cases
        ],
        "0",
    )
    row(
        "/metrics scrape median / max",
        [
            f"{statistics.median(c.scrape_ms):.1f} / {max(c.scrape_ms):.1f} ms"
            + mark(max(c.scrape_ms) <= TARGETS["scrape_ms"])
            if c.scrape_ms
            else "—"
            for c in cases
        ],
        f"≤ {TARGETS['scrape_ms']:.0f} ms",
    )

    def counts(c: Case) -> str:
        if c.counted is not None:
            return " / ".join(f"{c.counted[k]:,}" for k in "abc") + mark(c.counts_ok)
        if "writes" in c.extra:
            return f"{c.extra['writes']:,} writes (no contexts)" + mark(c.counts_ok)
        return f"made {' / '.join(f'{c.workload.per_context[k]:,}' for k in 'abc')}"

    row("counts per context a / b / c", [counts(c) for c in cases], "= made")
    row(
        "SIGTERM → exit",
        [
            fmt(c.extra.get("stop_s"), ".2f", " s")
            + (mark(c.extra["stop_s"] <= TARGETS["stop_s"]) if "stop_s" in c.extra else "")
            for c in cases
        ],
        f"≤ {TARGETS['stop_s']:.0f} s",
    )
    row(
        "links/programs left after exit",
        [
            f"{c.extra['left']} of {c.extra['links']}+{c.extra['progs']}{mark(c.extra['left'] == 0)}"
            if "left" in c.extra
            else "—"
            for c in cases
        ],
        "0",
    )
    lines = [
        f"Measured by `bench/daemon.py --seconds {seconds:g} --rate {rate}` on {machine_line()}.",
        "",
        *rows,
        "",
    ]
    lines += [
        "| start-up, `/usr/bin/python3.11` path target | cold (empty state_dir) | warm (cached) "
        "| SIGTERM → exit (max) | links/programs left | target |",
        "|---|---|---|---|---|---|",
    ]
    for mode, s in startup.items():
        stop_max = max(x["stop_s"] for x in s["stops"])
        left = sum(x["left"] for x in s["stops"])
        lines.append(
            f"| {mode} mode | {s['cold_s']:.2f} s "
            f"| {s['warm_s']:.2f} s{mark(s['warm_s'] <= TARGETS['startup_s'])}"
            f" | {stop_max:.2f} s{mark(stop_max <= TARGETS['stop_s'])} | {left}{mark(left == 0)} "
            f"| warm ≤ {TARGETS['startup_s']:.0f} s, stop ≤ {TARGETS['stop_s']:.0f} s |"
        )
    lines += [
        "",
        "Contexts: a = main > phase_a > emit, b = main > phase_b > emit, c = main > phase_b > helper_c > "
        "emit (`bench/daemon_workload.c`), each compared with the count the workload made. Tracer CPU is "
        "utime+stime from /proc/PID/stat over the workload's run and the drain of its samples, divided by "
        f"the run's wall time; it includes one /metrics scrape every {SCRAPE_EVERY_S:g} s. Start-up is "
        "`ccprofd run` exec → READY=1 (interpreter start, imports, analysis/plan from the cache, BPF "
        "compile and attach); warm is the median of 3.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rate", type=int, default=10000)
    ap.add_argument("--modes", default="unwind,instrumented")
    ap.add_argument("--update-readme", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/daemon.py needs root (BPF)")
    modes = [m for m in args.modes.split(",") if m]
    build_dir = tempfile.mkdtemp(prefix="ccd-bench-wl-")
    try:
        binary = build_workload(build_dir)
        cases = [run_untraced(binary, args.rate, args.seconds)]
        print(f"untraced: {cases[-1].workload}", file=sys.stderr)
        for mode in modes:
            cases.append(run_daemon_case(binary, args.rate, args.seconds, mode))
            print(f"{mode}: {cases[-1]}", file=sys.stderr)
        baseline = run_syscount(binary, args.rate, args.seconds)
        if baseline is not None:
            cases.append(baseline)
            print(f"syscount: {baseline}", file=sys.stderr)
        else:
            print(f"(no {SYSCOUNT}: apt-get install bpfcc-tools for the baseline)", file=sys.stderr)
        startup = {}
        for mode in modes:
            startup[mode] = run_startup(mode, 3)
            print(f"startup {mode}: {startup[mode]}", file=sys.stderr)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    table = render(cases, startup, args.rate, args.seconds)
    print(table)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "cases": [c.__dict__ | {"workload": c.workload.__dict__} for c in cases],
                    "startup": startup,
                },
                indent=1,
                default=str,
            )
        )
    if args.update_readme and not update_readme_section("daemon", table):
        print("(README.md has no <!-- bench:daemon --> section; not updated)")


if __name__ == "__main__":
    main()
