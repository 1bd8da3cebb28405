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
from bpf_helpers import IA32_SWITCHED, compile_c
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


# ------------------------------------------------------------------------------ the compat watch
@pytest.mark.parametrize("attach", ["raw", "per-syscall"])
def test_watch_ia32_samples_the_compat_call_under_a_set(program: Path, attach: str, tmp_path: Path) -> None:
    """``--watch-ia32``: under the same set, the compat call is sampled on either attach path (on
    the per-syscall one by the raw_syscalls program beside the events), named ``ia32:getpid``, its
    return value joined (the program printed it), the innermost frame at objdump's ``int $0x80``."""
    require_bpf()
    env = {"CCPROFD_SYSCALL_ATTACH": "raw"} if attach == "raw" else {}
    out = tmp_path / "watch.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--watch-ia32", "--format", "jsonl", "--retval",
            "--syscalls", "getpid,writev,write", "--output", str(out), "--", str(program)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    names = [s.get("syscall") for s in samples if s.get("event") == "syscall"]
    assert names == ["ia32:getpid", "write"], names
    s = samples[[s.get("syscall") for s in samples].index("ia32:getpid")]
    assert s["ret"] == int(proc.stdout) == s["pid"] and s["complete"], (s, proc.stdout)
    inner = s["frames"][-1]
    assert inner["function"] == "ia32_getpid" and int(inner["call_site"], 16) == int80_address(program) + 2
    assert "lost" not in proc.stderr, proc.stderr  # the return came: none counted lost


def _anomaly(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_watch_ia32_detect_alerts_and_enforce_kills(tmp_path: Path) -> None:
    """A model learned from the x86-64 ``getpid`` path (set getpid,write), then the same binary
    taking its ``int $0x80`` path: ``detect`` without the watch is blind to it (the gap the watch
    closes); with it, one ``unseen_context`` alert names ``ia32:getpid`` and the chain main > work >
    ia32_getpid (the program's own structure); ``--enforce`` kills the process; a model that learned
    that very context (learned with the watch) lets it run."""
    require_bpf()
    binary = compile_c(tmp_path, "switched", IA32_SWITCHED, "-O1")
    model = tmp_path / "m.json"
    sets = ["--syscalls", "getpid,write"]
    learned = _anomaly("learn", "--model", str(model), *sets, "--", str(binary), "0", cwd=REPO)
    assert learned.returncode == 0, learned.stderr

    blind = _anomaly("detect", "--model", str(model), *sets, "--", str(binary), "1", cwd=REPO)
    assert blind.returncode == 0 and '"kind"' not in blind.stderr, blind.stderr

    seen = _anomaly("detect", "--watch-ia32", "--model", str(model), *sets, "--", str(binary), "1", cwd=REPO)
    assert seen.returncode == 0, seen.stderr
    alerts = [json.loads(line) for line in seen.stderr.splitlines() if line.startswith("{")]
    assert [(a["kind"], a["syscall"]) for a in alerts] == [("unseen_context", "ia32:getpid")], seen.stderr
    frames = [f["function"] for f in alerts[0]["frames"] if f["analysed"]]
    assert frames == ["main", "work", "ia32_getpid"], alerts[0]["frames"]
    assert int(alerts[0]["frames"][-1]["call_site"], 16) == int80_address(binary) + 2

    watched = ["--watch-ia32", "--model", str(model), *sets, "--", str(binary), "1"]
    killed = _anomaly("detect", "--enforce", *watched, cwd=REPO)
    assert killed.returncode == 128 + 9 and killed.stdout == "", (killed.returncode, killed.stderr)
    denials = [json.loads(line) for line in killed.stderr.splitlines() if line.startswith("{")]
    assert [(d["syscall"], d.get("verdict")) for d in denials] == [("ia32:getpid", "killed")], killed.stderr

    relearned = _anomaly("learn", *watched, cwd=REPO)
    assert relearned.returncode == 0, relearned.stderr
    allowed = _anomaly("detect", "--enforce", *watched, cwd=REPO)
    assert allowed.returncode == 0 and allowed.stdout.strip().isdigit(), (allowed.returncode, allowed.stderr)
    assert '"kind"' not in allowed.stderr and "enforcement killed" not in allowed.stderr, allowed.stderr


def test_watch_ia32_is_unwind_mode_only(program: Path, tmp_path: Path) -> None:
    """A clear usage error, not a silently ignored flag."""
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented", "--watch-ia32", "--",
            str(program)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "--watch-ia32 needs --mode unwind" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
