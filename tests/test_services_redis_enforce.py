"""Enforcement from the unwinder on a real service (issue 14's last bullet): Debian's stock
redis-server (no frame pointers), the real ``ccprofd run`` daemon, ``action = "enforce"``.

The attack is the classic "write a file where the attacker wants" path: ``CONFIG SET dir /tmp/x``,
``CONFIG SET dbfilename evil``, ``SAVE``. Redis 7 refuses the first two unless
``enable-protected-configs`` is on, so the server here runs with it on (the vulnerable
configuration the attack needs; older redis had no such switch).

What the syscalls of the attack are, and under which functions, was read with an independent tool,
``strace -f -k`` on the same redis-server (not with ccprofd)::

    chdir("/tmp/x")                       <- ... configSetCommand < call < processCommand < ...
    openat(AT_FDCWD, "temp-PID.rdb", O_WRONLY|O_CREAT|O_TRUNC)  <- rdbSave < saveCommand < call < ...
    rename("temp-PID.rdb", "evil")        <- rdbSave < saveCommand < call < ...
    openat(AT_FDCWD, ".", O_RDONLY)       <- fsyncFileDir < rdbSave < saveCommand < ...

and ``nm -D`` lists ``rdbSave`` and ``saveCommand`` as functions of the binary (checked below).

The model is learned by the daemon itself (``action = "learn"``, unwind mode) over redis-benchmark
mixes plus what a normal redis does on these syscalls: serverCron's ``/proc/self/stat`` reads (every
tick), the log file opened for each log line (``serverLogRaw``), and BGSAVE (fork = ``clone``, the
child's ``rdbSave`` temp file, ``rename`` and directory fsync -- the child exits before the
daemon's rescan lists it, so this needs the learner's fix for unlisted forked children -- and the
parent's log lines). The
checked syscalls are a security set (files opened/renamed/unlinked, exec, connect, clone), not
``chdir``: with ``chdir`` in the set the kill would come one command earlier, at ``CONFIG SET dir``.

Then, enforcing: held-out benchmark mixes (other commands, sizes, pipelining, keyspaces) and a
BGSAVE run with no denial and redis alive; the attack's ``SAVE`` is killed at its first unseen
syscall, the ``openat`` of the temp file under ``saveCommand > rdbSave``. That ``openat`` completes
(SIGKILL is acted on at the return to user space): an empty ``temp-PID.rdb`` is left in the
attacker's directory, ``evil`` never appears.

Not covered by the model (so it would be killed too): anything redis does on these syscalls that
the learning did not exercise -- SAVE/BGREWRITEAOF/AOF, replication (connect to a master, diskless
sync), MODULE LOAD, DEBUG commands, shutdown's own log lines, log lines of
rare events (e.g. out-of-memory warnings), a redis-server started while enforcing (its loader's
first `openat` is unseen). A model learned where SAVE is normal would allow the
attack: the key is the calling context, not the syscall's arguments (the directory).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import require_tool
from daemon_fakes import config_text, wait_for
from daemon_harness import RunningDaemon, target_toml
from ports import free_port

from ccprofd.anomaly.modelstore import load_models

SYSCALLS = ["openat", "rename", "renameat", "renameat2", "unlink", "unlinkat", "execve", "execveat",
            "connect", "clone", "clone3"]
COMMON = "set,get,incr,lpush,lrange"
LEARN_MIXES = [
    ["-c", "10", "-n", "2000", "-t", COMMON],
    ["-c", "50", "-n", "2000", "-d", "100", "-t", COMMON],
    ["-c", "4", "-n", "2000", "-P", "8", "-r", "1000", "-t", COMMON],
]
HELD_OUT_MIXES = [
    ["-c", "20", "-n", "2000", "-d", "50", "-r", "5000", "-t", COMMON],
    ["-c", "8", "-n", "2000", "-P", "4", "-t", "hset,sadd,rpush,lpop,mset,ping"],
]


class Redis:
    """redis-server on a loopback port, its dir and log file under a temp dir."""

    def __init__(self, command: str, workdir: Path) -> None:
        """``command``: the redis-server name (redis picks server or checker by its argv[0])."""
        self.port = free_port()
        self.dir = workdir
        self.proc = subprocess.Popen(
            [command, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--enable-protected-configs", "yes", "--dir", str(workdir), "--daemonize", "no",
             "--logfile", str(workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self.cli("ping") == "PONG", timeout=30, interval=0.1)

    def cli(self, *args: str) -> str:
        got = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True)
        return got.stdout.strip()

    def bench(self, args: list[str]) -> None:
        subprocess.run(["redis-benchmark", "-p", str(self.port), "-q", *args], capture_output=True,
                       check=True)

    def info(self, key: str) -> str:
        for line in self.cli("info", "persistence").splitlines():
            if line.startswith(key + ":"):
                return line.split(":", 1)[1].strip()
        raise AssertionError(f"no {key} in INFO persistence")

    def bgsave(self) -> None:
        """BGSAVE and wait until the child is done; it must have succeeded."""
        before = int(self.info("rdb_changes_since_last_save") or 0)
        assert self.cli("bgsave") == "Background saving started", before
        wait_for(lambda: self.proc.poll() is not None or self.info("rdb_bgsave_in_progress") == "0",
                 timeout=60, interval=0.1)
        assert self.proc.poll() is None, f"redis-server died during BGSAVE: {self.proc.returncode}"
        assert self.info("rdb_last_bgsave_status") == "ok"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def redis_config(workdir: str, binary: str, action: str) -> str:
    anomaly = f"""[target.anomaly]
