"""Hot-edge weights as a ``ccprofd trace`` option: ``--save-edge-weights FILE`` (a profiling run that
counts every direct call site) and ``--edge-weights FILE`` (the plan gives hot edges the zero code).

* the file format round-trips, and a file that is not one, of another version or of another binary
  is refused with one line and exit status 2;
* end to end on ``tests/programs/hotedges.c`` (a function reached from a cold call site first in
  address order and from a hot one inside a recursion): the saved counts equal what the program
  does by construction, both runs stay exact against ``strace -f -k``, and the weighted plan makes
  no more probe hits than the default plan.  It used to make far fewer (the hot edge had the zero
  code and no probe); since zero-code edges into code that reaches a sample point carry a cut-only
  probe (a dead call's pieces must be dropped at the next call, see test_instrumented_stale_path.py)
  the hot edge is trapped too: with weights it only carries no id bits.
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
from strace_oracle import run_strace

from ccprofd.encode.weightsfile import FORMAT, VERSION, WeightsFileError, load_weights, save_weights

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSCALLS = "write,getppid"
DEPTH = 20
ITERS = 200  # hotedges.c


# ------------------------------------------------------------------------------------ format
BINARY = {"path": "/bin/x", "build_id": "ab12", "content_hash": "f" * 64}


def test_round_trip(tmp_path: pathlib.Path) -> None:
    counts = {(4096, 4200, 0x1010): 7, (4096, -2, 0x1020): 1, (4200, 4200, 0x1090): 300, (1, 2, 3): 0}
    path = tmp_path / "w.json"
    save_weights(path, BINARY, counts, {4096: "main", 4200: "step"})
    assert load_weights(path, "f" * 64) == {k: v for k, v in counts.items() if v}
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == (FORMAT, VERSION)
    assert {"caller": 4096, "callee": 4200, "site": "0x1010", "count": 7, "caller_name": "main",
            "callee_name": "step"} in doc["edges"]
    assert [p.name for p in tmp_path.iterdir()] == ["w.json"]  # no temporary file left behind


@pytest.mark.parametrize(("text", "words"), [
    ("not json", "not an edge-weights file"),
    ('{"format": "something-else"}', "not an edge-weights file"),
    (json.dumps({"format": FORMAT, "version": 99, "binary": BINARY, "edges": []}), "version 99"),
    (json.dumps({"format": FORMAT, "version": VERSION, "binary": {**BINARY, "content_hash": "0" * 64},
                 "edges": []}), "another binary"),
    (json.dumps({"format": FORMAT, "version": VERSION, "binary": BINARY, "edges": [{"caller": 1}]}),
     "edge 0 is malformed"),
])
def test_bad_files_are_refused(tmp_path: pathlib.Path, text: str, words: str) -> None:
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(WeightsFileError) as err:
        load_weights(path, "f" * 64)
    assert words in str(err.value) and "\n" not in str(err.value)


def run_cli(*args: str, cwd: pathlib.Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


@pytest.mark.parametrize("content", ["garbage", "other-binary", "missing"])
def test_cli_bad_weights_file_is_one_line_exit_2(tmp_path: pathlib.Path, content: str) -> None:
    binary = build("hotedges", opt="O2", pie=True)
    path = tmp_path / "w.json"
    if content == "garbage":
        path.write_text("{")
    elif content == "other-binary":
        other = {"path": "/bin/true", "build_id": None, "content_hash": "0" * 64}
        path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "edges": [], "binary": other}))
    proc = run_cli("--mode", "instrumented", "--edge-weights", str(path), "--", str(binary), "2")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ccprofd: ") and str(path) in lines[0], proc.stderr
    assert "hotedges: done" not in proc.stdout  # the command never ran


def test_cli_weights_need_instrumented_mode(tmp_path: pathlib.Path) -> None:
    proc = run_cli("--mode", "unwind", "--save-edge-weights", str(tmp_path / "w.json"), "--", "/bin/true")
    assert proc.returncode == 2 and "--mode instrumented" in proc.stderr
    assert not (tmp_path / "w.json").exists()


# -------------------------------------------------------------------------------- end to end
def traced(cmd: list[str], **options: Any) -> tuple[list[dict[str, Any]], int]:
    """Samples and probe hits of one in-process trace session (what ``ccprofd trace`` runs)."""
    from ccprofd.tracing.api import TraceOptions
    from ccprofd.tracing.session import open_session

    session = open_session(cmd, options=TraceOptions(mode="instrumented", syscalls=SYSCALLS, **options))
    samples = list(session.samples())
    bpf = session.summary()["bpf"]
    assert session.wait() == 0
    return samples, bpf["site_hits"] + bpf["tail_hits"] + bpf["entry_hits"]


def names_of(doc: dict[str, Any]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for e in doc["edges"]:
        key = (e["caller_name"], e["callee_name"])
        out[key] = out.get(key, 0) + e["count"]
    return out


@pytest.mark.bpf
@pytest.mark.parametrize("variant", [pytest.param({"opt": "O0", "pie": True}, id="O0-pie"),
                                     pytest.param({"opt": "O2", "pie": False}, id="O2-nopie")])
def test_weighted_plan_stays_exact(tmp_path: pathlib.Path, variant: dict[str, Any]) -> None:
    require_bpf()
    require_tool("strace")
    binary = pathlib.Path(build("hotedges", **variant))
    cmd = [str(binary), str(DEPTH)]
    weights = tmp_path / "weights.json"

    # The profiling run through the CLI: counts of every direct call site, written at exit.
    proc = run_cli("--mode", "instrumented", "--syscalls", SYSCALLS, "--save-edge-weights", str(weights),
                   "--output", str(tmp_path / "profile.txt"), "--", *cmd)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "hotedges: done\n"
    counts = names_of(json.loads(weights.read_text()))
    # What hotedges.c does, counted by hand: every call of the run.
    assert counts[("main", "cold_path")] == 1
    assert counts[("main", "descend")] == 1
    assert counts[("descend", "descend")] == DEPTH
    assert counts[("descend", "hot_path")] == DEPTH + 1
    assert counts[("cold_path", "step")] == 1
    assert counts[("hot_path", "step")] == ITERS * (DEPTH + 1)
    assert counts[("step", "getppid")] == 1 + 2 * (DEPTH + 1)

    oracle = run_strace(cmd, SYSCALLS.split(","))
    plain, plain_hits = traced(cmd)
    weighted, weighted_hits = traced(cmd, edge_weights=str(weights))
    for samples in (plain, weighted):
        result = compare(samples, oracle, binary)
        assert result.ok, result.report()
    assert len(weighted) == len(plain) == 2 + 2 * (DEPTH + 1)
    # Default plan: the cold edge (first in address order) has the zero code and the hot edge is
    # probed at each of its ITERS * (DEPTH + 1) calls.  Weighted, the hot edge has the zero code, but
    # step reaches getppid, so the edge keeps a (cut-only) probe: as many hits, not 10x fewer as
    # before the cut-only probes.
    assert plain_hits >= ITERS * (DEPTH + 1)
    assert weighted_hits >= ITERS * (DEPTH + 1)
    assert weighted_hits <= plain_hits, (weighted_hits, plain_hits)
