"""Checks of the strace oracle (``tests/strace_oracle.py``) and of ``fidelity.compare`` themselves.

No ccprofd here.  Every expectation is derived by hand from the C source of the program (which
functions are on the stack, how deep, which call site) and located with ``objdump -d`` (the address
after each ``call``), never copied from the oracle's own output:

* the address rule: each frame's vaddr is the address right after a ``call`` in objdump, whose
  target is the next inner frame's function (or the PLT stub of the libc function that made the
  syscall); on non-PIE builds strace's number is a file offset, not the vaddr;
* ``calls``: writes from main>say at two distinct call sites of main, openat/getppid from main>opener;
  the loader's syscalls before main and the exit-time flush carry no frames of the binary;
* ``recursion``: depth N gives N+1 frames of ``fact``, 2N+1 alternating is_even/is_odd, 3(N+1) ring
  frames;
* ``threads``: tasks in creation order, threads of one process, start routines outermost;
* ``forks``: the child is a process of its own and keeps main>spawn above child_work; a noreturn call
  at the very end of a function (``_exit``) is named after the caller (the ``ra - 1`` rule);
* ``execs``: the program image is tracked across execve;
* ``sighandler``/``sigframes``: handler frames above the interrupted context; a frame interrupted in
  the binary's own code (at a ``ud2``), on the normal stack and on a sigaltstack;
* stripped PIE and non-PIE: strace prints no names, the oracle gives the same vaddrs and takes the
  names from the unstripped twin;
* the parser on hand-written strace text (unfinished/resumed, signals, frame limit, C++ names);
* ``compare()`` on samples built by hand from objdump (must pass) and on deliberately wrong ones
  (wrong call site, missing frame, swapped order, wrong thread, wrong pid, extra/missing samples,
  an incomplete sample that is not a suffix) that must fail.
"""

from __future__ import annotations

import copy
import functools
import os
import pathlib
import re
import subprocess
from typing import Any

import pytest
from conftest import require_tool
from fidelity import compare, samples_from_oracle
from programs.build import build as build_program
from strace_oracle import (
    RawFrame,
    TargetFrame,
    Trace,
    analysed_syscalls,
    elf_layout,
    function_table,
    parse_strace,
    run_strace,
    target_frames,
)

VARIANTS = [pytest.param(opt, pie, id=f"{opt}-{'pie' if pie else 'nopie'}")
            for opt in ("O0", "O2") for pie in (True, False)]


def _build(name: str, **variant: Any) -> pathlib.Path:
    """tests/programs/build.py's build(), typed for this file."""
    return pathlib.Path(build_program(name, **variant))


@pytest.fixture(autouse=True)
def _tools() -> None:
    require_tool("strace")
    require_tool("objdump")


# --------------------------------------------------------------------------------------------------
# objdump: the independent reading of the code


class Code:
    """objdump -d of one binary: instructions, labels, and "what call ends right before address X"."""

    _INSN = re.compile(r"^\s*([0-9a-f]+):\t[0-9a-f ]+\t(.*)$")
    _LABEL = re.compile(r"^([0-9a-f]+) <(.+)>:$")

    def __init__(self, path: pathlib.Path) -> None:
        text = subprocess.run(["objdump", "-d", "-w", str(path)], check=True,
                              capture_output=True, text=True, env={"LC_ALL": "C", "PATH": os.environ["PATH"]}
                              ).stdout
        self.insns: list[tuple[int, str]] = []
        self.labels: dict[int, str] = {}
        for line in text.splitlines():
            m = self._LABEL.match(line)
            if m:
                self.labels[int(m.group(1), 16)] = m.group(2)
                continue
            m = self._INSN.match(line)
            if m:
                self.insns.append((int(m.group(1), 16), m.group(2).strip()))
        self.next_of = {a: self.insns[i + 1][0] for i, (a, _) in enumerate(self.insns[:-1])}
        self.call_before: dict[int, tuple[int, str]] = {}
        for addr, text_ in self.insns:
            words = [w for w in text_.split() if w not in ("bnd", "notrack")]
            if words and words[0].startswith("call") and addr in self.next_of:
                self.call_before[self.next_of[addr]] = (addr, " ".join(words[1:]))
        self.by_name = {v: k for k, v in self.labels.items()}

    def mnemonic_at(self, addr: int) -> str:
        for a, t in self.insns:
            if a == addr:
                return t.split()[0]
        raise KeyError(hex(addr))

    def calls_to(self, caller: str, callee: str) -> list[int]:
        """Return addresses (address after the call) of every ``call <callee>`` inside ``caller``."""
        lo = self.by_name[caller]
        hi = min((a for a in self.labels if a > lo), default=1 << 64)
        return sorted(ra for ra, (at, operand) in self.call_before.items()
                      if lo <= at < hi and operand.endswith(f"<{callee}>"))


