"""Exec targets (ccprofd/tracing/exec_target.c, kbtf.py): a process is tracked from its exec when its
new image is a followed inode -- whatever path, symlink or shell started it -- and only then.

The BTF reader is checked on a blob built here by hand (anonymous members, bit-field flag), and
the BPF side end to end: the inode number it reads through ``task->mm->exe_file`` with those
offsets must equal ``stat(2)``'s, or no followed exec would ever match.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

from ccprofd.kbpf.btf import BTFError, KernelBTF


def _btf(types: list[bytes], strings: bytes) -> bytes:
    body = b"".join(types)
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(body), len(body), len(strings))
    return hdr + body + strings


def _member(name: int, type_id: int, bit_off: int) -> bytes:
    return struct.pack("<III", name, type_id, bit_off)


def test_btf_member_offsets_through_anonymous_members() -> None:
    # strings: 0 "", 1 "int", 5 "outer", 11 "a", 13 "b", 15 "c", 17 "inner"
    strings = b"\0int\0outer\0a\0b\0c\0inner\0"
    t_int = struct.pack("<III", 1, 1 << 24, 8) + struct.pack("<I", 64)  # [1] INT size 8
    # [2] anonymous union { long c (bit 0) }, 8 bytes
    t_union = struct.pack("<III", 0, (5 << 24) | 1, 8) + _member(15, 1, 0)
    # [3] typedef-free anonymous struct { long b; union {c} } at bits 0 / 64
    t_anon = struct.pack("<III", 0, (4 << 24) | 2, 16) + _member(13, 1, 0) + _member(0, 2, 64)
    # [4] struct outer { long a; struct {b; union {c}} (at byte 16) }, kind_flag set: bit offsets
    #     carry a bit-field size in their top 8 bits (0 here)
    t_outer = struct.pack("<III", 5, (1 << 31) | (4 << 24) | 2, 32) + _member(11, 1, 0) + _member(0, 3, 128)
    btf = KernelBTF(_btf([t_int, t_union, t_anon, t_outer], strings))
    assert btf.member_offset("outer", "a") == 0
    assert btf.member_offset("outer", "b") == 16
    assert btf.member_offset("outer", "c") == 24
    with pytest.raises(BTFError, match="no member"):
        btf.member_offset("outer", "inner")
    with pytest.raises(BTFError, match="no struct"):
        btf.member_offset("missing", "a")
    with pytest.raises(BTFError, match="magic"):
        KernelBTF(b"\0" * 32)


def test_exec_target_tracks_the_inode_only(bpf: None, tmp_path: Path) -> None:
    from ccprofd.tracing.syscall_sampler import SyscallSampler

    followed = tmp_path / "followed"
    shutil.copy("/usr/bin/true", followed)
    twin = tmp_path / "twin"  # same bytes, another inode: not followed
    shutil.copy("/usr/bin/true", twin)
    (tmp_path / "lnk").symlink_to(followed)
    with SyscallSampler(syscalls=None) as sampler:
        sampler.attach()
        sampler.follow_exec(os.stat(followed).st_ino)
        runs = [subprocess.Popen([str(followed)]), subprocess.Popen([str(twin)]),
                subprocess.Popen(["/bin/sh", "-c", f"cd {tmp_path} && ./lnk; true"]),
                subprocess.Popen(["/bin/sh", "-c", f"cd {tmp_path} && exec ./lnk"])]
        for p in runs:
            assert p.wait(timeout=60) == 0
        time.sleep(0.2)
        events = sampler.poll(100)
        sampler.unfollow_exec(os.stat(followed).st_ino)
        subprocess.run([str(followed)], check=True)
        time.sleep(0.2)
        after = sampler.poll(100)
        stats = sampler.stats()
    found = {e.tgid for e in events if e.exec_target}
    assert runs[0].pid in found and runs[1].pid not in found and runs[3].pid in found
    assert len(found) == 3  # the direct run, the shell's forked child, the shell that exec'd
    assert {e.tgid for e in events} == found  # nothing else tracked (the twin, the shells before exec)
    assert stats["execs_found"] == 3
    # every syscall after the exec, exit_group included, as strace counts them for the same binary
    per_run = [sum(1 for e in events if e.tgid == pid and e.kind == "syscall") for pid in found]
    strace = shutil.which("strace")
    if strace is not None:
        out = subprocess.run([strace, "-f", "-qq", "-o", "/dev/stdout", str(followed)], capture_output=True,
                             text=True, check=True).stdout
        calls = [line.split(None, 1)[1] if line[:1].isdigit() else line for line in out.splitlines()]
        want = sum(1 for c in calls if c[:1].isalpha() and "(" in c and not c.startswith("execve("))
        assert per_run == [want] * 3, (per_run, want)
    assert not [e for e in after if e.exec_target]  # unfollowed: no longer matched
