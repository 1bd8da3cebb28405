"""``ccprofd trace`` as a command: exit status pass-through, stdio, bad input, -p PID, CPU samples.

Expected values come from the test programs' sources and objdump, never from ccprofd's output.
"""

from __future__ import annotations

import bisect
import itertools
import json
import pathlib
import pwd
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from bpf_helpers import compile_c
from conftest import require_bpf, require_tool
from programs.build import build

REPO = pathlib.Path(__file__).resolve().parent.parent


INSTRUMENTED = ("--mode", "instrumented")  # these tests check instrumented-mode behaviour


def ccprofd(*args: str, timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, **kw)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and "Traceback" not in proc.stderr, proc.stderr
    return lines[-1]


def unprivileged_python() -> list[str]:
    """``python -m``-ready argv of this Python as user nobody: a system interpreter of the same
    version (the venv's may live under a root-only home) with this checkout and the venv's
    packages on its path."""
    import shutil
    import site

    exe = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/bin")
    setpriv = shutil.which("setpriv")
    if exe is None or setpriv is None:
        require_tool(f"python{sys.version_info.major}.{sys.version_info.minor} in /usr/bin and setpriv")
    path = ":".join([str(REPO), *site.getsitepackages()])
    return [str(setpriv), "--reuid=nobody", "--regid=nogroup", "--clear-groups", "env", f"PYTHONPATH={path}",
            "HOME=/tmp", str(exe)]


@pytest.mark.parametrize("mode", ["instrumented", "unwind"])
def test_unprivileged_trace_says_permissions(mode: str) -> None:
    """Issue 15: as an unprivileged user the one line names the privileges needed, not tracefs."""
    proc = subprocess.run([*unprivileged_python(), "-m", "ccprofd.cli", "trace", "--mode", mode, "--",
                           "/bin/true"], capture_output=True, text=True, cwd="/tmp", timeout=600)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        "ccprofd: permission denied: tracing needs root, or CAP_BPF and CAP_PERFMON (running as uid "
        f"{pwd.getpwnam('nobody').pw_uid})"], proc.stderr


def test_unreadable_tracefs_is_a_permission_error(tmp_path: pathlib.Path, monkeypatch: Any) -> None:
    """A tracefs mounted root-only (0700, as on this machine) is not reported as "not mounted"."""
    from ccprofd.kbpf import tracefs

    locked = tmp_path / "tracing"  # what an unprivileged user sees: a directory it cannot enter
    locked.mkdir()
    monkeypatch.setattr(tracefs, "TRACEFS_DIRS", (str(locked),))
    monkeypatch.setattr(tracefs.os, "access", lambda path, mode: path != str(locked))
    with pytest.raises(tracefs.BPFError, match=r"^permission denied: .*tracefs.*tracing needs root"):
        tracefs.tracepoint_id("raw_syscalls:sys_enter")
    with pytest.raises(tracefs.BPFError, match=r"^permission denied: "):
        tracefs.tracepoint_fields("raw_syscalls", "sys_enter")
    monkeypatch.setattr(tracefs, "TRACEFS_DIRS", (str(tmp_path / "absent"),))
    with pytest.raises(tracefs.BPFError, match=r"^tracefs is not mounted"):
        tracefs.tracepoint_id("raw_syscalls:sys_enter")


