"""Benchmark: how many samples a second ``ccprofd trace`` decodes and writes as JSONL (issue 16).

Two target programs, each a loop of ``getppid()`` calls reached through a known chain:

* ``repeat``: ``main > outer > inner > syscall`` every time (one context, repeated);
* ``distinct``: 17 levels of function pairs, the path picked by the bits of the loop counter, so
  consecutive calls have different contexts (2^17 of them).

Measured in one run:

* **decode + write stage**: the ring-buffer records of a real traced run are captured, then fed
  to a fresh unwind mode (``UnwindSampler.deliver``, the ring callback) and written by the JSONL
  writer to a file, as ``ccprofd trace`` does, timed apart from the kernel side -- the rate at which
  samples can be decoded and written (the issue's target: >= 200,000/s repeated, >= 20,000/s
  distinct).  ``distinct`` pauses 0.3 s every 1,000 calls so the ring never overflows while capturing;
* **end to end**: ``ccprofd trace --syscalls getppid --format jsonl -o FILE -- PROGRAM N``: wall
  time, samples written, samples dropped (``lost`` records), peak RSS; beside it, in the same run,
  the program untraced and under ``strace -f -k -e trace=getppid -o FILE`` (the tool users know).

``--repo LABEL=DIR`` also replays the stage with another checkout's ccprofd (e.g. the commit before
a change, in a temporary clone), the versions taking turns, each replay a fresh process.

Run as root: ``.venv/bin/python bench/trace_throughput.py [--calls N] [--repo LABEL=DIR] [--update-readme]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# --replay-only runs in a subprocess with another checkout's ccprofd (--repo): that one first.
sys.path.insert(0, os.environ.get("CCPROFD_BENCH_REPO") or str(Path(__file__).resolve().parent.parent))

from bench.common import machine_line, publish, run_measured, status_mb
from ccprofd.export.jsonl import JsonlWriter
from ccprofd.tracing.api import RECORDS_PER_POLL, TraceOptions
from ccprofd.tracing.session import open_session
from ccprofd.tracing.unwind.mode import UnwindMode
from ccprofd.tracing.unwind.sampler import UnwindSampler

REPEAT_C = r"""
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
__attribute__((noinline)) void inner(void) { syscall(SYS_getppid); __asm__ volatile(""); }
__attribute__((noinline)) void outer(void) { inner(); __asm__ volatile(""); }
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000;
    for (long i = 0; i < n; i++) outer();
    return 0;
}
"""

LEVELS = 17


def distinct_c(levels: int = LEVELS) -> str:
    """Pairs of functions per level; level i+1's pick is bit i+1 of the counter."""
    out = ["#include <stdlib.h>", "#include <unistd.h>", "#include <sys/syscall.h>",
           "static volatile unsigned long sink;",
           "__attribute__((noinline)) void leaf(unsigned long v) { syscall(SYS_getppid); sink += v; }"]
    for i in reversed(range(levels)):
        nxt = "leaf(v)" if i == levels - 1 else f"((v >> {i + 1}) & 1 ? l{i + 1}b(v) : l{i + 1}a(v))"
        out += [f"__attribute__((noinline)) void l{i}{s}(unsigned long v) {{ {nxt}; sink++; }}" for s in "ab"]
    out += ["int main(int argc, char **argv) {",
            "    long n = argc > 1 ? atol(argv[1]) : 100000, pause = argc > 2 ? atol(argv[2]) : 0;",
            "    for (long i = 0; i < n; i++) {",
            "        if (pause && i && i % pause == 0) usleep(300000);",
            "        if (i & 1) l0b(i); else l0a(i);",
            "    }",
            "    return 0;", "}"]
    return "\n".join(out) + "\n"


def build(tmp: Path) -> dict[str, Path]:
    progs = {}
    for name, src in (("repeat", REPEAT_C), ("distinct", distinct_c())):
        c = tmp / f"{name}.c"
        c.write_text(src)
        progs[name] = tmp / name
        subprocess.run(["gcc", "-O1", "-g", "-o", str(progs[name]), str(c)], check=True)
    return progs


# ------------------------------------------------------------------------------ the stage alone
def capture(argv: list[str]) -> list[bytes]:
    """The uw_events records of a real traced run of ``argv``, in arrival order."""
    records: list[bytes] = []
    original = UnwindSampler.deliver

    def keep(self: UnwindSampler, raw: bytes) -> None:
        records.append(bytes(raw))
        original(self, raw)

    UnwindSampler.deliver = keep  # type: ignore[method-assign]
    try:
        session = open_session(argv, options=TraceOptions(syscalls="getppid"))
        for _ in session.batches():
            pass
        session.wait()
    finally:
        UnwindSampler.deliver = original  # type: ignore[method-assign]
    return records


