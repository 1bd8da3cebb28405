"""The fast trace writers (JsonlWriter, TextWriter) against the reference serialisation: every line
must equal ``json.dumps(sample.to_json())`` / ``format_text(sample.to_json())``, however the frame
cache is hit (shared frames lists, one list under several syscalls, a list replaced at the same
address, cache overflow)."""

from __future__ import annotations

import io
import json
import types
from typing import Any

import pytest
from conftest import skip_or_fail
from hypothesis import given, settings
from hypothesis import strategies as st

from ccprofd.export import jsonl
from ccprofd.export.jsonl import JsonlWriter, TextWriter, format_text, writer_for
from ccprofd.tracing.api import TraceSample

FRAME = st.fixed_dictionaries(
    {"function": st.one_of(st.none(), st.text(max_size=8)),
     "module": st.one_of(st.none(), st.text(max_size=8)),
     "build_id": st.one_of(st.none(), st.just("ab12")), "analysed": st.booleans(),
     "call_site": st.one_of(st.none(), st.just("0x10")),
     "return_address": st.one_of(st.none(), st.just("0x15"))},
    optional={"tail_call": st.just(True)})


def reference_jsonl(samples: list[TraceSample]) -> str:
    return "".join(json.dumps(s.to_json(), separators=(",", ":")) + "\n" for s in samples)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(FRAME, max_size=4), min_size=1, max_size=3), st.data())
def test_writers_equal_the_reference_serialisation(contexts: list[list[dict]], data: st.DataObject) -> None:
    samples = []
    for _ in range(data.draw(st.integers(1, 12))):
        frames = contexts[data.draw(st.integers(0, len(contexts) - 1))]  # shared, as the modes share it
        event = data.draw(st.sampled_from(["syscall", "cpu"]))
        syscall = data.draw(st.sampled_from(["write", "openat", "getppid", "mmap", "syscall_999"]))
        sample = TraceSample(
            data.draw(st.integers(0, 2**63)), data.draw(st.integers(1, 2**22)),
            data.draw(st.integers(1, 2**22)),
            event, syscall if event == "syscall" else None,
            data.draw(st.booleans()), frames,
            data.draw(st.one_of(st.none(), st.fixed_dictionaries({"path": st.text(max_size=6)}))))
        if not sample.complete:
            sample.reason = data.draw(st.sampled_from([None, "max_depth", "read_fault: 0x10"]))
        if event == "syscall" and data.draw(st.booleans()):  # argument words, a return (or none)
            sample.raw_args = tuple(data.draw(st.lists(st.integers(0, 2**64 - 1), max_size=6)))
            sample.returned = data.draw(st.one_of(st.none(), st.booleans()))
            if sample.returned:
                sample.ret = data.draw(st.integers(-4200, 2**63))
        samples.append(sample)
    out = io.StringIO()
    w = JsonlWriter(out)
    for s in samples:
        w.sample(s)
    assert out.getvalue() == ""  # written at flush(), once per batch
    w.flush()
    assert out.getvalue() == reference_jsonl(samples)
    out = io.StringIO()
    t = TextWriter(out)
    for s in samples:
        t.sample(s)
    t.flush()
    assert out.getvalue() == "".join(format_text(s.to_json()) for s in samples)


def test_text_writer_prints_strace_k_like_lines() -> None:
    frames = [{"function": "main", "module": "/b", "build_id": "ab", "analysed": True, "call_site": "0x10",
               "return_address": "0x15"},
              {"function": "write", "module": "/libc.so.6", "build_id": None, "analysed": False,
               "call_site": None, "return_address": None}]
    out = io.StringIO()
    w = writer_for("text", out)
    w.sample(TraceSample(1, 7, 8, "syscall", "write", True, frames))
    w.sample(TraceSample(2, 7, 9, "syscall", "write", False, frames))
    w.sample(TraceSample(3, 7, 7, "syscall", "openat", True, frames[:1], {"path": 'a "b"\n\u00e9'}))
    w.record({"event": "lost", "samples": 3, "reason": "ringbuf_full"})
    w.flush()
    assert out.getvalue().splitlines() == [
        "[pid 7 tid 8] write",
        " > /libc.so.6(write) [not analysed]",
        " > /b(main) call_site=0x10 return_address=0x15",
        "[pid 7 tid 9] write <incomplete>",
        " > /libc.so.6(write) [not analysed]",
        " > /b(main) call_site=0x10 return_address=0x15",
        '[pid 7 tid 7] openat("a \\"b\\"\\n\\303\\251")',  # the path as strace escapes it
        " > /b(main) call_site=0x10 return_address=0x15",
        "--- 3 samples lost (ringbuf_full) ---",
    ]


