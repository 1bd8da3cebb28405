"""Added BPF cost per syscall sample of enforcement from the unwinder (issue 19).

The unwind program (``uw_sys_enter``) with and without ``UW_ENFORCE``, same workload:
tests/programs/enforce_nofp.c (``-O2 -fomit-frame-pointer``) running ``cat FILE`` N times, then a
``cat`` of a FIFO that blocks in ``openat`` -- while it blocks, every sample has been taken and the
programs are still loaded, so ``kernel.bpf_stats_enabled``'s run_time_ns of the programs this
process holds is read then.  The model is learned from one run of the same commands, so every
enforced sample is allowed (the full key loop runs, nobody is killed).

Per sample = run_time_ns / samples of the target.  ``uw_sys_enter`` is a raw tracepoint: it also
runs (and returns early) for every other process's syscalls, which this includes; the FIFO wait is
kept short, and the median of ``--repeat`` runs is reported.

Usage: python bench/unwind_enforce_cost.py [--calls 5000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from programs.build import build  # noqa: E402
from report_bpf import bpf_stats_enabled, owned_prog_stats  # noqa: E402

from ccprofd.anomaly.model import Learner, TargetModel  # noqa: E402
from ccprofd.anomaly.unwind_enforce import enforcement_options  # noqa: E402
from ccprofd.tracing import session as tracer  # noqa: E402
from ccprofd.tracing.api import TraceOptions  # noqa: E402

# This bench measures the sample program on raw_syscalls:sys_enter (`uw_sys_enter`/`ccprof_sys_enter`),
# the path of `syscalls = "all"` and of large sets: its one-syscall sets would otherwise go on their
# own syscalls:sys_enter_<name> event (ccprofd/kbpf/syscall_entry.py), which bench/syscall_attach.py
# measures against the raw path.
os.environ.setdefault("CCPROFD_SYSCALL_ATTACH", "raw")

PROG = "uw_sys_enter"


class Collect:
    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []

    def sample(self, s: Any) -> None:
        self.samples.append(s.to_json())

    def record(self, r: Any) -> None: ...
    def flush(self) -> None: ...


def blocked_in_openat(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == "257"
    except (OSError, IndexError):
        return False


def one_run(prog: str, argv: list[str], fifo: Path, opts: TraceOptions) -> tuple[int, int, int, list[Any]]:
    """(run_time_ns, run_cnt, samples, samples' JSON) of one traced run.  The tracer runs on this
    (the main) thread; a helper reads the stats while the target blocks, then releases it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1)
    try:
        os.dup2(devnull, 1)  # the target's output (it inherits stdout)
        session = tracer.open_session([prog, *argv, "cat", str(fifo)], options=opts)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    writer = Collect()
    stats: list[dict[str, tuple[int, int]]] = []
    child = session.child
    assert child is not None

    def snapshot_then_release() -> None:
        try:
            for _ in range(30000):
                if blocked_in_openat(child):
                    break
                time.sleep(0.01)
            time.sleep(0.2)  # its last samples reach the ring; the programs are still loaded
            stats.append(owned_prog_stats())
        finally:
            with open(fifo, "w"):
                pass

    helper = threading.Thread(target=snapshot_then_release, daemon=True)
    helper.start()
    rc = tracer.run(session, writer, launched=True)
    helper.join()
    assert rc == 0 and stats, rc
    run_time, run_cnt = stats[0].get(PROG[:15], (0, 0))
    syscalls = [s for s in writer.samples if s["event"] == "syscall"]
    return run_time, run_cnt, len(syscalls), writer.samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000, help="cat commands per run")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    prog = str(build("enforce_nofp", opt="O2", frame_pointer=False))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "a.txt"
        data.write_text("alpha\n")
        fifo = Path(tmp) / "fifo"
        os.mkfifo(fifo)
        argv = ["cat", str(data)] * args.calls
        with bpf_stats_enabled():
            _, _, _, learned = one_run(prog, argv, fifo, TraceOptions(mode="unwind"))
            bid = next(f["build_id"] for s in learned for f in s["frames"] if f.get("analysed"))
            model = TargetModel(bid, prog)
            learner = Learner(model)
            for s in learned:
                learner.observe(s)
            enforce, allowed = enforcement_options(model)
            results: dict[str, list[float]] = {"plain": [], "enforce": []}
            for _ in range(args.repeat):
                for name, opts in (("plain", TraceOptions(mode="unwind")),
                                   ("enforce", TraceOptions(mode="unwind", enforce=enforce))):
                    run_time, run_cnt, n, _ = one_run(prog, argv, fifo, opts)
                    results[name].append(run_time / max(1, n))
                    print(f"{name:8} samples {n:7}  program runs {run_cnt:8}  "
                          f"run_time {run_time / 1e6:8.1f} ms  {run_time / max(1, n):8.0f} ns/sample",
                          file=sys.stderr)
    plain = statistics.median(results["plain"])
    enf = statistics.median(results["enforce"])
    print(f"\nuw_sys_enter, ns per sample of the target (median of {args.repeat}; "
          f"{len(allowed.keys)} allowed contexts, {args.calls} x cat): without enforcement {plain:.0f}, "
          f"with {enf:.0f}, added {enf - plain:.0f} ({(enf - plain) / plain:+.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
