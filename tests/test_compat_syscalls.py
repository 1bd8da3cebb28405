"""An ia32 (compat) syscall -- ``int $0x80`` in a 64-bit process -- is reported as what it is.

``raw_syscalls:sys_enter`` passes its ia32 number, which names another call in the x86-64 table:
ia32 20 is ``getpid``, x86-64 20 is ``writev``.  Both modes used to report such a call as ``writev``.
The raw path now marks it (kbpf/syscalls.py, ``IA32_BIT``) and it is named ``ia32:getpid``, with no
argument words (an ia32 call passes them in other registers) and outside every syscall set, as on
the per-syscall path, whose events leave compat calls out.  Oracles: strace, which names the call
from its own ia32 table; the program, which prints what the call returned (its pid, as getpid
returns); objdump, for the ``int $0x80`` instruction the innermost frame must be at.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import compile_c
from conftest import require_bpf, require_tool, skip_or_fail

REPO = Path(__file__).resolve().parent.parent

SOURCE = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) long ia32_getpid(void) {
    long r;
    asm volatile("int $0x80" : "=a"(r) : "0"(20L) : "memory");  /* ia32 getpid; x86-64 20 is writev */
    return r;
}
int main(void) {
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%ld\n", ia32_getpid());
    write(1, buf, n);
    return 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = compile_c(tmp_path_factory.mktemp("compat"), "ia32_getpid", SOURCE, "-O1")
    got = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    if got.returncode != 0 or not got.stdout.strip().isdigit():
        skip_or_fail(f"this kernel runs no int $0x80 syscalls (ia32 emulation off): {got.returncode}")
    return binary


def int80_address(binary: Path) -> int:
    """The link-time address of the ``int $0x80`` instruction, per objdump."""
    out = subprocess.run([require_tool("objdump"), "-d", "--no-show-raw-insn", str(binary)],
                         capture_output=True, text=True, check=True).stdout
    found = [int(m.group(1), 16) for m in re.finditer(r"^\s*([0-9a-f]+):\s+int\s+\$0x80", out, re.M)]
    assert len(found) == 1, found
    return found[0]


def trace(binary: Path, mode: str, syscalls: str, tmp_path: Path,
          env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], str]:
    out = tmp_path / f"{mode}.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--format", "jsonl", "--retval",
            "--syscalls", syscalls, "--output", str(out), "--", str(binary)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stdout


def test_strace_names_the_call_getpid(program: Path) -> None:
    """The oracle: strace decodes the call with its ia32 table."""
    got = subprocess.run([require_tool("strace"), "-qq", "-e", "trace=getpid,writev", str(program)],
                         capture_output=True, text=True, timeout=60)
    assert re.search(r"^getpid\(\)\s+= \d+$", got.stderr, re.M), got.stderr
    assert "writev" not in got.stderr


@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_all_syscalls_name_a_compat_call_ia32(program: Path, mode: str, tmp_path: Path) -> None:
    require_bpf()
    samples, stdout = trace(program, mode, "all", tmp_path)
    names = [s.get("syscall") for s in samples if s.get("event") == "syscall"]
    assert "writev" not in names, names
    compat = [s for s in samples if s.get("syscall") == "ia32:getpid"]
    assert len(compat) == 1, names
    s = compat[0]
    # getpid's return value, as the program printed it and as the pid the sample names
    assert s["ret"] == int(stdout) == s["pid"], (s, stdout)
    assert s["raw_args"] == [] and s["complete"], s
    # the innermost frame's exact pc is the one the kernel saved, past the 2-byte instruction (as
    # after a `syscall`)
    inner = s["frames"][-1]
    assert inner["function"] == "ia32_getpid", inner
    assert int(inner["call_site"], 16) == int80_address(program) + 2, inner
    assert [f["function"] for f in s["frames"] if f["analysed"]] == ["main", "ia32_getpid"], s["frames"]


@pytest.mark.parametrize("attach", ["raw", "per-syscall"])
def test_a_syscall_set_reports_no_compat_call(program: Path, attach: str, tmp_path: Path) -> None:
    """With a set, on either attach path, the compat call is in no set: not reported at all, and
    in particular not as the x86-64 call its number names."""
    require_bpf()
    env = {"CCPROFD_SYSCALL_ATTACH": "raw"} if attach == "raw" else {}
    samples, stdout = trace(program, "unwind", "getpid,writev,write", tmp_path, env)
    names = [s.get("syscall") for s in samples if s.get("event") == "syscall"]
    assert names == ["write"], names
    assert stdout.strip().isdigit()
