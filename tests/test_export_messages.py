"""The gRPC messages carry what the tracer's JSON carries (issue 14's review: Sample lacked the
arguments and the return value, Alert the unseen edge), and convert back to the same JSON."""

from __future__ import annotations

from typing import Any

from ccprofd.export.gen import ccprofd_pb2 as pb
from ccprofd.export.messages import SampleEncoder, alert_from_pb, alert_to_pb, sample_from_pb, sample_to_pb

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


def test_the_encoder_gives_what_sample_to_pb_gives() -> None:
    """The stream encoder converts a frames list once and reuses its bytes: every field must come
    out as the plain conversion's, for samples that share the list and for ones that do not."""
    shared = [FRAME, {**FRAME, "function": "open_cfg", "call_site": "0x20", "file": "a.c", "line": 7,
                      "inlined": [{"function": "inl", "file": "b.h", "line": 3}]}]
    samples = [
        sample(frames=shared, args={"path": "/etc/passwd"}, raw_args=[2**64 - 1, 0], ret=-2),
        sample(frames=shared, tid=9, ret=None, complete=False, reason="no_cfi: x"),
        sample(frames=[dict(f) for f in shared], syscall="write"),  # equal contents, another list
        sample(frames=[]),
        sample(event="cpu", syscall=None, frames=shared[:1]),
    ]
    encoder = SampleEncoder()
    for s in samples:
        item = {**s, "target": "app", "context": "c1"}
        assert encoder.sample(item) == sample_to_pb(s, "app", "c1")
    (batch,) = encoder.batches([{**s, "target": "app", "context": "c1"} for s in samples], dropped=4)
    assert list(batch.samples) == [sample_to_pb(s, "app", "c1") for s in samples]
    assert batch.dropped == 4


def test_the_encoder_converts_each_list_and_starts_over_when_full() -> None:
    """Entries are found by a list's identity: lists with other contents never share bytes, and a
    full table is emptied (its lists, and with them their ids, released) rather than grown."""
    encoder = SampleEncoder(limit=3)
    for name in ("a", "b", "c", "d", "e", "f", "g"):  # temporaries: ids are reused once released
        frames = [{**FRAME, "function": name}]
        assert pb.Sample.FromString(encoder.frames_bytes(frames)).frames[0].function == name
        assert encoder.frames_bytes(frames) is encoder.frames_bytes(frames)  # found, not redone
        assert len(encoder._frames) <= 3


def test_batches_split_at_the_size_bound_and_keep_order() -> None:
    deep = [{**FRAME, "function": f"f{i}"} for i in range(50)]
    items = [{**sample(frames=deep, tid=i), "target": "t", "context": "c"} for i in range(40)]
    one = sample_to_pb(items[0], "t", "c").ByteSize()
    batches = list(SampleEncoder().batches(items, dropped=1, max_bytes=one * 10 + 100))
    assert [len(b.samples) for b in batches] == [10, 10, 10, 10]
    assert [s.tid for b in batches for s in b.samples] == list(range(40))
    assert [b.dropped for b in batches] == [1, 0, 0, 0]
    assert all(b.ByteSize() <= one * 10 + 100 for b in batches)
    # one sample larger than the bound still goes, alone
    assert [len(b.samples) for b in SampleEncoder().batches(items[:3], max_bytes=10)] == [1, 1, 1]
    # nothing queued and nothing lost: no message; only losses: a message that says so
    assert list(SampleEncoder().batches([])) == []
    assert [(len(b.samples), b.dropped) for b in SampleEncoder().batches([], dropped=3)] == [(0, 3)]


def test_alert_of_kernel_counted_repeats_says_so_on_the_wire_and_in_ccprofctl() -> None:
    """An alert standing for samples only the kernel counted keeps ``counted`` (and the held
    ``suppressed``) through gRPC, and ``ccprofctl alerts`` prints no thread for it."""
    from ccprofd.cli.ctl import _alert_line

    alert = {"kind": "unseen_context", "time_ns": 9, "pid": 0, "tid": 0, "syscall": "openat",
             "build_id": "cd", "complete": True, "args": {}, "frames": [FRAME], "nearest": [],
             "counted": 6, "suppressed": 3, "target": "srv", "action": "detect"}
    back = alert_from_pb(pb.Alert.FromString(alert_to_pb(alert).SerializeToString()))
    assert (back["counted"], back["suppressed"], back["pid"], back["tid"]) == (6, 3, 0, 0)
    assert " srv ?/? x6 (counted in the kernel) unseen_context openat" in _alert_line(back)
    single = alert_from_pb(alert_to_pb(dict(alert, counted=0, pid=7, tid=8, suppressed=0)))
    assert "counted" not in single and " srv 7/8 unseen_context openat" in _alert_line(single)
