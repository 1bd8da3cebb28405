"""The ground truth for calling contexts at syscalls: ``strace -f -k``, parsed.  Imports nothing of ccprofd.

Every end-to-end test of ``ccprofd trace`` compares its samples, one by one, with what a debugger-grade
unwinder saw at the same syscall.  This module runs ``strace -f -k -qq -e trace=... -o FILE -- CMD``
(libunwind backend here, see ``strace -V``), parses the output into a plain value (:class:`Trace`:
tasks in creation order, each with its ordered syscalls and their frames as strace printed them), and
turns the frames that belong to the analysed binary into ELF virtual addresses (:func:`target_frames`).
``tests/gdb_oracle.py`` produces the same :class:`Trace` from ``gdb`` for stacks deeper than strace's
256-frame limit; ``tests/fidelity.py`` compares samples with either.

What strace prints, and the address rule
----------------------------------------
One line per frame, innermost first::

     > /path/of/module(symbol+0xOFF) [0xADDR]      symbol known (C++ demangled, with parameters)
     > /path/of/module() [0xADDR]                   no symbol (stripped binary)
     > /path/of/module(+0x0) [0xADDR]               no symbol, stack captured at syscall *entry*
                                                    (execve, exit, exit_group)
     > too many stack frames                        the 256-frame limit was hit (older frames lost)
     > unexpected_backtracing_error [0xIP]          the pc is in no executable file mapping

* ``module`` is the path of the file mapping that contains the pc, as ``/proc/PID/maps`` shows it
  (the kernel's d_path: symlinks resolved, so it equals ``os.path.realpath`` of the binary).
* ``ADDR`` is a **file offset**: ``pc - mapping_start + mapping_file_offset`` (strace's
  ``true_offset``), *not* a virtual address and not a load-bias-relative address.  The ELF virtual
  address is found through the program header: for the ``PT_LOAD`` with
  ``p_offset <= ADDR < p_offset + p_filesz`` (an executable one if two overlap),
  ``vaddr = ADDR - p_offset + p_vaddr``.  For a PIE built by GNU ld the text segment usually has
  ``p_vaddr == p_offset`` so ADDR happens to equal the vaddr; for a non-PIE binary it does not
  (``0x122e`` is vaddr ``0x40122e``).  ``tests/test_oracle_strace.py`` checks the rule against
  ``objdump -d`` on PIE and non-PIE builds.
* ``ADDR`` is the frame's pc exactly as the unwinder holds it: for the innermost frame the address
  after the ``syscall`` instruction; for a caller frame the **return address** (the address after its
  ``call``; not ``ra - 1``); for a frame interrupted by a signal, the interrupted instruction.
* ``symbol+0xOFF`` comes from libunwind (``unw_get_proc_name``): the nearest preceding symbol of the
  file's ``.symtab``/``.dynsym``, so in libc (no ``.symtab``) names are often wrong (``__restore_rt``
  prints as ``__sigaction+0x40``, ``__libc_start_call_main`` as ``__libc_init_first+0x8a``).  For the
  analysed binary this module does not use these names: :func:`target_frames` names each frame from
  the symbol table of the binary or of its unstripped twin (same build-id), looking up ``ra - 1`` for
  return addresses (a call as the last instruction of a function -- ``_exit``, ``longjmp`` -- returns
  to the first byte of the *next* function).

Tasks, creation order, processes
--------------------------------
strace ``-f`` prefixes each line with the task id (tid).  A :class:`Task` is one thread or process
(``fork`` children and threads alike).  **Creation order**: the command's first task is number 0; every
other task is numbered in the order in which its tid appears as the *return value* of a
``clone``/``clone3``/``fork``/``vfork`` line (the parent's view; the child's own lines may be printed
before that).  The kernel allocates tids increasingly, so this equals increasing tid order unless the
pid space wraps (checked: :attr:`Trace.tid_order_ok`).  A task's ``pid`` (tgid) is its creator's when
the clone had ``CLONE_THREAD``, else its own tid.  To see these, the process-management syscalls
(:data:`BOOKKEEPING`) are always traced; they appear in :attr:`Task.syscalls` only if requested.

Program images (exec)
---------------------
Each :class:`Syscall` records ``exe``: the realpath of the program image its task was running when it
*entered* the syscall.  The first task starts with ``exe = None`` (strace's own forked child, before it
execs the command); a successful ``execve`` sets it to the executed path (realpath), so the command's
own ``execve`` has ``exe = None`` and a later ``execve("/bin/echo")`` has the analysed binary as
``exe``, while every syscall after it has ``/usr/bin/echo``.  A new task inherits its creator's image.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

#: Syscalls traced in every run whatever the caller asks for: task creation and program images.
BOOKKEEPING: frozenset[str] = frozenset({"clone", "clone3", "fork", "vfork", "execve", "execveat"})
_CREATORS = frozenset({"clone", "clone3", "fork", "vfork"})
_EXECS = frozenset({"execve", "execveat"})

#: strace's fixed maximum number of frames per stack (strace 6.1: no option to raise it).
STRACE_MAX_FRAMES = 256

#: x86-64 ``__restore_rt``: ``mov $0xf,%rax; syscall`` (rt_sigreturn).  A frame whose pc points at
#: these bytes is the signal trampoline; the next older frame was interrupted, not calling.
SIGRETURN_TRAMPOLINE = bytes.fromhex("48c7c00f0000000f05")


class OracleError(RuntimeError):
    """The oracle could not run or could not parse its tool's output."""


