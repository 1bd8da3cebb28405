"""An alert carries its thread's flight-recorder history (issue #19): the daemon's anomaly monitor
asks the target's source for the events before the alert's syscall, ``alert_history`` of them, and
the gRPC Alert carries them through (proto round trip).  The real recorder is tested end to end in
test_history_e2e.py; here the source is a stand-in that records what it was asked."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ccprofd.anomaly.model import ModelSet
from ccprofd.daemon.anomaly_runtime import AnomalyMonitor, _Target
from ccprofd.daemon.config import AnomalyConfig, ConfigError, parse_config
from ccprofd.export.messages import alert_from_pb, alert_to_pb

EVENT = {"time_ns": 100, "pid": 7, "tid": 9, "event": "syscall", "syscall": "read", "complete": True,
         "frames": [{"function": "main", "module": "/bin/p", "build_id": None, "analysed": True,
                     "call_site": "0x10", "return_address": "0x15"}], "raw_args": [3, 4096, 512]}


class Source:
    def __init__(self) -> None:
        self.asked: list[tuple[int, int, int, int]] = []

    def history_before(self, pid: int, tid: int, time_ns: int, last: int) -> list[dict[str, Any]]:
        self.asked.append((pid, tid, time_ns, last))
        return [EVENT]


class Bus:
    def __init__(self) -> None:
        self.published: list[dict[str, Any]] = []

    def publish(self, item: dict[str, Any]) -> None:
        self.published.append(item)


def alert() -> dict[str, Any]:
    return {"kind": "unseen_context", "time_ns": 200, "pid": 7, "tid": 9, "syscall": "openat",
            "build_id": "b", "complete": True, "args": {}, "frames": [], "nearest": [], "suppressed": 0}


@pytest.mark.parametrize("alert_history", [16, 0])
def test_an_alert_carries_its_threads_history(tmp_path: Path, alert_history: int) -> None:
    source, bus = Source(), Bus()
    cfg = AnomalyConfig(action="detect", alert_history=alert_history)
    daemon = SimpleNamespace(targets={"app": SimpleNamespace(source=source)}, alerts=bus)
    monitor = AnomalyMonitor(daemon=daemon)  # type: ignore[arg-type]
    t = _Target("app", cfg, tmp_path / "m.json", ModelSet())
    monitor._publish(t, None, alert(), "line")  # type: ignore[arg-type]
    [published] = bus.published
    if alert_history == 0:
        assert published["history"] == [] and source.asked == []
        return
    assert source.asked == [(7, 9, 200, 16)]
    assert published["history"] == [EVENT]
    back = alert_from_pb(alert_to_pb(published))
    assert back["history"] == [{"time_ns": 100, "pid": 7, "tid": 9, "syscall": "read", "complete": True,
                                "frames": EVENT["frames"], "args": [3, 4096, 512]}]


def test_alert_history_config() -> None:
    base = '[daemon]\nstate_dir = "/tmp/x"\n[[target]]\nname = "a"\npath = "/bin/true"\n[target.anomaly]\n'
    assert parse_config(base + 'action = "detect"\n').targets[0].anomaly.alert_history == 16
    assert parse_config(base + "alert_history = 0\n").targets[0].anomaly.alert_history == 0
    for bad in ("alert_history = -1", "alert_history = 5000", "alert_history = true", 'alert_history = "x"'):
        with pytest.raises(ConfigError, match="alert_history"):
            parse_config(base + bad + "\n")
