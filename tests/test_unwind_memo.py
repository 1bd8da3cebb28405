"""Issue #18: the per-thread memo of outer frames (unwind.c, uw_memo_step and uw_memo_chain) is sound.

A thread's consecutive syscalls alternate between two call paths whose inner frames are identical
(same pc, CFA and rbp at every frame up to the one whose return address differs): main -> A -> mid
-> leaf and main -> B -> mid -> leaf, A and B the same code at the same stack depth.  So the outer
frames are rewritten between two samples under inner frames that look unchanged -- the case where a
memo that trusted its cached chain would report A for B.  The oracle is the program itself: leaf
passes its own return-address chain (``__builtin_return_address(0..2)``, the binary built with frame
pointers) in the syscall's argument registers, and the function each one lies in is checked against
``nm``'s symbol ranges (A, A, B, B, ... by iteration).  Every sample's pcs[1..3] must equal
that chain.  The same check, run with the re-read of reused slots switched off (``unchecked``), must
find wrong chains: the re-read is what makes the reuse correct.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from bpf_helpers import (
    WAIT_FOR_RELEASE,
    between_phases,
    compile_c,
    drain,
    encoded_sampler,
    load_bias,
    nm_functions,
    run_released,
)

from ccprofd.tracing.unwind.sampler import UnwindSampler, UnwoundSample

NR_WRITE = 1
N = 400

SOURCE = r"""
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#define NOI __attribute__((noinline, noclone))

NOI long leaf(long i) {
    long ra0 = (long)__builtin_return_address(0);  /* into mid */
    long ra1 = (long)__builtin_return_address(1);  /* into A or B */
    register long ra2 asm("r10") = (long)__builtin_return_address(2);  /* into main */
    long ret;
    asm volatile("syscall" : "=a"(ret) : "0"((long)SYS_write), "D"(-1L - i), "S"(ra0), "d"(ra1), "r"(ra2)
                 : "rcx", "r11", "memory");
    return ret;
}
NOI long mid(long i) { long r = leaf(i); asm volatile("" ::: "memory"); return r + 1; }
NOI long A(long i) { long r = mid(i); asm volatile("" ::: "memory"); return r + 1; }
NOI long B(long i) { long r = mid(i); asm volatile("" ::: "memory"); return r + 2; }

