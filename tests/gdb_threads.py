"""Ground truth for per-thread snapshots: ``gdb -p PID -batch`` walks every thread's stack now.

The counterpart of ``gdb_oracle.py`` for a process that is already running and blocked (the
oracle for ``GetThreadContexts``): gdb attaches, and for each thread (``thread apply all bt`` as a
Python walk, no frame limit, ``backtrace past-main``/``past-entry`` on) reports every machine frame
as (pc, module, file offset, ELF-independent name), innermost first, then detaches.  Frames gdb
synthesises (``INLINE_FRAME``, ``TAILCALL_FRAME``) are dropped, as in ``gdb_oracle.py``: they are not
on the machine stack.  The signal trampoline frame is kept (marked ``sigtramp``).  Imports nothing
of ccprofd.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

_SCRIPT = r'''
import gdb, json
CONFIG = json.loads(%(config)r)
for cmd in ("set pagination off", "set confirm off", "set backtrace past-main on",
            "set backtrace past-entry on", "set backtrace limit unlimited"):
    gdb.execute(cmd)
try:
    gdb.execute("set debuginfod enabled off")
except gdb.error:
    pass
gdb.execute("attach %%d" %% CONFIG["pid"], to_string=True)
rows = []
with open("/proc/%%d/maps" %% CONFIG["pid"]) as fh:
    for line in fh:
        parts = line.split(None, 5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        rows.append((lo, hi, parts[1], int(parts[2], 16), parts[5].strip() if len(parts) > 5 else ""))
def locate(pc):
    for lo, hi, perms, off, path in rows:
        if lo <= pc < hi and "x" in perms:
            return (path or None), pc - lo + off
    return None, None
out = []
for t in sorted(gdb.selected_inferior().threads(), key=lambda t: t.ptid[1]):
    t.switch()
    frames = []
    f = gdb.newest_frame()
    last = f
    while f is not None:
        kind = f.type()
        if kind not in (gdb.INLINE_FRAME, gdb.TAILCALL_FRAME):
            module, offset = locate(f.pc())
            frames.append({"pc": f.pc(), "name": f.name(), "module": module, "offset": offset,
                           "sigtramp": kind == gdb.SIGTRAMP_FRAME})
        last = f
        f = f.older()
    reason = last.unwind_stop_reason()
    out.append({"tid": t.ptid[1], "frames": frames,
                "stop_reason": gdb.frame_stop_reason_string(reason),
                "truncated": reason not in (gdb.FRAME_UNWIND_NO_REASON, gdb.FRAME_UNWIND_OUTERMOST)})
gdb.execute("detach", to_string=True)
with open(CONFIG["output"], "w") as fh:
    json.dump(out, fh)
'''


@dataclass(frozen=True)
class GdbFrame:
    pc: int
    name: str | None
    module: str | None
    offset: int | None  # file offset in module (strace's rule: pc - map start + map offset)
    sigtramp: bool


@dataclass(frozen=True)
class GdbThread:
    tid: int
    frames: tuple[GdbFrame, ...]  # innermost first
    stop_reason: str
    truncated: bool


def gdb_threads(pid: int, timeout: float = 600) -> dict[int, GdbThread]:
    """Attach gdb to ``pid``, walk every thread, detach: {tid: thread}."""
    gdb = shutil.which("gdb")
    if gdb is None:
        raise RuntimeError("gdb is not installed")
    with tempfile.TemporaryDirectory(prefix="gdb-threads-") as tmp:
        out = pathlib.Path(tmp) / "threads.json"
        script = pathlib.Path(tmp) / "walk.py"
        script.write_text(_SCRIPT % {"config": json.dumps({"pid": pid, "output": str(out)})})
        proc = subprocess.run([gdb, "-q", "-batch", "-nx", "-x", str(script)], capture_output=True,
                              text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL)
        if not out.exists():
            raise RuntimeError(f"gdb wrote nothing (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        doc = json.loads(out.read_text())
    return {t["tid"]: GdbThread(t["tid"], tuple(GdbFrame(**f) for f in t["frames"]), t["stop_reason"],
                                t["truncated"]) for t in doc}
