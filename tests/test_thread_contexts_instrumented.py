"""``GetThreadContexts`` in instrumented mode answers from the live per-thread BPF state
(ccprofd/tracing/instrumented/livestate.py).

End to end: the real ``ccprofd run`` with an instrumented target built WITHOUT unwind tables (no
``.eh_frame``/``.eh_frame_hdr``/``.debug_frame`` in the running file) and started after the daemon, so
its threads are tracked from their first instruction: four threads blocked at known depths
(tests/programs/blocked.c), ``ccprofctl contexts PID --format json`` over the real Unix socket.  Every
thread's analysed frames are the chain blocked.c implies, each return address one objdump lists after
a call of the next frame's function; with frame pointers kept, gdb (prologue analysis) walks the
threads too and every frame equals its walk (library frames at gdb's pcs, or one stand-in for a run of
them).  Without frame pointers gdb cannot walk the binary, so the source + objdump check is the oracle.
The ptrace + CFI walk of the same process (the unwind-mode path) is checked to fall short, for contrast.
A copy started before the daemon (attached mid-run, seeded only where a CFI walk of the thread is whole)
is flagged ``bpf-state: frames above ... unknown`` where it was not seeded.

And tests/programs/stale.c: main returned from a recursion 41 deep and blocks in park() through an
inline syscall, with no probe event since -- the real BPF state still holds the recursion's pieces;
the context is main -> park, as gdb walks it (without the userspace cut it is a decode error).

Unit: the userspace cut drops the pieces of frames that returned (a thread back from a deep recursion,
now blocked shallower: its BPF state still holds the deep pieces, as BPF drops them only at the next
probe event), the state layout reads back what seed.py writes, and the spliced library frames line up
only where the walk does.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import partial
from pathlib import Path

import pytest
from bpf_helpers import direct_call_sites
from conftest import require_tool
from daemon_fakes import config_text, wait_for
from daemon_harness import ROOT, RunningDaemon, target_toml
from test_thread_contexts_e2e import ctl, ctl_targets, vaddr_of
from test_userstack import EXPECTED_OUTPUT, all_blocked, release

from ccprofd.tracing.frames import Frame
from ccprofd.tracing.instrumented.livestate import (
    LiveState,
    current,
    parse_state,
    raw_context,
    splice_library_frames,
)
from ccprofd.tracing.instrumented.seed import Piece, SeedParams, SeedState, StateModel, state_blob

PROGRAMS = ROOT / "tests" / "programs"
DEPTH = 6
PARAMS = SeedParams(acyc_words=1, add=False, pairs=False, id_bits=64, rec_bits=4, pair_code_bits=0,
                    pair_id_bits=0, max_pieces=64, max_segs=4, rec_words=4)


# ----------------------------------------------------------------------------------------- unit
def _recursion_state(depth: int, top: int) -> tuple[SeedState, dict[int, int]]:
    """A root piece then ``depth`` call pieces, frame k's call recorded at sp ``top - 0x40 k`` with
    return address ``0x401000 + k``; each piece's snapshot id is k (the id *before* it)."""
    s = SeedState(1, flags=8, bias=0, acyc=[depth + 1])
    mem: dict[int, int] = {}
    for k in range(depth + 1):
        sp = top - 0x40 * k
        s.pieces.append(Piece(sp, 0x401000 + k, k, 0xFFFFFFFF, 5 if k == 0 else 1, 0, 0, (k,)))
        mem[sp - 8] = 0x401000 + k
    return s, mem


def _model(mem: dict[int, int]) -> StateModel:
    return StateModel([], {}, [], set(), PARAMS, mem.get)


