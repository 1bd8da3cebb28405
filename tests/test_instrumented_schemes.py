"""Instrumented mode under PCCE and HCCE plans (``--encoding pcce|hcce``), against ``strace -f -k``.

Every case of tests/test_trace_strace.py is run again with each scheme: the samples must match the
oracle sample by sample (exact or flagged, via ``fidelity.compare``), and -- since the three
schemes encode the same probe events differently but describe the same stacks -- each sample's
decoded context (syscall, complete, frames) must be identical to the Valence run of the same
program, thread by thread (threads in creation order, samples by ordinal).  A state-level test
re-encodes each decoded path with the reference state machine (``ccprofd.encode.machine.Encoder``)
and requires the words BPF kept to be exactly the machine's; another forces a code wider than the
id's words and requires the samples under it to be flagged, not wrapped.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from conftest import require_bpf, require_tool, skip_or_fail
from programs.build import build
from strace_oracle import Trace, run_strace
from test_trace_strace import CASES, SYSCALLS, VARIANTS, check_against, trace

SCHEMES = ["pcce", "hcce"]

# The shared cases plus recursion a few thousand frames deep (strace shows its innermost 256 frames,
# compared as a suffix; gdb checks the Valence run of it in test_trace_strace) and past the
# per-thread bound (flagged samples must be flagged alike).
DEEP_CASES = [("recursion", ["1500"]), ("recursion", ["3000"])]


@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    require_bpf()
    require_tool("strace")


_RUNS: dict[tuple[Any, ...], tuple[Trace, list[dict[str, Any]]]] = {}


def _oracle_and_valence(key: tuple[Any, ...], cmd: list[str],
                        tmp: pathlib.Path) -> tuple[Trace, list[dict[str, Any]]]:
    """The strace oracle and the Valence run of a command, once per module (shared by both schemes)."""
    if key not in _RUNS:
        oracle = run_strace(cmd, SYSCALLS)
        tmp.mkdir(parents=True, exist_ok=True)
        samples, _ = trace(cmd, SYSCALLS, tmp, "--encoding", "valence")
        _RUNS[key] = (oracle, samples)
    return _RUNS[key]


def contexts_by_thread(samples: Sequence[Mapping[str, Any]]) -> list[list[tuple[Any, ...]]]:
    """Per thread (in tid order, i.e. creation order), the decoded contexts in time order, without
    times and ids (which differ between two runs)."""
    by_tid: dict[int, list[tuple[int, int, tuple[Any, ...]]]] = defaultdict(list)
    for i, s in enumerate(samples):
        frames = tuple(tuple(sorted(f.items())) for f in s["frames"])
        by_tid[s["tid"]].append((s["time_ns"], i, (s["event"], s["syscall"], s["complete"], frames)))
    return [[c for _, _, c in sorted(lst)] for _, lst in sorted(by_tid.items())]


def assert_same_contexts(got: Sequence[Mapping[str, Any]], valence: Sequence[Mapping[str, Any]]) -> None:
    """Complete samples must be identical; where a run flagged a sample (its per-thread bound counts
    probe events, and schemes probe different edges), its frames must be a suffix of the other's."""
    a, b = contexts_by_thread(got), contexts_by_thread(valence)
    assert len(a) == len(b), f"{len(a)} threads, valence run {len(b)}"
    for t, (x, y) in enumerate(zip(a, b, strict=True)):
        assert len(x) == len(y), f"thread {t}: {len(x)} samples, valence run {len(y)}"
        for i, (cx, cy) in enumerate(zip(x, y, strict=True)):
            if cx[2] and cy[2]:
                assert cx == cy, f"thread {t} sample {i} differs from the valence run:\n{cx}\n{cy}"
                continue
            assert cx[:2] == cy[:2], (t, i, cx[:2], cy[:2])
            short, full = (cx[3], cy[3]) if not cx[2] else (cy[3], cx[3])
            assert not short or full[len(full) - len(short):] == short, (t, i, short, full)


