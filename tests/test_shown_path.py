"""The binary's frames are named by the path the user executed or configured when it is another name
of the same file.  Debian's /usr/bin/redis-server is a symlink to redis-check-rdb, and samples of
``ccprofd trace -- redis-server`` (and the services bench, ``ccprofctl hot``) named every redis frame
``/usr/bin/redis-check-rdb``.  The file's identity (inode, /proc/PID/maps) stays the real path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_bpf
from programs.build import build

from ccprofd.tracing.base import shown_path

REPO = Path(__file__).resolve().parent.parent


def test_shown_path_is_the_given_name_of_the_same_file(tmp_path: Path) -> None:
    real = tmp_path / "real-prog"
    real.write_bytes(b"\x7fELF")
    (tmp_path / "link").symlink_to("real-prog")
    other = tmp_path / "other"
    other.write_bytes(b"\x7fELF")
    assert shown_path(str(tmp_path / "link"), str(real)) == str(tmp_path / "link")
    assert shown_path(str(real), str(real)) == str(real)
    assert shown_path(str(other), str(real)) == str(real)  # not the same file: the real path
    assert shown_path(str(tmp_path / "gone"), str(real)) == str(real)
    assert shown_path("/proc/1/root/usr/bin/x", str(real)) == str(real)
    os.chdir(tmp_path)
    assert shown_path("link", str(real)) == str(tmp_path / "link")  # made absolute


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_frames_of_a_symlinked_binary_carry_the_executed_name(tmp_path: Path, mode: str) -> None:
    """Before: every analysed frame's module was ``real-prog`` (the symlink's target)."""
    require_bpf()
    shutil.copy(build("calls", opt="O2"), tmp_path / "real-prog")
    link = tmp_path / "my-prog"
    link.symlink_to("real-prog")
    assert os.path.realpath(link) == str(tmp_path / "real-prog")
    out = tmp_path / "t.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--format", "jsonl",
                           "--syscalls", "write", "--output", str(out), "--", str(link)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    samples = [s for s in map(json.loads, out.read_text().splitlines()) if s.get("syscall") == "write"]
    samples = [s for s in samples if any(f["analysed"] for f in s["frames"])]  # not exit()'s stdio flush
    assert len(samples) == 2  # calls.c: say() writes twice
    for s in samples:
        ours = [f for f in s["frames"] if f["analysed"]]
        assert [f["function"] for f in ours] == ["main", "say"], s["frames"]
        assert {f["module"] for f in ours} == {str(link)}, s["frames"]
        # libraries keep the names their mappings have (only the traced binary's name is the user's)
        assert all(f["module"] != str(link) for f in s["frames"] if not f["analysed"])
