"""Raw unwound frames (:mod:`ccprofd.proc.userstack`) -> the tracer's JSON frames.

The frame contract is the one of ``ccprofd trace`` in unwind mode (ccprofd/tracing/unwind/mode.py,
``UnwindSymbolizer``), so a thread snapshot and a sample of the same stack print the same frames:

* a frame in the analysed binary, inside a function of its call graph (the function holding the
  ELF entry point excepted, as in unwind mode): ``analysed: true``, the graph's (demangled) name,
  ``return_address`` = its pc as an ELF vaddr and ``call_site`` = the call instruction before it
  (from the graph's call sites); for the innermost frame -- and a frame a signal interrupted, whose
  pc is the interrupted instruction -- ``call_site`` is that instruction and ``return_address`` null;
* any other frame: ``analysed: false``, the module as the process names it, its build-id, the name
  of the ``.symtab``/``.dynsym`` function covering the pc (``pc - 1`` for a return address),
  ``return_address`` = its pc as an ELF vaddr (null when exact), ``call_site`` null;
* the vDSO is a module named ``[vdso]`` (its image read from the process, see vdso.py);
* a pc in no file mapping (JIT code, a deleted file): all null but ``return_address``.

Frames are outermost first and, as in a sample, begin at the outermost analysed frame.  Tail calls
leave no trace on the stack, so no ``tail_call`` frame appears here; gdb shows none either.
"""

from __future__ import annotations

import itertools
import os
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ccprofd.proc.maps import ModuleMapping
from ccprofd.proc.userstack import RawFrame
from ccprofd.tracing.frames import Frame, demangle, tail_reach


