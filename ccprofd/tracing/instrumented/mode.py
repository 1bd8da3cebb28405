"""Instrumented mode's :class:`~ccprofd.tracing.api.Mode`: Valence state maintained by uprobes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ccprofd.kbpf.bpfmap import RawMap
from ccprofd.kbpf.errors import BPFError
from ccprofd.tracing.api import TraceError, TraceOptions, TraceSample
from ccprofd.tracing.base import HIT, NEW, PLAIN, RET_RINGBUF_PAGES, SIDE, ContextReader, ModeBase
from ccprofd.tracing.frames import Decoded
from ccprofd.tracing.history import MAP_NAME as HISTORY_MAP
from ccprofd.tracing.history import HistoryEvent
from ccprofd.tracing.instrumented.constants import ARG_LEN, SF_BIAS
from ccprofd.tracing.instrumented.loader import (
    AGG_HIT,
    AGG_NEW,
    InstrumentedBPF,
    Limits,
    ProcessEvent,
    RawContext,
    RawHit,
    ScopeEntry,
)
from ccprofd.tracing.patharg import binary_path_arg
from ccprofd.tracing.syscall_sampler import EXEC_TARGET_FLAG, exec_verdict

if TYPE_CHECKING:
    from ccprofd.tracing.instrumented.callcount import CallCounter
    from ccprofd.tracing.instrumented.fpverify import VerifyRun
    from ccprofd.tracing.instrumented.scopeprefix import ScopePrefixes
    from ccprofd.tracing.instrumented.symbolize import Symbolizer

Event = RawContext | RawHit | ProcessEvent | ScopeEntry


def edge_weights_of(path: str | None, graph: Any) -> dict[tuple[int, int, int], int] | None:
    """--edge-weights: the counts of a profiling run of this very binary (TraceError otherwise)."""
    if not path:
        return None
    from ccprofd.encode.weightsfile import WeightsFileError, load_weights

    try:
        return load_weights(path, graph.binary.content_hash)
    except WeightsFileError as exc:
        raise TraceError(str(exc)) from None


class InstrumentedMode(ModeBase[Event, int]):
    """Instrumented mode: Valence state maintained by uprobes (instrumented.c, loader.py)."""

    name = "instrumented"

    def __init__(self, binary: str, options: TraceOptions) -> None:
        super().__init__(binary, options)
        self._bpf: InstrumentedBPF | None = None
        self._sym: Symbolizer | None = None
        self._verify: VerifyRun | None = None  # --verify: a frame-pointer walk per sample (fpverify.py)
        self._counter: CallCounter | None = None  # --save-edge-weights (callcount.py)
        self._graph_binary: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self._exec_targets: dict[int, tuple[int, int]] = {}
        self._new_processes: list[int] = []
        self._scope: ScopePrefixes | None = None  # --scope: prefixes above scope entries (scopeprefix.py)
        self._aggregating = False  # aggregate mode (the daemon): on from the first set_per_sample
        self._biases = ProcessBiases()  # for hits' unread path arguments (_unread_path)

    def prepare(self) -> None:
        from pathlib import Path

        from ccprofd.callgraph import analyze_binary
        from ccprofd.elf.image import ElfImage
        from ccprofd.encode import build_plan, get_plan
        from ccprofd.kbpf.syscalls import parse_syscalls
        from ccprofd.tracing.instrumented.symbolize import Symbolizer

        try:
            nrs = parse_syscalls(self.options.syscalls)
        except ValueError as exc:
            raise TraceError(str(exc)) from None
        if self.options.watch_ia32:
            raise TraceError("watching ia32 syscalls is implemented in unwind mode only")
        if self.options.encoding not in ("valence", "pcce", "hcce"):
            raise TraceError(f"--encoding {self.options.encoding}: instrumented mode implements valence, "
                             "pcce and hcce (stack tags cannot be decoded exactly)")
        cache = Path(self.options.cache_dir) if self.options.cache_dir else None
        graph = analyze_binary(self.path, cache_dir=cache)
        weights = edge_weights_of(self.options.edge_weights, graph)
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

        from ccprofd.persist.cache import AnalysisCache
        from ccprofd.tracing.instrumented.probeplan import ProbePlanError, cached_probe_plan

        try:
            pp = cached_probe_plan(graph, plan, image, AnalysisCache(cache),
                                   sample_points="all" if self.options.sample_hz else "syscalls",
                                   scope=self.options.scope)
        except ProbePlanError as exc:
            raise TraceError(str(exc)) from None
        self.build_id, self.probe_plan = graph.binary.build_id, pp
        self._sym = Symbolizer(pp, plan, source_lines=self.options.source_lines, cache=AnalysisCache(cache),
                               shown_as=self.shown_path)
        if self.options.scope:
            from ccprofd.tracing.instrumented.scopeprefix import live_prefixes

            self._scope = live_prefixes(pp, self._sym.names, self.options.cache_dir, module=self.shown_path)
        limits = Limits(sampler_ring=RET_RINGBUF_PAGES) if self.options.retval else Limits()
        self._bpf = InstrumentedBPF(pp, plan, syscalls=nrs, limits=limits, cache_dir=self.options.cache_dir,
                                    history=self.options.history)
        self._bpf.attach()
        if self.options.retval:
            self._bpf.sampler.attach_returns()
        if self.options.sample_hz:
            self._bpf.attach_cpu_sampling(int(self.options.sample_hz))
        if self.options.verify:
            self._prepare_verify(image(), nrs)
        if self.options.save_edge_weights:
            from ccprofd.tracing.instrumented.callcount import CallCounter, counted_sites

            self._graph_binary = {"path": graph.binary.path, "build_id": graph.binary.build_id,
                                  "content_hash": graph.binary.content_hash}
            self._names = dict(pp.names)
            self._counter = CallCounter(self.path, image().addrspace, counted_sites(graph.sites),
                                        cache_dir=self.options.cache_dir)
            self._counter.attach()
        # A record per sample, but repeated contexts decoded once: the kernel keys each context and
        # sends a later sample of it as a small header (decoded by a lookup).  Decoding every record
        # whole made a 100k-write burst overflow the ring (the daemon flips the same switch).
        self.set_per_sample(True)

    def _prepare_verify(self, image: Any, nrs: Any) -> None:
        """--verify: a frame-pointer walk at each sampled syscall, joined with the samples in poll()."""
        from ccprofd.elf.cfi import build_table
        from ccprofd.tracing.instrumented.fpverify import VerifyRun
        from ccprofd.tracing.instrumented.probeplan import CCOL

        table = build_table(image)
        kinds = (table.lookup(c[CCOL["vaddr"]]).kind
                 for c in self.probe_plan.callsites if not c[CCOL["is_jump"]])
        self._verify = VerifyRun(self.path, image, kinds, nrs, self.options.cache_dir)

    def track_launch(self, pid: int) -> None:
        if self._verify is not None:
            self._verify.track_launch(pid)
        if self._counter is not None:
            self._counter.track(pid)
        assert self._bpf is not None
        self._bpf.track_launch(pid)

    def track_running(self, pid: int, tids: Sequence[int]) -> None:
        if self._verify is not None:
            self._verify.track_running(pid)
        if self._counter is not None:
            self._counter.track(pid)
        assert self._bpf is not None
        self._bpf.track_running(pid, tids, cache_dir=self.options.cache_dir)  # seeds each thread (seed.py)

    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None:
        """Track every process that execs the file ``inode`` = (st_dev, st_ino) from its first
        instruction: the uprobes are attached to the inode for every process; BPF tracks the
        process and gives it a fresh state at its exec."""
        assert self._bpf is not None
        self._bpf.sampler.follow_exec(inode[1], cgroup_id)
        if self._verify is not None:
            self._verify.follow_exec(inode[1], cgroup_id)
        self._exec_targets[inode[1]] = inode

    def take_new_processes(self) -> list[int]:
        """Processes found at their exec of a followed file since the last call (confirmed)."""
        out, self._new_processes = self._new_processes, []
        return out

    # ------------------------------------------------------------------ ModeBase's hooks
    def _receive(self, timeout_ms: int) -> list[Event]:
        assert self._bpf is not None
        return list(self._bpf.poll(timeout_ms))

    def _take_returns(self) -> list[tuple[int, int, int, int]]:
        assert self._bpf is not None
        rets, self._bpf.returns = self._bpf.returns, []
        off = self._bpf.layout.clock_offset  # as the samples' times
        return [(e.time_ns + off, e.tid, -1 if e.syscall is None else e.syscall, e.ret) for e in rets]

    def _kind(self, r: Event) -> int:
        if isinstance(r, RawHit):
            return HIT
        if isinstance(r, RawContext):
            return NEW if r.agg == AGG_NEW else PLAIN
        return SIDE

    def _on_side_event(self, r: Event) -> None:
        if isinstance(r, ProcessEvent):
            self._biases.process_event(r)
        if isinstance(r, ProcessEvent) and r.kind == "exec" and r.aux & EXEC_TARGET_FLAG:
            assert self._bpf is not None
            verdict = exec_verdict(r.pid, self._exec_targets)
            if verdict == "followed":
                self._new_processes.append(r.pid)
            elif verdict == "other":  # the inode number matched another file, or our hold guard
                self._bpf.sampler.untrack(r.pid)
        elif isinstance(r, ScopeEntry) and self._scope is not None:
            self._scope.add(r)

    def _key(self, r: Event) -> int:
        assert isinstance(r, RawContext | RawHit)
        return r.ctx_id

    def _decode(self, r: Event) -> Decoded:
        assert isinstance(r, RawContext) and self._sym is not None
        d = self._sym.decode(r)
        if self._scope is not None:
            d = self._scope.join(r, d)
        if self._verify is not None and self._verify.verifier is not None:
            self._verify.verifier.add_sample(time_ns=r.time_ns, tid=r.tid, tgid=r.pid,
                                      syscall=r.syscall if r.event == "syscall" else None, ip=r.ip,
                                      sp=r.sp, bias=r.bias if r.flags & SF_BIAS else None,
                                      complete=d.complete, frames=d.frames)
        return d

    def _sample(self, r: Event, d: Decoded, *, timed: bool = True) -> TraceSample:
        assert isinstance(r, RawContext | RawHit)
        self._biases.note(r)
        arg = (r.arg or _unread_path(self, r)) if timed else None
        return self.trace_sample(r.time_ns if timed else 0, r.pid, r.tid, r.event, r.syscall, d, arg,
                                 r.sargs if timed else None)

    def _history_map(self) -> RawMap | None:
        if self._bpf is None:
            return None
        try:
            return self._bpf.module.map(HISTORY_MAP)
        except BPFError:  # compiled out (CCPROFD_HISTORY=0)
            return None

    def _history_key(self, ev: HistoryEvent) -> int | None:
        return ev.ctx if ev.ctx_kind in (AGG_NEW, AGG_HIT) else None

    def _history_clock_offset(self) -> int:
        assert self._bpf is not None
        return int(self._bpf.layout.clock_offset)

    def _kernel_counts(self) -> dict[int, int]:
        assert self._bpf is not None
        return self._bpf.agg_counts() if self._aggregating else {}

    def _after_poll(self) -> None:
        if self._verify is not None:
            self._verify.after_poll()

    def _new_context_reader(self) -> ContextReader:
        """GetThreadContexts from the live per-thread BPF state, made current during a brief ptrace
        stop (livestate.py)."""
        from ccprofd.tracing.instrumented.livestate import LiveContextReader

        return LiveContextReader(self._bpf, self._sym, self.path, self.options.cache_dir, scope=self._scope,
                                 shown_as=self.shown_path)

    # ------------------------------------------------------------------------------ daemon
    def set_per_sample(self, on: bool) -> None:
        """The daemon's switch: a record per sample (a consumer needs each one) or only new
        contexts (aggregate mode, turned on by the first call: repeated samples are then known only
        by the kernel's counts).  --scope (samples are joined with their scope entry's prefix) and
        --verify (each sample is checked against its own stack walk) keep a record per sample."""
        checking = self._verify is not None and self._verify.verifier is not None
        if self._bpf is None or checking or self._scope is not None or self._counter is not None:
            return
        if not self._aggregating:
            self._bpf.set_emit_hits(on)  # before aggregation starts: no sample falls between
            self._bpf.set_aggregate(True)
            self._aggregating = True
        elif on != self._per_sample:
            self._bpf.set_emit_hits(on)
        self._per_sample = on

    def summary(self) -> dict[str, Any]:
        out = self._summary(per_sample_records=self._per_sample or not self._aggregating)
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
        if self.options.verify and self._verify is not None:
            out["verify"] = self._verify.summary()
        return out

    def detach(self) -> None:
        if self._verify is not None:
            self._verify.detach()
        if self._bpf is not None:
            self._bpf.detach()

    def backlog(self) -> int:
        return self._bpf.module.ring_buffer_backlog() if self._bpf is not None else 0

    def map_entries(self) -> dict[str, int]:
        """Entries held now by each of this mode's BPF hash maps (the daemon's map metric)."""
        return self._bpf.module.map_entries() if self._bpf is not None else {}

    def drops(self) -> dict[str, int]:
        return {**(self._bpf.drops() if self._bpf is not None else {}),
                **self._returns.drops()}  # --retval's (all 0 without it)

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
        if self._verify is not None and self._bpf is not None:
            self._verify.close()
        self._close_contexts()  # thread snapshots' private vDSO copies
        if self._scope is not None:
            self._scope.close()
        if self._bpf is not None:
            self._bpf.close()
            self._bpf = None


class ProcessBiases:
    """The analysed binary's load bias per process, from its context records (SF_BIAS): a repeated
    context's hit record carries none, and its unread path argument needs it (_unread_path).  A fork
    keeps the parent's mappings; an exec or the group's exit ends them."""

    def __init__(self) -> None:
        self.by_pid: dict[int, int] = {}

    def note(self, r: RawContext | RawHit) -> None:
        if isinstance(r, RawContext) and r.flags & SF_BIAS:
            self.by_pid[r.pid] = r.bias

    def process_event(self, r: ProcessEvent) -> None:
        if r.kind == "fork" and r.pid in self.by_pid:
            self.by_pid[r.aux] = self.by_pid[r.pid]
        elif r.kind == "exec" or (r.kind == "exit" and r.aux):
            self.by_pid.pop(r.pid, None)


def _unread_path(mode: InstrumentedMode, r: RawContext | RawHit) -> str | None:
    """A path argument BPF could not read at entry, from the analysed binary's file (only its load
    bias is known here, from the process's context records: a path in a library keeps its pointer,
    and so does a hit of a process that never sent a context record with its bias)."""
    bias = mode._biases.by_pid.get(r.pid)
    if bias is None:
        return None
    return binary_path_arg(mode.path, mode.binary_inode, r.syscall, r.sargs, bias, ARG_LEN)