def test_cut_drops_the_pieces_of_a_returned_deep_recursion() -> None:
    top = 0x7FFF_F000_0000
    s, mem = _recursion_state(50, top)
    # back in frame 2, which now calls another (unprobed) function that blocks: that call wrote its
    # own return address where frame 2's recursive call had put one; frames 3..50's words are stale
    # but still in place (nothing deeper overwrote them)
    mem[top - 0x40 * 2 - 8] = 0x402222
    live = LiveState(s, [0] * len(s.pieces), 0, 77)
    current(live, _model(mem), tgid=77, sp=top - 0x40 * 2 - 8 - 0x30)
    assert len(s.pieces) == 2 and s.acyc == [2]  # the state before piece 2: frames 0..2
    assert live.pads == [0, 0] and not s.flags & 16
    # still inside the recursion at depth 40: everything recorded is alive
    s, mem = _recursion_state(50, top)
    live = LiveState(s, [0] * len(s.pieces), 0, 77)
    current(live, _model(mem), tgid=77, sp=top - 0x40 * 40 - 0x20)
    assert len(s.pieces) == 41 and s.acyc == [41]
    # the outermost frame returned (main's return address gone): every piece goes, whatever is stale
    s, mem = _recursion_state(50, top)
    mem[top - 8] = 0
    live = LiveState(s, [0] * len(s.pieces), 0, 77)
    current(live, _model(mem), tgid=77, sp=top - 0x40 * 50 - 0x20)
    assert s.pieces == [] and s.acyc == [0]
    # a word that cannot be read: the piece is kept and the context flagged, as BPF does
    s, mem = _recursion_state(5, top)
    del mem[top - 0x40 * 5 - 8]
    live = LiveState(s, [0] * len(s.pieces), 0, 77)
    current(live, _model(mem), tgid=77, sp=top - 0x40 * 5 - 0x20)
    assert len(s.pieces) == 6 and s.flags & 16
    raw = raw_context(live, pid=77, tid=78, ip=0x401234, sp=0, bias=None, scheme=None)
    assert raw.flags & 32 and raw.depth == 6


def test_fork_pending_state_of_a_new_thread_is_empty() -> None:
    s, mem = _recursion_state(3, 0x7FFF_0000_0000)
    s.flags |= 4
    live = LiveState(s, [0] * 4, 0, 77)
    current(live, _model(mem), tgid=77, sp=0x7FFF_0000_0000 - 0x1000)
    assert s.pieces == [] and s.flags == 0
    s, mem = _recursion_state(3, 0x7FFF_0000_0000)  # a forked process keeps its parent's context
    s.flags |= 4
    live = LiveState(s, [0] * 4, 0, 77)
    current(live, _model(mem), tgid=90, sp=0x7FFF_0000_0000 - 0x40 * 3 - 0x20)
    assert len(s.pieces) == 4 and not s.flags & 4


def test_a_thread_standing_on_an_entry_probe_gets_that_event_replayed() -> None:
    """Stopped on the first instruction of a callback the library called (entered, its entry probe not
    yet run): the segment the probe would push -- entered through the binary's library call -- is
    replayed, so the decoder sees the callback as entered from that call site."""
    top = 0x7FFF_0000_0000
    s = SeedState(1, flags=8, bias=0, acyc=[3])
    s.pieces.append(Piece(top, 0x401000, 0, 0xFFFFFFFF, 5, 0, 0, (0,)))  # root
    s.pieces.append(Piece(top - 0x100, 0x401100, 1, 7, 3, 0, 0, (3,)))  # call out of the binary (exit)
    mem = {top - 8: 0x401000, top - 0x108: 0x401100, top - 0x308: 0x7F00_0000_1234}  # ra into the library
    sites = [{"flags": 0, "node": 9, "mask": [0], "val": [0], "callsite": 0xFFFFFFFF, "ret_vaddr": 0}] * 2
    model = StateModel(sites, {}, [], set(), PARAMS, mem.get)
    live = LiveState(s, [0, 0], 0, 77)
    current(live, model, tgid=77, sp=top - 0x308, entry_probe=0)
    assert [p.kind for p in s.pieces] == [5, 3, 6] and s.segs == [2] and s.acyc == [0]
    seg = s.pieces[2]
    assert (seg.sp, seg.ret, seg.aux, seg.acyc_before) == (top - 0x300, 0x7F00_0000_1234, 7, (3,))
    assert live.pads == [0, 0, 0]


