"""Syscalls made after ``main`` returned (atexit handlers, destructors), both tracer modes, against
``strace -f -k`` sample by sample.

``exit()`` runs the handlers in frames that reuse the stack ``main`` and its callees left behind.
Instrumented mode keeps no return probes, so the pieces recorded under ``main`` must be recognised
as dead at the handler's entry although words of the dead frames may still hold their old return
addresses (found on ``/usr/bin/find``: ``close_stdout`` reported under ``main > ... > fflush``).
The oracle shows only the handler's chain below libc's exit code; a sample may say less (flagged
incomplete: a handler whose frame reuses another's slot and return address), never something else.
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
from strace_oracle import entry_function, run_strace

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSCALLS = ["write"]


def _trace(mode: str, cmd: list[str], tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    out = tmp_path / f"{mode}.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--format", "jsonl",
            "--syscalls", ",".join(SYSCALLS), "--output", str(out), "--", *cmd]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = ("deeper", "handler a", "handler b", "destructor")
    assert proc.stdout == "".join(f"exithandlers: {m}\n" for m in lines)
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["instrumented", "unwind"])
@pytest.mark.parametrize("depth", ["0", "3", "40"])
@pytest.mark.parametrize(("opt", "pie"), [("O0", True), ("O2", False)], ids=["O0-pie", "O2-nopie"])
def test_exit_handler_contexts(mode: str, depth: str, opt: str, pie: bool, tmp_path: pathlib.Path) -> None:
    require_bpf()
    require_tool("strace")
    binary = pathlib.Path(build("exithandlers", opt=opt, pie=pie))  # type: ignore[arg-type]
    cmd = [str(binary), depth]
    oracle = run_strace(cmd, SYSCALLS)
    samples = _trace(mode, cmd, tmp_path)
    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    assert result.stats.samples_compared == 4
    entry = entry_function(binary)  # _start: start-up code below every chain, not a context
    assert entry is not None and entry.name == "_start"
    chains = [[f["function"] for f in s["frames"] if f["analysed"] and f["function"] != entry.name]
              for s in samples]
    # The two atexit handlers' writes are known exactly: their chains start at the handler.
    expected = {"handler_a": ["handler_a", "flush_chain", "flush_chain", "flush_chain", "emit"],
                "handler_b": ["handler_b", "emit"]}
    for sample, chain in zip(samples, chains, strict=True):
        if chain and chain[0] in expected:
            assert sample["complete"], sample
            assert chain == expected.pop(chain[0])
        if chain and chain[0] == "main":
            assert sample["complete"], sample
    assert not expected, f"no complete sample for {sorted(expected)}"
