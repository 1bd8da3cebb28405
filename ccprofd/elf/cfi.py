"""x86-64 unwind tables from ``.eh_frame`` / ``.debug_frame``: what a BPF unwinder needs per pc.

For every address range of one ELF object the table says how to find the caller's frame:

* the CFA (``rsp + k`` or ``rbp + k``; the PLT's well-known ``rsp + k + 8*((rip & 15) >= n)``
  expression; the signal trampoline, whose registers are in the ``ucontext`` at ``rsp``);
* where the return address is (``CFA + ra_off``, always ``CFA - 8`` from gcc/clang);
* where the caller's ``rbp`` was saved (``CFA + off``), or that ``rbp`` is unchanged;
* ``END`` where the return address is undefined (``_start``, thread entry: the outermost frame),
  ``NONE`` where no FDE covers the address, ``UNSUPPORTED`` for any other DWARF expression.

Built by a small CFI interpreter over the raw section bytes (pyelftools decodes every instruction
into objects and takes ~1.7 s on python3.11; this takes a fraction of that), reusing the pointer
decoders of :mod:`ccprofd.elf.ehframe`.  Tables are plain data (sorted start addresses, a rule
index per start, a list of rule tuples), cached by build-id, and the same for every process that
maps the object: runtime addresses are translated by the caller (load bias), never stored here.
"""

from __future__ import annotations

import os
import struct
from array import array
from bisect import bisect_right
from dataclasses import dataclass
from typing import NamedTuple

from ccprofd.elf.ehframe import _read_encoded, _sleb, _uleb
from ccprofd.elf.image import ElfImage
from ccprofd.persist.cache import AnalysisCache

CACHE_KIND = "cfi"
TABLE_FORMAT = 1

# Rule kinds.
NONE = 0  # no CFI covers the address: the unwinder may try frame pointers
CFA_RSP = 1  # CFA = rsp + cfa_off
CFA_RBP = 2  # CFA = rbp + cfa_off
PLT = 3  # CFA = rsp + cfa_off + (8 if (pc & 15) >= aux else 0)
SIGNAL = 4  # signal trampoline: rsp'=*(rsp+cfa_off), rip'=*(rsp+ra_off), rbp'=*(rsp+rbp_off)
END = 5  # return address undefined: outermost frame
UNSUPPORTED = 6  # anything else; aux says why
KIND_NAMES = {NONE: "none", CFA_RSP: "rsp", CFA_RBP: "rbp", PLT: "plt", SIGNAL: "signal", END: "end",
              UNSUPPORTED: "unsupported"}

# rbp rules.
RBP_SAME = 0  # unchanged in the caller
RBP_AT_CFA = 1  # saved at CFA + rbp_off
RBP_UNDEF = 2  # not recoverable (undefined, in another register, an expression)
RBP_AT_SP = 3  # signal frames: saved at rsp + rbp_off

# Reasons for UNSUPPORTED (aux).
WHY_CFA_EXPR = 1
WHY_CFA_REG = 2
WHY_RA_RULE = 3
WHY_BAD_CFI = 4

_RSP, _RBP, _RIP = 7, 6, 16


class Rule(NamedTuple):
    """One row of the table (see the module docstring for the meaning of each field)."""

    kind: int
    cfa_off: int = 0
    rbp_kind: int = RBP_SAME
    rbp_off: int = 0
    ra_off: int = -8
    aux: int = 0

    def describe(self) -> str:
        name = KIND_NAMES.get(self.kind, str(self.kind))
        if self.kind in (CFA_RSP, CFA_RBP):
            rbp = {RBP_SAME: "same", RBP_AT_CFA: f"c{self.rbp_off:+d}", RBP_UNDEF: "lost"}.get(
                self.rbp_kind, "?")
            return f"{name}{self.cfa_off:+d} ra=c{self.ra_off:+d} rbp={rbp}"
        return f"{name}(cfa_off={self.cfa_off}, rbp={self.rbp_kind}:{self.rbp_off}, ra={self.ra_off}, " \
               f"aux={self.aux})"


