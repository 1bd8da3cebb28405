"""``ccprofd trace`` (instrumented mode) against ``strace -f -k`` and gdb, sample by sample.

Each test runs the real CLI on a test program (probes attached before exec), runs the same command
under the oracle, and compares with ``fidelity.compare``: threads by creation order, syscalls by
ordinal within the thread, every frame of the binary by function and return address.  The oracle is
independent of ccprofd (ptrace + libunwind / gdb); see tests/fidelity.py for the rules.
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
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented", "--format", "jsonl",
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
            pytest.param({"opt": "O2", "pie": False}, id="O2-nopie")]


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
    # Nothing was flagged: every case here is one instrumented mode must get exactly right.
    assert stats.incomplete_samples == 0, [s for s in samples if not s["complete"]]
    assert proc.stdout == oracle.stdout  # the command's own output passes through untouched


@pytest.mark.bpf
@pytest.mark.parametrize("pie", [True, False], ids=["pie", "nopie"])
@pytest.mark.parametrize("name", ["calls", "recursion", "fptr", "tailcall"])
def test_stripped(name: str, pie: bool, tmp_path: pathlib.Path) -> None:
    binary = pathlib.Path(build(name, opt="O2", pie=pie, strip=True))
    symbols = pathlib.Path(build(name, opt="O2", pie=pie))
    cmd = [str(binary)] + (["70"] if name == "recursion" else [])
    oracle = run_strace(cmd, SYSCALLS)
    samples, _ = trace(cmd, SYSCALLS, tmp_path)
    stats = check_against(oracle, samples, binary, symbols)
    assert stats.samples_compared >= 4 and stats.incomplete_samples == 0


@pytest.mark.bpf
def test_tail_frames_and_callbacks_are_reported(tmp_path: pathlib.Path) -> None:
    """Beyond the machine stack: tail-call frames (null return address) and the unanalysed library
    frame between a caller and its callback, in the places the sources put them."""
    binary = pathlib.Path(build("tailcall", opt="O2", pie=True))
    samples, _ = trace([str(binary)], ["getppid"], tmp_path)
    chains = [[(f["function"], bool(f.get("tail_call"))) for f in s["frames"]]
              for s in samples if s["frames"]]
    assert [("main", False), ("chain", True), ("step", True), ("finish", False)] in chains
    assert [("main", False), ("tail_plt", True)] in chains
    assert [("main", False), ("notail", False), ("finish", False)] in chains
    for s in samples:
        for f in s["frames"]:
            assert (f["return_address"] is None) == bool(f.get("tail_call")) or not f["analysed"]

    binary = pathlib.Path(build("fptr", opt="O0", pie=True))
    samples, _ = trace([str(binary)], ["getppid"], tmp_path)
    chains = [[(f["function"], f["analysed"]) for f in s["frames"]] for s in samples if s["frames"]]
    assert [("main", True), ("sort_it", True), ("qsort", False), ("cmp_int", True)] in chains
    assert [("main", True), ("run_table", True), ("op_sys", True)] in chains


@pytest.mark.bpf
def test_deep_recursion_against_gdb(tmp_path: pathlib.Path) -> None:
    """Thousands of frames (far beyond uretprobes' 64 and strace's 256): exact against gdb."""
    require_tool("gdb")
    from gdb_oracle import run_gdb

    binary = pathlib.Path(build("recursion", opt="O2", pie=True))
    cmd = [str(binary), "1500"]
    oracle, _ = run_gdb(cmd, ["getppid", "openat", "write"], timeout=600)
    samples, _ = trace(cmd, ["getppid", "openat", "write"], tmp_path)
    stats = check_against(oracle, samples, binary)
    assert stats.incomplete_samples == 0
    depths = sorted(len(s["frames"]) for s in samples if s["frames"])
    assert depths[-1] == 3 * 1501 + 1  # main + ring_a/b/c * 1501 (checked by gdb above as well)


@pytest.mark.bpf
def test_deeper_than_the_state_bound_is_flagged(tmp_path: pathlib.Path) -> None:
    """Past the per-thread bound (8192 pieces) a sample says complete: false and stays a suffix of
    the truth; samples after the recursion unwinds are complete again."""
    binary = pathlib.Path(build("recursion", opt="O2", pie=True))
    cmd = [str(binary), "3000"]  # ring: 3 * 3001 frames > 8192
    oracle = run_strace(cmd, SYSCALLS)
    samples, _ = trace(cmd, SYSCALLS, tmp_path)
    stats = check_against(oracle, samples, binary)
    flagged = [s for s in samples if not s["complete"]]
    assert [s["syscall"] for s in flagged] == ["openat", "close"]
    after = [s for s in samples if s["syscall"] == "write" and s["time_ns"] > flagged[-1]["time_ns"]]
    assert after and all(s["complete"] for s in after)
    assert stats.samples_compared >= 8


CONDITIONAL_TAIL_CALL = r"""
#include <unistd.h>
volatile long sink;
__attribute__((noinline, noipa)) int target(int x) { sink = getppid(); return x; }
int maybe(int x);
/* maybe(x): x > 0 ? target(x) -- a conditional tail call (jg target), as clang and hand-written
 * code emit it -- : getppid(). */