def replay(binary: Path, records: list[bytes], out_path: Path) -> dict[str, float]:
    """Decode and write ``records`` as ``ccprofd trace`` does (batches of RECORDS_PER_POLL, each
    delivered by the ring buffer's consume call inside ``mode.poll()``, one flush each) through a
    fresh mode; the rate counts every sample line written."""
    mode = UnwindMode(str(binary), TraceOptions(syscalls="getppid"))
    mode.prepare()
    sampler = mode.sampler
    assert sampler is not None
    written = 0
    # As in ccprofd trace, a poll's records reach the sampler inside mode.poll() (the ring buffer's
    # callback runs in UnwindSampler.take()'s ring_buffer_consume): the replay stands in for it.
    batches = iter([records[i:i + RECORDS_PER_POLL] for i in range(0, len(records), RECORDS_PER_POLL)])

    def consume(_max_records: int) -> int:
        got = next(batches, [])
        for raw in got:
            sampler.deliver(raw)
        return len(got)

    sampler.module.ring_buffer_consume = consume  # type: ignore[method-assign]
    try:
        with open(out_path, "w", encoding="utf-8") as out:
            writer = JsonlWriter(out)
            batched = hasattr(writer, "samples")
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(0, len(records), RECORDS_PER_POLL):
                batch = mode.poll(0)
                if batched:
                    writer.samples(batch)
                else:  # a version before JsonlWriter.samples()
                    for s in batch:
                        writer.sample(s)
                written += len(batch)
                writer.flush()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        mode.close()
    complete = sum('"complete":true' in line for line in out_path.read_text(encoding="utf-8").splitlines())
    return {"records": len(records), "written": written, "complete": complete, "seconds": seconds,
            "rate": written / seconds if seconds else 0.0, "cpu_rate": written / cpu if cpu else 0.0}


def replay_in(repo: Path, binary: Path, records_file: Path, out_path: Path) -> dict[str, float]:
    """:func:`replay` run by ``repo``'s ccprofd, in a subprocess (two versions side by side)."""
    env = {**os.environ, "CCPROFD_BENCH_REPO": str(repo), "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, __file__, "--replay-only", str(binary), str(records_file),
                           str(out_path)], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"replay with {repo} failed: {proc.stderr[-2000:]}")
    result: dict[str, float] = json.loads(proc.stdout.splitlines()[-1])
    return result


