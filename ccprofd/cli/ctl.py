"""``ccprofctl``: the client of a running ccprofd daemon (gRPC on its Unix socket, or TCP with TLS).

Exit status: 0 success, 2 bad usage or a query the daemon rejects (unknown target, pid or context), 1 when
the daemon cannot be reached or fails.  ``--format json`` (``--json``) prints frames in the
tracer's JSON form (hex address strings); ``stream`` and ``alerts`` print one JSON object per line.
``hot --format pprof`` writes a gzipped pprof profile, ``--format folded`` folded stacks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ccprofd import __version__

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
DEFAULT_SOCKET = "/run/ccprofd/ccprofd.sock"
FORMATS = ("text", "json", "pprof", "folded")


class CtlError(Exception):
    def __init__(self, message: str, status: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    fmt = _Parser(add_help=False)
    fmt.add_argument("--format", choices=FORMATS, default=argparse.SUPPRESS,
                     help="output format (default text; pprof and folded for hot)")
    fmt.add_argument("--json", dest="format", action="store_const", const="json", default=argparse.SUPPRESS,
                     help="short for --format json")
    fmt.add_argument("-o", "--output", default=argparse.SUPPRESS, help="write to FILE instead of stdout")
    p = _Parser(prog="ccprofctl", parents=[fmt],
                description="Query a running ccprofd daemon: targets, per-thread contexts, hot contexts, "
                            "live samples, alerts, call-graph statistics, what a context id stands for.",
                epilog="Exit status: 0 success, 2 bad usage or unknown target/pid/context, "
                       "1 daemon unreachable or failed.")
    p.add_argument("--version", action="version", version=f"ccprofctl {__version__}")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", help=f"daemon Unix socket (default $CCPROFD_SOCKET or {DEFAULT_SOCKET})")
    where.add_argument("--address", help="tcp://HOST:PORT of a daemon listening on TCP")
    p.add_argument("--tls-ca", help="CA certificate that signed the daemon's (enables TLS)")
    p.add_argument("--tls-cert", help="client certificate (when the daemon requires one)")
    p.add_argument("--tls-key", help="client private key")
    p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per unary call (default 10)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("targets", parents=[fmt], help="targets, binaries, build-ids, processes, threads")
    c = sub.add_parser("contexts", parents=[fmt], help="current context of every thread of a process")
    c.add_argument("pid", type=_pid, metavar="PID", help="process id")
    hi = sub.add_parser("history", parents=[fmt],
                        help="recorded syscalls (flight recorder) of a process's threads or of one thread")
    hi.add_argument("pid", type=_pid, metavar="PID|TID", help="process id (every thread) or thread id")
    hi.add_argument("--last", type=_positive_int, default=0, metavar="N",
                    help="only the N latest syscalls of each thread (default: all kept, 256)")
    h = sub.add_parser("hot", parents=[fmt], help="most frequent contexts")
    h.add_argument("--target", default="", help="one target (default: all)")
    h.add_argument("--by", choices=("syscall", "cpu"), default="syscall",
                   help="syscall samples (default) or CPU samples")
    h.add_argument("--top", type=_positive_int, default=0, metavar="N",
                   help="how many (default: the daemon's top_k)")
    h.add_argument("--since", type=_seconds, default=0.0, metavar="SECONDS",
                   help="only samples of the last SECONDS (default: since the daemon started)")
    h.add_argument("--syscall", default="", help="only this syscall")
    h.add_argument("--folded-marks", action="store_true",
                   help="--format folded: library frames as 'func [libc.so.6]', tail-call-reached frames "
                        "'func_[t]', inlined functions 'func_[i]'")
    stream_help = "live decoded samples (any the daemon dropped because this client fell behind: on stderr)"
    for name, helptext in (("stream", stream_help), ("alerts", "live anomaly alerts")):
        s = sub.add_parser(name, parents=[fmt], help=helptext)
        s.add_argument("--target", default="", help="one target (default: all)")
        s.add_argument("--syscalls", default="", help="comma-separated syscall names")
        s.add_argument("--count", type=_positive_int, default=0, help="stop after N items")
        s.add_argument("--duration", type=_seconds, default=0.0, help="stop after SECONDS")
        if name == "stream":
            s.add_argument("--pid", type=_pid, default=0, help="only this process")
            s.add_argument("--event", choices=("syscall", "cpu"), default="", help="only this kind of sample")
        else:
            s.add_argument("--kind", action="append", default=[], help="only this alert kind (repeatable)")
    st = sub.add_parser("stats", parents=[fmt], help="call-graph and encoding statistics of a target")
    st.add_argument("target", metavar="TARGET", help="target name (as `ccprofctl targets` lists it)")
    cx = sub.add_parser("context", parents=[fmt], help="the frames a context id (metrics label) stands for")
    cx.add_argument("context", metavar="HASH", help="context id, e.g. a metrics `context` label")
    cx.add_argument("--target", default="", help="one target (default: all)")
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return min(value, INT32_MAX)  # a count: "more than there can be" is "all"


INT32_MAX = 2**31 - 1


def _pid(text: str) -> int:
    """A process id any pid namespace can have (below the kernel's PID_MAX_LIMIT, 2**22): the
    daemon names host pids, which this client's own pid_max need not bound."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 0 < value < PID_MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a process id (1 to {PID_MAX_LIMIT - 1}), got {text!r}")
    return value


PID_MAX_LIMIT = 2**22


def _seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


# ------------------------------------------------------------------------------------ channel
def open_channel(args: argparse.Namespace) -> Any:
    import grpc

    if args.address:
        if not args.address.startswith("tcp://"):
            raise CtlError(f"--address must be tcp://HOST:PORT, got {args.address!r}", EXIT_USAGE)
        target = args.address[len("tcp://"):]
        if args.tls_ca or args.tls_cert or args.tls_key:
            if bool(args.tls_cert) != bool(args.tls_key):
                raise CtlError("--tls-cert and --tls-key go together", EXIT_USAGE)
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(args.tls_ca), private_key=_read(args.tls_key),
                certificate_chain=_read(args.tls_cert))
            return grpc.secure_channel(target, creds), args.address
        return grpc.insecure_channel(target), args.address
    if args.tls_ca or args.tls_cert or args.tls_key:
        raise CtlError("--tls-* options apply to --address tcp://... only", EXIT_USAGE)
    path = args.socket or os.environ.get("CCPROFD_SOCKET") or DEFAULT_SOCKET
    return grpc.insecure_channel(f"unix:{path}"), f"unix://{path}"


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror}", EXIT_USAGE) from None


