"""Daemon lifecycle end to end, with real BPF and the real ``ccprofd run`` process (issue 6):

* ``SIGKILL`` leaves nothing attached: every BPF link and program the daemon held (read from its
  ``/proc/PID/fdinfo``) disappears from the kernel (``bpftool``), no uprobe event names the binary,
  and the traced program keeps running unharmed;
* a binary upgrade (rename-over: new inode, new build-id) is picked up without a restart: a new
  process of the new binary is analysed and tracked with samples carrying the new build-id, while the
  process still running the old inode keeps being tracked with the old plan (old build-id);
* a process in another mount and pid namespace, whose binary exists only on a tmpfs mounted inside
  that namespace, is found (``pid`` and ``cgroup`` targets), analysed through ``/proc/PID/root``,
  reported with its host pid, and its samples' call sites equal the ``call`` instructions objdump
  lists in the binary.

Build-ids are read with ``readelf -n`` and call sites with ``objdump -d``, never from ccprofd.
Every wait is a generous liveness bound that fails with a message, not a timing assertion.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from bpf_helpers import direct_call_sites
from conftest import require_tool, skip_or_fail
from daemon_fakes import config_text, wait_for
from daemon_harness import RunningDaemon, kernel_ids
from daemon_harness import target_toml as harness_target_toml

from ccprofd.export.gen import ccprofd_pb2 as pb

MODES = ["unwind", "instrumented"]

# Reads commands on stdin: "a N" makes N getppid() from main > work_a > leaf, "b N" from
# main > work_b > leaf, "n" prints how many it made so far; between commands (poll timeout 5 ms)
# it keeps making getppid() from main > idle > leaf.  EOF: exit 0.  Prints "ready VERSION" first.
PROGRAM = r"""
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#ifndef VERSION
#define VERSION 1
#endif
static long made;
__attribute__((noinline)) long leaf(void) { made++; return getppid(); }
__attribute__((noinline)) long work_a(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += leaf();
    return s;
}
__attribute__((noinline)) long work_b(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += leaf();
    return s;
}
__attribute__((noinline)) long idle(void) { return leaf(); }
int main(void) {
    char line[64];
    long n;
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready %d\n", VERSION);
    for (;;) {
        struct pollfd p = {0, POLLIN, 0};
        if (poll(&p, 1, 5) == 0) { idle(); continue; }
        if (!fgets(line, sizeof line, stdin)) return 0;
        if (sscanf(line, "a %ld", &n) == 1) printf("did %ld\n", work_a(n) >= 0 ? n : -1);
        else if (sscanf(line, "b %ld", &n) == 1) printf("did %ld\n", work_b(n) >= 0 ? n : -1);
        else if (strcmp(line, "n\n") == 0) printf("made %ld\n", made);
    }
}
"""


def build(out: Path, version: int) -> Path:
    """gcc the test program with -DVERSION=version (a different build-id per version)."""
    gcc = require_tool("gcc")
    src = out.parent / f"lifecycle-v{version}.c"
    src.write_text(PROGRAM)
    subprocess.run(
        [gcc, "-g", "-O1", "-fno-optimize-sibling-calls", f"-DVERSION={version}", "-o", str(out), str(src)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def build_id(binary: Path) -> str:
    """The GNU build-id per ``readelf -n`` (independent of ccprofd's ELF reader)."""
    out = subprocess.run(
        [require_tool("readelf"), "-n", str(binary)], capture_output=True, text=True, check=True
    )
    m = re.search(r"Build ID: ([0-9a-f]+)", out.stdout)
    assert m, out.stdout
    return m.group(1)


class Program:
    """A running test program driven over its stdin/stdout."""

    def __init__(self, argv: list[str], **kw: Any) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)
        first = self.readline()
        assert first.startswith("ready"), first
        self.version = int(first.split()[1])

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.readline().strip()

    def made(self) -> int:
        reply = self.ask("n")
        assert reply.startswith("made "), reply
        return int(reply.split()[1])

    def close(self) -> int:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_daemon(workdir: str, targets: str) -> RunningDaemon:
    return RunningDaemon(workdir, config_text(workdir, targets, daemon_extra="top_k = 20"))


def hot(daemon: RunningDaemon, target: str) -> pb.GetHotContextsResponse:
    return daemon.stub.GetHotContexts(
        pb.GetHotContextsRequest(target=target, top_k=50, syscall="getppid"), timeout=30
    )


def target_toml(mode: str, spec: str) -> str:
    return harness_target_toml("prog", spec, ["getppid"], mode)


def uprobe_events_naming(path: Path) -> list[str]:
    """Lines of the tracefs uprobe_events that probe ``path`` (legacy, non-fd-owned uprobes)."""
    for tracefs in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        events = Path(tracefs) / "uprobe_events"
        if events.exists():
            return [line for line in events.read_text().splitlines() if str(path) in line]
    return []


