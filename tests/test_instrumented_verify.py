"""``ccprofd trace --mode instrumented --verify``: every syscall sample is also unwound in BPF by a
frame-pointer walk (``bpf_get_stack``) and compared with the decoded context
(ccprofd/tracing/instrumented/fpverify.py).

* end to end on the frame-pointer builds of the test programs: zero mismatches, and the check really
  compared frames (checked frames > 0, read from the exit line and, independently, the walk's
  return addresses are checked against objdump's call instructions below);
* the check can fail: hand-made contexts with one wrong, missing or extra frame are counted as
  mismatches, and a real traced run whose decoder is deliberately broken is caught;
* a binary without frame pointers is not checked (the walk would be wrong, not the context), and
  the exit line says so.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_bpf, require_tool
from programs.build import build

from ccprofd.elf.cfi import CFA_RBP, CFA_RSP, NONE, PLT
from ccprofd.tracing.frames import Frame
from ccprofd.tracing.instrumented.fpverify import (
    JOIN_SLACK_NS,
    MAX_FRAMES,
    FpStack,
    FpVerifier,
    compare_stack,
    frame_pointer_calls,
)

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSCALLS = "write,openat,getppid,close"
LINE = re.compile(r"^ccprofd: verify: (\d+) contexts checked, (\d+) mismatches against a frame-pointer walk "
                  r"\((\d+) frames checked;")


# --------------------------------------------------------------------------- unit: comparison
def frames(*ras: int | None, analysed: bool = True) -> list[Frame]:
    """Frames outermost first with these return addresses (None: the innermost frame's own syscall)."""
    return [Frame(f"f{i}", "/bin/x", None, analysed, None, ra) for i, ra in enumerate(ras)]


# main -> a -> b -> write@plt: return addresses 0x1101 (in main), 0x1205 (in a), 0x1309 (in b).
TRUTH = frames(0x1101, 0x1205, 0x1309)
# A frameless libc leaf: the walk reads b's frame record first, so 0x1309 is never seen.
WALK_LEAF = [None, 0x1205, 0x1101, None]
# A libc function with a frame of its own: the walk sees every return address.
WALK_FRAMED = [None, 0x1309, 0x1205, 0x1101, None]


def test_matching_contexts_are_not_mismatches() -> None:
    r = compare_stack(TRUTH, WALK_LEAF, complete=True, truncated=False)
    assert (r.frames, r.mismatch) == (2, False)
    r = compare_stack(TRUTH, WALK_FRAMED, complete=True, truncated=False)
    assert (r.frames, r.mismatch) == (3, False)


@pytest.mark.parametrize("walk", [WALK_LEAF, WALK_FRAMED], ids=["leaf", "framed"])
@pytest.mark.parametrize("corrupt", [
    frames(0x1101, 0x1207, 0x1309),          # a wrong call site in the middle
    frames(0x1101, 0x1309),                  # a frame missing
    frames(0x1101, 0x1205, 0x1205, 0x1309),  # a frame too many (as a lost recursion pop would give)
    frames(0x1109, 0x1205, 0x1309),          # the outermost frame wrong
], ids=["wrong", "missing", "extra", "outermost"])
def test_corrupted_contexts_are_mismatches(corrupt: list[Frame], walk: list[int | None]) -> None:
    r = compare_stack(corrupt, walk, complete=True, truncated=False)
    assert r.mismatch, r
    assert r.frames > 0


def test_recursion_alignment_is_exact() -> None:
    """Direct recursion repeats one return address: the frame count must still agree."""
    truth = frames(0x1101, 0x1405, 0x1405, 0x1405, 0x1309)
    walk = [None, 0x1405, 0x1405, 0x1405, 0x1101, None]  # leaf: 0x1309 unseen
    assert not compare_stack(truth, walk, complete=True, truncated=False).mismatch
    one_less = frames(0x1101, 0x1405, 0x1405, 0x1309)
    one_more = frames(0x1101, 0x1405, 0x1405, 0x1405, 0x1405, 0x1309)
    assert compare_stack(one_less, walk, complete=True, truncated=False).mismatch
    assert compare_stack(one_more, walk, complete=True, truncated=False).mismatch


def test_truncated_walk_compares_the_innermost_frames() -> None:
    deep = frames(0x1101, *([0x1405] * 300), 0x1309)
    walk: list[int | None] = [None, *([0x1405] * (MAX_FRAMES - 1))]
    r = compare_stack(deep, walk, complete=True, truncated=True)
    assert (r.frames, r.mismatch) == (MAX_FRAMES - 1, False)
    wrong = frames(0x1101, *([0x1405] * 300), 0x1501, 0x1309)  # innermost caller differs
    assert compare_stack(wrong, walk, complete=True, truncated=True).mismatch


def test_incomplete_samples_are_compared_over_their_known_frames() -> None:
    known = frames(0x1205, 0x1309)  # attached late: main's frame unknown
    r = compare_stack(known, WALK_LEAF, complete=False, truncated=False)
    assert (r.frames, r.mismatch) == (1, False)
    assert compare_stack(frames(0x1207, 0x1309), WALK_LEAF, complete=False, truncated=False).mismatch


def test_walk_stops_at_foreign_code() -> None:
    """Past a library frame (a qsort callback) the rbp chain is not trusted: only the innermost run
    of binary addresses is compared."""
    ctx = frames(0x1101, None, 0x1605, analysed=True)
    ctx[1].analysed = False
    walk = [None, 0x1605, None, 0x7777, 0x1101, None]  # 0x7777: garbage that happens to look in-binary
    r = compare_stack(ctx, walk, complete=True, truncated=False)
    assert (r.frames, r.mismatch) == (1, False)


def test_no_binary_frame_reached() -> None:
    r = compare_stack(TRUTH, [None, None, None], complete=True, truncated=False)
    assert (r.frames, r.mismatch) == (0, False)


def test_signal_frame_right_after_the_ip_is_not_compared() -> None:
    """A handler's syscall: handler -> write; the handler's frame record returns to __restore_rt
    (libc), and the interrupted frames follow.  The decoded context (main -> f -> [signal] ->
    handler) is not a continuation of what the walk reads there: nothing is compared."""
    ctx = frames(0x10E6, 0x12BE, 0x1254)
    r = compare_stack(ctx, [None, None, 0x10E6, None], complete=True, truncated=False)
    assert (r.frames, r.mismatch) == (0, False)


class Exec:
    def is_executable(self, vaddr: int) -> bool:
        return 0x1000 <= vaddr < 0x2000


def walk_of(tid: int, nr: int, ip: int, sp: int, stack: list[int], time_ns: int = 1000) -> FpStack:
    return FpStack(time_ns, tid, tid, nr, ip, sp, tuple(stack))


def test_join_pairs_samples_with_their_own_hit() -> None:
    """Walks of hits instrumented mode did not report are skipped; a sample whose walk has not
    arrived waits for it; samples never joined are counted, not guessed."""
    bias = 0x5550000
    v = FpVerifier(Exec(), pie=True)
    good = [0x7F0000000000, 0x1205 + bias, 0x1101 + bias, 0x7F0000001000]
    bad = [0x7F0000000000, 0x1207 + bias, 0x1101 + bias, 0x7F0000001000]
    v.add_walks([walk_of(7, 1, 0x7F0000000000, 0x7FFF0, bad)])  # an unreported hit (other sp)
    v.add_sample(time_ns=1000, tid=7, tgid=7, syscall=1, ip=0x7F0000000000, sp=0x7FFE0, bias=bias,
                 complete=True, frames=TRUTH)
    assert v.counts.checked == 0  # waiting for its walk
    v.add_walks([walk_of(7, 1, 0x7F0000000000, 0x7FFE0, good)])
    assert (v.counts.checked, v.counts.mismatches, v.counts.frames_checked) == (1, 0, 2)
    v.add_sample(time_ns=1000, tid=7, tgid=7, syscall=1, ip=0x7F0000000000, sp=0x7FFE0, bias=bias,
                 complete=True, frames=TRUTH)
    v.add_walks([walk_of(7, 1, 0x7F0000000000, 0x7FFE0, bad)])
    assert (v.counts.checked, v.counts.mismatches) == (2, 1)
    for nr in (1, None):
        v.add_sample(time_ns=1000, tid=8, tgid=7, syscall=nr, ip=1, sp=2, bias=bias, complete=True,
                     frames=TRUTH)
    c = v.finish()
    assert (c.unjoined, c.cpu_not_verified) == (1, 1)


def test_join_never_pairs_a_sample_with_a_later_hit() -> None:
    """A sample whose own walk is missing (its process was not walked yet) is not paired with a
    later hit that happens to have the same syscall, ip and sp."""
    v = FpVerifier(Exec(), pie=False)
    stack = [0x7F0000000000, 0x1205, 0x1101, 0x7F0000001000]
    v.add_sample(time_ns=1000, tid=9, tgid=9, syscall=1, ip=0x7F0000000000, sp=0x7FFE0, bias=0,
                 complete=True, frames=frames(0x1101, 0x1207, 0x1309))  # would mismatch
    v.add_sample(time_ns=1000 + 5 * JOIN_SLACK_NS, tid=9, tgid=9, syscall=1, ip=0x7F0000000000, sp=0x7FFE0,
                 bias=0, complete=True, frames=TRUTH)
    v.add_walks([walk_of(9, 1, 0x7F0000000000, 0x7FFE0, stack, time_ns=1000 + 5 * JOIN_SLACK_NS + 300)])
    c = v.finish()
    assert (c.checked, c.mismatches, c.unjoined) == (1, 0, 1)


def test_frame_pointer_calls_counts_cfa_rules() -> None:
    assert frame_pointer_calls([CFA_RBP, CFA_RBP, CFA_RSP, NONE, PLT]) == (2, 3)
    assert frame_pointer_calls([]) == (0, 0)


# ------------------------------------------------------------------------------ end to end
def trace(cmd: list[str], tmp_path: pathlib.Path, *extra: str) -> tuple[list[dict[str, Any]], str]:
    out = tmp_path / "samples.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented", "--verify",
            "--format", "jsonl", "--syscalls", SYSCALLS, "--output", str(out), *extra, "--", *cmd]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return samples, proc.stderr


