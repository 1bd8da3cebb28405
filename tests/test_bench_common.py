"""bench/common.py's report tail, shared by bench/unwind.py and bench/unwind_python.py: the report
a bench's ``measure`` prints is printed once and, when asked, put into README's bench section."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import common


def test_report_main_prints_and_updates_the_readme_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- bench:demo -->\nold\n<!-- /bench:demo -->\nb\n")
    monkeypatch.setattr(common, "README", readme)
    monkeypatch.setattr(common.os, "geteuid", lambda: 0)

    def measure(args: argparse.Namespace) -> int:
        print(f"| n | {args.n} |")
        return 0

    assert common.report_main("demo", measure, argparse.Namespace(n=3), update_readme=False) == 0
    assert capsys.readouterr().out == "| n | 3 |\n" and "old" in readme.read_text()
    assert common.report_main("demo", measure, argparse.Namespace(n=4), update_readme=True) == 0
    assert readme.read_text() == "a\n<!-- bench:demo -->\n| n | 4 |\n<!-- /bench:demo -->\nb\n"
    assert common.report_main("other", measure, argparse.Namespace(n=5), update_readme=True) == 1
    assert "bench/other.py: README.md has no bench:other section" in capsys.readouterr().err
    monkeypatch.setattr(common.os, "geteuid", lambda: 1000)
    assert common.report_main("demo", measure, argparse.Namespace(n=6), update_readme=True) == 2
    assert "needs root" in capsys.readouterr().err and "| n | 4 |" in readme.read_text()
    assert common.median([3.0, 1.0, 2.0]) == 2.0
