"""The traced command starts as its shell would have started it: default signal dispositions.

Python ignores SIGPIPE and SIGXFSZ, and an ignored disposition survives ``exec``; a command that
ccprofd launched with them ignored behaves differently from an untraced one (``yes | head`` loops
on EPIPE instead of dying by SIGPIPE).  Checked from the kernel's side (``SigIgn`` in
``/proc/PID/status``) and by the pipeline's outcome.
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import pytest
from conftest import require_bpf

REPO = pathlib.Path(__file__).resolve().parent.parent


def _trace_argv(*cmd: str) -> list[str]:
    return [sys.executable, "-m", "ccprofd.cli", "trace", "--syscalls", "getppid", "--output", "/dev/null",
            "--", *cmd]


@pytest.mark.bpf
def test_traced_command_ignores_no_signal() -> None:
    require_bpf()
    proc = subprocess.run(_trace_argv("/bin/sh", "-c", "grep SigIgn /proc/self/status"), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    ignored = int(proc.stdout.split()[1], 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        assert not ignored & (1 << (sig - 1)), f"{sig.name} ignored in the traced command: {proc.stdout}"


@pytest.mark.bpf
def test_broken_pipe_ends_the_command_by_sigpipe() -> None:
    require_bpf()
    tracer = subprocess.Popen(_trace_argv("/usr/bin/yes"), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert tracer.stdout is not None and tracer.stderr is not None
    assert tracer.stdout.readline() == b"y\n"
    tracer.stdout.close()  # the reader goes away, as `head -1` would
    err = tracer.stderr.read().decode()
    assert tracer.wait(timeout=600) == 128 + signal.SIGPIPE, err
    assert "Broken pipe" not in err
