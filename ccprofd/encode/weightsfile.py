"""Edge-weights files: the call counts of a profiling run (``ccprofd trace --save-edge-weights``),
read back by ``--edge-weights`` so that the plan gives hot edges the all-zero code (no probe).

Format (JSON, version 1)::

    {"format": "ccprofd-edge-weights", "version": 1,
     "binary": {"path": "/abs/path", "build_id": "…" | null, "content_hash": "…"},
     "edges": [{"caller": 4198742, "callee": 4198400, "site": "0x401a2b", "count": 1234,
                "caller_name": "main", "callee_name": "fib"}, …]}

``caller``/``callee`` are call-graph node ids (entry vaddrs of internal functions, negative ids for
imports) and ``site`` the call instruction's vaddr: together the edge key the encoder uses.  The names
are for people only.  A file is accepted only for the binary whose content hash it names (a rebuilt
binary's node ids and sites mean other things).  Written atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ccprofd.persist.atomicfile import atomic_write_bytes

FORMAT = "ccprofd-edge-weights"
VERSION = 1

EdgeKey = tuple[int, int, int]


class WeightsFileError(ValueError):
    """An unusable weights file (one line, for the CLI)."""


def save_weights(path: str | os.PathLike[str], binary: Mapping[str, Any], counts: Mapping[EdgeKey, int],
                 names: Mapping[int, str] | None = None) -> None:
    names = names or {}
    edges = [{"caller": u, "callee": v, "site": f"{k:#x}", "count": int(n),
              "caller_name": names.get(u), "callee_name": names.get(v)}
             for (u, v, k), n in sorted(counts.items(), key=lambda e: (e[0][2], e[0][0], e[0][1])) if n]
    doc = {"format": FORMAT, "version": VERSION,
           "binary": {"path": binary.get("path"), "build_id": binary.get("build_id"),
                      "content_hash": binary.get("content_hash")},
           "edges": edges}
    atomic_write_bytes(path, (json.dumps(doc, indent=1) + "\n").encode())


def load_weights(path: str | os.PathLike[str], content_hash: str) -> dict[EdgeKey, int]:
    """The edge counts in ``path``; WeightsFileError when it is unreadable, malformed or of another
    binary than the one with ``content_hash``."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise WeightsFileError(f"cannot read edge weights {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise WeightsFileError(f"{path}: not an edge-weights file (invalid JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise WeightsFileError(f"{path}: not an edge-weights file (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise WeightsFileError(f"{path}: edge-weights version {doc.get('version')!r}, this ccprofd reads "
                               f"version {VERSION}")
    binary = doc.get("binary")
    theirs = binary.get("content_hash") if isinstance(binary, dict) else None
    if theirs != content_hash:
        who = binary.get("path") if isinstance(binary, dict) else None
        raise WeightsFileError(f"{path}: edge weights of another binary ({who or '?'}, content hash "
                               f"{str(theirs)[:12]}…), not of this one ({content_hash[:12]}…)")
    out: dict[EdgeKey, int] = {}
    edges = doc.get("edges")
    if not isinstance(edges, list):
        raise WeightsFileError(f"{path}: \"edges\" is not a list")
    for i, e in enumerate(edges):
        try:
            key = (int(e["caller"]), int(e["callee"]), int(str(e["site"]), 0))
            n = int(e["count"])
        except (KeyError, TypeError, ValueError):
            raise WeightsFileError(f"{path}: edge {i} is malformed (needs caller, callee, site, count)") \
                from None
        if n < 0:
            raise WeightsFileError(f"{path}: edge {i} has a negative count")
        out[key] = out.get(key, 0) + n
    return out


__all__ = ["FORMAT", "VERSION", "WeightsFileError", "load_weights", "save_weights"]