def contexts_by_function(hot: pb.GetHotContextsResponse) -> list[tuple[int, list[str], set[str]]]:
    """(count, function names outermost first, build-ids of the program's frames) per context."""
    out = []
    for h in hot.contexts:
        names = [f.function for f in h.frames]
        builds = {f.build_id for f in h.frames if f.function in ("leaf", "work_a", "work_b", "idle", "main")}
        out.append((int(h.count), names, builds))
    return out


# ----------------------------------------------------------------------------------- SIGKILL
@pytest.mark.parametrize("started", ["before", "after"])
@pytest.mark.parametrize("mode", MODES)
def test_sigkill_leaves_nothing_attached(bpf: None, workdir: str, mode: str, started: str) -> None:
    """``started``: the program runs before the daemon starts (found running) or is started after
    it (followed from its exec, when the tracer may hold it until its mappings are loaded)."""
    binary = build(Path(workdir) / "prog", 1)
    prog: Program | None = None
    if started == "before":
        prog = Program([str(binary)])
    daemon = start_daemon(workdir, target_toml(mode, f'path = "{binary}"'))
    try:
        if prog is None:
            daemon.wait_attached()
            prog = Program([str(binary)])
        daemon.wait_tracked(prog.proc.pid)
        assert prog.ask("a 50") == "did 50"
        wait_for(lambda: hot(daemon, "prog").total_samples >= 50, timeout=120, interval=0.2)
        held = daemon.bpf_objects()
        links, progs = set(held.links), held.all_progs
        assert progs, "the daemon holds no BPF program"
        if mode == "instrumented":
            assert links, "instrumented mode holds no BPF link (uprobe_multi)"
        assert links <= kernel_ids("link") and progs <= kernel_ids("prog")
        before = prog.made()

        daemon.proc.send_signal(signal.SIGKILL)
        assert daemon.proc.wait(timeout=60) == -signal.SIGKILL

        def released() -> bool:
            return not (links & kernel_ids("link")) and not (progs & kernel_ids("prog"))

        try:
            wait_for(released, timeout=120, interval=0.2)
        except AssertionError:
            raise AssertionError(
                f"after SIGKILL the kernel still has links {sorted(links & kernel_ids('link'))} and programs "
                f"{sorted(progs & kernel_ids('prog'))} of the daemon"
            ) from None
        assert not uprobe_events_naming(binary)
        # The traced program is unharmed: still running, still making calls, answering, exiting 0.
        assert prog.proc.poll() is None
        wait_for(lambda: prog.made() > before + 20, timeout=60, interval=0.1)
        assert prog.ask("b 7") == "did 7"
        assert prog.close() == 0
    finally:
        daemon.kill()
        if prog is not None:
            prog.close()


# ----------------------------------------------------------------------------------- upgrade
@pytest.mark.parametrize("mode", MODES)
def test_binary_upgrade_tracks_old_and_new_inode(bpf: None, workdir: str, mode: str) -> None:
    bindir = Path(workdir) / "bin"
    bindir.mkdir()
    path = bindir / "prog"
    build(path, 1)
    old_build = build_id(path)
    old_inode = path.stat().st_ino
    old = Program([str(path)])
    daemon = start_daemon(workdir, target_toml(mode, f'path = "{path}"'))
    new: Program | None = None
    try:
        assert daemon.wait_tracked(old.proc.pid).build_id == old_build
        # Package upgrade: the new binary is written beside and renamed over (new inode).
        build(bindir / "prog.new", 2)
        new_build = build_id(bindir / "prog.new")
        assert new_build != old_build
        os.rename(bindir / "prog.new", path)
        assert path.stat().st_ino != old_inode
        new = Program([str(path)])
        assert new.version == 2 and old.version == 1
        p_new = daemon.wait_tracked(new.proc.pid, new_build)
        procs = daemon.processes()
        assert procs[old.proc.pid].build_id == old_build, "the old process lost its old plan"
        resp = daemon.targets()
        assert resp is not None
        binaries = {(b.build_id, b.inode) for t in resp.targets for b in t.binaries}
        assert {(old_build, old_inode), (new_build, path.stat().st_ino)} <= binaries, binaries
        assert p_new.build_id == new_build

        # Distinct counts from each process: each context's frames carry its own binary's build-id.
        n_old, n_new = 23, 31
        assert old.ask(f"a {n_old}") == f"did {n_old}"
        assert new.ask(f"b {n_new}") == f"did {n_new}"

        def counts() -> dict[tuple[str, str], int]:
            out: dict[tuple[str, str], int] = {}
            for count, names, builds in contexts_by_function(hot(daemon, "prog")):
                for work in ("work_a", "work_b"):
                    if work in names:
                        assert len(builds) == 1, (names, builds)
                        key = (work, next(iter(builds)))
                        out[key] = out.get(key, 0) + count
            return out

        want = {("work_a", old_build): n_old, ("work_b", new_build): n_new}
        try:
            wait_for(lambda: counts() == want, timeout=120, interval=0.2)
        except AssertionError:
            raise AssertionError(f"hot contexts {counts()} != {want}") from None

        # The old process exits: it is no longer tracked; the new one still is.
        assert old.close() == 0
        wait_for(lambda: old.proc.pid not in daemon.processes(), timeout=60, interval=0.2)
        assert daemon.processes()[new.proc.pid].build_id == new_build
        daemon.stop().assert_clean()
    finally:
        daemon.kill()
        old.close()
        if new is not None:
            new.close()


