"""Sample-by-sample comparison of ``ccprofd trace`` output with the strace/gdb ground truth.

``compare(samples, oracle, binary)`` takes ccprofd's JSONL samples (dicts, as specified in issue 4:
``{"time_ns", "pid", "tid", "event", "syscall", "complete", "frames": [{"function", "module",
"build_id", "analysed", "call_site", "return_address", "tail_call"?}, ...]}``, frames outermost first,
addresses ELF-vaddr hex strings) and a :class:`strace_oracle.Trace` (from ``run_strace`` or
``run_gdb``), and returns a :class:`Comparison`: every mismatch with a readable diff, and statistics.
The two runs are separate executions of the same deterministic command.

The rules
---------
* **What is compared.** Samples with ``event == "syscall"`` whose syscall the oracle traced
  (``oracle.requested``); others are counted as ignored.  On the oracle side, every requested syscall
  a task made while running the analysed binary (``exe`` at entry == the binary: the command's own
  ``execve`` and everything after an ``exec`` into another program are excluded; the exec'ing
  ``execve`` itself is included) -- *including* the dynamic loader's syscalls before ``main``, whose
  context is empty.  ``skip_leading_empty=True`` drops, on both sides and per task, the syscalls
  before the first one with a non-empty context (for a tracer that starts sampling at ``main``).
* **Threads** are matched by creation order.  Oracle: :attr:`Trace.tasks` order (clone returns, see
  strace_oracle).  Samples: ``sample_task_order`` (all tids of the ccprofd run in creation order, e.g.
  from its fork tracking) if given, else increasing tid -- the kernel hands out tids increasingly, so
  this is creation order unless the pid space wraps.  Only tasks with at least one compared syscall
  take part on either side.  Fork children are tasks like threads; a sample's ``pid`` must be the tid
  of the task matched with the oracle task's process leader (its tgid), consistently.
* **Syscalls** are matched by ordinal within the task (samples in ``time_ns`` order, ties in input
  order); the names must agree.  Missing and extra samples are mismatches.
* **Frames.**  Expected: the oracle's frames in the analysed binary (``target_frames``), outermost
  first.  Got: the sample's frames whose ``module`` is the binary (realpath), without
  ``tail_call: true`` frames.  With ``drop_entry_function`` (default) frames of the function holding
  the ELF entry point (``_start``, start-up code above ``main``) are removed from both.  A frame
  compares equal when the return addresses are equal (oracle frames of kind ``call``) and the
  functions are equal: same name, or a ccprofd ``sub_<hex>`` name whose hex is the oracle's function
  entry.  Oracle frames without a return address (the pc of the syscall itself inside the binary, a
  frame interrupted by a signal) are compared by function only: the spec gives them no return
  address.  ``check_names=False`` skips name checks (return addresses still identify the call sites).
* **Incomplete.** A sample with ``complete: false`` must be a suffix (innermost part) of the truth.
  An oracle stack cut short (strace's 256-frame limit, an unwinder error) is known only as a suffix:
  a complete sample must end with it; an incomplete one must agree with it on their common suffix.

What a tracer must know to pass (all measured here with strace 6.1/libunwind and gdb 13)
--------------------------------------------------------------------------------------
* Syscalls that never enter the kernel (vDSO ``clock_gettime``, ``gettimeofday``, ``time``,
  ``getcpu``) are invisible to strace and to ``raw_syscalls``: neither side has them.
* The dynamic loader's syscalls (``openat`` of ld.so.cache and libc, ``mmap``...) come before
  ``main`` with no frame of the binary; strict ordinals expect a sample (empty context) for each.
* Run both sides with the same kind of stdout: with a pipe, ``puts`` output is written by ``exit()``
  after ``main`` returned (a ``write`` with no frame of the binary); with a tty, inside ``main``.
* glibc's names: ``open`` -> ``openat``, ``fork`` -> ``clone``, ``pthread_create`` -> ``clone3``,
  ``waitpid`` -> ``wait4``, ``raise`` -> ``tgkill``, ``exit`` -> ``exit_group``, thread end -> ``exit``.
* A call as a function's last instruction (noreturn ``_exit``/``longjmp``/``__cxa_throw`` at -O2)
  returns to one byte past the function: symbolise return addresses with ``ra - 1``.
* A frame interrupted by a signal (the frame above the ``__restore_rt`` trampoline) holds the
  interrupted pc, not a return address; it is compared by function only.  Handler frames sit on top
  of the interrupted context, on a sigaltstack too.
* ``_start`` (the ELF entry) is on the main thread's stack above ``__libc_start_main``; dropped here.
* After a successful ``execve`` into another program the task's syscalls are not the binary's;
  the ``execve`` itself is (its stack is taken at entry).
"""

