"""Bash completion and man pages generated from the argparse parsers of ``ccprofd`` and
``ccprofctl``, so they cannot drift from the commands: ``scripts/setup.sh`` runs
``python -m ccprofd.cli.docgen bash-completion ccprofd`` (and ``man ccprofd``, ...) at install time
and the tests compare what they list with the parsers.

The completion script needs bash only (not the bash-completion package's helpers): it walks
``COMP_WORDS`` like argparse does (options that take a value skip their value, a word naming a
subcommand descends into it, ``--`` ends option parsing) and offers the current level's
subcommands, options, an option's choices, files for file arguments and pids for PID arguments.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ccprofd import __version__
from ccprofd.cli.mdroff import readme_section

# Values completed with file names / process ids: decided by the argument's metavar or dest.
_FILE_WORDS = ("FILE", "DIR", "OUTPUT", "INPUT", "BINARY", "PATH", "CACHE_DIR", "UNIT_DIR", "CONFIG_DIR",
               "EXECUTABLE", "CONFIG", "SOCKET", "TLS_CA", "TLS_CERT", "TLS_KEY")
_PID_WORDS = ("PID",)


@dataclass
class Option:
    flags: list[str]
    takes_value: bool
    choices: list[str]
    metavar: str
    help: str


@dataclass
class Level:
    """One parser: its options, positionals (metavar, help) and subcommands (name -> Level)."""

    path: tuple[str, ...]
    usage: str
    description: str
    help: str = ""
    epilog: str = ""
    options: list[Option] = field(default_factory=list)
    positionals: list[tuple[str, str]] = field(default_factory=list)
    commands: dict[str, Level] = field(default_factory=dict)
    remainder: bool = False  # takes "-- CMD [ARGS...]"

    def walk(self) -> Iterator[Level]:
        yield self
        for sub in self.commands.values():
            yield from sub.walk()


def describe(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), help_: str = "") -> Level:
    """The parser as a tree of :class:`Level` (hidden options left out)."""
    fmt = parser._get_formatter()
    usage = " ".join(parser.format_usage().split())
    usage = usage[len("usage: "):] if usage.startswith("usage: ") else usage
    level = Level(path, usage, parser.description or "", help_, parser.epilog or "")
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        text = " ".join(fmt._expand_help(action).split()) if action.help else ""
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                level.commands[name] = describe(sub, (*path, name), helps.get(name, ""))
        elif action.option_strings:
            metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
            level.options.append(Option(list(action.option_strings), action.nargs != 0,
                                        [str(c) for c in action.choices or ()], metavar, text))
        elif action.nargs == argparse.REMAINDER:
            level.remainder = True
            level.positionals.append((str(action.metavar or action.dest), text))
        else:
            level.positionals.append((str(action.metavar or action.dest.upper()), text))
    return level


def _value_kind(metavar: str, choices: Sequence[str]) -> str:
    if choices:
        return "choices"
    word = metavar.upper().replace("-", "_")
    if word in _PID_WORDS:
        return "pid"
    if word in _FILE_WORDS or word.endswith(("FILE", "_DIR")):
        return "file"
    return "none"


def _option_value_kind(opt: Option) -> str:
    kind = _value_kind(opt.metavar, opt.choices)
    if kind == "none":  # metavar-less options: decide by the long flag (--cache-dir, --unit-dir)
        long = max(opt.flags, key=len).lstrip("-").upper().replace("-", "_")
        kind = _value_kind(long, ())
    return kind


# ---------------------------------------------------------------------------------- bash
def bash_completion(prog: str, root: Level) -> str:
    """A bash script defining ``_PROG`` and registering it with ``complete -F``."""
    fn = "_" + re.sub(r"\W", "_", prog)
    levels = list(root.walk())
    lines = [
        f"# bash completion for {prog} {__version__}; generated from its argparse parser by",
        f"# `python -m ccprofd.cli.docgen bash-completion {prog}` (do not edit).",
        f"{fn}() {{",
        "    local cur=${COMP_WORDS[COMP_CWORD]} path='' word value=0 i dashdash=0 npos=0",
        "    local subs opts valopts",
        f"    {fn}_level() {{",
        '        case "$1" in',
    ]
    for lv in levels:
        valued = [f for o in lv.options if o.takes_value for f in o.flags]
        flags = [f for o in lv.options for f in o.flags]
        lines += [f"            {_sq(' '.join(lv.path))})",
                  f"                subs={_sq(' '.join(lv.commands))}; opts={_sq(' '.join(flags))}",
                  f"                valopts={_sq(' ' + ' '.join(valued) + ' ')} ;;"]
    lines += ["            *) subs=''; opts=''; valopts=' ' ;;", "        esac", "    }",
              f"    {fn}_values() {{  # completions of the value of option $2 at level $1",
              '        case "$1|$2" in']
    for lv in levels:
        for o in lv.options:
            if not o.takes_value:
                continue
            kind = _option_value_kind(o)
            action = {"choices": f"compgen -W {_sq(' '.join(o.choices))} -- \"$cur\"",
                      "file": 'compgen -f -- "$cur"',
                      "pid": "compgen -W \"$(ls /proc | grep -E '^[0-9]+$')\" -- \"$cur\"",
                      "none": ":"}[kind]
            pats = "|".join(_sq(f"{' '.join(lv.path)}|{f}") for f in o.flags)
            lines.append(f"            {pats}) {action} ;;")
    lines += ["        esac", "    }",
              f"    {fn}_positional() {{  # completions of positional argument $2 at level $1",
              '        case "$1|$2" in']
    for lv in levels:
        for n, (metavar, _) in enumerate(p for p in lv.positionals if not lv.remainder or
                                         not p[0].startswith("--")):
            kind = _value_kind(metavar, ())
            if kind != "none":
                action = 'compgen -f -- "$cur"' if kind == "file" else \
                    "compgen -W \"$(ls /proc | grep -E '^[0-9]+$')\" -- \"$cur\""
                lines.append(f"            {_sq(' '.join(lv.path) + '|' + str(n))}) {action} ;;")
    lines += [
        "        esac",
        "    }",
        f'    {fn}_level ""',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        word=${COMP_WORDS[i]}',
        "        if ((dashdash)); then dashdash=$((dashdash + 1)); continue; fi",
        "        if ((value)); then value=0; continue; fi",
        '        if [[ $word == -- ]]; then dashdash=1; continue; fi',
        '        if [[ $word == -* ]]; then',
        '            [[ $word != *=* && $valopts == *" $word "* ]] && value=1',
        "            continue",
        "        fi",
        '        if [[ " $subs " == *" $word "* ]]; then',
        '            path=${path:+$path }$word; npos=0',
        f'            {fn}_level "$path"',
        "            continue",
        "        fi",
        "        npos=$((npos + 1))",
        "    done",
        "    COMPREPLY=()",
        "    if ((dashdash == 1)); then",
        '        COMPREPLY=($(compgen -c -- "$cur"))',
        "    elif ((dashdash > 1)); then",
        '        COMPREPLY=($(compgen -f -- "$cur"))',
        "    elif ((value)); then",
        f'        COMPREPLY=($({fn}_values "$path" "${{COMP_WORDS[COMP_CWORD - 1]}}"))',
        '    elif [[ $cur == -* ]]; then',
        '        COMPREPLY=($(compgen -W "$opts" -- "$cur"))',
        '    elif [[ -n $subs ]]; then',
        '        COMPREPLY=($(compgen -W "$subs" -- "$cur"))',
        "    else",
        f'        COMPREPLY=($({fn}_positional "$path" "$npos"))',
        "    fi",
        "}",
        f"complete -o filenames -F {fn} {prog}",
        "",
    ]
    return "\n".join(lines)


def _sq(text: str) -> str:
    """A bash single-quoted word."""
    return "'" + text.replace("'", "'\\''") + "'"


# ---------------------------------------------------------------------------------- roff
def _roff(text: str) -> str:
    """Text for a roff line: backslashes and minus signs escaped (options copy-paste as ASCII),
    a leading control character neutralised."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + out if out.startswith((".", "'")) else out


