"""A thread's user call stack from its registers and memory, with the CFI tables BPF unwinds with.

Why here and not in BPF: ``GetThreadContexts`` asks for the context of a thread *now*, when it is
not making a syscall and no probe fires; the daemon stops the thread briefly (ptrace), reads its
registers and stack, and walks the stack with this module.  The walk is the BPF walk of
``ccprofd/tracing/unwind/unwind.c`` (``uw_unwind_step``) rule for rule, over the same
:class:`ccprofd.elf.cfi.UnwindTable` rows, so a thread snapshot and a syscall sample of the
same stack give the same frames:

* ``CFA = rsp + k`` / ``rbp + k`` / the PLT expression; return address at ``CFA + ra_off``; the
  caller's ``rbp`` restored from ``CFA + rbp_off`` or kept, and lost when the rule says so;
* the signal trampoline (``__restore_rt``): the interrupted ``rip``/``rsp``/``rbp`` are read from
  the ``ucontext`` at ``rsp``; the next pc is *exact* (the interrupted instruction, looked up as is)
  where a return address is looked up at ``pc - 1``;
* no CFI row: the frame-pointer rule (``CFA = rbp + 16``) at a return address where ``rbp`` looks
  like a frame pointer (above ``rsp``, within 8 MiB, aligned), never at an exact pc; the main
  thread's first frame (``rsp`` = the stack's start from ``/proc/PID/stat``) and a zero pc end the
  stack;
* ``END`` rows (undefined return address: ``_start``, a thread's ``clone3`` frame) end the stack;
* Go's systemstack on g0 (``GO_SWITCH``): the caller goes on from ``m.curg.sched``, reached through
  the thread's TLS slot of ``g`` (``fs_base``; :mod:`ccprofd.elf.gostack`); Go's morestack on g0
  (``GO_MORESTACK``): the goroutine goes on *at* ``m.curg.sched``; Go's vDSO calls (``GO_VDSO``):
  the caller goes on at ``m.vdsoPC``/``m.vdsoSP``; the first two are not crossed past a frame
  of Go's execute or schedule (``GO_CURG_SET``: m.curg may be another goroutine by then): there,
  and where m.curg is nil, morestack's chain ends complete (the scheduler's g0 stack); Go's
  asmcgocall on the stack it was called on (``CFA_DEREF``): the CFA is an rsp it kept in a slot,
  plus a constant.

Input: :class:`UserRegs`, a word reader (None = unreadable), the process's module mappings
(:class:`ccprofd.proc.maps.ProcessMaps`) and a table per mapping.  Output:
:class:`UnwoundStack` -- raw frames outermost first, and ``complete`` false (with the same reason
names BPF reports) when the walk stopped before the end of the stack.  Nothing here stops threads,
reads ``/proc`` or symbolises: that is :mod:`ccprofd.proc.threadsnap` and the decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ccprofd.elf import cfi
from ccprofd.proc.maps import ModuleMapping, ProcessMaps

DEFAULT_MAX_DEPTH = 4096
FP_MAX_SPAN = 8 << 20  # a frame pointer more than 8 MiB above rsp is not one (the BPF bound)

WordReader = Callable[[int], "int | None"]
TableOf = Callable[[ModuleMapping], "cfi.UnwindTable | None"]


@dataclass(frozen=True, slots=True)
class UserRegs:
    """The registers an unwind starts from (x86-64 user_regs_struct)."""

    rip: int
    rsp: int
    rbp: int
    fs_base: int = 0  # (0: unknown; only Go's systemstack crossing reads it)
    rax: int | None = None  # (None: unknown; only a clone's child window reads it, cfi.CLONE_CHILD)


@dataclass(frozen=True, slots=True)
class RawFrame:
    """One frame: ``pc`` is the runtime address it executes at -- the interrupted instruction when
    ``exact`` (innermost frame, or the frame a signal interrupted), else a return address.
    ``module``/``vaddr`` locate it in its ELF object (None outside any file mapping); ``cfa`` is the
    frame's canonical frame address (None for the outermost frame, whose caller is not unwound)."""

    pc: int
    exact: bool
    module: ModuleMapping | None
    vaddr: int | None
    cfa: int | None = None
    fp: bool = False  # unwound with the frame-pointer rule (no CFI covered the pc)


@dataclass(frozen=True, slots=True)
class UnwoundStack:
    """Frames outermost first; ``reason`` says why the walk stopped early (None: whole stack)."""

    frames: tuple[RawFrame, ...]
    reason: str | None = None

    @property
    def complete(self) -> bool:
        return self.reason is None


