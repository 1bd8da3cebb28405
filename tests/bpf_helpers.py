"""Helpers for the real-BPF tests: build small C programs and find probe sites *independently* of
ccprofd (objdump for instructions, readelf for program headers), so the tests check ccprofd's BPF
layer against the toolchain rather than against itself."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conftest import require_tool

if TYPE_CHECKING:
    from ccprofd.tracing.syscall_sampler import SyscallSampler
    from ccprofd.tracing.unwind.sampler import UnwindSampler, UnwoundSample


def compile_c(tmp_path: Path, name: str, source: str, *flags: str) -> Path:
    """gcc ``source`` into ``tmp_path/name`` and return the binary's path."""
    gcc = require_tool("gcc")
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    subprocess.run([gcc, "-g", *flags, "-o", str(out), str(src)], check=True, capture_output=True, text=True)
    return out


@dataclass(frozen=True)
class CallSite:
    vaddr: int
    function: str
    target: str  # objdump's symbolic target, e.g. "leaf" or "printf@plt"


_FUNC_RE = re.compile(r"^([0-9a-f]+) <([^>]+)>:$")
_INSN_RE = re.compile(r"^\s*([0-9a-f]+):\t([0-9a-f ]+)\t(\S+)\s*(.*)$")


def direct_call_sites(binary: Path) -> list[CallSite]:
    """Every ``call rel32`` (opcode e8) in executable sections, in address order, per objdump."""
    objdump = require_tool("objdump")
    text = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(binary)], check=True, capture_output=True, text=True
    ).stdout
    raw = subprocess.run([objdump, "-d", str(binary)], check=True, capture_output=True, text=True).stdout
    first_byte: dict[int, str] = {}
    for line in raw.splitlines():
        m = _INSN_RE.match(line)
        if m:
            first_byte[int(m.group(1), 16)] = m.group(2).split()[0]
    sites: list[CallSite] = []
    func = "?"
    for line in text.splitlines():
        fm = _FUNC_RE.match(line)
        if fm:
            func = fm.group(2)
            continue
        m = re.match(r"^\s*([0-9a-f]+):\s+(call\S*)\s+([0-9a-f]+)\s+<([^>]+)>", line)
        if m:
            va = int(m.group(1), 16)
            if first_byte.get(va) == "e8":
                sites.append(CallSite(va, func, m.group(4)))
    return sites


def pt_loads(binary: Path) -> list[tuple[int, int, int]]:
    """(vaddr, filesz, offset) of each PT_LOAD, from ``readelf -lW``."""
    readelf = require_tool("readelf")
    out = subprocess.run([readelf, "-lW", str(binary)], check=True, capture_output=True, text=True).stdout
    segs = []
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == "LOAD":
            offset, vaddr, _paddr, filesz = (int(p, 16) for p in parts[1:5])
            segs.append((vaddr, filesz, offset))
    return segs


def file_offset(binary: Path, vaddr: int) -> int:
    for start, filesz, off in pt_loads(binary):
        if start <= vaddr < start + filesz:
            return vaddr - start + off
    raise AssertionError(f"{vaddr:#x} not in a PT_LOAD of {binary}")


def nm_functions(binary: Path) -> dict[str, tuple[int, int]]:
    """Function name -> (start, end) ELF vaddrs of ``binary``'s defined text symbols, from nm
    (binutils, not ccprofd): the oracle the memo tests check unwound frames against."""
    out = subprocess.run([require_tool("nm"), "-S", "--defined-only", str(binary)], check=True,
                         capture_output=True, text=True).stdout
    syms: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tT":
            start, size = int(parts[0], 16), int(parts[1], 16)
            syms[parts[3]] = (start, start + size)
    return syms