@dataclass(frozen=True)
class ManExtra:
    """The parts of a page that are not in the parser: sections and their roff bodies."""

    title: str
    sections: tuple[tuple[str, str], ...]
    see_also: str
    description: str | None = None  # the README's DESCRIPTION (roff), after the parser's
    exit_status: str | None = None  # the README's EXIT STATUS (roff), instead of the parser's epilog


def man_page(prog: str, section: int, root: Level, extra: ManExtra) -> str:
    name_line = root.description.split(": ", 1)[0].split(". ", 1)[0].rstrip(".")
    out = [f'.\\" Generated from the argparse parser by `python -m ccprofd.cli.docgen man {prog}`.',
           f'.TH {prog.upper()} {section} "" "{prog} {__version__}" "{extra.title}"',
           ".nh", ".ad l",  # no hyphenation, ragged right: options and values stay whole
           ".SH NAME", f"{prog} \\- {_roff(name_line)}",
           ".SH SYNOPSIS"]
    for lv in root.walk():
        if lv is root or not lv.commands:
            out += [".PP", _roff(lv.usage)]
    out += [".SH DESCRIPTION", _roff(root.description)]
    if extra.description:
        out += [".PP", extra.description]
    out += _options(root.options, "OPTIONS", ".SH")
    if root.commands:
        out.append(".SH COMMANDS")
        for lv in root.walk():
            if lv is root:
                continue
            out += [f'.SS "{_roff(" ".join(lv.path))}"', _roff(lv.description or lv.help)]
            if lv.commands:
                out += [".PP", "Actions: " + ", ".join(f"\\fB{_roff(c)}\\fR" for c in lv.commands) + "."]
            for metavar, text in lv.positionals:
                out += [".TP", f"\\fI{_roff(metavar)}\\fR", _roff(text or "(argument)")]
            out += _options(lv.options, "", "")
            if lv.epilog:
                out += [".PP", _roff(lv.epilog)]
    if extra.exit_status:
        out += [".SH EXIT STATUS", extra.exit_status]
    elif root.epilog:
        out += [".SH EXIT STATUS", _roff(root.epilog)]
    for heading, body in extra.sections:
        out += [f".SH {heading}", body]
    out += [".SH SEE ALSO", extra.see_also, ""]
    return "\n".join(out)


