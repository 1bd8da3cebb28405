"""Syscall path arguments in unwind mode (``ccprofd trace``, the default mode): every sample of
``openat``/``execve`` carries its own argument, also when its context was seen before (then BPF
sends only a header-only record for it), and a path longer than instrumented mode's 256 bytes is
reported whole.

The expected arguments come from two independent sources: the paths the test hands the program
(it opens exactly those, in that order) and ``strace``'s decoded arguments of the same command
(``-s`` large enough that strace prints each string whole).
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

import pytest
from conftest import require_bpf, require_tool
from programs.build import build

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSCALLS = "openat,execve"
_LINE = re.compile(r'^(\d+)\s+(openat|execve)\((?:AT_FDCWD, |\d+, )?"((?:[^"\\]|\\.)*)"')


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), text)


def strace_args(argv: list[str]) -> list[tuple[str, str]]:
    """(syscall, path) of every openat/execve of the command's process, in order, up to and
    including its exec of another program (the first line, strace's own exec of the command, is
    made before ccprofd tracks the process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "strace.txt"
        proc = subprocess.run(["strace", "-f", "-qq", "-s", "65536", "-e", f"trace={SYSCALLS}",
                               "-o", str(out), "--", *argv], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        lines = out.read_text().splitlines()
    got: list[tuple[str, str]] = []
    for line in lines[1:]:
        m = _LINE.match(line)
        assert m, line
        got.append((m.group(2), _unescape(m.group(3))))
        if m.group(2) == "execve":
            break  # the exec'd program is not the traced binary: ccprofd stops following it
    return got


def trace(argv: list[str], tmp: pathlib.Path, *extra: str) -> list[dict[str, Any]]:
    out = tmp / "samples.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind",
                           "--format", "jsonl", "--syscalls", SYSCALLS, "--output", str(out), *extra,
                           "--", *argv],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def sample_arg(s: dict[str, Any]) -> tuple[str, str]:
    key = "filename" if s["syscall"] == "execve" else "path"
    assert set(s.get("args", {})) == {key}, s
    return s["syscall"], s["args"][key]


@pytest.mark.bpf
def test_each_sample_carries_its_own_path(tmp_path: pathlib.Path) -> None:
    require_bpf()
    require_tool("strace")
    prog = str(build("anomaly_cmds", opt="O2"))
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first\n")
    b.write_text("second\n")
    deep = tmp_path
    for i in range(6):  # a path of ~1,600 bytes: beyond instrumented mode's 256-byte buffer
        deep = deep / (chr(ord("p") + i) * 250)
    deep.mkdir(parents=True)
    long_file = deep / "long.txt"
    long_file.write_text("third\n")
    assert len(str(long_file)) > 1500
    # cat, head and count open through different chains; cat A twice: the second is a repeat of a
    # known context (a header-only record in BPF), as is the second head.
    plan = [("cat", a), ("cat", b), ("head", long_file), ("cat", a), ("head", b), ("count", a)]
    argv = [prog, *(x for cmd, path in plan for x in (cmd, str(path))), "run", "/bin/true"]

    samples = [s for s in trace(argv, tmp_path) if s["event"] == "syscall"]
    assert len({s["pid"] for s in samples}) == 1
    got = [sample_arg(s) for s in samples]

    # strace decodes the same arguments in the same order (the loader's opens included)
    assert got == strace_args(argv)
    # the program opened exactly what it was given, from its own code, then exec'd /bin/true
    in_prog = [(sample_arg(s), tuple(f["function"] for f in s["frames"] if f["analysed"]))
               for s in samples if any(f["analysed"] for f in s["frames"])]
    assert [x[0] for x in in_prog] == [("openat", str(p)) for _, p in plan] + [("execve", "/bin/true")]
    chains = [x[1] for x in in_prog]
    assert chains[0] == chains[1] == chains[3]  # one context, three different paths
    assert chains[2] == chains[4] and chains[0] != chains[2] != chains[5]
    assert chains[0][-2:] == ("load_file", "open_file") and chains[6][-2:] == ("run_program", "do_exec")

