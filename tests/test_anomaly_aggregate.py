"""The daemon's anomaly monitor on aggregate mode's two inputs: records (a context's first sample,
with its thread; every sample while some consumer wants each) and the kernel's per-context counts.

Unit tests (a fake daemon and source): every sample is learned exactly once whichever way it
arrived; a detector alerts a new context's first sample with its identity and the kernel-counted
repeats without one.  The end-to-end tests with real BPF are in tests/test_anomaly_daemon.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ccprofd.anomaly.model import Learner, ModelSet, TargetModel
from ccprofd.anomaly.modelstore import ModelStore, load_models, save_models
from ccprofd.daemon.anomaly_runtime import AnomalyMonitor
from ccprofd.daemon.config import AnomalyConfig
from ccprofd.daemon.source import BinaryInfo, ProcessInfo

BID = "b1d"


class Source:
    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo(10, "/srv/app", BID, 1)]

    def binaries(self) -> list[BinaryInfo]:
        return [BinaryInfo("/srv/app", BID)]

    def history_before(self, pid: int, tid: int, time_ns: int, last: int) -> list[dict[str, Any]]:
        assert pid and tid, "an alert without a thread has no history to read"
        return []


def sample(chain: tuple[str, ...], *, tid: int = 10, t: int = 0, path: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "time_ns": t, "pid": 10, "tid": tid, "event": "syscall", "syscall": "openat", "complete": True,
        "frames": [{"function": fn, "module": "/srv/app", "build_id": BID, "analysed": True,
                    "call_site": hex(0x10 * (i + 1)), "return_address": hex(0x10 * (i + 1) + 5)}
                   for i, fn in enumerate(chain)]}
    if path is not None:
        out["args"] = {"path": path}
    return out


NORMAL = ("main", "serve", "open_file")
HIDDEN = ("main", "debug", "open_file")


class Alerts:
    def __init__(self) -> None:
        self.published: list[dict[str, Any]] = []

    def publish(self, alert: dict[str, Any]) -> int:
        self.published.append(alert)
        return 0


def monitor_for(tmp_path: Path, action: str) -> tuple[AnomalyMonitor, Any, Alerts]:
    cfg = SimpleNamespace(anomaly=AnomalyConfig(action=action, alert_interval_seconds=0), mode="unwind")
    rt = SimpleNamespace(name="app", config=cfg, source=Source())
    alerts = Alerts()
    daemon = SimpleNamespace(targets={"app": rt}, alerts=alerts,
                             config=SimpleNamespace(daemon=SimpleNamespace(state_dir=str(tmp_path))))
    return AnomalyMonitor(daemon=daemon), rt, alerts  # type: ignore[arg-type]


def test_learning_takes_each_sample_once_from_records_and_counts(tmp_path: Path) -> None:
    """14 samples of one context arrive as: its first record + a count of 5 (aggregate); 3 records
    + a count of 3 (a consumer wanted each); a count of 2 whose second sample's record comes after
    the read; a count of 4.  The model counts 14, the same as 14 records one by one."""
    monitor, rt, _ = monitor_for(tmp_path, "learn")
    ctx = sample(NORMAL)
    monitor.observe(rt, sample(NORMAL, t=1), counted=False)
    monitor.observe_counts(rt, ctx, 5)
    for t in (2, 3, 4):
        monitor.observe(rt, sample(NORMAL, t=t), counted=False)
    monitor.observe_counts(rt, ctx, 3)
    monitor.observe_counts(rt, ctx, 2)
    monitor.observe(rt, sample(NORMAL, t=5), counted=False)  # its count was read before it came
    monitor.observe_counts(rt, ctx, 4)
    monitor.observe(rt, sample(HIDDEN, t=6), counted=True)  # a sample counted on its own (no key)
    learner = monitor.targets["app"].binaries[BID].learner
    assert learner is not None
    by_chain = {tuple(f[1] for f in key[1]): st.count for key, st in learner.model.contexts.items()}
    assert by_chain == {NORMAL: 14, HIDDEN: 1}
    assert learner.model.samples == 15
    assert monitor.targets["app"].binaries[BID].pending == {}


def test_detection_alerts_the_record_with_its_thread_and_counted_repeats_without(tmp_path: Path) -> None:
    path = ModelStore(tmp_path).path_for("app")
    path.parent.mkdir(parents=True, exist_ok=True)
    models = ModelSet()
    Learner(models.target(BID, "/srv/app"), syscalls=["openat"]).observe(sample(NORMAL))
    save_models(path, models)
    monitor, rt, alerts = monitor_for(tmp_path, "detect")
    monitor.observe(rt, sample(NORMAL, t=1), counted=False)
    monitor.observe_counts(rt, sample(NORMAL), 1000)  # a known context's repeats: nothing
    monitor.observe(rt, sample(HIDDEN, tid=11, t=2, path="/etc/shadow"), counted=False)
    monitor.observe_counts(rt, sample(HIDDEN), 1)  # that record's own sample: nothing more
    assert [(a["kind"], a["pid"], a["tid"], a["args"], a.get("counted")) for a in alerts.published] == [
        ("unseen_context", 10, 11, {"path": "/etc/shadow"}, None)]
    monitor.observe_counts(rt, sample(HIDDEN), 6)  # six more, only counted
    assert len(alerts.published) == 2
    again = alerts.published[1]
    assert (again["kind"], again["pid"], again["tid"], again["args"], again["counted"], again["history"]) == (
        "unseen_context", 0, 0, {}, 6, [])
    assert [f["function"] for f in again["frames"]] == list(HIDDEN)
    assert load_models(path).targets[BID].samples == 1  # detection writes nothing


def test_unseen_context_first_met_in_a_count_is_still_judged(tmp_path: Path) -> None:
    """A detector that starts while the kernel already holds the context (its record went to a
    previous configuration) judges its counted samples all the same."""
    path = ModelStore(tmp_path).path_for("app")
    path.parent.mkdir(parents=True, exist_ok=True)
    models = ModelSet()
    models.targets[BID] = TargetModel(BID, "/srv/app")
    Learner(models.targets[BID], syscalls=["openat"]).observe(sample(NORMAL))
    save_models(path, models)
    monitor, rt, alerts = monitor_for(tmp_path, "detect")
    monitor.observe_counts(rt, sample(HIDDEN), 3)
    [alert] = alerts.published
    assert (alert["kind"], alert["counted"], alert["pid"]) == ("unseen_context", 3, 0)