NO_CFI = Rule(NONE, 0, RBP_SAME, 0, 0, 0)


@dataclass(slots=True)
class UnwindTable:
    """Sorted rows of one ELF object: row i covers [starts[i], starts[i+1]) with rules[rule_ids[i]].

    Addresses are ELF virtual addresses.  The last row is always a NONE row (end of CFI)."""

    build_id: str | None
    path: str
    starts: array  # array('Q'), strictly increasing
    rule_ids: array  # array('H'), same length
    rules: list[Rule]
    fde_count: int = 0
    sources: tuple[str, ...] = ()

    def lookup(self, vaddr: int) -> Rule:
        i = bisect_right(self.starts, vaddr) - 1
        if i < 0:
            return NO_CFI
        return self.rules[self.rule_ids[i]]

    def __len__(self) -> int:
        return len(self.starts)

    def to_plain(self) -> dict[str, object]:
        return {"format": TABLE_FORMAT, "build_id": self.build_id, "path": self.path,
                "starts": self.starts.tobytes(), "rule_ids": self.rule_ids.tobytes(),
                "rules": [tuple(r) for r in self.rules], "fde_count": self.fde_count,
                "sources": list(self.sources)}

    @classmethod
    def from_plain(cls, d: dict[str, object]) -> UnwindTable:
        starts = array("Q")
        starts.frombytes(d["starts"])  # type: ignore[arg-type]
        rule_ids = array("H")
        rule_ids.frombytes(d["rule_ids"])  # type: ignore[arg-type]
        return cls(d["build_id"], str(d["path"]), starts, rule_ids,  # type: ignore[arg-type]
                   [Rule(*r) for r in d["rules"]],  # type: ignore[attr-defined]
                   int(d["fde_count"]), tuple(d["sources"]))  # type: ignore[call-overload,arg-type]


# ------------------------------------------------------------------------------------- parsing
@dataclass(slots=True)
class _Cie:
    code_align: int
    data_align: int
    ra_reg: int
    fde_encoding: int
    has_z: bool
    signal: bool
    init_pos: int
    init_end: int
    addr_size: int


class _State:
    """Register rules of the CFI interpreter that the table needs (CFA, rbp, return address)."""

    __slots__ = ("cfa_off", "cfa_reg", "cfa_special", "ra", "rbp")

    def __init__(self) -> None:
        self.cfa_reg = _RSP
        self.cfa_off = 8
        self.cfa_special: tuple[int, ...] | None = None  # (PLT, k, n) | (SIGNAL, k) | (UNSUPPORTED,)
        # rules: ("same",) ("undef",) ("cfa", off) ("sp", off) ("other",)
        self.rbp: tuple[str, int] = ("same", 0)
        self.ra: tuple[str, int] = ("cfa", -8)

    def copy(self) -> _State:
        s = _State()
        s.cfa_reg, s.cfa_off, s.cfa_special, s.rbp, s.ra = (self.cfa_reg, self.cfa_off, self.cfa_special,
                                                            self.rbp, self.ra)
        return s

    def rule(self, signal: bool) -> Rule:
        sp = self.cfa_special
        if sp is not None:
            if sp[0] == SIGNAL and self.ra[0] == "sp":
                rbp_kind, rbp_off = (RBP_AT_SP, self.rbp[1]) if self.rbp[0] == "sp" else (RBP_UNDEF, 0)
                return Rule(SIGNAL, sp[1], rbp_kind, rbp_off, self.ra[1], 0)
            if sp[0] == PLT and self.ra == ("cfa", -8):
                return Rule(PLT, sp[1], RBP_SAME if self.rbp[0] == "same" else RBP_UNDEF, 0, -8, sp[2])
            return Rule(UNSUPPORTED, aux=WHY_CFA_EXPR)
        if self.ra[0] == "undef":
            return Rule(END, 0, RBP_SAME, 0, 0, 0)
        if self.ra[0] != "cfa":
            return Rule(UNSUPPORTED, aux=WHY_RA_RULE)
        if self.cfa_reg == _RSP:
            kind = CFA_RSP
        elif self.cfa_reg == _RBP:
            kind = CFA_RBP
        else:
            return Rule(UNSUPPORTED, aux=WHY_CFA_REG)
        rk, ro = self.rbp
        if rk == "same":
            return Rule(kind, self.cfa_off, RBP_SAME, 0, self.ra[1], 0)
        if rk == "cfa":
            return Rule(kind, self.cfa_off, RBP_AT_CFA, ro, self.ra[1], 0)
        return Rule(kind, self.cfa_off, RBP_UNDEF, 0, self.ra[1], 0)


