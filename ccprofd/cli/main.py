"""``ccprofd``: the daemon and its tools (analyze now; trace, learn, detect and run as they land).

Exit status convention for every command: 0 success, 2 bad input or usage, 1 other failure;
commands that run a child pass its exit status through and use 125 when ccprofd fails mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ccprofd import __version__
from ccprofd.cli.errors import UsageError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_MIDRUN = 125


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _progress_printer() -> Any:
    if not sys.stderr.isatty():
        return None

    def show(stage: str, done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\r{stage}: {done}/{total} functions", end=end, file=sys.stderr, flush=True)

    return show


# ------------------------------------------------------------------------------------- analyze
def cmd_analyze(args: argparse.Namespace) -> int:
    from ccprofd.callgraph import analyze_binary, graph_stats

    graph = analyze_binary(args.binary, cache_dir=args.cache_dir, use_cache=not args.no_cache,
                           progress=_progress_printer())
    stats: dict[str, Any] = graph_stats(graph)
    if args.encoding:
        from ccprofd.encode.report import encoding_report

        schemes = ["valence", "pcce", "hcce"] if args.encoding == "all" else [args.encoding]
        stats["encodings"] = encoding_report(graph, schemes)
    if args.json:
        print(json.dumps(stats))
    else:
        _print_table(stats)
    return EXIT_OK


def _print_table(stats: dict[str, Any]) -> None:
    rows = [(k, v) for k, v in stats.items() if k != "encodings"]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.replace('_', ' '):<{width}}  {v}")
    for scheme, rep in stats.get("encodings", {}).items():
        print(f"\nencoding {scheme}:")
        for k, v in rep.items():
            print(f"  {k.replace('_', ' '):<{width}}  {v}")


# --------------------------------------------------------------------------------------- trace
def cmd_trace(args: argparse.Namespace) -> int:
    """``ccprofd trace``: calling contexts at each syscall of ``-- CMD`` or ``-p PID``."""
    from ccprofd.export.jsonl import writer_for
    from ccprofd.tracing.api import DEFAULT_MODE, TraceError, TraceOptions
    from ccprofd.tracing.session import attach_session, open_session, run

    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    pids = list(args.pid or [])
    if bool(command) == bool(pids):
        raise UsageError("give exactly one of -p PID (repeatable) and -- CMD [ARGS...]")
    if args.sample_hz < 0:
        raise UsageError("--sample-hz must be positive")
    from ccprofd.kbpf.features import privileges_problem, sample_hz_over_limit

    over = sample_hz_over_limit(args.sample_hz)
    if over is not None:
        raise UsageError(f"--sample-hz {over}")
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be a positive number of seconds")
    syscalls = _trace_expression(args.expr, args.syscalls)
    mode = args.mode or ("instrumented" if args.scope else DEFAULT_MODE)
    if args.scope and mode != "instrumented":
        raise UsageError("--scope needs --mode instrumented (unwind mode always sees the whole stack)")
    if (args.edge_weights or args.save_edge_weights) and mode != "instrumented":
        raise UsageError("--edge-weights and --save-edge-weights need --mode instrumented")
    if args.watch_ia32 and mode != "unwind":
        raise UsageError("--watch-ia32 needs --mode unwind")
    options = TraceOptions(mode=mode, syscalls=syscalls, encoding=args.encoding, scope=args.scope,
                           sample_hz=args.sample_hz, verify=args.verify,
                           cache_dir=str(args.cache_dir) if args.cache_dir else None,
                           edge_weights=args.edge_weights, save_edge_weights=args.save_edge_weights,
                           retval=args.format == "text" if args.retval is None else args.retval,
                           source_lines=(args.format == "text" if args.source_lines is None
                                         else args.source_lines),
                           watch_ia32=args.watch_ia32,
                           # nothing in `trace` reads the flight recorder (GetHistory, alerts): not
                           # built, which saves its map and half the unwinder's verification
                           history=0)
    problem = privileges_problem()
    if problem is not None:
        print(f"ccprofd: {problem}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stderr  # noqa: SIM115
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror}") from None
    writer = writer_for(args.format, out, timestamps=args.timestamps)
    if args.format == "jsonl":  # the hot path the compiled helpers are for (scripts/build_ext.sh)
        from ccprofd.decode import valence
        from ccprofd.export import jsonl

        helpers = [("export/cjsonl.c", jsonl.cjsonl), ("decode/cvalence.c", valence.cvalence)]
        if mode == "unwind":  # its sampler's module is loaded for the trace anyway
            from ccprofd.tracing.unwind import sampler

            helpers.append(("tracing/unwind/chits.c", sampler.chits))
        missing = [name for name, mod in helpers if mod is None]
        if missing:
            print(jsonl.COMPILED_MISSING_NOTE.format(", ".join(missing)), file=sys.stderr)
    from ccprofd.kbpf.rawmodule import close_tracepoints_in_background

    close_tracepoints_in_background()  # we exit right after detaching: do not wait for RCU
    try:
        try:
            session = open_session(command, options=options) if command else attach_session(pids, options)
        except TraceError as exc:
            raise UsageError(str(exc)) from None
        return run(session, writer, launched=bool(command), duration=args.duration)
    finally:
        if out is not sys.stderr:
            out.close()


def _trace_expression(expr: str | None, syscalls: str | None) -> str:
    """The syscall list of strace's ``-e trace=LIST`` (or ``-e LIST``) and/or ``--syscalls``."""
    if expr is None:
        return syscalls or "all"
    qualifier, sep, value = expr.partition("=")
    if not sep:
        qualifier, value = "trace", expr
    if qualifier not in ("trace", "t"):
        raise UsageError(f"-e {expr}: only -e trace=LIST is supported (syscall names and the classes "
                         "%file, %network, %process, %memory)")
    if syscalls is not None:
        raise UsageError("give the syscalls once: -e trace=LIST or --syscalls LIST")
    return value or "all"


