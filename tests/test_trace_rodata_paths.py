"""A syscall's path argument on a page the process had not touched yet (``ccprofd trace``).

BPF reads the path at syscall entry with ``bpf_probe_read_user_str``, which cannot fault a page in:
a string literal in ``.rodata`` whose page is not in the page tables yet read as -EFAULT, and the
sample printed its pointer (``openat(AT_FDCWD, 0x55..., O_RDONLY)``, the bundled demo's
``/etc/hostname`` on every run).  ccprofd now reads such a string from the binary's file (a
read-only segment's bytes are the file's).  ``tests/programs/rodata_paths.c`` opens a path that has
64 KiB of ``.rodata`` to itself (it reports that its page was absent before the open), and one in
``.data``: writable memory may differ from the file, so there a failed read keeps the pointer.

Expected output: strace's own decoding of the same program's openat calls (``strace -e
trace=openat``), line for line; for the ``.data`` path either strace's string or a pointer.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import require_bpf, require_tool
from programs.build import build

REPO = pathlib.Path(__file__).resolve().parent.parent
RODATA_PATH, DATA_PATH = "/etc/passwd", "/etc/group"  # the strings of rodata_paths.c
_POINTER_OPEN = re.compile(r"^openat\(AT_FDCWD, 0x[0-9a-f]+, O_RDONLY\) = \d+$")
_STRACE_PATH = re.compile(r'^openat\(AT_FDCWD, ("(?:[^"\\]|\\.)*")')
_HEAD = re.compile(r"^\[pid (\d+) tid \d+\] ")


def strace_openats(binary: str) -> list[str]:
    """strace's lines for the program's openat calls (``openat(AT_FDCWD, "...", ...) = 3``)."""
    proc = subprocess.run(["strace", "-qq", "-e", "trace=openat", "--", binary],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("openat(")]


def ccprofd_trace(binary: str, mode: str, fmt: str, out: pathlib.Path) -> tuple[str, str]:
    proc = subprocess.run([sys.executable, "-m", "ccprofd.cli", "trace", "--mode", mode, "--format", fmt,
                           "--syscalls", "openat", "--output", str(out), "--", binary],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, out.read_text()


def text_openats(text: str) -> list[str]:
    """The sample lines of ``--format text`` without their ``[pid P tid T]`` head."""
    return [_HEAD.sub("", line) for line in text.splitlines() if _HEAD.match(line)]


def jsonl_openats(text: str) -> list[str]:
    """The JSONL samples' paths (``args.path``), or ``0x...`` (their pointer) when they have none."""
    out = []
    for line in text.splitlines():
        s = json.loads(line)
        if s.get("event") == "syscall":
            out.append(s["args"]["path"] if "args" in s else hex(s["raw_args"][1]))
    return out


def strace_paths(lines: list[str]) -> list[str]:
    """The path strings of strace's lines (plain paths: JSON reads strace's quoting of them)."""
    out = []
    for line in lines:
        m = _STRACE_PATH.match(line)
        assert m, line
        out.append(json.loads(m.group(1)))
    return out


@pytest.mark.bpf
@pytest.mark.parametrize(("mode", "pie", "fmt"), [("unwind", True, "text"), ("unwind", False, "jsonl"),
                                                  ("instrumented", True, "jsonl"),
                                                  ("instrumented", False, "text")])
def test_path_on_untouched_rodata_page_matches_strace(mode: str, pie: bool, fmt: str,
                                                      tmp_path: pathlib.Path) -> None:
    require_bpf()
    require_tool("strace")
    binary = str(build("rodata_paths", opt="O2", pie=pie))
    expected = strace_openats(binary)
    assert sum(f'"{RODATA_PATH}"' in line for line in expected) == 1, expected

    stdout, out = ccprofd_trace(binary, mode, fmt, tmp_path / f"trace.{fmt}")
    # the case happened: the literal's page was not present when the program opened it
    assert "rodata_present=0" in stdout, stdout

    if fmt == "text":
        got = text_openats(out)
        assert len(got) == len(expected), (got, expected)
        for g, e in zip(got, expected, strict=True):
            if f'"{DATA_PATH}"' in e and _POINTER_OPEN.match(g):
                continue  # writable .data, not resident: its pointer (never a guessed string)
            assert g == e
    else:
        got = jsonl_openats(out)
        want = strace_paths(expected)
        assert len(got) == len(want), (got, want)
        for g, e in zip(got, want, strict=True):
            if e == DATA_PATH and g.startswith("0x"):
                continue
            # a pointer where a path was due: the whole samples say whether the context was known
            assert g == e, [line for line in out.splitlines() if '"event":"syscall"' in line.replace(" ", "")]


def _nm_address(binary: str, symbol: str) -> int:
    """The symbol's ELF vaddr as binutils' nm gives it."""
    out = subprocess.run(["nm", binary], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[0], 16) for line in out.splitlines() if line.endswith(f" {symbol}"))


def _relro_start(binary: str) -> int:
    out = subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[2], 16) for line in out.splitlines() if line.split()[:1] == ["GNU_RELRO"])


def test_read_only_string_only_where_the_file_is_what_is_mapped() -> None:
    """elf/rostring.py against binutils' addresses: the .rodata string is read (cut as BPF cuts
    it), while .data (writable), RELRO (relocated by the loader) and another file's inode give
    nothing."""
    from ccprofd.elf.rostring import read_only_string

    require_tool("nm")
    require_tool("readelf")
    binary = str(build("rodata_paths", opt="O2", pie=True))
    rodata, data = _nm_address(binary, "rodata_path"), _nm_address(binary, "data_path")
    assert read_only_string(binary, rodata, 4096) == RODATA_PATH.encode()
    assert read_only_string(binary, rodata + 5, 4096) == RODATA_PATH[5:].encode()
    assert read_only_string(binary, rodata, 5) == RODATA_PATH[:4].encode()  # a 5-byte buffer's string
    assert read_only_string(binary, rodata, 4096, inode=pathlib.Path(binary).stat().st_ino) is not None
    assert read_only_string(binary, rodata, 4096, inode=pathlib.Path(binary).stat().st_ino + 1) is None
    assert read_only_string(binary, data, 4096) is None
    assert read_only_string(binary, _relro_start(binary), 4096) is None
    assert read_only_string(binary, 1 << 40, 4096) is None  # in no segment
