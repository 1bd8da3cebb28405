"""Loading the unwinder's BPF programs: each program linked with its ``bpf_loop`` callbacks (bcc
leaves their addresses unrelocated) and handed to the verifier on a thread, so that start-up work
overlaps the verification, which cannot be cached."""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from typing import Any

from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.rawmodule import RawModule

BPF_PROG_TYPE_TRACEPOINT = 5
BPF_PROG_TYPE_PERF_EVENT = 7
BPF_PROG_TYPE_RAW_TRACEPOINT = 17
_BPF_CALL = 0x85
_LD_IMM64 = 0x18
_MOV64_IMM = 0xB7
#: the syscall and CPU-sampling unwinders: program type and callback kind
PROGRAMS = {"uw_sys_enter": (BPF_PROG_TYPE_RAW_TRACEPOINT, "sys"),
            "uw_sys_tp": (BPF_PROG_TYPE_TRACEPOINT, "sys"),  # per-syscall events (kbpf/syscall_entry.py)
            "uw_cpu_sample": (BPF_PROG_TYPE_PERF_EVENT, "cpu")}


def link_loop_callbacks(main: bytes, callbacks: dict[int, bytes]) -> tuple[bytes, list[int]]:
    """``main`` followed by the callbacks, with each ``bpf_loop`` call's callback argument (the
    ``ld_imm64`` into r2 before the call, left unrelocated by bcc) pointed at its callback, chosen
    by the call's loop count (the ``mov r1, imm`` before it): ``callbacks`` maps loop counts to
    callback code.  Returns the instructions and each callback's first instruction index."""
    insns = bytearray(main)
    starts: dict[int, int] = {}
    for nr_loops, code in callbacks.items():
        starts[nr_loops] = len(insns) // 8
        insns += code
    n_main = len(main) // 8
    patched = 0
    for j in range(n_main):
        code, _regs, _off, imm = struct.unpack_from("<BBhi", insns, j * 8)
        if code != _BPF_CALL or imm != rawbpf.BPF_FUNC_LOOP:
            continue
        ld = loops = None
        for k in range(j - 1, max(-1, j - 24), -1):
            kcode, kregs, _, kimm = struct.unpack_from("<BBhi", insns, k * 8)
            if kcode in (_BPF_CALL, 0x95):  # another call or an exit: out of this call's set-up
                break
            if ld is None and kcode == _LD_IMM64 and kregs & 0x0F == 2:
                ld = k
            elif loops is None and kcode == _MOV64_IMM and kregs & 0x0F == 1:
                loops = kimm
        if ld is None or loops is None or loops not in starts:
            raise BPFError(f"cannot link the callback of the bpf_loop call at instruction {j}")
        if struct.unpack_from("<B", insns, ld * 8 + 1)[0] >> 4 not in (0, 4):
            raise BPFError("bpf_loop callback argument is not a function address")
        struct.pack_into("<BBhi", insns, ld * 8, _LD_IMM64, (4 << 4) | 2, 0, starts[loops] - ld - 1)
        patched += 1
    if patched == 0:
        raise BPFError("program makes no bpf_loop call")
    return bytes(insns), list(starts.values())


class ProgramLoader:
    """The unwinder programs of one loaded module: loads started early run the verifier on a thread
    (ctypes releases the GIL for the syscall); a later :meth:`load` of the same program waits for
    it.  ``loops``: each bpf_loop's iteration count by loop name, which picks its callback."""

    def __init__(self, module: RawModule, loops: dict[str, int]) -> None:
        self.module = module
        self.loops = loops
        self.fds: list[int] = []
        self.loading: dict[str, tuple[threading.Thread, list[Any]]] = {}

    def callbacks(self, kind: str) -> dict[int, str]:
        """bpf_loop callbacks of the sys/cpu program, by loop count (the CPU sampler does not
        aggregate: no arena loop)."""
        names = {"unwind": f"uw_step_{kind}", "arena": f"uw_arena_{kind}", "enc": f"ue_enc_{kind}",
                 "hash": f"ue_hash_{kind}", "enf": f"uw_enf_{kind}"}
        sys_only = ("arena", "enf")  # the CPU sampler neither aggregates nor enforces
        return {count: names[loop] for loop, count in self.loops.items()
                if kind == "sys" or loop not in sys_only}

    def start(self, prog: str) -> None:
        """Hand ``prog`` to the kernel verifier in a thread (~1-2 s for the unwinder)."""
        prog_type, kind = PROGRAMS[prog]
        callbacks = self.callbacks(kind)
        main = self.module.function_bytes(prog)
        insns, starts = link_loop_callbacks(main, {n: self.module.function_bytes(cb)
                                                   for n, cb in callbacks.items()})
        names = [prog, *callbacks.values()]
        func_info = [(0, 3)] + [(start, 4 + i) for i, start in enumerate(starts)]
        result: list[Any] = []

        def load() -> None:
            try:
                btf = rawbpf.btf_load(rawbpf.int_btf(names))
                try:
                    fd = rawbpf.prog_load(prog_type, insns, name=prog[:15], btf_fd=btf, func_info=func_info)
                finally:
                    os.close(btf)
                result.append(("ok", fd))
            except BaseException as exc:  # re-raised in the thread that waits for the load
                result.append(("error", exc))

        thread = threading.Thread(target=load, name=f"ccprofd-verify-{prog}", daemon=True)
        self.loading[prog] = (thread, result)
        thread.start()

    def load(self, prog: str) -> int:
        """The fd of ``prog`` loaded (the load :meth:`start` began, when there is one, is waited for);
        it is closed by :meth:`close`."""
        if prog not in self.loading:
            self.start(prog)
        thread, result = self.loading.pop(prog)
        thread.join()
        kind, value = result[0]
        if kind == "error":
            raise value
        self.fds.append(value)
        return int(value)

    def join(self) -> None:
        """Wait for loads started but never used; their fds are closed with the others."""
        for thread, result in self.loading.values():
            thread.join()
            if result and result[0][0] == "ok":
                self.fds.append(result[0][1])
        self.loading.clear()

    def verified_insns(self) -> dict[str, int]:
        """Instructions the verifier processed for each unwinder (loaded, not attached): how far
        their loads are from the kernel's limit."""
        return {prog: rawbpf.prog_verified_insns(self.load(prog)) for prog in PROGRAMS}

    def close(self) -> None:
        self.join()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