class RawFrame(NamedTuple):
    """One frame as the unwinder printed it (innermost first in a stack)."""

    module: str | None  # file mapping that holds the pc; None for an error entry
    function: str | None  # symbol the unwinder printed (may be wrong outside the binary), None if none
    offset: int  # file offset of the pc in ``module`` (for an error entry: the raw pc, or 0)


@dataclass(frozen=True)
class Syscall:
    """One syscall of one task: its name, its stack at the syscall, and context for messages."""

    name: str
    frames: tuple[RawFrame, ...]  # innermost first
    truncated: bool  # the unwinder stopped early (frame limit or error): the oldest frames are missing
    exe: str | None  # realpath of the program image the task was running when it entered the syscall
    result: str = "?"  # text after " = " ("?" when the syscall did not return)
    args: str = ""
    line: int = 0  # 1-based line of the syscall in the tool's output


@dataclass
class Task:
    """One thread or process, with its syscalls in the order it made them."""

    index: int  # creation order (0 = the command's first task)
    tid: int
    pid: int  # tgid: the process this task belongs to
    parent_tid: int | None
    syscalls: list[Syscall] = field(default_factory=list)
    signals: list[tuple[int, str]] = field(default_factory=list)  # (syscalls before it, signal name)


@dataclass
class Trace:
    """The parsed ground truth of one run: tasks in creation order."""

    source: Literal["strace", "gdb"]
    command: tuple[str, ...]
    requested: frozenset[str]  # the syscall names the caller asked for (others are not in `syscalls`)
    tasks: list[Task]
    exit_status: int | None = None
    stdout: str = ""
    stderr: str = ""
    raw_output: str = ""  # the tool's output, for failure messages
    tid_order_ok: bool = True  # creation order == increasing tid order

    def task(self, tid: int) -> Task:
        for t in self.tasks:
            if t.tid == tid:
                return t
        raise KeyError(f"no task {tid} in the trace")

    def process_leader(self, task: Task) -> Task | None:
        """The task whose tid is ``task.pid`` (the process's first thread), if it is in the trace."""
        for t in self.tasks:
            if t.tid == task.pid:
                return t
        return None


# --------------------------------------------------------------------------------------------------
# Running strace


def strace_path() -> str:
    path = shutil.which("strace")
    if path is None:
        raise OracleError("strace is not installed")
    return path


