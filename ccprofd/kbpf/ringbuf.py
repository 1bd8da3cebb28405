"""Reading BPF ring buffers (BPF_MAP_TYPE_RINGBUF) through mmap, without libbpf or bcc.

The kernel's layout (``kernel/bpf/ringbuf.c``): page 0 holds the consumer position (mapped
read-write, we advance it), page 1 the producer position, then the data area mapped twice in a
row (read-only) so a record that wraps past the end reads as one contiguous slice.  Each record
starts with an 8-byte header: u32 length with BUSY (bit 31: still being written) and DISCARD
(bit 30: dropped by the program) flags, u32 page offset; records are 8-byte aligned.  Positions
only grow; offsets are taken modulo the data size.  Wake-ups come through epoll on the map fd.
"""

from __future__ import annotations

import mmap
import select
import struct
from collections.abc import Callable

from ccprofd.kbpf.errors import BPFError

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HDR_SIZE = 8
PAGE = mmap.PAGESIZE

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class RingBuffer:
    """One ring buffer map; :meth:`consume` hands each committed record to ``callback`` as bytes."""

    def __init__(self, name: str, map_fd: int, data_size: int, callback: Callable[[bytes], None]) -> None:
        if data_size <= 0 or data_size & (data_size - 1) or data_size % PAGE:
            raise BPFError(f"ring buffer {name}: size {data_size} is not a power-of-two number of pages")
        self.name = name
        self.fd = map_fd
        self.size = data_size
        self.mask = data_size - 1
        self.callback = callback
        try:
            self._cons = mmap.mmap(map_fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
            self._prod = mmap.mmap(map_fd, PAGE + 2 * data_size, mmap.MAP_SHARED, mmap.PROT_READ, offset=PAGE)
        except OSError as exc:
            raise BPFError(f"mapping ring buffer {name} failed: {exc.strerror}") from None

    def consume(self) -> int:
        """Deliver every committed record; return how many were delivered.  The position advances
        past each record before its callback runs, so an exception from the callback propagates
        with that record consumed (as libbpf does) and the next call resumes after it."""
        cons = _U64.unpack_from(self._cons, 0)[0]
        delivered = 0
        while True:
            prod = _U64.unpack_from(self._prod, 0)[0]
            if cons >= prod:
                return delivered
            off = PAGE + (cons & self.mask)
            length = _U32.unpack_from(self._prod, off)[0]
            if length & BUSY_BIT:
                return delivered
            size = length & ~(BUSY_BIT | DISCARD_BIT)
            cons += (size + HDR_SIZE + 7) & ~7
            record = None if length & DISCARD_BIT else self._prod[off + HDR_SIZE:off + HDR_SIZE + size]
            _U64.pack_into(self._cons, 0, cons)
            if record is not None:
                delivered += 1
                self.callback(record)

    def close(self) -> None:
        for m in (self._cons, self._prod):
            m.close()


class RingBufferSet:
    """The ring buffers of one module, with one epoll set over their fds."""

    def __init__(self) -> None:
        self.rings: dict[int, RingBuffer] = {}
        self._epoll: select.epoll | None = None

    def add(self, ring: RingBuffer) -> None:
        if self._epoll is None:
            self._epoll = select.epoll()
        self._epoll.register(ring.fd, select.EPOLLIN)
        self.rings[ring.fd] = ring

    def consume(self) -> int:
        """Drain every ring now."""
        return sum(ring.consume() for ring in list(self.rings.values()))

    def poll(self, timeout_ms: int = -1) -> int:
        """Wait up to ``timeout_ms`` (-1: forever) for a ring to signal, then drain the rings that did."""
        if self._epoll is None:
            raise BPFError("no ring buffer opened")
        try:
            ready = self._epoll.poll(-1 if timeout_ms < 0 else timeout_ms / 1000.0)
        except InterruptedError:
            return 0
        return sum(self.rings[fd].consume() for fd, _ in ready if fd in self.rings)

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None


__all__ = ["BUSY_BIT", "DISCARD_BIT", "RingBuffer", "RingBufferSet"]
