"""pprof and folded exports, parsed back independently: the pprof file with a minimal protobuf wire
decoder written here from the published profile.proto field numbers (not with ccprofd's writer or
its generated classes), cross-checked with the generated classes; ``go tool pprof`` too when
installed.  Folded stacks are parsed the way flamegraph.pl does (count after the last space)."""

from __future__ import annotations

import gzip
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from daemon_fakes import frame

from ccprofd.export.folded import write_folded
from ccprofd.export.pprof import write_pprof

ROWS = [
    {
        "target": "app",
        "context": "c1",
        "event": "syscall",
        "syscall": "write",
        "count": 7,
        "complete": True,
        "frames": [frame("main", 0x1139), frame("emit", 0x1180)],
    },
    {
        "target": "app",
        "context": "c2",
        "event": "syscall",
        "syscall": "openat",
        "count": 3,
        "complete": True,
        "frames": [
            frame("main", 0x1145),
            frame("load", 0x11A0),
            frame("qsort", 0, module="/usr/lib/libc.so.6", build_id="aa" * 20, analysed=False),
            frame("cmp;x", 0x11C4),
        ],
    },
    {
        "target": "app",
        "context": "c3",
        "event": "syscall",
        "syscall": "write",
        "count": 2,
        "complete": False,
        "frames": [frame("emit", 0x1180)],
    },
]


# ---- independent protobuf wire decoding (varint, 64-bit, length-delimited, 32-bit) ------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def fields(buf: bytes) -> list[tuple[int, Any]]:
    """(field number, value) pairs; length-delimited values are bytes, varints ints."""
    out = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i : i + 8], "little"), i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = int.from_bytes(buf[i : i + 4], "little"), i + 4
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((num, value))
    return out


def packed_or_single(values: list[Any]) -> list[int]:
    """Repeated scalars may be packed (bytes) or one varint per occurrence."""
    out: list[int] = []
    for v in values:
        if isinstance(v, bytes):
            i = 0
            while i < len(v):
                x, i = _varint(v, i)
                out.append(x)
        else:
            out.append(v)
    return out


def decode_profile(data: bytes) -> dict[str, Any]:
    """Profile fields: 1 sample_type, 2 sample, 3 mapping, 4 location, 5 function, 6 string_table."""
    top = fields(gzip.decompress(data))
    strings = [v.decode() for n, v in top if n == 6]
    functions = {}
    for n, v in top:
        if n == 5:
            f = dict(fields(v))
            functions[f[1]] = strings[f.get(2, 0)]
    mappings = {}
    for n, v in top:
        if n == 3:
            m = dict(fields(v))
            mappings[m[1]] = (strings[m.get(5, 0)], strings[m.get(6, 0)])
    locations = {}
    for n, v in top:
        if n == 4:
            lf = fields(v)
            d = dict(lf)
            lines = [dict(fields(x)) for k, x in lf if k == 4]
            locations[d[1]] = {
                "mapping": d.get(2, 0),
                "address": d.get(3, 0),
                "functions": [functions[ln[1]] for ln in lines],
            }
    samples = []
    for n, v in top:
        if n == 2:
            sf = fields(v)
            labels = {}
            for k, x in sf:
                if k == 3:
                    lab = dict(fields(x))
                    labels[strings[lab[1]]] = strings[lab.get(2, 0)]
            samples.append(
                {
                    "locations": [locations[x] for x in packed_or_single([x for k, x in sf if k == 1])],
                    "values": packed_or_single([x for k, x in sf if k == 2]),
                    "labels": labels,
                }
            )
    sample_types = [
        (strings[d.get(1, 0)], strings[d.get(2, 0)]) for n, v in top if n == 1 for d in [dict(fields(v))]
    ]
    return {"strings": strings, "samples": samples, "mappings": mappings, "sample_types": sample_types}


