"""Benchmark: the daemon's anomaly detection on a busy real service, with an attack injected under
load.  Why: until 2026-11-28 any ``[target.anomaly]`` action made the daemon take a record per
sample, which a busy service outruns (redis under redis-benchmark: tens of thousands of syscalls a
second against the daemon's ~10,000 records/s); records the full ring buffer refuses are samples
never judged.  Detection without transitions now runs in aggregate mode (README, "Aggregate mode").

Debian's ``redis-server`` (``--enable-protected-configs yes``: the configuration the attack
needs) on a loopback port in a temporary directory.  First the daemon of this tree learns it
(``action = "learn"``, unwind mode, ``syscalls = "all"``) over redis-benchmark mixes of the measured
tests.  Then per round, per tree (alternating): the daemon detects (``action = "detect"``, the
learned model) while redis-benchmark loads redis, and mid-load the attack is made with redis-cli:
``CONFIG SET dir`` to another directory, ``CONFIG SET dbfilename``, ``SAVE`` (its syscalls under
``saveCommand > rdbSave``: tests/test_services_redis_enforce.py, checked with ``strace -k``), then the
directory set back.  Per run: redis' requests/s (median over the tests), the daemon's CPU over the
load (% of one core), records the ring buffer refused and other drops (``/metrics``), alerts
logged, and whether an alert named ``rdbSave`` (the attack caught with its chain).

Usage (root): .venv/bin/python bench/services_detect.py [--rounds 2] [--requests 200000]
[--baseline TREE] [--update-readme]
``--baseline``: a checkout of another commit (generated code and helpers built), measured beside
this tree in the same run with the same model.  Needs redis-server and redis-tools
(bench/setup.sh installs them).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import ROOT, cpu_seconds, machine_line, publish
from services import TESTS, Redis, wait_tracked
from stream import compared_trees

sys.path.insert(0, str(ROOT / "tests"))
from daemon_fakes import config_text
from daemon_harness import RunningDaemon, target_toml

MARKER = "services-detect"
UNTRACED = "untraced (no daemon)"
LEARN_MIXES = [["-c", "50", "-t", TESTS], ["-c", "10", "-d", "100", "-t", TESTS],
               ["-c", "4", "-P", "8", "-r", "1000", "-t", TESTS]]
ALERT = re.compile(r"^.*ccprofd alert kind=(\w+) syscall=(\w+) .* context=(\S+)", re.M)


def daemon_config(workdir: str, action: str, model: Path) -> str:
    anomaly = f"""[target.anomaly]
action = "{action}"
model = "{model}"
flush_seconds = 1
alert_interval_seconds = 60
alert_history = 0
"""
    return config_text(workdir, target_toml("redis", f'path = "{Redis.binary}"', "all", "unwind", anomaly))


def bench(redis: Redis, args: list[str]) -> None:
    subprocess.run(["redis-benchmark", "-p", str(redis.port), "-q", *args], capture_output=True, check=True)


def cli(redis: Redis, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(redis.port), *args], capture_output=True,
                          text=True).stdout.strip()


def learn(workdir: Path, redis: Redis, model: Path, requests: int) -> None:
    wd = tempfile.mkdtemp(dir=workdir, prefix="learn-")
    with RunningDaemon(wd, daemon_config(wd, "learn", model)) as daemon:
        wait_tracked(daemon, redis.pids(), timeout=300)
        for mix in LEARN_MIXES:
            bench(redis, ["-n", str(requests // 4), *mix])
        time.sleep(3)  # the last counts read and flushed
        daemon.stop()


def attack(redis: Redis, evil: Path, home: Path) -> bool:
    ok = cli(redis, "config", "set", "dir", str(evil)) == "OK"
    ok &= cli(redis, "config", "set", "dbfilename", "evil.rdb") == "OK"
    ok &= cli(redis, "save") == "OK"
    ok &= cli(redis, "config", "set", "dir", str(home)) == "OK"
    return ok and (evil / "evil.rdb").exists()


def detect_run(workdir: Path, tree: Path, redis: Redis, model: Path, requests: int) -> dict[str, Any]:
    wd = tempfile.mkdtemp(dir=workdir, prefix="detect-")
    evil = Path(tempfile.mkdtemp(dir=workdir, prefix="evil-"))
    with RunningDaemon(wd, daemon_config(wd, "detect", model), prefix=["env", "-C", str(tree)]) as daemon:
        wait_tracked(daemon, redis.pids(), timeout=300)
        redis.warm()  # the daemon's first decodings
        time.sleep(1)
        log0 = len(daemon.log())
        cpu0, t0 = cpu_seconds(daemon.proc.pid), time.perf_counter()
        tests, made = load_with_attack(redis, evil, requests)
        wall = time.perf_counter() - t0
        time.sleep(3)  # the daemon drains what the load left
        cpu = cpu_seconds(daemon.proc.pid) - cpu0
        drops = {labels.get("reason", "?"): v
                 for labels, v in daemon.metric_samples("ccprofd_samples_dropped_total")}
        alerts = ALERT.findall(daemon.log()[log0:])
        daemon.stop()
    shutil.rmtree(evil, ignore_errors=True)
    return {"rps": statistics.median(t["rps"] for t in tests.values()),
            "daemon_cpu_pct": 100 * cpu / (wall + 3),
            "ringbuf_full": int(drops.get("ringbuf_full", 0)),
            "other_drops": int(sum(v for k, v in drops.items() if k != "ringbuf_full")),
            "alerts": len(alerts), "attack_made": made,
            "attack_alerts": sum(1 for _, _, chain in alerts if "rdbSave" in chain.split(">")),
            "attack_syscalls": sorted({sc for _, sc, chain in alerts if "rdbSave" in chain.split(">")}),
            # the other alerts, by kind, syscall and innermost program functions (for the report's text)
            "other": sorted({f"{kind} {sc} ...>{'>'.join(chain.split('>')[-4:])}"
                             for kind, sc, chain in alerts if "rdbSave" not in chain.split(">")})}


def load_with_attack(redis: Redis, evil: Path, requests: int) -> tuple[dict[str, dict[str, float]], bool]:
    """redis-benchmark's load, the attack made 1 s into it; the load's results and whether the
    attack did what it is for (the file written in ``evil``)."""
    made: list[bool] = []
    attacker = threading.Timer(1.0, lambda: made.append(attack(redis, evil, Path(redis_dir(redis)))))
    attacker.start()
    tests = redis.load(requests)
    attacker.join()
    return tests, bool(made and made[0])


def untraced_run(workdir: Path, redis: Redis, requests: int) -> dict[str, Any]:
    """The same load and attack with no daemon: the service's own throughput in this run."""
    evil = Path(tempfile.mkdtemp(dir=workdir, prefix="evil-"))
    redis.warm()
    time.sleep(1)
    tests, made = load_with_attack(redis, evil, requests)
    shutil.rmtree(evil, ignore_errors=True)
    return {"rps": statistics.median(t["rps"] for t in tests.values()), "attack_made": made}


