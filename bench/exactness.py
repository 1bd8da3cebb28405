"""ccprofd's frames against ``perf record -e raw_syscalls:sys_enter --call-graph dwarf`` (issue 14).

Pure helpers for bench/services.py: parse ``perf script -F pid,tid,time,event,trace,ip,sym,dso --ns``
(perf recorded with ``-k mono``), pair its events with ccprofd's samples of the same thread (the
first by time, after converting perf's CLOCK_MONOTONIC to ccprofd's CLOCK_REALTIME, then by the
sequence of syscall numbers), and compare the program's frames of each pair.

Only the program's own frames are compared (perf's entries whose DSO is the service's binary;
ccprofd's frames of the analysed binary that are on the stack, i.e. not tail calls): perf prints a
caller's address as its return address minus one, ccprofd gives the call instruction's ELF vaddr
and the return address, so a frame agrees when ``call_site <= perf address <= return_address``.
perf copies 8 KB of stack per sample (``--call-graph dwarf``'s default): a deep stack is cut short
and its chain does not reach ``_start``/``__libc_start_call_main``; such a sample is counted
``perf_truncated`` when its frames are the innermost part of ccprofd's, not as our error.
"""

from __future__ import annotations

import re
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
         first_tolerance_ns: int = 50_000_000, window: int = 64
         ) -> list[tuple[PerfEvent, OurSample | None]]:
    """Each perf event with a ccprofd sample of the same thread and syscall, in order per thread (a
    sample is used once, pairs never cross).  A thread's first event is placed by time (perf's
    CLOCK_MONOTONIC + ``offset_ns``, within ``first_tolerance_ns``); after that by sequence: the
    next of our samples with the same syscall among the following ``window``.  Timestamps cannot
    pair a whole run: under load our sample times fall behind perf's by up to hundreds of ms.
    perf loses events under load (ours has the extra ones, skipped); an event with no partner in
    the window is unmatched."""
    by_tid: dict[int, list[OurSample]] = defaultdict(list)
    for s in sorted(ours, key=lambda s: s.time_ns):
        by_tid[s.tid].append(s)
    pos: dict[int, int] = {}
    out: list[tuple[PerfEvent, OurSample | None]] = []
    for ev in sorted(perf, key=lambda e: e.time_ns):
        seq = by_tid.get(ev.tid, [])
        best = None
        if ev.tid not in pos:
            t = ev.time_ns + offset_ns
            for j, s in enumerate(seq):
                if s.nr == ev.nr and abs(s.time_ns - t) <= first_tolerance_ns and (
                        best is None or abs(s.time_ns - t) < abs(seq[best].time_ns - t)):
                    best = j
        else:
            i = pos[ev.tid]
            best = next((j for j in range(i, min(len(seq), i + window)) if seq[j].nr == ev.nr), None)
        if best is None:
            out.append((ev, None))
        else:
            pos[ev.tid] = best + 1
            out.append((ev, seq[best]))
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