__asm__(".text\n.globl maybe\n.type maybe, @function\nmaybe:\n.cfi_startproc\n"
        "\ttest %edi, %edi\n\tjg target\n"
        "\tsub $8, %rsp\n.cfi_def_cfa_offset 16\n\tcall getppid\n\txor %eax, %eax\n"
        "\tadd $8, %rsp\n.cfi_def_cfa_offset 8\n\tret\n.cfi_endproc\n.size maybe, .-maybe\n");
int main(int argc, char **argv) {
    (void)argv;
    sink = target(argc);    /* a second caller, so maybe -> target carries a code (a probe) */
    sink = maybe(0);        /* falls through: no call to target happens */
    sink = maybe(5);        /* tail-calls target */
    sink = maybe(-1);
    return 0;
}
"""


@pytest.mark.bpf
def test_conditional_tail_call(tmp_path: pathlib.Path) -> None:
    """A probe on ``jg target`` fires whether or not the jump is taken: only a taken one may record
    the tail edge (the condition is evaluated on EFLAGS)."""
    from bpf_helpers import compile_c

    binary = compile_c(tmp_path, "jcc", CONDITIONAL_TAIL_CALL, "-O2", "-fno-pie", "-no-pie")
    oracle = run_strace([str(binary)], ["getppid"])
    samples, _ = trace([str(binary)], ["getppid"], tmp_path)
    stats = check_against(oracle, samples, binary)
    assert stats.samples_compared == 4 and stats.incomplete_samples == 0
    chains = [[(f["function"], bool(f.get("tail_call"))) for f in s["frames"]]
              for s in samples if s["frames"]]
    assert chains == [[("main", False), ("target", False)], [("main", False), ("maybe", False)],
                      [("main", False), ("maybe", True), ("target", False)],
                      [("main", False), ("maybe", False)]]


COROUTINE = r"""
#include <stdlib.h>
#include <ucontext.h>
#include <unistd.h>
volatile long sink;
static ucontext_t main_ctx, co_ctx;
__attribute__((noinline)) void co_leaf(int round) { sink = getppid() + round; }
__attribute__((noinline)) void co(void) {
    co_leaf(1);
    swapcontext(&co_ctx, &main_ctx);   /* yield */
    co_leaf(2);                        /* resumed in the middle: no entry probe sees this */
}
__attribute__((noinline)) void driver(void) {
    swapcontext(&main_ctx, &co_ctx);   /* run co until it yields */
    sink = getppid();
    swapcontext(&main_ctx, &co_ctx);   /* resume it */
    sink = getppid();
}
int main(void) {
    size_t size = 1 << 16;
    char *stack = malloc(size);
    getcontext(&co_ctx);
    co_ctx.uc_stack.ss_sp = stack;
    co_ctx.uc_stack.ss_size = size;
    co_ctx.uc_link = &main_ctx;
    makecontext(&co_ctx, co, 0);
    driver();
    sink = getppid();
    return 0;
}
"""


@pytest.mark.bpf
def test_stack_switch_is_flagged_not_wrong(tmp_path: pathlib.Path) -> None:
    """makecontext/swapcontext: the coroutine runs on a heap stack, where a debugger sees only co's
    frames.  Its syscalls are reported as that suffix, complete: false (the caller across the switch
    is not on that stack); main's own syscalls stay exact and complete."""
    from bpf_helpers import compile_c

    binary = compile_c(tmp_path, "coroutine", COROUTINE, "-O1")
    oracle = run_strace([str(binary)], ["getppid"])
    samples, _ = trace([str(binary)], ["getppid"], tmp_path)
    check_against(oracle, samples, binary)
    got = [(s["complete"], [f["function"] for f in s["frames"]]) for s in samples if s["frames"]]
    assert got == [(False, ["co", "co_leaf"]), (True, ["main", "driver"]), (False, ["co", "co_leaf"]),
                   (True, ["main", "driver"]), (True, ["main"])]


@pytest.mark.bpf
@pytest.mark.parametrize("where", ["near", "far"])
def test_sigaltstack_above_the_thread_stack(where: str, tmp_path: pathlib.Path) -> None:
    """A thread's handler runs on a sigaltstack at higher addresses than the thread's stack (2 MiB or
    200 MiB above it).  The interrupted stack's pieces must not be cut by the handler's events (the
    two stacks are disjoint ranges, not one stack that returned): the handler's syscalls are exact or
    a flagged suffix, and every syscall after the handler returned is exact and complete.  Before,
    near: the handler's syscalls came out wrong and complete (``on_signal`` as a root), far: every
    later syscall of the thread was flagged (the interrupted stack's pieces were dropped)."""
    binary = pathlib.Path(build("altstack_above", opt="O2", pie=False))
    cmd = [str(binary), where]
    oracle = run_strace(cmd, ["getppid", "write"])
    samples, _ = trace(cmd, ["getppid", "write"], tmp_path)
    check_against(oracle, samples, binary)
    got = [(s["complete"], [f["function"] for f in s["frames"] if f["analysed"]]) for s in samples
           if any(f["analysed"] for f in s["frames"])]
    # The handler interrupted raise(), called from trigger: it is exact too, as on the thread's stack.
    assert got == [(True, ["worker", "before"]), (True, ["worker", "trigger", "on_signal"]),
                   (True, ["worker", "trigger", "on_signal", "in_handler"]), (True, ["worker", "after"]),
                   (True, ["worker", "after", "leaf"]), (True, ["worker"]), (True, ["main"])]