@functools.cache
def strace_features() -> tuple[str, frozenset[str]]:
    """(version line, optional features) from ``strace -V``, e.g. ``stack-trace=libunwind``."""
    out = subprocess.run([strace_path(), "-V"], check=True, capture_output=True, text=True).stdout
    lines = out.splitlines()
    feats: frozenset[str] = frozenset()
    for line in lines:
        if line.startswith("Optional features enabled:"):
            feats = frozenset(line.split(":", 1)[1].split())
    return (lines[0] if lines else "strace"), feats


def require_stack_trace() -> str:
    """The unwinder strace -k uses here ("libunwind" or "libdw"); OracleError if there is none."""
    _, feats = strace_features()
    for feat in feats:
        if feat.startswith("stack-trace="):
            return feat.split("=", 1)[1]
    raise OracleError("this strace was built without -k (stack-trace) support")


def run_strace(cmd: Sequence[str], syscalls: Iterable[str], *, cwd: str | os.PathLike[str] | None = None,
               env: dict[str, str] | None = None, timeout: float | None = None,
               stdin: int | None = subprocess.DEVNULL) -> Trace:
    """Run ``cmd`` under ``strace -f -k`` tracing ``syscalls`` (names strace knows) and parse the result.

    The command's stdout/stderr are captured into the returned trace; its exit status is
    ``exit_status`` (strace passes it through).
    """
    require_stack_trace()
    requested = frozenset(syscalls)
    if not requested:
        raise ValueError("no syscalls to trace")
    traced = sorted(requested | BOOKKEEPING)
    with tempfile.TemporaryDirectory(prefix="strace-oracle-") as tmp:
        out_file = pathlib.Path(tmp) / "strace.out"
        argv = [strace_path(), "-f", "-k", "-qq", "-e", "trace=" + ",".join(traced), "-o", str(out_file),
                "--", *cmd]
        proc = subprocess.run(argv, cwd=cwd, env=env, stdin=stdin, capture_output=True, text=True,
                              errors="replace", timeout=timeout)
        text = out_file.read_text(errors="replace") if out_file.exists() else ""
    if not text.strip():
        raise OracleError(f"strace produced no output (exit {proc.returncode}): {proc.stderr.strip()}")
    trace = parse_strace(text, requested=requested, command=tuple(cmd), cwd=str(cwd or os.getcwd()))
    trace.exit_status = proc.returncode
    trace.stdout = proc.stdout
    trace.stderr = proc.stderr
    return trace


class AttachedStrace:
    """``strace -f -k -p PID`` attached to a running process (:func:`attach_strace`); :meth:`finish`
    waits for the process to end (strace exits with it) and parses what strace saw."""

    def __init__(self, proc: subprocess.Popen[str], out_file: pathlib.Path, requested: frozenset[str],
                 tmp: tempfile.TemporaryDirectory[str], pid: int, exe: str) -> None:
        self.pid = pid
        self.exe = exe
        self.proc = proc
        self.out_file = out_file
        self.requested = requested
        self._tmp = tmp

    def finish(self, timeout: float | None = None) -> Trace:
        try:
            _, err = self.proc.communicate(timeout=timeout)
            text = self.out_file.read_text(errors="replace") if self.out_file.exists() else ""
        finally:
            self._tmp.cleanup()
        if not text.strip():
            raise OracleError(f"strace -p produced no output (exit {self.proc.returncode}): {err.strip()}")
        trace = parse_strace(text, requested=self.requested)
        trace.stderr = err
        # Attached, strace saw no clone or exec: every task is a thread of `pid` running `exe`.
        for task in trace.tasks:
            task.pid = self.pid
            task.syscalls = [dataclasses.replace(sc, exe=self.exe) for sc in task.syscalls]
        return trace


