"""``ccprofd trace --mode unwind`` against ``strace -f -k`` and gdb, sample by sample.

The real CLI runs each test program (stack unwound in BPF at every syscall, encoded there with the
binary's Valence plan, decoded here); the same command runs under the oracle (ptrace + libunwind,
or gdb for stacks deeper than strace's 256 frames), and ``fidelity.compare`` matches threads by
creation order, syscalls by ordinal, and every frame of the binary by function and return address.
``--verify`` re-encodes each new context's own stack with the reference ``Encoder`` in userspace:
the run's summary must report zero mismatches.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_bpf, require_tool
from fidelity import compare
from programs.build import build
from strace_oracle import Trace, run_strace

SYSCALLS = ["write", "openat", "getppid", "close"]
REPO = pathlib.Path(__file__).resolve().parent.parent


def trace(cmd: list[str], syscalls: list[str], tmp_path: pathlib.Path, *extra: str,
          check: bool = True) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    out = tmp_path / "samples.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--verify", "--format", "jsonl",
            "--syscalls", ",".join(syscalls), "--output", str(out), *extra, "--", *cmd]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return samples, proc


def check_against(oracle: Trace, samples: list[dict[str, Any]], binary: pathlib.Path,
                  symbols: pathlib.Path | None = None) -> Any:
    result = compare(samples, oracle, binary, symbols_path=symbols)
    assert result.ok, result.report()
    return result.stats


def assert_verified(proc: subprocess.CompletedProcess[str]) -> None:
    """The --verify line: every new context's BPF encoding equal to the reference Encoder's."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ccprofd: verify:")]
    assert len(lines) == 1, proc.stderr
    words = lines[0].split()
    checked, mismatches = int(words[2]), int(words[5])
    assert checked >= 1 and mismatches == 0, lines[0]


@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    require_bpf()
    require_tool("strace")


CASES = [
    ("calls", []), ("recursion", ["10"]), ("recursion", ["70"]), ("tailcall", []), ("fptr", []),
    ("threads", ["70"]), ("longjmp", ["70"]), ("exceptions", ["70"]), ("sighandler", []), ("forks", []),
    ("execs", []), ("switch", []),
]
VARIANTS = [pytest.param({"opt": "O0", "pie": True}, id="O0-pie"),
            pytest.param({"opt": "O2", "pie": False}, id="O2-nopie"),
            pytest.param({"opt": "O2", "pie": True, "frame_pointer": False}, id="O2-pie-nofp")]


@pytest.mark.bpf
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("name", "args"), CASES, ids=[f"{n}-{'-'.join(a) or 'default'}" for n, a in CASES])
def test_matches_strace(name: str, args: list[str], variant: dict[str, Any], tmp_path: pathlib.Path) -> None:
    binary = pathlib.Path(build(name, **variant))
    cmd = [str(binary), *args]
    oracle = run_strace(cmd, SYSCALLS)
    samples, proc = trace(cmd, SYSCALLS, tmp_path)
    stats = check_against(oracle, samples, binary)
    assert stats.samples_compared >= 4
    assert stats.frames_compared >= 3
    assert stats.incomplete_samples == 0, [s for s in samples if not s["complete"]]
    assert not [s for s in samples if not s["complete"]]  # loader and exit-time syscalls too
    assert proc.stdout == oracle.stdout
    assert_verified(proc)


@pytest.mark.bpf
@pytest.mark.parametrize("pie", [True, False], ids=["pie", "nopie"])
@pytest.mark.parametrize("name", ["calls", "recursion", "fptr", "tailcall"])
def test_stripped(name: str, pie: bool, tmp_path: pathlib.Path) -> None:
    binary = pathlib.Path(build(name, opt="O2", pie=pie, strip=True, frame_pointer=False))
    symbols = pathlib.Path(build(name, opt="O2", pie=pie, frame_pointer=False))
    cmd = [str(binary)] + (["70"] if name == "recursion" else [])
    oracle = run_strace(cmd, SYSCALLS)
    samples, _ = trace(cmd, SYSCALLS, tmp_path)
    stats = check_against(oracle, samples, binary, symbols)
    assert stats.samples_compared >= 4 and stats.incomplete_samples == 0


