"""The syscall sampler on real processes: exact event counts for a tracked pid, user registers
inside the process's own mappings, fork following, exec stopping (or not, with exec credit)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from bpf_helpers import compile_c

from ccprofd.tracing.syscall_sampler import SamplerEvent, SyscallSampler

NR_WRITE = 1
NR_GETPPID = 110

# Unless argv[1] is "-n", every mode starts by writing "ready" (its exec is complete: tracking it
# now cannot race with the exec, which would end the tracking) and waiting for one byte on stdin
# (so the test can track the pid first).  Syscalls it makes on purpose: getppid() N times, and
# write() once per "done".
PROG_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
static void calls(int n) { for (int i = 0; i < n; i++) getppid(); }
static void done(void) { write(1, "done\n", 5); }
int main(int argc, char **argv) {
    int a = 1;
    if (strcmp(argv[a], "-n") == 0) a++;
    else { char c; write(1, "ready\n", 6); if (read(0, &c, 1) != 1) return 3; }
    const char *mode = argv[a];
    int n = atoi(argv[a + 1]);
    if (!strcmp(mode, "calls")) {            /* calls N: N getppid, done, wait for EOF */
        calls(n); done();
        char c; while (read(0, &c, 1) > 0) {}
        return 0;
    }
    if (!strcmp(mode, "fork")) {             /* fork N M: parent N, child M getppid */
        int m = atoi(argv[a + 2]);
        calls(n);
        pid_t p = fork();
        if (p == 0) { calls(m); _exit(0); }
        waitpid(p, 0, 0);
        dprintf(1, "child %d\n", (int)p);
        return 0;
    }
    if (!strcmp(mode, "forkexec")) {         /* forkexec N M K: child M getppid, then exec K */
        int m = atoi(argv[a + 2]);
        calls(n);
        pid_t p = fork();
        if (p == 0) {
            calls(m);
            execl("/proc/self/exe", argv[0], "-n", "calls", argv[a + 3], (char *)0);
            _exit(9);
        }
        waitpid(p, 0, 0);
        dprintf(1, "child %d\n", (int)p);
        return 0;
    }
    if (!strcmp(mode, "exec")) {             /* exec N: exec self making N getppid */
        execl("/proc/self/exe", argv[0], "-n", "calls", argv[a + 1], (char *)0);
        return 9;
    }
    return 2;
}
"""


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SyscallSampler]:
    from conftest import require_bpf

    require_bpf()
    with SyscallSampler(syscalls=[NR_GETPPID, NR_WRITE], max_tracked=64, ringbuf_pages=16) as s:
        s.attach()
        yield s


@pytest.fixture(scope="module")
def prog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_c(tmp_path_factory.mktemp("sc"), "sc", PROG_C, "-O0", "-fno-omit-frame-pointer")


def _drain(s: SyscallSampler) -> list[SamplerEvent]:
    out: list[SamplerEvent] = []
    while True:
        batch = s.poll(0)
        if not batch:
            return out
        out.extend(batch)


def _start(prog: Path, s: SyscallSampler, *args: str, execs: int = 0) -> subprocess.Popen[bytes]:
    _drain(s)
    p = subprocess.Popen([str(prog), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    s.track(p.pid, execs=execs)
    return p


def _child_pid(out: bytes) -> int:
    return next(int(line.split()[1]) for line in out.splitlines() if line.startswith(b"child "))


def _maps(pid: int) -> list[tuple[int, int, str, str]]:
    out = []
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1], parts[5] if len(parts) > 5 else ""))
    return out


def _where(maps: list[tuple[int, int, str, str]], addr: int) -> tuple[str, str] | None:
    for lo, hi, perms, name in maps:
        if lo <= addr < hi:
            return perms, name
    return None


def test_exact_count_and_registers(sampler: SyscallSampler, prog: Path) -> None:
    n = 250
    p = _start(prog, sampler, "calls", str(n))
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(b"g")
    p.stdin.flush()
    assert p.stdout.readline() == b"done\n"  # all its syscalls so far are in the ring buffer
    maps = _maps(p.pid)
    events = [e for e in _drain(sampler) if e.tgid == p.pid]
    p.stdin.close()
    assert p.wait() == 0

    getppid = [e for e in events if e.kind == "syscall" and e.syscall == NR_GETPPID]
    writes = [e for e in events if e.kind == "syscall" and e.syscall == NR_WRITE]
    assert len(getppid) == n
    assert len(writes) == 1
    assert {e.tid for e in getppid} == {p.pid}
    for e in getppid + writes:
        ip_map = _where(maps, e.ip)
        assert ip_map is not None and "x" in ip_map[0] and "libc" in ip_map[1], (hex(e.ip), ip_map)
        assert _where(maps, e.sp) is not None and _where(maps, e.sp)[1] == "[stack]"  # type: ignore[index]
        assert _where(maps, e.bp) is not None and _where(maps, e.bp)[1] == "[stack]"  # type: ignore[index]
    assert len({e.ip for e in getppid}) == 1 and len({e.sp for e in getppid}) == 1  # same loop
    times = [e.time_ns for e in getppid]
    assert times == sorted(times)
    # The process exited: its tracking entry is gone, nothing was dropped.
    assert p.pid not in sampler.tracked()
    st = sampler.stats()
    assert st["ringbuf_full"] == 0 and st["tracked_full"] == 0


