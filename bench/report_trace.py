"""ccprofd trace sessions for the evaluation report, run in-process through the tracer's own Mode and
Session classes (what ``ccprofd trace`` runs), launched through :func:`report_bpf.launch` like every
baseline so that wall times are comparable.

Variants: ``instrumented`` (the default Valence plan, or ``encoding="pcce"|"hcce"`` for the
per-scheme cost), ``instrumented`` with hot-edge zero coding (the plan built with edge weights from a
profiling run, :class:`WeightedInstrumentedMode`), ``--scope``, and ``unwind`` when the tracer has it
(otherwise :class:`NotMeasured` carries the tracer's own one-line reason).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from report_bpf import Reaper, launch, owned_prog_stats, stats_delta

from ccprofd.tracing.api import Mode, TraceError, TraceOptions
from ccprofd.tracing.instrumented.mode import InstrumentedMode
from ccprofd.tracing.session import Session, make_mode

EdgeKey = tuple[int, int, int]


class NotMeasured(Exception):
    """A variant that cannot run here (a feature not landed, a missing tool): reported, not fatal."""


class WeightedInstrumentedMode(InstrumentedMode):
    """Instrumented mode whose Valence plan is built with edge weights (hot incoming edges get the
    all-zero code, hence no probe): ``ccprofd trace --edge-weights FILE``, the in-memory counts of the
    profiling run written to a temporary weights file first."""

    def __init__(self, binary: str, options: TraceOptions, weights: Mapping[EdgeKey, int]) -> None:
        import dataclasses
        import tempfile

        from ccprofd.callgraph import analyze_binary
        from ccprofd.encode.weightsfile import save_weights

        graph = analyze_binary(binary, cache_dir=Path(options.cache_dir) if options.cache_dir else None)
        fd, self.weights_file = tempfile.mkstemp(prefix="ccprofd-weights-", suffix=".json")
        os.close(fd)
        b = graph.binary
        identity = {"path": b.path, "build_id": b.build_id, "content_hash": b.content_hash}
        save_weights(self.weights_file, identity, weights)
        super().__init__(binary, dataclasses.replace(options, edge_weights=self.weights_file))

    def close(self) -> None:
        super().close()
        with contextlib.suppress(OSError):
            os.unlink(self.weights_file)


@dataclass
class TraceRun:
    """One traced run: wall and CPU time of the target, its samples (JSON dicts as ``ccprofd trace``
    writes them), the mode's counters gained during the run and the BPF run time gained per program."""

    variant: str
    seconds: float
    cpu: float
    samples: list[dict[str, Any]]
    counters: dict[str, int]
    exit_code: int
    bpf: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def probe_hits(self) -> int:
        c = self.counters
        return c.get("site_hits", 0) + c.get("tail_hits", 0) + c.get("entry_hits", 0)


BPF_PROGRAMS = (
    "ccprof_sys_enter",
    "cc_site_probe",
    "cc_tail_probe",
    "cc_entry_probe",
    "uw_sys_enter",
    "uw_cpu_sample",
)


def _counters(summary: Mapping[str, Any]) -> dict[str, int]:
    out = {k: int(v) for k, v in (summary.get("bpf") or {}).items() if isinstance(v, (int, float))}
    for k in ("samples", "incomplete", "decode_errors", "lost_contexts"):
        if isinstance(summary.get(k), int):
            out[k] = int(summary[k])
    return out


class Tracer:
    """One ccprofd variant prepared once for a binary (analysis, plan, BPF compile, attach) and run on
    any number of commands of that binary, one after another."""

    def __init__(
        self,
        binary: str,
        *,
        variant: str = "instrumented",
        scope: str | None = None,
        weights: Mapping[EdgeKey, int] | None = None,
        syscalls: str | None = None,
        sample_hz: int = 0,
        cache_dir: str | None = None,
        encoding: str = "valence",
    ) -> None:
        import time

        self.variant = variant
        mode_name = "unwind" if variant.startswith("unwind") else "instrumented"
        opts = TraceOptions(
            mode=mode_name, syscalls=syscalls, scope=scope, cache_dir=cache_dir, sample_hz=sample_hz,
            encoding=encoding,
        )
        path = os.path.realpath(binary)
        t0 = time.perf_counter()
        try:
            self.mode: Mode = (
                WeightedInstrumentedMode(path, opts, weights)
                if weights is not None
                else make_mode(path, opts)
            )
            self.mode.prepare()
        except TraceError as exc:
            raise NotMeasured(str(exc)) from None
        except BaseException:
            with contextlib.suppress(Exception):
                self.mode.close()
            raise
        self.prepare_seconds = time.perf_counter() - t0

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        keep_samples: bool | int = True,
    ) -> TraceRun:
        """Run one command; ``keep_samples``: all (True), none (False) or at most that many."""
        child = launch(argv, stdin=stdin, env=env)
        try:
            self.mode.track_launch(child.pid)
        except BaseException:
            child.abort()
            raise
        reaper = Reaper(child.pid)  # reaps at exit: /proc/PID goes, and the session drains and stops
        before_c = _counters(self.mode.summary())
        before = owned_prog_stats()
        t0 = child.release()
        session = Session(self.mode, attached=child.pid, detach_at_end=False)  # the next run reuses it
        samples: list[dict[str, Any]] = []
        limit = (1 << 62) if keep_samples is True else int(keep_samples)
        for batch in session.batches():
            room = limit - len(samples)
            if room > 0:
                samples.extend(s.to_json() for s in batch[:room])
        ex = reaper.wait()
        after = owned_prog_stats()
        after_c = _counters(self.mode.summary())
        counters = {k: v - before_c.get(k, 0) for k, v in after_c.items()}
        bpf = {name: stats_delta(before, after, name) for name in BPF_PROGRAMS}
        return TraceRun(
            self.variant,
            ex.at - t0,
            ex.cpu,
            samples,
            counters,
            ex.code,
            {k: v for k, v in bpf.items() if v[1]},
        )

    def close(self) -> None:
        self.mode.close()

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
