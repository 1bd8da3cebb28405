"""BPF baselines and measurement plumbing for the evaluation report.

* :func:`launch` starts a command gated before its exec (so probes and tracking are in place from its
  first instruction), the same way for every variant, so wall times are comparable.
* :class:`Baselines`: one small BPF program set, tracking the launched process and its forks:
  ``bl_call`` on every direct call / tail-jump site of a binary (a per-site hit counter: the number
  of function calls, the edge weights for hot-edge zero coding, and the cost of "probing every call
  site"), ``bl_sys_count`` (syscalls of the tracked processes) and ``bl_sys_stack``
  (``bpf_get_stack(BPF_F_USER_STACK)`` at every syscall, each stack sent to userspace through a ring
  buffer and drained: the frame-pointer baseline).
* :func:`owned_prog_stats` reads ``run_time_ns``/``run_cnt`` (``kernel.bpf_stats_enabled``) of the
  programs *this* process holds (their ids from ``/proc/self/fdinfo``), so programs of other users of
  the machine with the same name are never mixed in.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccprofd.callgraph.model import CallGraph
from ccprofd.elf.image import ElfImage
from ccprofd.kbpf.rawmodule import load_module
from ccprofd.kbpf.uprobe_multi import UprobeMultiLink, attach_uprobe_multi

BASELINE_C = r"""
#include <asm/ptrace.h>
#define MAXF 127
struct bl_stack { u64 ips[MAXF]; };
BPF_HASH(bl_tracked, u32, u8, 4096);
BPF_PERCPU_ARRAY(bl_site_hits, u64, NSITES);
BPF_PERCPU_ARRAY(bl_counts, u64, 4);          // 0 syscalls, 1 stacks taken, 2 frames, 3 ringbuf full
BPF_PERCPU_ARRAY(bl_scratch, struct bl_stack, 1);
BPF_RINGBUF_OUTPUT(bl_stacks, 256);