def attach_strace(pid: int, syscalls: Iterable[str], *, threads: int = 1) -> AttachedStrace:
    """Attach ``strace -f -k`` to the running process ``pid`` and return once strace reports every
    one of its ``threads`` attached (strace's own "attached" lines on stderr)."""
    require_stack_trace()
    requested = frozenset(syscalls)
    traced = sorted(requested | BOOKKEEPING)
    exe = os.path.realpath(f"/proc/{pid}/exe")
    tmp = tempfile.TemporaryDirectory(prefix="strace-oracle-")
    out_file = pathlib.Path(tmp.name) / "strace.out"
    argv = [strace_path(), "-f", "-k", "-e", "trace=" + ",".join(traced), "-o", str(out_file), "-p", str(pid)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, errors="replace")
    assert proc.stderr is not None
    seen: list[str] = []
    while True:
        line = proc.stderr.readline()
        if not line:
            tmp.cleanup()
            raise OracleError(f"strace -p {pid} ended before attaching: {''.join(seen).strip()}")
        seen.append(line)
        m = re.search(r"Process \d+ attached(?: with (\d+) threads)?", line)
        if m and int(m.group(1) or 1) >= threads:
            break
    return AttachedStrace(proc, out_file, requested, tmp, pid, exe)


# --------------------------------------------------------------------------------------------------
# Parsing strace's output