int main(int argc, char **argv) {
""" + WAIT_FOR_RELEASE + r"""    for (long i = 0; i < n; i++) {
        if ((i >> 1) & 1)  /* A A B B A A ...: repeated stacks and changed ones */
            B(i);
        else
            A(i);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def sampler() -> Iterator[UnwindSampler]:
    from conftest import require_bpf

    require_bpf()
    with UnwindSampler(syscalls=[NR_WRITE], aggregate=False, max_depth=4096) as s:
        s.attach()
        yield s


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("memo")
    return compile_c(tmp, "alternate", SOURCE, "-O1", "-fno-omit-frame-pointer", "-fno-inline")


def run(s: UnwindSampler, binary: Path) -> tuple[list[UnwoundSample], int]:
    biases: list[int] = []
    got, _pid = run_released(s, [str(binary), str(N)], lambda pid: biases.append(load_bias(pid, binary)))
    return [x for x in got if x.syscall == NR_WRITE], biases[0]


def wrong_chains(samples: list[UnwoundSample], bias: int, syms: dict[str, tuple[int, int]]) -> list[str]:
    """Samples whose frames 1..3 differ from the program's own return-address chain."""
    def inside(pc: int, name: str) -> bool:
        lo, hi = syms[name]
        return lo < pc - bias <= hi  # a return address follows its call: up to the function's end

    bad = []
    assert len(samples) == N, len(samples)
    for x in samples:
        assert x.sargs is not None
        rdi, ra0, ra1, ra2 = x.sargs[0], x.sargs[1], x.sargs[2], x.sargs[3]
        i = (1 << 64) - 1 - rdi  # fd = -1 - i
        # the program's own chain is what nm says it must be (independent of the unwinder)
        want_ab = "B" if (i >> 1) & 1 else "A"
        assert inside(ra0, "mid") and inside(ra1, want_ab) and inside(ra2, "main"), (i, x.sargs)
        if not x.complete or tuple(x.pcs[1:4]) != (ra0, ra1, ra2):
            want = [hex(ra0), hex(ra1), hex(ra2)]
            bad.append(f"i={i}: {[hex(p) for p in x.pcs[1:4]]} != {want} ({x.reason})")
    return bad


def test_memo_reuses_outer_frames_only_when_every_slot_rereads_equal(sampler: UnwindSampler,
                                                                      program: Path) -> None:
    syms = nm_functions(program)
    sampler.set_memo("on")
    before = sampler.stats()
    samples, bias = run(sampler, program)
    after = sampler.stats()
    d = {k: after[k] - before[k]
         for k in ("samples", "memo_hits", "memo_frames", "memo_rejects", "memo_chains")}
    assert wrong_chains(samples, bias, syms) == []
    # the memo was used (libc's start-up frames above main) and refused where the chain changed
    # (mid's return address into A / B): both paths of the check ran
    assert d["memo_hits"] >= N - 1, d
    assert d["memo_rejects"] >= N // 2 - 1, d
    # the second sample of each pair (A A, B B) is the first one's whole chain (uw_memo_chain); the
    # first of a pair starts in the same state at leaf but mid's return slot differs: not whole
    assert N // 2 - 2 <= d["memo_chains"] <= N // 2, d


@pytest.mark.parametrize("mode", ["unchecked", "chain unchecked"])
def test_without_the_reread_the_memo_reports_wrong_chains(sampler: UnwindSampler, program: Path,
                                                         mode: str) -> None:
    """The check above fails when reused slots are not re-read: the test can see the bug it guards.
    ``unchecked``: no re-read at all; ``chain unchecked``: the whole-chain reuse alone (frame by
    frame reuse still re-reads) -- B's samples after A's start in A's state at leaf, and only the
    re-read of mid's return slot tells them apart."""
    syms = nm_functions(program)
    sampler.set_memo(mode)
    try:
        samples, bias = run(sampler, program)
    finally:
        sampler.set_memo("on")
    bad = wrong_chains(samples, bias, syms)
    assert len(bad) >= N // 4, bad[:5]


def test_memo_off_is_every_frame_afresh(sampler: UnwindSampler, program: Path) -> None:
    syms = nm_functions(program)
    sampler.set_memo("off")
    try:
        before = sampler.stats()
        samples, bias = run(sampler, program)
        after = sampler.stats()
    finally:
        sampler.set_memo("on")
    assert wrong_chains(samples, bias, syms) == []
    assert after["memo_hits"] == before["memo_hits"]


def test_encoded_contexts_of_alternating_paths_stay_apart(program: Path, tmp_path: Path) -> None:
    """Encoded and aggregated in the kernel (as ``trace`` and the daemon run it): a sample whose
    pcs equal the previous one's reuses its encoding and skips the arena compare, one whose pcs equal
    one of the CPU's recent chains (the chain cache) is counted at that chain's verified entry, any
    other is encoded afresh.  The two paths are two contexts of N/2 samples each, whichever way
    they came."""
    from conftest import require_bpf

    require_bpf()
    with encoded_sampler(program, tmp_path, [NR_WRITE]) as s:
        s.attach()
        before = s.stats()
        run(s, program)
        after = s.stats()
        counts = sorted(s.counts().values())
    same = after["same_as_previous"] - before["same_as_previous"]
    cached = after["chain_cache_hits"] - before["chain_cache_hits"]
    by_way = after["memo_counted"] - before["memo_counted"]
    assert counts == [N // 2, N // 2], counts
    # A A B B A A ...: the first A and the first B are encoded, their repeats reuse the previous
    # sample's encoding.  From the second A on, the first of each pair starts where the other path's
    # chain (kept in the same memo way: both start in leaf's state) did, is unwound afresh and found
    # in the chain cache; its repeat's whole chain is then that way's, counted at the entry the way
    # remembers from the first.
    assert N - 4 <= same + cached + by_way <= N - 2, (same, cached, by_way)
    assert N // 2 - 4 <= cached <= N // 2 and N // 2 - 4 <= by_way <= N // 2, (cached, by_way)


PHASES_SOURCE = SOURCE.replace("""    for (long i = 0; i < n; i++) {""",
                               """    for (long i = 0; i < 2 * n; i++) {
        if (i == n) {  /* between the phases: wait while the test removes the counts entries */
            write(1, "mid\\n", 4);
            if (read(0, &c, 1) != 1)
                return 1;
        }""")


def test_chain_cache_counts_only_at_the_entry_it_verified(tmp_path: Path) -> None:
    """The chain cache counts a repeated chain at the counts entry its context was verified at, and
    only while that entry is still there at the same arena offset.  Mid-run, with the process's
    chains in the cache, every counts entry is removed (nothing in ccprofd removes one; this is
    what the check guards): the second phase's samples must be counted afresh -- two new entries of
    N/2 each, none counted at (or lost with) the entries that are gone."""
    from conftest import require_bpf

    require_bpf()
    assert PHASES_SOURCE != SOURCE
    binary = compile_c(tmp_path, "phases", PHASES_SOURCE, "-O1", "-fno-omit-frame-pointer", "-fno-inline")
    with encoded_sampler(binary, tmp_path, [NR_WRITE]) as s:
        s.attach()
        with between_phases(s, [str(binary), str(N)]) as p:
            drain(s, p.pid)
            phase1 = sorted(s.counts().values())
            mid = s.stats()
            s.module.map("uw_counts").clear()
        drain(s, p.pid)
        after = s.stats()
        counts = sorted(s.counts().values())
    assert phase1 == [1, N // 2, N // 2], phase1  # A, B and the "mid" line
    # both caches were in use after (see test_encoded_contexts_of_alternating_paths_stay_apart)
    assert after["chain_cache_hits"] - mid["chain_cache_hits"] >= N // 2 - 4
    assert after["memo_counted"] - mid["memo_counted"] >= N // 2 - 4
    assert counts == [N // 2, N // 2], counts
    assert after["new_contexts"] - mid["new_contexts"] == 2


TWO_CALLS_SOURCE = r"""
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#define NOI __attribute__((noinline, noclone))

/* one syscall instruction, two syscalls: W W G G W W ... (write to fd -1, getppid), each followed
   by a write from libc's wrapper (another chain, so no sample is the same as the one before it) */
NOI long leaf(long nr) {
    long ret;
    asm volatile("syscall" : "=a"(ret) : "0"(nr), "D"(-1L) : "rcx", "r11", "memory");
    return ret;
}
NOI long mid(long nr) { long r = leaf(nr); asm volatile("" ::: "memory"); return r + 1; }

int main(int argc, char **argv) {
""" + WAIT_FOR_RELEASE + r"""    for (long i = 0; i < n; i++) {
        mid(((i >> 1) & 1) ? SYS_getppid : SYS_write);
        if (write(-1, "", 0) != -1)
            return 1;
    }
    return 0;
}
"""


def test_a_memo_way_counts_only_the_syscall_it_verified(tmp_path: Path) -> None:
    """Two syscalls made from one instruction with the whole chain unchanged: the second starts in
    the state the first's memo way did and its whole chain is that way's, but its context is another
    (the syscall is part of it).  The way's remembered entry is for the first syscall only, so each
    syscall's samples are counted under its own context: N/2 each, and the libc write between them
    N; the repeats counted by their ways."""
    from conftest import require_bpf

    require_bpf()
    nr_getppid = 110
    binary = compile_c(tmp_path, "two_calls", TWO_CALLS_SOURCE, "-O1", "-fno-omit-frame-pointer",
                       "-fno-inline")
    with encoded_sampler(binary, tmp_path, [NR_WRITE, nr_getppid]) as s:
        s.attach()
        before = s.stats()
        run_released(s, [str(binary), str(N)], lambda pid: None)
        after = s.stats()
        counts = sorted(s.counts().values())
    d = {k: after[k] - before[k] for k in ("memo_chains", "memo_counted", "same_as_previous")}
    # every sample of the loop but the first of each path is its way's whole chain; the first W or
    # G after the other syscall is not counted by the way (it remembers the other's entry)
    assert d["memo_chains"] >= 2 * N - 4, d
    assert N + N // 2 - 4 <= d["memo_counted"] <= N + N // 2, d
    assert d["same_as_previous"] <= 2, d
    # the loop's two syscalls from mid (N/2 each) and the libc write (N)
    assert counts == [N // 2, N // 2, N], counts
