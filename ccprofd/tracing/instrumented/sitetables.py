"""Tables the BPF side and the seeder both derive from a probe plan: dense node indexes and the
return-site table (return address -> call site id and flags), so instrumented.c's ``cc_ret`` map and
the seeder's model of it come from one computation."""

from __future__ import annotations

from ccprofd.tracing.instrumented.constants import RS_IN_SCOPE, RS_INDIRECT, RS_VIA_PLT
from ccprofd.tracing.instrumented.probeplan import CCOL, ProbePlan


def dense_nodes(probe_plan: ProbePlan) -> dict[int, int]:
    """Node id -> the small index the BPF maps use for it."""
    return {n: i for i, n in enumerate(sorted(probe_plan.names))}


def ret_table(probe_plan: ProbePlan) -> list[tuple[int, int]]:
    """Return address vaddr -> callsite id | RS_INDIRECT | RS_VIA_PLT | RS_IN_SCOPE, for every call
    instruction."""
    scope = set(probe_plan.in_scope) if probe_plan.in_scope is not None else None
    out: list[tuple[int, int]] = []
    for i, c in enumerate(probe_plan.callsites):
        if c[CCOL["is_jump"]]:
            continue
        v = i
        if c[CCOL["kind"]] == "indirect":
            v |= RS_INDIRECT
        elif c[CCOL["kind"]] == "plt":
            v |= RS_VIA_PLT  # a PLT call can land in the binary's own exported functions
        if scope is None or c[CCOL["caller"]] in scope:
            v |= RS_IN_SCOPE
        out.append((c[CCOL["vaddr"]] + c[CCOL["length"]], v))
    return out
