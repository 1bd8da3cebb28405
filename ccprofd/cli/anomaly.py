"""``ccprofd learn``, ``ccprofd detect`` and ``ccprofd model``: the anomaly detector without the daemon.

Samples come either from a traced command (``-- CMD [ARGS...]``, through the tracer's session API:
probes attached before the command runs, its exit status passed through, 125 when tracing fails
mid-run) or from a JSONL file written by ``ccprofd trace --format jsonl`` (``--samples
FILE``).  Kept out of cli.py so that file stays a thin dispatcher; cli.py calls
:func:`add_commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from ccprofd.anomaly.detector import AlertWriter, Detector, DetectorOptions
from ccprofd.anomaly.model import (
    GRANULARITIES,
    PREFIX_MATCHES,
    AllowRule,
    EdgeKey,
    FramePattern,
    Learner,
    ModelError,
    ModelSet,
    TargetModel,
    edge_text,
    iter_frames_text,
)
from ccprofd.anomaly.modelstore import (
    ModelFileError,
    PeriodicFlusher,
    load_models,
    locked,
    merge_into,
    save_models,
)
from ccprofd.cli.errors import UsageError
from ccprofd.daemon.config import AnomalyConfig

# the recorded syscalls before it a live `detect` alert carries, as many as the daemon's by default
ALERT_HISTORY = AnomalyConfig().alert_history


class _Usage(Exception):
    """Raised here, turned into cli.UsageError (exit 2) by :func:`_run`."""


class _Unavailable(Exception):
    """A missing capability of this build or machine (exit status 1)."""


# --------------------------------------------------------------------------------- sample input
def _read_jsonl(path: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        fh: IO[str] = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise _Usage(f"cannot read samples {path}: {exc.strerror}") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                s = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _Usage(f"{path}:{n}: not a JSON sample ({exc.msg})") from None
            if not isinstance(s, dict) or "frames" not in s or "syscall" not in s:
                raise _Usage(f"{path}:{n}: not a decoded sample (needs \"syscall\" and \"frames\")")
            out.append(s)
    return out


def _target_of(sample: dict[str, Any]) -> tuple[str, str] | None:
    frames = sample.get("frames") or []
    if not frames:
        return None
    f = frames[0]
    bid = f.get("build_id") or f.get("module")
    return (str(bid), str(f.get("module") or "")) if bid else None


def _by_target(samples: list[dict[str, Any]]) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    """Each sample with its target (build-id, path): the outermost frame's module.  Samples without
    frames (before ``main``) belong to the file's target when there is exactly one."""
    targets = {t for s in samples if (t := _target_of(s)) is not None}
    only = next(iter(targets)) if len(targets) == 1 else None
    for s in samples:
        t = _target_of(s) or only
        if t is not None:
            yield t, s


def _parse_syscalls(text: str | None) -> list[str] | None:
    if text is None or text == "all":
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise _Usage("--syscalls needs a comma-separated list of names, or 'all'")
    return names


def _open_traced(args: argparse.Namespace, syscalls: list[str] | None,
                 on_launch: Callable[[int], None] | None = None, enforce: Any = None,
                 history: int | None = None) -> Any:
    """The tracer's session for ``-- CMD``: probes attached before the command execs.  ``history``:
    the flight recorder's events per thread (TraceOptions.history; learn reads none: 0)."""
    from ccprofd.kbpf.errors import BPFError
    from ccprofd.tracing import session as tracer

    try:
        opts = tracer.TraceOptions(mode=args.mode, syscalls=",".join(syscalls) if syscalls else None,
                                   cache_dir=args.cache_dir, enforce=enforce, history=history,
                                   sample_hz=getattr(args, "sample_hz", 0),
                                   watch_ia32=getattr(args, "watch_ia32", False))
        return tracer.open_session(list(args.command), options=opts, on_launch=on_launch)
    except tracer.TraceError as exc:
        raise _Usage(str(exc)) from None
    except (BPFError, OSError) as exc:
        raise _Unavailable(f"cannot start tracing: {str(exc).strip().splitlines()[0]}") from None