def test_untracked_process_is_not_reported(sampler: SyscallSampler, prog: Path) -> None:
    _drain(sampler)
    p = subprocess.run([str(prog), "-n", "fork", "20", "5"], capture_output=True, check=True)
    assert p.stdout.startswith(b"child ")
    assert _drain(sampler) == []


def test_fork_children_are_followed(sampler: SyscallSampler, prog: Path) -> None:
    p = _start(prog, sampler, "fork", "30", "17")
    out, _ = p.communicate(b"g")
    assert p.returncode == 0
    child = _child_pid(out)
    events = _drain(sampler)
    forks = [e for e in events if e.kind == "fork" and e.tgid == p.pid]
    assert [e.aux for e in forks] == [child]
    calls = [e for e in events if e.kind == "syscall" and e.syscall == NR_GETPPID]
    assert sum(e.tgid == p.pid for e in calls) == 30
    assert sum(e.tgid == child for e in calls) == 17
    assert {e.tid for e in calls if e.tgid == child} == {child}
    exits = {e.tgid for e in events if e.kind == "exit"}
    assert exits == {p.pid, child}
    assert not {p.pid, child} & sampler.tracked()


def test_exec_stops_tracking(sampler: SyscallSampler, prog: Path) -> None:
    p = _start(prog, sampler, "forkexec", "4", "6", "40")
    out, _ = p.communicate(b"g")
    assert p.returncode == 0
    child = _child_pid(out)
    events = _drain(sampler)
    execs = [e for e in events if e.kind == "exec"]
    assert [(e.tgid, e.aux) for e in execs] == [(child, child)]
    calls = [e for e in events if e.kind == "syscall" and e.syscall == NR_GETPPID]
    assert sum(e.tgid == p.pid for e in calls) == 4
    # 6 before the exec; the exec'd image's 40 are not reported.
    assert sum(e.tgid == child for e in calls) == 6
    exec_time = execs[0].time_ns
    assert all(e.time_ns < exec_time for e in events if e.tgid == child and e.kind == "syscall")


def test_exec_credit_keeps_tracking_a_launcher_child(sampler: SyscallSampler, prog: Path) -> None:
    p = _start(prog, sampler, "exec", "12", execs=1)
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(b"g")
    p.stdin.flush()
    assert p.stdout.readline() == b"done\n"
    events = _drain(sampler)
    p.stdin.close()
    assert p.wait() == 0
    assert [e.kind for e in events if e.kind == "exec"] == ["exec"]
    assert sum(e.kind == "syscall" and e.syscall == NR_GETPPID and e.tgid == p.pid for e in events) == 12


def test_syscall_set_and_all(sampler: SyscallSampler, prog: Path) -> None:
    try:
        sampler.set_syscalls([NR_WRITE])
        p = _start(prog, sampler, "fork", "9", "3")
        p.communicate(b"g")
        ev = [e for e in _drain(sampler) if e.kind == "syscall"]
        # dprintf's one write in the parent; no getppid.
        assert [(e.tgid, e.syscall) for e in ev] == [(p.pid, NR_WRITE)]
        sampler.set_syscalls(None)
        p = _start(prog, sampler, "fork", "9", "3")
        p.communicate(b"g")
        nrs = [e.syscall for e in _drain(sampler) if e.kind == "syscall" and e.tgid == p.pid]
        assert nrs.count(NR_GETPPID) == 9 and len(set(nrs)) > 3  # read, fork/clone, wait4, write...
    finally:
        sampler.set_syscalls([NR_GETPPID, NR_WRITE])


def test_tracked_table_is_bounded(prog: Path) -> None:
    from conftest import require_bpf

    from ccprofd.kbpf.errors import BPFError

    require_bpf()
    with SyscallSampler(syscalls=[NR_GETPPID], max_tracked=2, ringbuf_pages=1) as s:
        s.attach()
        fake = 1 << 22  # above the default pid_max: no such process
        s.track(fake)
        s.track(fake + 1)
        with pytest.raises(BPFError, match="table full"):
            s.track(fake + 2)
        s.untrack(fake)
        p = _start(prog, s, "fork", "1", "1")  # table full again: {fake + 1, p}
        out, _ = p.communicate(b"g")
        child = _child_pid(out)
        events = _drain(s)
        assert s.stats()["tracked_full"] == 1  # the fork could not be followed, and says so
        assert not [e for e in events if e.tgid == child]
        assert sum(e.kind == "syscall" and e.tgid == p.pid for e in events) == 1
