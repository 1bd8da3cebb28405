"""Unwind mode on Debian's own programs, which no test program resembles, against ``strace -f -k``.

The test programs are ours; these are stripped distribution builds (coreutils, tar, sed, findutils,
perl, git and the static-pie ldconfig), with their own compilers' choices, libraries and locale
start-up. Each command runs once under ``ccprofd trace --mode unwind --verify`` and once under the
oracle (ptrace + libunwind, independent of ccprofd), and:

* every frame of the binary is compared by ``fidelity.compare`` (threads by creation order,
  syscalls by ordinal, frames by return address);
* the library frames between the syscall and the binary are compared too: the same modules in the
  same order, and each frame's function name must be the function that holds strace's address
  (``tests/library_oracle.py``: nm of the object and of libc6-dbg's debug file, ``.eh_frame`` FDEs
  for stripped local functions; binutils only);
* ``--verify``: every new context's BPF encoding equals the reference encoder's.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import require_bpf, require_tool
from fidelity import compare, same_file
from library_oracle import object_symbols, strace_vaddrs
from strace_oracle import Trace, run_strace

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSCALLS = ["openat", "read", "write", "close", "fstat", "newfstatat", "getdents64", "mmap", "brk", "lseek"]


def _tree(root: pathlib.Path) -> pathlib.Path:
    """A small directory tree, the same for both runs."""
    tree = root / "tree"
    for i in range(6):
        d = tree / f"d{i}"
        d.mkdir(parents=True)
        for j in range(4):
            (d / f"f{j}.txt").write_text("".join(f"line {k} of {i}/{j}\n" for k in range(50 * (j + 1))))
    return tree


def _commands(tmp: pathlib.Path, tree: pathlib.Path) -> dict[str, list[str]]:
    text = str(tree / "d0" / "f3.txt")
    return {
        "tar": ["tar", "-cf", str(tmp / "out.tar"), "-C", str(tree.parent), "tree"],
        "sort": ["sort", "-r", text],
        "sed": ["sed", "-n", "s/line 1/LINE/p", text],
        "find": ["find", str(tree), "-name", "f2.txt"],
        "perl": ["perl", "-e", f'opendir(D, "{tree}"); my @a = readdir D; open(F, "{text}"); '
                               'my @l = <F>; print scalar(@a), " ", scalar(@l), "\\n";'],
        "git": ["git", "-C", str(REPO), "--no-pager", "log", "--oneline", "-3", "--", "README.md"],
        "ldconfig": ["/sbin/ldconfig", "-p"],
    }


@dataclass
class LibraryCheck:
    samples_checked: int = 0
    frames_named: int = 0  # library frames a binutils rule names, and whose name was compared
    frames_unnamed: int = 0
    problems: list[str] = field(default_factory=list)


def _syscall_samples(samples: Sequence[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    by_tid: dict[int, list[Mapping[str, Any]]] = {}
    for s in sorted(samples, key=lambda s: int(s.get("time_ns", 0))):
        if s.get("event", "syscall") == "syscall" and "tid" in s:
            by_tid.setdefault(int(s["tid"]), []).append(s)
    return by_tid


def check_library_frames(samples: Sequence[Mapping[str, Any]], oracle: Trace, binary: str) -> LibraryCheck:
    """The innermost run of library frames of each sample against the oracle's same syscall."""
    out = LibraryCheck()
    by_tid = _syscall_samples(samples)
    tids = list(by_tid)  # in order of first sample; compare() has checked the tasks' order
    for index, task in enumerate(oracle.tasks):
        if index >= len(tids):
            break
        theirs = [sc for sc in task.syscalls if sc.name in oracle.requested]
        for ordinal, (mine, sc) in enumerate(zip(by_tid[tids[index]], theirs, strict=False)):
            frames = [f for f in mine.get("frames") or [] if not f.get("tail_call")]
            if not frames or not mine.get("complete", True) or sc.truncated or mine.get("syscall") != sc.name:
                continue
            got: list[tuple[str, str]] = []
            for f in reversed(frames):
                if f.get("analysed"):
                    break
                got.append((os.path.realpath(str(f.get("module"))), str(f.get("function"))))
            want: list[tuple[str | None, int | None]] = []
            for depth, (module, vaddr) in enumerate(strace_vaddrs(sc.frames)):
                if module is not None and same_file(module, binary):
                    break
                want.append((module, None if vaddr is None else vaddr - (1 if depth else 0)))
            where = f"task {index} syscall #{ordinal} {sc.name}"
            out.samples_checked += 1
            got_modules, want_modules = [m for m, _ in got], [m for m, _ in want]
            if got_modules != want_modules:
                out.problems.append(f"{where}: modules {got_modules} != strace's {want_modules}")
                continue
            for (module, name), (_, vaddr) in zip(got, want, strict=True):
                verdict = None if vaddr is None else object_symbols(module).agrees(vaddr, name)
                if verdict is None:
                    out.frames_unnamed += 1
                    continue
                out.frames_named += 1
                if not verdict:
                    found = object_symbols(module).function_at(vaddr or 0)
                    held_by = f"{sorted(found[1])} at {hex(found[0])}" if found else "no function"
                    out.problems.append(f"{where}: {name} in {module}, strace's {hex(vaddr or 0)} "
                                        f"is in {held_by}")
    return out


