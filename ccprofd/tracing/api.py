"""The tracing API every mode and every caller shares: options, samples, errors, the mode protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

MODES = ("unwind", "instrumented")  # the default first



DEFAULT_MODE = "unwind"  # cheap; instrumented mode is for --scope and unwind-table-less code

# Ring buffer records one poll takes at most.  The bound keeps memory flat and a poll short when
# the target produces records faster than they are decoded: the rest waits in the kernel's ring,
# and once that is full the BPF side drops and counts (``ringbuf_full``) -- backpressure instead
# of an ever-growing queue in Python, and a stop request is seen within one batch.  1024, not
# 4096: while a batch of new contexts is decoded and formatted (the cyclic GC paused), each holds
# ~10 kB, so 4096 of them were ~45 MB of peak RSS (the distinct flood of tests/test_trace_stop.py:
# 207 MB, over issue 16's bound; 161 MB with 1024).
RECORDS_PER_POLL = 1024

#: What the kernel side of a mode could not do (``Mode.drops()`` keys), each as it is reported:
#: the output record's ``event`` and unit (``{"event": "lost", "samples": N, "reason": ...}``),
#: and what the line at exit on standard error says after the count.  Nothing is dropped silently.
DROPS: dict[str, tuple[str, str, str]] = {
    "ringbuf_full": ("lost", "samples", "samples dropped: decoding fell behind and the ring buffer was full"),
    "tracked_full": ("lost", "processes",
                     "processes not followed (their samples are lost): the tracked-process table was full"),
    "events_ringbuf_full": ("lost", "events",
                            "process events (fork/exec/exit) dropped: their ring buffer was full"),
    "maps_ringbuf_full": ("lost", "map_events",
                          "new-mapping events dropped (samples in those mappings may be flagged "
                          "incomplete): their ring buffer was full"),
    "scope_ringbuf_full": ("lost", "scope_entries",
                           "--scope entries lost (samples under them are flagged): their ring buffer was "
                           "full"),
    "thread_state_full": ("degraded", "threads",
                          "threads traced without per-thread state (their samples are flagged incomplete, "
                          "'no per-thread state'): every state slot was in use (CCPROFD_THREADS)"),
    "return_lost": ("lost", "returns",
                    "--retval returns lost (their samples are written '= ?' though the call returned): "
                    "the process-event ring was full"),
    "return_unjoined": ("lost", "unjoined_returns",
                        "--retval return records left without their sample (the sample was dropped)"),
}



class TraceError(Exception):
    """Bad input for a trace (one line, exit status 2)."""



@dataclass(frozen=True, slots=True)
class UnwindEnforcement:
    """Enforcement from the unwinder (unwind mode only): the allowed (syscall number, context key)
    pairs, keys as ccprofd/anomaly/unwind_enforce.py computes them from a model; ``syscalls`` the
    numbers judged (None: every sampled syscall).  ``kill=False`` records denials only (audit);
    ``deny_incomplete``: a context the unwinder could not complete is denied (no model holds one)."""

    allowed: frozenset[tuple[int, int]]
    syscalls: tuple[int, ...] | None = None
    kill: bool = True
    deny_incomplete: bool = True


@dataclass(frozen=True, slots=True)
class TraceOptions:
    mode: str = DEFAULT_MODE
    syscalls: str | None = None  # "write,openat" or "all"/None
    encoding: str = "valence"
    scope: str | None = None
    sample_hz: int = 0
    verify: bool = False
    cache_dir: str | None = None
    edge_weights: str | None = None  # instrumented mode: build the plan with the call counts in this file
    save_edge_weights: str | None = None  # count every direct call site's hits; write them here at exit
    retval: bool = False  # join each syscall sample to its return value (raw_syscalls:sys_exit)
    # frames get DWARF file/line/inlined (tracing/symbols.ModuleSource); off by default: pyelftools
    # reads a compile unit in ~40 ms (libc's first ~0.2 s), paid in the poll loop at a frame's first use
    source_lines: bool = False
    enforce: UnwindEnforcement | None = None  # unwind mode: kill (syscall, context) pairs outside a model
    # unwind mode: also sample every ia32 syscall (`int $0x80` in a 64-bit process), whatever the
    # set, as ``ia32:<name>`` -- a raw_syscalls program beside the per-syscall events, paid on every
    # syscall of the machine (kbpf/syscall_entry.py, "the compat watch")
    watch_ia32: bool = False
    # The flight recorder's events per thread (tracing/history.c): None = CCPROFD_HISTORY or its
    # default (256); 0 = compiled out, no map.  `ccprofd trace` and `learn` pass 0: nothing they do
    # reads it, and it doubles the unwinder's verification (~+80 ms) and creates a 14 MB map.
    history: int | None = None



#: The ``reason`` of an incomplete sample whose decoder gave none (none does today).
UNKNOWN_REASON = "unknown"


@dataclass(slots=True)
class TraceSample:
    """One decoded sample in the issue-4 JSONL format.  ``frames`` is shared by every sample of
    the same context (the writers serialise it once): read it, never change it."""

    time_ns: int
    pid: int
    tid: int
    event: str
    syscall: str | None
    complete: bool
    frames: list[dict[str, Any]] = field(default_factory=list)
    #: Cheap syscall arguments, e.g. {"path": ...} for open*/execve* (absent when unknown).
    args: dict[str, str] | None = None
    #: The syscall's argument registers at entry as unsigned 64-bit words, as many as it takes when
    #: kbpf/syscalls.SYSCALL_ARGS knows it (else all six); None for CPU samples and old records.
    raw_args: tuple[int, ...] | None = None
    #: With TraceOptions.retval: True once the return is known (``ret``), False when it never came
    #: (exit_group, a successful execve that ended tracking: strace's ``= ?``); None: not traced.
    returned: bool | None = None
    ret: int | None = None
    #: Why the context is incomplete (the decoder's reason, as the summary's ``incomplete_reasons``
    #: and GetThreadContexts say it); None when complete.
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"time_ns": self.time_ns, "pid": self.pid, "tid": self.tid, "event": self.event,
                               "syscall": self.syscall, "complete": self.complete}
        if not self.complete:
            out["reason"] = self.reason or UNKNOWN_REASON
        out["frames"] = self.frames
        if self.args:
            out["args"] = self.args
        if self.raw_args is not None:
            out["raw_args"] = list(self.raw_args)
        if self.returned is not None:
            out["ret"] = self.ret
        return out



class Mode(Protocol):
    """How contexts are obtained.  ``prepare`` before the command runs (analysis, compile, attach);
    ``track_launch`` for our gated child (before it execs the target), ``track_running`` for -p;
    ``follow_exec`` for every process that execs a file later (the daemon's path targets; found ones
    come back from ``take_new_processes``); ``poll`` returns decoded samples; ``summary`` statistics
    for the end-of-run report; ``detach`` stops producing samples while what is recorded can
    still be polled (a stop drains it: ``backlog`` says how many records wait); ``drops`` counts,
    by reason (:data:`DROPS`), what the kernel side could not do (samples it could not send because
    decoding fell behind, processes it could not follow, threads it keeps no state for);
    ``map_entries`` the entries its BPF hash maps hold now; ``close``
    releases everything.  The daemon also uses ``set_per_sample``/``poll_counted`` (aggregate
    mode: the kernel counts repeated contexts), ``thread_contexts`` (GetThreadContexts) and the
    flight recorder's ``history`` / ``history_before`` (GetHistory, an alert's ``history``)."""

    name: str
    path: str
    build_id: str | None
    context_samples: bool  # keep what poll_counted() needs per context (a Session turns it off)

    def prepare(self) -> None: ...
    def track_launch(self, pid: int) -> None: ...
    def track_running(self, pid: int, tids: Sequence[int]) -> None: ...
    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None: ...
    def take_new_processes(self) -> list[int]: ...
    def poll(self, timeout_ms: int) -> list[TraceSample]: ...
    def unfinished(self) -> list[TraceSample]: ...
    def summary(self) -> dict[str, Any]: ...
    def detach(self) -> None: ...
    def backlog(self) -> int: ...
    def drops(self) -> dict[str, int]: ...
    def map_entries(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def set_per_sample(self, on: bool) -> None: ...
    def poll_counted(self, timeout_ms: int) -> tuple[list[tuple[TraceSample, bool]],
                                                     list[tuple[TraceSample, int]]]: ...
    def thread_contexts(self, pid: int) -> dict[str, Any]: ...
    def history(self, pid: int, last: int = 0) -> dict[str, Any]: ...
    def history_before(self, tid: int, time_ns: int, last: int) -> list[dict[str, Any]]: ...
    def history_threads(self) -> dict[int, list[dict[str, Any]]]: ...


def path_args(syscall: str | None, arg: str | None) -> dict[str, str] | None:
    """A sample's cheap arguments: the kernel's name for the path argument (exec*: filename)."""
    if arg is None:
        return None
    return {"filename" if (syscall or "").startswith("exec") else "path": arg}

