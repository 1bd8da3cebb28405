"""The context id (the metrics' ``context`` label, the ``context`` of GetHotContexts and
StreamSamples) is the same for the same chain in both tracer modes, so a target that switches mode
(the daemon does, on its probe-hit budget) keeps its series.

Unwind mode reports library frames (libc's ``write`` below the program's call of it, every libc
frame between ``qsort``'s caller and the program's comparison callback); instrumented mode reports
no library leaf and one placeholder frame for a library in between.  The id is defined on the
program's frames only; the library leaf is a separate field.  A call whose target left the binary
through a tail jump (tailcall.c's ``tail_plt`` jumping to ``getppid@plt``) has the tail-call frame in
both modes: instrumented mode probes the jump, unwind mode infers it from the call graph.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_bpf
from daemon_fakes import frame
from programs.build import build

from ccprofd.daemon.store import TargetStore, context_id, leaf_name, library_leaf

REPO = pathlib.Path(__file__).resolve().parent.parent


def lib_frame(name: str) -> dict[str, Any]:
    return {"function": name, "module": "/usr/lib/x86_64-linux-gnu/libc.so.6", "build_id": "ab" * 20,
            "analysed": False, "call_site": None, "return_address": None}


def test_library_frames_do_not_change_the_id() -> None:
    program = [frame("main", 0x1111), frame("say", 0x1264)]
    unwind = [*program, lib_frame("write")]
    assert context_id(unwind) == context_id(program)
    assert leaf_name(unwind) == leaf_name(program) == "say"
    assert library_leaf(unwind) == "write" and library_leaf(program) == ""
    # A library between two program frames: unwind mode's libc frames, instrumented mode's placeholder.
    cb = frame("cmp_int", 0x1290)
    assert context_id([program[0], lib_frame("qsort_r"), lib_frame(""), cb, lib_frame("getppid")]) == \
        context_id([program[0], lib_frame("qsort"), cb])
    # Program frames still tell contexts apart.
    assert context_id(unwind) != context_id([program[0], frame("say", 0x1265), lib_frame("write")])


def test_store_keeps_one_series_across_a_mode_switch() -> None:
    store = TargetStore(top_k=5)
    program = [frame("main", 0x1111), frame("say", 0x1264)]
    for frames in ([*program, lib_frame("write")], program):  # unwind mode's sample, then instrumented's
        store.add({"event": "syscall", "syscall": "write", "complete": True, "frames": frames})
    (hot,) = store.hot()
    assert hot.count == 2 and hot.leaf == "say" and hot.leaf_library == "write"
    assert [(s.context, s.leaf, s.value) for s in store.scrape() if s.context != "other"] == \
        [(context_id(program), "say", 2)]


def trace(mode: str, binary: pathlib.Path, tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    out = tmp_path / f"{mode}.jsonl"
    argv = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--format", "jsonl",
            "--syscalls", "write,getppid", "--output", str(out), "--", str(binary)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    # The program's own syscalls: those with a frame of the program.  Instrumented mode reports the
    # others (the loader's, exit's flush after main returned) with no frames, unwind mode with
    # their library frames.
    return [s for s in samples if s.get("event") == "syscall" and any(f["analysed"] for f in s["frames"])]


def program_chain(sample: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(f["function"], f["call_site"]) for f in sample["frames"] if f["analysed"]]


@pytest.mark.parametrize("program", ["calls", "fptr", "tailcall"])
def test_same_chain_same_id_in_both_modes(program: str, tmp_path: pathlib.Path) -> None:
    require_bpf()
    binary = build(program, opt="O2")
    unwind = trace("unwind", binary, tmp_path)
    instrumented = trace("instrumented", binary, tmp_path)
    # Single-threaded and deterministic: the same syscalls from the same program chains, in order
    # (each mode is checked against strace -f -k by its own tests).
    assert [(s["syscall"], program_chain(s)) for s in unwind] == \
        [(s["syscall"], program_chain(s)) for s in instrumented]
    assert all(s["complete"] for s in unwind + instrumented)
    # The frames differ: unwind mode has libc's leaf (and libc frames inside qsort's call).
    if program == "tailcall":  # main -> tail_plt, which tail-jumps to getppid@plt (by hand: tailcall.c)
        chains = [[(f["function"], bool(f.get("tail_call"))) for f in s["frames"]] for s in unwind]
        assert [("main", False), ("tail_plt", True), ("getppid", False)] in chains
    assert all(not s["frames"][-1]["analysed"] for s in unwind)
    assert all(s["frames"][-1]["analysed"] for s in instrumented)
    for u, i in zip(unwind, instrumented, strict=True):
        assert context_id(u["frames"]) == context_id(i["frames"]), (u, i)
        assert leaf_name(u["frames"]) == leaf_name(i["frames"])
        # libc's wrappers of the two syscalls (glibc names its getppid wrapper getppid)
        assert library_leaf(u["frames"]) == u["syscall"] and library_leaf(i["frames"]) == ""