# ------------------------------------------------------------------------------ bad input (exit 2)
@pytest.mark.parametrize(("argv", "message"), [
    (["trace"], "give exactly one of"),
    (["trace", "-p", "1", "--", "/bin/true"], "give exactly one of"),
    (["trace", "--", "/nonexistent/cmd"], "command not found"),
    (["trace", "--", "/etc/passwd"], "not an executable"),
    (["trace", "--syscalls", "write,nosuchcall", "--", "/bin/true"], "unknown syscall 'nosuchcall'"),
    (["trace", "-p", "999999999"], "no process 999999999"),
    (["trace", "--scope", "(", "--", "/bin/true"], "not a valid regular expression"),
    (["trace", "--scope", "^no_such_function_anywhere$", "--", "/bin/true"], "matches no function"),
    (["trace", "--encoding", "pcce", "--", "/bin/true"], "implements valence only"),
    (["trace", "--sample-hz", "100000000", "--", "/bin/true"], "kernel.perf_event_max_sample_rate"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str) -> None:
    if "--scope" in argv or "--encoding" in argv:
        require_bpf()  # these get as far as analysing the binary
    proc = ccprofd(*argv)
    assert proc.returncode == 2, proc.stderr
    assert message in one_line_error(proc)


def test_script_is_rejected_with_a_hint(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "s.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    proc = ccprofd("trace", *INSTRUMENTED, "--", str(script))
    assert proc.returncode == 2
    assert "trace its interpreter" in one_line_error(proc)


# ----------------------------------------------------------------------------- running commands
@pytest.mark.bpf
def test_exit_status_stdio_and_default_output(tmp_path: pathlib.Path) -> None:
    require_bpf()
    prog = compile_c(tmp_path, "exit3", r"""
        #include <stdio.h>
        #include <unistd.h>
        int main(void) {
            char buf[16];
            ssize_t n = read(0, buf, sizeof buf);
            printf("got %zd\n", n);
            fprintf(stderr, "to stderr\n");
            return 3;
        }""", "-O0")
    proc = ccprofd("trace", *INSTRUMENTED, "--syscalls", "read,write", "--", str(prog), input="hello")
    assert proc.returncode == 3  # the command's status passes through
    assert proc.stdout == "got 5\n"  # its stdout is untouched: samples go to stderr
    assert "to stderr" in proc.stderr
    # strace-style: fd 0, a buffer of 16 bytes, "hello" read (the program's source and input)
    # text format: the frame's source line (-g; on by default in text) is the line calling read
    src_lines = (tmp_path / "exit3.c").read_text().splitlines()
    read_line = next(i for i, ln in enumerate(src_lines, 1) if "read(0" in ln)
    assert re.search(r"\] read\(0, 0x[0-9a-f]+, 16\) = 5\n > \S+exit3\(main\) "
                     + re.escape(f"{tmp_path / 'exit3.c'}:{read_line}") + r" call_site=0x[0-9a-f]+ "
                     r"return_address=0x", proc.stderr), proc.stderr

    out = tmp_path / "s.jsonl"
    proc = ccprofd("trace", *INSTRUMENTED, "--syscalls", "read", "--format", "jsonl", "--output", str(out),
                   "--", str(prog), input="x")
    assert proc.returncode == 3
    assert proc.stderr == "to stderr\n"  # with --output nothing else is written to stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    reads = [s for s in samples if s["frames"]]
    assert len(reads) == 1
    s = reads[0]
    assert set(s) >= {"time_ns", "pid", "tid", "event", "syscall", "complete", "frames"}
    assert s["event"] == "syscall" and s["syscall"] == "read" and s["complete"] is True
    assert abs(s["time_ns"] - time.time_ns()) < 600 * 10**9  # CLOCK_REALTIME
    (f,) = s["frames"]
    assert f["function"] == "main" and f["module"] == str(prog) and f["analysed"] is True
    assert f["build_id"] and re.fullmatch(r"[0-9a-f]+", f["build_id"])
    # call_site is main's call to read@plt, per objdump; return_address the next instruction
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(prog)], capture_output=True, text=True,
                         check=True).stdout
    calls = re.findall(r"^\s*([0-9a-f]+):\s+call\s+[0-9a-f]+ <read@plt>", dis, re.M)
    assert f["call_site"] == f"0x{int(calls[0], 16):x}"
    assert int(f["return_address"], 16) == int(calls[0], 16) + 5


@pytest.mark.bpf
def test_killed_command_reports_128_plus_signal(tmp_path: pathlib.Path) -> None:
    require_bpf()
    prog = compile_c(tmp_path, "killself", r"""
        #include <signal.h>
        #include <unistd.h>
        int main(void) { kill(getpid(), SIGTERM); pause(); return 0; }""")
    proc = ccprofd("trace", *INSTRUMENTED, "--syscalls", "kill", "--", str(prog))
    assert proc.returncode == 128 + signal.SIGTERM


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_a_child_that_execs_another_program_is_said_not_followed(mode: str, tmp_path: pathlib.Path) -> None:
    """``-- sh -c``: the shell's own writes are traced; the child that execs ls is not followed (one
    executable per trace), and the trace says so at the end instead of staying silent."""
    require_bpf()
    out = tmp_path / "out.jsonl"
    proc = ccprofd("trace", "--mode", mode, "--syscalls", "write", "--format", "jsonl", "-o", str(out), "--",
                   "/bin/sh", "-c", "echo one; /bin/ls / >/dev/null; echo two")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "one\ntwo\n"
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["syscall"] for s in samples if s.get("event") == "syscall"] == ["write", "write"]
    note = "ccprofd: 1 traced process exec'd another program and was not traced further"
    assert note in proc.stderr, proc.stderr
    quiet = ccprofd("trace", "--mode", mode, "--syscalls", "write", "-o", str(tmp_path / "q.txt"), "--",
                    "/bin/sh", "-c", "echo one")
    assert quiet.returncode == 0 and "exec'd another program" not in quiet.stderr, quiet.stderr


