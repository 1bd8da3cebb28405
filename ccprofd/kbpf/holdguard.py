"""The hold guard: continues the processes BPF holds stopped when the process that should release
them (the daemon, ``ccprofd trace``) dies without doing so.

Unwind mode stops new target processes (SIGSTOP from BPF) until userspace has loaded their
mappings, and records each stop in a BPF hash (``uw_held``: tgid -> 1).  Links and programs are
owned by file descriptors, so a SIGKILLed daemon leaves nothing attached -- but a process it was
holding would stay stopped for ever: a production outage.  So each sampler that can hold starts
this guard, a separate small process that keeps its own descriptor of the ``uw_held`` map (the map
outlives the daemon) and the read end of a pipe whose write end only the daemon has.  When the pipe
reaches end of file (the daemon closed it after a clean end, exited or was killed), the guard
continues every held process, and keeps sweeping until the daemon is gone (or
ended cleanly) and no new hold has appeared for a while: the kernel detaches a dead process's
programs a little after its descriptors close (link release is deferred), and until then a continued
process can be held again at its next executable mapping.  It ignores SIGINT/SIGTERM/SIGHUP (a
service manager signals the whole group; the guard must outlive the daemon) and runs in its own
session.

Residual risk: the guard itself being SIGKILLed before the daemon dies (``kill -9`` of the whole
control group, the OOM killer choosing it) leaves a process held at that moment stopped; ``kill
-CONT`` continues it.  Also a process a user stopped on purpose while it was held is continued.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import struct
import subprocess
import sys
import time

from ccprofd.kbpf.abi import BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY, MapElemAttr

SWEEP_INTERVAL_S = 0.05
_GUARDS: set[int] = set()  # pids of the guards this process started


def is_guard(pid: int) -> bool:
    """Whether ``pid`` is a hold guard of this process: never a traced process, even when the
    target is the interpreter the guard runs on (its exec may match an exec target)."""
    return pid in _GUARDS
QUIET_S = 2.0  # after the daemon is gone: exit once no hold has been seen for this long


def held_tgids(map_fd: int) -> list[int]:
    """Keys (u32 tgids) of a BPF hash, read through raw ``bpf(2)`` (no bcc in the guard)."""
    from ccprofd.kbpf.rawbpf import BPFSyscallError, bpf

    out: list[int] = []
    key = ctypes.c_uint32(0)
    nxt = ctypes.c_uint32(0)
    first = True
    for _ in range(1 << 20):
        attr = MapElemAttr(map_fd=map_fd, key=0 if first else ctypes.addressof(key),
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
    from ccprofd.kbpf.rawbpf import BPFSyscallError, bpf

    key = ctypes.c_uint32(tgid)
    with contextlib.suppress(BPFSyscallError):
        bpf(BPF_MAP_DELETE_ELEM, MapElemAttr(map_fd=map_fd, key=ctypes.addressof(key)), "releasing")


#: The hold map's name in the kernel (unwind.c's BPF_HASH): how another instance's holds are found.
HELD_MAP_NAME = b"uw_held"


def held_elsewhere(tgid: int, own_map_fd: int) -> bool:
    """Whether another ccprofd instance still holds ``tgid``: a ``uw_held`` map other than ours
    (the daemon following a binary and ``ccprofd trace`` of it both stop its new processes at exec
    and at each executable mapping, each until its own mappings are loaded) has its entry.  A
    SIGCONT is not counted: the first holder to continue the process would release the other's
    hold too, whose samples then run ahead of its mappings."""
    from ccprofd.kbpf.rawbpf import BPFSyscallError, map_fd_by_id, map_has_key, map_ids, map_info, obj_id

    try:
        own = obj_id(own_map_fd)
    except BPFSyscallError:
        own = -1
    key = struct.pack("<I", tgid)
    for map_id in map_ids():
        if map_id == own:
            continue
        try:
            fd = map_fd_by_id(map_id)
        except BPFSyscallError:
            continue  # gone meanwhile
        try:
            info = map_info(fd)
            if info.name == HELD_MAP_NAME and info.key_size == 4 and map_has_key(fd, key, info.value_size):
                return True
        except BPFSyscallError:
            pass
        finally:
            os.close(fd)
    return False


def release(map_fd: int, tgid: int) -> bool:
    """Drop our hold of ``tgid`` and continue it unless another instance still holds it; returns
    whether it was continued.  The entry goes first: once continued, the process may be held again
    at once (its next executable mapping) and that new entry must survive; and of several holders
    releasing at once, the last to drop its entry finds no other and continues the process."""
    _delete(map_fd, tgid)
    if held_elsewhere(tgid, map_fd):
        return False
    try:
        os.kill(tgid, signal.SIGCONT)
    except ProcessLookupError:
        return False
    return True


def sweep(map_fd: int) -> list[int]:
    """Continue every held process (unless another instance holds it too); returns those continued.
    Not only those already stopped: the SIGSTOP of a hold may still be pending (the process finishes
    its syscall first), and a SIGCONT sent now discards it -- an entry dropped without one would
    leave that process stopped."""
    return [tgid for tgid in held_tgids(map_fd) if release(map_fd, tgid)]


class HoldGuard:
    """Starts the guard for a ``uw_held`` map; :meth:`close` makes it sweep and exit."""

    def __init__(self, held_map_fd: int) -> None:
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ccprofd.kbpf.holdguard", str(held_map_fd), str(r), str(os.getpid())],
                pass_fds=(held_map_fd, r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=None if _stderr_is_journal() else subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(r)
        self._w = w
        os.set_inheritable(w, False)
        _GUARDS.add(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        """A clean end (every program of ours is detached): the guard sweeps until no hold has
        appeared for a while (detaching completes asynchronously), then exits on its own."""
        if self._w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._w, b"c")
            os.close(self._w)
            self._w = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(0)  # reap it if it is done already; otherwise it finishes alone


def main(argv: list[str]) -> int:
    map_fd, pipe_fd, daemon = int(argv[0]), int(argv[1]), int(argv[2])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    clean = False
    while True:
        try:
            data = os.read(pipe_fd, 4096)
        except InterruptedError:
            continue
        except OSError:
            break
        if not data:
            break
        clean = clean or b"c" in data
    quiet_since = time.monotonic()
    while True:
        released = sweep(map_fd)
        if released:
            quiet_since = time.monotonic()
            print(f"ccprofd hold guard: continued held process(es) {released}", file=sys.stderr)
        if clean or not _alive(daemon):
            if time.monotonic() - quiet_since >= QUIET_S:
                return 0
        else:
            quiet_since = time.monotonic()
        time.sleep(SWEEP_INTERVAL_S)


def _stderr_is_journal() -> bool:
    """Whether our stderr is systemd's journal stream (the daemon under systemd): then the guard may
    write its one line there.  Any other stderr (a terminal, a caller's pipe as in
    ``out=$(ccprofd trace ... 2>&1)``) is not inherited: the guard outlives us by a few seconds and
    would keep a caller reading our output waiting for EOF."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return bool(stream) and stream == f"{st.st_dev}:{st.st_ino}"


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has released its descriptors: not alive here)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
