"""``ccprofd learn``, ``ccprofd detect`` and ``ccprofd model``: the anomaly detector without the daemon.

Samples come either from a traced command (``-- CMD [ARGS...]``, through the tracer's session API
once it is available) or from a JSONL file written by ``ccprofd trace --format jsonl`` (``--samples
FILE``).  Kept out of cli.py so that file stays a thin dispatcher; cli.py calls
:func:`add_commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from typing import IO, Any

from ccprofd.daemon.anomaly import (
    AllowRule,
    FramePattern,
    Learner,
    ModelError,
    ModelSet,
    TargetModel,
    iter_frames_text,
)
from ccprofd.daemon.detector import AlertWriter, Detector, DetectorOptions
from ccprofd.daemon.modelstore import (
    ModelFileError,
    PeriodicFlusher,
    load_models,
    locked,
    merge_into,
    save_models,
)


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


def _traced_command(argv: Sequence[str], syscalls: list[str] | None) -> Any:
    """The tracer's session for ``-- CMD`` (samples + the command's exit status)."""
    try:
        from ccprofd.daemon import tracer  # type: ignore[attr-defined]
    except ImportError:
        raise _Unavailable("tracing a command needs the tracer (ccprofd/daemon/tracer.py), which this build "
                     "does not have yet; record samples with `ccprofd trace --format jsonl` and pass "
                     "--samples FILE") from None
    if shutil.which(argv[0]) is None:
        raise _Usage(f"command not found: {argv[0]}")
    return tracer.open_session(list(argv), syscalls=syscalls)  # pragma: no cover - tracer not landed


# ------------------------------------------------------------------------------------- learn
def cmd_learn(args: argparse.Namespace) -> int:
    syscalls = _parse_syscalls(args.syscalls)
    _check_model_readable(args.model)
    if args.samples is None:
        session = _traced_command(args.command, syscalls)
        target = (session.build_id, session.path)
        _learn_stream(args, ((target, s) for s in session.samples()), syscalls)
        return int(session.wait())
    samples = [s for s in _read_jsonl(args.samples) if syscalls is None or s.get("syscall") in syscalls]
    _learn_stream(args, _by_target(samples), syscalls)
    return 0


def _learn_stream(args: argparse.Namespace, pairs: Iterator[tuple[tuple[str, str], dict[str, Any]]],
                  syscalls: list[str] | None) -> None:
    """Learn as samples arrive (never buffered: the periodic flush bounds what a kill loses)."""
    learners: dict[str, tuple[Learner, PeriodicFlusher]] = {}
    n = 0
    for (bid, path), s in pairs:
        entry = learners.get(bid)
        if entry is None:
            learner = Learner(TargetModel(bid, path), syscalls=syscalls, transitions=args.transitions)
            entry = learners[bid] = (learner, PeriodicFlusher(args.model, learner, args.flush_interval))
        entry[0].observe(s)
        entry[1].maybe_flush()
        n += 1
    for _, flusher in learners.values():
        flusher.flush()
    print(f"ccprofd: learned {n} samples of {len(learners)} target(s) into {args.model}", file=sys.stderr)


def _check_model_readable(path: str) -> None:
    try:
        load_models(path)
    except ModelFileError as exc:
        raise _Usage(f"{exc} — not touching it; move it away to start a new model") from None


# ------------------------------------------------------------------------------------ detect
def cmd_detect(args: argparse.Namespace) -> int:
    syscalls = _parse_syscalls(args.syscalls)
    try:
        models = load_models(args.model, missing_ok=False)
    except ModelFileError as exc:
        raise _Usage(str(exc)) from None
    opts = DetectorOptions(collapse_recursion=args.collapse_recursion, transitions=args.transitions,
                           min_count=args.min_count, alert_interval_seconds=args.alert_interval)
    with _alert_stream(args.output) as stream:
        writer = AlertWriter(stream)
        detectors: dict[str, Detector] = {}
        pairs: Iterator[tuple[tuple[str, str], dict[str, Any]]]
        session = None
        if args.samples is None:
            session = _traced_command(args.command, syscalls)
            target = (session.build_id, session.path)
            pairs = ((target, s) for s in session.samples())
        else:
            pairs = _by_target([s for s in _read_jsonl(args.samples)
                                if syscalls is None or s.get("syscall") in syscalls])
        for (bid, path), s in pairs:
            det = detectors.get(bid)
            if det is None:
                det = detectors[bid] = _detector_for(models, bid, path, opts)
            for alert in det.check(s):
                writer.write(alert)
    return int(session.wait()) if session is not None else 0


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
        for i, key in enumerate(m.ordered_contexts()):
            st = m.contexts[key]
            print(f"  [{i}] {key[0]}  count {st.count}")
            for line in iter_frames_text(key[1], m.modules):
                print(f"        {line}")
    return 0


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


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--syscalls", metavar="LIST|all", default=None,
                   help="comma-separated syscall names to model (default: all)")
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


def _run(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        from ccprofd.cli import UsageError

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
    de.add_argument("--transitions", action="store_true",
                    help="also alert on unseen transitions (model must be learned with --transitions)")
    de.add_argument("--min-count", type=int, default=1, metavar="N",
                    help="contexts learned fewer than N times count as unseen (default 1)")
    de.add_argument("--alert-interval", type=float, default=60.0, metavar="SECONDS",
                    help="repeat the same alert at most once per interval (default 60; 0: always)")
    _source_args(de)
    de.set_defaults(func=_run(cmd_detect))

    mo = sub.add_parser("model", help="inspect and edit anomaly model files",
                        description="Show, edit and merge model files written by `ccprofd learn`.")
    msub = mo.add_subparsers(dest="model_command", metavar="ACTION", required=True,
                             parser_class=sub._parser_class)
    sh = msub.add_parser("show", help="list targets and contexts with symbolised frames")
    sh.add_argument("file", metavar="FILE")
    sh.add_argument("--json", action="store_true", help="print the model file's JSON (the export format)")
    sh.set_defaults(func=_run(cmd_model_show))
    rm = msub.add_parser("remove", help="forget contexts by their number in `model show`")
    rm.add_argument("file", metavar="FILE")
    rm.add_argument("--id", type=int, action="append", required=True, metavar="N")
    rm.add_argument("--build-id", default=None, help="target (prefix of its build-id) when FILE has several")
    rm.set_defaults(func=_run(cmd_model_remove))
    al = msub.add_parser("allow", help="allow a syscall from every context starting with a prefix")
    al.add_argument("file", metavar="FILE")
    al.add_argument("--syscall", required=True, help="syscall name, or '*' for any")
    al.add_argument("--prefix", required=True, metavar="FRAMES",
                    help="comma-separated frames, outermost first: FUNCTION or FUNCTION@0xCALLSITE")
    al.add_argument("--comment", default="")
    al.add_argument("--build-id", default=None, help="target (prefix of its build-id) when FILE has several")
    al.set_defaults(func=_run(cmd_model_allow))
    me = msub.add_parser("merge", help="merge model files (runs, hosts) into OUTPUT")
    me.add_argument("output", metavar="OUTPUT")
    me.add_argument("inputs", nargs="+", metavar="INPUT")
    me.set_defaults(func=_run(cmd_model_merge))

