"""pprof and folded exports, parsed back independently: the pprof file with a minimal protobuf wire
decoder written here from the published profile.proto field numbers (not with ccprofd's writer or
its generated classes), cross-checked with the generated classes; ``go tool pprof`` too when
installed.  Folded stacks are parsed the way flamegraph.pl does (count after the last space)."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from conftest import require_tool
from daemon_fakes import frame

from ccprofd.export.folded import write_folded
from ccprofd.export.pprof import ModuleRange, write_pprof

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
    """Profile fields: 1 sample_type, 2 sample, 3 mapping, 4 location, 5 function, 6 string_table.
    Mapping: 1 id, 2 memory_start, 3 memory_limit, 4 file_offset, 5 filename, 6 build_id.
    Location: 1 id, 2 mapping_id, 3 address, 4 line (1 function_id, 2 line).
    Function: 1 id, 2 name, 3 system_name, 4 filename."""
    top = fields(gzip.decompress(data))
    strings = [v.decode() for n, v in top if n == 6]
    functions = {}
    filenames = {}
    for n, v in top:
        if n == 5:
            f = dict(fields(v))
            functions[f[1]] = strings[f.get(2, 0)]
            filenames[strings[f.get(2, 0)]] = strings[f.get(4, 0)]
    mappings = {}
    ranges = {}
    for n, v in top:
        if n == 3:
            m = dict(fields(v))
            mappings[m[1]] = (strings[m.get(5, 0)], strings[m.get(6, 0)])
            ranges[m[1]] = (m.get(2, 0), m.get(3, 0), m.get(4, 0))
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
                "lines": [ln.get(2, 0) for ln in lines],
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
    mapping_order = [dict(fields(v))[1] for n, v in top if n == 3]
    return {"strings": strings, "samples": samples, "mappings": mappings, "sample_types": sample_types,
            "ranges": ranges, "filenames": filenames, "mapping_order": mapping_order}


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


LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
LIBC_ID = "bb" * 20


def library_leaf_rows() -> list[dict[str, Any]]:
    """A syscall made inside libc (its frame the leaf, as unwind mode reports it) from pid 77, and
    a CPU-less second process of the same binary (pid 78) loaded elsewhere."""
    lib = frame("getppid", 0, module=LIBC, build_id=LIBC_ID, analysed=False)
    lib["call_site"], lib["return_address"] = None, hex(0x2A0F0)
    return [
        {"target": "app", "context": "c1", "syscall": "getppid", "count": 4, "pid": 77,
         "frames": [frame("main", 0x1139), frame("leaf", 0x1180), lib]},
        {"target": "app", "context": "c2", "syscall": "getppid", "count": 1, "pid": 78,
         "frames": [frame("main", 0x1139)]},
    ]


MODULES = {
    # /proc/PID/maps r-x lines: the program's text at file offset 0x1000 (vaddr 0x1000), libc's
    # at offset 0x26000 (vaddr 0x26000); bias = start - (vaddr & ~0xfff)
    77: [ModuleRange(LIBC, 0x7F0000026000, 0x7F000017C000, 0x26000, 0x7F0000000000, LIBC_ID, False),
         ModuleRange("/opt/app/bin", 0x555500001000, 0x555500002000, 0x1000, 0x555500000000,
                     frame("x", 0)["build_id"], True)],
    78: [ModuleRange("/opt/app/bin", 0x566600001000, 0x566600002000, 0x1000, 0x566600000000,
                     frame("x", 0)["build_id"], True)],
}


def test_pprof_mappings_are_the_process_maps_with_the_main_binary_first() -> None:
    """Issue 17: Mapping 1 was whatever module the first location was in (a syscall profile said
    `File: libc.so.6`), every mapping started at 0 and library frames sat at address 0 of a
    placeholder; now Mapping 1 is the executable and each mapping is a real range of the process
    with its build-id, and locations are at runtime addresses."""
    prof = decode_profile(write_pprof(library_leaf_rows(), modules=MODULES))
    app_id = frame("x", 0)["build_id"]
    order = prof["mapping_order"]
    assert [prof["mappings"][m] for m in order] == [("/opt/app/bin", app_id), ("/opt/app/bin", app_id),
                                                     (LIBC, LIBC_ID)]
    assert [prof["ranges"][m] for m in order] == [(0x555500001000, 0x555500002000, 0x1000),
                                                   (0x566600001000, 0x566600002000, 0x1000),
                                                   (0x7F0000026000, 0x7F000017C000, 0x26000)]
    first, second = prof["samples"]
    # leaf first: syscall pseudo-frame (no mapping), libc at return address - 1, leaf, main
    assert [(loc["functions"], loc["mapping"], loc["address"]) for loc in first["locations"]] == [
        (["syscall:getppid"], 0, 0),
        (["getppid"], order[2], 0x7F0000000000 + 0x2A0F0 - 1),
        (["leaf"], order[0], 0x555500000000 + 0x1180),
        (["main"], order[0], 0x555500000000 + 0x1139),
    ]
    assert [(loc["mapping"], loc["address"]) for loc in second["locations"][1:]] == [
        (order[1], 0x566600000000 + 0x1139)]


def test_pprof_without_maps_still_puts_the_program_first_and_no_binary_as_source_file() -> None:
    """Without process maps (ccprofctl hot --format pprof) addresses stay ELF addresses, the
    program's module is still Mapping 1, and no function's file name is the binary's path (which
    made `go tool pprof -list` print the ELF's bytes as source)."""
    prof = decode_profile(write_pprof(library_leaf_rows()))
    assert [prof["mappings"][m][0] for m in prof["mapping_order"]] == ["/opt/app/bin", LIBC]
    assert prof["mapping_order"][0] == 1
    assert set(prof["filenames"].values()) == {""}


