"""A compiled BPF module loaded and attached with raw syscalls: what the tracers and the daemon use,
so that bcc and libbcc (LLVM) never map into their processes.

:func:`load_module` compiles BPF C once (:func:`ccprofd.kbpf.objcache.compile_cached`, in a
subprocess, cached on disk) and returns a :class:`RawModule`, whose API is the bcc adapter's
``BccModule``: maps are created at construction, programs are loaded on first use (the verifier
log is requested only to explain a failure), attachments are owned by fds the module closes in
:meth:`RawModule.cleanup`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Sequence
from types import TracebackType
from typing import Literal

from ccprofd.elf.errors import BinaryError
from ccprofd.elf.symbols import symbol_offset
from ccprofd.kbpf import attach as _attach
from ccprofd.kbpf import rawbpf
from ccprofd.kbpf.abi import PERF_ATTR_DISABLED, PERF_ATTR_FREQ, PerfEventAttr
from ccprofd.kbpf.bpfmap import (
    MAP_HASH,
    MAP_LRU_HASH,
    MAP_LRU_PERCPU_HASH,
    MAP_PERCPU_HASH,
    MAP_RINGBUF,
    RawMap,
    create_map,
)
from ccprofd.kbpf.errors import BPFError
from ccprofd.kbpf.objcache import CompiledObject, apply_relocations, compile_cached
from ccprofd.kbpf.ringbuf import RingBuffer, RingBufferSet
from ccprofd.kbpf.tracefs import tracepoint_id

ProgType = Literal["kprobe", "tracepoint", "raw_tracepoint", "perf_event"]
PROG_TYPES: dict[str, int] = {"kprobe": 2, "tracepoint": 5, "perf_event": 7, "raw_tracepoint": 17}
# Set by a command that exits right after tracing (``ccprofd trace``): tracepoint attachments are
# then closed by a short-lived grandchild (:func:`ccprofd.kbpf.attach.close_in_background`), so
# the command does not wait ~0.35 s of RCU grace periods at exit.  Off for long-lived callers.
BACKGROUND_TRACEPOINT_CLOSE = False


def close_tracepoints_in_background(on: bool = True) -> None:
    """See :data:`BACKGROUND_TRACEPOINT_CLOSE`."""
    global BACKGROUND_TRACEPOINT_CLOSE
    BACKGROUND_TRACEPOINT_CLOSE = on


PERF_TYPE_SOFTWARE = _attach.PERF_TYPE_SOFTWARE
PERF_COUNT_SW_CPU_CLOCK = _attach.PERF_COUNT_SW_CPU_CLOCK


def _verifier_reason(log: str) -> str:
    """The verifier's reason: the last line before its statistics."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    stats = ("processed ", "verification time", "stack depth")
    for ln in reversed(lines):
        if not ln.startswith(stats):
            return ln
    return lines[-1] if lines else ""


