"""The bcc adapter and the raw loader (compile once in a subprocess, load with raw bpf(2)): compile
errors, maps, ring buffers, perf-event sampling — on the real kernel, each test on both paths."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import compile_c

from ccprofd.kbpf.bcc_adapter import BccModule
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.rawmodule import load_module

REPO = Path(__file__).resolve().parent.parent

BUSY_C = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) {
    char c;
    write(1, "ready\n", 6);
    if (read(0, &c, 1) != 1) return 3;
    volatile unsigned long x = 0;
    for (unsigned long i = 0; i < 50000000UL; i++) x += i;
    printf("%lu\n", x);
    return 0;
}
"""


def test_only_bcc_adapter_imports_bcc() -> None:
    offenders = []
    for path in (REPO / "ccprofd").rglob("*.py"):
        if path.name == "bcc_adapter.py":
            continue
        if re.search(r"^\s*(import bcc|from bcc\b)", path.read_text(), re.MULTILINE):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_only_the_compile_worker_reaches_bcc() -> None:
    """The tracers load through the raw loader; bcc (libbcc, LLVM) runs only in the compile worker's
    process (and in the start-up feature probe that checks bcc is installed)."""
    users = []
    for path in (REPO / "ccprofd").rglob("*.py"):
        pattern = (r"^\s*(from ccprofd\.kbpf(\.bcc_adapter| import bcc_adapter)"
                   r"|import ccprofd\.kbpf\.bcc_adapter)")
        if re.search(pattern, path.read_text(), re.MULTILINE):
            users.append(str(path.relative_to(REPO)))
    assert sorted(users) == ["ccprofd/kbpf/compile_worker.py", "ccprofd/kbpf/features.py"]