def test_pprof_source_lines_and_inlined_frames() -> None:
    """A frame's source `file`/`line` become the function's file name and the location's line; the
    frame's `inlined` calls (the tracer's form: outermost first, the frame's own line being the
    outermost call's site) are extra lines of the frame's one location, innermost first as
    profile.proto says: the innermost inlined function at the address's line, then each caller at
    its call of it, the physical function last."""
    outer = dict(frame("main", 0x1139), file="/src/app.c", line=40)
    caller = dict(frame("parse", 0x1180), file="/src/app.c", line=12,
                  inlined=[{"function": "get_byte", "file": "/src/buf.h", "line": 7},
                           {"function": "peek", "file": "/src/peek.h", "line": 3}])
    rows = [{"target": "app", "syscall": "read", "count": 2, "frames": [outer, caller]}]
    prof = decode_profile(write_pprof(rows))
    (s,) = prof["samples"]
    assert [(loc["functions"], loc["lines"]) for loc in s["locations"]] == [
        (["syscall:read"], [0]), (["peek", "get_byte", "parse"], [3, 7, 12]), (["main"], [40])]
    assert s["locations"][1]["address"] == 0x1180  # the physical frame's call site
    assert prof["filenames"] == {"syscall:read": "", "peek": "/src/peek.h", "get_byte": "/src/buf.h",
                                 "parse": "/src/app.c", "main": "/src/app.c"}


def test_go_tool_pprof_reads_it(tmp_path: Path) -> None:
    """golang-go is installed by scripts/setup.sh: under CI=true a missing go fails this test."""
    go = require_tool("go")
    path = tmp_path / "cpu.pb.gz"
    path.write_bytes(write_pprof(library_leaf_rows(), modules=MODULES))
    env = dict(os.environ, PPROF_TMPDIR=str(tmp_path), HOME=str(tmp_path))
    out = subprocess.run([go, "tool", "pprof", "-top", str(path)], capture_output=True, text=True, check=True,
                         env=env).stdout
    assert "leaf" in out and "main" in out
    # the profile is named after Mapping 1: the program, not the library its syscall was made in
    assert "\nFile: bin\n" in "\n" + out, out


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