def verify_line(stderr: str) -> tuple[int, int, int]:
    found = [m for m in (LINE.match(ln) for ln in stderr.splitlines()) if m]
    assert len(found) == 1, stderr
    checked, mismatches, frames_checked = (int(g) for g in found[0].groups())
    return checked, mismatches, frames_checked


def call_returns(binary: pathlib.Path) -> set[int]:
    """Addresses right after every call instruction of the binary, from objdump (independent of
    ccprofd's disassembler)."""
    text = subprocess.run([require_tool("objdump"), "-d", "--no-show-raw-insn", str(binary)], check=True,
                          capture_output=True, text=True).stdout
    addrs = [int(m.group(1), 16) for m in re.finditer(r"^\s*([0-9a-f]+):\s+(\S+)", text, re.M)]
    calls = [int(m.group(1), 16) for m in re.finditer(r"^\s*([0-9a-f]+):\s+call", text, re.M)]
    following = dict(itertools.pairwise(addrs))
    return {following[c] for c in calls if c in following}


CASES = [
    ("calls", []), ("recursion", ["10"]), ("recursion", ["70"]), ("recursion", ["300"]), ("tailcall", []),
    ("fptr", []), ("threads", ["70"]), ("longjmp", ["70"]), ("exceptions", ["70"]), ("sighandler", []),
    ("forks", []), ("execs", []), ("switch", []),
]
VARIANTS = [pytest.param({"opt": "O0", "pie": True}, id="O0-pie"),
            pytest.param({"opt": "O2", "pie": False}, id="O2-nopie"),
            pytest.param({"opt": "O2", "pie": True, "strip": True}, id="O2-pie-stripped")]


