"""Unwind mode's records -> frames: decode the encoded part with the plan, splice in library frames."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple

from ccprofd.callgraph.model import ROOT
from ccprofd.decode import CachingDecoder, DecodeError, UnknownCaller, decoder_for
from ccprofd.elf.debugfile import DebugFileLocator
from ccprofd.encode.plan import COL
from ccprofd.encode.segments import OUTSIDE, EncodedState, Segment
from ccprofd.persist.cache import AnalysisCache
from ccprofd.tracing.frames import SKIPPED_FRAME, Decoded, Frame, demangle, frame_json, tail_reach
from ccprofd.tracing.symbols import ModuleSource, ModuleSymbols
from ccprofd.tracing.unwind.constants import (
    UE_F_ANCHOR,
    UE_F_INNER_EXACT,
    UE_F_REC_OVF,
    UE_F_SEG_OVF,
    UE_F_UNAN_OVF,
)
from ccprofd.tracing.unwind.plan import FN_SKIP, MAX_TAIL_CHAIN, NO_NODE, UnwindEncoding
from ccprofd.tracing.unwind.sampler import EncodedRecord, UnwoundSample


# ---------------------------------------------------------------------------- symbolisation
class UnwindSymbolizer:
    """Decodes encoded records of one analysed binary into issue-4 frames (cached per context)."""

    def __init__(self, encoding: UnwindEncoding, plan: Mapping[str, Any],
                 module_of_key: Any, cache: AnalysisCache | None = None, source_lines: bool = False,
                 shown_as: str | None = None) -> None:
        """``cache``: where the symbol tables of unanalysed objects are kept (by file identity).
        ``source_lines``: give frames their DWARF file/line/inlined calls (:class:`ModuleSource`).
        ``shown_as``: the module name of the binary's frames (base.shown_path), if not its real path."""
        self.enc = encoding
        self.cache = cache
        self.plan = plan
        # Each new kernel context is decoded once (hits reuse the result, tracing/kernelcounts.py), so
        # this cache only catches a state seen under another key: small, it bounds memory in a
        # flood of distinct contexts (65,536 cached paths were ~130 MB).
        self.decoder = CachingDecoder(decoder_for(plan), max_entries=4096)
        real = os.path.realpath(str(encoding.binary["path"]))
        self.module: str = shown_as or real
        self.build_id: str | None = encoding.binary.get("build_id")
        names = [str(n) for n in plan["names"]]
        pretty = demangle(names)
        self.names = [pretty.get(n, n) for n in names]
        self.nodes = encoding.nodes
        self.module_of_key = module_of_key
        self._index = {n: i for i, n in enumerate(self.nodes)}
        self._dicts: tuple[dict[int, int], dict[int, int]] | None = None
        # Outer frames by (node, call site, return address, tail call): shared by the contexts
        # that pass through them (read-only once made), so a new context mostly reuses frames.
        self._frames: dict[tuple[int, int | None, int | None, bool], FrameJson] = {}
        self._edge_frames: dict[tuple[int, int, int], EdgeFrame] = {}  # by decoded edge (not OUTSIDE)
        self._library: dict[tuple[int, int, bool], FrameJson] = {}  # library frames by (key, vaddr, exact)
        self._inner_frames: dict[tuple[int, int, bool], FrameJson] = {}  # by (node, pc, exact)
        self._tail_exits: dict[tuple[int, str | None], tuple[FrameJson, ...]] = {}
        self._symbols: dict[str, ModuleSymbols] = {}
        self.source_lines = source_lines
        self._sources: dict[str, ModuleSource] = {}
        # debug files: the system's, and debuginfod's (when opted in) kept in this trace's cache dir
        self.locator = DebugFileLocator.from_env(cache.directory if cache is not None else None)
        self._own_source = ModuleSource(real, self.build_id, self.locator, cache)
        # (direct callee by call site, tail edges by caller, functions with other jumps): made at first use
        self._exits: ExitTables | None = None
        self.errors = 0

    def _name(self, node: int) -> str:
        i = self._index.get(node)
        if i is None:
            return f"sub_{node:x}" if node >= 0 else f"node_{node}"
        return self.names[i]

    def _frame(self, node: int) -> Frame:
        return Frame(self._name(node), self.module, self.build_id, True)

    def _lookups(self) -> tuple[dict[int, int], dict[int, int]]:
        """(call sites by return address, call lengths by site) as plain dicts, made at first use."""
        if self._dicts is None:
            self._dicts = (_plain(self.enc.callsites), _plain(self.enc.call_lengths))
        return self._dicts

    def _unanalysed(self, key: int, vaddr: int, exact: bool) -> FrameJson:
        """A library frame and its JSON, made once per (module key, vaddr, exact) and shared (a
        module key names one module for the sampler's lifetime, tables.py)."""
        got = self._library.get((key, vaddr, exact))
        if got is not None:
            return got
        mod = self.module_of_key(key)
        if mod is None:
            f = Frame(None, None, None, False, None, None if exact else vaddr)
            return f, frame_json(f)  # not kept: the key may be loaded later
        path, build_id, readable = mod
        syms = self._symbols.get(readable)
        if syms is None:
            syms = self._symbols[readable] = ModuleSymbols(readable, self.cache, self.locator, build_id)
        name = syms.name_at(vaddr if exact else vaddr - 1)
        if name is not None and name.startswith("_Z"):
            name = demangle([name]).get(name, name)
        f = Frame(name, path, build_id, False, None, None if exact else vaddr)
        if self.source_lines:
            src = self._sources.get(readable)
            if src is None:
                src = self._sources[readable] = ModuleSource(readable, build_id, self.locator, self.cache)
            f.set_source(src.at(vaddr if exact else vaddr - 1))
        if len(self._library) >= FRAME_CACHE_ENTRIES:
            self._library.clear()
        got = self._library[(key, vaddr, exact)] = (f, frame_json(f))
        return got

    def _own_lines(self, f: Frame) -> Frame:
        """``f`` (a frame of the analysed binary) with its source location: at its call (or jump)
        instruction, else at its return address - 1."""
        if self.source_lines:
            at = f.call_site if f.call_site is not None else (
                f.return_address - 1 if f.return_address else None)
            if at is not None:
                f.set_source(self._own_source.at(at))
        return f

    def state_of(self, rec: EncodedRecord) -> EncodedState:
        nodes = self.nodes
        segs = tuple(Segment(s.saved, s.rec_height, s.site, nodes[s.callee],
                             None if s.caller == NO_NODE else nodes[s.caller]) for s in rec.segments)
        return EncodedState(acyc=rec.acyc, rec=rec.rec, rec_len=rec.rec_len, segments=segs)

    def decode(self, rec: EncodedRecord | None, reason: str | None, fp: bool = False) -> Decoded:
        """``fp``: the unwind used the frame-pointer rule somewhere (no CFI there), so a frame may
        have been skipped: a call that cannot reach the next frame flags the context."""
        complete = reason is None
        if rec is None:
            return Decoded([], False, reason or "no encoded context")
        if rec.flags & (UE_F_ANCHOR | UE_F_SEG_OVF | UE_F_REC_OVF | UE_F_UNAN_OVF):
            complete = False
            reason = reason or _flag_reason(rec.flags)
        if fp and complete and rec.segments and skipped_frame(rec, self.nodes, self._exit_tables()):
            complete, reason = False, SKIPPED_FRAME
        if rec.node == NO_NODE:
            # No frame of the binary on the stack (the dynamic loader before the entry point, a
            # thread a library started): the context is the library frames themselves.
            alone = [self._unanalysed(u.module_key, u.vaddr, u.exact) for u in rec.unanalysed]
            return Decoded.with_json(list(map(_FIRST, alone)), list(map(_SECOND, alone)), complete, reason)
        node = self.nodes[rec.node]
        try:
            # No segment, no recID (most contexts): the plan's acyclic walk without an EncodedState
            path = (self.decoder.decode_acyclic(rec.acyc, node) if not rec.segments and not rec.rec_len
                    else None)
            if path is None:
                path = self.decoder.decode(self.state_of(rec), node)
        except UnknownCaller as exc:
            path = exc.partial
            if not rec.flags & UE_F_ANCHOR:
                self.errors += 1
                return Decoded([], False, "decode error: unknown caller")
        except DecodeError as exc:
            self.errors += 1
            return Decoded([], False, f"decode error: {exc}")
        nodes = self.nodes
        seg_ret = {(s.site, nodes[s.callee], nodes[s.caller]): s.ret
                   for s in rec.segments if s.caller != NO_NODE} if rec.segments else _NO_RETS
        frames, jsons, ntail = self._path_frames(path, node, seg_ret)
        if len(frames) - ntail != rec.nframes:
            self.errors += 1
            return Decoded([], False, f"decode error: {len(frames) - ntail} frames decoded, "
                                      f"{rec.nframes} unwound")
        inner_key = (path[-1][1] if path else node, rec.inner, bool(rec.flags & UE_F_INNER_EXACT))
        got = self._inner_frames.get(inner_key)
        if got is None:
            got = self._inner_frame(*inner_key)
        inner = frames[-1] = got[0]
        jsons[-1] = got[1]
        if rec.unanalysed:
            below: dict[int, list[FrameJson]] = {}
            for u in rec.unanalysed:
                below.setdefault(u.after, []).append(self._unanalysed(u.module_key, u.vaddr, u.exact))
            last = rec.nframes - 1
            library = below.get(last)
            if library and not rec.flags & UE_F_INNER_EXACT and inner.call_site is not None:
                for f, j in self._tail_exit(inner.call_site, library[0][0].function):
                    frames.append(f)
                    jsons.append(j)
            if library is not None and len(below) == 1:  # all below the innermost frame: at the end
                frames.extend(map(_FIRST, library))
                jsons.extend(map(_SECOND, library))
            else:
                # Library frames below stack frame k follow k's tail frames: a call that tail-jumped
                # into a library entered it from the last of them.
                out: list[Frame] = []
                out_json: list[dict[str, Any]] = []
                k = -1
                for f, j in zip(frames, jsons, strict=True):
                    if not f.tail_call:
                        for lf, lj in below.get(k, ()):
                            out.append(lf)
                            out_json.append(lj)
                        k += 1
                    out.append(f)
                    out_json.append(j)
                for lf, lj in below.get(k, ()):
                    out.append(lf)
                    out_json.append(lj)
                frames, jsons = out, out_json
        return Decoded.with_json(frames, jsons, complete, reason)

    def _inner_frame(self, node: int, inner: int, exact: bool) -> FrameJson:
        """The innermost frame of the binary (in function ``node``, at ``inner``: its exact pc,
        else its return address) and its JSON, made once per (node, pc, exactness) and shared by
        the contexts that end there, as outer frames are (read-only once made)."""
        f = self._frame(node)
        if exact:
            f.call_site = inner
        else:
            f.return_address = inner
            f.call_site = self._lookups()[0].get(inner)
        if len(self._inner_frames) >= FRAME_CACHE_ENTRIES:
            self._inner_frames.clear()
        got = self._inner_frames[(node, inner, exact)] = (f, frame_json(self._own_lines(f)))
        return got

    def _exit_tables(self) -> ExitTables:
        if self._exits is None:
            self._exits = _tail_exit_tables(self.enc, self.plan, self.nodes)
        return self._exits

    def _tail_exit(self, call_site: int, entered: str | None) -> tuple[FrameJson, ...]:
        """:meth:`_tail_exit_frames`, made once per (call site, library function) and shared."""
        got = self._tail_exits.get((call_site, entered))
        if got is None:
            if len(self._tail_exits) >= FRAME_CACHE_ENTRIES:
                self._tail_exits.clear()
            got = self._tail_exits[(call_site, entered)] = tuple(
                (f, frame_json(f)) for f in self._tail_exit_frames(call_site, entered))
        return got

    def _tail_exit_frames(self, call_site: int, entered: str | None) -> list[Frame]:
        """The tail-call frames between the innermost frame of the binary and the library function
        below it: its direct call reached a function of the binary that left through tail jumps
        (the last one into the PLT), so those functions are on no stack.  Instrumented mode sees
        them at their tail jumps; here they are the one chain of tail edges from the call's
        target to an import (to ``entered``, the library function below, when there are several).
        None when the chain is not known whole (no direct target, an indirect jump on the way)."""
        direct, tails, other_jumpers, _jumps = self._exit_tables()
        start = direct.get(call_site)
        if start is None:
            return []
        found: list[tuple[list[tuple[int, int]], int]] = []  # ([(function, jump site)], import)
        todo: list[tuple[int, list[tuple[int, int]]]] = [(start, [])]
        while todo:
            node, chain = todo.pop()
            if node in other_jumpers:
                return []
            for nxt, site in tails.get(node, []):
                step = [*chain, (node, site)]
                if nxt < ROOT:  # an import: the jump left the binary
                    found.append((step, nxt))
                elif len(step) < MAX_TAIL_CHAIN and all(nxt != fn for fn, _ in step):
                    todo.append((nxt, step))
        if len(found) > 1:
            found = [f for f in found if entered is not None and self._name(f[1]) == entered]
        if len(found) != 1:
            return []
        return [self._own_lines(Frame(self._name(fn), self.module, self.build_id, True, site, None, True))
                for fn, site in found[0][0]]

    def _path_frames(self, path: Sequence[tuple[int, int, int]], node: int,
                     seg_ret: Mapping[tuple[int, int, int], int]
                     ) -> tuple[list[Frame], list[dict[str, Any]], int]:
        """(frames outermost first, their JSON dicts, how many are tail-call frames); every frame but
        the innermost is shared through the cache, the innermost's place is held by a placeholder
        (decode() puts the frame, and its JSON, there: it depends on the record's pc).  A decoded
        path is a chain (each edge's caller is the previous edge's callee), so an edge's frame is
        its caller's, at its site."""
        if not path:
            return [_INNER], [_PENDING], 0
        start = 1 if path[0][0] == ROOT else 0
        edges = path[start:] if start else path
        known = self._edge_frames
        try:  # every edge seen before (a new context of known calls): lookups and copies at C speed
            got = list(map(known.__getitem__, edges))
        except KeyError:
            got = self._new_edge_frames(edges, seg_ret)
        frames = list(map(_FIRST, got))
        jsons = list(map(_SECOND, got))
        frames.append(_INNER)  # the innermost frame's place: decode() puts it there
        jsons.append(_PENDING)
        return frames, jsons, sum(map(_THIRD, got))

    def _new_edge_frames(self, edges: Sequence[tuple[int, int, int]],
                         seg_ret: Mapping[tuple[int, int, int], int]) -> list[EdgeFrame]:
        """:meth:`_path_frames` the long way, keeping each edge's frame (the edges into a segment
        from outside, whose return address is the record's own, are made each time)."""
        lengths = self._lookups()[1]
        jumps = self.enc.jump_sites
        cache = self._frames
        known = self._edge_frames
        if len(cache) >= FRAME_CACHE_ENTRIES:
            cache.clear()
        if len(known) >= FRAME_CACHE_ENTRIES:
            known.clear()
        out = []
        for e in edges:
            caller, callee, site = e
            if site == OUTSIDE:
                call_site, ret, tail = None, seg_ret.get((site, callee, caller), 0) or None, False
            elif not site:
                call_site, ret, tail = None, None, False
            elif site in jumps:
                call_site, ret, tail = site, None, True
            else:
                call_site, ret, tail = site, site + lengths.get(site, 0), False
            key = (caller, call_site, ret, tail)
            fj = cache.get(key)
            if fj is None:
                f = self._own_lines(Frame(self._name(caller), self.module, self.build_id, True, call_site,
                                          ret, tail))
                fj = cache[key] = (f, frame_json(f))
            got = (fj[0], fj[1], 1 if tail else 0)
            if site != OUTSIDE:
                known[e] = got
            out.append(got)
        return out