def test_state_layout_reads_back_what_seed_writes() -> None:
    s, _ = _recursion_state(7, 0x7FFF_0000_0000)
    s.segs = [0]
    s.rec, s.rec_len = 0b1011, 4
    size = 48 + 8 + 4 * PARAMS.max_segs + 8 * PARAMS.rec_words + 48 * PARAMS.max_pieces
    live = parse_state(state_blob(s, PARAMS, size), PARAMS)
    assert live.state.pieces == s.pieces and live.state.acyc == s.acyc and live.state.segs == [0]
    assert (live.state.rec, live.state.rec_len, live.state.bias, live.state.flags) == (0b1011, 4, 0, 8)
    raw = raw_context(live, pid=1, tid=2, ip=3, sp=4, bias=None, scheme=None)
    assert raw.depth == 8 and raw.top_kind == 1 and raw.segments[0].probe == 0 and raw.rec == 0b1011


def test_library_frames_spliced_only_where_the_walk_lines_up() -> None:
    def fa(name: str, ra: int | None, site: int | None = None) -> Frame:
        return Frame(name, "/bin/x", None, True, site, ra)

    def lib(name: str, ra: int | None) -> Frame:
        return Frame(name, "/lib/libc.so.6", "b", False, None, ra)

    decoded = [fa("main", 0x1105, 0x1100), Frame("raise", None, None, False), fa("on_sig", 0x1205, 0x1200)]
    walked = [fa("main", 0x1105, 0x1100), lib("raise", 0x3000), lib("__restore_rt", 0x3100),
              fa("on_sig", 0x1205, 0x1200), lib("read", None)]
    out = splice_library_frames(decoded, walked)
    assert [f.function for f in out] == ["main", "raise", "__restore_rt", "on_sig", "read"]
    # the walk stopped in the binary (no unwind tables): the stand-in stays, the innermost library
    # frame below the last call is still the walk's
    out = splice_library_frames(decoded, walked[3:])
    assert [f.function for f in out] == ["main", "raise", "on_sig", "read"] and out[1].module is None
    # a walk whose binary frames do not carry the same return address is not used
    out = splice_library_frames(decoded, [fa("main", 0x1111, 0x1100), *walked[1:3], fa("on_sig", 0x1299)])
    assert [f.function for f in out] == ["main", "raise", "on_sig"]


# ------------------------------------------------------------------------------------------ e2e
def build_without_unwind_tables(out_dir: Path, frame_pointer: bool) -> Path:
    """blocked.c at -O0 with no unwind table of any kind in the file (no .eh_frame, .eh_frame_hdr or
    .debug_frame; the C library's start-up objects' tables removed too)."""
    gcc = require_tool("gcc")
    objcopy = require_tool("objcopy")
    full = out_dir / "blocked-full"
    fp = "-fno-omit-frame-pointer" if frame_pointer else "-fomit-frame-pointer"
    subprocess.run([gcc, "-O0", "-g", "-pthread", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables", fp,
                    "-I", str(PROGRAMS), str(PROGRAMS / "blocked.c"), "-o", str(full)], check=True)
    exe = out_dir / "blocked-notables"
    subprocess.run([objcopy, "--remove-section=.eh_frame", "--remove-section=.eh_frame_hdr",
                    "--remove-section=.debug_frame", str(full), str(exe)], check=True)
    sections = subprocess.run([require_tool("readelf"), "-SW", str(exe)], check=True, capture_output=True,
                              text=True).stdout
    assert ".text" in sections and not any(s in sections for s in (".eh_frame", ".debug_frame"))
    return exe


#: analysed functions of each blocked thread, outermost first (blocked.c), by the function it starts in
EXPECTED_CHAINS = {
    "main": ["main"] + ["down_main"] * (DEPTH + 1) + ["blocking_read"],
    "reader_main": ["reader_main"] + ["down_read"] * (DEPTH + 1) + ["blocking_read"],
    "sleeper_main": ["sleeper_main"] + ["down_sleep"] * (DEPTH + 1),
    "handler_main": ["handler_main", "on_usr2"] + ["down_sig"] * (DEPTH + 1) + ["blocking_read"],
}
LEAF_CALLS = {"blocking_read": "read@plt", "down_sleep": "nanosleep@plt"}


