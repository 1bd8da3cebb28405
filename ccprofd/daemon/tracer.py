"""A trace session: ``ccprofd trace`` — start ``-- CMD`` with probes attached before its exec, or
attach to ``-p PID``; stream decoded samples; pass the command's stdio and exit status through.

Modes plug in through :class:`Mode`: anything that can be prepared for a binary, told which
processes to follow, and polled for :class:`TraceSample` values (instrumented mode here; unwind mode
implements the same interface).  The session owns the process side (fork, exec gate, wait, signals)
and nothing about how contexts are obtained.

Public API::

    TraceOptions(...)                         what to trace and how
    open_session(argv, *, syscalls=None, options=None) -> Session   (also used by learn/detect)
    Session.samples() -> Iterator[dict]       JSON-ready samples until the command has exited
    Session.wait() -> int                     the command's exit status (128+N for signal N)
    attach_session(pid, options) -> Session   for -p PID (wait() returns 0 after detaching)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

from ccprofd.bpf.errors import BPFError

MODES = ("instrumented", "unwind")
DEFAULT_MODE = "unwind"  # cheap; instrumented mode is for --scope and unwind-table-less code


class TraceError(Exception):
    """Bad input for a trace (one line, exit status 2)."""


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


@dataclass(slots=True)
class TraceSample:
    """One decoded sample in the issue-4 JSONL format."""

    time_ns: int
    pid: int
    tid: int
    event: str
    syscall: str | None
    complete: bool
    frames: list[dict[str, Any]] = field(default_factory=list)
    #: Cheap syscall arguments, e.g. {"path": ...} for open*/execve* (absent when unknown).
    args: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"time_ns": self.time_ns, "pid": self.pid, "tid": self.tid, "event": self.event,
                               "syscall": self.syscall, "complete": self.complete, "frames": self.frames}
        if self.args:
            out["args"] = self.args
        return out


class Mode(Protocol):
    """How contexts are obtained.  ``prepare`` before the command runs (analysis, compile, attach);
    ``track_launch`` for our gated child (before it execs the target), ``track_running`` for -p;
    ``follow_exec`` for every process that execs a file later (the daemon's path targets; found ones
    come back from ``take_new_processes``); ``poll`` returns decoded samples; ``summary`` statistics
    for the end-of-run report."""

    name: str
    path: str
    build_id: str | None

    def prepare(self) -> None: ...
    def track_launch(self, pid: int) -> None: ...
    def track_running(self, pid: int, tids: Sequence[int]) -> None: ...
    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None: ...
    def take_new_processes(self) -> list[int]: ...
    def poll(self, timeout_ms: int) -> list[TraceSample]: ...
    def summary(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class InstrumentedMode:
    """Instrumented mode: Valence state maintained by uprobes (ccprofd/bpf/instrumented.*)."""

    name = "instrumented"

    def __init__(self, binary: str, options: TraceOptions) -> None:
        # /proc/PID/root/...: a binary in another mount namespace; resolving it would leave that namespace.
        self.path = binary if binary.startswith("/proc/") else os.path.realpath(binary)
        self.options = options
        self.build_id: str | None = None
        self._bpf: Any = None
        self._sym: Any = None
        self.samples_seen = 0
        self.incomplete = 0
        self.reasons: dict[str, int] = {}
        self._fp: Any = None  # --verify: the frame-pointer walk (ccprofd/bpf/fpverify.py)
        self._verifier: Any = None
        self.verify_skipped: str | None = None
        self._counter: Any = None  # --save-edge-weights (ccprofd/bpf/callcount.py)
        self._graph_binary: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self._exec_targets: dict[int, tuple[int, int]] = {}
        self._new_processes: list[int] = []
        self._scope: Any = None  # --scope: prefixes above scope entries (ccprofd/decode/scopeprefix.py)
        self._contexts: Any = None  # GetThreadContexts: LiveContextReader, made at first use
        # aggregate mode (the daemon, ccprofd/bpf/kernelcounts.py): on from the first set_per_sample
        from ccprofd.bpf.kernelcounts import KernelCounts

        self._kernel: KernelCounts[int] = KernelCounts()
        self._aggregating = False
        self._per_sample = True
        self.records = 0  # sample records received (new contexts only, in aggregate mode)

    def prepare(self) -> None:
        from pathlib import Path

        from ccprofd.bpf.instrumented import InstrumentedBPF
        from ccprofd.bpf.syscall_names import parse_syscalls
        from ccprofd.callgraph import analyze_binary
        from ccprofd.callgraph.elfimage import ElfImage
        from ccprofd.decode.frames import Symbolizer
        from ccprofd.encode import build_plan, get_plan

        try:
            nrs = parse_syscalls(self.options.syscalls)
        except ValueError as exc:
            raise TraceError(str(exc)) from None
        if self.options.encoding not in ("valence", "pcce", "hcce"):
            raise TraceError(f"--encoding {self.options.encoding}: instrumented mode implements valence, "
                             "pcce and hcce (stack tags cannot be decoded exactly)")
        cache = Path(self.options.cache_dir) if self.options.cache_dir else None
        graph = analyze_binary(self.path, cache_dir=cache)
        weights = self._load_weights(graph)
        plan = get_plan(graph, self.options.encoding, weights=weights, cache_dir=cache)
        words = int(plan["report"].get("words_needed") or 1)
        if plan["report"].get("overflow"):  # PCCE/HCCE ids wider than one word: size the id to fit
            plan = get_plan(graph, self.options.encoding, pcce_words=words, weights=weights, cache_dir=cache)
        if plan["binary"].get("content_hash") != graph.binary.content_hash:
            # The plan cache is keyed by build-id, which a stripped copy shares with its original.
            plan = build_plan(graph, self.options.encoding, pcce_words=max(1, int(plan["acyc_words"])),
                              weights=weights)
        images: list[Any] = []

        def image() -> Any:  # read only when needed: a cached probe plan needs no ELF parse
            if not images:
                images.append(ElfImage(self.path))
            return images[0]

        from ccprofd.bpf.probeplan import ProbePlanError, cached_probe_plan
        from ccprofd.callgraph.cache import AnalysisCache

        try:
            pp = cached_probe_plan(graph, plan, image, AnalysisCache(cache),
                                   sample_points="all" if self.options.sample_hz else "syscalls",
                                   scope=self.options.scope)
        except ProbePlanError as exc:
            raise TraceError(str(exc)) from None
        self.build_id = graph.binary.build_id
        self.probe_plan = pp
        self._sym = Symbolizer(pp, plan)
        if self.options.scope:
            from ccprofd.decode.scopeprefix import live_prefixes

            self._scope = live_prefixes(pp, self._sym.names, self.options.cache_dir)
        self._bpf = InstrumentedBPF(pp, plan, syscalls=nrs, cache_dir=self.options.cache_dir)
        self._bpf.attach()
        if self.options.sample_hz:
            self._bpf.attach_cpu_sampling(int(self.options.sample_hz))
        if self.options.verify:
            self._prepare_verify(image(), nrs)
        if self.options.save_edge_weights:
            from ccprofd.bpf.callcount import CallCounter, counted_sites

            self._graph_binary = {"path": graph.binary.path, "build_id": graph.binary.build_id,
                                  "content_hash": graph.binary.content_hash}
            self._names = dict(pp.names)
            self._counter = CallCounter(self.path, image().addrspace, counted_sites(graph.sites),
                                        cache_dir=self.options.cache_dir)
            self._counter.attach()

    def _load_weights(self, graph: Any) -> dict[tuple[int, int, int], int] | None:
        """--edge-weights: the counts of a profiling run of this very binary (TraceError otherwise)."""
        if not self.options.edge_weights:
            return None
        from ccprofd.encode.weightsfile import WeightsFileError, load_weights

        try:
            return load_weights(self.options.edge_weights, graph.binary.content_hash)
        except WeightsFileError as exc:
            raise TraceError(str(exc)) from None

    def _prepare_verify(self, image: Any, nrs: Any) -> None:
        """--verify: a frame-pointer walk at each sampled syscall, joined with the samples in poll().
        A binary whose functions do not keep frame pointers is not checked (the walk would be wrong,
        not the context): the exit line says so."""
        from ccprofd.bpf.fpverify import FpStackSampler, FpVerifier, frame_pointer_calls
        from ccprofd.bpf.probeplan import CCOL
        from ccprofd.callgraph.cfi import build_table

        table = build_table(image)
        fp, total = frame_pointer_calls(table.lookup(c[CCOL["vaddr"]]).kind for c in self.probe_plan.callsites
                                        if not c[CCOL["is_jump"]])
        if total == 0 or fp * 10 < total * 9:
            self.verify_skipped = (f"{self.path} does not keep frame pointers (.eh_frame: {fp} of its "
                                   f"{total} calls are made with the frame defined from rbp)")
            return
        self._fp = FpStackSampler(syscalls=nrs, cache_dir=self.options.cache_dir)
        self._fp.attach()
        self._verifier = FpVerifier(image.addrspace, pie=image.pie, bias_of=self._bias_of)
        self._biases: dict[int, int | None] = {}
        self._addrspace = image.addrspace

    def _bias_of(self, tgid: int) -> int | None:
        """Load bias of the binary in process ``tgid`` from its maps (None when it is gone)."""
        if tgid not in self._biases:
            from ccprofd.decode.procmaps import read_maps

            bias = None
            try:
                for m in read_maps(tgid):
                    if m.file_backed and os.path.realpath(m.path) == self.path:
                        bias = self._addrspace.load_bias(m.start, m.offset)
                        break
            except (OSError, ValueError):
                bias = None
            if bias is None:
                return None  # not cached: a later sample may find the process
            self._biases[tgid] = bias
        return self._biases[tgid]

    def track_launch(self, pid: int) -> None:
        if self._fp is not None:
            self._fp.track_launch(pid)
        if self._counter is not None:
            self._counter.track(pid)
        self._bpf.track_launch(pid)

    def track_running(self, pid: int, tids: Sequence[int]) -> None:
        if self._fp is not None:
            self._fp.track_running(pid)
        if self._counter is not None:
            self._counter.track(pid)
        self._bpf.track_running(pid, tids, cache_dir=self.options.cache_dir)  # seeds each thread (seed.py)

    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None:
        """Track every process that execs the file ``inode`` = (st_dev, st_ino) from its first
        instruction: the uprobes are attached to the inode for every process; BPF tracks the
        process and gives it a fresh state at its exec."""
        self._bpf.sampler.follow_exec(inode[1], cgroup_id)
        if self._fp is not None:
            self._fp.follow_exec(inode[1], cgroup_id)  # --verify: walks of the same processes
        self._exec_targets[inode[1]] = inode

    def take_new_processes(self) -> list[int]:
        """Processes found at their exec of a followed file since the last call (confirmed)."""
        out, self._new_processes = self._new_processes, []
        return out

    def _exec_found(self, tgid: int) -> None:
        from ccprofd.bpf.holdguard import is_guard
        from ccprofd.bpf.syscall_sampler import exe_matches

        if is_guard(tgid):  # our own hold guard, started on a target interpreter
            self._bpf.sampler.untrack(tgid)
            return
        try:
            ino = os.stat(f"/proc/{tgid}/exe").st_ino
        except OSError:
            return  # already gone: its samples stand, nothing to register
        want = self._exec_targets.get(ino)
        if want is not None and exe_matches(tgid, want):
            self._new_processes.append(tgid)
        else:  # the inode number matched another file: not ours
            self._bpf.sampler.untrack(tgid)

    def poll(self, timeout_ms: int) -> list[TraceSample]:
        return [t for t, _ in self._poll_decoded(timeout_ms, in_kernel=False)]

    def _decode(self, ev: Any) -> Any:
        d = self._sym.decode(ev)
        if self._scope is not None:
            d = self._scope.join(ev, d)
        if self._verifier is not None:
            from ccprofd.bpf.instrumented import SF_BIAS

            self._verifier.add_sample(time_ns=ev.time_ns, tid=ev.tid, tgid=ev.pid,
                                      syscall=ev.syscall if ev.event == "syscall" else None, ip=ev.ip,
                                      sp=ev.sp, bias=ev.bias if ev.flags & SF_BIAS else None,
                                      complete=d.complete, frames=d.frames)
        return d

    def _count(self, complete: bool, reason: str | None, n: int) -> None:
        self.samples_seen += n
        if not complete:
            self.incomplete += n
            key = (reason or "?").split(":")[0]
            self.reasons[key] = self.reasons.get(key, 0) + n

    def _poll_decoded(self, timeout_ms: int, *, in_kernel: bool) -> list[tuple[TraceSample, bool]]:
        """Every sample record as a TraceSample, each with whether it is one sample counted here
        (False with ``in_kernel`` for new and repeated contexts: the kernel's count has them)."""
        from ccprofd.bpf.instrumented import AGG_NEW, ProcessEvent, RawContext, RawHit, ScopeEntry
        from ccprofd.bpf.syscall_names import syscall_name
        from ccprofd.bpf.syscall_sampler import EXEC_TARGET_FLAG
        from ccprofd.decode.frames import Decoded

        events = self._bpf.poll(timeout_ms)
        fresh: dict[int, Any] = {}
        for ev in events:  # new contexts first: a hit (another CPU) may overtake its context's record
            if isinstance(ev, RawContext) and ev.agg == AGG_NEW:
                d = fresh[id(ev)] = self._decode(ev)
                name = syscall_name(ev.syscall)
                self._kernel.learn(ev.ctx_id, TraceSample(0, ev.pid, ev.tid, ev.event, name, d.complete,
                                                          [f.to_json() for f in d.frames]), d)
        out: list[tuple[TraceSample, bool]] = []
        for ev in events:
            if isinstance(ev, ProcessEvent) and ev.kind == "exec" and ev.aux & EXEC_TARGET_FLAG:
                self._exec_found(ev.pid)
            if isinstance(ev, ScopeEntry) and self._scope is not None:
                self._scope.add(ev)
            if isinstance(ev, RawHit):
                d = self._kernel.hit(ev.ctx_id)
                if d is None:
                    d = Decoded([], False, "context record lost")
                counted = not in_kernel
            elif isinstance(ev, RawContext):
                d = fresh[id(ev)] if id(ev) in fresh else self._decode(ev)
                counted = not (in_kernel and ev.agg == AGG_NEW)
            else:
                continue
            self.records += 1
            if counted:
                self._count(d.complete, d.reason, 1)
            name = syscall_name(ev.syscall)
            out.append((TraceSample(ev.time_ns, ev.pid, ev.tid, ev.event, name, d.complete,
                                    [f.to_json() for f in d.frames], _path_args(name, ev.arg)), counted))
        if self._fp is not None and self._verifier is not None:
            self._verifier.add_walks(self._fp.poll())  # after the samples: their walks are in by now
        return out

    def set_per_sample(self, on: bool) -> None:
        """The daemon's switch: a record per sample (a consumer needs each one) or only new
        contexts (aggregate mode, turned on by the first call: repeated samples are then known only
        by the kernel's counts).  --scope (samples are joined with their scope entry's prefix) and
        --verify (each sample is checked against its own stack walk) keep a record per sample."""
        if self._bpf is None or any(x is not None for x in (self._scope, self._verifier, self._counter)):
            return
        if not self._aggregating:
            self._bpf.set_emit_hits(on)  # before aggregation starts: no sample falls between
            self._bpf.set_aggregate(True)
            self._aggregating = True
        elif on != self._per_sample:
            self._bpf.set_emit_hits(on)
        self._per_sample = on

    def poll_counted(self, timeout_ms: int) -> tuple[list[tuple[TraceSample, bool]],
                                                     list[tuple[TraceSample, int]]]:
        """The daemon's poll: ``(records, counts)`` as unwind mode's (see kernelcounts.py): every
        record with whether it is itself one sample to count (without aggregation, CPU samples,
        states larger than a key, contexts the full table could not take), and the samples the
        kernel counted per context since the previous call."""
        records = self._poll_decoded(timeout_ms, in_kernel=True)
        counts: list[tuple[TraceSample, int]] = []
        if self._aggregating:
            for ctx, d, n in self._kernel.deltas(self._bpf.agg_counts()):
                counts.append((ctx, n))
                self._count(d.complete, d.reason, n)
        return records, counts

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.name, "samples": self.samples_seen, "incomplete": self.incomplete,
                               "incomplete_reasons": dict(self.reasons), "records": self.records,
                               "per_sample_records": self._per_sample or not self._aggregating,
                               "lost_contexts": self._kernel.lost}
        if self._bpf is not None:
            out["bpf"] = self._bpf.stats()
            out["probes"] = self.probe_plan.stats
        if self._sym is not None:
            out["decode_errors"] = self._sym.errors
        if self._scope is not None:
            out["scope_prefix"] = self._scope.summary()
        if self._bpf is not None and self._bpf.seed_report:
            out["seeding"] = {str(p): {str(t): r for t, r in th.items()}
                              for p, th in self._bpf.seed_report.items()}
        if self.options.verify:
            if self.verify_skipped is not None:
                out["verify"] = {"checked": 0, "mismatches": 0, "frames_checked": 0,
                                 "skipped": self.verify_skipped}
            elif self._verifier is not None:
                out["verify"] = self._verifier.counts.to_json()
                if self._fp is not None:
                    out["verify"]["bpf"] = self._fp.stats()
        return out

    def thread_contexts(self, pid: int) -> dict[str, Any]:
        """Every thread's context now, from its live per-thread BPF state, made current during a brief
        ptrace stop (ccprofd/daemon/livestate.py): ``{"pid", "error", "threads": [...]}``."""
        from ccprofd.daemon.livestate import LiveContextReader

        reader = getattr(self, "_contexts", None)
        if reader is None:
            reader = self._contexts = LiveContextReader(self._bpf, self._sym, self.path,
                                                        self.options.cache_dir, scope=self._scope)
        return reader.read(pid)

    def close(self) -> None:
        import sys

        if self._counter is not None:
            counter: Any = self._counter
            self._counter = None
            try:
                if self.options.save_edge_weights:
                    from ccprofd.encode.weightsfile import save_weights

                    save_weights(self.options.save_edge_weights, self._graph_binary, counter.counts(),
                                 self._names)
            except OSError as exc:
                print(f"ccprofd: cannot write edge weights {self.options.save_edge_weights}: "
                      f"{exc.strerror or exc}", file=sys.stderr)
            finally:
                counter.close()
        if self._fp is not None and self._verifier is not None:
            fp: Any = self._fp
            self._fp = None
            try:
                self._verifier.add_walks(fp.poll())
                c = self._verifier.finish()
            finally:
                fp.close()
            print(f"ccprofd: verify: {c.checked} contexts checked, {c.mismatches} mismatches against a "
                  f"frame-pointer walk ({c.frames_checked} frames checked; {c.no_frames} samples whose walk "
                  f"reached no frame of the binary, {c.unjoined} without a walk, {c.cpu_not_verified} CPU "
                  "samples not verified)", file=sys.stderr)
            for line in c.examples:
                print(f"ccprofd: verify: mismatch: {line}", file=sys.stderr)
        elif self.verify_skipped is not None and self._bpf is not None:
            print(f"ccprofd: verify: skipped: {self.verify_skipped}", file=sys.stderr)
        # thread snapshots' and --scope walks' private vDSO copies (ccprofd/decode/modules.py)
        reader, self._contexts = getattr(self, "_contexts", None), None
        if reader is not None:
            reader.close()
        if self._scope is not None:
            self._scope.close()
        if self._bpf is not None:
            self._bpf.close()
            self._bpf = None


