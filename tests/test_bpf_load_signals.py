"""A BPF program load interrupted by a stop.  The kernel's verifier gives up with EAGAIN when the
loading process is stopped in the middle (SIGSTOP, Ctrl-Z's SIGTSTP, a debugger's or profiler's
attach: ``py-spy record`` on ``ccprofd trace`` failed every time, "loading probe program uw_sys_tp
[...]: Resource temporarily unavailable").  The unwinder's programs take tens of milliseconds to
verify, so they are the exposed ones.  ccprofd loads again, as libbpf does
(rawbpf.PROG_LOAD_ATTEMPTS)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Loads the unwinder's programs twice; before each large program's first attempt (not a retry) it
#: says so on stdout ("load"), so the test stops it for a moment while the verifier works; at the
#: end, the loads the kernel refused with EAGAIN and the samplers that failed.
LOADER = r"""
import errno, sys
from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.abi import BPF_PROG_LOAD
real = rawbpf.bpf
eagain = 0
retrying = set()  # programs whose last attempt was refused with EAGAIN
def spy(cmd, attr, what):
    global eagain
    if cmd == BPF_PROG_LOAD and attr.insn_cnt > 3000 and what not in retrying:
        print("load", flush=True)
    retrying.discard(what)
    try:
        return real(cmd, attr, what)
    except rawbpf.BPFSyscallError as exc:
        if cmd == BPF_PROG_LOAD and exc.errno == errno.EAGAIN:
            eagain += 1
            retrying.add(what)
        raise
rawbpf.bpf = spy
from ccprofd.tracing.unwind.sampler import UnwindSampler
failed = 0
for _ in range(2):
    try:
        with UnwindSampler(syscalls=[1], encoding=None) as s:
            s.verified_insns()
    except rawbpf.BPFSyscallError as exc:
        failed += 1
        print("error", exc, flush=True)
print("done", eagain, failed, flush=True)
"""


def test_the_unwinders_load_survives_a_stop_during_verification() -> None:
    """Each large program's first load is stopped once (SIGSTOP, then SIGCONT 10 ms later), 5 ms
    in: every sampler must come up, and the kernel must really have refused some load with EAGAIN
    (else nothing was tested)."""
    from conftest import require_bpf

    require_bpf()
    proc = subprocess.Popen([sys.executable, "-c", LOADER], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("load"):
            time.sleep(0.005)  # (the verifier takes tens of milliseconds on these programs)
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.01)
            os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=300) == 0, lines
    done = lines[-1].split()
    assert done[0] == "done", lines
    eagain, failed = int(done[1]), int(done[2])
    assert failed == 0, lines
    assert eagain >= 1, lines
