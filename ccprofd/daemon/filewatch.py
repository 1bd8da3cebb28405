"""Exec gate: the daemon sees every exec of a watched file *before* the new image is mapped.

Why: probes and unwind tables are planned for a file's bytes, but uprobes are attached to its inode.
A file rewritten in place (``cp new old``: same inode, other bytes) keeps the old probes, and the
kernel plants them at the old build's offsets in every process that maps the new bytes (they died
with SIGSEGV); unwind mode decoded them with the old build's functions (``frames: []``,
``complete: true``).  A writer cannot rewrite a file while it runs (ETXTBSY), so the moment that
matters is the next exec.

fanotify's ``FAN_OPEN_EXEC_PERM`` on the file's inode makes each exec wait for this process's
answer, before the image is mapped and so before any uprobe is planted in it.  The gate's thread
calls ``check(identity, pid)`` for each such exec and answers "allow" when it returns (the
caller re-plans first when the identity is not the one it planned for); ``FAN_CLOSE_WRITE`` calls
``changed(identity)`` so a rewrite is re-planned before any exec at all.  Every exec is allowed:
on a timeout or an error too (a missed or flagged sample is better than a failed exec), and the
kernel allows pending execs itself when the group is closed (the daemon stops or dies).

The cost: while the daemon is frozen (SIGSTOP, a debugger) the gated file's execs wait.  Only
instrumented-mode targets are gated (a stale plan there plants breakpoints mid-instruction); unwind
mode holds each new process at exec until the daemon has loaded its mappings anyway, and the daemon
compares the file's identity before each poll that may release such holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger("ccprofd")

FAN_CLOEXEC = 0x01
FAN_CLASS_CONTENT = 0x04
FAN_MARK_ADD = 0x01
FAN_CLOSE_WRITE = 0x08
FAN_OPEN_EXEC_PERM = 0x00040000
FAN_ALLOW = 0x01
FAN_NOFD = -1
AT_FDCWD = -100
_META = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
_RESPONSE = struct.Struct("=iI")  # struct fanotify_response


class FileIdentity(NamedTuple):
    """What says a file's bytes are the ones read: (dev, inode) and what any write changes."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @property
    def inode(self) -> tuple[int, int]:
        return (self.dev, self.ino)


def identity_of(st: os.stat_result) -> FileIdentity:
    return FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_identity(path: str) -> FileIdentity | None:
    try:
        return identity_of(os.stat(path))
    except OSError:
        return None


def _ours(pid: int) -> bool:
    """Whether ``pid`` is this process or one of its children (e.g. the BPF compile worker, which
    a re-plan may start while the gate waits for that re-plan)."""
    me = os.getpid()
    if pid == me:
        return True
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("PPid:"):
                    return int(line.split()[1]) == me
    except (OSError, ValueError):
        pass
    return False


class ExecGate:
    """One fanotify group and the thread that answers it (see the module docstring)."""

    def __init__(self, check: Callable[[FileIdentity, int], None],
                 changed: Callable[[FileIdentity], None]) -> None:
        self.check = check
        self.changed = changed
        self._fd = -1
        self._stop_r, self._stop_w = -1, -1
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self) -> None:
        """Raises OSError where fanotify permission events are not available (no CAP_SYS_ADMIN,
        a kernel without CONFIG_FANOTIFY_ACCESS_PERMISSIONS)."""
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
        libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                                       ctypes.c_char_p]
        self._mark_fn = libc.fanotify_mark
        fd = libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC, os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_init: {os.strerror(err)}")
        self._fd = fd
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="ccprofd-exec-gate", daemon=True)
        self._thread.start()

    def watch(self, path: str, gate_execs: bool = True) -> None:
        """Watch the file at ``path`` (its inode: a later rename does not move the mark) for rewrites
        and, with ``gate_execs``, hold its execs (see the module docstring)."""
        if self._fd < 0:
            return
        mask = FAN_CLOSE_WRITE | (FAN_OPEN_EXEC_PERM if gate_execs else 0)
        if self._mark_fn(self._fd, FAN_MARK_ADD, mask, AT_FDCWD, os.fsencode(path)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_mark {path}: {os.strerror(err)}")

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            try:
                buf = os.read(self._fd, 4096)
            except OSError:
                return
            off = 0
            while off + _META.size <= len(buf):
                length, _vers, _res, _mlen, mask, fd, pid = _META.unpack_from(buf, off)
                off += max(length, _META.size)
                self._answer(mask, fd, pid)

    def _answer(self, mask: int, fd: int, pid: int) -> None:
        try:
            if fd != FAN_NOFD:
                ident = identity_of(os.fstat(fd))
                if mask & FAN_OPEN_EXEC_PERM:
                    if not _ours(pid):  # the daemon's own helpers must not wait on the daemon
                        self.check(ident, pid)
                elif mask & FAN_CLOSE_WRITE:
                    self.changed(ident)
        except Exception as exc:  # never leave an exec waiting on a bug here
            self.errors += 1
            log.error("exec gate: %s", exc)
        finally:
            if fd != FAN_NOFD:
                if mask & FAN_OPEN_EXEC_PERM:
                    with contextlib.suppress(OSError):
                        os.write(self._fd, _RESPONSE.pack(fd, FAN_ALLOW))
                os.close(fd)

    def close(self) -> None:
        """Stop answering; the kernel allows whatever still waits when the group's fd closes."""
        if self._stop_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._stop_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for fd in (self._fd, self._stop_r, self._stop_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._stop_r = self._stop_w = -1
        self._thread = None