_PID_LINE = re.compile(r"^(\d+) +(.*)$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)$")
_RESULT = re.compile(r" = (.*)$")
_SIGNAL = re.compile(r"^--- (SIG\w+|\S+) ")
_FRAME_ADDR = re.compile(r"^(.*) \[0x([0-9a-f]+)\]$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


@dataclass
class _Record:
    """A syscall or signal of one task while parsing (in the task's own order)."""

    tid: int
    kind: Literal["syscall", "signal"]
    name: str
    line: int
    args: str = ""
    result: str | None = None  # None while unfinished
    result_line: int = 0  # line on which the result was printed (the "resumed" line if unfinished)
    frames: list[RawFrame] = field(default_factory=list)
    truncated: bool = False


def parse_frame_line(text: str) -> tuple[RawFrame | None, bool]:
    """One `` > ...`` line (without the marker) -> (frame or None, whether the stack is truncated)."""
    text = text.strip()
    m = _FRAME_ADDR.match(text)
    if m is None:
        # "too many stack frames", "BUG IN ..." and any other bare error: frames are lost from here on.
        return None, True
    head, addr = m.group(1), int(m.group(2), 16)
    if "(" not in head or not head.endswith(")"):
        # "unexpected_backtracing_error [0xIP]": pc in no executable file mapping; the walk stopped.
        return RawFrame(None, head or None, addr), True
    idx = head.index("(")
    module, inner = head[:idx], head[idx + 1:-1]
    function: str | None = None
    if inner:
        name, sep, _off = inner.rpartition("+0x")
        function = (name if sep else inner) or None
    return RawFrame(module, function, addr), False


def _unescape(s: str) -> str:
    raw = s.encode("latin-1", "backslashreplace").decode("unicode_escape").encode("latin-1", "replace")
    return os.fsdecode(raw)


def parse_strace(text: str, *, requested: Iterable[str] | None = None, command: Sequence[str] = (),
                 cwd: str | None = None) -> Trace:
    """Parse the ``-o`` file of ``strace -f -k -qq`` (one file, pid-prefixed lines) into a :class:`Trace`.

    ``requested``: the syscalls to keep in :attr:`Task.syscalls` (default: every syscall seen).
    ``cwd``: the directory relative ``execve`` paths are resolved against.
    """
    records: dict[int, list[_Record]] = {}
    first_seen: list[int] = []
    pending: dict[int, _Record] = {}  # tid -> unfinished syscall
    owner: _Record | None = None  # the record the next frame lines belong to
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith(" > "):
            if owner is None:
                raise OracleError(f"strace output line {lineno}: a frame line follows no finished syscall")
            frame, trunc = parse_frame_line(line[3:])
            if owner.truncated:
                continue
            if frame is not None:
                owner.frames.append(frame)
            owner.truncated = owner.truncated or trunc
            continue
        owner = None
        if not line.strip():
            continue
        m = _PID_LINE.match(line)
        if m is None:
            raise OracleError(f"strace output line {lineno}: no pid prefix (was -f used?): {line!r}")
        tid, rest = int(m.group(1)), m.group(2)
        if tid not in records:
            records[tid] = []
            first_seen.append(tid)
        if rest.startswith("+++") or rest.startswith("???"):
            continue  # exit / "superseded by execve" notices
        sm = _SIGNAL.match(rest)
        if sm is not None:
            rec = _Record(tid, "signal", sm.group(1), lineno, result="")
            records[tid].append(rec)
            owner = rec
            continue
        rm = _RESUMED.match(rest)
        if rm is not None:
            rec_or_none = pending.pop(tid, None)
            if rec_or_none is None or rec_or_none.name != rm.group(1):
                raise OracleError(f"strace output line {lineno}: resumed {rm.group(1)} was never started")
            rec = rec_or_none
            tail = rm.group(2)
            rec.args += tail
            res = _RESULT.search(tail)
            rec.result = res.group(1) if res else "?"
            rec.result_line = lineno
            owner = rec
            continue
        cm = _CALL.match(rest)
        if cm is None:
            raise OracleError(f"strace output line {lineno}: cannot parse {line!r}")
        rec = _Record(tid, "syscall", cm.group(1), lineno, args=cm.group(2))
        records[tid].append(rec)
        if rest.endswith("<unfinished ...>"):
            pending[tid] = rec
            continue
        res = _RESULT.search(rest)
        rec.result = res.group(1) if res else "?"
        rec.result_line = lineno
        owner = rec
    return _assemble(records, first_seen, requested=requested, command=command, cwd=cwd, raw=text)


def _ok_result(result: str | None) -> int | None:
    if result is None:
        return None
    m = re.match(r"^(-?\d+)", result.strip())
    return int(m.group(1)) if m else None


def _assemble(records: dict[int, list[_Record]], first_seen: list[int], *, requested: Iterable[str] | None,
              command: Sequence[str], cwd: str | None, raw: str) -> Trace:
    if not first_seen:
        raise OracleError("the trace has no tasks")
    root = first_seen[0]
    # Creation: (child tid) -> (parent tid, CLONE_THREAD?, index of the creating record in the parent).
    created: dict[int, tuple[int, bool, int]] = {}
    creation_order: list[int] = [root]
    # The clone returns in file order (the order in which they were printed).
    returns: list[tuple[int, int, int, bool, int]] = []  # (line, child, parent, thread, record index)
    for tid, recs in records.items():
        for i, rec in enumerate(recs):
            if rec.kind == "syscall" and rec.name in _CREATORS:
                child = _ok_result(rec.result)
                if child is not None and child > 0:
                    thread = rec.name in ("clone", "clone3") and "CLONE_THREAD" in rec.args
                    returns.append((rec.result_line, child, tid, thread, i))
    for _line, child, parent, thread, i in sorted(returns):
        if child in created or child == root:
            continue
        created[child] = (parent, thread, i)
        creation_order.append(child)
    for tid in first_seen:  # tasks whose creation was not seen (should not happen under -f)
        if tid not in creation_order:
            creation_order.append(tid)

    wanted = frozenset(requested) if requested is not None else None
    tasks: list[Task] = []
    exe_at_record: dict[int, list[str | None]] = {}
    by_tid: dict[int, Task] = {}
    for index, tid in enumerate(creation_order):
        recs = records.get(tid, [])
        if tid in created:
            parent, thread, at = created[tid]
            pid = by_tid[parent].pid if thread and parent in by_tid else tid
            exe = exe_at_record[parent][at] if parent in exe_at_record else None
            parent_tid: int | None = parent
        else:
            pid, exe, parent_tid = tid, None, None
        task = Task(index=index, tid=tid, pid=pid, parent_tid=parent_tid)
        exes: list[str | None] = []
        for rec in recs:
            exes.append(exe)
            if rec.kind == "signal":
                task.signals.append((len(task.syscalls), rec.name))
                continue
            if wanted is None or rec.name in wanted:
                task.syscalls.append(Syscall(name=rec.name, frames=tuple(rec.frames), truncated=rec.truncated,
                                             exe=exe, result=rec.result or "?", args=rec.args, line=rec.line))
            if rec.name in _EXECS and _ok_result(rec.result) == 0:
                exe = _exec_path(rec, cwd)
        exe_at_record[tid] = exes
        by_tid[tid] = task
        tasks.append(task)
    order_ok = [t.tid for t in tasks] == sorted(t.tid for t in tasks)
    return Trace(source="strace", command=tuple(command),
                 requested=wanted if wanted is not None else frozenset(
                     r.name for rs in records.values() for r in rs if r.kind == "syscall"),
                 tasks=tasks, raw_output=raw, tid_order_ok=order_ok)


def _exec_path(rec: _Record, cwd: str | None) -> str | None:
    args = rec.args
    if rec.name == "execveat":
        parts = args.split(",", 1)  # execveat(dirfd, "path", ...)
        args = parts[1] if len(parts) > 1 else args
    m = _QUOTED.search(args)
    if m is None:
        return None
    path = _unescape(m.group(1))
    if not os.path.isabs(path) and cwd:
        path = os.path.join(cwd, path)
    return os.path.realpath(path)


# --------------------------------------------------------------------------------------------------
# ELF facts (from readelf, never from ccprofd)


def _readelf(*args: str) -> str:
    return subprocess.run(["readelf", *args], check=True, capture_output=True, text=True,
                          env={"LC_ALL": "C", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}).stdout


class Segment(NamedTuple):
    offset: int
    vaddr: int
    filesz: int
    memsz: int
    flags: str


@dataclass(frozen=True)
class ElfLayout:
    """The PT_LOAD segments, entry point and build-id of one ELF file (``readelf -lW -hW -nW``)."""

    path: str
    segments: tuple[Segment, ...]
    entry: int
    build_id: str | None
    pie: bool

    def vaddr_of_offset(self, offset: int) -> int | None:
        """File offset -> ELF virtual address through the PT_LOAD that maps it (executable first)."""
        hits = [s for s in self.segments if s.offset <= offset < s.offset + s.filesz]
        if not hits:
            return None
        hits.sort(key=lambda s: "E" not in s.flags)
        seg = hits[0]
        return offset - seg.offset + seg.vaddr

    def offset_of_vaddr(self, vaddr: int) -> int | None:
        for s in self.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                return vaddr - s.vaddr + s.offset
        return None


_LOAD_RE = re.compile(r"^\s*LOAD\s+0x([0-9a-f]+)\s+0x([0-9a-f]+)\s+0x[0-9a-f]+\s+0x([0-9a-f]+)\s+"
                      r"0x([0-9a-f]+)\s+(.+?)\s+0x[0-9a-f]+\s*$")


@functools.cache
def elf_layout(path: str) -> ElfLayout:
    real = os.path.realpath(path)
    segs = []
    for line in _readelf("-lW", real).splitlines():
        m = _LOAD_RE.match(line)
        if m:
            segs.append(Segment(int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16),
                                int(m.group(4), 16), m.group(5).replace(" ", "")))
    header = _readelf("-hW", real)
    em = re.search(r"Entry point address:\s+0x([0-9a-f]+)", header)
    tm = re.search(r"Type:\s+(\w+)", header)
    bm = re.search(r"Build ID:\s+([0-9a-f]+)", _readelf("-nW", real))
    if not segs or em is None:
        raise OracleError(f"{real}: not an ELF executable with PT_LOAD segments")
    return ElfLayout(real, tuple(segs), int(em.group(1), 16), bm.group(1) if bm else None,
                     bool(tm and tm.group(1) == "DYN"))


