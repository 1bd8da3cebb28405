"""Issue #18 (per-sample cost): the cheaper paths of the unwinder report what the expensive ones did.

* the six syscall argument registers, now read from pt_regs in one copy, are the values the
  program passed (known here: the test chooses them);
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from ccprofd.tracing.unwind.sampler import UnwindSampler, UnwoundSample

NR_SENDTO = 44
PYTHON = "/usr/bin/python3.11"


@pytest.fixture(scope="module")
def sampler() -> Iterator[UnwindSampler]:
    from conftest import require_bpf

    require_bpf()
    with UnwindSampler(syscalls=[NR_SENDTO], max_depth=4096) as s:
        s.attach()
        yield s


def run_tracked(s: UnwindSampler, code: str) -> list[UnwoundSample]:
    """Run ``code`` in python3.11, tracked from its first line on; its samples."""
    p = subprocess.Popen([PYTHON, "-c",
                          "import sys\nsys.stdin.read(1)\n" + code], stdin=subprocess.PIPE)
    assert p.stdin is not None
    s.track(p.pid)
    p.stdin.write(b"x")
    p.stdin.close()
    assert p.wait(timeout=60) == 0
    out: list[UnwoundSample] = []
    quiet = time.monotonic()
    while time.monotonic() - quiet < 0.3:
        got = s.poll(50)
        if got:
            quiet = time.monotonic()
            out.extend(x for x in got if x.tgid == p.pid)
    return out


def test_syscall_argument_registers_are_the_values_passed(sampler: UnwindSampler) -> None:
    """sendto(fd, buf, len, flags, addr, addrlen) with six distinct values (a bad fd: it fails
    with EBADF before using any): rdi rsi rdx r10 r8 r9 in that order."""
    want = (977, 0x1000, 5, 0x40, 0x2000, 16)
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"assert libc.syscall({NR_SENDTO}, *[ctypes.c_long(v) for v in {want!r}]) == -1\n")
    samples = [x for x in run_tracked(sampler, code) if x.syscall == NR_SENDTO]
    assert len(samples) == 1, samples
    assert samples[0].sargs == want
