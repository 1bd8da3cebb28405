"""Syscall sampling of tracked processes, with fork following — a building block for tracers.

``raw_syscalls:sys_enter`` (raw tracepoint) reports, for every tracked process (by tgid) and every
selected syscall number, the user ``ip``/``sp``/``bp`` at entry into a ring buffer.
``sched_process_fork`` makes children (and threads) of tracked processes tracked;
``sched_process_exec`` stops tracking (unless the entry was given exec credit, which is how a
launcher tracks a child from before its exec of the target), and starts tracking any process that
execs an *exec target* (:meth:`SyscallSampler.follow_exec`: a binary by inode number, optionally
only inside one cgroup; see exec_target.c), so processes started later are sampled from their
first instruction; ``sched_process_exit`` cleans up.
All BPF memory is bounded: the tracked-process hash (``max_tracked``) and the ring buffer
(``ringbuf_pages``); overflows are counted in :meth:`SyscallSampler.stats`, never silent.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ccprofd.kbpf.bpfmap import RawMap
from ccprofd.kbpf.cdefs import c_constants
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.objcache import cache_dir_under
from ccprofd.kbpf.rawmodule import load_module
from ccprofd.kbpf.syscall_entry import entry_plan, exit_event
from ccprofd.kbpf.tracefs import tracepoint_has_field
from ccprofd.tracing.api import RECORDS_PER_POLL

C_SOURCE = "syscall_sampler.c"
EXEC_TARGET_SOURCE = "exec_target.c"
_C = c_constants(Path(__file__).with_name(C_SOURCE))  # the constants shared with the C (kbpf/cdefs.py)
EXEC_TARGET_FLAG = _C["CCPROF_EXEC_TARGET"]  # EV_EXEC aux: the new image is an exec target
NR_SYSCALL_SLOTS = _C["NR_SYSCALL_SLOTS"]
SYSCALL_NR_OFFSET = _C["SYSCALL_NR_OFFSET"]  # where ccprof_sys_tp (and uw_sys_tp) read the number
SYSCALL_RET_OFFSET = _C["SYSCALL_RET_OFFSET"]  # where ccprof_sys_exit_tp reads the return value
CFG_SYSCALL_PATH, PATH_RAW, PATH_EVENTS, PATH_OFF = (_C[n] for n in ("CFG_SYSCALL_PATH", "PATH_RAW",
                                                                     "PATH_EVENTS", "PATH_OFF"))
CFG_COMPAT_WATCH = _C["CFG_COMPAT_WATCH"]

KINDS = {_C["EV_SYSCALL"]: "syscall", _C["EV_FORK"]: "fork", _C["EV_EXEC"]: "exec", _C["EV_EXIT"]: "exit",
         _C["EV_RET"]: "ret"}
STATS = ("events", "ringbuf_full", "tracked_full", "forks", "execs_stopped", "execs_found")

_EVENT = struct.Struct("<QIIIiQQQQ")  # struct ccprof_event without CCPROF_EVENT_EXTRA
EVENT_SIZE = _EVENT.size


@dataclass(frozen=True, slots=True)
class SamplerEvent:
    """One record from the ring buffer.  ``time_ns`` is CLOCK_MONOTONIC (see
    :func:`monotonic_to_realtime_ns`); ``syscall`` is None for process events; ``aux`` is the child
    pid (fork), the old pid (exec, with :data:`EXEC_TARGET_FLAG` when the new image is an exec
    target), 1 (exit), the return value as an unsigned word (ret: see :attr:`ret`); ``extra``
    holds CCPROF_EVENT_EXTRA bytes."""

    kind: str
    time_ns: int
    tgid: int
    tid: int
    syscall: int | None
    ip: int
    sp: int
    bp: int
    aux: int
    extra: bytes = b""

    @classmethod
    def decode(cls, raw: bytes) -> SamplerEvent:
        t, kind, tgid, tid, nr, ip, sp, bp, aux = _EVENT.unpack_from(raw)
        return cls(
            KINDS.get(kind, str(kind)),
            t,
            tgid,
            tid,
            None if nr < 0 else nr,
            ip,
            sp,
            bp,
            aux,
            bytes(raw[EVENT_SIZE:]),
        )

    @property
    def ret(self) -> int:
        """A ``ret`` event's return value, signed (the kernel returns a long: -errno on failure)."""
        return self.aux - (1 << 64) if self.aux >> 63 else self.aux

    @property
    def exec_target(self) -> bool:
        """An exec whose new image is an exec target (BPF started or kept tracking it)."""
        return self.kind == "exec" and bool(self.aux & EXEC_TARGET_FLAG)


