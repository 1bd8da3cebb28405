"""The anomaly model: which (syscall, exact calling context) pairs a target binary normally makes.

Input is the tracer's decoded sample (``{"time_ns", "pid", "tid", "event", "syscall", "complete",
"frames": [{"function", "module", "build_id", "analysed", "call_site", "return_address",
"tail_call"?}, ...]}``, frames outermost first).  A context is identified by its frames' (module,
function, call site) triples — the call site is what separates two calls of ``open`` from the same
function, which is the point of a calling-context model (Feng et al., S&P 2003) over a syscall-set
model.  Models are kept per target build-id: code addresses mean nothing across builds.

The model stores exact contexts only.  Looking up with recursion collapsed is a view computed at
lookup time (:func:`collapse_cycles`), so the same learned model can be evaluated both ways.
Call edges (:func:`context_edges`) are a second view computed at lookup time: a context is the chain
of edges "caller function at this call site -> callee function" from the outermost frame to the
syscall.  The ``edges`` granularity accepts an unseen context whose every edge was seen for that
syscall (a new combination of known calls); the file format does not change, because the edges of
a model are those of its stored contexts (a removed context takes its edges with it).
The ``routines`` granularity (:func:`routine_junction`) is ``edges`` plus one generalisation: a
*shared routine* of a syscall is a function learned making that syscall when called from at least
:data:`SHARED_ROUTINE_CALLERS` different call sites (a lock, an allocator, a file-open helper);
a context is also accepted when it is a prefix whose every edge was learned (for any syscall, or
shown running by a CPU sample while learning, :attr:`TargetModel.calls`: the program was seen going
that way), one call into a shared routine of the syscall (the only edge allowed to be new), and a
tail whose every edge was learned for the syscall.  A routine that makes
its syscall only sometimes (a lock's ``futex`` under contention, an allocator's ``madvise`` purge)
is then not new behaviour at a known call path; a function that never made a syscall before
(``BeginCopyTo``, ``saveCommand``) still puts an edge unseen for every syscall before the junction.
A third view, on by default in the detector, is a signal handler's part of a context
(:func:`signal_handler_part`): frames interrupted by a signal are stored with the call site
:data:`SIGNAL_SITE` (models learned before that mark store them with none, and must be learned
again to judge handlers' syscalls this way).
Transitions between consecutive (syscall, context) pairs of a thread (Feng's "virtual path") are
recorded only when asked for, and the model counts how many runs recorded them: a transition set
learned from only some runs is incomplete and must not be used to alert.

Everything here is plain data with a documented JSON form (:meth:`ModelSet.to_dict`), written and
read by :mod:`ccprofd.anomaly.modelstore`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FORMAT_NAME = "ccprofd-anomaly-model"
FORMAT_VERSION = 1

#: (module id, function, call site).  Module id is the module's build-id, else its path.
FrameKey = tuple[str, str, str | None]
#: (syscall name, frames outermost first).
ContextKey = tuple[str, tuple[FrameKey, ...]]
#: A call edge: (caller frame, callee (module id, function)).  The caller is None for the context's
#: outermost frame (its entry); the callee is None for the innermost frame's call site that makes
#: the syscall itself.  Recursion adds no edge: deeper recursion through the same call sites has the
#: same edge set (collapsed by construction).
EdgeKey = tuple[FrameKey | None, tuple[str, str] | None]
#: Model granularities: exact contexts, every call edge seen for the syscall, or that plus one new
#: call into a routine shared for the syscall (:func:`routine_junction`).
GRANULARITIES = ("exact", "edges", "routines")
#: How granularity "routines" matches the edges before the shared-routine call: by call site (the
#: caller called the callee at this call site) or by function (the caller called the callee at some
#: call site; :func:`function_edge`).
PREFIX_MATCHES = ("sites", "functions")
#: A function is a shared routine of a syscall when it was learned making it from this many
#: different call sites (one caller is one context's habit, not a routine others call).
SHARED_ROUTINE_CALLERS = 2
#: A thread's first sample has no predecessor: its transition starts here.
THREAD_START = None

DEFAULT_MAX_CYCLE = 16
#: The call site a context keeps for a frame interrupted by a signal: the frame outward of a signal
#: handler's trampoline, whose pc is where the signal happened to land, not a call.
SIGNAL_SITE = "signal"
#: The "return address" of a call site reached by a tail jump: none on the machine stack.
TAIL_CALL = "tail"
_BROKEN = ("", ())  # a thread's previous sample was incomplete: no transition from it
#: How samples name an ia32 (compat) syscall: ``ia32:getpid`` (kbpf/syscalls.py's syscall_name).
IA32_PREFIX = "ia32:"


class ModelError(ValueError):
    """A model value that does not have the documented shape (bad input: exit status 2)."""


# ------------------------------------------------------------------------------ sample -> keys
def module_id(frame: Mapping[str, Any]) -> str:
    """A frame's module identity: its build-id, else its path (build-ids survive moves and renames)."""
    return str(frame.get("build_id") or frame.get("module") or "?")