def unwind(regs: UserRegs, read_word: WordReader, maps: ProcessMaps, table_of: TableOf, *,
           start_stack: int = 0, max_depth: int = DEFAULT_MAX_DEPTH) -> UnwoundStack:
    """Walk one thread's stack from ``regs`` (see the module docstring for the rules)."""
    inner_first: list[RawFrame] = []
    pc, sp, bp = regs.rip, regs.rsp, regs.rbp
    bp_valid = True
    exact = True
    tables: dict[int, cfi.UnwindTable | None] = {}
    where: dict[tuple[int, bool], tuple[ModuleMapping | None, int | None, bool, cfi.Rule | None]] = {}

    def done(reason: str | None) -> UnwoundStack:
        return UnwoundStack(tuple(reversed(inner_first)), reason)

    curg_set = False  # a frame so far is Go's execute or schedule (cfi.GO_CURG_SET)
    while True:
        if len(inner_first) >= max_depth:
            return done("max_depth")
        hit = where.get((pc, exact))
        if hit is None:  # recursion repeats return addresses: look each up once per walk
            mod = maps.find(pc)
            vaddr = mod.vaddr(pc) if mod is not None else None
            known = mod is not None or pc == 0 or any(m.start <= pc < m.end for m in maps.other_exec)
            rule: cfi.Rule | None = None
            if mod is not None:
                if mod.start not in tables:
                    tables[mod.start] = table_of(mod)
                table = tables[mod.start]
                if table is not None and len(table):
                    rule = table.lookup(mod.vaddr(pc if exact else pc - 1))
            hit = where[(pc, exact)] = (mod, vaddr, known, rule)
        mod, vaddr, known, rule = hit
        frame_at = len(inner_first)
        inner_first.append(RawFrame(pc, exact, mod, vaddr))
        if not known:
            return done("unknown_pc")
        kind = rule.kind if rule is not None else cfi.NONE
        if kind == cfi.END or (kind == cfi.NONE and pc == 0):
            return done(None)
        if frame_at == 0 and exact and kind == cfi.CFA_RSP and rule is not None \
                and rule.aux & cfi.CLONE_CHILD:
            # after a clone's syscall: the child (rax 0) has no caller here; the parent's row holds
            # only for the parent
            if regs.rax is None:
                return done("unsupported_cfi")
            if regs.rax == 0:
                return done(None)
        if kind in (cfi.GO_SWITCH, cfi.GO_MORESTACK, cfi.GO_VDSO):
            assert rule is not None and mod is not None
            crossed = _go_switch(rule, mod, regs.fs_base, read_word, curg_set)
            if isinstance(crossed, str):
                return done(crossed)
            inner_first[frame_at] = RawFrame(pc, exact, mod, vaddr, crossed[0])
            if crossed[1] == 0:
                return done(None)
            sp, pc, bp, bp_valid, exact = crossed[0], crossed[1], crossed[2], kind != cfi.GO_VDSO, False
            continue
        if kind == cfi.CFA_DEREF:
            assert rule is not None
            slot = read_word(sp + rule.cfa_off)
            if slot is None:
                return done("read_fault")
            cfa = slot + rule.aux
            if cfa <= sp:
                return done("bad_frame")
            dra = read_word(cfa - 8) if not cfa & 7 else None
            if dra is None:
                return done("read_fault")
            if rule.rbp_kind != cfi.RBP_SAME:
                bp_valid = False
            inner_first[frame_at] = RawFrame(pc, exact, mod, vaddr, cfa)
            if dra == 0:
                return done(None)
            sp, pc, exact = cfa, dra, False
            continue
        fp = False
        reads: list[int]
        cfa = 0
        if rule is None or kind == cfi.NONE:
            if start_stack and sp == start_stack:
                return done(None)  # the main thread's first frame: the loader's entry, no CFI
            # frame pointers only at a return address: at an exact pc the function may not have set
            # rbp up (yet, or at all), and the walk would skip its caller (unwind.c says the same)
            if exact or not bp_valid or bp < sp or bp - sp > FP_MAX_SPAN or bp & 7:
                if mod is None or tables.get(mod.start) is None:
                    return done("no_table")  # [vdso], JIT code, an object without CFI
                return done("no_cfi")
            cfa = bp + 16
            reads = [bp + 8, bp]
            fp = True
        elif kind == cfi.SIGNAL:
            reads = [sp + rule.ra_off, sp + rule.cfa_off]
            if rule.rbp_kind == cfi.RBP_AT_SP:
                reads.append(sp + rule.rbp_off)
        else:
            if kind == cfi.CFA_RSP:
                cfa = sp + rule.cfa_off
            elif kind == cfi.CFA_RBP:
                if not bp_valid:
                    return done("rbp_lost")
                cfa = bp + rule.cfa_off
            elif kind == cfi.PLT:
                cfa = sp + rule.cfa_off + (8 if (pc & 15) >= rule.aux else 0)
            else:
                return done("unsupported_cfi")
            reads = [cfa + rule.ra_off]
            if rule.rbp_kind == cfi.RBP_AT_CFA:
                reads.append(cfa + rule.rbp_off)
        values: list[int] = []
        for addr in reads:
            v = read_word(addr)
            if v is None:
                return done("read_fault")
            values.append(v)
        if kind == cfi.SIGNAL:
            inner_first[frame_at] = RawFrame(pc, exact, mod, vaddr, sp)
            pc, sp = values[0], values[1]
            bp_valid = len(values) == 3
            bp = values[2] if bp_valid else 0
            exact = True
            continue
        ra = values[0]
        if fp or len(values) == 2:
            bp = values[1]
            bp_valid = True  # restored from the stack: known again even if an inner frame lost it
        elif rule is not None and rule.rbp_kind != cfi.RBP_SAME:
            bp_valid = False
        inner_first[frame_at] = RawFrame(pc, exact, mod, vaddr, cfa, fp)
        if ra == 0:
            return done(None)  # the conventional end of the stack
        if cfa <= sp:
            return done("bad_frame")
        sp, pc = cfa, ra
        exact = kind == cfi.CFA_RSP and rule is not None and bool(rule.aux & cfi.CALLER_EXACT)
        curg_set = curg_set or (kind == cfi.CFA_RSP and rule is not None and bool(rule.aux & cfi.GO_CURG_SET))


