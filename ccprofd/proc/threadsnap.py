"""A snapshot of every thread of a running process: registers and unwound stack, taken with ptrace.

Why ptrace: a thread blocked in ``read`` or ``nanosleep`` makes no syscall and hits no probe, so no
BPF program sees its stack; ``PTRACE_SEIZE`` + ``PTRACE_INTERRUPT`` stops it for the time of one
``PTRACE_GETREGS`` and a walk of its stack (read through ``/proc/PID/mem``), then ``PTRACE_DETACH``
lets it go on.  Unlike ``PTRACE_ATTACH`` this sends no ``SIGSTOP``: the process sees no signal, and a
syscall the stop interrupted is restarted by the kernel (``-ERESTARTSYS`` -> re-executed,
``-ERESTART_RESTARTBLOCK`` -> ``restart_syscall``), so the program observes neither ``EINTR`` nor a
shorter sleep (tests/test_threadsnap.py checks both).  A signal that arrives during the stop is
handed back at detach.  Every thread is stopped before any is read, so the snapshot is one moment
of the process; unwind tables are loaded *before* the stop, so the stop lasts only the walks.

ptrace calls are made by the calling OS thread from seize to detach (the kernel ties a tracee to the
tracing thread); :func:`snapshot` does the whole cycle in one call.  Errors are values: a process
that is gone, ptrace refused (no ``CAP_SYS_PTRACE``, Yama, already traced by a debugger or strace --
the tracer's pid is named) give :attr:`ProcessSnapshot.error`; a thread that exits meanwhile is
left out.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ccprofd.elf import cfi
from ccprofd.proc.maps import DEFAULT_PROC_ROOT, ProcessMaps, module_mappings, start_stack
from ccprofd.proc.modules import ModuleCache
from ccprofd.proc.tasks import threads_of
from ccprofd.proc.userstack import StackMemory, UnwoundStack, UserRegs, unwind

PTRACE_GETREGS = 12
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_EVENT_STOP = 128
WALL = 0x40000000  # __WALL: wait for threads (clone children) too


class _UserRegs(ctypes.Structure):
    """x86-64 ``struct user_regs_struct`` (sys/user.h)."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi",
        "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs",
        "gs")]


_libc: ctypes.CDLL | None = None


def _ptrace(request: int, tid: int, addr: int = 0, data: int = 0) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.ptrace.restype = ctypes.c_long
        _libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if _libc.ptrace(request, tid, ctypes.c_void_p(addr), ctypes.c_void_p(data)) == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclass(frozen=True, slots=True)
class ThreadSnapshot:
    """One thread at the moment of the stop (``stack`` None when it could not be read: ``error``)."""

    tid: int
    comm: str
    regs: UserRegs | None
    stack: UnwoundStack | None
    error: str | None = None


@dataclass(slots=True)
class ProcessSnapshot:
    """Every thread of one process; ``error`` (one line) when the process could not be stopped."""

    pid: int
    threads: list[ThreadSnapshot] = field(default_factory=list)
    maps: ProcessMaps | None = None
    error: str | None = None
    stopped_ns: int = 0  # how long the process was held: first PTRACE_SEIZE to last PTRACE_DETACH


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def tracer_of(pid: int, proc_root: str = DEFAULT_PROC_ROOT) -> int:
    """The pid already ptracing ``pid`` (``TracerPid`` of /proc/PID/status), 0 when none."""
    for line in _read_text(os.path.join(proc_root, str(pid), "status")).splitlines():
        if line.startswith("TracerPid:"):
            with contextlib.suppress(ValueError):
                return int(line.split()[1])
    return 0


def _refused(pid: int, exc: OSError, proc_root: str) -> str:
    tracer = tracer_of(pid, proc_root)
    if tracer == os.getpid():
        return f"ptrace refused: pid {pid} is held by this process already (another snapshot, or the " \
               f"attach-time seeding of its threads); try again"
    if tracer:
        comm = _read_text(os.path.join(proc_root, str(tracer), "comm")).strip() or "?"
        return f"ptrace refused: pid {pid} is already traced by pid {tracer} ({comm})"
    return f"ptrace refused for pid {pid}: {exc.strerror} (needs CAP_SYS_PTRACE and a Yama ptrace_scope " \
           f"that allows it)"


