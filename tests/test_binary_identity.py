"""A binary is what its bytes are, wherever it lies and whatever the cache remembers (issue 15).

* A copy of an analysed binary at another path is traced at *its* path: the cached plans must not
  carry the first path (the probes were attached to the first file, every sample of the copy came
  out ``frames: []``, ``complete: true``; unwind mode named the first path's module).
* Cache entries are checked, not trusted: a damaged entry is recomputed (a flipped byte in a CFI
  entry ended ``trace`` in an IndexError; flips in a call-graph entry changed ``analyze`` output
  silently), and an edited binary that keeps its build-id and size is analysed again.

Expected frames come from the test program's source (tests/programs/calls.c: write is reached by
main > say > write), never from ccprofd's output.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_bpf
from programs.build import build

REPO = pathlib.Path(__file__).resolve().parent.parent


def trace(cache: pathlib.Path, mode: str, exe: str, out: pathlib.Path) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--cache-dir", str(cache),
                           "--mode", mode, "-e", "trace=write", "--format", "jsonl", "-o", str(out),
                           "--", exe], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]


def analysed_chain(sample: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["function"], f["module"]) for f in sample["frames"] if f["analysed"]]


@pytest.mark.parametrize("mode", ["instrumented", "unwind"])
def test_copy_at_another_path_is_traced_at_its_own_path(tmp_path: pathlib.Path, mode: str) -> None:
    require_bpf()
    original = pathlib.Path(build("calls", opt="O2", pie=True, strip=False))
    copy = tmp_path / "copy-of-calls"
    shutil.copy2(original, copy)
    cache = tmp_path / "cache"
    for exe in (original, copy):  # the first run fills the cache, the copy's run reuses it
        samples = trace(cache, mode, str(exe), tmp_path / "out.jsonl")
        says = [s for s in samples if s["syscall"] == "write" and len(s["frames"]) > 0
                and any(f["function"] == "say" for f in s["frames"])]
        # calls.c: two write(2)s through main > say (puts' write goes through libc alone)
        assert len(says) >= 2, samples
        for s in says:
            assert s["complete"] is True
            assert analysed_chain(s)[:2] == [("main", str(exe)), ("say", str(exe))], s