def _classify_cfa_expr(expr: bytes) -> tuple[int, ...]:
    """Recognise the two CFA expressions x86-64 code uses in practice."""
    try:
        if expr and expr[0] == 0x77:  # DW_OP_breg7 (rsp)
            k, pos = _sleb(expr, 1)
            rest = expr[pos:]
            if rest == b"\x06":  # deref: signal frame, CFA = *(rsp + k)
                return (SIGNAL, k)
            # breg16 0; lit15; and; lit<n>; ge; lit3; shl; plus  -- the lazy-binding PLT
            if (len(rest) == 9 and rest[0] == 0x80 and rest[1] == 0x00 and rest[2] == 0x3F
                    and rest[3] == 0x1A and 0x30 <= rest[4] <= 0x4F and rest[5:] == b"\x2a\x33\x24\x22"):
                return (PLT, k, rest[4] - 0x30)
    except IndexError:
        pass
    return (UNSUPPORTED,)


def _sp_expr(expr: bytes) -> tuple[str, int]:
    """``DW_OP_breg7 k`` (register saved at rsp + k, as in signal frames), else 'other'."""
    if expr and expr[0] == 0x77:
        try:
            k, pos = _sleb(expr, 1)
        except IndexError:
            return ("other", 0)
        if pos == len(expr):
            return ("sp", k)
    return ("other", 0)