static __always_inline int bl_is_tracked(void) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return bl_tracked.lookup(&tgid) != 0;
}
static __always_inline void bl_add(u32 idx, u64 n) {
    u64 *v = bl_counts.lookup(&idx);
    if (v)
        *v += n;
}
int bl_call(struct pt_regs *ctx) {
    if (!bl_is_tracked())
        return 0;
    u32 i = (u32)bpf_get_attach_cookie(ctx);
    u64 *v = bl_site_hits.lookup(&i);
    if (v)
        (*v)++;
    return 0;
}
int bl_sys_count(struct bpf_raw_tracepoint_args *ctx) {
    if (bl_is_tracked())
        bl_add(0, 1);
    return 0;
}
int bl_sys_stack(struct bpf_raw_tracepoint_args *ctx) {
    if (!bl_is_tracked())
        return 0;
    u32 z = 0;
    struct bl_stack *b = bl_scratch.lookup(&z);
    if (!b)
        return 0;
    long n = bpf_get_stack(ctx, b->ips, sizeof(b->ips), BPF_F_USER_STACK);
    bl_add(1, 1);
    if (n > 0)
        bl_add(2, n / 8);
    if (bl_stacks.ringbuf_output(b, sizeof(*b), 0) != 0)
        bl_add(3, 1);
    return 0;
}
int bl_fork(struct tracepoint__sched__sched_process_fork *args) {
    if (!bl_is_tracked())
        return 0;
    u32 child = (u32)args->child_pid;
    u8 one = 1;
    bl_tracked.update(&child, &one);
    return 0;
}
"""


@dataclass(frozen=True, slots=True)
class Launched:
    """A child forked and waiting to exec ``argv``; :meth:`release` lets it run."""

    pid: int
    gate: int

    def release(self) -> float:
        """Let the child exec; returns the release time (perf_counter)."""
        t = time.perf_counter()
        os.write(self.gate, b"x")
        os.close(self.gate)
        return t

    def abort(self) -> None:
        os.close(self.gate)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


ADDR_NO_RANDOMIZE = 0x0040000  # personality(2) flag: what setarch -R sets
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork


def no_aslr() -> None:
    """Turn address-space randomisation off for this process and what it execs (as ``setarch -R``).
    Every workload run -- untraced, traced and under strace -- is a separate execution, and the
    fidelity comparison matches them syscall by syscall: a program whose path depends on where its
    memory lies makes different syscalls in each.  python3.11 is one: obmalloc's arenas come from
    mmap at 4 KiB alignment and use only whole 16 KiB pools, so how many allocations an arena
    serves, and which allocation makes the next arena's mmap, depends on the address mmap returned
    (python-json's syscall #288 came from PyBytes_FromStringAndSize in some runs and from a unicode
    allocation in others, under strace and under ccprofd alike)."""
    cur = _LIBC.personality(0xFFFFFFFF)
    if cur != -1:
        _LIBC.personality(cur | ADDR_NO_RANDOMIZE)


def launch(
    argv: Sequence[str],
    *,
    stdin: str | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> Launched:
    """Fork a child that execs ``argv`` (stdout/stderr to /dev/null, stdin from ``stdin`` or
    /dev/null, no address-space randomisation: :func:`no_aslr`) once released; EOF on the gate
    makes it exit 125 without running anything."""
    path = argv[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(w)
            go = os.read(r, 1)
            os.close(r)
            if go != b"x":
                os._exit(125)
            fd_in = os.open(stdin or os.devnull, os.O_RDONLY)
            fd_out = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd_in, 0)
            os.dup2(fd_out, 1)
            os.dup2(fd_out, 2)
            if cwd:
                os.chdir(cwd)
            no_aslr()
            if env is not None:
                os.execve(path, list(argv), env)
            os.execv(path, list(argv))
        finally:
            os._exit(127)
    os.close(r)
    return Launched(pid, w)


@dataclass(frozen=True, slots=True)
class Exit:
    """How a child ended: perf_counter time it was reaped, exit code, CPU seconds (user + sys, from
    wait4's rusage: includes uprobe traps and BPF programs run in its context)."""

    at: float
    code: int
    cpu: float


def wait_exit(pid: int) -> Exit:
    """Reap ``pid`` (blocking)."""
    _, status, usage = os.wait4(pid, 0)
    return Exit(time.perf_counter(), os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime)


class Reaper:
    """Reaps a child in a thread the moment it exits (a pidfd becomes readable), so the main thread
    can keep draining BPF buffers; ``/proc/PID`` disappears once reaped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exit: Exit | None = None
        self._fd = os.pidfd_open(pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        p.poll()
        self.exit = wait_exit(self.pid)

    @property
    def done(self) -> bool:
        return self.exit is not None

    def wait(self, timeout: float = 1800.0) -> Exit:
        self._thread.join(timeout)
        os.close(self._fd)
        if self.exit is None:
            raise TimeoutError(f"process {self.pid} did not exit")
        return self.exit


@dataclass(frozen=True, slots=True)
class Timing:
    seconds: float  # wall: release to exit
    cpu: float  # user + sys of the target and its reaped children


def run_untraced(
    argv: Sequence[str], *, stdin: str | None = None, env: dict[str, str] | None = None, check: bool = True
) -> Timing:
    """One untraced run through the same launcher as every traced variant."""
    child = launch(argv, stdin=stdin, env=env)
    t0 = child.release()
    ex = wait_exit(child.pid)
    if check and ex.code != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {ex.code}")
    return Timing(ex.at - t0, ex.cpu)


def call_sites(graph: CallGraph) -> list[tuple[int, int, int]]:
    """(caller, callee, site vaddr) of every direct call and tail jump of the binary's own code (the
    instructions "probing every call site" probes; indirect calls have no static callee and are not
    counted)."""
    out = []
    for s in graph.sites:
        if s.target is not None and s.kind in ("direct", "plt", "tail"):
            out.append((s.function, s.target, s.address))
    return sorted(set(out), key=lambda e: e[2])


@dataclass
@dataclass
class BaselineResult:
    seconds: float
    cpu: float
    syscalls: int
    calls: int | None = None
    weights: dict[tuple[int, int, int], int] | None = None
    stacks: int | None = None
    frames: int | None = None
    ringbuf_full: int | None = None
    exit_code: int = 0


class Baselines:
    """The baseline BPF programs for one binary (see the module docstring)."""

    def __init__(self, max_sites: int = 1 << 17) -> None:
        self.max_sites = max_sites
        self.module = load_module(f"#define NSITES {max_sites}\n" + BASELINE_C)
        self.module.attach_tracepoint("sched:sched_process_fork", "bl_fork")
        self.path = ""
        self.sites: list[tuple[int, int, int]] = []
        self._image: ElfImage | None = None
        self.stacks_seen = 0

        def on_stack(_raw: bytes) -> None:
            self.stacks_seen += 1

        self.module.open_ring_buffer("bl_stacks", on_stack)

    def set_binary(self, path: str, graph: CallGraph) -> None:
        """Probe this binary's call sites in :meth:`count_calls` from now on."""
        sites = call_sites(graph)
        if len(sites) > self.max_sites:
            raise ValueError(f"{path}: {len(sites)} call sites, more than the {self.max_sites} counters")
        self.path = os.path.realpath(path)
        self.sites = sites
        self._image = ElfImage(self.path)

    def _reset(self) -> None:
        self.module.map("bl_tracked").clear()
        self.module.map("bl_counts").clear()
        hits = self.module.map("bl_site_hits")
        for i in range(len(self.sites)):
            hits.delete(i)

    def _run(
        self, argv: Sequence[str], stdin: str | None, env: dict[str, str] | None, drain: bool
    ) -> tuple[Timing, int]:
        child = launch(argv, stdin=stdin, env=env)
        self.module.map("bl_tracked").set(child.pid, 1)
        reaper = Reaper(child.pid)
        t0 = child.release()
        while drain and not reaper.done:
            self.module.ring_buffer_poll(50)
        ex = reaper.wait()
        self.module.ring_buffer_consume()
        return Timing(ex.at - t0, ex.cpu), ex.code

    def _detach_sys_enter(self) -> None:
        self.module.detach_raw_tracepoint("sys_enter")

    def count_calls(
        self, argv: Sequence[str], *, stdin: str | None = None, env: dict[str, str] | None = None
    ) -> BaselineResult:
        """Every direct call / tail-jump site probed (uprobe_multi, per-site counters) + syscall count."""
        if self._image is None:
            raise ValueError("count_calls before set_binary")
        self._reset()
        offsets = [self._image.addrspace.vaddr_to_offset(site) for _, _, site in self.sites]
        fd = self.module.load_func("bl_call", "kprobe", attach_type=48)
        self.module.attach_raw_tracepoint("sys_enter", "bl_sys_count")
        link: UprobeMultiLink | None = None
        try:
            link = attach_uprobe_multi(fd, self.path, offsets, list(range(len(offsets))))
            timing, code = self._run(argv, stdin, env, drain=False)
        finally:
            if link is not None:
                link.close()
            self._detach_sys_enter()
        hits = self.module.map("bl_site_hits")
        weights: dict[tuple[int, int, int], int] = {}
        for i, edge in enumerate(self.sites):
            n = int(hits.get(i) or 0)
            if n:
                weights[edge] = n
        counts = self.module.map("bl_counts")
        return BaselineResult(
            timing.seconds,
            timing.cpu,
            int(counts.get(0) or 0),
            calls=sum(weights.values()),
            weights=weights,
            exit_code=code,
        )

    def get_stack(
        self, argv: Sequence[str], *, stdin: str | None = None, env: dict[str, str] | None = None
    ) -> BaselineResult:
        """bpf_get_stack(BPF_F_USER_STACK) at every syscall, stacks drained from a ring buffer."""
        self._reset()
        self.module.attach_raw_tracepoint("sys_enter", "bl_sys_stack")
        try:
            timing, code = self._run(argv, stdin, env, drain=True)
        finally:
            self._detach_sys_enter()
        counts = self.module.map("bl_counts")
        stacks = int(counts.get(1) or 0)
        return BaselineResult(
            timing.seconds,
            timing.cpu,
            stacks,
            stacks=stacks,
            frames=int(counts.get(2) or 0),
            ringbuf_full=int(counts.get(3) or 0),
            exit_code=code,
        )

    def close(self) -> None:
        self.module.cleanup()


