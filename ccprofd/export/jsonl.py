"""``ccprofd trace`` output: one JSON object per sample (``--format jsonl``) or ``strace -k``-like text.

Both take the sample dicts of the issue-4 format (``time_ns, pid, tid, event, syscall, complete,
frames``; frames outermost first) and write to a text stream, flushing per sample so a reader of
the file (or a pipe) sees samples as they happen.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import IO, Any

FORMATS = ("text", "jsonl")


def write_jsonl(out: IO[str], sample: Mapping[str, Any]) -> None:
    out.write(json.dumps(sample, separators=(",", ":")) + "\n")
    out.flush()


def format_text(sample: Mapping[str, Any]) -> str:
    """``[pid P tid T] syscall`` (plus ``<incomplete>``), then the frames innermost first as strace -k
    prints them: `` > module(function) call_site=... return_address=...``."""
    if sample.get("event") == "lost":
        return f"--- {sample['samples']} samples lost ({sample['reason']}) ---\n"
    what = sample.get("syscall") if sample.get("event") == "syscall" else sample.get("event")
    head = f"[pid {sample['pid']} tid {sample['tid']}] {what}"
    if not sample.get("complete", True):
        head += " <incomplete>"
    lines = [head]
    for f in reversed(sample.get("frames") or []):
        name = f.get("function") or "?"
        parts = [f" > {f.get('module') or '?'}({name})"]
        if f.get("call_site"):
            parts.append(f"call_site={f['call_site']}")
        if f.get("return_address"):
            parts.append(f"return_address={f['return_address']}")
        if f.get("tail_call"):
            parts.append("[tail call]")
        if not f.get("analysed", True):
            parts.append("[not analysed]")
        lines.append(" ".join(parts))
    return "\n".join(lines) + "\n"


def write_text(out: IO[str], sample: Mapping[str, Any]) -> None:
    out.write(format_text(sample))
    out.flush()
