"""Unit tests of the unwinder's userspace parts: /proc/PID/maps parsing and load bias (against a fake
/proc root and against readelf's program headers), the bpf_loop callback linker, sample decoding, the
unwind-encoding cache."""

from __future__ import annotations

import struct
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import pt_loads
from hypothesis import given, settings
from hypothesis import strategies as st
from programs.build import build

from ccprofd.callgraph import analyze_binary
from ccprofd.elf.image import ElfImage
from ccprofd.encode import get_plan
from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.errors import BPFError
from ccprofd.persist.cache import AnalysisCache
from ccprofd.proc.maps import module_mappings, parse_maps, read_maps
from ccprofd.tracing.unwind import plan as unwind_plan
from ccprofd.tracing.unwind.programs import link_loop_callbacks
from ccprofd.tracing.unwind.sampler import (
    ARG_LEN,
    FLAG_HIT,
    EncodedRecord,
    EncodedSegment,
    RecordLayout,
    UnanalysedFrame,
    UnwindSampler,
    UnwoundSample,
    hit_sample,
)

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


def _fake_proc(tmp: Path, pid: int, lines: list[str]) -> str:
    d = tmp / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "maps").write_text("\n".join(lines) + "\n")
    return str(tmp / "proc")


def test_parse_maps_fields() -> None:
    text = ("55d0c0a00000-55d0c0a01000 r-xp 00001000 08:01 1234   /usr/bin/prog with space\n"
            "7ffd1c1f0000-7ffd1c1f2000 r-xp 00000000 00:00 0          [vdso]\n"
            "garbage line\n"
            "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n")
    maps = parse_maps(text)
    assert [m.path for m in maps] == ["/usr/bin/prog with space", "[vdso]", ""]
    assert maps[0].start == 0x55D0C0A00000 and maps[0].offset == 0x1000 and maps[0].executable
    assert maps[0].file_backed and not maps[1].file_backed and not maps[2].executable


def test_load_bias_from_fake_proc_matches_readelf(tmp_path: Path) -> None:
    """A libc text mapping at an arbitrary base: bias = base - (page-aligned vaddr of the PT_LOAD
    whose page-aligned offset is the mapping's offset), with PT_LOADs read by readelf."""
    text_seg = next((va, off) for va, _sz, off in pt_loads(Path(LIBC)) if va != 0)
    page = 0x1000
    base = 0x7F1234500000
    map_off = text_seg[1] & ~(page - 1)
    root = _fake_proc(tmp_path, 42, [
        f"{base:x}-{base + 0x10000:x} r-xp {map_off:08x} 08:01 99 {LIBC}",
        "7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0 [vdso]",
    ])
    pm = module_mappings(42, lambda p: ElfImage(p).addrspace, root)
    assert len(pm.mappings) == 1 and [m.path for m in pm.other_exec] == ["[vdso]"]
    mm = pm.mappings[0]
    assert mm.bias == base - (text_seg[0] & ~(page - 1))
    assert pm.find(base + 0x10) is mm and pm.find(base + 0x10000) is None
    assert mm.vaddr(base + 0x10) == (text_seg[0] & ~(page - 1)) + 0x10


def test_real_process_bias_translates_a_libc_function_to_its_nm_address() -> None:
    """In this very process: the runtime address of libc's getppid (ctypes) translated with the
    computed bias is the address ``nm -D`` gives for it."""
    import ctypes
    import os

    libc = ctypes.CDLL(None)
    runtime = ctypes.cast(libc.getppid, ctypes.c_void_p).value
    assert runtime is not None
    pm = module_mappings(os.getpid(), lambda p: ElfImage(p).addrspace)
    mm = pm.find(runtime)
    assert mm is not None and "libc" in mm.path
    nm = subprocess.run(["nm", "-D", "--defined-only", mm.open_path], capture_output=True, text=True).stdout
    addrs = {int(line.split()[0], 16) for line in nm.splitlines()
             if len(line.split()) == 3 and line.split()[2].split("@")[0] == "getppid"}
    assert mm.vaddr(runtime) in addrs
    assert read_maps(os.getpid())


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return rawbpf.insn(code, dst, src, off, imm)


def test_link_loop_callbacks_points_each_call_at_its_callback() -> None:
    main = (_insn(0xB7, 1, imm=4097) + _insn(0x18, 2) + _insn(0) + _insn(0x85, imm=181)  # unwind loop
            + _insn(0xB7, 1, imm=4096) + _insn(0x18, 2) + _insn(0) + _insn(0x85, imm=181)  # arena loop
            + _insn(0xB7, 0) + _insn(0x95))
    cb_a, cb_b = _insn(0xB7, 0) + _insn(0x95), _insn(0xB7, 0, imm=1) + _insn(0x95)
    linked, starts = link_loop_callbacks(main, {4097: cb_a, 4096: cb_b})
    assert starts == [10, 12] and len(linked) == len(main) + 32
    for ld_at, target in ((1, 10), (5, 12)):
        code, regs, _, imm = struct.unpack_from("<BBhi", linked, ld_at * 8)
        assert (code, regs >> 4, regs & 15) == (0x18, 4, 2)
        assert ld_at + imm + 1 == target


