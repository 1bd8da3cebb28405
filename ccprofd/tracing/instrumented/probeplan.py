"""The probe plan: which instructions of the target carry a uprobe in instrumented mode, and why.

Input: the call graph, its encoding plan and the ELF image (for file offsets, the CFA rule at each
probed site, ``syscall`` instructions and GOT slots).  Output: a plain, JSON-able
:class:`ProbePlan`, the single input of the BPF loader (:mod:`ccprofd.tracing.instrumented.loader`) and, with
the encoding plan, of symbolisation (:mod:`ccprofd.tracing.instrumented.symbolize`).

Probe kinds (one BPF program each):

``site``   a ``call`` instruction: set the edge's acycID bits (``acyc``), push its recID code
           (``cyclic``), or record that the thread leaves the binary there (``plt_exit``: a PLT call,
           or ``plt_exit|indirect``: a ``call [rip+GOT]`` of an import) so that a syscall in the
           library is attributed to the calling function.
``tail``   a tail ``jmp``: the same, for tail edges and tail jumps into the PLT.
``entry``  the entry of a root function (main, thread start routines, callbacks, signal handlers,
           exported functions): entered from outside code it starts a segment (or, on a thread with
           no context yet, takes the root edge); entered from an indirect call site of the binary it
           starts a segment at that site.  Indirect call sites themselves need no probe: the entry
           probe identifies them by the return address on the stack.

``site``/``tail`` with reason ``cut`` only: a call or tail jump whose edge has the zero code, into a
function from which a sample point is reachable.  It changes no id bits and pushes nothing; it only
drops the pieces recorded below the caller's CFA (calls that have returned).  Without it a dead
call's piece whose return-address word survives (the frames reached next do not write it) stays in
the state when every later call on the path has the zero code, and the sample decodes to a context
that never happened (``/usr/bin/find``: a call in ``sub_c080``, returned before the traversal,
surfacing as ``sub_7890``'s call at 0x7c13).  Liveness rests on "every call from a frame G cuts
the state at G's CFA", so every call on a path to a sample point is an event.

What is *not* probed (and what keeps the trap count down): edges into functions from which no
sample point is reachable (for syscall sampling: functions that make no library call other than
known pure ones, contain no ``syscall`` instruction and no indirect call); calls to pure library
functions (``strlen``...); the ELF entry point.

Schema (``PROBE_PLAN_VERSION`` 4: entry probes moved past instructions uprobes refuse, see
:mod:`~ccprofd.tracing.instrumented.uprobe_insn`, and a plan with a refused site probe not built, so
a cached plan from before that check is rebuilt), all addresses ELF virtual addresses:
``binary`` {path, build_id, identity}; ``encoding`` {scheme, key}; ``acyc_words``;
``rec_code_bits``; ``names`` {node: name}; ``functions`` [[start, end, node]] sorted (fragments are
extra ranges of their owner); ``callsites`` [[vaddr, length, kind, caller, target|None, is_jump,
instruction bytes hex]] (every call/jmp site of the graph, indexed by *callsite id*); ``probes``
[[kind, vaddr, file offset, reasons, plan site id|-1, callsite id|-1, cfa reg|-1, cfa offset, node,
cond]] indexed by *probe id* (the attach cookie), ``node`` being the caller for site/tail probes and
the entered function for entry probes, ``cond`` the x86 condition code of a conditional tail jump
(-1: unconditional); ``scope`` regex or None; ``stats``.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.elf.cfi import RBP, RSP, cfa_rules
from ccprofd.elf.errors import BinaryError, CfiError
from ccprofd.elf.image import ElfImage
from ccprofd.encode.plan import COL, REASON_BITS
from ccprofd.persist.cache import CACHE_FORMAT as ANALYSIS_FORMAT
from ccprofd.persist.cache import AnalysisCache
from ccprofd.tracing.instrumented.uprobe_insn import moved_entry, refused

PROBE_PLAN_FORMAT = "ccprofd-probe-plan"
PROBE_PLAN_VERSION = 4

R_ACYC = REASON_BITS["acyc"]
R_CYCLIC = REASON_BITS["cyclic"]
R_PLT_EXIT = REASON_BITS["plt_exit"]
R_OUTSIDE_ENTRY = REASON_BITS["outside_entry"]
R_INDIRECT = REASON_BITS["indirect"]
R_SCOPE = 32  # entry of a --scope function: its callers are unknown (anchor segment)
R_CUT = 64  # a zero-code call/tail jump into a function that reaches a sample point: cut only
REASONS = {**REASON_BITS, "scope": R_SCOPE, "cut": R_CUT}

PROBE_KINDS = ("site", "tail", "entry")
PROBE_COLUMNS = ["kind", "vaddr", "offset", "reasons", "plan_site", "callsite", "cfa_reg", "cfa_off", "node",
                 "cond"]
PCOL = {name: i for i, name in enumerate(PROBE_COLUMNS)}
CALLSITE_COLUMNS = ["vaddr", "length", "kind", "caller", "target", "is_jump", "bytes"]
CCOL = {name: i for i, name in enumerate(CALLSITE_COLUMNS)}

# Library functions that neither enter the kernel nor call back into the program: a call to one
# can never be interrupted by a syscall sample, so it needs no exit probe under syscall sampling.
PURE_LIBRARY_FUNCTIONS = frozenset({
    "memcpy", "memmove", "memset", "memcmp", "memchr", "memrchr", "rawmemchr", "bcmp", "bzero", "mempcpy",
    "strlen", "strnlen", "strcmp", "strncmp", "strcasecmp", "strncasecmp", "strcpy", "strncpy", "stpcpy",
    "stpncpy", "strcat", "strncat", "strchr", "strrchr", "strchrnul", "strstr", "strcasestr", "strspn",
    "strcspn", "strpbrk", "strtok_r", "strdup_unused", "wcslen", "wcscmp", "wcsncmp", "wcscpy", "wcschr",
    "wmemcpy", "wmemset", "wmemcmp", "wmemchr", "__memcpy_chk", "__memmove_chk", "__memset_chk",
    "__strcpy_chk", "__stpcpy_chk", "__strcat_chk", "__strncpy_chk", "__mempcpy_chk", "__wmemcpy_chk",
    "__wmemset_chk", "__ctype_b_loc", "__ctype_tolower_loc", "__ctype_toupper_loc", "__errno_location",
    "toupper", "tolower", "isalpha", "isdigit", "isspace", "isalnum", "isupper", "islower", "isxdigit",
    "ispunct", "isprint", "abs", "labs", "llabs", "div", "ldiv", "strtol", "strtoul", "strtoll", "strtoull",
    "atoi", "atol", "atoll", "sqrt", "sqrtf", "floor", "floorf", "ceil", "ceilf", "fabs", "fabsf", "fmod",
    "round", "trunc", "lround", "llround", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "exp",
    "exp2", "log", "log2", "log10", "pow", "hypot", "frexp", "ldexp", "modf"
})


class ProbePlanError(ValueError):
    """The inputs do not fit together (plan of another binary, unknown scope...)."""


@dataclass(slots=True)
class ProbePlan:
    """See the module docstring for the meaning of each field."""

    binary: dict[str, Any]
    encoding: dict[str, Any]
    acyc_words: int
    rec_code_bits: int
    names: dict[int, str]
    functions: list[list[int]]
    callsites: list[list[Any]]
    probes: list[list[Any]]
    sample_points: str = "syscalls"
    scope: str | None = None
    in_scope: list[int] | None = None
    imports: dict[int, str] = field(default_factory=dict)
    tail_entries: list[list[int]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    format: str = PROBE_PLAN_FORMAT
    version: int = PROBE_PLAN_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["names"] = {str(k): v for k, v in self.names.items()}
        d["imports"] = {str(k): v for k, v in self.imports.items()}
        return d

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> ProbePlan:
        if data.get("format") != PROBE_PLAN_FORMAT or data.get("version") != PROBE_PLAN_VERSION:
            raise ProbePlanError(f"probe plan format {data.get('format')!r} v{data.get('version')!r}, "
                                 f"expected {PROBE_PLAN_FORMAT!r} v{PROBE_PLAN_VERSION}")
        d = dict(data)
        d["names"] = {int(k): v for k, v in d["names"].items()}
        d["imports"] = {int(k): v for k, v in d.get("imports", {}).items()}
        return ProbePlan(**d)

    def probes_of_kind(self, kind: str) -> list[int]:
        return [i for i, p in enumerate(self.probes) if p[PCOL["kind"]] == kind]


class FunctionIndex:
    """Which analysed function holds an ELF virtual address, over a probe plan's ``functions`` rows
    ``[lo, hi, node]`` sorted by ``lo``.  A range may enclose later-starting ones (an owner folded
    with its fragments), so the search walks back from the nearest start, within 16 MiB."""

    def __init__(self, functions: Sequence[Sequence[int]]) -> None:
        self._rows = functions
        self._starts = [r[0] for r in functions]

    def at(self, vaddr: int) -> int | None:
        i = bisect_right(self._starts, vaddr) - 1
        while i >= 0:
            lo, hi, node = self._rows[i][:3]
            if lo <= vaddr < hi:
                return int(node)
            if vaddr - lo > 1 << 24:
                break
            i -= 1
        return None


# ------------------------------------------------------------------------------------- analysis
def syscall_functions(image: ElfImage, graph: CallGraph) -> set[int]:
    """Functions holding a ``syscall`` instruction (found by byte search, confirmed by
    disassembling the holding function from its start, so a 0f 05 inside another instruction does
    not count)."""
    ranges = sorted((d["addr"], d["addr"] + d["size"], n) for n, d in graph.graph.nodes(data=True)
                    if d["kind"] == "function" and d["size"] > 0)
    for n, d in graph.graph.nodes(data=True):
        for lo, hi in d.get("fragments") or []:
            ranges.append((lo, hi, n))
    ranges.sort()
    starts = [r[0] for r in ranges]
    from bisect import bisect_right

    from capstone import CS_ARCH_X86, CS_MODE_64, Cs  # imported here: a warm start needs no disassembler

    md = Cs(CS_ARCH_X86, CS_MODE_64)
    md.skipdata = True
    candidates: set[tuple[int, int, int]] = set()
    for sec in image.code_sections():
        body = image.section_bytes(sec)
        pos = body.find(b"\x0f\x05")
        while pos >= 0:
            va = sec.vaddr + pos
            i = bisect_right(starts, va) - 1
            if i >= 0 and va < ranges[i][1]:
                candidates.add(ranges[i])
            pos = body.find(b"\x0f\x05", pos + 1)
    found: set[int] = set()
    for lo, hi, node in candidates:
        code = image.bytes_at(lo, hi - lo)
        if any(m == "syscall" for _a, _s, m, _o in md.disasm_lite(code, lo)):
            found.add(node)
    return found


_GOT_OPERAND = re.compile(r"^qword ptr \[rip(?: ([+-]) (0x[0-9a-f]+|\d+))?\]$")


def import_slots(image: ElfImage) -> dict[int, str]:
    """GOT slot vaddr -> imported symbol name (JUMP_SLOT / GLOB_DAT relocations with a symbol)."""
    with image.parsing("dynamic relocations"):
        return _import_slots(image)


def _import_slots(image: ElfImage) -> dict[int, str]:
    from elftools.elf.relocation import RelocationSection

    out: dict[int, str] = {}
    for sec in image.elf.iter_sections():
        if not isinstance(sec, RelocationSection) or not sec.is_RELA() or not sec["sh_link"]:
            continue
        symtab = image.elf.get_section(sec["sh_link"])
        if not hasattr(symtab, "get_symbol"):
            continue
        for rel in sec.iter_relocations():
            if rel["r_info_sym"] == 0:
                continue
            sym = symtab.get_symbol(rel["r_info_sym"])
            if sym.name and sym["st_shndx"] == "SHN_UNDEF":
                out.setdefault(rel["r_offset"], sym.name)
    return out


def got_target(operand: str | None, address: int, length: int, slots: Mapping[int, str]) -> str | None:
    """The import a ``call qword ptr [rip + d]`` goes through, or None."""
    if not operand:
        return None
    m = _GOT_OPERAND.match(operand.strip())
    if not m:
        return None
    disp = int(m.group(2), 0) if m.group(2) else 0
    slot = address + length + (-disp if m.group(1) == "-" else disp)
    return slots.get(slot)


def jump_condition(code: bytes) -> int:
    """The x86 condition code (0-15) of a conditional jump (``jcc rel8``/``jcc rel32``), -1 for any
    other instruction.  A tail call can be conditional (``je other_function``): its probe fires
    whether or not the branch is taken, so the BPF program evaluates the condition on EFLAGS."""
    i = 0
    while i < len(code) and code[i] in (0x2E, 0x3E, 0xF2):  # branch hints, bnd prefix
        i += 1
    if i < len(code) and 0x70 <= code[i] <= 0x7F:
        return code[i] & 0x0F
    if i + 1 < len(code) and code[i] == 0x0F and 0x80 <= code[i + 1] <= 0x8F:
        return code[i + 1] & 0x0F
    return -1


def _reaching(graph: CallGraph, seeds: set[int]) -> set[int]:
    """Functions from which a seed is reachable through direct and tail edges."""
    g = graph.graph
    found = set(seeds)
    todo = list(seeds)
    while todo:
        n = todo.pop()
        for u, _v in g.in_edges(n):
            if u != ROOT and u not in found:
                found.add(u)
                todo.append(u)
    return found


def _below(graph: CallGraph, tops: set[int]) -> set[int]:
    g = graph.graph
    found = set(tops)
    todo = list(tops)
    while todo:
        n = todo.pop()
        for _u, v in g.out_edges(n):
            if v not in found and g.nodes[v]["kind"] == "function":
                found.add(v)
                todo.append(v)
    return found


# ----------------------------------------------------------------------------------------- build
def build_probe_plan(graph: CallGraph, plan: Mapping[str, Any], image: ElfImage, *,
                     sample_points: str = "syscalls", scope: str | None = None) -> ProbePlan:
    """Choose the probes for ``plan`` (built from ``graph``) on ``image``.

    ``sample_points``: ``"syscalls"`` (prune edges from which no syscall can be reached) or
    ``"all"`` (CPU sampling: any instruction can be sampled, nothing is pruned).  ``scope``: a
    regular expression over function names; only the call graph below the matching functions is
    instrumented.
    """
    if sample_points not in ("syscalls", "all"):
        raise ProbePlanError(f"sample_points must be 'syscalls' or 'all', not {sample_points!r}")
    ident = plan.get("identity")
    b = graph.binary
    if plan["binary"].get("content_hash") != b.content_hash:
        raise ProbePlanError(f"encoding plan {ident} was not built for {b.path}")
    g = graph.graph
    names: dict[int, str] = {int(n): str(d["name"]) for n, d in g.nodes(data=True)}
    functions = {n for n in graph.functions()}
    entry_fn = _entry_function(graph)

    # Sample points and the functions from which one is reachable.
    slots = import_slots(image)
    seeds = set(syscall_functions(image, graph)) if sample_points == "syscalls" else set(functions)
    for s in graph.sites:
        if s.function == entry_fn:
            continue
        if s.kind in ("plt", "tail") and s.target is not None and g.nodes[s.target]["kind"] == "external":
            if sample_points == "all" or names[s.target] not in PURE_LIBRARY_FUNCTIONS:
                seeds.add(s.function)
        elif s.kind == "indirect" and not s.is_jump:
            imp = got_target(s.operand, s.address, s.length, slots)
            if imp is None or sample_points == "all" or imp not in PURE_LIBRARY_FUNCTIONS:
                seeds.add(s.function)
    reach = _reaching(graph, seeds)

    in_scope: set[int] = set(functions)
    scope_tops: set[int] = set()
    if scope is not None:
        try:
            rx = re.compile(scope)
        except re.error as exc:
            raise ProbePlanError(f"--scope {scope!r} is not a valid regular expression: {exc}") from None
        scope_tops = {n for n in functions if rx.search(names[n])}
        if not scope_tops:
            raise ProbePlanError(f"--scope {scope!r} matches no function of {b.path}")
        in_scope = _below(graph, scope_tops)

    # Call sites (indexed), and CFA rules at every call/jmp site we may probe.
    callsites: list[list[Any]] = []
    cs_index: dict[int, int] = {}
    for s in sorted(graph.sites, key=lambda s: s.address):
        if s.address in cs_index:
            continue
        cs_index[s.address] = len(callsites)
        callsites.append([s.address, s.length, s.kind, s.function, s.target, s.is_jump, s.bytes_hex])

    probes: list[list[Any]] = []
    stats = {"acyc": 0, "cyclic": 0, "plt_exit": 0, "got_exit": 0, "entry": 0, "scope_entry": 0,
             "cut_only": 0, "skipped_unreachable": 0, "skipped_pure": 0, "skipped_out_of_scope": 0}
    pending: list[tuple[str, int, int, int, int, int]] = []  # kind, vaddr, reasons, plan site, cs, node
    rows = plan["sites"]
    ci, ki, si, ri, kd = COL["caller"], COL["callee"], COL["site"], COL["reasons"], COL["kind"]
    for sid, row in enumerate(rows):
        caller, callee, site = row[ci], row[ki], row[si]
        if caller in (ROOT, entry_fn):
            continue
        if caller not in in_scope:
            stats["skipped_out_of_scope"] += 1
            continue
        kind = "tail" if row[kd] == "tail" else "site"
        external = g.nodes[callee]["kind"] == "external"
        if external:
            if sample_points == "syscalls" and names[callee] in PURE_LIBRARY_FUNCTIONS:
                stats["skipped_pure"] += 1
                continue
            pending.append((kind, site, R_PLT_EXIT, sid, cs_index[site], caller))
            stats["plt_exit"] += 1
            continue
        reasons = row[ri] & (R_ACYC | R_CYCLIC)
        if callee not in reach:
            stats["skipped_unreachable"] += 1
            continue
        if not reasons:
            # The edge adds nothing to the id, but the call is an event all the same: pieces recorded
            # below the caller's CFA belong to calls that have returned, and without this cut they
            # survive when every later call on the path has the zero code (see the module docstring).
            pending.append((kind, site, R_CUT, sid, cs_index[site], caller))
            stats["cut_only"] += 1
            continue
        pending.append((kind, site, reasons, sid, cs_index[site], caller))
        stats["cyclic" if reasons & R_CYCLIC else "acyc"] += 1
    imports: dict[int, str] = {}
    for s in graph.sites:
        if (s.kind == "indirect" and not s.is_jump and s.function != entry_fn and s.function in in_scope):
            imp = got_target(s.operand, s.address, s.length, slots)
            if imp is not None:
                imports[cs_index[s.address]] = imp
            if imp is None or (sample_points == "syscalls" and imp in PURE_LIBRARY_FUNCTIONS):
                continue
            pending.append(("site", s.address, R_PLT_EXIT | R_INDIRECT, -1, cs_index[s.address], s.function))
            stats["got_exit"] += 1

    # Entry probes: roots from which a sample point is reachable (outside entries), and scope tops.
    root_site = {row[ki]: sid for sid, row in enumerate(rows) if row[ci] == ROOT}
    entries: dict[int, int] = {}
    for r in graph.roots():
        if r == entry_fn or g.nodes[r]["kind"] != "function" or r not in reach or r not in in_scope:
            continue
        entries[r] = R_OUTSIDE_ENTRY
    for t in scope_tops:
        entries[t] = entries.get(t, 0) | R_SCOPE
    for r, reasons in sorted(entries.items()):
        va = _entry_probe_address(image, g.nodes[r]["addr"])
        why = refused(image.bytes_at(va, 15))
        if why is not None:
            va = _moved_entry_probe(image, va, g.nodes[r], why)
            stats["entry_moved"] = stats.get("entry_moved", 0) + 1
        pending.append(("entry", va, reasons, root_site.get(r, -1), -1, r))
        stats["scope_entry" if reasons & R_SCOPE else "entry"] += 1

    # Which functions can reach an entry-probed root through direct tail jumps only: a return address
    # of a call to one of them on the stack at the root's entry is that call's own (encoded) path.
    tail_entries: list[list[int]] = []
    for r in sorted(entries):
        seen: set[int] = set()
        todo = [r]
        while todo:
            n = todo.pop()
            for u, _v, kind in g.in_edges(n, data="kind"):
                if kind == "tail" and u != ROOT and u not in seen and u != r:
                    seen.add(u)
                    todo.append(u)
        tail_entries.extend([u, r] for u in sorted(seen))

    _check_site_probes(pending, callsites, names)
    site_vas = [p[1] for p in pending if p[0] != "entry"]
    eh = image.sections.get(".eh_frame")
    try:
        rules = cfa_rules(image.section_bytes(eh), eh.vaddr, site_vas) if eh is not None else {}
    except CfiError as exc:
        raise BinaryError(image.path, str(exc)) from None
    for kind, va, reasons, sid, cs, node in sorted(pending, key=lambda p: (p[1], p[0])):
        if kind == "entry":
            reg, off = RSP, 8
        else:
            rule = rules.get(va)
            reg, off = (rule.reg, rule.offset) if rule is not None and rule.reg in (RSP, RBP) else (-1, 0)
        cond = jump_condition(bytes.fromhex(callsites[cs][CCOL["bytes"]])) if kind == "tail" else -1
        probes.append([kind, va, image.addrspace.vaddr_to_offset(va), reasons, sid, cs, reg, off, node, cond])
    stats["probes"] = len(probes)
    stats["no_cfa"] = sum(1 for p in probes if p[PCOL["cfa_reg"]] < 0)
    stats["reaching_functions"] = len(reach)

    fn_ranges: list[list[int]] = []
    for n in functions:
        d = g.nodes[n]
        if d["size"] > 0:
            fn_ranges.append([d["addr"], d["addr"] + d["size"], n])
        for lo, hi in d.get("fragments") or []:
            fn_ranges.append([lo, hi, n])
    fn_ranges.sort()
    return ProbePlan(
        binary={"path": b.path, "build_id": b.build_id, "identity": ident, "pie": b.pie},
        encoding={"scheme": plan["scheme"], "key": plan.get("key")},
        acyc_words=int(plan["acyc_words"]), rec_code_bits=int(plan["rec_code_bits"]),
        names=names, functions=fn_ranges, callsites=callsites, probes=probes,
        sample_points=sample_points, scope=scope,
        in_scope=sorted(in_scope) if scope is not None else None, imports=imports,
        tail_entries=tail_entries, stats=stats)


PROBE_PLAN_CACHE_KIND = "probe-plan"


def probe_plan_cache_key(graph: CallGraph, plan: Mapping[str, Any], sample_points: str,
                         scope: str | None) -> str | None:
    """What a probe plan depends on: the encoding plan (its key covers the binary's identity and
    content, scheme and parameters), the graph it was built from (the analysis format and size), the
    binary's bytes (file offsets, CFA rules, ``syscall`` instructions: its content hash), the sample
    points and the scope; and the probe-plan format."""
    import hashlib

    if not plan.get("key") or plan["binary"].get("content_hash") != graph.binary.content_hash:
        return None
    blob = repr((plan["key"], graph.binary.content_hash, graph.number_of_nodes(), graph.number_of_edges(),
                 ANALYSIS_FORMAT, PROBE_PLAN_VERSION, sample_points, scope))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached_probe_plan(graph: CallGraph, plan: Mapping[str, Any], image: Callable[[], ElfImage],
                      cache: AnalysisCache, *, sample_points: str = "syscalls",
                      scope: str | None = None) -> ProbePlan:
    """:func:`build_probe_plan`, from ``cache`` when it holds the plan for these inputs (a warm start:
    no networkx graph, no disassembly, no ``.eh_frame`` pass), else built and stored atomically.
    ``image`` is called only when the plan is built.  A damaged entry is rebuilt."""
    key = probe_plan_cache_key(graph, plan, sample_points, scope)
    if key is not None:
        got = cache.load(PROBE_PLAN_CACHE_KIND, key)
        if isinstance(got, dict) and got.get("cache_key") == key:
            try:
                pp = ProbePlan.from_dict(got["plan"])
                if pp.binary.get("identity") == plan.get("identity") and \
                        pp.encoding.get("key") == plan.get("key"):
                    # keyed by content: the entry may have been made for a copy at another path,
                    # and the probes go on the file at this one
                    pp.binary["path"] = graph.binary.path
                    return pp
            except (KeyError, TypeError, ValueError, AttributeError):
                pass  # damaged: rebuilt below
    pp = build_probe_plan(graph, plan, image(), sample_points=sample_points, scope=scope)
    if key is not None:
        cache.store(PROBE_PLAN_CACHE_KIND, key, {"cache_key": key, "plan": pp.to_dict()})
    return pp


def _entry_function(graph: CallGraph) -> int | None:
    """The function holding the ELF entry point (``_start``): it only calls into libc's start-up,
    which enters ``main`` as an outside entry."""
    entry = graph.binary.entry
    for n in graph.functions():
        d = graph.graph.nodes[n]
        if d["addr"] <= entry < d["addr"] + d["size"]:
            return int(n)
    return None


def _check_site_probes(pending: Sequence[tuple[str, int, int, int, int, int]],
                       callsites: Sequence[Sequence[Any]], names: Mapping[int, str]) -> None:
    """Refuse the plan, in one line, when x86 uprobes would refuse one of its call/jmp site probes
    (uprobe_insn: e.g. ``cs call``, ``notrack call``): the kernel would fail the whole link only at
    attach, with a bare errno 524.  Unlike an entry probe, a site probe never moves: it must fire
    before its call or jump transfers control, and the instruction before it need not be the same
    point (a branch may land between them, the stack pointer may differ)."""
    for kind, va, _reasons, _sid, cs, node in pending:
        if kind == "entry":
            continue
        why = refused(bytes.fromhex(callsites[cs][CCOL["bytes"]]))
        if why is not None:
            name = names.get(node, f"sub_{node}")
            raise ProbePlanError(
                f"x86 uprobes refuse the {'tail jump' if kind == 'tail' else 'call'} of {name} at {va:#x} "
                f"({why}), which this plan must probe: trace this binary in unwind mode, or leave {name} "
                f"out of --scope")


_ENDBR64 = b"\xf3\x0f\x1e\xfa"
_PUSH_REG = frozenset({0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x56, 0x57})


def _moved_entry_probe(image: ElfImage, va: int, fn: Mapping[str, Any], why: str) -> int:
    """The entry probe of ``fn`` past its first instruction, refused for ``why`` (uprobe_insn), or a
    one-line error: a probe the kernel refuses fails the whole link, one placed elsewhere would be wrong."""
    end = int(fn["addr"]) + int(fn["size"])
    moved, why_not = moved_entry(image.bytes_at(va, end - va), va) if end > va else (None, "size unknown")
    if moved is None:
        raise ProbePlanError(
            f"x86 uprobes refuse the entry of {fn['name']} at {va:#x} ({why}) and the probe cannot move "
            f"past it ({why_not}): trace this binary in unwind mode, or leave {fn['name']} out of --scope")
    return moved


def _entry_probe_address(image: ElfImage, addr: int) -> int:
    """Where to probe a function's entry: after an ``endbr64`` when a ``push`` follows (the push is
    emulated by the kernel, the endbr64 would be single-stepped at ten times the cost); the stack
    pointer is the same at both."""
    head = image.bytes_at(addr, 6)
    if head[:4] == _ENDBR64 and (head[4] in _PUSH_REG or (head[4] == 0x41 and 0x50 <= head[5] <= 0x57)):
        return addr + 4
    return addr
