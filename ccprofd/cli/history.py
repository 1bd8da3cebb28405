"""``ccprofd history FILE``: a saved flight-recorder history (``state_dir/history/TARGET.wet``,
written by the daemon with ``persist_history_seconds``) read offline, without a daemon, in
``ccprofctl history``'s text or JSON form."""

from __future__ import annotations

import argparse
import datetime
import decimal
import json
import sys
from typing import Any

from ccprofd.cli.errors import UsageError


def add_command(sub: Any) -> None:
    h = sub.add_parser(
        "history", help="read a saved flight-recorder history file (STATE_DIR/history/TARGET.wet)",
        description="Print the syscalls a daemon saved for a target (persist_history_seconds) from its "
                    "history file, offline, in ccprofctl history's format: per process, per thread, each "
                    "syscall's time (ns since the epoch), argument words and calling context. Each thread "
                    "is walked with the file's cursor, forward (oldest first) or backward (--reverse).",
        epilog="Exit status: 0 success, 2 bad usage, a file that is not a (complete) history file, or a "
               "thread or process the file does not hold.")
    h.add_argument("file", metavar="FILE", help="history file, e.g. /var/lib/ccprofd/history/TARGET.wet")
    who = h.add_mutually_exclusive_group()
    who.add_argument("--tid", type=_id, default=0, metavar="TID", help="only this thread")
    who.add_argument("--pid", type=_id, default=0, metavar="PID", help="only this process's threads")
    h.add_argument("--last", type=_count, default=0, metavar="N",
                   help="only the N latest syscalls of each thread")
    h.add_argument("--since", type=_time, default=None, metavar="TIME",
                   help="only syscalls at or after TIME: seconds since the epoch, nanoseconds as printed "
                        "(a number above 10^15), or an ISO 8601 time (UTC unless it has an offset)")
    h.add_argument("--until", type=_time, default=None, metavar="TIME",
                   help="only syscalls at or before TIME")
    h.add_argument("--reverse", action="store_true", help="newest first (the cursor walks backward)")
    h.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    h.set_defaults(func=cmd_history)


def _id(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive thread or process id, got {text!r}")
    return value


def _count(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _time(text: str) -> int:
    """TIME as ns since the epoch (the unit of the events' times)."""
    try:
        number = decimal.Decimal(text)  # exact: a float would round nanoseconds
    except decimal.InvalidOperation:
        number = None
    if number is not None:
        if not (number.is_finite() and 0 <= number < 2**63):
            raise argparse.ArgumentTypeError(f"expected a time, got {text!r}")
        return int(number) if number > 10**15 else int(number * 10**9)
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected epoch seconds, nanoseconds or an ISO 8601 time, got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000


def cmd_history(args: argparse.Namespace) -> int:
    from ccprofd.cli.ctl import history_lines
    from ccprofd.daemon.historyfile import HistoryFileError
    from ccprofd.daemon.historyread import Selection, load, select_threads, thread_events

    if args.since is not None and args.until is not None and args.since > args.until:
        raise UsageError("--since is after --until")
    sel = Selection(last=args.last, since=args.since, until=args.until, reverse=args.reverse)
    target = _target_name(args.file)
    try:
        store = load(args.file)
        threads = select_threads(store, tid=args.tid, pid=args.pid)
        rows = [{"pid": th.pid, "tid": th.tid, "events": thread_events(store, th, sel)} for th in threads]
    except HistoryFileError as exc:
        raise UsageError(str(exc)) from None
    except LookupError as exc:
        raise UsageError(f"{args.file}: {exc}") from None
    if args.format == "json":
        print(json.dumps({"file": args.file, "target": target, "source": "persisted",
                          "order": "newest first" if args.reverse else "oldest first", "threads": rows},
                         indent=2))
        return 0
    lines: list[str] = []
    for pid in dict.fromkeys(th.pid for th in threads):
        mine = [r for r in rows if r["pid"] == pid]
        lines += history_lines(pid, f"target {target}, persisted", mine, reverse=args.reverse)
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


def _target_name(path: str) -> str:
    """The target a history file is named after (``TARGET.wet``)."""
    from pathlib import Path

    p = Path(path)
    return p.stem if p.suffix == ".wet" else p.name
