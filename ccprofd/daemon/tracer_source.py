"""The daemon's :class:`~ccprofd.daemon.source.SampleSource` over the tracer's modes
(:mod:`ccprofd.tracing.session`): one prepared mode (analysis, plan, probes) per binary inode, fed with
the processes of the target.

Which processes: a ``path`` target follows every process whose executable is that inode; a ``pid``
target that process; a ``cgroup`` target every process listed in ``cgroup.procs`` (one mode per
distinct binary).

New processes are tracked from their first instruction: each mode of a ``path`` target follows
execs of its inode (``Mode.follow_exec``: BPF starts tracking a process at ``sched_process_exec``
when its new image is that inode, before it runs; unwind mode holds it there until its mappings are
loaded; instrumented mode's uprobes are attached to the inode for every process).  Each mode of a
``cgroup`` target follows execs of its binary inside that cgroup.  Processes found that way are
registered as soon as the mode reports them (``take_new_processes``), without waiting for a rescan.

Processes already running at start (and, as a safety net, any process an exec hook missed, e.g.
when a ring buffer was full) are found by a rescan every second and tracked from then on with
their threads' contexts flagged incomplete until their frames are known (the tracer decides that),
never guessed.  A process in another mount namespace is analysed through ``/proc/PID/root`` and
reported with its host pid.  The daemon's own pid is never tracked.

A binary is planned for its bytes, not its inode: a file rewritten in place (``cp new old``) is
re-planned -- its old mode closed (probes detached) and a new one prepared for the new bytes --
before any process runs it: in instrumented mode through the exec gate
(:mod:`ccprofd.daemon.filewatch`: each exec of a watched file waits until the plan in place is for
the bytes exec'd); in unwind mode, where BPF holds each new process at its exec until a poll loads
its mappings, the file's identity is compared before each poll (and a rewrite's ``close`` starts
the re-plan at once).  Where fanotify is not available, instrumented mode compares at each poll too
(a process exec'd in between runs under the old plan).

Per-thread contexts (``thread_contexts``) come from a brief ptrace stop of the process, each thread
unwound with the same CFI tables as the BPF unwinder (ccprofd/proc/threadsnap.py), in both modes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ccprofd.daemon.config import DaemonConfig, TargetConfig, binary_problem, cgroup_problem
from ccprofd.daemon.filewatch import ExecGate, FileIdentity, file_identity
from ccprofd.daemon.historypersist import HistoryPersister, history_path
from ccprofd.daemon.source import (
    BinaryInfo,
    ProcessInfo,
    SourceCounters,
    TargetWaiting,
    ThreadContext,
    UnknownProcess,
)
from ccprofd.proc.tasks import tgid_of, threads_of
from ccprofd.tracing.api import Mode, TraceOptions

RESCAN_S = 1.0
REPLAN_WAIT_S = 120.0  # the longest an exec of a rewritten file waits for its new plan
#: instrumented mode's uprobe hit counters (cc_stats): call sites, tail jumps, function entries
PROBE_HIT_STATS = ("site_hits", "tail_hits", "entry_hits")
Inode = tuple[int, int]
log = logging.getLogger("ccprofd")


@dataclass
class _Binary:
    path: str
    inode: Inode
    mode: Mode
    build_id: str = ""
    following_execs: bool = False  # the mode tracks new processes of this inode from their exec
    ident: FileIdentity | None = None  # the file as it was when planned (taken before reading it)


def _exe_of(pid: int) -> tuple[str, Inode] | None:
    """The executable ``pid`` runs, as a path the daemon can open, and its (dev, inode)."""
    try:
        st = os.stat(f"/proc/{pid}/exe")
        link = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
    if link.endswith(" (deleted)"):
        return None
    inode = (st.st_dev, st.st_ino)
    for candidate in (link, f"/proc/{pid}/root{link}"):
        try:
            cst = os.stat(candidate)
        except OSError:
            continue
        if (cst.st_dev, cst.st_ino) == inode:
            return candidate, inode
    return None


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


class TracerSource:
    """The daemon's sample source for one target over the tracer's modes (see the module docstring).

    Why this class is long: it is the one owner of a target's binaries -- discovery by rescan and
    exec hooks, the SampleSource queries, and the re-plan of a binary rewritten in place, which
    must act on the same table of binaries and tracked processes under the pump thread."""

    def __init__(self, target: TargetConfig, daemon: DaemonConfig) -> None:
        self.target = target
        self.state_dir = daemon.state_dir
        self.options = TraceOptions(
            mode=target.mode, syscalls=",".join(target.syscalls) if target.syscalls else None,
            encoding=target.encoding, scope=target.scope, sample_hz=target.perf_sample_hz,
            verify=target.verify, cache_dir=str(daemon.state_dir / "cache"),
            source_lines=target.source_lines, watch_ia32=target.watch_ia32)
        self.binaries_by_inode: dict[Inode, _Binary] = {}
        self.tracked: dict[int, Inode] = {}
        self.self_pid = os.getpid()
        self.decode_errors = 0
        self.execs_found = 0  # processes registered through an exec hook (not a rescan)
        self.per_sample = True  # until the daemon says no consumer needs every sample
        every = target.persist_history_seconds  # the flight recorder saved to state_dir (0: never)
        where = history_path(daemon.state_dir, target.name)
        self._history = HistoryPersister(where, every) if every else None
        self._last_scan = 0.0
        self.replans = 0  # binaries re-planned because their file was rewritten
        # a re-planned binary's last records and counts (_drain), for the next poll_counted
        self._drained_records: list[tuple[dict[str, Any], bool]] = []
        self._drained_counts: list[tuple[dict[str, Any], int]] = []
        self._gate: ExecGate | None = None
        self._stale: dict[Inode, threading.Event] = {}  # rewritten: re-plan, then set the event
        self._stale_lock = threading.Lock()

    # ------------------------------------------------------------------------------ discovery
    def _follow_execs(self, binary: _Binary) -> None:
        """Have ``binary``'s mode track every later exec of its inode (path targets: anywhere;
        cgroup targets: inside the cgroup).  Without the hook (a mode or kernel that lacks it) new
        processes are still found by the rescan, flagged incomplete until their frames are known."""
        t = self.target
        if binary.following_execs or t.pid is not None:
            return
        cgroup_id = 0
        if t.cgroup is not None:
            try:
                cgroup_id = os.stat(t.cgroup).st_ino  # cgroup v2 id = the directory's inode number
            except OSError:
                return
        binary.mode.follow_exec(binary.inode, cgroup_id)
        binary.following_execs = True

    def _register_new(self, binary: _Binary) -> None:
        """Processes the mode found at their exec of ``binary``: tracked from their first instruction."""
        for pid in binary.mode.take_new_processes():
            if pid != self.self_pid and os.path.exists(f"/proc/{pid}"):
                self.tracked[pid] = binary.inode
                self.execs_found += 1

    def _candidates(self) -> Iterable[int]:
        t = self.target
        if t.pid is not None:
            return [t.pid]
        if t.cgroup is not None:
            try:
                with open(os.path.join(t.cgroup, "cgroup.procs")) as fh:
                    return [int(x) for x in fh.read().split()]
            except OSError:
                return []
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]

    def _binary_for(self, path: str, inode: Inode) -> _Binary:
        from ccprofd.tracing.session import make_mode

        b = self.binaries_by_inode.get(inode)
        if b is None:
            ident = file_identity(path)  # before the bytes are read: a later write shows as a change
            if self._gate is not None:
                try:
                    self._gate.watch(path, gate_execs=self.options.mode == "instrumented")
                except OSError as exc:
                    log.warning("target %s: %s: rewrites found by polling only", self.target.name, exc)
            mode = make_mode(path, self._options_for(path))
            mode.prepare()
            b = _Binary(path, inode, mode, mode.build_id or "", ident=ident)
            self.binaries_by_inode[inode] = b
        return b

    def _options_for(self, path: str) -> TraceOptions:
        """The tracer options of one binary: with ``[target.anomaly] action = "enforce"`` in unwind
        mode, the unwinder enforces the model of this binary's build-id (none: detection only, the
        anomaly monitor says why).  The model is read when the binary is set up: a reload (which
        re-attaches the target) picks up a re-learned model."""
        an = self.target.anomaly
        if an.action != "enforce" or self.options.mode != "unwind":
            return self.options
        from dataclasses import replace

        from ccprofd.anomaly.modelstore import ModelFileError, load_models
        from ccprofd.anomaly.unwind_enforce import enforcement_options
        from ccprofd.daemon.anomaly_runtime import model_path
        from ccprofd.elf.image import ElfImage

        try:
            bid = ElfImage(path).build_id()
            model = load_models(str(model_path(self.state_dir, self.target.name, an))).targets.get(bid or "")
        except (ModelFileError, OSError, ValueError) as exc:
            log.error("target %s: cannot enforce on %s (detecting only): %s", self.target.name, path, exc)
            return self.options
        if model is None:
            return self.options
        enf, allowed = enforcement_options(model)
        log.warning("target %s: enforcing the model of %s from the unwinder: SIGKILL at syscall entry "
                    "(the killed syscall itself completes); %d allowed contexts, %d not keyable",
                    self.target.name, path, len(enf.allowed), allowed.unkeyed)
        return replace(self.options, enforce=enf)

    def enforcement_denials(self) -> list[Any]:
        """Each thread's first denial by the unwinders of this target's binaries (enforce action)."""
        out: list[Any] = []
        for b in list(self.binaries_by_inode.values()):
            get = getattr(b.mode, "enforcement", None)
            if get is not None:
                out += get()[1]
        return out

    # ------------------------------------------------------------------ rewritten binaries
    def _gate_check(self, ident: FileIdentity, pid: int) -> None:
        """The exec gate's thread, before ``pid`` maps the file ``ident``: wait until the plan in
        place is the one for these bytes (the pump thread re-plans, :meth:`_replan_stale`)."""
        with self._stale_lock:
            event = self._stale.get(ident.inode)  # being re-planned: wait for the end of it
        if event is None:
            b = self.binaries_by_inode.get(ident.inode)
            if b is None or b.ident == ident:
                return
            event = self._mark_stale(ident.inode)
        if not event.wait(REPLAN_WAIT_S):
            log.warning("target %s: pid %d exec'd inode %d before its new plan was ready", self.target.name,
                        pid, ident.ino)

    def _gate_changed(self, ident: FileIdentity) -> None:
        """The file ``ident`` was closed after a write: re-plan it now, before any exec asks."""
        b = self.binaries_by_inode.get(ident.inode)
        if b is not None and b.ident != ident:
            self._mark_stale(ident.inode)

    def _mark_stale(self, inode: Inode) -> threading.Event:
        with self._stale_lock:
            return self._stale.setdefault(inode, threading.Event())

    def _replan_stale(self) -> None:
        """Re-plan every binary whose file was rewritten in place.  No process can run the old
        bytes (the write needed the file not running), so whatever runs that inode runs the new
        bytes: instrumented mode closes the old mode first (its probes were placed for other
        bytes; the exec gate holds new execs meanwhile); unwind mode first hands the processes the
        old mode found at their exec (held there, not yet run) to the new one, then closes it."""
        for inode, b in list(self.binaries_by_inode.items()):
            now = file_identity(b.path)
            if b.ident is not None and now is not None and now.inode == inode and now != b.ident:
                self._mark_stale(inode)  # no gate, or its event not seen yet
        with self._stale_lock:
            stale = list(self._stale.items())
        for inode, event in stale:
            try:
                old = self.binaries_by_inode.get(inode)
                if old is not None:
                    self._replan(inode, old)
            except Exception as exc:  # e.g. a half-written file: found again by the rescan
                log.error("target %s: re-planning %s failed: %s", self.target.name, inode, exc)
            finally:
                with self._stale_lock:
                    self._stale.pop(inode, None)
                event.set()

    def _drain(self, old: _Binary) -> None:
        """What a mode about to close still holds: its last records and the kernel's counts not
        yet read (the next :meth:`poll_counted` returns them)."""
        if not old.mode.context_samples:
            return
        try:
            _read_counted(old.mode, 0, self._drained_records, self._drained_counts)
        except Exception as exc:
            log.error("target %s: last read of %s before re-planning failed: %s", self.target.name,
                      old.path, exc)

    def _replan(self, inode: Inode, old: _Binary) -> None:
        pids = [p for p, i in self.tracked.items() if i == inode]
        with contextlib.suppress(Exception):
            pids += old.mode.take_new_processes()
        for pid in pids:
            self.tracked.pop(pid, None)
        del self.binaries_by_inode[inode]
        if self.options.mode == "instrumented":
            self._drain(old)
            with contextlib.suppress(Exception):
                old.mode.close()
        try:
            new = self._binary_for(old.path, inode)
            self._follow_execs(new)
            for pid in dict.fromkeys(pids):
                if pid != self.self_pid and os.path.exists(f"/proc/{pid}"):
                    new.mode.track_running(pid, threads_of(pid))
                    self.tracked[pid] = inode
            self._scan()  # and those whose exec the old mode saw but did not report (still held)
        finally:
            if self.options.mode != "instrumented":
                self._drain(old)
                with contextlib.suppress(Exception):
                    old.mode.close()  # continues what it held: tracked by the new mode now
        self.replans += 1
        log.info("target %s: %s was rewritten (build-id %s -> %s): re-planned", self.target.name,
                 old.path, old.build_id or "none", new.build_id or "none")

    def _scan(self) -> None:
        self._last_scan = time.monotonic()
        want: Inode | None = None
        if self.target.path is not None:
            try:
                st = os.stat(self.target.path)
                want = (st.st_dev, st.st_ino)
            except OSError:
                want = None
        alive = set()
        from ccprofd.kbpf.holdguard import is_guard

        for pid in self._candidates():
            if pid == self.self_pid or is_guard(pid):  # the daemon and its hold guards
                continue
            if pid in self.tracked:
                if os.path.exists(f"/proc/{pid}"):
                    alive.add(pid)
                continue
            exe = _exe_of(pid)
            if exe is None:
                continue
            path, inode = exe
            if self.target.path is not None and inode != want:
                continue
            binary = self._binary_for(self.target.path if inode == want and self.target.path else path, inode)
            self._follow_execs(binary)
            self._register_new(binary)  # an exec hook may have found it already: not a running process
            if pid in self.tracked:
                alive.add(pid)
                continue
            binary.mode.track_running(pid, threads_of(pid))
            self.tracked[pid] = inode
            alive.add(pid)
        for pid in set(self.tracked) - alive:
            del self.tracked[pid]

    # ------------------------------------------------------------------------ SampleSource
    def start(self) -> None:
        t = self.target
        problem = binary_problem(t.path) if t.path is not None else \
            cgroup_problem(t.cgroup) if t.cgroup is not None else None
        if problem is not None:  # the daemon retries until it is there
            raise TargetWaiting(f"{t.path or t.cgroup} {problem}")
        gate = ExecGate(self._gate_check, self._gate_changed)
        try:
            gate.start()
            self._gate = gate
        except OSError as exc:
            log.warning("target %s: no exec gate (%s): a binary rewritten in place is re-planned at "
                        "the next poll", t.name, exc)
        if t.path is not None:
            try:
                st = os.stat(t.path)
            except FileNotFoundError:  # removed since the check
                self.close()  # the gate started above
                raise TargetWaiting(f"{t.path} does not exist") from None
            self._follow_execs(self._binary_for(t.path, (st.st_dev, st.st_ino)))
        self._scan()
        if self.target.pid is not None and not self.tracked:
            raise RuntimeError(f"no process {self.target.pid} (or it runs a deleted executable)")

    def poll(self, timeout_ms: int) -> list[dict[str, Any]]:
        self._replan_stale()
        out = [sample for sample, _ in self._drained_records]  # (this API takes no counts)
        self._drained_records, self._drained_counts = [], []
        binaries = list(self.binaries_by_inode.values())
        if not binaries:
            time.sleep(timeout_ms / 1000)
        else:
            share = max(1, timeout_ms // len(binaries)) if timeout_ms else 0  # 0: a last read, no wait
            for b in binaries:
                out.extend(s.to_json() for s in b.mode.poll(share))
                self._register_new(b)  # found at exec: registered now, before any rescan
        if time.monotonic() - self._last_scan >= RESCAN_S:
            self._scan()
        if self._history is not None:
            self._history.maybe_save([b.mode for b in binaries])
        return out

    def set_per_sample(self, on: bool) -> None:
        """Whether a consumer needs every sample as a record (see the daemon's ``_pump``); both
        modes count samples in the kernel otherwise (aggregate mode)."""
        self.per_sample = on
        for b in list(self.binaries_by_inode.values()):  # also called from gRPC threads
            b.mode.set_per_sample(on)

    def poll_counted(self, timeout_ms: int) -> tuple[list[tuple[dict[str, Any], bool]],
                                                     list[tuple[dict[str, Any], int]]]:
        """Like :meth:`poll`, for the daemon's store: ``(records, counts)`` -- every record with
        whether it is one sample to count, and ``(context sample, n)`` for samples counted in the
        kernel (aggregate mode's per-context counts) since the previous call."""
        self._replan_stale()
        records, self._drained_records = self._drained_records, []
        counts, self._drained_counts = self._drained_counts, []
        binaries = list(self.binaries_by_inode.values())
        if not binaries:
            time.sleep(timeout_ms / 1000)
        else:
            # (0 stays 0: a last read that must not wait, and takes the kernel's counts whatever came)
            share = max(1, timeout_ms // len(binaries)) if timeout_ms else 0
            for b in binaries:
                b.mode.set_per_sample(self.per_sample)  # a mode prepared since the last switch
                _read_counted(b.mode, share, records, counts)
                self._register_new(b)  # found at exec: registered now, before any rescan
        if time.monotonic() - self._last_scan >= RESCAN_S:
            self._scan()
        if self._history is not None:
            self._history.maybe_save([b.mode for b in binaries])
        return records, counts

    def mode(self) -> str:
        return self.target.mode

    def processes(self) -> list[ProcessInfo]:
        out = []
        for pid, inode in sorted(self.tracked.items()):
            b = self.binaries_by_inode.get(inode)  # a binary being re-planned has none
            if b is None:
                continue
            out.append(ProcessInfo(pid, b.path, b.build_id, len(threads_of(pid)), _comm(pid), inode[1]))
        return out

    def binaries(self) -> list[BinaryInfo]:
        return [BinaryInfo(b.path, b.build_id, inode[1], True)
                for inode, b in list(self.binaries_by_inode.items())]

    def thread_contexts(self, pid: int) -> list[ThreadContext]:
        inode = self.tracked.get(pid)
        binary = self.binaries_by_inode.get(inode) if inode is not None else None
        if binary is None:
            raise UnknownProcess(f"no target follows pid {pid}")
        got = binary.mode.thread_contexts(pid)  # a ptrace snapshot unwound with the CFI tables
        if got["error"]:
            if got["error"].startswith("ptrace refused"):
                raise PermissionError(got["error"])
            if got["error"].startswith("no process"):
                raise UnknownProcess(got["error"])  # it exited since it was listed
            raise RuntimeError(got["error"])
        return [ThreadContext(t["tid"], t["complete"], tuple(t["frames"]), t["comm"], t["reason"])
                for t in got["threads"]]

    def _modes_for(self, pid: int) -> list[Any]:
        """The modes that may hold ``pid``'s history: its binary's first (a process, or a live
        thread's process), then every other (a thread or process that has exited)."""
        inode = self.tracked.get(pid)
        if inode is None:
            inode = self.tracked.get(tgid_of(pid) or -1)
        first = self.binaries_by_inode.get(inode) if inode is not None else None
        rest = [b for b in list(self.binaries_by_inode.values()) if b is not first]
        return [b.mode for b in ([first] if first is not None else []) + rest]

    def history(self, pid: int, last: int) -> dict[str, Any]:
        errors = []
        for mode in self._modes_for(pid):
            got = mode.history(pid, last)
            if got["threads"]:
                return got
            errors.append(got["error"])
        raise UnknownProcess(next((e for e in errors if e and "off" in e), None)
                             or f"no recorded syscalls of pid {pid} in this target")

    def history_before(self, pid: int, tid: int, time_ns: int, last: int) -> list[dict[str, Any]]:
        for mode in self._modes_for(pid):
            got = mode.history_before(tid, time_ns, last)
            if got:
                return got
        return []

    def callgraph_stats(self) -> dict[str, Any]:
        from pathlib import Path

        from ccprofd.callgraph import analyze_binary, graph_stats
        from ccprofd.encode.report import encoding_report

        out: dict[str, Any] = {}
        cache = Path(self.options.cache_dir) if self.options.cache_dir else None
        for b in self.binaries_by_inode.values():
            graph = analyze_binary(b.path, cache_dir=cache)
            stats: dict[str, Any] = dict(graph_stats(graph))
            stats["encodings"] = encoding_report(graph, [self.target.encoding], cache_dir=cache)
            stats["tracer"] = b.mode.summary()
            out[b.path] = stats
        return out

    def counters(self) -> SourceCounters:
        dropped: dict[str, int] = {}
        errors = mismatches = hits = 0
        maps: dict[str, int] = {}
        for b in list(self.binaries_by_inode.values()):
            summary = b.mode.summary()
            errors += int(summary.get("decode_errors") or 0)
            mismatches += int((summary.get("verify") or {}).get("mismatches") or 0)  # verify = true
            bpf = summary.get("bpf") or {}
            hits += sum(int(bpf.get(k) or 0) for k in PROBE_HIT_STATS)  # instrumented mode's uprobes
            for key, value in bpf.items():
                if isinstance(value, int) and ("full" in key or "lost" in key or "drop" in key):
                    dropped[key] = dropped.get(key, 0) + value
            for name, n in b.mode.map_entries().items():
                maps[name] = maps.get(name, 0) + n
        return SourceCounters(probe_hits=hits, decode_errors=errors, verify_mismatches=mismatches,
                              dropped=dropped, map_entries=maps)

    def close(self) -> None:
        if self._gate is not None:
            self._gate.close()  # pending execs are allowed by the kernel
            self._gate = None
        with self._stale_lock:
            for event in self._stale.values():
                event.set()
            self._stale.clear()
        if self._history is not None and self.binaries_by_inode:  # what the rings hold, before they go
            self._history.save([b.mode for b in self.binaries_by_inode.values()], final=True)
        for b in self.binaries_by_inode.values():
            with contextlib.suppress(Exception):  # one failing close must not keep the others attached
                b.mode.close()
        self.binaries_by_inode.clear()
        self.tracked.clear()


def _read_counted(mode: Mode, timeout_ms: int, records: list[tuple[dict[str, Any], bool]],
                  counts: list[tuple[dict[str, Any], int]]) -> None:
    """One ``poll_counted`` of a mode, its records and counts appended in the daemon's JSON form."""
    got, deltas = mode.poll_counted(timeout_ms)
    records.extend((s.to_json(), counted) for s, counted in got)
    counts.extend((s.to_json(), n) for s, n in deltas)


def make_source(target: TargetConfig, daemon: DaemonConfig) -> TracerSource:
    return TracerSource(target, daemon)
