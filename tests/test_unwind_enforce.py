"""Enforcement from the unwinder (issue 19), with real BPF, on tests/programs/enforce_nofp.c built
with ``-O2 -fomit-frame-pointer``: a model learned by ``ccprofd learn --mode unwind`` is loaded into
the unwinder's allowed set; normal runs are untouched, the hidden ``wipe`` path is killed by SIGKILL
at its ``unlink``.  The key of the attack context is checked against a computation from objdump's
call instructions (return addresses), independent of ccprofd's decoder and of its BPF."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import require_bpf, require_tool
from programs.build import build

from ccprofd.anomaly.model import Learner, TargetModel
from ccprofd.anomaly.modelstore import load_models
from ccprofd.anomaly.unwind_enforce import binary_pcs, unwind_allowed
from ccprofd.tracing.api import TraceError, TraceOptions, UnwindEnforcement
from ccprofd.tracing.session import make_mode
from ccprofd.tracing.unwind.sampler import _program_defines

NR_UNLINK = 87  # x86-64 ABI
OWN_FUNCTIONS = ("main", "run_script", "dispatch", "cmd_cat", "cmd_rm", "cmd_wipe", "load_file", "open_file",
                 "remove_file", "wipe_file", "emit")


def ccprofd(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli", *args], capture_output=True, text=True,
                          cwd=cwd)


def prog() -> str:
    return str(build("enforce_nofp", opt="O2", frame_pointer=False))


def disassembly(path: str) -> dict[str, list[tuple[int, str]]]:
    """objdump's instructions per function: (address, text)."""
    out = subprocess.run([require_tool("objdump"), "-d", "--no-show-raw-insn", path], check=True,
                         capture_output=True, text=True).stdout
    funcs: dict[str, list[tuple[int, str]]] = {}
    cur: list[tuple[int, str]] | None = None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"^\s+([0-9a-f]+):\s+(.*)$", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return funcs


def return_after_call(funcs: dict[str, list[tuple[int, str]]], caller: str, callee: str) -> int:
    """The return address of ``caller``'s only call to ``callee`` ("*" = its only indirect call)."""
    insns = funcs[caller]
    hits = [i for i, (_, text) in enumerate(insns) if text.startswith("call")
            and (("*" in text) if callee == "*" else text.endswith(f"<{callee}>"))]
    assert len(hits) == 1, (caller, callee, hits)
    return insns[hits[0] + 1][0]


def fnv_key(values: list[int]) -> int:
    """unwind.c's hash written out again: h = (h ^ v) * FNV prime, from the FNV offset basis."""
    h = 14695981039346656037
    for v in values:
        h = ((h ^ v) * 1099511628211) % 2**64
    return h


def wipe_key_by_objdump(path: str) -> int:
    funcs = disassembly(path)
    chain = [("wipe_file", "unlink@plt"), ("cmd_wipe", "wipe_file"), ("dispatch", "*"),
             ("run_script", "dispatch"), ("main", "run_script")]  # innermost first
    return fnv_key([return_after_call(funcs, a, b) for a, b in chain])


def test_program_has_no_frame_pointer_prologue() -> None:
    """The point of the issue: no function of ours sets up rbp as a frame pointer."""
    funcs = disassembly(prog())
    for name in OWN_FUNCTIONS:
        texts = [t for _, t in funcs[name]]
        assert not any(re.fullmatch(r"mov\s+%rsp,%rbp", t) for t in texts), (name, texts[:4])
    # dispatch even uses rbp as an ordinary register
    assert any(re.fullmatch(r"mov\s+%rsi,%rbp", t) for _, t in funcs["dispatch"])


