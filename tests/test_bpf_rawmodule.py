"""The raw loader: compiled-object serialisation and caching (units), and on the real kernel its maps
(checked with bpftool), ring-buffer reader (wrap-around, discarded records), attachments firing and
cleanup leaving nothing of ours behind (bpftool, by the ids of our own fds)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import compile_c
from conftest import require_tool

from ccprofd.kbpf import objcache, rawbpf
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.objcache import CompiledObject, FunctionSpec, MapSpec
from ccprofd.kbpf.rawmodule import load_module

# ----------------------------------------------------------------------------------------- units


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _ld_map(dst: int, fd: int) -> bytes:
    return _insn(0x18, dst=dst, src=1, imm=fd) + _insn(0)


def test_relocations_split_and_apply_round_trip() -> None:
    # r1 = map fd 7; r2 = 5; r1 = map fd 9; a ld_imm64 of a plain constant whose second half looks
    # like a map load must not be taken for one; exit
    code = (_ld_map(1, 7) + _insn(0xB7, dst=2, imm=5) + _ld_map(1, 9)
            + _insn(0x18, dst=3, imm=1) + _insn(0, src=1, imm=7) + _insn(0x95))
    insns, relocs = objcache.split_relocations(code, {7: "counts", 9: "events"})
    assert relocs == ((0, "counts"), (3, "events"))
    assert struct.unpack_from("<i", insns, 0 * 8 + 4)[0] == 0
    assert struct.unpack_from("<i", insns, 3 * 8 + 4)[0] == 0
    assert insns[5 * 8:] == code[5 * 8:]  # the constant load is untouched
    fn = FunctionSpec("f", insns, relocs)
    out = objcache.apply_relocations(fn, {"counts": 40, "events": 41})
    assert out == (_ld_map(1, 40) + _insn(0xB7, dst=2, imm=5) + _ld_map(1, 41) + code[5 * 8:])
    with pytest.raises(BPFError, match="map fd 8"):
        objcache.split_relocations(_ld_map(1, 8), {7: "counts"})


def _sample_object() -> CompiledObject:
    desc = ["pair", [["a", "unsigned long long"], ["b", "unsigned int", [3]]], "struct"]
    return CompiledObject("GPL", (MapSpec("h", 1, 4, 24, 16, 1, "unsigned int", desc),
                                  MapSpec("rb", 27, 0, 0, 4096, 0, None, None)),
                          (FunctionSpec("f", _ld_map(1, 0) + _insn(0x95), ((0, "h"),)),))


def test_compiled_object_serialises_losslessly() -> None:
    obj = _sample_object()
    assert CompiledObject.from_json(obj.to_json()) == obj
    for bad in (b"", b"{", b'{"format": 99}', obj.to_json().replace(b'"h"', b'"x"', 1),
                obj.to_json()[:-5]):
        with pytest.raises(ValueError):
            CompiledObject.from_json(bad)


def test_cache_key_changes_with_everything_the_object_depends_on() -> None:
    base = objcache.cache_key("int f;", ("-DA=1",), "env")
    assert objcache.cache_key("int f;", ("-DA=1",), "env") == base
    assert objcache.cache_key("int g;", ("-DA=1",), "env") != base
    assert objcache.cache_key("int f;", ("-DA=2",), "env") != base
    assert objcache.cache_key("int f;", ("-DA", "=1"), "env") != base
    assert objcache.cache_key("int f;", ("-DA=1",), "other kernel") != base
    env = objcache.environment_identity()
    assert os.uname().release in env and "libbcc" in env


def test_compile_cached_compiles_once_and_recompiles_on_change_or_corruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, tuple[str, ...]]] = []

    def fake_compile(text: str, cflags: Any) -> CompiledObject:  # the subprocess, faked: no bcc here
        calls.append((text, tuple(cflags)))
        return _sample_object()

    monkeypatch.setattr(objcache, "compile_in_subprocess", fake_compile)
    assert objcache.compile_cached("src", ["-DX"], cache_dir=tmp_path) == _sample_object()
    assert objcache.compile_cached("src", ["-DX"], cache_dir=tmp_path) == _sample_object()
    assert calls == [("src", ("-DX",))]
    objcache.compile_cached("src2", ["-DX"], cache_dir=tmp_path)
    objcache.compile_cached("src", ["-DY"], cache_dir=tmp_path)
    assert len(calls) == 3
    files = sorted(tmp_path.iterdir())
    assert len(files) == 3 and all(f.suffix == ".json" for f in files)
    path = objcache.cache_path(tmp_path, objcache.cache_key("src", ("-DX",)))
    for corrupt in (b"\x00garbage", path.read_bytes()[:20]):
        path.write_bytes(corrupt)
        assert objcache.compile_cached("src", ["-DX"], cache_dir=tmp_path) == _sample_object()
    assert len(calls) == 5
    assert CompiledObject.from_json(path.read_bytes()) == _sample_object()  # rewritten whole
    monkeypatch.setenv(objcache.ENV_CACHE_DIR, str(tmp_path / "env"))
    objcache.compile_cached("src", ["-DX"])
    assert (tmp_path / "env").is_dir() and len(calls) == 6


def test_compile_cached_takes_an_object_built_at_set_up(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An object scripts/prebuild_bpf.sh left in the prebuilt directory is used (and copied into
    the cache) instead of compiling; a corrupt one, another text, or no prebuilt directory
    ($CCPROFD_BPF_PREBUILT_DIR empty) compiles as before."""
    calls: list[str] = []

    def fake_compile(text: str, cflags: Any) -> CompiledObject:
        calls.append(text)
        return _sample_object()

    monkeypatch.setattr(objcache, "compile_in_subprocess", fake_compile)
    pre = tmp_path / "prebuilt"
    pre.mkdir()
    objcache.store(objcache.cache_path(pre, objcache.cache_key("src", ())), _sample_object())
    monkeypatch.setenv(objcache.ENV_PREBUILT_DIR, str(pre))
    assert objcache.compile_cached("src", cache_dir=tmp_path / "c1") == _sample_object()
    assert calls == []
    assert objcache.cache_path(tmp_path / "c1", objcache.cache_key("src", ())).is_file()
    objcache.compile_cached("other", cache_dir=tmp_path / "c1")
    assert calls == ["other"]
    objcache.cache_path(pre, objcache.cache_key("src", ())).write_bytes(b"\x00garbage")
    objcache.compile_cached("src", cache_dir=tmp_path / "c2")
    assert calls == ["other", "src"]
    objcache.store(objcache.cache_path(pre, objcache.cache_key("src", ())), _sample_object())
    monkeypatch.setenv(objcache.ENV_PREBUILT_DIR, "")
    objcache.compile_cached("src", cache_dir=tmp_path / "c3")
    assert calls == ["other", "src", "src"]