def _execute(buf: bytes, pos: int, end: int, st: _State, cie: _Cie, init: _State | None, loc: int,
             rows: list[tuple[int, Rule]] | None, enc: int, sec_vaddr: int, is_eh: bool) -> int:
    """Run CFI instructions [pos, end); append (loc, rule) to ``rows`` at each advance.  Returns loc."""
    stack: list[_State] = []
    ca, da = cie.code_align, cie.data_align
    signal = cie.signal

    def emit(_at: int) -> None:
        if rows is not None:
            rows.append((loc, st.rule(signal)))

    while pos < end:
        op = buf[pos]
        pos += 1
        hi = op & 0xC0
        low = op & 0x3F
        if hi == 0x40:  # advance_loc
            emit(loc)
            loc += low * ca
            continue
        if hi == 0x80:  # offset(reg) uleb*da
            v, pos = _uleb(buf, pos)
            _set_reg(st, low, ("cfa", v * da))
            continue
        if hi == 0xC0:  # restore(reg)
            if init is not None:
                _restore_reg(st, init, low)
            continue
        if op == 0x00:  # nop
            continue
        if op == 0x02:
            emit(loc)
            loc += buf[pos] * ca
            pos += 1
        elif op == 0x03:
            emit(loc)
            loc += struct.unpack_from("<H", buf, pos)[0] * ca
            pos += 2
        elif op == 0x04:
            emit(loc)
            loc += struct.unpack_from("<I", buf, pos)[0] * ca
            pos += 4
        elif op == 0x01:  # set_loc
            emit(loc)
            if is_eh:
                loc, pos = _read_encoded(buf, pos, enc, sec_vaddr + pos)
            else:
                loc = struct.unpack_from("<Q", buf, pos)[0]
                pos += 8
        elif op == 0x0C:  # def_cfa
            st.cfa_reg, pos = _uleb(buf, pos)
            st.cfa_off, pos = _uleb(buf, pos)
            st.cfa_special = None
        elif op == 0x0D:  # def_cfa_register
            st.cfa_reg, pos = _uleb(buf, pos)
            st.cfa_special = None
        elif op == 0x0E:  # def_cfa_offset
            st.cfa_off, pos = _uleb(buf, pos)
        elif op == 0x12:  # def_cfa_sf
            st.cfa_reg, pos = _uleb(buf, pos)
            v, pos = _sleb(buf, pos)
            st.cfa_off = v * da
            st.cfa_special = None
        elif op == 0x13:  # def_cfa_offset_sf
            v, pos = _sleb(buf, pos)
            st.cfa_off = v * da
        elif op == 0x0F:  # def_cfa_expression
            n, pos = _uleb(buf, pos)
            st.cfa_special = _classify_cfa_expr(buf[pos:pos + n])
            pos += n
        elif op == 0x05:  # offset_extended reg, uleb
            r, pos = _uleb(buf, pos)
            v, pos = _uleb(buf, pos)
            _set_reg(st, r, ("cfa", v * da))
        elif op == 0x11:  # offset_extended_sf reg, sleb
            r, pos = _uleb(buf, pos)
            v, pos = _sleb(buf, pos)
            _set_reg(st, r, ("cfa", v * da))
        elif op == 0x2F:  # GNU_negative_offset_extended
            r, pos = _uleb(buf, pos)
            v, pos = _uleb(buf, pos)
            _set_reg(st, r, ("cfa", -v * da))
        elif op == 0x06:  # restore_extended
            r, pos = _uleb(buf, pos)
            if init is not None:
                _restore_reg(st, init, r)
        elif op == 0x07:  # undefined
            r, pos = _uleb(buf, pos)
            _set_reg(st, r, ("undef", 0))
        elif op == 0x08:  # same_value
            r, pos = _uleb(buf, pos)
            _set_reg(st, r, ("same", 0))
        elif op == 0x09:  # register reg, reg2
            r, pos = _uleb(buf, pos)
            r2, pos = _uleb(buf, pos)
            _set_reg(st, r, ("same", 0) if r == r2 else ("other", 0))
        elif op == 0x0A:  # remember_state
            stack.append(st.copy())
        elif op == 0x0B:  # restore_state (the CFA is part of the saved state)
            if stack:
                s = stack.pop()
                st.cfa_reg, st.cfa_off, st.cfa_special, st.rbp, st.ra = (s.cfa_reg, s.cfa_off, s.cfa_special,
                                                                         s.rbp, s.ra)
        elif op == 0x10:  # expression reg, block
            r, pos = _uleb(buf, pos)
            n, pos = _uleb(buf, pos)
            _set_reg(st, r, _sp_expr(buf[pos:pos + n]))
            pos += n
        elif op == 0x16:  # val_expression reg, block
            r, pos = _uleb(buf, pos)
            n, pos = _uleb(buf, pos)
            _set_reg(st, r, ("other", 0))
            pos += n
        elif op in (0x14, 0x15):  # val_offset(_sf)
            r, pos = _uleb(buf, pos)
            _, pos = (_uleb if op == 0x14 else _sleb)(buf, pos)
            _set_reg(st, r, ("other", 0))
        elif op == 0x2E:  # GNU_args_size
            _, pos = _uleb(buf, pos)
        else:
            raise ValueError(f"unknown DW_CFA opcode {op:#x}")
    return loc


def _set_reg(st: _State, reg: int, rule: tuple[str, int]) -> None:
    if reg == _RBP:
        st.rbp = rule
    elif reg == _RIP:
        st.ra = rule


def _restore_reg(st: _State, init: _State, reg: int) -> None:
    if reg == _RBP:
        st.rbp = init.rbp
    elif reg == _RIP:
        st.ra = init.ra


def _entry_header(buf: bytes, pos: int) -> tuple[int, int, int, bool]:
    """(length-field end = body start, entry end, id field offset, 64-bit DWARF)."""
    length = struct.unpack_from("<I", buf, pos)[0]
    pos += 4
    is64 = False
    if length == 0xFFFFFFFF:
        length = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8
        is64 = True
    return pos, pos + length, pos, is64