def _target_binary(argv: Sequence[str]) -> tuple[str, str]:
    """(path, build-id) of the command's executable; models are keyed by build-id, so a binary
    without one is refused before anything runs."""
    from ccprofd.elf.image import ElfImage
    from ccprofd.tracing import session as tracer

    try:
        path = tracer.resolve_command(argv)
        bid = ElfImage(path).build_id()
    except tracer.TraceError as exc:
        raise _Usage(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise _Usage(f"{argv[0]}: cannot read the executable: {exc}") from None
    if not bid:
        raise _Usage(f"{path} has no build-id (no GNU build-id note, no Go build ID); anomaly models "
                     "are keyed by build-id (link with -Wl,--build-id)")
    return path, bid


def _run_session(session: Any, write: Callable[[dict[str, Any]], None]) -> int:
    """Stream the session's samples to ``write``: the command's status, 125 if tracing failed.
    ``lost`` records (samples the kernel dropped) are not samples: run() reports them on stderr."""
    from ccprofd.tracing import session as tracer

    class SamplesOnly:
        def sample(self, s: Any) -> None:
            write(s.to_json())

        def samples(self, batch: list[Any]) -> None:
            for s in batch:
                write(s.to_json())

        def record(self, r: dict[str, Any]) -> None:
            pass

        def flush(self) -> None:
            pass

    return int(tracer.run(session, SamplesOnly(), launched=True))


# ------------------------------------------------------------------------------------- learn
class _LearnSink:
    """Learns samples as they arrive (never buffered: the periodic flush bounds what a kill loses)."""

    def __init__(self, args: argparse.Namespace, syscalls: list[str] | None) -> None:
        self.args = args
        self.syscalls = syscalls
        self.learners: dict[str, tuple[Learner, PeriodicFlusher]] = {}
        self.samples = 0

    def add(self, target: tuple[str, str], sample: dict[str, Any]) -> None:
        bid, path = target
        entry = self.learners.get(bid)
        if entry is None:
            learner = Learner(TargetModel(bid, path), syscalls=self.syscalls,
                              transitions=self.args.transitions)
            entry = self.learners[bid] = (learner, PeriodicFlusher(self.args.model, learner,
                                                                   self.args.flush_interval))
        entry[0].observe(sample)
        entry[1].maybe_flush()
        self.samples += 1

    def finish(self) -> None:
        for _, flusher in self.learners.values():
            flusher.flush()
        print(f"ccprofd: learned {self.samples} samples of {len(self.learners)} target(s) into "
              f"{self.args.model}", file=sys.stderr)


def cmd_learn(args: argparse.Namespace) -> int:
    if args.samples is not None and args.sample_hz:
        raise _Usage("--sample-hz samples -- CMD; with --samples the file's CPU samples are learned")
    syscalls = _parse_syscalls(args.syscalls)
    _check_model_readable(args.model)
    sink = _LearnSink(args, syscalls)
    if args.samples is None:
        path, bid = _target_binary(args.command)
        target = (bid, path)
        # The run counts even when it made no sample: a run is what the learning curve counts.
        sink.learners[bid] = (learner := Learner(TargetModel(bid, path), syscalls=syscalls,
                                                 transitions=args.transitions),
                              PeriodicFlusher(args.model, learner, args.flush_interval))
        session = _open_traced(args, syscalls, history=0)  # nothing here reads the flight recorder
        try:
            status = _run_session(session, lambda s: sink.add(target, s))
        finally:
            sink.finish()
        return status
    for target_, s in _by_target([s for s in _read_jsonl(args.samples)
                                  if syscalls is None or s.get("syscall") in syscalls
                                  or s.get("event") == "cpu"]):
        sink.add(target_, s)
    sink.finish()
    return 0


def _check_model_readable(path: str) -> None:
    try:
        load_models(path)
    except ModelFileError as exc:
        raise _Usage(f"{exc} — not touching it; move it away to start a new model") from None


# ------------------------------------------------------------------------------------ detect
class _Enforcement:
    """``detect --enforce``: the kernel-side enforcer of the model, and the link between its
    denials and the detector's alerts (same pid, tid and syscall)."""

    def __init__(self, path: str, model: TargetModel) -> None:
        from ccprofd.anomaly.enforce import Enforcer
        from ccprofd.kbpf.errors import BPFError

        try:
            self.enforcer = Enforcer(path, model, enforce=True)
        except BPFError as exc:
            raise _Unavailable(f"cannot enforce: {str(exc).strip().splitlines()[0]}") from None
        self.pending: dict[tuple[int, int, str], list[str]] = {}
        self.denied = 0
        if self.enforcer.mode != "lsm":
            print(f"ccprofd: enforcing by SIGKILL at syscall entry ({self.enforcer.lsm_error}); "
                  "a denied syscall may still complete", file=sys.stderr)
        if self.enforcer.allowed.unkeyed:
            print(f"ccprofd: {self.enforcer.allowed.unkeyed} model context(s) cannot be keyed for "
                  "enforcement (no frame-pointer chain to them): they will be denied", file=sys.stderr)

    def collect(self) -> None:
        from ccprofd.kbpf.syscalls import syscall_name

        for d in self.enforcer.poll(0):
            self.denied += 1
            key = (d.pid, d.tid, syscall_name(d.syscall_nr) or str(d.syscall_nr))
            self.pending.setdefault(key, []).append(d.verdict)

    def annotate(self, alert: dict[str, Any]) -> dict[str, Any]:
        self.collect()
        alert["action"] = "enforce"
        verdicts = self.pending.get((alert["pid"], alert["tid"], alert["syscall"]))
        alert["denied"] = bool(verdicts)
        if verdicts:
            alert["verdict"] = verdicts.pop(0)
        return alert

    def close(self) -> None:
        self.collect()
        for (pid, tid, syscall), verdicts in sorted(self.pending.items()):
            for verdict in verdicts:
                print(f"ccprofd: enforcement {verdict} {syscall} of pid {pid} tid {tid} (its context "
                      "has no key in the model; the detector did not report it)", file=sys.stderr)
        self.enforcer.close()


class _UnwindEnforcement:
    """``detect --enforce --mode unwind``: the model's allowed set in the tracer's own unwinder
    (unwind.c ``UW_ENFORCE``), which kills a (syscall, context) pair outside it at sys_enter;
    works without frame pointers.  Denials are read back from the tracer's mode to annotate the
    detector's alerts (same pid, tid and syscall)."""

    def __init__(self, model: TargetModel) -> None:
        from ccprofd.anomaly.unwind_enforce import enforcement_options

        self.options, self.allowed = enforcement_options(model)
        self.session: Any = None
        self.reported: set[tuple[int, int, int]] = set()
        print("ccprofd: enforcing from the unwinder: SIGKILL at syscall entry (BPF LSM programs are not "
              "used); the killed syscall itself still runs to completion", file=sys.stderr)
        if self.allowed.unkeyed:
            print(f"ccprofd: {self.allowed.unkeyed} model context(s) cannot be keyed (a frame without a "
                  "learned call site or return address): they will be denied", file=sys.stderr)
        if self.allowed.ignored_rules:
            print(f"ccprofd: {self.allowed.ignored_rules} allow rule(s) are not enforced (prefixes are "
                  "not finite keys): contexts they allow are killed", file=sys.stderr)

    def _denials(self) -> list[Any]:
        return [] if self.session is None else list(self.session.mode.enforcement()[1])

    def annotate(self, alert: dict[str, Any]) -> dict[str, Any]:
        from ccprofd.kbpf.syscalls import syscall_name

        alert["action"] = "enforce"
        alert["denied"] = False
        for d in self._denials():
            name = syscall_name(d.syscall_nr) or str(d.syscall_nr)
            if (d.tgid, d.tid, name) == (alert["pid"], alert["tid"], alert["syscall"]):
                alert["denied"] = True
                alert["verdict"] = d.verdict
                self.reported.add((d.tgid, d.tid, d.ktime_ns))
        return alert

    def close(self) -> None:
        from ccprofd.kbpf.syscalls import syscall_name

        for d in self._denials():
            if (d.tgid, d.tid, d.ktime_ns) not in self.reported:
                what = "an incomplete context" if d.incomplete else "a context outside the model"
                print(f"ccprofd: enforcement {d.verdict} {syscall_name(d.syscall_nr) or d.syscall_nr} of pid "
                      f"{d.tgid} tid {d.tid} ({what}; the detector did not report it)", file=sys.stderr)


def cmd_detect(args: argparse.Namespace) -> int:
    syscalls = _parse_syscalls(args.syscalls)
    if args.enforce and args.samples is not None:
        raise _Usage("--enforce needs a command to run (-- CMD), not --samples")
    try:
        models = load_models(args.model, missing_ok=False)
    except ModelFileError as exc:
        raise _Usage(str(exc)) from None
    if args.granularity != "exact" and args.enforce:
        raise _Usage(f"--granularity {args.granularity} cannot be enforced (the kernel-side enforcer "
                     "checks exact contexts): drop --enforce or use --granularity exact")
    if args.prefix_match != "sites" and args.granularity != "routines":
        raise _Usage(f"--prefix-match {args.prefix_match} applies to --granularity routines only")
    opts = DetectorOptions(collapse_recursion=args.collapse_recursion, transitions=args.transitions,
                           granularity=args.granularity, prefix_match=args.prefix_match,
                           min_count=args.min_count, alert_interval_seconds=args.alert_interval)
    with _alert_stream(args.output) as stream:
        if args.samples is not None:
            writer = AlertWriter(stream)
            detectors: dict[str, Detector] = {}
            for (bid, path), s in _by_target([s for s in _read_jsonl(args.samples)
                                               if syscalls is None or s.get("syscall") in syscalls]):
                det = detectors.get(bid)
                if det is None:
                    det = detectors[bid] = _detector_for(models, bid, path, opts)
                for alert in det.check(s):
                    writer.write(alert)
            return 0
        path, bid = _target_binary(args.command)
        det = _detector_for(models, bid, path, opts)
        if args.enforce and args.mode == "unwind":
            return _detect_unwind_enforced(args, syscalls, det, stream)
        enforcement = _Enforcement(path, det.model) if args.enforce else None

        def write(sample: dict[str, Any]) -> None:
            for alert in det.check(sample):
                d = alert.to_dict()
                # the thread's recorded syscalls before this one (the flight recorder), as the daemon's
                d["history"] = session.mode.history_before(alert.tid, alert.time_ns, ALERT_HISTORY)
                if enforcement is not None:
                    d = enforcement.annotate(d)
                stream.write(json.dumps(d, separators=(",", ":")) + "\n")
                stream.flush()

        try:
            hook = None if enforcement is None else enforcement.enforcer.track_launch
            session = _open_traced(args, syscalls, on_launch=hook)
            return _run_session(session, write)
        finally:
            if enforcement is not None:
                enforcement.close()


def _detect_unwind_enforced(args: argparse.Namespace, syscalls: list[str] | None, det: Detector,
                            stream: IO[str]) -> int:
    """``detect --enforce`` in unwind mode: the tracer's unwinder enforces (no second program)."""
    enforcement = _UnwindEnforcement(det.model)

    def write(sample: dict[str, Any]) -> None:
        for alert in det.check(sample):
            d = enforcement.annotate(alert.to_dict())
            stream.write(json.dumps(d, separators=(",", ":")) + "\n")
            stream.flush()

    session = _open_traced(args, syscalls, enforce=enforcement.options)
    enforcement.session = session
    try:
        return _run_session(session, write)
    finally:
        enforcement.close()


def _detector_for(models: ModelSet, build_id: str, path: str, opts: DetectorOptions) -> Detector:
    model = models.targets.get(build_id)
    if model is None:
        stale = models.stale_for(path, build_id)
        hint = (f"; it has models of {path} for build-id(s) {', '.join(m.build_id for m in stale)} "
                f"(the binary changed: learn again)") if stale else ""
        raise _Usage(f"model has no target with build-id {build_id} ({path}){hint}")
    try:
        return Detector(model, opts)
    except ValueError as exc:
        raise _Usage(str(exc)) from None


@contextlib.contextmanager
def _alert_stream(output: str | None) -> Iterator[IO[str]]:
    if output is None:
        yield sys.stderr
        return
    try:
        fh = open(output, "a", encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise _Usage(f"cannot write alerts to {output}: {exc.strerror}") from None
    with fh:
        yield fh


# ------------------------------------------------------------------------------------- model
def _load_existing(path: str) -> ModelSet:
    try:
        return load_models(path, missing_ok=False)
    except ModelFileError as exc:
        raise _Usage(str(exc)) from None


def _pick(models: ModelSet, build_id: str | None) -> TargetModel:
    if build_id is not None:
        hits = [m for b, m in models.targets.items() if b.startswith(build_id)]
        if len(hits) != 1:
            raise _Usage(f"--build-id {build_id}: {len(hits)} targets match")
        return hits[0]
    if len(models.targets) != 1:
        raise _Usage(f"the model has {len(models.targets)} targets; choose one with --build-id")
    return next(iter(models.targets.values()))


def cmd_model_show(args: argparse.Namespace) -> int:
    models = _load_existing(args.file)
    if args.json:
        print(json.dumps(models.to_dict(), indent=1))
        return 0
    for bid in sorted(models.targets):
        m = models.targets[bid]
        syscalls = "all" if m.syscalls is None else ",".join(sorted(m.syscalls))
        print(f"target {m.path or '?'}  build-id {bid}")
        print(f"  runs {m.runs} (with transitions {m.runs_with_transitions})  samples {m.samples}  "
              f"incomplete skipped {m.incomplete_skipped}  syscalls {syscalls}  contexts {len(m.contexts)}  "
              f"transitions {len(m.transitions)}")
        for i, rule in enumerate(m.allow_rules):
            print(f"  allow rule {i}: {rule.syscall} from {' > '.join(map(str, rule.prefix))}"
                  + (f"  # {rule.comment}" if rule.comment else ""))
        if args.edges:
            edges = m.edges()
            print(f"  call edges {len(edges)} (what --granularity edges accepts, per syscall)")
            for (syscall, edge), n in sorted(edges.items(), key=_edge_order):
                print(f"  {syscall:<16} {edge_text(edge, syscall, m.modules)}  count {n}")
            continue
        for i, key in enumerate(m.ordered_contexts()):
            st = m.contexts[key]
            print(f"  [{i}] {key[0]}  count {st.count}")
            for line in iter_frames_text(key[1], m.modules):
                print(f"        {line}")
    return 0


def _edge_order(item: tuple[tuple[str, EdgeKey], int]) -> tuple[str, str, str, str, str]:
    (syscall, (caller, callee)), _ = item
    return (syscall, "" if caller is None else caller[1], "" if caller is None else caller[2] or "",
            "" if callee is None else callee[1], "" if callee is None else callee[0])


def _edit(path: str, edit: Any) -> None:
    with locked(path):
        models = _load_existing(path)
        edit(models)
        save_models(path, models)


def cmd_model_remove(args: argparse.Namespace) -> int:
    def edit(models: ModelSet) -> None:
        m = _pick(models, args.build_id)
        ordered = m.ordered_contexts()
        for i in sorted(set(args.id), reverse=True):
            if not 0 <= i < len(ordered):
                raise _Usage(f"no context [{i}] (the model has {len(ordered)}; see `ccprofd model show`)")
            m.remove_context(ordered[i])

    _edit(args.file, edit)
    return 0


def cmd_model_allow(args: argparse.Namespace) -> int:
    try:
        prefix = tuple(FramePattern.parse(p) for p in args.prefix.split(",") if p.strip())
    except ModelError as exc:
        raise _Usage(str(exc)) from None
    if not prefix:
        raise _Usage("--prefix needs at least one frame (FUNCTION or FUNCTION@0xCALLSITE, outermost first)")

    def edit(models: ModelSet) -> None:
        _pick(models, args.build_id).add_allow_rule(AllowRule(args.syscall, prefix, args.comment or ""))

    _edit(args.file, edit)
    return 0


def cmd_model_merge(args: argparse.Namespace) -> int:
    delta = ModelSet()
    for src in args.inputs:
        delta.merge(_load_existing(src))
    try:
        merge_into(args.output, delta)
    except ModelFileError as exc:
        raise _Usage(str(exc)) from None
    return 0


# ------------------------------------------------------------------------------------ parser
def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def _sample_hz(text: str) -> int:
    from ccprofd.kbpf.features import sample_hz_over_limit

    try:
        hz = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if hz < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    over = sample_hz_over_limit(hz)
    if over is not None:
        raise argparse.ArgumentTypeError(over)
    return hz


def _source_args(p: argparse.ArgumentParser) -> None:
    from ccprofd.tracing.api import DEFAULT_MODE, MODES

    p.add_argument("--syscalls", metavar="LIST|all", default=None,
                   help="comma-separated syscall names to model (default: all)")
    p.add_argument("--mode", choices=MODES, default=DEFAULT_MODE,
                   help=f"tracer mode for -- CMD (default {DEFAULT_MODE}); contexts are the same in both")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="analysis cache directory")
    p.add_argument("--watch-ia32", action="store_true",
                   help="unwind mode, with --syscalls: also sample every ia32 syscall (int $0x80 in a "
                        "64-bit process) as ia32:NAME, which a set's per-syscall events never see; "
                        "detect judges them like any call (a model allows one only if it learned that "
                        "context). Every syscall of the machine pays a short raw_syscalls program")
    p.add_argument("--samples", metavar="FILE", default=None,
                   help="read decoded samples from a `ccprofd trace --format jsonl` file ('-': stdin) "
                        "instead of tracing a command")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                   help="the command to run traced")


