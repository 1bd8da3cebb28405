"""Bash completion and man pages generated from the argparse parsers (issue 17): the completion
script run by a real bash (and loaded by the real bash-completion loader) offers the commands'
real subcommands, options and choices; the man pages render with groff and man without a
warning and name every command and option.  Expected values come from the parsers themselves
(walked here with argparse's public behaviour: ``--help`` text is not used) and, for a few, by
hand."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_tool, skip_or_fail

from ccprofd.cli import docgen

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m ccprofd.cli.docgen install --root DIR``, as scripts/setup.sh runs it."""
    root = tmp_path_factory.mktemp("root")
    out = subprocess.run([sys.executable, "-m", "ccprofd.cli.docgen", "install", "--root", str(root)],
                         capture_output=True, text=True, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return root


def complete(script: Path, line: str) -> list[str]:
    """COMPREPLY of the completion function for the words of ``line`` (a trailing space: complete
    an empty word), in a bash without any other completion loaded."""
    words = shlex.split(line) + ([""] if line.endswith(" ") else [])
    prog = words[0]
    code = (f"source {shlex.quote(str(script))}; COMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); "
            f"COMP_CWORD={len(words) - 1}; _{prog}; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
    out = subprocess.run([require_tool("bash"), "--norc", "--noprofile", "-c", code], capture_output=True,
                         text=True, check=True, cwd="/")
    return [w for w in out.stdout.splitlines() if w]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def visible_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {f for a in parser._actions if a.help != argparse.SUPPRESS for f in a.option_strings}


def test_completion_lists_the_real_subcommands_and_options(installed: Path) -> None:
    comp = installed / docgen.COMPLETION_DIR
    # by hand (the README's command lists)
    assert complete(comp / "ccprofd", "ccprofd ") == ["analyze", "trace", "history", "learn", "detect",
                                                      "model", "run", "install-service"]
    assert complete(comp / "ccprofd", "ccprofd history --") == ["--help", "--tid", "--pid", "--last",
                                                                "--since", "--until", "--reverse", "--format"]
    assert complete(comp / "ccprofctl", "ccprofctl ") == ["targets", "contexts", "history", "hot", "stream",
                                                            "alerts", "stats", "context"]
    assert complete(comp / "ccprofd", "ccprofd tr") == ["trace"]
    assert complete(comp / "ccprofd", "ccprofd model ") == ["show", "remove", "allow", "merge"]
    assert complete(comp / "ccprofd", "ccprofd trace --mode ") == ["unwind", "instrumented"]
    assert complete(comp / "ccprofd", "ccprofd trace --format j") == ["jsonl"]
    assert complete(comp / "ccprofd", "ccprofd trace --no-r") == ["--no-retval"]
    assert complete(comp / "ccprofctl", "ccprofctl --socket /run/x.sock ho") == ["hot"]  # value skipped
    assert complete(comp / "ccprofctl", "ccprofctl hot --by ") == ["syscall", "cpu"]
    assert complete(comp / "ccprofctl", "ccprofctl hot --format ") == ["text", "json", "pprof", "folded"]
    assert complete(comp / "ccprofd", "ccprofd analyze /usr/bin/gzi") == ["/usr/bin/gzip"]  # BINARY: files
    hosts = complete(comp / "ccprofd", "ccprofd run --config /etc/host")
    assert sorted(hosts) == sorted(glob.glob("/etc/host*"))
    assert str(os.getpid()) in complete(comp / "ccprofd", f"ccprofd trace -p {os.getpid()}")
    # after "--": the command, then its arguments as files
    assert "bash" in complete(comp / "ccprofd", "ccprofd trace --mode unwind -- bas")
    assert complete(comp / "ccprofd", "ccprofd trace -- /bin/ls /etc/hostn") == ["/etc/hostname"]
    # every level of both parsers: its options exactly (hidden ones left out), its subcommands
    for prog in ("ccprofd", "ccprofctl"):
        todo: list[tuple[tuple[str, ...], argparse.ArgumentParser]] = [((), docgen.parser_of(prog))]
        while todo:
            path, parser = todo.pop()
            line = " ".join((prog, *path))
            assert set(complete(comp / prog, line + " -")) == visible_flags(parser), line
            subs = subparsers(parser)
            if subs:
                assert complete(comp / prog, line + " ") == list(subs), line
            todo += [((*path, name), sub) for name, sub in subs.items()]
    assert "--source-factory" not in complete(comp / "ccprofd", "ccprofd run --")  # help=SUPPRESS


def test_bash_completion_package_loads_it_on_first_use(installed: Path) -> None:
    """The real bash-completion loader finds the file where setup.sh installs it (XDG_DATA_DIRS
    points it at the test's root instead of /usr/share)."""
    loader = Path("/usr/share/bash-completion/bash_completion")
    if not loader.exists():
        skip_or_fail("bash-completion is not installed (scripts/setup.sh installs it)")
    code = ("source /usr/share/bash-completion/bash_completion; _completion_loader ccprofctl; "
            "complete -p ccprofctl; COMP_WORDS=(ccprofctl stream --event ''); COMP_CWORD=3; _ccprofctl; "
            "echo \"${COMPREPLY[@]}\"")
    env = dict(os.environ, XDG_DATA_DIRS=str(installed / "usr/share"))
    out = subprocess.run([require_tool("bash"), "--norc", "--noprofile", "-c", code], capture_output=True,
                         text=True, check=False, env=env)
    assert out.stdout.splitlines() == ["complete -o filenames -F _ccprofctl ccprofctl", "syscall cpu"], out


@pytest.mark.parametrize(("prog", "section"), [("ccprofd", 8), ("ccprofctl", 1)])
def test_man_pages_render_without_warnings(installed: Path, prog: str, section: int) -> None:
    page = installed / docgen.MAN_DIR / f"man{section}" / f"{prog}.{section}"
    assert oct(page.stat().st_mode & 0o777) == "0o644"
    groff = subprocess.run([require_tool("groff"), "-man", "-Tutf8", "-ww", "-z", str(page)],
                           capture_output=True, text=True, check=False)
    assert (groff.returncode, groff.stderr) == (0, ""), groff.stderr
    env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="0", LC_ALL="C.UTF-8")
    man = subprocess.run([require_tool("man"), "--warnings", "-l", str(page)], capture_output=True,
                         text=True, check=False, env=env)
    assert (man.returncode, man.stderr) == (0, ""), man.stderr
    text = re.sub(r".\x08", "", man.stdout)
    assert text.splitlines()[0].split() == [f"{prog.upper()}({section})", *(
        ["System", "Administration"] if section == 8 else ["User", "Commands"]), f"{prog.upper()}({section})"]
    # every command and every visible option of the parser, spelt with ASCII hyphens
    todo = [((), docgen.parser_of(prog))]
    while todo:
        path, parser = todo.pop()
        if path:
            assert re.search(rf"^ {{3}}{re.escape(' '.join(path))}$", text, re.M), path
        for flag in visible_flags(parser) - {"-h", "--help"}:
            assert re.search(rf"(^|[\s,\[]){re.escape(flag)}([\s,=\]]|$)", text, re.M), (path, flag)
        todo += [((*path, n), s) for n, s in subparsers(parser).items()]
    if prog == "ccprofd":  # the configuration keys, from the config module (retire_after_seconds: issue 17)
        assert "retire_after_seconds = 3600" in text and "SEE ALSO" in text and "ccprofctl(1)" in text
    else:
        assert "ccprofd(8)" in text
    # the README's text (issue 17: "a man page generated from the README"): its sections, headed as
    # the page's, with sentences of the README's own (wrapped by man, so compared word by word)
    words = " ".join(text.split())
    readme = (ROOT / "README.md").read_text()
    if prog == "ccprofd":
        headings = ["DESCRIPTION", "EXIT STATUS", "COMMANDS IN DETAIL", "PERFORMANCE", "KNOWN LIMITS"]
        sentences = ["It statically analyses the target ELF into a call graph",
                     "Commands that run a child pass its exit status through"]
        subsections = ["ccprofd analyze", "ccprofd trace", "ccprofd learn, detect, model"]
    else:
        headings = ["DETAILS"]
        sentences = ["an unknown key is an error, and a rejected reload keeps the running configuration"]
        subsections = ["ccprofctl for the ccprofd group"]
    for h in headings:
        assert re.search(rf"^{h}$", text, re.M), h
    for sentence in sentences:
        assert sentence in " ".join(readme.split()) and sentence in words, sentence
    for sub in subsections:
        assert f"### {sub}" in readme or f"#### {sub}" in readme
        assert re.search(rf"^ {{3}}{re.escape(sub)}$", text, re.M), sub
    # no Markdown left (a lone `**` is text: "2**64")
    assert "<!--" not in text and "```" not in text and not re.search(r"\*\*[A-Za-z][^*\n]{0,60}\*\*", text)


def test_markdown_to_roff_keeps_spans_code_and_tables_whole() -> None:
    """The README's Markdown as roff (``ccprofd.cli.mdroff``), rendered by groff: bold and code
    spans that wrap in the Markdown, a fenced block kept verbatim, a table as preformatted rows,
    HTML comments dropped, non-ASCII characters through ``\\[u....]`` escapes."""
    from ccprofd.cli.mdroff import section, to_roff

    md = ("## A\n\nSome **bold\ntext** and `a\ncode` \u2014 done.\n<!-- bench:x -->\n\n"
          "* one\n  continued\n* two\n\n```\n.leading dot -x\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
          "\n### Sub\n\ntext\n\n## B\n\nlast\n")
    body = section(md, "A")
    assert body is not None and "last" not in body and "### Sub" in body
    roff = ".TH T 1\n" + to_roff(body, top_level=1)
    groff = subprocess.run([require_tool("groff"), "-man", "-Tutf8", "-ww"], input=roff, capture_output=True,
                           text=True, check=False, env=dict(os.environ, LC_ALL="C.UTF-8"))
    assert (groff.returncode, groff.stderr) == (0, ""), groff.stderr
    out = re.sub(r".\x08", "", groff.stdout)
    flat = " ".join(out.split())
    assert "Some bold text and a code \u2014 done." in flat
    assert "bench" not in flat
    assert "\u2022 one continued" in flat and "\u2022 two" in flat
    assert re.search(r"^ +\.leading dot -x$", out, re.M)  # verbatim, not a roff request
    assert re.search(r"^ +\| a \| b \|$", out, re.M) and re.search(r"^ +\| 1 \| 2 \|$", out, re.M)
    assert re.search(r"^ +Sub$", out, re.M)


def test_setup_installs_them_and_bad_usage_is_one_line() -> None:
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert "-m ccprofd.cli.docgen install --root /" in setup
    assert re.search(r"APT_PACKAGES=\([^)]*\bman-db\b[^)]*\bgroff-base\b[^)]*\bbash-completion\b", setup)
    bad = subprocess.run([sys.executable, "-m", "ccprofd.cli.docgen", "man", "ccprof"], capture_output=True,
                         text=True, check=False, cwd=ROOT)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "invalid choice" in bad.stderr
