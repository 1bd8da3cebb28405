"""Thread and process creation, unwound in BPF, sample by sample against gdb (issue 14).

``tests/programs/spawns.c`` creates a thread (``pthread_create``: glibc's ``__clone3``), a process
(``fork``: ``clone`` with SIGCHLD), a spawned program (``posix_spawn``: ``clone3`` with
CLONE_VM|CLONE_VFORK) and a ``vfork``.  glibc's clone/clone3 close their FDE just before the
``syscall`` (in the child the parent's CFI would be wrong), so the parent's pc at that syscall is in no
FDE: before ccprofd.elf.cfi filled such fall-through gaps, every thread creation was sampled
``incomplete`` (no_cfi).  strace -k (libunwind) stops there too, after one frame, so the oracle is
gdb, which unwinds it by prologue analysis: every sample must be complete and its pcs equal gdb's
at the same syscall entry, per thread and in order.  glibc's ``vfork`` pops its return address into
rdi before the syscall (``cfi_register rip, rdi``), a rule the unwinder evaluates in the innermost
frame of a syscall sample (rdi as saved at the entry); before, ``unsupported_cfi``.  Also covered:
the new thread's first syscalls (rseq, set_robust_list from start_thread, whose outermost frame
has ``cfi_undefined rip``) and a syscall of the thread's own start routine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from programs.build import build
from test_unwind_gdb import run_with_gdb
from test_unwind_programs import drain

from ccprofd.elf import cfi
from ccprofd.tracing.unwind.sampler import UnwindSampler

# x86-64 syscall numbers (asm/unistd_64.h)
NRS = {"clone": 56, "vfork": 58, "getppid": 110, "set_robust_list": 273, "rseq": 334, "clone3": 435}
NAMES = {nr: name for name, nr in NRS.items()}


@pytest.fixture(scope="module")
def sampler() -> Iterator[UnwindSampler]:
    from conftest import require_bpf

    require_bpf()
    with UnwindSampler(syscalls=sorted(NRS.values()), max_depth=4096) as s:
        s.attach()
        yield s


def test_clone3_parent_pc_is_in_no_fde_but_falls_through() -> None:
    """The premise, from libc itself: the ``syscall`` of __clone3 ends an FDE and the pc after it is
    in none (readelf), and the table gives it the rule of the FDE it falls through from."""
    libc = subprocess.run(["sh", "-c", "ldd /bin/true | sed -n 's/.*libc.so.6 => \\([^ ]*\\).*/\\1/p'"],
                          check=True, capture_output=True, text=True).stdout.strip()
    table = cfi.load_table(libc)
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", libc], check=True, capture_output=True,
                         text=True).stdout
    # glibc's clone3.S: "mov $0x1b3,%eax; syscall; test %rax,%rax" (SYS_clone3 = 435 = 0x1b3)
    lines = dis.splitlines()
    at = next(i for i, line in enumerate(lines) if line.rstrip().endswith("mov    $0x1b3,%eax")
              and lines[i + 1].rstrip().endswith("syscall"))
    after = int(lines[at + 2].split(":")[0], 16)
    # readelf exits 1 on warnings about libc's other debug sections; the FDE lines are all there
    frames = subprocess.run(["readelf", "--debug-dump=frames", libc], check=False, capture_output=True,
                            text=True).stdout
    ranges = [tuple(int(x, 16) for x in line.split("pc=")[1].split(".."))
              for line in frames.splitlines() if " FDE " in line and "pc=" in line]
    assert not any(lo <= after < hi for lo, hi in ranges), "glibc's clone3 parent path has an FDE here"
    rule = table.lookup(after)
    assert (rule.kind, rule.cfa_off, rule.ra_off) == (cfi.CFA_RSP, 8, -8), rule.describe()


def test_thread_and_process_creation_equal_gdb(sampler: UnwindSampler, tmp_path: Path) -> None:
    binary = build("spawns", opt="O2", pie=True, frame_pointer=False)
    sampler.poll(0)
    pid, stops = run_with_gdb([str(binary)], list(NRS), tmp_path, sampler.track)
    samples = drain(sampler, pid)
    by_tid_gdb: dict[int, list[tuple[int, ...]]] = {}
    for st in stops:
        by_tid_gdb.setdefault(st.tid, []).append(st.pcs)
    by_tid: dict[int, list[tuple[str, bool, str | None, tuple[int, ...]]]] = {}
    for smp in samples:
        by_tid.setdefault(smp.tid, []).append((NAMES[smp.syscall], smp.complete, smp.reason, tuple(smp.pcs)))
    assert sorted(by_tid) == sorted(by_tid_gdb) and len(by_tid) == 2, (sorted(by_tid), sorted(by_tid_gdb))
    seen = []
    for tid, gstops in by_tid_gdb.items():
        got = by_tid[tid]
        assert len(got) == len(gstops), f"tid {tid}: {[g[0] for g in got]}, gdb stopped {len(gstops)}x"
        for i, ((name, complete, reason, pcs), want) in enumerate(zip(got, gstops, strict=True)):
            where = f"tid {tid} syscall #{i} ({name})"
            assert complete, f"{where}: incomplete ({reason}) after {[hex(p) for p in pcs]}"
            assert pcs == want, f"{where}: bpf {[hex(p) for p in pcs]} gdb {[hex(p) for p in want]}"
            seen.append(name)
    # main: clone3 (pthread_create), clone (fork), clone3 (posix_spawn), vfork; the thread: rseq,
    # set_robust_list, getppid
    assert sorted(seen) == sorted(["clone3", "clone", "clone3", "vfork", "rseq", "set_robust_list",
                                   "getppid"]), seen
