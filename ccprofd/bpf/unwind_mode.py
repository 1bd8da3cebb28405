"""Unwind mode for ``ccprofd trace``: contexts computed at each sample by unwinding the stack in BPF
and encoding it there with the analysed binary's Valence plan, decoded here into issue-4 frames.

Stages (data flows one way): call graph + Valence plan -> :class:`UnwindEncoding` (unwind_plan.py)
-> BPF maps -> :class:`~ccprofd.bpf.unwind.EncodedRecord` per new context -> ``decoder_for(plan)``
-> :class:`~ccprofd.decode.frames.Frame` values.  :class:`UnwindMode` implements the tracer's
``Mode`` interface (ccprofd/daemon/tracer.py).

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
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ccprofd.bpf.unwind import (
    FLAG_HIT,
    FLAG_NEW,
    UE_F_ANCHOR,
    UE_F_INNER_EXACT,
    UE_F_REC_OVF,
    UE_F_SEG_OVF,
    UE_F_UNAN_OVF,
    EncodedRecord,
    UnwoundSample,
)
from ccprofd.bpf.unwind_plan import FN_SKIP, NO_NODE, UnwindEncoding
from ccprofd.callgraph.model import ROOT
from ccprofd.decode import CachingDecoder, DecodeError, UnknownCaller, decoder_for
from ccprofd.decode.frames import Decoded, Frame, demangle
from ccprofd.encode import Encoder
from ccprofd.encode.plan import COL
from ccprofd.encode.segments import OUTSIDE, EncodedState, Segment


# ------------------------------------------------------------------------------ ELF symbols
class ModuleSymbols:
    """Function symbols of one unanalysed object (``.symtab`` where present, else ``.dynsym``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._starts: list[int] = []
        self._rows: list[tuple[int, int, str]] = []
        try:
            from elftools.elf.elffile import ELFFile

            with open(path, "rb") as fh:
                elf = ELFFile(fh)
                rows: dict[int, tuple[int, int, str]] = {}
                for name in (".dynsym", ".symtab"):
                    sec = elf.get_section_by_name(name)
                    if sec is None or not hasattr(sec, "iter_symbols"):
                        continue
                    for sym in sec.iter_symbols():
                        if sym["st_info"]["type"] not in ("STT_FUNC", "STT_GNU_IFUNC") or not sym.name:
                            continue
                        lo, size = int(sym["st_value"]), int(sym["st_size"])
                        if size <= 0 or sym["st_shndx"] == "SHN_UNDEF":
                            continue
                        old = rows.get(lo)
                        # prefer the public name (no leading underscore) among aliases
                        if old is None or (old[2].startswith("_") and not sym.name.startswith("_")):
                            rows[lo] = (lo, lo + size, sym.name)
        except (OSError, ValueError, ImportError):
            rows = {}
        except Exception:  # malformed ELF: no names, never a crash
            rows = {}
        self._rows = sorted(rows.values())
        self._starts = [r[0] for r in self._rows]

    def name_at(self, vaddr: int) -> str | None:
        i = bisect_right(self._starts, vaddr) - 1
        if i >= 0:
            lo, hi, name = self._rows[i]
            if lo <= vaddr < hi:
                return name
        return None


# ---------------------------------------------------------------------------- symbolisation
class UnwindSymbolizer:
    """Decodes encoded records of one analysed binary into issue-4 frames (cached per context)."""

    def __init__(self, encoding: UnwindEncoding, plan: Mapping[str, Any],
                 module_of_key: Any) -> None:
        self.enc = encoding
        self.plan = plan
        self.decoder = CachingDecoder(decoder_for(plan))
        self.module: str = os.path.realpath(str(encoding.binary["path"]))
        self.build_id: str | None = encoding.binary.get("build_id")
        names = [str(n) for n in plan["names"]]
        pretty = demangle(names)
        self.names = [pretty.get(n, n) for n in names]
        self.nodes = encoding.nodes
        self.module_of_key = module_of_key
        self._index = {n: i for i, n in enumerate(self.nodes)}
        self._symbols: dict[str, ModuleSymbols] = {}
        self.errors = 0

    def _name(self, node: int) -> str:
        i = self._index.get(node)
        if i is None:
            return f"sub_{node:x}" if node >= 0 else f"node_{node}"
        return self.names[i]

    def _frame(self, node: int) -> Frame:
        return Frame(self._name(node), self.module, self.build_id, True)

    def _unanalysed(self, key: int, vaddr: int, exact: bool) -> Frame:
        mod = self.module_of_key(key)
        if mod is None:
            return Frame(None, None, None, False, None, None if exact else vaddr)
        path, build_id, readable = mod
        syms = self._symbols.get(readable)
        if syms is None:
            syms = self._symbols[readable] = ModuleSymbols(readable)
        name = syms.name_at(vaddr if exact else vaddr - 1)
        if name is not None and name.startswith("_Z"):
            name = demangle([name]).get(name, name)
        return Frame(name, path, build_id, False, None, None if exact else vaddr)

    def state_of(self, rec: EncodedRecord) -> EncodedState:
        nodes = self.nodes
        segs = tuple(Segment(s.saved, s.rec_height, s.site, nodes[s.callee],
                             None if s.caller == NO_NODE else nodes[s.caller]) for s in rec.segments)
        return EncodedState(acyc=rec.acyc, rec=rec.rec, rec_len=rec.rec_len, segments=segs)

    def decode(self, rec: EncodedRecord | None, reason: str | None) -> Decoded:
        complete = reason is None
        if rec is None:
            return Decoded([], False, reason or "no encoded context")
        if rec.flags & (UE_F_ANCHOR | UE_F_SEG_OVF | UE_F_REC_OVF | UE_F_UNAN_OVF):
            complete = False
            reason = reason or _flag_reason(rec.flags)
        if rec.node == NO_NODE:
            return Decoded([], complete, reason)
        node = self.nodes[rec.node]
        state = self.state_of(rec)
        try:
            path = self.decoder.decode(state, node)
        except UnknownCaller as exc:
            path = exc.partial
            if not rec.flags & UE_F_ANCHOR:
                self.errors += 1
                return Decoded([], False, "decode error: unknown caller")
        except DecodeError as exc:
            self.errors += 1
            return Decoded([], False, f"decode error: {exc}")
        nodes = self.nodes
        seg_ret = {(s.site, nodes[s.callee], nodes[s.caller]): s.ret
                   for s in rec.segments if s.caller != NO_NODE}
        frames = self._path_frames(path, node, seg_ret)
        stack_frames = [i for i, f in enumerate(frames) if not f.tail_call]
        if len(stack_frames) != rec.nframes:
            self.errors += 1
            return Decoded([], False, f"decode error: {len(stack_frames)} frames decoded, "
                                      f"{rec.nframes} unwound")
        inner = frames[-1]
        if rec.flags & UE_F_INNER_EXACT:
            inner.call_site = rec.inner
        else:
            inner.return_address = rec.inner
            inner.call_site = self.enc.callsites.get(rec.inner)
        if rec.unanalysed:
            out: list[Frame] = []
            below: dict[int, list[Frame]] = {}
            for u in rec.unanalysed:
                below.setdefault(u.after, []).append(self._unanalysed(u.module_key, u.vaddr, u.exact))
            k = 0
            for f in frames:
                out.append(f)
                if not f.tail_call:
                    out.extend(below.get(k, ()))
                    k += 1
            frames = out
        return Decoded(frames, complete, reason)

    def _path_frames(self, path: Sequence[tuple[int, int, int]], node: int,
                     seg_ret: Mapping[tuple[int, int, int], int]) -> list[Frame]:
        if not path:
            return [self._frame(node)]
        start = 0
        if path[0][0] == ROOT:
            first, start = path[0][1], 1
        else:
            first = path[0][0]
        frames = [self._frame(first)]
        for caller, callee, site in path[start:]:
            prev = frames[-1]
            if site == OUTSIDE:
                ret = seg_ret.get((site, callee, caller), 0)
                prev.return_address = ret or None
            elif site:
                prev.call_site = site
                if site in self.enc.jump_sites:
                    prev.tail_call = True
                else:
                    prev.return_address = site + self.enc.call_lengths.get(site, 0)
            frames.append(self._frame(callee))
        return frames


def _flag_reason(flags: int) -> str:
    for bit, why in ((UE_F_SEG_OVF, "segments_full"), (UE_F_REC_OVF, "recid_full"),
                     (UE_F_UNAN_OVF, "unanalysed_frames_full"), (UE_F_ANCHOR, "outer_frames_unknown")):
        if flags & bit:
            return why
    return "incomplete"


# ------------------------------------------------------------------------- reference encoder
@dataclass(frozen=True, slots=True)
class StackFrame:
    """One unwound frame as the reference encoder sees it (outermost first)."""

    module_key: int
    analysed: bool  # in the analysed binary's mapping
    vaddr: int
    exact: bool


def reference_record(enc: UnwindEncoding, plan: Mapping[str, Any], frames: Sequence[StackFrame],
                     complete_unwind: bool, *, max_segments: int = 64) -> tuple[EncodedState, int, int]:
    """(encoded state, innermost dense node or NO_NODE, analysed frames) of a stack, computed by
    driving :class:`Encoder` with the calls that built it -- the semantics the BPF pass must match.
    Anchors (outer frames unknown) are segments whose caller is None."""
    rows = plan["sites"]
    nodes = enc.nodes
    e = Encoder(plan)
    cur: int | None = None
    cur_v = 0
    cur_exact = False
    gap = 0
    nframes = 0
    anchored = False

    def anchor(callee: int) -> None:
        nonlocal e, nframes, anchored
        e = Encoder(plan)
        e.enter_from_outside(nodes[callee])
        anchored = True
        nframes = 0

    for f in frames:
        hit = enc.function_at(f.vaddr if f.exact else f.vaddr - 1) if f.analysed else None
        if hit is None or hit[1] & FN_SKIP:
            if cur is not None:
                gap += 1
            continue
        node = hit[0]
        if cur is None:
            if not complete_unwind:
                anchor(node)
            elif (0, node) in enc.edges:
                for sid in enc.edges[(0, node)].sites:
                    r = rows[sid]
                    e.call((r[COL["caller"]], r[COL["callee"]], r[COL["site"]]))
            else:
                e.enter_from_outside(nodes[node])
        else:
            row = enc.edges.get((cur_v, node)) if not cur_exact and gap == 0 else None
            if row is not None:
                for sid in row.sites:
                    r = rows[sid]
                    e.call((r[COL["caller"]], r[COL["callee"]], r[COL["site"]]))
            elif len(e.segments) >= max_segments:
                anchor(node)
            elif not cur_exact and cur_v in enc.callsites:
                e.unencoded_call(enc.callsites[cur_v], nodes[node])
            else:
                e.enter_from_outside(nodes[node])
        nframes += 1
        cur, cur_v, cur_exact, gap = node, f.vaddr, f.exact, 0
    st = e.state()
    if anchored and st.segments:
        first = st.segments[0]
        st = EncodedState(acyc=st.acyc, rec=st.rec, rec_len=st.rec_len,
                          segments=(Segment(first.saved, first.rec_height, first.site, first.callee, None),
                                    *st.segments[1:]))
    return st, (cur if cur is not None else NO_NODE), nframes


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
        # count already taken for it (ccprofd/bpf/kernelcounts.py)
        from ccprofd.bpf.kernelcounts import KernelCounts

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

        from ccprofd.bpf.syscall_names import parse_syscalls
        from ccprofd.bpf.unwind import UnwindSampler
        from ccprofd.bpf.unwind_plan import UnwindPlanError, cached_unwind_encoding
        from ccprofd.callgraph import analyze_binary
        from ccprofd.callgraph.cache import AnalysisCache
        from ccprofd.daemon.tracer import TraceError
        from ccprofd.encode import get_plan

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
        from ccprofd.bpf.syscall_names import syscall_name
        from ccprofd.daemon.tracer import TraceSample, _path_args

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
                                    [f.to_json() for f in d.frames], _path_args(name, s.arg)), counted))
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
        if reader is not None:  # thread snapshots' private vDSO copies (ccprofd/decode/modules.py)
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
        (ccprofd/daemon/threadsnap.py): ``{"pid", "error", "threads": [...]}``."""
        from ccprofd.daemon.threadsnap import ContextReader

        reader = getattr(self, "_contexts", None)
        if reader is None:
            reader = self._contexts = ContextReader(self.path, self.options.cache_dir)
        return reader.read(pid)


LIBRARY_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib",
                "/usr/lib")


def load_set(binary: str, limit: int = 64) -> list[str]:
    """The binary, its interpreter and the shared objects it needs (DT_NEEDED, searched in its
    RPATH/RUNPATH and the standard directories): what the process will map at exec, so their
    tables can be loaded before it runs.  Objects not found here are loaded when they are mapped."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    out: list[str] = []
    todo = [binary]
    seen: set[str] = set()
    while todo and len(out) < limit:
        path = os.path.realpath(todo.pop(0))
        if path in seen:
            continue
        seen.add(path)
        try:
            with open(path, "rb") as fh:
                elf = ELFFile(fh)
                out.append(path)
                needed: list[str] = []
                dirs: list[str] = []
                for seg in elf.iter_segments():
                    if seg["p_type"] == "PT_INTERP":
                        todo.append(str(seg.get_interp_name()))  # type: ignore[attr-defined]
                for sec in elf.iter_sections():
                    if not isinstance(sec, DynamicSection):
                        continue
                    for tag in sec.iter_tags():
                        if tag.entry.d_tag == "DT_NEEDED":
                            needed.append(str(getattr(tag, "needed", "")))
                        elif tag.entry.d_tag in ("DT_RPATH", "DT_RUNPATH"):
                            value = str(getattr(tag, "rpath", None) or getattr(tag, "runpath", ""))
                            dirs += [d.replace("$ORIGIN", os.path.dirname(path))
                                     for d in value.split(":") if d]
        except Exception:  # not an ELF file we can read: it is loaded (or flagged) when mapped
            continue
        for name in needed:
            for d in (*dirs, *LIBRARY_DIRS):
                cand = os.path.join(d, name)
                if os.path.exists(cand):
                    todo.append(cand)
                    break
    return out


def stack_frames(sampler: Any, s: UnwoundSample) -> list[StackFrame] | None:
    """A sample's pcs as :class:`StackFrame` values, outermost first (None: mappings unknown)."""
    out: list[StackFrame] = []
    for pc, exact in zip(reversed(s.pcs), reversed(s.exact), strict=True):
        info = sampler.resolve(s.tgid, pc, s.time_ns)
        if info is None:
            if out:
                return None
            continue  # the outermost pc of a stack cut short at an unknown mapping
        key, analysed, vaddr = info
        out.append(StackFrame(key, analysed, vaddr, exact))
    return out