def test_text_prints_arguments_and_return_values_as_strace_does() -> None:
    """Arguments by kind and the return value.  Expected lines are strace 6's for the same calls
    (x86-64: AT_FDCWD is -100, O_CLOEXEC 0o2000000, O_CREAT 0o100, ENOENT 2), except where ccprofd
    prints less: buffers as pointers (strace: their strings), mmap's prot/flags in hex (strace:
    PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS), lseek's whence as a number (SEEK_END)."""
    out = io.StringIO()
    w = writer_for("text", out)
    cases = [
        ("write", None, (1, 0x7FFD0010, 22), True, 22),
        ("openat", {"path": "/etc/ld.so.cache"}, (2**64 - 100, 0x7F00, 0o2000000, 0), True, 3),
        ("openat", {"path": "/nonexistent"}, (2**64 - 100, 0x7F00, 0o1101, 0o644), True, -2),
        ("close", None, (3,), True, 0),
        ("lseek", None, (3, 2**64 - 5, 2), True, 95),
        ("mmap", None, (0, 8192, 3, 0x22, 2**32 - 1, 0), True, 0x7F2A1C000000),
        ("exit_group", None, (0,), False, None),
        ("syscall_999", None, (0, 1, 2**64 - 1, 0, 0, 0), True, -38),
        ("read", None, (0, 0, 10), None, None),  # no return value traced
    ]
    for i, (name, path, words, returned, ret) in enumerate(cases):
        w.sample(TraceSample(i, 7, 7, "syscall", name, True, [], path, words, returned, ret))
    w.flush()
    assert out.getvalue().splitlines() == [
        "[pid 7 tid 7] write(1, 0x7ffd0010, 22) = 22",
        '[pid 7 tid 7] openat(AT_FDCWD, "/etc/ld.so.cache", O_RDONLY|O_CLOEXEC) = 3',
        '[pid 7 tid 7] openat(AT_FDCWD, "/nonexistent", O_WRONLY|O_CREAT|O_TRUNC, 0644) = -1 ENOENT (No such '
        'file or directory)',
        "[pid 7 tid 7] close(3) = 0",
        "[pid 7 tid 7] lseek(3, -5, 2) = 95",
        "[pid 7 tid 7] mmap(NULL, 8192, 0x3, 0x22, -1, 0) = 0x7f2a1c000000",
        "[pid 7 tid 7] exit_group(0) = ?",
        "[pid 7 tid 7] syscall_999(0, 0x1, 0xffffffffffffffff, 0, 0, 0) = -1 ENOSYS (Function not "
        "implemented)",
        "[pid 7 tid 7] read(0, NULL, 10)",
    ]
    got = [json.loads(line) for line in _jsonl([TraceSample(1, 7, 7, "syscall", "close", True, [], None, (3,),
                                                            True, 0),
                                                TraceSample(2, 7, 7, "syscall", "exit_group", True, [], None,
                                                            (0,), False)])]
    assert [(g["raw_args"], g["ret"]) for g in got] == [([3], 0), ([0], None)]


def _jsonl(samples: list[TraceSample]) -> list[str]:
    out = io.StringIO()
    w = JsonlWriter(out)
    for s in samples:
        w.sample(s)
    w.flush()
    return out.getvalue().splitlines()


def test_cache_follows_list_identity_not_address(monkeypatch) -> None:
    """A frames list freed and another allocated at the same id must not get the old text, and a
    full cache starts over instead of growing."""
    monkeypatch.setattr(jsonl, "FRAME_CACHE_ENTRIES", 4)
    out = io.StringIO()
    w = JsonlWriter(out)
    samples = []
    for i in range(50):
        frames = [{"function": f"f{i}", "module": None, "build_id": None, "analysed": True,
                   "call_site": None, "return_address": None}]
        s = TraceSample(i, 1, 1, "syscall", "read", True, frames)
        samples.append(s.to_json())
        w.sample(s)
        del s, frames  # the next list may reuse the address
    w.flush()
    assert [json.loads(line) for line in out.getvalue().splitlines()] == samples
    assert len(w._tails) <= 4



# ------------------------------------------------------------------ the compiled formatter (cjsonl.c)
def require_compiled() -> None:
    """The compiled path must be tested wherever set-up ran: skipped on a bare checkout, a failure
    under CI=true (scripts/setup.sh builds it with scripts/build_ext.sh)."""
    if jsonl.cjsonl is None:
        skip_or_fail("ccprofd/export/cjsonl.c is not built (bash scripts/build_ext.sh)")


def test_the_compiled_formatter_is_built() -> None:
    require_compiled()
    assert jsonl.COMPILED


