"""Dynamic encoding lengths (Figures 4-5) and userspace decode cost (Figure 7b) from real traces.

Each sample ccprofd reported (frames of the traced binary, outermost first, exactly as ``ccprofd
trace`` writes them) names one call path of the real run.  :class:`PathRebuilder` turns the frames
back into the encoder operations that path consists of -- ``call`` along a call-graph edge (found
by the caller frame's ``call_site``), a segment for an entry from code ccprofd did not analyse
(``enter_from_outside``) or through a call the graph has no edge for (``unencoded_call``) -- and
:class:`Reencoder` replays them through :class:`ccprofd.encode.Encoder` (the probes' reference
semantics) under each scheme's plan, incrementally (only the part of the path that changed since the
previous sample).  The length of a state is ``EncodedState.context_words()`` (the convention every
report uses); the plain context length is one word per frame (per call edge of the path).

So the lengths are those each scheme would have had at the very samples of the real run; only the
Valence state was maintained live (by the BPF probes), and that state is checked: the re-encoded
Valence state must decode (``decoder_for(plan)``) back to the same path (``roundtrip_failures``).
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.decode import DecodeError, decoder_for
from ccprofd.encode import EncodedState, Encoder, EncodingOverflow, build_plan
from ccprofd.tracing.frames import demangle

SCHEMES = ("pcce", "valence", "hcce")
_SUB = re.compile(r"^sub_([0-9a-f]+)$")

# An encoder operation: ("call", caller, callee, site) | ("outside", callee) | ("unencoded", site, callee)
Op = tuple[Any, ...]


def plans_for(graph: CallGraph, weights: Mapping[tuple[int, int, int], int] | None = None) -> dict[str, Any]:
    """One plan per scheme; PCCE/HCCE ids get as many words as they need (an overflowing id would
    be reported, not wrapped, by the encoder: the paper lets gcc overflow, here it is widened)."""
    plans: dict[str, Any] = {}
    for s in SCHEMES:
        plan = build_plan(graph, s, weights=weights)
        need = int(plan["report"].get("words_needed") or 1)
        if s in ("pcce", "hcce") and plan["report"].get("overflow"):
            plan = build_plan(graph, s, pcce_words=need, weights=weights)
        plans[s] = plan
    return plans


class PathRebuilder:
    """Frames of one binary (outermost first) -> encoder operations."""

    def __init__(self, graph: CallGraph) -> None:
        g = graph.graph
        self.path = os.path.realpath(graph.binary.path)
        self.by_site: dict[int, dict[int, int]] = {}  # site -> {callee: caller}
        self.roots: set[int] = set()
        for u, v, k in g.edges(keys=True):
            if u == ROOT:
                self.roots.add(v)
            else:
                self.by_site.setdefault(k, {})[v] = u
        names: dict[str, list[int]] = {}
        functions = [n for n, kind in g.nodes(data="kind") if kind == "function"]
        pretty = demangle(str(g.nodes[n]["name"]) for n in functions)
        for n in functions:
            raw = str(g.nodes[n]["name"])
            for name in {raw, pretty.get(raw, raw), *g.nodes[n].get("aliases", [])}:
                names.setdefault(name, []).append(n)
        self.names = names
        self.functions = set(functions)

    def node_of(self, name: str | None) -> int | None:
        if name is None:
            return None
        found = self.names.get(name)
        if found and len(found) == 1:
            return found[0]
        m = _SUB.match(name)
        if m and int(m.group(1), 16) in self.functions:
            return int(m.group(1), 16)
        return None

    def ops(self, frames: Sequence[Mapping[str, Any]]) -> list[Op] | None:
        """The operations of the path the frames show; None when a step cannot be identified."""
        ops: list[Op] = []
        prev: int | None = None  # node of the previous analysed frame
        prev_site: int | None = None  # its call_site
        gap = False  # unanalysed frames since the previous analysed one
        for f in frames:
            if not f.get("analysed"):
                if prev is not None or ops:
                    gap = True
                continue
            callee: int | None = None
            if prev is None:
                callee = self.node_of(f.get("function"))
                if callee is None:
                    return None
                ops.append(("call", ROOT, callee, 0) if callee in self.roots else ("outside", callee))
            elif prev_site is None:
                callee = self.node_of(f.get("function"))
                if callee is None:
                    return None
                ops.append(("outside", callee))
            else:
                cands = self.by_site.get(prev_site, {})
                callee = self.node_of(f.get("function"))
                if not gap and callee is None and len(cands) == 1:
                    callee = next(iter(cands))
                if callee is None:
                    return None
                if not gap and cands.get(callee) == prev:
                    ops.append(("call", prev, callee, prev_site))
                else:
                    ops.append(("unencoded", prev_site, callee))
            prev = callee
            cs = f.get("call_site")
            prev_site = int(cs, 16) if isinstance(cs, str) else None
            gap = False
        return ops


class Reencoder:
    """One Encoder per scheme, moved from path to path by unwinding to the common prefix."""

    def __init__(self, plans: Mapping[str, Any]) -> None:
        self.plans = dict(plans)
        self.encoders = {s: Encoder(p) for s, p in self.plans.items()}
        self.applied: list[Op] = []

    def move_to(self, ops: Sequence[Op]) -> None:
        k = 0
        limit = min(len(ops), len(self.applied))
        while k < limit and ops[k] == self.applied[k]:
            k += 1
        drop = len(self.applied) - k
        for enc in self.encoders.values():
            if drop:
                enc.unwind(drop)
            for op in ops[k:]:
                if op[0] == "call":
                    enc.call((op[1], op[2], op[3]))
                elif op[0] == "outside":
                    enc.enter_from_outside(op[1])
                else:
                    enc.unencoded_call(op[1], op[2])
        self.applied = list(ops)

    def reset(self) -> None:
        if self.applied:
            for enc in self.encoders.values():
                enc.unwind(len(self.applied))
            self.applied = []

    def states(self) -> dict[str, EncodedState]:
        return {s: e.state() for s, e in self.encoders.items()}


@dataclass
class Lengths:
    """Per event kind ("syscall", "cpu"): histograms of words per scheme and of the plain length."""

    hist: dict[str, dict[str, Counter[int]]] = field(default_factory=dict)
    samples: int = 0
    used: int = 0
    incomplete: int = 0
    empty: int = 0
    unrebuilt: int = 0
    overflow: int = 0
    roundtrip_checked: int = 0
    roundtrip_failures: int = 0
    # distinct (scheme, state, node) contexts kept for decode timing: scheme -> [(words, state, node)]
    contexts: dict[str, dict[tuple[EncodedState, int], int]] = field(default_factory=dict)

    def add(self, event: str, key: str, words: int) -> None:
        self.hist.setdefault(event, {}).setdefault(key, Counter())[words] += 1

    def average(self, event: str, key: str) -> float | None:
        c = self.hist.get(event, {}).get(key)
        if not c:
            return None
        n = sum(c.values())
        return sum(k * v for k, v in c.items()) / n

    def maximum(self, event: str, key: str) -> int | None:
        c = self.hist.get(event, {}).get(key)
        return max(c) if c else None

    def to_json(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "used": self.used,
            "incomplete": self.incomplete,
            "empty": self.empty,
            "unrebuilt": self.unrebuilt,
            "overflow": self.overflow,
            "roundtrip_checked": self.roundtrip_checked,
            "roundtrip_failures": self.roundtrip_failures,
            "hist": {
                ev: {k: {str(w): n for w, n in sorted(c.items())} for k, c in d.items()}
                for ev, d in self.hist.items()
            },
        }


def encoding_lengths(
    samples: Iterable[Mapping[str, Any]],
    graph: CallGraph,
    plans: Mapping[str, Any],
    *,
    keep_contexts: int = 4000,
) -> Lengths:
    """Histogram the encoding length of every complete sample under each scheme (see module doc)."""
    rb = PathRebuilder(graph)
    rec = Reencoder(plans)
    valence = decoder_for(plans["valence"])
    out = Lengths(contexts={s: {} for s in plans})
    checked: set[tuple[EncodedState, int]] = set()
    by_thread: dict[int, list[Mapping[str, Any]]] = {}
    for s in samples:
        by_thread.setdefault(int(s.get("tid", 0)), []).append(s)
    for lst in by_thread.values():
        rec.reset()
        for s in lst:
            out.samples += 1
            if not s.get("complete", True):
                out.incomplete += 1
                continue
            mine = [
                f for f in s.get("frames", []) if _same(f.get("module"), rb.path) or not f.get("analysed")
            ]
            if not any(f.get("analysed") for f in mine):
                out.empty += 1
                continue
            ops = rb.ops(mine)
            if not ops:
                out.unrebuilt += 1
                continue
            try:
                rec.move_to(ops)
            except EncodingOverflow:
                out.overflow += 1
                rec.reset()
                continue
            except (KeyError, ValueError):
                out.unrebuilt += 1
                rec.reset()
                continue
            out.used += 1
            event = str(s.get("event", "syscall"))
            node = ops[-1][2] if ops[-1][0] == "call" else ops[-1][-1]
            states = rec.states()
            for scheme, st in states.items():
                words = st.context_words()
                out.add(event, scheme, words)
                ctx = out.contexts[scheme]
                if len(ctx) < keep_contexts:
                    ctx.setdefault((st, node), words)
            out.add(event, "plain", len(ops))
            out.add(event, "segments", sum(1 for op in ops if op[0] != "call"))
            key = (states["valence"], node)
            if key not in checked:
                checked.add(key)
                out.roundtrip_checked += 1
                try:
                    path = valence.decode(states["valence"], node)
                except DecodeError:
                    path = None
                if path is None or [tuple(e) for e in path] != _edges(ops):
                    out.roundtrip_failures += 1
    return out


def _edges(ops: Sequence[Op]) -> list[tuple[int, int, int]]:
    """The path a decoder returns for these operations: call edges as they are; a segment is the
    edge (caller, callee, site) with site OUTSIDE (-1) for an entry from outside code."""
    out: list[tuple[int, int, int]] = []
    prev = ROOT
    for op in ops:
        if op[0] == "call":
            out.append((op[1], op[2], op[3]))
            prev = op[2]
        elif op[0] == "outside":
            out.append((prev, op[1], -1))
            prev = op[1]
        else:
            out.append((prev, op[2], op[1]))
            prev = op[2]
    return out


def decode_cost(
    plans: Mapping[str, Any],
    contexts: Mapping[str, Mapping[tuple[EncodedState, int], int]],
    *,
    per_scheme: int = 200,
    repeat: int = 3,
) -> dict[str, list[tuple[int, float]]]:
    """Userspace decode time: (context words, best-of-``repeat`` ns per decode) for up to
    ``per_scheme`` distinct contexts per scheme spread over the lengths seen, with a fresh
    (non-caching) decoder."""
    out: dict[str, list[tuple[int, float]]] = {}
    for scheme, ctx in contexts.items():
        dec = decoder_for(plans[scheme])
        items = sorted(ctx.items(), key=lambda kv: kv[1])
        if len(items) > per_scheme:
            step = len(items) / per_scheme
            items = [items[int(i * step)] for i in range(per_scheme)]
        rows: list[tuple[int, float]] = []
        for (state, node), words in items:
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter_ns()
                try:
                    dec.decode(state, node)
                except DecodeError:
                    best = float("nan")
                    break
                best = min(best, time.perf_counter_ns() - t0)
            rows.append((words, best))
        out[scheme] = rows
    return out


def _same(module: Any, path: str) -> bool:
    return isinstance(module, str) and (module == path or os.path.realpath(module) == path)
