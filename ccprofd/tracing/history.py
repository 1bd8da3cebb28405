"""The flight recorder (history.c): per-thread rings of the last syscall samples, kept by BPF at the
sample point and read here only on demand.

:func:`history_source` is the C text a program includes (before its mode's own C, which calls
``ccprof_history_put`` at each syscall sample); :func:`read_thread` reads one thread's ring from the
``ccprof_history`` map and returns its events oldest first.  Decoding an event's context is the
mode's business (``ctx``/``ctx2``/``ctx_kind`` are what its decoded-context cache is keyed by).
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccprofd.kbpf.bpfmap import RawMap
from ccprofd.kbpf.cdefs import c_constants
from ccprofd.kbpf.errors import BPFError

C_SOURCE = "history.c"
_C = c_constants(Path(__file__).with_name(C_SOURCE))
HISTORY_ARGS = _C["CCPROF_HISTORY_ARGS"]
HDR_BYTES = _C["CCPROF_HISTORY_HDR_BYTES"]
EV_BYTES = _C["CCPROF_HISTORY_EV_BYTES"]
DEFAULT_HISTORY_LEN = 256  # events kept per thread (issue #19)
DEFAULT_HISTORY_THREADS = 1024  # threads kept (LRU): 1024 x 14 kB = 14.7 MB of BPF memory
MAP_NAME = "ccprof_history"

_HDR = struct.Struct("<QII")
_EV = struct.Struct(f"<QiIQQ{HISTORY_ARGS}Q")
assert _HDR.size == HDR_BYTES and _EV.size == EV_BYTES


@dataclass(frozen=True, slots=True)
class HistoryEvent:
    """One recorded syscall sample.  ``time_ns`` is CLOCK_MONOTONIC, the same value as the sample's
    ring-buffer record; ``ctx_kind``/``ctx``/``ctx2`` identify its context (mode-specific)."""

    time_ns: int
    tgid: int
    tid: int
    syscall: int
    ctx_kind: int
    ctx: int
    ctx2: int
    args: tuple[int, ...]


ENV_LENGTH = "CCPROFD_HISTORY"  # events kept per thread; 0 turns the recorder off (README)


def configured_length(requested: int | None = None) -> int:
    """Events per thread: ``requested`` when given (a caller that never reads the recorder passes
    0), else ``CCPROFD_HISTORY`` (0 or a power of two up to 4096), else the default."""
    if requested is not None:
        if requested < 0 or requested > 4096 or requested & (requested - 1):
            raise BPFError(f"history length must be 0 or a power of two up to 4096, not {requested}")
        return requested
    text = os.environ.get(ENV_LENGTH)
    if text is None:
        return DEFAULT_HISTORY_LEN
    n = int(text) if text.isdigit() else -1
    if n < 0 or n > 4096 or n & (n - 1):
        raise BPFError(f"{ENV_LENGTH} must be 0 or a power of two up to 4096, not {text!r}")
    return n


def history_bytes(length: int) -> int:
    """sizeof(struct ccprof_hist) for ``length`` events."""
    return HDR_BYTES + length * EV_BYTES


def history_source(length: int = DEFAULT_HISTORY_LEN, threads: int = DEFAULT_HISTORY_THREADS) -> str:
    """history.c with its knobs; ``length`` 0: the recorder is compiled out (no map, no stores)."""
    if length < 0 or length & (length - 1):
        raise BPFError(f"history length must be 0 or a power of two, not {length}")
    if threads < 1:
        raise BPFError(f"history threads must be positive, not {threads}")
    defines = f"#define CCPROF_HISTORY_LEN {length}\n"
    if length:
        defines += (f"#define CCPROF_HISTORY_THREADS {threads}\n"
                    f"#define CCPROF_HISTORY_BYTES {history_bytes(length)}\n")
    return defines + Path(__file__).with_name(C_SOURCE).read_text(encoding="utf-8")


def decode_ring(raw: bytes, tid: int) -> list[HistoryEvent]:
    """The events of one thread's ring, oldest first.  The slot being written while the map was
    copied may be torn; an event older than its predecessor (that slot) is dropped."""
    if len(raw) < HDR_BYTES:
        return []
    length = (len(raw) - HDR_BYTES) // EV_BYTES
    if length == 0:
        return []
    written, tgid, _ = _HDR.unpack_from(raw)
    first = max(0, written - length)
    out: list[HistoryEvent] = []
    last = -1
    for i in range(first, written):
        t, nr, kind, ctx, ctx2, *args = _EV.unpack_from(raw, HDR_BYTES + (i % length) * EV_BYTES)
        if t == 0 or t < last:
            continue
        last = t
        out.append(HistoryEvent(t, tgid, tid, nr, kind, ctx, ctx2, tuple(args)))
    return out


def read_thread(history: RawMap, tid: int) -> list[HistoryEvent]:
    """Thread ``tid``'s recorded events, oldest first ([] when it has none or was evicted)."""
    value = history.get(tid)
    if value is None:
        return []
    return decode_ring(_raw(value), tid)


def threads(history: RawMap) -> list[int]:
    """The tids that have a ring."""
    keys = history.keys()  # a RawMap is not iterable
    return sorted(int(getattr(k, "value", k)) for k in keys)


def _raw(value: Any) -> bytes:
    """The bytes of a map value (bcc describes the blob as a char array)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return ctypes.string_at(ctypes.addressof(value), ctypes.sizeof(value))
