"""The flight recorder's ring layout (tracing/history.c) as Python reads it (tracing/history.py):
the event and header layout checked against gcc's own sizeof/offsetof of the C structs, and the
ring decoding (oldest first, wrap-around, a torn slot, an empty ring) on rings built by hand."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
from conftest import require_tool

from ccprofd.tracing import history

C_FILE = Path(history.__file__).with_name("history.c")


def test_layout_equals_gcc(tmp_path: Path) -> None:
    require_tool("gcc")
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <stdint.h>\n"
        "typedef uint64_t u64; typedef uint32_t u32; typedef int32_t s32;\n"
        "#define BPF_TABLE(...)\n#define BPF_ARRAY(...)\n"
        "#define CCPROF_HISTORY_LEN 4\n#define CCPROF_HISTORY_THREADS 1\n"
        f"#define CCPROF_HISTORY_BYTES {history.history_bytes(4)}\n"
        "#define ccprof_history (*(struct { void *(*lookup)(u32 *); void (*update)(u32 *, void *); } *)0)\n"
        "#define ccprof_history_zero ccprof_history\n"
        + C_FILE.read_text()
        + "\nint main(void) {\n"
        '  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu\\n", sizeof(struct ccprof_hist_ev),\n'
        "    offsetof(struct ccprof_hist_ev, ktime_ns), offsetof(struct ccprof_hist_ev, nr),\n"
        "    offsetof(struct ccprof_hist_ev, ctx_kind), offsetof(struct ccprof_hist_ev, ctx),\n"
        "    offsetof(struct ccprof_hist_ev, ctx2), offsetof(struct ccprof_hist_ev, args),\n"
        "    offsetof(struct ccprof_hist, ev), sizeof(struct ccprof_hist));\n  return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-w", "-o", str(exe), str(src)], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = [int(x) for x in out.split()]
    # what history.py unpacks: <QiIQQ3Q per event after a <QII header
    assert got == [history.EV_BYTES, 0, 8, 12, 16, 24, 32, history.HDR_BYTES, history.history_bytes(4)]
    assert history.HISTORY_ARGS == 3


def ring(written: int, length: int, tgid: int, events: dict[int, tuple[int, int]]) -> bytes:
    """A ring as BPF leaves it: event i (time, nr) in slot i % length."""
    raw = bytearray(struct.pack("<QII", written, tgid, 0) + bytes(length * history.EV_BYTES))
    for i, (t, nr) in events.items():
        struct.pack_into("<QiIQQ3Q", raw, history.HDR_BYTES + (i % length) * history.EV_BYTES,
                         t, nr, 1, 100 + i, 200 + i, i, 0, 0)
    return bytes(raw)


def test_decode_ring_oldest_first_after_wrapping() -> None:
    # 6 events written into 4 slots: events 2..5 remain, slot 0 holds event 4
    raw = ring(6, 4, 77, {i: (1000 + i, i) for i in range(6)})
    evs = history.decode_ring(raw, 78)
    assert [(e.time_ns, e.syscall, e.ctx, e.ctx2, e.args[0]) for e in evs] == [
        (1000 + i, i, 100 + i, 200 + i, i) for i in range(2, 6)]
    assert {(e.tgid, e.tid, e.ctx_kind) for e in evs} == {(77, 78, 1)}


def test_decode_ring_partial_empty_and_torn() -> None:
    assert [e.syscall for e in history.decode_ring(ring(2, 4, 1, {0: (5, 0), 1: (6, 1)}), 1)] == [0, 1]
    assert history.decode_ring(ring(0, 4, 1, {}), 1) == []
    assert history.decode_ring(b"", 1) == []
    # the slot being written when the map was copied: its time is older than its predecessor's
    torn = ring(6, 4, 1, {2: (10, 2), 3: (11, 3), 4: (3, 4), 5: (13, 5)})
    assert [e.syscall for e in history.decode_ring(torn, 1)] == [2, 3, 5]


def test_configured_length(monkeypatch: pytest.MonkeyPatch) -> None:
    mp = monkeypatch
    mp.delenv(history.ENV_LENGTH, raising=False)
    assert history.configured_length() == history.DEFAULT_HISTORY_LEN
    for ok in ("0", "64", "4096"):
        mp.setenv(history.ENV_LENGTH, ok)
        assert history.configured_length() == int(ok)
    for bad in ("3", "-1", "8192", "x"):
        mp.setenv(history.ENV_LENGTH, bad)
        with pytest.raises(history.BPFError, match="CCPROFD_HISTORY"):
            history.configured_length()
