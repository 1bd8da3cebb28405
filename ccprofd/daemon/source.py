"""The seam between the daemon and the tracer: what a target's sample source must provide.

The daemon owns configuration, lifecycle, aggregation and export; the tracer (instrumented or
unwind mode) owns probes, BPF state, decoding and symbolisation.  One :class:`SampleSource` serves
one ``[[target]]``; the daemon builds it through a :data:`SourceFactory`, calls :meth:`start`
once (READY=1 is sent after every target's ``start`` returned), calls :meth:`poll` from one
dedicated thread, the query methods from gRPC/metrics threads at any time (so they must be safe to
call concurrently with ``poll``), and :meth:`close` exactly once when the target goes away
(reload, mode switch, shutdown).  All counters are cumulative since :meth:`start`.

Samples are plain dicts in the tracer's JSONL format (the contract of ``ccprofd trace --format
jsonl``): ``{"time_ns", "pid", "tid", "event": "syscall"|"cpu", "syscall", "complete", "frames":
[{"function", "module", "build_id", "analysed", "call_site", "return_address"[, "tail_call"][, "file",
"line"][, "inlined"]}, ...]}`` with frames outermost first and addresses as hex strings
(``return_address`` may be None); ``file``/``line``/``inlined`` when the target has ``source_lines``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ccprofd.daemon.config import DaemonConfig, TargetConfig

Sample = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A process the source follows.  ``pid`` is the host pid; ``binary`` the path the daemon opened
    (``/proc/PID/root/...`` for a process in another mount namespace)."""

    pid: int
    binary: str
    build_id: str
    threads: int
    comm: str = ""
    inode: int = 0


@dataclass(frozen=True, slots=True)
class BinaryInfo:
    """A binary (one inode) the source has analysed and attached probes to."""

    path: str
    build_id: str
    inode: int = 0
    attached: bool = True


@dataclass(frozen=True, slots=True)
class ThreadContext:
    """The current decoded context of one thread, frames as in a sample (outermost first)."""

    tid: int
    complete: bool
    frames: tuple[Mapping[str, Any], ...]
    comm: str = ""
    reason: str | None = None  # why incomplete (the unwinder's reason), None when complete


@dataclass(frozen=True, slots=True)
class SourceCounters:
    """Cumulative counters of one source.  ``dropped`` maps a reason (``ringbuf_full``,
    ``thread_state_full``...) to lost samples; ``map_entries`` maps a BPF map name to its current
    number of entries."""

    probe_hits: int = 0
    verify_mismatches: int = 0
    decode_errors: int = 0
    dropped: Mapping[str, int] = field(default_factory=dict)
    map_entries: Mapping[str, int] = field(default_factory=dict)


class TargetWaiting(Exception):
    """``start`` found nothing to attach to yet: the target's path or cgroup does not exist (or is
    not an ELF file / a cgroup now).  The daemon shows the target as ``waiting`` with this one-line
    reason and calls ``start`` of a new source again until it succeeds."""


class UnknownProcess(LookupError):
    """``thread_contexts`` was asked about a pid the source does not follow."""


@runtime_checkable
class SampleSource(Protocol):
    def start(self) -> None:
        """Analyse (from the cache when the build-id is known), attach, and return once probes are
        live.  Raise :class:`ccprofd.kbpf.errors.BPFError` (one-line message) on failure, and
        :class:`TargetWaiting` when the target's path or cgroup is not there (yet)."""

    def poll(self, timeout_ms: int) -> Iterable[Sample]:
        """Decoded samples that arrived since the last call, waiting at most ``timeout_ms``."""

    def mode(self) -> str:
        """The mode actually in effect: "instrumented" or "unwind"."""

    def processes(self) -> list[ProcessInfo]:
        """Processes currently followed."""

    def binaries(self) -> list[BinaryInfo]:
        """Binaries (inodes) currently analysed and attached."""

    def thread_contexts(self, pid: int) -> list[ThreadContext]:
        """Current context of every thread of ``pid``; raise :class:`UnknownProcess` if not followed."""

    def history(self, pid: int, last: int) -> dict[str, Any]:
        """The flight recorder: the last recorded syscall samples of each thread of process ``pid``
        (or of thread ``pid``), decoded, oldest first: ``{"pid", "threads": [{"tid", "events"}]}``;
        raise :class:`UnknownProcess` when no binary of the source has recorded it."""

    def history_before(self, pid: int, tid: int, time_ns: int, last: int) -> list[dict[str, Any]]:
        """Thread ``tid``'s (of process ``pid``) ``last`` recorded samples before ``time_ns``: an
        alert's ``history`` ([] when nothing is recorded)."""

    def callgraph_stats(self) -> dict[str, Any]:
        """The analyze/encoding report per binary: ``{binary path: {...graph_stats, "encodings": ...}}``."""

    def counters(self) -> SourceCounters:
        """Cumulative counters since :meth:`start`."""

    def close(self) -> None:
        """Detach everything and free BPF resources; idempotent."""


SourceFactory = Callable[[TargetConfig, DaemonConfig], SampleSource]
"""Builds the (not yet started) source of one target; the default is the tracer's ``make_source``."""

TRACER_FACTORY = "ccprofd.daemon.tracer_source:make_source"


def load_factory(spec: str = TRACER_FACTORY) -> SourceFactory:
    """Resolve ``module:function``; a missing tracer is a one-line :class:`RuntimeError`."""
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
        factory = getattr(module, attr or "make_source")
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"sample source {spec!r} is not available: {exc}") from None
    return factory
