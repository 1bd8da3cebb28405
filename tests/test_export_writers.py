"""The fast trace writers (JsonlWriter, TextWriter) against the reference serialisation: every line
must equal ``json.dumps(sample.to_json())`` / ``format_text(sample.to_json())``, however the frame
cache is hit (shared frames lists, one list under several syscalls, a list replaced at the same
address, cache overflow)."""

from __future__ import annotations

import io
import json

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
        samples.append(TraceSample(
            data.draw(st.integers(0, 2**63)), data.draw(st.integers(1, 2**22)),
            data.draw(st.integers(1, 2**22)),
            event, data.draw(st.sampled_from(["write", "openat", "getppid"])) if event == "syscall" else None,
            data.draw(st.booleans()), frames,
            data.draw(st.one_of(st.none(), st.fixed_dictionaries({"path": st.text(max_size=6)})))))
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

