"""On-disk cache of analysis results, keyed by build-id (or content hash), written atomically.

Values are plain data serialised with marshal: fast to load, and loading runs no code.

The key also includes the file size and whether ``.symtab`` is present: a stripped copy shares its
build-id with the unstripped original but yields different names.
"""

from __future__ import annotations

import contextlib
import gc
import marshal
import os
from pathlib import Path
from typing import Any

from ccprofd.persist.atomicfile import atomic_write_bytes

CACHE_FORMAT = 3  # bump whenever the analysis output changes meaning


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
            gc_was_enabled = gc.isenabled()
            gc.disable()  # millions of small containers: the cyclic GC would triple the load time
            try:
                obj = marshal.loads(raw)
            finally:
                if gc_was_enabled:
                    gc.enable()
        except FileNotFoundError:
            return None
        except Exception:
            # A corrupt entry is only a cache miss; it is rewritten by the next store.
            return None
        if not isinstance(obj, dict) or obj.get("cache_format") != CACHE_FORMAT:
            return None
        return obj.get("value")

    def store(self, kind: str, key: str, value: Any) -> None:
        data = marshal.dumps({"cache_format": CACHE_FORMAT, "value": value})
        with contextlib.suppress(OSError):  # a read-only or full cache dir must not fail the analysis
            atomic_write_bytes(self.path_for(kind, key), data)