def test_pprof_round_trip_through_the_published_schema() -> None:
    data = write_pprof(ROWS, event="syscall")
    assert data[:2] == b"\x1f\x8b"  # gzip, as pprof requires on disk
    prof = decode_profile(data)
    assert prof["strings"][0] == ""
    assert prof["sample_types"] == [("syscalls", "count")]
    got = []
    for s in prof["samples"]:
        names = [loc["functions"][0] for loc in s["locations"]]
        got.append((names, s["values"], s["labels"]))
    assert got == [
        (["syscall:write", "emit", "main"], [7], {"target": "app", "syscall": "write", "context": "c1"}),
        (
            ["syscall:openat", "cmp;x", "qsort", "load", "main"],
            [3],
            {"target": "app", "syscall": "openat", "context": "c2"},
        ),
        (
            ["syscall:write", "emit"],
            [2],
            {"target": "app", "syscall": "write", "context": "c3", "complete": "false"},
        ),
    ]
    # Leaf-first locations carry the call-site addresses of their module's mapping (with build-id).
    loc = prof["samples"][0]["locations"][1]
    assert loc["address"] == 0x1180
    assert prof["mappings"][loc["mapping"]] == ("/opt/app/bin", frame("x", 0)["build_id"])
    # The same location object is shared: "emit" at 0x1180 appears in two samples with one id.
    assert prof["samples"][0]["locations"][1] == prof["samples"][2]["locations"][1]


def test_pprof_cpu_profile_values_and_generated_classes_agree() -> None:
    from ccprofd.export.gen import profile_pb2

    rows = [dict(r, event="cpu", syscall=None) for r in ROWS]
    data = write_pprof(rows, event="cpu", period_ns=20_408_163)
    prof = decode_profile(data)
    assert prof["sample_types"] == [("samples", "count"), ("cpu", "nanoseconds")]
    assert [s["values"] for s in prof["samples"]] == [
        [7, 7 * 20_408_163],
        [3, 3 * 20_408_163],
        [2, 2 * 20_408_163],
    ]
    msg = profile_pb2.Profile.FromString(gzip.decompress(data))
    assert msg.period == 20_408_163 and len(msg.sample) == 3
    assert [
        msg.string_table[msg.function[loc.line[0].function_id - 1].name]
        for loc in (msg.location[i - 1] for i in msg.sample[0].location_id)
    ] == ["emit", "main"]


def test_go_tool_pprof_reads_it_when_installed(tmp_path: Path) -> None:
    go = shutil.which("go")
    if go is None:
        pytest.skip("go toolchain not installed (the wire-level test above covers the format)")
    path = tmp_path / "cpu.pb.gz"
    path.write_bytes(write_pprof(ROWS))
    out = subprocess.run(
        [go, "tool", "pprof", "-top", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "emit" in out and "main" in out


def parse_folded(text: str) -> dict[tuple[str, ...], int]:
    out = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        out[tuple(stack.split(";"))] = int(count)
    return out


def test_folded_round_trip() -> None:
    text = write_folded(ROWS, event="syscall")
    assert text.endswith("\n")
    assert parse_folded(text) == {
        ("app", "main", "emit", "syscall:write"): 7,
        ("app", "main", "load", "qsort", "cmp:x", "syscall:openat"): 3,
        ("app", "[incomplete]", "emit", "syscall:write"): 2,
    }
    # Same function chain through different call sites merges into one folded line.
    twice = [ROWS[0], dict(ROWS[0], context="c9", frames=[frame("main", 0x2000), frame("emit", 0x2010)])]
    assert parse_folded(write_folded(twice)) == {("app", "main", "emit", "syscall:write"): 14}
    assert parse_folded(write_folded([dict(r, event="cpu") for r in ROWS[:1]], event="cpu")) == {
        ("app", "main", "emit"): 7
    }
    assert write_folded([]) == ""


def test_folded_has_a_root_frame_per_target() -> None:
    """Issue 17: the same chain in two targets stays two stacks under each target's root, instead of
    one merged stack that no flame graph can split again."""
    two = [ROWS[0], dict(ROWS[0], target="db;x", context="c8", count=5)]
    assert parse_folded(write_folded(two)) == {
        ("app", "main", "emit", "syscall:write"): 7,
        ("db:x", "main", "emit", "syscall:write"): 5,
    }
