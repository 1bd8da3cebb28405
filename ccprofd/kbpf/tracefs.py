"""tracefs: where it is mounted, tracepoint ids, and the fields of a tracepoint's record.

Tracepoint records differ by kernel (fields are added, moved, renamed), so programs that read one
take the offsets from the running kernel's ``events/<category>/<event>/format`` instead of
hard-coding them; this module is the one reader of those files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ccprofd.kbpf.errors import BPFError

TRACEFS_DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


def tracefs_dir() -> str | None:
    """The mounted tracefs (the one with ``events/``), or None."""
    for d in TRACEFS_DIRS:
        if os.path.isdir(os.path.join(d, "events")):
            return d
    return None


def no_tracefs_error() -> BPFError:
    """Why :func:`tracefs_dir` found none: not mounted, or (most often) mounted but readable by
    root only, which is a matter of privileges, not of mounting."""
    for d in TRACEFS_DIRS:
        if os.path.isdir(d) and not os.access(d, os.R_OK | os.X_OK):
            return BPFError(f"permission denied: {d} (tracefs) is readable by root only; tracing needs "
                            "root, or CAP_BPF and CAP_PERFMON with access to tracefs")
    return BPFError("tracefs is not mounted (mount -t tracefs tracefs /sys/kernel/tracing)")


def tracepoint_id(tp: str) -> int:
    """The perf id of tracepoint ``category:event`` (tracefs ``events/<category>/<event>/id``)."""
    category, sep, event = tp.partition(":")
    if not sep or not category or not event or "/" in tp:
        raise BPFError(f"bad tracepoint name {tp!r} (want category:event)")
    base = tracefs_dir()
    if base is None:
        raise no_tracefs_error()
    try:
        with open(os.path.join(base, "events", category, event, "id"), encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError) as exc:
        raise BPFError(f"no tracepoint {tp}: {getattr(exc, 'strerror', None) or exc}") from None


@dataclass(frozen=True, slots=True)
class TracepointField:
    """One ``field:`` line of a format file: where the field is in the record."""

    name: str
    offset: int
    size: int


def parse_format(text: str) -> dict[str, TracepointField]:
    """The fields of a tracepoint format file, by name (``*name`` and ``name[16]`` declare
    ``name``); lines that are not well-formed field lines are skipped."""
    out: dict[str, TracepointField] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.strip().split(";")]
        if not parts[0].startswith("field:"):
            continue
        decl = parts[0].removeprefix("field:").split()
        if not decl:
            continue
        name = decl[-1].lstrip("*").split("[", 1)[0]
        attrs = dict(p.split(":", 1) for p in parts[1:] if ":" in p)
        try:
            out.setdefault(name, TracepointField(name, int(attrs["offset"]), int(attrs["size"])))
        except (KeyError, ValueError):
            continue
    return out


def tracepoint_fields(category: str, event: str) -> dict[str, TracepointField]:
    """The record fields of tracepoint ``category:event`` on the running kernel."""
    base = tracefs_dir()
    if base is None:
        raise no_tracefs_error()
    path = os.path.join(base, "events", category, event, "format")
    try:
        with open(path, encoding="ascii") as fh:
            return parse_format(fh.read())
    except OSError as exc:
        raise BPFError(f"cannot read tracepoint format {path}: {exc.strerror}") from None


def tracepoint_field_offset(category: str, event: str, name: str) -> int:
    """Byte offset of field ``name`` in the record of tracepoint ``category:event``."""
    field = tracepoint_fields(category, event).get(name)
    if field is None:
        raise BPFError(f"tracepoint {category}:{event} has no field {name}")
    return field.offset


def tracepoint_has_field(category: str, event: str, name: str) -> bool:
    """Whether tracepoint ``category:event`` has field ``name`` (False when tracefs or the
    tracepoint is missing) -- kernels differ."""
    try:
        return name in tracepoint_fields(category, event)
    except BPFError:
        return False


def tracefs_syscalls() -> frozenset[str] | None:
    """Syscall names the running kernel knows (its ``syscalls:sys_enter_*`` events), or None when
    tracefs is not readable — then names are checked for syntax only."""
    for base in TRACEFS_DIRS:
        try:
            names = os.listdir(f"{base}/events/syscalls")
        except OSError:
            continue
        found = frozenset(n[len("sys_enter_"):] for n in names if n.startswith("sys_enter_"))
        if found:
            return found
    return None