def run_strace(argv: Sequence[str], *, stdin: str | None = None, env: dict[str, str] | None = None) -> Timing:
    """``strace -f -k`` (every syscall, output discarded) on the command; CPU is strace's and the
    target's together (strace does the unwinding in its own process)."""
    cmd = [shutil.which("strace") or "strace", "-f", "-k", "-qq", "-o", os.devnull, "--", *argv]
    child = launch(cmd, stdin=stdin, env=env)
    t0 = child.release()
    ex = wait_exit(child.pid)
    if ex.code != 0:
        raise RuntimeError(f"strace -f -k {' '.join(argv)} exited with {ex.code}")
    return Timing(ex.at - t0, ex.cpu)


# ------------------------------------------------------------------------------- BPF run time
def _owned_prog_ids() -> set[int]:
    ids: set[int] = set()
    base = Path("/proc/self/fdinfo")
    for entry in base.iterdir():
        try:
            text = entry.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("prog_id:"):
                ids.add(int(line.split()[1]))
    return ids


def prog_stats(ids: set[int]) -> dict[str, tuple[int, int]]:
    """name -> (run_time_ns, run_cnt) summed over the BPF programs ``ids`` of one name (bpftool;
    counted only while run-time stats are on)."""
    out = subprocess.run(["bpftool", "-j", "prog", "show"], check=True, capture_output=True, text=True).stdout
    stats: dict[str, tuple[int, int]] = {}
    for p in json.loads(out or "[]"):
        if int(p.get("id", -1)) in ids:
            name = str(p.get("name", ""))
            t, c = stats.get(name, (0, 0))
            stats[name] = (t + int(p.get("run_time_ns", 0)), c + int(p.get("run_cnt", 0)))
    return stats