def test_link_loop_callbacks_refuses_what_it_cannot_link() -> None:
    no_count = _insn(0x18, 2) + _insn(0) + _insn(0x85, imm=181) + _insn(0x95)
    with pytest.raises(BPFError):
        link_loop_callbacks(no_count, {1: _insn(0x95)})
    with pytest.raises(BPFError):
        link_loop_callbacks(_insn(0xB7, 0) + _insn(0x95), {1: _insn(0x95)})


def test_sample_decoding() -> None:
    path = b"/tmp/x.txt\0"
    arg = path + bytes(ARG_LEN - len(path))
    raw = struct.pack("<QIIIiIIIIQQII6Q", 123, 16, 10, 11, 257, 3, 0, 1, 1, 7, 8, len(path), 0,
                      2**64 - 100, 0x1000, 0o2000000, 0, 0, 0) + arg \
        + struct.pack("<3Q", 1, 2, 3)
    s = UnwoundSample.decode(raw)
    got = (s.tgid, s.tid, s.syscall, s.pcs, s.complete, s.fp_frames, s.key, s.arg, s.sargs)
    assert got == (10, 11, 257, (1, 2, 3), True, 1, (7, 8), "/tmp/x.txt",
                   (2**64 - 100, 0x1000, 0o2000000, 0, 0, 0))
    cpu = UnwoundSample.decode(struct.pack("<QIIIiIIIIQQII6Q", 1, 16, 1, 1, -1, 0, 1, 0, 0, 0, 0, 0, 0,
                                           *[0] * 6) + bytes(ARG_LEN))
    assert cpu.syscall is None and cpu.event == "cpu" and cpu.reason == "max_depth" and not cpu.complete
    assert cpu.arg is None and cpu.sargs is None
    # a repeated context's header-only record carries the sample's own argument
    hit = UnwoundSample.decode(struct.pack("<QIIIiIIIIQQII6Q", 5, 18, 2, 2, 59, 4, 0, 0, 0, 7, 8, len(path),
                                           0, 0x2000, 0x3000, 0x4000, 0, 0, 0) + path)
    assert hit.flags & FLAG_HIT and hit.pcs == () and hit.arg == "/tmp/x.txt" and hit.key == (7, 8)
    assert hit.sargs == (0x2000, 0x3000, 0x4000, 0, 0, 0)


def test_deliver_counts_a_short_record_and_decodes_hits_inline() -> None:
    """The ring callback: a complete hit header is kept as its header's fields (HitHeader), which
    stand for the same sample as UnwoundSample.decode makes of it; a record shorter than its kind
    needs is counted, not decoded (no exception out of the poll)."""
    sampler = UnwindSampler.__new__(UnwindSampler)  # deliver() needs no BPF: only its own state
    sampler._pending, sampler.malformed, sampler.layout, sampler.fp_frames = [], 0, None, 0
    sampler.processes = types.SimpleNamespace(stale=set())
    hit = struct.pack("<QIIIiIIIIQQII6Q", 5, 18, 2, 3, 110, 4, 0, 1, 0, 7, 8, 0, 0, *range(6))
    sampler.deliver(hit)
    assert len(sampler._pending) == 1 and isinstance(sampler._pending[0], tuple)
    got = hit_sample(sampler._pending[0])
    assert got == UnwoundSample.decode(hit)
    assert got.flags & FLAG_HIT and got.syscall == 110 and got.tgid == 2 and got.tid == 3
    assert got.sargs == (0, 1, 2, 3, 4, 5) and got.key == (7, 8) and got.fp_frames == 1
    assert sampler.fp_frames == 1  # counted as the record arrived
    sample_header_only = struct.pack("<QIIIiIIIIQQII6Q", 5, 16, 2, 3, 110, 4, 0, 0, 0, 7, 8, 0, 0, *[0] * 6)
    sampler.deliver(sample_header_only)  # a full sample's kind, but no room for its 4 pcs
    assert sampler.malformed == 1 and len(sampler._pending) == 1


