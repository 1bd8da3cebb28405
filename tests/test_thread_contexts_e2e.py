"""``GetThreadContexts`` end to end: the real ``ccprofd run`` on a config naming
tests/programs/blocked.c (four threads blocked at known depths: read, nanosleep, read inside a signal
handler, the main thread's read), ``ccprofctl contexts PID --format json`` over the real Unix
socket, and every thread's frames compared with what gdb -- attached afterwards, the threads still
blocked where they were -- walks for that thread: the same frames (from the outermost analysed
one down, as in a sample; gdb's start-up frames above it are checked to be unanalysed), modules, each
return address at gdb's pc, each analysed frame's name gdb's, and each analysed caller's
``call_site`` the ``call`` instruction objdump lists right before that return address, calling the
next frame's function.  Then the program is released and must print what it prints untraced (no
EINTR, the sleep not cut short) and exit 0.  Unwind mode (default) and instrumented mode.  And the
frames equal, thread by thread, the JSON frames ``ccprofd trace`` (unwind mode) sampled at the
entry of the syscall each thread is blocked in: the same stack, the tracer's own frame contract.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import direct_call_sites, pt_loads
from conftest import require_tool
from daemon_fakes import config_text, wait_for
from daemon_harness import ROOT, RunningDaemon, target_toml
from test_userstack import EXPECTED_OUTPUT, all_blocked, blocked_program, release

from ccprofd.proc.threadsnap import tracer_of

DEPTH = 6


def ctl(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli.ctl", "--socket", sock, *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def ctl_targets(daemon: RunningDaemon) -> list[dict[str, Any]]:
    """``ccprofctl targets --json`` of a running daemon (empty while its socket does not answer)."""
    daemon.check_running()
    out = ctl(daemon.socket_path, "targets", "--json")
    return json.loads(out.stdout) if out.returncode == 0 else []  # type: ignore[no-any-return]


def vaddr_of(module: str, offset: int) -> int:
    """File offset -> ELF vaddr through the PT_LOAD segments (readelf)."""
    for vaddr, filesz, off in pt_loads(Path(module)):
        if off <= offset < off + filesz:
            return offset - off + vaddr
    raise AssertionError(f"offset {offset:#x} not in a PT_LOAD of {module}")


def check_thread(frames: list[dict[str, object]], gdb_frames: list[object], binary: Path,
                 calls: dict[int, tuple[int, str]]) -> None:
    """One thread's JSON frames (outermost first) against gdb's walk (innermost first)."""
    real_binary = os.path.realpath(binary)
    want = list(reversed(gdb_frames))
    # as in a sample, the frames begin at the outermost analysed one: gdb's start-up frames above it
    # (_start, __libc_start_main, start_thread, clone3) are left out, and only those
    cut = len(want) - len(frames)
    assert cut >= 0, ([f["function"] for f in frames], [g.name for g in want])  # type: ignore[attr-defined]
    for g in want[:cut]:
        assert os.path.realpath(g.module) != real_binary or g.name == "_start", g  # type: ignore[attr-defined]
    want = want[cut:]
    assert frames[0]["analysed"] is True
    for i, (f, g) in enumerate(zip(frames, want, strict=True)):
        exact = i == len(want) - 1 or want[i + 1].sigtramp  # type: ignore[attr-defined]
        module = os.path.realpath(g.module)  # type: ignore[attr-defined]
        assert f["module"] is not None and os.path.realpath(str(f["module"])) == module
        v = vaddr_of(module, g.offset)  # type: ignore[attr-defined]
        if exact:
            assert f["return_address"] is None
        else:
            assert f["return_address"] == f"{v:#x}", (i, f, g)
        if module != real_binary or g.name == "_start":  # type: ignore[attr-defined]
            assert f["analysed"] is False and f["call_site"] is None
            continue
        assert f["analysed"] is True and f["function"] == g.name, (f, g)  # type: ignore[attr-defined]
        if exact:
            assert f["call_site"] == f"{v:#x}"
            continue
        site, callee = calls[v]  # objdump: the call right before this return address
        assert f["call_site"] == f"{site:#x}"
        inner = frames[i + 1]
        if callee.endswith("@plt"):  # into a library (whose name may be an alias: raise/gsignal)
            assert inner["analysed"] is False and inner["module"] != f["module"]
        else:
            assert callee == inner["function"]


@pytest.mark.parametrize("mode,variant", [
    pytest.param("unwind", {"opt": "O2", "frame_pointer": False}, id="unwind-O2-omit-frame-pointer"),
    pytest.param("instrumented", {"opt": "O0"}, id="instrumented-O0"),
])
def test_contexts_equal_gdb(bpf: None, workdir: str, mode: str, variant: dict[str, object]) -> None:
    from gdb_threads import gdb_threads

    require_tool("gdb")
    with blocked_program(DEPTH, **variant) as prog:
        binary = Path(os.readlink(f"/proc/{prog.pid}/exe"))
        target = target_toml("blocked", f'path = "{binary}"', ["getppid"], mode)
        with RunningDaemon(workdir, config_text(workdir, target)) as daemon:
            sock = daemon.socket_path
            wait_for(lambda: any(p["pid"] == prog.pid for t in ctl_targets(daemon)
                                 for p in t.get("processes", [])), timeout=300)
            wait_for(lambda: all_blocked(prog.pid), timeout=60)
            out = ctl(sock, "contexts", str(prog.pid), "--format", "json")
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            assert doc["pid"] == prog.pid and doc["target"] == "blocked" and doc["mode"] == mode
            text = ctl(sock, "contexts", str(prog.pid))
            assert text.returncode == 0
            assert f"pid {prog.pid} (target blocked, {mode} mode): 4 threads" in text.stdout

            wait_for(lambda: all_blocked(prog.pid), timeout=60)
            gdb = gdb_threads(prog.pid)
            assert sorted(gdb) == sorted(t["tid"] for t in doc["threads"])
            calls = {c.vaddr + 5: (c.vaddr, c.target) for c in direct_call_sites(binary)}  # e8 rel32: 5 bytes
            chains = set()
            for t in doc["threads"]:
                assert t["complete"] is True and t["reason"] is None
                check_thread(t["frames"], list(gdb[t["tid"]].frames), binary, calls)
                chains.add(tuple(f["function"] for f in t["frames"] if f["analysed"]))
            for fn in ("down_read", "down_sleep", "down_sig", "down_main"):
                assert any(fn in c for c in chains), (fn, chains)
            if variant["opt"] == "O0":  # at -O0 every level of the recursion is a frame
                assert any(c.count("down_sig") == DEPTH + 1 and "on_usr2" in c and "handler_main" in c
                           for c in chains)

            # ptrace refused (strace holds the process): one line saying so, non-zero exit
            strace = require_tool("strace")
            tracer = subprocess.Popen([strace, "-qq", "-o", "/dev/null", "-p", str(prog.pid)],
                                      stderr=subprocess.DEVNULL)
            try:
                wait_for(lambda: tracer_of(prog.pid) == tracer.pid, timeout=60)
                refused = ctl(sock, "contexts", str(prog.pid))
                assert refused.returncode != 0 and "Traceback" not in refused.stderr
                assert f"already traced by pid {tracer.pid} (strace)" in refused.stderr
                assert len(refused.stderr.strip().splitlines()) == 1
            finally:
                tracer.terminate()
                tracer.wait()
            unknown = ctl(sock, "contexts", "1")
            assert unknown.returncode != 0 and "pid 1" in unknown.stderr
            wait_for(lambda: all_blocked(prog.pid), timeout=60)
            assert release(prog) == (EXPECTED_OUTPUT, 0)
            daemon.stop().assert_clean()


def test_snapshot_frames_equal_the_tracers_samples_of_the_same_stacks(bpf: None, tmp_path: Path) -> None:
    """The frame contract is the tracer's: while ``ccprofd trace`` (unwind mode) runs blocked.c, each
    thread's last sample -- taken at the entry of the read/nanosleep it then blocks in, i.e. on the
    very stack it is blocked with -- must carry the same JSON frames as a snapshot of that thread."""
    from test_userstack import programs

    from ccprofd.tracing.threadcontexts import ContextReader

    exe = programs.build("blocked", opt="O2", frame_pointer=False)
    out = tmp_path / "samples.jsonl"
    trace = subprocess.Popen([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind",
                              "--syscalls", "read,clock_nanosleep", "--format", "jsonl", "--output", str(out),
                              "--", str(exe), "4"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert trace.stdout is not None and trace.stdin is not None
        line = trace.stdout.readline()
        assert line.startswith("ready "), trace.stderr.read() if trace.stderr else line
        pid = int(line.split()[1])
        wait_for(lambda: all_blocked(pid), timeout=120)

        def last_samples() -> dict[int, dict[str, object]]:
            last: dict[int, dict[str, object]] = {}
            for row in out.read_text().splitlines() if out.exists() else []:
                s = json.loads(row)
                last[s["tid"]] = s
            blocking = {t: s for t, s in last.items() if s["syscall"] in ("read", "clock_nanosleep")}
            return blocking if len(blocking) == 4 else {}

        # every thread is blocked in its last syscall now, so the snapshot is final; the tracer may
        # not have written those last samples yet (main's earlier usleep sample can still be its
        # last line): wait until they are there, then compare in full
        snap = ContextReader(str(exe)).read(pid)
        assert snap["error"] is None

        def matching() -> dict[int, dict[str, object]]:
            last = last_samples()
            same = all(t["tid"] in last and last[t["tid"]]["frames"] == t["frames"] for t in snap["threads"])
            return last if same else {}

        try:
            samples = wait_for(matching, timeout=60)
        except AssertionError:
            samples = wait_for(last_samples, timeout=60)  # differing for good: the asserts below say how
        assert sorted(samples) == sorted(t["tid"] for t in snap["threads"])
        for t in snap["threads"]:
            s = samples[t["tid"]]
            assert s["complete"] is True and t["complete"] is True
            assert t["frames"] == s["frames"], t["tid"]
        assert any(f["function"] == "on_usr2" for t in snap["threads"] for f in t["frames"])
        stdout, _ = trace.communicate("go\n", timeout=300)
        assert (stdout, trace.returncode) == (EXPECTED_OUTPUT, 0)
    finally:
        if trace.poll() is None:
            trace.kill()
            trace.wait()
