"""Stack-tag decoding: a backward search over graph paths, collision-prone by construction.

Because ``MIX`` is invertible in its first argument, the tag before the current function is known
exactly; the search branches only on which caller it was.  Every function sequence from a root
whose chained tag equals the query is a candidate; the search stops at ``max_depth`` functions,
after ``max_steps`` expansions, or after ``time_budget`` seconds, and says whether it was cut.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ccprofd.callgraph.model import ROOT
from ccprofd.encode.plan import COL, check_plan
from ccprofd.encode.stacktags import unmix


@dataclass(slots=True)
class TagCandidates:
    candidates: list[tuple[int, ...]] = field(default_factory=list)  # node ids, outermost first
    complete: bool = True  # False when a step or time budget cut the search
    steps: int = 0


class _Budget(Exception):
    pass


class StackTagDecoder:
    def __init__(self, plan: Mapping[str, Any]) -> None:
        check_plan(plan)
        if plan["scheme"] != "stacktags":
            raise ValueError(f"not a stack-tags plan: {plan['scheme']!r}")
        self.nodes: list[int] = list(plan["nodes"])
        self.ids: dict[int, int] = dict(zip(self.nodes, plan["tables"]["ids"], strict=True))
        preds: dict[int, set[int]] = {n: set() for n in self.nodes}
        for row in plan["sites"]:
            preds[row[COL["callee"]]].add(row[COL["caller"]])
        self.preds = {n: sorted(p) for n, p in preds.items()}

    def candidates(self, tag: int, node: int, *, max_depth: int = 32, max_steps: int = 1_000_000,
                   time_budget: float | None = None,
                   extra_edges: Iterable[tuple[int, int]] = ()) -> TagCandidates:
        """All function sequences ending at ``node`` whose tag is ``tag``.

        ``extra_edges``: (caller, callee) transitions known from elsewhere (entries from outside
        code have caller ROOT or the node they interrupted; edges discovered at run time).
        """
        result = TagCandidates()
        if node == ROOT:
            result.candidates = [()] if tag == 0 else []
            return result
        preds = self.preds
        extra: dict[int, list[int]] = {}
        for u, v in extra_edges:
            if u not in preds.get(v, ()):
                extra.setdefault(v, []).append(u)
        deadline = None if time_budget is None else time.monotonic() + time_budget
        ids = self.ids
        path: list[int] = []
        seen: set[tuple[int, ...]] = set()

        def visit(m: int, t: int) -> None:
            result.steps += 1
            if result.steps > max_steps:
                raise _Budget
            if deadline is not None and result.steps & 1023 == 0 and time.monotonic() > deadline:
                raise _Budget
            path.append(m)
            prev = unmix(t, ids[m])
            callers = preds.get(m, [])
            more = extra.get(m, [])
            if prev == 0 and (ROOT in callers or ROOT in more):
                cand = tuple(reversed(path))
                if cand not in seen:
                    seen.add(cand)
                    result.candidates.append(cand)
            if len(path) < max_depth:
                for p in (*callers, *more):
                    if p != ROOT:
                        visit(p, prev)
            path.pop()

        if node not in ids:
            return result
        limit = sys.getrecursionlimit()
        if max_depth + 50 > limit:
            sys.setrecursionlimit(max_depth + 50)
        try:
            visit(node, tag)
        except _Budget:
            result.complete = False
        return result