@pytest.mark.bpf
def test_fork_child_behind_a_backlog(tmp_path: pathlib.Path) -> None:
    """A fork child's samples taken in a poll full of other samples: the fork event that gives the
    child its parent's mappings is read before they are decoded.  Before, a full budget of samples
    left the event ring unread, and --verify re-encoded the child's stacks with no mappings (3
    mismatches of 6 contexts, every run; gdb's libiberty vfork child showed it first)."""
    binary = pathlib.Path(build("forkburst", opt="O2"))
    cmd = [str(binary)]
    oracle = run_strace(cmd, ["close"])  # the bursts' getppid are ours only (ignored)
    samples, proc = trace(cmd, ["getppid", "close"], tmp_path)
    assert proc.stdout == oracle.stdout == "forkburst: done\n"
    stats = check_against(oracle, samples, binary)
    # the loader's two closes (of ld.so.cache and libc) and the child's three
    assert stats.samples_compared == 5 and stats.incomplete_samples == 0, stats
    child = [s for s in samples if s["syscall"] == "close" and s["pid"] != samples[-1]["pid"]]
    assert len(child) == 3
    for s in child:
        names = [f["function"] for f in s["frames"] if f["analysed"]]
        assert names == ["main", "spawn", "child_work"], names
    assert sum(1 for s in samples if s["syscall"] == "getppid") == 40000
    assert_verified(proc)


@pytest.mark.bpf
def test_deep_recursion_against_gdb(tmp_path: pathlib.Path) -> None:
    """Thousands of frames (beyond strace's 256 and bpf_get_stack's 127): exact against gdb, with
    the recursion compressed in recID."""
    require_tool("gdb")
    from gdb_oracle import run_gdb

    binary = pathlib.Path(build("recursion", opt="O2", pie=True, frame_pointer=False))
    cmd = [str(binary), "1300"]
    oracle, _ = run_gdb(cmd, ["getppid", "openat", "write"], timeout=600)
    samples, _ = trace(cmd, ["getppid", "openat", "write"], tmp_path)
    stats = check_against(oracle, samples, binary)
    assert stats.incomplete_samples == 0
    depths = sorted(len([f for f in s["frames"] if f["analysed"]]) for s in samples if s["frames"])
    assert depths[-1] == 3 * 1301 + 1  # main + ring_a/b/c * 1301 (gdb agreed frame by frame above)


@pytest.mark.bpf
def test_libc_frames_between_syscall_and_binary(tmp_path: pathlib.Path) -> None:
    """Unanalysed frames carry their module, build-id, symbol name and own return address; in a
    -fomit-frame-pointer binary the libc frames under qsort were unwound through CFI."""
    binary = pathlib.Path(build("fptr", opt="O2", pie=True, frame_pointer=False))
    samples, _ = trace([str(binary)], ["getppid"], tmp_path)
    chains = [[(f["function"], f["analysed"]) for f in s["frames"]]
              for s in samples if s["frames"]]
    via_qsort = [c for c in chains if ("cmp_int", True) in c]
    assert via_qsort, chains
    for c in via_qsort:
        i, j = c.index(("sort_it", True)), c.index(("cmp_int", True))
        assert j - i >= 2 and all(not a for _, a in c[i + 1:j])  # libc frames in between
        assert c[i + 1][0] in ("qsort", "qsort_r")
    libc = [f for s in samples for f in s["frames"] if not f["analysed"]]
    assert libc and all(f["module"] and f["module"].startswith("/") and f["build_id"] for f in libc)
    inner = [s["frames"][-1] for s in samples if s["frames"]]
    assert all(not f["analysed"] and f["return_address"] is None and f["function"] == "getppid"
               for f in inner)
    middle = [f for s in samples for f in s["frames"][:-1] if not f["analysed"]]
    assert middle and all(f["return_address"] for f in middle)


PLUGIN_C = r"""
#include <unistd.h>
volatile long plug_sink;
__attribute__((constructor)) static void plug_init(void) { plug_sink = getppid(); }
__attribute__((noinline)) static int plug_inner(int (*cb)(int), int depth, int n) {
    if (depth == 0) return cb(n);
    int r = plug_inner(cb, depth - 1, n);
    plug_sink += r;
    return r + 1;
}
__attribute__((noinline)) int plug_run(int (*cb)(int), int n) {
    return plug_inner(cb, 3, n) + (int)getppid() * 0;
}
"""