action = "{action}"
flush_seconds = 1
alert_interval_seconds = 3600
"""
    return config_text(workdir, target_toml("redis", f'path = "{binary}"', SYSCALLS, "unwind", anomaly))


def chains(model: Path, syscall: str) -> set[tuple[str, ...]]:
    out = set()
    for m in load_models(model).targets.values():
        for (name, frames) in m.contexts:
            if name == syscall:
                out.add(tuple(str(f[1]) for f in frames))
    return out


def follows(d: RunningDaemon, pid: int) -> bool:
    resp = d.targets()
    return resp is not None and any(p.pid == pid and t.state == "attached"
                                    for t in resp.targets for p in t.processes)


@pytest.mark.bpf
def test_redis_config_set_dir_save_is_killed_normal_load_is_not(bpf: None, workdir: str,
                                                                  tmp_path: Path) -> None:
    for tool in ("redis-server", "redis-benchmark", "redis-cli", "nm"):
        require_tool(tool)
    # A path target follows (and here kills) every process of that file on the host: the stock binary
    # is copied (same bytes and build-id, its own inode) so no other redis on this shared machine is
    # enforced.  /usr/bin/redis-server is a symlink to redis-check-rdb, and redis picks server or
    # checker by its argv[0]: the copy is named redis-server.
    stock = os.path.realpath(shutil.which("redis-server") or "")
    binary = str(tmp_path / "redis-server")
    shutil.copy2(stock, binary)
    command = binary
    dynsyms = subprocess.run(["nm", "-D", "--defined-only", binary], capture_output=True, text=True,
                             check=True).stdout
    funcs = {parts[2] for parts in (line.split() for line in dynsyms.splitlines())
             if len(parts) == 3 and parts[1] in "Tt"}
    assert {"rdbSave", "saveCommand", "rdbSaveBackground", "bgsaveCommand"} <= funcs

    data = tmp_path / "data"
    data.mkdir()
    evil_dir = tmp_path / "x"
    evil_dir.mkdir()
    model = Path(workdir) / "state" / "anomaly" / "redis.model.json"
    redis = Redis(command, data)
    d: RunningDaemon | None = None
    try:
        # -- learn: the daemon's own model, in unwind mode ----------------------------------------
        d = RunningDaemon(workdir, redis_config(workdir, binary, "learn"))
        wait_for(lambda: d is not None and follows(d, redis.proc.pid), timeout=300)
        for mix in LEARN_MIXES:
            redis.bench(mix)
            redis.cli("info")
            redis.bgsave()
        # BGSAVE's fork, its child's rename (a process the daemon never listed) and the parent's
        # "done" log line reached the model
        wait_for(lambda: model.exists() and any("rdbSaveBackground" in c for c in chains(model, "clone"))
                 and any("rdbSaveBackground" in c and "rdbSave" in c for c in chains(model, "rename"))
                 and any("backgroundSaveDoneHandler" in c for c in chains(model, "openat")), timeout=120)
        learned = chains(model, "openat")
        assert not any("saveCommand" in c for c in learned)  # SAVE was never part of normal operation

        # -- enforce --------------------------------------------------------------------------------
        d.write_config(redis_config(workdir, binary, "enforce"))
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: d is not None and "reloaded" in d.log(), timeout=300)
        wait_for(lambda: d is not None and "from the unwinder" in d.log(), timeout=300)
        wait_for(lambda: d is not None and follows(d, redis.proc.pid), timeout=300)

        # (1) held-out normal operation: untouched
        for mix in HELD_OUT_MIXES:
            redis.bench(mix)
        redis.bgsave()
        redis.cli("info")
        assert redis.proc.poll() is None and redis.cli("ping") == "PONG"
        assert "verdict=" not in d.log(), d.log()[-3000:]

        # (2) the attack: killed at SAVE's first unseen syscall
        assert redis.cli("config", "set", "dir", str(evil_dir)) == "OK"
        assert redis.cli("config", "set", "dbfilename", "evil") == "OK"
        redis.cli("save")  # the connection dies with the server
        assert redis.proc.wait(timeout=60) == -signal.SIGKILL
        wait_for(lambda: d is not None and "verdict=killed syscall=openat" in d.log(), timeout=60)
        err = d.stop().log
        alerts = [line for line in err.splitlines()
                  if "ccprofd alert kind=unseen_context syscall=openat" in line and "action=enforce" in line]
        # strace -k's chain of that openat, outermost first: ... readQueryFromClient > processInputBuffer
        # > processCommand > call > saveCommand > rdbSave (then libc's open64)
        temp = f"temp-{redis.proc.pid}.rdb"
        [killed] = [line for line in alerts if f'path="{temp}"' in line]
        chain = "readQueryFromClient>processInputBuffer>processCommand>call>saveCommand>rdbSave>"
        assert chain in killed, killed
        assert "Traceback" not in err
        # what landed on disk: the openat ran (an empty temp file), nothing after it did
        left = {p.name: p.stat().st_size for p in evil_dir.iterdir()}
        assert left == {temp: 0}, left
    finally:
        if d is not None:
            d.kill()
        redis.stop()


def test_learn_keeps_samples_of_an_unlisted_forked_child(tmp_path: Path) -> None:
    """No BPF: the daemon's learner gets a sample of pid 11, which the source does not list (a
    forked child that exited before any rescan); its analysed frames were decoded against the
    target's binary (build-id "bid"), so it is learned for that binary.  A sample with no analysed
    frame, or with a build-id the source has not analysed, is still dropped."""
    from types import SimpleNamespace

    from ccprofd.daemon.anomaly_runtime import AnomalyMonitor
    from ccprofd.daemon.config import AnomalyConfig
    from ccprofd.daemon.source import BinaryInfo, ProcessInfo

    class Source:
        def processes(self) -> list[ProcessInfo]:
            return [ProcessInfo(10, "/srv/redis", "bid", 1)]

        def binaries(self) -> list[BinaryInfo]:
            return [BinaryInfo("/srv/redis", "bid")]

    def sample(pid: int, build_id: str | None, analysed: bool = True) -> dict[str, object]:
        return {"time_ns": 1, "pid": pid, "tid": pid, "event": "syscall", "syscall": "rename",
                "complete": True,
                "frames": [{"function": "rdbSave", "module": "/srv/redis", "build_id": build_id,
                            "analysed": analysed, "call_site": "0x10", "return_address": "0x15"}]}

    cfg = SimpleNamespace(anomaly=AnomalyConfig(action="learn"), mode="unwind")
    rt = SimpleNamespace(name="redis", config=cfg, source=Source())
    daemon = SimpleNamespace(targets={"redis": rt}, config=SimpleNamespace(daemon=SimpleNamespace(
        state_dir=str(tmp_path))), alerts=None)
    monitor = AnomalyMonitor(daemon=daemon)  # type: ignore[arg-type]
    monitor.observe(rt, sample(11, "bid"))
    monitor.observe(rt, sample(12, "other"))
    monitor.observe(rt, sample(13, "bid", analysed=False))
    t = monitor.targets["redis"]
    assert set(t.binaries) == {"bid"}
    learner = t.binaries["bid"].learner
    assert learner is not None and len(learner.model.contexts) == 1
