"""Detector on hand-built samples: each alert kind, nearest contexts, rate limiting, thresholds,
allow rules, recursion collapsing both ways, JSON and log-line output."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from test_anomaly_model import BID, sample

from ccprofd.anomaly.detector import AlertWriter, Detector, DetectorOptions, RateLimiter
from ccprofd.anomaly.model import AllowRule, FramePattern, Learner, TargetModel

S = 1_000_000_000
OPEN_A = [("main", "0x10"), ("cmd_a", "0x20"), ("load", "0x30")]
OPEN_B = [("main", "0x10"), ("cmd_b", "0x40"), ("load", "0x30")]
OPEN_C = [("main", "0x14"), ("other", "0x50")]
READ_A = [("main", "0x10"), ("cmd_a", "0x24")]
HIDDEN = [("main", "0x10"), ("cmd_a", "0x28"), ("sneak", "0x60")]


def learned(*samples: dict[str, Any], transitions: bool = False, syscalls: list[str] | None = None,
            ) -> TargetModel:
    model = TargetModel(BID, "/bin/prog")
    learner = Learner(model, transitions=transitions, syscalls=syscalls)
    for s in samples:
        learner.observe(s)
    return model


def base_model(**kw: Any) -> TargetModel:
    return learned(sample("openat", OPEN_A), sample("openat", OPEN_A), sample("openat", OPEN_B),
                   sample("openat", OPEN_C), sample("read", READ_A), **kw)


def test_known_contexts_raise_nothing() -> None:
    det = Detector(base_model())
    for chain in (OPEN_A, OPEN_B, OPEN_C):
        assert det.check(sample("openat", chain)) == []
    assert det.check(sample("read", READ_A)) == []
    assert det.counts["samples"] == 4


def test_unseen_context_alert_fields_and_nearest() -> None:
    det = Detector(base_model())
    s = sample("openat", HIDDEN, t=5 * S)
    s["args"] = {"path": "/etc/shadow"}
    s["pid"], s["tid"] = 42, 43
    [alert] = det.check(s)
    d = alert.to_dict()
    assert d["kind"] == "unseen_context" and d["syscall"] == "openat"
    assert (d["pid"], d["tid"], d["time_ns"], d["build_id"]) == (42, 43, 5 * S, BID)
    assert d["args"] == {"path": "/etc/shadow"}
    assert [f["function"] for f in d["frames"]] == ["main", "cmd_a", "sneak"]
    # Nearest: OPEN_A shares main@0x10 (2 learned), OPEN_B shares main@0x10 (1), OPEN_C shares nothing.
    assert [(n["common_prefix"], n["count"], [f["function"] for f in n["frames"]]) for n in d["nearest"]] == [
        (1, 2, ["main", "cmd_a", "load"]), (1, 1, ["main", "cmd_b", "load"]), (0, 1, ["main", "other"])]
    # The same context for another syscall is a different pair.
    [again] = det.check(sample("read", OPEN_A))
    assert again.kind == "unseen_context" and [n["frames"][1]["function"] for n in again.nearest] == ["cmd_a"]


def test_nearest_limited_to_same_syscall_and_three() -> None:
    model = learned(*(sample("write", [("main", "0x10"), (f"w{i}", hex(0x100 + i))]) for i in range(5)),
                    sample("openat", OPEN_A))
    [alert] = Detector(model).check(sample("write", [("main", "0x10"), ("new", "0x999")]))
    assert len(alert.nearest) == 3
    assert all(n["frames"][1]["function"].startswith("w") for n in alert.nearest)


def test_rate_limiting_per_context_and_suppressed_count() -> None:
    det = Detector(base_model(), DetectorOptions(alert_interval_seconds=10))
    out = [det.check(sample("openat", HIDDEN, t=t * S)) for t in (0, 1, 2, 9)]
    assert [len(a) for a in out] == [1, 0, 0, 0]
    other = det.check(sample("read", HIDDEN, t=3 * S))  # another pair is another alert
    assert len(other) == 1
    [later] = det.check(sample("openat", HIDDEN, t=10 * S))
    assert later.suppressed == 3
    assert det.counts["suppressed"] == 3 and det.counts["unseen_context"] == 3


def test_repeats_counted_in_the_kernel_are_held_then_alerted_without_identity() -> None:
    """Aggregate mode: the hidden context's first sample is alerted with its thread; 5 and 2 more
    that only the kernel counted, read within the interval, are held; 4 more read after it raise
    the alert again, standing for those 4, naming no thread or arguments, and saying 7 were held."""
    det = Detector(base_model(), DetectorOptions(alert_interval_seconds=10))
    first = sample("openat", HIDDEN, t=1 * S)
    first["pid"], first["tid"], first["args"] = 42, 43, {"path": "/etc/shadow"}
    [alert] = det.check(first)
    assert (alert.pid, alert.counted, alert.suppressed) == (42, 0, 0)
    representative = dict(first, time_ns=0)  # the daemon's context sample: no time of its own
    assert det.check_repeats(representative, 5, 3 * S) == []
    assert det.check_repeats(representative, 2, 9 * S) == []
    [again] = det.check_repeats(representative, 4, 12 * S)
    d = again.to_dict()
    assert (d["kind"], d["pid"], d["tid"], d["time_ns"], d["args"]) == ("unseen_context", 0, 0, 12 * S, {})
    assert (d["counted"], d["suppressed"]) == (4, 7)
    assert [f["function"] for f in d["frames"]] == ["main", "cmd_a", "sneak"]
    assert "counted=4 pid=? tid=?" in again.log_line()
    assert "counted" not in alert.to_dict()
    assert det.counts["samples"] == 12 and det.counts["suppressed"] == 7


def test_repeats_of_known_or_unmodelled_contexts_raise_nothing() -> None:
    model = learned(sample("openat", OPEN_A), syscalls=["openat"])
    det = Detector(model, DetectorOptions(alert_interval_seconds=0))
    assert det.check_repeats(sample("openat", OPEN_A), 1000, S) == []
    assert det.check_repeats(sample("write", HIDDEN), 7, S) == []
    assert det.counts["unmodelled_syscall"] == 7 and det.counts["samples"] == 1007
    [inc] = det.check_repeats(sample("openat", OPEN_A[1:], complete=False), 3, S)
    assert (inc.kind, inc.counted, inc.complete) == ("incomplete_context", 3, False)
    # a repeat judged first (its record was never seen: a reload mid-run) is alerted on its own
    [unseen] = det.check_repeats(sample("openat", HIDDEN), 2, S)
    assert (unseen.kind, unseen.counted, unseen.suppressed) == ("unseen_context", 2, 0)


def test_learner_counts_repeats_like_samples() -> None:
    """Learning 1 record + 9 kernel-counted repeats gives the model what 10 records would."""
    one_by_one = learned(*[sample("openat", OPEN_A, t=t) for t in range(10)], syscalls=["openat"])
    model = TargetModel(BID, "/bin/prog")
    learner = Learner(model, syscalls=["openat"])
    learner.observe(sample("openat", OPEN_A, t=0))
    learner.observe_repeats(sample("openat", OPEN_A), 9, 9)
    learner.observe_repeats(sample("openat", OPEN_A[1:], complete=False), 4, 9)
    assert model.contexts == one_by_one.contexts and model.samples == one_by_one.samples == 10
    assert model.incomplete_skipped == 4


def test_rate_limiter_zero_interval_emits_all() -> None:
    rl = RateLimiter(0)
    assert [rl.admit("k", 5) for _ in range(3)] == [0, 0, 0]


def test_min_count_thresholds_rare_contexts() -> None:
    det = Detector(base_model(), DetectorOptions(min_count=2, alert_interval_seconds=0))
    assert det.check(sample("openat", OPEN_A)) == []       # learned twice
    assert len(det.check(sample("openat", OPEN_B))) == 1   # learned once: rare


def test_incomplete_sample_is_flagged_not_judged() -> None:
    det = Detector(base_model())
    [alert] = det.check(sample("openat", OPEN_A[1:], complete=False))
    assert alert.kind == "incomplete_context" and alert.complete is False
    quiet = Detector(base_model(), DetectorOptions(report_incomplete=False))
    assert quiet.check(sample("openat", OPEN_A[1:], complete=False)) == []


def test_unmodelled_syscall_is_not_judged() -> None:
    model = learned(sample("openat", OPEN_A), syscalls=["openat"])
    det = Detector(model)
    assert det.check(sample("write", HIDDEN)) == []
    assert det.counts["unmodelled_syscall"] == 1
    assert len(det.check(sample("openat", HIDDEN))) == 1


def test_allow_rule_suppresses_family() -> None:
    model = base_model()
    model.add_allow_rule(AllowRule("openat", (FramePattern("main"), FramePattern("cmd_a", "0x28"))))
    det = Detector(model)
    assert det.check(sample("openat", HIDDEN)) == []
    assert det.counts["allowed_by_rule"] == 1
    assert len(det.check(sample("read", HIDDEN))) == 1  # rule is for openat only


def test_transitions() -> None:
    a, r = sample("openat", OPEN_A), sample("read", READ_A)
    model = learned(a, r, a, r, transitions=True)   # START->a, a->r, r->a
    det = Detector(model, DetectorOptions(transitions=True, alert_interval_seconds=0))
    assert det.check(a) == [] and det.check(r) == [] and det.check(a) == []
    [alert] = det.check(a)                           # a->a never learned
    assert alert.kind == "unseen_transition"
    assert alert.previous is not None and alert.previous["syscall"] == "openat"
    assert [f["function"] for f in alert.previous["frames"]] == ["main", "cmd_a", "load"]
    [first] = det.check({**r, "tid": 7})             # START->r never learned
    assert first.kind == "unseen_transition" and first.to_dict()["previous"] is None
    # After an unseen context the next transition is not judged (one alert per anomaly).
    det.check(sample("openat", HIDDEN))
    assert det.check(a) == []
    # Off by default even when the model has transitions.
    assert Detector(model).check(a) == [] and Detector(model).options.transitions is False


def test_transitions_need_every_run() -> None:
    model = learned(sample("openat", OPEN_A), transitions=True)
    Learner(model, transitions=False)
    with pytest.raises(ValueError, match="1 of 2"):
        Detector(model, DetectorOptions(transitions=True))


def rec(depth: int) -> list[tuple[str, str]]:
    return [("main", "0x10"), *([("walk", "0x70")] * depth), ("load", "0x30")]


def test_collapse_recursion_false_positives_both_ways() -> None:
    model = learned(sample("openat", rec(3)), sample("openat", rec(1)))
    plain = Detector(model, DetectorOptions(alert_interval_seconds=0))
    collapsed = Detector(model, DetectorOptions(collapse_recursion=True, alert_interval_seconds=0))
    # Deeper recursion through the learned edge: new without collapsing, known with it.
    assert len(plain.check(sample("openat", rec(40)))) == 1
    assert collapsed.check(sample("openat", rec(40))) == []
    # A different cycle (through a new call site) stays new either way.
    other = [("main", "0x10"), ("walk", "0x70"), ("walk", "0x74"), ("walk", "0x70"), ("load", "0x30")]
    assert len(collapsed.check(sample("openat", other))) == 1
    # No recursion at all was never learned: new either way.
    assert len(collapsed.check(sample("openat", rec(0)))) == 1


def test_json_and_log_line() -> None:
    det = Detector(base_model())
    s = sample("openat", HIDDEN, t=S)
    s["args"] = {"path": "/etc/shadow"}
    [alert] = det.check(s)
    buf = io.StringIO()
    w = AlertWriter(buf)
    w.write(alert)
    line = buf.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    d = json.loads(line)
    assert d["kind"] == "unseen_context" and d["syscall"] == "openat" and len(d["frames"]) == 3
    log = alert.log_line()
    assert "\n" not in log
    assert "kind=unseen_context" in log and "context=main>cmd_a>sneak" in log and 'path="/etc/shadow"' in log