@functools.cache
def code_of(path: pathlib.Path) -> Code:
    return Code(path)


def chain(frames: list[TargetFrame]) -> list[str | None]:
    """Function names outermost first, without the start-up code (_start)."""
    return [f.function for f in reversed(frames) if f.function != "_start"]


def ras(frames: list[TargetFrame]) -> list[int | None]:
    return [f.return_address for f in reversed(frames) if f.function != "_start"]


def syscalls_of(trace: Trace, binary: pathlib.Path, task: int = 0) -> list[Any]:
    return analysed_syscalls(trace.tasks[task], binary)


def check_address_rule(frames: list[TargetFrame], code: Code) -> None:
    """Each "call" frame: pc = address after a call; its target is the inner frame's function or a PLT."""
    for i, f in enumerate(frames):
        if f.kind != "call":
            continue
        assert f.pc in code.call_before, f"{f.function} frame pc {f.pc:#x} is not right after a call"
        _, operand = code.call_before[f.pc]
        inner = frames[i - 1] if i > 0 else None
        if inner is not None and inner.depth == f.depth - 1:  # the inner frame is in the binary too
            if operand.startswith("*"):
                continue  # an indirect call: any target
            assert operand.endswith(f"<{inner.function}>"), (f.function, hex(f.pc), operand, inner)
        else:
            assert "@plt>" in operand or operand.startswith("*"), (f.function, hex(f.pc), operand)


# --------------------------------------------------------------------------------------------------
# The address rule, PIE and non-PIE


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_address_rule_against_objdump(opt: str, pie: bool) -> None:
    binary = _build("calls", opt=opt, pie=pie)
    trace = run_strace([str(binary)], ["write", "getppid", "openat"])
    code = code_of(binary)
    layout = elf_layout(str(binary))
    assert layout.pie == pie
    seen = 0
    for sc in syscalls_of(trace, binary):
        tfs = target_frames(sc.frames, binary)
        check_address_rule(tfs, code)
        for tf in tfs:
            raw = sc.frames[tf.depth]
            # strace's number is a file offset: for non-PIE it differs from the vaddr by the base.
            text_seg = next(s for s in layout.segments if "E" in s.flags)
            assert tf.pc == raw.offset - text_seg.offset + text_seg.vaddr
            if not pie:
                assert tf.pc == raw.offset + 0x400000 and raw.offset < 0x400000
            # strace names binary frames from .symtab as "name+0xOFF"; the oracle agrees by vaddr.
            assert raw.function is not None and tf.function is not None
            sym = function_table(str(binary)).by_name(raw.function.split("(")[0])
            assert sym.start == tf.entry, (raw, tf)
            seen += 1
    assert seen >= 8