class FunctionSymbol(NamedTuple):
    name: str | None  # None: known only from an FDE (stripped binary)
    start: int
    size: int  # 0 = unknown: extends to the next function


_COLD = re.compile(r"^(.+)\.cold(?:\.\d+)?$")
_SYM = re.compile(r"^\s*\d+:\s+([0-9a-f]+)\s+(\d+|0x[0-9a-f]+)\s+FUNC\s+(\w+)\s+\w+\s+(\w+)\s+(.*)$")
_FDE = re.compile(r"\bFDE\b.*\bpc=([0-9a-f]+)\.\.([0-9a-f]+)")


@dataclass(frozen=True)
class FunctionTable:
    """Functions of one ELF file by address: FUNC symbols (demangled), else ``.eh_frame`` FDE ranges.

    gcc's ``f.cold`` fragments are folded into ``f`` (they run in f's frame).  Several symbols at one
    address are aliases; the GLOBAL one, then the shortest name, is used.
    """

    path: str
    functions: tuple[FunctionSymbol, ...]  # sorted by start
    fragments: tuple[tuple[int, int, int], ...]  # (start, end, owner start) of .cold parts, sorted

    def containing(self, vaddr: int) -> FunctionSymbol | None:
        """The function whose code holds ``vaddr`` (a fragment's owner for a fragment address)."""
        starts = [f[0] for f in self.fragments]
        i = bisect.bisect_right(starts, vaddr) - 1
        if i >= 0 and self.fragments[i][0] <= vaddr < self.fragments[i][1]:
            return self.at(self.fragments[i][2])
        keys = [f.start for f in self.functions]
        j = bisect.bisect_right(keys, vaddr) - 1
        if j < 0:
            return None
        fn = self.functions[j]
        if fn.size and vaddr >= fn.start + fn.size:
            return None
        return fn

    def at(self, start: int) -> FunctionSymbol | None:
        keys = [f.start for f in self.functions]
        j = bisect.bisect_left(keys, start)
        return self.functions[j] if j < len(keys) and keys[j] == start else None

    def by_name(self, name: str) -> FunctionSymbol:
        for fn in self.functions:
            if fn.name == name:
                return fn
        raise KeyError(f"{self.path}: no function {name!r}")