FRAME_CACHE_ENTRIES = 1 << 17

# A frame and its JSON dict (frames.frame_json), kept together by the caches that share frames.
FrameJson = tuple[Frame, dict[str, Any]]
# An edge's frame, its JSON, and 1 when it is a tail call's.
EdgeFrame = tuple[Frame, dict[str, Any], int]
_FIRST, _SECOND, _THIRD = itemgetter(0), itemgetter(1), itemgetter(2)
_NO_RETS: dict[tuple[int, int, int], int] = {}
_INNER = Frame(None, None, None, True)  # the innermost frame's place until decode() fills it
_PENDING: dict[str, Any] = {}  # the innermost frame's JSON slot until decode() fills it


def skipped_frame(rec: EncodedRecord, nodes: Sequence[int], exits: ExitTables) -> bool:
    """Whether a frame of the record calls, at a direct call site, a function that cannot be the
    next frame: the call's target, or a function it reaches by tail jumps alone.  Only a
    frame-pointer walk gives that (rbp was the caller's caller's: a function without a frame of
    its own was skipped).  Unknown when the way from the target leaves the call graph (an import,
    which may call back; an indirect jump): not flagged."""
    for seg in rec.segments:
        if seg.caller == NO_NODE or seg.site <= 0:
            continue  # the outermost frame, or no call site (a signal frame's caller)
        target = exits.direct.get(seg.site)
        if target is None:
            continue  # an indirect call, or one into an import
        reach = tail_reach(target, exits.jumps)
        if reach is not None and nodes[seg.callee] not in reach:
            return True
    return False


