"""Issue #18 (per-sample cost): the cheaper paths of the unwinder report what the expensive ones did.

* the six syscall argument registers, now read from pt_regs in one copy, are the values the
  program passed (known here: the test chooses them);
* the work counters (``uw_stats``) show the page index and the two-mapping cache at work: a frame
  costs at most a couple of rule-search steps (a full binary search over python3.11's 64k rows
  takes ~16), and a stack that goes libc -> python3.11 -> libc -> python3.11 searches the mappings
  twice, not four times -- and only in a thread's first sample: the mapping and rule caches stay
  valid while the process's mappings are the same upload (uw_proc.gen), so later samples of the
  loop search none.  The frames themselves are checked against gdb in test_unwind_programs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from bpf_helpers import WAIT_FOR_RELEASE, between_phases, drain, encoded_sampler, run_released

from ccprofd.tracing.unwind.sampler import UnwindSampler, UnwoundSample

NR_WRITE, NR_SENDTO = 1, 44
PYTHON = "/usr/bin/python3.11"
# 200 writes from two Python functions (issue #18's loop, shorter)
WRITE_LOOP = ("import os\nfd = os.open('/dev/null', os.O_WRONLY)\n"
              "def inner():\n    for _ in range(200):\n        os.write(fd, b'x')\n"
              "def outer():\n    inner()\n")


@pytest.fixture(scope="module")
def sampler() -> Iterator[UnwindSampler]:
    from conftest import require_bpf

    require_bpf()
    with UnwindSampler(syscalls=[NR_SENDTO, NR_WRITE], max_depth=4096) as s:
        s.attach()
        yield s


def run_tracked(s: UnwindSampler, setup: str, body: str) -> list[UnwoundSample]:
    """Run ``setup`` then ``body`` in python3.11, tracked from the end of ``setup`` (every module it
    needs is mapped by then: samples never meet a mapping loaded after ``track``); its samples."""
    code = f"import sys\n{setup}\nsys.stdout.write('ready\\n')\nsys.stdout.flush()\nsys.stdin.read(1)\n{body}"
    return run_released(s, [PYTHON, "-c", code])[0]


def test_syscall_argument_registers_are_the_values_passed(sampler: UnwindSampler) -> None:
    """sendto(fd, buf, len, flags, addr, addrlen) with six distinct values (a bad fd: it fails
    with EBADF before using any): rdi rsi rdx r10 r8 r9 in that order."""
    want = (977, 0x1000, 5, 0x40, 0x2000, 16)
    setup = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)"
    body = f"assert libc.syscall({NR_SENDTO}, *[ctypes.c_long(v) for v in {want!r}]) == -1\n"
    samples = [x for x in run_tracked(sampler, setup, body) if x.syscall == NR_SENDTO]
    assert len(samples) == 1, samples
    assert samples[0].complete, samples[0].reason
    assert samples[0].sargs == want


def test_rule_search_steps_and_mapping_searches_per_sample(sampler: UnwindSampler) -> None:
    """Every frame unwound (the per-thread memo off: it would skip most of them, see below)."""
    sampler.set_memo("off")
    try:
        before = sampler.stats()
        samples = [x for x in run_tracked(sampler, WRITE_LOOP, "outer()\n") if x.syscall == NR_WRITE]
        after = sampler.stats()
    finally:
        sampler.set_memo("on")
    d = {k: after[k] - before[k] for k in ("samples", "frames", "lookup_steps", "map_searches", "incomplete")}
    assert d["samples"] == 200 and d["incomplete"] == 0, d
    assert samples and all(x.complete for x in samples)
    # python3.11's frames run through libc's write and start in libc's __libc_start_call_main and
    # python3.11's _start: two module switches back to a module seen before
    assert d["frames"] / d["samples"] >= 8, d
    assert d["lookup_steps"] <= 2 * d["frames"], d
    # the two mappings, searched in the first sample only (kept: same process, same upload); a
    # few more if the thread's samples ran on both CPUs (each CPU's slot has its own caches)
    assert 2 <= d["map_searches"] <= 2 * (os.cpu_count() or 1), d


def test_memo_takes_the_outer_frames_of_a_repeated_stack(sampler: UnwindSampler) -> None:
    """The loop's stacks repeat: after the first sample, each frame but the innermost comes from
    the thread's memo (its slots re-read and unchanged), so a sample searches one mapping (frame
    0's) and no rule table beyond frame 0's; the frames are those of the memo-off run above."""
    before = sampler.stats()
    samples = [x for x in run_tracked(sampler, WRITE_LOOP, "outer()\n") if x.syscall == NR_WRITE]
    after = sampler.stats()
    d = {k: after[k] - before[k] for k in ("samples", "frames", "lookup_steps", "map_searches", "incomplete",
                                           "memo_hits", "memo_frames", "memo_rejects")}
    assert d["samples"] == 200 and d["incomplete"] == 0, d
    assert samples and all(x.complete for x in samples)
    assert d["memo_hits"] >= d["samples"] - 1, d
    # all but at most two frames of each sample after the first (frame 0 is always unwound)
    assert d["memo_frames"] >= d["frames"] - 2 * d["samples"] - d["frames"] // d["samples"], d
    # frame 0's mapping is the one its slot's cache kept from the previous sample
    assert d["map_searches"] <= 2 * (os.cpu_count() or 1), d
    assert d["lookup_steps"] < d["frames"] // 4, d


def test_encoding_pass_searches_a_bucket_of_functions(tmp_path: Path) -> None:
    """The encoding pass (python3.11 analysed, as `trace` runs it) finds each analysed frame's
    function in its page-index bucket and reuses the two cached mappings: at most a couple of
    function-search steps per frame on top of the rule-search steps (a search over python3.11's
    ~3,200 functions takes ~12), and, as without the encoding, the two mappings searched in the
    first sample only."""
    from conftest import require_bpf

    require_bpf()
    with encoded_sampler(PYTHON, tmp_path, [NR_WRITE]) as s:
        s.attach()
        s.set_memo("off")  # the encoding pass's own searches, over every frame
        before = s.stats()
        run_tracked(s, WRITE_LOOP, "outer()\n")
        after = s.stats()
    d = {k: after[k] - before[k] for k in ("samples", "frames", "lookup_steps", "map_searches", "incomplete")}
    assert d["samples"] == 200 and d["incomplete"] == 0, d
    assert d["lookup_steps"] <= 4 * d["frames"], d
    assert 2 <= d["map_searches"] <= 2 * (os.cpu_count() or 1), d


PHASES_SOURCE = r"""
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
int main(int argc, char **argv) {
""" + WAIT_FOR_RELEASE + r"""    for (long i = 0; i < 2 * n; i++) {
        if (i == n) {  /* between the phases: wait while the test replaces the mappings */
            write(1, "mid\n", 4);
            if (read(0, &c, 1) != 1)
                return 1;
        }
        syscall(SYS_write, -1L, (void *)0, i);  /* fails (EBADF); rdx = i tells the phase */
    }
    return 0;
}
"""


def test_kept_caches_follow_the_upload_of_the_mappings(sampler: UnwindSampler, tmp_path: Path) -> None:
    """The mapping and rule caches kept between a process's samples are valid for one upload of its
    mappings (uw_proc.gen) only.  Mid-run the process's BPF mappings are replaced by an upload that
    has none (n = 0, a new gen): from the next sample on, every sample must find no mapping
    (incomplete, unknown pc) -- a cache kept across that upload would still resolve the repeated
    stack from the mappings cached before, and report those samples complete."""
    from bpf_helpers import compile_c

    n = 200
    binary = compile_c(tmp_path, "phases", PHASES_SOURCE, "-O1")
    with between_phases(sampler, [str(binary), str(n)]) as p:
        procs = sampler.module.map("uw_procs")
        entry = procs.get(p.pid)
        assert entry is not None and entry.n > 0 and entry.gen != 0
        entry.n = 0
        entry.gen = (entry.gen + 0x10000) % 0xFFFFFFFF + 1  # an upload number the tracker never gave
        procs.set(p.pid, entry)
    got: list[UnwoundSample] = drain(sampler, p.pid)
    ours = [x for x in got if x.syscall == NR_WRITE and x.sargs is not None and x.sargs[0] == (1 << 64) - 1]
    before = [x for x in ours if x.sargs is not None and x.sargs[2] < n]
    after = [x for x in ours if x.sargs is not None and x.sargs[2] >= n]
    assert len(before) == n and len(after) == n, (len(before), len(after))
    assert all(x.complete for x in before), {x.reason for x in before}
    complete_after = [x.sargs[2] for x in after if x.complete and x.sargs is not None]
    assert not complete_after, f"{len(complete_after)} samples resolved with the replaced mappings"
    assert {x.reason for x in after} <= {"unknown_pc", "no_maps"}, {x.reason for x in after}
