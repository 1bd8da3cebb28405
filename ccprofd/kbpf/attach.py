"""Attaching loaded BPF programs with raw syscalls: raw tracepoints (BPF_RAW_TRACEPOINT_OPEN),
and perf events — tracepoints (PERF_TYPE_TRACEPOINT, id from tracefs), software sampling events,
classic uprobes (the ``uprobe`` PMU) — with PERF_EVENT_IOC_SET_BPF + ENABLE.

Every attachment is owned by the fd returned here: closing it detaches, so nothing stays attached
after the owning process dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
from collections.abc import Sequence

from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.abi import (
    BPF_RAW_TRACEPOINT_OPEN,
    PERF_ATTR_DISABLED,
    PERF_ATTR_FREQ,
    PerfEventAttr,
    RawTracepointAttr,
)
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.tracefs import tracepoint_id

SYS_PERF_EVENT_OPEN = 298
PERF_TYPE_SOFTWARE = 1
PERF_TYPE_TRACEPOINT = 2
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408
PERF_FLAG_FD_CLOEXEC = 1 << 3

_libc = ctypes.CDLL(None, use_errno=True)


def attach_raw_tracepoint_fd(prog_fd: int, name: str) -> int:
    """BPF_RAW_TRACEPOINT_OPEN; returns the link fd (closing it detaches)."""
    buf = ctypes.create_string_buffer(name.encode())
    attr = RawTracepointAttr()
    attr.name = ctypes.addressof(buf)
    attr.prog_fd = prog_fd
    return rawbpf.bpf(BPF_RAW_TRACEPOINT_OPEN, attr, f"attaching raw tracepoint {name}")


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int, what: str) -> int:
    """perf_event_open(2) with FD_CLOEXEC; returns the fd or raises a one-line BPFError."""
    attr.size = ctypes.sizeof(PerfEventAttr)
    fd = _libc.syscall(SYS_PERF_EVENT_OPEN, ctypes.byref(attr), pid, cpu, -1, PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise BPFError(f"perf_event_open({what}) failed: {os.strerror(err)}")
    return int(fd)


def perf_event_open_cpu_clock(cpu: int, hz: int) -> int:
    """A disabled software CPU-clock sampling event on one CPU (all tasks), ``hz`` samples/s."""
    attr = PerfEventAttr(type=PERF_TYPE_SOFTWARE, config=PERF_COUNT_SW_CPU_CLOCK, sample_freq=hz,
                         flags=PERF_ATTR_DISABLED | PERF_ATTR_FREQ)
    return perf_event_open(attr, -1, cpu, f"cpu-clock, cpu {cpu}")


def perf_event_set_bpf(perf_fd: int, prog_fd: int, what: str = "the CPU sampler") -> None:
    """Attach a loaded program to a perf event and enable it."""
    try:
        fcntl.ioctl(perf_fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(perf_fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError as exc:
        raise BPFError(f"attaching {what} to a perf event failed: {exc.strerror}") from None


def online_cpus() -> list[int]:
    try:
        with open("/sys/devices/system/cpu/online", encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return list(range(os.cpu_count() or 1))
    cpus: list[int] = []
    for part in text.split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def attach_tracepoint_fd(prog_fd: int, tp: str) -> int:
    """A tracepoint program on ``category:event``; returns the perf event fd that owns it.

    The kernel records a tracepoint's event for its perf listeners (``perf record``/``stat``/
    ``trace`` -e that event, on any process) only when every BPF program attached to it returns
    non-zero; ccprofd's tracepoint programs return 1, so attaching them hides nothing from perf
    (returning 0, as they did, counted nothing of that event for perf while ccprofd ran).  The
    perf event that owns the program stays disabled: the program runs all the same (it hangs on
    the tracepoint, not on the event), and an event passed on then costs nothing more unless
    another perf listener is there (an enabled event of ours would be one, on every hit)."""
    attr = PerfEventAttr(type=PERF_TYPE_TRACEPOINT, config=tracepoint_id(tp), flags=PERF_ATTR_DISABLED)
    fd = perf_event_open(attr, -1, 0, f"tracepoint {tp}")
    try:
        perf_event_set_bpf(fd, prog_fd, f"a program to tracepoint {tp}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_sysfs(path: str) -> str:
    with open(path, encoding="ascii") as fh:
        return fh.read().strip()


def uprobe_pmu() -> tuple[int, int]:
    """(perf type of the ``uprobe`` PMU, config bit that makes a uretprobe)."""
    base = "/sys/bus/event_source/devices/uprobe"
    try:
        ptype = int(_read_sysfs(f"{base}/type"))
        fmt = _read_sysfs(f"{base}/format/retprobe")  # "config:0"
        bit = int(fmt.split(":", 1)[1].split("-")[0])
    except (OSError, ValueError, IndexError) as exc:
        raise BPFError(f"the kernel has no usable uprobe PMU ({base}): {exc}") from None
    return ptype, bit


def attach_uprobe_fd(prog_fd: int, path: str, offset: int, *, pid: int = -1, retprobe: bool = False) -> int:
    """A classic uprobe (or uretprobe) at file offset ``offset`` of ``path``, for process ``pid``
    (-1: every process); returns the perf event fd that owns it."""
    ptype, retbit = uprobe_pmu()
    cpath = ctypes.create_string_buffer(os.fsencode(path))
    attr = PerfEventAttr(type=ptype, config=(1 << retbit) if retprobe else 0, sample_freq=1, wakeup_events=1,
                         config1=ctypes.addressof(cpath), config2=offset)
    what = f"{'uretprobe' if retprobe else 'uprobe'} {path}+{offset:#x}"
    fd = perf_event_open(attr, pid if pid >= 0 else -1, 0 if pid < 0 else -1, what)
    try:
        perf_event_set_bpf(fd, prog_fd, f"a program to {what}")
    except BaseException:
        os.close(fd)
        raise
    return fd




__all__ = ["attach_raw_tracepoint_fd", "attach_tracepoint_fd", "attach_uprobe_fd", "online_cpus",
           "perf_event_open", "perf_event_open_cpu_clock", "perf_event_set_bpf",
           "uprobe_pmu"]


# ------------------------------------------------------------------------- detaching at exit
def close_in_background(fds: Sequence[int]) -> None:
    """Close ``fds`` here at once and leave their *last* reference to a short-lived grandchild
    that closes them and exits.

    Closing a tracepoint perf event whose program is the last on it waits for RCU grace periods
    (~30-90 ms each here, ~0.35 s for a trace's six sched tracepoints); a command that is about to
    exit need not wait for that.  Only for attachments whose programs do nothing once the caller
    has emptied their maps (the kernel detaches when the grandchild's copy is closed).  The
    grandchild first closes every other descriptor, so it keeps no pipe (a reader of our stdout
    sees EOF when we exit) and no last reference to anything else.  If fork fails the fds are
    closed here."""
    fds = [fd for fd in fds if fd >= 0]
    if not fds:
        return
    try:
        ready_r, ready_w = os.pipe()  # EOF once this process and the child have closed their copies
    except OSError:
        ready_r = ready_w = -1
    pid = -1
    if ready_r >= 0:
        try:
            pid = os.fork()
        except OSError:
            pid = -1
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            if os.fork() == 0:  # the grandchild: reparented to init (or a subreaper) when we exit
                os.setsid()
                keep = {*fds, ready_r}
                for fd in _open_fds():
                    if fd not in keep:
                        with contextlib.suppress(OSError):
                            os.close(fd)
                # Wait until every other copy is closed, so this one is the last (closing a copy
                # that is not the last is quick): otherwise the child or our caller could be
                # left holding the last one, and wait for the grace periods after all.
                with contextlib.suppress(OSError):
                    while os.read(ready_r, 1):
                        pass
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            else:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        finally:
            os._exit(0)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)  # a duplicate when the fork worked: returns at once
    for fd in (ready_r, ready_w):
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)  # the write end last: it releases the grandchild
    if pid > 0:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _open_fds() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 1024))
