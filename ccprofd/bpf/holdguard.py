"""The hold guard: continues the processes BPF holds stopped when the process that should release
them (the daemon, ``ccprofd trace``) dies without doing so.

Unwind mode stops new target processes (SIGSTOP from BPF) until userspace has loaded their
mappings, and records each stop in a BPF hash (``uw_held``: tgid -> 1).  Links and programs are
owned by file descriptors, so a SIGKILLed daemon leaves nothing attached -- but a process it was
holding would stay stopped for ever: a production outage.  So each sampler that can hold starts
this guard, a separate small process that keeps its own descriptor of the ``uw_held`` map (the map
outlives the daemon) and the read end of a pipe whose write end only the daemon has.  When the pipe
reaches end of file (the daemon closed it, exited or was killed), the guard continues every held
process that is still stopped, sweeps again shortly after (programs may detach a moment after the
pipe closes), and exits.  It ignores SIGINT/SIGTERM/SIGHUP (a service manager signals the whole
group; the guard must outlive the daemon) and runs in its own session.

Residual risk, documented: the guard itself being SIGKILLed before the daemon (e.g. ``kill -9`` of
the whole control group) leaves a held process stopped; ``ccprofd`` logs the guard's pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
SWEEP_DELAYS_S = (0.0, 0.1, 0.5)


class _MapKeyAttr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("next_key", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


def held_tgids(map_fd: int) -> list[int]:
    """Keys (u32 tgids) of a BPF hash, read through raw ``bpf(2)`` (no bcc in the guard)."""
    from ccprofd.bpf.rawbpf import BPFSyscallError, bpf

    out: list[int] = []
    key = ctypes.c_uint32(0)
    nxt = ctypes.c_uint32(0)
    first = True
    for _ in range(1 << 20):
        attr = _MapKeyAttr(map_fd=map_fd, key=0 if first else ctypes.addressof(key),
                           next_key=ctypes.addressof(nxt))
        try:
            bpf(BPF_MAP_GET_NEXT_KEY, attr, "listing held processes")
        except BPFSyscallError:
            break  # ENOENT: no more keys
        out.append(int(nxt.value))
        key.value = nxt.value
        first = False
    return out


def _delete(map_fd: int, tgid: int) -> None:
    from ccprofd.bpf.rawbpf import BPFSyscallError, bpf

    key = ctypes.c_uint32(tgid)
    with contextlib.suppress(BPFSyscallError):
        bpf(BPF_MAP_DELETE_ELEM, _MapKeyAttr(map_fd=map_fd, key=ctypes.addressof(key)), "releasing")


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rpartition(b")")[2].split()[0] == b"T"
    except (OSError, IndexError):
        return False


def sweep(map_fd: int) -> list[int]:
    """Continue every held process that is stopped; returns those continued."""
    released = []
    for tgid in held_tgids(map_fd):
        if _stopped(tgid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(tgid, signal.SIGCONT)
                released.append(tgid)
        _delete(map_fd, tgid)
    return released


class HoldGuard:
    """Starts the guard for a ``uw_held`` map; :meth:`close` makes it sweep and exit."""

    def __init__(self, held_map_fd: int) -> None:
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ccprofd.bpf.holdguard", str(held_map_fd), str(r)],
                pass_fds=(held_map_fd, r), stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(r)
        self._w = w
        os.set_inheritable(w, False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self, timeout: float = 5.0) -> None:
        if self._w >= 0:
            os.close(self._w)
            self._w = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)


def main(argv: list[str]) -> int:
    map_fd, pipe_fd = int(argv[0]), int(argv[1])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            if not os.read(pipe_fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    for delay in SWEEP_DELAYS_S:
        time.sleep(delay)
        released = sweep(map_fd)
        if released:
            print(f"ccprofd hold guard: continued held process(es) {released}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
