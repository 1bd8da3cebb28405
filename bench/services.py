"""Benchmark: a real service under ccprofd, driven by its own load generator (issue 14; redis so far).

Debian's ``redis-server`` is started on a loopback port in a temporary directory (no persistence)
and loaded with ``redis-benchmark`` (GET, SET, LRANGE_100; 50 clients).  In one run, alternating
round by round so drifts of this shared VM hit every configuration alike:

* ``untraced``;
* ``unwind-all``: the real ``ccprofd run`` daemon with redis-server as a ``path`` target, unwind mode,
  ``syscalls = "all"``;
* ``unwind-security``: the same with the security set (execve, openat, connect, accept4, mprotect,
  mmap, clone3, unlinkat, renameat2);
* ``perf-dwarf``: ``perf record -e raw_syscalls:sys_enter --call-graph dwarf -p PID`` (what a user
  reaches for to get the same stacks).

Per configuration: requests/s and p50/p99 latency per test (medians over the rounds), and for the
daemon its CPU (utime+stime during the load, % of one core), peak RSS (VmHWM), dropped samples and
distinct contexts (its /metrics), and the top of ``ccprofctl hot`` (the hot contexts must name
redis' own functions).

Not yet here (issue 14 asks for them): nginx/ab and postgres/pgbench, instrumented mode with
--scope, a frame-pointer baseline, the exactness check against perf script, anomaly learning
curves and injected attacks.

Usage (root): .venv/bin/python bench/services.py [--rounds 3] [--requests 50000] [--update-readme]
Needs redis-server and redis-tools (bench/setup.sh installs them) and linux-perf for perf-dwarf.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import ROOT, machine_line, update_readme_section

sys.path.insert(0, str(ROOT / "tests"))  # the daemon harness the end-to-end tests use
from daemon_fakes import config_text, wait_for
from daemon_harness import RunningDaemon, target_toml

SECURITY = ["execve", "openat", "connect", "accept4", "mprotect", "mmap", "clone3", "unlinkat", "renameat2"]
TESTS = "get,set,lrange_100"
CLK_TCK = os.sysconf("SC_CLK_TCK")
CONFIGS = ("untraced", "unwind-all", "unwind-security", "perf-dwarf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def vm_hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------------------------- redis
class Redis:
    binary = "/usr/bin/redis-server"

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--daemonize", "no", "--logfile", str(workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, timeout=30, interval=0.1)

    def _answers(self) -> bool:
        got = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True, text=True)
        return got.stdout.strip() == "PONG"

    def load(self, requests: int) -> dict[str, dict[str, float]]:
        """redis-benchmark's CSV: per test, requests/s and p50/p99 latency (ms)."""
        out = subprocess.run(["redis-benchmark", "-p", str(self.port), "-t", TESTS, "-n", str(requests),
                              "-c", "50", "--csv"], capture_output=True, text=True, check=True).stdout
        rows = list(csv.DictReader(io.StringIO(out)))
        return {r["test"]: {"rps": float(r["rps"]), "p50": float(r["p50_latency_ms"]),
                            "p99": float(r["p99_latency_ms"])} for r in rows}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


# ---------------------------------------------------------------------------------- tracers
def run_daemon(workdir: Path, redis: Redis, syscalls: list[str] | str, requests: int) -> dict[str, Any]:
    wd = tempfile.mkdtemp(dir=workdir, prefix="d-")
    target = target_toml("redis", f'path = "{redis.binary}"', syscalls, "unwind")
    with RunningDaemon(wd, config_text(wd, target, daemon_extra="top_k = 20")) as daemon:
        daemon.wait_tracked(redis.proc.pid, timeout=120)
        cpu0 = cpu_seconds(daemon.proc.pid)
        t0 = time.perf_counter()
        result = redis.load(requests)
        wall = time.perf_counter() - t0
        time.sleep(1.5)  # the daemon drains what the load left in the rings
        cpu = cpu_seconds(daemon.proc.pid) - cpu0
        dropped = sum(v for _, v in daemon.metric_samples("ccprofd_samples_dropped_total"))
        ctl = [sys.executable, "-m", "ccprofd.cli.ctl", "--socket", daemon.socket_path]
        every = json.loads(subprocess.run([*ctl, "--format", "json", "hot"], capture_output=True, text=True,
                                          cwd=ROOT, timeout=120, check=True).stdout)
        contexts, samples = len(every["contexts"]), every["total_samples"]
        hot = subprocess.run([*ctl, "hot", "--top", "3"], capture_output=True, text=True, cwd=ROOT,
                             timeout=60).stdout
        rss = vm_hwm_mb(daemon.proc.pid)
        daemon.stop()
    return {"tests": result, "daemon_cpu_pct": 100 * cpu / (wall + 1.5), "daemon_rss_mb": rss,
            "dropped": dropped, "contexts": contexts, "samples": samples, "hot": hot}