def monotonic_to_realtime_ns(mono_ns: int) -> int:
    """Convert a bpf_ktime_get_ns() timestamp to CLOCK_REALTIME (offset measured now)."""
    offset = time.clock_gettime_ns(time.CLOCK_REALTIME) - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    return mono_ns + offset


def exec_target_source(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """exec_target.c with the kernel struct offsets it and the raw-path compat check need (from the
    running kernel's BTF, cached beside the compiled BPF objects, ``<cache_dir>/bpf``: like them they
    depend on the kernel only, and the object cache key needs this text, so a fresh analysis cache
    with the objects kept does not walk the BTF again, ~0.8 s); without BTF the offsets are left out:
    no exec matches (processes are then found by rescans only) and compat syscalls are not marked."""
    from ccprofd.kbpf.btf import BTFError, sampler_offsets
    from ccprofd.kbpf.objcache import default_cache_dir
    from ccprofd.kbpf.syscalls import compat_defines

    bpf_dir = cache_dir_under(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        defines = "".join(f"#define {k} {v}\n" for k, v in sampler_offsets(bpf_dir).items())
    except BTFError:
        defines = ""
    own = Path(__file__).with_name(EXEC_TARGET_SOURCE).read_text(encoding="utf-8")
    return defines + compat_defines() + own


def sampler_source(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The sampler's C text (exec_target.c first; it is include-guarded, so a program that puts it
    before its own prelude, as :class:`SyscallSampler` does, may include it again)."""
    own = Path(__file__).with_name(C_SOURCE).read_text(encoding="utf-8")
    return exec_target_source(cache_dir) + own


def set_exec_target(targets: RawMap, inode: int, cgroup_id: int = 0) -> None:
    """Track every process that execs the file with inode number ``inode`` (in cgroup ``cgroup_id``
    only, unless 0).  BPF matches the inode number alone; callers confirm with /proc/PID/exe."""
    if inode <= 0:
        raise BPFError(f"bad inode number {inode}")
    try:
        targets.set(inode, cgroup_id)
    except BPFError:
        raise BPFError(f"cannot follow execs of inode {inode}: exec-target table full") from None


def exec_verdict(tgid: int, followed: Mapping[int, tuple[int, int]]) -> str:
    """BPF matched process ``tgid``'s new image by inode number alone; what it really runs:
    "followed" (one of ``followed``, st_ino -> (st_dev, st_ino)), "gone" (exited already), or
    "other" (another file with the same inode number, or our own hold guard): stop tracking it."""
    from ccprofd.kbpf.holdguard import is_guard

    try:
        st = os.stat(f"/proc/{tgid}/exe")
    except OSError:
        return "other" if os.path.exists(f"/proc/{tgid}") else "gone"
    if is_guard(tgid):
        return "other"
    return "followed" if followed.get(st.st_ino) == (st.st_dev, st.st_ino) else "other"


class SyscallSampler:
    """Compile, configure and attach the sampler; drain its events with :meth:`poll`.

    ``syscalls``: numbers to report (None = all).  ``prelude``: C text put before the source, for
    programs that extend it through CCPROF_EVENT_EXTRA / CCPROF_SYSCALL_HOOK and add programs of
    their own (then reach them through :attr:`module`).  ``cache_dir``: the analysis cache
    directory; the compiled program is kept in its ``bpf/`` sub-directory (None: the default cache).
    """

    def __init__(
        self,
        *,
        syscalls: Iterable[int] | None = None,
        max_tracked: int = 4096,
        ringbuf_pages: int = 64,
        prelude: str = "",
        cflags: Sequence[str] = (),
        cache_dir: str | os.PathLike[str] | None = None,
        entry_attach: bool = True,
    ) -> None:
        if max_tracked < 1:
            raise BPFError(f"max_tracked must be positive, not {max_tracked}")
        if ringbuf_pages < 1 or ringbuf_pages & (ringbuf_pages - 1):
            raise BPFError(f"ringbuf_pages must be a power of two, not {ringbuf_pages}")
        defines = [f"#define MAX_TRACKED {max_tracked}", f"#define RINGBUF_PAGES {ringbuf_pages}"]
        if tracepoint_has_field("sched", "sched_process_exit", "group_dead"):
            defines.append("#define HAVE_GROUP_DEAD 1")
        self.max_tracked = max_tracked
        # exec_target.c goes before the prelude too, so a prelude's exec hook can use it
        text = "\n".join(defines) + "\n" + exec_target_source(cache_dir) + "\n" + prelude + "\n" + \
            sampler_source(cache_dir)
        self.module = load_module(text, cflags, cache_dir=cache_dir_under(cache_dir))
        self._pending: list[SamplerEvent] = []
        self._attached = False
        self._returns = False
        self._tracked = self.module.map("tracked")
        self._syscall_set = self.module.map("syscall_set")
        self._config = self.module.map("config")
        self._stats = self.module.map("stats")
        self.module.open_ring_buffer("events", lambda raw: self._pending.append(SamplerEvent.decode(raw)))
        #: the syscalls attached one by one (kbpf/syscall_entry.py), None: raw_syscalls:sys_enter
        self.entry_plan: dict[int, str] | None = None
        self._nrs: list[int] | None = None
        self.set_syscalls(syscalls)
        if entry_attach:
            self.entry_plan = entry_plan(self._nrs, nr_offset=SYSCALL_NR_OFFSET,
                                         ret_offset=SYSCALL_RET_OFFSET)

    def set_syscalls(self, syscalls: Iterable[int] | None) -> None:
        """Report these syscall numbers (None: all).  Takes effect immediately (a set that grows
        past the per-syscall events attached moves to raw_syscalls:sys_enter, with no gap)."""
        nrs = None if syscalls is None else sorted(set(syscalls))
        if nrs is not None:
            bad = [n for n in nrs if not 0 <= n < NR_SYSCALL_SLOTS]
            if bad:
                raise BPFError(f"syscall number out of range: {bad[0]}")
        grows = self._attached and self.entry_plan is not None and (
            nrs is None or not set(nrs) <= set(self.entry_plan))
        if grows:
            self.module.attach_raw_tracepoint("sys_enter", "ccprof_sys_enter")  # idle until switched
            if self._returns:
                self.module.attach_raw_tracepoint("sys_exit", "ccprof_sys_exit")
        self._nrs = nrs
        if nrs is None:
            self._config.set(0, 1)
        else:
            self._config.set(0, 0)
            self._syscall_set.clear()
            self._syscall_set.update_many([(n, 1) for n in nrs])
        if grows:
            assert self.entry_plan is not None
            self._config.set(CFG_SYSCALL_PATH, PATH_RAW)
            for event in self.entry_plan.values():
                self.module.detach_tracepoint(event)
                self.module.detach_tracepoint(exit_event(event))
            self.entry_plan = None

    def attach_returns(self) -> None:
        """Also report the return of every reported syscall (``ret`` events, raw_syscalls:sys_exit,
        or the set's own exit events on the per-syscall path): one more program run and ring record
        per syscall, so only when asked."""
        self._returns = True
        if self.entry_plan is None:
            self.module.attach_raw_tracepoint("sys_exit", "ccprof_sys_exit")
            return
        self._config.set(CFG_SYSCALL_PATH, PATH_EVENTS)
        for event in self.entry_plan.values():
            self.module.attach_tracepoint(exit_event(event), "ccprof_sys_exit_tp")

    def attach(self) -> None:
        """Attach all four programs.  Process tracepoints first, so no child escapes between."""
        if self._attached:
            return
        self.module.attach_tracepoint("sched:sched_process_fork", "ccprof_fork")
        self.module.attach_tracepoint("sched:sched_process_exec", "ccprof_exec")
        self.module.attach_tracepoint("sched:sched_process_exit", "ccprof_exit")
        if self.entry_plan is None:
            self.module.attach_raw_tracepoint("sys_enter", "ccprof_sys_enter")
        else:
            self._config.set(CFG_SYSCALL_PATH, PATH_EVENTS)
            for event in self.entry_plan.values():
                self.module.attach_tracepoint(event, "ccprof_sys_tp")
        self._attached = True

    def syscall_program_fd(self) -> int:
        """The program that runs at syscall entry (on raw_syscalls:sys_enter, or on the per-syscall
        events), -1 before :meth:`attach`: its run count is how many syscalls paid for the sampler."""
        if not self._attached:
            return -1
        return self.module.program_fds["ccprof_sys_enter" if self.entry_plan is None else "ccprof_sys_tp"]

    def track(self, tgid: int, *, execs: int = 0) -> None:
        """Track process ``tgid`` (and, from now on, its children).  ``execs``: how many execs keep
        tracking — 1 for a launcher child that has yet to exec the target."""
        value = self._tracked.leaf_type()
        value.execs_left = execs
        try:
            self._tracked.set(tgid, value)
        except BPFError:
            raise BPFError(
                f"cannot track pid {tgid}: tracked-process table full ({self.max_tracked} entries)"
            ) from None

    def untrack(self, tgid: int) -> None:
        self._tracked.delete(tgid)

    def follow_exec(self, inode: int, cgroup_id: int = 0) -> None:
        """Track every process that execs the file with inode number ``inode`` (from its exec on;
        only in cgroup ``cgroup_id`` unless 0).  Its EV_EXEC event has :attr:`SamplerEvent.exec_target`;
        the match is by inode number only, so confirm it (:func:`exec_verdict`) and untrack on a miss."""
        set_exec_target(self.module.map("exec_targets"), inode, cgroup_id)

    def unfollow_exec(self, inode: int) -> None:
        self.module.map("exec_targets").delete(inode)

    def tracked(self) -> set[int]:
        """Keys of the tracked table: tracked tgids, plus tids of live threads they created."""
        return {int(k) for k, _ in self._tracked.items()}

    def poll(self, timeout_ms: int = 0) -> list[SamplerEvent]:
        """Events that arrived since the last call (waits up to ``timeout_ms`` when there are none)."""
        if not self.module.ring_buffer_consume(RECORDS_PER_POLL) and timeout_ms != 0:
            self.module.ring_buffer_poll(timeout_ms, RECORDS_PER_POLL)
        out, self._pending = self._pending, []
        return out

    def stats(self) -> dict[str, int]:
        """Counters summed over CPUs: events, ringbuf_full (dropped), tracked_full, forks, execs_stopped."""
        return read_stats(self._stats)

    def detach(self) -> None:
        """Stop sampling (every program detached); what is in the rings stays readable until close()."""
        self._config.set(CFG_SYSCALL_PATH, PATH_OFF)  # before the events' background close
        self.module.detach()

    def close(self) -> None:
        self.module.cleanup()

    def __enter__(self) -> SyscallSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_stats(stats: RawMap) -> dict[str, int]:
    """The sampler's ``stats`` map (of whichever module compiled it in) as counters by name."""
    return {name: int(stats.get(i) or 0) for i, name in enumerate(STATS)}
