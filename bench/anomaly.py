"""Anomaly detection on a real program: ``bash`` running a workload script with varied arguments.

Learning curve: every run is traced once with the real tracer (``ccprofd trace --format jsonl``,
all syscalls); models are learned through ``ccprofd learn --samples`` one training run at a time
(repeatable learning merges into the model file), and after k runs the held-out runs (other
arguments, other orders) are checked with ``ccprofd detect --samples --alert-interval 0`` (all
held-out runs in one file; alerts are told apart by pid).  A false positive is an alert on a held-out
run: reported per run (any alert) and per sample (alerts / complete samples), for exact contexts, with
``--collapse-recursion``, and with ``--granularity edges`` (issue 19).

Injected unusual path: the workload's ``inject`` command reads a file through the ``source`` builtin,
which no training run used (training reads files only through redirections).  It is run through the
real ``ccprofd detect -- bash ...``, exact and ``--granularity edges``, and the alerts are listed.

Writes docs/anomaly-learning-curve.png and docs/anomaly.md (the markdown table printed at the end).
Usage: python bench/anomaly.py [--train 16] [--held-out 8] [--mode instrumented] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CCPROFD = [sys.executable, "-c", "from ccprofd.cli.main import main; raise SystemExit(main())"]

WORKLOAD = r"""
# Commands from the argument list: NAME ARG pairs, run in order (pure bash: no external programs,
# so every syscall is bash's own).
loops() {
    local i s=""
    for ((i = 0; i < $1; i++)); do s+="${i}"; (( i % 3 )) || s+=","; done
    printf '%s\n' "${#s}"
}
recurse() { if (( $1 > 0 )); then recurse $(( $1 - 1 )); else echo bottom; fi; }
readfile() { local n=0 line; while IFS= read -r line; do n=$(( n + ${#line} )); done < "$1"; echo "$n"; }
strings() {
    local w=$1 out
    for out in "${w^^}" "${w,,}" "${w:1}" "${w//a/_}"; do
        case $out in *_*) echo "u $out";; *) echo "p $out";; esac
    done
}
append() {
    local f=$TMPDIR/bench-anomaly.$$ i c
    for ((i = 0; i < $1; i++)); do echo "line $i" >> "$f"; done
    c=$(< "$f"); echo "${#c}"; : > "$f"
}
inject() { source "$1"; echo "sourced ${injected_value:-nothing}"; }
while (( $# >= 2 )); do "$1" "$2"; shift 2; done
"""

COMMANDS = ("loops", "recurse", "readfile", "strings", "append")
FILES = ("/etc/hostname", "/etc/passwd", "/etc/services", "/etc/os-release", "/etc/hosts")
WORDS = ("alpha", "banana", "Kafka", "data", "xyz", "Palindrome")


def run_args(rng: random.Random) -> list[str]:
    """One run: 3-6 commands in random order with random arguments."""
    out: list[str] = []
    for name in rng.sample(COMMANDS, rng.randint(3, len(COMMANDS))):
        arg = {"loops": lambda: str(rng.randint(1, 200)), "recurse": lambda: str(rng.randint(0, 40)),
               "readfile": lambda: rng.choice(FILES), "strings": lambda: rng.choice(WORDS),
               "append": lambda: str(rng.randint(1, 30))}[name]()
        out += [name, arg]
    return out


def ccprofd(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*CCPROFD, *args], capture_output=True, text=True, cwd=ROOT)
    if check and r.returncode not in (0,):
        raise SystemExit(f"ccprofd {' '.join(args[:3])}... failed ({r.returncode}): "
                         f"{r.stderr.strip()[-500:]}")
    return r


def trace(work: Path, script: Path, argv: list[str], mode: str, out: Path) -> int:
    r = ccprofd("trace", "--mode", mode, "--format", "jsonl", "--output", str(out), "--",
                "/bin/bash", str(script), *argv)
    if r.returncode != 0:
        raise SystemExit(f"tracing bash {' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[-300:]}")
    return sum(1 for line in out.read_text().splitlines() if json.loads(line).get("complete"))


#: Detector variants of the learning curve: (tag, extra ``ccprofd detect`` options).
VARIANTS = (("exact", []), ("collapsed", ["--collapse-recursion"]), ("edges", ["--granularity", "edges"]))


def detect(model: Path, samples: Path, extra: list[str]) -> list[dict[str, Any]]:
    r = ccprofd("detect", *extra, "--model", str(model), "--alert-interval", "0", "--samples", str(samples))
    return [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]


def run_pid(samples: Path) -> int:
    """The pid of a traced run (bash runs no other program: one pid per run)."""
    pids = {json.loads(line).get("pid") for line in samples.read_text().splitlines()}
    if len(pids) != 1:
        raise SystemExit(f"{samples}: expected the samples of one process, found pids {sorted(pids)}")
    return int(pids.pop())


def inner(a: dict[str, Any]) -> str:
    return " > ".join(str(f.get("function")) for f in a["frames"][-4:]) or "(no frame)"


def edge_text(a: dict[str, Any]) -> str:
    e = a.get("unseen_edge") or {}
    caller, callee = e.get("caller"), e.get("callee")
    left = "(entry)" if not caller else str(caller["function"])
    return f"{left} -> {a['syscall'] if not callee else callee['function']}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=16)
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--mode", default="instrumented")
    ap.add_argument("--seed", type=int, default=7)
    opts = ap.parse_args()
    rng = random.Random(opts.seed)
    work = Path(tempfile.mkdtemp(prefix="ccprofd-bench-anomaly-"))
    script = work / "workload.sh"
    script.write_text(WORKLOAD)
    lib = work / "lib.sh"
    lib.write_text("injected_value=42\n")

    runs = [run_args(rng) for _ in range(opts.train + opts.held_out)]
    t0 = time.monotonic()
    samples: list[Path] = []
    complete: list[int] = []
    for i, argv in enumerate(runs):
        out = work / f"run{i:02d}.jsonl"
        complete.append(trace(work, script, argv, opts.mode, out))
        samples.append(out)
        print(f"traced run {i + 1}/{len(runs)}: bash workload.sh {' '.join(argv)}", file=sys.stderr)
    trace_s = time.monotonic() - t0
    train, held = samples[: opts.train], samples[opts.train:]
    held_complete = complete[opts.train:]

    model = work / "model.json"
    held_all = work / "held-out.jsonl"
    held_all.write_text("".join(h.read_text() for h in held))
    held_pids = [run_pid(h) for h in held]
    curve: list[dict[str, Any]] = []
    residual: dict[str, dict[tuple[str, str], int]] = {"exact": {}, "edges": {}}
    for k, run in enumerate(train, start=1):
        ccprofd("learn", "--model", str(model), "--samples", str(run))
        doc = json.loads(model.read_text())
        contexts = sum(len(t["contexts"]) for t in doc["targets"])
        row: dict[str, Any] = {"k": k, "contexts": contexts}
        for tag, extra in VARIANTS:
            found = detect(model, held_all, extra)
            per_run = [sum(1 for a in found if a["pid"] == pid) for pid in held_pids]
            assert sum(per_run) == len(found), "an alert of no held-out run"
            row[f"runs_fp_{tag}"] = sum(1 for n in per_run if n) / len(held)
            row[f"samples_fp_{tag}"] = len(found) / max(1, sum(held_complete))
            if k == len(train) and tag in residual:
                for a in found:
                    rkey = (a["syscall"], inner(a) if tag == "exact" else edge_text(a))
                    residual[tag][rkey] = residual[tag].get(rkey, 0) + 1
        curve.append(row)
        print(f"k={k}: {row}", file=sys.stderr)

    # The injected unusual path, through the real `ccprofd detect -- CMD`.
    inject_argv = ["loops", "50", "inject", str(lib), "readfile", "/etc/hostname"]
    injected: dict[str, list[dict[str, Any]]] = {}
    for granularity in ("exact", "edges"):
        alerts_file = work / f"inject-alerts-{granularity}.jsonl"
        r = ccprofd("detect", "--model", str(model), "--granularity", granularity, "--mode", opts.mode,
                    "--output", str(alerts_file), "--", "/bin/bash", str(script), *inject_argv)
        if r.returncode != 0:
            raise SystemExit(f"detect on the injected run failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        injected[granularity] = ([json.loads(line) for line in alerts_file.read_text().splitlines()]
                                 if alerts_file.exists() else [])

    DOCS.mkdir(exist_ok=True)
    plot(curve, opts)
    table = markdown(curve, opts, trace_s, len(runs), injected, str(lib), residual)
    (DOCS / "anomaly.md").write_text(table)
    print(table)
    return 0


def plot(curve: list[dict[str, Any]], opts: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["k"] for r in curve]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ks, [100 * r["runs_fp_exact"] for r in curve], "o-",
            label="held-out runs with an alert (exact)")
    ax.plot(ks, [100 * r["runs_fp_collapsed"] for r in curve], "s--",
            label="held-out runs with an alert (recursion collapsed)")
    ax.plot(ks, [100 * r["runs_fp_edges"] for r in curve], "D-.",
            label="held-out runs with an alert (granularity edges)")
    ax.plot(ks, [100 * r["samples_fp_exact"] for r in curve], "^-", label="alerted samples (exact)")
    ax.plot(ks, [100 * r["samples_fp_collapsed"] for r in curve], "v--", label="alerted samples (collapsed)")
    ax.plot(ks, [100 * r["samples_fp_edges"] for r in curve], "x-.", label="alerted samples (edges)")
    ax.set_xlabel("training runs")
    ax.set_ylabel("false positives (%)")
    ax.set_title(f"ccprofd anomaly model: bash, {opts.held_out} held-out runs ({opts.mode} mode)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "anomaly-learning-curve.png", dpi=110)


def injected_summary(inj: list[dict[str, Any]], lib: str) -> tuple[bool, str]:
    """Whether the ``openat`` of the sourced file was reported, and through which function."""
    lib_opens = [a for a in inj if a["syscall"] == "openat" and a.get("args", {}).get("path") == lib]
    via = [f["function"] for a in lib_opens for f in a["frames"] if "source" in str(f.get("function"))]
    return bool(lib_opens), f" (its context goes through `{via[0]}`)" if via else ""


def markdown(curve: list[dict[str, Any]], opts: argparse.Namespace, trace_s: float, nruns: int,
             injected: dict[str, list[dict[str, Any]]], lib: str,
             residual: dict[str, dict[tuple[str, str], int]]) -> str:
    last = curve[-1]
    lines = [
        "# Anomaly detection: learning curve and an injected path",
        "",
        f"Generated by `python bench/anomaly.py --train {opts.train} --held-out {opts.held_out} "
        f"--mode {opts.mode} --seed {opts.seed}`. Workload: `/bin/bash workload.sh` running 3-5 pure-bash "
        "commands (loops, recursion "
        "to depth 40, `while read` over a file, string expansions, appending to a file) in random order with "
        f"random arguments; all syscalls traced. {nruns} runs traced in {trace_s:.0f} s.",
        "",
        "False positives: alerts on held-out runs of the same workload (other arguments and orders) after "
        "learning k runs. *Runs*: share of held-out runs with at least one alert. *Samples*: alerts per "
        "complete sample (`--alert-interval 0`: every unseen sample counts). Three ways of judging the "
        "same learned model: *exact* contexts (the default), exact contexts with *recursion collapsed* "
        "(`--collapse-recursion`), and `--granularity edges`: a context is accepted when each of its call "
        "edges (caller function at a call site -> callee, the outermost frame's entry and the innermost "
        "call site's syscall included) was learned for that syscall.",
        "",
        "| training runs | contexts | runs FP (exact) | runs FP (collapsed) | runs FP (edges) "
        "| samples FP (exact) | samples FP (collapsed) | samples FP (edges) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in curve:
        lines.append(f"| {r['k']} | {r['contexts']} | {100 * r['runs_fp_exact']:.0f}% | "
                     f"{100 * r['runs_fp_collapsed']:.0f}% | {100 * r['runs_fp_edges']:.0f}% | "
                     f"{100 * r['samples_fp_exact']:.2f}% | {100 * r['samples_fp_collapsed']:.2f}% | "
                     f"{100 * r['samples_fp_edges']:.2f}% |")
    lines += [
        "",
        "![learning curve](anomaly-learning-curve.png)",
        "",
        f"After {last['k']} training runs: held-out runs with a false alert "
        f"{100 * last['runs_fp_exact']:.0f}% "
        f"(exact), {100 * last['runs_fp_collapsed']:.0f}% (collapsed), {100 * last['runs_fp_edges']:.0f}% "
        "(edges).",
        "",
        "Injected unusual path: `inject FILE` runs `source FILE` — an `openat` of a file through the "
        "`source` builtin, a chain no training run used (training opens files only for redirections). "
        "`ccprofd detect -- bash workload.sh loops 50 inject lib.sh readfile /etc/hostname` on the "
        f"{opts.train}-run model, once per granularity:",
        "",
    ]
    for granularity, inj in injected.items():
        found, through = injected_summary(inj, lib)
        lines.append(f"* `--granularity {granularity}`: {len(inj)} alert(s); the `openat` of lib.sh "
                     f"{'was' if found else 'was NOT'} reported{through}.")
    lines += [
        "",
        "| granularity | alert | syscall | path | innermost frames | unseen edge (edges) |",
        "|---|---|---|---|---|---|",
    ]
    for granularity, inj in injected.items():
        for a in inj:
            path = Path(a.get("args", {}).get("path", "")).name
            edge = edge_text(a) if a.get("unseen_edge") else ""
            lines.append(f"| {granularity} | {a['kind']} | {a['syscall']} | {path} | {inner(a)} | {edge} |")
    lines += [
        "",
        f"What the {opts.train}-run model still flags in held-out runs, exact contexts (the innermost "
        "frames and how many samples):",
        "",
        "| syscall | innermost frames | samples |",
        "|---|---|---:|",
    ]
    for (syscall, where), n in sorted(residual["exact"].items(), key=lambda x: -x[1]):
        lines.append(f"| {syscall} | {where} | {n} |")
    lines += [
        "",
        "and with `--granularity edges` (the first unseen edge of each alert: caller -> callee):",
        "",
        "| syscall | unseen edge | samples |",
        "|---|---|---:|",
    ]
    for (syscall, where), n in sorted(residual["edges"].items(), key=lambda x: -x[1]):
        lines.append(f"| {syscall} | {where} | {n} |")
    if not residual["edges"]:
        lines.append("| (none) | | 0 |")
    # Enforcement is measured by tests (tests/test_unwind_enforce.py), granularity routines on the
    # services (bench/services_anomaly.py), not by this benchmark: their hand-written sections are
    # appended as they stand.
    for name in ("anomaly-routines.md", "anomaly-enforcement.md"):
        section = (DOCS / name).read_text(encoding="utf-8")
        lines += ["", section.split("-->\n", 1)[-1].rstrip("\n")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
