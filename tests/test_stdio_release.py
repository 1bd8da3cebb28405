"""Helper processes never hold the caller's stdio: when ``ccprofd trace`` exits, a caller reading
its output through a pipe sees EOF at once (the hold guard, which outlives ccprofd by a few seconds
to continue any process BPF still holds, gets /dev/null instead of the caller's stdout/stderr)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import require_bpf


def _holders(pipe_inode: int) -> list[int]:
    """Processes (other than this one) with a descriptor on the pipe ``pipe_inode``."""
    want = f"pipe:[{pipe_inode}]"
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                    out.append(int(pid))
                    break
            except OSError:
                continue
    return out


@pytest.mark.bpf
def test_no_helper_keeps_the_callers_pipe_open() -> None:
    require_bpf()
    proc = subprocess.Popen([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--syscalls",
                             "write", "--", "/bin/echo", "hi"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    inode = os.fstat(proc.stdout.fileno()).st_ino
    assert proc.wait(timeout=300) == 0
    # ccprofd has exited: nobody but us may still hold the pipe (the guard lives on for ~2 s)
    assert _holders(inode) == []
    assert b"hi" in proc.stdout.read()
