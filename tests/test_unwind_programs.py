"""The BPF unwinder on real processes, sample by sample against gdb (tests/test_unwind_gdb.py).

Each program runs under gdb, which stops at the entry of every getppid/write and records every
frame's pc; ccprofd unwinds the same process at the same syscalls in BPF.  Per thread, the i-th
sample must equal the i-th gdb stop exactly (all runtime pcs, innermost first), or — only past
``max_depth`` — be flagged incomplete with the frames it has equal to gdb's innermost ones.
Covered: recursion to 1,000 and 4,000+ frames, threads, a qsort callback (libc frames between the
syscall and the binary, unwound through CFI: the binaries have no frame pointers and no frame may be
unwound through rbp), a signal handler on the same stack and on a sigaltstack, PIE and non-PIE,
stripped, -O0 and -O2.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from bpf_helpers import compile_c, direct_call_sites, drain
from programs.build import build
from test_unwind_gdb import GdbStop, run_with_gdb

from ccprofd.elf import cfi
from ccprofd.tracing.unwind.sampler import UnwindSampler, UnwoundSample

NR_WRITE, NR_GETPPID = 1, 110
SYSCALLS = ["getppid", "write"]


@pytest.fixture(scope="module")
def sampler() -> Iterator[UnwindSampler]:
    from conftest import require_bpf

    require_bpf()
    with UnwindSampler(syscalls=[NR_GETPPID, NR_WRITE], max_depth=4096) as s:
        s.attach()
        yield s


def unwind_vs_gdb(s: UnwindSampler, argv: list[str], tmp: Path) -> tuple[list[UnwoundSample], list[GdbStop]]:
    """Run under gdb and ccprofd at once; assert per-thread, per-ordinal equality; return both."""
    s.poll(0)
    pid, stops = run_with_gdb(argv, SYSCALLS, tmp, s.track)
    samples = drain(s, pid)
    by_tid_gdb: dict[int, list[GdbStop]] = {}
    for st in stops:
        by_tid_gdb.setdefault(st.tid, []).append(st)
    by_tid_bpf: dict[int, list[UnwoundSample]] = {}
    for smp in samples:
        by_tid_bpf.setdefault(smp.tid, []).append(smp)
    assert sorted(by_tid_gdb) == sorted(by_tid_bpf), (sorted(by_tid_gdb), sorted(by_tid_bpf))
    for tid, gstops in by_tid_gdb.items():
        bsamples = by_tid_bpf[tid]
        assert len(bsamples) == len(gstops), f"tid {tid}: {len(bsamples)} samples, gdb stopped {len(gstops)}x"
        for i, (g, b) in enumerate(zip(gstops, bsamples, strict=True)):
            where = f"tid {tid} syscall #{i} ({b.syscall})"
            if b.complete:
                diff = next((k for k, (x, y) in enumerate(zip(b.pcs, g.pcs, strict=False)) if x != y),
                            min(len(b.pcs), len(g.pcs)))
                assert b.pcs == g.pcs, f"{where}: first difference at frame {diff} of {len(g.pcs)}; " \
                    f"bpf {[hex(p) for p in b.pcs[:12]]} gdb {[hex(p) for p in g.pcs[:12]]}"
            else:
                assert b.reason == "max_depth", f"{where}: incomplete ({b.reason})"
                assert len(g.pcs) > s.max_depth, f"{where}: flagged max_depth at {len(g.pcs)} frames"
                assert b.pcs == g.pcs[: len(b.pcs)], f"{where}: incomplete sample disagrees with gdb"
    return samples, stops


def module_of(s: UnwindSampler, smp: UnwoundSample, pc: int) -> str:
    r = s.symbolize(smp.tgid, pc)
    return r.module if r else "?"


@pytest.mark.parametrize("variant", [
    {"opt": "O0", "pie": False},
    {"opt": "O2", "pie": True, "frame_pointer": False},
    {"opt": "O2", "pie": True, "frame_pointer": False, "strip": True},
])
def test_recursion_1000_frames(sampler: UnwindSampler, tmp_path: Path, variant: dict[str, object]) -> None:
    binary = build("recursion", **variant)  # type: ignore[arg-type]
    samples, stops = unwind_vs_gdb(sampler, [str(binary), "1000"], tmp_path)
    assert max(len(st.pcs) for st in stops) > 2000  # is_even/is_odd recursion of 2 x 1000
    assert all(smp.complete for smp in samples)
    if variant.get("frame_pointer") is False:
        assert all(smp.fp_frames == 0 for smp in samples)


def test_recursion_4000_frames_and_past_max_depth(sampler: UnwindSampler, tmp_path: Path) -> None:
    """fact(4000) is unwound completely (~4,000 frames); is_even(8000) is deeper than max_depth:
    flagged incomplete, with its 4,096 innermost frames equal to gdb's."""
    binary = build("recursion", opt="O2", pie=True, frame_pointer=False)
    samples, _ = unwind_vs_gdb(sampler, [str(binary), "4000"], tmp_path)
    getppid = [smp for smp in samples if smp.syscall == NR_GETPPID]
    assert len(getppid) == 1 and getppid[0].complete and len(getppid[0].pcs) > 4000
    deep = [smp for smp in samples if not smp.complete]
    assert len(deep) == 1 and deep[0].reason == "max_depth" and len(deep[0].pcs) == 4096


def test_threads(sampler: UnwindSampler, tmp_path: Path) -> None:
    binary = build("threads", opt="O2", pie=True, frame_pointer=False)
    samples, _ = unwind_vs_gdb(sampler, [str(binary), "40"], tmp_path)
    assert len({smp.tid for smp in samples}) == 3  # main, worker a, worker b
    assert all(smp.complete for smp in samples)


