"""Who removes the private vDSO copies (ccprofd/proc/vdso.py) that the stack walks outside BPF make
when the cache directory cannot be written: the :class:`ccprofd.proc.modules.ModuleCache` that made
them, closed by its owner -- a thread-snapshot reader at its tracer mode's close, attach-time seeding
when its one snapshot is done, ``--scope`` prefixes at the tracer's close.  Before, nothing closed
them and every snapshot reader, seeding and scoped run left a ``ccprofd-vdso-*.so`` in the temporary
directory for good.

The cache directory is made unwritable for root too by putting it under a regular file (mkdir
fails with ENOTDIR); the temporary directory is a fresh one (``TMPDIR``), so a file left there is
one of these copies and nothing else's."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from conftest import require_bpf, require_tool
from programs.build import build
from test_instrumented_seeding import _wait_line
from test_userstack import blocked_program

REPO = pathlib.Path(__file__).resolve().parent.parent
VDSO_COPY = "ccprofd-vdso-*.so"


def _copies(tmp: pathlib.Path) -> list[pathlib.Path]:
    return sorted(tmp.glob(VDSO_COPY))


@pytest.fixture
def unwritable_cache(tmp_path: pathlib.Path) -> pathlib.Path:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    return blocker / "cache"


@pytest.fixture
def private_tmp(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[pathlib.Path]:
    """A fresh temporary directory for this process (tempfile) and the commands it starts (TMPDIR)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp


def test_snapshot_reader_removes_its_copy_when_its_mode_closes(unwritable_cache: pathlib.Path,
                                                               private_tmp: pathlib.Path) -> None:
    """GetThreadContexts in unwind mode: the reader walks through a private copy (a thread blocked in
    a syscall has the vDSO nowhere on its stack, but its maps hold it), and the mode's close removes
    it; the reader is made again on a later request."""
    from ccprofd.tracing.api import TraceOptions
    from ccprofd.tracing.unwind.mode import UnwindMode

    exe = build("blocked", opt="O0")
    mode = UnwindMode(str(exe), TraceOptions(mode="unwind", cache_dir=str(unwritable_cache)))
    with blocked_program(4, opt="O0") as prog:  # every thread blocked in a syscall
        got = mode.thread_contexts(prog.pid)
        assert got["error"] is None and len(got["threads"]) == 4
        assert all(t["complete"] for t in got["threads"]), got
        assert len(_copies(private_tmp)) == 1  # the path under test was taken: one private copy, in use
        assert not unwritable_cache.exists()
        mode.close()
        assert _copies(private_tmp) == []
        assert mode.thread_contexts(prog.pid)["error"] is None  # usable again after close
        assert len(_copies(private_tmp)) == 1
        mode.close()
        assert _copies(private_tmp) == []


def test_attach_seeding_leaves_no_copy(unwritable_cache: pathlib.Path, private_tmp: pathlib.Path) -> None:
    """``trace --mode instrumented -p PID``: seeding stops the process once with its own module
    cache, which is closed as soon as the threads are seeded."""
    require_bpf()
    binary = build("seeding", opt="O0", pie=True)
    prog = subprocess.Popen([str(binary), "20", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert prog.stdin is not None and prog.stdout is not None
    tracer: subprocess.Popen[str] | None = None
    try:
        pid = int(_wait_line(prog.stdout, "ready", "the program").split()[1])
        tracer = subprocess.Popen(
            [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented", "--format", "jsonl",
             "--syscalls", "getppid", "--cache-dir", str(unwritable_cache), "--output",
             str(private_tmp.parent / "samples.jsonl"), "-p", str(pid)],
            cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(private_tmp)})
        assert tracer.stderr is not None
        line = _wait_line(tracer.stderr, "attached to pid", "ccprofd trace")
        assert "2 of 2 threads seeded" in line, line
        assert _copies(private_tmp) == []  # seeding is over: its copy is gone while the trace goes on
        prog.stdin.write("xx")
        prog.stdin.close()
        assert prog.stdout.read().strip().endswith("done")
        assert prog.wait(timeout=300) == 0
        err = tracer.stderr.read()
        assert tracer.wait(timeout=300) == 0, err
    finally:
        for p in (prog, tracer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert _copies(private_tmp) == []


def test_scope_prefixes_leave_no_copy(unwritable_cache: pathlib.Path, private_tmp: pathlib.Path,
                                      tmp_path: pathlib.Path) -> None:
    """``--scope``: the prefix walks keep their copy for the whole run (entries keep coming), and the
    tracer's close removes it.  The prefixes were made through it: samples in the scope complete."""
    require_bpf()
    require_tool("strace")
    from test_instrumented_scope_prefix import PER_ROUND, ROUNDS, in_scope, trace_scoped

    binary = build("scoped", opt="O0", pie=True)
    samples = trace_scoped(binary, tmp_path, [str(ROUNDS), "0"], "--scope", "^handler$", "--cache-dir",
                           str(unwritable_cache), env={"TMPDIR": str(private_tmp)})
    assert len(samples) == ROUNDS * PER_ROUND
    inside = [s for s in samples if in_scope(s)]
    assert inside and all(s["complete"] for s in inside)
    assert _copies(private_tmp) == []