def test_record_decoding_by_hand() -> None:
    """A whole new-context record (header, path argument, struct ue_rec, tagged pcs) decoded field by
    field as laid out by hand here: exact bits (bit 63) split off pcs and unanalysed vaddrs, a
    two-word acycID, two segments, a recID over two words cut to its length."""
    layout = RecordLayout(acyc_words=2, max_segs=2, rec_words=2, max_unan=2)
    exact = 1 << 63
    hdr = struct.pack("<QIIIiIIIIQQII6Q", 9, 16, 4, 5, 39, 3, 0, 0, 0x10, 1, 2, 0, 0, *[0] * 6)
    rec_len = 70  # two words, the second's bits above 6 are not part of it
    ue = struct.pack("<IIIIQII", 3, 0x20, rec_len, 2, 0x1234, 1, 2) + struct.pack("<2Q", 0xAA, 0xBB)
    ue += struct.pack("<2Q", 1, 2) + struct.pack("<IIIIqQ", 4, 7, 8, 0, -1, 0x99)
    ue += struct.pack("<2Q", 3, 4) + struct.pack("<IIIIqQ", 6, 9, 10, 0, 0x500, 0)
    ue += struct.pack("<2Q", 0xF0F0, 0xFFC1)
    ue += struct.pack("<2Q", (7 << 32) | 1, exact | 0x7000) + struct.pack("<2Q", 0, 0)
    assert len(ue) == layout.size
    raw = hdr + bytes(ARG_LEN) + ue + struct.pack("<3Q", exact | 0x401000, 0x401234, 0x402000)
    s = UnwoundSample.decode(raw, layout)
    assert (s.time_ns, s.tgid, s.tid, s.syscall, s.key, s.flags) == (9, 4, 5, 39, (1, 2), 0x10)
    assert s.pcs == (0x401000, 0x401234, 0x402000) and s.exact == (True, False, False)
    assert s.encoded == EncodedRecord(
        node=3, flags=0x20, inner=0x1234, nframes=2, acyc=(0xAA, 0xBB), rec=0xF0F0 | (0x01 << 64),
        rec_len=rec_len, segments=(EncodedSegment((1, 2), 4, 7, 8, -1, 0x99),
                                   EncodedSegment((3, 4), 6, 9, 10, 0x500, 0)),
        unanalysed=(UnanalysedFrame(1, 7, 0x7000, True),))
    plain = UnwoundSample.decode(raw[:-24] + struct.pack("<3Q", 1, 2, 3), layout)
    assert plain.pcs == (1, 2, 3) and plain.exact == (False, False, False)
    signal = UnwoundSample.decode(raw[:-24] + struct.pack("<3Q", 1, exact | 2, exact | 3), layout)
    assert signal.pcs == (1, 2, 3) and signal.exact == (False, True, True)  # below a signal frame


def test_hit_headers_make_the_same_samples_as_decoded_hits() -> None:
    """UnwindMode turns a hit kept as its header (the flood's fast path) into the TraceSample it
    makes of the same record decoded whole: syscall (its argument words cut to the call's count)
    and CPU samples."""
    from ccprofd.tracing.frames import Decoded, Frame
    from ccprofd.tracing.unwind.mode import UnwindMode

    mode = UnwindMode.__new__(UnwindMode)
    mode._clock_offset = 1000
    d = Decoded([Frame("main", "/bin/x", None, True, 0x10, 0x15)], True)
    for nr in (1, 39, 0, -1):  # write (3 words), getppid (none), read, a CPU sample
        raw = struct.pack("<QIIIiIIIIQQII6Q", 5, 18, 2, 3, nr, 0, 0, 1, 0, 7, 8, 0, 0, *range(10, 16))
        sampler = UnwindSampler.__new__(UnwindSampler)
        sampler._pending, sampler.malformed, sampler.layout, sampler.fp_frames = [], 0, None, 0
        sampler.deliver(raw)
        (header,) = sampler._pending
        assert isinstance(header, tuple)
        assert mode._kinds([header]) == mode._kinds([hit_sample(header)]) == [mode._kind(header)]
        assert mode._key(header) == mode._key(hit_sample(header)) == (7, 8)
        assert mode._sample(header, d) == mode._sample(hit_sample(header), d)
    assert mode._sample(header, d).event == "cpu"


