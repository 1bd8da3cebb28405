"""ELF -> CallGraph: the analysis pipeline (functions, exact disassembly, PLT, address-taken, roots)."""

from __future__ import annotations

import gc
import re
import struct
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from elftools.elf.relocation import RelocationSection

from ccprofd.callgraph.disasm import Branch, Cs, SweepResult, csweep, first_non_padding, make_disassembler
from ccprofd.callgraph.functions import FunctionInfo, FunctionTable
from ccprofd.callgraph.model import SITE_KINDS, BinaryInfo, CallGraph, GraphRows
from ccprofd.callgraph.parallel import sweep_functions
from ccprofd.elf.addrspace import AddressSpace
from ccprofd.elf.image import ElfImage
from ccprofd.elf.plt import PltResolver

Progress = Callable[[str, int, int], None]

R_X86_64_64 = 1
R_X86_64_GLOB_DAT = 6
R_X86_64_RELATIVE = 8
_DATA_SKIP_PREFIXES = (".eh_frame", ".gcc_except_table", ".interp", ".note", ".gnu", ".dyn", ".rela",
                       ".rel.", ".hash", ".comment", ".debug")


def analyze_image(image: ElfImage, progress: Progress | None = None) -> CallGraph:
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the analysis allocates ~10^6 objects and frees none: cyclic GC passes are pure cost
    try:
        return _analyze(image, progress)
    finally:
        if gc_was_enabled:
            gc.enable()


def _analyze(image: ElfImage, progress: Progress | None) -> CallGraph:
    t0 = time.perf_counter()
    table = FunctionTable(image)
    plt = PltResolver(image)
    md = make_disassembler()

    parts = _sweep_all(image, table, md, plt, progress)
    code_refs = [r for start in table.starts for r in parts[start].code_refs]
    owner = _fold_fragments(image, table, parts)
    binary = BinaryInfo(
        path=image.path, build_id=image.build_id(), content_hash=image.content_hash, pie=image.pie,
        elf_type=image.elf_type, entry=image.entry,
        text_bytes=sum(s.size for s in image.code_sections()))
    graph = GraphRows()

    fragments: dict[int, list[tuple[int, int]]] = {}
    for frag, own in owner.items():
        fragments.setdefault(own, []).append((frag, table.by_start[frag].end))
    for start in table.starts:
        if start in owner:
            continue
        fn = table.by_start[start]
        graph.add_function(start, fn.name, addr=start, size=fn.end - start, aliases=fn.aliases,
                           fragments=sorted(fragments.get(start, [])))

    externals: dict[str, int] = {}

    def external(name: str) -> int:
        if name not in externals:
            node = -2 - len(externals)
            externals[name] = node
            graph.add_function(node, name, kind="external")
        return externals[name]

    if csweep is not None:
        def plt_node(tgt: int) -> int:
            return external(plt.resolve(tgt) or f"plt_{tgt:x}")

        starts_q = array("Q", table.starts)
        ends_q = array("Q", (table.by_start[s].end for s in table.starts))
        plt_q = array("Q", (a for r in plt.ranges() for a in r))
        sites, out = graph.sinks()
        branches = [parts[s].branches for s in table.starts]
        csweep.site_rows(branches, table.starts, starts_q, ends_q, owner, plt_q, plt_node, SITE_KINDS, sites,
                         out)
    else:
        _site_rows(table, parts, owner, plt, graph, external)
    del parts

    _mark_roots(graph, image, table, code_refs, owner)
    return CallGraph.from_rows(binary, graph, time.perf_counter() - t0)


def _site_rows(table: FunctionTable, parts: dict[int, SweepResult], owner: dict[int, int], plt: PltResolver,
               graph: GraphRows, external: Callable[[str], int]) -> None:
    """The site rows of every branch (the reference of csweep.site_rows, and its fallback)."""
    by_start, containing_of, in_plt, add_call = table.by_start, table.containing, plt.in_plt, graph.add_call
    for start in table.starts:
        part = parts[start]
        end = table.by_start[start].end
        own = owner.get(start, start)
        for b in part.branches:
            if start <= b.address < end:  # swept from this function's range: its own branch
                caller = own
            else:
                containing = table.containing(b.address)
                if containing is None:
                    continue  # cannot happen: every swept byte belongs to a function range
                caller = owner.get(containing.start, containing.start)
            site = _site_row(b, caller, by_start, containing_of, in_plt, plt, owner, external)
            if site is not None:
                add_call(site)
        part.branches = []  # freed as the rows grow: node's branches and rows are ~100 MB each


