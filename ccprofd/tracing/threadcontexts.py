"""GetThreadContexts in unwind mode: a ptrace snapshot of every thread, decoded into the tracer's frames."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from ccprofd.persist.cache import AnalysisCache
from ccprofd.proc.modules import ModuleCache
from ccprofd.proc.threadsnap import snapshot
from ccprofd.tracing.frames import SKIPPED_FRAME


class ContextReader:
    """``GetThreadContexts`` for the processes of one analysed binary: snapshot + decode.

    Returns a plain value: ``{"pid", "error", "threads": [{"tid", "comm", "complete", "reason",
    "frames"}]}`` with frames as in the tracer's JSON, outermost first.  One snapshot at a time
    (a second ``PTRACE_SEIZE`` of the same threads would be refused)."""

    def __init__(self, binary_path: str, cache_dir: str | None = None, shown_as: str | None = None) -> None:
        import threading
        from pathlib import Path

        self.binary_path = os.path.realpath(binary_path)
        self.shown_as = shown_as  # the module name of the binary's frames, if not its real path
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.modules = ModuleCache(AnalysisCache(self.cache_dir) if self.cache_dir else None)
        self._decoder: Any = None
        self._lock = threading.Lock()

    def _frame_decoder(self) -> Any:
        if self._decoder is None:
            from ccprofd.callgraph import analyze_binary
            from ccprofd.tracing.symbols import ModuleSymbols
            from ccprofd.tracing.threadframes import AnalysedBinary, FrameDecoder

            graph = analyze_binary(self.binary_path, cache_dir=self.cache_dir)  # from the cache
            analysed = AnalysedBinary.from_graph(graph, self.binary_path)
            if self.shown_as:
                analysed = replace(analysed, path=self.shown_as)
            self._decoder = FrameDecoder(analysed, self.modules.build_id_of, ModuleSymbols)
        return self._decoder

    def close(self) -> None:
        """Release what the snapshots made: the module cache's private vDSO copies (a read-only cache
        directory).  The owner -- the tracer mode that created this reader -- calls it at its close."""
        with self._lock:  # not under a snapshot that is walking through them
            self.modules.close()

    def read(self, pid: int) -> dict[str, Any]:
        decoder = self._frame_decoder()
        with self._lock:
            snap = snapshot(pid, self.modules)
        threads: list[dict[str, Any]] = []
        for th in snap.threads:
            if th.stack is None:
                threads.append({"tid": th.tid, "comm": th.comm, "complete": False, "reason": th.error,
                                "frames": []})
                continue
            frames = [f.to_json() for f in decoder.frames(th.stack.frames)]
            complete, reason = th.stack.complete, th.stack.reason
            if complete and decoder.skipped_frame(th.stack.frames):
                complete, reason = False, SKIPPED_FRAME  # as a sample of the same stack is flagged
            threads.append({"tid": th.tid, "comm": th.comm, "complete": complete, "reason": reason,
                            "frames": frames})
        return {"pid": pid, "error": snap.error, "threads": threads}