@dataclass(frozen=True, slots=True)
class AnalysedBinary:
    """Function ranges, names and call sites of the analysed binary (from its call graph)."""

    path: str  # the module name frames carry (the mode's real path)
    build_id: str | None
    identity: tuple[int, int]  # (st_dev, st_ino) of the file, to recognise its mappings
    starts: tuple[int, ...]
    ranges: tuple[tuple[int, int, str], ...]  # (lo, hi, name), sorted by lo
    callsites: dict[int, int]  # return-address vaddr -> call-instruction vaddr
    # the direct calls into the binary's functions: return-address vaddr -> the callee's name
    direct_callee: dict[int, str] = field(default_factory=dict)
    # each function's jumps out of it: the functions they enter (None: an indirect jump or an import)
    tail_jumps: dict[str, tuple[str | None, ...]] = field(default_factory=dict)

    @classmethod
    def from_graph(cls, graph: object, path: str) -> AnalysedBinary:
        """From a :class:`ccprofd.callgraph.model.CallGraph` of the file at ``path``."""
        g = graph.graph  # type: ignore[attr-defined]
        binary = graph.binary  # type: ignore[attr-defined]
        entry = binary.entry
        raw: list[tuple[int, int, str]] = []
        for n in graph.functions():  # type: ignore[attr-defined]
            d = g.nodes[n]
            spans = ([(d["addr"], d["addr"] + d["size"])] if d["size"] > 0 else []) + \
                [tuple(r) for r in d.get("fragments") or []]
            if any(lo <= entry < hi for lo, hi in spans):
                continue  # _start: only calls into libc's start-up; unanalysed as in unwind mode
            raw.extend((lo, hi, str(d["name"])) for lo, hi in spans)
        pretty = demangle(name for _, _, name in raw)
        ranges = tuple(sorted((lo, hi, pretty.get(name, name)) for lo, hi, name in raw))
        sites = {s.return_address: s.address for s in graph.sites if not s.is_jump}  # type: ignore[attr-defined]
        own = {n: pretty.get(str(g.nodes[n]["name"]), str(g.nodes[n]["name"]))
               for n in graph.functions()}  # type: ignore[attr-defined]
        direct: dict[int, str] = {}
        jumps: dict[str, list[str | None]] = {}
        for s in graph.sites:  # type: ignore[attr-defined]
            if s.is_jump:
                caller = own.get(s.function)
                if caller is not None:
                    jumps.setdefault(caller, []).append(own.get(s.target) if s.target is not None else None)
            elif s.kind == "direct" and s.target in own:
                direct[s.return_address] = own[s.target]
        st = os.stat(path)
        return cls(path, binary.build_id, (st.st_dev, st.st_ino), tuple(r[0] for r in ranges), ranges, sites,
                   direct, {k: tuple(v) for k, v in jumps.items()})

    def function_at(self, vaddr: int) -> str | None:
        i = bisect_right(self.starts, vaddr) - 1
        if i >= 0:
            lo, hi, name = self.ranges[i]
            if lo <= vaddr < hi:
                return name
        return None


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class FrameDecoder:
    """Turns raw frames into JSON frames (symbols of each module read once and kept)."""

    def __init__(self, analysed: AnalysedBinary | None, build_id_of: Callable[[ModuleMapping], str | None],
                 symbols_of: Callable[[str], object]) -> None:
        self.analysed = analysed
        self.build_id_of = build_id_of
        self.symbols_of = symbols_of  # open path -> an object with name_at(vaddr) -> str | None
        self._symbols: dict[str, object] = {}
        self._is_analysed: dict[str, bool] = {}

    def _in_binary(self, m: ModuleMapping) -> bool:
        got = self._is_analysed.get(m.open_path)
        if got is None:
            got = self.analysed is not None and _identity(m.open_path) == self.analysed.identity
            self._is_analysed[m.open_path] = got
        return got

    def _name(self, m: ModuleMapping, vaddr: int) -> str | None:
        syms = self._symbols.get(m.open_path)
        if syms is None:
            syms = self._symbols[m.open_path] = self.symbols_of(m.open_path)
        name: str | None = syms.name_at(vaddr)  # type: ignore[attr-defined]
        if name is not None and name.startswith("_Z"):
            name = demangle([name]).get(name, name)
        return name

    def frame(self, f: RawFrame) -> Frame:
        m, v = f.module, f.vaddr
        if m is None or v is None:
            return Frame(None, None, None, False, None, None if f.exact else f.pc)
        lookup = v if f.exact else v - 1
        a = self.analysed
        if a is not None and self._in_binary(m):
            name = a.function_at(lookup)
            if name is not None:
                if f.exact:
                    return Frame(name, a.path, a.build_id, True, v, None)
                return Frame(name, a.path, a.build_id, True, a.callsites.get(v), v)
        return Frame(self._name(m, lookup), m.path, self.build_id_of(m), False, None, None if f.exact else v)

    def skipped_frame(self, raw: Sequence[RawFrame]) -> bool:
        """Whether a walk that used frame pointers (``fp``) skipped a frame: a frame of the binary
        whose direct call cannot reach the next frame (unwind/symbolize.py's skipped_frame check)."""
        a = self.analysed
        if a is None or not any(f.fp for f in raw):
            return False
        for caller, callee in itertools.pairwise(raw):
            if caller.exact or caller.module is None or caller.vaddr is None or callee.module is None \
                    or callee.vaddr is None or not self._in_binary(caller.module) \
                    or not self._in_binary(callee.module):
                continue
            target = a.direct_callee.get(caller.vaddr)
            name = a.function_at(callee.vaddr if callee.exact else callee.vaddr - 1)
            if target is None or name is None:
                continue
            reach = tail_reach(target, a.tail_jumps)
            if reach is not None and name not in reach:
                return True
        return False

    def frames(self, raw: Iterable[RawFrame]) -> list[Frame]:
        """JSON-able frames of a stack (outermost first), from its outermost analysed frame down, as
        the tracer reports a sample (the start-up frames above ``main`` or a thread's start routine
        -- ``_start``, ``__libc_start_main``, ``start_thread``, ``clone3`` -- are left out).  A stack
        with no analysed frame is reported whole (a sample would have no frame at all)."""
        out = [self.frame(f) for f in raw]
        first = next((i for i, f in enumerate(out) if f.analysed), 0)
        return out[first:]
