"""Conversions between the tracer's JSON form (frames, samples, alerts) and the ``ccprofd.v1``
protobuf messages, both ways, so the server and ``ccprofctl --json`` speak the same field names.
Addresses are hex strings in JSON and integers on the wire; a JSON ``null`` is an absent field."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ccprofd.export.gen import ccprofd_pb2 as pb

#: A SampleBatch's serialised size bound: well under gRPC's default 4 MiB receive limit, so a
#: client with default channel options takes any batch (deep stacks are ~10 KiB a sample).
BATCH_MAX_BYTES = 1 << 20


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
    msg = pb.Sample(frames=frames_to_pb(sample.get("frames") or ()))
    return _fill_sample(msg, sample, target, context)


def _fill_sample(msg: Any, sample: Mapping[str, Any], target: str, context: str) -> Any:
    """``msg`` with every field of ``sample`` but its frames."""
    msg.time_ns = int(sample.get("time_ns") or 0)
    msg.pid = int(sample.get("pid") or 0)
    msg.tid = int(sample.get("tid") or 0)
    msg.event = str(sample.get("event") or "syscall")
    msg.syscall = str(sample.get("syscall") or "")
    msg.complete = bool(sample.get("complete", True))
    msg.target = target
    msg.context = context
    msg.reason = str(sample.get("reason") or "")
    raw_args = sample.get("raw_args")
    if raw_args:
        msg.raw_args.extend([int(a) & 0xFFFF_FFFF_FFFF_FFFF for a in raw_args])
    for key, value in (sample.get("args") or {}).items():
        msg.args[str(key)] = str(value)
    if "ret" in sample:
        if sample["ret"] is None:
            msg.unreturned = True
        else:
            msg.ret = int(sample["ret"])
    return msg


class SampleEncoder:
    """Sample messages for one stream, each context's frames converted once.

    Why: converting a sample's frames is nearly all of a Sample's cost (~50 of ~60 µs for 8
    frames), and the tracers give every sample of a context the same frames list (read-only,
    ``TraceSample.frames``).  So the encoder keeps each list's frames as serialised ``Sample.frames``
    bytes, found by the list's identity, and merges them into the message.  An entry holds its list,
    so the identity cannot be reused while the entry exists; the table starts over when full."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._frames: dict[int, tuple[list[Any], bytes]] = {}

    def frames_bytes(self, frames: list[Any]) -> bytes:
        entry = self._frames.get(id(frames))
        if entry is not None and entry[0] is frames:
            return entry[1]
        data = pb.Sample(frames=frames_to_pb(frames)).SerializeToString()
        if len(self._frames) >= self.limit:
            self._frames.clear()
        self._frames[id(frames)] = (frames, data)
        return data

    def fill(self, msg: Any, sample: Mapping[str, Any], target: str = "", context: str = "") -> Any:
        """``msg`` (an empty Sample) filled from ``sample``: what :func:`sample_to_pb` gives."""
        frames = sample.get("frames")
        if frames:
            msg.MergeFromString(self.frames_bytes(frames))
        return _fill_sample(msg, sample, target, context)

    def sample(self, item: Mapping[str, Any]) -> Any:
        """A bus item (a sample with its ``target`` and ``context``) as a Sample."""
        return self.fill(pb.Sample(), item, item.get("target", ""), item.get("context", ""))

    def batches(self, items: Sequence[Mapping[str, Any]], dropped: int = 0,
                max_bytes: int = BATCH_MAX_BYTES) -> Iterator[Any]:
        """``items`` as SampleBatch messages, in order, each at most ``max_bytes`` serialised
        (or one sample, if that alone is larger); ``dropped`` goes into the first."""
        batch, size = pb.SampleBatch(dropped=dropped), 0
        for item in items:
            target, context = item.get("target", ""), item.get("context", "")
            n = self.fill(batch.samples.add(), item, target, context).ByteSize() + 8  # + tag, length
            if size + n > max_bytes and len(batch.samples) > 1:
                del batch.samples[-1]
                yield batch
                batch = pb.SampleBatch()
                self.fill(batch.samples.add(), item, target, context)
                size = 0
            size += n
        if batch.samples or batch.dropped:
            yield batch


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
                   build_id=str(alert.get("build_id") or ""), context=str(alert.get("context") or ""),
                   counted=int(alert.get("counted") or 0), suppressed=int(alert.get("suppressed") or 0))
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
            "suppressed": msg.suppressed,
            **({"counted": msg.counted} if msg.counted else {}),
            **({"unseen_edge": _edge_from_pb(msg.unseen_edge)} if msg.HasField("unseen_edge") else {})}


def _edge_from_pb(edge: Any) -> dict[str, Any]:
    return {"syscall": edge.syscall,
            "caller": _edge_frame_from_pb(edge.caller) if edge.HasField("caller") else None,
            "callee": _edge_frame_from_pb(edge.callee) if edge.HasField("callee") else None}
