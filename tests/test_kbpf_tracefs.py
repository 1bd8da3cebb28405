"""kbpf/tracefs.py: format files parsed into field offsets (checked against a sample and against the
running kernel's own format text, read independently), and the one-line errors callers print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import skip_or_fail

from ccprofd.kbpf import tracefs
from ccprofd.kbpf.errors import BPFError

SAMPLE = """name: sample
ID: 1
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:__data_loc char[] parent_comm;\toffset:8;\tsize:4;\tsigned:0;
\tfield:const char * filename;\toffset:16;\tsize:8;\tsigned:0;
\tfield:char *name;\toffset:24;\tsize:8;\tsigned:0;
\tfield:char comm[16];\toffset:32;\tsize:16;\tsigned:0;
\tfield:int broken;\toffset:x;\tsize:4;\tsigned:1;

print fmt: "field:int fake; offset:99;", REC->filename
"""


def test_parse_format_names_offsets_and_sizes() -> None:
    got = {n: (f.offset, f.size) for n, f in tracefs.parse_format(SAMPLE).items()}
    assert got == {"common_type": (0, 2), "common_pid": (4, 4), "parent_comm": (8, 4), "filename": (16, 8),
                   "name": (24, 8), "comm": (32, 16)}


def _tracefs() -> Path:
    base = tracefs.tracefs_dir()
    if base is None:
        skip_or_fail("tracefs not mounted")
    assert base is not None
    return Path(base)


def test_field_offsets_match_the_running_kernel_format() -> None:
    text = (_tracefs() / "events/sched/sched_process_fork/format").read_text()
    want = int(re.search(r"field:pid_t child_pid;\s*offset:(\d+);", text).group(1))  # type: ignore[union-attr]
    assert tracefs.tracepoint_field_offset("sched", "sched_process_fork", "child_pid") == want
    assert tracefs.tracepoint_has_field("sched", "sched_process_fork", "child_pid")
    assert not tracefs.tracepoint_has_field("sched", "sched_process_fork", "no_such_field")
    assert not tracefs.tracepoint_has_field("sched", "no_such_event", "child_pid")
    tp_id = int((_tracefs() / "events/sched/sched_process_fork/id").read_text())
    assert tracefs.tracepoint_id("sched:sched_process_fork") == tp_id


def test_errors_say_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _tracefs()
    with pytest.raises(BPFError, match=r"^tracepoint sched:sched_process_fork has no field nope$"):
        tracefs.tracepoint_field_offset("sched", "sched_process_fork", "nope")
    missing = base / "events/sched/no_such_event/format"
    with pytest.raises(BPFError, match=rf"^cannot read tracepoint format {missing}: No such file"):
        tracefs.tracepoint_field_offset("sched", "no_such_event", "child_pid")
    monkeypatch.setattr(tracefs, "TRACEFS_DIRS", (str(tmp_path),))
    assert tracefs.tracefs_dir() is None
    with pytest.raises(BPFError, match=r"^tracefs is not mounted \(mount -t tracefs"):
        tracefs.tracepoint_field_offset("sched", "sched_process_fork", "child_pid")
    assert not tracefs.tracepoint_has_field("sched", "sched_process_fork", "child_pid")
    with pytest.raises(BPFError, match=r"^tracefs is not mounted"):
        tracefs.tracepoint_id("sched:sched_process_fork")