def frame_key(frame: Mapping[str, Any], interrupted: bool = False) -> FrameKey:
    site = SIGNAL_SITE if interrupted else frame.get("call_site")
    return (module_id(frame), str(frame.get("function") or "?"), None if site is None else str(site))


def interrupted_by_signal(frame: Mapping[str, Any]) -> bool:
    """Whether a frame that is not the innermost one was interrupted by a signal: it has neither
    a call site nor a return address (the tracer reports its exact pc, and the next frame inward is
    the signal trampoline, ``__restore_rt``); a tail-called frame has its own marker."""
    return frame.get("call_site") is None and frame.get("return_address") is None \
        and not frame.get("tail_call")


def context_key(sample: Mapping[str, Any]) -> ContextKey:
    """The model key of one decoded sample.  A frame interrupted by a signal is keyed with the call
    site :data:`SIGNAL_SITE`, so a lookup can tell the handler's part of a context from the part it
    interrupted (:func:`signal_handler_part`)."""
    try:
        frames = sample["frames"]
        syscall = str(sample["syscall"])
    except (KeyError, TypeError) as exc:
        raise ModelError(f"sample without {exc}: not a decoded syscall sample") from None
    last = len(frames) - 1
    return syscall, tuple(frame_key(f, i < last and interrupted_by_signal(f)) for i, f in enumerate(frames))


def signal_handler_part(syscall: str, frames: Sequence[FrameKey]) -> tuple[FrameKey, ...]:
    """The frames inward of the innermost frame interrupted by a signal (the trampoline, the handler
    and what it called); all the frames when no signal interrupted the context.  ``rt_sigreturn``
    is made by the signal trampoline alone: its context is its innermost frame (the trampoline), the
    frames outward being what the returning handler had interrupted.

    What a signal interrupted says where the signal happened to land (any instruction of the
    process can be interrupted: an asynchronous event), not who made the syscall: a handler's
    syscall is judged by the handler's own chain, as a context of its own, wherever it landed."""
    if syscall == "rt_sigreturn":
        return tuple(frames[-1:])
    for i in range(len(frames) - 1, -1, -1):
        if frames[i][2] == SIGNAL_SITE:
            return tuple(frames[i + 1:])
    return tuple(frames)