def marked_rows() -> list[dict[str, Any]]:
    """main > sort_all > qsort (libc) > msort_with_tmp.part.0 (libc, msort_with_tmp inlined into
    it) > cmp_sys (reached by a tail call) > getppid."""
    libc = {"module": "/usr/lib/x86_64-linux-gnu/libc.so.6", "build_id": "aa" * 20, "analysed": False}
    return [{"target": "app", "syscall": "getppid", "count": 3, "frames": [
        frame("main", 0x1139), frame("sort_all", 0x1150),
        frame("qsort", 0x3f000, **libc),
        dict(frame("msort_with_tmp.part.0", 0x3fbf0, **libc), file="./stdlib/msort.c", line=64,
             inlined=[{"function": "msort_with_tmp", "file": "./stdlib/msort.c", "line": 44}]),
        dict(frame("cmp_sys", 0x1200), tail_call=True, return_address=None)]}]


def test_folded_inlined_calls_are_frames_and_marks_are_an_option() -> None:
    """Issue 17: folded stacks take the frames' inlined calls as frames (below the frame they are in,
    as pprof and perf show them); with marks, library frames say their module as perf script does
    (`func [libc.so.6]`) and tail-call-reached / inlined frames get flamegraph.pl-style `_[t]` /
    `_[i]` suffixes.  Parsed as flamegraph.pl does: count after the last space, frames split on `;`."""
    plain = parse_folded(write_folded(marked_rows()))
    assert plain == {("app", "main", "sort_all", "qsort", "msort_with_tmp.part.0", "msort_with_tmp",
                      "cmp_sys", "syscall:getppid"): 3}
    marked = parse_folded(write_folded(marked_rows(), marks=True))
    assert marked == {("app", "main", "sort_all", "qsort [libc.so.6]", "msort_with_tmp.part.0 [libc.so.6]",
                       "msort_with_tmp [libc.so.6]_[i]", "cmp_sys_[t]", "syscall:getppid"): 3}
    (stack,) = marked
    # flamegraph.pl's annotation tests (its --inline colouring matches /_\[i\]$/)
    assert [f for f in stack if re.search(r"_\[i\]$", f)] == ["msort_with_tmp [libc.so.6]_[i]"]
    # a module name with the separator in it cannot split a frame
    rows = marked_rows()
    rows[0]["frames"][2] = dict(rows[0]["frames"][2], module="/opt/lib;x.so")
    (odd,) = parse_folded(write_folded(rows, marks=True))
    assert len(odd) == len(stack) and odd[3] == "qsort [lib:x.so]"


def test_process_modules_read_this_process_maps() -> None:
    """process_modules on this Python process, against /proc/self/maps and readelf -n."""
    import re

    from ccprofd.export.pprof import process_modules

    mods = process_modules(os.getpid())
    exe = os.readlink("/proc/self/exe")
    maps = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and "x" in parts[1] and parts[5].startswith("/"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.setdefault(parts[5], (lo, hi, int(parts[2], 16)))
    libc = next(m for m in mods if re.search(r"/libc[.-]", m.path))
    assert (libc.start, libc.limit, libc.offset) == maps[libc.path] and not libc.main
    notes = subprocess.run([require_tool("readelf"), "-n", libc.path], capture_output=True, text=True,
                           check=True).stdout
    assert f"Build ID: {libc.build_id}" in notes
    assert any(m.main and m.path == exe for m in mods)
    # the bias maps the text segment's ELF addresses onto the mapping (readelf -l: its PT_LOAD)
    segs = subprocess.run([require_tool("readelf"), "-lW", libc.path], capture_output=True, text=True,
                          check=True).stdout
    loads = [tuple(int(x, 16) for x in m.groups())
             for m in re.finditer(r"LOAD\s+0x([0-9a-f]+) 0x([0-9a-f]+)", segs)]
    (text_vaddr,) = [v for off, v in loads if off & ~0xFFF == libc.offset]
    assert libc.start - libc.bias == text_vaddr & ~0xFFF