@functools.cache
def function_table(path: str) -> FunctionTable:
    real = os.path.realpath(path)
    found: dict[int, list[tuple[str, int, bool]]] = {}
    for line in _readelf("-sW", "-C", real).splitlines():
        m = _SYM.match(line)
        if m is None or m.group(4) == "UND":
            continue
        addr = int(m.group(1), 16)
        size = int(m.group(2), 0)
        name = m.group(5).strip().split("@", 1)[0]
        if addr == 0 or not name:
            continue
        found.setdefault(addr, []).append((name, size, m.group(3) == "GLOBAL"))
    functions: list[FunctionSymbol] = []
    cold: list[tuple[str, int, int]] = []
    for addr, names in found.items():
        names.sort(key=lambda n: (not n[2], len(n[0]), n[0]))
        name, size, _ = names[0]
        if _COLD.match(name):
            cold.append((name, addr, size))
            continue
        functions.append(FunctionSymbol(name, addr, max(n[1] for n in names)))
    if not functions:  # stripped: FDE ranges give the functions, without names
        for line in _readelf("--debug-dump=frames", real).splitlines():
            m = _FDE.search(line)
            if m:
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                if hi > lo:
                    functions.append(FunctionSymbol(None, lo, hi - lo))
    functions.sort(key=lambda f: f.start)
    owners = {f.name: f.start for f in functions if f.name}
    fragments = []
    for name, addr, size in cold:
        m = _COLD.match(name)
        assert m is not None
        owner = owners.get(m.group(1))
        if owner is not None:
            fragments.append((addr, addr + max(size, 1), owner))
        else:
            functions.append(FunctionSymbol(name, addr, size))
    functions.sort(key=lambda f: f.start)
    return FunctionTable(real, tuple(functions), tuple(sorted(fragments)))