def _check_source(args: argparse.Namespace) -> None:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    args.command = cmd
    if bool(cmd) == (args.samples is not None):
        raise _Usage("give either -- CMD [ARGS...] or --samples FILE")
    if getattr(args, "watch_ia32", False) and (args.samples is not None or args.mode != "unwind"):
        raise _Usage("--watch-ia32 needs -- CMD in --mode unwind")


def _run(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            if hasattr(args, "command") and isinstance(args.command, list):
                _check_source(args)
            return int(func(args))
        except (_Usage, ModelError) as exc:
            raise UsageError(str(exc)) from None
        except _Unavailable as exc:
            print(f"ccprofd: {exc}", file=sys.stderr)
            return 1

    return run


def add_commands(sub: Any) -> None:
    """Register learn, detect and model on cli.py's sub-parser collection."""
    le = sub.add_parser(
        "learn", help="learn the (syscall, calling context) pairs of a program into a model file",
        description="Trace a command (or read samples) and merge every (syscall, exact calling context) "
                    "pair it makes into the model FILE (per target build-id). Repeatable: runs merge. "
                    "The file is written atomically and at least every --flush-interval seconds.")
    le.add_argument("--model", required=True, metavar="FILE", help="model file (created if missing)")
    le.add_argument("--transitions", action="store_true",
                    help="also learn per-thread transitions between consecutive (syscall, context) pairs")
    le.add_argument("--flush-interval", type=_positive_float, default=5.0, metavar="SECONDS",
                    help="merge into FILE at least this often while learning (default 5)")
    le.add_argument("--sample-hz", type=_sample_hz, default=0, metavar="N",
                    help="also take CPU samples at N Hz while tracing -- CMD: the calls they show "
                         "executing are evidence for `detect --granularity routines` (a path seen "
                         "running, not only seen making syscalls); default 0, none")
    _source_args(le)
    le.set_defaults(func=_run(cmd_learn))

    de = sub.add_parser(
        "detect", help="report syscalls made from calling contexts a model has not seen",
        description="Trace a command (or read samples) and write one JSON alert per line for each "
                    "(syscall, context) pair not in the model. Exit status: the command's.")
    de.add_argument("--model", required=True, metavar="FILE", help="model file written by `ccprofd learn`")
    de.add_argument("--output", metavar="FILE", default=None,
                    help="append alerts to FILE (default: standard error)")
    de.add_argument("--collapse-recursion", action="store_true",
                    help="collapse repeated recursive cycles before lookup")
    de.add_argument("--granularity", choices=GRANULARITIES, default="exact",
                    help="exact: alert on every context not learned as a whole; edges: accept a context "
                         "whose every call edge (caller function at a call site -> callee) was learned "
                         "for the syscall, and name the unseen edge otherwise; routines: as edges, and "
                         "also accept one new call into a routine learned making the syscall from 2 or "
                         "more call sites, from a call path learned for any syscall (or seen running by "
                         "`learn --sample-hz` CPU samples) [exact]")
    de.add_argument("--prefix-match", choices=PREFIX_MATCHES, default="sites",
                    help="--granularity routines: a call before the shared routine's counts as seen when "
                         "the caller called the callee at this call site (sites), or at any call site "
                         "(functions: accepts a rarely run site of a known call, which CPU samples may "
                         "miss; an attack that only changes the call site of a known call is accepted "
                         "too) [sites]")
    de.add_argument("--transitions", action="store_true",
                    help="also alert on unseen transitions (model must be learned with --transitions)")
    de.add_argument("--min-count", type=int, default=1, metavar="N",
                    help="contexts learned fewer than N times count as unseen (default 1)")
    de.add_argument("--alert-interval", type=float, default=60.0, metavar="SECONDS",
                    help="repeat the same alert at most once per interval (default 60; 0: always)")
    de.add_argument("--enforce", action="store_true",
                    help="also kill the target at a syscall made from a context outside the model. "
                         "--mode unwind (the default): the unwinder checks every traced syscall at "
                         "syscall entry and sends SIGKILL (the killed syscall itself still completes); "
                         "no frame pointers needed. --mode instrumented: open, exec and connect only, "
                         "keyed by a frame-pointer walk (BPF LSM -EPERM where loadable, else SIGKILL)")
    _source_args(de)
    de.set_defaults(func=_run(cmd_detect))

    mo = sub.add_parser("model", help="inspect and edit anomaly model files",
                        description="Show, edit and merge model files written by `ccprofd learn`.")
    msub = mo.add_subparsers(dest="model_command", metavar="ACTION", required=True,
                             parser_class=sub._parser_class)
    sh = msub.add_parser("show", help="list targets and contexts with symbolised frames")
    sh.add_argument("file", metavar="FILE", help="model file")
    sh.add_argument("--json", action="store_true", help="print the model file's JSON (the export format)")
    sh.add_argument("--edges", action="store_true",
                    help="list the call edges per syscall (derived from the contexts), not the contexts")
    sh.set_defaults(func=_run(cmd_model_show))
    rm = msub.add_parser("remove", help="forget contexts by their number in `model show`")
    rm.add_argument("file", metavar="FILE", help="model file (rewritten atomically)")
    rm.add_argument("--id", type=int, action="append", required=True, metavar="N",
                    help="context number as `model show` lists it (repeatable)")
    rm.add_argument("--build-id", default=None, help="target (prefix of its build-id) when FILE has several")
    rm.set_defaults(func=_run(cmd_model_remove))
    al = msub.add_parser("allow", help="allow a syscall from every context starting with a prefix")
    al.add_argument("file", metavar="FILE", help="model file (rewritten atomically)")
    al.add_argument("--syscall", required=True, help="syscall name, or '*' for any")
    al.add_argument("--prefix", required=True, metavar="FRAMES",
                    help="comma-separated frames, outermost first: FUNCTION or FUNCTION@0xCALLSITE")
    al.add_argument("--comment", default="", help="note kept with the rule in the model")
    al.add_argument("--build-id", default=None, help="target (prefix of its build-id) when FILE has several")
    al.set_defaults(func=_run(cmd_model_allow))
    me = msub.add_parser("merge", help="merge model files (runs, hosts) into OUTPUT")
    me.add_argument("output", metavar="OUTPUT", help="merged model file to write")
    me.add_argument("inputs", nargs="+", metavar="INPUT", help="model files to merge")
    me.set_defaults(func=_run(cmd_model_merge))