def test_the_cache_keeps_the_most_recently_used_objects(tmp_path: Path) -> None:
    obj = _sample_object()
    paths = [tmp_path / f"{i:02d}.v{objcache.FORMAT_VERSION}.json" for i in range(5)]
    for i, p in enumerate(paths):
        objcache.store(p, obj, keep=3)
        os.utime(p, ns=(i * 10**9, i * 10**9))  # stored in order, a second apart
    assert sorted(tmp_path.iterdir()) == paths[2:]
    assert objcache.load_cached(paths[2]) == obj  # a hit makes it the most recent
    objcache.store(tmp_path / f"new.v{objcache.FORMAT_VERSION}.json", obj, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([paths[2].name, paths[4].name,
                                                                 f"new.v{objcache.FORMAT_VERSION}.json"])


def test_compile_error_in_the_worker_is_one_line(bpf: None, tmp_path: Path) -> None:
    with pytest.raises(BPFError) as ei:
        load_module("int f(void *ctx) { return undefined_symbol; }", cache_dir=tmp_path)
    text = str(ei.value)
    assert "\n" not in text and text.startswith("BPF compile/load failed:")
    assert "error:" in text and "undefined_symbol" in text
    assert list(tmp_path.iterdir()) == []  # nothing cached for a failed compile


# ------------------------------------------------------------------------------- real BPF: maps


def _bpftool(*args: str) -> Any:
    out = subprocess.run([require_tool("bpftool"), "-j", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout or "null")


def _hexbytes(values: list[str]) -> bytes:
    return bytes(int(v, 16) for v in values)


MAPS_C = """
struct pair { u64 a; u32 b; };
BPF_HASH(h, u32, struct pair, 2048);
BPF_ARRAY(arr, u64, 8);
BPF_PERCPU_ARRAY(pc, u64, 1);
BPF_QUEUE(q, u32, 8);
BPF_ARRAY(me, u32, 1);
int on_enter(struct bpf_raw_tracepoint_args *ctx) {
    u32 k = 0;
    u32 *pid = me.lookup(&k);
    if (!pid || *pid != (bpf_get_current_pid_tgid() >> 32) || ctx->args[1] != 110)
        return 0;
    pc.increment(k);
    u32 popped;
    if (q.pop(&popped) == 0) {
        popped += 1000;
        q.push(&popped, 0);
    }
    return 0;
}
"""


def test_map_operations_agree_with_bpftool(bpf: None, tmp_path: Path) -> None:
    with load_module(MAPS_C, cache_dir=tmp_path) as mod:
        h = mod.map("h")
        assert (h.map_type, h.max_entries, h.percpu) == (1, 2048, False)
        assert [f[0] for f in h.leaf_type._fields_][:2] == ["a", "b"]  # C field names, without bcc
        items = []
        for k in range(1500):  # one batch update
            v = h.leaf_type()
            v.a, v.b = k * 1_000_003, k ^ 0x5A5A
            items.append((k, v))
        h.update_many(items)
        dump = _bpftool("map", "dump", "id", str(h.id))
        theirs = {struct.unpack("<I", _hexbytes(e["key"]))[0]:
                  struct.unpack_from("<QI", _hexbytes(e["value"])) for e in dump}
        assert theirs == {k: (k * 1_000_003, k ^ 0x5A5A) for k in range(1500)}
        ours = {k: (v.a, v.b) for k, v in h.items_batch()}
        assert ours == theirs and len(h) == 1500
        # the map-entries metric: counted in batches of 1024, as many as bpftool lists
        assert h.entries() == len(dump) == 1500 and mod.map_entries() == {"h": 1500}
        assert {k: (v.a, v.b) for k, v in h.items()} == theirs
        # written by bpftool, read by us
        value = [f"{b:02x}" for b in struct.pack("<QI", 77, 88) + bytes(4)]
        subprocess.run([require_tool("bpftool"), "map", "update", "id", str(h.id),
                        "key", "hex", "0a", "00", "00", "00", "value", "hex", *value],
                       check=True, capture_output=True)
        got = h.get(10)
        assert (got.a, got.b) == (77, 88)
        assert h.delete(10) and not h.delete(10) and h.get(10) is None
        assert len(_bpftool("map", "dump", "id", str(h.id))) == 1499
        h.clear()
        assert _bpftool("map", "dump", "id", str(h.id)) == [] and len(h) == 0 and h.entries() == 0

        arr = mod.map("arr")
        arr.update_many([(1, 11), (6, 66)])
        arr.set(3, 33)
        dump = _bpftool("map", "dump", "id", str(arr.id))
        assert [struct.unpack("<Q", _hexbytes(e["value"]))[0] for e in dump] == [0, 11, 0, 33, 0, 0, 66, 0]
        assert arr.delete(3) and arr.get(3) == 0
        arr.clear()
        assert all(_hexbytes(e["value"]) == bytes(8) for e in _bpftool("map", "dump", "id", str(arr.id)))


def test_percpu_sums_and_queue_push_pop_from_both_sides(bpf: None, tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    with load_module(MAPS_C, cache_dir=tmp_path) as mod:
        mod.map("me").set(0, os.getpid())
        q = mod.map("q")
        for v in (5, 6, 7):
            q.push(v)
        assert _hexbytes(_bpftool("map", "peek", "id", str(q.id))["value"]) == struct.pack("<I", 5)
        mod.attach_raw_tracepoint("sys_enter", "on_enter")
        per_cpu = {}
        saved = os.sched_getaffinity(0)
        try:
            for i, cpu in enumerate(cpus[:2]):
                os.sched_setaffinity(0, {cpu})
                for _ in range(10 * (i + 1)):
                    os.getppid()
                per_cpu[cpu] = 10 * (i + 1)
        finally:
            os.sched_setaffinity(0, saved)
        mod.detach_raw_tracepoint("sys_enter")
        pc = mod.map("pc")
        vals = pc.get_percpu(0)
        assert [vals[c] for c in per_cpu] == list(per_cpu.values())
        assert pc.get(0) == pc.sum_percpu(0) == sum(per_cpu.values())
        theirs = _bpftool("map", "lookup", "id", str(pc.id), "key", "0", "0", "0", "0")
        assert {e["cpu"]: struct.unpack("<Q", _hexbytes(e["value"]))[0] for e in theirs["values"]
                if e["cpu"] in per_cpu} == per_cpu
        # each getppid popped the head and pushed it back +1000: the queue rotated sum(...) times
        n = sum(per_cpu.values())
        expected = [5, 6, 7]
        for _ in range(n):
            expected = [*expected[1:], expected[0] + 1000]
        assert [q.pop(), q.pop(), q.pop(), q.pop()] == [*expected, None]


# ------------------------------------------------------------------------------ real BPF: rings

RING_C = """
#define NREC 3000
BPF_RINGBUF_OUTPUT(rb, 1);            /* one page: 3,000 records wrap around it many times */
struct scratch_buf { u8 b[256]; };
BPF_PERCPU_ARRAY(scratch, struct scratch_buf, 1);
BPF_ARRAY(state, u32, 2);             /* [0] our pid, [1] next sequence number */
int on_enter(struct bpf_raw_tracepoint_args *ctx) {
    u32 k0 = 0, k1 = 1;
    u32 *pid = state.lookup(&k0);
    if (!pid || *pid != (bpf_get_current_pid_tgid() >> 32) || ctx->args[1] != 110)
        return 0;
    u32 *seqp = state.lookup(&k1);
    if (!seqp)
        return 0;
    u32 seq = *seqp;
    *seqp = seq + 1;
    if (seq % 7 == 3) {                /* reserved, written, then discarded */
        u32 *r = rb.ringbuf_reserve(sizeof(u32) * 4);
        if (r) { r[0] = seq; rb.ringbuf_discard(r, 0); }
        return 0;
    }
    struct scratch_buf *sb = scratch.lookup(&k0);
    if (!sb)
        return 0;
    u8 *buf = sb->b;
    u32 len = 4 + ((seq * 37) & 127) + ((seq * 11) & 63);  /* 4..194 bytes: unaligned sizes too */
    __builtin_memcpy(buf, &seq, 4);
    for (int i = 4; i < 208; i++)
        buf[i] = (u8)(seq + i);
    rb.ringbuf_output(buf, len, 0);
    return 0;
}
"""


def _expected_record(seq: int) -> bytes:
    n = 4 + ((seq * 37) & 127) + ((seq * 11) & 63)
    return struct.pack("<I", seq) + bytes((seq + i) & 0xFF for i in range(4, n))


def test_ring_buffer_wraps_around_and_skips_discarded_records(bpf: None, tmp_path: Path) -> None:
    with load_module(RING_C, cache_dir=tmp_path) as mod:
        mod.map("state").set(0, os.getpid())
        got: list[bytes] = []
        mod.open_ring_buffer("rb", got.append)
        mod.attach_raw_tracepoint("sys_enter", "on_enter")
        total = 3000
        for i in range(total):
            os.getppid()
            if i % 8 == 7:  # 8 records of <= 208 bytes (with header) fit in the page: drain first
                mod.ring_buffer_consume()
        mod.ring_buffer_poll(0)
        mod.ring_buffer_consume()
        sent = mod.map("state").get(1)
    assert sent == total
    expected = [_expected_record(s) for s in range(total) if s % 7 != 3]
    assert len(got) == len(expected)
    assert got == expected
    assert sum(len(r) + 8 for r in got) > 50 * 4096  # wrapped the one-page data area many times


def test_records_stay_intact_while_a_producer_refills_a_full_ring(bpf: None, tmp_path: Path) -> None:
    """A record is copied out before the consumer position that frees its space is published: a
    producer on the other CPU keeping the ring full must never overwrite a record being read (a
    consumer that advanced first read records half overwritten by the next ones)."""
    with load_module(RING_C, cache_dir=tmp_path) as mod:
        got: list[bytes] = []
        mod.open_ring_buffer("rb", got.append)
        child = subprocess.Popen([sys.executable, "-c",
                                  "import os, sys\nsys.stdin.read(1)\nfor _ in range(400000): os.getppid()"],
                                 stdin=subprocess.PIPE)
        assert child.stdin is not None
        mod.map("state").set(0, child.pid)
        mod.attach_raw_tracepoint("sys_enter", "on_enter")
        child.stdin.write(b"x")
        child.stdin.close()
        while child.poll() is None:
            mod.ring_buffer_consume(budget=64)  # the ring is refilled as soon as space is freed
        mod.ring_buffer_consume()
        sent = mod.map("state").get(1)
    assert sent == 400000 and len(got) > 2000
    seqs = [struct.unpack_from("<I", r)[0] for r in got]
    bad = [s for s, r in zip(seqs, got, strict=True) if r != _expected_record(s)]
    assert not bad, f"{len(bad)} of {len(got)} records overwritten while read"
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_ring_buffer_budget_backlog_and_detach(bpf: None, tmp_path: Path) -> None:
    """A budget bounds what one consume delivers (the rest waits in the ring, counted by backlog);
    after detach() the program no longer runs but what it recorded can still be read."""
    with load_module(RING_C, cache_dir=tmp_path) as mod:
        mod.map("state").set(0, os.getpid())
        got: list[bytes] = []
        mod.open_ring_buffer("rb", got.append)
        mod.attach_raw_tracepoint("sys_enter", "on_enter")
        for _ in range(7):  # sequence 0..6: seq 3 is discarded, 6 records of <= 208 bytes fit
            os.getppid()
        assert mod.ring_buffer_backlog() == 6
        assert mod.ring_buffer_consume(budget=4) == 4
        assert mod.ring_buffer_backlog() == 2
        mod.detach()
        for _ in range(5):
            os.getppid()
        assert mod.map("state").get(1) == 7  # the program ran no more
        assert mod.ring_buffer_consume(budget=10) == 2
        assert mod.ring_buffer_backlog() == 0
    assert got == [_expected_record(s) for s in range(7) if s != 3]


def test_ring_buffer_poll_waits_for_a_record(bpf: None, tmp_path: Path) -> None:
    src = """
    BPF_RINGBUF_OUTPUT(rb, 1);
    int on_fork(struct tracepoint__sched__sched_process_fork *args) {
        u32 c = args->child_pid;
        rb.ringbuf_output(&c, sizeof(c), 0);
        return 0;
    }
    """
    with load_module(src, cache_dir=tmp_path) as mod:
        got: list[int] = []
        mod.open_ring_buffer("rb", lambda raw: got.append(struct.unpack("<I", raw)[0]))
        mod.attach_tracepoint("sched:sched_process_fork", "on_fork")
        p = subprocess.Popen(["true"])
        p.wait()
        for _ in range(50):
            if p.pid in got:
                break
            mod.ring_buffer_poll(100)
        assert p.pid in got


# ------------------------------------------------------------------------- attach and cleanup

UPROBE_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) int target(int x) { return x * 2 + 1; }
int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    long s = 0;
    for (int i = 0; i < n; i++) s += target(i);
    printf("%ld\n", s);
    return 0;
}
"""

ATTACH_C = """
#include <uapi/linux/bpf_perf_event.h>
BPF_ARRAY(hits, u64, 8);
BPF_ARRAY(me, u32, 1);
static inline void hit(u32 k) { u64 *v = hits.lookup(&k); if (v) __sync_fetch_and_add(v, 1); }
int on_fork(struct tracepoint__sched__sched_process_fork *args) {
    u32 k = 0;
    u32 *pid = me.lookup(&k);
    if (pid && *pid == args->parent_pid) hit(0);
    return 0;
}
int on_enter(struct bpf_raw_tracepoint_args *ctx) {
    u32 k = 0;
    u32 *pid = me.lookup(&k);
    if (pid && *pid == (bpf_get_current_pid_tgid() >> 32) && ctx->args[1] == 110) hit(1);
    return 0;
}
int on_sample(struct bpf_perf_event_data *ctx) { hit(2); return 0; }
int on_call(struct pt_regs *ctx) { hit(3); return 0; }
int on_return(struct pt_regs *ctx) { if (PT_REGS_RC(ctx) % 2 == 1) hit(4); return 0; }
"""


def _perf_lines(prog_ids: set[int]) -> list[str]:
    out = subprocess.run([require_tool("bpftool"), "perf", "list"], capture_output=True, text=True,
                         check=True).stdout
    return [ln for ln in out.splitlines()
            if any(f"prog_id {i} " in ln + " " for i in prog_ids) and f"pid {os.getpid()} " in ln + " "]


def test_attachments_fire_and_cleanup_leaves_nothing_of_ours(bpf: None, tmp_path: Path) -> None:
    exe = compile_c(tmp_path, "uprobed", UPROBE_C, "-O1")
    mod = load_module(ATTACH_C, cache_dir=tmp_path / "cache")
    try:
        mod.map("me").set(0, os.getpid())
        mod.attach_tracepoint("sched:sched_process_fork", "on_fork")
        mod.attach_raw_tracepoint("sys_enter", "on_enter")
        mod.attach_perf_event("on_sample", sample_freq=1000)
        mod.attach_uprobe(str(exe), "on_call", sym="target")
        mod.attach_uprobe(str(exe), "on_return", sym="target", retprobe=True)
        for _ in range(5):
            os.getppid()
        out = subprocess.run([str(exe), "41"], capture_output=True, text=True, check=True)  # one fork
        assert out.stdout.strip() == str(sum(2 * i + 1 for i in range(41)))
        hits = mod.map("hits")
        assert hits.get(0) >= 1  # our fork of exe (subprocess may fork helpers too, never fewer)
        assert hits.get(1) >= 5
        assert hits.get(3) == 41 and hits.get(4) == 41  # every call, every (odd) return value
        for _ in range(200):  # CPU-clock samples at 1 kHz on every CPU: some within a few ms of work
            if hits.get(2):
                break
            sum(range(20000))
        assert hits.get(2) > 0
        prog_ids = {rawbpf.obj_id(fd) for fd in mod.program_fds.values()}
        link_ids = {rawbpf.obj_id(fd) for fd in mod.link_fds}
        map_ids = {mod.map(n).id for n in ("hits", "me")}
        assert len(prog_ids) == 5 and len(link_ids) == 1
        shown = {p["id"] for p in _bpftool("prog", "show")}
        assert prog_ids <= shown
        assert link_ids <= {lk["id"] for lk in _bpftool("link", "show")}
        # tracepoint, 2 uprobes, and one cpu-clock event per online CPU
        assert len(_perf_lines(prog_ids)) >= 3 + 1
    finally:
        mod.cleanup()
    mod.cleanup()  # idempotent
    # the kernel frees programs after an RCU grace period and their maps later still, from a
    # workqueue once the last program holding them is gone: wait for all three, not a fixed time

    def left() -> tuple[set[int], set[int], set[int]]:
        return (
            prog_ids & {p["id"] for p in _bpftool("prog", "show")},
            link_ids & {lk["id"] for lk in _bpftool("link", "show")},
            map_ids & {m["id"] for m in _bpftool("map", "show")},
        )

    for _ in range(300):
        if left() == (set(), set(), set()):
            break
        time.sleep(0.1)
    assert left() == (set(), set(), set())
    assert _perf_lines(prog_ids) == []


def test_load_and_attach_errors_are_one_line(bpf: None, tmp_path: Path) -> None:
    src = "BPF_HASH(a, u32, u64, 1);\nint f(void *ctx) { u32 k = 0; u64 *v = a.lookup(&k); return *v; }"
    with load_module(src, cache_dir=tmp_path) as mod:
        with pytest.raises(BPFError) as ei:
            mod.load_func("f", "kprobe")
        assert "\n" not in str(ei.value) and "invalid mem access" in str(ei.value)
        with pytest.raises(BPFError, match="no tracepoint sched:nope"):
            mod.attach_tracepoint("sched:nope", "f")
        with pytest.raises(BPFError, match="no function symbol nope"):
            mod.attach_uprobe("/bin/true", "f", sym="nope")