def _trace(argv: list[str], out: pathlib.Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ccprofd.cli", "trace", "--mode", "unwind", "--verify", "--format", "jsonl",
           "--syscalls", ",".join(SYSCALLS), "--output", str(out), "--", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900,
                          stdin=subprocess.DEVNULL)


NAMES = ["tar", "sort", "sed", "find", "perl", "git", "ldconfig"]
STATIC = {"ldconfig"}  # static-pie


@pytest.mark.bpf
@pytest.mark.parametrize("name", NAMES)
def test_system_binary_matches_strace(name: str, tmp_path: pathlib.Path) -> None:
    require_bpf()
    require_tool("strace")
    tree = _tree(tmp_path)
    argv = _commands(tmp_path, tree)[name]
    binary = os.path.realpath(require_tool(argv[0]) if "/" not in argv[0] else argv[0])
    out = tmp_path / "samples.jsonl"
    proc = _trace(argv, out)
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    (tmp_path / "out.tar").unlink(missing_ok=True)
    oracle = run_strace(argv, SYSCALLS, cwd=REPO, timeout=900)
    assert oracle.exit_status == 0, oracle.stderr

    result = compare(samples, oracle, binary)
    assert result.ok, result.report()
    assert result.stats.samples_compared >= 20, result.stats

    lib = check_library_frames(samples, oracle, binary)
    assert not lib.problems, "\n".join(lib.problems[:10])
    if name in STATIC:  # no library: every frame is the binary's
        assert lib.samples_checked >= 20 and lib.frames_named == lib.frames_unnamed == 0, lib
    else:
        assert lib.samples_checked >= 20 and lib.frames_named >= 20, lib

    verify = [ln for ln in proc.stderr.splitlines() if ln.startswith("ccprofd: verify:")]
    assert len(verify) == 1, proc.stderr
    words = verify[0].split()
    assert int(words[2]) >= 1 and int(words[5]) == 0, verify[0]


@pytest.mark.bpf
def test_library_check_finds_a_wrong_name_and_a_missing_frame(tmp_path: pathlib.Path) -> None:
    """The library check can fail: one sample's libc frame renamed to its caller's name, and
    another's innermost frame dropped, are both reported."""
    require_bpf()
    require_tool("strace")
    tree = _tree(tmp_path)
    argv = _commands(tmp_path, tree)["sed"]
    binary = os.path.realpath(require_tool("sed"))
    out = tmp_path / "samples.jsonl"
    proc = _trace(argv, out)
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    oracle = run_strace(argv, SYSCALLS, cwd=REPO, timeout=900)
    assert not check_library_frames(samples, oracle, binary).problems

    def deep(s: Mapping[str, Any]) -> bool:
        return len([f for f in s.get("frames") or [] if not f.get("analysed")]) >= 3

    candidates = [i for i, s in enumerate(samples) if s.get("event", "syscall") == "syscall" and deep(s)]
    assert len(candidates) >= 2
    renamed = json.loads(json.dumps(samples))
    frames = renamed[candidates[0]]["frames"]
    frames[-2]["function"] = frames[-3]["function"]
    problems = check_library_frames(renamed, oracle, binary).problems
    assert len(problems) == 1 and "strace's" in problems[0], problems

    dropped = json.loads(json.dumps(samples))
    del dropped[candidates[1]]["frames"][-1]
    problems = check_library_frames(dropped, oracle, binary).problems
    assert len(problems) == 1 and "modules" in problems[0], problems
    shutil.rmtree(tree)