def collapse_cycles(frames: Sequence[FrameKey], max_cycle: int = DEFAULT_MAX_CYCLE) -> tuple[FrameKey, ...]:
    """Collapse every run of a repeated block of frames to one copy (a recursive cycle entered
    again through the same call sites), for blocks of up to ``max_cycle`` frames.

    ``f@1 f@1 f@1 g@2`` -> ``f@1 g@2``; mutual ``a@1 b@2 a@1 b@2 a@1`` -> ``a@1 b@2 a@1``.  Deeper
    recursion through the same edges then maps to the same key; a cycle through a new call site
    does not disappear, because the frames differ.
    """
    out = list(frames)
    changed = True
    while changed:
        changed = False
        for period in range(1, min(max_cycle, len(out) // 2) + 1):
            i = 0
            while i + 2 * period <= len(out):
                if out[i:i + period] == out[i + period:i + 2 * period]:
                    del out[i + period:i + 2 * period]
                    changed = True
                else:
                    i += 1
    return tuple(out)


def context_edge_path(frames: Sequence[FrameKey]) -> tuple[EdgeKey, ...]:
    """The call edges of a context in chain order, repeats kept (one per frame, plus the syscall's):
    the entry edge into the outermost frame, each frame's call site into the next frame's function,
    and the innermost frame's call site into the syscall.  An empty context is (None, None)."""
    if not frames:
        return ((None, None),)
    edges: list[EdgeKey] = [(None, (frames[0][0], frames[0][1]))]
    edges += [(f, (g[0], g[1])) for f, g in itertools.pairwise(frames)]
    edges.append((frames[-1], None))
    return tuple(edges)


def context_edges(frames: Sequence[FrameKey]) -> tuple[EdgeKey, ...]:
    """The call edges of a context (:func:`context_edge_path`), outermost first, without repeats."""
    return tuple(dict.fromkeys(context_edge_path(frames)))


def cpu_call_edges(sample: Mapping[str, Any]) -> tuple[EdgeKey, ...]:
    """The call edges a CPU sample shows executing, outermost first, without repeats: the edges of
    its chain (:func:`context_edge_path`, frames keyed as :func:`context_key` keys them) but the
    last, as the innermost frame was running, not calling."""
    frames = sample.get("frames") or []
    last = len(frames) - 1
    keys = tuple(frame_key(f, i < last and interrupted_by_signal(f)) for i, f in enumerate(frames))
    return tuple(dict.fromkeys(context_edge_path(keys)[:-1])) if keys else ()


def _call_row(mod_index: Mapping[str, int], caller: FrameKey | None, callee: tuple[str, str],
              n: int) -> list[Any]:
    if caller is None:
        return [-1, None, None, mod_index[callee[0]], callee[1], n]
    return [mod_index[caller[0]], caller[1], caller[2], mod_index[callee[0]], callee[1], n]


def _edge_modules(caller: FrameKey | None, callee: tuple[str, str] | None) -> list[str]:
    return [x[0] for x in (caller, callee) if x is not None]


def shared_routines(edges: Mapping[tuple[str, EdgeKey], int], need: int = 1,
                    callers: int = SHARED_ROUTINE_CALLERS) -> set[tuple[str, tuple[str, str]]]:
    """(syscall, (module id, function)) of every function learned (``need`` samples or more per
    edge) making the syscall from at least ``callers`` different call sites, its own recursive
    calls and the entry not counted."""
    seen: dict[tuple[str, tuple[str, str]], set[FrameKey]] = {}
    for (syscall, (caller, callee)), n in edges.items():
        if n >= need and caller is not None and callee is not None and (caller[0], caller[1]) != callee:
            seen.setdefault((syscall, callee), set()).add(caller)
    return {k for k, sites in seen.items() if len(sites) >= callers}


def function_edge(edge: EdgeKey) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """A call edge without its call site: (caller (module id, function), callee).  Prefix matching
    by function (``prefix_match = "functions"``) counts an edge seen when any call site of the same
    caller called the same callee."""
    caller, callee = edge
    return (None if caller is None else (caller[0], caller[1])), callee


def routine_junction(syscall: str, path: Sequence[EdgeKey], learned: Callable[[EdgeKey], bool],
                     learned_any: Callable[[EdgeKey], bool],
                     shared: Callable[[str, tuple[str, str]], bool]) -> int | None:
    """Granularity ``routines``: the index in ``path`` (:func:`context_edge_path`) of a call into a
    shared routine of ``syscall`` such that every edge before it was learned for some syscall or
    seen running in a CPU sample
    (``learned_any``) and every edge after it for this one (``learned``); None when there is none.

    Why this accepts: the program was seen taking every call before the junction, and the routine
    was seen making the syscall from other call sites along exactly the calls after it; the one new
    fact is that the routine made the syscall at this call site too, which a routine that makes it
    only sometimes (contention, a purge threshold) does.  What stays an alert: a call path through
    a function never seen making a syscall (its incoming edge is unseen for every syscall), a
    routine not shared for the syscall, or a second new edge."""
    n = len(path)
    tail_ok = [True] * (n + 1)  # tail_ok[i]: every edge after i learned for the syscall
    for i in range(n - 1, 0, -1):
        tail_ok[i - 1] = tail_ok[i] and learned(path[i])
    for j, (_, callee) in enumerate(path):
        if callee is not None and tail_ok[j] and shared(syscall, callee):
            return j
        if not learned_any(path[j]):
            return None  # every later junction would have this unseen edge before it
    return None


def common_prefix_len(a: Sequence[FrameKey], b: Sequence[FrameKey]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------- allow rules
@dataclass(frozen=True, slots=True)
class FramePattern:
    """One frame of an allow rule's prefix: a function name, optionally pinned to one call site."""

    function: str
    call_site: str | None = None

    def matches(self, frame: FrameKey) -> bool:
        return frame[1] == self.function and (self.call_site is None or frame[2] == self.call_site)

    @classmethod
    def parse(cls, text: str) -> FramePattern:
        """``FUNCTION`` or ``FUNCTION@0xCALLSITE``."""
        name, _, site = text.strip().partition("@")
        if not name:
            raise ModelError(f"empty function name in frame pattern {text!r}")
        if site:
            try:
                site = hex(int(site, 16))
            except ValueError:
                raise ModelError(f"call site in {text!r} is not a hex address") from None
        return cls(name, site or None)

    def __str__(self) -> str:
        return self.function + (f"@{self.call_site}" if self.call_site else "")


@dataclass(frozen=True, slots=True)
class AllowRule:
    """Allow ``syscall`` (``*``: any) from every context that starts with ``prefix`` (outermost
    first).  An operator's edit: learned contexts are exact; rules cover families of them."""

    syscall: str
    prefix: tuple[FramePattern, ...]
    comment: str = ""

    def matches(self, key: ContextKey) -> bool:
        syscall, frames = key
        if self.syscall not in ("*", syscall) or len(frames) < len(self.prefix):
            return False
        return all(p.matches(f) for p, f in zip(self.prefix, frames, strict=False))

    def to_dict(self) -> dict[str, Any]:
        return {"syscall": self.syscall, "prefix": [str(p) for p in self.prefix], "comment": self.comment}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AllowRule:
        prefix = tuple(FramePattern.parse(p) for p in d["prefix"])
        return cls(str(d["syscall"]), prefix, str(d.get("comment", "")))


# -------------------------------------------------------------------------------------- model
@dataclass(slots=True)
class ContextStats:
    count: int = 0
    first_ns: int = 0
    last_ns: int = 0

    def add(self, n: int, first_ns: int, last_ns: int) -> None:
        self.first_ns = first_ns if not self.count else min(self.first_ns, first_ns)
        self.last_ns = max(self.last_ns, last_ns)
        self.count += n


@dataclass
class TargetModel:
    """Normal behaviour of one target binary (one build-id)."""

    build_id: str
    path: str = ""
    runs: int = 0
    runs_with_transitions: int = 0
    samples: int = 0
    incomplete_skipped: int = 0
    #: Syscall names learned; None = all syscalls were traced.
    syscalls: frozenset[str] | None = None
    contexts: dict[ContextKey, ContextStats] = field(default_factory=dict)
    transitions: dict[tuple[ContextKey | None, ContextKey], int] = field(default_factory=dict)
    allow_rules: list[AllowRule] = field(default_factory=list)
    #: module id -> path, for display.
    modules: dict[str, str] = field(default_factory=dict)
    #: (module id, call site) -> return address (vaddr hex) or TAIL_CALL, for enforcement keys.
    return_addresses: dict[tuple[str, str], str] = field(default_factory=dict)
    #: Call edge -> CPU samples through it (:func:`cpu_call_edges`): calls seen executing, whether
    #: or not a syscall was made under them.  Evidence for granularity "routines" only.
    calls: dict[EdgeKey, int] = field(default_factory=dict)

    # -- learning ----------------------------------------------------------------------------
    def add_context(self, key: ContextKey, time_ns: int, n: int = 1) -> None:
        stats = self.contexts.get(key)
        if stats is None:
            stats = self.contexts[key] = ContextStats()
        stats.add(n, time_ns, time_ns)

    def note_frames(self, frames: Iterable[Mapping[str, Any]]) -> None:
        for f in frames:
            mid = module_id(f)
            if mid not in self.modules and f.get("module"):
                self.modules[mid] = str(f["module"])
            site, ret = f.get("call_site"), f.get("return_address")
            if site is not None and f.get("tail_call"):
                # A tail jump leaves no return address on the machine stack: a stack walk skips it.
                self.return_addresses.setdefault((mid, str(site)), TAIL_CALL)
            elif site is not None and ret is not None:
                self.return_addresses.setdefault((mid, str(site)), str(ret))

    def learned_syscall(self, syscall: str) -> bool:
        """Whether this model has an opinion about ``syscall``: it was traced while learning, or it is
        an ia32 call (``ia32:<name>``, `int $0x80` in a 64-bit process), which every model judges --
        a set's sampling sees one only under the compat watch, and the model allows one only where
        it learned that very context (as the unwinder's enforcement does)."""
        return self.syscalls is None or syscall in self.syscalls or syscall.startswith(IA32_PREFIX)

    def transitions_usable(self) -> bool:
        """Transitions alert only if every learning run recorded them."""
        return self.runs > 0 and self.runs_with_transitions == self.runs

    def merge(self, other: TargetModel) -> None:
        """Add another model of the same build (other runs, processes or hosts) into this one."""
        if other.build_id != self.build_id:
            raise ModelError(f"cannot merge a model of build-id {other.build_id} into {self.build_id}")
        if not self.runs and not self.contexts:
            self.syscalls = other.syscalls
        elif self.syscalls is not None:
            # Modelled syscalls: those any merged part traced (None, "all", absorbs).
            self.syscalls = None if other.syscalls is None else self.syscalls | other.syscalls
        self.path = other.path or self.path
        self.runs += other.runs
        self.runs_with_transitions += other.runs_with_transitions
        self.samples += other.samples
        self.incomplete_skipped += other.incomplete_skipped
        for key, st in other.contexts.items():
            mine = self.contexts.get(key)
            if mine is None:
                self.contexts[key] = ContextStats(st.count, st.first_ns, st.last_ns)
            else:
                mine.add(st.count, st.first_ns, st.last_ns)
        for tkey, n in other.transitions.items():
            self.transitions[tkey] = self.transitions.get(tkey, 0) + n
        for rule in other.allow_rules:
            if rule not in self.allow_rules:
                self.allow_rules.append(rule)
        for mid, path in other.modules.items():
            self.modules.setdefault(mid, path)
        for rkey, ret in other.return_addresses.items():
            self.return_addresses.setdefault(rkey, ret)
        for edge, n in other.calls.items():
            self.calls[edge] = self.calls.get(edge, 0) + n

    def add_calls(self, edges: Iterable[EdgeKey], n: int = 1) -> None:
        for edge in edges:
            self.calls[edge] = self.calls.get(edge, 0) + n

    def edges(self, view: Callable[[str, Sequence[FrameKey]], Sequence[FrameKey]] | None = None
              ) -> dict[tuple[str, EdgeKey], int]:
        """(syscall, call edge) -> samples through it: the view granularity "edges" judges by,
        derived from the stored contexts (not stored itself), each seen through ``view`` if given."""
        out: dict[tuple[str, EdgeKey], int] = {}
        for (syscall, frames), st in self.contexts.items():
            for e in context_edges(frames if view is None else view(syscall, frames)):
                out[(syscall, e)] = out.get((syscall, e), 0) + st.count
        return out

    # -- editing -----------------------------------------------------------------------------
    def ordered_contexts(self) -> list[ContextKey]:
        """Contexts in the stable order ``model show`` numbers them (by syscall, then frames)."""
        return sorted(self.contexts, key=_sort_key)

    def remove_context(self, key: ContextKey) -> None:
        """Forget a context and every transition into or out of it."""
        if key not in self.contexts:
            raise ModelError("no such context in the model")
        del self.contexts[key]
        self.transitions = {t: n for t, n in self.transitions.items() if key not in t}

    def add_allow_rule(self, rule: AllowRule) -> None:
        if rule not in self.allow_rules:
            self.allow_rules.append(rule)

    def allowed_by_rule(self, key: ContextKey) -> AllowRule | None:
        for rule in self.allow_rules:
            if rule.matches(key):
                return rule
        return None

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        ordered = self.ordered_contexts()
        index = {k: i for i, k in enumerate(ordered)}
        mods = sorted({f[0] for _, frames in ordered for f in frames} | set(self.modules)
                      | {m for caller, callee in self.calls for m in _edge_modules(caller, callee)})
        mod_index = {m: i for i, m in enumerate(mods)}
        contexts = []
        for key in ordered:
            syscall, frames = key
            st = self.contexts[key]
            contexts.append({
                "syscall": syscall,
                "frames": [[mod_index[m], fn, site] for m, fn, site in frames],
                "count": st.count, "first_ns": st.first_ns, "last_ns": st.last_ns,
            })
        transitions = sorted(
            ([-1 if a is None else index[a], index[b], n] for (a, b), n in self.transitions.items()
             if (a is None or a in index) and b in index))
        return {
            "build_id": self.build_id,
            "path": self.path,
            "runs": self.runs,
            "runs_with_transitions": self.runs_with_transitions,
            "samples": self.samples,
            "incomplete_skipped": self.incomplete_skipped,
            "syscalls": None if self.syscalls is None else sorted(self.syscalls),
            "modules": [{"id": m, "path": self.modules.get(m, "")} for m in mods],
            "contexts": contexts,
            "transitions": transitions,
            "allow_rules": [r.to_dict() for r in self.allow_rules],
            "return_addresses": sorted([mod_index[m], site, ret]
                                       for (m, site), ret in self.return_addresses.items() if m in mod_index),
            # [caller module (-1: the entry), caller function, call site, callee module, callee
            # function, CPU samples]
            "calls": sorted((_call_row(mod_index, caller, callee, n)
                             for (caller, callee), n in self.calls.items() if callee is not None),
                            key=lambda r: [x if x is not None else "" for x in r]),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TargetModel:
        try:
            mods = [str(m["id"]) for m in d["modules"]]
            model = cls(
                build_id=str(d["build_id"]), path=str(d.get("path", "")), runs=int(d["runs"]),
                runs_with_transitions=int(d.get("runs_with_transitions", 0)),
                samples=int(d.get("samples", 0)),
                incomplete_skipped=int(d.get("incomplete_skipped", 0)),
                syscalls=None if d.get("syscalls") is None else frozenset(map(str, d["syscalls"])))
            model.modules = {str(m["id"]): str(m.get("path", "")) for m in d["modules"]}
            ordered: list[ContextKey] = []
            for c in d["contexts"]:
                key: ContextKey = (str(c["syscall"]), tuple(
                    (mods[int(mi)], str(fn), None if site is None else str(site))
                    for mi, fn, site in c["frames"]))
                ordered.append(key)
                model.contexts[key] = ContextStats(int(c["count"]), int(c.get("first_ns", 0)),
                                                   int(c.get("last_ns", 0)))
            for a, b, n in d.get("transitions", []):
                model.transitions[(None if int(a) < 0 else ordered[int(a)], ordered[int(b)])] = int(n)
            model.allow_rules = [AllowRule.from_dict(r) for r in d.get("allow_rules", [])]
            for mi, site, ret in d.get("return_addresses", []):
                model.return_addresses[(mods[int(mi)], str(site))] = str(ret)
            for cmi, cfn, csite, mi, fn, n in d.get("calls", []):
                site = None if csite is None else str(csite)
                caller = None if int(cmi) < 0 else (mods[int(cmi)], str(cfn), site)
                model.calls[(caller, (mods[int(mi)], str(fn)))] = int(n)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ModelError(f"malformed target model: {type(exc).__name__}: {exc}") from None
        return model


def _sort_key(key: ContextKey) -> tuple[str, int, tuple[tuple[str, str, str], ...]]:
    syscall, frames = key
    return syscall, len(frames), tuple((m, fn, site or "") for m, fn, site in frames)


@dataclass
class ModelSet:
    """All target models of one model file, by build-id.  A model for an old build-id stays (an
    upgrade can be rolled back) but is never applied to another build."""

    targets: dict[str, TargetModel] = field(default_factory=dict)

    def target(self, build_id: str, path: str = "") -> TargetModel:
        """The model of ``build_id``, created empty when absent."""
        model = self.targets.get(build_id)
        if model is None:
            model = self.targets[build_id] = TargetModel(build_id, path)
        elif path:
            model.path = path
        return model

    def merge(self, other: ModelSet) -> None:
        for bid, model in other.targets.items():
            self.target(bid).merge(model)

    def stale_for(self, path: str, build_id: str) -> list[TargetModel]:
        """Models learned for ``path`` under another build-id: the target was upgraded and needs
        re-learning (they are kept, not applied)."""
        return [m for bid, m in self.targets.items() if bid != build_id and m.path == path]

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                "targets": [self.targets[b].to_dict() for b in sorted(self.targets)]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSet:
        if not isinstance(d, Mapping) or d.get("format") != FORMAT_NAME:
            raise ModelError("not a ccprofd anomaly model (no \"format\": \"ccprofd-anomaly-model\")")
        if d.get("version") != FORMAT_VERSION:
            raise ModelError(f"model format version {d.get('version')!r}; this ccprofd reads version "
                             f"{FORMAT_VERSION}")
        targets = d.get("targets")
        if not isinstance(targets, list):
            raise ModelError("model has no list of targets")
        out = cls()
        for t in targets:
            if not isinstance(t, Mapping):
                raise ModelError("target model is not an object")
            model = TargetModel.from_dict(t)
            out.targets[model.build_id] = model
        return out


# ------------------------------------------------------------------------------------ learning
class Learner:
    """Feeds one run's samples into a target model: counts contexts, and optionally the
    per-thread transitions between consecutive (syscall, context) pairs.

    Incomplete samples (``complete: false``) are counted and skipped: their unknown prefix would
    teach the model a context that never happened.
    """

    def __init__(self, model: TargetModel, *, syscalls: Iterable[str] | None = None,
                 transitions: bool = False) -> None:
        self.model = model
        self.transitions = transitions
        self._last: dict[int, Any] = {}
        traced = None if syscalls is None else frozenset(syscalls)
        if model.runs == 0 and not model.contexts:
            model.syscalls = traced
        elif model.syscalls is not None:
            model.syscalls = None if traced is None else model.syscalls | traced
        model.runs += 1
        if transitions:
            model.runs_with_transitions += 1

    def observe(self, sample: Mapping[str, Any], key: ContextKey | None = None) -> ContextKey | None:
        """Learn one sample; returns its key (None when skipped).  A CPU sample (``"event":
        "cpu"``, complete) adds the calls it shows executing (:attr:`TargetModel.calls`).
        ``key``: the sample's ``context_key``, if the caller has it already."""
        key = self._learn(sample, 1, int(sample.get("time_ns", 0)), key)
        if sample.get("event", "syscall") != "syscall":
            return None
        tid = int(sample.get("tid", 0))
        if key is None:
            # Incomplete: the thread's sequence is broken, its next transition has no known predecessor.
            self._last[tid] = _BROKEN
            return None
        if self.transitions:
            prev = self._last.get(tid, THREAD_START)
            if prev is not _BROKEN:
                tkey = (prev, key)
                self.model.transitions[tkey] = self.model.transitions.get(tkey, 0) + 1
            self._last[tid] = key
        return key

    def observe_repeats(self, sample: Mapping[str, Any], n: int, time_ns: int) -> None:
        """Learn ``n`` more samples of ``sample``'s context that only the kernel counted (the
        daemon's aggregate mode), read at ``time_ns``: counted as :meth:`observe` counts them.
        They teach no transitions: a learner with transitions is fed every sample instead."""
        if n > 0:
            self._learn(sample, n, time_ns)

    def _learn(self, sample: Mapping[str, Any], n: int, time_ns: int,
               key: ContextKey | None = None) -> ContextKey | None:
        """Count ``n`` samples of ``sample``'s context into the model; the context's key, None for a
        sample that teaches no context (a CPU sample, an incomplete one)."""
        event = sample.get("event", "syscall")
        if event == "cpu" and sample.get("complete", True):
            self.model.add_calls(cpu_call_edges(sample), n)
            self.model.note_frames(sample.get("frames") or [])
        if event != "syscall":
            return None
        if not sample.get("complete", True):
            self.model.incomplete_skipped += n
            return None
        key = context_key(sample) if key is None else key
        self.model.samples += n
        self.model.add_context(key, time_ns, n)
        self.model.note_frames(sample["frames"])
        return key

    def take_delta(self) -> TargetModel:
        """Hand over everything learned so far and continue into a fresh, empty delta of the same
        target (what a periodic flush merges into the file).  The run is counted in the first
        delta only; per-thread transition state carries over."""
        delta = self.model
        self.model = TargetModel(delta.build_id, delta.path, syscalls=delta.syscalls)
        return delta

    def thread_exited(self, tid: int) -> None:
        """Forget a thread (tids are reused)."""
        self._last.pop(tid, None)


def edge_text(edge: EdgeKey, syscall: str, modules: Mapping[str, str]) -> str:
    """``caller@site (module) -> callee (module)``; ``(entry)`` and the syscall name at the ends."""
    def where(mid: str) -> str:
        path = modules.get(mid, "")
        return path.rsplit("/", 1)[-1] if path else (mid[:12] if mid else "?")

    caller, callee = edge
    left = "(entry)" if caller is None else f"{caller[1]}@{caller[2] or '?'} ({where(caller[0])})"
    right = syscall if callee is None else f"{callee[1]} ({where(callee[0])})"
    return f"{left} -> {right}"


def iter_frames_text(frames: Sequence[FrameKey], modules: Mapping[str, str]) -> Iterator[str]:
    """``function  call_site  module`` lines of a context, outermost first (for ``model show``)."""
    for mid, fn, site in frames:
        path = modules.get(mid, "")
        where = path.rsplit("/", 1)[-1] if path else (mid[:12] if mid else "?")
        yield f"{fn:<32} {site or '-':<12} {where}"
