"""The gRPC messages carry what the tracer's JSON carries (issue 14's review: Sample lacked the
arguments and the return value, Alert the unseen edge), and convert back to the same JSON."""

from __future__ import annotations

from typing import Any

from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.export.messages import alert_from_pb, alert_to_pb, sample_from_pb, sample_to_pb

FRAME = {"function": "main", "module": "/bin/p", "build_id": "ab", "analysed": True, "call_site": "0x10",
         "return_address": "0x15"}


def sample(**extra: Any) -> dict[str, Any]:
    return {"time_ns": 5, "pid": 7, "tid": 8, "event": "syscall", "syscall": "openat", "complete": True,
            "frames": [FRAME], **extra}


def test_sample_arguments_and_return_value_survive_the_wire() -> None:
    traced = sample(args={"path": "/etc/passwd"}, raw_args=[2**64 - 100, 4096, 0], ret=-2)
    msg = pb.Sample.FromString(sample_to_pb(traced, "app", "c1").SerializeToString())
    assert dict(msg.args) == {"path": "/etc/passwd"} and list(msg.raw_args) == [2**64 - 100, 4096, 0]
    assert msg.HasField("ret") and msg.ret == -2 and not msg.unreturned
    back = sample_from_pb(msg)
    assert back["args"] == {"path": "/etc/passwd"} and back["raw_args"] == [2**64 - 100, 4096, 0]
    assert back["ret"] == -2 and back["frames"] == [FRAME]


def test_a_return_that_never_came_differs_from_returns_not_traced() -> None:
    never = pb.Sample.FromString(sample_to_pb(sample(syscall="exit_group", ret=None)).SerializeToString())
    assert never.unreturned and not never.HasField("ret") and sample_from_pb(never)["ret"] is None
    untraced = pb.Sample.FromString(sample_to_pb(sample()).SerializeToString())
    assert not untraced.unreturned and "ret" not in sample_from_pb(untraced)
    assert "args" not in sample_from_pb(untraced) and "raw_args" not in sample_from_pb(untraced)


def test_alert_carries_the_unseen_edge() -> None:
    edge = {"syscall": "openat", "caller": {"function": "rdbSave", "module": "/usr/bin/redis-server",
                                            "build_id": "cd", "call_site": "0x4a10"},
            "callee": {"function": "fopen", "module": "/lib/libc.so.6", "build_id": "ef"}}
    alert = {"kind": "unseen_context", "time_ns": 9, "pid": 7, "tid": 8, "syscall": "openat",
             "build_id": "cd", "complete": True, "args": {}, "frames": [FRAME], "nearest": [],
             "unseen_edge": edge}
    back = alert_from_pb(pb.Alert.FromString(alert_to_pb(alert).SerializeToString()))
    assert back["unseen_edge"] == edge
    entry = dict(alert, unseen_edge={"syscall": "openat", "caller": None,
                                     "callee": {"function": "main", "module": "/bin/p", "build_id": "ab"}})
    assert alert_from_pb(alert_to_pb(entry))["unseen_edge"] == entry["unseen_edge"]
    assert "unseen_edge" not in alert_from_pb(alert_to_pb(dict(alert, unseen_edge=None)))


def test_an_incomplete_sample_says_why_on_the_wire() -> None:
    flagged = sample(complete=False, reason="no_cfi: pc 0x4010 in /bin/p has no FDE")
    msg = pb.Sample.FromString(sample_to_pb(flagged).SerializeToString())
    assert msg.reason == "no_cfi: pc 0x4010 in /bin/p has no FDE"
    assert sample_from_pb(msg)["reason"] == flagged["reason"]
    assert "reason" not in sample_from_pb(sample_to_pb(sample()))