def test_model_key_matches_objdump_computation() -> None:
    """Model -> map key: a decoded sample's frames (call sites and return addresses from objdump,
    a library frame at the end, one tail-jump frame in the middle) give the hash of the return
    addresses alone, innermost first; library and tail frames add nothing."""
    path = prog()
    funcs = disassembly(path)
    bid = "f" * 40
    chain = [("main", "run_script"), ("run_script", "dispatch"), ("dispatch", "*"), ("cmd_wipe", "wipe_file"),
             ("wipe_file", "unlink@plt")]
    frames: list[dict[str, Any]] = []
    for caller, callee in chain:
        ret = return_after_call(funcs, caller, callee)
        site = next(a for a, _ in funcs[caller] if a < ret and not any(a < b < ret for b, _ in funcs[caller]))
        frames.append({"function": caller, "module": path, "build_id": bid, "call_site": hex(site),
                       "return_address": hex(ret)})
    tail = {"function": "tailer", "module": path, "build_id": bid, "call_site": "0x999", "tail_call": True,
            "return_address": None}
    frames.insert(3, tail)
    frames.append({"function": "unlink", "module": "/lib/libc.so.6", "build_id": "a" * 40, "call_site": None,
                   "return_address": None})
    model = TargetModel(bid, path)
    Learner(model, syscalls=["unlink"]).observe({"syscall": "unlink", "tid": 1, "frames": frames})
    allowed = unwind_allowed(model)
    assert allowed.unkeyed == 0 and allowed.syscalls == [NR_UNLINK]
    assert allowed.keys == {(NR_UNLINK, wipe_key_by_objdump(path))}
    # the innermost frame in the binary with no return address: the syscall's own (exact) pc
    key = model.contexts and next(iter(model.contexts))[1]
    exact = (*key[:-1][:-1], (bid, "wipe_file", "0x1234"))
    assert binary_pcs(model, exact)[0] == (0x1234, True)  # type: ignore[index]
    # a frame of the binary whose return address was never learned: not keyable
    assert binary_pcs(model, ((bid, "main", "0x42"), (bid, "x", "0x50"))) is None


def test_enforcement_is_compiled_only_when_asked() -> None:
    """Programs without enforcement are the same text as before (no UW_ENFORCE, same loops)."""
    class Enc:
        functions: tuple[int, ...] = ()
        edges: tuple[int, ...] = ()
        callsites: tuple[int, ...] = ()
        rec_code_bits = 4

    class Layout:
        acyc_words, rec_words, max_segs, max_unan, total_words = 1, 2, 4, 4, 40

    plain, loops = _program_defines(max_depth=64, max_maps=8, max_procs=8, max_entries=8, max_modules=8,
                                    max_rules=8, max_contexts=8, arena_words=8, ringbuf_pages=8,
                                    encoding=Enc(), layout=Layout())  # type: ignore[arg-type]
    assert "UW_ENFORCE" not in plain and "enf" not in loops
    enf, eloops = _program_defines(max_depth=64, max_maps=8, max_procs=8, max_entries=8, max_modules=8,
                                   max_rules=8, max_contexts=8, arena_words=8, ringbuf_pages=8,
                                   encoding=Enc(), layout=Layout(), enforce_keys=3)  # type: ignore[arg-type]
    assert enf.startswith(plain.split("#define UW_ARENA_LOOPS")[0]) and "#define UW_ENFORCE 1" in enf
    assert len(set(eloops.values())) == len(eloops)
    with pytest.raises(TraceError, match="--mode unwind"):
        make_mode(prog(), TraceOptions(mode="instrumented", enforce=UnwindEnforcement(frozenset())))


@pytest.fixture(scope="module")
def learned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    require_bpf()
    path = prog()
    d = tmp_path_factory.mktemp("unwind_enforce")
    (d / "a.txt").write_text("alpha\n")
    model = d / "model.json"
    training = (["cat", "a.txt", "rm", "b1"], ["rm", "b2", "cat", "a.txt", "cat", "a.txt"], ["cat", "a.txt"])
    for cmds in training:
        for c in cmds:
            if c.startswith("b"):
                (d / c).write_text("x")
        r = ccprofd("learn", "--mode", "unwind", "--model", str(model), "--", path, *cmds, cwd=d)
        assert r.returncode == 0, r.stderr
    return path, model, d