def check_by_source(frames: list[dict[str, object]], calls: dict[int, tuple[int, str]]) -> None:
    """Without a debugger that can walk it: the analysed chain blocked.c implies for this thread, each
    analysed caller's return address one objdump lists right after a call of the next frame's
    function (its ``call_site`` that call), the innermost one after the libc call it blocks in."""
    analysed = [f for f in frames if f["analysed"]]
    chain = [str(f["function"]) for f in analysed]
    assert chain == EXPECTED_CHAINS[chain[0]], chain
    for i, f in enumerate(analysed):
        site, callee = calls[int(str(f["return_address"]), 16)]
        assert f["call_site"] == f"{site:#x}", f
        if i + 1 < len(analysed):
            nxt = analysed[i + 1]["function"]
            assert callee == nxt or (callee == "raise@plt" and nxt == "on_usr2"), (f, callee, nxt)
        else:
            assert callee == LEAF_CALLS[chain[-1]], (f, callee)
    assert frames[-1]["analysed"] is False  # the library function it blocks in


def match_gdb(frames: list[dict[str, object]], gdb_frames: list[object], binary: Path,
              calls: dict[int, tuple[int, str]]) -> None:
    """One thread's JSON frames (outermost first) against gdb's walk (innermost first): every frame
    of the binary one for one (name, return address, objdump's call site; the innermost exact); each
    library frame at gdb's pc in gdb's module, or a stand-in (module null) for a run of >= 1 gdb
    frames outside the binary."""
    real = os.path.realpath(binary)
    want = list(reversed(gdb_frames))

    def in_binary(g: object) -> bool:
        return g.module is not None and os.path.realpath(g.module) == real  # type: ignore[attr-defined]

    # gdb's frames above the outermost analysed one (start-up code, which gdb cannot walk reliably
    # without tables either) are not compared
    start = max(i for i, g in enumerate(want) if in_binary(g) and g.name == frames[0]["function"])  # type: ignore[attr-defined]
    want = want[start:]
    assert frames and frames[0]["analysed"] is True
    j = 0
    for i, f in enumerate(frames):
        if f["module"] is None:  # a stand-in for library code
            assert f["analysed"] is False and j < len(want) and not in_binary(want[j]), (i, f)
            while j < len(want) and not in_binary(want[j]):
                j += 1
            continue
        g = want[j]
        exact = j == len(want) - 1 or want[j + 1].sigtramp  # type: ignore[attr-defined]
        v = vaddr_of(os.path.realpath(g.module), g.offset)  # type: ignore[attr-defined]
        assert os.path.realpath(str(f["module"])) == os.path.realpath(g.module), (i, f, g)  # type: ignore[attr-defined]
        assert f["return_address"] == (None if exact else f"{v:#x}"), (i, f, g)
        if in_binary(g):
            assert f["analysed"] is True and f["function"] == g.name, (i, f, g)  # type: ignore[attr-defined]
            if exact:
                assert f["call_site"] == f"{v:#x}"
            else:
                site, callee = calls[v]
                assert f["call_site"] == f"{site:#x}", (i, f, g)
                nxt = frames[i + 1]
                assert (nxt["analysed"] is False) if callee.endswith("@plt") else nxt["function"] == callee
        else:
            assert f["analysed"] is False and f["call_site"] is None
        j += 1
    assert j == len(want), (len(frames), [g.name for g in want])  # type: ignore[attr-defined]


@pytest.mark.parametrize("frame_pointer", [
    pytest.param(True, id="frame-pointers-gdb"), pytest.param(False, id="omit-frame-pointer-objdump")])