class RawModule:
    """One compiled translation unit: its maps (created now), programs (loaded on demand) and
    attachments.  ``cleanup()`` (or the context manager) detaches and closes everything."""

    def __init__(self, obj: CompiledObject) -> None:
        self.obj = obj
        self._closed = False
        self._map_fds: dict[str, int] = {}
        self._maps: dict[str, RawMap] = {}
        self._progs: dict[tuple[str, int, int], int] = {}
        self._attach_fds: list[int] = []
        self._tp_fds: list[int] = []  # tracepoint perf events (also in _attach_fds)
        self._tp_by_name: dict[str, list[int]] = {}  # the same, by tracepoint
        self._raw_tps: dict[str, list[int]] = {}
        self._rings = RingBufferSet()
        try:
            for spec in obj.maps:
                self._map_fds[spec.name] = create_map(spec)
                self._maps[spec.name] = RawMap(spec, self._map_fds[spec.name])
        except BaseException:
            self.cleanup()
            raise

    # -- programs ---------------------------------------------------------------------------------
    def function_bytes(self, name: str) -> bytes:
        """Function ``name``'s instructions with map references pointing at this module's maps,
        for loaders that patch them before loading (``bpf_loop`` callbacks)."""
        return apply_relocations(self.obj.function(name), self._map_fds)

    def load_func(self, name: str, prog_type: ProgType | int, *, attach_type: int = -1) -> int:
        """Load (verify) program ``name``; return its fd.  ``attach_type=48`` prepares a kprobe-type
        program for uprobe_multi links.  Loading twice returns the same fd."""
        ptype = PROG_TYPES[prog_type] if isinstance(prog_type, str) else prog_type
        key = (name, ptype, attach_type)
        if key in self._progs:
            return self._progs[key]
        insns = self.function_bytes(name)
        try:
            fd = rawbpf.prog_load(ptype, insns, expected_attach_type=max(0, attach_type), name=name[:15],
                                  license_=self.obj.license, log_size=1 << 20)
        except rawbpf.BPFSyscallError as exc:
            raise BPFError(f"loading BPF program {name} failed: {os.strerror(exc.errno)}"
                           + (f" [{exc.log_reason}]" if exc.log_reason else "")) from None
        self._progs[key] = fd
        return fd

    def attach_tracepoint(self, tp: str, fn_name: str) -> None:
        """Attach ``fn_name`` to ``category:event``."""
        tracepoint_id(tp)  # a bad name fails here, before the program is verified
        fd = self.load_func(fn_name, "tracepoint")
        tp_fd = _attach.attach_tracepoint_fd(fd, tp)
        self._attach_fds.append(tp_fd)
        self._tp_fds.append(tp_fd)
        self._tp_by_name.setdefault(tp, []).append(tp_fd)

    def attach_tracepoint_prog(self, tp: str, prog_fd: int) -> None:
        """Attach an already loaded tracepoint program (``prog_fd``, not owned) to ``category:event``;
        the attachment is this module's, closed as :meth:`attach_tracepoint`'s are."""
        tp_fd = _attach.attach_tracepoint_fd(prog_fd, tp)
        self._attach_fds.append(tp_fd)
        self._tp_fds.append(tp_fd)
        self._tp_by_name.setdefault(tp, []).append(tp_fd)

    def detach_tracepoint(self, tp: str) -> None:
        """Detach every program this module attached to tracepoint ``category:event``."""
        for fd in self._tp_by_name.pop(tp, []):
            self._attach_fds.remove(fd)
            self._tp_fds.remove(fd)
            os.close(fd)

    def attach_raw_tracepoint(self, tp: str, fn_name: str) -> None:
        """Attach ``fn_name`` to raw tracepoint ``tp`` (e.g. ``sys_enter``)."""
        fd = self.load_func(fn_name, "raw_tracepoint")
        self._raw_tps.setdefault(tp, []).append(_attach.attach_raw_tracepoint_fd(fd, tp))

    def detach_raw_tracepoint(self, tp: str) -> None:
        """Detach every program this module attached to raw tracepoint ``tp``."""
        for fd in self._raw_tps.pop(tp, []):
            os.close(fd)

    def attach_uprobe(
        self, path: str, fn_name: str, *, sym: str, sym_off: int = 0, pid: int = -1, retprobe: bool = False
    ) -> None:
        """One classic uprobe (perf-event based) on ``sym+sym_off`` of ``path``.  Fine for a few
        probes; use uprobe_multi links for many sites."""
        try:
            offset = symbol_offset(path, sym, sym_off)
        except BinaryError as exc:
            raise BPFError(str(exc)) from None
        fd = self.load_func(fn_name, "kprobe")
        self._attach_fds.append(_attach.attach_uprobe_fd(fd, path, offset, pid=pid, retprobe=retprobe))

    def attach_perf_event(
        self,
        fn_name: str,
        *,
        ev_type: int = PERF_TYPE_SOFTWARE,
        ev_config: int = PERF_COUNT_SW_CPU_CLOCK,
        sample_freq: int = 0,
        sample_period: int = 0,
        pid: int = -1,
        cpu: int = -1,
    ) -> None:
        """Sampling perf event running ``fn_name``: by default software CPU_CLOCK.  ``pid`` is one
        *thread* (perf semantics, no inheritance); pid=-1 samples every task on each CPU (one event
        per online CPU when ``cpu`` is -1)."""
        if (sample_freq > 0) == (sample_period > 0):
            raise BPFError("attach_perf_event: give exactly one of sample_freq and sample_period")
        fd = self.load_func(fn_name, "perf_event")
        cpus = [cpu] if cpu >= 0 or pid >= 0 else _attach.online_cpus()
        for c in cpus:
            attr = PerfEventAttr(type=ev_type, config=ev_config, sample_freq=sample_freq or sample_period,
                                 flags=PERF_ATTR_DISABLED | (PERF_ATTR_FREQ if sample_freq else 0))
            pfd = _attach.perf_event_open(attr, pid, c, f"{ev_type}:{ev_config} for {fn_name}")
            self._attach_fds.append(pfd)
            _attach.perf_event_set_bpf(pfd, fd, fn_name)

    @property
    def program_fds(self) -> dict[str, int]:
        """Loaded programs by function name (fds owned by this module)."""
        return {name: fd for (name, _, _), fd in self._progs.items()}

    @property
    def link_fds(self) -> list[int]:
        """Raw tracepoint links owned by this module."""
        return [fd for fds in self._raw_tps.values() for fd in fds]

    # -- maps -------------------------------------------------------------------------------------
    def map(self, name: str) -> RawMap:
        """The map called ``name`` in the C source."""
        try:
            return self._maps[name]
        except KeyError:
            raise BPFError(f"no BPF map {name}") from None

    def map_entries(self) -> dict[str, int]:
        """Entries held now by each hash map of this module (arrays, rings and queues have a fixed
        size or none: left out)."""
        hashes = (MAP_HASH, MAP_LRU_HASH, MAP_PERCPU_HASH, MAP_LRU_PERCPU_HASH)
        return {name: m.entries() for name, m in self._maps.items() if m.map_type in hashes}

    def open_ring_buffer(self, name: str, callback: Callable[[bytes], None]) -> None:
        """Deliver each record of ring buffer ``name`` to ``callback`` as bytes during
        :meth:`ring_buffer_poll` / :meth:`ring_buffer_consume` (an exception in the callback
        propagates from them; the record is consumed)."""
        m = self.map(name)
        if m.map_type != MAP_RINGBUF:
            raise BPFError(f"map {name} is not a ring buffer")
        self._rings.add(RingBuffer(name, m.fd, m.max_entries, callback))

    def ring_buffer_poll(self, timeout_ms: int = -1, budget: int | None = None) -> int:
        """Wait up to ``timeout_ms`` (-1: forever) for records and dispatch them (at most ``budget``);
        returns how many were dispatched."""
        return self._rings.poll(timeout_ms, budget)

    def ring_buffer_consume(self, budget: int | None = None, rings: Collection[str] | None = None) -> int:
        """Dispatch the records available now (at most ``budget``; of the ring buffers called
        ``rings``, default all), without waiting."""
        return self._rings.consume(budget, rings)

    def ring_buffer_backlog(self) -> int:
        """Records waiting in this module's ring buffers."""
        return self._rings.backlog()

    # -- lifetime ---------------------------------------------------------------------------------
    def detach(self) -> None:
        """Detach every attachment (no program runs from here on) but keep maps and ring buffers,
        so what is already recorded can still be read; :meth:`cleanup` closes the rest."""
        self._close_attachments()

    def _close_attachments(self) -> None:
        """Close every attachment; tracepoints in the background when so configured (the other
        attachments first, so programs that make samples stop before this returns)."""
        later = set(self._tp_fds) if BACKGROUND_TRACEPOINT_CLOSE else set()
        fds = [*self._attach_fds, *(fd for fds in self._raw_tps.values() for fd in fds)]
        self._attach_fds.clear()
        self._tp_fds.clear()
        self._tp_by_name.clear()
        self._raw_tps.clear()
        for fd in fds:
            if fd not in later:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if later:
            _attach.close_in_background(sorted(later))

    def cleanup(self) -> None:
        """Detach everything attached through this module and close it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._close_attachments()
        self._rings.close()
        for fd in [*self._progs.values(), *self._map_fds.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._progs.clear()
        self._map_fds.clear()

    def __enter__(self) -> RawModule:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


def load_module(text: str, cflags: Sequence[str] = (), *,
                cache_dir: str | os.PathLike[str] | None = None) -> RawModule:
    """Compile ``text`` once (cached under ``cache_dir``, default
    :func:`ccprofd.kbpf.objcache.default_cache_dir`) and create its maps."""
    return RawModule(compile_cached(text, tuple(cflags), cache_dir=cache_dir))


__all__ = ["PROG_TYPES", "ProgType", "RawModule", "load_module"]