@pytest.mark.bpf
def test_attach_to_running_process_is_seeded(tmp_path: pathlib.Path) -> None:
    """-p PID: the thread is seeded by one unwind at attach (ccprofd/tracing/instrumented/seed.py),
    so every sample is complete and equal to the true stack (tests/test_instrumented_seeding.py
    compares with strace -p;
    the refused-ptrace case, flagged and a suffix, is tested there too)."""
    require_bpf()
    prog = compile_c(tmp_path, "loop", r"""
        #include <stdlib.h>
        #include <unistd.h>
        volatile long sink;
        __attribute__((noinline)) void leaf(void) { sink = getppid(); }
        __attribute__((noinline)) void mid(int n) { if (n) mid(n - 1); else leaf(); sink++; }
        __attribute__((noinline)) void outer(void) { mid(3); sink++; }
        int main(int argc, char **argv) {
            int rounds = argc > 1 ? atoi(argv[1]) : 20;
            for (int i = 0; i < rounds; i++) { usleep(50000); outer(); }
            return 0;
        }""", "-O1")
    target = subprocess.Popen([str(prog), "2400"])
    out = tmp_path / "p.jsonl"
    tracer = subprocess.Popen([sys.executable, "-m", "ccprofd.cli", "trace", *INSTRUMENTED,
                               "--syscalls", "getppid", "--format", "jsonl", "--output", str(out),
                               "-p", str(target.pid)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 5):
            time.sleep(0.2)
        tracer.send_signal(signal.SIGINT)  # Ctrl-C detaches
        _, err = tracer.communicate(timeout=60)
        assert target.poll() is None  # detaching left the process running
    finally:
        target.kill()
        target.wait()
    assert tracer.returncode == 0, err
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) >= 5
    truth = ["main", "outer", "mid", "mid", "mid", "mid", "leaf"]  # from the source: mid(3) recurses 3x
    assert "1 of 1 threads seeded" in err, err
    for s in samples:
        assert s["complete"] is True, s
        assert [f["function"] for f in s["frames"]] == truth


@pytest.mark.bpf
def test_cpu_samples_follow_real_call_sites() -> None:
    """--sample-hz: CPU samples (event "cpu") decoded like syscalls.  Each complete sample's frames
    must chain through real call instructions (objdump): every return address follows a call whose
    target is the next frame's function, at the frame's ``call_site``.  The innermost frame is either
    the sampled instruction (``call_site`` inside that function, no return address) or, for a sample
    taken in library code (write, open ... of the program's libc calls), the binary's call into the
    library through its PLT (README: the binary's caller through its innermost recorded exit)."""
    require_bpf()
    require_tool("objdump")
    binary = pathlib.Path(build("recursion", opt="O2", pie=True))
    proc = ccprofd("trace", *INSTRUMENTED, "--syscalls", "getppid", "--sample-hz", "997", "--format", "jsonl",
                   "--", str(binary), "2500")
    assert proc.returncode == 0
    samples = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    cpu = [s for s in samples if s["event"] == "cpu" and s["complete"] and s["frames"]]
    assert len(cpu) >= 3
    dis = subprocess.run(["objdump", "-d", "-w", str(binary)], capture_output=True, text=True,
                         check=True).stdout
    call_after: dict[int, tuple[int, str, bool]] = {}  # return address -> (call site, callee, via the PLT)
    for m in re.finditer(r"^\s*([0-9a-f]+):\t((?:[0-9a-f]{2} )+)\s*\tcall\s+[0-9a-f]+ <([^>]+)>", dis, re.M):
        site, callee = int(m.group(1), 16), m.group(3)
        call_after[site + len(m.group(2).split())] = (site, callee.split("@")[0], callee.endswith("@plt"))
    symbols = sorted((int(a, 16), name) for a, name in re.findall(r"^([0-9a-f]+) <([^>]+)>:$", dis, re.M))

    def function_at(vaddr: int) -> str:
        return symbols[bisect.bisect_right(symbols, (vaddr, "\uffff")) - 1][1]

    # A sample may also land in the start-up/exit routines libc runs around main (DT_INIT, crtstuff).
    around_main = {"main", "_init", "_fini", "frame_dummy", "register_tm_clones", "deregister_tm_clones",
                   "__do_global_dtors_aux", "_start"}
    assert any(s["frames"][0]["function"] == "main" for s in cpu)
    for s in cpu:
        frames = s["frames"]
        assert frames[0]["function"] in around_main, frames[0]
        for outer, inner in itertools.pairwise(frames):
            site, callee, _ = call_after[int(outer["return_address"], 16)]
            assert (callee, int(outer["call_site"], 16)) == (inner["function"], site), (outer, inner)
        last = frames[-1]
        if last["return_address"] is None:  # the sampled instruction, in the innermost function
            assert function_at(int(last["call_site"], 16)) == last["function"], last
        else:  # sampled in a library: the innermost frame is the binary's call into it
            site, callee, via_plt = call_after[int(last["return_address"], 16)]
            assert via_plt and int(last["call_site"], 16) == site, (last, callee)
