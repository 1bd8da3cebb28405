"""Aggregate mode's userspace half, shared by the tracer modes (unwind and instrumented).

In aggregate mode BPF counts samples per context in a kernel map and sends each context's first
sample whole (a "new" record, decoded once here); later samples of it are only counted, or sent as
a header naming the context when a consumer needs every sample ("hits").  This joins the two: it
keeps each context's decoded sample by its kernel key and turns the map's running counts into
``(context, n)`` deltas, each sample counted exactly once whether or not its record was sent.

The map is read after the ring buffer is drained (the modes' ``poll_counted``): a key whose new
record is not in yet (still being sent on another CPU) is skipped and its count left for the next
read, so nothing is lost; a key whose record was never sent (ring buffer full) is deleted by BPF.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)

#: While records flood in, the map is read at most this often (the counts wait in the kernel): the
#: daemon then polls without waiting, and reading and converting the whole map at every poll was
#: ~11% of its poll thread at 10,000 records/s.
COUNTS_READ_S = 0.1


class KernelCounts(Generic[Key]):
    """Context samples by kernel key, and the part of each key's count already taken."""

    def __init__(self) -> None:
        self._contexts: dict[Key, tuple[Any, Any]] = {}
        # contexts learnt lazily: key -> arg, ``self._make(arg)`` the context, made when deltas()
        # first needs it (their _contexts entry's context is None until then)
        self._later: dict[Key, Any] = {}
        self._make: Callable[[Any], Any] | None = None
        self._taken: dict[Key, int] = {}
        self._order: deque[Key] = deque()  # learn_bounded()'s keys, oldest first
        self.lost = 0  # hit records whose context record never came (or was forgotten)
        self.forgotten = 0  # contexts learn_bounded() dropped to stay within its limit
        self._read_at = float("-inf")  # the last read_due() that said yes

    def read_due(self, flooding: bool) -> bool:
        """Whether to read the counts map now: always, but at most every :data:`COUNTS_READ_S`
        while ``flooding`` (records came, and the poll may wait: not a last read)."""
        now = time.monotonic()
        if flooding and now - self._read_at < COUNTS_READ_S:
            return False
        self._read_at = now
        return True

    def learn(self, key: Key, context: Any, decoded: Any) -> None:
        """A new context's sample (``context``: what the daemon's store is given for it; ``decoded``:
        the mode's decode result, for hits and statistics).  The first one sent stands."""
        self._contexts.setdefault(key, (context, decoded))

    def learn_bounded(self, key: Key, decoded: Any, limit: int) -> None:
        """:meth:`learn` for a tracer that never takes counts (``ccprofd trace``, learn, detect): at
        most ``limit`` contexts are kept, the oldest forgotten first, so memory stays bounded however
        many distinct contexts a target makes; a later hit of a forgotten context is counted as
        lost, as one whose record never came (the kernel does not send it again)."""
        ctx = self._contexts
        if key in ctx:
            return
        if len(ctx) >= limit and self._order:
            ctx.pop(self._order.popleft(), None)
            self.forgotten += 1
        ctx[key] = (None, decoded)
        self._order.append(key)

    def learn_later(self, key: Key, make: Callable[[Any], Any], arg: Any, decoded: Any) -> None:
        """:meth:`learn` with the context ``make(arg)`` made only when :meth:`deltas` needs it
        (the daemon's modes; a Session's mode, which never takes counts, uses :meth:`learn_bounded`).
        ``make(arg)`` must give the same context whenever it is called, and ``make`` is the same
        for every key (the mode's: kept once, not per key, as ``arg`` is kept small: both stay
        alive as long as the context, and every object kept is work for the cyclic GC)."""
        if key not in self._contexts:
            self._contexts[key] = (None, decoded)
            self._later[key] = arg
            self._make = make

    @property
    def by_key(self) -> Mapping[Key, tuple[Any, Any]]:
        """Every known ``key: (context, decoded)`` (read it, never change it): what the compiled
        hit loop (tracing/unwind/chits.c) looks keys up in; it counts unknown keys into ``lost``."""
        return self._contexts

    def known(self, key: Key) -> tuple[Any, Any] | None:
        return self._contexts.get(key)

    def hit(self, key: Key) -> Any | None:
        """The decoded context of a hit record, None (counted as lost) when it is unknown."""
        got = self._contexts.get(key)
        if got is None:
            self.lost += 1
            return None
        return got[1]

    def deltas(self, counts: Mapping[Key, int]) -> list[tuple[Any, Any, int]]:
        """``(context, decoded, n)``: samples counted under each known key since the last call."""
        out: list[tuple[Any, Any, int]] = []
        for key, value in counts.items():
            got = self._contexts.get(key)
            if got is None:
                continue
            delta = value - self._taken.get(key, 0)
            if delta > 0:
                self._taken[key] = value
                if got[0] is None and key in self._later:
                    assert self._make is not None
                    got = self._contexts[key] = (self._make(self._later.pop(key)), got[1])
                out.append((got[0], got[1], delta))
        return out