class ExitTables(NamedTuple):
    """What the plan says about how calls and jumps leave functions (:func:`_tail_exit_tables`)."""

    direct: dict[int, int]  # direct call site -> callee
    tails: dict[int, list[tuple[int, int]]]  # caller -> [(callee, jump site)]
    other_jumpers: set[int]  # functions with a jump that is no known tail edge
    jumps: dict[int, list[int | None]]  # tail_reach's table: None for an import or an unknown jump


def _tail_exit_tables(enc: UnwindEncoding, plan: Mapping[str, Any], nodes: Sequence[int]) -> ExitTables:
    """The plan's direct call sites (site -> callee), tail edges (caller -> [(callee, jump site)])
    and the functions with a jump that is no known tail edge, for the tail-exit frames; and the
    same jumps as :func:`tail_reach` takes them, for the skipped-frame check."""
    si, ci, ki, kd = COL["site"], COL["caller"], COL["callee"], COL["kind"]
    jumps = enc.jump_sites
    direct: dict[int, int] = {}
    tails: dict[int, list[tuple[int, int]]] = {}
    tail_sites: set[int] = set()
    for r in plan["sites"]:
        site, caller, callee = r[si], r[ci], r[ki]
        if not site or caller == ROOT:
            continue
        if r[kd] == "tail" or site in jumps:
            tails.setdefault(caller, []).append((callee, site))
            tail_sites.add(site)
        elif r[kd] == "direct" and callee > ROOT:
            direct[site] = callee
    # A function with a jump that is no known tail edge (an indirect jump) may leave the
    # binary by a way the call graph does not show.
    other_jumpers = set()
    for site in jumps:
        if site not in tail_sites:
            fn = enc.function_at(site)
            if fn is not None:
                other_jumpers.add(nodes[fn[0]])
    reach_jumps: dict[int, list[int | None]] = {  # an import (callee < ROOT) leaves the graph
        caller: [None if callee < ROOT else callee for callee, _site in edges]
        for caller, edges in tails.items()}
    for jumper in other_jumpers:
        reach_jumps.setdefault(jumper, []).append(None)
    return ExitTables(direct, tails, other_jumpers, reach_jumps)


