"""The pprof endpoints end to end: the real ``ccprofd run`` (unwind mode, real BPF) following a
running program, and ``go tool pprof`` fetching ``/debug/pprof/syscalls`` and
``/debug/pprof/profile`` over HTTP itself.  What the profile says is checked against independent
sources: the mappings against the program's ``/proc/PID/maps`` and ``readelf -n`` build-ids, the
addresses by letting pprof re-symbolise them from the binary's own DWARF (``-symbolize=force``:
pprof's ELF/DWARF reader turns each runtime address back into function and source line, which only
works when mapping ranges, file offsets and addresses are right), and the function names against
the program's source."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from bpf_helpers import compile_c
from conftest import require_tool
from daemon_fakes import config_text
from daemon_harness import RunningDaemon, target_toml

from ccprofd.export.gen import ccprofd_pb2 as pb

# Runs until killed: getppid() five times through main > work_a > leaf, then CPU time in
# main > burn > spin, then getppid() in a qsort comparator (libc between two frames of the program),
# then getpid() in note(), always inlined into outer(), then a 2 ms sleep.  The markers name the
# lines the checks expect.
PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
volatile unsigned long sink;
__attribute__((noinline)) long leaf(void) {
    return getppid(); /* L_LEAF */
}
__attribute__((noinline)) long work_a(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += leaf(); /* L_WORK */
    return s;
}
static int cmp(const void *a, const void *b) {
    getppid(); /* L_CMP */
    return *(const int *)a - *(const int *)b;
}
__attribute__((noinline)) void sorter(void) {
    int v[2] = {2, 1};
    qsort(v, 2, sizeof v[0], cmp); /* L_SORT */
}
__attribute__((noinline)) void spin(void) {
    for (unsigned long i = 0; i < 4000000UL; i++) sink += i; /* L_SPIN */
}
__attribute__((noinline)) void burn(void) {
    spin(); /* L_BURN */
}
static inline __attribute__((always_inline)) long note(int x) {
    return getpid() + x; /* L_NOTE */
}
__attribute__((noinline)) long outer(int x) {
    long r = note(x); /* L_OUTER */
    return r + 1;
}
int main(void) {
    struct timespec ts = {0, 2000000};
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    for (;;) {
        work_a(5); /* L_MAIN_WORK */
        burn(); /* L_MAIN_BURN */
        sorter(); /* L_MAIN_SORT */
        outer(3); /* L_MAIN_OUTER */
        nanosleep(&ts, NULL);
    }
}
"""


def line_of(marker: str) -> int:
    """The source line (1-based, as compile_c writes PROGRAM) holding ``marker``."""
    return next(i for i, text in enumerate(PROGRAM.splitlines(), 1) if marker in text)


def build_id(path: str) -> str:
    out = subprocess.run([require_tool("readelf"), "-n", path], capture_output=True, text=True,
                         check=True).stdout
    found = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert found, out
    return found.group(1)