def _run_case(scheme: str, name: str, args: list[str], variant: Mapping[str, Any],
              tmp_path: pathlib.Path) -> tuple[Any, list[dict[str, Any]], Trace, Any]:
    binary = pathlib.Path(build(name, **variant))
    cmd = [str(binary), *args]
    key = (name, tuple(args), tuple(sorted(variant.items())))
    oracle, valence = _oracle_and_valence(key, cmd, tmp_path.parent / f"valence-{abs(hash(key))}")
    samples, proc = trace(cmd, SYSCALLS, tmp_path, "--encoding", scheme)
    stats = check_against(oracle, samples, binary)
    assert_same_contexts(samples, valence)
    return stats, samples, oracle, proc


@pytest.mark.bpf
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("name", "args"), CASES, ids=[f"{n}-{'-'.join(a) or 'default'}" for n, a in CASES])
def test_scheme_matches_strace_and_valence(scheme: str, name: str, args: list[str], variant: dict[str, Any],
                                           tmp_path: pathlib.Path) -> None:
    stats, samples, oracle, proc = _run_case(scheme, name, args, variant, tmp_path)
    assert stats.samples_compared >= 4
    assert stats.frames_compared >= 3
    assert stats.incomplete_samples == 0, [s for s in samples if not s["complete"]]
    assert proc.stdout == oracle.stdout


@pytest.mark.bpf
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("name", "args"), DEEP_CASES, ids=[f"{n}-{a[0]}" for n, a in DEEP_CASES])
def test_scheme_deep_recursion(scheme: str, name: str, args: list[str], tmp_path: pathlib.Path) -> None:
    stats, samples, _, _ = _run_case(scheme, name, args, {"opt": "O2", "pie": True}, tmp_path)
    assert stats.samples_compared >= 8
    depths = sorted(len(s["frames"]) for s in samples if s["frames"] and s["complete"])
    if args == ["1500"]:
        assert stats.incomplete_samples == 0
        assert depths[-1] == 3 * 1501 + 1  # main + ring_a/b/c * 1501
    else:
        # 3 * 3001 frames: flagged like Valence when the scheme probes every ring edge (> 8192 pieces);
        # PCCE probes only the back edge of the ring (En = 0 elsewhere): 3001 pieces fit, exact.
        flagged = [s["syscall"] for s in samples if not s["complete"]]
        assert flagged in (["openat", "close"], [])
        if not flagged:
            assert depths[-1] == 3 * 3001 + 1


@pytest.mark.bpf
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("pie", [True, False], ids=["pie", "nopie"])
@pytest.mark.parametrize("name", ["calls", "recursion", "fptr", "tailcall"])
def test_scheme_stripped(scheme: str, name: str, pie: bool, tmp_path: pathlib.Path) -> None:
    binary = pathlib.Path(build(name, opt="O2", pie=pie, strip=True))
    symbols = pathlib.Path(build(name, opt="O2", pie=pie))
    cmd = [str(binary)] + (["70"] if name == "recursion" else [])
    key = ("stripped", name, pie)
    oracle, valence = _oracle_and_valence(key, cmd, tmp_path.parent / f"valence-{abs(hash(key))}")
    samples, _ = trace(cmd, SYSCALLS, tmp_path, "--encoding", scheme)
    stats = check_against(oracle, samples, binary, symbols)
    assert stats.samples_compared >= 4 and stats.incomplete_samples == 0
    assert_same_contexts(samples, valence)


# ------------------------------------------------------------------------------ state level
def _recorded_states(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                     scheme: str) -> Iterator[tuple[Any, int, list[Any], Mapping[str, Any]]]:
    """Run ``argv`` traced in-process and yield, per decoded sample, (EncodedState from BPF, node,
    decoded path, the plan): what the symboliser handed the plan's decoder."""
    from ccprofd.decode import CachingDecoder
    from ccprofd.tracing import session as tracer

    seen: list[tuple[Any, int, list[Any], Mapping[str, Any]]] = []
    real = CachingDecoder.decode

    def recording(self: CachingDecoder, state: Any, node: int) -> list[Any]:
        path = real(self, state, node)
        seen.append((state, node, list(path), self.decoder.plan))
        return path

    monkeypatch.setattr(CachingDecoder, "decode", recording)
    session = tracer.open_session(argv, syscalls=SYSCALLS,
                                  options=tracer.TraceOptions(mode="instrumented", encoding=scheme))
    try:
        samples = list(session.samples())
        assert session.wait() == 0
    finally:
        session.close()
    assert samples
    yield from seen


