"""``--verify`` for instrumented mode: each syscall sample is also unwound in BPF by a frame-pointer
walk (``bpf_get_stack`` with ``BPF_F_USER_STACK``, at most 127 frames) and compared with the context
instrumented mode decoded for the same syscall.

Three parts, each usable alone:

* :class:`FpStackSampler` — the BPF side (``fpverify.c`` as the prelude of the syscall sampler):
  one :class:`FpStack` per selected syscall of the tracked processes, into its own ring buffer.
* :func:`compare_stack` — the comparison of one decoded context with one walk (pure; unit-tested
  with deliberately corrupted contexts).
* :class:`FpVerifier` — the join: a walk and a sample belong together when they are the same
  syscall hit.  Both samplers track the same processes with the same syscall filter, so each thread's
  walks are a superset of its samples in the same order; a sample is paired with the next walk of its
  thread that has the same syscall number, user ip and user sp (walks skipped on the way were hits
  instrumented mode did not report).  Timestamps are not used: the two programs read the clock at
  different moments of the same hit.

What is compared: the walk's return addresses that fall in the target binary's executable
segments (translated to ELF vaddrs with the process's load bias), from the first one after the
sampled ip outwards until the first address outside the binary (an outside address right after the
ip -- a signal frame's ``__restore_rt``, a library frame, a garbage ``rbp`` -- means nothing is
compared; past foreign code the rbp chain is not trustworthy: libraries are built without frame
pointers), against the decoded frames' ``return_address`` values,
innermost first.  The walk may lack the innermost one: a frameless library leaf (``write``) leaves
``rbp`` at its caller's frame, so the return address of the binary's call into the library is never
read; the alignment allows exactly that one-frame offset and nothing else.  When the decoded
context is complete, the walk ended in foreign code, was not truncated and crossed no other binary
frames, the outermost frames must line up too.  Incomplete samples are compared over their known
(innermost) frames only.  CPU samples are not verified (a second perf event would fire at other
moments).
"""

from __future__ import annotations

import functools
import struct
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ccprofd.kbpf.errors import BPFError
from ccprofd.tracing.syscall_sampler import SyscallSampler, monotonic_to_realtime_ns

C_SOURCE = "fpverify.c"
MAX_FRAMES = 127  # bpf_get_stack's default limit (kernel.perf_event_max_stack)
STATS = ("events", "ringbuf_full", "stack_failed")

_HEAD = struct.Struct("<QIIiIQQ")
#: A walk more than this much later than a sample cannot be of the sample's hit (the two programs
#: run within microseconds of each other at one hit; clock conversions differ by far less).
JOIN_SLACK_NS = 1_000_000
#: Walks no sample claimed are dropped once this much older than their thread's newest walk (hits
#: instrumented mode does not report, e.g. of a process it stopped tracking).
KEEP_UNCLAIMED_NS = 2_000_000_000


