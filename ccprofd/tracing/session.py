"""A trace session: ``ccprofd trace`` — start ``-- CMD`` with probes attached before its exec, or
attach to ``-p PID``; stream decoded samples; pass the command's stdio and exit status through.

Modes plug in through :class:`Mode`: anything that can be prepared for a binary, told which
processes to follow, and polled for :class:`TraceSample` values (instrumented mode here; unwind mode
implements the same interface).  The session owns the process side (fork, exec gate, wait, signals)
and nothing about how contexts are obtained.

Public API::

    TraceOptions(...)                         what to trace and how
    open_session(argv, *, syscalls=None, options=None) -> Session   (also used by learn/detect)
    Session.samples() -> Iterator[dict]       JSON-ready samples until the command has exited
    Session.wait() -> int                     the command's exit status (128+N for signal N)
    attach_session(pids, options) -> Session  for -p PID... (wait() returns 0 after detaching)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, Protocol

from ccprofd.kbpf.errors import BPFError
from ccprofd.proc.tasks import list_threads
from ccprofd.tracing.api import DROPS, MODES, Mode, TraceError, TraceOptions, TraceSample

# After Ctrl-C/SIGTERM (stop()), how long the records already in the rings are still decoded and
# written before the rest is reported as unread: the user asked to stop, so not much longer.
STOP_DRAIN_S = 1.0


def make_mode(binary: str, options: TraceOptions) -> Mode:
    if options.mode == "instrumented":
        from ccprofd.tracing.instrumented.mode import InstrumentedMode

        if options.enforce is not None:
            raise TraceError("enforcement from the unwinder needs --mode unwind")

        return InstrumentedMode(binary, options)
    if options.mode == "unwind":
        from ccprofd.tracing.unwind.mode import UnwindMode

        return UnwindMode(binary, options)
    raise TraceError(f"unknown --mode {options.mode!r} (expected one of {', '.join(MODES)})")


def resolve_command(argv: Sequence[str]) -> str:
    """The executable ``argv[0]`` names (PATH lookup as execvp does); TraceError when there is none."""
    if not argv:
        raise TraceError("no command given after --")
    cmd = argv[0]
    path = cmd if "/" in cmd else shutil.which(cmd)
    if path is None or not os.path.exists(path):
        raise TraceError(f"command not found: {cmd}")
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise TraceError(f"{cmd}: not an executable file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"\x7fELF":
        raise TraceError(f"{cmd}: not an ELF executable (to trace a script, trace its interpreter)")
    return os.path.abspath(path)


def exit_status(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


class Session:
    """A running trace: the mode plus the traced process(es)."""

    def __init__(self, mode: Mode, *, child: int | None = None,
                 attached: Sequence[int] | int | None = None, detach_at_end: bool = True) -> None:
        """``detach_at_end=False``: the mode outlives this session (one prepared mode traces
        several commands in turn, as bench/report_trace.py does): it is drained, not detached."""
        self.mode = mode
        mode.context_samples = False  # a session never takes the kernel's counts (poll_counted)
        self.detach_at_end = detach_at_end
        self.child = child
        self.attached: tuple[int, ...] = (attached,) if isinstance(attached, int) else tuple(attached or ())
        self.path = mode.path
        self.build_id = mode.build_id
        self.status: int | None = None
        self.failed: BaseException | None = None
        self.unread = 0  # records left in the rings when the drain after stop() ran out of time
        self._stop = False
        self._hurry = False

    # ------------------------------------------------------------------------------ running
    def stop(self) -> None:
        """Detach at the next poll (Ctrl-C in -p mode)."""
        self._stop = True
        self._hurry = True

    def hurry(self) -> None:
        """Keep tracing until the command exits, then drain for at most STOP_DRAIN_S (Ctrl-C or
        SIGTERM while tracing a command: the user wants it over, not every buffered sample)."""
        self._hurry = True

    def _target_alive(self) -> bool:
        if self.child is not None:
            if self.status is not None:
                return False
            pid, st = os.waitpid(self.child, os.WNOHANG)
            if pid == self.child:
                self.status = exit_status(st)
                return False
            return True
        if self.attached:
            return any(os.path.exists(f"/proc/{pid}") for pid in self.attached)
        return False

    def batches(self, poll_ms: int = 100) -> Iterator[list[TraceSample]]:
        """Batches of samples until the target exits or stop(); then the mode is detached (no new
        samples) and what is already recorded is drained: all of it after an exit, for at most
        :data:`STOP_DRAIN_S` after stop() or hurry(), so a flood in the rings cannot hold us."""
        try:
            while not self._stop and self._target_alive():
                batch = self.mode.poll(poll_ms)
                if batch:
                    yield batch
            if self.detach_at_end:
                self.mode.detach()
            deadline = time.monotonic() + STOP_DRAIN_S
            while True:
                if self._hurry and time.monotonic() > deadline:
                    self.unread = self.mode.backlog()
                    break
                batch = self.mode.poll(0)
                if batch:
                    yield batch
                elif not self.mode.backlog():  # counting the backlog walks the ring: only when idle
                    break
            rest = self.mode.unfinished()  # --retval: samples whose return never came
            if rest:
                yield rest
        except (BPFError, OSError) as exc:
            self.failed = exc
            raise

    def samples(self) -> Iterator[dict[str, Any]]:
        for batch in self.batches():
            for s in batch:
                yield s.to_json()

    def wait(self) -> int:
        """The command's exit status (waiting for it if needed); 0 for an attached process."""
        if self.child is not None and self.status is None:
            while True:
                try:
                    _, st = os.waitpid(self.child, 0)
                    self.status = exit_status(st)
                    break
                except InterruptedError:
                    continue
                except ChildProcessError:
                    self.status = 0
                    break
        self.close()
        return self.status if self.status is not None else 0

    def close(self) -> None:
        self.mode.close()

    def summary(self) -> dict[str, Any]:
        return self.mode.summary()


