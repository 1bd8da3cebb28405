"""The unwinder's verifier cost: how many instructions the kernel verifier processes to load the
syscall and CPU-sampling unwinders, for an encoding shaped like python3.11's (2 acycID words, 13-bit
recID codes, 7,574 functions) and a bigger one, and without an encoding.  The limit is 1,000,000
processed instructions: past it the program does not load at all.  Paths the verifier cannot prune
multiply that count (it was 677,494 for python3.11 while the binary searches' bounds split its
states), so each load must stay a wide margin below the limit, not merely under it."""

from __future__ import annotations

import os
import struct

import pytest

from ccprofd.kbpf import rawbpf
from ccprofd.tracing.unwind.plan import UnwindEncoding
from ccprofd.tracing.unwind.sampler import UnwindSampler

KERNEL_LIMIT = 1_000_000
MARGIN = 10  # each load processes at most a tenth of the limit


def _encoding(acyc_words: int, rec_code_bits: int, nfuncs: int) -> UnwindEncoding:
    """An encoding of the given shape; the verifier sees only its sizes (the maps' contents are data)."""
    return UnwindEncoding(binary={"path": "/nonexistent"}, plan_key=None, acyc_words=acyc_words,
                          rec_code_bits=rec_code_bits, nodes=list(range(nfuncs)), root_index=nfuncs,
                          functions=[[16 * i, 16 * i + 16, i, 0] for i in range(nfuncs)], edges={},
                          callsites={}, call_lengths={}, jump_sites=set())


@pytest.mark.parametrize("shape", [None, (2, 13, 7574), (8, 20, 1 << 16)],
                         ids=["unencoded", "python3.11-like", "bigger"])
def test_unwinder_loads_far_below_the_verifier_limit(shape: tuple[int, int, int] | None) -> None:
    from conftest import require_bpf, skip_or_fail

    require_bpf()
    enc = _encoding(*shape) if shape else None
    with UnwindSampler(syscalls=[1], encoding=enc) as s:
        counts = s.verified_insns()
        if not any(counts.values()):
            skip_or_fail("kernel does not report verified_insns (before 5.16)")
        for prog, n in counts.items():
            assert 0 < n < KERNEL_LIMIT // MARGIN, f"{prog}: the verifier processed {n} instructions"


def test_verified_insns_reads_the_kernels_count() -> None:
    """A program whose count is known by hand: 5 instructions, no branch, so the verifier processes
    each once."""
    from conftest import require_bpf, skip_or_fail

    require_bpf()

    def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
        return struct.pack("<BBhi", code, dst | src << 4, off, imm)

    prog = (insn(0xB7, 0, imm=0)      # r0 = 0
            + insn(0x07, 0, imm=1)     # r0 += 1
            + insn(0x07, 0, imm=2)     # r0 += 2
            + insn(0x57, 0, imm=1)     # r0 &= 1
            + insn(0x95))              # exit
    fd = rawbpf.prog_load(rawbpf.BPF_PROG_TYPE_SOCKET_FILTER, prog, name="ccprofd_vtest")
    try:
        n = rawbpf.prog_verified_insns(fd)
        if n == 0:
            skip_or_fail("kernel does not report verified_insns (before 5.16)")
        assert n == 5
    finally:
        os.close(fd)


@pytest.mark.parametrize("shape", [None, (2, 13, 7574)], ids=["unencoded", "python3.11-like"])
def test_the_flight_recorder_adds_little_verification(shape: tuple[int, int, int] | None) -> None:
    """The recorder (tracing/history.c) is a few stores at the end of the syscall sample, so it may
    add a few hundred processed instructions, not a second pass over the unwind loops: it once
    doubled them (11,139 -> 21,786 for a small target, ~+80 ms of every start-up) because its
    guard branched on the tracepoint's `regs`, which made that value precise and kept its NULL and
    non-NULL cases apart through every bpf_loop callback."""
    from conftest import require_bpf, skip_or_fail

    require_bpf()
    enc = _encoding(*shape) if shape else None
    counts = {}
    for length in (0, 256):
        with UnwindSampler(syscalls=[1], encoding=enc, history=length) as s:
            counts[length] = s.verified_insns()["uw_sys_enter"]
    if not counts[0]:
        skip_or_fail("kernel does not report verified_insns (before 5.16)")
    # (not strictly more: state pruning may even save a few, 64,796 without and 64,785 with it once)
    assert counts[0] * 0.95 < counts[256] < counts[0] * 1.1, counts