REASON = st.sampled_from([None, "max_depth", "context record lost", 'decode error: "x"\n\u00e9'])
INT = st.one_of(st.integers(0, 2**64 - 1), st.integers(-2**70, 2**70), st.booleans())


def _adversarial(data: st.DataObject, contexts: list[list[dict]]) -> TraceSample:
    """Samples that take every branch of the compiled helper: ints past 64 bits or negative, bools
    where ints go, a list of argument words, path arguments (ASCII or not), returns, 'cpu' events."""
    frames = contexts[data.draw(st.integers(0, len(contexts) - 1))]
    event = data.draw(st.sampled_from(["syscall", "cpu"]))
    s = TraceSample(data.draw(INT), data.draw(INT), data.draw(INT), event,
                    data.draw(st.sampled_from(["write", "getppid"])) if event == "syscall" else None,
                    data.draw(st.booleans()), frames,
                    data.draw(st.one_of(st.none(), st.just({}),
                                        st.fixed_dictionaries({"path": st.text(max_size=4)}))))
    if data.draw(st.booleans()):
        words = data.draw(st.lists(INT, max_size=6))
        s.raw_args = tuple(words) if data.draw(st.booleans()) else words  # type: ignore[assignment]
    if data.draw(st.integers(0, 3)) == 0:
        s.returned = data.draw(st.booleans())
        s.ret = data.draw(st.integers(-4200, 2**63)) if s.returned else None
    if not s.complete:
        s.reason = data.draw(REASON)
    return s


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(FRAME, max_size=3), min_size=1, max_size=3), st.data())
def test_compiled_and_python_batches_write_the_same_bytes(contexts: list[list[dict]],
                                                          data: st.DataObject) -> None:
    """JsonlWriter.samples() compiled, the same without the helper, and one sample() at a time all
    write the same bytes (the reference serialisation's, for ints), with records in between and
    the tail cache overflowing."""
    require_compiled()
    batches = [[_adversarial(data, contexts) for _ in range(data.draw(st.integers(0, 8)))]
               for _ in range(data.draw(st.integers(1, 4)))]
    want = []
    for b in batches:
        want += [json.dumps(s.to_json(), separators=(",", ":")) + "\n" for s in b]
        want.append('{"event":"lost","samples":1}\n')
    compiled = jsonl.cjsonl
    outputs = []
    for how in ("compiled", "python", "one by one"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(jsonl, "FRAME_CACHE_ENTRIES", data.draw(st.sampled_from([1, 2, 4096])))
            mp.setattr(jsonl, "cjsonl", compiled if how == "compiled" else None)
            out = io.StringIO()
            w = JsonlWriter(out)
            for b in batches:
                if how == "one by one":
                    for s in b:
                        w.sample(s)
                else:
                    w.samples(b)
                w.record({"event": "lost", "samples": 1})
                w.flush()
            outputs.append(out.getvalue())
    assert outputs[0] == outputs[1] == outputs[2]
    bools = any(isinstance(v, bool) for b in batches for s in b
                for v in (s.time_ns, s.pid, s.tid, *(s.raw_args or ())))
    if not bools:  # a bool where an int goes prints as Python does, not as JSON: the same both ways
        assert outputs[0] == "".join(want)


def test_compiled_formatter_takes_the_common_line_itself(monkeypatch) -> None:
    """The helper formats a plain line without calling back into Python for the line (else it
    would be no faster): a cached context's at once, a new context's once the writer has made
    its tail (JsonlWriter._tail, once per context), in a batch of one context repeated and in a
    batch of distinct contexts (each sample its own frames list); only other lines go the long way."""
    require_compiled()
    frame = {"function": "main", "module": "/b", "build_id": None, "analysed": True,
             "call_site": "0x10", "return_address": "0x15"}
    frames = [frame]
    w = JsonlWriter(io.StringIO())
    calls, tails = [], []
    slow, tail = w._line, w._tail
    monkeypatch.setattr(w, "_line", lambda s: calls.append(s) or slow(s))
    monkeypatch.setattr(w, "_tail", lambda s: tails.append(s) or tail(s))
    batch = [TraceSample(i, 5, 6, "syscall", "getppid", True, frames, None, (i, 2**64 - 1))
             for i in range(100)]
    distinct = [TraceSample(i, 5, 6, "syscall", "getppid", True, [frame, {**frame, "line": i}], None, (i,))
                for i in range(50)]
    other = TraceSample(7, 5, 6, "syscall", "openat", True, frames, ("/etc/x",), (1, 2))
    w.samples(batch)
    w.samples([*distinct, other])
    w.flush()
    assert calls == [other] and tails == [batch[0], *distinct, other]
    assert w.out.getvalue() == reference_jsonl([*batch, *distinct, other])  # type: ignore[attr-defined]


def test_trace_says_when_the_compiled_helpers_are_missing(tmp_path) -> None:
    """Without the compiled helpers (CCPROFD_PURE_PYTHON=1 stands for a checkout where set-up did
    not build them) `ccprofd trace --format jsonl` still writes the same samples and notes on stderr
    which helpers are missing; with them built, no note."""
    import os
    import subprocess
    import sys

    from conftest import require_bpf

    require_bpf()
    require_compiled()
    lines = []
    for pure in (True, False):
        env = {k: v for k, v in os.environ.items() if k != "CCPROFD_PURE_PYTHON"}
        if pure:
            env["CCPROFD_PURE_PYTHON"] = "1"
        out = tmp_path / f"{pure}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--syscalls", "exit_group",
                               "--format", "jsonl", "-o", str(out), "--", "/bin/true"],
                              env=env, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
        noted = "compiled helpers not built (export/cjsonl.c, decode/cvalence.c, tracing/unwind/chits.c)"
        assert (noted in proc.stderr) == pure, proc.stderr
        lines.append([json.loads(line)["syscall"] for line in out.read_text().splitlines()])
    assert lines[0] == lines[1] == ["exit_group"]