def detect(learned: tuple[str, Path, Path], *cmds: str) -> tuple[subprocess.CompletedProcess[str],
                                                                  list[dict[str, Any]]]:
    path, model, d = learned
    out = d / "alerts.jsonl"
    out.unlink(missing_ok=True)
    r = ccprofd("detect", "--enforce", "--mode", "unwind", "--model", str(model), "--output", str(out), "--",
                path, *cmds, cwd=d)
    alerts = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return r, alerts


@pytest.mark.bpf
def test_normal_runs_are_untouched(learned: tuple[str, Path, Path]) -> None:
    """Many enforced runs of the learned commands in other orders and numbers: none is killed,
    each prints what it should and removes what it should."""
    _, model, d = learned
    [target] = load_models(str(model)).targets.values()
    assert unwind_allowed(target).unkeyed == 0
    rng = random.Random(19)
    for run in range(12):
        cmds: list[str] = []
        expect_out = ""
        removed = []
        for i in range(rng.randint(1, 6)):
            if rng.random() < 0.5:
                cmds += ["cat", "a.txt"]
                expect_out += "alpha\n"
            else:
                name = f"n{run}_{i}"
                (d / name).write_text("y")
                cmds += ["rm", name]
                removed.append(name)
        r, alerts = detect(learned, *cmds)
        assert (r.returncode, alerts) == (0, []), (cmds, r.stderr)
        assert r.stdout == expect_out
        assert not any((d / n).exists() for n in removed)


@pytest.mark.bpf
def test_attack_path_is_killed_before_it_returns(learned: tuple[str, Path, Path]) -> None:
    """The hidden wipe: SIGKILL at its unlink, the marker written right after the unlink never
    appears.  The unlink itself completes: bpf_send_signal at sys_enter is acted on when the task
    returns to user space, after the syscall ran (the file is gone) -- the limit the README states."""
    _, _, d = learned
    victim = d / "victim.txt"
    victim.write_text("precious")
    r, alerts = detect(learned, "cat", "a.txt", "wipe", "victim.txt", "cat", "a.txt")
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    assert r.stdout == "alpha\n"  # the command before ran; nothing after the unlink did
    assert "ATTACK-DONE" not in r.stdout
    [alert] = alerts
    verdict = (alert["syscall"], alert["action"], alert["denied"], alert["verdict"])
    assert verdict == ("unlink", "enforce", True, "killed")
    assert [f["function"] for f in alert["frames"] if f["analysed"]][-2:] == ["cmd_wipe", "wipe_file"]
    assert not victim.exists(), "the killed unlink did not complete: update the README's limit"


@pytest.mark.bpf
def test_bpf_key_is_the_objdump_key(learned: tuple[str, Path, Path]) -> None:
    """Audit mode (no kill): the key BPF computed for the wipe's unlink equals the hash of the
    return addresses objdump shows for that chain."""
    from ccprofd.tracing import session as tracer

    path, model, d = learned
    [target] = load_models(str(model)).targets.values()
    allowed = unwind_allowed(target)
    opts = TraceOptions(mode="unwind", enforce=UnwindEnforcement(frozenset(allowed.keys), None, kill=False))
    (d / "v2.txt").write_text("z")
    fd = os.open(d / "out.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    saved = os.dup(1)
    try:
        os.dup2(fd, 1)
        s = tracer.open_session([path, "wipe", str(d / "v2.txt")], options=opts)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)

    class Nothing:
        def sample(self, s: Any) -> None: ...
        def samples(self, batch: Any) -> None: ...
        def record(self, r: Any) -> None: ...
        def flush(self) -> None: ...

    rc = tracer.run(s, Nothing(), launched=True)
    stats, denials = s.mode.enforcement()
    assert rc == 0 and (d / "out.txt").read_text() == "ATTACK-DONE\n"  # audit: not killed
    # denied: the unlink, then the marker's write (its context is new too); the thread's first is kept
    assert stats["killed"] == 0 and stats["denied"] == 2 and stats["checked"] == stats["allowed"] + 2
    [den] = denials
    assert (den.syscall_nr, den.verdict, den.incomplete) == (NR_UNLINK, "denied", False)
    assert den.key == wipe_key_by_objdump(path)
