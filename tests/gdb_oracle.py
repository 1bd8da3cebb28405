"""Ground truth for stacks deeper than strace's 256 frames: ``gdb -batch`` with ``catch syscall``.

Same output shape as ``tests/strace_oracle.py`` (a :class:`strace_oracle.Trace`, frames as
:class:`strace_oracle.RawFrame` with *file offsets*), so ``target_frames`` and ``tests/fidelity.py``
work on either.  Imports nothing of ccprofd.

How it works: gdb runs a generated Python script that catches the requested syscalls (one
``catch syscall NAME`` each), and at every syscall-*entry* stop walks the whole stack with
``gdb.newest_frame()``/``older()`` (no frame limit; ``backtrace past-main``/``past-entry`` on so the
walk goes up to ``_start`` like strace's).  Each frame's pc is turned into (module, file offset) with
the stopped process's ``/proc/PID/maps`` -- ``offset = pc - mapping_start + mapping_file_offset``,
exactly strace's rule -- so both oracles print the same numbers for the same frame.

* Entry vs return stops: gdb stops twice per syscall; a per-thread toggle tells them apart, and the
  entry stop is cross-checked by ``$rax == -ENOSYS`` (x86-64 sets it before the entry stop).
* Frames gdb synthesises are dropped: ``INLINE_FRAME`` (the machine frame with the same pc follows)
  and ``TAILCALL_FRAME`` (from DWARF call-site info; not on the machine stack -- strace cannot see
  them either).  Their count is kept in :attr:`GdbRun.synthetic_frames`.  The signal trampoline frame
  (``SIGTRAMP_FRAME``) is kept, as strace keeps it.
* Tasks: threads in the order gdb reports them (``gdb.events.new_thread``: the ptrace clone event in
  the parent, i.e. creation order), main thread first.  **Only one process**: forked children are
  detached (gdb's default) and not traced -- use strace for fork tests.  ``exec`` is followed, and
  ``exe`` (the image at syscall entry) comes from ``/proc/PID/exe``.
* Cost (measured here): ~0.5 s start-up, then ~0.2 s per 1,000 frames walked (3 syscalls at depth
  10,000 -- 40,000 frames -- took 2.3 s); strace -k takes ~0.1 s but stops at 256 frames.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from strace_oracle import OracleError, RawFrame, Syscall, Task, Trace

_SCRIPT = r'''
import gdb, json, os

CONFIG = json.loads(%(config)r)
out = open(CONFIG["output"], "w")

def emit(obj):
    out.write(json.dumps(obj) + "\n")
    out.flush()

for cmd in ("set pagination off", "set confirm off", "set startup-with-shell off",
            "set backtrace past-main on", "set backtrace past-entry on", "set backtrace limit unlimited",
            "set print thread-events off", "set print inferior-events off"):
    gdb.execute(cmd)
try:
    gdb.execute("set debuginfod enabled off")
except gdb.error:
    pass

if CONFIG.get("attach"):  # attached first: catchpoints set before an attach did not fire (gdb 13)
    gdb.execute("attach %%d" %% CONFIG["attach"], to_string=True)

catch_names = {}
for name in CONFIG["syscalls"]:
    gdb.execute("catch syscall " + name)
    catch_names[gdb.breakpoints()[-1].number] = name

in_syscall = {}   # (pid, lwp) -> True between entry and return stop
state = {"stop": False}
maps_cache = {}

def read_maps(pid):
    rows = []
    with open("/proc/%%d/maps" %% pid) as fh:
        for line in fh:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            rows.append((lo, hi, parts[1], int(parts[2], 16), path))
    return rows

def locate(rows, pc):
    for lo, hi, perms, off, path in rows:
        if lo <= pc < hi:
            if path.startswith("/") and "x" in perms:
                return path, pc - lo + off
            return (path or None), pc
    return None, pc

def on_new_thread(ev):
    t = ev.inferior_thread
    emit({"event": "thread", "pid": t.ptid[0], "tid": t.ptid[1] or t.ptid[0]})

def on_exited(ev):
    emit({"event": "exited", "code": getattr(ev, "exit_code", None)})

def on_stop(ev):
    thread = gdb.selected_thread()
    pid, lwp = thread.ptid[0], thread.ptid[1] or thread.ptid[0]
    if isinstance(ev, gdb.SignalEvent):
        emit({"event": "signal", "pid": pid, "tid": lwp, "name": ev.stop_signal})
        return
    if not isinstance(ev, gdb.BreakpointEvent):
        return
    names = [catch_names[b.number] for b in ev.breakpoints if b.number in catch_names]
    if not names:
        return
    key = (pid, lwp)
    entering = not in_syscall.get(key, False)
    in_syscall[key] = entering
    if not entering:
        return
    if CONFIG.get("stop_file") and os.path.exists(CONFIG["stop_file"]):
        state["stop"] = True  # attached: the caller asked to detach (this syscall is not recorded)
        return
    rax = int(gdb.parse_and_eval("$rax"))
    rows = read_maps(pid)
    try:
        exe = os.path.realpath("/proc/%%d/exe" %% pid)
    except OSError:
        exe = None
    frames = []
    synthetic = 0
    f = gdb.newest_frame()
    last = f
    while f is not None and len(frames) < CONFIG["max_frames"]:
        kind = f.type()
        if kind in (gdb.INLINE_FRAME, gdb.TAILCALL_FRAME):
            synthetic += 1
        else:
            pc = f.pc()
            module, offset = locate(rows, pc)
            frames.append([module, f.name(), offset])
        last = f
        f = f.older()
    reason = last.unwind_stop_reason() if last is not None else gdb.FRAME_UNWIND_NO_REASON
    truncated = f is not None or reason not in (gdb.FRAME_UNWIND_NO_REASON, gdb.FRAME_UNWIND_OUTERMOST)
    emit({"event": "syscall", "pid": pid, "tid": lwp, "name": names[0], "frames": frames,
          "truncated": truncated, "stop_reason": gdb.frame_stop_reason_string(reason),
          "entry_rax_ok": rax == -38, "exe": exe, "synthetic": synthetic})

gdb.events.new_thread.connect(on_new_thread)
gdb.events.exited.connect(on_exited)
gdb.events.stop.connect(on_stop)

try:
    if CONFIG.get("attach"):
        for t in gdb.selected_inferior().threads():
            emit({"event": "thread", "pid": t.ptid[0], "tid": t.ptid[1] or t.ptid[0]})
        emit({"event": "attached"})
        while not state["stop"]:
            gdb.execute("continue", to_string=True)
        gdb.execute("detach", to_string=True)
    else:
        gdb.execute("run", to_string=True)
        while True:
            gdb.execute("continue", to_string=True)
except gdb.error as exc:
    if "not being run" not in str(exc):
        emit({"event": "error", "message": str(exc)})
out.close()
'''


@dataclass
class GdbRun:
    """Facts about a gdb oracle run that the :class:`Trace` has no field for."""

    synthetic_frames: int  # inline and tail-call frames gdb showed and the oracle dropped
    entry_check_failures: int  # entry stops where $rax was not -ENOSYS (should be 0)


def gdb_path() -> str:
    path = shutil.which("gdb")
    if path is None:
        raise OracleError("gdb is not installed")
    return path


def run_gdb(cmd: Sequence[str], syscalls: Iterable[str], *, cwd: str | os.PathLike[str] | None = None,
            env: dict[str, str] | None = None, timeout: float | None = None,
            max_frames: int = 1_000_000) -> tuple[Trace, GdbRun]:
    """Run ``cmd`` under gdb, catching ``syscalls``, and return the trace (strace's shape) and run facts.

    The command's own output is mixed with gdb's and not returned; its exit status is.
    """
    requested = frozenset(syscalls)
    if not requested:
        raise ValueError("no syscalls to catch")
    with tempfile.TemporaryDirectory(prefix="gdb-oracle-") as tmp:
        events_file = pathlib.Path(tmp) / "events.jsonl"
        script = pathlib.Path(tmp) / "oracle.py"
        config = json.dumps({"output": str(events_file), "syscalls": sorted(requested),
                             "max_frames": max_frames})
        script.write_text(_SCRIPT % {"config": config})
        argv = [gdb_path(), "-q", "-batch", "-nx", "-x", str(script), "--args", *cmd]
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise OracleError(f"gdb oracle timed out after {timeout} s on {list(cmd)}") from None
        text = events_file.read_text() if events_file.exists() else ""
    if not text.strip():
        raise OracleError(f"gdb produced no events (exit {proc.returncode}): {stderr.strip()[-2000:]}")
    trace, run = parse_gdb_events(text, requested=requested, command=tuple(cmd))
    trace.stdout, trace.stderr = stdout, stderr
    return trace, run


class AttachedGdb:
    """gdb attached to a running process (:func:`attach_gdb`), catching syscalls until
    :meth:`finish`: that creates the stop file, and gdb detaches at the next caught syscall entry
    (which the caller must cause; it is not recorded)."""

    def __init__(self, proc: subprocess.Popen[str], tmp: tempfile.TemporaryDirectory[str],
                 requested: frozenset[str], pid: int) -> None:
        self.proc, self._tmp, self.requested, self.pid = proc, tmp, requested, pid
        self.events_file = pathlib.Path(tmp.name) / "events.jsonl"
        self.stop_file = pathlib.Path(tmp.name) / "stop"

    def request_stop(self) -> None:
        self.stop_file.touch()

    def finish(self, timeout: float | None = None) -> tuple[Trace, GdbRun]:
        try:
            try:
                _, stderr = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.communicate()
                raise OracleError(f"gdb attached to {self.pid} did not detach in {timeout} s") from None
            text = self.events_file.read_text() if self.events_file.exists() else ""
        finally:
            self._tmp.cleanup()
        lines = "\n".join(line for line in text.splitlines() if '"attached"' not in line)
        if not lines.strip():
            raise OracleError(f"gdb -p {self.pid} produced no events (exit {self.proc.returncode}): "
                              f"{stderr.strip()[-2000:]}")
        trace, run = parse_gdb_events(lines, requested=self.requested, command=(f"pid {self.pid}",))
        trace.stderr = stderr
        return trace, run


def attach_gdb(pid: int, syscalls: Iterable[str], *, timeout: float = 120,
               max_frames: int = 1_000_000) -> AttachedGdb:
    """Attach gdb to the running process ``pid`` (every thread), catching ``syscalls``; return once
    it is attached and the catchpoints are armed.  Only syscalls *entered* after the attach are
    seen: a thread blocked in a syscall at attach time must be blocked in one not caught (its
    return would be taken for an entry; ``entry_check_failures`` would count it)."""
    requested = frozenset(syscalls)
    if not requested:
        raise ValueError("no syscalls to catch")
    tmp = tempfile.TemporaryDirectory(prefix="gdb-oracle-")
    events = pathlib.Path(tmp.name) / "events.jsonl"
    script = pathlib.Path(tmp.name) / "oracle.py"
    config = json.dumps({"output": str(events), "syscalls": sorted(requested), "max_frames": max_frames,
                         "attach": pid, "stop_file": str(pathlib.Path(tmp.name) / "stop")})
    script.write_text(_SCRIPT % {"config": config})
    argv = [gdb_path(), "-q", "-batch", "-nx", "-x", str(script)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", start_new_session=True)
    deadline = time.monotonic() + timeout
    while '"attached"' not in (events.read_text() if events.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            tmp.cleanup()
            raise OracleError(f"gdb could not attach to {pid}: {err.strip()[-2000:]}")
        time.sleep(0.05)
    return AttachedGdb(proc, tmp, requested, pid)


def parse_gdb_events(text: str, *, requested: frozenset[str],
                     command: tuple[str, ...]) -> tuple[Trace, GdbRun]:
    """The event lines written by the gdb script -> :class:`Trace` (tasks in thread-report order)."""
    tasks: dict[int, Task] = {}
    exit_status: int | None = None
    synthetic = 0
    entry_failures = 0
    first_pid: int | None = None

    def task_for(pid: int, tid: int) -> Task:
        nonlocal first_pid
        if first_pid is None:
            first_pid = pid
        if tid not in tasks:
            parent = None if tid == pid else pid
            tasks[tid] = Task(index=len(tasks), tid=tid, pid=pid, parent_tid=parent)
        return tasks[tid]

    for lineno, line in enumerate(text.splitlines(), 1):
        ev = json.loads(line)
        kind = ev["event"]
        if kind == "thread":
            task_for(ev["pid"], ev["tid"])
        elif kind == "exited":
            exit_status = ev.get("code")
            if exit_status is None:
                exit_status = 0
        elif kind == "signal":
            task = task_for(ev["pid"], ev["tid"])
            task.signals.append((len(task.syscalls), ev["name"]))
        elif kind == "syscall":
            task = task_for(ev["pid"], ev["tid"])
            frames = tuple(RawFrame(m, n, int(o)) for m, n, o in ev["frames"])
            synthetic += ev.get("synthetic", 0)
            entry_failures += 0 if ev.get("entry_rax_ok", True) else 1
            task.syscalls.append(Syscall(name=ev["name"], frames=frames, truncated=bool(ev["truncated"]),
                                         exe=ev.get("exe"), line=lineno))
        elif kind == "error":
            raise OracleError(f"gdb: {ev['message']}")
    ordered = sorted(tasks.values(), key=lambda t: t.index)
    # The main thread first even if gdb reported another thread before it (it does not, but be exact).
    ordered.sort(key=lambda t: (t.tid != first_pid, t.index))
    for i, t in enumerate(ordered):
        t.index = i
    trace = Trace(source="gdb", command=command, requested=requested, tasks=ordered, exit_status=exit_status,
                  raw_output=text, tid_order_ok=[t.tid for t in ordered] == sorted(t.tid for t in ordered))
    return trace, GdbRun(synthetic, entry_failures)
