"""Instructions x86 uprobes refuse, and where a function's entry probe can go instead.

The kernel decodes a probed instruction when it first installs the breakpoint in a process
(``arch/x86/kernel/uprobes.c``, ``uprobe_init_insn``) and refuses, with ENOTSUPP (errno 524),
lock- and es/cs/ss/ds-prefixed instructions and the one-byte opcodes its ``good_insns_64`` table
leaves out.  A ``uprobe_multi`` link holding one refused site fails as a whole, and only once a
running process maps the binary, so the probe plan checks its sites first.  Postgres' ``SetLatch``
starts with ``lock addl $0,(%rsp)`` (a memory barrier), for example.

An entry probe on a refused first instruction moves to the next instruction when that is
provably the same point of the function: the refused instruction neither transfers control nor
writes the stack pointer (the probe's CFA is still ``rsp + 8``), and no branch of the function
can land on the next instruction (no direct branch targets it, and the function has no indirect
jump).  Otherwise the plan is refused with the reason: a probe elsewhere would be wrong.
"""

from __future__ import annotations

import re

#: Legacy prefixes (any order, before an optional REX byte) and the ones uprobes refuse.
_LEGACY_PREFIXES = frozenset((0xF0, 0xF2, 0xF3, 0x2E, 0x36, 0x3E, 0x26, 0x64, 0x65, 0x66, 0x67))
_REFUSED_PREFIXES = {0xF0: "lock", 0x26: "es", 0x2E: "cs", 0x36: "ss", 0x3E: "ds"}
#: One-byte opcodes ``good_insns_64`` marks unsupported (invalid in 64-bit mode, or privileged /
#: trapping in user space: int3, int N, into, iret, in/out, hlt, cli/sti, far call/jmp, aam/aad).
#: Two-byte (0f xx) opcodes are not modelled: the compilers' function entries do not use the
#: refused ones.
_REFUSED_OPCODES = frozenset((
    0x06, 0x07, 0x0E, 0x16, 0x17, 0x1E, 0x1F, 0x27, 0x2F, 0x37, 0x3F, 0x60, 0x61, 0x62, 0x6C, 0x6D,
    0x6E, 0x6F, 0x82, 0x9A, 0xCC, 0xCD, 0xCE, 0xCF, 0xD4, 0xD5, 0xD6, 0xE4, 0xE5, 0xE6, 0xE7, 0xEA,
    0xEC, 0xED, 0xEE, 0xEF, 0xF1, 0xF4, 0xFA, 0xFB))
_STACK_REGISTER = re.compile(r"\b(rsp|esp|sp|spl)\b")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_STACK_MNEMONICS = frozenset(("push", "pushfq", "pushf", "pop", "popfq", "popf", "enter", "leave"))


def refused(code: bytes) -> str | None:
    """Why x86 uprobes refuse the instruction ``code`` starts with, or None."""
    i = 0
    while i < len(code) and code[i] in _LEGACY_PREFIXES:
        if code[i] in _REFUSED_PREFIXES:
            return f"{_REFUSED_PREFIXES[code[i]]}-prefixed instruction"
        i += 1
    if i < len(code) and 0x40 <= code[i] <= 0x4F:
        i += 1
    if i < len(code) and code[i] in _REFUSED_OPCODES:
        return f"opcode {code[i]:#04x}"
    return None


def moved_entry(code: bytes, addr: int) -> tuple[int | None, str]:
    """Where the entry probe of the function whose bytes are ``code`` (at ``addr``) can go when
    its first instruction is refused: ``(address, "")``, or ``(None, why not)``."""
    from capstone import CS_ARCH_X86, CS_MODE_64, Cs  # only for the rare refused entry

    insns = list(Cs(CS_ARCH_X86, CS_MODE_64).disasm_lite(code, addr))
    if len(insns) < 2 or insns[0][0] != addr:
        return None, "the function's code does not decode past its first instruction"
    _a, size, mnemonic, operands = insns[0]
    if mnemonic.startswith(("j", "call", "ret", "loop", "int", "syscall", "xbegin")):
        return None, f"its first instruction ({mnemonic}) transfers control"
    if mnemonic in _STACK_MNEMONICS or _STACK_REGISTER.search(_BRACKETS.sub("", operands)):
        return None, f"its first instruction ({mnemonic} {operands}) writes the stack pointer"
    after = addr + size
    for a, _s, m, ops in insns:
        if m.startswith(("j", "loop", "xbegin", "call")):
            target = ops.strip()
            if not target.startswith("0x"):
                if m.startswith("j"):
                    return None, f"the function has an indirect jump at {a:#x}"
                continue
            if int(target, 16) == after:
                return None, f"a branch at {a:#x} lands on the next instruction"
    return after, ""