def test_importing_the_bpf_layer_does_not_import_bcc() -> None:
    code = (
        "import sys\n"
        "import ccprofd.kbpf.bcc_adapter, ccprofd.kbpf.features, ccprofd.kbpf.uprobe_multi\n"
        "import ccprofd.tracing.syscall_sampler, ccprofd.kbpf.rawmodule, ccprofd.tracing.unwind.sampler\n"
        "import ccprofd.tracing.instrumented.loader\n"
        "import ccprofd.tracing.instrumented.callcount, ccprofd.tracing.instrumented.fpverify\n"
        "import ccprofd.daemon.service\n"
        "assert 'bcc' not in sys.modules, 'bcc imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.fixture(params=["bcc", "raw"])
def make(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """A module constructor: bcc in this process, or compile-once + raw load (same API)."""
    if request.param == "bcc":
        return BccModule
    cache = tmp_path_factory.mktemp("bpfobj")
    return lambda text, cflags=(): load_module(text, cflags, cache_dir=cache)


def test_compile_error_is_one_line(bpf: None, make: Any) -> None:
    with pytest.raises(BPFError) as ei:
        make("int f(void *ctx) { return undefined_symbol; }")
    text = str(ei.value)
    assert "\n" not in text
    assert "undefined_symbol" in text and "error" in text


def test_verifier_rejection_is_one_line(bpf: None, make: Any) -> None:
    src = "BPF_HASH(a, u32, u64, 1);\nint f(void *ctx) { u32 k = 0; u64 *v = a.lookup(&k); return *v; }"
    with make(src) as mod, pytest.raises(BPFError) as ei:
        mod.load_func("f", "kprobe")
    text = str(ei.value)
    assert "\n" not in text and text.startswith("loading BPF program f failed")
    assert "invalid mem access" in text  # the verifier's reason, from its log


def test_unknown_program_and_map(bpf: None, make: Any) -> None:
    with make("BPF_ARRAY(a, u64, 1);\nint f(void *ctx) { return 0; }") as mod:
        with pytest.raises(BPFError, match="nope"):
            mod.load_func("nope", "kprobe")
        with pytest.raises(BPFError, match="no BPF map nope"):
            mod.map("nope")


def test_maps(bpf: None, make: Any) -> None:
    src = """
    struct pair { u64 a; u32 b; };
    BPF_ARRAY(arr, u64, 8);
    BPF_HASH(h, u32, struct pair, 4);
    BPF_PERCPU_ARRAY(pc, u64, 2);
    int f(void *ctx) { return 0; }
    """
    with make(src, cflags=["-DUNUSED=1"]) as mod:
        arr = mod.map("arr")
        assert arr.max_entries == 8 and arr.fd > 0
        arr.set(3, 42)
        arr.update_many([(0, 7), (7, 9)])
        assert [arr.get(i) for i in range(8)] == [7, 0, 0, 42, 0, 0, 0, 9]
        arr.clear()
        assert [arr.get(i) for i in range(8)] == [0] * 8

        h = mod.map("h")
        v = h.leaf_type()
        v.a, v.b = 1 << 40, 5
        h.set(10, v)
        got = h.get(10)
        assert (got.a, got.b) == (1 << 40, 5)
        assert h.get(11) is None and h.get(11, "x") == "x"
        for k in (1, 2, 3):
            h.set(k, v)
        with pytest.raises(BPFError, match="map h: update failed"):
            h.set(4, v)  # bounded: the fifth key does not fit
        assert len(h) == 4
        assert h.delete(10) and not h.delete(10)
        assert sorted(k for k, _ in h.items()) == [1, 2, 3]
        h.clear()
        assert h.items() == []

        pc = mod.map("pc")
        assert pc.percpu and pc.get(0) == 0
        assert len(pc.get_percpu(0)) >= os.cpu_count()  # type: ignore[operator]


def test_ring_buffer_and_raw_tracepoint(bpf: None, make: Any) -> None:
    src = """
    BPF_RINGBUF_OUTPUT(rb, 1);
    BPF_ARRAY(me, u32, 1);
    int on_enter(struct bpf_raw_tracepoint_args *ctx) {
        u32 k = 0;
        u32 *pid = me.lookup(&k);
        if (!pid || *pid != (bpf_get_current_pid_tgid() >> 32) || ctx->args[1] != 110)
            return 0;
        u64 nr = ctx->args[1];
        rb.ringbuf_output(&nr, sizeof(nr), 0);
        return 0;
    }
    """
    with make(src) as mod:
        mod.map("me").set(0, os.getpid())
        got: list[bytes] = []
        mod.open_ring_buffer("rb", got.append)
        mod.attach_raw_tracepoint("sys_enter", "on_enter")
        for _ in range(5):
            os.getppid()
        assert mod.ring_buffer_consume(budget=2) == 2  # the rest waits in the ring
        assert got == [(110).to_bytes(8, "little")] * 2
        assert mod.ring_buffer_consume() == 3
        assert got == [(110).to_bytes(8, "little")] * 5
        with pytest.raises(BPFError, match="not a ring buffer"):
            mod.open_ring_buffer("me", got.append)


def test_ring_buffer_callback_errors_propagate(bpf: None, make: Any) -> None:
    src = """
    BPF_RINGBUF_OUTPUT(rb, 1);
    int on_fork(struct tracepoint__sched__sched_process_fork *args) {
        u32 c = args->child_pid;
        rb.ringbuf_output(&c, sizeof(c), 0);
        return 0;
    }
    """
    with make(src) as mod:

        def boom(_: bytes) -> None:
            raise RuntimeError("callback failed")

        mod.open_ring_buffer("rb", boom)
        mod.attach_tracepoint("sched:sched_process_fork", "on_fork")
        subprocess.run(["true"], check=True)
        with pytest.raises(RuntimeError, match="callback failed"):
            mod.ring_buffer_poll(1000)


def test_perf_event_cpu_clock_sampling_of_one_process(bpf: None, make: Any, tmp_path: Path) -> None:
    exe = compile_c(tmp_path, "busy", BUSY_C, "-O0")
    src = """
    #include <uapi/linux/bpf_perf_event.h>
    BPF_HASH(samples, u32, u64, 64);
    BPF_ARRAY(in_main, u64, 1);
    int on_sample(struct bpf_perf_event_data *ctx) {
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        u64 zero = 0;
        u64 *v = samples.lookup_or_try_init(&tgid, &zero);
        if (v)
            __sync_fetch_and_add(v, 1);
        return 0;
    }
    """
    p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        with make(src) as mod:
            mod.attach_perf_event("on_sample", sample_freq=999, pid=p.pid)
            out, _ = p.communicate(b"g")
            samples = dict(mod.map("samples").items())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and out.strip() == str(sum(range(50000000))).encode()
    assert samples.get(p.pid, 0) > 0
    assert set(samples) == {p.pid}  # a per-pid event samples nobody else
    with make("int f(void *ctx) { return 0; }") as mod, pytest.raises(BPFError, match="exactly one"):
        mod.attach_perf_event("f")


def _perf_attachments_of_this_process() -> list[str]:
    """This process's tracepoint/perf attachments, as ``bpftool perf list`` (the kernel) reports them."""
    out = subprocess.run(["bpftool", "perf", "list"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if re.search(rf"\bpid {os.getpid()}\b", line)]


def test_two_programs_on_one_tracepoint_are_both_detached(bpf: None, make: Any) -> None:
    """bcc keys its tracepoint fds by name: the first of two programs of one module on the same
    tracepoint used to stay attached after cleanup (each instrumented-mode session leaked three,
    until the kernel's 64-per-tracepoint limit refused the next attach)."""
    src = """
    int first(void *ctx) { return 0; }
    int second(void *ctx) { return 0; }
    """
    before = _perf_attachments_of_this_process()
    mod = make(src)
    mod.attach_tracepoint("sched:sched_process_fork", "first")
    mod.attach_tracepoint("sched:sched_process_fork", "second")
    attached = _perf_attachments_of_this_process()
    assert len(attached) - len(before) == 2, attached
    mod.cleanup()
    assert _perf_attachments_of_this_process() == before
