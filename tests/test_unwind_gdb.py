"""gdb as the independent unwinder for the BPF unwinder's end-to-end tests.

The program runs under ``gdb -batch``; gdb stops it at ``__libc_start_main`` (libc is mapped by
then), the test starts tracking the pid with ccprofd, and gdb then stops at the *entry* of every
selected syscall (``catch syscall``; entry and return stops are told apart by
``rax == -ENOSYS``) and records the pc of every machine frame (inlined-call frames, which gdb lists with their
caller's pc, and tail-call frames it infers from libc's debug info are left out; ``set backtrace past-main``
and ``past-entry``, no depth limit).  The same process is unwound by ccprofd's BPF program at the same
syscall entries, so the two can be compared sample by sample: per thread, the i-th syscall stop
of gdb against the i-th sample of that thread.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from conftest import require_tool

_SCRIPT = r'''
import gdb, os, time
gdb.execute("set pagination off")
gdb.execute("set confirm off")
gdb.execute("set breakpoint pending on")
gdb.execute("set backtrace past-main on")
gdb.execute("set backtrace past-entry on")
gdb.execute("set backtrace limit unlimited")
gdb.execute("set print thread-events off")
gdb.execute("set print inferior-events off")
gdb.execute("handle SIGUSR1 SIGUSR2 SIGALRM nostop noprint pass")
gdb.execute("break __libc_start_main")
gdb.execute("run", to_string=True)
gdb.execute("delete")
gdb.execute("catch syscall %(syscalls)s")
with open(%(pidfile)r + ".tmp", "w") as fh:
    fh.write(str(gdb.selected_inferior().pid))
os.rename(%(pidfile)r + ".tmp", %(pidfile)r)
while not os.path.exists(%(gofile)r):
    time.sleep(0.01)
out = open(%(outfile)r, "w")
while True:
    try:
        gdb.execute("continue", to_string=True)
    except gdb.error:
        break
    if not gdb.selected_inferior().pid:
        break
    if int(gdb.parse_and_eval("$rax")) != -38:  # at syscall entry rax is -ENOSYS; else a return
        continue
    frame = gdb.newest_frame()
    pcs = []
    while frame is not None:
        # inlined calls and tail-call frames gdb infers from DWARF call-site info are not on the stack
        if frame.type() not in (gdb.INLINE_FRAME, gdb.TAILCALL_FRAME):
            pcs.append(frame.pc())
        frame = frame.older()
    out.write("%%d %%s\n" %% (gdb.selected_thread().ptid[1], " ".join("%%x" %% pc for pc in pcs)))
    out.flush()
out.close()
'''


@dataclass(frozen=True)
class GdbStop:
    tid: int
    pcs: tuple[int, ...]


def run_with_gdb(argv: Sequence[str], syscalls: Sequence[str], tmp: Path,
                 on_pid: Callable[[int], None], timeout: float = 300.0) -> tuple[int, list[GdbStop]]:
    """Run ``argv`` under gdb; call ``on_pid(pid)`` once it is stopped at ``__libc_start_main``;
    return (pid, the syscall-entry stops in order)."""
    gdb = require_tool("gdb")
    pidfile, gofile, outfile = tmp / "gdb.pid", tmp / "gdb.go", tmp / "gdb.out"
    for f in (pidfile, gofile, outfile):
        f.unlink(missing_ok=True)
    script = tmp / "oracle.py"
    script.write_text(_SCRIPT % {"syscalls": " ".join(syscalls), "pidfile": str(pidfile),
                                 "gofile": str(gofile), "outfile": str(outfile)})
    proc = subprocess.Popen([gdb, "-batch", "-nx", "-x", str(script), "--args", *argv],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise AssertionError(f"gdb did not reach __libc_start_main: {out[-2000:]}")
            time.sleep(0.01)
        pid = int(pidfile.read_text())
        on_pid(pid)
        gofile.write_text("go")
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stops = []
    for line in outfile.read_text().splitlines() if outfile.exists() else []:
        tid, _, rest = line.partition(" ")
        stops.append(GdbStop(int(tid), tuple(int(x, 16) for x in rest.split())))
    assert stops, f"gdb recorded no syscall stops: {out.decode(errors='replace')[-2000:]}"
    return pid, stops


def test_oracle_sees_the_known_call_chain(tmp_path: Path) -> None:
    """The oracle itself: at fact's getppid, gdb's frames contain fact's return addresses into
    fact and main exactly as objdump places the calls (return address = call + 5)."""
    from bpf_helpers import direct_call_sites
    from programs.build import build

    binary = build("recursion", opt="O0", pie=False)
    calls = direct_call_sites(binary)
    after_fact_calls = {c.vaddr + 5 for c in calls if c.target == "fact"}
    _, stops = run_with_gdb([str(binary), "3"], ["getppid"], tmp_path, lambda pid: None)
    first = stops[0].pcs
    in_fact = [pc for pc in first if pc in after_fact_calls]
    assert len(in_fact) == 4, [hex(p) for p in first]  # main->fact(3) + 3 recursive calls