def _path_args(syscall: str | None, arg: str | None) -> dict[str, str] | None:
    """A sample's cheap arguments: the kernel's name for the path argument (exec*: filename)."""
    if arg is None:
        return None
    return {"filename" if (syscall or "").startswith("exec") else "path": arg}


def make_mode(binary: str, options: TraceOptions) -> Mode:
    if options.mode == "instrumented":
        return InstrumentedMode(binary, options)
    if options.mode == "unwind":
        from ccprofd.bpf.unwind_mode import UnwindMode

        return UnwindMode(binary, options)
    raise TraceError(f"unknown --mode {options.mode!r} (expected one of {', '.join(MODES)})")


def resolve_command(argv: Sequence[str]) -> str:
    """The executable ``argv[0]`` names (PATH lookup as execvp does); TraceError when there is none."""
    if not argv:
        raise TraceError("no command given after --")
    cmd = argv[0]
    path = cmd if "/" in cmd else shutil.which(cmd)
    if path is None or not os.path.exists(path):
        raise TraceError(f"command not found: {cmd}")
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise TraceError(f"{cmd}: not an executable file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"\x7fELF":
        raise TraceError(f"{cmd}: not an ELF executable (to trace a script, trace its interpreter)")
    return os.path.abspath(path)


def exit_status(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


class Session:
    """A running trace: the mode plus the traced process(es)."""

    def __init__(self, mode: Mode, *, child: int | None = None, attached: int | None = None) -> None:
        self.mode = mode
        self.child = child
        self.attached = attached
        self.path = mode.path
        self.build_id = mode.build_id
        self.status: int | None = None
        self.failed: BaseException | None = None
        self._stop = False

    # ------------------------------------------------------------------------------ running
    def stop(self) -> None:
        """Detach at the next poll (Ctrl-C in -p mode)."""
        self._stop = True

    def _target_alive(self) -> bool:
        if self.child is not None:
            if self.status is not None:
                return False
            pid, st = os.waitpid(self.child, os.WNOHANG)
            if pid == self.child:
                self.status = exit_status(st)
                return False
            return True
        if self.attached is not None:
            return os.path.exists(f"/proc/{self.attached}")
        return False

    def batches(self, poll_ms: int = 100) -> Iterator[list[TraceSample]]:
        """Batches of samples until the target exits (then the buffers are drained) or stop()."""
        try:
            while not self._stop and self._target_alive():
                batch = self.mode.poll(poll_ms)
                if batch:
                    yield batch
            empty = 0
            while empty < 2:
                batch = self.mode.poll(20)
                if batch:
                    empty = 0
                    yield batch
                else:
                    empty += 1
        except (BPFError, OSError) as exc:
            self.failed = exc
            raise

    def samples(self) -> Iterator[dict[str, Any]]:
        for batch in self.batches():
            for s in batch:
                yield s.to_json()

    def wait(self) -> int:
        """The command's exit status (waiting for it if needed); 0 for an attached process."""
        if self.child is not None and self.status is None:
            while True:
                try:
                    _, st = os.waitpid(self.child, 0)
                    self.status = exit_status(st)
                    break
                except InterruptedError:
                    continue
                except ChildProcessError:
                    self.status = 0
                    break
        self.close()
        return self.status if self.status is not None else 0

    def close(self) -> None:
        self.mode.close()

    def summary(self) -> dict[str, Any]:
        return self.mode.summary()


def _gated_child(path: str, argv: Sequence[str]) -> tuple[int, int]:
    """Fork a child that execs ``path`` once released (one byte on the returned pipe fd); EOF
    without the byte (ccprofd failed before attaching) makes it exit 125 without running anything."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(w)
            go = os.read(r, 1)
            os.close(r)
            if go != b"x":
                os._exit(125)
            # Python ignores SIGPIPE and SIGXFSZ and an ignored disposition survives exec: give
            # the command the dispositions its shell would (`ccprofd trace -- yes | head` must end
            # by SIGPIPE, not loop on EPIPE), as subprocess's restore_signals does.
            for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            os.execv(path, list(argv))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.write(2, f"ccprofd: cannot execute {argv[0]}: {exc.strerror}\n".encode())
            os._exit(126 if exc.errno in (13, 8) else 127)
        os._exit(127)
    os.close(r)
    return pid, w


def open_session(argv: Sequence[str], *, syscalls: Sequence[str] | str | None = None,
                 options: TraceOptions | None = None,
                 on_launch: Callable[[int], None] | None = None) -> Session:
    """Start ``argv`` traced: probes attached before it execs, so contexts are complete from the
    first instruction of ``main``.  ``syscalls``: names (or a comma-separated string); None = all.
    ``on_launch(pid)`` runs before the child is released (e.g. to put it under enforcement too)."""
    opts = options or TraceOptions()
    if syscalls is not None and not isinstance(syscalls, str):
        syscalls = ",".join(syscalls)
    if syscalls is not None:
        opts = TraceOptions(**{**_asdict(opts), "syscalls": syscalls})
    path = resolve_command(argv)
    mode = make_mode(path, opts)
    pid, gate = _gated_child(path, argv)
    try:
        mode.prepare()
        mode.track_launch(pid)
        if on_launch is not None:
            on_launch(pid)
    except BaseException:
        os.close(gate)  # the child exits without running the command
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        mode.close()
        raise
    os.write(gate, b"x")
    os.close(gate)
    return Session(mode, child=pid)


def attach_session(pid: int, options: TraceOptions) -> Session:
    """Trace the running process ``pid`` (its threads' frames above the first event are unknown)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        raise TraceError(f"no process {pid}") from None
    except PermissionError:
        raise TraceError(f"cannot inspect process {pid}: permission denied") from None
    if exe.endswith(" (deleted)"):
        raise TraceError(f"process {pid} runs a deleted executable")
    mode = make_mode(exe, options)
    try:
        mode.prepare()
        mode.track_running(pid, tids)
    except BaseException:
        mode.close()
        raise
    seeded = mode.summary().get("seeding", {}).get(str(pid))
    if seeded is not None:  # one line once the threads run again: what is complete from now on
        import sys

        bad = {t: r for t, r in seeded.items() if r is not None}
        why = "".join(f"; {'thread ' + t if t != '0' else 'all'} not seeded: {r}" for t, r in bad.items())
        print(f"ccprofd: attached to pid {pid}: {len(seeded) - len(bad)} of {len(seeded)} threads seeded by "
              f"one unwind{why}", file=sys.stderr, flush=True)
    return Session(mode, attached=pid)


def _asdict(o: TraceOptions) -> dict[str, Any]:
    return {k: getattr(o, k) for k in o.__slots__}


# ------------------------------------------------------------------------------------------ run
Writer = Callable[[TraceSample], None]


def run(session: Session, write: Writer, *, launched: bool) -> int:
    """Stream the session's samples to ``write``; returns the exit status for the CLI."""
    previous: dict[signal.Signals, Any] = {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if launched:
            if signum == signal.SIGTERM and session.child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(session.child, signal.SIGTERM)
            return  # Ctrl-C reaches the command through the terminal; we keep tracing it
        session.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        try:
            for batch in session.batches():
                for s in batch:
                    write(s)
        except (BPFError, OSError) as exc:
            import sys

            print(f"ccprofd: tracing failed: {exc}", file=sys.stderr)
            session.close()
            if launched:
                session.wait()
            return 125
        status = session.wait()
        return status if launched else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

