"""Correctness alongside the measurements: ccprofd's samples against ``strace -f -k`` of the same
command (a separate run of a deterministic command), compared sample by sample with the test
suite's own oracle and rules (``tests/strace_oracle.py``, ``tests/fidelity.py``: threads by creation
order, syscalls by ordinal, every frame of the binary by return address and function).

The strace run is also the ``strace -f -k`` cost baseline: it is timed (wall, and CPU of strace and
the target together) before its output is parsed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from report_bpf import Timing, launch, wait_exit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fidelity import compare
from strace_oracle import (
    BOOKKEEPING,
    Trace,
    parse_strace,
    strace_path,
)

FRAME_KINDS = ("frames", "incomplete-not-suffix")


@dataclass
class OracleRun:
    trace: Trace
    timing: Timing
    syscalls: list[str]


def strace_oracle(
    argv: Sequence[str],
    syscalls: Iterable[str],
    *,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
) -> OracleRun:
    """Run ``argv`` under ``strace -f -k -qq -e trace=...`` (timed), then parse its output."""
    requested = sorted(set(syscalls))
    traced = sorted(set(requested) | BOOKKEEPING)
    with tempfile.TemporaryDirectory(prefix="ccprofd-report-strace-") as tmp:
        out = Path(tmp) / "strace.out"
        cmd = [
            strace_path(),
            "-f",
            "-k",
            "-qq",
            "-e",
            "trace=" + ",".join(traced),
            "-o",
            str(out),
            "--",
            *argv,
        ]
        child = launch(cmd, stdin=stdin, env=env)
        t0 = child.release()
        ex = wait_exit(child.pid)
        text = out.read_text(errors="replace") if out.exists() else ""
    if ex.code != 0 or not text.strip():
        raise RuntimeError(f"strace -f -k {' '.join(argv)} exited with {ex.code}")
    trace = parse_strace(text, requested=requested, command=tuple(argv), cwd=os.getcwd())
    trace.exit_status = ex.code
    return OracleRun(trace, Timing(ex.at - t0, ex.cpu), requested)


@dataclass
class Fidelity:
    compared: int = 0
    equal: int = 0  # complete and equal to the oracle's stack (or its known suffix)
    incomplete_ok: int = 0  # flagged incomplete and a correct innermost part
    wrong: int = 0  # a frame differs (complete), or an incomplete sample is not a suffix
    missing: int = 0
    extra: int = 0
    other: int = 0  # thread/pid/syscall-order mismatches
    oracle_truncated: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def fraction_equal(self) -> float | None:
        return self.equal / self.compared if self.compared else None

    def to_json(self) -> dict[str, Any]:
        d = {
            k: getattr(self, k)
            for k in (
                "compared",
                "equal",
                "incomplete_ok",
                "wrong",
                "missing",
                "extra",
                "other",
                "oracle_truncated",
            )
        }
        d["fraction_equal"] = self.fraction_equal
        d["examples"] = self.examples[:3]
        return d


def fidelity(samples: Sequence[Mapping[str, Any]], oracle: Trace, binary: str) -> Fidelity:
    """Compare and count (see the module docstring)."""
    result = compare(samples, oracle, binary)
    st = result.stats
    kinds = Counter(m.kind for m in result.mismatches)
    wrong = sum(kinds[k] for k in FRAME_KINDS)
    wrong_incomplete = kinds["incomplete-not-suffix"]
    out = Fidelity(
        compared=st.samples_compared,
        wrong=wrong,
        missing=kinds["missing-sample"],
        extra=kinds["extra-sample"],
        oracle_truncated=st.oracle_truncated,
        other=sum(v for k, v in kinds.items() if k not in (*FRAME_KINDS, "missing-sample", "extra-sample")),
    )
    out.incomplete_ok = st.incomplete_samples - wrong_incomplete
    # Missing samples are counted as compared by fidelity.compare's stats only when both sides exist.
    out.equal = max(0, st.samples_compared - wrong - out.incomplete_ok)
    out.examples = [m.render()[:600] for m in result.mismatches[:3]]
    return out