def test_small_targets_share_one_program_text() -> None:
    """The encoded program's table sizes are rounded up to buckets, so two small targets with the
    same encoding widths get the same BPF text (one compiled object, which set-up can prebuild);
    a target past the smallest bucket gets bigger tables, never smaller than its own counts."""
    from ccprofd.tracing.unwind.sampler import _program_defines

    def text(nfuncs: int, nedges: int, nsites: int) -> str:
        enc = types.SimpleNamespace(functions=[[0, 1, 0, 0]] * nfuncs, edges=dict.fromkeys(range(nedges)),
                                    callsites=dict.fromkeys(range(nsites)), rec_code_bits=0)
        layout = RecordLayout(acyc_words=1, max_segs=64, rec_words=2, max_unan=128)
        return _program_defines(max_depth=4096, max_maps=256, max_procs=256, max_entries=1 << 20,
                                max_modules=1024, max_rules=4096, max_contexts=1 << 16, arena_words=1 << 21,
                                ringbuf_pages=4096, encoding=enc, layout=layout)[0]  # type: ignore[arg-type]

    small = text(3, 5, 4)
    assert text(40, 300, 250) == small and "#define UE_MAX_FUNCS 1024\n" in small
    big = text(3000, 10_000, 5000)
    assert big != small
    for name, at_least in (("UE_MAX_FUNCS", 3000), ("UE_MAX_EDGES", 10_000), ("UE_MAX_SITES", 5000)):
        (line,) = [ln for ln in big.splitlines() if ln.startswith(f"#define {name} ")]
        assert int(line.split()[2]) >= at_least


def test_unwind_encoding_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoding is stored once per plan and read back equal; a stripped twin (same build-id,
    other content) never gets its twin's entry; a damaged entry is rebuilt."""
    cache = AnalysisCache(tmp_path / "cache")
    built = []
    real_build = unwind_plan.build_unwind_encoding

    def counting_build(graph: Any, plan: Any) -> Any:
        built.append(graph.binary.path)
        return real_build(graph, plan)

    monkeypatch.setattr(unwind_plan, "build_unwind_encoding", counting_build)
    encodings = {}
    for strip in (False, True, False, True):
        binary = str(build("calls", opt="O2", strip=strip))
        graph = analyze_binary(binary, cache_dir=tmp_path / "cache")
        plan = get_plan(graph, "valence", cache_dir=tmp_path / "cache", use_cache=False)
        enc = unwind_plan.cached_unwind_encoding(graph, plan, cache)
        assert unwind_plan.encoding_to_plain(enc) == unwind_plan.encoding_to_plain(real_build(graph, plan))
        encodings[strip] = enc
    assert len(built) == 2  # once per file, then from the cache
    assert encodings[False].binary["content_hash"] != encodings[True].binary["content_hash"]
    for entry in (tmp_path / "cache" / unwind_plan.CACHE_KIND).iterdir():
        entry.write_bytes(b"torn")
    unwind_plan.cached_unwind_encoding(graph, plan, cache)
    assert len(built) == 3


def test_tail_exit_frames_only_where_the_call_graph_has_one_chain(tmp_path: Path) -> None:
    """A call whose target tail-jumped into a library: the tail-call frames come from the one chain of
    tail edges from the target to an import (tailcall.c: main -> tail_plt, ``jmp getppid@plt``),
    picked by the library function entered when there are several; none when it is not known whole."""
    from ccprofd.encode.plan import COL
    from ccprofd.tracing.unwind.symbolize import UnwindSymbolizer

    graph = analyze_binary(str(build("tailcall", opt="O2", pie=True)), cache_dir=tmp_path)
    plan = get_plan(graph, "valence", cache_dir=tmp_path, use_cache=False)
    sym = UnwindSymbolizer(unwind_plan.build_unwind_encoding(graph, plan), plan, lambda _key: None)
    name = dict(zip(plan["nodes"], plan["names"], strict=True))
    rows = [(r[COL["site"]], name.get(r[COL["caller"]]), name.get(r[COL["callee"]]), r[COL["kind"]],
             r[COL["callee"]]) for r in plan["sites"]]
    (call,) = [s for s, a, b, k, _ in rows if (a, b, k) == ("main", "tail_plt", "direct")]
    (jump,) = [s for s, a, b, k, _ in rows if (a, b, k) == ("tail_plt", "getppid", "tail")]
    (notail,) = [s for s, a, b, k, _ in rows if (a, b, k) == ("main", "notail", "direct")]
    (puts,) = {n for _, _, b, _, n in rows if b == "puts"}

    def chain(site: int, entered: str | None) -> list[tuple[str | None, int | None, bool]]:
        return [(f.function, f.call_site, f.tail_call) for f in sym._tail_exit_frames(site, entered)]

    assert chain(call, "getppid") == chain(call, None) == [("tail_plt", jump, True)]
    cached = sym._tail_exit(call, "getppid")  # what decode() uses: made once, with the frames' JSON
    assert sym._tail_exit(call, "getppid") is cached
    assert [f for f, _ in cached] == sym._tail_exit_frames(call, "getppid")
    assert [j for _, j in cached] == [f.to_json() for f in sym._tail_exit_frames(call, "getppid")]
    assert chain(notail, "getppid") == []  # notail calls finish: no tail jump out of the binary
    # A second way out of tail_plt (as `return x ? getppid() : puts(...)` would have): ambiguous
    # unless the library function entered names it.
    tables = sym._exit_tables()
    tail_plt = tables.direct[call]
    tables.tails[tail_plt].append((puts, jump + 2))
    assert chain(call, None) == [] and chain(call, "write") == []
    assert chain(call, "getppid") == [("tail_plt", jump, True)]
    assert chain(call, "puts") == [("tail_plt", jump + 2, True)]
    # An indirect jump in tail_plt: it may leave the binary some other way.
    tables.other_jumpers.add(tail_plt)
    assert chain(call, "getppid") == []