def _options(options: list[Option], heading: str, macro: str) -> list[str]:
    shown = [o for o in options if "--help" not in o.flags]
    if not shown:
        return []
    out = [f"{macro} {heading}"] if macro else [".PP", "Options:"]
    for o in shown:
        value = ""
        if o.takes_value:
            value = " \\fI" + _roff("{" + ",".join(o.choices) + "}" if o.choices else o.metavar) + "\\fR"
        flags = ", ".join(f"\\fB{_roff(f)}\\fR" + value for f in o.flags)
        out += [".TP", flags, _roff(o.help or "(no description)")]
    return out


def _config_schema() -> str:
    """The configuration schema, from :mod:`ccprofd.daemon.config`'s docstring (one source)."""
    from ccprofd.daemon import config

    doc = config.__doc__ or ""
    schema = doc.split("Schema (defaults in brackets)::", 1)[-1]
    body = "\n".join(_roff(line[4:] if line.startswith("    ") else line)
                     for line in schema.strip("\n").splitlines())
    return ("The daemon reads a TOML file (default \\fI/etc/ccprofd/ccprofd.toml\\fR), validated "
            "completely at start and on reload (SIGHUP); an error names the file, line and key, an "
            "unknown key is an error. Keys and defaults:\n.PP\n.nf\n.in +2n\n" + body + "\n.in\n.fi")