def owned_prog_stats() -> dict[str, tuple[int, int]]:
    """name -> (run_time_ns, run_cnt) summed over the BPF programs this process holds."""
    return prog_stats(_owned_prog_ids())


@contextlib.contextmanager
def bpf_stats_enabled() -> Iterator[None]:
    """``kernel.bpf_stats_enabled=1`` for the duration, then the previous value."""
    knob = Path("/proc/sys/kernel/bpf_stats_enabled")
    before = knob.read_text().strip()
    knob.write_text("1")
    try:
        yield
    finally:
        knob.write_text(before)


def stats_delta(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], prefix: str
) -> tuple[int, int]:
    """(run_time_ns, run_cnt) gained by programs whose name starts with ``prefix`` (bpftool
    truncates names to 15 characters)."""
    t = c = 0
    for name, (rt, rc) in after.items():
        if name.startswith(prefix[:15]) or prefix.startswith(name):
            bt, bc = before.get(name, (0, 0))
            t += rt - bt
            c += rc - bc
    return t, c


def jsonable(obj: Any) -> Any:
    """Tuples-as-keys and dataclasses made JSON-able for the raw results file."""
    if isinstance(obj, dict):
        return {
            (",".join(map(str, k)) if isinstance(k, tuple) else str(k)): jsonable(v) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj
