"""Granularity "edges" (issue 19): a context is accepted when each of its call edges (caller function
at a call site -> callee, and the innermost call site -> the syscall) was learned for that syscall.

Models are learned from hand-built samples with the real :class:`Learner`; every expected edge and
verdict is derived by hand from the chains written next to it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_anomaly_model import BID, sample

from ccprofd.anomaly.detector import Detector, DetectorOptions
from ccprofd.anomaly.model import Learner, ModelSet, TargetModel, context_edges, context_key

# Two commands reach the same allocator through two parsers.  Training sees cmd_a->parse_x and
# cmd_b->parse_y; a held-out run does cmd_a->parse_y: every edge is known, the chain is not.
A_X = [("main", "0x10"), ("cmd_a", "0x20"), ("parse_x", "0x30"), ("xmalloc", "0x40")]
B_Y = [("main", "0x14"), ("cmd_b", "0x24"), ("parse_y", "0x34"), ("xmalloc", "0x40")]
A_Y = [("main", "0x10"), ("cmd_a", "0x28"), ("parse_y", "0x34"), ("xmalloc", "0x40")]  # cmd_a@0x28 new
A_Y_KNOWN_SITES = [("main", "0x10"), ("cmd_a", "0x20"), ("parse_y", "0x34"), ("xmalloc", "0x40")]
# The injected path: a known prefix reaching xmalloc from a function that never called it.
INJECTED = [("main", "0x10"), ("cmd_a", "0x20"), ("sneak", "0x50"), ("xmalloc", "0x40")]


def model_of(*chains: list[tuple[str, str]], syscall: str = "brk") -> TargetModel:
    model = TargetModel(BID, "/bin/prog")
    learner = Learner(model)
    for c in chains:
        learner.observe(sample(syscall, c))
    return model


def det(model: TargetModel, granularity: str, **kw: Any) -> Detector:
    return Detector(model, DetectorOptions(granularity=granularity, alert_interval_seconds=0, **kw))


def fk(fn: str, site: str) -> tuple[str, str, str]:
    return (BID, fn, site)


def test_context_edges_by_hand() -> None:
    _, frames = context_key(sample("brk", A_X))
    assert context_edges(frames) == (
        (None, (BID, "main")),
        (fk("main", "0x10"), (BID, "cmd_a")),
        (fk("cmd_a", "0x20"), (BID, "parse_x")),
        (fk("parse_x", "0x30"), (BID, "xmalloc")),
        (fk("xmalloc", "0x40"), None))
    assert context_edges(()) == ((None, None),)


def test_recursion_depth_does_not_change_the_edges() -> None:
    def rec(n: int) -> tuple[Any, ...]:
        return context_key(sample("brk", [("main", "0x10"), *[("walk", "0x70")] * n, ("xmalloc", "0x40")]))[1]
    # Depth 2 adds the self edge walk@0x70 -> walk; deeper adds nothing.
    assert context_edges(rec(2)) == context_edges(rec(3))
    assert set(context_edges(rec(40))) == set(context_edges(rec(2)))
    assert set(context_edges(rec(2))) - set(context_edges(rec(1))) == {(fk("walk", "0x70"), (BID, "walk"))}
    assert set(context_edges(rec(0))) != set(context_edges(rec(1)))  # main->xmalloc, not main->walk


def test_new_combination_of_seen_edges_accepted_in_edges_mode_only() -> None:
    model = model_of(A_X, B_Y)
    exact, edges = det(model, "exact"), det(model, "edges")
    # cmd_a@0x20 -> parse_x and cmd_b ... parse_y@0x34 -> xmalloc were both learned.
    [alert] = exact.check(sample("brk", A_Y_KNOWN_SITES))
    assert alert.kind == "unseen_context" and alert.unseen_edge is None
    # edge cmd_a@0x20 -> parse_y is not learned (cmd_a@0x20 called parse_x): still new in edges mode.
    [alert] = edges.check(sample("brk", A_Y_KNOWN_SITES))
    assert alert.unseen_edge is not None
    assert (alert.unseen_edge["caller"]["function"], alert.unseen_edge["caller"]["call_site"],
            alert.unseen_edge["callee"]["function"]) == ("cmd_a", "0x20", "parse_y")
    # Learn cmd_a@0x20 -> parse_y through another path (for brk): now the combination is all known.
    model2 = model_of(A_X, B_Y,
                      [("main", "0x18"), ("cmd_a", "0x20"), ("parse_y", "0x34"), ("xmalloc", "0x40")])
    # main@0x10 -> cmd_a (A_X), cmd_a@0x20 -> parse_y (3rd), parse_y@0x34 -> xmalloc, xmalloc@0x40 -> brk
    assert det(model2, "edges").check(sample("brk", A_Y_KNOWN_SITES)) == []
    assert len(det(model2, "exact").check(sample("brk", A_Y_KNOWN_SITES))) == 1


def test_prefix_variation_accepted() -> None:
    # The bash case: the same allocation reached under other outer prefixes.
    model = model_of([("main", "0x10"), ("run", "0x20"), ("expand", "0x30"), ("xmalloc", "0x40")],
                     [("main", "0x14"), ("source", "0x24"), ("run", "0x20"), ("subst", "0x38"),
                      ("xmalloc", "0x40")])
    held_out = [("main", "0x14"), ("source", "0x24"), ("run", "0x20"), ("expand", "0x30"),
                ("xmalloc", "0x40")]
    assert det(model, "edges").check(sample("brk", held_out)) == []
    assert len(det(model, "exact").check(sample("brk", held_out))) == 1


def test_edges_are_per_syscall() -> None:
    model = model_of(A_X, B_Y)
    Learner(model).observe(sample("openat", [("main", "0x10"), ("cmd_a", "0x20"), ("sneak", "0x50"),
                                             ("open_it", "0x60")]))
    # cmd_a@0x20 -> sneak was learned for openat, never for brk.
    [alert] = det(model, "edges").check(sample("brk", INJECTED))
    e = alert.unseen_edge
    assert e is not None and e["syscall"] == "brk"
    assert (e["caller"]["function"], e["caller"]["call_site"], e["callee"]["function"]) == (
        "cmd_a", "0x20", "sneak")


def test_injected_path_with_one_unseen_edge_alerted_in_both_modes() -> None:
    model = model_of(A_X, B_Y)
    for g in ("exact", "edges"):
        [alert] = det(model, g).check(sample("brk", INJECTED))
        assert alert.kind == "unseen_context"
    [alert] = det(model, "edges").check(sample("brk", INJECTED))
    d = json.loads(alert.to_json())
    assert d["unseen_edge"]["caller"] == {"function": "cmd_a", "module": "/bin/prog", "build_id": BID,
                                          "call_site": "0x20"}
    assert d["unseen_edge"]["callee"]["function"] == "sneak"
    assert "unseen_edge=cmd_a@0x20>sneak" in alert.log_line()
    # The exact alert has no edge to name.
    [alert] = det(model, "exact").check(sample("brk", INJECTED))
    assert "unseen_edge" not in alert.to_dict()


def test_entry_and_syscall_edges_count() -> None:
    model = model_of(A_X)
    # Same edges but entered from another outermost function: the entry edge is new.
    [a] = det(model, "edges").check(sample("brk", [("thread_start", "0x5"), *A_X]))
    assert a.unseen_edge is not None and a.unseen_edge["caller"] is None
    assert a.unseen_edge["callee"]["function"] == "thread_start"
    assert "unseen_edge=->thread_start" in a.log_line()
    [a] = det(model, "edges").check(sample("brk", A_X[1:]))
    assert a.unseen_edge is not None and a.unseen_edge["caller"] is None
    # A learned chain stopping one frame early: parse_x@0x30 made no brk itself.
    [a] = det(model, "edges").check(sample("brk", A_X[:3]))
    assert a.unseen_edge is not None and a.unseen_edge["callee"] is None
    assert a.unseen_edge["caller"]["function"] == "parse_x"
    assert "unseen_edge=parse_x@0x30>brk" in a.log_line()


def test_recursion_depth_variation_accepted_in_edges_mode() -> None:
    def rec(n: int) -> list[tuple[str, str]]:
        return [("main", "0x10"), *[("walk", "0x70")] * n, ("xmalloc", "0x40")]
    model = model_of(rec(1), rec(3))
    assert det(model, "edges").check(sample("brk", rec(40))) == []
    assert len(det(model, "exact").check(sample("brk", rec(40)))) == 1
    # A cycle through a new call site is a new edge.
    [a] = det(model, "edges").check(sample("brk", [("main", "0x10"), ("walk", "0x74"), ("xmalloc", "0x40")]))
    assert a.unseen_edge is not None and a.unseen_edge["caller"]["call_site"] == "0x74"


def test_min_count_applies_to_edges() -> None:
    model = model_of(A_X, A_X, B_Y)
    d = det(model, "edges", min_count=2)
    assert d.check(sample("brk", A_X)) == []
    [a] = d.check(sample("brk", B_Y))  # each B_Y-only edge learned once
    # The entry edge -> main was learned 3 times; main@0x14 -> cmd_b, B_Y's first own edge, once.
    assert a.unseen_edge is not None
    assert (a.unseen_edge["caller"]["function"], a.unseen_edge["caller"]["call_site"],
            a.unseen_edge["callee"]["function"]) == ("main", "0x14", "cmd_b")


def test_bad_granularity_and_transitions_refused() -> None:
    model = model_of(A_X)
    with pytest.raises(ValueError, match="granularity"):
        det(model, "fuzzy")
    with pytest.raises(ValueError, match="exact contexts"):
        Detector(model, DetectorOptions(granularity="edges", transitions=True))


def test_version_1_model_file_written_before_granularities_loads_and_works_in_edges_mode() -> None:
    # A model file as `ccprofd learn` wrote it before this option existed (format version 1).
    doc = {"format": "ccprofd-anomaly-model", "version": 1, "targets": [{
        "build_id": BID, "path": "/bin/prog", "runs": 2, "runs_with_transitions": 0, "samples": 2,
        "incomplete_skipped": 0, "syscalls": None, "modules": [{"id": BID, "path": "/bin/prog"}],
        "contexts": [
            {"syscall": "brk", "frames": [[0, fn, site] for fn, site in A_X], "count": 1, "first_ns": 0,
             "last_ns": 0},
            {"syscall": "brk", "frames": [[0, fn, site] for fn, site in B_Y], "count": 1, "first_ns": 0,
             "last_ns": 0}],
        "transitions": [], "allow_rules": [], "return_addresses": []}]}
    model = ModelSet.from_dict(json.loads(json.dumps(doc))).targets[BID]
    assert det(model, "edges").check(sample("brk", A_X)) == []
    assert len(det(model, "edges").check(sample("brk", INJECTED))) == 1
    assert len(det(model, "edges").check(sample("brk", A_Y))) == 1  # cmd_a@0x28 never learned


def test_daemon_detector_gets_the_configured_granularity(tmp_path: Any) -> None:
    # The daemon's [target.anomaly] granularity reaches the detector it builds for a binary.
    from ccprofd.daemon.anomaly_runtime import AnomalyMonitor, _Target
    from ccprofd.daemon.config import AnomalyConfig

    models = ModelSet()
    def rec(n: int) -> list[tuple[str, str]]:
        return [("main", "0x10"), *[("walk", "0x70")] * n, ("xmalloc", "0x40")]

    models.targets[BID] = model_of(rec(2))
    monitor = AnomalyMonitor(daemon=None)  # type: ignore[arg-type]  # _new_binary does not use it
    for granularity, alerts in (("exact", 1), ("edges", 0), ("routines", 0)):
        cfg = AnomalyConfig(action="detect", granularity=granularity)
        t = _Target("prog", cfg, tmp_path / "m.json", models)
        b = monitor._new_binary(t, BID, "/bin/prog")
        assert b.detector is not None and b.detector.options.granularity == granularity
        assert len(b.detector.check(sample("brk", rec(5)))) == alerts  # deeper through learned edges
        assert len(b.detector.check(sample("brk", INJECTED))) == 1


def test_model_show_edges_lists_each_syscalls_edges(tmp_path: Any) -> None:
    import subprocess
    import sys

    from ccprofd.anomaly.modelstore import save_models

    models = ModelSet()
    models.targets[BID] = model_of(A_X, A_X)
    Learner(models.targets[BID]).observe(sample("openat", [("main", "0x10"), ("cmd_a", "0x20")]))
    path = tmp_path / "m.json"
    save_models(str(path), models)
    r = subprocess.run([sys.executable, "-m", "ccprofd.cli", "model", "show", "--edges", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [x.strip() for x in r.stdout.splitlines()[2:]]
    # A_X twice for brk: 5 edges, count 2 each; the openat context: 3 edges, count 1 (by hand).
    assert lines == [
        "call edges 8 (what --granularity edges accepts, per syscall)",
        "brk              (entry) -> main (prog)  count 2",
        "brk              cmd_a@0x20 (prog) -> parse_x (prog)  count 2",
        "brk              main@0x10 (prog) -> cmd_a (prog)  count 2",
        "brk              parse_x@0x30 (prog) -> xmalloc (prog)  count 2",
        "brk              xmalloc@0x40 (prog) -> brk  count 2",
        "openat           (entry) -> main (prog)  count 1",
        "openat           cmd_a@0x20 (prog) -> openat  count 1",
        "openat           main@0x10 (prog) -> cmd_a (prog)  count 1"]
