"""``ccprofd trace`` start-up and exit times (issue #16: ≤ 0.4 s cached, ≤ 1.5 s cold).

The target is a tiny C program that prints CLOCK_MONOTONIC at the top of ``main``; the bench
reads the same clock before spawning ``ccprofd trace -o /dev/null -- STAMP`` and after it exits:

* start-up = spawn of ccprofd → first instruction of the target's ``main`` (interpreter start,
  imports, analysis from the cache, BPF load and attach, fork/exec of the target);
* exit = the target's ``main`` → ccprofd has exited (the target returns at once: detach, drain,
  close);
* total = the whole command.

Cases: *cached* (analysis and compiled BPF object cached, after one warm-up run), *cold, BPF
cached* (empty analysis cache, compiled object present), *cold, BPF prebuilt at set-up* (empty
caches, the objects ``scripts/prebuild_bpf.sh`` compiled for a small program in the prebuilt
directory, as set-up leaves them) and *cold* (nothing: includes the clang compile).  ``--repo
DIR`` runs another checkout (e.g. an old commit in a temporary clone) so two versions are measured
side by side in one run; ``strace -f -k -o /dev/null stamp`` (the baseline issue 16 names) is
measured in the same rounds.
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


def one_run(repo: Path, stamp: Path, env_extra: dict[str, str],
            argv: list[str] | None = None) -> tuple[float, float, float]:
    """(start-up, exit, total) seconds of one ``ccprofd trace`` of ``stamp`` (or of ``argv``)."""
    env = {**os.environ, "PYTHONPATH": str(repo), "CCPROFD_BPF_PREBUILT_DIR": "", **env_extra}
    # As installed: modules load from bytecode (a PYTHONDONTWRITEBYTECODE=1 shell would make every
    # run compile all of ccprofd from source, ~0.3 s, which no installed copy pays).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if argv is None:
        argv = [sys.executable, "-m", "ccprofd.cli", "trace", "-o", "/dev/null", "--", str(stamp)]
    t0 = time.monotonic_ns()
    proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True)
    t1 = time.monotonic_ns()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    stamped = int(proc.stdout.split()[0])
    return (stamped - t0) / 1e9, (t1 - stamped) / 1e9, (t1 - t0) / 1e9


CASES = ("cached", "cold, BPF cached", "cold, BPF prebuilt at set-up", "cold")
STRACE = "strace -f -k"  # the baseline issue 16 names: the tool users know, stacks included


def prebuild(repo: Path, directory: Path) -> bool:
    """Run the checkout's set-up step that compiles the BPF objects ahead (scripts/prebuild_bpf.sh)
    into ``directory``; False when the checkout has none (it then compiles as in the cold case)."""
    script = repo / "scripts" / "prebuild_bpf.sh"
    if not script.exists():
        return False
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHON": sys.executable}
    subprocess.run(["bash", str(script), str(directory)], cwd=repo, env=env, check=True,
                   capture_output=True)
    return True


def measure(repos: list[tuple[str, Path]], stamp: Path, runs: int,
            scratch: Path) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Medians of (start-up, exit, total) per checkout and case.  The checkouts take turns run by
    run (a shared machine's load changes over minutes: it then weighs on both alike)."""
    warm: dict[str, Path] = {}
    prebuilt: dict[str, Path] = {}
    for label, repo in repos:
        warm[label] = scratch / f"warm-{len(warm)}"
        one_run(repo, stamp, {"CCPROFD_CACHE_DIR": str(warm[label])})  # fills both caches
        prebuilt[label] = scratch / f"prebuilt-{len(prebuilt)}"
        if not prebuild(repo, prebuilt[label]):
            print(f"startup: {label} has no scripts/prebuild_bpf.sh: its prebuilt case compiles",
                  file=sys.stderr)
    got: dict[str, dict[str, list[tuple[float, float, float]]]] = {
        label: {case: [] for case in CASES} for label, _ in repos}
    got[STRACE] = {"-": []}
    for _ in range(runs):
        for label, repo in repos:
            # compiled objects go to <analysis cache>/bpf
            got[label]["cached"].append(one_run(repo, stamp, {"CCPROFD_CACHE_DIR": str(warm[label])}))
            for case in CASES[1:]:
                fresh = Path(tempfile.mkdtemp(dir=scratch))
                extra = {"CCPROFD_CACHE_DIR": str(fresh)}
                if case == "cold, BPF cached":
                    shutil.copytree(warm[label] / "bpf", fresh / "bpf")
                elif case == "cold, BPF prebuilt at set-up":
                    extra["CCPROFD_BPF_PREBUILT_DIR"] = str(prebuilt[label])
                got[label][case].append(one_run(repo, stamp, extra))
                shutil.rmtree(fresh, ignore_errors=True)
        if shutil.which("strace"):
            argv = [*STRACE.split(), "-o", "/dev/null", str(stamp)]
            got[STRACE]["-"].append(one_run(ROOT, stamp, {}, argv))
    if not got[STRACE]["-"]:
        del got[STRACE]
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
            name = f"`{label} -o /dev/null stamp`" if label == STRACE else label
            lines.append(f"| {name} | {case} | {start:.2f} s | {exit_:.2f} s | {total:.2f} s |")
    lines += ["", "Targets (issue #16): start-up ≤ 0.4 s cached, ≤ 1.5 s cold, for a small binary "
              "(`ccprofd trace -o /dev/null -- stamp`, unwind mode, a 16 kB C program printing "
              "CLOCK_MONOTONIC at the top of `main`)."]
    publish("startup", "\n".join(lines), args.update_readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