def exec_maps(pid: int) -> dict[str, tuple[int, int, int]]:
    """path -> (start, end, offset) of each file's r-x mapping, from /proc/PID/maps."""
    out = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and "x" in parts[1] and parts[5].startswith("/"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out[parts[5]] = (lo, hi, int(parts[2], 16))
    return out


def raw_mappings(raw: str) -> dict[int, tuple[int, int, int, str, str]]:
    """`go tool pprof -raw`'s Mappings section: id -> (start, limit, offset, file, build-id)."""
    section = raw.split("\nMappings\n", 1)[1]
    out = {}
    for line in section.splitlines():
        m = re.match(r"\s*(\d+): 0x([0-9a-f]+)/0x([0-9a-f]+)/0x([0-9a-f]+) (\S+) ?([0-9a-f]*)", line)
        if m:
            out[int(m[1])] = (int(m[2], 16), int(m[3], 16), int(m[4], 16), m[5], m[6])
    return out


def traces(text: str) -> list[list[str]]:
    """The stacks of `go tool pprof -traces` (leaf first), one entry per frame: the frame's text
    without the sample value and label lines."""
    out = []
    for block in text.split("-----------+-------------------------------------------------------")[1:]:
        frames = []
        for line in block.splitlines():
            if re.match(r"\s*\w+:\s", line):  # a label line: "    target:  prog"
                continue
            frame = re.sub(r"^\s*\d[\d.]*(ns|us|µs|ms|s|m|h)?\s+", "", line).strip()  # value column
            if frame:
                frames.append(frame)
        if frames:
            out.append(frames)
    return out


def raw_locations(raw: str) -> dict[int, tuple[int, int, list[str]]]:
    """`go tool pprof -raw`'s Locations section: id -> (address, mapping id, its lines innermost
    first as "function file:line")."""
    section = raw.split("\nLocations\n", 1)[1].split("\nMappings\n", 1)[0]
    out: dict[int, tuple[int, int, list[str]]] = {}
    last = 0
    for line in section.splitlines():
        m = re.match(r"\s*(\d+): 0x([0-9a-f]+) (?:M=(\d+) )?(.*?) s=\d+$", line)
        if m:
            last = int(m[1])
            out[last] = (int(m[2], 16), int(m[3] or 0), [m[4]])
        elif (more := re.match(r"\s+(\S.*?) s=\d+$", line)) and last:
            out[last][2].append(more[1])
    return out


def elf_address(binary: str, runtime: int, mapping: tuple[int, int, int]) -> int:
    """The ELF virtual address of a runtime address in ``mapping`` (start, end, file offset), through
    the program headers `readelf -lW` lists: file offset -> the executable LOAD segment's vaddr."""
    start, _, offset = mapping
    at = runtime - start + offset
    out = subprocess.run([require_tool("readelf"), "-lW", binary], capture_output=True, text=True,
                         check=True).stdout
    load = r"^\s*LOAD\s+0x([0-9a-f]+) 0x([0-9a-f]+) 0x[0-9a-f]+ 0x([0-9a-f]+) 0x[0-9a-f]+ (.*?) 0x"
    for m in re.finditer(load, out, re.M):
        off, vaddr, size = (int(x, 16) for x in m.groups()[:3])
        if "E" in m[4] and off <= at < off + size:
            return vaddr + at - off
    raise AssertionError(f"{at:#x} in no executable LOAD segment of {binary}:\n{out}")


def addr2line_lines(binary: str, addr: int) -> list[str]:
    """``addr2line -f -i -e BINARY ADDR`` as pprof prints lines: "function file:line", innermost
    first (the inlined functions, then the function they are in)."""
    out = subprocess.run([require_tool("addr2line"), "-f", "-i", "-e", binary, f"{addr:#x}"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return [f"{fn} {where.split()[0]}" for fn, where in zip(out[0::2], out[1::2], strict=True)]


def pprof(go: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([go, "tool", "pprof", *args], capture_output=True, text=True, env=env, timeout=600,
                          check=True)


def test_go_tool_pprof_fetches_real_mappings_addresses_and_names(bpf: None, workdir: str,
                                                                 tmp_path: Path) -> None:
    go = require_tool("go")  # golang-go: installed by scripts/setup.sh, so CI=true fails without it
    binary = compile_c(tmp_path, "pprofprog", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    prog = subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True)
    env = dict(os.environ, PPROF_TMPDIR=str(tmp_path), HOME=str(tmp_path))
    try:
        assert prog.stdout is not None and prog.stdout.readline() == "ready\n"
        target = target_toml("prog", f'path = "{binary}"', ["getppid", "getpid"], "unwind",
                             "perf_sample_hz = 99\n")
        with RunningDaemon(workdir, config_text(workdir, target)) as daemon:
            daemon.wait_tracked(prog.pid)
            base = daemon.metrics_url().removesuffix("/metrics")
            maps = exec_maps(prog.pid)
            libc = next(p for p in maps if re.search(r"/libc[.-]", p))

            # ---- the syscall profile, fetched by pprof itself
            fetched = pprof(go, env, "-raw", f"{base}/debug/pprof/syscalls?seconds=3")
            saved = re.search(r"Saved profile in (\S+)", fetched.stderr)
            assert saved, fetched.stderr
            mappings = raw_mappings(fetched.stdout)
            # Mapping 1 is the program, at its r-x range of the process, with its build-id.
            assert mappings[1] == (*maps[str(binary)], str(binary), build_id(str(binary))), fetched.stdout
            # libc: its own mapping, its real range and the build-id readelf reads from the file.
            (lib,) = [m for m in mappings.values() if m[3] == libc]
            assert lib == (*maps[libc], libc, build_id(libc))
            top = pprof(go, env, "-top", saved[1]).stdout
            assert re.search(r"^File: pprofprog$", top, re.M), top
            # The stack the program makes, names as in its source (libc's getppid below leaf).
            stacks = traces(pprof(go, env, "-traces", saved[1]).stdout)
            assert ["syscall:getppid", "getppid", "leaf", "work_a", "main"] in stacks, stacks
            # pprof re-symbolises the runtime addresses from the binary's DWARF: the call lines.
            forced = traces(pprof(go, env, "-symbolize=force", "-lines", "-traces", saved[1]).stdout)
            src = binary.with_suffix(".c")
            want = [f"leaf {src}:{line_of('L_LEAF')}", f"work_a {src}:{line_of('L_WORK')}",
                    f"main {src}:{line_of('L_MAIN_WORK')}"]
            assert any(s[-3:] == want for s in forced), forced
            # -list does not print the binary as source (function file names were its path).
            # A library frame between two of the program's (qsort's, below the comparator) is at
            # a runtime address inside libc's mapping, and the program's frames around it resolve.
            raw = pprof(go, env, "-raw", saved[1]).stdout
            lib_id = next(i for i, m in mappings.items() if m[3] == libc)
            locs = {int(m[1]): (int(m[2], 16), int(m[3] or 0), m[4]) for m in
                    re.finditer(r"^\s*(\d+): 0x([0-9a-f]+) (?:M=(\d+) )?(\S+)", raw, re.M)}
            samples = [[int(x) for x in m[1].split()]
                       for m in re.finditer(r"^\s*\d+: ((?:\d+ )+)$", raw, re.M)]
            cmp_stacks = [ids for ids in samples if any(locs[i][2] == "cmp" for i in ids)]
            assert cmp_stacks, raw
            for ids in cmp_stacks:
                outer = locs[ids[[locs[i][2] for i in ids].index("cmp") + 1]]
                assert outer[1] == lib_id and lib[0] <= outer[0] < lib[1], (outer, lib, raw)
            want = [f"cmp {src}:{line_of('L_CMP')}"]
            assert any(want[0] in st and f"sorter {src}:{line_of('L_SORT')}" in st for st in forced), forced
            listed = pprof(go, env, "-list", "leaf", saved[1]).stdout
            assert "ELF" not in listed and "\x00" not in listed, listed[:500]
            listed = pprof(go, env, "-symbolize=force", "-list", "leaf", saved[1]).stdout
            assert "return getppid(); /* L_LEAF */" in listed, listed

            # ---- the CPU profile at the standard path, `-seconds` as pprof users pass it
            fetched = pprof(go, env, "-seconds", "3", "-traces", f"{base}/debug/pprof/profile")
            saved = re.search(r"Saved profile in (\S+)", fetched.stderr)
            assert saved, fetched.stderr
            assert re.search(r"^Type: cpu$", fetched.stdout, re.M), fetched.stdout
            assert ["spin", "burn", "main"] in traces(fetched.stdout), fetched.stdout
            forced = traces(pprof(go, env, "-symbolize=force", "-lines", "-traces", saved[1]).stdout)
            want = [f"spin {src}:{line_of('L_SPIN')}", f"burn {src}:{line_of('L_BURN')}",
                    f"main {src}:{line_of('L_MAIN_BURN')}"]
            assert want in forced, forced
            mappings = raw_mappings(pprof(go, env, "-raw", saved[1]).stdout)
            assert mappings[1][3] == str(binary)

            # gRPC still serves while a window is open elsewhere (sanity: the daemon is healthy)
            assert daemon.stub.ListTargets(pb.ListTargetsRequest(), timeout=10).targets
            daemon.stop().assert_clean()
    finally:
        prog.kill()
        prog.wait(timeout=30)


def test_go_tool_pprof_lines_come_from_the_daemon_not_from_resymbolisation(bpf: None, workdir: str,
                                                                           tmp_path: Path) -> None:
    """Issue 17: the daemon's frames carry DWARF file/line and inlined calls (``source_lines``, on by
    default), so `go tool pprof -lines` shows source lines WITHOUT re-symbolising (``-symbolize=none``:
    pprof reads only the profile): every location of the program has the lines `addr2line -f -i`
    gives for its address (its ELF address computed from /proc/PID/maps and `readelf -l`), and the
    always-inlined note() is its own line above outer() at outer's one location."""
    go = require_tool("go")
    binary = compile_c(tmp_path, "pprofprog", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    prog = subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True)
    env = dict(os.environ, PPROF_TMPDIR=str(tmp_path), HOME=str(tmp_path))
    try:
        assert prog.stdout is not None and prog.stdout.readline() == "ready\n"
        target = target_toml("prog", f'path = "{binary}"', ["getppid", "getpid"], "unwind")
        with RunningDaemon(workdir, config_text(workdir, target)) as daemon:
            daemon.wait_tracked(prog.pid)
            base = daemon.metrics_url().removesuffix("/metrics")
            maps = exec_maps(prog.pid)
            fetched = pprof(go, env, "-symbolize=none", "-raw", f"{base}/debug/pprof/syscalls?seconds=3")
            saved = re.search(r"Saved profile in (\S+)", fetched.stderr)
            assert saved, fetched.stderr
            daemon.stop().assert_clean()
        mappings = raw_mappings(fetched.stdout)
        assert mappings[1][3] == str(binary)
        locations = raw_locations(fetched.stdout)
        mine = {i: loc for i, loc in locations.items() if loc[1] == 1}
        assert mine, fetched.stdout
        for address, _, lines in mine.values():
            want = addr2line_lines(str(binary), elf_address(str(binary), address, maps[str(binary)]))
            assert lines == want, (hex(address), lines, want, fetched.stdout)
        src = binary.with_suffix(".c")
        note = next(loc for loc in mine.values() if loc[2][0].startswith("note "))
        assert note[2] == [f"note {src}:{line_of('L_NOTE')}", f"outer {src}:{line_of('L_OUTER')}"], note
        stacks = traces(pprof(go, env, "-symbolize=none", "-lines", "-traces", saved[1]).stdout)
        want_stack = [f"note {src}:{line_of('L_NOTE')} (inline)", f"outer {src}:{line_of('L_OUTER')}",
                      f"main {src}:{line_of('L_MAIN_OUTER')}"]
        assert any(s[-3:] == want_stack for s in stacks), stacks
        want_stack = [f"leaf {src}:{line_of('L_LEAF')}", f"work_a {src}:{line_of('L_WORK')}",
                      f"main {src}:{line_of('L_MAIN_WORK')}"]
        assert any(s[-3:] == want_stack for s in stacks), stacks
        listed = pprof(go, env, "-symbolize=none", "-list", "outer", saved[1]).stdout
        assert "long r = note(x); /* L_OUTER */" in listed, listed
    finally:
        prog.kill()
        prog.wait(timeout=30)


def test_traces_parser_reads_pprof_output() -> None:
    """The -traces parser above, on text in go tool pprof's format."""
    text = ("File: x\n-----------+-------------------------------------------------------\n"
            "    target:  prog\n       pid:  12\n        230   syscall:getppid\n"
            "             leaf /a.c:5\n             main /a.c:9\n"
            "-----------+-------------------------------------------------------\n"
            "      10ms   spin\n             main\n"
            "-----------+-------------------------------------------------------\n")
    assert traces(text) == [["syscall:getppid", "leaf /a.c:5", "main /a.c:9"], ["spin", "main"]]
