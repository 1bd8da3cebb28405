"""``ccprofd learn`` / ``ccprofd detect [--enforce]`` end to end: the real CLI, the real tracer
(every mode ``make_mode`` supports) and real BPF on tests/programs/anomaly_cmds.c.

The expected alerts are not taken from ccprofd: they are the (syscall, function chain) pairs that
``strace -f -k`` (libunwind, an independent unwinder) sees in the hidden run and in none of the
training runs.  strace cannot see a frame replaced by a tail jump, so those frames are left out of
ccprofd's chains before comparing (they are real frames; strace just has no way to show them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from anomaly_strace import strace_samples
from conftest import require_bpf, require_tool, skip_or_fail
from programs.build import build

from ccprofd.tracing.api import MODES, TraceError, TraceOptions
from ccprofd.tracing.session import make_mode

SYSCALLS = "openat,read,write,execve"
Chain = tuple[str, tuple[str, ...]]


def ccprofd(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli",
                           *args], capture_output=True, text=True, cwd=cwd)


def require_mode(mode: str, prog: str) -> None:
    try:
        make_mode(prog, TraceOptions(mode=mode))
    except TraceError as exc:
        skip_or_fail(f"tracer mode {mode} is not in this build: {exc}")


def chain(syscall: str, frames: list[dict[str, Any]]) -> Chain:
    """The frames in the program (unwind mode also reports library frames: those inward of it, and
    every frame of a syscall made with none of the program's, such as the loader's).  A frame says
    whether it is the program's (``analysed``), except a model's (an alert's ``nearest``), which is
    the program's when its module is not a shared object."""
    return syscall, tuple(str(f["function"]) for f in frames if not f.get("tail_call") and
                          f.get("analysed", ".so" not in Path(str(f["module"])).name))


def strace_chains(argv: list[str]) -> set[Chain]:
    samples, rc = strace_samples(argv, syscalls=SYSCALLS)
    assert rc == 0, argv
    return {chain(s["syscall"], s["frames"]) for s in samples if s["frames"]}


def alerts_of(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def data(tmp_path: Path) -> dict[str, str]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first line\nsecond line\n")
    b.write_text("x" * 5000 + "\n")
    return {"a": str(a), "b": str(b)}


TRAINING = [["cat", "{a}", "count", "{a}"], ["head", "{a}", "run", "/bin/true"]]
NORMAL = [["count", "{b}", "head", "{b}", "cat", "{a}", "cat", "/nonexistent"],
          ["head", "{a}", "head", "{b}", "count", "{a}", "run", "/bin/echo"]]


def fill(cmds: list[str], data: dict[str, str]) -> list[str]:
    return [c.format(**data) for c in cmds]


def learn(prog: str, model: Path, mode: str, data: dict[str, str]) -> None:
    for cmds in TRAINING:
        r = ccprofd("learn", "--model", str(model), "--mode", mode, "--syscalls", SYSCALLS, "--",
                    prog, *fill(cmds, data))
        assert r.returncode == 0, r.stderr
    [target] = json.loads(model.read_text())["targets"]
    assert target["runs"] == len(TRAINING)


@pytest.mark.bpf
@pytest.mark.parametrize("mode", MODES)
def test_learn_then_detect_exactly_the_hidden_paths(mode: str, data: dict[str, str], tmp_path: Path) -> None:
    require_bpf()
    require_tool("strace")
    prog = str(build("anomaly_cmds", opt="O2"))
    require_mode(mode, prog)
    model = tmp_path / "model.json"
    learn(prog, model, mode, data)

    # Further normal runs, other orders and arguments: not one alert; the command's exit status
    # (1: a file did not exist) passes through.
    for cmds, status in zip(NORMAL, (1, 0), strict=True):
        out = tmp_path / "normal.jsonl"
        r = ccprofd("detect", "--model", str(model), "--mode", mode, "--syscalls", SYSCALLS,
                    "--output", str(out), "--", prog, *fill(cmds, data))
        assert r.returncode == status, r.stderr
        assert alerts_of(out) == [], cmds

    # The hidden command: exactly what strace -k sees only in it.
    hidden = ["cat", data["b"], "debug", data["a"]]
    known = set().union(*(strace_chains([prog, *fill(c, data)]) for c in TRAINING))
    expected = strace_chains([prog, *hidden]) - known
    assert ("openat", ("main", "run_script", "dispatch", "cmd_debug", "audit_dump", "raw_open")) in expected
    # Alerts go to stderr by default; the command's stdout passes through untouched.
    r = ccprofd("detect", "--model", str(model), "--mode", mode, "--syscalls", SYSCALLS, "--",
                prog, *hidden)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "x" * 5000 + "\nHIDDEN-OPENED\nfirst line\nsecond line\n"  # detection only
    alerts = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    assert {chain(a["syscall"], a["frames"]) for a in alerts} == expected
    assert len(alerts) == len(expected)  # the repeated read of the same context: rate-limited
    assert all(a["kind"] == "unseen_context" and a["complete"] for a in alerts)
    [opened] = [a for a in alerts if a["syscall"] == "openat"]
    assert opened["args"] == {"path": data["a"]}
    # The nearest known openat contexts share main > run_script > dispatch.
    assert opened["nearest"] and all(n["common_prefix"] == 3 for n in opened["nearest"])
    # Each alert carries its thread's syscalls before it (the flight recorder): for the openat, the
    # same syscalls in the same contexts as strace -f -k lists right before it in a run of its own.
    traced, _ = strace_samples([prog, *hidden], syscalls=SYSCALLS)
    order = [chain(s["syscall"], s["frames"]) for s in traced]
    at = order.index(("openat", ("main", "run_script", "dispatch", "cmd_debug", "audit_dump", "raw_open")))
    before = order[1:at]  # strace's first is the execve of the program, made before it was traced
    assert order[0][0] == "execve" and before
    history = [chain(e["syscall"], e["frames"]) for e in opened["history"]]
    assert history == before[-16:]
    assert all(e["time_ns"] < opened["time_ns"] and e["tid"] == opened["tid"] for e in opened["history"])


@pytest.mark.bpf
@pytest.mark.parametrize("mode", MODES)
def test_execve_from_an_unseen_context(mode: str, data: dict[str, str], tmp_path: Path) -> None:
    require_bpf()
    require_tool("strace")
    prog = str(build("anomaly_cmds", opt="O2"))
    require_mode(mode, prog)
    model = tmp_path / "model.json"
    learn(prog, model, mode, data)
    out = tmp_path / "alerts.jsonl"
    r = ccprofd("detect", "--model", str(model), "--mode", mode, "--syscalls", SYSCALLS,
                "--output", str(out), "--", prog, "cat", data["a"], "shell", "/bin/echo")
    assert r.returncode == 0 and r.stdout == "first line\nsecond line\nHIDDEN-EXECED\n"
    [alert] = alerts_of(out)
    expected = strace_chains([prog, "shell", "/bin/echo"]) - strace_chains([prog, "run", "/bin/echo"])
    assert {chain(alert["syscall"], alert["frames"])} == {c for c in expected if c[0] == "execve"}
    assert alert["args"] == {"filename": "/bin/echo"}
    nearest = chain("execve", alert["nearest"][0]["frames"])  # the learned execve context
    assert nearest[1][-2:] == ("run_program", "do_exec")


@pytest.mark.bpf
def test_learning_merges_and_refuses_a_corrupt_model(data: dict[str, str], tmp_path: Path) -> None:
    require_bpf()
    prog = str(build("anomaly_cmds", opt="O2"))
    model = tmp_path / "model.json"
    learn(prog, model, "instrumented", data)
    doc = json.loads(model.read_text())
    [target] = doc["targets"]
    contexts = {(c["syscall"], tuple(f[1] for f in c["frames"])) for c in target["contexts"]}
    # Both runs are in the file: cat/count from the first, head and the exec from the second.
    assert ("openat", ("main", "run_script", "dispatch", "cmd_count", "load_file", "open_file")) in contexts
    assert ("execve", ("main", "run_script", "dispatch", "cmd_run", "run_program", "do_exec")) in contexts
    model.write_text("{ torn")
    r = ccprofd("learn", "--model", str(model), "--", prog, "cat", data["a"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "corrupt" in r.stderr
    assert model.read_text() == "{ torn"
    r = ccprofd("detect", "--model", str(tmp_path / "missing.json"), "--", prog, "cat", data["a"])
    assert r.returncode == 2 and "does not exist" in r.stderr


@pytest.mark.bpf
def test_detect_enforce_blocks_the_hidden_open_and_exec(data: dict[str, str], tmp_path: Path) -> None:
    """The issue's test: the marker written right after a denied openat / execve never appears.
    Enforcement keys contexts by frame-pointer walks: the target keeps frame pointers."""
    require_bpf()
    prog = str(build("anomaly_cmds", opt="O2", frame_pointer=True))
    model = tmp_path / "model.json"
    learn(prog, model, "instrumented", data)
    a = data["a"]

    def enforce(*cmds: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
        out = tmp_path / "alerts.jsonl"
        if out.exists():
            out.unlink()
        # The same tracer mode as learning: only instrumented mode sees tail-call frames.
        r = ccprofd("detect", "--enforce", "--mode", "instrumented", "--model", str(model),
                    "--syscalls", SYSCALLS, "--output", str(out), "--", prog, *cmds)
        return r, alerts_of(out)

    r, alerts = enforce("head", data["b"], "count", a, "run", "/bin/echo")
    assert (r.returncode, alerts) == (0, []), r.stderr
    # head of b, the 23 bytes of a, and the newline echo prints without arguments
    assert r.stdout == "x" * 5000 + "\n23\n\n"

    r, alerts = enforce("cat", a, "debug", a)
    assert "HIDDEN-OPENED" not in r.stdout
    assert r.stdout == "first line\nsecond line\n"  # the normal command before it ran
    [alert] = alerts  # killed at the openat: nothing after it ran
    assert alert["syscall"] == "openat" and alert["action"] == "enforce" and alert["denied"]
    if alert["verdict"] == "killed":
        assert r.returncode == 128 + signal.SIGKILL
        assert "a denied syscall may still complete" in r.stderr
    else:  # BPF LSM: -EPERM, the program reports the failed open and exits 1
        assert alert["verdict"] == "denied" and r.returncode == 1

    r, alerts = enforce("shell", "/bin/echo")
    assert "HIDDEN-EXECED" not in r.stdout
    assert [(x["syscall"], x["denied"]) for x in alerts] == [("execve", True)]
    assert alerts[0]["args"] == {"filename": "/bin/echo"}


def test_usage_errors(tmp_path: Path) -> None:
    model = tmp_path / "m.json"
    r = ccprofd("learn", "--model", str(model), "--", "/nonexistent/prog")
    assert r.returncode == 2 and r.stderr.startswith("ccprofd: ") and r.stderr.count("\n") == 1
    r = ccprofd("learn", "--model", str(model), "--", "/etc/passwd")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    r = ccprofd("detect", "--enforce", "--model", str(model), "--samples", os.devnull)
    assert r.returncode == 2 and "--enforce" in r.stderr
    assert not model.exists()


# Issue 19, granularity "edges", on tests/programs/anomaly_edges.c (built -O2 -fomit-frame-pointer:
# unwind mode walks .eh_frame, not frame pointers).  Training sees front a with plain output and
# front b with loud output; the normal held-out run swaps them and recurses deeper (new exact
# contexts made of learned call edges); the attack reaches write through finish -> leak.
EDGES_TRAINING = [["a", "1", "plain"], ["b", "2", "loud"]]
EDGES_NORMAL = ["a", "5", "loud", "b", "3", "plain", "a", "0", "plain"]
EDGES_ATTACK = ["b", "1", "plain", "a", "2", "leak"]


def call_sites_of(prog: str, caller: str, callee: str) -> set[str]:
    """The addresses of ``call <callee>`` inside ``caller``, by objdump (independent of ccprofd)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={caller}", prog],
                         capture_output=True, text=True, check=True).stdout
    return {hex(int(line.split(":")[0], 16)) for line in out.splitlines()
            if line.strip().endswith(f"<{callee}>") and "call" in line}


@pytest.mark.bpf
@pytest.mark.parametrize("mode", MODES)
def test_edges_granularity_accepts_new_combinations_and_catches_the_unseen_edge(
        mode: str, tmp_path: Path) -> None:
    require_bpf()
    require_tool("objdump")
    prog = str(build("anomaly_edges", opt="O2", frame_pointer=False))
    require_mode(mode, prog)
    model = tmp_path / "model.json"
    for argv in EDGES_TRAINING:
        r = ccprofd("learn", "--model", str(model), "--mode", mode, "--syscalls", "write", "--", prog, *argv)
        assert r.returncode == 0, r.stderr

    def detect(granularity: str, argv: list[str], stdout: str) -> list[dict[str, Any]]:
        out = tmp_path / f"alerts-{granularity}.jsonl"
        out.unlink(missing_ok=True)
        r = ccprofd("detect", "--model", str(model), "--mode", mode, "--syscalls", "write",
                    "--granularity", granularity, "--alert-interval", "0", "--output", str(out),
                    "--", prog, *argv)
        assert r.returncode == 0, r.stderr
        assert r.stdout == stdout
        return alerts_of(out)

    # Normal run: three writes, each a context never learned as a whole (exact alerts on each),
    # every edge of which was learned for write (edges: nothing).
    normal_out = "!5\n3\n0\n"
    exact = detect("exact", EDGES_NORMAL, normal_out)
    assert len(exact) == 3 and all(a["kind"] == "unseen_context" for a in exact)
    assert [chain(a["syscall"], a["frames"])[1][2:] for a in exact] == [
        ("front_a", *["walk"] * 6, "finish", "say_loud", "emit"),
        ("front_b", *["walk"] * 4, "finish", "say_plain", "emit"),
        ("front_a", "walk", "finish", "say_plain", "emit")]
    assert detect("edges", EDGES_NORMAL, normal_out) == []

    # The attack: caught in both granularities; edges names finish's call of leak (objdump's address).
    attack_out = "1\nLEAKED\n"
    # (exact also alerts on "b 1 plain", a new combination: front b never printed plain.)
    [_, exact_alert] = detect("exact", EDGES_ATTACK, attack_out)
    [alert] = detect("edges", EDGES_ATTACK, attack_out)
    for a in (exact_alert, alert):
        assert chain(a["syscall"], a["frames"]) == (
            "write", ("main", "run_script", "front_a", "walk", "walk", "walk", "finish", "leak"))
    edge = alert["unseen_edge"]
    assert (edge["syscall"], edge["caller"]["function"], edge["callee"]["function"]) == (
        "write", "finish", "leak")
    assert {edge["caller"]["call_site"]} == call_sites_of(prog, "finish", "leak")
    assert "unseen_edge" not in exact_alert

    # Enforcement checks exact contexts: refused with edges, one line, exit 2.
    r = ccprofd("detect", "--model", str(model), "--granularity", "edges", "--enforce", "--", prog, "a", "1",
                "plain")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot be enforced" in r.stderr


def anomaly_cpu_program() -> str:
    """tests/programs/anomaly_cpu.c built -O2, for a test that traces it and checks its premises with
    strace -k and objdump."""
    require_bpf()
    require_tool("strace")
    require_tool("objdump")
    return str(build("anomaly_cpu", opt="O2"))


# Issue 14, granularity "routines" with CPU samples while learning, on tests/programs/anomaly_cpu.c:
# training runs crunch (no syscall under it) and writes through say from cmd_a and cmd_b; the
# held-out run writes through say from crunch; the attack writes through say from evil.
@pytest.mark.bpf
def test_routines_accepts_a_path_cpu_samples_saw_running(tmp_path: Path) -> None:
    prog = anomaly_cpu_program()
    # The premise, by strace -k: the held-out write's chain is new, and main never wrote through crunch.
    learned_chains = strace_chains([prog, "train", "1000"])
    assert ("write", ("main", "crunch", "say")) in strace_chains([prog, "held", "1000"]) - learned_chains
    assert not any("crunch" in fns for _, fns in learned_chains)
    [crunch_site] = call_sites_of(prog, "main", "crunch")

    def detect(model: Path, granularity: str, argv: list[str]) -> list[dict[str, Any]]:
        out = tmp_path / "alerts.jsonl"
        out.unlink(missing_ok=True)
        r = ccprofd("detect", "--model", str(model), "--syscalls", "write", "--granularity", granularity,
                    "--alert-interval", "0", "--output", str(out), "--", prog, *argv)
        assert r.returncode == 0, r.stderr
        return alerts_of(out)

    for hz in (0, 997):
        model = tmp_path / f"model-{hz}.json"
        r = ccprofd("learn", "--model", str(model), "--syscalls", "write", "--sample-hz", str(hz), "--",
                    prog, "train")
        assert r.returncode == 0 and r.stdout == "a\nb\n", r.stderr
        [target] = json.loads(model.read_text())["targets"]
        mods = [m["path"] for m in target["modules"]]
        calls = {(fn, site, callee): n for cm, fn, site, m, callee, n in target["calls"]
                 if cm >= 0 and Path(mods[cm]).resolve() == Path(prog).resolve()}
        # ~300 ms in crunch: at 997 Hz, many samples through main's one call of crunch (objdump's)
        assert calls.get(("main", crunch_site, "crunch"), 0) >= (10 if hz else 0)
        held = detect(model, "routines", ["held", "1000"])
        attack = detect(model, "routines", ["evil"])
        if hz:
            assert held == []  # main -> crunch ran; the one new edge is crunch -> say, a shared routine
            assert len(detect(model, "edges", ["held", "1000"])) == 1  # evidence for routines only
        else:
            assert [chain(a["syscall"], a["frames"]) for a in held] == [("write", ("main", "crunch", "say"))]
        # evil never ran: alerted either way, naming main's call of evil
        [alert] = attack
        assert chain(alert["syscall"], alert["frames"]) == ("write", ("main", "evil", "say"))
        assert (alert["unseen_edge"]["caller"]["function"], alert["unseen_edge"]["callee"]["function"]) == (
            "main", "evil")
    r = ccprofd("learn", "--model", str(tmp_path / "m.json"), "--sample-hz", "99", "--samples", os.devnull)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--sample-hz" in r.stderr


# Issue 14, routines with prefix_match "functions", on tests/programs/anomaly_cpu.c: training calls
# cmd_a (which writes through the shared say) from one call site of main; `again` calls it from
# main's other call site, which never ran in training.
@pytest.mark.bpf
def test_routines_prefix_match_functions_accepts_a_known_call_at_a_new_site(tmp_path: Path) -> None:
    prog = anomaly_cpu_program()
    cmd_a_sites = call_sites_of(prog, "main", "cmd_a")
    assert len(cmd_a_sites) == 2, cmd_a_sites  # objdump: main calls cmd_a at two call sites
    # The premise, by strace -k: the same function chain in training and in `again`.
    assert ("write", ("main", "cmd_a", "say")) in strace_chains([prog, "again"]) & strace_chains(
        [prog, "train", "1000"])
    model = tmp_path / "model.json"
    r = ccprofd("learn", "--model", str(model), "--syscalls", "write", "--", prog, "train", "1000")
    assert r.returncode == 0 and r.stdout == "a\nb\n", r.stderr
    [target] = json.loads(model.read_text())["targets"]
    [trained_site] = {c["frames"][0][2] for c in target["contexts"]
                      if [f[1] for f in c["frames"][:2]] == ["main", "cmd_a"]}
    [again_site] = cmd_a_sites - {trained_site}

    def detect(argv: list[str], *extra: str) -> list[dict[str, Any]]:
        out = tmp_path / "alerts.jsonl"
        out.unlink(missing_ok=True)
        r = ccprofd("detect", "--model", str(model), "--syscalls", "write", "--granularity", "routines",
                    "--alert-interval", "0", "--output", str(out), *extra, "--", prog, *argv)
        assert r.returncode == 0, r.stderr
        return alerts_of(out)

    # By call site (the default): main's call of cmd_a at the other site is new.
    [alert] = detect(["again"])
    assert chain(alert["syscall"], alert["frames"]) == ("write", ("main", "cmd_a", "say"))
    edge = alert["unseen_edge"]
    assert (edge["caller"]["function"], edge["caller"]["call_site"], edge["callee"]["function"]) == (
        "main", again_site, "cmd_a")
    # By function: main called cmd_a in training, cmd_a -> say -> write is learned, say is shared.
    assert detect(["again"], "--prefix-match", "functions") == []
    # A function never called in training is alerted either way.
    [attack] = detect(["evil"], "--prefix-match", "functions")
    assert chain(attack["syscall"], attack["frames"]) == ("write", ("main", "evil", "say"))