@pytest.mark.bpf
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("name", "args"), CASES, ids=[f"{n}-{'-'.join(a) or 'default'}" for n, a in CASES])
def test_verify_no_mismatch_on_fp_programs(name: str, args: list[str], variant: dict[str, Any],
                                            tmp_path: pathlib.Path) -> None:
    require_bpf()
    binary = pathlib.Path(build(name, frame_pointer=True, **variant))
    samples, stderr = trace([str(binary), *args], tmp_path)
    checked, mismatches, frames_checked = verify_line(stderr)
    assert mismatches == 0, stderr
    assert checked > 0 and frames_checked >= checked, stderr
    # The decoded return addresses the walk confirmed are real return sites (objdump), not
    # something both sides could agree on by construction.
    returns = call_returns(binary)
    seen = {int(f["return_address"], 16) for s in samples for f in s["frames"] if f.get("return_address")}
    assert seen and seen <= returns


@pytest.mark.bpf
def test_deep_recursion_is_checked_over_the_walks_127_frames(tmp_path: pathlib.Path) -> None:
    require_bpf()
    binary = build("recursion", opt="O2", pie=True, frame_pointer=True)
    _, stderr = trace([str(binary), "300"], tmp_path)
    _checked, mismatches, frames_checked = verify_line(stderr)
    assert mismatches == 0, stderr
    # getppid (fact), write (is_even) and openat (ring_c) are made 300 frames deep: each is
    # compared over the walk's whole buffer (the ip plus 126 return addresses).
    assert frames_checked >= 3 * (MAX_FRAMES - 2), stderr