# --------------------------------------------------------------------------------- containers
NS_SCRIPT = """
set -e
mount -t tmpfs ccprofd-test "$1"
cp "$2" "$1/prog"
exec "$1/prog"
"""


def host_child(parent: int) -> int:
    """The pid (host view) of ``parent``'s only child."""

    def find() -> int | None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                return int(entry)
        return None

    return int(wait_for(find, timeout=30, interval=0.05))


@pytest.mark.parametrize(("mode", "kind"), [("unwind", "pid"), ("instrumented", "pid"), ("unwind", "cgroup")])
def test_process_in_other_mount_and_pid_namespace(bpf: None, workdir: str, mode: str, kind: str) -> None:
    unshare = require_tool("unshare")
    src = build(Path(workdir) / "prog-src", 1)
    private = Path(workdir) / "private"
    private.mkdir()
    cgroup: Path | None = None
    preexec = None
    if kind == "cgroup":
        root = cgroup_root()
        if root is None:
            skip_or_fail("no cgroup hierarchy mounted")
        assert root is not None
        cgroup = root / f"ccprofd-test-{os.getpid()}-{int(time.time())}"
        cgroup.mkdir()

        def preexec() -> None:  # join the cgroup before exec: every descendant is in it
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    ns = Program(
        [
            unshare,
            "--mount",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
            "sh",
            "-c",
            NS_SCRIPT,
            "sh",
            str(private),
            str(src),
        ],
        preexec_fn=preexec,
    )
    pid = host_child(ns.proc.pid)
    daemon: RunningDaemon | None = None
    try:
        # The binary exists only inside the namespace; from the host, /proc/PID/root reaches it.
        inner = os.readlink(f"/proc/{pid}/exe")
        assert inner == f"{private}/prog"
        assert not (private / "prog").exists()
        assert os.path.samefile(f"/proc/{pid}/root{inner}", f"/proc/{pid}/exe")
        assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
        spec = f"pid = {pid}" if kind == "pid" else f'cgroup = "{cgroup}"'
        daemon = start_daemon(workdir, target_toml(mode, spec))
        daemon.wait_tracked(pid, build_id(src))  # reported with its host pid
        resp = daemon.targets()
        assert resp is not None
        inodes = {b.inode for t in resp.targets for b in t.binaries if b.build_id == build_id(src)}
        assert inodes == {os.stat(f"/proc/{pid}/exe").st_ino}  # attached to the inode it runs

        n_a, n_b = 17, 29
        assert ns.ask(f"a {n_a}") == f"did {n_a}"
        assert ns.ask(f"b {n_b}") == f"did {n_b}"
        # Call sites as objdump lists them in the binary (same bytes as the copy in the namespace).
        sites = {(s.function, s.target): s.vaddr for s in direct_call_sites(src)}

        def work_contexts() -> dict[str, tuple[int, list[Any]]]:
            out: dict[str, tuple[int, list[Any]]] = {}
            for h in hot(daemon, "prog").contexts:
                names = [f.function for f in h.frames]
                for work in ("work_a", "work_b"):
                    if work in names:
                        out[work] = (out.get(work, (0, []))[0] + int(h.count), list(h.frames))
            return out

        try:
            wait_for(
                lambda: {k: c for k, (c, _) in work_contexts().items()} == {"work_a": n_a, "work_b": n_b},
                timeout=120,
                interval=0.2,
            )
        except AssertionError:
            raise AssertionError(f"hot contexts {work_contexts()}\n{daemon.log()}") from None
        for work, (_, frames) in work_contexts().items():
            # Frames are outermost first; a frame's call_site is where it called the next one.
            names = [f.function for f in frames]
            i = names.index(work)
            assert names[i - 1] == "main" and names[i + 1] == "leaf", names
            assert frames[i - 1].call_site == sites[("main", work)], (work, frames)
            assert frames[i].call_site == sites[(work, "leaf")], (work, frames)
            assert {frames[j].build_id for j in (i - 1, i, i + 1)} == {build_id(src)}
        daemon.stop().assert_clean()
    finally:
        if daemon is not None:
            daemon.kill()
        ns.close()
        if cgroup is not None:
            _remove_cgroup(cgroup)


def cgroup_root() -> Path | None:
    """A writable cgroup hierarchy: the cgroup2 mount if there is one, else a v1 hierarchy."""
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    for fstype in ("cgroup2", "cgroup"):
        for m in mounts:
            if m[2] == fstype and (Path(m[1]) / "cgroup.procs").exists():
                return Path(m[1])
    return None


def _remove_cgroup(cgroup: Path) -> None:
    def empty() -> bool:
        return not (cgroup / "cgroup.procs").read_text().split()

    try:
        wait_for(empty, timeout=30, interval=0.1)
        cgroup.rmdir()
    except (OSError, AssertionError):
        pass
