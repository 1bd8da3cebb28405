"""Hot contexts as Brendan Gregg's folded stacks (``flamegraph.pl``, speedscope, inferno input).

One line per context: the target's name as the root frame (so contexts of several targets do not
merge in one flame graph: ``app;main;emit`` and ``db;main;emit``), then the frames outermost first,
all joined by ``;``, a space, the count.  Syscall
profiles end each stack with the pseudo-frame ``syscall:NAME`` so the flame graph shows what the
context did.  Incomplete contexts start with ``[incomplete]`` so an unknown prefix is visible
rather than looking like a root.  ``;`` and newlines inside names are replaced (they would break
the format); spaces are kept, since readers split the count off at the last space.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

INCOMPLETE = "[incomplete]"


def _clean(name: str) -> str:
    return name.replace(";", ":").replace("\n", " ").replace("\r", " ")


def _name(frame: Mapping[str, Any]) -> str:
    name = frame.get("function") or f"[unknown {frame.get('module') or ''}]".replace(" ]", "]")
    return _clean(str(name))


def folded_lines(rows: Iterable[Mapping[str, Any]], *, event: str = "syscall") -> list[str]:
    """Merge rows with identical folded stacks (different call sites of the same functions)."""
    merged: dict[str, int] = {}
    for row in rows:
        parts = [_clean(str(row["target"]))] if row.get("target") else []
        if not row.get("complete", True):
            parts.append(INCOMPLETE)
        parts.extend(_name(f) for f in row.get("frames") or [])
        if event == "syscall" and row.get("syscall"):
            parts.append(f"syscall:{row['syscall']}")
        stack = ";".join(parts) or "[empty]"
        merged[stack] = merged.get(stack, 0) + int(row.get("count", 0))
    return [f"{stack} {count}" for stack, count in sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))]


def write_folded(rows: Iterable[Mapping[str, Any]], *, event: str = "syscall") -> str:
    lines = folded_lines(rows, event=event)
    return "\n".join(lines) + ("\n" if lines else "")
