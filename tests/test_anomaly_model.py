"""Anomaly model: context keys, recursion collapsing, learning, merging, editing, serialisation.

Hand-built samples: every expected value below is derived by hand from the sample written next to it.
"""

from __future__ import annotations

from typing import Any

import pytest

from ccprofd.anomaly.model import (
    AllowRule,
    FramePattern,
    Learner,
    ModelError,
    ModelSet,
    TargetModel,
    collapse_cycles,
    common_prefix_len,
    context_key,
)

BID = "ab" * 20


def frame(fn: str, site: str | None, ret: str | None = None, bid: str = BID) -> dict[str, Any]:
    return {"function": fn, "module": "/bin/prog", "build_id": bid, "analysed": True, "call_site": site,
            "return_address": ret}


def sample(syscall: str, chain: list[tuple[str, str]], *, tid: int = 1, t: int = 0,
           complete: bool = True) -> dict[str, Any]:
    return {"time_ns": t, "pid": 1, "tid": tid, "event": "syscall", "syscall": syscall, "complete": complete,
            "frames": [frame(fn, site, hex(int(site, 16) + 5)) for fn, site in chain]}


MAIN_OPEN = [("main", "0x10"), ("load", "0x20")]
MAIN_OPEN_OTHER_SITE = [("main", "0x10"), ("load", "0x24")]


def test_context_key_separates_call_sites_and_syscalls() -> None:
    a = context_key(sample("openat", MAIN_OPEN))
    b = context_key(sample("openat", MAIN_OPEN_OTHER_SITE))
    c = context_key(sample("read", MAIN_OPEN))
    assert a != b and a != c
    assert a == ("openat", ((BID, "main", "0x10"), (BID, "load", "0x20")))


def test_context_key_rejects_non_samples() -> None:
    with pytest.raises(ModelError):
        context_key({"pid": 1})


def k(*names: str) -> tuple[tuple[str, str, str], ...]:
    return tuple(("m", n.split("@")[0], n.split("@")[1]) for n in names)


@pytest.mark.parametrize(("frames", "expected"), [
    (k("main@1", "f@2", "f@2", "f@2", "g@3"), k("main@1", "f@2", "g@3")),
    (k("main@1", "a@2", "b@3", "a@2", "b@3", "a@2"), k("main@1", "a@2", "b@3", "a@2")),
    (k("a@1", "b@2", "c@3", "a@1", "b@2", "c@3", "a@1", "b@2", "c@3"), k("a@1", "b@2", "c@3")),
    # f recursing through two different call sites is not a repeated block
    (k("main@1", "f@2", "f@3", "f@2", "x@9"), k("main@1", "f@2", "f@3", "f@2", "x@9")),
    (k(), k()),
])
def test_collapse_cycles(frames: Any, expected: Any) -> None:
    assert collapse_cycles(frames) == expected


def test_collapse_same_for_any_depth() -> None:
    deep = k("main@1", *(["f@2"] * 500), "leaf@3")
    shallow = k("main@1", "f@2", "f@2", "leaf@3")
    assert collapse_cycles(deep) == collapse_cycles(shallow) == k("main@1", "f@2", "leaf@3")


def test_collapse_respects_max_cycle() -> None:
    block = [f"f{i}@{i}" for i in range(5)]
    frames = k(*block, *block)
    assert collapse_cycles(frames, max_cycle=4) == frames
    assert collapse_cycles(frames, max_cycle=5) == k(*block)


def test_common_prefix_len() -> None:
    assert common_prefix_len(k("a@1", "b@2", "c@3"), k("a@1", "b@2", "d@4")) == 2
    assert common_prefix_len(k("a@1"), k("b@1")) == 0


def test_learner_counts_and_skips_incomplete() -> None:
    model = TargetModel(BID, "/bin/prog")
    learner = Learner(model, syscalls=["openat", "read"])
    for t in range(3):
        learner.observe(sample("openat", MAIN_OPEN, t=t + 10))
    learner.observe(sample("openat", MAIN_OPEN_OTHER_SITE, t=5))
    assert learner.observe(sample("openat", [("load", "0x20")], complete=False)) is None
    assert learner.observe({"event": "cpu", "syscall": "", "frames": []}) is None
    st = model.contexts[context_key(sample("openat", MAIN_OPEN))]
    assert (st.count, st.first_ns, st.last_ns) == (3, 10, 12)
    assert len(model.contexts) == 2
    assert (model.runs, model.samples, model.incomplete_skipped) == (1, 4, 1)
    assert model.syscalls == frozenset({"openat", "read"})
    assert model.return_addresses[(BID, "0x20")] == "0x25"
    assert model.modules[BID] == "/bin/prog"
    assert not model.transitions


def test_learner_transitions_per_thread() -> None:
    model = TargetModel(BID)
    learner = Learner(model, transitions=True)
    a, b = sample("openat", MAIN_OPEN), sample("read", MAIN_OPEN)
    ka, kb = context_key(a), context_key(b)
    learner.observe(a)                       # thread 1: START -> a
    learner.observe({**a, "tid": 2})         # thread 2: START -> a
    learner.observe(b)                       # thread 1: a -> b
    learner.observe({**b, "complete": False})  # breaks thread 1's chain
    learner.observe(a)                       # no transition recorded from the incomplete sample
    assert model.transitions == {(None, ka): 2, (ka, kb): 1}
    assert model.transitions_usable()


