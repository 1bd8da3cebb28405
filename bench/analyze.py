"""Benchmark of `ccprofd analyze`: cold and cached analysis time and peak RSS, against `objdump -d`.

Each measurement runs in a fresh process (so peak RSS is that run's own), median of --repeat runs.
Usage: .venv/bin/python bench/analyze.py [--repeat N] [--update-readme] [BINARY ...]
Default binaries: /usr/bin/python3.11 and the largest ELF executable found in the usual places.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from common import Run, machine_line, python, run_measured, update_readme_section

TARGETS = {"python3.11": (3.0, 0.3, None), "large": (30.0, None, 1536.0)}  # cold s, cached s, RSS MB


SEARCH_DIRS = ("/usr/bin", "/usr/sbin", "/usr/lib/x86_64-linux-gnu")


def largest_elf(dirs: tuple[str, ...] = SEARCH_DIRS) -> Path | None:
    best: tuple[int, Path] | None = None
    for d in dirs:
        for entry in os.scandir(d):
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                size = entry.stat().st_size
                if best is not None and size <= best[0]:
                    continue
                with open(entry.path, "rb") as fh:
                    head = fh.read(20)
                if head[:4] == b"\x7fELF" and head[4] == 2 and head[18] == 62:
                    best = (size, Path(entry.path))
            except OSError:
                continue
    return best[1] if best else None


def median_run(runs: list[Run]) -> Run:
    runs = sorted(runs, key=lambda r: r.seconds)
    mid = runs[len(runs) // 2]
    return Run(statistics.median(r.seconds for r in runs), max(r.max_rss_mb for r in runs), mid.returncode)


def measure(binary: Path, repeat: int) -> dict[str, Run]:
    cache = tempfile.mkdtemp(prefix="ccprofd-bench-cache-")
    analyze = [python(), "-m", "ccprofd.cli", "analyze", "--json", "--cache-dir", cache, str(binary)]
    cold = []
    cached = []
    for _ in range(repeat):
        for p in Path(cache).rglob("*"):
            if p.is_file():
                p.unlink()
        cold.append(run_measured(analyze))
        cached.append(run_measured(analyze))
    objdump = [run_measured(["objdump", "-d", str(binary)]) for _ in range(repeat)]
    noop = [run_measured([python(), "-c", "import ccprofd.cli"]) for _ in range(repeat)]
    return {"cold": median_run(cold), "cached": median_run(cached), "objdump": median_run(objdump),
            "startup": median_run(noop)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("binaries", nargs="*", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args()
    binaries = args.binaries or [Path("/usr/bin/python3.11")]
    if not args.binaries:
        # node (~28 MB of text) is the large target; the largest ELF shows where it ends.
        for extra in (Path("/usr/bin/node"), largest_elf()):
            if extra is not None and extra.exists() and extra not in binaries:
                binaries.append(extra)
    lines = [f"Measured on {machine_line()}; median of {args.repeat} runs, each a fresh process.", "",
             "| binary | .text | cold analyze | cached analyze | (of which interpreter start-up) "
             "| peak RSS cold | `objdump -d` | objdump RSS |",
             "|---|---|---|---|---|---|---|---|"]
    for b in binaries:
        from ccprofd.elf.image import ElfImage

        text_mb = sum(s.size for s in ElfImage(str(b)).code_sections()) / 1e6
        m = measure(b, args.repeat)
        for k in ("cold", "cached"):
            if m[k].returncode != 0:
                raise SystemExit(f"analyze {k} run failed on {b}")
        lines.append(f"| `{b}` | {text_mb:.1f} MB | {m['cold'].seconds:.2f} s | {m['cached'].seconds:.2f} s "
                     f"| {m['startup'].seconds:.2f} s | {m['cold'].max_rss_mb:.0f} MB "
                     f"| {m['objdump'].seconds:.2f} s | {m['objdump'].max_rss_mb:.0f} MB |")
    lines += ["", "Targets (issue #2): python3.11 cold ≤ 3 s and cached ≤ 0.3 s; ~28 MB of text cold ≤ 30 s "
              "with peak RSS ≤ 1.5 GB. Times are whole `ccprofd analyze --json` commands, "
              "interpreter start-up included."]
    table = "\n".join(lines)
    print(table)
    if args.update_readme and not update_readme_section("analyze", table):
        print("(README.md has no <!-- bench:analyze --> section; not updated)")


if __name__ == "__main__":
    main()
