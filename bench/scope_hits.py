"""Which of instrumented mode's probes fire, how often, for a ``scope`` on a real service (issue 14).

Used by bench/services.py (``instrumented-scope``): the probe plan ccprofd builds for the service's
binary with the configuration's ``scope`` (``build_probe_plan``: the same plan the daemon attaches)
is attached *without* ccprofd, one counting uprobe_multi program on every probe of the plan, the
attach cookie being the probe's index; the service's load runs; the per-probe counts say which
probes fire and how often, by the function they sit in (a call site's caller, an entry probe's
function) and by the callee of the call (a site or tail probe).  This tells whether a scope is
affordable before it is measured: every hit is a uprobe trap (a few µs) whether or not the thread is
inside the scope.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from ccprofd.callgraph import analyze_binary
from ccprofd.elf.image import ElfImage
from ccprofd.encode import get_plan
from ccprofd.kbpf.rawbpf import BPFError
from ccprofd.kbpf.rawmodule import load_module
from ccprofd.kbpf.uprobe_multi import attach_uprobe_multi
from ccprofd.tracing.instrumented.probeplan import CCOL, PCOL, build_probe_plan

COUNTER = r"""
BPF_PERCPU_ARRAY(hits, u64, %(n)d);
int count_probe(struct pt_regs *ctx) {
    u32 k = (u32)bpf_get_attach_cookie(ctx);
    u64 *v = hits.lookup(&k);
    if (v)
        (*v)++;
    return 0;
}
"""


def scope_plan(binary: str, scope: str) -> Any:
    """The probe plan instrumented mode attaches for ``scope`` (syscall sample points, Valence)."""
    graph = analyze_binary(binary)
    return build_probe_plan(graph, get_plan(graph, "valence"), ElfImage(binary), scope=scope)


def refused(fd: int, path: str, pp: Any) -> list[list[Any]]:
    """The probes the kernel refuses one by one (kind, vaddr, function, error): uprobes analyse the
    instruction when they are first installed in a process, so this needs the service running."""
    out: list[list[Any]] = []
    for i, p in enumerate(pp.probes):
        try:
            attach_uprobe_multi(fd, path, [int(p[PCOL["offset"]])], cookies=[i]).close()
        except BPFError as exc:
            node = pp.names.get(int(p[PCOL["node"]]), "?")
            out.append([str(p[PCOL["kind"]]), hex(int(p[PCOL["vaddr"]])), node, str(exc)])
    return out


def count_hits(binary: str, scope: str, load: Callable[[], Any]) -> dict[str, Any]:
    """Run ``load`` with a counter on every probe of ``scope``'s plan; the counts by probe."""
    path = os.path.realpath(binary)
    pp = scope_plan(path, scope)
    probes = pp.probes
    mod = load_module(COUNTER % {"n": max(1, len(probes))})
    try:
        fd = mod.load_func("count_probe", "kprobe", attach_type=48)  # BPF_TRACE_UPROBE_MULTI
        try:
            link = attach_uprobe_multi(fd, path, [int(p[PCOL["offset"]]) for p in probes],
                                       cookies=list(range(len(probes))), pid=None)
        except BPFError as exc:
            return {"probes": len(probes), "kinds": dict(Counter(str(p[PCOL["kind"]]) for p in probes)),
                    "error": str(exc), "refused": refused(fd, path, pp)}
        try:
            result = load()
        finally:
            link.close()
        counts = [int(mod.map("hits").get(i) or 0) for i in range(len(probes))]
    finally:
        mod.cleanup()
    names = pp.names

    def callee(p: list[Any]) -> str:
        cs = int(p[PCOL["callsite"]])
        if p[PCOL["kind"]] == "entry" or cs < 0:
            return "(entry)"
        target = pp.callsites[cs][CCOL["target"]]
        if target is None:
            imp = pp.imports.get(int(p[PCOL["vaddr"]]))
            return f"{imp}@plt" if imp else "(indirect/import)"
        return names.get(int(target), hex(int(target)))

    by_site: Counter[tuple[str, str, str]] = Counter()
    for p, c in zip(probes, counts, strict=True):
        if c:
            by_site[(str(p[PCOL["kind"]]), names.get(int(p[PCOL["node"]]), "?"), callee(p))] += c
    return {"probes": len(probes), "probes_fired": sum(1 for c in counts if c), "hits": sum(counts),
            "kinds": dict(Counter(str(p[PCOL["kind"]]) for p in probes)),
            "top": [[k, f, t, c] for (k, f, t), c in by_site.most_common(12)], "load": result}