def _readme_sections(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """(man section, README heading) pairs as (heading, roff body), those the README has."""
    out = []
    for man_heading, readme_heading in pairs:
        body = readme_section(readme_heading, top_level=1)
        if body:
            out.append((man_heading, body))
    return tuple(out)


def _extras(prog: str) -> ManExtra:
    if prog == "ccprofd":
        files = readme_section("FILES", top_level=1)
        return ManExtra("System Administration", (
            *_readme_sections(("COMMANDS IN DETAIL", "COMMANDS")),
            ("CONFIGURATION", _config_schema()),
            ("ENVIRONMENT", ".TP\n.B CCPROFD_CACHE_DIR\nAnalysis cache of \\fBanalyze\\fR and "
                            "\\fBtrace\\fR (default \\fI~/.cache/ccprofd\\fR)."),
            ("FILES", ".TP\n.I /etc/ccprofd/ccprofd.toml\nThe daemon's configuration.\n"
                      ".TP\n.I /var/lib/ccprofd\nState: analysis and plan cache, anomaly models.\n"
                      ".TP\n.I /run/ccprofd/ccprofd.sock\nThe gRPC socket \\fBccprofctl\\fR(1) "
                      "connects to.\n.TP\n.I /etc/systemd/system/ccprofd.service\nThe unit "
                      "\\fBinstall\\-service\\fR writes." + (f"\n.PP\n{files}" if files else "")),
            *_readme_sections(("PERFORMANCE", "PERFORMANCE"), ("KNOWN LIMITS", "STATUS AND KNOWN LIMITS")),
        ), "\\fBccprofctl\\fR(1), \\fBstrace\\fR(1), \\fBsystemd.exec\\fR(5); the project's "
           "README, from which the DESCRIPTION and the sections after COMMANDS are generated.",
            description=readme_section("DESCRIPTION", top_level=1),
            exit_status=readme_section("EXIT STATUS", top_level=1))
    return ManExtra("User Commands", (
        *_readme_sections(("DETAILS", "ccprofd run (the daemon) and ccprofctl")),
        ("ENVIRONMENT", ".TP\n.B CCPROFD_SOCKET\nThe daemon's Unix socket (default "
                        "\\fI/run/ccprofd/ccprofd.sock\\fR)."),
    ), "\\fBccprofd\\fR(8); the project's README (DETAILS is generated from it).")


def parser_of(prog: str) -> argparse.ArgumentParser:
    if prog == "ccprofd":
        from ccprofd.cli.main import build_parser

        return build_parser()
    if prog == "ccprofctl":
        from ccprofd.cli.ctl import build_parser as build_ctl_parser

        return build_ctl_parser()
    raise SystemExit(f"docgen: unknown program {prog!r} (ccprofd or ccprofctl)")


SECTIONS = {"ccprofd": 8, "ccprofctl": 1}


#: Where ``install`` puts each file, below its root (bash-completion loads completions/NAME on
#: the first completion of NAME; /usr/local/share/man is in man-db's default path).
COMPLETION_DIR = "usr/share/bash-completion/completions"
MAN_DIR = "usr/local/share/man"


def generate(kind: str, prog: str) -> str:
    root = describe(parser_of(prog))
    if kind == "bash-completion":
        return bash_completion(prog, root)
    return man_page(prog, SECTIONS[prog], root, _extras(prog))


def install(root: Path) -> list[Path]:
    """Write both programs' completion and man page below ``root`` ("/" for the system)."""
    written = []
    for prog, section in SECTIONS.items():
        for kind, path in (("bash-completion", root / COMPLETION_DIR / prog),
                           ("man", root / MAN_DIR / f"man{section}" / f"{prog}.{section}")):
            _write(path, generate(kind, prog))
            written.append(path)
    return written


def _write(path: Path, text: str) -> None:
    from ccprofd.persist.atomicfile import atomic_write_bytes

    atomic_write_bytes(path, text.encode())
    path.chmod(0o644)  # read by every user's shell and man


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ccprofd.cli.docgen",
                                description="Write the bash completion or the man page of ccprofd or "
                                            "ccprofctl, or install all four below a root directory.")
    sub = p.add_subparsers(dest="kind", required=True)
    for kind in ("bash-completion", "man"):
        one = sub.add_parser(kind)
        one.add_argument("prog", choices=tuple(SECTIONS))
        one.add_argument("-o", "--output", type=Path, help="file to write (default stdout)")
    inst = sub.add_parser("install")
    inst.add_argument("--root", type=Path, default=Path("/"), help="install below this directory (default /)")
    args = p.parse_args(argv)
    try:
        if args.kind == "install":
            for path in install(args.root):
                print(path)
        elif args.output is None:
            sys.stdout.write(generate(args.kind, args.prog))
        else:
            _write(args.output, generate(args.kind, args.prog))
    except OSError as exc:
        print(f"docgen: {exc.filename or ''}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
