"""Unwind mode for ``ccprofd trace``: contexts computed at each sample by unwinding the stack in BPF
and encoding it there with the analysed binary's Valence plan, decoded here into issue-4 frames.

Stages (data flows one way): call graph + Valence plan -> :class:`UnwindEncoding` (unwind_plan.py)
-> BPF maps -> :class:`~ccprofd.tracing.unwind.sampler.EncodedRecord` per new context -> ``decoder_for(plan)``
-> :class:`~ccprofd.tracing.instrumented.symbolize.Frame` values.  :class:`UnwindMode` implements the tracer's
``Mode`` interface (ccprofd/tracing/session.py).

How a record becomes frames (outermost first):

* the plan's decoder turns the encoded state (acycID, recID, segments) and the innermost analysed
  node into a path ``[(caller, callee, site), ...]``; each edge gives the caller frame's
  ``call_site`` and ``return_address`` (``site`` + the call's length), or ``tail_call`` for a tail
  jump (a chain the stack cannot show but the plan encoded, see unwind_plan.py); a segment at
  ``OUTSIDE`` leaves them null (the caller was interrupted by a signal) unless the stack held a
  return address there;
* frames outside the analysed binary (libc, the loader, the vDSO, ...) come with the record as
  (module key, vaddr) after the analysed frame they lie below; they carry ``analysed: false``,
  their module, build-id, the function name from the object's ``.symtab``/``.dynsym`` when one
  covers the address, and their own return address (null for the innermost frame, whose pc is the
  instruction after the ``syscall``, and for frames interrupted by a signal);
* the innermost analysed frame's ``return_address`` is the one through which the library code
  below it was entered, or, when the sample's pc is inside the binary, ``call_site`` is that pc;
* the context is ``complete: false`` when the unwind stopped early (the reason is counted) or an
  internal bound was hit; then only the innermost, exactly known part is reported.

:func:`reference_record` recomputes an encoded context from a stack with
:class:`ccprofd.encode.Encoder` (the reference semantics) so tests -- and ``--verify`` -- can check
the BPF encoder sample by sample.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from ccprofd.elf.needed import load_set
from ccprofd.tracing.frames import Decoded, Frame
from ccprofd.tracing.unwind.plan import UnwindEncoding
from ccprofd.tracing.unwind.sampler import (
    FLAG_HIT,
    FLAG_NEW,
    UnwoundSample,
)
from ccprofd.tracing.unwind.symbolize import UnwindSymbolizer, reference_record, stack_frames


# ---------------------------------------------------------------------------------- the mode
class UnwindMode:
    """``ccprofd trace --mode unwind`` (the tracer's Mode interface)."""

    name = "unwind"

    def __init__(self, binary: str, options: Any) -> None:
        # /proc/PID/root/...: a binary in another mount namespace; resolving it would leave that namespace.
        self.path = binary if binary.startswith("/proc/") else os.path.realpath(binary)
        self.options = options
        self.build_id: str | None = None
        self.sampler: Any = None
        self._contexts: Any = None  # GetThreadContexts: a ContextReader, made at first use, closed at close()
        self.symbolizer: UnwindSymbolizer | None = None
        self.plan: dict[str, Any] | None = None
        self.encoding: UnwindEncoding | None = None
        # aggregate mode (the daemon): each new context's sample (no time, args) and the kernel
        # count already taken for it (ccprofd/tracing/kernelcounts.py)
        from ccprofd.tracing.kernelcounts import KernelCounts

        self._kernel: KernelCounts[tuple[int, int]] = KernelCounts()
        self._per_sample = True
        self.records = 0  # ring-buffer records received (samples of new contexts only in aggregate mode)
        self._clock_offset = time.time_ns() - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self.samples_seen = 0
        self.incomplete = 0
        self.verify_checked = 0
        self.verify_mismatches = 0
        self.reasons: dict[str, int] = {}
        self.fp_frames = 0

    # -------------------------------------------------------------------------------- set-up
    def prepare(self) -> None:
        from pathlib import Path

        from ccprofd.callgraph import analyze_binary
        from ccprofd.encode import get_plan
        from ccprofd.kbpf.syscalls import parse_syscalls
        from ccprofd.persist.cache import AnalysisCache
        from ccprofd.tracing.api import TraceError
        from ccprofd.tracing.unwind.plan import UnwindPlanError, cached_unwind_encoding
        from ccprofd.tracing.unwind.sampler import UnwindSampler

        try:
            nrs = parse_syscalls(self.options.syscalls)
        except ValueError as exc:
            raise TraceError(str(exc)) from None
        if self.options.encoding != "valence":
            raise TraceError(f"--encoding {self.options.encoding}: unwind mode implements valence only")
        if self.options.scope:
            raise TraceError("--scope is not implemented in unwind mode (every sample is unwound whole)")
        cache = Path(self.options.cache_dir) if self.options.cache_dir else None
        graph = analyze_binary(self.path, cache_dir=cache)
        self.plan = get_plan(graph, "valence", cache_dir=cache)
        if self.plan["binary"].get("content_hash") != graph.binary.content_hash:
            # a plan cached for another file with the same build-id (e.g. the unstripped twin)
            self.plan = get_plan(graph, "valence", cache_dir=cache, use_cache=False)
        try:
            self.encoding = cached_unwind_encoding(graph, self.plan, AnalysisCache(cache))
        except UnwindPlanError as exc:
            raise TraceError(str(exc)) from None
        self.build_id = graph.binary.build_id
        self.sampler = UnwindSampler(syscalls=nrs, aggregate=True, emit_hits=True, encoding=self.encoding,
                                     cache=AnalysisCache(cache), load_early=True)
        self.symbolizer = UnwindSymbolizer(self.encoding, self.plan, self.sampler.module_of_key)
        for path in load_set(self.path):
            self.sampler.preload(path)
        self.sampler.attach()
        if self.options.sample_hz:
            self.sampler.attach_cpu_sampling(int(self.options.sample_hz))

    def track_launch(self, pid: int) -> None:
        self.sampler.track(pid, launched=True)

    def track_running(self, pid: int, tids: Sequence[int]) -> None:
        self.sampler.track(pid)  # every thread: each sample unwinds its whole stack

    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None:
        """Track every process that execs the file ``inode`` = (st_dev, st_ino) from its first
        instruction (BPF holds it at exec until its mappings are loaded)."""
        self.sampler.follow_exec(inode, cgroup_id)

    def take_new_processes(self) -> list[int]:
        """Processes found at their exec of a followed file since the last call (confirmed)."""
        out, self.sampler.new_processes = self.sampler.new_processes, []
        return list(out)

    # -------------------------------------------------------------------------------- samples
    def poll(self, timeout_ms: int) -> list[Any]:
        return [t for t, _ in self._poll_decoded(timeout_ms, in_kernel=False)]

    def _poll_decoded(self, timeout_ms: int, *, in_kernel: bool) -> list[tuple[Any, bool]]:
        """Every record as a TraceSample, each with whether it is one sample counted here (False
        with ``in_kernel`` for new and repeated contexts: the kernel's count has them)."""
        from ccprofd.kbpf.syscalls import syscall_name
        from ccprofd.tracing.api import TraceSample, path_args

        raw = self.sampler.poll(timeout_ms)
        self.records += len(raw)
        fresh: dict[int, Decoded] = {}
        for s in raw:  # new contexts first: a hit may overtake its context's record
            if s.flags & FLAG_NEW and not s.flags & FLAG_HIT:
                d = fresh[id(s)] = self._decode(s)
                name = syscall_name(s.syscall) if s.syscall is not None else None
                self._kernel.learn(s.key, TraceSample(0, s.tgid, s.tid, s.event, name, d.complete,
                                                      [f.to_json() for f in d.frames]), d)
        out: list[tuple[Any, bool]] = []
        for s in raw:
            if s.flags & FLAG_HIT:
                known = self._kernel.hit(s.key)
                d = known if known is not None else Decoded([], False, "context record lost")
            else:
                d = fresh[id(s)] if id(s) in fresh else self._decode(s)
            counted = not (in_kernel and s.flags & (FLAG_HIT | FLAG_NEW))
            self.fp_frames += s.fp_frames
            if counted:
                self._count(d.complete, d.reason, 1)
            name = syscall_name(s.syscall) if s.syscall is not None else None
            out.append((TraceSample(s.time_ns + self._clock_offset, s.tgid, s.tid, s.event, name, d.complete,
                                    [f.to_json() for f in d.frames], path_args(name, s.arg)), counted))
        return out

    def _count(self, complete: bool, reason: str | None, n: int) -> None:
        self.samples_seen += n
        if not complete:
            self.incomplete += n
            key = (reason or "?").split(":")[0]
            self.reasons[key] = self.reasons.get(key, 0) + n

    def set_per_sample(self, on: bool) -> None:
        """The daemon's switch: a record per sample (a consumer needs each one) or only new
        contexts (aggregate mode: repeated samples are known only by the kernel's counts)."""
        if self.sampler is not None and on != self._per_sample:
            self.sampler.set_emit_hits(on)
            self._per_sample = on

    def poll_counted(self, timeout_ms: int) -> tuple[list[tuple[Any, bool]], list[tuple[Any, int]]]:
        """The daemon's poll: ``(records, counts)``.  ``records``: every record received, each with
        whether it is itself one sample to count (CPU samples, collisions, contexts the kernel
        could not store); ``counts``: ``(context, n)``, the samples the kernel counted under
        each context since the previous call, whether or not per-sample records were sent for
        them (the kernel increments a context's count before it sends its record, so counting
        from the map alone neither loses nor repeats a sample when the switch flips).

        The map is read after the ring buffer is drained: a context whose first record is not
        in yet (still being sent by another CPU) is left for the next call, its count not yet
        taken, so nothing is lost.  Keys whose record was never sent are deleted by BPF."""
        records = self._poll_decoded(timeout_ms, in_kernel=True)
        counts: list[tuple[Any, int]] = []
        for ctx, d, n in self._kernel.deltas(self.sampler.counts()):
            counts.append((ctx, n))
            self._count(d.complete, d.reason, n)
        return records, counts

    def _decode(self, s: UnwoundSample) -> Decoded:
        assert self.symbolizer is not None
        d = self.symbolizer.decode(s.encoded, s.reason)
        if getattr(self.options, "verify", False):
            self._verify(s)
        # frames are mutable: each sample gets its own copies
        return Decoded([Frame(f.function, f.module, f.build_id, f.analysed, f.call_site, f.return_address,
                              f.tail_call) for f in d.frames], d.complete, d.reason)

    def _verify(self, s: UnwoundSample) -> None:
        """Re-encode the sample's own stack with the reference Encoder and compare (--verify)."""
        assert self.encoding is not None and self.plan is not None and self.symbolizer is not None
        if s.encoded is None:
            return
        frames = stack_frames(self.sampler, s)
        if frames is None:
            return
        want, node, nframes = reference_record(self.encoding, self.plan, frames, s.complete)
        got = self.symbolizer.state_of(s.encoded)
        self.verify_checked += 1
        if (got, s.encoded.node, s.encoded.nframes) != (want, node, nframes):
            self.verify_mismatches += 1

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.name, "samples": self.samples_seen, "incomplete": self.incomplete,
                               "incomplete_reasons": dict(self.reasons), "lost_contexts": self._kernel.lost,
                               "fp_frames": self.fp_frames, "records": self.records,
                               "per_sample_records": self._per_sample}
        if self.sampler is not None:
            out["bpf"] = self.sampler.stats()
            out["map_bytes"] = sum(self.sampler.map_memory_bytes().values())
        if self.symbolizer is not None:
            out["decode_errors"] = self.symbolizer.errors
        if getattr(self.options, "verify", False):
            out["verify"] = {"checked": self.verify_checked, "mismatches": self.verify_mismatches}
        return out

    def close(self) -> None:
        reader = getattr(self, "_contexts", None)
        if reader is not None:  # thread snapshots' private vDSO copies (ccprofd/proc/modules.py)
            self._contexts = None
            reader.close()
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
            if getattr(self.options, "verify", False):
                import sys

                print(f"ccprofd: verify: {self.verify_checked} contexts checked, {self.verify_mismatches} "
                      f"mismatches against the reference encoder", file=sys.stderr)

    def thread_contexts(self, pid: int) -> dict[str, Any]:
        """Every thread's context now, unwound from a brief ptrace stop with the CFI tables
        (ccprofd/proc/threadsnap.py): ``{"pid", "error", "threads": [...]}``."""
        from ccprofd.tracing.threadcontexts import ContextReader

        reader = getattr(self, "_contexts", None)
        if reader is None:
            reader = self._contexts = ContextReader(self.path, self.options.cache_dir)
        return reader.read(pid)