from __future__ import annotations

import difflib
import json
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from strace_oracle import (
    FunctionSymbol,
    Syscall,
    TargetFrame,
    Task,
    Trace,
    analysed_syscalls,
    entry_function,
    same_file,
    target_frames,
)

_SUB = re.compile(r"^sub_([0-9a-fA-F]+)$")


@dataclass(frozen=True)
class Frame:
    """One comparable frame (either side): function, its entry if known, return address."""

    function: str | None
    entry: int | None = None
    return_address: int | None = None
    kind: str = "call"  # oracle: call | innermost | interrupted; sample: "sample"

    def render(self) -> str:
        ra = f"{self.return_address:#x}" if self.return_address is not None else "-"
        name = self.function or (f"sub_{self.entry:x}" if self.entry is not None else "?")
        note = "" if self.kind in ("call", "sample") else f" ({self.kind})"
        return f"{name} @ {ra}{note}"


@dataclass(frozen=True)
class Mismatch:
    kind: str  # threads | pid | missing-sample | extra-sample | syscall | frames | incomplete-not-suffix
    thread: int | None  # creation index of the task
    oracle_tid: int | None
    sample_tid: int | None
    ordinal: int | None  # index of the syscall within the task
    syscall: str | None
    detail: str
    expected: tuple[Frame, ...] = ()
    got: tuple[Frame, ...] = ()

    def render(self) -> str:
        where = f"thread #{self.thread}" if self.thread is not None else "threads"
        tids = f" (oracle tid {self.oracle_tid}, sample tid {self.sample_tid})"
        head = f"{where}{tids}"
        if self.ordinal is not None:
            head += f", syscall #{self.ordinal} {self.syscall}"
        lines = [f"{head}: {self.kind}: {self.detail}"]
        if self.expected or self.got:
            lines.append(_side_by_side(self.expected, self.got))
        return "\n".join(lines)


@dataclass
class Stats:
    threads_compared: int = 0
    samples_compared: int = 0
    frames_compared: int = 0  # expected frames checked against a sample frame
    function_only_frames: int = 0  # of those, frames compared by function only (no return address)
    incomplete_samples: int = 0
    oracle_truncated: int = 0  # samples compared against an oracle stack known only as a suffix
    ignored_samples: int = 0  # cpu samples, syscalls the oracle did not trace
    unnamed_frames: int = 0  # frames whose function could not be compared by name


@dataclass
class Comparison:
    mismatches: list[Mismatch] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def report(self, limit: int = 20) -> str:
        s = self.stats
        head = (f"{len(self.mismatches)} mismatch(es); compared {s.samples_compared} samples, "
                f"{s.frames_compared} frames ({s.function_only_frames} by function only), "
                f"{s.threads_compared} threads; {s.incomplete_samples} incomplete samples, "
                f"{s.oracle_truncated} against truncated oracle stacks, {s.ignored_samples} ignored")
        body = [m.render() for m in self.mismatches[:limit]]
        if len(self.mismatches) > limit:
            body.append(f"... and {len(self.mismatches) - limit} more")
        return "\n\n".join([head, *body])

    def assert_ok(self) -> None:
        assert self.ok, self.report()


def load_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """ccprofd ``--format jsonl`` output -> list of sample dicts."""
    out = []
    for line in pathlib.Path(path).read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


# --------------------------------------------------------------------------------------------------
# Both sides as comparable frames


def expected_frames(syscall: Syscall, binary: str | os.PathLike[str], *,
                    symbols_path: str | os.PathLike[str] | None = None,
                    drop: FunctionSymbol | None = None) -> tuple[Frame, ...]:
    """The oracle's frames of ``binary`` for one syscall, outermost first, as comparable frames."""
    tfs: list[TargetFrame] = target_frames(syscall.frames, binary, symbols_path=symbols_path)
    out = [Frame(t.function, t.entry, t.return_address, t.kind) for t in reversed(tfs)
           if drop is None or not _is_dropped(t, drop)]
    return tuple(out)


