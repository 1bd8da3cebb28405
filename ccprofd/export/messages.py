"""Conversions between the tracer's JSON form (frames, samples, alerts) and the ``ccprofd.v1``
protobuf messages, both ways, so the server and ``ccprofctl --json`` speak the same field names.
Addresses are hex strings in JSON and integers on the wire; a JSON ``null`` is an absent field."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ccprofd.export.gen import ccprofd_pb2 as pb


def _address(value: Any) -> int | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, int) else int(str(value), 16)


def frame_to_pb(f: Mapping[str, Any]) -> Any:
    msg = pb.Frame(function=str(f.get("function") or ""), module=str(f.get("module") or ""),
                   build_id=str(f.get("build_id") or ""), analysed=bool(f.get("analysed", False)),
                   tail_call=bool(f.get("tail_call", False)))
    site = _address(f.get("call_site"))
    if site is not None:
        msg.call_site = site
    ret = _address(f.get("return_address"))
    if ret is not None:
        msg.return_address = ret
    if f.get("file"):
        msg.file = str(f["file"])
    if f.get("line"):
        msg.line = int(f["line"])
    for c in f.get("inlined") or ():
        msg.inlined.add(function=str(c.get("function") or ""), file=str(c.get("file") or ""),
                        line=int(c.get("line") or 0))
    return msg


def frames_to_pb(frames: Iterable[Mapping[str, Any]]) -> list[Any]:
    return [frame_to_pb(f) for f in frames]


def frame_from_pb(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "function": msg.function or None, "module": msg.module or None, "build_id": msg.build_id or None,
        "analysed": msg.analysed,
        "call_site": hex(msg.call_site) if msg.HasField("call_site") else None,
        "return_address": hex(msg.return_address) if msg.HasField("return_address") else None}
    if msg.tail_call:
        out["tail_call"] = True
    if msg.file:
        out["file"] = msg.file
    if msg.line:
        out["line"] = msg.line
    if msg.inlined:
        out["inlined"] = [{"function": c.function or None, "file": c.file or None, "line": c.line or None}
                          for c in msg.inlined]
    return out


def frames_from_pb(frames: Iterable[Any]) -> list[dict[str, Any]]:
    return [frame_from_pb(f) for f in frames]


def sample_to_pb(sample: Mapping[str, Any], target: str = "", context: str = "") -> Any:
    """A sample as a Sample; ``args``/``raw_args``/``ret`` follow the JSON: a ``ret`` key with null
    is a return that never came (``unreturned``), no ``ret`` key: returns not traced."""
    msg = pb.Sample(time_ns=int(sample.get("time_ns") or 0), pid=int(sample.get("pid") or 0),
                    tid=int(sample.get("tid") or 0), event=str(sample.get("event") or "syscall"),
                    syscall=str(sample.get("syscall") or ""), complete=bool(sample.get("complete", True)),
                    frames=frames_to_pb(sample.get("frames") or ()), target=target, context=context,
                    reason=str(sample.get("reason") or ""),
                    raw_args=[int(a) & 0xFFFF_FFFF_FFFF_FFFF for a in sample.get("raw_args") or ()])
    for key, value in (sample.get("args") or {}).items():
        msg.args[str(key)] = str(value)
    if "ret" in sample:
        if sample["ret"] is None:
            msg.unreturned = True
        else:
            msg.ret = int(sample["ret"])
    return msg


def sample_from_pb(msg: Any) -> dict[str, Any]:
    out = {"time_ns": msg.time_ns, "pid": msg.pid, "tid": msg.tid, "event": msg.event,
           "syscall": msg.syscall or None, "complete": msg.complete, "frames": frames_from_pb(msg.frames),
           "target": msg.target, "context": msg.context}
    if msg.reason:
        out["reason"] = msg.reason
    if msg.args:
        out["args"] = dict(msg.args)
    if msg.raw_args:
        out["raw_args"] = list(msg.raw_args)
    if msg.HasField("ret"):
        out["ret"] = msg.ret
    elif msg.unreturned:
        out["ret"] = None
    return out


def history_event_to_pb(ev: Mapping[str, Any]) -> Any:
    """A flight-recorder event (ModeBase.history's JSON) as a HistoryEvent."""
    return pb.HistoryEvent(time_ns=int(ev.get("time_ns") or 0), pid=int(ev.get("pid") or 0),
                           tid=int(ev.get("tid") or 0), syscall=str(ev.get("syscall") or ""),
                           complete=bool(ev.get("complete", False)),
                           frames=frames_to_pb(ev.get("frames") or ()),
                           args=[int(a) for a in ev.get("raw_args") or ()])


def history_event_from_pb(msg: Any) -> dict[str, Any]:
    return {"time_ns": msg.time_ns, "pid": msg.pid, "tid": msg.tid, "syscall": msg.syscall or None,
            "complete": msg.complete, "frames": frames_from_pb(msg.frames), "args": list(msg.args)}


def alert_to_pb(alert: Mapping[str, Any]) -> Any:
    msg = pb.Alert(time_ns=int(alert.get("time_ns") or 0), target=str(alert.get("target") or ""),
                   pid=int(alert.get("pid") or 0), tid=int(alert.get("tid") or 0),
                   syscall=str(alert.get("syscall") or ""), kind=str(alert.get("kind") or ""),
                   complete=bool(alert.get("complete", True)), frames=frames_to_pb(alert.get("frames") or ()),
                   action=str(alert.get("action") or ""), denied=bool(alert.get("denied", False)),
                   build_id=str(alert.get("build_id") or ""), context=str(alert.get("context") or ""))
    for key, value in (alert.get("args") or {}).items():
        msg.args[str(key)] = str(value)
    for near in alert.get("nearest") or ():
        msg.nearest.add(frames=frames_to_pb(near.get("frames") or ()), count=int(near.get("count") or 0),
                        common_prefix=int(near.get("common_prefix") or 0))
    msg.history.extend(history_event_to_pb(ev) for ev in alert.get("history") or ())
    edge = alert.get("unseen_edge")
    if edge:
        msg.unseen_edge.syscall = str(edge.get("syscall") or "")
        if edge.get("caller"):
            msg.unseen_edge.caller.CopyFrom(frame_to_pb(edge["caller"]))
        if edge.get("callee"):
            msg.unseen_edge.callee.CopyFrom(frame_to_pb(edge["callee"]))
    return msg


def _edge_frame_from_pb(msg: Any) -> dict[str, Any]:
    return {k: v for k, v in frame_from_pb(msg).items() if v is not None and k != "analysed"}


def alert_from_pb(msg: Any) -> dict[str, Any]:
    return {"time_ns": msg.time_ns, "target": msg.target, "pid": msg.pid, "tid": msg.tid,
            "syscall": msg.syscall, "args": dict(msg.args), "kind": msg.kind, "complete": msg.complete,
            "frames": frames_from_pb(msg.frames), "action": msg.action, "denied": msg.denied,
            "build_id": msg.build_id, "context": msg.context,
            "nearest": [{"frames": frames_from_pb(n.frames), "count": n.count,
                         "common_prefix": n.common_prefix} for n in msg.nearest],
            "history": [history_event_from_pb(ev) for ev in msg.history],
            **({"unseen_edge": _edge_from_pb(msg.unseen_edge)} if msg.HasField("unseen_edge") else {})}


def _edge_from_pb(edge: Any) -> dict[str, Any]:
    return {"syscall": edge.syscall,
            "caller": _edge_frame_from_pb(edge.caller) if edge.HasField("caller") else None,
            "callee": _edge_frame_from_pb(edge.callee) if edge.HasField("callee") else None}