def test_page_index_bounds_the_row_of_every_vaddr() -> None:
    """Every vaddr's row (the last start <= v, found here by bisect over the whole table) lies in its
    bucket's [bounds[b], bounds[b + 1]] range, as unwind.c's narrowed binary search assumes; vaddrs
    before the first row find none and those past the last bucket the last row."""
    import random
    from bisect import bisect_right

    from ccprofd.tracing.unwind.tables import MIN_PAGE_SHIFT, page_index

    rng = random.Random(18)
    for trial in range(40):
        n = rng.choice([1, 2, 5, 50, 400])
        gaps = [rng.choice([1, 3, 16, 17, 40, 64, 300, 4096]) for _ in range(n)]
        first = rng.randrange(0, 1 << 20)
        starts = []
        pos = first
        for g in gaps:
            starts.append(pos)
            pos += g
        base, shift, bounds = page_index(starts)
        assert shift >= MIN_PAGE_SHIFT and base <= starts[0] and base % (1 << shift) == 0
        assert len(bounds) <= n + 2  # never much bigger than the rows
        nb = len(bounds) - 1
        for v in [*range(max(0, first - 40), pos + 300), *(s + d for s in starts for d in (-1, 0, 1))]:
            want = bisect_right(starts, v)  # rows starting at or before v; the row is want - 1
            if v < base:
                lo = hi = 0
            elif (v - base) >> shift >= nb:
                lo = hi = n
            else:
                b = (v - base) >> shift
                lo, hi = bounds[b], bounds[b + 1]
            assert lo <= want <= hi, (trial, v)
            assert want == lo + bisect_right(starts[lo:hi], v)

# ------------------------------------------------------------ the compiled hit loop (chits.c)
def _hits_mode(raw: list[Any], offset: int) -> Any:
    """An UnwindMode (not prepared) whose next poll receives ``raw``."""
    from ccprofd.tracing.api import TraceOptions
    from ccprofd.tracing.unwind.mode import UnwindMode

    mode = UnwindMode("/bin/true", TraceOptions())
    mode._clock_offset = offset
    mode._receive = lambda _timeout: list(raw)  # type: ignore[method-assign]
    return mode


def test_the_compiled_hit_loop_is_built() -> None:
    from conftest import skip_or_fail

    from ccprofd.tracing.unwind import mode

    if mode.chits is None:
        skip_or_fail("ccprofd/tracing/unwind/chits.c is not built (bash scripts/build_ext.sh)")


HIT_WORDS = st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                      st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([-1, 0, 1, 39, 59, 231, 999, 2**31 - 1]),
                          st.integers(0, 2**64 - 1), st.integers(1, 2**32 - 2), HIT_WORDS), max_size=40),
       st.integers(-2**62, 2**62), st.booleans())
def test_compiled_hit_loop_makes_the_python_loops_samples(hits: list[Any], offset: int,
                                                          fresh_info: bool) -> None:
    """A poll of hit headers through chits.c and through ModeBase's Python loop (the reference)
    gives equal TraceSamples and the same tallies: contexts complete, incomplete and unknown (lost),
    CPU samples, syscalls with 0..6 argument words and unknown ones, numbers not yet in
    SYSCALL_INFO, a negative clock offset."""
    from ccprofd.tracing import base
    from ccprofd.tracing.frames import Decoded, Frame
    from ccprofd.tracing.unwind import mode as mode_module

    if mode_module.chits is None:
        pytest.skip("chits.c not built (test_the_compiled_hit_loop_is_built says so)")
    contexts = {(1, 1): Decoded([Frame("main", "/bin/x", None, True, 0x10, 0x15)], True),
                (2, 2): Decoded([Frame("f", "/bin/x", None, True, 0x20, None)], False, "depth: too deep"),
                (3, 3): Decoded([], False, "decode error: x")}  # key (0, 0): never learnt (lost)
    fmt = "<QIIIiIIIIQQII6Q"
    raw = [struct.unpack(fmt, struct.pack(fmt, t, 18, tgid, tgid + 1, nr, 0, 0, 0, 0, k, k, 0, 0, *words))
           for k, nr, t, tgid, words in hits]
    results = []
    for compiled in (True, False):
        if fresh_info:
            base.SYSCALL_INFO.clear()
        mode = _hits_mode(raw, offset)
        for key, d in contexts.items():
            mode._kernel.learn(key, None, d)
        with pytest.MonkeyPatch.context() as mp:
            if not compiled:
                mp.setattr(mode_module, "chits", None)
            else:
                assert mode._hits_only(list(raw)) is not None
            out = mode.poll(0)
        results.append((out, mode.samples_seen, mode.incomplete, mode.reasons, mode.records,
                        mode._kernel.lost))
    assert results[0] == results[1]
    assert all(s.frames is contexts[(1, 1)].json_frames() for s in results[0][0] if s.complete)  # shared
    # an incomplete sample says why, as its context's Decoded does (JSONL's "reason")
    assert all((s.reason is None) == s.complete for s in results[0][0])
    assert {s.reason for s in results[0][0] if not s.complete} <= {"depth: too deep", "decode error: x",
                                                                   base.LOST_CONTEXT}


