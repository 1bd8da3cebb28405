"""Issue 15 item 6: a target whose binary or cgroup does not exist yet waits for it (``waiting`` in
``ListTargets``, ``ccprofctl targets`` and ``ccprofd_target_state``) and attaches when it appears,
instead of failing once with a raw ``[Errno 2]`` and never recovering."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from bpf_helpers import compile_c
from conftest import skip_or_fail
from daemon_fakes import config_text, started_daemon, wait_for
from daemon_harness import RunningDaemon, target_toml

from ccprofd.daemon.service import attach_waiting
from ccprofd.daemon.tracer_source import make_source
from ccprofd.export.gen import ccprofd_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
N = 23

PROGRAM = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) long leaf(void) { return getppid(); }
int main(void) {
    char line[64];
    long s = 0;
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (int i = 0; i < N; i++) s += leaf();
    printf("done %ld\n", s > 0);
    while (fgets(line, sizeof line, stdin)) {}
    return 0;
}
""".replace("N;", f"{N};")


def ctl_targets(sock: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ccprofd.cli.ctl", "--socket", sock, "targets"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_path_target_waits_then_attaches_when_the_binary_appears(bpf: None, workdir: str,
                                                                  tmp_path: Path) -> None:
    built = compile_c(tmp_path, "built", PROGRAM, "-O0", "-fno-omit-frame-pointer")
    path = Path(workdir) / "opt" / "prog"  # not there yet, nor its directory
    config = config_text(workdir, target_toml("prog", f'path = "{path}"', ["getppid"], "unwind"))
    with RunningDaemon(workdir, config) as daemon:
        (t,) = daemon.targets().targets
        assert (t.state, t.error) == ("waiting", f"{path} does not exist"), t
        out = ctl_targets(daemon.socket_path)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert "state waiting" in lines[0] and lines[1] == f"  waiting: {path} does not exist", out.stdout
        states = {labels["state"]: v for labels, v in daemon.metric_samples("ccprofd_target_state")
                  if labels["target"] == "prog"}
        assert states["waiting"] == 1 and states["attached"] == 0 and states["failed"] == 0
        assert f"warning: {daemon.config_path}:" in daemon.log() and "does not exist" in daemon.log()
        # the binary is installed (a copy: written in place, then complete)
        path.parent.mkdir()
        shutil.copy2(built, path)
        daemon.wait_attached(timeout=300)
        prog = subprocess.Popen([str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert prog.stdout is not None and prog.stdin is not None
        try:
            assert prog.stdout.readline() == "ready\n"
            daemon.wait_tracked(prog.pid)
            prog.stdin.write("go\n")
            prog.stdin.flush()
            assert prog.stdout.readline() == "done 1\n"

            def counted() -> int:
                resp = daemon.stub.GetHotContexts(pb.GetHotContextsRequest(target="prog", top_k=5), timeout=5)
                return int(resp.total_samples) if resp.total_samples >= N else 0

            assert wait_for(counted, timeout=120) == N  # exactly the N getppid() of the source
        finally:
            prog.stdin.close()
            prog.wait(timeout=60)
        (t,) = daemon.targets().targets
        assert t.state == "attached" and not t.error
        stopped = daemon.stop()
    stopped.assert_clean()
    assert "Errno" not in stopped.log


def test_cgroup_target_waits_for_its_cgroup(workdir: str) -> None:
    unified = next((d for d in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
                    if os.path.isfile(os.path.join(d, "cgroup.procs"))), None)
    if unified is None or not os.access(unified, os.W_OK):
        skip_or_fail("no writable cgroup v2 hierarchy")
        return
    group = os.path.join(unified, f"ccprofd-test-{os.getpid()}")
    try:
        with started_daemon(f'[[target]]\nname = "cg"\ncgroup = "{group}"\n', workdir=workdir,
                            factory=make_source, servers=False) as served:
            daemon = served.daemon
            rt = daemon.targets["cg"]
            assert (rt.state, rt.error) == ("waiting", f"{group} does not exist")
            attach_waiting(daemon)
            assert rt.state == "waiting"
            os.mkdir(group)
            attach_waiting(daemon)  # seen: attached once unchanged at the next check
            attach_waiting(daemon)
            assert (rt.state, rt.error) == ("attached", ""), rt.error
    finally:
        if os.path.isdir(group):
            os.rmdir(group)