@pytest.mark.bpf
def test_without_frame_pointers_verify_is_skipped_and_says_so(tmp_path: pathlib.Path) -> None:
    require_bpf()
    binary = build("calls", opt="O2", pie=True, frame_pointer=False)
    samples, stderr = trace([str(binary)], tmp_path)
    assert samples
    assert not any(LINE.match(ln) for ln in stderr.splitlines()), stderr
    skipped = [ln for ln in stderr.splitlines() if ln.startswith("ccprofd: verify: skipped:")]
    assert len(skipped) == 1 and "does not keep frame pointers" in skipped[0], stderr


@pytest.mark.bpf
def test_verify_catches_a_broken_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real traced run (real BPF, real walk) whose decoder is deliberately broken: every decoded
    context with two or more stack frames gets the call site of one frame moved by one byte.  The walk
    must disagree."""
    require_bpf()
    from ccprofd.tracing.api import TraceOptions
    from ccprofd.tracing.frames import Decoded
    from ccprofd.tracing.instrumented.symbolize import Symbolizer
    from ccprofd.tracing.session import open_session

    real = Symbolizer.decode

    def broken(self: Symbolizer, s: Any) -> Decoded:
        d = real(self, s)
        on_stack = [f for f in d.frames if f.return_address is not None]
        if len(on_stack) >= 2:
            on_stack[-2].return_address = (on_stack[-2].return_address or 0) + 1
        return d

    monkeypatch.setattr(Symbolizer, "decode", broken)
    binary = build("recursion", opt="O0", pie=True, frame_pointer=True)
    session = open_session([str(binary), "10"], options=TraceOptions(mode="instrumented", verify=True,
                                                                    syscalls=SYSCALLS))
    n = sum(1 for _ in session.samples())
    session.wait()
    v = session.summary()["verify"]
    assert n > 0
    assert v["mismatches"] > 0, v


def test_daemon_counts_verify_mismatches_of_its_modes() -> None:
    """``ccprofd_verify_mismatches_total`` comes from SourceCounters.verify_mismatches: the tracer
    source sums what each of its modes reports in ``summary()["verify"]``."""
    from ccprofd.daemon.tracer_source import TracerSource, _Binary

    class Reporting:
        def __init__(self, verify: dict[str, int] | None) -> None:
            self.verify = verify

        def summary(self) -> dict[str, Any]:
            return {"decode_errors": 0, **({"verify": self.verify} if self.verify else {})}

        def map_entries(self) -> dict[str, int]:  # the Mode protocol's, read by counters()
            return {}

    src = TracerSource.__new__(TracerSource)
    src.binaries_by_inode = {(1, i): _Binary(f"/bin/{i}", (1, i), Reporting(v))
                             for i, v in enumerate([{"checked": 9, "mismatches": 2}, None,
                                                    {"checked": 4, "mismatches": 3}])}
    assert src.counters().verify_mismatches == 5


@pytest.mark.bpf
def test_verify_when_attached_to_a_running_process(tmp_path: pathlib.Path) -> None:
    """-p PID --verify: the walk sampler tracks the attached process like instrumented mode does;
    its samples are checked and agree."""
    import signal
    import time

    require_bpf()
    src = tmp_path / "loop.c"
    src.write_text(r"""
        #include <stdlib.h>
        #include <unistd.h>
        volatile long sink;
        __attribute__((noinline)) void leaf(void) { sink = getppid(); }
        __attribute__((noinline)) void mid(int n) { if (n) mid(n - 1); else leaf(); sink++; }
        __attribute__((noinline)) void outer(void) { mid(3); sink++; }
        int main(int argc, char **argv) {
            int rounds = argc > 1 ? atoi(argv[1]) : 20;
            for (int i = 0; i < rounds; i++) { usleep(50000); outer(); }
            return 0;
        }""")
    prog = tmp_path / "loop"
    subprocess.run([require_tool("gcc"), "-O1", "-g", "-fno-omit-frame-pointer", "-o", str(prog), str(src)],
                   check=True)
    target = subprocess.Popen([str(prog), "2400"])
    out = tmp_path / "p.jsonl"
    tracer = subprocess.Popen([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "instrumented",
                               "--verify", "--syscalls", "getppid", "--format", "jsonl", "--output", str(out),
                               "-p", str(target.pid)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120  # waiting for samples to exist, not a performance limit
        while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 5):
            time.sleep(0.2)
        tracer.send_signal(signal.SIGINT)
        _, err = tracer.communicate(timeout=60)
    finally:
        target.kill()
        target.wait()
    assert tracer.returncode == 0, err
    checked, mismatches, frames_checked = verify_line(err)
    assert mismatches == 0, err
    assert checked >= 3 and frames_checked >= 4 * checked, err  # outer, mid x4 (leaf's own is skipped)