@functools.cache
def _module_bytes_at(path: str, offset: int, size: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(size)
    except OSError:
        return b""


def is_sigreturn_trampoline(frame: RawFrame) -> bool:
    """Whether the frame's pc is at an x86-64 rt_sigreturn trampoline (``__restore_rt``), by its bytes."""
    if frame.module is None or not frame.module.startswith("/"):
        return False
    return _module_bytes_at(frame.module, frame.offset, len(SIGRETURN_TRAMPOLINE)) == SIGRETURN_TRAMPOLINE


# --------------------------------------------------------------------------------------------------
# Frames of the analysed binary


class TargetFrame(NamedTuple):
    """A frame of the analysed binary, with ELF virtual addresses.

    ``kind``: ``"call"`` -- the frame is calling the next inner frame, ``pc`` is a return address and
    ``return_address == pc``; ``"innermost"`` -- the pc of the syscall itself is in the binary (a
    ``syscall`` instruction in the binary's own code); ``"interrupted"`` -- the next inner frame is a
    signal trampoline, ``pc`` is the interrupted instruction.  The last two have no return address.
    """

    function: str | None  # demangled name from the binary's (or twin's) symbols; None if unknown
    entry: int | None  # vaddr of the function's entry (symbols, else FDE), None if unknown
    pc: int  # vaddr of the frame's pc
    return_address: int | None
    kind: Literal["call", "innermost", "interrupted"]
    depth: int  # index of the frame in the whole stack (0 = innermost)


def same_file(a: str | None, b: str) -> bool:
    if a is None:
        return False
    return os.path.realpath(a.removesuffix(" (deleted)")) == os.path.realpath(b)


def target_frames(frames: Sequence[RawFrame], binary_path: str | os.PathLike[str], *,
                  symbols_path: str | os.PathLike[str] | None = None) -> list[TargetFrame]:
    """The frames of ``frames`` (innermost first) that belong to ``binary_path``, innermost first.

    ``symbols_path``: an unstripped twin of a stripped binary (same build-id) to take names from;
    default the binary itself (names from its ``.symtab``/``.dynsym``, else FDE ranges without names).
    """
    binary = os.path.realpath(binary_path)
    layout = elf_layout(binary)
    table = function_table(_symbols_file(binary, symbols_path))
    out: list[TargetFrame] = []
    for depth, frame in enumerate(frames):
        if not same_file(frame.module, binary):
            continue
        vaddr = layout.vaddr_of_offset(frame.offset)
        if vaddr is None:
            raise OracleError(f"{binary}: file offset {frame.offset:#x} is in no PT_LOAD segment")
        kind: Literal["call", "innermost", "interrupted"]
        if depth == 0:
            kind = "innermost"
        elif is_sigreturn_trampoline(frames[depth - 1]):
            kind = "interrupted"
        else:
            kind = "call"
        fn = table.containing(vaddr - 1 if kind == "call" else vaddr)
        out.append(TargetFrame(fn.name if fn else None, fn.start if fn else None, vaddr,
                               vaddr if kind == "call" else None, kind, depth))
    return out


def _symbols_file(binary: str, symbols_path: str | os.PathLike[str] | None) -> str:
    if symbols_path is None:
        return binary
    twin = os.path.realpath(symbols_path)
    a, b = elf_layout(binary).build_id, elf_layout(twin).build_id
    if a is not None and b is not None and a != b:
        raise OracleError(f"{twin} is not a twin of {binary}: build-id {b} != {a}")
    return twin


def entry_function(binary_path: str | os.PathLike[str], *,
                   symbols_path: str | os.PathLike[str] | None = None) -> FunctionSymbol | None:
    """The function holding the ELF entry point (``_start``): process start-up code, not a context.

    By symbol where one covers the entry, else by the ``.eh_frame`` FDE that covers it (binutils'
    readelf): binaries such as Debian's lua5.4 export some symbols but none for ``_start``."""
    binary = os.path.realpath(binary_path)
    entry = elf_layout(binary).entry
    found = function_table(_symbols_file(binary, symbols_path)).containing(entry)
    if found is not None and (not found.size or found.start <= entry < found.start + found.size):
        return found
    for line in _readelf("--debug-dump=frames", binary).splitlines():
        m = _FDE.search(line)
        if m:
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            if lo <= entry < hi:
                return FunctionSymbol(None, lo, hi - lo)
    return None


def analysed_syscalls(task: Task, binary_path: str | os.PathLike[str]) -> list[Syscall]:
    """The syscalls of ``task`` made while it ran the analysed binary (``exe`` equal to it)."""
    return [s for s in task.syscalls if s.exe is not None and same_file(s.exe, os.fspath(binary_path))]
