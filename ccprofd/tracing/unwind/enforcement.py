"""The maps of enforcement from the unwinder (unwind.c ``UW_ENFORCE``, issue 19): the allowed
(syscall number, context key) set and the judged syscalls going in, counters and each thread's
first denial coming out.  Keys are computed from a model by ccprofd/anomaly/unwind_enforce.py."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.rawmodule import RawModule

#: unwind.c's enforcement counters (UW_ENF_STAT_*), configuration slots and verdict values.
ENF_STATS = ("checked", "allowed", "denied", "incomplete", "killed")
ENF_CFG_KILL, ENF_CFG_INCOMPLETE = 0, 1
ENF_KILLED = 3


@dataclass(frozen=True, slots=True)
class EnforcementDenial:
    """A (syscall, context) pair the unwinder found outside the allowed set."""

    tgid: int
    tid: int
    syscall_nr: int
    key: int          # 0 when the context was incomplete (no key)
    verdict: str      # "killed" (SIGKILL sent) | "denied" (audit only)
    incomplete: bool
    ktime_ns: int


class UnwindEnforcementMaps:
    """Enforcement's side of one loaded unwinder module (compiled with ``UW_ENFORCE``)."""

    def __init__(self, module: RawModule) -> None:
        self.module = module

    def configure(self, allowed: Iterable[tuple[int, int]], syscalls: Iterable[int] | None, *,
                  kill: bool = True, deny_incomplete: bool = True) -> None:
        """Load the allowed pairs and judge ``syscalls`` (None: every sampled one).  Set before the
        target runs; ``kill=False`` only records the denials (audit)."""
        allowed_map = self.module.map("uw_enf_allowed")
        pairs = sorted(set(allowed))
        if len(pairs) > allowed_map.max_entries:
            raise BPFError(f"{len(pairs)} allowed contexts do not fit the map ({allowed_map.max_entries})")
        items = []
        for nr, key in pairs:
            k = allowed_map.key_type()
            k.nr, k.hash = nr, key
            items.append((k, 1))
        allowed_map.update_many(items)
        nrs_map = self.module.map("uw_enf_nrs")
        nrs = range(nrs_map.max_entries) if syscalls is None else sorted(set(syscalls))
        nrs_map.update_many([(nr, 1) for nr in nrs if 0 <= nr < nrs_map.max_entries])
        cfg = self.module.map("uw_enf_config")
        cfg.set(ENF_CFG_KILL, 1 if kill else 0)
        cfg.set(ENF_CFG_INCOMPLETE, 1 if deny_incomplete else 0)

    def stats(self) -> dict[str, int]:
        """Syscalls checked, allowed, denied, denied as incomplete, killed (UW_ENF_STAT_*)."""
        m = self.module.map("uw_enf_stats")
        return {name: int(m.get(i) or 0) for i, name in enumerate(ENF_STATS)}

    def denials(self) -> list[EnforcementDenial]:
        """The first denial of each thread that had one (a killed process makes no second; in
        audit mode the counters have the rest)."""
        out = []
        for k, v in self.module.map("uw_enf_denials").items():
            verdict = "killed" if v.verdict == ENF_KILLED else "denied"
            out.append(EnforcementDenial(int(v.tgid), int(getattr(k, "value", k)), int(v.nr), int(v.hash),
                                         verdict, bool(v.incomplete), int(v.ktime_ns)))
        return sorted(out, key=lambda d: d.ktime_ns)