def _gated_child(path: str, argv: Sequence[str]) -> tuple[int, int]:
    """Fork a child that execs ``path`` once released (one byte on the returned pipe fd); EOF
    without the byte (ccprofd failed before attaching) makes it exit 125 without running anything."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(w)
            go = os.read(r, 1)
            os.close(r)
            if go != b"x":
                os._exit(125)
            # Python ignores SIGPIPE and SIGXFSZ and an ignored disposition survives exec: give
            # the command the dispositions its shell would (`ccprofd trace -- yes | head` must end
            # by SIGPIPE, not loop on EPIPE), as subprocess's restore_signals does.
            for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            os.execv(path, list(argv))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.write(2, f"ccprofd: cannot execute {argv[0]}: {exc.strerror}\n".encode())
            os._exit(126 if exc.errno in (13, 8) else 127)
        os._exit(127)
    os.close(r)
    return pid, w


def open_session(argv: Sequence[str], *, syscalls: Sequence[str] | str | None = None,
                 options: TraceOptions | None = None,
                 on_launch: Callable[[int], None] | None = None) -> Session:
    """Start ``argv`` traced: probes attached before it execs, so contexts are complete from the
    first instruction of ``main``.  ``syscalls``: names (or a comma-separated string); None = all.
    ``on_launch(pid)`` runs before the child is released (e.g. to put it under enforcement too)."""
    opts = options or TraceOptions()
    if syscalls is not None and not isinstance(syscalls, str):
        syscalls = ",".join(syscalls)
    if syscalls is not None:
        opts = TraceOptions(**{**_asdict(opts), "syscalls": syscalls})
    path = resolve_command(argv)
    mode = make_mode(path, opts)
    pid, gate = _gated_child(path, argv)
    try:
        mode.prepare()
        mode.track_launch(pid)
        if on_launch is not None:
            on_launch(pid)
    except BaseException:
        os.close(gate)  # the child exits without running the command
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        mode.close()
        raise
    os.write(gate, b"x")
    os.close(gate)
    return Session(mode, child=pid)


def attach_session(pids: int | Sequence[int], options: TraceOptions) -> Session:
    """Trace the running process(es) ``pids`` (their threads' frames above the first event are
    unknown).  Several processes must run the same executable: one binary is analysed per trace."""
    import sys

    pids = [pids] if isinstance(pids, int) else list(dict.fromkeys(pids))
    targets: dict[int, tuple[str, list[int]]] = {}
    for pid in pids:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            targets[pid] = (exe, list_threads(pid))
        except FileNotFoundError:
            raise TraceError(f"no process {pid}") from None
        except PermissionError:
            raise TraceError(f"cannot inspect process {pid}: permission denied") from None
        if exe.endswith(" (deleted)"):
            raise TraceError(f"process {pid} runs a deleted executable")
    exes = {exe for exe, _ in targets.values()}
    if len(exes) > 1:
        listing = ", ".join(f"{pid}: {exe}" for pid, (exe, _) in targets.items())
        raise TraceError(f"the processes run different executables ({listing}); trace one executable "
                         "per ccprofd trace")
    mode = make_mode(exes.pop(), options)
    try:
        mode.prepare()
        for pid, (_, tids) in targets.items():
            mode.track_running(pid, tids)
    except BaseException:
        mode.close()
        raise
    seeding = mode.summary().get("seeding", {})
    for pid in targets:
        seeded = seeding.get(str(pid))
        if seeded is not None:  # one line once the threads run again: what is complete from now on
            bad = {t: r for t, r in seeded.items() if r is not None}
            why = not_seeded(bad)
            print(f"ccprofd: attached to pid {pid}: {len(seeded) - len(bad)} of {len(seeded)} threads seeded "
                  f"by one unwind{why}", file=sys.stderr, flush=True)
    return Session(mode, attached=list(targets))


def not_seeded(bad: dict[str, str]) -> str:
    """``; thread T not seeded: WHY`` per thread, or ``; N threads not seeded: WHY`` per reason
    when more than 3 threads share it (hundreds of threads past the state slots: one line)."""
    by_reason: dict[str, list[str]] = {}
    for tid, reason in bad.items():
        by_reason.setdefault(reason, []).append(tid)
    out = []
    for reason, tids in by_reason.items():
        if len(tids) > 3:
            out.append(f"; {len(tids)} threads not seeded: {reason}")
        else:
            out += [f"; {'thread ' + t if t != '0' else 'all'} not seeded: {reason}" for t in tids]
    return "".join(out)


def _asdict(o: TraceOptions) -> dict[str, Any]:
    return {k: getattr(o, k) for k in o.__slots__}


# ------------------------------------------------------------------------------------------ run
class Writer(Protocol):
    """Where :func:`run` puts its output (ccprofd/export/jsonl.py's writers are ones)."""

    def sample(self, s: TraceSample) -> None: ...
    def samples(self, batch: list[TraceSample]) -> None: ...
    def record(self, r: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...


def lost_record(count: int, reason: str = "ringbuf_full") -> dict[str, Any]:
    """The output record of ``count`` drops of ``reason`` (api.DROPS) since the previous one, e.g.
    ``{"event": "lost", "samples": N, "reason": "ringbuf_full"}``."""
    event, unit, _ = DROPS.get(reason, ("lost", "samples", ""))
    return {"time_ns": time.time_ns(), "event": event, unit: count, "reason": reason}


class DropTally:
    """The mode's drop counters as last reported: :meth:`records` turns what grew into output
    records, :meth:`lines` says the totals at exit."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.seen: dict[str, int] = {}

    def records(self) -> list[dict[str, Any]]:
        out = []
        for reason, now in self.mode.drops().items():
            if now > self.seen.get(reason, 0):
                out.append(lost_record(now - self.seen.get(reason, 0), reason))
                self.seen[reason] = now
        return out

    def lines(self) -> list[str]:
        return [f"ccprofd: {n} {DROPS[r][2] if r in DROPS else r}" for r, n in self.seen.items() if n]


def not_followed(session: Session) -> int:
    """Processes the trace stopped following when they exec'd another program (the shared syscall
    sampler's ``execs_stopped``), or 0 when the mode does not say."""
    try:
        return int(session.summary().get("bpf", {}).get("sampler_execs_stopped", 0))
    except (BPFError, OSError, AttributeError):
        return 0


def run(session: Session, writer: Writer, *, launched: bool, duration: float | None = None) -> int:
    """Stream the session's samples to ``writer`` (flushed once per batch, with a ``lost`` record
    whenever the kernel side dropped samples since the previous batch); returns the exit status
    for the CLI.  What was lost or left unread is also said on stderr at the end.  ``duration``:
    stop after that many seconds as on SIGTERM (a launched command is sent SIGTERM, as `timeout`
    does; an attached process is detached and left running)."""
    import sys

    previous: dict[signal.Signals, Any] = {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if launched:
            session.hurry()
            if signum == signal.SIGTERM and session.child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(session.child, signal.SIGTERM)
            return  # Ctrl-C reaches the command through the terminal; we keep tracing it
        session.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    if duration is not None:
        previous[signal.SIGALRM] = signal.signal(signal.SIGALRM,
                                                 lambda _s, _f: on_signal(signal.SIGTERM, None))
        signal.setitimer(signal.ITIMER_REAL, max(duration, 0.001))
    drops = DropTally(session.mode)
    try:
        try:
            for r in drops.records():  # e.g. threads of -p PID left without state at attach
                writer.record(r)
            for batch in session.batches():
                writer.samples(batch)
                for r in drops.records():
                    writer.record(r)
                writer.flush()
            for r in drops.records():
                writer.record(r)
            writer.flush()
        except (BPFError, OSError) as exc:
            print(f"ccprofd: tracing failed: {exc}", file=sys.stderr)
            session.close()
            if launched:
                session.wait()
            return 125
        for line in drops.lines():
            print(line, file=sys.stderr)
        left = not_followed(session)
        if left:
            print(f"ccprofd: {left} traced process{'es' if left > 1 else ''} exec'd another program and "
                  f"{'were' if left > 1 else 'was'} not traced further (a trace follows one executable: "
                  "trace that program itself)", file=sys.stderr)
        if session.unread:
            print(f"ccprofd: stopped with {session.unread} recorded samples not yet decoded "
                  f"(drained for {STOP_DRAIN_S:g} s)", file=sys.stderr)
        status = session.wait()
        return status if launched else 0
    finally:
        if duration is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