def test_contexts_of_a_binary_without_unwind_tables_from_bpf_state(
        bpf: None, workdir: str, frame_pointer: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With frame pointers gdb walks the binary (prologue analysis) and is the oracle; without them
    gdb cannot (no CFI anywhere: its walk stops in blocking_read), and the chain blocked.c implies,
    checked against objdump's call sites, is."""
    from gdb_threads import gdb_threads

    from ccprofd.tracing.threadcontexts import ContextReader

    if frame_pointer:
        require_tool("gdb")
        import gdb_threads as gdb_module

        # gdb's prologue analysis reads the code; the probes' int3 bytes there would mislead it: read
        # the read-only sections from the file instead
        monkeypatch.setattr(gdb_module, "_SCRIPT", gdb_module._SCRIPT.replace(
            '"set pagination off", ', '"set pagination off", "set trust-readonly-sections on", '))
    binary = build_without_unwind_tables(Path(workdir), frame_pointer)
    config = config_text(workdir, target_toml("notables", f'path = "{binary}"', ["getppid"], "instrumented"))
    sock = f"{workdir}/ccprofd.sock"
    # one copy running before the daemon: attached mid-run, its threads seeded only where a CFI walk of
    # them is whole -- without unwind tables, not at all (then flagged, never guessed)
    early = subprocess.Popen([str(binary), str(DEPTH)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert early.stdout is not None and early.stdout.readline().startswith("ready ")
        wait_for(lambda: all_blocked(early.pid), timeout=60)
    except BaseException:
        early.kill()
        early.wait()
        raise
    daemon: RunningDaemon | None = None
    prog: subprocess.Popen[str] | None = None
    try:
        daemon = RunningDaemon(workdir, config)
        targets = partial(ctl_targets, daemon)
        wait_for(lambda: any(b.get("attached") for t in targets() for b in t.get("binaries", [])),
                 timeout=300)
        # started after the probes are attached: tracked from its first instruction (no seeding)
        prog = subprocess.Popen([str(binary), str(DEPTH)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        assert prog.stdout is not None and prog.stdout.readline().startswith("ready ")
        pid = prog.pid
        wait_for(lambda: any(p["pid"] == pid for t in targets() for p in t.get("processes", [])),  # type: ignore[index, attr-defined]
                 timeout=120)
        wait_for(lambda: all_blocked(pid), timeout=60)
        out = ctl(sock, "contexts", str(pid), "--format", "json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["mode"] == "instrumented" and len(doc["threads"]) == 4

        calls = {c.vaddr + 5: (c.vaddr, c.target) for c in direct_call_sites(binary)}
        assert {int(t) for t in os.listdir(f"/proc/{pid}/task")} == {t["tid"] for t in doc["threads"]}
        for t in doc["threads"]:
            assert t["complete"] is True and t["reason"] is None, t
            check_by_source(t["frames"], calls)
        starts = {next(f["function"] for f in t["frames"] if f["analysed"]) for t in doc["threads"]}
        assert starts == set(EXPECTED_CHAINS)
        if frame_pointer:
            wait_for(lambda: all_blocked(pid), timeout=60)
            gdb = gdb_threads(pid)
            assert sorted(gdb) == sorted(t["tid"] for t in doc["threads"])
            for t in doc["threads"]:
                match_gdb(t["frames"], list(gdb[t["tid"]].frames), binary, calls)

        # contrast: the ptrace + CFI walk (the unwind-mode answer) of the same threads cannot say this
        wait_for(lambda: all_blocked(pid), timeout=60)
        walked = ContextReader(str(binary)).read(pid)
        assert walked["error"] is None
        by_tid = {t["tid"]: t for t in doc["threads"]}
        # (with frame pointers it follows rbp through the binary, but not through _start: the main
        # thread is incomplete; without them it has nothing to go on in the binary)
        differ = [t["tid"] for t in walked["threads"]
                  if not (t["complete"] and t["frames"] == by_tid[t["tid"]]["frames"])]
        assert len(differ) >= (1 if frame_pointer else 4), walked

        wait_for(lambda: all_blocked(pid), timeout=60)
        assert release(prog) == (EXPECTED_OUTPUT, 0)

        wait_for(lambda: any(p["pid"] == early.pid for t in targets() for p in t.get("processes", [])),  # type: ignore[index, attr-defined]
                 timeout=120)
        wait_for(lambda: all_blocked(early.pid), timeout=60)
        out = ctl(sock, "contexts", str(early.pid), "--format", "json")
        assert out.returncode == 0, out.stderr
        threads = json.loads(out.stdout)["threads"]
        assert len(threads) == 4
        unseeded = "bpf-state: frames above the thread's first probe event are unknown"
        for t in threads:
            if t["complete"]:  # seeded (a whole CFI walk at attach, through frame pointers)
                assert t["reason"] is None and frame_pointer
                check_by_source(t["frames"], calls)
            else:
                assert t["reason"].startswith(unseeded), t
        # the main thread's walk cannot cross _start without tables: never seeded
        assert sum(not t["complete"] for t in threads) >= (1 if frame_pointer else 4)
        wait_for(lambda: all_blocked(early.pid), timeout=60)
        assert release(early) == (EXPECTED_OUTPUT, 0)
        daemon.stop().assert_clean()
    finally:
        for p in (prog, early):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if daemon is not None:
            daemon.kill()


@pytest.mark.parametrize("scope", [None, "^park$"], ids=["unscoped", "scope-park"])
def test_contexts_after_a_returned_deep_recursion_drop_its_stale_pieces(bpf: None, workdir: str,
                                                                        scope: str | None) -> None:
    """tests/programs/stale.c: main returned from deep^41 and blocks in park() through an inline
    syscall, no probe event since the return -- the thread's BPF state still holds the recursion's
    pieces; the context read now is main -> park, as gdb walks it.  With ``scope = "^park$"`` only
    park is probed: its state is a segment of unknown caller, and the frames above it come from the
    unwind of the stack copied at its entry (scopeprefix.py), joined as for a sample."""
    from gdb_threads import gdb_threads
    from test_userstack import programs

    require_tool("gdb")
    binary = programs.build("stale", opt="O0")
    target = target_toml("stale", f'path = "{binary}"', ["getppid"], "instrumented",
                         f'scope = "{scope}"\n' if scope else "")
    daemon = RunningDaemon(workdir, config_text(workdir, target))
    sock = daemon.socket_path
    targets = partial(ctl_targets, daemon)
    prog: subprocess.Popen[str] | None = None
    try:
        def parked(pid: int) -> bool:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
                return state == "S" and Path(f"/proc/{pid}/syscall").read_text().split()[0] == "0"
            except OSError:
                return False

        wait_for(lambda: any(b.get("attached") for t in targets() for b in t.get("binaries", [])),
                 timeout=300)
        prog = subprocess.Popen([str(binary), "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert prog.stdout is not None and prog.stdout.readline().startswith("ready ")
        pid = prog.pid
        wait_for(lambda: parked(pid), timeout=60)
        wait_for(lambda: any(p["pid"] == pid for t in targets() for p in t.get("processes", [])),  # type: ignore[index, attr-defined]
                 timeout=120)

        def context() -> dict[str, object]:
            out = ctl(sock, "contexts", str(pid), "--format", "json")
            assert out.returncode == 0, out.stderr
            (t,) = json.loads(out.stdout)["threads"]
            return t  # type: ignore[no-any-return]

        # (--scope: the entry's stack copy reaches the daemon's pump within one poll)
        t = wait_for(lambda: (lambda t: t if t["complete"] else None)(context()), timeout=30)
        assert t["complete"] is True and t["reason"] is None, t
        assert [f["function"] for f in t["frames"]] == ["main", "park"]
        calls = {c.vaddr + 5: (c.vaddr, c.target) for c in direct_call_sites(binary)}
        wait_for(lambda: parked(pid), timeout=60)
        match_gdb(t["frames"], list(gdb_threads(pid)[pid].frames), binary, calls)
        wait_for(lambda: parked(pid), timeout=60)
        stdout, _ = prog.communicate("go\n", timeout=120)
        assert (stdout, prog.returncode) == ("done 40 1\n", 0)
        daemon.stop().assert_clean()
    finally:
        if prog is not None and prog.poll() is None:
            prog.kill()
            prog.wait()
        daemon.kill()