def _plain(m: Mapping[int, int]) -> dict[int, int]:
    as_dict = getattr(m, "as_dict", None)
    return as_dict() if as_dict is not None else dict(m)


def _flag_reason(flags: int) -> str:
    for bit, why in ((UE_F_SEG_OVF, "segments_full"), (UE_F_REC_OVF, "recid_full"),
                     (UE_F_UNAN_OVF, "unanalysed_frames_full"), (UE_F_ANCHOR, "outer_frames_unknown")):
        if flags & bit:
            return why
    return "incomplete"



# ------------------------------------------------------------------------- reference encoder
@dataclass(frozen=True, slots=True)
class StackFrame:
    """One unwound frame as the reference encoder sees it (outermost first)."""

    module_key: int
    analysed: bool  # in the analysed binary's mapping
    vaddr: int
    exact: bool



def reference_record(enc: UnwindEncoding, plan: Mapping[str, Any], frames: Sequence[StackFrame],
                     complete_unwind: bool, *, max_segments: int = 64) -> tuple[EncodedState, int, int]:
    """(encoded state, innermost dense node or NO_NODE, analysed frames) of a stack, computed by
    driving :class:`Encoder` with the calls that built it -- the semantics the BPF pass must match.
    Anchors (outer frames unknown) are segments whose caller is None."""
    from ccprofd.encode.machine import Encoder  # --verify and tests only: not at start-up

    rows = plan["sites"]
    nodes = enc.nodes
    e = Encoder(plan)
    cur: int | None = None
    cur_v = 0
    cur_exact = False
    gap = 0
    nframes = 0
    anchored = False

    def anchor(callee: int) -> None:
        nonlocal e, nframes, anchored
        e = Encoder(plan)
        e.enter_from_outside(nodes[callee])
        anchored = True
        nframes = 0

    for f in frames:
        hit = enc.function_at(f.vaddr if f.exact else f.vaddr - 1) if f.analysed else None
        if hit is None or hit[1] & FN_SKIP:
            if cur is not None:
                gap += 1
            continue
        node = hit[0]
        if cur is None:
            if not complete_unwind:
                anchor(node)
            elif (0, node) in enc.edges:
                for sid in enc.edges[(0, node)].sites:
                    r = rows[sid]
                    e.call((r[COL["caller"]], r[COL["callee"]], r[COL["site"]]))
            else:
                e.enter_from_outside(nodes[node])
        else:
            row = enc.edges.get((cur_v, node)) if not cur_exact and gap == 0 else None
            if row is not None:
                for sid in row.sites:
                    r = rows[sid]
                    e.call((r[COL["caller"]], r[COL["callee"]], r[COL["site"]]))
            elif len(e.segments) >= max_segments:
                anchor(node)
            elif not cur_exact and cur_v in enc.callsites:
                e.unencoded_call(enc.callsites[cur_v], nodes[node])
            else:
                e.enter_from_outside(nodes[node])
        nframes += 1
        cur, cur_v, cur_exact, gap = node, f.vaddr, f.exact, 0
    st = e.state()
    if anchored and st.segments:
        first = st.segments[0]
        st = EncodedState(acyc=st.acyc, rec=st.rec, rec_len=st.rec_len,
                          segments=(Segment(first.saved, first.rec_height, first.site, first.callee, None),
                                    *st.segments[1:]))
    return st, (cur if cur is not None else NO_NODE), nframes



def stack_frames(sampler: Any, s: UnwoundSample) -> list[StackFrame] | None:
    """A sample's pcs as :class:`StackFrame` values, outermost first (None: mappings unknown)."""
    out: list[StackFrame] = []
    for pc, exact in zip(reversed(s.pcs), reversed(s.exact), strict=True):
        info = sampler.resolve(s.tgid, pc, s.time_ns)
        if info is None:
            if out:
                return None
            continue  # the outermost pc of a stack cut short at an unknown mapping
        key, analysed, vaddr = info
        out.append(StackFrame(key, analysed, vaddr, exact))
    return out