def load_bias(pid: int, binary: Path) -> int:
    """Runtime minus ELF vaddr of ``binary``'s first mapping in process ``pid`` (PIE), from
    /proc/PID/maps."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(binary) and int(fields[2], 16) == 0:
            return int(fields[0].split("-")[0], 16)
    raise AssertionError(f"{binary} not mapped in {pid}")


def encoded_sampler(binary: str | Path, cache_dir: Path, syscalls: list[int]) -> UnwindSampler:
    """An unwind sampler of ``syscalls`` that encodes and aggregates in the kernel, as ``trace`` and
    the daemon run it, with ``binary``'s Valence unwind encoding (analysed under ``cache_dir``); for
    a ``with`` block."""
    from ccprofd.callgraph import analyze_binary
    from ccprofd.encode import get_plan
    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.tracing.unwind.plan import cached_unwind_encoding
    from ccprofd.tracing.unwind.sampler import UnwindSampler

    graph = analyze_binary(str(binary), cache_dir=cache_dir)
    plan = get_plan(graph, "valence", cache_dir=cache_dir)
    enc = cached_unwind_encoding(graph, plan, AnalysisCache(cache_dir))
    return UnwindSampler(syscalls=syscalls, aggregate=True, encoding=enc, cache=AnalysisCache(cache_dir))


#: The start of main in the C programs :func:`run_released` drives: n from argv[1], then "ready" and
#: the wait for the release byte (before it the program makes no syscall worth sampling).
WAIT_FOR_RELEASE = r"""    long n = atol(argv[1]);
    char c;
    write(1, "ready\n", 6);
    if (read(0, &c, 1) != 1)
        return 1;
"""


def run_released(s: UnwindSampler, argv: list[str],
                 on_ready: Callable[[int], None] | None = None) -> tuple[list[UnwoundSample], int]:
    """Run ``argv`` (a program that prints ``ready`` and waits for one byte on stdin), track it once
    it is ready (``on_ready(pid)`` first, while its mappings are those of the run), release it and
    collect its samples until the rings stay quiet for 0.3 s; returns them and its pid."""
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None
    assert p.stdout.readline() == b"ready\n"
    if on_ready is not None:
        on_ready(p.pid)
    s.track(p.pid)
    p.stdin.write(b"x")
    p.stdin.close()
    assert p.wait(timeout=60) == 0
    return drain(s, p.pid), p.pid


@contextlib.contextmanager
def between_phases(s: UnwindSampler, argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (a program that prints ``ready``, waits for a byte, runs its first phase, prints
    ``mid`` and waits for another byte before its second phase) tracked by ``s``: the block runs
    between the two phases, then the second one runs to the program's successful end."""
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline() == b"ready\n"
        s.track(p.pid)
        p.stdin.write(b"x")
        p.stdin.flush()
        assert p.stdout.readline() == b"mid\n"
        yield p
        p.stdin.write(b"x")
        p.stdin.close()
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def drain(s: UnwindSampler | SyscallSampler, tgid: int) -> list[Any]:
    """What ``s`` delivers for process ``tgid`` until its rings stay quiet for 0.3 s."""
    out: list[Any] = []
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 0.3:
        got = s.poll(50)
        if got:
            quiet_since = time.monotonic()
            out.extend(x for x in got if x.tgid == tgid)
    return out


#: A program whose ``work(1)`` makes an ia32 ``getpid`` (``int $0x80``; x86-64 20 would be writev) and
#: ``work(0)`` the x86-64 one: learned on ``0``, the compat call of ``1`` is a context never seen
#: (tests/test_compat_syscalls.py, tests/test_anomaly_daemon.py; the compat watch).
IA32_SWITCHED = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((noinline)) long ia32_getpid(void) {
    long r;
    asm volatile("int $0x80" : "=a"(r) : "0"(20L) : "memory");  /* ia32 getpid */
    return r;
}
__attribute__((noinline)) long work(int evil) { return evil ? ia32_getpid() : getpid(); }
int main(int argc, char **argv) {
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%ld\n", work(argc > 1 && atoi(argv[1])));
    write(1, buf, n);
    return 0;
}
"""