def _sweep_all(image: ElfImage, table: FunctionTable, md: Cs, plt: PltResolver,
               progress: Progress | None) -> dict[int, SweepResult]:
    """Sweep every function; grow the table from gaps and call targets until it is stable.

    Only functions whose [start, end) changed are swept again, so discovering a function that
    has neither symbol nor FDE costs one more sweep of a few functions, not of the whole binary.
    """
    done: dict[int, tuple[int, SweepResult]] = {}
    # What each swept part contributes to the splitting references (its code references and its
    # jumps out of its own range): computed once when it is swept, not again every round.
    contributes: dict[int, tuple[list[int], Sequence[int]]] = {}
    gap_starts: dict[tuple[int, int], int | None] = {}
    pointers: set[int] = set()
    candidates: Iterable[int] = table.starts  # round 1: every function; then those whose end moved

    gaps: list[tuple[int, int]] = []

    def scan_gaps() -> None:
        """The gaps, and the first instruction of each not looked at yet: the table does not change
        during a sweep, so this runs while a forked worker sweeps."""
        gaps[:] = table.gaps()
        for lo, hi in gaps:
            if (lo, hi) not in gap_starts:  # a gap's bytes do not change: looked at once, not every round
                gap_starts[lo, hi] = _first_non_padding(md, image.bytes_at(lo, hi - lo), lo)

    def first_round_meanwhile() -> None:
        pointers.update(_code_pointers_in_data(image))
        scan_gaps()

    for _round in range(50):
        todo = [(s, table.by_start[s].end) for s in candidates
                if done.get(s, (-1,))[0] != table.by_start[s].end]
        table.touched.clear()
        swept = sweep_functions(image.bytes_at, md, todo, progress,
                                first_round_meanwhile if _round == 0 else scan_gaps)
        jumps_out, calls = _round_facts(todo, swept, table, plt)
        for (start, end), part, jumps in zip(todo, swept, jumps_out, strict=True):
            done[start] = (end, part)  # starts are never removed: no part goes stale
            contributes[start] = (part.code_refs, jumps)
        grown = False
        # Code no function covers: it starts at its first non-padding instruction.
        for lo, hi in list(gaps):  # as scan_gaps found them: the table did not change since
            first = gap_starts[lo, hi]
            if first is not None:
                grown |= table.add_start(first, weak=True)
        # Addresses taken in code or stored in init/fini arrays and relocations split such code.
        # So do jumps into it from another function (tail calls, e.g. crtstuff's frame_dummy).
        refs = pointers.union(*(refs_of for pair in contributes.values() for refs_of in pair))
        for r in _refs_in(sorted(refs), [*gaps, *((s, table.by_start[s].end) for s in table.weak_starts)]):
            holder = table.containing(r)
            if holder is not None and holder.weak and holder.start != r:
                grown |= table.add_start(r, weak=True)
        # Call targets that are not known function starts.  Only the parts swept this round: an
        # older part's targets were added when it was swept (starts are never removed) or are
        # not code (PLT stubs, addresses outside the code sections), so they add nothing again.
        for t in calls:
            grown |= table.add_start(t)
        if not grown:
            break
        candidates = sorted(table.touched)
    if progress is not None:
        progress("disassembling", len(table.starts), len(table.starts))
    return {start: done[start][1] for start in table.starts}


def _round_facts(todo: list[tuple[int, int]], swept: list[SweepResult], table: FunctionTable,
                 plt: PltResolver) -> tuple[list[Sequence[int]], list[int]]:
    """The targets of each swept part's direct unconditional jumps out of its own range, and the
    direct call targets (in branch order) that are neither known starts nor PLT stubs."""
    if csweep is not None:
        ranges = array("Q", (a for r in todo for a in r))
        plt_q = array("Q", (a for r in plt.ranges() for a in r))
        starts = array("Q", table.starts)
        jumps, calls = csweep.round_facts([p.branches for p in swept], ranges, starts, plt_q)
        return jumps, calls
    jumps_out: list[Sequence[int]] = []
    for (start, end), part in zip(todo, swept, strict=True):
        jumps_out.append([b.target for b in part.branches if not b.is_call and not b.conditional
                          and b.target is not None and not start <= b.target < end])
    calls = [b.target for part in swept for b in part.branches if b.is_call and b.target is not None
             and b.target not in table.by_start and not plt.in_plt(b.target)]
    return jumps_out, calls


