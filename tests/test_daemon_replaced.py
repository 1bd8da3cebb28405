"""End to end with real BPF: a ``path`` target's file replaced in place (``cp new old``: the same
inode, other bytes) while the daemon runs (issue 15).

Before, the daemon never noticed: its build-id stayed the old one in ``ListTargets``, every new
process of an instrumented target died with SIGSEGV (its uprobes went in at the old build's
offsets), and an unwind target reported the new build's samples as ``frames: []``,
``complete: true``.  Now the daemon holds each exec of a watched file (fanotify permission event)
until the probes and tables in place are the ones planned for the bytes being exec'd, so every
process of the new build runs unharmed and its samples name the new build's functions.

Expected frames come from the two programs' sources (version B's getppid is reached by main >
b_outer > b_leaf), the expected build-id from ``readelf -n``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from bpf_helpers import compile_c
from conftest import require_tool
from daemon_fakes import wait_for
from daemon_harness import SampleStream
from test_daemon_newprocs import PROGRAM as VERSION_A
from test_daemon_newprocs import start_daemon, warm_up

N = 6
# Another build: other functions, other sizes, so every offset of version A is wrong for it.
VERSION_B = r"""
#include <unistd.h>
#include <sys/syscall.h>
volatile long sink;
__attribute__((noinline)) long b_leaf(int k) { sink += k; return syscall(SYS_getppid); }
__attribute__((noinline)) long b_pad(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += i * sink;
    return s;
}
__attribute__((noinline)) long b_outer(int n) {
    long s = b_pad(n);
    for (int i = 0; i < n; i++) s += b_leaf(i);
    return s;
}
int main(void) { return b_outer(N) > 0 ? 0 : 1; }
""".replace("(N)", f"({N})")


def build_id(path: Path) -> str:
    out = subprocess.run([require_tool("readelf"), "-n", str(path)], check=True, capture_output=True,
                         text=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert m, out
    return m.group(1)


@pytest.mark.parametrize("mode", ["instrumented", "unwind"])
def test_binary_replaced_in_place_is_replanned_before_it_runs(bpf: None, workdir: str, tmp_path: Path,
                                                              mode: str) -> None:
    a = compile_c(tmp_path, "version_a", VERSION_A, "-O1", "-fno-omit-frame-pointer")
    b = compile_c(tmp_path, "version_b", VERSION_B, "-O1", "-fno-omit-frame-pointer")
    assert build_id(a) != build_id(b)
    target = tmp_path / "target"
    shutil.copy2(a, target)
    inode = target.stat().st_ino
    with start_daemon(workdir, target, mode) as daemon:
        stream = SampleStream(daemon.stub, "prog")
        try:
            warm: list[int] = []
            wait_for(lambda: warm_up(target, stream, warm), timeout=120, interval=0.2)
            shutil.copyfile(b, target)  # cp new old: truncated and rewritten in place
            assert target.stat().st_ino == inode
            runs = []
            for _ in range(4):  # at once: no time for a rescan to notice first
                p = subprocess.Popen([str(target)])
                try:
                    status: int | str = p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    status = "hung"
                assert status == 0, f"run of the replaced binary: status {status}\n{daemon.log()}"
                runs.append(p.pid)

            def sampled() -> bool:
                return all(sum(s.syscall == "getppid" for s in stream.of(pid)) >= N for pid in runs)

            try:
                wait_for(sampled, timeout=120, interval=0.2)
            except AssertionError:
                got = {pid: [(s.syscall, s.complete, len(s.frames)) for s in stream.of(pid)] for pid in runs}
                raise AssertionError(f"runs not sampled: {got}\n{daemon.log()}") from None
            # The runs made during the re-plan: each sample is the new build's context, or flagged
            # (unwind mode may adopt a held process as a running one); never a wrong complete one.
            for pid in runs:
                inner = [s for s in stream.of(pid) if s.syscall == "getppid"]
                assert len(inner) == N
                for s in inner:
                    chain = [(f.function, f.module) for f in s.frames if f.analysed]
                    assert not s.complete or [fn for fn, _ in chain] == ["main", "b_outer", "b_leaf"], \
                        (pid, s.complete, chain)
                    assert not s.complete or {m for _, m in chain} == {str(target)}
            if mode == "instrumented":  # the gate held each exec until the new plan was attached
                assert all(s.complete for pid in runs for s in stream.of(pid) if s.syscall == "getppid")
            assert "was rewritten" in daemon.log() and "no exec gate" not in daemon.log()
            listed = daemon.targets()
            assert listed is not None
            assert {bi.build_id for bi in listed.targets[0].binaries} == {build_id(b)}, listed
            # once re-planned, a run is exact
            p = subprocess.Popen([str(target)])
            assert p.wait(timeout=60) == 0
            wait_for(lambda: sum(s.syscall == "getppid" for s in stream.of(p.pid)) >= N, timeout=120,
                     interval=0.2)
            for s in stream.of(p.pid):
                if s.syscall == "getppid":
                    assert s.complete and [f.function for f in s.frames if f.analysed] == \
                        ["main", "b_outer", "b_leaf"], s
        finally:
            stream.close()
        daemon.stop().assert_clean()


def test_exec_gate_holds_each_exec_until_checked_and_reports_rewrites(tmp_path: Path) -> None:
    """The gate alone (no BPF): an exec of a watched file waits in the kernel until ``check``
    returns, with the identity of the file as exec'd; a rewrite's close calls ``changed``."""
    import os
    import threading

    from ccprofd.daemon.filewatch import ExecGate, file_identity

    exe = tmp_path / "true-copy"
    shutil.copy2("/bin/true", exe)
    release = threading.Event()
    checked: list[tuple[object, int]] = []
    changed: list[object] = []

    def check(ident: object, pid: int) -> None:
        checked.append((ident, pid))
        release.wait(60)

    gate = ExecGate(check, changed.append)
    try:
        gate.start()
    except OSError as exc:
        pytest.skip(f"fanotify permission events unavailable: {exc}")
    try:
        gate.watch(str(exe))
        # from a grandchild: the gate never holds this process's own children (its helpers)
        p = subprocess.Popen(["/bin/sh", "-c", f"{exe}; true"])
        wait_for(lambda: bool(checked), timeout=60, interval=0.05)
        assert checked[0][0] == file_identity(str(exe)) and checked[0][1] != p.pid
        assert p.poll() is None  # still waiting at its child's exec
        release.set()
        assert p.wait(timeout=60) == 0
        with open(exe, "r+b") as fh:  # rewritten in place (same bytes: the close is what counts)
            fh.write(fh.read(4))
        wait_for(lambda: bool(changed), timeout=60, interval=0.05)
        assert changed[0] == file_identity(str(exe))
        assert os.stat(exe).st_ino == changed[0].ino  # type: ignore[attr-defined]
    finally:
        release.set()
        gate.close()


@pytest.mark.parametrize("mode", ["instrumented", "unwind"])
def test_daemon_traces_a_copy_of_an_analysed_binary_at_its_own_path(bpf: None, workdir: str, tmp_path: Path,
                                                                     mode: str) -> None:
    """The daemon's cache already holds the plans of the same bytes at another path (a ``trace``
    of the original with the daemon's cache directory): a ``path`` target on the copy must probe
    and name the copy (before: every sample ``frames: []``, or the original's module)."""
    import sys

    original = compile_c(tmp_path, "original", VERSION_A, "-O1", "-fno-omit-frame-pointer")
    copy = tmp_path / "copy"
    shutil.copy2(original, copy)
    cache = Path(workdir) / "state" / "cache"
    subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--cache-dir", str(cache), "--mode", mode,
                    "-e", "trace=getppid", "-o", str(tmp_path / "out.txt"), "--", str(original)],
                   check=True, capture_output=True, timeout=600)
    with start_daemon(workdir, copy, mode) as daemon:
        stream = SampleStream(daemon.stub, "prog")
        try:
            warm: list[int] = []
            wait_for(lambda: warm_up(copy, stream, warm), timeout=120, interval=0.2)
            p = subprocess.Popen([str(copy)])
            assert p.wait(timeout=60) == 0
            wait_for(lambda: sum(s.syscall == "getppid" for s in stream.of(p.pid)) >= 8, timeout=120,
                     interval=0.2)
            for s in stream.of(p.pid):
                if s.syscall == "getppid":  # main > work_a|work_b > leaf (test_daemon_newprocs.PROGRAM)
                    chain = [(f.function, f.module) for f in s.frames if f.analysed]
                    assert s.complete and [fn for fn, _ in chain] in (["main", "work_a", "leaf"],
                                                                      ["main", "work_b", "leaf"]), s
                    assert {m for _, m in chain} == {str(copy)}
        finally:
            stream.close()
        daemon.stop().assert_clean()
