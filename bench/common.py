"""Shared helpers for the benchmarks: timing child processes, peak RSS, README table updates."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


@dataclass(frozen=True)
class Run:
    seconds: float
    max_rss_mb: float
    returncode: int


def run_measured(argv: list[str], *, stdout: int | None = subprocess.DEVNULL,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> Run:
    """Run a child and return its wall time and peak RSS (from wait4's rusage, not sampled)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Run(elapsed, usage.ru_maxrss / 1024, proc.returncode)


def cpu_model() -> str:
    """The processor's name from /proc/cpuinfo: the same tree measured on two hosts of this VM type
    differed 3x (an AMD host with SRSO "Safe RET", an Intel one without), so every result names it."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "unknown CPU"


def machine_line() -> str:
    return (f"{platform.node() or 'host'}: {os.cpu_count()} CPUs ({cpu_model()}), "
            f"kernel {platform.release()}, Python {platform.python_version()}, "
            f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}")


def update_readme_section(name: str, body: str) -> bool:
    """Replace the text between <!-- bench:NAME --> and <!-- /bench:NAME --> in README.md."""
    if not README.exists():
        return False
    text = README.read_text()
    pattern = re.compile(rf"(<!-- bench:{re.escape(name)} -->\n).*?(<!-- /bench:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        return False
    README.write_text(pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text))
    return True


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (field 3, the state, first)."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) in seconds."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def reaped_cpu_seconds(pid: int) -> float:
    """cutime + cstime of ``pid`` in seconds: the CPU time of the children it has waited for."""
    fields = _stat_fields(pid)
    return (int(fields[13]) + int(fields[14])) / CLK_TCK


def status_mb(pid: int, key: str) -> float:
    """A size line of /proc/PID/status (``VmRSS``, ``VmHWM``...) in MB; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def publish(section: str, text: str, update_readme: bool) -> None:
    """Print a benchmark's report and, when asked, put it into the README's bench:SECTION."""
    print(text)
    if update_readme and not update_readme_section(section, text):
        print(f"{section}: README has no bench:{section} section", file=sys.stderr)


def python() -> str:
    return sys.executable


def median(xs: list[float]) -> float:
    """The middle value (the upper one of an even count), as the unwind benches report."""
    s = sorted(xs)
    return s[len(s) // 2]


BPF_ENABLE_STATS = 32


class _EnableStatsAttr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32)]  # BPF_STATS_RUN_TIME = 0


@contextlib.contextmanager
def run_time_stats() -> Iterator[None]:
    """BPF run-time stats on while the block runs, through a ``BPF_ENABLE_STATS`` fd rather than the
    ``kernel.bpf_stats_enabled`` sysctl: the kernel counts the fd apart from the sysctl, so another
    benchmark on this shared machine switching the sysctl off mid-run does not zero our figures."""
    from ccprofd.kbpf import rawbpf

    fd = rawbpf.bpf(BPF_ENABLE_STATS, _EnableStatsAttr(0), "BPF_ENABLE_STATS")
    try:
        yield
    finally:
        os.close(fd)


def report_main(name: str, measure: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                *, update_readme: bool) -> int:
    """Run a root-only bench's ``measure`` (which prints its report), print the report and, when
    asked, put it into README's ``bench:NAME`` section; the exit status (2: not root, 1: no such
    section)."""
    if os.geteuid() != 0:
        print(f"bench/{name}.py: needs root (BPF)", file=sys.stderr)
        return 2
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = measure(args)
    report = buf.getvalue()
    print(report, end="")
    if rc == 0 and update_readme and not update_readme_section(name, report):
        print(f"bench/{name}.py: README.md has no bench:{name} section", file=sys.stderr)
        return 1
    return rc
