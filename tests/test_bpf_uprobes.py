"""Real uprobes on real processes: one classic uprobe (smoke), and uprobe_multi links on every
``call rel32`` of a test program, with sites found independently through objdump/readelf."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from bpf_helpers import compile_c, direct_call_sites, file_offset
from conftest import require_tool

from ccprofd.kbpf.bcc_adapter import BccModule
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.uprobe_multi import attach_uprobe_multi

SMOKE_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) int target(int x) { return x * 2 + 1; }
int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    long s = 0;
    for (int i = 0; i < n; i++) s += target(i);
    for (int i = 0; i < n / 2; i++) s += target(-i);
    printf("%ld\n", s);
    return 0;
}
"""

COUNT_BY_COOKIE = r"""
BPF_ARRAY(hits, u64, 256);
int on_site(struct pt_regs *ctx) {
    u32 k = (u32)bpf_get_attach_cookie(ctx);
    u64 *v = hits.lookup(&k);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
"""

# Loop structure => per-site call counts (hand-derived, see EXPECTED below).
MULTI_C = r"""
#include <stdio.h>
#include <unistd.h>
static int acc;
__attribute__((noinline)) void leaf(int x) { acc = acc * 31 + x; }
__attribute__((noinline)) void mid(int x) { leaf(x); leaf(x + 1); }
__attribute__((noinline)) int rec(int d) { if (d == 0) return 0; leaf(d); return rec(d - 1) + 1; }
int main(int argc, char **argv) {
    if (argc > 1) { char c; if (read(0, &c, 1) != 1) return 3; }
    for (int i = 0; i < 10; i++) mid(i);
    for (int i = 0; i < 3; i++) leaf(i * 7);
    int r = rec(5);
    printf("acc=%d r=%d\n", acc, r);
    return 0;
}
"""

# (function, callee) -> hits for one run, in address order within each function (-O0 keeps source
# order): main reads stdin only when given an argument (not here); its loops run mid 10x and leaf
# 3x; mid calls leaf twice per call; rec(5) recurses 5 times, calling leaf once per non-zero depth.
EXPECTED = {
    "main": [("read@plt", 0), ("mid", 10), ("leaf", 3), ("rec", 1), ("printf@plt", 1)],
    "mid": [("leaf", 10), ("leaf", 10)],
    "rec": [("leaf", 5), ("rec", 5)],
}