def stage(label_repos: list[tuple[str, Path]], binary: Path, records: list[bytes], tmp: Path,
          repeats: int) -> dict[str, dict[str, float]]:
    """Median, slowest and fastest replay of ``records`` per checkout, the checkouts taking turns."""
    records_file = tmp / f"records-{binary.name}.pickle"
    records_file.write_bytes(pickle.dumps(records))
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in label_repos}
    for _ in range(repeats):
        for label, repo in label_repos:
            runs[label].append(replay_in(repo, binary, records_file, tmp / f"replay-{binary.name}.jsonl"))
    out = {}
    for label, rs in runs.items():
        rs.sort(key=lambda r: r["rate"])
        cpu = sorted(r.get("cpu_rate", 0.0) for r in rs)
        out[label] = {**rs[len(rs) // 2], "best": rs[-1]["rate"], "worst": rs[0]["rate"],
                      "cpu_rate": cpu[len(cpu) // 2]}
    return out


# ------------------------------------------------------------------------------------ end to end
def count_lines(path: Path) -> tuple[int, int]:
    samples = lost = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("event") == "lost":
                lost += rec["samples"]
            else:
                samples += 1
    return samples, lost


def traced_run(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MB of ccprofd itself -- not of its compile worker or hold guard,
    which wait4's rusage would fold in), VmHWM read every 20 ms while it runs."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, status_mb(proc.pid, "VmHWM"))
        time.sleep(0.02)
    return time.perf_counter() - t0, peak


def end_to_end(prog: Path, calls: int, tmp: Path, strace_calls: int) -> dict[str, float]:
    out = tmp / f"{prog.name}.jsonl"
    untraced = run_measured([str(prog), str(calls)])
    seconds, rss = traced_run([sys.executable, "-m", "ccprofd.cli", "trace", "--syscalls", "getppid",
                               "--format", "jsonl", "-o", str(out), "--", str(prog), str(calls)])
    samples, lost = count_lines(out)
    row: dict[str, float] = {"untraced_s": untraced.seconds, "traced_s": seconds,
                             "rss_mb": rss, "samples": samples, "lost": lost,
                             "rate": samples / seconds}
    if shutil.which("strace"):
        st_out = tmp / f"{prog.name}.strace"
        st = run_measured(["strace", "-f", "-k", "-e", "trace=getppid", "-o", str(st_out), str(prog),
                           str(strace_calls)])
        text = st_out.read_text(encoding="utf-8", errors="replace")
        n = sum("getppid()" in line for line in text.splitlines())
        row.update({"strace_s": st.seconds, "strace_samples": n, "strace_rate": n / st.seconds})
    return row


def render(stages: dict[str, dict[str, dict[str, float]]], e2e: dict[str, dict[str, float]],
           calls: int) -> str:
    lines = [f"Measured by `bench/trace_throughput.py` on {machine_line()}.", "",
             "Decode + write stage (records of a real run replayed through a fresh unwind mode and the "
             "JSONL writer, to a file, each replay a fresh process; median of the replays, with the "
             "slowest and fastest; the checkouts take turns; *by CPU time*: samples over the replay's "
             "own CPU seconds, the rate a machine to itself would see, for a shared machine's runs):", "",
             "| contexts | version | samples | complete | seconds | samples/s (median) | slowest – fastest "
             "| by CPU time (median) | target |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    targets = {"repeat": 200_000, "distinct": 20_000}
    for name, per_repo in stages.items():
        for label, r in per_repo.items():
            lines.append(f"| {name} | {label} | {int(r['written']):,} | {int(r['complete']):,} | "
                         f"{r['seconds']:.2f} | {r['rate']:,.0f} | {r['worst']:,.0f} – {r['best']:,.0f} | "
                         f"{r['cpu_rate']:,.0f} | {targets[name]:,} |")
    lines += ["", f"End to end, {calls:,} getppid() calls (`ccprofd trace --format jsonl -o FILE`, "
              "beside the program untraced and `strace -f -k` on a shorter run; peak RSS is ccprofd's own, "
              "VmHWM):", "",
              "| program | untraced s | ccprofd s | samples written | dropped | written/s | peak RSS MB "
              "| strace -k lines/s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in e2e.items():
        lines.append(f"| {name} | {r['untraced_s']:.2f} | {r['traced_s']:.2f} | {int(r['samples']):,} | "
                     f"{int(r['lost']):,} | {r['rate']:,.0f} | {r['rss_mb']:.0f} | "
                     f"{r.get('strace_rate', float('nan')):,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1_000_000, help="getppid() calls end to end (default 1M)")
    ap.add_argument("--stage-calls", type=int, default=200_000, help="calls captured for the stage replay")
    ap.add_argument("--repeats", type=int, default=5, help="replays of each stage (median reported)")
    ap.add_argument("--strace-calls", type=int, default=20_000,
                    help="calls under strace -k (it manages ~1,500 a second here)")
    ap.add_argument("--update-readme", action="store_true",
                    help="rewrite the README's bench:trace_throughput section")
    ap.add_argument("--repo", action="append", default=[], metavar="LABEL=DIR",
                    help="also replay the stage with this checkout's ccprofd (repeatable)")
    ap.add_argument("--replay-only", nargs=3, metavar=("BINARY", "RECORDS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replay_only:  # a subprocess of stage(): one replay, its numbers as JSON on stdout
        binary, records_file, out = (Path(p) for p in args.replay_only)
        print(json.dumps(replay(binary, pickle.loads(records_file.read_bytes()), out)))
        return 0
    label_repos = [(label, Path(path).resolve()) for label, _, path in (r.partition("=") for r in args.repo)]
    label_repos.append(("this", Path(__file__).resolve().parent.parent))
    if os.geteuid() != 0:
        print("trace_throughput: needs root (BPF)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ccprofd-tput-") as d:
        tmp = Path(d)
        progs = build(tmp)
        stages = {}
        for name, argv in (("repeat", [str(progs["repeat"]), str(args.stage_calls)]),
                           ("distinct", [str(progs["distinct"]), str(args.stage_calls // 10), "1000"])):
            records = capture(argv)
            stages[name] = stage(label_repos, progs[name], records, tmp, args.repeats)
            print(f"stage {name}: {stages[name]}", file=sys.stderr)
        e2e = {}
        for name in ("repeat", "distinct"):
            e2e[name] = end_to_end(progs[name], args.calls, tmp, min(args.calls, args.strace_calls))
            print(f"end to end {name}: {e2e[name]}", file=sys.stderr)
    publish("trace_throughput", render(stages, e2e, args.calls), args.update_readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
