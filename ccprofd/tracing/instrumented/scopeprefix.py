"""--scope: the frames above a scope function, from one unwind of the stack copied at its entry.

Why: with ``--scope`` only the call graph below the scope functions carries probes, so the encoded
context of a sample inside the scope starts at a segment with no known caller (``complete: false``).
The scope's entry probe (rare by design) copies the registers and the stack pages above ``sp``
into a :class:`ccprofd.tracing.instrumented.loader.ScopeEntry`; here that copy is unwound with the BPF
unwinder's CFI rules (:mod:`ccprofd.proc.userstack`, a word reader over the copy), and a sample
whose outermost segment is that entry (joined by thread and the entry's per-thread sequence number,
the latest entry with that key before the sample) gets the prefix frames prepended.  Exact or
flagged: the join is made only when the outermost segment is the sample's only unknown, and the
prefix walk reached the thread's outermost frame within the copy; otherwise the sample is left as
the decoder reported it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ccprofd.proc.maps import ModuleMapping, ProcessMaps
from ccprofd.proc.userstack import UnwoundStack, UserRegs, unwind
from ccprofd.tracing.frames import Decoded, Frame
from ccprofd.tracing.instrumented.probeplan import CCOL, PCOL, R_SCOPE, FunctionIndex, ProbePlan

NONE32 = 0xFFFFFFFF
SEGMENT_UNKNOWN = "caller of a segment unknown"

MapsOf = Callable[[int], "ProcessMaps | None"]
TableOf = Callable[[ModuleMapping], Any]


@dataclass(frozen=True, slots=True)
class Prefix:
    time_ns: int
    frames: list[Frame]  # outermost first, ending with the scope function's caller
    reason: str | None  # why the walk is not whole (None: complete)


class ScopePrefixes:
    """Prefixes of scope entries per (tid, seq), joined to samples (see the module docstring)."""

    def __init__(self, probe_plan: ProbePlan, names: dict[int, str], maps_of: MapsOf, table_of: TableOf,
                 start_stack_of: Callable[[int], int], entry_vaddr: int | None,
                 on_close: Callable[[], None] | None = None, module: str | None = None) -> None:
        self.pp = probe_plan
        self.module = module or probe_plan.binary["path"]  # the binary's frames' module name
        self._on_close = on_close  # releases what maps_of/table_of hold (live_prefixes' module cache)
        self.names = names
        self.maps_of = maps_of
        self.table_of = table_of
        self.start_stack_of = start_stack_of
        self.scope_probes = {i for i, p in enumerate(probe_plan.probes)
                             if p[PCOL["kind"]] == "entry" and p[PCOL["reasons"]] & R_SCOPE}
        self._functions = FunctionIndex(probe_plan.functions)
        self._call_at_ret = {c[CCOL["vaddr"]] + c[CCOL["length"]]: c[CCOL["vaddr"]]
                             for c in probe_plan.callsites if not c[CCOL["is_jump"]]}
        self._entry_fn = self.function_at(entry_vaddr) if entry_vaddr is not None else None
        self._prefixes: dict[tuple[int, int], list[Prefix]] = {}
        st = os.stat(probe_plan.binary["path"])
        self._identity = (st.st_dev, st.st_ino)
        self._is_binary: dict[str, bool] = {}
        self.stats = {"entries": 0, "complete_prefixes": 0, "joined": 0, "not_joined": 0}
        self.reasons: dict[str, int] = {}

    def function_at(self, vaddr: int) -> int | None:
        return self._functions.at(vaddr)

    def _in_binary(self, m: ModuleMapping | None) -> bool:
        if m is None:
            return False
        got = self._is_binary.get(m.open_path)
        if got is None:
            try:
                st = os.stat(m.open_path)
                got = (st.st_dev, st.st_ino) == self._identity
            except OSError:
                got = False
            self._is_binary[m.open_path] = got
        return got

    # ------------------------------------------------------------------------------- entries
    def add(self, entry: Any) -> None:
        """A :class:`ccprofd.tracing.instrumented.loader.ScopeEntry`: unwind its copy, keep the prefix."""
        self.stats["entries"] += 1
        stack, why = self._unwind(entry)
        frames: list[Frame] = []
        if stack is not None:
            frames = self._frames(stack)
            why = stack.reason
        if why is None:
            self.stats["complete_prefixes"] += 1
        else:
            self.reasons[why] = self.reasons.get(why, 0) + 1
        lst = self._prefixes.setdefault((entry.tid, entry.seq), [])
        lst.append(Prefix(entry.time_ns, frames, why))
        del lst[:-4]  # the same key again is a newer entry (a recycled slot): keep the latest few

    def _unwind(self, entry: Any) -> tuple[UnwoundStack | None, str | None]:
        maps = self.maps_of(entry.pid)
        if maps is None:
            return None, "process maps unreadable"
        base, data = entry.base, entry.stack

        def word(addr: int) -> int | None:
            off = addr - base
            if off < 0 or off + 8 > len(data):
                return None  # outside the copy: the walk stops there (flagged)
            return int.from_bytes(data[off:off + 8], "little")

        start = self.start_stack_of(entry.pid) if entry.tid == entry.pid else 0
        stack = unwind(UserRegs(entry.ip, entry.sp, entry.bp), word, maps, self.table_of, start_stack=start)
        if stack.reason == "read_fault":
            return stack, f"stack copy of {len(data)} bytes too small"
        return stack, stack.reason

    def _frames(self, stack: UnwoundStack) -> list[Frame]:
        """The binary's frames above the scope function (outermost first), as the tracer prints a
        path: start-up frames above the first analysed one dropped, a run of other code between
        two of the binary's frames shown as one outside frame."""
        raw = list(stack.frames[:-1])  # the last one is the scope function itself, at its entry
        out: list[Frame] = []
        outside = False
        module = self.module
        build_id = self.pp.binary.get("build_id")
        for f in raw:
            node = None
            if self._in_binary(f.module) and f.vaddr is not None:
                node = self.function_at(f.vaddr if f.exact else f.vaddr - 1)
            if node is None or node == self._entry_fn:
                outside = outside or bool(out)
                continue
            if outside:
                out.append(Frame(None, None, None, False))
                outside = False
            call = None if f.exact or f.vaddr is None else self._call_at_ret.get(f.vaddr)
            out.append(Frame(self.names.get(node, f"node_{node}"), module, build_id, True, call,
                             None if f.exact else f.vaddr))
        if outside:
            out.append(Frame(None, None, None, False))
        return out

    # ------------------------------------------------------------------------------- samples
    def join(self, ev: Any, decoded: Decoded) -> Decoded:
        """``decoded`` with the prefix of its scope entry prepended, when that makes it whole."""
        from ccprofd.tracing.instrumented.loader import INCOMPLETE_FLAGS

        segs = ev.segments
        if decoded.complete or decoded.reason != SEGMENT_UNKNOWN or not segs or ev.flags & INCOMPLETE_FLAGS:
            return decoded
        top = segs[0]
        if top.probe not in self.scope_probes or top.aux != NONE32 or top.seq == 0:
            return decoded
        if any(g.aux == NONE32 for g in segs[1:]):
            return decoded  # another segment's caller is unknown too
        node = self.pp.probes[top.probe][PCOL["node"]]
        if not decoded.frames or decoded.frames[0].function != self.names.get(node):
            return decoded
        cands = [p for p in self._prefixes.get((ev.tid, top.seq), []) if p.time_ns <= ev.time_ns]
        if not cands or cands[-1].reason is not None:
            self.stats["not_joined"] += 1
            return decoded
        self.stats["joined"] += 1
        return Decoded(list(cands[-1].frames) + list(decoded.frames), True, None)

    def forget(self, tid: int) -> None:
        for key in [k for k in self._prefixes if k[0] == tid]:
            del self._prefixes[key]

    def summary(self) -> dict[str, Any]:
        return {**self.stats, "incomplete_prefix_reasons": dict(self.reasons)}

    def close(self) -> None:
        """At the tracer's close: no entry is walked after it."""
        if self._on_close is not None:
            self._on_close()