def _refs_in(ordered: list[int], regions: list[tuple[int, int]]) -> list[int]:
    """The references of ``ordered`` (sorted) inside ``regions``, in order.

    Only a reference inside a weak function or in code no function covers (a gap) can split
    anything: a function found by symbols or CFI is never split, and splitting a weak function only
    ever covers its own range and the gap after it.  So the references are looked up region by
    region (node: ~70k gaps and weak functions) instead of one by one (~500k)."""
    if csweep is not None:
        found: list[int] = csweep.refs_in(ordered, regions)
        return found
    out: list[int] = []
    last = -1
    for lo, hi in sorted(regions):
        lo = max(lo, last)  # weak functions found in a gap lie inside it: each address once
        if hi <= lo:
            continue
        out += ordered[bisect_left(ordered, lo):bisect_left(ordered, hi)]
        last = hi
    return out


#: Gaps made of one padding byte alone (node: ~70k of them, each disassembled every round): int3,
#: the one-byte nop, zero fill (``00 00`` is ``add byte ptr [rax], al``, a lone 00 a ``.byte``).
_UNIFORM_PADDING = (b"\xcc", b"\x90", b"\x00")


def _first_non_padding(md: Cs, code: bytes, base: int) -> int | None:
    """:func:`first_non_padding`, without disassembling a gap that is one padding byte repeated."""
    if code and code[:1] in _UNIFORM_PADDING and not code.strip(code[:1]):
        return None
    return first_non_padding(md, code, base)


def _code_pointers_in_data(image: ElfImage) -> set[int]:
    """Definite code pointers: init/fini array entries and RELATIVE relocation addends."""
    found: set[int] = set()
    for name in (".init_array", ".fini_array", ".preinit_array"):
        sec = image.sections.get(name)
        if sec is not None and sec.type != "SHT_NOBITS":
            words = array("Q")
            body = image.section_bytes(sec)
            words.frombytes(body[:len(body) - len(body) % 8])
            found.update(words)
    for rsec in image.elf.iter_sections():
        if isinstance(rsec, RelocationSection) and rsec.is_RELA():
            found.update(addend for _off, _sym, rtype, addend in image.relocations(rsec)
                         if rtype == R_X86_64_RELATIVE)
    return {a for a in found if image.addrspace.is_executable(a)}


def _fold_fragments(image: ElfImage, table: FunctionTable, parts: dict[int, SweepResult]) -> dict[int, int]:
    """Map each fragment start to its owner: the function that jumps into its range.

    Most fragments are entered by a direct jump; cold switch cases are entered only through a jump
    table, so fragments still without an owner are looked up in the tables of indirect jumps.
    """
    frag_starts = {s for s, fn in table.by_start.items() if fn.fragment}
    entered_from: dict[int, int] = {}
    if csweep is not None and list(parts) == table.starts:
        fns = [table.by_start[s] for s in table.starts]
        for dest_start, start in csweep.fragment_entries(
                [p.branches for p in parts.values()], table.starts, array("Q", table.starts),
                array("Q", (fn.end for fn in fns)), bytes(fn.fragment for fn in fns)):
            entered_from.setdefault(dest_start, start)
    else:
        for start, part in parts.items():
            end = table.by_start[start].end
            for b in part.branches:
                if b.is_call or b.target is None or start <= b.target < end:
                    continue  # calls, indirect jumps and jumps inside the function itself
                # gcc groups several cold blocks in one fragment: hot code may jump to any of them.
                dest = table.containing(b.target)
                if dest is not None and dest.fragment and dest.start != start:
                    entered_from.setdefault(dest.start, start)
    missing = frag_starts - entered_from.keys()
    if missing:
        for frag, src in _jump_table_entries(image, parts, missing).items():
            entered_from.setdefault(frag, src)
    owner: dict[int, int] = {}
    for frag, first in entered_from.items():
        src, seen = first, {frag}
        while src in frag_starts and src in entered_from and src not in seen:  # fragment of a fragment
            seen.add(src)
            src = entered_from[src]
        if src not in frag_starts:
            owner[frag] = src
    return owner


