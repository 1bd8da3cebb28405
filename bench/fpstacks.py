"""The frame-pointer stacks baseline of bench/services.py (issue 14): what a bcc user writes to get
a user stack per syscall, and how much of the stack it gets on a distribution build.

A bcc program on ``raw_syscalls:sys_enter`` filtered by process (the given pids and every process
they fork afterwards, via ``sched_process_fork``) calls ``bpf_get_stackid(ctx, &stacks,
BPF_F_USER_STACK)`` (the kernel's frame-pointer walk, at most 127 frames) and counts (syscall,
stack id) pairs in a hash map; nothing is sent to user space per sample.  On SIGINT/SIGTERM it
reads the maps and writes JSON: samples, walks that failed (negative ids: no room in the stack map,
or a fault), distinct stacks, and the depth the walks reached, overall and in frames of the
service's own binary (module of each address from ``/proc/PID/maps`` of the first pid, read at the
end while the service still runs).  Debian builds redis, nginx and postgres without frame pointers,
so the walk stops (or goes astray) after the first frame whose caller did not save ``rbp``: the
depths say how far that gets.

Usage (root): python bench/fpstacks.py -p PID [-p PID ...] --binary PATH --output FILE
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

PROGRAM = r"""
#include <uapi/linux/ptrace.h>

struct key_t { u32 nr; s32 stackid; };

BPF_HASH(tgids, u32, u8, 4096);
BPF_STACK_TRACE(stacks, 65536);
BPF_HASH(counts, struct key_t, u64, 262144);

TRACEPOINT_PROBE(sched, sched_process_fork) {
    /* the current task forks: a followed process's children are followed (a new thread's tid is
       added too, harmlessly: it is never a tgid of another process) */
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!tgids.lookup(&tgid))
        return 0;
    u32 child = args->child_pid;
    u8 one = 1;
    tgids.update(&child, &one);
    return 0;
}

TRACEPOINT_PROBE(raw_syscalls, sys_enter) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!tgids.lookup(&tgid))
        return 0;
    struct key_t k = {};
    k.nr = args->id;
    k.stackid = stacks.get_stackid(args, BPF_F_USER_STACK);
    counts.increment(k);
    return 0;
}
"""


def module_of(maps: list[tuple[int, int, str]], addr: int) -> str:
    for lo, hi, path in maps:
        if lo <= addr < hi:
            return path
    return "?"


def read_maps(pid: int) -> list[tuple[int, int, str]]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, parts[5] if len(parts) > 5 else ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--pid", type=int, action="append", required=True)
    ap.add_argument("--binary", required=True, help="the service's executable (its frames are counted apart)")
    ap.add_argument("--output", required=True)
    opts = ap.parse_args()
    from bcc import BPF  # type: ignore[import-untyped]

    b = BPF(text=PROGRAM)
    tgids = b["tgids"]
    for pid in opts.pid:
        tgids[tgids.Key(pid)] = tgids.Leaf(1)
    print("attached", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    binary = os.path.realpath(opts.binary)
    maps = read_maps(opts.pid[0])
    stacks = b["stacks"]
    samples = failed = 0
    depth_sum = prog_sum = 0
    hist: dict[int, int] = {}
    prog_hist: dict[int, int] = {}
    distinct: set[int] = set()
    for k, v in b["counts"].items():
        n = int(v.value)
        samples += n
        if k.stackid < 0:
            failed += n
            continue
        distinct.add(k.stackid)
        addrs = list(stacks.walk(k.stackid))
        depth = len(addrs)
        mods = [module_of(maps, a) for a in addrs]
        in_prog = sum(1 for m in mods if m.startswith("/") and os.path.realpath(m) == binary)
        depth_sum += depth * n
        prog_sum += in_prog * n
        hist[depth] = hist.get(depth, 0) + n
        prog_hist[in_prog] = prog_hist.get(in_prog, 0) + n
    walked = max(1, samples - failed)
    result: dict[str, Any] = {
        "samples": samples, "failed": failed, "distinct_stacks": len(distinct),
        "mean_depth": depth_sum / walked, "mean_program_frames": prog_sum / walked,
        "depth_hist": dict(sorted(hist.items())), "program_frames_hist": dict(sorted(prog_hist.items())),
        "followed": len(tgids)}
    Path(opts.output).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
