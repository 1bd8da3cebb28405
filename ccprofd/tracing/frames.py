"""The tracer's frame values (JSON-ready, outermost first) and C++ demangling, shared by both modes."""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ccprofd.elf.dwarflines import InlinedCall, SourceLocation

T = TypeVar("T")


@dataclass(slots=True)
class Frame:
    """One frame of a reported context.

    ``file``/``line``: where in the frame's function the frame is, from DWARF (the call
    instruction for an outer frame, the syscall's site for the innermost); ``inlined``: the
    functions the compiler inlined there, outermost first, each with its own file/line (the
    frame's ``file``/``line`` is then the outermost inlined call's site).  In JSON all three
    appear only when known: ``"file": str, "line": int, "inlined": [{"function", "file",
    "line"}, ...]``."""

    function: str | None
    module: str | None
    build_id: str | None
    analysed: bool
    call_site: int | None = None
    return_address: int | None = None
    tail_call: bool = False
    file: str | None = None
    line: int | None = None
    inlined: tuple[InlinedCall, ...] = ()

    def set_source(self, where: SourceLocation | None) -> None:
        """Take a DWARF location (None leaves the frame without one)."""
        if where is not None:
            self.file, self.line, self.inlined = where.file, where.line, where.inlined

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "function": self.function, "module": self.module, "build_id": self.build_id,
            "analysed": self.analysed,
            "call_site": f"{self.call_site:#x}" if self.call_site is not None else None,
            "return_address": f"{self.return_address:#x}" if self.return_address is not None else None,
        }
        if self.tail_call:
            d["tail_call"] = True
        if self.file is not None:
            d["file"] = self.file
        if self.line is not None:
            d["line"] = self.line
        if self.inlined:
            d["inlined"] = [c.to_json() for c in self.inlined]
        return d



# One JSON dict per distinct frame, shared by every context that has it (contexts share most of
# their frames), so writers can serialise a frame once; bounded, starts over when full.
_FRAME_JSON: dict[tuple[Any, ...], dict[str, Any]] = {}
FRAME_JSON_ENTRIES = 1 << 17


def frame_json(f: Frame) -> dict[str, Any]:
    """``f.to_json()``, the same (read-only) dict for equal frames."""
    key = (f.function, f.module, f.build_id, f.analysed, f.call_site, f.return_address, f.tail_call,
           f.file, f.line, f.inlined)
    got = _FRAME_JSON.get(key)
    if got is None:
        if len(_FRAME_JSON) >= FRAME_JSON_ENTRIES:
            _FRAME_JSON.clear()
        got = _FRAME_JSON[key] = f.to_json()
    return got


def demangle(names: Iterable[str]) -> dict[str, str]:
    """Demangled forms of C++ names (``_Z...``), through one batched ``c++filt`` run; names it cannot
    demangle (or every name, when c++filt is missing) map to themselves."""
    mangled = sorted({n for n in names if n.startswith("_Z")})
    out = {n: n for n in mangled}
    tool = shutil.which("c++filt")
    if not mangled or tool is None:
        return out
    import subprocess  # only with C++ names to demangle: not at every start-up

    try:
        proc = subprocess.run([tool], input="\n".join(mangled) + "\n", capture_output=True, text=True,
                              timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return out
    lines = proc.stdout.splitlines()
    if len(lines) == len(mangled):
        out.update(zip(mangled, lines, strict=True))
    return out



@dataclass(frozen=True, slots=True)
class Decoded:
    """A symbolised sample: its frames and whether they are the whole context."""

    frames: list[Frame]
    complete: bool
    reason: str | None = None  # why incomplete (for statistics), None when complete
    _json: list[dict[str, Any]] | None = field(default=None, init=False, repr=False, compare=False)

    def json_frames(self) -> list[dict[str, Any]]:
        """The frames as JSON-ready dicts, made once: every sample of this context shares the list
        (read-only), which is what lets the writers serialise a repeated context only once."""
        if self._json is None:
            object.__setattr__(self, "_json", [frame_json(f) for f in self.frames])
        assert self._json is not None
        return self._json

    @staticmethod
    def with_json(frames: list[Frame], json: list[dict[str, Any]], complete: bool,
                  reason: str | None = None) -> Decoded:
        """A Decoded whose JSON dicts the caller already has (``json[i]`` is ``frame_json(frames[i])``,
        e.g. kept beside frames it reuses), so :meth:`json_frames` need not look each one up."""
        d = Decoded(frames, complete, reason)
        object.__setattr__(d, "_json", json)
        return d


# ------------------------------------------------------------------- the skipped-frame check
#: the reason of a stack whose frame-pointer walk skipped a frame: a direct call in it cannot reach
#: the next frame (unwind/symbolize.py for samples, threadframes.py for thread snapshots)
SKIPPED_FRAME = "frame_skipped"


def tail_reach(start: T, jumps: Mapping[T, Sequence[T | None]]) -> set[T] | None:
    """``start`` and the functions it reaches by tail jumps alone (``jumps``: each function's jump
    targets); None when a jump on the way leaves what the call graph knows (a target None: an
    indirect jump, an import)."""
    reach = {start}
    todo = [start]
    while todo:
        for nxt in jumps.get(todo.pop(), ()):
            if nxt is None:
                return None
            if nxt not in reach:
                reach.add(nxt)
                todo.append(nxt)
    return reach