# ------------------------------------------------------------------------------------ commands
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    fmt = getattr(args, "format", "text")
    if fmt in ("pprof", "folded") and args.command != "hot":
        print(f"ccprofctl: --format {fmt} applies to 'hot' only", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "folded_marks", False) and fmt != "folded":
        print("ccprofctl: --folded-marks applies to --format folded only", file=sys.stderr)
        return EXIT_USAGE
    output = getattr(args, "output", None)
    if fmt == "pprof" and output is None and sys.stdout.isatty():
        print("ccprofctl: pprof output is binary: redirect it or use --output FILE", file=sys.stderr)
        return EXIT_USAGE
    import grpc

    try:
        channel, where = open_channel(args)
        with channel:
            command: Callable[..., int] = COMMANDS[args.command]
            out = open(output, "wb") if output else sys.stdout.buffer  # noqa: SIM115 - closed below
            try:
                return command(args, channel, fmt, _Writer(out))
            finally:
                if output:
                    out.close()
    except CtlError as exc:
        print(f"ccprofctl: {exc}", file=sys.stderr)
        return exc.status
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
        if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
            print(f"ccprofctl: {details}", file=sys.stderr)
            return EXIT_USAGE
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            print(f"ccprofctl: cannot reach ccprofd at {where}: {details}", file=sys.stderr)
            return EXIT_FAILURE
        print(f"ccprofctl: {code.name.lower()}: {details}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        print(f"ccprofctl: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_OK if args.command in ("stream", "alerts") else 130


class _Writer:
    def __init__(self, out: Any) -> None:
        self.out = out

    def line(self, text: str = "") -> None:
        self.out.write((text + "\n").encode())
        self.out.flush()

    def json(self, value: Any, indent: int | None = 2) -> None:
        self.line(json.dumps(value, indent=indent))

    def raw(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()


def _stub(channel: Any) -> Any:
    from ccprofd.export.gen import ccprofd_pb2_grpc

    return ccprofd_pb2_grpc.ProfilerStub(channel)


def _frames_text(frames: list[dict[str, Any]], w: _Writer, indent: str = "    ") -> None:
    for depth, f in enumerate(frames):
        name = f.get("function") or "??"
        site = f.get("call_site") or "-"
        note = "" if f.get("analysed", True) else "  (not analysed)"
        note += "  (tail call)" if f.get("tail_call") else ""
        w.line(f"{indent}#{depth:<3} {name:<32} {site:>12}  {f.get('module') or ''}{_source(f)}{note}")
        for c in f.get("inlined") or ():  # outermost first, like the frames, below their frame
            w.line(f"{indent}     {'> ' + str(c.get('function') or '??'):<32} {'':>12}  {_source(c).strip()}"
                   "  (inlined)")


def _source(f: dict[str, Any]) -> str:
    """``  FILE:LINE`` of a frame or inlined call ("" when it has no file)."""
    if not f.get("file"):
        return ""
    return f"  {f['file']}:{f['line']}" if f.get("line") else f"  {f['file']}"


def cmd_targets(args: argparse.Namespace, channel: Any, fmt: str, w: _Writer) -> int:
    from google.protobuf import json_format

    from ccprofd.export.gen import ccprofd_pb2 as pb

    resp = _stub(channel).ListTargets(pb.ListTargetsRequest(), timeout=args.timeout)
    if fmt == "json":
        w.json([json_format.MessageToDict(t, preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True) for t in resp.targets])
        return EXIT_OK
    for t in resp.targets:
        mode = t.mode if t.mode == t.configured_mode else f"{t.mode} (configured {t.configured_mode})"
        w.line(f"{t.name}: {t.kind} {t.spec}  mode {mode}  encoding {t.encoding}  state {t.state}  "
               f"samples {t.samples}  syscalls {','.join(t.syscalls) or 'all'}"
               + (f"  perf {t.perf_sample_hz} Hz" if t.perf_sample_hz else ""))
        if t.error:
            label = {"waiting": "waiting", "attached": "note"}.get(t.state, "error")
            w.line(f"  {label}: {t.error}")
        for b in t.binaries:
            w.line(f"  binary {b.path}  build-id {b.build_id or '-'}  inode {b.inode}"
                   + ("" if b.attached else "  (not attached)"))
        for p in t.processes:
            w.line(f"  pid {p.pid:<8} threads {p.threads:<4} {p.comm:<16} {p.binary}")
        for n in t.needs_learning:
            why = "upgraded: the model of an older build is kept, not applied" if n.reason == "upgraded" \
                else "no model"
            w.line(f"  needs re-learning: {n.binary}  build-id {n.build_id or '-'}  ({why})")
    return EXIT_OK


def cmd_contexts(args: argparse.Namespace, channel: Any, fmt: str, w: _Writer) -> int:
    from ccprofd.export.gen import ccprofd_pb2 as pb
    from ccprofd.export.messages import frames_from_pb

    resp = _stub(channel).GetThreadContexts(pb.GetThreadContextsRequest(pid=args.pid), timeout=args.timeout)
    threads = [{"tid": t.tid, "comm": t.comm, "complete": t.complete, "reason": t.reason or None,
                "frames": frames_from_pb(t.frames)} for t in resp.threads]
    if fmt == "json":
        w.json({"pid": resp.pid, "target": resp.target, "mode": resp.mode, "threads": threads})
        return EXIT_OK
    w.line(f"pid {resp.pid} (target {resp.target}, {resp.mode} mode): {len(threads)} threads")
    for t in threads:
        w.line(f"  tid {t['tid']} {t['comm']}"
               + ("" if t["complete"] else f"  [incomplete: {t['reason'] or 'prefix unknown'}]"))
        _frames_text(t["frames"], w)
    return EXIT_OK


def cmd_history(args: argparse.Namespace, channel: Any, fmt: str, w: _Writer) -> int:
    from ccprofd.export.gen import ccprofd_pb2 as pb
    from ccprofd.export.messages import history_event_from_pb

    resp = _stub(channel).GetHistory(pb.GetHistoryRequest(pid=args.pid, last=args.last), timeout=args.timeout)
    threads = [{"tid": t.tid, "events": [history_event_from_pb(e) for e in t.events]} for t in resp.threads]
    source = resp.source or "live"
    if fmt == "json":
        w.json({"pid": resp.pid, "target": resp.target, "mode": resp.mode, "source": source,
                "threads": threads})
        return EXIT_OK
    for line in history_lines(resp.pid, f"target {resp.target}, {resp.mode} mode, {source}", threads):
        w.line(line)
    return EXIT_OK


def history_lines(pid: int, what: str, threads: list[dict[str, Any]], reverse: bool = False) -> list[str]:
    """The text form of one process's history (``ccprofctl history``, ``ccprofd history FILE``):
    threads of ``{"tid", "events"}``, events in ``history_event_from_pb``'s JSON form."""
    lines = [f"pid {pid} ({what}): {len(threads)} threads"]
    for t in threads:
        order = "newest" if reverse else "oldest"
        lines.append(f"  tid {t['tid']}: {len(t['events'])} syscalls, {order} first")
        for e in t["events"]:
            args_text = ", ".join(f"{a:#x}" for a in e["args"])
            flag = "" if e["complete"] else "  [incomplete]"
            lines.append(f"    {e['time_ns']} {e['syscall']}({args_text}){flag}: {_chain(e['frames'])}")
    return lines


def hot_rows(resp: Any) -> list[dict[str, Any]]:
    """GetHotContexts rows as JSON; ``leaf`` is the program's innermost function (as the metrics'
    label), ``leaf_library`` the library function below it when the mode reports one."""
    from ccprofd.daemon.store import library_leaf
    from ccprofd.export.messages import frames_from_pb

    rows = []
    for h in resp.contexts:
        frames = frames_from_pb(h.frames)
        rows.append({"target": h.target, "context": h.context, "event": h.event, "syscall": h.syscall or None,
                     "count": h.count, "complete": h.complete, "leaf": h.leaf,
                     "leaf_library": library_leaf(frames), "frames": frames,
                     "first_seen_ns": h.first_seen_ns, "last_seen_ns": h.last_seen_ns})
    return rows


def cmd_hot(args: argparse.Namespace, channel: Any, fmt: str, w: _Writer) -> int:
    from ccprofd.export.gen import ccprofd_pb2 as pb

    now = time.time_ns()
    # --since longer than the epoch (the daemon's whole life, then): all-time totals
    since = now - int(args.since * 1e9) if 0 < args.since * 1e9 < now else 0
    by = pb.HOT_BY_CPU if args.by == "cpu" else pb.HOT_BY_SYSCALL
    req = pb.GetHotContextsRequest(target=args.target, by=by, top_k=args.top, since_ns=since,
                                   syscall=args.syscall)
    resp = _stub(channel).GetHotContexts(req, timeout=args.timeout)
    rows = hot_rows(resp)
    if fmt == "pprof":
        from ccprofd.export.pprof import write_pprof

        w.raw(write_pprof(rows, event=args.by, period_ns=resp.sample_period_ns, time_ns=resp.since_ns,
                          duration_ns=max(0, resp.until_ns - resp.since_ns)))
    elif fmt == "folded":
        from ccprofd.export.folded import write_folded

        w.raw(write_folded(rows, event=args.by, marks=args.folded_marks).encode())
    elif fmt == "json":
        w.json({"by": args.by, "total_samples": resp.total_samples, "since_ns": resp.since_ns,
                "until_ns": resp.until_ns, "sample_period_ns": resp.sample_period_ns, "contexts": rows})
    else:
        w.line(f"{len(rows)} hottest of {resp.total_samples} {args.by} samples")
        for r in rows:
            share = 100.0 * r["count"] / resp.total_samples if resp.total_samples else 0.0
            what = f"syscall {r['syscall']}" if r["event"] == "syscall" else "cpu"
            w.line(f"{r['count']:>10} {share:5.1f}%  {r['target']}  {what}  context {r['context']}"
                   + ("" if r["complete"] else "  [incomplete]"))
            _frames_text(r["frames"], w)
    return EXIT_OK


def _until(args: argparse.Namespace) -> Callable[[int], bool]:
    deadline = time.monotonic() + args.duration if args.duration > 0 else None

    def done(n: int) -> bool:
        expired = deadline is not None and time.monotonic() >= deadline
        return bool((args.count and n >= args.count) or expired)

    return done


def cmd_stream(args: argparse.Namespace, channel: Any, fmt: str, w: _Writer) -> int:
    from ccprofd.export.gen import ccprofd_pb2 as pb
    from ccprofd.export.messages import sample_from_pb

    req = pb.SampleFilter(target=args.target, pid=args.pid, event=args.event,
                          syscalls=[s for s in args.syscalls.split(",") if s])
    stub = _stub(channel)
    try:
        return _consume(stub.StreamSampleBatches, req, args, fmt, w, sample_from_pb, _sample_line,
                        batched=True)
    except _Unimplemented:  # a daemon older than StreamSampleBatches
        return _consume(stub.StreamSamples, req, args, fmt, w, sample_from_pb, _sample_line)


def cmd_alerts(args: argparse.Namespace, channel: Any, fmt: str, w: _Writer) -> int:
    from ccprofd.export.gen import ccprofd_pb2 as pb
    from ccprofd.export.messages import alert_from_pb

    syscalls = [s for s in args.syscalls.split(",") if s]
    req = pb.AlertFilter(target=args.target, kinds=args.kind, syscalls=syscalls)
    return _consume(_stub(channel).StreamAlerts, req, args, fmt, w, alert_from_pb, _alert_line)


class _Unimplemented(Exception):
    """The daemon does not serve the RPC (an older version), before anything was printed."""


def _consume(rpc: Any, req: Any, args: argparse.Namespace, fmt: str, w: _Writer,
             convert: Callable[[Any], dict[str, Any]], text: Callable[[dict[str, Any]], str],
             batched: bool = False) -> int:
    """Print a stream's items until --count/--duration; ``batched``: each message holds
    ``samples`` and how many the daemon ``dropped`` before them (said on stderr, never silently)."""
    import grpc

    done = _until(args)
    timeout = args.duration if args.duration > 0 else None
    n = 0
    call = rpc(req, timeout=timeout)
    try:
        for msg in call:
            if batched and msg.dropped:
                print(f"ccprofctl: the daemon dropped {msg.dropped} samples of this stream: "
                      "it could not send them as fast as they came (narrow the filter)", file=sys.stderr)
            for one in msg.samples if batched else (msg,):
                item = convert(one)
                w.line(json.dumps(item) if fmt == "json" else text(item))
                n += 1
                if done(n):
                    return EXIT_OK
            if done(n):
                break
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED and n == 0:
            raise _Unimplemented() from None
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    finally:
        call.cancel()
    return EXIT_OK


def _chain(frames: list[dict[str, Any]]) -> str:
    return " > ".join(str(f.get("function") or "??") for f in frames)


def _sample_line(s: dict[str, Any]) -> str:
    what = s["syscall"] if s["event"] == "syscall" else "cpu"
    flag = "" if s["complete"] else f" [incomplete: {s.get('reason') or 'unknown'}]"
    args = "".join(f" {k}={v}" for k, v in sorted((s.get("args") or {}).items()))
    ret = "" if "ret" not in s else f" = {'?' if s['ret'] is None else s['ret']}"
    return (f"{s['time_ns']} {s['target']} {s['pid']}/{s['tid']} {what}{args}{ret} {s['context']}{flag}: "
            f"{_chain(s['frames'])}")


def _alert_line(a: dict[str, Any]) -> str:
    args = " ".join(f"{k}={v}" for k, v in sorted(a["args"].items()))
    denied = " DENIED" if a["denied"] else ""
    edge = ""
    if a.get("unseen_edge"):
        from ccprofd.anomaly.detector import edge_text

        edge = f" unseen_edge={edge_text(a['unseen_edge'])}"
    who = f"{a['pid']}/{a['tid']}" if not a.get("counted") else f"?/? x{a['counted']} (counted in the kernel)"
    return (f"{a['time_ns']} {a['target']} {who} {a['kind']} {a['syscall']}{denied} "
            f"{args}{edge}: {_chain(a['frames'])}")


def cmd_stats(args: argparse.Namespace, channel: Any, fmt: str, w: _Writer) -> int:
    from google.protobuf import json_format

    from ccprofd.export.gen import ccprofd_pb2 as pb

    req = pb.GetCallGraphStatsRequest(target=args.target)
    resp = _stub(channel).GetCallGraphStats(req, timeout=args.timeout)
    binaries = [{"path": b.path, "build_id": b.build_id, "stats": _ints(json_format.MessageToDict(b.stats))}
                for b in resp.binaries]
    if fmt == "json":
        w.json({"target": resp.target, "binaries": binaries})
        return EXIT_OK
    for b in binaries:
        w.line(f"{b['path']} (build-id {b['build_id'] or '-'})")
        _stats_text(b["stats"], w, "  ")
    return EXIT_OK


def cmd_context(args: argparse.Namespace, channel: Any, fmt: str, w: _Writer) -> int:
    from ccprofd.export.gen import ccprofd_pb2 as pb
    from ccprofd.export.messages import frames_from_pb

    req = pb.GetContextRequest(context=args.context, target=args.target)
    resp = _stub(channel).GetContext(req, timeout=args.timeout)
    rows = [{"target": c.target, "context": c.context, "complete": c.complete, "leaf": c.leaf,
             "frames": frames_from_pb(c.frames)} for c in resp.contexts]
    if fmt == "json":
        w.json(rows)
        return EXIT_OK
    for r in rows:
        w.line(f"context {r['context']}  target {r['target']}" + ("" if r["complete"] else "  [incomplete]"))
        _frames_text(r["frames"], w)
    return EXIT_OK


def _ints(value: Any) -> Any:
    """Struct carries every number as a double: give integral ones back as ints."""
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _stats_text(stats: dict[str, Any], w: _Writer, indent: str) -> None:
    for key, value in stats.items():
        if isinstance(value, dict):
            w.line(f"{indent}{key.replace('_', ' ')}:")
            _stats_text(value, w, indent + "  ")
        else:
            w.line(f"{indent}{key.replace('_', ' '):<28} {value}")


COMMANDS: dict[str, Callable[..., int]] = {
    "targets": cmd_targets, "contexts": cmd_contexts, "history": cmd_history, "hot": cmd_hot,
    "stream": cmd_stream, "alerts": cmd_alerts, "stats": cmd_stats, "context": cmd_context}


if __name__ == "__main__":
    raise SystemExit(main())