def test_take_delta_counts_run_once_and_keeps_syscalls() -> None:
    model = TargetModel(BID)
    learner = Learner(model, syscalls=["openat"])
    learner.observe(sample("openat", MAIN_OPEN))
    first = learner.take_delta()
    learner.observe(sample("openat", MAIN_OPEN))
    second = learner.take_delta()
    assert (first.runs, second.runs) == (1, 0)
    assert second.syscalls == frozenset({"openat"}) and sum(s.count for s in second.contexts.values()) == 1
    merged = TargetModel(BID)
    merged.merge(first)
    merged.merge(second)
    assert merged.runs == 1 and merged.contexts[context_key(sample("openat", MAIN_OPEN))].count == 2


def test_merge_sums_and_unions() -> None:
    m1, m2 = TargetModel(BID), TargetModel(BID)
    Learner(m1, syscalls=["openat"]).observe(sample("openat", MAIN_OPEN, t=7))
    l2 = Learner(m2, syscalls=["read"])
    l2.observe(sample("openat", MAIN_OPEN, t=3))
    l2.observe(sample("read", MAIN_OPEN, t=9))
    m1.merge(m2)
    st = m1.contexts[context_key(sample("openat", MAIN_OPEN))]
    assert (st.count, st.first_ns, st.last_ns) == (2, 3, 7)
    assert m1.runs == 2 and m1.syscalls == frozenset({"openat", "read"})
    m3 = TargetModel(BID)
    Learner(m3, syscalls=None)
    m1.merge(m3)
    assert m1.syscalls is None  # "all" absorbs
    with pytest.raises(ModelError):
        m1.merge(TargetModel("cd" * 20))


def test_merge_partial_transitions_not_usable() -> None:
    m = TargetModel(BID)
    Learner(m, transitions=True)
    Learner(m, transitions=False)
    assert (m.runs, m.runs_with_transitions) == (2, 1)
    assert not m.transitions_usable()


def test_round_trip_preserves_everything() -> None:
    models = ModelSet()
    m = models.target(BID, "/bin/prog")
    learner = Learner(m, syscalls=["openat", "read"], transitions=True)
    for s in (sample("openat", MAIN_OPEN, t=1), sample("read", MAIN_OPEN, t=2),
              sample("openat", MAIN_OPEN_OTHER_SITE, t=3, tid=4)):
        learner.observe(s)
    m.add_allow_rule(AllowRule("openat", (FramePattern("main"), FramePattern("load", "0x30")), "ok"))
    back = ModelSet.from_dict(models.to_dict())
    b = back.targets[BID]
    assert b.contexts == m.contexts
    assert b.transitions == m.transitions
    assert b.allow_rules == m.allow_rules
    assert b.return_addresses == m.return_addresses
    assert (b.runs, b.runs_with_transitions, b.samples, b.syscalls, b.path) == (
        1, 1, 3, frozenset({"openat", "read"}), "/bin/prog")


@pytest.mark.parametrize("doc", [
    {}, {"format": "something-else", "version": 1, "targets": []},
    {"format": "ccprofd-anomaly-model", "version": 2, "targets": []},
    {"format": "ccprofd-anomaly-model", "version": 1, "targets": {}},
    {"format": "ccprofd-anomaly-model", "version": 1, "targets": [{"build_id": "x"}]},
    {"format": "ccprofd-anomaly-model", "version": 1, "targets": [
        {"build_id": "x", "runs": 1, "modules": [],
         "contexts": [{"syscall": "openat", "frames": [[3, "f", "0x1"]], "count": 1}]}]},
])
def test_from_dict_rejects_malformed(doc: dict[str, Any]) -> None:
    with pytest.raises(ModelError):
        ModelSet.from_dict(doc)


def test_allow_rule_matching() -> None:
    rule = AllowRule("openat", (FramePattern.parse("main"), FramePattern.parse("load@0x20")))
    assert rule.matches(context_key(sample("openat", [*MAIN_OPEN, ("deeper", "0x99")])))
    assert rule.matches(context_key(sample("openat", MAIN_OPEN)))
    assert not rule.matches(context_key(sample("openat", MAIN_OPEN_OTHER_SITE)))
    assert not rule.matches(context_key(sample("read", MAIN_OPEN)))
    assert not rule.matches(context_key(sample("openat", [("main", "0x10")])))
    anyc = AllowRule("*", (FramePattern.parse("main"),))
    assert anyc.matches(context_key(sample("read", MAIN_OPEN)))
    with pytest.raises(ModelError):
        FramePattern.parse("load@zz")
    with pytest.raises(ModelError):
        FramePattern.parse("@0x10")


def test_remove_context_drops_its_transitions() -> None:
    m = TargetModel(BID)
    learner = Learner(m, transitions=True)
    a, b = sample("openat", MAIN_OPEN), sample("read", MAIN_OPEN)
    learner.observe(a)
    learner.observe(b)
    m.remove_context(context_key(a))
    assert list(m.contexts) == [context_key(b)]
    assert m.transitions == {}
    with pytest.raises(ModelError):
        m.remove_context(context_key(a))


def test_stale_models_kept_not_applied() -> None:
    models = ModelSet()
    models.target("old", "/usr/bin/prog")
    models.target("new", "/usr/bin/prog")
    models.target("other", "/usr/bin/else")
    assert [m.build_id for m in models.stale_for("/usr/bin/prog", "new")] == ["old"]
    assert "old" in models.targets  # kept
