"""ccprofd's frames against ``perf record -e raw_syscalls:sys_enter --call-graph dwarf`` (issue 14).

Pure helpers for bench/services.py: parse ``perf script -F pid,tid,time,event,trace,ip,sym,dso --ns``
(perf recorded with ``-k mono``), pair its events with ccprofd's samples of the same thread and
syscall by time (perf's CLOCK_MONOTONIC shifted to ccprofd's CLOCK_REALTIME), and compare the
program's frames of each pair.

Only the program's own frames are compared (perf's entries whose DSO is the service's binary;
ccprofd's frames of the analysed binary that are on the stack, i.e. not tail calls): perf prints a
caller's address as its return address minus one, ccprofd gives the call instruction's ELF vaddr
and the return address, so a frame agrees when ``call_site <= perf address <= return_address``.
perf copies 8 KB of stack per sample (``--call-graph dwarf``'s default): a deep stack is cut short
and its chain does not reach ``_start``/``__libc_start_call_main``; such a sample is counted
``perf_truncated`` when its frames are the innermost part of ccprofd's, not as our error.
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: perf's chain ends here when it reached the bottom of the stack
STACK_BOTTOM = ("_start", "__libc_start_call_main", "__libc_start_main", "__libc_start_main_impl",
                "__clone3", "clone3", "start_thread")

_HEAD = re.compile(r"^\s*(\d+)/(\d+)\s+(\d+)\.(\d+):\s+raw_syscalls:sys_enter:\s+NR (\d+)")
_FRAME = re.compile(r"^\s+([0-9a-f]+)\s+(.*?)\s+\((.*)\)\s*$")


@dataclass
class PerfEvent:
    """One ``sys_enter`` of perf script: times in ns (CLOCK_MONOTONIC with ``-k mono``), frames
    innermost first as (address, symbol, dso)."""

    pid: int
    tid: int
    time_ns: int
    nr: int
    frames: list[tuple[int, str, str]] = field(default_factory=list)


def parse_perf_script(text: str) -> list[PerfEvent]:
    """Events of ``perf script -F pid,tid,time,event,trace,ip,sym,dso --ns`` output."""
    out: list[PerfEvent] = []
    cur: PerfEvent | None = None
    for line in text.splitlines():
        m = _HEAD.match(line)
        if m:
            pid, tid, sec, frac, nr = m.groups()
            cur = PerfEvent(int(pid), int(tid), int(sec) * 10**9 + int(frac.ljust(9, "0")[:9]), int(nr))
            out.append(cur)
            continue
        f = _FRAME.match(line)
        if f and cur is not None:
            cur.frames.append((int(f.group(1), 16), f.group(2), f.group(3)))
        elif not line.strip():
            cur = None
    return out


def perf_program_frames(ev: PerfEvent, module: str) -> tuple[list[int], bool]:
    """(addresses of ``module``'s frames, outermost first; whether the chain reached the stack's
    bottom).  perf's inlined entries (DSO ``inlined``) are not frames; a repeated address is
    (recursion through one call site); ``_start`` (below ``main``, where ccprofd's frames begin) is
    left out."""
    addrs: list[int] = []
    for ip, sym, dso in ev.frames:
        if dso == module and sym not in STACK_BOTTOM:
            addrs.append(ip)
    bottom = any(sym in STACK_BOTTOM for _ip, sym, _dso in ev.frames)
    return addrs[::-1], bottom


@dataclass
class OurSample:
    """One ccprofd sample: program frames outermost first as (call_site, return_address)."""

    pid: int
    tid: int
    time_ns: int
    nr: int
    complete: bool
    frames: list[tuple[int, int]]


def pair(perf: Sequence[PerfEvent], ours: Sequence[OurSample], offset_ns: int,
         tolerance_ns: int = 50_000, search_ns: int = 5_000_000) -> list[tuple[PerfEvent, OurSample | None]]:
    """Each perf event with a ccprofd sample of the same thread and syscall at the same time, in the
    thread's order (each sample used once, pairs never cross: the two stamps differ by microseconds
    of jitter, more than between two quick ``rt_sigaction`` calls, so the earliest free sample
    within ``tolerance_ns`` is taken, not the nearest).  Both stamp the syscall entry in the kernel
    with CLOCK_MONOTONIC; ours are shifted to CLOCK_REALTIME by the daemon's offset, ``offset_ns``
    is this process's estimate of it, refined by the median difference of the nearest candidates
    (within ``search_ns``).  A perf event with no partner is unpaired; perf loses events under
    load, so ours has extra ones."""
    cands: dict[tuple[int, int], list[OurSample]] = defaultdict(list)
    for s in sorted(ours, key=lambda s: s.time_ns):
        cands[(s.tid, s.nr)].append(s)
    times = {k: [s.time_ns for s in v] for k, v in cands.items()}

    def nearest(ev: PerfEvent, off: int, within: int) -> int | None:
        ts = times.get((ev.tid, ev.nr), [])
        t = ev.time_ns + off
        i = bisect.bisect_left(ts, t - within)
        best = None
        while i < len(ts) and ts[i] <= t + within:
            if best is None or abs(ts[i] - t) < abs(ts[best] - t):
                best = i
            i += 1
        return best

    diffs = []
    for ev in perf:
        j = nearest(ev, offset_ns, search_ns)
        if j is not None:
            diffs.append(times[(ev.tid, ev.nr)][j] - ev.time_ns)
    off = int(statistics.median(diffs)) if diffs else offset_ns
    used: dict[tuple[int, int], set[int]] = defaultdict(set)
    last: dict[int, int] = {}  # per thread: the time of our latest paired sample
    out: list[tuple[PerfEvent, OurSample | None]] = []
    for ev in sorted(perf, key=lambda e: e.time_ns):
        key = (ev.tid, ev.nr)
        ts, t = times.get(key, []), ev.time_ns + off
        i = bisect.bisect_left(ts, t - tolerance_ns)
        while i < len(ts) and (i in used[key] or ts[i] <= last.get(ev.tid, -1)):
            i += 1
        if i < len(ts) and ts[i] <= t + tolerance_ns:
            used[key].add(i)
            last[ev.tid] = ts[i]
            out.append((ev, cands[key][i]))
        else:
            out.append((ev, None))
    return out


def frames_agree(perf_addrs: Sequence[int], ours: Sequence[tuple[int, int]]) -> bool:
    if len(perf_addrs) != len(ours):
        return False
    return all(cs <= a <= ra for a, (cs, ra) in zip(perf_addrs, ours, strict=True))


def compare(pairs: Iterable[tuple[PerfEvent, OurSample | None]], module: str) -> dict[str, int]:
    """Counts: ``agree``; ``perf_truncated`` (perf's chain stopped short of the stack's bottom and its
    frames are the innermost of ours); ``differ``; ``ours_incomplete`` (ccprofd flagged the sample
    incomplete); ``unmatched`` (no ccprofd sample of that thread and syscall near that time)."""
    out = dict.fromkeys(("agree", "perf_truncated", "differ", "ours_incomplete", "unmatched"), 0)
    for ev, s in pairs:
        if s is None:
            out["unmatched"] += 1
            continue
        if not s.complete:
            out["ours_incomplete"] += 1
            continue
        addrs, bottom = perf_program_frames(ev, module)
        if frames_agree(addrs, s.frames):
            out["agree"] += 1
        elif not bottom and len(addrs) < len(s.frames) and frames_agree(addrs, s.frames[-len(addrs):] if addrs
                                                                        else []):
            out["perf_truncated"] += 1
        else:
            out["differ"] += 1
    return out


def first_syscalls(events: Iterable[tuple[int, int, int]]) -> dict[int, int]:
    """pid -> its first syscall number, from (pid, time_ns, nr) triples."""
    first: dict[int, tuple[int, int]] = {}
    for pid, t, nr in events:
        if pid not in first or t < first[pid][0]:
            first[pid] = (t, nr)
    return {pid: nr for pid, (_t, nr) in first.items()}
