"""``ccprofd trace`` start-up and exit times (issue #16: ≤ 0.4 s cached, ≤ 1.5 s cold).

The target is a tiny C program that prints CLOCK_MONOTONIC at the top of ``main``; the bench
reads the same clock before spawning ``ccprofd trace -o /dev/null -- STAMP`` and after it exits:

* start-up = spawn of ccprofd → first instruction of the target's ``main`` (interpreter start,
  imports, analysis from the cache, BPF load and attach, fork/exec of the target);
* exit = the target's ``main`` → ccprofd has exited (the target returns at once: detach, drain,
  close);
* total = the whole command.

Cases: *cached* (analysis and compiled BPF object cached, after one warm-up run), *cold, BPF
cached* (empty analysis cache, compiled object present) and *cold* (both empty: includes the
clang compile).  ``--repo DIR`` runs another checkout (e.g. an old commit in a temporary clone) so
two versions are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, machine_line, publish

STAMP_C = r"""
#include <stdio.h>
#include <time.h>
int main(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    printf("%lld\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    return 0;
}
"""


def build_stamp(directory: Path) -> Path:
    src = directory / "stamp.c"
    exe = directory / "stamp"
    src.write_text(STAMP_C)
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src)], check=True)
    return exe


def one_run(repo: Path, stamp: Path, env_extra: dict[str, str]) -> tuple[float, float, float]:
    """(start-up, exit, total) seconds of one ``ccprofd trace`` of ``stamp``."""
    env = {**os.environ, "PYTHONPATH": str(repo), **env_extra}
    # As installed: modules load from bytecode (a PYTHONDONTWRITEBYTECODE=1 shell would make every
    # run compile all of ccprofd from source, ~0.3 s, which no installed copy pays).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "-o", "/dev/null", "--", str(stamp)]
    t0 = time.monotonic_ns()
    proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True)
    t1 = time.monotonic_ns()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    stamped = int(proc.stdout.split()[0])
    return (stamped - t0) / 1e9, (t1 - stamped) / 1e9, (t1 - t0) / 1e9


CASES = ("cached", "cold, BPF cached", "cold")


def measure(repos: list[tuple[str, Path]], stamp: Path, runs: int,
            scratch: Path) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Medians of (start-up, exit, total) per checkout and case.  The checkouts take turns run by
    run (a shared machine's load changes over minutes: it then weighs on both alike)."""
    warm: dict[str, Path] = {}
    for label, repo in repos:
        warm[label] = scratch / f"warm-{len(warm)}"
        one_run(repo, stamp, {"CCPROFD_CACHE_DIR": str(warm[label])})  # fills both caches
    got: dict[str, dict[str, list[tuple[float, float, float]]]] = {
        label: {case: [] for case in CASES} for label, _ in repos}
    for _ in range(runs):
        for label, repo in repos:
            # compiled objects go to <analysis cache>/bpf
            got[label]["cached"].append(one_run(repo, stamp, {"CCPROFD_CACHE_DIR": str(warm[label])}))
            for case in ("cold, BPF cached", "cold"):
                fresh = Path(tempfile.mkdtemp(dir=scratch))
                if case == "cold, BPF cached":
                    shutil.copytree(warm[label] / "bpf", fresh / "bpf")
                got[label][case].append(one_run(repo, stamp, {"CCPROFD_CACHE_DIR": str(fresh)}))
                shutil.rmtree(fresh, ignore_errors=True)
    return {label: {case: tuple(statistics.median(r[i] for r in rs) for i in range(3))  # type: ignore[misc]
                    for case, rs in cases.items()} for label, cases in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repo", action="append", default=[], metavar="LABEL=DIR",
                    help="also measure this checkout (repeatable); this one is measured as 'this'")
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args()
    repos = [("this", ROOT)]
    for spec in args.repo:
        label, _, path = spec.partition("=")
        repos.insert(0, (label, Path(path).resolve()))
    with tempfile.TemporaryDirectory(prefix="ccprofd-startup-") as tmp:
        scratch = Path(tmp)
        stamp = build_stamp(scratch)
        results = measure(repos, stamp, args.runs, scratch)
    lines = [f"Measured on {machine_line()}; median of {args.runs} runs, each a fresh process, "
             "the versions taking turns.", "",
             "| version | case | start-up (spawn → target's main) | exit (target's main → ccprofd gone) "
             "| total |",
             "|---|---|---|---|---|"]
    for label, res in results.items():
        for case, (start, exit_, total) in res.items():
            lines.append(f"| {label} | {case} | {start:.2f} s | {exit_:.2f} s | {total:.2f} s |")
    lines += ["", "Targets (issue #16): start-up ≤ 0.4 s cached, ≤ 1.5 s cold, for a small binary "
              "(`ccprofd trace -o /dev/null -- stamp`, unwind mode, a 16 kB C program printing "
              "CLOCK_MONOTONIC at the top of `main`)."]
    publish("startup", "\n".join(lines), args.update_readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
