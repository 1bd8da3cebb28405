"""Hot contexts as Brendan Gregg's folded stacks (``flamegraph.pl``, speedscope, inferno input).

One line per context: the target's name as the root frame (so contexts of several targets do not
merge in one flame graph: ``app;main;emit`` and ``db;main;emit``), then the frames outermost first,
all joined by ``;``, a space, the count.  A function the compiler inlined at a frame (the frame's
``inlined`` calls, when the frames have source lines) is a frame of its own below the one it was
inlined into, as in pprof and ``perf script``.  Syscall
profiles end each stack with the pseudo-frame ``syscall:NAME`` so the flame graph shows what the
context did.  Incomplete contexts start with ``[incomplete]`` so an unknown prefix is visible
rather than looking like a root.  ``;`` and newlines inside names are replaced (they would break
the format); spaces are kept, since readers split the count off at the last space.

Marks (``marks=True``, ``ccprofctl hot --format folded --folded-marks``): a library frame (a module
other than the analysed program) gets its module's file name in brackets as ``perf script`` prints
it (``getppid [libc.so.6]``), and flamegraph.pl-style suffixes say how a frame was reached:
``_[t]`` entered by a tail call (on no stack: the caller jumped), ``_[i]`` inlined into the frame
above it (stackcollapse-perf.pl's ``--inline`` mark, which flamegraph.pl colours).  Without marks
the stacks are plain function names, so stacks from tools without these facts merge with them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

INCOMPLETE = "[incomplete]"
TAIL_MARK, INLINE_MARK = "_[t]", "_[i]"


def _clean(name: str) -> str:
    return name.replace(";", ":").replace("\n", " ").replace("\r", " ")


def _name(frame: Mapping[str, Any]) -> str:
    name = frame.get("function") or f"[unknown {frame.get('module') or ''}]".replace(" ]", "]")
    return _clean(str(name))


def _module_mark(frame: Mapping[str, Any]) -> str:
    module = frame.get("module")
    if frame.get("analysed", True) or not module:
        return ""
    return f" [{_clean(os.path.basename(str(module)))}]"


def _frames(frame: Mapping[str, Any], marks: bool) -> list[str]:
    """The folded frames of one frame: its function, then the functions inlined into it."""
    module = _module_mark(frame) if marks else ""
    out = [_name(frame) + module + (TAIL_MARK if marks and frame.get("tail_call") else "")]
    for call in frame.get("inlined") or ():
        name = _clean(str(call.get("function") or "[unknown inlined]"))
        out.append(name + module + INLINE_MARK if marks else name)
    return out


def folded_lines(rows: Iterable[Mapping[str, Any]], *, event: str = "syscall",
                 marks: bool = False) -> list[str]:
    """Merge rows with identical folded stacks (different call sites of the same functions)."""
    merged: dict[str, int] = {}
    for row in rows:
        parts = [_clean(str(row["target"]))] if row.get("target") else []
        if not row.get("complete", True):
            parts.append(INCOMPLETE)
        for f in row.get("frames") or []:
            parts.extend(_frames(f, marks))
        if event == "syscall" and row.get("syscall"):
            parts.append(f"syscall:{row['syscall']}")
        stack = ";".join(parts) or "[empty]"
        merged[stack] = merged.get(stack, 0) + int(row.get("count", 0))
    return [f"{stack} {count}" for stack, count in sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))]


def write_folded(rows: Iterable[Mapping[str, Any]], *, event: str = "syscall", marks: bool = False) -> str:
    lines = folded_lines(rows, event=event, marks=marks)
    return "\n".join(lines) + ("\n" if lines else "")
