"""The processes unwind mode follows: their mappings in the BPF maps (re-read when they change),
what happens at fork, exec and exit, exec-followed binaries, and the processes BPF holds stopped
until their mappings are loaded."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ccprofd.kbpf.bpfmap import RawMap
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.holdguard import release
from ccprofd.proc.maps import ProcessMaps, module_mappings, start_stack
from ccprofd.tracing.patharg import path_from_file
from ccprofd.tracing.syscall_sampler import SamplerEvent, exec_verdict, set_exec_target
from ccprofd.tracing.unwind.constants import UE_ANALYSED
from ccprofd.tracing.unwind.tables import LoadedModule, ModuleTables

if TYPE_CHECKING:
    from ccprofd.kbpf.holdguard import HoldGuard



@dataclass(frozen=True, slots=True)
class ResolvedPc:
    """A runtime pc as (module path, build-id, ELF virtual address)."""

    module: str
    build_id: str | None
    vaddr: int


@dataclass(slots=True)
class ProcessView:
    """One process's mappings as the last read saw them, with each mapping's module."""

    maps: ProcessMaps
    modules: dict[int, LoadedModule] = field(default_factory=dict)  # mapping start -> module


class ProcessTracker:
    """Tracked processes and their mappings (``tracked``, ``uw_procs``, ``uw_stop``, ``uw_held``,
    ``exec_targets`` maps).  Mappings are re-read for processes marked stale (an exec, a sample at
    an unknown pc); samples still queued across an exec resolve against the image they were taken
    in."""

    def __init__(self, maps: dict[str, RawMap], tables: ModuleTables, *, proc_root: str,
                 max_maps: int) -> None:
        self._m = maps
        self.tables = tables
        self.proc_root = proc_root
        self.max_maps = max_maps
        self.procs: dict[int, ProcessView] = {}
        # Mappings replaced by an exec, with the exec's time: samples taken before it (still queued
        # when the exec is seen) resolve against the image they were taken in.
        self.before_exec: dict[int, list[tuple[int, ProcessView]]] = {}
        self.stale: set[int] = set()
        self.stopping: set[int] = set()  # launched processes BPF stops until their maps are loaded
        self.exec_targets: dict[int, tuple[int, int]] = {}  # inode number -> (st_dev, st_ino)
        #: Processes BPF started tracking at their exec of a followed binary (confirmed through
        #: /proc/PID/exe), for the caller to register; it empties the list.
        self.new_processes: list[int] = []
        self.exec_mismatches = 0  # inode-number matches that /proc/PID/exe did not confirm
        self.refresh_failures = 0  # mapping re-reads that failed (samples flagged meanwhile)
        self.events: list[SamplerEvent] = []
        self._guard: HoldGuard | None = None
        # uw_proc.gen of the last upload: each upload of a process's mappings gets a new number, so
        # BPF's per-thread memo of outer frames (unwind.c) never reuses a chain unwound with others
        self._gen = 0

    # ----------------------------------------------------------------------------- following
    def track(self, tgid: int, *, launched: bool = False) -> None:
        """Load ``tgid``'s mappings and tables, then sample it (and the children it forks).

        ``launched``: ``tgid`` is a child of ours that has not exec'd the target yet; tracking
        survives that one exec, and BPF stops the process at it (and at each later executable
        mapping) until the next poll has loaded the new mappings."""
        if launched:
            self._start_guard()
            self._m["uw_stop"].set(tgid, 1)
            self.stopping.add(tgid)
        else:
            self.refresh_maps(tgid)
        value = self._m["tracked"].leaf_type()
        value.execs_left = 1 if launched else 0
        self._m["tracked"].set(tgid, value)

    def follow_exec(self, inode: tuple[int, int], cgroup_id: int = 0) -> None:
        """Track every process that execs the file ``inode`` = (st_dev, st_ino), from its first
        instruction (only inside cgroup ``cgroup_id`` unless 0).  BPF holds each such process at its
        exec until the next poll has loaded its mappings; it is then listed in
        :attr:`new_processes`."""
        self._start_guard()
        set_exec_target(self._m["exec_targets"], inode[1], cgroup_id)
        self.exec_targets[inode[1]] = inode

    def unfollow_exec(self, inode: tuple[int, int]) -> None:
        self._m["exec_targets"].delete(inode[1])
        self.exec_targets.pop(inode[1], None)

    def _start_guard(self) -> None:
        if self._guard is None:
            from ccprofd.kbpf.holdguard import HoldGuard

            self._guard = HoldGuard(self._m["uw_held"].fd)

    def forget(self, tgid: int) -> None:
        """Drop the mappings kept for symbolising samples of a process that has exited."""
        self.procs.pop(tgid, None)
        self.before_exec.pop(tgid, None)

    def untrack(self, tgid: int) -> None:
        self._m["tracked"].delete(tgid)
        self._m["uw_procs"].delete(tgid)
        self.forget(tgid)

    def refresh_maps(self, tgid: int) -> bool:
        """Re-read /proc/TGID/maps and update the BPF mapping table; False when the process is gone."""
        try:
            maps = module_mappings(tgid, self.tables.addrspace_of, self.proc_root)
        except OSError:
            return False
        maps = self.tables.with_vdso(maps)
        proc = ProcessView(maps)
        entry = self._m["uw_procs"].leaf_type()
        mappings = maps.mappings[: self.max_maps]
        for i, mm in enumerate(mappings):
            try:
                mod = self.tables.module_for(mm)
            except BPFError:
                if not os.path.exists(os.path.join(self.proc_root, str(tgid))):
                    return False  # it exited while its maps were read (its /proc paths went with it)
                raise
            proc.modules[mm.start] = mod
            slot = entry.m[i]
            slot.start, slot.end, slot.module = mm.start, mm.end, mod.module_id
            slot.bias = mm.bias & (2**64 - 1)
            slot.info = mod.key | (UE_ANALYSED if mod.analysed else 0)
        entry.n = len(mappings)
        entry.start_stack = start_stack(tgid, self.proc_root)
        self._gen = self._gen % 0xFFFFFFFF + 1  # never 0 (BPF: "no mappings seen")
        entry.gen = self._gen
        self._m["uw_procs"].set(tgid, entry)
        self.procs[tgid] = proc
        return True

    # -------------------------------------------------------------------------------- events
    def on_event(self, raw: bytes) -> None:
        """A fork/exec/exit record of the shared syscall sampler."""
        ev = SamplerEvent.decode(raw)
        self.events.append(ev)
        if ev.exec_target:
            self._exec_found(ev.tgid)
        if ev.kind == "exec":
            old = self.procs.pop(ev.tgid, None)
            if old is not None:
                history = self.before_exec.setdefault(ev.tgid, [])
                history.append((ev.time_ns, old))
                del history[:-4]  # bounded: only samples still queued at an exec need these
            self.stale.add(ev.tgid)
        elif ev.kind == "fork":
            parent = self.procs.get(ev.tgid)
            if parent is not None and ev.aux not in self.procs:
                self.procs[ev.aux] = parent  # until it execs, a child has its parent's mappings

    def _exec_found(self, tgid: int) -> None:
        """BPF matched ``tgid``'s new image by inode number: confirm it is a followed file, else
        stop tracking it (it is released by the next :meth:`release_held`)."""
        verdict = exec_verdict(tgid, self.exec_targets)
        if verdict == "followed":
            self.stale.add(tgid)
            if tgid not in self.new_processes:
                self.new_processes.append(tgid)
        elif verdict == "other":
            self.exec_mismatches += 1
            with contextlib.suppress(BPFError):
                self._m["tracked"].delete(tgid)
            with contextlib.suppress(BPFError):
                self._m["uw_stop"].delete(tgid)

    def _refresh_or_count(self, tgid: int) -> None:
        """refresh_maps, a failure counted (``refresh_failures``) instead of raised: the process's
        samples are then flagged (no_maps / unknown_pc, which marks it stale again), and one
        process's unreadable mappings neither stop the others' sampling nor a release."""
        try:
            self.refresh_maps(tgid)
        except BPFError:
            self.refresh_failures += 1

    def refresh_stale(self) -> None:
        """Re-read the mappings of every stale tracked process, then continue the held ones."""
        for tgid in sorted(self.stale):
            if self._m["tracked"].get(tgid) is not None:
                self._refresh_or_count(tgid)
        # BPF stopped these until their mappings were loaded (launched and exec-found processes):
        # continued only here, each after its entry is gone, so a hold right after is never lost
        self.release_held(self.stale)
        self.stale.clear()

    def release_held(self, done: set[int], *, refresh: bool = True) -> None:
        """Continue every process BPF holds, after loading its mappings if it is tracked (those in
        ``done`` were loaded already in this poll)."""
        held = [int(k) for k, _ in self._m["uw_held"].items()]
        for tgid in held:
            if refresh and tgid not in done and self._m["tracked"].get(tgid) is not None:
                self._refresh_or_count(tgid)  # a failure must not keep it stopped
            release(self._m["uw_held"].fd, tgid)  # continued unless another instance holds it too

    # ------------------------------------------------------------------------- symbolisation
    def symbolize(self, tgid: int, pc: int) -> ResolvedPc | None:
        """(module, build-id, ELF vaddr) of a runtime pc in the process's current mappings."""
        proc = self.procs.get(tgid)
        if proc is None:
            return None
        mm = proc.maps.find(pc)
        if mm is None:
            return None
        mod = proc.modules.get(mm.start)
        return ResolvedPc(mm.path, mod.build_id if mod else None, mm.vaddr(pc))

    def _proc_at(self, tgid: int, time_ns: int | None) -> ProcessView | None:
        """The process's mappings at ``time_ns`` (None: now)."""
        if time_ns is not None:
            for exec_time, before in self.before_exec.get(tgid, ()):
                if time_ns < exec_time:
                    return before
        return self.procs.get(tgid)

    def resolve(self, tgid: int, pc: int, time_ns: int | None = None) -> tuple[int, bool, int] | None:
        """(module key, in the analysed binary, ELF vaddr) of a runtime pc, as BPF saw it at
        ``time_ns`` (the sample's own time; default: the current mappings)."""
        proc = self._proc_at(tgid, time_ns)
        if proc is None:
            return None
        mm = proc.maps.find(pc)
        if mm is None:
            return None
        mod = proc.modules.get(mm.start)
        if mod is None:
            return None
        return mod.key, mod.analysed, mm.vaddr(pc)

    def string_at(self, tgid: int, address: int, limit: int, time_ns: int | None = None) -> str | None:
        """The NUL-terminated string at ``address`` of the process (as mapped at ``time_ns``), read
        from the file of the ELF object mapped there when it lies in a read-only segment of it
        (tracing/patharg.py: a path argument BPF could not read at entry); else None."""
        proc = self._proc_at(tgid, time_ns)
        if proc is None:
            return None
        for mm in proc.maps.mappings:
            mod = proc.modules.get(mm.start)
            vaddr = address - mm.bias
            if mod is None or not mm.path.startswith("/") or mod.addrspace.segment_of(vaddr) is None:
                continue  # not this object's image ([vdso] has no file)
            return path_from_file((mm.open_path, mod.readable, mod.path), mm.inode, vaddr, limit)
        return None

    # ----------------------------------------------------------------------------- shutdown
    def continue_launched(self) -> None:
        """Never leave a launched process stopped."""
        for tgid in self.stopping:
            with contextlib.suppress(ProcessLookupError):
                os.kill(tgid, signal.SIGCONT)
        self.stopping.clear()

    def release_all(self) -> None:
        """After every program is detached: continue what BPF still holds (maps still open)."""
        with contextlib.suppress(BPFError):
            self.release_held(set(), refresh=False)

    def close_guard(self) -> None:
        if self._guard is not None:
            self._guard.close()  # its last sweep runs with every program detached
            self._guard = None