def _parse_cie(buf: bytes, off: int, is_eh: bool) -> _Cie:
    body, end, _, is64 = _entry_header(buf, off)
    pos = body + (8 if is64 else 4)
    version = buf[pos]
    pos += 1
    aug_end = buf.index(b"\x00", pos)
    aug = buf[pos:aug_end].decode("ascii", "replace")
    pos = aug_end + 1
    addr_size = 8
    if "eh" in aug:
        pos += 8
    if not is_eh and version >= 4:
        addr_size = buf[pos]
        pos += 2  # address_size, segment_selector_size
    code_align, pos = _uleb(buf, pos)
    data_align, pos = _sleb(buf, pos)
    if version == 1:
        ra_reg = buf[pos]
        pos += 1
    else:
        ra_reg, pos = _uleb(buf, pos)
    fde_enc = 0x00
    has_z = aug.startswith("z")
    if has_z:
        alen, pos = _uleb(buf, pos)
        apos, aend = pos, pos + alen
        for ch in aug[1:]:
            if ch == "R":
                fde_enc = buf[apos]
                apos += 1
            elif ch == "L":
                apos += 1
            elif ch == "P":
                penc = buf[apos]
                apos += 1
                _, apos = _read_encoded(buf, apos, penc & 0x7F, 0, apply=False)
            elif ch in "SB":
                continue
            else:
                break
        pos = aend
    return _Cie(code_align, data_align, ra_reg, fde_enc, has_z, "S" in aug, pos, end, addr_size)


Fde = tuple[int, int, list[tuple[int, Rule]]]


def parse_frames(buf: bytes, section_vaddr: int, is_eh: bool) -> tuple[list[Fde], int]:
    """Every FDE of one section as (pc_begin, pc_end, rows); rows are (address, rule) in order."""
    cies: dict[int, tuple[_Cie, _State]] = {}
    fdes: list[Fde] = []
    pos = 0
    n = len(buf)
    count = 0
    while pos + 4 <= n:
        body, end, _, is64 = _entry_header(buf, pos)
        if end == body and not is64:  # zero terminator
            if is_eh:
                break
            pos = end
            continue
        if end > n:
            raise ValueError("truncated CFI entry")
        if is64:
            cie_id = struct.unpack_from("<Q", buf, body)[0]
            after_id = body + 8
            is_cie = cie_id == 0 if is_eh else cie_id == 0xFFFFFFFFFFFFFFFF
        else:
            cie_id = struct.unpack_from("<I", buf, body)[0]
            after_id = body + 4
            is_cie = cie_id == 0 if is_eh else cie_id == 0xFFFFFFFF
        if is_cie:
            pos = end
            continue
        cie_off = body - cie_id if is_eh else cie_id
        got = cies.get(cie_off)
        if got is None:
            cie = _parse_cie(buf, cie_off, is_eh)
            init = _State()
            _execute(buf, cie.init_pos, cie.init_end, init, cie, None, 0, None, cie.fde_encoding,
                     section_vaddr, is_eh)
            got = cies[cie_off] = (cie, init)
        cie, init = got
        p = after_id
        if is_eh:
            pc_begin, p = _read_encoded(buf, p, cie.fde_encoding, section_vaddr + p)
            pc_range, p = _read_encoded(buf, p, cie.fde_encoding & 0x0F, 0, apply=False)
        else:
            pc_begin, pc_range = struct.unpack_from("<QQ", buf, p)
            p += 16
        if cie.has_z:
            alen, p = _uleb(buf, p)
            p += alen
        count += 1
        if pc_range > 0:
            st = init.copy()
            rows: list[tuple[int, Rule]] = []
            loc = _execute(buf, p, end, st, cie, init, pc_begin, rows, cie.fde_encoding, section_vaddr, is_eh)
            rows.append((loc, st.rule(cie.signal)))
            fdes.append((pc_begin, pc_begin + pc_range, rows))
        pos = end
    return fdes, count