def test_compiled_hit_loop_leaves_a_mixed_batch_to_python() -> None:
    """A batch with any record that is not a hit header (a new context, a plain sample) is not the
    compiled loop's: it returns None and the Python loop decodes new contexts first, as always."""
    from ccprofd.tracing.unwind import mode as mode_module

    if mode_module.chits is None:
        pytest.skip("chits.c not built (test_the_compiled_hit_loop_is_built says so)")
    hdr = struct.unpack("<QIIIiIIIIQQII6Q", struct.pack("<QIIIiIIIIQQII6Q", 5, 18, 2, 3, 39, 0, 0, 0, 0, 7, 8,
                                                        0, 0, *range(6)))
    whole = UnwoundSample.decode(struct.pack("<QIIIiIIIIQQII6Q", 5, 18, 2, 3, 39, 0, 0, 0, 0, 7, 8, 0, 0,
                                             *range(6)))
    mode = _hits_mode([], 0)
    assert mode._hits_only([hdr, whole]) is None
    assert mode._hits_only([hdr, hdr[:5]]) is None
    assert mode._hits_only([]) == ([], 0, 0, [])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_compiled_record_decoder_makes_the_python_decoders_objects(data: st.DataObject) -> None:
    """chits.decode_record against UnwoundSample.decode (the reference) on random whole records of
    random layouts: the same objects field for field (and type: bools stay bools), or None where the
    Python decoder is to do it (hits, unknown reasons, multi-word recIDs, short records)."""
    from ccprofd.tracing.unwind import sampler as sampler_module
    from ccprofd.tracing.unwind.constants import EV_HIT, EV_SAMPLE, REASONS

    chits = sampler_module.chits
    if chits is None:
        pytest.skip("chits.c not built (test_the_compiled_hit_loop_is_built says so)")
    u32, u64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
    small = st.integers(0, 3)
    layout = RecordLayout(data.draw(st.integers(1, 3)), data.draw(small), data.draw(small), data.draw(small))
    n = data.draw(st.integers(0, 6))
    reason = data.draw(st.sampled_from([*REASONS, 999]))
    arg = data.draw(st.binary(max_size=12))
    hdr = struct.pack("<QIIIiIIIIQQII6Q", data.draw(u64), data.draw(st.sampled_from([EV_SAMPLE, EV_HIT])),
                      data.draw(u32), data.draw(u32), data.draw(st.integers(-2**31, 2**31 - 1)), n, reason,
                      data.draw(u32), data.draw(u32), data.draw(u64), data.draw(u64),
                      data.draw(st.sampled_from([0, len(arg), ARG_LEN, ARG_LEN + 1])), 0,
                      *[data.draw(u64) for _ in range(6)])
    w = layout.acyc_words
    rec = struct.pack("<IIIIQII", data.draw(u32), data.draw(u32), data.draw(st.integers(0, 64 * 3)),
                      data.draw(st.integers(0, 5)), data.draw(u64), data.draw(st.integers(0, 5)),
                      data.draw(u32))
    rec += struct.pack(f"<{w}Q", *[data.draw(u64) for _ in range(w)])
    for _ in range(layout.max_segs):
        rec += struct.pack(f"<{w}Q", *[data.draw(u64) for _ in range(w)])
        rec += struct.pack("<IIIIqQ", data.draw(u32), data.draw(u32), data.draw(u32), 0,
                           data.draw(st.integers(-2**63, 2**63 - 1)), data.draw(u64))
    rec += struct.pack(f"<{layout.rec_words}Q", *[data.draw(u64) for _ in range(layout.rec_words)])
    rec += struct.pack(f"<{2 * layout.max_unan}Q", *[data.draw(u64) for _ in range(2 * layout.max_unan)])
    assert len(rec) == layout.size
    pcs = struct.pack(f"<{n}Q", *[data.draw(u64) for _ in range(n)])
    raw = hdr + (arg + bytes(ARG_LEN))[:ARG_LEN] + rec + pcs
    raw = raw[:data.draw(st.sampled_from([len(raw), len(raw), len(raw) - 1, 200]))]
    got = chits.decode_record(raw, EV_HIT, ARG_LEN, (layout.acyc_words, layout.max_segs, layout.rec_words,
                                                     layout.max_unan), REASONS)
    try:
        want = UnwoundSample.decode(raw, layout)
    except struct.error:
        assert got is None
        return
    if got is not None:
        assert got == want and repr(got) == repr(want)
    else:  # declined: only for what the Python decoder is to do
        assert (want.flags & FLAG_HIT or want.reason not in REASONS.values() or want.encoded is None
                or ((want.encoded.rec_len + 63) // 64 > 1 and layout.rec_words > 1))


def test_compiled_record_decoder_decodes_the_hand_laid_record() -> None:
    """test_record_decoding_by_hand's record with a one-word recID: the compiled decoder takes it
    (not None) and gives the Python decoder's objects, with the exact bits split off as there."""
    from ccprofd.tracing.unwind import sampler as sampler_module
    from ccprofd.tracing.unwind.constants import EV_HIT, REASONS

    if sampler_module.chits is None:
        pytest.skip("chits.c not built (test_the_compiled_hit_loop_is_built says so)")
    layout = RecordLayout(acyc_words=2, max_segs=2, rec_words=2, max_unan=2)
    exact = 1 << 63
    hdr = struct.pack("<QIIIiIIIIQQII6Q", 9, 16, 4, 5, 39, 3, 0, 0, 0x10, 1, 2, 5, 0, *range(6))
    ue = struct.pack("<IIIIQII", 3, 0x20, 40, 2, 0x1234, 1, 2) + struct.pack("<2Q", 0xAA, 0xBB)
    ue += struct.pack("<2Q", 1, 2) + struct.pack("<IIIIqQ", 4, 7, 8, 0, -1, 0x99)
    ue += struct.pack("<2Q", 3, 4) + struct.pack("<IIIIqQ", 6, 9, 10, 0, 0x500, 0)
    ue += struct.pack("<2Q", 0xFFFF_F0F0_F0F0, 0xFFC1)
    ue += struct.pack("<2Q", (7 << 32) | 1, exact | 0x7000) + struct.pack("<2Q", 0, 0)
    path = b"/a\xff\0zz"
    pcs = struct.pack("<3Q", exact | 0x401000, 0x401234, 0x402000)
    raw = hdr + (path + bytes(ARG_LEN))[:ARG_LEN] + ue + pcs
    got = sampler_module.chits.decode_record(raw, EV_HIT, ARG_LEN, (2, 2, 2, 2), REASONS)
    want = UnwoundSample.decode(raw, layout)
    assert got is not None and got == want and repr(got) == repr(want)
    assert got.encoded.rec == 0xF0F0_F0F0 & ((1 << 40) - 1) | 0xFF_0000_0000  # cut to its 40 bits
    assert got.arg == "/a\udcff" and got.exact == (True, False, False) and got.sargs == tuple(range(6))


def test_a_new_contexts_daemon_sample_is_made_only_when_its_count_is_taken() -> None:
    """A new context's representative sample (no time, what poll_counted() gives the daemon's
    store) is made when the kernel's count of it is first taken, not at every poll (ccprofd trace
    never takes counts): the same TraceSample as the mode's own ``_sample(r, d, timed=False)``,
    made once, the first record of a key standing; poll() meanwhile makes only the output sample."""
    from ccprofd.tracing.frames import Decoded, Frame
    from ccprofd.tracing.unwind.constants import EV_SAMPLE, FLAG_NEW

    def record(t: int, tid: int, key: int) -> UnwoundSample:
        hdr = struct.pack("<QIIIiIIIIQQII6Q", t, EV_SAMPLE, 7, tid, 39, 0, 0, 0, FLAG_NEW, key, key, 0, 0,
                          *range(6))
        return UnwoundSample.decode(hdr + bytes(ARG_LEN))

    d = Decoded([Frame("main", "/bin/x", None, True, 0x10, 0x15)], True)
    first, again, other = record(5, 8, 1), record(6, 9, 1), record(7, 10, 2)
    mode = _hits_mode([first, again, other], 100)
    made: list[Any] = []
    sample, representative = mode._sample, mode._representative

    def spy(arg: Any) -> Any:
        got = representative(arg)
        made.append(got.tid)
        return got

    mode._representative = spy  # type: ignore[method-assign]
    mode._decode = lambda _r: d  # type: ignore[method-assign]
    out = mode.poll(0)
    assert [s.time_ns for s in out] == [105, 106, 107] and made == []
    mode._receive = lambda _timeout: []  # type: ignore[method-assign]
    mode._kernel_counts = lambda: {(1, 1): 3}  # type: ignore[method-assign]
    _, counts = mode.poll_counted(0)
    assert counts == [(sample(first, d, timed=False), 3)] and made == [8]
    assert counts[0][0].time_ns == 0 and counts[0][0].tid == 8
    mode._kernel_counts = lambda: {(1, 1): 5, (2, 2): 1}  # type: ignore[method-assign]
    _, counts = mode.poll_counted(0)
    assert counts == [(sample(first, d, timed=False), 2), (sample(other, d, timed=False), 1)]
    assert made == [8, 10]


def test_the_innermost_frame_is_made_once_per_pc_and_shared(tmp_path: Path) -> None:
    """decode() of records that end in the same function at the same pc (exact, or a return
    address) shares one innermost frame and its JSON, made once; another pc or exactness gets its
    own, and making it leaves the first context's frames as they were (frames are shared read-only).
    The frames are checked by hand: main at the pc, its call site looked up from a return address."""
    from ccprofd.callgraph.model import ROOT
    from ccprofd.encode import Encoder
    from ccprofd.encode.plan import COL
    from ccprofd.tracing.unwind.constants import UE_F_INNER_EXACT
    from ccprofd.tracing.unwind.sampler import EncodedRecord
    from ccprofd.tracing.unwind.symbolize import UnwindSymbolizer

    graph = analyze_binary(str(build("tailcall", opt="O2", pie=True)), cache_dir=tmp_path)
    plan = get_plan(graph, "valence", cache_dir=tmp_path, use_cache=False)
    enc = unwind_plan.build_unwind_encoding(graph, plan)
    sym = UnwindSymbolizer(enc, plan, lambda _key: None)
    name = dict(zip(plan["nodes"], plan["names"], strict=True))
    (entry,) = [(r[COL["caller"]], r[COL["callee"]], r[COL["site"]]) for r in plan["sites"]
                if r[COL["caller"]] == ROOT and name.get(r[COL["callee"]]) == "main"]
    encoder = Encoder(plan)
    encoder.call(entry)
    acyc = encoder.state().acyc
    main = enc.nodes.index(entry[1])
    ret, call = next(iter(sym._lookups()[0].items()))  # a return address in the binary and its call site

    def decode(inner: int, flags: int) -> Any:
        return sym.decode(EncodedRecord(main, flags, inner, 1, acyc, 0, 0, (), ()), None)

    first = decode(ret, 0)
    assert [(f.function, f.call_site, f.return_address) for f in first.frames] == [("main", call, ret)]
    assert first.json_frames() == [first.frames[0].to_json()] and first.complete
    again = decode(ret, 0)
    assert again.frames[0] is first.frames[0] and again.json_frames()[0] is first.json_frames()[0]
    exact = decode(ret, UE_F_INNER_EXACT)
    other = decode(ret + 1, 0)
    assert [(f.function, f.call_site, f.return_address) for f in exact.frames] == [("main", ret, None)]
    assert [(f.function, f.return_address) for f in other.frames] == [("main", ret + 1)]
    assert exact.frames[0] is not first.frames[0] and other.frames[0] is not first.frames[0]
    assert [(f.function, f.call_site, f.return_address) for f in first.frames] == [("main", call, ret)]
    assert first.json_frames() == [first.frames[0].to_json()]


def test_a_poll_runs_with_the_cyclic_gc_paused() -> None:
    """mode.poll() reads and decodes its records with the cyclic GC paused (a batch's records and
    samples are no garbage; collections every 700 of them only moved them to older generations),
    turns it back on after, also when the read fails, and leaves it off when it was off."""
    import gc

    seen: list[bool] = []
    mode = _hits_mode([], 0)

    def receive(_timeout: int) -> list[Any]:
        seen.append(gc.isenabled())
        return []

    mode._receive = receive  # type: ignore[method-assign]
    assert gc.isenabled()
    assert mode.poll(0) == [] and seen == [False] and gc.isenabled()

    def failing(_timeout: int) -> list[Any]:
        raise OSError("ring buffer")

    mode._receive = failing  # type: ignore[method-assign]
    with pytest.raises(OSError):
        mode.poll(0)
    assert gc.isenabled()
    mode._receive = receive  # type: ignore[method-assign]
    gc.disable()
    try:
        mode.poll(0)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, False]