_ABS_TABLE = re.compile(r"\[(?:\w+ \+ )?\w+\*8 \+ (0x[0-9a-f]+)\]$")
_MAX_TABLE_ENTRIES = 4096


def _jump_table_entries(image: ElfImage, parts: dict[int, SweepResult], wanted: set[int]) -> dict[int, int]:
    """Which function's jump table holds each wanted code address.

    Absolute tables (non-PIE): ``jmp qword ptr [reg*8 + base]``, 8-byte code addresses at base.
    Relative tables (PIE): a ``lea reg, [rip + base]`` in a function with a register jump, 4-byte
    offsets from base.  A table is read until an entry no longer lands in executable code.
    """
    found: dict[int, int] = {}
    space = image.addrspace
    executable: dict[int, bool] = {}  # is_executable per address, for the tables read again and again
    segments = _segments_q(space)
    if csweep is not None:  # the operands of each part's indirect jumps, None for most parts
        operands = csweep.indirect_jumps([p.branches for p in parts.values()])
    else:
        operands = [[b.operand for b in p.branches if not b.is_call and b.target is None] or None
                    for p in parts.values()]
    for (start, part), jumps in zip(parts.items(), operands, strict=True):
        if not jumps:
            continue
        for operand in jumps:
            m = _ABS_TABLE.search(operand)
            if m:
                for word in _table_words(image, int(m.group(1), 16), 8, executable, segments):
                    if word in wanted:
                        found.setdefault(word, start)
        if image.elf_type != "DYN" or not any("ptr" not in operand for operand in jumps):
            continue  # relative tables are what position-independent code uses
        bases = csweep.data_refs_of(part.code_refs, segments) if csweep is not None else None
        if bases is None:
            bases = [base for base in part.code_refs
                     if not space.is_executable(base) and space.segment_of(base) is not None]
        for base in bases:
            for target in _table_words(image, base, 4, executable, segments):
                if target in wanted:
                    found.setdefault(target, start)
    return found


_WORDS = {8: struct.Struct("<Q"), 4: struct.Struct("<i")}


def _segments_q(space: AddressSpace) -> array[int]:
    """The (vaddr, memsz, flags) of each segment, in ``space``'s order, for csweep.table_words."""
    return array("Q", (v for s in space.segments for v in (s.vaddr, s.memsz, s.flags)))


def _table_words(image: ElfImage, base: int, width: int, executable: dict[int, bool],
                 segments: array[int] | None = None) -> list[int]:
    """The code addresses of the jump table at ``base``: 8-byte absolute addresses (``width`` 8) or
    4-byte offsets from ``base`` (``width`` 4), up to the first entry that is not backed by file
    bytes or does not land in executable code, at most _MAX_TABLE_ENTRIES.

    The entries are unpacked from one slice of the file, for as long as they lie in ``base``'s
    segment: reading each through ``bytes_at`` (a segment lookup per entry) made the tables of
    python3.11 cost more than its disassembly."""
    space = image.addrspace
    out: list[int] = []
    seg = space.segment_of(base)
    if seg is None or base - seg.vaddr >= seg.filesz:
        return out
    off = seg.offset + (base - seg.vaddr)
    # entries starting in this segment's file bytes and wholly inside the file
    room = min(seg.vaddr + seg.filesz - base + width - 1, len(image.data) - off) // width
    n = min(_MAX_TABLE_ENTRIES, max(room, 0))
    relative = width == 4
    if csweep is not None:
        if segments is None:
            segments = _segments_q(space)
        got = csweep.table_words(image.data[off:off + n * width], base, width, segments)
        if got is not None:
            if len(got) < n:
                return got  # stopped at an entry that is no code address
            out = got
    for (value,) in _WORDS[width].iter_unpack(image.data[off + len(out) * width:off + n * width]):
        word = base + value if relative else value
        ok = executable.get(word)
        if ok is None:
            ok = executable[word] = space.is_executable(word)
        if not ok:
            return out
        out.append(word)
    # past the segment (or the file): entry by entry, as bytes_at reads them
    for i in range(n, _MAX_TABLE_ENTRIES):
        try:
            (value,) = _WORDS[width].unpack(image.bytes_at(base + width * i, width))
        except (ValueError, struct.error):
            break
        word = base + value if relative else value
        if not space.is_executable(word):
            break
        out.append(word)
    return out


