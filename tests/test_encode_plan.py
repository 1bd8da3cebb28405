"""The plan as a value: serialisable, versioned, keyed, cached atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_encode_graphs import BIN, make_graph

from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.decode import decoder_for
from ccprofd.encode import Encoder, PlanError, build_plan, get_plan, load_plan, save_plan
from ccprofd.encode.plan import COL, SITE_COLUMNS, plan_key, plan_path, store_plan


def graph() -> CallGraph:
    return make_graph(4, [(0, 1), (1, 2), (2, 1), (1, 3), (0, 3)], roots=(0,))


@pytest.mark.parametrize("scheme", ["valence", "pcce", "hcce", "stacktags"])
def test_plan_survives_json_and_decodes_the_same(scheme: str) -> None:
    g = graph()
    plan = build_plan(g, scheme)
    again = json.loads(json.dumps(plan))
    assert again == plan
    assert plan["site_columns"] == SITE_COLUMNS
    # every probed site is listed with a reason
    assert plan["probed"] == [i for i, r in enumerate(plan["sites"]) if r[COL["reasons"]]]
    if scheme == "stacktags":
        return
    path = [(ROOT, 0x1000, 0), (0x1000, 0x2000, 0x1001), (0x2000, 0x3000, 0x2002), (0x3000, 0x2000, 0x3003)]
    enc = Encoder(plan)
    for e in path:
        enc.call(e)
    assert decoder_for(again).decode(enc.state(), 0x2000) == path


def test_key_depends_on_identity_scheme_and_parameters() -> None:
    base = {"pcce_words": 1, "weights_hash": None}
    k = plan_key(BIN, "pcce", base)
    assert k == plan_key(BIN, "pcce", dict(base))
    assert k != plan_key(BIN, "hcce", base)
    assert k != plan_key(BIN, "pcce", {"pcce_words": 2, "weights_hash": None})
    assert k != plan_key(BIN, "pcce", {"pcce_words": 1, "weights_hash": "ab"})
    assert plan_key(BIN.replace(path="/elsewhere"), "pcce", base) == k  # identity, not path
    assert plan_key(BIN.replace(build_id="deadbeef"), "pcce", base) != k
    assert plan_key(BIN.replace(content_hash="1" * 64), "pcce", base) != k
    # A stripped twin shares the build-id, not the content: it must not share the plan.
    with_id = BIN.replace(build_id="deadbeef")
    assert plan_key(with_id.replace(content_hash="2" * 64), "pcce", base) != plan_key(with_id, "pcce", base)


def test_cache_round_trip_and_atomic_files(tmp_path: Path) -> None:
    g = graph()
    plan = get_plan(g, "valence", cache_dir=tmp_path)
    path = plan_path(tmp_path, plan["key"])
    assert path.exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind
    # a second call reads the file: prove it by marking the stored copy
    stored = json.loads(path.read_text())
    stored["report"]["marker"] = 42
    save_plan(stored, path)  # edited without its checksum: not trusted, rebuilt
    assert "marker" not in get_plan(g, "valence", cache_dir=tmp_path)["report"]
    store_plan(stored, tmp_path)
    assert get_plan(g, "valence", cache_dir=tmp_path)["report"]["marker"] == 42
    # other weights -> other key -> other file
    w = {(0x1000, 0x2000, 0x1001): 5}
    pw = get_plan(g, "valence", weights=w, cache_dir=tmp_path)
    assert pw["key"] != plan["key"] and plan_path(tmp_path, pw["key"]).exists()
    # a corrupt cache file is rebuilt, not trusted
    path.write_text("{not json")
    fresh = get_plan(g, "valence", cache_dir=tmp_path)
    assert "marker" not in fresh["report"] and load_plan(path)["key"] == fresh["key"]


def test_cached_plan_for_a_different_graph_is_not_used(tmp_path: Path) -> None:
    small = make_graph(2, [(0, 1)])
    big = make_graph(3, [(0, 1), (1, 2)])  # same BinaryInfo: only the graph differs
    get_plan(small, "pcce", cache_dir=tmp_path)
    assert get_plan(big, "pcce", cache_dir=tmp_path)["report"]["nodes"] == 4


def test_unwritable_cache_directory_still_gives_the_plan(tmp_path: Path) -> None:
    """A cache directory that cannot be written (here: under a regular file, which fails for root
    too) only means the plan is not kept; it made ``trace --mode instrumented --cache-dir`` fail."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    g = graph()
    plan = get_plan(g, "valence", cache_dir=blocker / "cache")
    built = build_plan(g, "valence")
    plan.pop("report")  # timings differ
    built.pop("report")
    assert plan == built
    assert blocker.read_text() == ""


def test_wrong_version_is_refused(tmp_path: Path) -> None:
    plan = build_plan(graph(), "hcce")
    plan["version"] = 999
    p = tmp_path / "p.json"
    save_plan(plan, p)
    with pytest.raises(PlanError):
        load_plan(p)
    with pytest.raises(PlanError):
        decoder_for(plan)


def test_stripped_twin_gets_its_own_cached_plan(tmp_path: Path) -> None:
    """A stripped copy has its twin's build-id (checked with readelf here) but no symbols: the plan
    cache must hand each its own plan, not the twin's names."""
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "programs"))
    from build import build  # type: ignore[import-not-found]

    from ccprofd.callgraph import analyze_binary

    full = build("calls", opt="O0", pie=True, strip=False)
    stripped = build("calls", opt="O0", pie=True, strip=True)

    def note(p: str) -> str:
        out = subprocess.run(["readelf", "-n", p], capture_output=True, text=True, check=True).stdout
        return next(line.split()[-1] for line in out.splitlines() if "Build ID" in line)

    assert note(full) == note(stripped)
    plans = [get_plan(analyze_binary(p, cache_dir=tmp_path), "valence", cache_dir=tmp_path)
             for p in (full, stripped)]
    assert plans[0]["key"] != plans[1]["key"]
    assert "main" in plans[0]["names"]
    assert "main" not in plans[1]["names"]