def _go_switch(rule: cfi.Rule, mod: ModuleMapping, fs_base: int, read_word: WordReader,
               curg_set: bool) -> tuple[int, int, int] | str:
    """(rsp, pc, rbp) of the goroutine that switched to g0 -- that called Go's systemstack
    (:data:`ccprofd.elf.cfi.GO_SWITCH`), or morestack (:data:`~ccprofd.elf.cfi.GO_MORESTACK`) -- from
    ``m.curg.sched``, or the reason the walk stops (as unwind.c's ``uw_go_switch``).  pc 0: the chain
    ends here, complete -- morestack's when ``curg_set`` (a frame of Go's execute or schedule was
    walked: m.curg may be another goroutine) or m.curg is nil (the scheduler runs on g0 from there)."""
    morestack = rule.kind == cfi.GO_MORESTACK
    if curg_set and rule.kind != cfi.GO_VDSO:
        return (0, 0, 0) if morestack else "unsupported_cfi"
    if not fs_base:
        return "unsupported_cfi"
    g = read_word(fs_base + rule.cfa_off)
    m = read_word(g + (rule.aux & 0xFF)) if g else None
    if rule.kind == cfi.GO_VDSO:
        # a vDSO call's caller: pc m.vdsoPC at rsp m.vdsoSP, whose slot below holds that pc
        vsp = read_word(m + rule.rbp_off) if m else None
        vpc = read_word(m + rule.ra_off) if m else None
        if not vsp or not vpc or vsp < 8 or vsp & 7:
            return "unsupported_cfi"
        slot = read_word(vsp - 8)
        if slot is None:
            return "read_fault"
        return (vsp, vpc, 0) if slot == vpc else "unsupported_cfi"
    curg = read_word(m + (rule.aux >> 8 if morestack else rule.rbp_off)) if m else None
    if curg == 0 and morestack:
        return 0, 0, 0
    if not curg:
        return "unsupported_cfi"
    ssp, spc, sbp = (read_word(curg + rule.rbp_kind + k) for k in (0, 8, 48))
    if not ssp or spc is None or sbp is None:
        return "unsupported_cfi"
    if morestack:
        # the instruction before sched.pc: a direct call (e8, rel32) of morestack or morestack_noctxt
        word = read_word(spc - 8) if spc >= 8 else None
        if word is None or (word >> 24) & 0xFF != 0xE8:
            return "unsupported_cfi"
        rel = word >> 32
        target = mod.vaddr(spc + (rel - (1 << 32) if rel >= 1 << 31 else rel))
        if target != rule.rbp_off and (rule.ra_off == 0 or target != rule.ra_off):
            return "unsupported_cfi"
        return ssp, spc, sbp
    if mod.vaddr(spc) != rule.ra_off:
        return "unsupported_cfi"
    ra = read_word(ssp)
    if ra is None:
        return "read_fault"
    return ssp + 8, ra, sbp


class StackMemory:
    """Word reads through a page cache over a raw reader (``read(addr, n) -> bytes | None``): a
    stack walk reads neighbouring words, one ``pread`` of ``/proc/PID/mem`` per page serves them."""

    PAGE = 4096

    def __init__(self, read: Callable[[int, int], bytes | None]) -> None:
        self._read = read
        self._pages: dict[int, bytes | None] = {}

    def word(self, addr: int) -> int | None:
        if addr < 0 or addr > (1 << 64) - 8:
            return None
        base = addr & ~(self.PAGE - 1)
        off = addr - base
        if off + 8 > self.PAGE:  # straddles two pages (unaligned)
            lo, hi = self.word_bytes(base, off, self.PAGE - off), self.word_bytes(base + self.PAGE, 0,
                                                                                  8 - (self.PAGE - off))
            if lo is None or hi is None:
                return None
            return int.from_bytes(lo + hi, "little")
        got = self.word_bytes(base, off, 8)
        return None if got is None else int.from_bytes(got, "little")

    def word_bytes(self, base: int, off: int, n: int) -> bytes | None:
        if base not in self._pages:
            page = self._read(base, self.PAGE)
            self._pages[base] = page if page is not None and len(page) == self.PAGE else None
        page = self._pages[base]
        return None if page is None else page[off:off + n]