@dataclass(frozen=True, slots=True)
class FpStack:
    """One walk: when (CLOCK_REALTIME, converted as instrumented samples are), the thread, the
    syscall, the user ip/sp at entry, and the walked addresses (runtime addresses, innermost first;
    ``stack[0]`` is the ip)."""

    time_ns: int
    tgid: int
    tid: int
    syscall: int
    ip: int
    sp: int
    stack: tuple[int, ...]

    @classmethod
    def decode(cls, raw: bytes) -> FpStack:
        ktime, tgid, tid, nr, n, ip, sp = _HEAD.unpack_from(raw)
        n = min(n, MAX_FRAMES, (len(raw) - _HEAD.size) // 8)
        stack = struct.unpack_from(f"<{n}Q", raw, _HEAD.size)
        return cls(monotonic_to_realtime_ns(ktime), tgid, tid, nr, ip, sp, tuple(stack))

    @property
    def truncated(self) -> bool:
        return len(self.stack) >= stack_limit()


@functools.cache
def stack_limit() -> int:
    """Frames a walk can return: :data:`MAX_FRAMES`, or less when ``kernel.perf_event_max_stack``
    is set lower (then a walk of that length was cut short, not the whole stack)."""
    try:
        with open("/proc/sys/kernel/perf_event_max_stack", encoding="ascii") as fh:
            return max(1, min(MAX_FRAMES, int(fh.read().strip())))
    except (OSError, ValueError):
        return MAX_FRAMES


class FpStackSampler:
    """Compile and attach the walk; :meth:`poll` returns the walks that arrived since the last call."""

    def __init__(self, *, syscalls: Iterable[int] | None = None, ringbuf_pages: int = 256,
                 cache_dir: str | None = None) -> None:
        if ringbuf_pages < 1 or ringbuf_pages & (ringbuf_pages - 1):
            raise BPFError(f"ringbuf_pages must be a power of two, not {ringbuf_pages}")
        prelude = (f"#define FP_MAX_FRAMES {MAX_FRAMES}\n#define FP_RINGBUF_PAGES {ringbuf_pages}\n"
                   + Path(__file__).with_name(C_SOURCE).read_text(encoding="utf-8"))
        self.sampler = SyscallSampler(syscalls=syscalls, prelude=prelude, cache_dir=cache_dir)
        self.module = self.sampler.module
        self._stacks: list[FpStack] = []
        self.module.open_ring_buffer("fp_events", lambda raw: self._stacks.append(FpStack.decode(raw)))

    def attach(self) -> None:
        self.sampler.attach()

    def track_launch(self, pid: int) -> None:
        """As instrumented mode tracks its launched child: from before its exec of the target."""
        self.sampler.track(pid, execs=1)

    def track_running(self, pid: int) -> None:
        self.sampler.track(pid)

    def follow_exec(self, inode: int, cgroup_id: int = 0) -> None:
        """As instrumented mode follows later execs of its binary (daemon path targets)."""
        self.sampler.follow_exec(inode, cgroup_id)

    def poll(self) -> list[FpStack]:
        self.sampler.poll(0)  # also drains the sampler's own (unused) events, so it never fills up
        out, self._stacks = self._stacks, []
        return out

    def stats(self) -> dict[str, int]:
        m = self.module.map("fp_stats")
        out = {name: int(m.get(i) or 0) for i, name in enumerate(STATS)}
        out.update({f"sampler_{k}": v for k, v in self.sampler.stats().items()})
        return out

    def detach(self) -> None:
        self.sampler.detach()

    def close(self) -> None:
        self.sampler.close()


# ------------------------------------------------------------------------------- comparison
class HasReturnAddress(Protocol):
    @property
    def return_address(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class StackCheck:
    """The outcome for one sample: frames compared and whether they disagreed."""

    frames: int
    mismatch: bool
    detail: str = ""


def compare_stack(frames: Sequence[HasReturnAddress], walk: Sequence[int | None], *, complete: bool,
                  truncated: bool) -> StackCheck:
    """Compare decoded ``frames`` (outermost first) with a walk (ELF vaddrs of the binary, ``None``
    for addresses outside it; innermost first, ``walk[0]`` the sampled ip).  See the module docstring
    for the rules."""
    decoded = [f.return_address for f in reversed(frames) if f.return_address is not None]
    # The run starts right after the ip: an address outside the binary there is a library frame
    # with a frame pointer, a signal frame (__restore_rt) or a garbage rbp -- in every case what
    # follows is no longer known to continue the innermost binary frame's chain.
    i = 1
    while i < len(walk) and walk[i] is not None:
        i += 1
    run = [int(a) for a in walk[1:i] if a is not None]
    if not run:
        return StackCheck(0, False, "the walk reached no frame of the binary")
    ended_outside = i < len(walk)
    more_binary_later = any(a is not None for a in walk[i:])
    if complete and not truncated and ended_outside and not more_binary_later \
            and all(getattr(f, "analysed", True) for f in frames):
        # The walk covered the binary's whole stack: both ends must line up.
        j = len(decoded) - len(run)
        if j in (0, 1) and decoded[j:] == run:
            return StackCheck(len(run), False)
        return StackCheck(min(len(run), len(decoded)), True,
                          f"walk {_hex(run)} vs decoded {_hex(decoded)}")
    best: StackCheck | None = None
    for j in (0, 1):
        n = min(len(run), len(decoded) - j)
        if n <= 0:
            continue
        if run[:n] != decoded[j:j + n]:
            continue
        if complete and len(run) > len(decoded) - j:
            continue  # the stack holds binary frames the decoded context lacks
        best = StackCheck(n, False)
        break
    if best is not None:
        return best
    return StackCheck(min(len(run), len(decoded)), True, f"walk {_hex(run)} vs decoded {_hex(decoded)}")


def _hex(values: Sequence[int]) -> str:
    shown = ", ".join(f"{v:#x}" for v in values[:8])
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"


# ------------------------------------------------------------------------------------ joining
class BinaryAddresses(Protocol):
    def is_executable(self, vaddr: int) -> bool: ...


@dataclass
class VerifyCounts:
    """What ``--verify`` reports (``summary()["verify"]``)."""

    checked: int = 0  # samples compared over at least one frame
    mismatches: int = 0
    frames_checked: int = 0
    no_frames: int = 0  # joined, but the walk reached no frame of the binary
    unjoined: int = 0  # syscall samples without a walk of the same hit
    no_bias: int = 0  # PIE process whose load bias was unknown
    cpu_not_verified: int = 0
    examples: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"checked": self.checked, "mismatches": self.mismatches, "frames_checked": self.frames_checked,
                "no_frames": self.no_frames, "unjoined": self.unjoined, "no_bias": self.no_bias,
                "cpu_not_verified": self.cpu_not_verified}


@dataclass
class _Pending:
    time_ns: int
    tid: int
    tgid: int
    syscall: int
    ip: int
    sp: int
    bias: int | None
    complete: bool
    frames: Sequence[HasReturnAddress]


class FpVerifier:
    """Joins samples with walks and keeps the counts.  ``bias_of(tgid)`` gives a process's load bias
    when a sample does not carry one (None when unknown)."""

    def __init__(self, addrspace: BinaryAddresses, *, pie: bool, bias_of: Any = None,
                 max_examples: int = 5) -> None:
        self.addrspace = addrspace
        self.pie = pie
        self.bias_of = bias_of
        self.counts = VerifyCounts()
        self.max_examples = max_examples
        self._walks: dict[int, deque[FpStack]] = {}
        self._pending: dict[int, deque[_Pending]] = {}

    def add_walks(self, walks: Iterable[FpStack]) -> None:
        touched: set[int] = set()
        for w in walks:
            self._walks.setdefault(w.tid, deque()).append(w)
            touched.add(w.tid)
        for tid in touched:
            self._drain(tid)
            q = self._walks[tid]
            if q and not self._pending.get(tid):
                newest = q[-1].time_ns
                while q and q[0].time_ns < newest - KEEP_UNCLAIMED_NS:
                    q.popleft()

    def add_sample(self, *, time_ns: int, tid: int, tgid: int, syscall: int | None, ip: int, sp: int,
                   bias: int | None, complete: bool, frames: Sequence[HasReturnAddress]) -> None:
        if syscall is None:
            self.counts.cpu_not_verified += 1
            return
        self._pending.setdefault(tid, deque()).append(
            _Pending(time_ns, tid, tgid, syscall, ip, sp, bias, complete, list(frames)))
        self._drain(tid)

    def finish(self) -> VerifyCounts:
        """Samples still without a walk are counted as unjoined."""
        for q in self._pending.values():
            self.counts.unjoined += len(q)
            q.clear()
        return self.counts

    def _drain(self, tid: int) -> None:
        pending = self._pending.get(tid)
        walks = self._walks.get(tid)
        while pending and walks:
            s, w = pending[0], walks[0]
            same_hit = ((w.syscall, w.ip, w.sp) == (s.syscall, s.ip, s.sp)
                        and w.time_ns >= s.time_ns - JOIN_SLACK_NS)
            if w.time_ns > s.time_ns + JOIN_SLACK_NS:
                # Later than the sample's own hit: that walk is missing (its process was not
                # tracked yet, or the ring buffer was full); never pair the sample with another hit.
                pending.popleft()
                self.counts.unjoined += 1
            elif same_hit:
                self._check(pending.popleft(), walks.popleft())
            else:
                walks.popleft()  # an earlier hit instrumented mode did not report

    def _check(self, s: _Pending, w: FpStack) -> None:
        bias = s.bias
        if bias is None:
            bias = 0 if not self.pie else (self.bias_of(s.tgid) if self.bias_of is not None else None)
        if bias is None:
            self.counts.no_bias += 1
            return
        walk = [a - bias if self.addrspace.is_executable(a - bias) else None for a in w.stack]
        result = compare_stack(s.frames, walk, complete=s.complete, truncated=w.truncated)
        if result.frames == 0 and not result.mismatch:
            self.counts.no_frames += 1
            return
        self.counts.checked += 1
        self.counts.frames_checked += result.frames
        if result.mismatch:
            self.counts.mismatches += 1
            if len(self.counts.examples) < self.max_examples:
                self.counts.examples.append(f"tid {s.tid} syscall {s.syscall}: {result.detail}")


def frame_pointer_calls(rules: Iterable[int]) -> tuple[int, int]:
    """(calls made with the CFA defined from ``rbp``, calls with a known CFA rule), for the
    ``.eh_frame`` rule kind (:mod:`ccprofd.elf.cfi`) at each call instruction of the binary.
    A function compiled with frame pointers defines its CFA from ``rbp`` once its frame is set up —
    also in split-off ``.cold`` parts, which a prologue check would miss — and one without them from
    ``rsp``, so this says whether the walk can go through the binary's frames."""
    from ccprofd.elf.cfi import CFA_RBP, CFA_RSP

    fp = total = 0
    for kind in rules:
        if kind in (CFA_RBP, CFA_RSP):
            total += 1
            fp += kind == CFA_RBP
    return fp, total


__all__ = ["JOIN_SLACK_NS", "MAX_FRAMES", "FpStack", "FpStackSampler", "FpVerifier", "StackCheck",
           "VerifyCounts", "compare_stack", "frame_pointer_calls"]


class VerifyRun:
    """``--verify`` for one traced binary: a frame-pointer walk at each sampled syscall, joined with
    the decoded samples.  A binary whose functions do not keep frame pointers is not checked (the
    walk would be wrong, not the context): ``skipped`` says why, and so does the exit line."""

    def __init__(self, path: str, image: Any, call_kinds: Iterable[Any], syscalls: Any,
                 cache_dir: str | None) -> None:
        self.path = path
        self.skipped: str | None = None
        self.sampler: FpStackSampler | None = None
        self.verifier: FpVerifier | None = None
        fp, total = frame_pointer_calls(call_kinds)
        if total == 0 or fp * 10 < total * 9:
            self.skipped = (f"{path} does not keep frame pointers (.eh_frame: {fp} of its "
                            f"{total} calls are made with the frame defined from rbp)")
            return
        self._biases: dict[int, int] = {}
        self._addrspace = image.addrspace
        self.sampler = FpStackSampler(syscalls=syscalls, cache_dir=cache_dir)
        self.sampler.attach()
        self.verifier = FpVerifier(image.addrspace, pie=image.pie, bias_of=self._bias_of)

    def _bias_of(self, tgid: int) -> int | None:
        """Load bias of the binary in process ``tgid`` from its maps (None when it is gone)."""
        if tgid not in self._biases:
            import os

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
        if self.sampler is not None:
            self.sampler.track_launch(pid)

    def track_running(self, pid: int) -> None:
        if self.sampler is not None:
            self.sampler.track_running(pid)

    def follow_exec(self, inode: int, cgroup_id: int) -> None:
        if self.sampler is not None:
            self.sampler.follow_exec(inode, cgroup_id)  # walks of the same processes

    def detach(self) -> None:
        if self.sampler is not None:
            self.sampler.detach()

    def after_poll(self) -> None:
        if self.sampler is not None and self.verifier is not None:
            self.verifier.add_walks(self.sampler.poll())  # after the samples: their walks are in by now

    def summary(self) -> dict[str, Any]:
        if self.skipped is not None or self.verifier is None:
            return {"checked": 0, "mismatches": 0, "frames_checked": 0, "skipped": self.skipped}
        out: dict[str, Any] = self.verifier.counts.to_json()
        if self.sampler is not None:
            out["bpf"] = self.sampler.stats()
        return out

    def close(self) -> None:
        """Join the last walks and print the result line (the skip reason when not checked)."""
        import sys

        sampler, self.sampler = self.sampler, None
        if sampler is None or self.verifier is None:
            if self.skipped is not None:
                print(f"ccprofd: verify: skipped: {self.skipped}", file=sys.stderr)
            return
        try:
            self.verifier.add_walks(sampler.poll())
            c = self.verifier.finish()
        finally:
            sampler.close()
        print(f"ccprofd: verify: {c.checked} contexts checked, {c.mismatches} mismatches against a "
              f"frame-pointer walk ({c.frames_checked} frames checked; {c.no_frames} samples whose walk "
              f"reached no frame of the binary, {c.unjoined} without a walk, {c.cpu_not_verified} CPU "
              "samples not verified)", file=sys.stderr)
        for line in c.examples:
            print(f"ccprofd: verify: mismatch: {line}", file=sys.stderr)
