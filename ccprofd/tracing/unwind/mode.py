"""Unwind mode for ``ccprofd trace``: contexts computed at each sample by unwinding the stack in BPF
and encoding it there with the analysed binary's Valence plan, decoded here into issue-4 frames.

Stages (data flows one way): call graph + Valence plan -> :class:`UnwindEncoding` (plan.py)
-> BPF maps -> :class:`~ccprofd.tracing.unwind.sampler.EncodedRecord` per new context -> ``decoder_for(plan)``
-> :class:`~ccprofd.tracing.instrumented.symbolize.Frame` values.  :class:`UnwindMode` implements the tracer's
``Mode`` interface (ccprofd/tracing/session.py).

How a record becomes frames (outermost first):

* the plan's decoder turns the encoded state (acycID, recID, segments) and the innermost analysed
  node into a path ``[(caller, callee, site), ...]``; each edge gives the caller frame's
  ``call_site`` and ``return_address`` (``site`` + the call's length), or ``tail_call`` for a tail
  jump (a chain the stack cannot show but the plan encoded, see plan.py); a segment at
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
from collections.abc import Mapping, Sequence
from typing import Any

from ccprofd.elf.needed import load_set
from ccprofd.kbpf.bpfmap import RawMap
from ccprofd.kbpf.errors import BPFError
from ccprofd.tracing.api import TraceOptions, TraceSample, path_args
from ccprofd.tracing.base import (
    HIT,
    LOST_DECODED,
    NEW,
    PLAIN,
    RET_RINGBUF_PAGES,
    SYSCALL_INFO,
    ContextReader,
    ModeBase,
    syscall_info,
)
from ccprofd.tracing.frames import Decoded
from ccprofd.tracing.history import MAP_NAME as HISTORY_MAP
from ccprofd.tracing.history import HistoryEvent
from ccprofd.tracing.patharg import PATH_ARG_REGISTER, path_pointer
from ccprofd.tracing.unwind.constants import ARG_LEN, FLAG_COLLISION, FLAG_HIT, FLAG_NEW, FLAG_UNAGGREGATED
from ccprofd.tracing.unwind.enforcement import EnforcementDenial, UnwindEnforcementMaps
from ccprofd.tracing.unwind.plan import UnwindEncoding
from ccprofd.tracing.unwind.sampler import (
    HIT_ARGS,
    HIT_KEY1,
    HIT_KEY2,
    HIT_NR,
    HIT_TGID,
    HIT_TID,
    HIT_TIME,
    HitHeader,
    UnwindSampler,
    UnwoundSample,
)
from ccprofd.tracing.unwind.symbolize import UnwindSymbolizer, reference_record, stack_frames

# The compiled hit loop (chits.c, built by scripts/build_ext.sh at set-up): a poll of hits only
# (a flood of repeated contexts) made into the same TraceSamples as _sample(), ~4x faster.
# CCPROFD_PURE_PYTHON=1 leaves it out (the tests compare both paths).
try:
    if os.environ.get("CCPROFD_PURE_PYTHON"):
        raise ImportError("CCPROFD_PURE_PYTHON is set")
    from ccprofd.tracing.unwind import chits  # type: ignore[attr-defined, unused-ignore]

    if chits.HEADER != (HIT_TIME, HIT_TGID, HIT_TID, HIT_NR, HIT_KEY1, HIT_KEY2, HIT_ARGS, HIT_ARGS + 6):
        raise ImportError("chits.c reads another hit header layout than sampler.py's")  # rebuild it
    chits.prepare(TraceSample, ("time_ns", "pid", "tid", "event", "syscall", "complete", "frames", "args",
                                "raw_args", "returned", "ret", "reason"))
except (ImportError, TypeError):  # TypeError: built from an older chits.c (other fields): rebuild it
    chits = None

# ---------------------------------------------------------------------------------- the mode
# What the sampler hands the mode: decoded records, and the hits of a flood as their header's fields.
Record = UnwoundSample | HitHeader


class UnwindMode(ModeBase[Record, tuple[int, int]]):
    """``ccprofd trace --mode unwind`` (the tracer's Mode interface)."""

    name = "unwind"

    def __init__(self, binary: str, options: TraceOptions) -> None:
        super().__init__(binary, options)
        self.sampler: UnwindSampler | None = None
        self.symbolizer: UnwindSymbolizer | None = None
        self.plan: dict[str, Any] | None = None
        self.encoding: UnwindEncoding | None = None
        self._clock_offset = time.time_ns() - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self.verify_checked = 0
        self._path_syscalls: dict[str | None, int] = {}  # prepare()
        self.verify_mismatches = 0
        self.fp_frames = 0
        self._enforcement_final: tuple[dict[str, int], list[EnforcementDenial]] = ({}, [])
        self.enforcement_maps: UnwindEnforcementMaps | None = None

    # -------------------------------------------------------------------------------- set-up
    def prepare(self) -> None:
        from pathlib import Path

        from ccprofd.callgraph import analyze_binary
        from ccprofd.encode import get_plan
        from ccprofd.kbpf.syscalls import parse_syscalls
        from ccprofd.persist.cache import AnalysisCache
        from ccprofd.tracing.api import TraceError
        from ccprofd.tracing.unwind.plan import UnwindPlanError, cached_unwind_encoding

        try:
            nrs = parse_syscalls(self.options.syscalls)
        except ValueError as exc:
            raise TraceError(str(exc)) from None
        # the traced syscalls whose path BPF reads (name -> nr): their hits are checked for one
        self._path_syscalls = {syscall_info(nr)[0]: nr for nr in PATH_ARG_REGISTER
                               if nrs is None or nr in nrs}
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
        analysis_cache = AnalysisCache(cache)
        enf = self.options.enforce
        self.sampler = UnwindSampler(syscalls=nrs, aggregate=True, emit_hits=True, encoding=self.encoding,
                                     cache=analysis_cache, load_early=True,
                                     events_ringbuf_pages=RET_RINGBUF_PAGES if self.options.retval else 16,
                                     enforce_keys=0 if enf is None else max(1, len(enf.allowed)),
                                     history=self.options.history,
                                     compat_watch=self.options.watch_ia32)
        if enf is not None:
            self.enforcement_maps = UnwindEnforcementMaps(self.sampler.module)
            self.enforcement_maps.configure(enf.allowed, enf.syscalls, kill=enf.kill,
                                            deny_incomplete=enf.deny_incomplete)
        self.symbolizer = UnwindSymbolizer(self.encoding, self.plan, self.sampler.module_of_key,
                                           analysis_cache, source_lines=self.options.source_lines,
                                           shown_as=self.shown_path)
        for path in load_set(self.path, cache=analysis_cache):
            self.sampler.preload(path)
        self.sampler.attach()
        if self.options.retval:
            self.sampler.attach_returns()
        if self.options.sample_hz:
            self.sampler.attach_cpu_sampling(int(self.options.sample_hz))

    def enforcement(self) -> tuple[dict[str, int], list[EnforcementDenial]]:
        """Enforcement counters and each thread's first denial (empty without ``options.enforce``)."""
        if self.sampler is None:
            return self._enforcement_final  # what close() read last
        maps = self.enforcement_maps
        return ({}, []) if maps is None else (maps.stats(), maps.denials())

    def track_launch(self, pid: int) -> None:
        assert self.sampler is not None
        self.sampler.track(pid, launched=True)

    def track_running(self, pid: int, tids: Sequence[int]) -> None:
        assert self.sampler is not None
        self.sampler.track(pid)  # every thread: each sample unwinds its whole stack

    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None:
        """Track every process that execs the file ``inode`` = (st_dev, st_ino) from its first
        instruction (BPF holds it at exec until its mappings are loaded)."""
        assert self.sampler is not None
        self.sampler.follow_exec(inode, cgroup_id)

    def take_new_processes(self) -> list[int]:
        """Processes found at their exec of a followed file since the last call (confirmed)."""
        assert self.sampler is not None
        out, self.sampler.new_processes = self.sampler.new_processes, []
        return list(out)

    # -------------------------------------------------------------------------------- samples
    # ------------------------------------------------------------------ ModeBase's hooks
    def _receive(self, timeout_ms: int) -> list[Record]:
        assert self.sampler is not None
        raw = self.sampler.take(timeout_ms)
        self.fp_frames = self.sampler.fp_frames  # counted by the sampler as records arrive
        return raw

    def _take_returns(self) -> list[tuple[int, int, int, int]]:
        assert self.sampler is not None
        rets, self.sampler.returns = self.sampler.returns, []
        off = self._clock_offset
        return [(e.time_ns + off, e.tid, e.syscall if e.syscall is not None else -1, e.ret) for e in rets]

    def _kind(self, r: Record) -> int:
        if isinstance(r, tuple):
            return HIT
        flags = r.flags
        return HIT if flags & FLAG_HIT else NEW if flags & FLAG_NEW else PLAIN

    def _kinds(self, raw: list[Record]) -> list[int]:
        return [HIT if isinstance(r, tuple) or r.flags & FLAG_HIT else NEW if r.flags & FLAG_NEW else PLAIN
                for r in raw]

    def _key(self, r: Record) -> tuple[int, int]:
        return r[HIT_KEY1:HIT_KEY2 + 1] if isinstance(r, tuple) else r.key  # type: ignore[return-value]

    def _sample(self, r: Record, d: Decoded, *, timed: bool = True) -> TraceSample:
        if isinstance(r, tuple):  # a hit's header (the bulk of a flood): straight to its TraceSample
            nr = r[HIT_NR]
            if nr < 0:
                return TraceSample(r[HIT_TIME] + self._clock_offset, r[HIT_TGID], r[HIT_TID], "cpu", None,
                                   d.complete, d.json_frames(), None, None, None, None,
                                   None if d.complete else d.reason)
            name, nargs = SYSCALL_INFO.get(nr) or syscall_info(nr)
            sargs = r[HIT_ARGS:HIT_ARGS + nargs]
            path = self._unread_path(r[HIT_TGID], nr, sargs, r[HIT_TIME]) if nr in PATH_ARG_REGISTER else None
            return TraceSample(r[HIT_TIME] + self._clock_offset, r[HIT_TGID], r[HIT_TID], "syscall", name,
                               d.complete, d.json_frames(), path_args(name, path), sargs, None, None,
                               None if d.complete else d.reason)
        if not timed:
            return self.trace_sample(0, r.tgid, r.tid, r.event, r.syscall, d)
        nrs = r.syscall
        arg = r.arg if r.arg is not None else self._unread_path(r.tgid, nrs, r.sargs, r.time_ns)
        return self.trace_sample(r.time_ns + self._clock_offset, r.tgid, r.tid,
                                 "cpu" if nrs is None else "syscall", nrs, d, arg, r.sargs)

    def _unread_path(self, tgid: int, nr: int | None, sargs: tuple[int, ...] | None,
                     time_ns: int) -> str | None:
        """A path argument BPF could not read at entry (a page not faulted in yet), from the file
        mapped there when it is a read-only segment of an object (tracing/patharg.py)."""
        ptr = path_pointer(nr, sargs)
        if not ptr or self.sampler is None:
            return None
        return self.sampler.processes.string_at(tgid, ptr, ARG_LEN, time_ns)

    def _later_context(self, r: Record, d: Decoded) -> Any:
        # the fields _sample(timed=False) reads, not the record (its pcs, encoded state...)
        assert not isinstance(r, tuple)  # a new context's record is never a hit's header
        return (r.tgid, r.tid, r.event, r.syscall, d)

    def _representative(self, arg: Any) -> TraceSample:
        return self.trace_sample(0, *arg)

    def _history_map(self) -> RawMap | None:
        if self.sampler is None:
            return None
        try:
            return self.sampler.module.map(HISTORY_MAP)
        except BPFError:  # compiled out (CCPROFD_HISTORY=0)
            return None

    def _history_key(self, ev: HistoryEvent) -> tuple[int, int] | None:
        # a hash shared with another context, or a context not stored: sent on its own
        return None if ev.ctx_kind & (FLAG_COLLISION | FLAG_UNAGGREGATED) else (ev.ctx, ev.ctx2)

    def _history_clock_offset(self) -> int:
        return self._clock_offset

    def _hits_only(self, raw: list[Record]) -> tuple[list[TraceSample], int, int, list[Decoded]] | None:
        if chits is None:
            return None
        got: tuple[list[TraceSample], int, int, list[Decoded]] | None = chits.hit_samples(
            raw, self._kernel.by_key, SYSCALL_INFO, syscall_info, self._clock_offset, LOST_DECODED)
        if got is not None and self._path_syscalls:  # a hit has no path when BPF could not read it
            for s in got[0]:
                nr = self._path_syscalls.get(s.syscall) if s.args is None else None
                if nr is not None:
                    s.args = path_args(s.syscall, self._unread_path(s.pid, nr, s.raw_args,
                                                                    s.time_ns - self._clock_offset))
        return got

    def _kernel_counts(self) -> Mapping[tuple[int, int], int]:
        assert self.sampler is not None
        return self.sampler.counts()

    def _new_context_reader(self) -> ContextReader:
        """Every thread unwound from a brief ptrace stop with the CFI tables (proc/threadsnap.py)."""
        from ccprofd.tracing.threadcontexts import ContextReader as SnapshotReader

        return SnapshotReader(self.path, self.options.cache_dir, shown_as=self.shown_path)

    def set_per_sample(self, on: bool) -> None:
        """The daemon's switch: a record per sample (a consumer needs each one) or only new
        contexts (aggregate mode: repeated samples are known only by the kernel's counts)."""
        if self.sampler is not None and on != self._per_sample:
            self.sampler.set_emit_hits(on)
            self._per_sample = on

    def _decode(self, s: Record) -> Decoded:  # new and plain records only: never a HitHeader
        assert self.symbolizer is not None and not isinstance(s, tuple)
        d = self.symbolizer.decode(s.encoded, s.reason, s.fp_frames > 0)  # fresh Frames every record
        if self.options.verify:
            self._verify(s)
        return d

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
        out = self._summary(per_sample_records=self._per_sample)
        out["fp_frames"] = self.fp_frames
        if self.sampler is not None:
            out["bpf"] = self.sampler.stats()
            out["map_bytes"] = sum(self.sampler.map_memory_bytes().values())
        if self.options.enforce is not None:
            out["enforcement"] = self.enforcement()[0]
        if self.symbolizer is not None:
            out["decode_errors"] = self.symbolizer.errors
        if self.options.verify:
            out["verify"] = {"checked": self.verify_checked, "mismatches": self.verify_mismatches}
        return out

    def detach(self) -> None:
        if self.sampler is not None:
            self.sampler.detach()

    def backlog(self) -> int:
        return self.sampler.module.ring_buffer_backlog() if self.sampler is not None else 0

    def map_entries(self) -> dict[str, int]:
        """Entries held now by each of this mode's BPF hash maps (the daemon's map metric)."""
        return self.sampler.module.map_entries() if self.sampler is not None else {}

    def drops(self) -> dict[str, int]:
        return {**(self.sampler.drops() if self.sampler is not None else {}),
                **self._returns.drops()}  # --retval's (all 0 without it)

    def close(self) -> None:
        self._close_contexts()  # thread snapshots' private vDSO copies
        if self.sampler is not None:
            if self.options.enforce is not None:
                self._enforcement_final = self.enforcement()
            self.sampler.close()
            self.sampler = None
            if self.options.verify:
                import sys

                print(f"ccprofd: verify: {self.verify_checked} contexts checked, {self.verify_mismatches} "
                      f"mismatches against the reference encoder", file=sys.stderr)