# --------------------------------------------------------------------------------------------------
# Hand-derived contexts


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_calls_two_call_sites_and_loader(opt: str, pie: bool) -> None:
    binary = _build("calls", opt=opt, pie=pie)
    trace = run_strace([str(binary)], ["write", "getppid", "openat"])
    assert trace.exit_status == 0 and len(trace.tasks) == 1
    code = code_of(binary)
    scs = syscalls_of(trace, binary)
    names = [s.name for s in scs]
    # Loader: ld.so.cache and libc opened before main -- no frame of the binary at all.
    loader = [s for s in scs if s.name == "openat" and "/dev/null" not in s.args]
    assert len(loader) >= 2 and all(target_frames(s.frames, binary) == [] for s in loader)
    # Program order, from the source: open, getppid (opener), say 1, say 2, then the exit-time flush
    # of puts' buffer (stdout is a pipe): its write has only start-up code above it.
    body = [s for s in scs if s not in loader]
    assert [s.name for s in body] == ["openat", "getppid", "write", "write", "write"], names
    opened, ppid, say1, say2, flush = body
    assert '"calls: say 1\\n"' in say1.args and '"calls: say 2\\n"' in say2.args
    assert '"calls: start\\n"' in flush.args
    for sc in (opened, ppid):
        assert chain(target_frames(sc.frames, binary)) == ["main", "opener"]
    assert ras(target_frames(opened.frames, binary))[1] == code.calls_to("opener", "open@plt")[0]
    assert ras(target_frames(ppid.frames, binary))[1] == code.calls_to("opener", "getppid@plt")[0]
    sites = code.calls_to("main", "say")
    assert len(sites) == 2
    f1, f2 = target_frames(say1.frames, binary), target_frames(say2.frames, binary)
    assert chain(f1) == chain(f2) == ["main", "say"]
    assert ras(f1) == [sites[0], code.calls_to("say", "write@plt")[0]]
    assert ras(f2) == [sites[1], code.calls_to("say", "write@plt")[0]]
    assert chain(target_frames(flush.frames, binary)) == []


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_recursion_depths(opt: str, pie: bool) -> None:
    n = 20
    binary = _build("recursion", opt=opt, pie=pie)
    trace = run_strace([str(binary), str(n)], ["write", "getppid", "openat"])
    code = code_of(binary)
    scs = [s for s in syscalls_of(trace, binary) if target_frames(s.frames, binary)]
    fact = next(s for s in scs if s.name == "getppid")
    frames = target_frames(fact.frames, binary)
    check_address_rule(frames, code)
    assert chain(frames) == ["main"] + ["fact"] * (n + 1)
    assert set(ras(frames)[2:-1]) == set(code.calls_to("fact", "fact"))  # one recursive call site
    even = next(s for s in scs if s.name == "write" and "even" in s.args)
    frames = target_frames(even.frames, binary)
    check_address_rule(frames, code)
    assert chain(frames) == ["main"] + ["is_even", "is_odd"] * n + ["is_even", "report"]
    ring = next(s for s in scs if s.name == "openat")
    frames = target_frames(ring.frames, binary)
    check_address_rule(frames, code)
    assert chain(frames) == ["main"] + ["ring_a", "ring_b", "ring_c"] * (n + 1)
    assert not fact.truncated and not ring.truncated


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_threads_creation_order_and_start_routines(opt: str, pie: bool) -> None:
    n = 5
    binary = _build("threads", opt=opt, pie=pie)
    trace = run_strace([str(binary), str(n)], ["write", "getppid"])
    assert [t.index for t in trace.tasks] == [0, 1, 2] and trace.tid_order_ok
    main, a, b = trace.tasks
    assert a.pid == b.pid == main.tid == main.pid and a.parent_tid == b.parent_tid == main.tid
    assert [s.name for s in a.syscalls] == ["getppid"] and [s.name for s in b.syscalls] == ["write"]
    fa = target_frames(a.syscalls[0].frames, binary)
    fb = target_frames(b.syscalls[0].frames, binary)
    assert chain(fa) == ["worker_a"] + ["down_a"] * (n + 1)
    assert chain(fb) == ["worker_b"] + ["down_b"] * (n + 1)
    check_address_rule(fa, build_code := code_of(binary))
    check_address_rule(fb, build_code)
    # The start routine is entered from libc (start_thread): the frame above it is not the binary's.
    assert fa[-1].depth + 1 < len(a.syscalls[0].frames)
    assert not any(chain(target_frames(s.frames, binary))[:1] == ["worker_a"] for s in main.syscalls)


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_fork_child_and_noreturn_call_at_function_end(opt: str, pie: bool) -> None:
    binary = _build("forks", opt=opt, pie=pie)
    trace = run_strace([str(binary)], ["write", "getppid", "wait4", "exit_group"])
    assert len(trace.tasks) == 2
    parent, child = trace.tasks
    assert child.pid == child.tid != parent.pid and child.parent_tid == parent.tid
    code = code_of(binary)
    cw = [s for s in child.syscalls if s.name in ("write", "getppid", "exit_group")]
    assert [s.name for s in cw] == ["write", "getppid", "exit_group"]
    for sc in cw:
        frames = target_frames(sc.frames, binary)
        assert chain(frames) == ["main", "spawn", "child_work"]
        check_address_rule(frames, code)
        assert ras(frames)[1] == code.calls_to("spawn", "child_work")[0]
    pw = [s for s in parent.syscalls if s.name in ("wait4",)]
    pframes = target_frames(pw[0].frames, binary)
    assert chain(pframes) == ["main", "spawn", "parent_work"]
    assert ras(pframes)[1] == code.calls_to("spawn", "parent_work")[0]
    # _exit is noreturn: at -O2 its call is child_work's last instruction, so the return address is
    # one past child_work's end.  The oracle still names the frame child_work (it looks up ra - 1).
    exit_ra = ras(target_frames(cw[2].frames, binary))[-1]
    assert exit_ra is not None
    cw_sym = function_table(str(binary)).by_name("child_work")
    if opt == "O2":
        assert exit_ra == cw_sym.start + cw_sym.size


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_exec_changes_the_image(opt: str, pie: bool) -> None:
    binary = _build("execs", opt=opt, pie=pie)
    trace = run_strace([str(binary)], ["write", "getppid", "execve"])
    (task,) = trace.tasks
    names = [(s.name, s.exe) for s in task.syscalls]
    real = os.path.realpath(binary)
    echo = os.path.realpath("/bin/echo")
    assert names[0] == ("execve", None)  # the command's own exec, by strace's child
    assert ("execve", real) in names
    after = names[names.index(("execve", real)) + 1:]
    assert after and all(exe == echo for _, exe in after)
    mine = analysed_syscalls(task, binary)
    assert [s.name for s in mine] == ["write", "getppid", "write", "execve"]
    assert chain(target_frames(mine[-1].frames, binary)) == ["main", "run_exec"]


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_signal_handler_frames(opt: str, pie: bool) -> None:
    binary = _build("sighandler", opt=opt, pie=pie)
    trace = run_strace([str(binary)], ["write", "getppid"])
    (task,) = trace.tasks
    assert [name for _, name in task.signals] == ["SIGUSR1"]
    scs = analysed_syscalls(task, binary)
    inside = [s for s in scs if "in handler" in s.args or s.name == "getppid"]
    assert [chain(target_frames(s.frames, binary)) for s in inside] == [
        ["main", "trigger", "on_signal"], ["main", "trigger", "on_signal", "in_handler"]]
    # raise() was interrupted inside libc: trigger's frame is a plain call frame.
    assert all(f.kind == "call" for s in inside for f in target_frames(s.frames, binary))


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_frame_interrupted_in_the_binary(opt: str, pie: bool) -> None:
    binary = _build("sigframes", opt=opt, pie=pie)
    trace = run_strace([str(binary)], ["write", "getppid"])
    (task,) = trace.tasks
    assert trace.exit_status == 0 and [n for _, n in task.signals] == ["SIGILL", "SIGILL"]
    code = code_of(binary)
    scs = analysed_syscalls(task, binary)
    in_handler = [s for s in scs if target_frames(s.frames, binary) and "on_ill" in
                  chain(target_frames(s.frames, binary))]
    assert len(in_handler) == 4  # write + getppid, on the normal stack then on the sigaltstack
    main_sites = code.calls_to("main", "round")
    for i, sc in enumerate(in_handler):
        frames = target_frames(sc.frames, binary)
        leaf = ["handler_leaf"] if sc.name == "getppid" else []
        expect = ["main", "round", "fault_here", "on_ill", *leaf]
        assert chain(frames) == expect
        interrupted = [f for f in frames if f.kind == "interrupted"]
        assert [f.function for f in interrupted] == ["fault_here"]
        assert interrupted[0].return_address is None
        assert code.mnemonic_at(interrupted[0].pc) == "ud2"
        assert ras(frames)[0] == main_sites[i // 2]  # round 1, then round 2 (altstack)
        check_address_rule(frames, code)


@pytest.mark.parametrize("opt,pie", VARIANTS)
def test_stripped_binary_same_vaddrs_names_from_twin(opt: str, pie: bool) -> None:
    twin = _build("calls", opt=opt, pie=pie)
    stripped = _build("calls", opt=opt, pie=pie, strip=True)
    syscalls = ["write", "getppid", "openat"]
    full = syscalls_of(run_strace([str(twin)], syscalls), twin)
    bare = syscalls_of(run_strace([str(stripped)], syscalls), stripped)
    assert [s.name for s in full] == [s.name for s in bare]
    with_frames = 0
    for a, b in zip(full, bare, strict=True):
        named = target_frames(a.frames, twin)
        from_twin = target_frames(b.frames, stripped, symbols_path=twin)
        unnamed = target_frames(b.frames, stripped)
        # strace has no names for the stripped binary's frames
        assert all(b.frames[f.depth].function is None for f in unnamed)
        assert [(f.function, f.pc, f.kind) for f in from_twin] == [(f.function, f.pc, f.kind) for f in named]
        # without the twin: FDE ranges give the same function entries, no names
        assert [(f.entry, f.pc) for f in unnamed] == [(f.entry, f.pc) for f in named]
        assert all(f.function is None for f in unnamed)
        with_frames += bool(named)
    assert with_frames >= 4


def test_twin_with_another_build_id_is_refused() -> None:
    from strace_oracle import OracleError
    a = _build("calls", opt="O0", pie=True, strip=True)
    b = _build("calls", opt="O2", pie=True)
    frames = (RawFrame(str(a), None, 0x1100),)
    with pytest.raises(OracleError, match="not a twin"):
        target_frames(frames, a, symbols_path=b)


# --------------------------------------------------------------------------------------------------
# The parser on hand-written text


def test_parser_unfinished_resumed_signals_and_limits() -> None:
    text = "\n".join([
        '100 execve("/bin/true", ["true"], 0x7ffd /* 3 vars */) = 0',
        " > /usr/lib/ld.so(_dl_start+0x10) [0x1010]",
        "100 clone3({flags=CLONE_VM|CLONE_THREAD|CLONE_SETTLS, exit_signal=0} => {parent_tid=[102]}, 88)"
        " = 102",
        " > /lib/libc.so.6() [0x2000]",
        '102 write(1, "b", 1 <unfinished ...>',
        "100 clone(child_stack=NULL, flags=CLONE_CHILD_CLEARTID|SIGCHLD, child_tidptr=0x1) = 101",
        " > /lib/libc.so.6(_Fork+0x23) [0x3000]",
        "101 getppid()                         = 100",
        " > /lib/libc.so.6(getppid+0x7) [0x4000]",
        " > /bin/true(ns::f(int)+0x8) [0x1234]",
        " > /bin/true(+0x0) [0x1111]",
        "102 <... write resumed>)              = 1",
        " > /lib/libc.so.6(__write+0x10) [0x5000]",
        " > /bin/true(g+0x1) [0x1300]",
        " > too many stack frames",
        "100 --- SIGCHLD {si_signo=SIGCHLD, si_code=CLD_EXITED} ---",
        " > /lib/libc.so.6(wait4+0x13) [0x6000]",
        "100 +++ exited with 0 +++",
    ])
    trace = parse_strace(text, requested={"write", "getppid"}, cwd="/")
    # Creation order: by the order of the clone returns (102 before 101), not by tid, not by first line.
    assert [t.tid for t in trace.tasks] == [100, 102, 101]
    assert not trace.tid_order_ok
    root, thread, child = trace.tasks
    assert thread.pid == 100 and child.pid == 101 and child.parent_tid == 100
    assert root.syscalls == [] and root.signals == [(0, "SIGCHLD")]
    (w,) = thread.syscalls
    assert w.name == "write" and w.result == "1" and w.truncated
    assert w.frames == (RawFrame("/lib/libc.so.6", "__write", 0x5000), RawFrame("/bin/true", "g", 0x1300))
    (g,) = child.syscalls
    assert g.frames[1] == RawFrame("/bin/true", "ns::f(int)", 0x1234)
    assert g.frames[2] == RawFrame("/bin/true", None, 0x1111) and not g.truncated
    # Images: the execve made everything after it /bin/true (realpath), inherited by new tasks.
    assert g.exe == os.path.realpath("/bin/true") == w.exe


def test_parser_rejects_orphan_frames() -> None:
    from strace_oracle import OracleError
    with pytest.raises(OracleError, match="line 2"):
        parse_strace('100 write(1, "x", 1 <unfinished ...>\n > /lib/libc.so.6(w+0x1) [0x10]\n')


# --------------------------------------------------------------------------------------------------
# compare(): hand-built samples from objdump must pass, wrong ones must fail


def _frame(binary: pathlib.Path, function: str, ra: int | None, **extra: Any) -> dict[str, Any]:
    return {"function": function, "module": str(binary), "build_id": None, "analysed": True,
            "call_site": None, "return_address": None if ra is None else f"{ra:#x}", **extra}


def _sample(tid: int, syscall: str, frames: list[dict[str, Any]], t: int, complete: bool = True,
            pid: int | None = None) -> dict[str, Any]:
    return {"time_ns": t, "pid": tid if pid is None else pid, "tid": tid, "event": "syscall",
            "syscall": syscall, "complete": complete, "frames": frames}


def _calls_samples(binary: pathlib.Path, code: Code, tid: int = 4242) -> list[dict[str, Any]]:
    """What a correct tracer writes for calls.c, from the source and objdump alone (libc frames too)."""
    libc = {"function": "__write", "module": "/usr/lib/x86_64-linux-gnu/libc.so.6", "build_id": None,
            "analysed": False, "call_site": None, "return_address": None}
    main_opener = code.calls_to("main", "opener")[0]
    say1, say2 = code.calls_to("main", "say")
    say_write = code.calls_to("say", "write@plt")[0]
    rows = [
        ("openat", []), ("openat", []),  # the loader, before main
        ("openat", [("main", main_opener), ("opener", code.calls_to("opener", "open@plt")[0])]),
        ("getppid", [("main", main_opener), ("opener", code.calls_to("opener", "getppid@plt")[0])]),
        ("write", [("main", say1), ("say", say_write)]),
        ("write", [("main", say2), ("say", say_write)]),
        ("write", []),  # puts' buffer, flushed by exit() after main returned
    ]
    out = []
    for i, (name, frames) in enumerate(rows):
        fs = [_frame(binary, f, ra) for f, ra in frames]
        out.append(_sample(tid, name, [*fs, libc] if fs else [], 1000 + i))
    return out


@pytest.fixture(scope="module")
def calls_case() -> tuple[pathlib.Path, Trace, Code]:
    require_tool("strace")
    binary = _build("calls", opt="O0", pie=False)
    return binary, run_strace([str(binary)], ["write", "getppid", "openat"]), code_of(binary)


def test_compare_accepts_hand_built_samples(calls_case: tuple[pathlib.Path, Trace, Code]) -> None:
    binary, trace, code = calls_case
    samples = _calls_samples(binary, code)
    result = compare(samples, trace, binary)
    result.assert_ok()
    assert result.stats.samples_compared == 7 and result.stats.frames_compared == 8
    # cpu samples and syscalls the oracle did not trace are ignored, tail-call frames excluded
    extra = copy.deepcopy(samples)
    extra.append({**extra[0], "event": "cpu", "syscall": None})
    extra.insert(3, _sample(4242, "close", [], 1002))
    extra[4]["frames"].insert(1, _frame(binary, "twice", None, tail_call=True))
    result = compare(extra, trace, binary)
    result.assert_ok()
    assert result.stats.ignored_samples == 2
    # ccprofd's names for functions of a stripped binary: sub_<entry>
    subs = copy.deepcopy(samples)
    subs[4]["frames"][0]["function"] = f"sub_{code.by_name['main']:x}"
    compare(subs, trace, binary).assert_ok()


def _must_fail(samples: list[dict[str, Any]], trace: Trace, binary: pathlib.Path, kind: str,
               **kw: Any) -> str:
    result = compare(samples, trace, binary, **kw)
    assert not result.ok, "a wrong sample set passed"
    assert kind in {m.kind for m in result.mismatches}, result.report()
    return result.report()


def test_compare_rejects_wrong_call_site(calls_case: tuple[pathlib.Path, Trace, Code]) -> None:
    binary, trace, code = calls_case
    samples = _calls_samples(binary, code)
    a, b = samples[4]["frames"][0], samples[5]["frames"][0]
    a["return_address"], b["return_address"] = b["return_address"], a["return_address"]
    report = _must_fail(samples, trace, binary, "frames")
    assert "syscall #4 write" in report and "return address" in report and "! main" in report


def test_compare_rejects_missing_and_swapped_frames(calls_case: tuple[pathlib.Path, Trace, Code]) -> None:
    binary, trace, code = calls_case
    missing = _calls_samples(binary, code)
    del missing[3]["frames"][1]  # getppid without opener
    _must_fail(missing, trace, binary, "frames")
    swapped = _calls_samples(binary, code)
    fr = swapped[2]["frames"]
    fr[0], fr[1] = fr[1], fr[0]
    _must_fail(swapped, trace, binary, "frames")
    renamed = _calls_samples(binary, code)
    renamed[3]["frames"][1]["function"] = "twice"
    _must_fail(renamed, trace, binary, "frames")
    wrong_sub = _calls_samples(binary, code)
    wrong_sub[3]["frames"][0]["function"] = f"sub_{code.by_name['opener']:x}"
    _must_fail(wrong_sub, trace, binary, "frames")


def test_compare_incomplete_must_be_a_suffix(calls_case: tuple[pathlib.Path, Trace, Code]) -> None:
    binary, trace, code = calls_case
    inner = _calls_samples(binary, code)
    inner[5]["complete"] = False
    del inner[5]["frames"][0]  # only say: the innermost part of main>say
    result = compare(inner, trace, binary)
    result.assert_ok()
    assert result.stats.incomplete_samples == 1
    outer = _calls_samples(binary, code)
    outer[5]["complete"] = False
    del outer[5]["frames"][1]  # only main: a prefix, not a suffix
    _must_fail(outer, trace, binary, "incomplete-not-suffix")


def test_compare_rejects_missing_extra_and_renamed_syscalls(calls_case: tuple[pathlib.Path, Trace, Code]
                                                           ) -> None:
    binary, trace, code = calls_case
    fewer = _calls_samples(binary, code)[:-1]
    _must_fail(fewer, trace, binary, "missing-sample")
    more = _calls_samples(binary, code)
    more.append(_sample(4242, "write", [], 9999))
    _must_fail(more, trace, binary, "extra-sample")
    renamed = _calls_samples(binary, code)
    renamed[3]["syscall"] = "getpid"
    renamed[3]["syscall"] = "openat"
    _must_fail(renamed, trace, binary, "syscall")
    # the loader's samples left out shift every ordinal -- unless asked to start at the first context
    from_main = _calls_samples(binary, code)[2:]
    _must_fail(from_main, trace, binary, "frames")
    compare(from_main, trace, binary, skip_leading_empty=True).assert_ok()


def test_compare_threads_and_processes() -> None:
    threads = _build("threads", opt="O2", pie=True)
    trace = run_strace([str(threads), "4"], ["write", "getppid"])
    good = samples_from_oracle(trace, threads)
    # renumber as another run would (tids differ between runs; creation order is what matches)
    remap = {t.tid: 7000 + 10 * i for i, t in enumerate(trace.tasks)}
    for s in good:
        s["tid"], s["pid"] = remap[s["tid"]], remap[s["pid"]]
    compare(good, trace, threads).assert_ok()
    # the two workers' samples attributed to each other's thread
    a, b = 7010, 7020
    swapped = copy.deepcopy(good)
    for s in swapped:
        if s["tid"] in (a, b):
            s["tid"] = a + b - s["tid"]
    _must_fail(swapped, trace, threads, "syscall")
    # creation order given explicitly: reversing it must fail too
    _must_fail(good, trace, threads, "syscall", sample_task_order=[7000, 7020, 7010])
    compare(good, trace, threads, sample_task_order=[7000, 7010, 7020]).assert_ok()

    forks = _build("forks", opt="O2", pie=False)
    ftrace = run_strace([str(forks)], ["write", "getppid"])
    fgood = samples_from_oracle(ftrace, forks)
    compare(fgood, ftrace, forks).assert_ok()
    parent_tid = ftrace.tasks[0].tid
    child_as_thread = copy.deepcopy(fgood)
    for s in child_as_thread:
        if s["tid"] != parent_tid:
            s["pid"] = parent_tid  # the fork child reported as a thread of the parent
    _must_fail(child_as_thread, ftrace, forks, "pid")
    # the child's context must keep the parent's frames (main>spawn above child_work)
    lost = copy.deepcopy(fgood)
    for s in lost:
        if s["tid"] != parent_tid:
            s["frames"] = [f for f in s["frames"] if f["function"] == "child_work"]
    _must_fail(lost, ftrace, forks, "frames")


def test_entry_function_without_a_start_symbol_is_the_entry_fde(tmp_path: pathlib.Path) -> None:
    """A binary that keeps symbols but none for ``_start`` (like Debian's lua5.4): the oracle's
    entry function is the ``.eh_frame`` FDE holding the entry point, so ``_start`` frames are still
    dropped on both sides.  The FDE is checked against ``readelf --debug-dump=frames`` here."""
    from strace_oracle import entry_function

    require_tool("objcopy")
    src = build_program("calls", opt="O2", pie=True, strip=False)
    no_start = tmp_path / "calls-no-start"
    subprocess.run(["objcopy", "--strip-symbol=_start", src, str(no_start)], check=True)
    entry = int(re.search(r"Entry point address:\s+(0x[0-9a-f]+)",
                          subprocess.run(["readelf", "-h", str(no_start)], capture_output=True, text=True,
                                         check=True).stdout).group(1), 16)  # type: ignore[union-attr]
    fdes = [(int(a, 16), int(b, 16)) for a, b in re.findall(
        r"FDE.*pc=([0-9a-f]+)\.\.([0-9a-f]+)",
        subprocess.run(["readelf", "--debug-dump=frames", str(no_start)], capture_output=True, text=True,
                       check=True).stdout)]
    (lo, hi), = [(a, b) for a, b in fdes if a <= entry < b]
    with_sym = entry_function(src)
    assert with_sym is not None and with_sym.name == "_start" and with_sym.start == entry
    fn = entry_function(no_start)
    assert fn is not None and fn.name is None
    assert (fn.start, fn.start + fn.size) == (lo, hi)