def run_perf(workdir: Path, redis: Redis, requests: int) -> dict[str, Any]:
    data = workdir / "perf.data"
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "raw_syscalls:sys_enter", "--call-graph", "dwarf",
                             "-p", str(redis.proc.pid), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches
    cpu0 = cpu_seconds(perf.pid)
    t0 = time.perf_counter()
    result = redis.load(requests)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(perf.pid) - cpu0
    perf.send_signal(signal.SIGINT)
    perf.wait(timeout=300)
    size = data.stat().st_size if data.exists() else 0
    data.unlink(missing_ok=True)
    return {"tests": result, "perf_cpu_pct": 100 * cpu / wall, "perf_data_mb": size / 2**20}


# ------------------------------------------------------------------------------------ report
def median_tests(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    tests = runs[0]["tests"].keys()
    return {t: {k: statistics.median(r["tests"][t][k] for r in runs) for k in ("rps", "p50", "p99")}
            for t in tests}


def render(results: dict[str, list[dict[str, Any]]], rounds: int, requests: int) -> str:
    base = median_tests(results["untraced"])
    version = subprocess.run([Redis.binary, "--version"], capture_output=True, text=True).stdout.split()[2]
    lines = [f"Measured by `bench/services.py` on {machine_line()}; redis-server {version}, "
             f"redis-benchmark -c 50 -n {requests:,}, {rounds} rounds alternating, medians.", "",
             "| configuration | test | requests/s | vs untraced | p50 ms | p99 ms |",
             "|---|---|---:|---:|---:|---:|"]
    for cfg in CONFIGS:
        if not results.get(cfg):
            continue
        med = median_tests(results[cfg])
        for t, m in med.items():
            change = 100 * (m["rps"] / base[t]["rps"] - 1)
            lines.append(f"| {cfg} | {t} | {m['rps']:,.0f} | {change:+.0f}% | {m['p50']:.3f} | "
                         f"{m['p99']:.3f} |")
    lines += ["", "| configuration | tracer CPU % of a core | tracer peak RSS MB | samples | dropped "
              "| contexts |",
              "|---|---:|---:|---:|---:|---:|"]
    for cfg in ("unwind-all", "unwind-security"):
        if results.get(cfg):
            r = results[cfg]
            lines.append(f"| {cfg} | {statistics.median(x['daemon_cpu_pct'] for x in r):.0f} | "
                         f"{max(x['daemon_rss_mb'] for x in r):.0f} | "
                         f"{statistics.median(x['samples'] for x in r):,.0f} | "
                         f"{statistics.median(x['dropped'] for x in r):,.0f} | "
                         f"{statistics.median(x['contexts'] for x in r):,.0f} |")
    if results.get("perf-dwarf"):
        r = results["perf-dwarf"]
        lines.append(f"| perf-dwarf | {statistics.median(x['perf_cpu_pct'] for x in r):.0f} | – | – | – | "
                     f"({statistics.median(x['perf_data_mb'] for x in r):.0f} MB perf.data) |")
    if results.get("unwind-all"):
        lines += ["", "Top of `ccprofctl hot` (unwind-all, last round):", "", "```",
                  results["unwind-all"][-1]["hot"].rstrip()[:3000], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("services: needs root (BPF)", file=sys.stderr)
        return 2
    for tool in ("redis-server", "redis-benchmark", "redis-cli"):
        if not shutil.which(tool):
            print(f"services: {tool} missing: run bench/setup.sh (apt-get install redis-server redis-tools)",
                  file=sys.stderr)
            return 2
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="ccprofd-services-") as d:
        work = Path(d)
        redis = Redis(work)
        try:
            redis.load(args.requests)  # warm-up: allocator, page cache
            for rnd in range(args.rounds):
                for cfg in CONFIGS:
                    if cfg == "untraced":
                        r: dict[str, Any] = {"tests": redis.load(args.requests)}
                    elif cfg == "unwind-all":
                        r = run_daemon(work, redis, "all", args.requests)
                    elif cfg == "unwind-security":
                        r = run_daemon(work, redis, SECURITY, args.requests)
                    elif shutil.which("perf"):
                        r = run_perf(work, redis, args.requests)
                    else:
                        continue
                    results[cfg].append(r)
                    print(f"round {rnd + 1} {cfg}: " + ", ".join(
                        f"{t} {m['rps']:,.0f}/s" for t, m in r["tests"].items()), file=sys.stderr)
        finally:
            redis.stop()
    text = render(results, args.rounds, args.requests)
    print(text)
    if args.update_readme and not update_readme_section("services", text):
        print("services: README has no bench:services section", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