def snapshot(pid: int, modules: ModuleCache, *, proc_root: str = DEFAULT_PROC_ROOT,
             max_depth: int = 4096,
             while_stopped: Callable[[ThreadSnapshot, Callable[[int], int | None]], None] | None = None
             ) -> ProcessSnapshot:
    """Stop every thread of ``pid``, unwind each, let them go (see the module docstring).

    ``while_stopped(thread, read_word)`` runs for each unwound thread before any is let go (seeding
    instrumented mode's state from the stack must happen while the stack is that one)."""
    out = ProcessSnapshot(pid)
    tids = threads_of(pid, proc_root)
    if not tids:
        out.error = f"no process {pid}"
        return out
    try:
        maps = modules.with_vdso(module_mappings(pid, modules.addrspace_of, proc_root), proc_root)
    except OSError as exc:
        out.error = f"cannot read the mappings of pid {pid}: {exc.strerror or exc}"
        return out
    out.maps = maps
    tables: dict[int, cfi.UnwindTable | None] = {m.start: modules.table_of(m) for m in maps.mappings}
    stack_top = start_stack(pid, proc_root)
    try:
        mem = os.open(os.path.join(proc_root, str(pid), "mem"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            out.error = _refused(pid, exc, proc_root)
        else:
            out.error = f"cannot open the memory of pid {pid}: {exc.strerror or exc}"
        return out
    seized: list[int] = []
    pending: dict[int, int] = {}  # tid -> signal to hand back at detach
    t0 = time.monotonic_ns()
    try:
        for tid in tids:
            try:
                _ptrace(PTRACE_SEIZE, tid)
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    continue  # the thread exited since it was listed
                out.error = _refused(pid, exc, proc_root)
                return out
            seized.append(tid)
            with contextlib.suppress(OSError):
                _ptrace(PTRACE_INTERRUPT, tid)
        stopped: list[int] = []
        for tid in seized:
            sig = _wait_stop(tid)
            if sig is None:
                continue  # exited
            pending[tid] = sig
            stopped.append(tid)

        def read(addr: int, n: int) -> bytes | None:
            try:
                return os.pread(mem, n, addr)
            except (OSError, OverflowError, ValueError):
                return None

        memory = StackMemory(read)
        for tid in stopped:
            comm = _read_text(os.path.join(proc_root, str(pid), "task", str(tid), "comm")).strip()
            raw = _UserRegs()
            try:
                _ptrace(PTRACE_GETREGS, tid, 0, ctypes.addressof(raw))
            except OSError as exc:
                out.threads.append(ThreadSnapshot(tid, comm, None, None, f"PTRACE_GETREGS: {exc.strerror}"))
                continue
            regs = UserRegs(raw.rip, raw.rsp, raw.rbp, raw.fs_base, raw.rax)
            stack = unwind(regs, memory.word, maps, lambda m: tables.get(m.start),
                           start_stack=stack_top if tid == pid else 0, max_depth=max_depth)
            out.threads.append(ThreadSnapshot(tid, comm, regs, stack))
            if while_stopped is not None:
                while_stopped(out.threads[-1], memory.word)
    finally:
        for tid in seized:
            if tid not in pending:
                # seized but never waited for (a later thread was refused, or an error): PTRACE_DETACH
                # works only on a stopped tracee, and one left seized would hang at its next signal
                with contextlib.suppress(OSError):
                    _ptrace(PTRACE_INTERRUPT, tid)
                sig = _wait_stop(tid)
                if sig is None:
                    continue  # exited
                pending[tid] = sig
            with contextlib.suppress(OSError):  # gone meanwhile: nothing to detach
                _ptrace(PTRACE_DETACH, tid, 0, pending.get(tid, 0))
        if seized:
            out.stopped_ns = time.monotonic_ns() - t0
        os.close(mem)
    return out


def _wait_stop(tid: int) -> int | None:
    """Wait for the seized thread's stop; the signal to re-inject at detach (0 for the interrupt's
    own stop), or None when the thread exited instead."""
    while True:
        try:
            _, status = os.waitpid(tid, WALL)
        except ChildProcessError:
            return None
        except InterruptedError:
            continue
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            return None
        if not os.WIFSTOPPED(status):
            continue
        event = status >> 16
        sig = os.WSTOPSIG(status)
        if event == PTRACE_EVENT_STOP:
            return 0  # the interrupt (or a group-stop, which resumes as it was at detach)
        if event == 0 and sig != signal.SIGTRAP:
            return sig  # signal-delivery-stop: the signal was dequeued, deliver it at detach
        return 0


