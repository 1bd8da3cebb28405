"""Benchmark of `ccprofd analyze`: cold and cached analysis time and peak RSS, optionally side by side
with other checkouts of ccprofd (``--repo LABEL=DIR``, e.g. the commit before a change).

Each measurement is one fresh `ccprofd analyze --json` process (so peak RSS is that run's own), with
the checkouts' runs interleaved so that a noisy machine weighs on all of them alike; the table gives
the median wall time of --repeat runs and, beside it, the median CPU time (user + system of the
process and its children), which a loaded machine disturbs less.  Usage:
.venv/bin/python bench/analyze.py [--repeat N] [--repo LABEL=DIR ...] [--objdump] [--update-readme]
[BINARY ...].  Default binaries: /usr/bin/python3.11 and /usr/bin/node.
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
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, machine_line, python, update_readme_section

#: Issue #18: whole `analyze` command, cold: python3.11 ≤ 1.5 s; node ≤ 12 s with peak RSS ≤ 500 MB;
#: cached ≤ 0.15 s.
TARGETS = {"python3.11": (1.5, 0.15, None), "node": (12.0, 0.15, 500.0)}


@dataclass(frozen=True)
class Measured:
    seconds: float
    cpu_seconds: float
    max_rss_mb: float
    returncode: int


def run(argv: list[str], repo: Path) -> Measured:
    """One child run: wall time, CPU time (its own and its children's) and peak RSS from wait4."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=repo)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    # wait4 reports the child with its reaped descendants (Linux: RUSAGE_BOTH), so forked workers'
    # CPU is included; ru_maxrss is then the largest single process's peak, not a sum.
    return Measured(elapsed, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
                    os.waitstatus_to_exitcode(status))


def compile_bytecode(repo: Path) -> None:
    """Write ``repo``'s ccprofd bytecode first, as installing a package does: without it (e.g. with
    PYTHONDONTWRITEBYTECODE=1 in the environment) every run compiles each imported module again,
    ~40 ms of a ~0.1 s cache hit that no installed ccprofd pays."""
    subprocess.run([python(), "-m", "compileall", "-q", str(repo / "ccprofd")], stdout=subprocess.DEVNULL,
                   check=False)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def fastest(runs: list[Measured]) -> Measured:
    """The least disturbed run (least wall time): on a shared machine, the nearest to an idle one."""
    return min(runs, key=lambda r: r.seconds)


def median(runs: list[Measured]) -> Measured:
    return Measured(statistics.median(r.seconds for r in runs),
                    statistics.median(r.cpu_seconds for r in runs),
                    max(r.max_rss_mb for r in runs), max((r.returncode for r in runs), key=abs))


def measure(binary: Path, repos: list[tuple[str, Path]], repeat: int) -> dict[str, dict[str, Measured]]:
    caches = {label: Path(tempfile.mkdtemp(prefix=f"ccprofd-bench-{label}-")) for label, _ in repos}
    runs: dict[str, dict[str, list[Measured]]] = {label: {"cold": [], "cached": []} for label, _ in repos}
    try:
        for _ in range(repeat):
            for label, repo in repos:
                analyze = [python(), "-m", "ccprofd.cli", "analyze", "--json", "--cache-dir",
                           str(caches[label]), str(binary)]
                shutil.rmtree(caches[label], ignore_errors=True)
                runs[label]["cold"].append(run(analyze, repo))
                runs[label]["cached"].append(run(analyze, repo))
    finally:
        for c in caches.values():
            shutil.rmtree(c, ignore_errors=True)
    return {label: {k: median(v) for k, v in r.items()} | {f"{k}-min": fastest(v) for k, v in r.items()}
            for label, r in runs.items()}


#: The serialized call graph without what may differ between identical results (timing, the path).
DIGEST = """
import hashlib, json, sys
from ccprofd.callgraph import analyze_binary
d = analyze_binary(sys.argv[1], use_cache=False).to_dict()
d.pop("analysis_seconds")
d["binary"].pop("path")
print(hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest())
"""


def graph_digest(repo: Path, binary: Path) -> str:
    """SHA-256 of ``repo``'s serialized call graph of ``binary`` (a fresh, uncached analysis)."""
    proc = subprocess.run([python(), "-c", DIGEST, str(binary)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"digest with {repo} failed: {proc.stderr[-2000:]}")
    return proc.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("binaries", nargs="*", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--repo", action="append", default=[], metavar="LABEL=DIR",
                    help="also measure another checkout's ccprofd (its gRPC code must be generated)")
    ap.add_argument("--objdump", action="store_true", help="also time `objdump -d` for scale")
    ap.add_argument("--large-repeat", type=int, default=None, metavar="N",
                    help="runs for binaries with more than 10 MB of code (default: --repeat)")
    ap.add_argument("--digest", action="store_true",
                    help="also check that every checkout's serialized call graph is the same (SHA-256)")
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args()
    defaults = (Path("/usr/bin/python3.11"), Path("/usr/bin/node"))
    binaries = args.binaries or [p for p in defaults if p.exists()]
    repos = [(label, Path(path).resolve()) for label, _, path in (r.partition("=") for r in args.repo)]
    repos.append(("this", ROOT))
    for _, repo in repos:
        compile_bytecode(repo)
    load_before = load_average()
    lines = [f"Measured on {machine_line()}; median of {args.repeat} runs (binaries over 10 MB of code: "
             f"{args.large_repeat or args.repeat}), each a fresh process, the checkouts' runs interleaved, "
             "bytecode compiled beforehand (as an installed package has it). Wall time (CPU time "
             "user+system, workers included); \"fastest\" is the run with the least wall time, the least "
             "disturbed by other load.", "",
             "| binary | .text | ccprofd | cold analyze | cold, fastest | cached analyze | cached, fastest "
             "| peak RSS cold |",
             "|---|---|---|---|---|---|---|---|"]
    sys.path.insert(0, str(ROOT))
    from ccprofd.elf.image import ElfImage

    digest_lines: list[str] = []
    for b in binaries:
        text_mb = sum(s.size for s in ElfImage(str(b)).code_sections()) / 1e6
        repeat = args.large_repeat if args.large_repeat and text_mb > 10 else args.repeat
        m = measure(b, repos, repeat)
        for label, _ in repos:
            r = m[label]
            for k in ("cold", "cached"):
                if r[k].returncode != 0:
                    raise SystemExit(f"{label}: analyze {k} run failed on {b}")
            lines.append(f"| `{b}` | {text_mb:.1f} MB | {label} | {r['cold'].seconds:.2f} s "
                         f"({r['cold'].cpu_seconds:.2f} s) | {r['cold-min'].seconds:.2f} s "
                         f"({r['cold-min'].cpu_seconds:.2f} s) | {r['cached'].seconds:.3f} s "
                         f"({r['cached'].cpu_seconds:.3f} s) | {r['cached-min'].seconds:.3f} s "
                         f"({r['cached-min'].cpu_seconds:.3f} s) | {r['cold'].max_rss_mb:.0f} MB |")
        if args.objdump:
            od = median([run(["objdump", "-d", str(b)], ROOT) for _ in range(args.repeat)])
            lines.append(f"| `{b}` | {text_mb:.1f} MB | `objdump -d` | {od.seconds:.2f} s "
                         f"({od.cpu_seconds:.2f} s) | | | | {od.max_rss_mb:.0f} MB |")
        if args.digest:
            digests = {label: graph_digest(repo, b) for label, repo in repos}
            same = len(set(digests.values())) == 1
            digest_lines.append(f"`{b}`: " + (f"identical, sha256 `{digests['this'][:16]}…`" if same else
                                              "DIFFERENT: " + ", ".join(f"{k} {v[:16]}" for k, v in
                                                                        digests.items())))
    if digest_lines:
        lines += ["", "Serialized call graph of each checkout (`--digest`): " + "; ".join(digest_lines) + "."]
    lines += ["", f"Load average (1/5/15 min) at the start: {load_before}; at the end: {load_average()} "
              f"(this VM's {os.cpu_count()} CPUs are shared with other work)."]
    lines += ["", "Targets (issue #18): whole `ccprofd analyze --json` command, interpreter start-up "
              "included: python3.11 cold ≤ 1.5 s, node cold ≤ 12 s with peak RSS ≤ 500 MB, cached ≤ 0.15 s."]
    table = "\n".join(lines)
    print(table)
    if args.update_readme and not update_readme_section("analyze", table):
        print("(README.md has no <!-- bench:analyze --> section; not updated)")


if __name__ == "__main__":
    main()