def live_prefixes(probe_plan: ProbePlan, names: dict[int, str],
                  cache_dir: str | None = None, module: str | None = None) -> ScopePrefixes:
    """A :class:`ScopePrefixes` reading the traced processes' maps and module tables from ``/proc``
    (the objects' CFI tables as thread snapshots load them)."""
    from pathlib import Path

    from ccprofd.elf.image import ElfImage
    from ccprofd.persist.cache import AnalysisCache
    from ccprofd.proc.maps import DEFAULT_PROC_ROOT, module_mappings, start_stack
    from ccprofd.proc.modules import ModuleCache

    modules = ModuleCache(AnalysisCache(Path(cache_dir)) if cache_dir else None)
    maps: dict[int, ProcessMaps | None] = {}

    def maps_of(pid: int) -> ProcessMaps | None:
        # Kept once they hold a module (an exited process has none: its entries stay flagged).
        if maps.get(pid) is None:
            try:
                got = module_mappings(pid, modules.addrspace_of)
                maps[pid] = modules.with_vdso(got, DEFAULT_PROC_ROOT) if got.mappings else None
            except OSError:
                maps[pid] = None
        return maps[pid]

    starts: dict[int, int] = {}

    def start_stack_of(pid: int) -> int:
        if pid not in starts:
            starts[pid] = start_stack(pid, DEFAULT_PROC_ROOT)
        return starts[pid]

    entry = ElfImage(probe_plan.binary["path"]).entry
    return ScopePrefixes(probe_plan, names, maps_of, modules.table_of, start_stack_of, entry,
                         on_close=modules.close, module=module)