def test_a_stale_compiled_formatter_is_called_as_it_was_built(monkeypatch) -> None:
    """A cjsonl built from an older cjsonl.c (no TAKES_TAIL_OF: format_samples takes four
    arguments) is called with four, not failing the trace with a TypeError; the bytes are the same."""
    require_compiled()
    compiled = jsonl.cjsonl

    def four(samples: Any, tails: Any, slow: Any, lines: Any) -> None:
        compiled.format_samples(samples, tails, slow, lines)

    assert jsonl._TAIL_OF
    monkeypatch.setattr(jsonl, "cjsonl", types.SimpleNamespace(format_samples=four))
    monkeypatch.setattr(jsonl, "_TAIL_OF", getattr(jsonl.cjsonl, "TAKES_TAIL_OF", 0) == 1)
    frames = [{"function": "main", "module": "/b", "build_id": None, "analysed": True,
               "call_site": "0x10", "return_address": "0x15"}]
    batch = [TraceSample(i, 5, 6, "syscall", "getppid", True, list(frames), None, (i,)) for i in range(3)]
    w = JsonlWriter(io.StringIO())
    w.samples(batch)
    w.flush()
    assert w.out.getvalue() == reference_jsonl(batch)  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["compiled", "python", "one by one"])
def test_jsonl_says_why_a_sample_is_incomplete(how: str, monkeypatch) -> None:
    """An incomplete sample's line carries its ``reason`` (the decoder's, as the summary and
    GetThreadContexts give it) right after ``complete``; a complete one has none.  One frames list
    under two reasons (an empty list may be shared) is not given the first one's cached reason."""
    if how == "compiled":
        require_compiled()
    else:
        monkeypatch.setattr(jsonl, "cjsonl", None)
    frames: list[dict[str, Any]] = []
    batch = [TraceSample(1, 2, 3, "syscall", "write", False, frames, None, None, None, None, "max_depth"),
             TraceSample(2, 2, 3, "syscall", "write", False, frames, None, None, None, None,
                         "context record lost"),
             TraceSample(3, 2, 3, "syscall", "write", True, frames),
             TraceSample(4, 2, 3, "cpu", None, False, frames)]  # no reason known: said so
    w = JsonlWriter(io.StringIO())
    if how == "one by one":
        for s in batch:
            w.sample(s)
    else:
        w.samples(batch)
    w.flush()
    assert w.out.getvalue().splitlines() == [  # type: ignore[attr-defined]
        '{"time_ns":1,"pid":2,"tid":3,"event":"syscall","syscall":"write","complete":false,'
        '"reason":"max_depth","frames":[]}',
        '{"time_ns":2,"pid":2,"tid":3,"event":"syscall","syscall":"write","complete":false,'
        '"reason":"context record lost","frames":[]}',
        '{"time_ns":3,"pid":2,"tid":3,"event":"syscall","syscall":"write","complete":true,"frames":[]}',
        '{"time_ns":4,"pid":2,"tid":3,"event":"cpu","syscall":null,"complete":false,'
        '"reason":"unknown","frames":[]}']


def test_a_compiled_formatter_of_another_tail_layout_is_not_used() -> None:
    """A cjsonl built before the tails held the reason would format an incomplete context's line
    with the first reason cached for its frames: jsonl.py only takes a helper of its own layout."""
    require_compiled()
    assert jsonl.cjsonl is not None and jsonl.cjsonl.TAIL_FIELDS == 6
