"""On-disk cache of analysis results, keyed by build-id (or content hash), written atomically.

Values are plain data serialised with marshal: fast to load, and loading runs no code.

Entries are checked, not trusted: each file is a magic, a stream of marshal pieces and the SHA-256
of the pieces (layout below :class:`AnalysisCache`); a file whose digest does not match (flipped
bits, a torn, truncated or foreign file) is a miss, with one warning line, and the caller
recomputes and rewrites it.  A flipped bit in a marshal payload
often still loads, as a *different* value (a changed count, an IndexError later), so loading alone
proves nothing.  Callers key entries by the content hash of the file they describe (build-id and
size are not enough: an edited binary can keep both).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import marshal
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CACHE_FORMAT = 7  # bump whenever the analysis output changes meaning (6: Go functions from .gopclntab;
# 7: a Go build ID stands in for a missing GNU build-id)
MAGIC = b"ccprofd-cache\n"
_DIGEST = 32  # SHA-256 of the pieces, at the end of the file


def file_identity(path: str) -> str | None:
    """(dev, inode, size, mtime) of ``path`` as a key part: it changes when the file is replaced
    or rewritten, and checking it reads no byte of the file (for entries about system files that
    every start-up would otherwise re-parse: libc's symbols, a binary's DT_NEEDED closure)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_dev:x}-{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def default_cache_dir() -> Path:
    env = os.environ.get("CCPROFD_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ccprofd"


class AnalysisCache:
    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path_for(self, kind: str, key: str) -> Path:
        return self.directory / kind / f"{key}.v{CACHE_FORMAT}.marshal"

    def load(self, kind: str, key: str) -> Any | None:
        path = self.path_for(kind, key)
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            return None
        head = len(MAGIC)
        body = memoryview(raw)[head:len(raw) - _DIGEST]
        if (len(raw) < head + _DIGEST or raw[:head] != MAGIC
                or hashlib.sha256(body).digest() != raw[len(raw) - _DIGEST:]):
            import logging  # only here: a cache hit must not pay for importing it

            logging.getLogger("ccprofd").warning("cache entry %s is damaged (checksum mismatch): recomputed",
                                                 path)
            return None
        gc_was_enabled = gc.isenabled()
        gc.disable()  # millions of small containers: the cyclic GC would triple the load time
        try:
            pieces = _read_pieces(body)
            header = next(pieces)
            if header != ("ccprofd-cache", CACHE_FORMAT):
                return None
            value = _decode(pieces)
            if next(pieces, _END) is not _END:
                return None  # trailing pieces: not a stream this code wrote
            return value
        except Exception:
            return None  # checksummed but unreadable (another Python's marshal): a miss
        finally:
            if gc_was_enabled:
                gc.enable()

    def store(self, kind: str, key: str, value: Any) -> None:
        from ccprofd.persist.atomicfile import atomic_write_chunks  # tempfile: not for a cache hit

        with contextlib.suppress(OSError):  # a read-only or full cache dir must not fail the analysis
            atomic_write_chunks(self.path_for(kind, key), _stream(value))


# The entry is a stream of separately marshalled pieces, so that storing a large value (the
# ~50 MB call graph of node) never holds its whole marshal image: CPython's marshal.dumps grows its
# buffer by doubling, which alone cost ~2x the payload at once.  File layout: MAGIC, then frames
# (8-byte little-endian length + one marshal piece), then the SHA-256 of all frames, computed
# while writing.  Pieces, each a tuple whose first item is a tag:
#   (_LEAF, value)                    the value itself (marshalled whole);
#   (_SEQ, is_tuple, n)               a list/tuple longer than CHUNK: n slices of CHUNK items follow,
#                                     concatenated (each a leaf, or _MIXED if it has a long child);
#   (_MAP, n)                         a dict longer than CHUNK: n dict slices follow likewise, merged;
#   (_MIXED, kind, keys, small, big)  a short list/tuple/dict with some large children: ``small``
#                                     holds the other children in order, the large ones (at indexes
#                                     ``big``) follow as encoded sub-streams.
# A piece is thus bounded by CHUNK elements, except where a container deeper than _large looks
# (three levels; one level inside a long container's slices) is itself long.
CHUNK = 4096
_LEAF, _SEQ, _MAP, _MIXED = 0, 1, 2, 3
_LEN = 8  # bytes of a frame's little-endian length field
_END = object()


def _large(v: Any, depth: int = 3) -> bool:
    """Whether ``v`` is worth splitting: a container longer than CHUNK, or one holding such a
    container within ``depth`` levels (deeper ones are marshalled whole, so the check stays cheap)."""
    t = type(v)
    if t is not list and t is not tuple and t is not dict:
        return False
    if len(v) > CHUNK:
        return True
    if depth == 0:
        return False
    return any(_large(x, depth - 1) for x in (v.values() if t is dict else v))


def _pieces(v: Any) -> Iterator[Any]:
    t = type(v)
    if not _large(v):
        yield (_LEAF, v)
    elif len(v) > CHUNK:
        if t is dict:
            items = list(v.items())
            yield (_MAP, (len(items) + CHUNK - 1) // CHUNK)
            slices: Iterator[Any] = (dict(items[i:i + CHUNK]) for i in range(0, len(items), CHUNK))
        else:
            yield (_SEQ, t is tuple, (len(v) + CHUNK - 1) // CHUNK)
            slices = (v[i:i + CHUNK] for i in range(0, len(v), CHUNK))
        for part in slices:
            # only the slice's own children are looked at (the rows of a long table are many)
            if any((type(x) is list or type(x) is tuple or type(x) is dict) and len(x) > CHUNK
                   for x in (part.values() if t is dict else part)):
                yield from _mixed(part)
            else:
                yield (_LEAF, part)
    else:
        yield from _mixed(v)


def _mixed(v: Any) -> Iterator[Any]:
    t = type(v)
    keys = tuple(v) if t is dict else None
    vals = list(v.values()) if t is dict else list(v)
    big = [i for i, x in enumerate(vals) if _large(x)]
    bigset = set(big)
    small = [x for i, x in enumerate(vals) if i not in bigset]
    yield (_MIXED, "d" if t is dict else ("t" if t is tuple else "l"), keys, small, tuple(big))
    for i in big:
        yield from _pieces(vals[i])


def _stream(value: Any) -> Iterator[bytes]:
    """The file's chunks; only one marshalled piece is alive at a time."""
    digest = hashlib.sha256()
    yield MAGIC
    for piece in itertools.chain([("ccprofd-cache", CACHE_FORMAT)], _pieces(value)):
        data = marshal.dumps(piece)
        size = len(data).to_bytes(_LEN, "little")
        digest.update(size)
        digest.update(data)
        yield size
        yield data
        del data
    yield digest.digest()


def _read_pieces(body: memoryview) -> Iterator[Any]:
    pos, end = 0, len(body)
    while pos < end:
        size = int.from_bytes(body[pos:pos + _LEN], "little")
        pos += _LEN
        if pos > end:
            raise ValueError("length field runs past the end")
        if size > end - pos:
            raise ValueError("piece runs past the end")
        yield marshal.loads(body[pos:pos + size])
        pos += size


def _decode(pieces: Iterator[Any]) -> Any:
    piece = next(pieces)
    tag = piece[0]
    if tag == _LEAF:
        return piece[1]
    if tag == _SEQ:
        out: list[Any] = []
        for _ in range(piece[2]):
            out.extend(_decode(pieces))
        return tuple(out) if piece[1] else out
    if tag == _MAP:
        d: dict[Any, Any] = {}
        for _ in range(piece[1]):
            d.update(_decode(pieces))
        return d
    if tag == _MIXED:
        _, kind, keys, small, big = piece
        vals: list[Any] = []
        it = iter(small)
        nbig = len(big)
        bigset = set(big)
        total = len(small) + nbig
        for i in range(total):
            vals.append(_decode(pieces) if i in bigset else next(it))
        if kind == "d":
            return dict(zip(keys, vals, strict=True))
        return tuple(vals) if kind == "t" else vals
    raise ValueError(f"unknown cache piece tag {tag!r}")

