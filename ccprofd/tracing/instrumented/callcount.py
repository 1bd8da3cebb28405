"""Per-call-site hit counts of a traced run (``--save-edge-weights``): every direct call and tail
jump of the binary with a known callee carries a counting uprobe (uprobe_multi; cookie = site index),
so the counts are the edge call counts whatever the plan probes.  Indirect calls have no static
callee and are not counted (their edges keep the encoder's default weight)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ccprofd.elf.addrspace import AddressSpace
from ccprofd.kbpf.objcache import cache_dir_under
from ccprofd.kbpf.rawmodule import load_module
from ccprofd.kbpf.uprobe_multi import UprobeMultiLink, attach_uprobe_multi

C_SOURCE = "callcount.c"

EdgeKey = tuple[int, int, int]


def counted_sites(sites: Sequence[object]) -> list[EdgeKey]:
    """(caller, callee, site vaddr) of every direct/PLT call and tail jump with a known callee
    (``graph.sites`` of a call graph), sorted by site."""
    kinds = ("direct", "plt", "tail")
    out = {(int(s.function), int(s.target), int(s.address))  # type: ignore[attr-defined]
           for s in sites if getattr(s, "target", None) is not None and getattr(s, "kind", None) in kinds}
    return sorted(out, key=lambda e: (e[2], e[0], e[1]))


class CallCounter:
    """Compile, attach (to ``path``, at the file offsets of ``edges``' sites) and read the counts."""

    def __init__(self, path: str, addrspace: AddressSpace, edges: Sequence[EdgeKey], *,
                 max_tracked: int = 4096, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = path
        self.edges = list(edges)
        self.offsets = [addrspace.vaddr_to_offset(site) for _, _, site in self.edges]
        text = (f"#define NSITES {max(1, len(self.edges))}\n#define MAX_TRACKED {max_tracked}\n"
                + Path(__file__).with_name(C_SOURCE).read_text(encoding="utf-8"))
        self.module = load_module(text, cache_dir=cache_dir_under(cache_dir))
        self._link: UprobeMultiLink | None = None

    def attach(self) -> None:
        self.module.attach_tracepoint("sched:sched_process_fork", "cnt_fork")
        if self.edges:
            fd = self.module.load_func("cnt_site", "kprobe", attach_type=48)
            self._link = attach_uprobe_multi(fd, self.path, self.offsets, list(range(len(self.edges))))

    def track(self, pid: int) -> None:
        self.module.map("cnt_tracked").set(pid, 1)

    def counts(self) -> dict[EdgeKey, int]:
        hits = self.module.map("cnt_hits")
        out: dict[EdgeKey, int] = {}
        for i, edge in enumerate(self.edges):
            n = int(hits.get(i) or 0)
            if n:
                out[edge] = out.get(edge, 0) + n
        return out

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
        self.module.cleanup()


__all__ = ["CallCounter", "counted_sites"]
