"""A Go service under ccprofd: Debian's prometheus (Go, stripped, cgo), loaded through its own HTTP API.

What it measures, for one or two ccprofd trees side by side in one run (``--baseline DIR``: e.g. a
``git worktree`` of an older commit; windows alternate between the trees):

* every syscall of the running server traced (``ccprofd trace -p PID --mode unwind --syscalls
  all``) for ``--windows`` windows of ``--seconds``: how many chains are complete, and where the
  others stop (their reason and outermost function: a Go stack switch, a cgo call, ...);
* anomaly detection on them: ``ccprofd learn --samples`` on every window but the last, ``ccprofd
  detect --samples`` on the last, alerts by kind.  ``incomplete_context`` alerts are what a flagged
  chain costs an operator: the model cannot judge it.

The load: a client thread asking prometheus for ``/api/v1/query`` (two queries), ``/metrics``,
``/api/v1/labels`` and ``/api/v1/series`` in turn, while prometheus scrapes itself every second.
Nothing is installed here: ``prometheus`` is Debian's package (scripts/setup.sh installs it).

    .venv/bin/python bench/go_service.py [--baseline DIR] [--windows 4] [--seconds 15] [--update-readme]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # as bench/services.py does
from common import machine_line, python, report_main
from ports import free_port

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS = "/usr/bin/prometheus"
QUERIES = ("/api/v1/query?query=up", "/api/v1/query?query=rate(prometheus_http_requests_total%5B1m%5D)",
           "/metrics", "/api/v1/labels", "/api/v1/series?match%5B%5D=up")


def start_prometheus(work: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cfg = work / "prometheus.yml"
    target = f"static_configs: [{{targets: ['127.0.0.1:{port}']}}]"
    cfg.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                   f"scrape_configs: [{{job_name: self, {target}}}]\n")
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"prometheus did not become ready: {(work / 'prometheus.log').read_text()[-2000:]}")


def load(port: int, stop: threading.Event, counts: collections.Counter[str]) -> None:
    i = 0
    while not stop.is_set():
        q = QUERIES[i % len(QUERIES)]
        i += 1
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{q}", timeout=5) as r:
                r.read()
            counts["ok"] += 1
        except OSError:
            counts["error"] += 1
        time.sleep(0.02)


def trace_window(tree: Path, pid: int, seconds: float, out: Path) -> None:
    argv = [python(), "-m", "ccprofd.cli", "trace", "-p", str(pid), "--mode", "unwind", "--syscalls", "all",
            "--format", "jsonl", "--duration", str(seconds), "--output", str(out)]
    got = subprocess.run(argv, cwd=tree, capture_output=True, text=True, timeout=seconds + 600)
    if got.returncode != 0:
        raise SystemExit(f"ccprofd trace ({tree}) failed: {got.stderr.strip()[-2000:]}")


def chains(path: Path) -> dict[str, Any]:
    """Counts of one window's syscall samples: complete, and the flagged ones by reason and by the
    function their chain stops at (outermost frame)."""
    total = complete = 0
    stops: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("event", "syscall") != "syscall":
            continue
        total += 1
        if r.get("complete"):
            complete += 1
            continue
        frames = r.get("frames") or []
        outer = (frames[0].get("function") or "?").removesuffix(".abi0") if frames else "(none)"
        stops[f"{r.get('reason')} at {outer}"] += 1
    return {"total": total, "complete": complete, "stops": stops}


def anomaly(tree: Path, windows: list[Path], work: Path, tag: str) -> dict[str, tuple[int, int]]:
    """Alerts on the last window after learning the others: kind -> (alerts, distinct contexts)."""
    model = work / f"model-{tag}.json"
    for w in windows[:-1]:
        got = subprocess.run([python(), "-m", "ccprofd.cli", "learn", "--model", str(model),
                              "--samples", str(w)], cwd=tree, capture_output=True, text=True, timeout=600)
        if got.returncode != 0:
            raise SystemExit(f"ccprofd learn ({tree}) failed: {got.stderr.strip()[-2000:]}")
    alerts = work / f"alerts-{tag}.jsonl"
    got = subprocess.run([python(), "-m", "ccprofd.cli", "detect", "--model", str(model), "--samples",
                          str(windows[-1]), "--alert-interval", "0", "--output", str(alerts)],
                         cwd=tree, capture_output=True, text=True, timeout=600)
    if got.returncode != 0:
        raise SystemExit(f"ccprofd detect ({tree}) failed: {got.stderr.strip()[-2000:]}")
    kinds: collections.Counter[str] = collections.Counter()
    distinct: dict[str, set[str]] = collections.defaultdict(set)
    if alerts.exists():
        for line in alerts.read_text().splitlines():
            a = json.loads(line)
            kinds[a["kind"]] += 1
            frames = tuple((f.get("function"), f.get("call_site")) for f in a.get("frames") or [])
            distinct[a["kind"]].add(json.dumps([a.get("syscall"), frames]))
    return {k: (n, len(distinct[k])) for k, n in kinds.items()}


def git_rev(tree: Path) -> str:
    got = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True)
    return got.stdout.strip() or "?"


def measure(args: argparse.Namespace) -> int:
    if not os.path.exists(PROMETHEUS):
        print(f"bench/go_service.py: {PROMETHEUS} not installed (Debian's prometheus package)",
              file=sys.stderr)
        return 2
    trees = [("this tree", REPO)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    work = Path(tempfile.mkdtemp(prefix="ccprofd-go-service-"))
    proc, port = start_prometheus(work)
    stop = threading.Event()
    requests: collections.Counter[str] = collections.Counter()
    loader = threading.Thread(target=load, args=(port, stop, requests), daemon=True)
    loader.start()
    windows: dict[str, list[Path]] = {name: [] for name, _ in trees}
    try:
        time.sleep(args.warmup)
        for i in range(args.windows):
            for name, tree in trees:
                out = work / f"{name.replace(' ', '-')}-{i}.jsonl"
                trace_window(tree, proc.pid, args.seconds, out)
                windows[name].append(out)
    finally:
        stop.set()
        loader.join(timeout=10)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    version = subprocess.run([PROMETHEUS, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    print(f"Measured by `bench/go_service.py` on {machine_line()}.\n")
    print(f"**{version.strip()}** (Debian's: Go, stripped, cgo), scraping itself every second, "
          f"{requests['ok']} API requests answered during the run ({requests['error']} failed); "
          f"{args.windows} windows of {args.seconds:g} s per tree, every syscall traced "
          f"(`ccprofd trace -p`, unwind mode), trees alternating window by window.\n")
    print("| tree | syscall samples | complete | flagged: where chains stop (top 4) | "
          "alerts on the last window after learning the others (every sample; distinct contexts) |")
    print("|---|---:|---:|---|---|")
    for name, tree in trees:
        per = [chains(w) for w in windows[name]]
        total = sum(p["total"] for p in per)
        complete = sum(p["complete"] for p in per)
        stops: collections.Counter[str] = collections.Counter()
        for p in per:
            stops.update(p["stops"])
        kinds = anomaly(tree, windows[name], work, name.replace(" ", "-"))
        top = ", ".join(f"{n} {k}" for k, n in stops.most_common(4)) or "none"
        alerts = ", ".join(f"{k} {n:,} ({d} contexts)" for k, (n, d) in sorted(kinds.items())) or "none"
        share = 100.0 * complete / total if total else 0.0
        print(f"| {name} ({git_rev(tree)}) | {total:,} | {complete:,} ({share:.1f}%) | {top} | {alerts} |")
    if args.keep:
        print(f"\n(files kept in {work})")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="DIR", help="another ccprofd tree to measure beside this one")
    ap.add_argument("--windows", type=int, default=4, help="trace windows per tree (default 4)")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds per window (default 15)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the first window")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (samples, models)")
    ap.add_argument("--update-readme", action="store_true",
                    help="rewrite the README's bench:go_service section")
    args = ap.parse_args()
    if args.windows < 2:
        ap.error("--windows must be at least 2 (learn on all but the last)")
    return report_main("go_service", measure, args, update_readme=args.update_readme)


if __name__ == "__main__":
    sys.exit(main())