DLMAIN_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
volatile long sink;
__attribute__((noinline)) int from_plugin(int n) {
    if (n == 0) { sink = getppid(); return 1; }
    int r = from_plugin(n - 1);
    sink += r;
    return r + 1;
}
__attribute__((noinline)) int run_plugin(const char *path) {
    void *h = dlopen(path, RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return -1; }
    int (*run)(int (*)(int), int) = (int (*)(int (*)(int), int))dlsym(h, "plug_run");
    int r = run(from_plugin, 5);
    sink = write(1, "plugin done\n", 12);
    return r;
}
int main(int argc, char **argv) { return run_plugin(argv[1]) > 0 ? 0 : 1; }
"""


@pytest.mark.bpf
def test_dlopen_library_frames(tmp_path: pathlib.Path) -> None:
    """A library loaded with dlopen mid-run: its constructor's syscall (under dlopen), and a
    callback from its own recursion into the binary.  Its frames (no frame pointers) are unwound
    through its CFI from the mappings re-read at the dlopen, exact against strace."""
    gcc = require_tool("gcc")
    (tmp_path / "plug.c").write_text(PLUGIN_C)
    (tmp_path / "dlmain.c").write_text(DLMAIN_C)
    lib, binary = tmp_path / "libplug.so", tmp_path / "dlmain"
    subprocess.run([gcc, "-O2", "-g", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", str(lib),
                    str(tmp_path / "plug.c")], check=True)
    subprocess.run([gcc, "-O2", "-g", "-fomit-frame-pointer", "-o", str(binary), str(tmp_path / "dlmain.c"),
                    "-ldl"], check=True)
    cmd = [str(binary), str(lib)]
    oracle = run_strace(cmd, SYSCALLS)
    samples, proc = trace(cmd, SYSCALLS, tmp_path)
    stats = check_against(oracle, samples, binary)
    assert stats.incomplete_samples == 0 and not [s for s in samples if not s["complete"]]
    assert_verified(proc)
    plugin_frames = [[f["function"] for f in s["frames"] if f["module"] == str(lib)]
                     for s in samples if s["syscall"] == "getppid"]
    assert ["plug_init"] in plugin_frames  # the constructor, under dlopen
    callback = [s for s in samples if any(f["function"] == "from_plugin" for f in s["frames"])]
    assert len(callback) == 1
    names = [f["function"] for f in callback[0]["frames"]]
    i, j = names.index("run_plugin"), names.index("from_plugin")
    between = callback[0]["frames"][i + 1:j]
    # plug_inner recursing (gcc may clone it: plug_inner.*) between the binary's two frames
    assert len(between) >= 3 and all(f["module"] == str(lib) and f["build_id"] and f["return_address"]
                                     and f["function"].startswith("plug_") for f in between), between
    assert names[j:] == ["from_plugin"] * 6 + ["getppid"]


SPIN_C = r"""
#include <stdlib.h>
volatile unsigned long sink;
__attribute__((noinline)) void spin(unsigned long n) { for (unsigned long i = 0; i < n; i++) sink += i * i; }
__attribute__((noinline)) void outer(unsigned long n) { spin(n); sink++; }
int main(int argc, char **argv) { outer(strtoul(argv[1], 0, 10)); return 0; }
"""


@pytest.mark.bpf
def test_cpu_samples(tmp_path: pathlib.Path) -> None:
    """--sample-hz: CPU-clock samples of the traced process, decoded the same way: inside spin()
    (pc in the binary: call_site is the sampled pc), called from outer() at the call objdump shows."""
    from bpf_helpers import compile_c, direct_call_sites

    binary = compile_c(tmp_path, "spin", SPIN_C, "-O1", "-fomit-frame-pointer")
    samples, _ = trace([str(binary), "400000000"], ["getppid"], tmp_path, "--sample-hz", "199")
    cpu = [s for s in samples if s["event"] == "cpu"]
    assert len(cpu) >= 10, len(cpu)
    assert all(s["syscall"] is None and s["complete"] for s in cpu)
    calls = {(c.function, c.target): c.vaddr for c in direct_call_sites(binary)}
    in_spin = [s for s in cpu if [f["function"] for f in s["frames"]] == ["main", "outer", "spin"]]
    assert len(in_spin) >= 0.9 * len(cpu), [[f["function"] for f in s["frames"]] for s in cpu][:5]
    for s in in_spin:
        main, outer, spin = s["frames"]
        assert int(outer["call_site"], 16) == calls[("outer", "spin")]
        assert int(outer["return_address"], 16) == calls[("outer", "spin")] + 5
        assert int(main["call_site"], 16) == calls[("main", "outer")]
        assert spin["return_address"] is None and spin["call_site"] is not None


def analysed_contexts(samples: list[dict[str, Any]]) -> dict[int, list[tuple[str, list[tuple[Any, Any]]]]]:
    """Per thread (creation order = tid order), per syscall: the analysed non-tail frames."""
    by_tid: dict[int, list[tuple[str, list[tuple[Any, Any]]]]] = {}
    for s in sorted(samples, key=lambda s: s["time_ns"]):
        if s["event"] != "syscall":
            continue
        frames = [(f["function"], f["return_address"]) for f in s["frames"]
                  if f["analysed"] and not f.get("tail_call")]
        by_tid.setdefault(s["tid"], []).append((s["syscall"], frames if s["complete"] else None))
    return {i: by_tid[t] for i, t in enumerate(sorted(by_tid))}


@pytest.mark.bpf
@pytest.mark.parametrize(("name", "args"), [
    ("calls", []), ("recursion", ["70"]), ("tailcall", []), ("fptr", []), ("threads", ["30"]),
    ("longjmp", ["30"]), ("exceptions", ["30"]), ("sighandler", [])])
def test_same_contexts_as_instrumented_mode(name: str, args: list[str], tmp_path: pathlib.Path) -> None:
    """Both modes on the same program: identical decoded contexts over the analysed frames, sample by
    sample (tail-call frames, which only instrumented mode sees, excepted; the innermost frame's
    return address too when instrumented mode left the binary through a tail jump)."""
    binary = pathlib.Path(build(name, opt="O2", pie=True))
    cmd = [str(binary), *args]
    unwound, _ = trace(cmd, SYSCALLS, tmp_path)
    out = tmp_path / "instrumented.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented", "--format",
                           "jsonl", "--syscalls", ",".join(SYSCALLS), "--output", str(out), "--", *cmd],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    instrumented = [json.loads(line) for line in out.read_text().splitlines()]
    a, b = analysed_contexts(unwound), analysed_contexts(instrumented)
    assert sorted(a) == sorted(b)
    compared = 0
    for t in a:
        # the loader's syscalls have no analysed frame in either mode
        ua = [x for x in a[t] if x[1] or x[1] is None]
        ib = [x for x in b[t] if x[1] or x[1] is None]
        assert len(ua) == len(ib), (t, ua, ib)
        for (sa, fa), (sb, fb) in zip(ua, ib, strict=True):
            assert sa == sb
            assert fa is not None
            if fb is None:
                continue  # instrumented mode flagged it incomplete
            assert [f for f, _ in fa] == [f for f, _ in fb]
            assert fa[:-1] == fb[:-1]
            compared += 1
    assert compared >= 3


@pytest.mark.bpf
@pytest.mark.parametrize("variant", VARIANTS)
def test_signal_return_against_gdb(variant: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """The ``rt_sigreturn`` that ends every signal handler is made by glibc's ``__restore_rt``,
    whose FDE covers exactly its two instructions, so the pc after the syscall lies past it: the
    sample was flagged ``no_cfi`` (every handled signal an ``incomplete_context``).  A syscall
    sample's own pc is now looked up inside the syscall instruction.  The chain goes on through the
    signal frame into the interrupted ``main > trigger > raise``, frame by frame as gdb has it."""
    require_tool("gdb")
    from gdb_oracle import run_gdb

    binary = pathlib.Path(build("sighandler", **variant))
    cmd = [str(binary)]
    oracle, _ = run_gdb(cmd, ["rt_sigreturn", "getppid"], timeout=600)
    samples, _ = trace(cmd, ["rt_sigreturn", "getppid"], tmp_path)
    stats = check_against(oracle, samples, binary)
    returns = [s for s in samples if s["syscall"] == "rt_sigreturn"]
    assert len(returns) == 1 and returns[0]["complete"], returns
    assert stats.incomplete_samples == 0
    names = [f["function"] for f in returns[0]["frames"] if f["analysed"]]
    assert names == ["main", "trigger"], names
