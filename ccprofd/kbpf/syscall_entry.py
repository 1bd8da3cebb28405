"""Per-syscall attachment: a sampler's syscall program on the ``syscalls:sys_enter_<name>`` events
of the syscalls it samples, instead of on ``raw_syscalls:sys_enter``.

Why: a program on ``raw_syscalls:sys_enter`` runs on every syscall of every task of the machine
and returns at once for the syscalls outside the set; on a CPU with retpolines and SRSO "Safe RET"
each of those runs (an indirect call into the program, its helper calls for the tracked-process
lookup, the returns) is expensive.  On the per-syscall events the kernel's perf syscall handler
tests the syscall's bit and returns for a syscall outside the set: no program runs.  (Both still
set the syscall-tracing work flag on every task, so every syscall takes the slow entry path:
that part cannot be avoided here.  Cheaper per-function hooks were measured out: this kernel has
no kprobes (CONFIG_KPROBES is off) and refuses every trampoline program, fentry and LSM alike,
with EPERM: README, "Per-syscall attachment".)

Same samples as on ``raw_syscalls``: the perf handler passes a BPF program a record whose first
word is the user ``pt_regs`` pointer (the one ``sys_enter`` passes; the kernel puts it there so
that ``bpf_get_stack`` works) and whose ``__syscall_nr`` (offset 8) is the number; the samplers'
syscall-set filter stays in BPF, so the attached set may be a superset of the sampled one.
Not the same: an ia32 (compat) syscall is not reported by these events at all (the kernel
ignores compat syscalls in syscall events); on ``raw_syscalls`` it arrives with its ia32 number,
which the raw-path programs mark (``syscalls.IA32_BIT``), so it is named ``ia32:<name>`` and is in
no set.  *The compat watch* (unwind mode, ``TraceOptions.watch_ia32``; tracing/unwind/sampler.py)
closes that gap: the unwinder's raw_syscalls program is attached beside the events too, returns at
its ``TS_COMPAT`` test for every call that is not an ia32 one, and samples the ia32 ones whatever
the set (config ``CFG_COMPAT_WATCH``); ~11 ns on every syscall of the machine (README,
"Per-syscall attachment"), so it is opt-in.  x32 is not built into this kernel
(CONFIG_X86_X32_ABI), and its numbers (bit 30 set) are outside every set on both paths.

``CCPROFD_SYSCALL_ATTACH=raw`` in the environment keeps every set on ``raw_syscalls`` (for
benchmarks and tests that compare the two).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.syscalls import syscall_table
from ccprofd.kbpf.tracefs import tracefs_syscalls, tracepoint_field_offset

#: Sets of at most this many syscalls are attached per syscall; larger ones (and "all") stay on
#: raw_syscalls:sys_enter.  Measured (README, "Per-syscall attachment"): a syscall outside the set
#: costs the unwinder ~170-275 ns less on the events, one inside it ~120 ns more (the perf handler
#: builds a record first), so the events win while under ~60% of the process's syscalls are in the
#: set.  ccprofd does not know that fraction when it attaches; the size bound is its proxy (and
#: keeps the perf event fds few): a small set of a service's hottest calls would do better raw.
MAX_ENTRY_SYSCALLS = 64
ENV_SWITCH = "CCPROFD_SYSCALL_ATTACH"


def entry_plan(nrs: Iterable[int] | None, *, nr_offset: int, ret_offset: int,
               extra: Iterable[int] = ()) -> dict[int, str] | None:
    """Syscall number -> event name (``syscalls:sys_enter_<name>``) for ``nrs`` plus ``extra``
    (syscalls the program must see although not sampled), or None when the set stays on
    raw_syscalls: all syscalls, an empty set, more than :data:`MAX_ENTRY_SYSCALLS`, a syscall
    without its events in tracefs, an event whose ``__syscall_nr`` is not at ``nr_offset`` or
    whose exit event's ``ret`` is not at ``ret_offset`` (where the programs read them), or
    ``CCPROFD_SYSCALL_ATTACH=raw``.  The exit events (:func:`exit_event`) serve ``--retval``."""
    if nrs is None or os.environ.get(ENV_SWITCH, "") == "raw":
        return None
    wanted = set(nrs)
    if not wanted or len(wanted) > MAX_ENTRY_SYSCALLS:
        return None
    wanted |= set(extra)
    known = tracefs_syscalls()
    if known is None:
        return None
    table = syscall_table()
    plan: dict[int, str] = {}
    for nr in sorted(wanted):
        name = table.get(nr)
        if name is None or name not in known:
            return None
        plan[nr] = name
    try:
        for name in plan.values():
            if tracepoint_field_offset("syscalls", f"sys_enter_{name}", "__syscall_nr") != nr_offset \
                    or tracepoint_field_offset("syscalls", f"sys_exit_{name}", "__syscall_nr") != nr_offset \
                    or tracepoint_field_offset("syscalls", f"sys_exit_{name}", "ret") != ret_offset:
                return None
    except BPFError:
        return None
    return {nr: f"syscalls:sys_enter_{name}" for nr, name in plan.items()}


def exit_event(enter_event: str) -> str:
    """The exit event of a plan's entry event (``syscalls:sys_enter_X`` -> ``syscalls:sys_exit_X``)."""
    return enter_event.replace(":sys_enter_", ":sys_exit_", 1)
