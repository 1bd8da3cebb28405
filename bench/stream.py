"""Benchmark of ``StreamSamples`` delivery: how many of a busy target's samples one subscriber of
the whole target receives, and what the daemon spends doing it.

Why: with a subscriber every sample is a record the daemon's poll thread decodes, counts and
publishes in Python, with the GIL held; the gRPC thread that sends the subscriber's messages gets
the GIL only between those, and a subscriber that falls behind loses samples
(``stream_subscriber_slow``, counted).  So the cost per sample of both threads decides it, and
per message: ``StreamSampleBatches`` sends what is queued in one message.

Workload: bench/daemon_workload.c (write(2) at --rate calls/s for --seconds from three contexts),
under ``ccprofd run`` with a ``path`` target (both tracer modes), one subscriber attached before
the workload starts: ``StreamSamples`` of the target, ``StreamSampleBatches`` of it, or
``StreamSamples`` of pid 1, which receives nothing (the daemon still decodes every sample as a
record and offers it, so its CPU is the poll thread's without the sending).  Per case (--rounds
rounds): samples received by the subscriber and in how many messages, ``stream_subscriber_slow``
drops (and, batched, the drops the messages themselves report), other drops, samples counted by
``GetHotContexts`` (must equal the writes made), daemon CPU (% of one core over the workload's run
and the drain) and the workload's achieved rate.

Usage: .venv/bin/python bench/stream.py [--rate 10000] [--seconds 10] [--rounds 3]
       [--modes unwind,instrumented] [--subscribers target,"target (batches)","pid 1"]
       [--baseline TREE] [--update-readme]
--baseline: a checkout of another commit (with its generated code and helpers built): each case
runs its daemon from there too, alternating with this tree's, so both are measured in one run.
Needs root (BPF) and gcc.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from common import machine_line, publish  # noqa: E402
from daemon import (  # noqa: E402
    DAEMON_SETTINGS,
    build_workload,
    dropped_samples,
    hot_counts,
    run_under_daemon,
)
from daemon_fakes import config_text  # noqa: E402
from daemon_harness import RunningDaemon, SampleStream, target_toml  # noqa: E402

MARKER = "stream"
BATCHED = "target (batches)"


@dataclass
class StreamCase:
    tree: str
    mode: str
    # "target": StreamSamples of the whole target; "target (batches)": StreamSampleBatches of it;
    # "pid 1": StreamSamples of another process (receives nothing)
    subscriber: str
    made: int
    rate: float
    received: int
    slow_drops: int
    other_drops: int
    counted: int
    daemon_cpu_pct: float
    messages: int
    in_stream_drops: int | None  # batched: the messages' own drop counts, added up


def run_case(binary: Path, tree: str, tree_dir: Path, mode: str, subscriber: str, rate: int,
             seconds: float) -> StreamCase:
    workdir = tempfile.mkdtemp(prefix="ccd-stream-", dir="/tmp")
    try:
        target = target_toml("wl", f'path = "{binary}"', ["write"], mode)
        # the daemon runs from tree_dir (python -m ccprofd.cli imports the package of its cwd)
        daemon = RunningDaemon(workdir, config_text(workdir, target, daemon_extra=DAEMON_SETTINGS),
                               prefix=["env", "-C", str(tree_dir)])
        streams: list[SampleStream] = []

        def subscribe(_pid: int) -> None:
            # pid 1: every sample is still a record decoded and offered to the subscriber, none is sent
            streams.append(SampleStream(daemon.stub, "wl", pid=1 if subscriber == "pid 1" else 0,
                                        batched=subscriber == BATCHED))

        run = run_under_daemon(daemon, "wl", binary, rate, seconds, before=subscribe, drain_timeout=120)
        (stream,), result, pid = streams, run.result, run.pid
        time.sleep(2)  # what the subscriber's queue still holds reaches it
        received = len(stream.of(pid))
        stream.close()
        messages, in_stream = stream.messages, stream.dropped if stream.batched else None
        drops = dropped_samples(daemon, "wl")
        counted = sum(hot_counts(daemon, "wl")[0].values())
        daemon.stop()
        slow = drops.pop("stream_subscriber_slow", 0)
        return StreamCase(tree, mode, subscriber, result.made, result.rate, received, slow,
                          sum(drops.values()), counted, 100 * run.daemon_cpu_s / result.wall_s, messages,
                          in_stream)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def render(cases: list[StreamCase], args: argparse.Namespace) -> str:
    lines = [
        f"`bench/stream.py --rate {args.rate} --seconds {args.seconds:g} --rounds {args.rounds}"
        f"{' --baseline ' + args.baseline_name if args.baseline else ''}` ({machine_line()}; medians over "
        "the rounds, the trees alternating). One subscriber: `StreamSamples` of the whole target, "
        "`StreamSampleBatches` of it (\"batches\"), or `StreamSamples` of pid 1; the "
        "daemon counts every sample (`GetHotContexts`) whatever the subscriber receives. Daemon CPU: "
        "% of one core over the workload's run and the drain. Drops in the stream: the batched "
        "messages' own `dropped` counts, added up.",
        "",
        "| mode | subscriber of | daemon | writes made (rate) | received by the subscriber | messages | "
        "`stream_subscriber_slow` | drops in the stream | other drops | counted by the daemon | daemon CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    trees = list(dict.fromkeys(c.tree for c in cases))
    for mode, sub in dict.fromkeys((c.mode, c.subscriber) for c in cases):
        for tree in trees:
            group = [c for c in cases if (c.mode, c.subscriber, c.tree) == (mode, sub, tree)]

            def med(attr: str, group: list[StreamCase] = group) -> float:
                return statistics.median(getattr(c, attr) for c in group)

            if not group:
                continue
            made = med("made")
            in_stream = ("–" if group[0].in_stream_drops is None
                         else f"{statistics.median(c.in_stream_drops or 0 for c in group):,.0f}")
            lines.append(
                f"| {mode} | {sub} | {tree} | {made:,.0f} ({med('rate'):,.0f}/s) | "
                f"{med('received'):,.0f} ({100 * med('received') / made:.1f}%) | {med('messages'):,.0f} | "
                f"{med('slow_drops'):,.0f} | {in_stream} | "
                f"{med('other_drops'):,.0f} | {med('counted'):,.0f} | {med('daemon_cpu_pct'):.0f}% |"
            )
    return "\n".join(lines) + "\n"


def serves_batches(tree: Path) -> bool:
    """Whether the daemon of ``tree`` has StreamSampleBatches (a baseline may predate it)."""
    return "StreamSampleBatches" in (tree / "proto" / "ccprofd.proto").read_text()


def git_head(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or tree.name


def compared_trees(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(name, checkout) of this tree and ``--baseline`` (first) if given; sets ``args.baseline_name``."""
    if args.baseline is not None and not (args.baseline / "ccprofd" / "cli").is_dir():
        ap.error(f"--baseline {args.baseline}: not a ccprofd checkout")
    trees = [(f"this tree ({git_head(ROOT)})", ROOT)]
    if args.baseline is not None:
        args.baseline_name = git_head(args.baseline)
        trees.insert(0, (f"baseline ({args.baseline_name})", args.baseline))
    return trees


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=10000, help="write(2) calls per second (default 10000)")
    ap.add_argument("--seconds", type=float, default=10.0, help="workload length per case (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every case (default 3)")
    ap.add_argument("--modes", default="unwind,instrumented", help="tracer modes (default both)")
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit to compare with")
    ap.add_argument("--subscribers", default=f"target,{BATCHED},pid 1",
                    help=f"subscribers, comma-separated (default: target,{BATCHED},pid 1)")
    ap.add_argument("--update-readme", action="store_true", help="write the table into README.md")
    args = ap.parse_args()
    trees = compared_trees(ap, args)
    out_dir = tempfile.mkdtemp(prefix="ccd-stream-bin-")
    try:
        binary = build_workload(out_dir)
        cases: list[StreamCase] = []
        for r in range(args.rounds):
            for mode, sub in [(m, s) for m in args.modes.split(",") for s in args.subscribers.split(",")]:
                for tree, tree_dir in trees if r % 2 == 0 else trees[::-1]:
                    if sub == BATCHED and not serves_batches(tree_dir):
                        continue
                    c = run_case(binary, tree, tree_dir, mode, sub, args.rate, args.seconds)
                    print(f"round {r + 1} {mode} {sub} {tree}: received {c.received}/{c.made}, slow drops "
                          f"{c.slow_drops}, other {c.other_drops}, counted {c.counted}, "
                          f"daemon CPU {c.daemon_cpu_pct:.0f}%", file=sys.stderr)
                    cases.append(c)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    publish(MARKER, render(cases, args), args.update_readme)


if __name__ == "__main__":
    main()