def redis_dir(redis: Redis) -> str:
    return cli(redis, "config", "get", "dir").splitlines()[-1]


def render(rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [f"Measured by `bench/services_detect.py --rounds {args.rounds} --requests {args.requests}"
             f"{' --baseline ' + args.baseline_name if args.baseline else ''}` on {machine_line()}. "
             "redis-server under redis-benchmark (get, set, lrange_100; 50 clients), the daemon with "
             "`[target.anomaly] action = \"detect\"`, unwind mode, `syscalls = \"all\"`, a model the daemon "
             "learned over three other mixes; the attack (`CONFIG SET dir`, `dbfilename`, `SAVE`) made 1 s "
             "into the load. One row per run, the trees and an untraced run (the same load and attack, no "
             "daemon) alternating.", "",
             "| tree | redis req/s (median of tests) | daemon CPU | refused by the ring buffer | other drops "
             "| alerts | attack alerted (syscalls under `rdbSave`) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for tree, r in rows:
        if tree == UNTRACED:
            lines.append(f"| {tree} | {r['rps']:,.0f} | – | – | – | – | – |")
            continue
        caught = (f"yes: {r['attack_alerts']} ({', '.join(r['attack_syscalls'])})" if r["attack_alerts"]
                  else "**no**") if r["attack_made"] else "attack failed"
        lines.append(f"| {tree} | {r['rps']:,.0f} | {r['daemon_cpu_pct']:.0f}% | {r['ringbuf_full']:,} | "
                     f"{r['other_drops']:,} | {r['alerts']} | {caught} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    ap.add_argument("--requests", type=int, default=200000,
                    help="redis-benchmark -n per test (default 200000)")
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit to compare with")
    ap.add_argument("--update-readme", action="store_true", help="write the table into README.md")
    args = ap.parse_args()
    for tool in ("redis-server", "redis-benchmark", "redis-cli"):
        if shutil.which(tool) is None:
            ap.error(f"{tool} not found: run bench/setup.sh")
    trees = compared_trees(ap, args)
    workdir = Path(tempfile.mkdtemp(prefix="ccd-detect-"))
    redis = Redis(workdir, ("--enable-protected-configs", "yes"))
    rows: list[tuple[str, dict[str, Any]]] = []
    trees_run: list[tuple[str, Path | None]] = [(UNTRACED, None), *trees]
    try:
        model = workdir / "redis.model.json"
        learn(workdir, redis, model, args.requests)
        for r in range(args.rounds):
            for name, tree in trees_run if r % 2 == 0 else trees_run[::-1]:
                got = (untraced_run(workdir, redis, args.requests) if tree is None
                       else detect_run(workdir, tree, redis, model, args.requests))
                print(f"round {r + 1} {name}: {got}", file=sys.stderr)
                rows.append((name, got))
    finally:
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    publish(MARKER, render(rows, args), args.update_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
