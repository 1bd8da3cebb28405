"""Instrumented mode's :class:`~ccprofd.tracing.api.Mode`: Valence state maintained by uprobes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ccprofd.tracing.api import TraceError, TraceOptions, TraceSample, path_args


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
        self._fp: Any = None  # --verify: the frame-pointer walk (ccprofd/tracing/instrumented/fpverify.py)
        self._verifier: Any = None
        self.verify_skipped: str | None = None
        self._counter: Any = None  # --save-edge-weights (ccprofd/tracing/instrumented/callcount.py)
        self._graph_binary: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self._exec_targets: dict[int, tuple[int, int]] = {}
        self._new_processes: list[int] = []
        self._scope: Any = None  # --scope: prefixes above scope entries (scopeprefix.py)
        self._contexts: Any = None  # GetThreadContexts: LiveContextReader, made at first use
        # aggregate mode (the daemon, ccprofd/tracing/kernelcounts.py): on from the first set_per_sample
        from ccprofd.tracing.kernelcounts import KernelCounts

        self._kernel: KernelCounts[int] = KernelCounts()
        self._aggregating = False
        self._per_sample = True
        self.records = 0  # sample records received (new contexts only, in aggregate mode)

    def prepare(self) -> None:
        from pathlib import Path

        from ccprofd.callgraph import analyze_binary
        from ccprofd.elf.image import ElfImage
        from ccprofd.encode import build_plan, get_plan
        from ccprofd.kbpf.syscalls import parse_syscalls
        from ccprofd.tracing.instrumented.loader import InstrumentedBPF
        from ccprofd.tracing.instrumented.symbolize import Symbolizer

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

        from ccprofd.persist.cache import AnalysisCache
        from ccprofd.tracing.instrumented.probeplan import ProbePlanError, cached_probe_plan

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
            from ccprofd.tracing.instrumented.scopeprefix import live_prefixes

            self._scope = live_prefixes(pp, self._sym.names, self.options.cache_dir)
        self._bpf = InstrumentedBPF(pp, plan, syscalls=nrs, cache_dir=self.options.cache_dir)
        self._bpf.attach()
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
        from ccprofd.elf.cfi import build_table
        from ccprofd.tracing.instrumented.fpverify import FpStackSampler, FpVerifier, frame_pointer_calls
        from ccprofd.tracing.instrumented.probeplan import CCOL

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
            from ccprofd.proc.maps import read_maps

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
        from ccprofd.kbpf.holdguard import is_guard
        from ccprofd.tracing.syscall_sampler import exe_matches

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
            from ccprofd.tracing.instrumented.loader import SF_BIAS

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
        from ccprofd.kbpf.syscalls import syscall_name
        from ccprofd.tracing.frames import Decoded
        from ccprofd.tracing.instrumented.loader import AGG_NEW, ProcessEvent, RawContext, RawHit, ScopeEntry
        from ccprofd.tracing.syscall_sampler import EXEC_TARGET_FLAG

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
                                    [f.to_json() for f in d.frames], path_args(name, ev.arg)), counted))
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
        ptrace stop (ccprofd/tracing/instrumented/livestate.py): ``{"pid", "error", "threads": [...]}``."""
        from ccprofd.tracing.instrumented.livestate import LiveContextReader

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
        # thread snapshots' and --scope walks' private vDSO copies (ccprofd/proc/modules.py)
        reader, self._contexts = getattr(self, "_contexts", None), None
        if reader is not None:
            reader.close()
        if self._scope is not None:
            self._scope.close()
        if self._bpf is not None:
            self._bpf.close()
            self._bpf = None