def test_qsort_callback_libc_frames_unwound_through_cfi(sampler: UnwindSampler, tmp_path: Path) -> None:
    """getppid inside qsort's comparator: between cmp_int and sort_it lie libc frames (qsort's
    merge sort), and neither libc nor this -fomit-frame-pointer binary keeps frame pointers."""
    binary = build("fptr", opt="O2", pie=True, frame_pointer=False)
    samples, _ = unwind_vs_gdb(sampler, [str(binary)], tmp_path)
    assert all(smp.complete and smp.fp_frames == 0 for smp in samples)
    nm = subprocess.run(["nm", str(binary)], check=True, capture_output=True, text=True).stdout
    cmp_int = next(int(line.split()[0], 16) for line in nm.splitlines() if line.endswith(" cmp_int"))
    through_qsort = 0
    for smp in samples:
        mods = [module_of(sampler, smp, pc) for pc in smp.pcs]
        vaddrs = [sampler.symbolize(smp.tgid, pc) for pc in smp.pcs]
        # frame 1 is the return address into cmp_int; the frames after it are libc until sort_it
        if len(vaddrs) > 2 and vaddrs[1] and vaddrs[1].module == str(binary) and \
                cmp_int <= vaddrs[1].vaddr < cmp_int + 0x100:
            assert "libc" in mods[2], mods[:6]
            through_qsort += 1
    assert through_qsort >= 1


SIGALT_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
volatile long sink;
#define NOINLINE __attribute__((noinline))
NOINLINE void in_handler(int d) { if (d == 0) { sink = getppid(); return; } in_handler(d - 1); sink++; }
NOINLINE void on_signal(int sig) { sink = write(1, "handler\n", 8); in_handler(sig % 5 + 3); }
NOINLINE long deep(int n) {
    if (n == 0) { raise(SIGUSR1); return getppid(); }
    long r = deep(n - 1); sink = r; return r + 1;
}
int main(int argc, char **argv) {
    int alt = argc > 1 && strcmp(argv[1], "alt") == 0;
    struct sigaction sa; memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    if (alt) {
        stack_t ss; ss.ss_sp = malloc(1 << 16); ss.ss_size = 1 << 16; ss.ss_flags = 0;
        if (sigaltstack(&ss, 0)) return 2;
        sa.sa_flags = SA_ONSTACK;
    }
    sigaction(SIGUSR1, &sa, 0);
    sink = deep(30);
    return 0;
}
"""


@pytest.mark.parametrize("mode", ["same", "alt"])
def test_signal_handler_frames(sampler: UnwindSampler, tmp_path: Path, mode: str) -> None:
    """Syscalls inside a signal handler (on the thread's stack, and on a sigaltstack): the unwind
    goes through __restore_rt's saved ucontext into the interrupted raise() and on to main."""
    binary = compile_c(tmp_path, "sigalt", SIGALT_C, "-O2", "-fomit-frame-pointer")
    samples, _ = unwind_vs_gdb(sampler, [str(binary), mode], tmp_path)

    def through_trampoline(smp: UnwoundSample) -> bool:
        for pc in smp.pcs:
            r = sampler.symbolize(smp.tgid, pc)
            if r and cfi.load_table(r.module).lookup(r.vaddr).kind == cfi.SIGNAL:
                return True
        return False

    in_handler = [smp for smp in samples if through_trampoline(smp)]
    # write in on_signal and getppid in in_handler, both above raise() > deep(30) x 31 > main
    assert len(in_handler) == 2 and all(len(smp.pcs) > 38 for smp in in_handler)
    assert all(smp.complete and smp.fp_frames == 0 for smp in samples)


def test_aggregation_counts_contexts_in_kernel(tmp_path: Path) -> None:
    """Aggregated mode: N getppid calls from one call chain are one context counted N times; each
    other chain (a() from a second call site in main, b()) is its own context; only new contexts
    are sent to userspace.  Which call site each context went through is checked with objdump."""
    from conftest import require_bpf

    require_bpf()
    src = r"""
#include <unistd.h>
#include <stdlib.h>
__attribute__((noinline)) void a(int n) { for (int i = 0; i < n; i++) getppid(); }
__attribute__((noinline)) void b(int n) { for (int i = 0; i < n; i++) getppid(); }
int main(int argc, char **argv) { char c; write(1, "ready\n", 6); read(0, &c, 1);
    int n = atoi(argv[1]); a(n); b(2 * n); a(n); return 0; }
"""
    binary = compile_c(tmp_path, "agg", src, "-O2", "-fomit-frame-pointer")
    with UnwindSampler(syscalls=[NR_GETPPID], aggregate=True, max_depth=256, ringbuf_pages=64) as s:
        s.attach()
        p = subprocess.Popen([str(binary), "500"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert p.stdout is not None and p.stdin is not None and p.stdout.readline() == b"ready\n"
        s.track(p.pid)
        p.stdin.write(b"x")
        p.stdin.close()
        assert p.wait(timeout=60) == 0
        sent = drain(s, p.pid)
        counts = s.counts()
        stats = s.stats()
        sites = {c.vaddr + 5: c.target for c in direct_call_sites(binary) if c.function == "main"}
        by_site = {}
        for x in sent:
            ret_into_main = [r.vaddr for pc in x.pcs if (r := s.symbolize(x.tgid, pc)) and r.vaddr in sites]
            assert len(ret_into_main) == 1, x
            by_site[ret_into_main[0]] = counts[x.key]
    assert len(sent) == 3 and all(x.flags & 1 for x in sent), sent  # three new contexts, nothing else
    expected = {ra: (1000 if target == "b" else 500) for ra, target in sites.items() if target in ("a", "b")}
    assert by_site == expected
    assert stats["collisions"] == 0 and stats["samples"] == 2000