# ------------------------------------------------------------------------------ table building
def _compact(fdes: list[Fde]) -> tuple[array, array, list[Rule]]:
    """Merge FDE rows into one sorted table; NONE rows cover the gaps between FDEs."""
    fdes.sort(key=lambda f: (f[0], -f[1]))
    rule_index: dict[Rule, int] = {NO_CFI: 0}
    rules: list[Rule] = [NO_CFI]
    starts = array("Q")
    ids = array("H")
    covered_to = 0

    def put(addr: int, rule: Rule) -> None:
        rid = rule_index.get(rule)
        if rid is None:
            rid = rule_index[rule] = len(rules)
            rules.append(rule)
            if rid > 0xFFFF:
                raise ValueError("more than 65535 distinct unwind rules")
        if starts and starts[-1] == addr:
            ids[-1] = rid
            if len(ids) > 1 and ids[-2] == rid:
                starts.pop()
                ids.pop()
            return
        if ids and ids[-1] == rid:
            return
        starts.append(addr)
        ids.append(rid)

    for lo, hi, rows in fdes:
        if hi <= covered_to:
            continue  # entirely inside an earlier FDE (duplicate); the first one wins
        lo = max(lo, covered_to)
        if starts and lo > covered_to:
            put(covered_to, NO_CFI)
        for i, (loc, rule) in enumerate(rows):
            nxt = rows[i + 1][0] if i + 1 < len(rows) else hi
            if nxt <= lo or loc >= hi:
                continue
            put(max(loc, lo), rule)
        covered_to = hi
    if starts:
        put(covered_to, NO_CFI)
    return starts, ids, rules


def build_table(image: ElfImage) -> UnwindTable:
    """Parse ``.eh_frame`` (and ``.debug_frame`` for ranges it does not cover) of one object."""
    fdes: list[Fde] = []
    sources: list[str] = []
    count = 0
    eh = image.sections.get(".eh_frame")
    if eh is not None and eh.type != "SHT_NOBITS" and eh.size:
        got, c = parse_frames(image.section_bytes(eh), eh.vaddr, True)
        fdes.extend(got)
        count += c
        sources.append(".eh_frame")
    dbg = image.sections.get(".debug_frame")
    if dbg is not None and dbg.type != "SHT_NOBITS" and dbg.size:
        got, c = parse_frames(image.section_bytes(dbg), 0, False)
        # .eh_frame wins where both describe an address: append after, and _compact keeps the first.
        eh_ranges = sorted((lo, hi) for lo, hi, _ in fdes)
        fdes.extend(f for f in got if not _overlaps(eh_ranges, f[0], f[1]))
        count += c
        sources.append(".debug_frame")
    starts, ids, rules = _compact(fdes)
    return UnwindTable(image.build_id(), image.path, starts, ids, rules, count, tuple(sources))


def _overlaps(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    i = bisect_right(ranges, (lo, 1 << 64)) - 1
    if i >= 0 and ranges[i][1] > lo:
        return True
    return i + 1 < len(ranges) and ranges[i + 1][0] < hi


def cache_key(image: ElfImage) -> str:
    """Build-id where there is one (shared by every copy of the object), else the content hash."""
    bid = image.build_id()
    return f"b{bid}-{len(image.data)}" if bid else f"h{image.content_hash}"


def load_table(path: str | os.PathLike[str], cache: AnalysisCache | None = None,
               image: ElfImage | None = None) -> UnwindTable:
    """The unwind table of the ELF at ``path``, from the cache when it has it."""
    img = image if image is not None else ElfImage(os.fspath(path))
    cache = cache if cache is not None else AnalysisCache()
    key = cache_key(img)
    plain = cache.load(CACHE_KIND, key)
    if isinstance(plain, dict) and plain.get("format") == TABLE_FORMAT:
        table = UnwindTable.from_plain(plain)
        table.path = img.path
        return table
    table = build_table(img)
    cache.store(CACHE_KIND, key, table.to_plain())
    return table
