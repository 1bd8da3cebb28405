"""On-disk cache of analysis results, keyed by build-id (or content hash), written atomically.

Values are plain data serialised with marshal: fast to load, and loading runs no code.

Entries are checked, not trusted: each file is a magic, the SHA-256 of the marshal payload and the
payload; a file whose digest does not match (flipped bits, a torn or foreign file) is a miss, with
one warning line, and the caller recomputes and rewrites it.  A flipped bit in a marshal payload
often still loads, as a *different* value (a changed count, an IndexError later), so loading alone
proves nothing.  Callers key entries by the content hash of the file they describe (build-id and
size are not enough: an edited binary can keep both).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import marshal
import os
from pathlib import Path
from typing import Any

CACHE_FORMAT = 4  # bump whenever the analysis output changes meaning
MAGIC = b"ccprofd-cache\n"
_DIGEST = 32  # SHA-256 of the payload, after the magic


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
        head = len(MAGIC) + _DIGEST
        payload = memoryview(raw)[head:]
        if raw[:len(MAGIC)] != MAGIC or hashlib.sha256(payload).digest() != raw[len(MAGIC):head]:
            import logging  # only here: a cache hit must not pay for importing it

            logging.getLogger("ccprofd").warning("cache entry %s is damaged (checksum mismatch): recomputed",
                                                 path)
            return None
        gc_was_enabled = gc.isenabled()
        gc.disable()  # millions of small containers: the cyclic GC would triple the load time
        try:
            obj = marshal.loads(payload)
        except Exception:
            return None  # checksummed but unreadable (another Python's marshal): a miss
        finally:
            if gc_was_enabled:
                gc.enable()
        if not isinstance(obj, dict) or obj.get("cache_format") != CACHE_FORMAT:
            return None
        return obj.get("value")

    def store(self, kind: str, key: str, value: Any) -> None:
        from ccprofd.persist.atomicfile import atomic_write_chunks  # tempfile: not for a cache hit

        payload = marshal.dumps({"cache_format": CACHE_FORMAT, "value": value})
        with contextlib.suppress(OSError):  # a read-only or full cache dir must not fail the analysis
            atomic_write_chunks(self.path_for(kind, key), (MAGIC, hashlib.sha256(payload).digest(), payload))