def test_single_uprobe_counts_calls(bpf: None, tmp_path: Path) -> None:
    exe = compile_c(tmp_path, "smoke", SMOKE_C, "-O1")
    with BccModule(
        "BPF_ARRAY(hits, u64, 1);\n"
        "int on_call(struct pt_regs *ctx) { u32 k = 0; u64 *v = hits.lookup(&k);"
        " if (v) __sync_fetch_and_add(v, 1); return 0; }"
    ) as mod:
        mod.attach_uprobe(str(exe), "on_call", sym="target")
        out = subprocess.run([str(exe), "37"], capture_output=True, text=True, check=True)
        assert mod.map("hits").get(0) == 37 + 37 // 2
    expected_sum = sum(2 * i + 1 for i in range(37)) + sum(-2 * i + 1 for i in range(37 // 2))
    assert out.stdout.strip() == str(expected_sum)


def _bpftool_links() -> list[dict[str, object]]:
    out = subprocess.run(
        [require_tool("bpftool"), "link", "show", "-j"], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out or "[]")


@pytest.mark.parametrize("pie", [True, False], ids=["pie", "nopie"])
def test_uprobe_multi_every_call_site(bpf: None, tmp_path: Path, pie: bool) -> None:
    exe = compile_c(
        tmp_path, "multi", MULTI_C, "-O0", "-fpie" if pie else "-fno-pie", "-pie" if pie else "-no-pie"
    )
    sites = direct_call_sites(exe)
    offsets = [file_offset(exe, s.vaddr) for s in sites]
    if not pie:
        assert all(o != s.vaddr for o, s in zip(offsets, sites, strict=True))  # translation exercised
    reference = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout

    with BccModule(COUNT_BY_COOKIE) as mod:
        prog = mod.load_func("on_site", "kprobe", attach_type=48)
        t0 = time.perf_counter()
        link = attach_uprobe_multi(prog, exe, offsets, list(range(len(sites))))
        attach_s = time.perf_counter() - t0
        link_id = link.link_id
        assert link_id in {int(str(x["id"])) for x in _bpftool_links()}
        traced = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
        hits = mod.map("hits")
        counts = [int(hits.get(i)) for i in range(len(sites))]
        t0 = time.perf_counter()
        link.close()
        detach_s = time.perf_counter() - t0
        # Probes are gone: the kernel no longer lists the link, and a new run adds no hits.
        assert link_id not in {int(str(x["id"])) for x in _bpftool_links()}
        subprocess.run([str(exe)], capture_output=True, text=True, check=True)
        assert [int(hits.get(i)) for i in range(len(sites))] == counts
    print(f"{len(sites)} sites: attach {attach_s * 1e3:.2f} ms, detach {detach_s * 1e3:.2f} ms")

    assert traced == reference  # a probe inside an instruction would have corrupted the result
    got: dict[str, list[tuple[str, int]]] = {}
    for site, n in zip(sites, counts, strict=True):
        got.setdefault(site.function, []).append((site.target, n))
    for func, expected in EXPECTED.items():
        assert got.get(func) == expected, func
    # C runtime start-up/tear-down code runs each of its call sites at most once per process.
    for func, lst in got.items():
        if func not in EXPECTED:
            assert all(n <= 1 for _, n in lst), (func, lst)


def test_uprobe_multi_pid_filter_excludes_other_processes(bpf: None, tmp_path: Path) -> None:
    exe = compile_c(tmp_path, "multi", MULTI_C, "-O0")
    sites = direct_call_sites(exe)
    offsets = [file_offset(exe, s.vaddr) for s in sites]
    mid_sites = [i for i, s in enumerate(sites) if s.function == "main" and s.target == "mid"]
    procs = [
        subprocess.Popen([str(exe), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)
    ]
    try:
        with BccModule(COUNT_BY_COOKIE) as mod:
            prog = mod.load_func("on_site", "kprobe", attach_type=48)
            with attach_uprobe_multi(prog, exe, offsets, list(range(len(sites))), pid=procs[0].pid):
                outs = [p.communicate(b"g")[0] for p in procs]
                hits = mod.map("hits")
                counts = Counter({i: int(hits.get(i)) for i in range(len(sites))})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert outs[0] == outs[1]
    assert all(p.returncode == 0 for p in procs)
    # Only the filtered process counted: one run's worth, not two.
    assert [counts[i] for i in mid_sites] == [10]
    assert sum(counts.values()) >= 10 + 3 + 1 + 1 + 20 + 10


def test_uprobe_multi_cookies_are_64_bit(bpf: None, tmp_path: Path) -> None:
    exe = compile_c(tmp_path, "smoke", SMOKE_C, "-O1")
    site = next(s for s in direct_call_sites(exe) if s.function == "main" and s.target == "target")
    cookie = 0xDEADBEEF_00000007
    src = (
        "BPF_HASH(seen, u64, u64, 4);\n"
        "int on_site(struct pt_regs *ctx) { u64 k = bpf_get_attach_cookie(ctx); u64 z = 0;"
        " u64 *v = seen.lookup_or_try_init(&k, &z); if (v) __sync_fetch_and_add(v, 1); return 0; }"
    )
    with BccModule(src) as mod:
        prog = mod.load_func("on_site", "kprobe", attach_type=48)
        with attach_uprobe_multi(prog, exe, [file_offset(exe, site.vaddr)], [cookie]):
            subprocess.run([str(exe), "5"], check=True, capture_output=True)
        assert mod.map("seen").items() == [(cookie, 5)]


def test_uprobe_multi_errors_are_one_line(bpf: None, tmp_path: Path) -> None:
    with BccModule(COUNT_BY_COOKIE) as mod:
        prog = mod.load_func("on_site", "kprobe", attach_type=48)
        with pytest.raises(BPFError, match="not a regular file"):
            attach_uprobe_multi(prog, tmp_path / "missing", [0])
        f = tmp_path / "small"
        f.write_bytes(b"\x90" * 16)
        with pytest.raises(BPFError) as ei:
            attach_uprobe_multi(prog, f, [1 << 20])  # beyond the end of the file
        assert "\n" not in str(ei.value) and "uprobe_multi link on" in str(ei.value)
        with pytest.raises(BPFError, match="cookies"):
            attach_uprobe_multi(prog, f, [0, 1], [1])
    # A program loaded without the uprobe_multi attach type is refused by the kernel.
    with BccModule(COUNT_BY_COOKIE) as mod:
        plain = mod.load_func("on_site", "kprobe")
        with pytest.raises(BPFError, match="uprobe_multi link on"):
            attach_uprobe_multi(plain, f, [0])