def _is_dropped(frame: TargetFrame, drop: FunctionSymbol) -> bool:
    """The oracle frame is in ``drop``: by entry, or by pc when ``drop`` is an unnamed FDE range."""
    if frame.entry is not None and frame.entry == drop.start:
        return True
    return bool(drop.size) and drop.start <= frame.pc < drop.start + drop.size


def _hex(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    return int(str(value), 16)


def sample_frames(sample: Mapping[str, Any], binary: str | os.PathLike[str], *,
                  drop: FunctionSymbol | None = None) -> tuple[Frame, ...]:
    """A sample's frames of ``binary`` (by module path), outermost first, tail-call frames removed."""
    out = []
    for f in sample.get("frames") or []:
        if f.get("tail_call"):
            continue
        if not same_file(f.get("module"), os.fspath(binary)):
            continue
        ra = _hex(f.get("return_address"))
        name = f.get("function")
        if drop is not None and _in_function(drop, name, ra):
            continue
        out.append(Frame(name, None, ra, "sample"))
    return tuple(out)


def _in_function(fn: FunctionSymbol, name: str | None, ra: int | None) -> bool:
    if ra is not None and fn.size:
        return fn.start < ra <= fn.start + fn.size  # a return address may be one past the last byte
    if name is not None and fn.name is not None:
        return name == fn.name
    m = _SUB.match(name or "")
    return bool(m and int(m.group(1), 16) == fn.start)


def _frame_problem(exp: Frame, got: Frame, check_names: bool, stats: Stats) -> str | None:
    stats.frames_compared += 1
    if exp.kind == "call":
        if got.return_address != exp.return_address:
            return "return address"
    else:
        stats.function_only_frames += 1
    if not check_names:
        return None
    m = _SUB.match(got.function or "")
    if m and exp.entry is not None:
        return None if int(m.group(1), 16) == exp.entry else "function"
    if exp.function is None or got.function is None:
        stats.unnamed_frames += 1
        return None if exp.kind == "call" else "function unknown"
    return None if got.function == exp.function else "function"


def _match_all(exp: Sequence[Frame], got: Sequence[Frame], check_names: bool, stats: Stats) -> str | None:
    problems = [p for e, g in zip(exp, got, strict=True) if (p := _frame_problem(e, g, check_names, stats))]
    return problems[0] if problems else None


def _side_by_side(exp: Sequence[Frame], got: Sequence[Frame]) -> str:
    """Frames outermost first, expected | got, aligned by difflib; '!' marks a differing row."""
    def key(f: Frame) -> tuple[Any, ...]:
        return (f.return_address,)

    rows: list[tuple[str, str, str]] = []
    sm = difflib.SequenceMatcher(a=[key(f) for f in exp], b=[key(f) for f in got], autojunk=False)
    for op, a0, a1, b0, b1 in sm.get_opcodes():
        if op == "equal":
            for fe, fg in zip(exp[a0:a1], got[b0:b1], strict=True):
                mark = " " if (fe.function == fg.function or _SUB.match(fg.function or "")) else "!"
                rows.append((mark, fe.render(), fg.render()))
        else:
            ea, gb = list(exp[a0:a1]), list(got[b0:b1])
            for i in range(max(len(ea), len(gb))):
                e = ea[i].render() if i < len(ea) else ""
                g = gb[i].render() if i < len(gb) else ""
                rows.append(("-" if not g else "+" if not e else "!", e, g))
    width = max([len("expected (outermost first)"), *(len(r[1]) for r in rows)])
    lines = [f"    {'expected (outermost first)':<{width}}  got"]
    lines += [f"  {m} {e:<{width}}  {g}" for m, e, g in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The comparison


@dataclass
class _OracleTask:
    task: Task
    syscalls: list[tuple[Syscall, tuple[Frame, ...]]]


def _oracle_side(oracle: Trace, binary: str, symbols_path: str | os.PathLike[str] | None,
                 drop: FunctionSymbol | None, skip_leading_empty: bool) -> list[_OracleTask]:
    out = []
    for task in oracle.tasks:
        rows = [(s, expected_frames(s, binary, symbols_path=symbols_path, drop=drop))
                for s in analysed_syscalls(task, binary)]
        if skip_leading_empty:
            while rows and not rows[0][1] and not rows[0][0].truncated:
                rows.pop(0)
        if rows:
            out.append(_OracleTask(task, rows))
    return out


def compare(samples: Iterable[Mapping[str, Any]], oracle: Trace, binary: str | os.PathLike[str], *,
            symbols_path: str | os.PathLike[str] | None = None, check_names: bool = True,
            drop_entry_function: bool = True, skip_leading_empty: bool = False,
            sample_task_order: Sequence[int] | None = None) -> Comparison:
    """Compare ccprofd samples with the oracle, sample by sample (rules in the module docstring).

    ``binary``: the analysed binary (the file the command runs, stripped or not);
    ``symbols_path``: its unstripped twin, where the oracle takes function names from.
    """
    result = Comparison()
    stats = result.stats
    binary_s = os.path.realpath(binary)
    drop = entry_function(binary_s, symbols_path=symbols_path) if drop_entry_function else None
    otasks = _oracle_side(oracle, binary_s, symbols_path, drop, skip_leading_empty)

    by_tid: dict[int, list[tuple[int, Mapping[str, Any]]]] = {}
    for i, s in enumerate(samples):
        if s.get("event", "syscall") != "syscall" or s.get("syscall") not in oracle.requested:
            stats.ignored_samples += 1
            continue
        by_tid.setdefault(int(s["tid"]), []).append((i, s))
    sample_lists: dict[int, list[tuple[Mapping[str, Any], tuple[Frame, ...]]]] = {}
    for tid, rows in by_tid.items():
        rows.sort(key=lambda r: (int(r[1].get("time_ns", 0)), r[0]))
        lst = [(r[1], sample_frames(r[1], binary_s, drop=drop)) for r in rows]
        if skip_leading_empty:
            while lst and not lst[0][1] and lst[0][0].get("complete", True):
                lst.pop(0)
        if lst:
            sample_lists[tid] = lst
    if sample_task_order is not None:
        rank = {tid: i for i, tid in enumerate(sample_task_order)}
        unknown = sorted(t for t in sample_lists if t not in rank)
        if unknown:
            result.mismatches.append(Mismatch("threads", None, None, None, None, None,
                                              f"sample tids {unknown} are not in sample_task_order"))
        stids = sorted(sample_lists, key=lambda t: (rank.get(t, len(rank)), t))
    else:
        stids = sorted(sample_lists)

    if len(stids) != len(otasks):
        result.mismatches.append(Mismatch(
            "threads", None, None, None, None, None,
            f"oracle has {len(otasks)} tasks with compared syscalls "
            f"(tids {[o.task.tid for o in otasks]}), samples have {len(stids)} (tids {stids})"))

    pairing = {o.task.tid: stids[i] for i, o in enumerate(otasks) if i < len(stids)}
    for i in range(max(len(otasks), len(stids))):
        ot = otasks[i] if i < len(otasks) else None
        stid = stids[i] if i < len(stids) else None
        slist = sample_lists.get(stid, []) if stid is not None else []
        if ot is None:
            for n, (s, got) in enumerate(slist):
                result.mismatches.append(Mismatch("extra-sample", i, None, stid, n, s.get("syscall"),
                                                  "a task the oracle does not have", (), got))
            continue
        stats.threads_compared += 1 if stid is not None else 0
        if stid is not None and slist:
            _check_pid(result, i, ot, stid, slist, pairing, oracle)
        _compare_task(result, i, ot, stid, slist, check_names)
    return result


def _check_pid(result: Comparison, index: int, ot: _OracleTask, stid: int,
               slist: Sequence[tuple[Mapping[str, Any], tuple[Frame, ...]]], pairing: dict[int, int],
               oracle: Trace) -> None:
    pids = {int(s["pid"]) for s, _ in slist}
    if len(pids) != 1:
        result.mismatches.append(Mismatch("pid", index, ot.task.tid, stid, None, None,
                                          f"samples of one tid carry several pids {sorted(pids)}"))
        return
    pid = pids.pop()
    leader = oracle.process_leader(ot.task)
    expected = pairing.get(leader.tid) if leader is not None else None
    if leader is not None and leader.tid == ot.task.tid:
        expected = stid
    if expected is not None and pid != expected:
        result.mismatches.append(Mismatch(
            "pid", index, ot.task.tid, stid, None, None,
            f"sample pid {pid}, but the oracle task belongs to process {ot.task.pid} (task "
            f"#{leader.index if leader else '?'}), matched with sample tid {expected}"))


def _compare_task(result: Comparison, index: int, ot: _OracleTask, stid: int | None,
                  slist: Sequence[tuple[Mapping[str, Any], tuple[Frame, ...]]], check_names: bool) -> None:
    otid = ot.task.tid
    for n in range(max(len(ot.syscalls), len(slist))):
        if n >= len(slist):
            sc, exp = ot.syscalls[n]
            result.mismatches.append(Mismatch("missing-sample", index, otid, stid, n, sc.name,
                                              "the oracle saw this syscall, no sample has it", exp, ()))
            continue
        sample, got = slist[n]
        if n >= len(ot.syscalls):
            result.mismatches.append(Mismatch("extra-sample", index, otid, stid, n, sample.get("syscall"),
                                              "a sample the oracle has no syscall for", (), got))
            continue
        sc, exp = ot.syscalls[n]
        if sample.get("syscall") != sc.name:
            result.mismatches.append(Mismatch("syscall", index, otid, stid, n, sc.name,
                                              f"sample is {sample.get('syscall')!r}, oracle {sc.name!r}",
                                              exp, got))
            continue
        problem = _compare_one(result.stats, sc, exp, bool(sample.get("complete", True)), got, check_names)
        if problem is not None:
            kind, detail = problem
            result.mismatches.append(Mismatch(kind, index, otid, stid, n, sc.name, detail, exp, got))


def _compare_one(stats: Stats, sc: Syscall, exp: tuple[Frame, ...], complete: bool, got: tuple[Frame, ...],
                 check_names: bool) -> tuple[str, str] | None:
    """One sample against its oracle syscall -> (mismatch kind, detail) or None."""
    stats.samples_compared += 1
    if not complete:
        stats.incomplete_samples += 1
    if sc.truncated:
        stats.oracle_truncated += 1
    if complete and not sc.truncated:
        if len(got) != len(exp):
            return "frames", f"{len(exp)} frames expected, {len(got)} reported"
        problem = _match_all(exp, got, check_names, stats)
        return ("frames", f"{problem} differs") if problem else None
    if sc.truncated and complete:
        # The truth is [unknown older frames] + exp: the sample must end with exp.
        if len(got) < len(exp):
            return "frames", (f"the oracle's stack was cut short and still has {len(exp)} frames of the "
                              f"binary; the sample has only {len(got)}")
        problem = _match_all(exp, got[len(got) - len(exp):], check_names, stats)
        return ("frames", f"{problem} differs in the innermost {len(exp)} frames") if problem else None
    if not sc.truncated:
        # An incomplete sample must be the innermost part of the truth.
        if len(got) > len(exp):
            return "incomplete-not-suffix", f"{len(got)} frames reported, the truth has only {len(exp)}"
        problem = _match_all(exp[len(exp) - len(got):], got, check_names, stats)
        return ("incomplete-not-suffix", f"the {len(got)} reported frames are not the innermost part of the "
                f"truth ({problem} differs)") if problem else None
    # Both are suffixes of the truth: they must agree on their common innermost part.
    common = min(len(exp), len(got))
    problem = _match_all(exp[len(exp) - common:], got[len(got) - common:], check_names, stats)
    return ("incomplete-not-suffix", f"{problem} differs in the common innermost {common} frames") \
        if problem else None


def samples_from_oracle(oracle: Trace, binary: str | os.PathLike[str], *,
                        symbols_path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The samples a perfect tracer would write for the oracle's run (frames of ``binary`` only).

    For tests of :func:`compare` itself (mutate them and expect failures) and as a readable statement
    of what ccprofd must produce.  ``call_site`` is not known to the oracle and left null.
    """
    binary_s = os.path.realpath(binary)
    out: list[dict[str, Any]] = []
    t = 0
    for task in oracle.tasks:
        for sc in analysed_syscalls(task, binary_s):
            frames = []
            for tf in reversed(target_frames(sc.frames, binary_s, symbols_path=symbols_path)):
                ra = tf.return_address
                name = tf.function or (f"sub_{tf.entry:x}" if tf.entry is not None else None)
                frames.append({"function": name, "module": binary_s, "build_id": None, "analysed": True,
                               "call_site": None, "return_address": f"{ra:#x}" if ra is not None else None})
            t += 1
            out.append({"time_ns": t, "pid": task.pid, "tid": task.tid, "event": "syscall",
                        "syscall": sc.name, "complete": not sc.truncated, "frames": frames})
    return out