@pytest.mark.bpf
@pytest.mark.parametrize("scheme", ["valence", *SCHEMES])
@pytest.mark.parametrize(("name", "args", "opt"), [("recursion", ["70"], "O0"), ("recursion", ["70"], "O2"),
                                                   ("calls", [], "O0"), ("tailcall", [], "O2")])
def test_bpf_state_equals_reference_machine(scheme: str, name: str, args: list[str], opt: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The words BPF keeps (acycID/id, recID, PCCE's pairs) equal ``machine.Encoder``'s after the
    same calls, for every sample without segments: the C side implements the reference semantics
    (forward adds with carry, back-edge pairs, recID pushes), not just something that decodes."""
    from ccprofd.encode.machine import Encoder

    binary = str(build(name, opt=opt, pie=True))
    checked = 0
    deepest = 0
    for state, _node, path, plan in _recorded_states(monkeypatch, [binary, *args], scheme):
        if state.segments:
            continue
        enc = Encoder(plan)
        for edge in path:
            enc.call(edge)
        want = enc.state()
        assert (state.acyc, state.pairs) == (want.acyc, want.pairs), path
        assert (state.rec_len, state.rec) == (want.rec_len, want.rec), path
        checked += 1
        deepest = max(deepest, len(want.pairs), want.rec_len)
    assert checked >= 4
    if name == "recursion" and scheme != "valence":
        assert deepest >= 20  # the recursion's back edges / cyclic edges were on the stack


@pytest.mark.bpf
def test_id_overflow_is_flagged_not_wrapped(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """A PCCE code wider than the id's words (what an id that outgrows ``pcce_words`` looks like at a
    probe) freezes the thread at that frame: samples under that edge are ``complete: false`` with no
    frames, and samples after the frame is gone are exact again."""
    from ccprofd.encode.plan import COL
    from ccprofd.tracing.instrumented import loader as instrumented

    binary = str(build("calls", opt="O0", pie=True))
    hit: dict[str, Any] = {}
    real_site_table = instrumented.site_table

    def widened(probe_plan: Any, plan: Mapping[str, Any]) -> list[dict[str, Any]]:
        rows = plan["sites"]
        for p in probe_plan.probes:
            sid = p[instrumented.PCOL["plan_site"]]
            if p[instrumented.PCOL["kind"]] == "site" and sid >= 0 and not hit:
                row = rows[sid]
                if row[COL["code"]] and not row[COL["reasons"]] & instrumented.R_CYCLIC:
                    hit["site"] = row[COL["site"]]
                    hit["callee"] = plan["names"][plan["nodes"].index(row[COL["callee"]])]
                    row = list(row)
                    row[COL["code"]] = row[COL["code"]] + (1 << 64)  # needs a second word
                    plan = {**plan, "sites": [*rows[:sid], row, *rows[sid + 1:]]}
                    break
        table = real_site_table(probe_plan, plan)
        flagged = [t for t in table if t["flags"] & instrumented.F_OVERFLOW]
        assert len(flagged) == 1
        return table

    monkeypatch.setattr(instrumented, "site_table", widened)
    from ccprofd.tracing import session as tracer

    session = tracer.open_session([binary], syscalls=SYSCALLS,
                                  options=tracer.TraceOptions(mode="instrumented", encoding="pcce"))
    try:
        samples = list(session.samples())
        summary = session.summary()  # before wait(), which closes the mode
        session.wait()
        overflows = summary.get("bpf", {}).get("overflows", 0)
    finally:
        session.close()
    if not hit:
        skip_or_fail("the calls program has no PCCE-coded call site")
    site = f"{hit['site']:#x}"
    under = [s for s in samples if not s["complete"]]
    assert overflows >= 1 and under, (hit, summary.get("bpf"), samples)
    assert summary["incomplete_reasons"].get("id overflow") == len(under), summary
    assert all(not s["frames"] for s in under)  # flagged, and nothing guessed
    complete = [s for s in samples if s["complete"] and s["frames"]]
    assert complete and all(f.get("call_site") != site for s in complete for f in s["frames"])
