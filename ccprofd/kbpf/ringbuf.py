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
from collections.abc import Callable, Collection

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

    def consume(self, budget: int | None = None) -> int:
        """Deliver committed records, at most ``budget`` (None: until none is left); return how
        many were delivered.  A budget is what keeps a caller responsive when the producer is faster
        than the callbacks: without it this loop never returns (records keep arriving) and the
        callbacks' output grows without bound; with it the unread records wait in the ring, and
        once it is full the BPF side drops and counts.  The position advances past each record
        before its callback runs, so an exception from the callback propagates with that record
        consumed (as libbpf does) and the next call resumes after it."""
        data, cons_page, callback, mask = self._prod, self._cons, self.callback, self.mask
        read_u64, read_u32, write_u64 = _U64.unpack_from, _U32.unpack_from, _U64.pack_into
        cons = read_u64(cons_page, 0)[0]
        prod = read_u64(data, 0)[0]  # re-read only when the records known so far are consumed
        limit = -1 if budget is None else max(budget, 0)
        delivered = 0
        while delivered != limit:
            if cons >= prod:
                prod = read_u64(data, 0)[0]
                if cons >= prod:
                    break
            off = PAGE + (cons & mask)
            length = read_u32(data, off)[0]
            if length & BUSY_BIT:
                break
            size = length & ~(BUSY_BIT | DISCARD_BIT)
            cons += (size + HDR_SIZE + 7) & ~7
            if length & DISCARD_BIT:
                write_u64(cons_page, 0, cons)
                continue
            # Copy the record out BEFORE publishing the new consumer position: from then on the
            # kernel may reserve that space for the next record and overwrite it.
            record = data[off + HDR_SIZE:off + HDR_SIZE + size]
            write_u64(cons_page, 0, cons)
            delivered += 1
            callback(record)
        return delivered

    def backlog(self) -> int:
        """Committed records not consumed yet (discarded ones not counted); reads headers only."""
        cons = _U64.unpack_from(self._cons, 0)[0]
        prod = _U64.unpack_from(self._prod, 0)[0]
        n = 0
        while cons < prod:
            length = _U32.unpack_from(self._prod, PAGE + (cons & self.mask))[0]
            if length & BUSY_BIT:
                break
            n += 0 if length & DISCARD_BIT else 1
            cons += ((length & ~(BUSY_BIT | DISCARD_BIT)) + HDR_SIZE + 7) & ~7
        return n

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

    def consume(self, budget: int | None = None, names: Collection[str] | None = None) -> int:
        """Deliver the records available now, at most ``budget`` in all (None: every one), from
        every ring or the rings called ``names``."""
        rings = [r for r in self.rings.values() if names is None or r.name in names]
        return self._consume(rings, budget)

    def poll(self, timeout_ms: int = -1, budget: int | None = None) -> int:
        """Wait up to ``timeout_ms`` (-1: forever) for a ring to signal, then deliver the records of
        the rings that did, at most ``budget`` in all."""
        if self._epoll is None:
            raise BPFError("no ring buffer opened")
        try:
            ready = self._epoll.poll(-1 if timeout_ms < 0 else timeout_ms / 1000.0)
        except InterruptedError:
            return 0
        return self._consume([self.rings[fd] for fd, _ in ready if fd in self.rings], budget)

    @staticmethod
    def _consume(rings: list[RingBuffer], budget: int | None) -> int:
        delivered = 0
        for ring in rings:
            left = None if budget is None else budget - delivered
            if left is not None and left <= 0:
                break
            delivered += ring.consume(left)
        return delivered

    def backlog(self) -> int:
        """Records committed to the rings and not delivered yet."""
        return sum(ring.backlog() for ring in self.rings.values())

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None


__all__ = ["BUSY_BIT", "DISCARD_BIT", "RingBuffer", "RingBufferSet"]
