"""``/debug/pprof/profile`` and ``/debug/pprof/syscalls`` on the metrics port: the samples the
daemon decodes during the next ``seconds``, as a gzipped pprof profile — what ``go tool pprof
http://HOST:PORT/debug/pprof/profile`` and the collectors that scrape pprof endpoints (Parca,
Pyroscope) fetch.

Why a live window and not the stored counts: a CPU profile is "what ran during these N seconds",
and the samples of the window carry their process, whose maps (read when its first sample
arrives) give the real runtime mappings and addresses.  The samples come from the daemon's sample
bus (:class:`~ccprofd.daemon.query.DaemonView`), as ``StreamSamples`` gets them: subscribing makes
every target send a record per sample for as long as the window lasts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from ccprofd.daemon.query import DaemonView
from ccprofd.export.pprof import ModuleRange, process_modules, write_pprof

PROFILE_PATH = "/debug/pprof/profile"
SYSCALLS_PATH = "/debug/pprof/syscalls"
PATHS = {PROFILE_PATH: "cpu", SYSCALLS_PATH: "syscall"}
DEFAULT_SECONDS = 30  # as Go's net/http/pprof
MAX_SECONDS = 600
POLL_S = 0.25
# Go's net/http/pprof answers with these; pprof clients only need the gzipped body.
HEADERS = [("Content-Type", "application/octet-stream"),
           ("Content-Disposition", 'attachment; filename="profile"')]


class BadRequest(ValueError):
    """A request the endpoint cannot answer (bad ``seconds``, unknown ``target``): one line, 400."""


@dataclass(frozen=True, slots=True)
class Request:
    event: str  # "cpu" | "syscall"
    seconds: float
    targets: tuple[str, ...]  # empty: every target


def parse_request(daemon: DaemonView, path: str, query: str) -> Request:
    """The request's event, window and targets; :class:`BadRequest` with the reason."""
    event = PATHS[path]
    args = parse_qs(query, keep_blank_values=True)
    raw = args.get("seconds", [str(DEFAULT_SECONDS)])[-1]
    try:
        seconds = float(raw)
    except ValueError:
        raise BadRequest(f"seconds={raw!r} is not a number") from None
    if not 0 < seconds <= MAX_SECONDS:  # also rejects nan
        raise BadRequest(f"seconds={raw} is out of range (0 < seconds <= {MAX_SECONDS})")
    targets = tuple(t for t in args.get("target", []) if t)
    known = set(daemon.targets)
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise BadRequest(f"no target {unknown[0]!r} (targets: {', '.join(sorted(known)) or 'none'})")
    if event == "cpu":
        selected = [daemon.targets[t] for t in targets] if targets else list(daemon.runtimes())
        if not any(rt.config.perf_sample_hz for rt in selected):
            raise BadRequest("no selected target samples CPU time (set perf_sample_hz in its [[target]])")
    return Request(event, seconds, targets)


def collect(daemon: DaemonView, req: Request,
            read_modules: Callable[[int], list[ModuleRange]] = process_modules) -> bytes:
    """Subscribe, gather the window's samples (their processes' maps on first sight), answer the
    gzipped profile.  Ends early, with what it has, when the daemon stops."""
    wanted = set(req.targets)

    def accept(item: dict[str, Any]) -> bool:
        return item.get("event") == req.event and (not wanted or item.get("target") in wanted)

    counts: dict[tuple[Any, ...], list[Any]] = {}
    modules: dict[int, list[ModuleRange]] = {}
    start_ns = time.time_ns()
    deadline = time.monotonic() + req.seconds

    def take(item: dict[str, Any]) -> None:
        pid = int(item.get("pid") or 0)
        if pid and pid not in modules:
            try:
                modules[pid] = read_modules(pid)
            except OSError:
                modules[pid] = []  # gone already: its frames keep their ELF addresses
        key = _row_key(item)
        slot = counts.get(key)
        if slot is None:
            counts[key] = [item, 1]
        else:
            slot[1] += 1

    with daemon.samples.subscribe(accept) as sub:
        while not daemon.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            item = sub.get(min(POLL_S, left))
            if item is not None:
                take(item)
        while (item := sub.get(0)) is not None:  # what the window published and is still queued
            take(item)
        lost = sub.dropped
    duration = time.time_ns() - start_ns
    rows = [dict(item, count=n) for item, n in counts.values()]
    comments = [f"ccprofd: {lost} samples of the window lost (the subscriber queue was full)"] if lost else []
    return write_pprof(rows, event=req.event, period_ns=_period_ns(daemon, req), time_ns=start_ns,
                       duration_ns=duration, modules=modules, comments=comments)


def _row_key(item: dict[str, Any]) -> tuple[Any, ...]:
    frames = tuple(tuple(sorted((k, v) for k, v in f.items() if not isinstance(v, list | dict)))
                   for f in item.get("frames") or ())
    return (item.get("target"), item.get("pid"), item.get("syscall"), item.get("context"),
            bool(item.get("complete", True)), frames)


def _period_ns(daemon: DaemonView, req: Request) -> int:
    """The CPU sampling period when every selected target samples at one rate (0 otherwise)."""
    if req.event != "cpu":
        return 0
    selected = [daemon.targets[t] for t in req.targets] if req.targets else list(daemon.runtimes())
    rates = {rt.config.perf_sample_hz for rt in selected if rt.config.perf_sample_hz}
    return 1_000_000_000 // rates.pop() if len(rates) == 1 else 0


def serve(daemon: DaemonView, environ: dict[str, Any],
          start_response: Callable[..., Any]) -> Iterable[bytes]:
    """The WSGI answer for one of :data:`PATHS`."""
    text = [("Content-Type", "text/plain; charset=utf-8")]
    if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
        start_response("405 Method Not Allowed", [*text, ("Allow", "GET, HEAD")])
        return [b"only GET\n"]
    try:
        req = parse_request(daemon, environ.get("PATH_INFO") or "", environ.get("QUERY_STRING") or "")
    except BadRequest as exc:
        start_response("400 Bad Request", text)
        return [f"{exc}\n".encode()]
    body = collect(daemon, req)
    start_response("200 OK", [*HEADERS, ("Content-Length", str(len(body)))])
    return [body]