def _site_row(b: Branch, caller: int, by_start: dict[int, FunctionInfo],
              containing: Callable[[int], FunctionInfo | None], in_plt: Callable[[int], bool],
              plt: PltResolver, owner: dict[int, int], external: Callable[[str], int]) -> list[Any] | None:
    """The site row (as in ``CallGraph.to_dict()["sites"]``) of one branch, None if it is no call site.

    Called for every branch (node: ~500k), so written flat: the tuple unpacked once, no closure."""
    address, length, raw, is_call, _conditional, tgt, operand = b
    if tgt is None:
        return [caller, address, address + length, length, raw.hex(), "indirect", None, operand, not is_call]
    if in_plt(tgt):
        node = external(plt.resolve(tgt) or f"plt_{tgt:x}")
        if is_call:
            return [caller, address, address + length, length, raw.hex(), "plt", node, None, False]
        return [caller, address, address + length, length, raw.hex(), "tail", node, None, True]
    if is_call:
        # a function's start is its own containing function (ends lie past starts): no bisect
        callee_fn = by_start.get(tgt) or containing(tgt)
        if callee_fn is None:  # a call out of the code sections: treat like an unknown target
            return [caller, address, address + length, length, raw.hex(), "indirect", None, operand, False]
        callee = owner.get(callee_fn.start, callee_fn.start)
        return [caller, address, address + length, length, raw.hex(), "direct", callee, None, False]
    # A jump: a tail call when it lands on another function's entry (not on a fragment it owns).
    if tgt not in by_start or tgt in owner or tgt == caller:
        return None
    return [caller, address, address + length, length, raw.hex(), "tail", tgt, None, True]


def _mark_roots(graph: GraphRows, image: ElfImage, table: FunctionTable, code_refs: list[int],
                owner: dict[int, int]) -> None:
    # Fragments run in their owner's frame: a pointer to one (a jump-table entry) is no entry point.
    starts = {s for s, fn in table.by_start.items() if s not in owner and not fn.fragment}
    taken = {a for a in code_refs if a in starts}
    taken |= _data_refs(image, starts)
    tags = image.dynamic_tags()
    for t in ("DT_INIT", "DT_FINI"):
        if tags.get(t) in starts:
            taken.add(tags[t])
    taken |= {s for s in starts if table.by_start[s].exported}
    for node in taken:
        graph.set_address_taken(node)
    roots = set(taken)
    entry_fn = table.containing(image.entry)
    if entry_fn is not None:
        roots.add(owner.get(entry_fn.start, entry_fn.start))
    for s in starts:
        fn = table.by_start[s]
        if fn.name == "main" or "main" in fn.aliases:
            roots.add(s)
    for r in sorted(roots):
        graph.add_root(r)


def _data_refs(image: ElfImage, starts: set[int]) -> set[int]:
    """Function addresses stored in data: relocations, and pointer-sized words of data sections."""
    found: set[int] = set()
    for sec in image.elf.iter_sections():
        if not isinstance(sec, RelocationSection) or not sec.is_RELA():
            continue
        link = sec["sh_link"]
        for _off, sym_index, rtype, addend in image.relocations(sec):
            if rtype == R_X86_64_RELATIVE:
                if addend in starts:
                    found.add(addend)
            elif rtype in (R_X86_64_64, R_X86_64_GLOB_DAT) and link and sym_index:
                _name, value, defined = image.symbol_at(link, sym_index)
                val = value + addend
                if defined and val in starts:
                    found.add(val)
    for dsec in image.sections.values():
        if (dsec.executable or not (dsec.flags & 0x2) or dsec.type == "SHT_NOBITS" or dsec.size < 8
                or dsec.name.startswith(_DATA_SKIP_PREFIXES)):
            continue
        skip = (-dsec.vaddr) % 8
        lo = dsec.offset + min(skip, dsec.size)
        hi = lo + (dsec.offset + dsec.size - lo) // 8 * 8
        if hi > lo:  # the words read in place: no copy of node's tens of MB of data sections
            with memoryview(image.data) as data, data[lo:hi] as body, body.cast("Q") as words:
                found |= starts.intersection(words)
    return found


__all__ = ["analyze_image"]
