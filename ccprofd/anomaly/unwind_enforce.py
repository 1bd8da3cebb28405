"""Enforcement from the unwinder (issue 19): the allowed set of a model as the keys the unwind-mode
BPF program computes at ``sys_enter`` (ccprofd/tracing/unwind/unwind.c, ``UW_ENFORCE``).

The kernel key of a sample: FNV-1a-style over the unwound pcs that lie in an analysed function of
the target binary, innermost first, each as its ELF vaddr (a return address; an exact pc -- the
instruction after a ``syscall`` made in the binary itself -- with bit 63 set).  Library frames, the
entry function and frames above the outermost analysed one are not hashed: they are exactly the
frames the decoder does not report as analysed frames of the binary, so a model learned by
``ccprofd learn --mode unwind`` gives the same key from its stored frames:

* a frame of another module is skipped;
* a frame of the binary contributes the return address learned for its call site
  (``TargetModel.return_addresses``), or nothing when that call site is a tail jump (no return
  address on the stack);
* the innermost frame of the whole context, when it is in the binary and its call site has no
  return address, is the syscall's own pc (exact).

A context where none of these applies (a frame whose call site or return address was never
learned: a frame interrupted by a signal) cannot be keyed; it is counted and stays outside the
allowed set.  Unlike the frame-pointer enforcer (enforce.py), every traced syscall is judged and the
target needs no frame pointers, only the .eh_frame tables the unwinder already uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ccprofd.anomaly.model import TAIL_CALL, FrameKey, TargetModel
from ccprofd.kbpf.syscalls import syscall_number, syscall_numbers
from ccprofd.tracing.api import UnwindEnforcement

KEY_SEED = 0xCBF29CE484222325
KEY_PRIME = 0x100000001B3
EXACT_BIT = 1 << 63
_MASK = (1 << 64) - 1


def key_of_pcs(pcs: Sequence[tuple[int, bool]]) -> int:
    """The kernel's hash of the binary's (vaddr, exact) pcs, innermost first."""
    h = KEY_SEED
    for v, exact in pcs:
        h = ((h ^ (v | (EXACT_BIT if exact else 0))) * KEY_PRIME) & _MASK
    return h


def binary_pcs(model: TargetModel, frames: Sequence[FrameKey]) -> list[tuple[int, bool]] | None:
    """The (vaddr, exact) pcs the unwinder finds in the binary for this context, innermost first;
    None when a frame of the binary has no learned return address."""
    out: list[tuple[int, bool]] = []
    last = len(frames) - 1
    for i in range(last, -1, -1):
        mid, _fn, site = frames[i]
        if mid != model.build_id:
            continue
        if site is None:
            return None
        ret = model.return_addresses.get((mid, site))
        if ret == TAIL_CALL:
            continue
        try:
            if ret is None:
                if i != last:
                    return None
                out.append((int(site, 16), True))  # the syscall instruction's pc, in the binary
            else:
                out.append((int(ret, 16), False))
        except ValueError:
            return None
    return out


@dataclass
class UnwindAllowed:
    """The allowed (syscall number, key) pairs of a model, the syscalls it judges, and what could not
    be keyed (reported, never guessed)."""

    keys: set[tuple[int, int]]
    syscalls: list[int] | None  # None: the model was learned with every syscall traced
    unkeyed: int
    unknown_syscalls: int
    ignored_rules: int


def unwind_allowed(model: TargetModel) -> UnwindAllowed:
    """Every context of ``model`` as the kernel key of the unwinder."""
    numbers = syscall_numbers()
    keys: set[tuple[int, int]] = set()
    unkeyed = unknown = 0
    for syscall, frames in model.contexts:
        nr = numbers.get(syscall)
        if nr is None and syscall.startswith("ia32:"):  # learned under the compat watch: marked number
            nr = syscall_number(syscall)
        if nr is None:
            unknown += 1
            continue
        pcs = binary_pcs(model, frames)
        if pcs is None:
            unkeyed += 1
            continue
        keys.add((nr, key_of_pcs(pcs)))
    judged = None if model.syscalls is None else sorted(numbers[s] for s in model.syscalls if s in numbers)
    return UnwindAllowed(keys, judged, unkeyed, unknown, len(model.allow_rules))


def enforcement_options(model: TargetModel) -> tuple[UnwindEnforcement, UnwindAllowed]:
    """The tracer option that makes unwind mode enforce ``model`` (kill outside it), and what went
    into it (for the caller's report of unkeyed contexts and allow rules that are not enforced)."""
    allowed = unwind_allowed(model)
    syscalls = None if allowed.syscalls is None else tuple(allowed.syscalls)
    return UnwindEnforcement(frozenset(allowed.keys), syscalls), allowed
