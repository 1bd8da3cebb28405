"""Decoded-sample dicts from ``strace -f -k``: an independent source of real contexts for the
anomaly model tests (no ccprofd code involved in producing them).

Each syscall strace reports becomes a sample in the tracer's format: the frames are the innermost
contiguous run of frames in the target binary (what the tracer reports, outermost = ``main`` or a
thread's start routine; ``_start`` is dropped), outermost first; ``return_address`` is the address
strace prints, and ``call_site`` the call instruction ending there, found with objdump
(:mod:`binutils_oracle`).  Syscalls made before ``main`` (the dynamic loader) have no frames.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import tempfile
from typing import Any

from binutils_oracle import oracle

_SYSCALL = re.compile(r"^(\d+)\s+(?:<\.\.\. )?([a-z0-9_]+)\((.*)$")
_FRAME = re.compile(r"^\s*>\s+(\S+?)\((\S*?)\)\s+\[0x([0-9a-f]+)\]")
_FRAME_NOSYM = re.compile(r"^\s*>\s+(\S+?)\(\)\s+\[0x([0-9a-f]+)\]")
_PATH_ARG = re.compile(r'^(?:AT_FDCWD|\d+), "((?:[^"\\]|\\.)*)"')
_EXEC_ARG = re.compile(r'^"((?:[^"\\]|\\.)*)"')


def strace_samples(argv: list[str], *, syscalls: str = "openat,read,write,execve",
                   env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Run ``argv`` under ``strace -f -k``; return (samples, exit status)."""
    binary = pathlib.Path(argv[0]).resolve()
    orc = oracle(binary)
    ret_to_site = {s.return_address: s.address for s in orc.sites}
    with tempfile.NamedTemporaryFile(prefix="ccprofd-strace-", suffix=".txt", delete=False) as tmp:
        out = tmp.name
    try:
        proc = subprocess.run(["strace", "-f", "-qq", "-k", "-e", f"trace={syscalls}", "-o", out, *argv],
                              capture_output=True, env=env)
        text = pathlib.Path(out).read_text(errors="replace")
    finally:
        os.unlink(out)
    samples: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    raw_frames: list[tuple[str, str, int]] = []

    def finish() -> None:
        if current is None:
            return
        frames: list[dict[str, Any]] = []
        for module, sym, addr in raw_frames:  # innermost first
            if pathlib.Path(module).resolve() != binary:
                if frames:
                    break
                continue
            fn = sym.split("+", 1)[0] if sym else f"sub_{addr:x}"
            if fn == "_start":
                break
            site = ret_to_site.get(addr)
            frames.append({"function": fn, "module": str(binary), "build_id": orc.build_id, "analysed": True,
                           "call_site": None if site is None else hex(site), "return_address": hex(addr)})
        frames.reverse()
        current["frames"] = frames
        samples.append(current)

    for line in text.splitlines():
        m = _SYSCALL.match(line)
        if m:
            finish()
            pid, name, rest = int(m.group(1)), m.group(2), m.group(3)
            args: dict[str, Any] = {}
            pm = _PATH_ARG.match(rest)
            if name in ("openat", "open") and pm:
                args["path"] = pm.group(1)
            em = _EXEC_ARG.match(rest)
            if name == "execve" and em:
                args["filename"] = em.group(1)
            current = {"time_ns": len(samples), "pid": pid, "tid": pid, "event": "syscall", "syscall": name,
                       "complete": True, "args": args}
            raw_frames = []
            continue
        f = _FRAME.match(line)
        if f and current is not None:
            raw_frames.append((f.group(1), f.group(2), int(f.group(3), 16)))
    finish()
    return samples, proc.returncode