# ---------------------------------------------------------------------------------------- main
# Commands registered here; the others (learn, detect, model, run, install-service) import their
# modules to register, which costs ~0.1 s of start-up that `ccprofd trace` does not need.
_OWN_COMMANDS = ("analyze", "trace")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; ``command`` (one of :data:`_OWN_COMMANDS`, the first argument): only what
    parsing that command needs."""
    parser = _Parser(
        prog="ccprofd",
        description="Calling-context profiler daemon: which exact chain of calls reached each syscall "
                    "or CPU sample of a native x86-64 program, without recompiling it.",
        epilog="Exit status: 0 success, 2 bad input or usage, 1 other failure. "
               "See the README (man-page style) for every command.")
    parser.add_argument("--version", action="version", version=f"ccprofd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    an = sub.add_parser(
        "analyze", help="static call graph and encoding statistics of an ELF binary",
        description="Disassemble an x86-64 ELF executable or shared object, build its static call graph "
                    "(functions from symbols and .eh_frame, direct/PLT/tail/indirect call sites, "
                    "address-taken functions, roots) and print Table-1-style statistics. Results are "
                    "cached by build-id.")
    an.add_argument("binary", metavar="BINARY", help="path of the ELF file to analyse")
    an.add_argument("--json", action="store_true", help="print one JSON object (stable key names)")
    an.add_argument("--encoding", choices=["valence", "pcce", "hcce", "all"],
                    help="also compute the calling-context encoding(s) and report their sizes")
    an.add_argument("--cache-dir", type=_path_arg, default=None,
                    help="analysis cache directory (default: $CCPROFD_CACHE_DIR or ~/.cache/ccprofd)")
    an.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    an.set_defaults(func=cmd_analyze)
    if command == "analyze":  # a cache hit is ~0.1 s in all: the trace parser and its imports are not
        return parser

    from ccprofd.tracing.api import MODES


    tr = sub.add_parser(
        "trace", help="calling context of every syscall of a command or process (like strace -k)",
        description="Run CMD (or attach to PID) with calling-context probes and report, for every selected "
                    "syscall, the exact chain of calls of the analysed binary that reached it. The command's "
                    "stdin/stdout/stderr and exit status pass through; samples go to --output or stderr.",
        epilog="Exit status: the command's own (128+N if killed by signal N); 125 if ccprofd fails while "
               "the command runs; 2 for bad input; 1 if tracing cannot start.")
    tr.add_argument("--mode", choices=MODES, default=None,
                    help="how contexts are obtained: unwind (default; BPF unwinds with .eh_frame at each "
                         "sample) or instrumented (uprobes keep the context; the default with --scope)")
    tr.add_argument("--syscalls", default=None, metavar="LIST",
                    help="comma-separated syscall names to sample, or 'all' (default); strace's classes "
                         "%%file, %%network, %%process and %%memory stand for their syscalls")
    tr.add_argument("-e", dest="expr", metavar="trace=LIST",
                    help="strace's spelling of --syscalls: -e trace=write,%%file (or -e write)")
    tr.add_argument("-f", dest="follow_forks", action="store_true",
                    help="accepted for strace habits: forks and threads are always followed")
    tr.add_argument("-tt", dest="timestamps", action="store_const", const="tt", default=None,
                    help="text format: start each sample with the wall-clock time, HH:MM:SS.microseconds")
    tr.add_argument("-ttt", dest="timestamps", action="store_const", const="ttt",
                    help="text format: start each sample with seconds since the epoch, with microseconds")
    tr.add_argument("--duration", type=float, metavar="SECONDS",
                    help="stop after SECONDS as on SIGTERM: an attached process is detached and left "
                         "running; a command is sent SIGTERM (as timeout(1) does) and its status returned")
    tr.add_argument("--format", choices=["text", "jsonl"], default="text",
                    help="output format (default text)")
    tr.add_argument("--output", "-o", metavar="FILE", help="write samples to FILE instead of stderr")
    tr.add_argument("--retval", action=argparse.BooleanOptionalAction, default=None,
                    help="join each syscall sample to its return value ('= 22', '= ?' when it never "
                         "returned), at the cost of one more BPF run and record per traced syscall "
                         "(default: on in text format, off in jsonl)")
    tr.add_argument("--source-lines", action=argparse.BooleanOptionalAction, default=None,
                    help="give frames their source file:line and inlined calls from DWARF (the module's "
                         "or its separate debug file's, e.g. libc6-dbg's), read as frames first appear: "
                         "~0.2 s at libc's first frame, ~40 ms per further compile unit (default: on in "
                         "text format, off in jsonl)")
    tr.add_argument("--watch-ia32", action="store_true",
                    help="unwind mode: also sample every ia32 syscall (int $0x80 in a 64-bit process) "
                         "whatever --syscalls says, as ia32:NAME; a set's per-syscall events never see "
                         "them. Adds a program on raw_syscalls:sys_enter that every syscall of the "
                         "machine runs (README, \"How the syscalls are attached\")")
    tr.add_argument("--encoding", choices=["valence", "pcce", "hcce"], default="valence",
                    help="calling-context encoding of instrumented mode (unwind mode: valence only)")
    tr.add_argument("--scope", metavar="FUNCTION_REGEX",
                    help="instrument only the call graph below functions whose name matches")
    tr.add_argument("--sample-hz", type=int, default=0, metavar="N", help="also take CPU samples at N Hz")
    tr.add_argument("--verify", action="store_true",
                    help="cross-check each sample: unwind mode re-encodes its stack with the reference "
                         "encoder; instrumented mode compares it with a frame-pointer walk (bpf_get_stack, "
                         "up to 127 frames; skipped for binaries without frame pointers). Counts at exit")
    tr.add_argument("--edge-weights", metavar="FILE",
                    help="instrumented mode: build the plan with the call counts in FILE (from "
                         "--save-edge-weights on the same binary); hot edges get the zero code, no probe")
    tr.add_argument("--save-edge-weights", metavar="FILE",
                    help="instrumented mode, profiling run: also count calls on every direct call site of "
                         "the binary (slow: one probe hit per call) and write the counts to FILE at exit")
    tr.add_argument("--cache-dir", type=_path_arg, default=None, help="analysis cache directory")
    tr.add_argument("-p", "--pid", type=int, action="append", metavar="PID",
                    help="attach to the running process PID; repeat for several processes of the same "
                         "executable")
    tr.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                    help="the command to run traced")
    tr.set_defaults(func=cmd_trace)
    if command in _OWN_COMMANDS:
        return parser

    from ccprofd.cli.history import add_command as add_history_command

    add_history_command(sub)
    if command == "history":
        return parser

    from ccprofd.cli.anomaly import add_commands as add_anomaly_commands

    add_anomaly_commands(sub)

    from ccprofd.cli.daemon import add_daemon_commands

    add_daemon_commands(sub)  # run, install-service
    return parser


def _path_arg(value: str) -> Any:
    from pathlib import Path

    return Path(value)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_in[0] if args_in else None)
    args = parser.parse_args(args_in)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from ccprofd.elf.errors import BinaryError
    from ccprofd.kbpf.errors import BPFError

    try:
        return int(args.func(args))
    except (BinaryError, UsageError) as exc:
        print(f"ccprofd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BPFError as exc:
        text = str(exc)
        print(text if text.startswith("ccprofd:") else f"ccprofd: {text}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # before the tracer's own handlers were installed (start-up)
        print("ccprofd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output closed early (e.g. piped to head): not an error worth a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:
        print(f"ccprofd: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
