"""CI keeps the evaluation report from rotting: ``bench/report.py --reduced`` runs for real (BPF,
strace) into a temporary directory, and its tables, raw numbers and figures must be well-formed and
consistent with each other (the full report is ``make bench``)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_bpf, require_tool, skip_or_fail

REPO = pathlib.Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, Any]]:
    require_bpf()
    require_tool("strace")
    require_tool("bpftool")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        skip_or_fail("matplotlib (the bench extra) not installed")
    out = tmp_path_factory.mktemp("report")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "report.py"), "--reduced", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=1200,
                          env={**os.environ, "CCPROFD_REPORT_DEBUG": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.bpf
def test_files_and_figures(report: tuple[pathlib.Path, dict[str, Any]]) -> None:
    out, results = report
    for name in ("results.md", "results-summary.md", "results.json"):
        assert (out / name).stat().st_size > 200, name
    for fig in ("report-fig4-lengths.png", "report-fig5-average.png", "report-fig6-overhead.png",
                "report-fig7b-query.png"):
        data = (out / fig).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, fig
    md = (out / "results.md").read_text()
    for fig in ("report-fig4-lengths.png", "report-fig6-overhead.png"):
        assert f"]({fig})" in md
    meta = results["meta"]
    assert meta["kernel"] == os.uname().release and meta["reduced"] is True
    assert meta["kernel"] in md and meta["date"] in md  # every page states where and when


@pytest.mark.bpf
def test_tables_are_well_formed(report: tuple[pathlib.Path, dict[str, Any]]) -> None:
    out, _ = report
    lines = (out / "results.md").read_text().splitlines()
    tables = 0
    i = 0
    while i < len(lines):
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            cols = lines[i].count("|")
            assert lines[i + 1].count("|") == cols, lines[i]
            j = i + 2
            while j < len(lines) and lines[j].startswith("| "):
                assert lines[j].count("|") - lines[j].count("\\|") == cols, lines[j]
                j += 1
            assert j > i + 2, f"table without rows: {lines[i]}"
            tables += 1
            i = j
        else:
            i += 1
    assert tables >= 7


@pytest.mark.bpf
def test_numbers_are_consistent(report: tuple[pathlib.Path, dict[str, Any]]) -> None:
    _, results = report
    static = {r["binary"]: r for r in results["static"]}
    rec = static["test:recursion"]
    # tests/programs/recursion.c documents 3 SCCs with cycles; its graph is small enough to enumerate
    assert rec["complex_sccs"] == 3 and rec["stacktags"]["method"] == "enumerated"
    wls = {w["name"]: w for w in results["workloads"]}
    assert set(wls) == {"bash-recursive", "test:recursion"}
    for w in wls.values():
        assert "error" not in w, w
        v = w["variants"]
        assert v["untraced"]["seconds"] > 0
        assert v["instrumented"]["samples"] > 0
        assert w["calls"] > 0 and w["syscalls"] > 0
        L = w["lengths"]
        assert L["used"] > 0 and L["roundtrip_failures"] == 0
        hist = L["hist"]["syscall"]
        for key in ("plain", "pcce", "valence", "hcce"):
            assert sum(hist[key].values()) == L["used"]  # one length per used sample and scheme
        avg = L["average"]
        assert avg["valence"] <= avg["pcce"]  # recursive workloads: Valence's recID is the shorter one
        fid = w["fidelity"]["instrumented"]
        assert fid["compared"] > 0 and fid["wrong"] == 0, fid
        # Per-scheme instrumentation cost: PCCE and HCCE plans maintained live, checked like Valence.
        for scheme in ("pcce", "hcce"):
            sv = v[f"instrumented_{scheme}"]
            assert "not_measured" not in sv and "error" not in sv, sv
            assert sv["samples"] > 0 and sv["probe_hits"] > 0, (scheme, sv)
            assert sv["ratio_wall"] > 0 and sv["hits_per_1000_calls"] > 0
            sf = w["fidelity"][f"instrumented_{scheme}"]
            assert sf["compared"] > 0 and sf["wrong"] == 0, (scheme, sf)
    # recursion.c at depth 100: the deepest sample has > 100 frames of the binary, in one word per frame
    assert wls["test:recursion"]["lengths"]["max"]["plain"] > 100
    q = results["query"]
    assert q.get("rows"), q
