"""Benchmark: real services under ccprofd, driven by their own load generators (issue 14).

Debian's ``redis-server`` (loaded with ``redis-benchmark``: SET, GET, LPUSH, LRANGE_100; 50 clients),
``nginx`` (a master and two workers serving a 4 KB and a 64 KB file, loaded with ``ab -k``,
50 clients) and ``postgres`` (a throwaway cluster initdb'd under the temporary directory as the
postgres user, fsync off, loaded with ``pgbench -c 4 -j 2 -T N``: select-only ``-S`` and the
read-write tpcb-like script) are started on loopback ports in a temporary directory.  In one run,
alternating round by round so drifts of this shared VM hit every configuration alike:

* ``untraced``;
* ``unwind-all``: the real ``ccprofd run`` daemon with the service's binary as a ``path`` target,
  unwind mode, ``syscalls = "all"``;
* ``unwind-security``: the same with the security set (execve, openat, connect, accept4, mprotect,
  mmap, clone3, unlinkat, renameat2);
* ``unwind-security-raw``: the same set forced onto ``raw_syscalls:sys_enter``
  (``CCPROFD_SYSCALL_ATTACH=raw``), as every set was sampled before the per-syscall events;
* ``perf-dwarf``: ``perf record -e raw_syscalls:sys_enter --call-graph dwarf -p PID`` (what a user
  reaches for to get the same stacks).

Per configuration: requests/s (postgres: transactions/s) and p50/p99 latency per test (medians
over the rounds; pgbench's from its per-transaction log), and for the daemon its CPU (utime+stime
during the load, % of one core), peak RSS (VmHWM), dropped samples and distinct contexts (its
/metrics and ``ccprofctl hot``), and the top of ``ccprofctl hot`` (the hot contexts must name
the service's own functions).

Then, for each service, the exactness check (:func:`check_exactness`, bench/exactness.py):
a short load traced by the daemon and by perf at once, every perf event paired with our sample of
the same thread and syscall and the program's frames compared; for postgres with ``pgbench -C``
(a backend forked by the postmaster per transaction), each forked backend must be followed from
its first syscall.  ``CCPROFD_BENCH_KEEP=FILE`` keeps the check's ``perf script`` text in FILE
and our samples in FILE.ours.json, to look at disagreements.

* ``bpf-fp``: the frame-pointer stacks baseline, bench/fpstacks.py (bcc: ``bpf_get_stackid`` with
  ``BPF_F_USER_STACK`` on raw_syscalls:sys_enter, filtered by process), with the depth its walks
  reach (Debian's builds omit frame pointers: most chains stop after a frame or two).

* ``instrumented-scope``: the daemon in instrumented mode, every syscall, with a ``scope``
  (:data:`SCOPES`) on a subsystem the load never calls; the scope is called once after the load.
  Its probe hits (the daemon's /metrics) are reported.
* ``scope-probes``: no ccprofd; one counting uprobe on every probe of the plan instrumented mode
  builds for that scope (bench/scope_hits.py) under the same load: which probes fire, how often,
  in which function (and, when the kernel refuses the link, which probe it refuses).

Every configuration's load records the load average after it; each round starts one configuration
later than the one before.  The report gives, per test, the median over rounds of the change
against the same round's untraced run and issue 14's targets met or not (:func:`targets`).
``--bpf-stats`` adds, for unwind-all, the daemon's BPF run time per sample (BPF_ENABLE_STATS)
against the service's and the daemon's CPU.

Anomaly learning curves and injected attacks: bench/services_anomaly.py.

Usage (root): .venv/bin/python bench/services.py [--services redis,nginx,postgres] [--rounds 5]
[--requests 50000] [--seconds 10] [--configs ...] [--no-exactness] [--bpf-stats] [--update-readme]
Needs redis-server, redis-tools, nginx-light, apache2-utils, postgresql-15 (bench/setup.sh installs
them) and linux-perf for perf-dwarf and the exactness check.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import exactness
import scope_hits
from common import ROOT, cpu_seconds, machine_line, publish, reaped_cpu_seconds, run_time_stats, status_mb
from report_bpf import prog_stats

sys.path.insert(0, str(ROOT / "tests"))  # the daemon harness the end-to-end tests use
from daemon_fakes import config_text, wait_for
from daemon_harness import RunningDaemon, SampleStream, target_toml
from nginx_conf import nginx_conf
from ports import free_port

from ccprofd.kbpf.syscalls import syscall_numbers

SECURITY = ["execve", "openat", "connect", "accept4", "mprotect", "mmap", "clone3", "unlinkat", "renameat2"]
TESTS = "get,set,lrange_100"
CONFIGS = ("untraced", "unwind-all", "unwind-security", "unwind-security-raw", "perf-dwarf", "bpf-fp",
           "instrumented-scope", "scope-probes")


# ---------------------------------------------------------------------------------- services
def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as fh:
            out += [int(c) for c in fh.read().split()]
    return out


class Redis:
    """redis-server (one process; its I/O threads off, as Debian ships it) under redis-benchmark."""

    name = "redis"
    binary = "/usr/bin/redis-server"
    tools = ("redis-server", "redis-benchmark", "redis-cli")

    def __init__(self, workdir: Path, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--daemonize", "no", "--logfile", str(workdir / "redis.log"), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, timeout=30, interval=0.1)

    def _answers(self) -> bool:
        got = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True, text=True)
        return got.stdout.strip() == "PONG"

    def version(self) -> str:
        return subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout.split()[2]

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def load(self, requests: int) -> dict[str, dict[str, float]]:
        """redis-benchmark's CSV: per test, requests/s and p50/p99 latency (ms)."""
        out = subprocess.run(["redis-benchmark", "-p", str(self.port), "-t", TESTS, "-n", str(requests),
                              "-c", "50", "--csv"], capture_output=True, text=True, check=True).stdout
        rows = list(csv.DictReader(io.StringIO(out)))
        return {r["test"]: {"rps": float(r["rps"]), "p50": float(r["p50_latency_ms"]),
                            "p99": float(r["p99_latency_ms"])} for r in rows}

    def warm(self) -> None:
        """A short load of the measured kinds before each measured one (:func:`timed_load`)."""
        subprocess.run(["redis-benchmark", "-p", str(self.port), "-t", TESTS, "-n", "10000", "-c", "50",
                        "-q"], capture_output=True, check=True)

    def check_load(self) -> None:
        """A short load for the exactness check."""
        subprocess.run(["redis-benchmark", "-p", str(self.port), "-t", "get,set", "-n", "2000", "-c", "4",
                        "-q"], capture_output=True, check=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)




class Nginx:
    """nginx (a master and two workers) serving a 4 KB and a 64 KB static file under ab."""

    name = "nginx"
    binary = "/usr/sbin/nginx"
    tools = ("nginx", "ab")
    FILES: ClassVar[dict[str, int]] = {"small.html": 4096, "large.bin": 65536}

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        root = workdir / "nginx"
        (root / "www").mkdir(parents=True)
        for d in (workdir, root, root / "www"):  # the workers run as www-data: they must read the files
            d.chmod(0o755)
        for name, size in self.FILES.items():
            (root / "www" / name).write_bytes(os.urandom(size // 2).hex().encode()[:size])
            (root / "www" / name).chmod(0o644)
        conf = root / "nginx.conf"
        conf.write_text(nginx_conf(root, self.port, workers=2, connections=1024))
        self.proc = subprocess.Popen([self.binary, "-c", str(conf), "-p", str(root)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: len(children(self.proc.pid)) == 2 and self._answers(), timeout=30, interval=0.1)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def version(self) -> str:
        got = subprocess.run([self.binary, "-v"], capture_output=True, text=True)
        return got.stderr.strip().split("/")[-1]

    def pids(self) -> list[int]:
        return [self.proc.pid, *children(self.proc.pid)]

    def load(self, requests: int) -> dict[str, dict[str, float]]:
        """ab, keep-alive, 50 concurrent clients: requests/s and p50/p99 (ms) per file."""
        out: dict[str, dict[str, float]] = {}
        for name in self.FILES:
            text = subprocess.run(["ab", "-q", "-k", "-n", str(requests), "-c", "50",
                                   f"http://127.0.0.1:{self.port}/{name}"],
                                  capture_output=True, text=True, check=True).stdout
            if "Non-2xx responses" in text or "Failed requests:        0" not in text:
                raise RuntimeError(f"nginx answered {name} with errors:\n{text}")
            rps = float(re.search(r"Requests per second:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
            pct = dict(re.findall(r"^\s+(\d+)%\s+(\d+)", text, re.M))
            out[f"GET /{name}"] = {"rps": rps, "p50": float(pct["50"]), "p99": float(pct["99"])}
        return out

    def warm(self) -> None:
        """A short load of the measured kinds before each measured one (:func:`timed_load`)."""
        for name in self.FILES:
            subprocess.run(["ab", "-q", "-k", "-n", "2000", "-c", "50", f"http://127.0.0.1:{self.port}/{name}"],
                           capture_output=True, check=True)

    def check_load(self) -> None:
        """A short load for the exactness check: ab, keep-alive, 4 clients, both files."""
        for name, n in (("small.html", 1500), ("large.bin", 500)):
            subprocess.run(["ab", "-q", "-k", "-n", str(n), "-c", "4", f"http://127.0.0.1:{self.port}/{name}"],
                           capture_output=True, check=True)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGQUIT)  # graceful: the workers finish, the master exits
        self.proc.wait(timeout=30)


#: the newest PostgreSQL installed (Debian's postgresql-NN packages)
PG_BIN = max(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]),
             default=Path("/usr/lib/postgresql/15/bin/postgres")).parent.as_posix()


class Postgres:
    """A throwaway PostgreSQL cluster (initdb under the temp dir, owned by the postgres user,
    loopback port, fsync off: the tracer's cost, not the disk's, is measured) under pgbench."""

    name = "postgres"
    binary = f"{PG_BIN}/postgres"
    tools = ("pgbench", "pg_isready", f"{PG_BIN}/initdb")
    CLIENTS = 4
    #: pgbench's built-in scripts measured (test name -> flags)
    SCRIPTS: ClassVar[dict[str, list[str]]] = {"select-only (-S)": ["-S"], "tpcb-like (read-write)": []}

    def __init__(self, workdir: Path, seconds: int = 10) -> None:
        import pwd

        self.seconds = seconds
        self.port = free_port()
        self.dir = workdir / "pg"
        self.dir.mkdir()
        workdir.chmod(0o755)
        pw = pwd.getpwnam("postgres")
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        subprocess.run([f"{PG_BIN}/initdb", "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres",
                        "--no-sync"], check=True, capture_output=True, cwd=self.dir, **self.user)  # type: ignore[arg-type]
        self.log = open(self.dir / "postgres.log", "w")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(
            [self.binary, "-D", str(self.dir / "data"), "-p", str(self.port), "-k", str(self.dir),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
             "-c", "full_page_writes=off", "-c", "max_connections=50",
             # epoch times in the log: checkpoints() places the checkpoints in a bench's windows
             "-c", "log_line_prefix=%n [%p] ", "-c", "log_checkpoints=on"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir, **self.user)  # type: ignore[arg-type]
        wait_for(self._answers, timeout=60, interval=0.2)
        self.pgbench(["-i", "-s", "2", "-q"])

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"postgres exited: {(self.dir / 'postgres.log').read_text()[-2000:]}")
        return subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port)]).returncode == 0

    def pgbench(self, args: list[str]) -> str:
        return subprocess.run(["pgbench", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", *args,
                               "postgres"], capture_output=True, text=True, check=True, cwd=self.dir).stdout

    def checkpoints(self, what: str = "complete") -> list[int]:
        """When each checkpoint the server logged so far ended (epoch ns; ``what="starting"``: began).
        A checkpoint's last steps (WAL segments removed or recycled, commit-log and subtransaction
        segments truncated, files of truncated or dropped relations unlinked) run when it ends, once
        per cycle (``checkpoint_timeout``, 5 min by default), on what happened before it began."""
        out = []
        for line in (self.dir / "postgres.log").read_text(errors="replace").splitlines():
            if f"checkpoint {what}:" in line and line[:1].isdigit():
                sec, _, ms = line.split()[0].partition(".")  # %n: "1795737506.797" (exact, not a float)
                out.append(int(sec) * 10**9 + int(ms.ljust(9, "0")[:9]))
        return out

    def version(self) -> str:
        # "postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)"
        return subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout.split()[2]

    def pids(self) -> list[int]:
        return [self.proc.pid, *children(self.proc.pid)]

    def load(self, requests: int) -> dict[str, dict[str, float]]:
        """pgbench -c 4 -j 2 -T seconds per script: transactions/s and p50/p99 latency (ms) from its
        per-transaction log (``requests`` is not used: pgbench runs for a time)."""
        out: dict[str, dict[str, float]] = {}
        for test, flags in self.SCRIPTS.items():
            logs = Path(tempfile.mkdtemp(dir=self.dir, prefix="log-"))
            text = self.pgbench(["-c", str(self.CLIENTS), "-j", "2", "-T", str(self.seconds), *flags,
                                 "-l", f"--log-prefix={logs}/tx"])
            tps = float(re.search(r"^tps = ([\d.]+)", text, re.M).group(1))  # type: ignore[union-attr]
            lat = sorted(int(line.split()[2]) / 1000 for f in logs.iterdir() for line in f.open())
            shutil.rmtree(logs)
            out[test] = {"rps": tps, "p50": lat[len(lat) // 2],
                         "p99": lat[min(len(lat) - 1, len(lat) * 99 // 100)]}
        return out

    def warm(self) -> None:
        """A short load of the measured kinds before each measured one (:func:`timed_load`)."""
        for flags in self.SCRIPTS.values():
            self.pgbench(["-c", str(self.CLIENTS), "-j", "2", "-T", "1", *flags])

    def check_load(self) -> None:
        """pgbench -C: a new connection, so a backend forked by the postmaster, per transaction."""
        self.pgbench(["-C", "-S", "-c", "2", "-j", "2", "-T", "4"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # fast shutdown: backends end, the postmaster exits
        self.proc.wait(timeout=60)
        self.log.close()


SERVICES = {"redis": Redis, "nginx": Nginx, "postgres": Postgres}


# ---------------------------------------------------------------------------------- tracers
def wait_tracked(daemon: RunningDaemon, pids: list[int] | set[int], timeout: float = 300) -> None:
    """Until the daemon follows each of ``pids`` that is still alive (a postgres child such as an
    autovacuum worker may exit in between)."""
    for pid in sorted(pids):
        try:
            wait_for(lambda p=pid: not os.path.exists(f"/proc/{p}") or p in daemon.processes(),  # type: ignore[misc]
                     timeout=timeout, interval=0.2)
        except AssertionError:
            raise AssertionError(f"pid {pid} ({Path(f'/proc/{pid}/cmdline').read_bytes()!r}) not followed: "
                                 f"{daemon.targets()}") from None


Service = Redis | Nginx | Postgres


def service_cpu(svc: Service) -> float:
    """CPU seconds the service has used: its live processes' user + system time, plus what its main
    process reaped of exited children (cutime + cstime: postgres' per-connection backends).  BPF
    programs run inside the service's syscalls, so their time is in it."""
    total = 0.0
    for pid in svc.pids():
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total + reaped_cpu_seconds(svc.proc.pid)


#: seconds between the warm-up load and the measured one: the tracer drains and settles
WARM_SETTLE_SECONDS = 1.0


def timed_load(svc: Service, requests: int) -> tuple[dict[str, dict[str, float]], float, float]:
    """``svc.load`` with the service's CPU seconds over it (:func:`service_cpu`; measured 0.3 s after
    the load, so that postgres' backends have exited and been reaped) and the load's wall time.

    A short warm-up load of the same kinds runs first, in every configuration: a daemon started for
    the measurement decodes its first samples of a binary once (its line tables, the encoding's node
    table: ~0.35 s of CPU for postgres, 7% of a core over a 5 s load), a one-time cost that a
    daemon left running does not pay per load; what is measured is the steady state."""
    svc.warm()
    time.sleep(WARM_SETTLE_SECONDS)
    c0 = service_cpu(svc)
    t0 = time.perf_counter()
    result = svc.load(requests)
    wall = time.perf_counter() - t0
    time.sleep(0.3)
    return result, service_cpu(svc) - c0, wall


def work_units(name: str, tests: dict[str, dict[str, float]], requests: int, seconds: int) -> float:
    """Requests (transactions for postgres) a load made: the fixed count per test, or for pgbench's
    timed scripts their rate times the duration."""
    if name == "postgres":
        return sum(t["rps"] for t in tests.values()) * seconds
    return float(requests * len(tests))


#: ``instrumented-scope``: a subsystem the load never calls, per service (instrumented mode probes
#: only the call graph below it), and how the bench calls it once after the load
SCOPES = {"redis": "^(saveCommand|bgsaveCommand|configSetCommand)$",
          "nginx": "^ngx_reopen_files$",  # the master, on SIGUSR1 (log rotation)
          # the smallest probe plan of the rare entry points tried: 1,983 probes (its call graph
          # reaches elog/ereport); ^(DoCopy|be_lo_export)$ has 42,421, ^be_lo_export$ 7,758
          "postgres": "^pg_reload_conf$"}


def call_scope(svc: Service) -> None:
    """Run the scoped subsystem once (its samples show the scope works under the same daemon)."""
    if isinstance(svc, Redis):
        subprocess.run(["redis-cli", "-p", str(svc.port), "save"], capture_output=True, check=True)
    elif isinstance(svc, Nginx):
        svc.proc.send_signal(signal.SIGUSR1)
    else:
        subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(svc.port), "-U", "postgres", "-Atc",
                        "SELECT pg_reload_conf()", "postgres"], capture_output=True, check=True,
                       cwd=svc.dir)


def stats_delta(before: dict[str, tuple[int, int]],
                after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Per program, what ran between two :func:`report_bpf.prog_stats` readings (programs that did not
    run left out)."""
    delta = {name: (ns - before.get(name, (0, 0))[0], cnt - before.get(name, (0, 0))[1])
             for name, (ns, cnt) in after.items()}
    return {name: v for name, v in delta.items() if v[1] > 0}


@contextlib.contextmanager
def bpf_stats_on(on: bool) -> Iterator[None]:
    """BPF run-time stats on while the block runs (common.run_time_stats); they add two clock reads
    per program run, so only ``--bpf-stats`` runs use them."""
    if not on:
        yield
        return
    with run_time_stats():
        yield


@contextlib.contextmanager
def raw_syscall_attach() -> Iterator[None]:
    """The daemon started in the block samples on raw_syscalls:sys_enter whatever its set's size (the
    path every set took before the per-syscall events, kbpf/syscall_entry.py)."""
    old = os.environ.get("CCPROFD_SYSCALL_ATTACH")
    os.environ["CCPROFD_SYSCALL_ATTACH"] = "raw"
    try:
        yield
    finally:
        if old is None:
            del os.environ["CCPROFD_SYSCALL_ATTACH"]
        else:
            os.environ["CCPROFD_SYSCALL_ATTACH"] = old


def run_daemon(workdir: Path, svc: Service, syscalls: list[str] | str, requests: int,
               mode: str = "unwind", bpf_stats: bool = False) -> dict[str, Any]:
    """The service's load under ``ccprofd run`` with the service's binary as a ``path`` target
    (its running processes are found by the daemon's /proc rescan).  ``instrumented`` mode scopes
    to :data:`SCOPES` and calls the scope once after the load."""
    wd = tempfile.mkdtemp(dir=workdir, prefix="d-")
    scope = f"scope = '{SCOPES[svc.name]}'\n" if mode == "instrumented" else ""
    target = target_toml(svc.name, f'path = "{svc.binary}"', syscalls, mode, scope)
    with RunningDaemon(wd, config_text(wd, target, daemon_extra="top_k = 20")) as daemon:
        wait_tracked(daemon, svc.pids(), timeout=120)
        progs = daemon.bpf_objects().all_progs
        with bpf_stats_on(bpf_stats):
            bpf0 = prog_stats(progs) if bpf_stats else {}
            cpu0 = cpu_seconds(daemon.proc.pid)
            result, svc_cpu, wall = timed_load(svc, requests)
            bpf1 = prog_stats(progs) if bpf_stats else {}
        time.sleep(1.2)  # the daemon drains what the load left in the rings (0.3 s more in timed_load)
        cpu = cpu_seconds(daemon.proc.pid) - cpu0
        if mode == "instrumented":
            call_scope(svc)
            time.sleep(1.5)
        dropped = sum(v for _, v in daemon.metric_samples("ccprofd_samples_dropped_total"))
        probe_hits = sum(v for _, v in daemon.metric_samples("ccprofd_probe_hits_total"))
        ctl = [sys.executable, "-m", "ccprofd.cli.ctl", "--socket", daemon.socket_path]
        every = json.loads(subprocess.run([*ctl, "--format", "json", "hot", "--top", "1000000"],
                                          capture_output=True, text=True,
                                          cwd=ROOT, timeout=120, check=True).stdout)
        contexts, samples = len(every["contexts"]), every["total_samples"]
        counted = max(1, sum(r["count"] for r in every["contexts"]))
        depth = sum(r["count"] * len(r["frames"]) for r in every["contexts"]) / counted
        program = sum(r["count"] * sum(1 for f in r["frames"] if os.path.realpath(str(f.get("module"))) ==
                                       os.path.realpath(svc.binary)) for r in every["contexts"]) / counted
        hot = subprocess.run([*ctl, "hot", "--top", "3"], capture_output=True, text=True, cwd=ROOT,
                             timeout=60).stdout
        rss = status_mb(daemon.proc.pid, "VmHWM")
        daemon.stop()
    return {"tests": result, "daemon_cpu_pct": 100 * cpu / (wall + 1.5), "daemon_rss_mb": rss,
            "dropped": dropped, "probe_hits": probe_hits, "contexts": contexts, "samples": samples,
            "hot": hot,
            "mean_depth": depth, "mean_program_frames": program, "wall": wall, "service_cpu_s": svc_cpu,
            "daemon_cpu_s": cpu, "bpf_progs": (per := stats_delta(bpf0, bpf1)),
            "bpf_ns": sum(ns for ns, _ in per.values()), "bpf_runs": sum(cnt for _, cnt in per.values())}


def program_table(prof: list[dict[str, Any]]) -> list[str]:
    """Markdown rows: per BPF program of the daemon, median runs/s, ns per run and share of the BPF
    time over ``--bpf-stats`` rounds (which program the time is spent in)."""
    def one(x: dict[str, Any], name: str) -> tuple[float, float, float]:
        ns, cnt = x["bpf_progs"].get(name, (0, 0))
        return cnt / x["wall"], ns / max(1, cnt), 100 * ns / max(1, x["bpf_ns"])

    names = {n for x in prof for n in x["bpf_progs"]}
    rows = {n: [statistics.median(one(x, n)[i] for x in prof) for i in range(3)] for n in names}
    return ["| BPF program | runs/s | ns per run | share of the BPF time |", "|---|---:|---:|---:|",
            *(f"| `{n}` | {r[0]:,.0f} | {r[1]:,.0f} | {r[2]:.0f}% |"
              for n, r in sorted(rows.items(), key=lambda kv: -kv[1][2]))]


def run_perf(workdir: Path, svc: Service, requests: int) -> dict[str, Any]:
    data = workdir / "perf.data"
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "raw_syscalls:sys_enter", "--call-graph", "dwarf",
                             "-p", ",".join(map(str, svc.pids())), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches
    cpu0 = cpu_seconds(perf.pid)
    result, svc_cpu, wall = timed_load(svc, requests)
    cpu = cpu_seconds(perf.pid) - cpu0
    perf.send_signal(signal.SIGINT)
    perf.wait(timeout=300)
    size = data.stat().st_size if data.exists() else 0
    data.unlink(missing_ok=True)
    os.sync()  # its GBs of perf.data written back now, not during the next configuration's load
    return {"tests": result, "perf_cpu_pct": 100 * cpu / wall, "perf_data_mb": size / 2**20,
            "service_cpu_s": svc_cpu}


def run_fpstacks(workdir: Path, svc: Service, requests: int) -> dict[str, Any]:
    """The frame-pointer baseline (bench/fpstacks.py: bcc, ``bpf_get_stackid(BPF_F_USER_STACK)`` on
    raw_syscalls:sys_enter for the service's processes and their children)."""
    out = workdir / "fp.json"
    argv = [sys.executable, str(ROOT / "bench" / "fpstacks.py"), "--binary", svc.binary, "--output", str(out)]
    for pid in svc.pids():
        argv += ["-p", str(pid)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "attached":
        raise RuntimeError(f"fpstacks did not attach: {proc.communicate(timeout=60)[1][-800:]}")
    cpu0 = cpu_seconds(proc.pid)
    result, svc_cpu, wall = timed_load(svc, requests)
    cpu = cpu_seconds(proc.pid) - cpu0
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"fpstacks failed ({proc.returncode}): {err[-800:]}")
    stats = json.loads(out.read_text())
    out.unlink()
    return {"tests": result, "fp_cpu_pct": 100 * cpu / wall, "service_cpu_s": svc_cpu, **stats}


def perf_events_open(pid: int) -> bool:
    """Whether process ``pid`` holds a perf_event fd (perf record has opened its events)."""
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]":
                    return True
    return False


#: the exactness check's second pairing (µs-level jitter between perf's and our stamps of a syscall)
WIDE_TOLERANCE_NS = 150_000


def check_exactness(workdir: Path, svc: Service) -> dict[str, Any]:
    """A short load traced by the daemon (unwind, every syscall, its samples streamed) and by
    ``perf record --call-graph dwarf -k mono`` at once; each perf event paired with our sample of
    the same thread and syscall (bench/exactness.py) and the program's frames compared.  perf
    inherits its events into children forked after it attached, so the processes the service
    forks (postgres: a backend per connection) are checked too: each must have samples, the
    same first syscall (followed from its first instruction) and the same number of syscalls."""
    wd = tempfile.mkdtemp(dir=workdir, prefix="x-")
    module = os.path.realpath(svc.binary)
    numbers = syscall_numbers()
    target = target_toml(svc.name, f'path = "{svc.binary}"', "all", "unwind")
    before = set(svc.pids())
    data = workdir / "exact.data"
    # a stream queue drops for a slow subscriber (counted): large enough to lose nothing here
    with RunningDaemon(wd, config_text(wd, target, daemon_extra="stream_queue = 5000000")) as daemon:
        wait_tracked(daemon, before)
        before = {p for p in svc.pids() if os.path.exists(f"/proc/{p}")}  # perf -p refuses a gone pid
        stream = SampleStream(daemon.stub, svc.name)
        perf = subprocess.Popen(["perf", "record", "-q", "-k", "mono", "-e", "raw_syscalls:sys_enter",
                                 "--call-graph", "dwarf", "-p", ",".join(map(str, sorted(before))),
                                 "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        # perf attaches: its event fds exist (on a loaded machine this took longer than the 1 s
        # once waited here, and perf saw 61 of nginx's 14,000 syscalls), then it enables them
        wait_for(lambda: perf_events_open(perf.pid), timeout=120, interval=0.1)
        time.sleep(1.0)
        offset = time.time_ns() - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        svc.check_load()
        perf.send_signal(signal.SIGINT)
        _, perf_err = perf.communicate(timeout=300)
        if perf.returncode not in (0, -signal.SIGINT) or not data.exists():
            raise RuntimeError(f"perf record failed ({perf.returncode}): {perf_err.strip()[-500:]}")
        stopped_ns = time.time_ns()

        def drained() -> bool:
            """The daemon drained its rings and the stream its queue: a sample stamped 2 s after
            perf stopped arrived, or nothing came for 3 s (an idle service)."""
            n = len(stream.samples)
            time.sleep(3.0)
            got = stream.samples
            return len(got) == n or max(s.time_ns for s in got[n:]) > stopped_ns + 2_000_000_000

        wait_for(drained, timeout=600, interval=0)
        samples = stream.samples
        stream.close()
        dropped = sum(v for _, v in daemon.metric_samples("ccprofd_samples_dropped_total"))
        daemon.stop()
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "pid,tid,time,event,trace,ip,sym,dso",
                             "--ns"], capture_output=True, text=True, check=True).stdout
    data.unlink(missing_ok=True)
    events = exactness.parse_perf_script(script)
    if os.environ.get("CCPROFD_BENCH_KEEP"):  # the raw material, for looking at disagreements
        Path(os.environ["CCPROFD_BENCH_KEEP"]).write_text(script)
    ours = [exactness.OurSample(
        s.pid, s.tid, s.time_ns, numbers.get(s.syscall, -1), s.complete,
        [(f.call_site, f.return_address if f.HasField("return_address") else f.call_site)
         for f in s.frames if f.analysed and not f.tail_call and f.HasField("call_site")])
        for s in samples if s.event == "syscall"]
    if os.environ.get("CCPROFD_BENCH_KEEP"):
        Path(os.environ["CCPROFD_BENCH_KEEP"] + ".ours.json").write_text(json.dumps([o.__dict__
                                                                                     for o in ours]))
    counts = exactness.compare(exactness.pair(events, ours, offset), module)
    # the unpaired again with a wider window: a timing slip (the two stamps of one syscall further
    # apart than the tolerance) pairs there; a sample we lost or a wrong chain does not agree
    wide = exactness.compare(exactness.pair(events, ours, offset, tolerance_ns=WIDE_TOLERANCE_NS), module)
    # processes forked during the load: perf saw them from their first syscall
    perf_first = exactness.first_syscalls((e.pid, e.time_ns, e.nr) for e in events if e.pid not in before)
    our_first = exactness.first_syscalls((s.pid, s.time_ns, s.nr) for s in ours if s.pid in perf_first)
    perf_n: dict[int, int] = {}
    for e in events:
        perf_n[e.pid] = perf_n.get(e.pid, 0) + 1
    our_n: dict[int, int] = {}
    for o in ours:
        our_n[o.pid] = our_n.get(o.pid, 0) + 1
    return {**counts, "wide": wide, "perf_events": len(events), "our_samples": len(ours), "dropped": dropped,
            "forked": len(perf_first), "forked_seen": sum(p in our_first for p in perf_first),
            "forked_first_same": sum(our_first.get(p) == nr for p, nr in perf_first.items()),
            "forked_count_same": sum(our_n.get(p) == perf_n[p] for p in perf_first),
            "forked_fewer": sum(our_n.get(p, 0) < perf_n[p] for p in perf_first),
            # glibc's fork child starts with set_robust_list (before any code of the program runs)
            "forked_first_robust": sum(our_first.get(p) == numbers["set_robust_list"] for p in perf_first)}


# ------------------------------------------------------------------------------------ report
def median_tests(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    tests = runs[0]["tests"].keys()
    return {t: {k: statistics.median(r["tests"][t][k] for r in runs) for k in ("rps", "p50", "p99")}
            for t in tests}


LOADS = {"redis": "redis-benchmark -c 50 -n {n}", "nginx": "ab -k -c 50 -n {n}",
         "postgres": "pgbench -s 2, -c 4 -j 2 -T {s} per script, fsync off"}


def paired_change(results: dict[str, list[dict[str, Any]]], cfg: str, test: str) -> float:
    """Median over rounds of the throughput change against the untraced run of the same round (%):
    the rounds alternate, so a drift of the shared machine hits both halves of a pair alike."""
    pairs = zip(results["untraced"], results[cfg], strict=False)
    return statistics.median(100 * (c["tests"][test]["rps"] / u["tests"][test]["rps"] - 1) for u, c in pairs)


#: issue 14's throughput targets: loss with every syscall traced, and with the security set
TARGET_ALL, TARGET_SECURITY = 10.0, 2.0


def targets(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The load average of the run and, per test, issue 14's targets met or not (paired medians)."""
    loads = [r["load1"] for rs in results.values() for r in rs if "load1" in r]
    out = [""]
    if loads:
        out.append(f"Load average (1 min) after each measured load: median {statistics.median(loads):.2f}, "
                   f"{min(loads):.2f}-{max(loads):.2f} (2 CPUs shared with other work).")
    if not results.get("unwind-all") and not results.get("unwind-security"):
        return out
    out += ["", "Throughput change against the untraced run of the same round, median over the rounds, "
            f"and issue 14's targets (every syscall: loss <= {TARGET_ALL:g}% and less than perf's; "
            f"security set: loss <= {TARGET_SECURITY:g}%):", "",
            "| test | unwind-all | perf-dwarf | unwind-security | every syscall | security set |",
            "|---|---:|---:|---:|---|---|"]
    for t in results["untraced"][0]["tests"]:
        ch = {c: paired_change(results, c, t) for c in ("unwind-all", "perf-dwarf", "unwind-security")
              if results.get(c)}
        cell = {c: f"{v:+.1f}%" for c, v in ch.items()}
        met_all = "–"
        if "unwind-all" in ch:
            ok = -ch["unwind-all"] <= TARGET_ALL and ch["unwind-all"] > ch.get("perf-dwarf", -100.0)
            met_all = "met" if ok else "**not met**"
        met_sec = "–" if "unwind-security" not in ch else \
            ("met" if -ch["unwind-security"] <= TARGET_SECURITY else "**not met**")
        out.append(f"| {t} | {cell.get('unwind-all', '–')} | {cell.get('perf-dwarf', '–')} | "
                   f"{cell.get('unwind-security', '–')} | {met_all} | {met_sec} |")
    if results.get("unwind-security") and results.get("unwind-security-raw"):
        out += ["", "The security set by attach path (kbpf/syscall_entry.py), same pairing:", "",
                "| test | per-syscall events (unwind-security) "
                "| raw_syscalls:sys_enter (unwind-security-raw) |",
                "|---|---:|---:|"]
        for t in results["untraced"][0]["tests"]:
            out.append(f"| {t} | {paired_change(results, 'unwind-security', t):+.1f}% | "
                       f"{paired_change(results, 'unwind-security-raw', t):+.1f}% |")
    return out


def cpu_table(name: str, results: dict[str, list[dict[str, Any]]], requests: int, seconds: int) -> list[str]:
    """The service's own CPU per request by configuration (its processes' user + system time over the
    whole load, the BPF programs that run in its syscalls included), and the paired change against
    the same round's untraced load: the tracer's cost to the service itself, which the throughput
    of a load generator sharing the 2 CPUs (slowed too by the syscall-tracing slow path every
    tracepoint turns on for all tasks, and competing with the tracer for the CPUs) shows only
    mixed with the noise of the machine."""
    def per_unit(r: dict[str, Any]) -> float:
        return 1e6 * r["service_cpu_s"] / max(1.0, work_units(name, r["tests"], requests, seconds))

    base = [r for r in results["untraced"] if "service_cpu_s" in r]
    if not base:
        return []
    unit = "transaction" if name == "postgres" else "request"
    out = ["", f"The service's own CPU per {unit} (user + system time of its processes over the whole "
           "load, the BPF programs run in its syscalls included; median over the rounds, and the median "
           "of the change against the same round's untraced load):", "",
           f"| configuration | CPU µs per {unit} | vs untraced |", "|---|---:|---:|"]
    for cfg, rs in results.items():
        runs = [r for r in rs if "service_cpu_s" in r]
        if not runs:
            continue
        med = statistics.median(per_unit(r) for r in runs)
        pairs = zip(base, runs, strict=False)
        change = "" if cfg == "untraced" else \
            f"{statistics.median(100 * (per_unit(c) / per_unit(u) - 1) for u, c in pairs):+.1f}%"
        out.append(f"| {cfg} | {med:,.1f} | {change} |")
    return out


def render_service(name: str, version: str, results: dict[str, list[dict[str, Any]]], rounds: int,
                   requests: int, seconds: int = 0) -> list[str]:
    base = median_tests(results["untraced"])
    rate = "transactions/s" if name == "postgres" else "requests/s"
    load = LOADS[name].format(n=f"{requests:,}", s=f"{seconds:g}")
    lines = [f"**{name} {version}**, {load}, {rounds} rounds alternating, medians:", "",
             f"| configuration | test | {rate} | vs untraced | p50 ms | p99 ms |",
             "|---|---|---:|---:|---:|---:|"]
    for cfg in CONFIGS:
        if not results.get(cfg):
            continue
        med = median_tests(results[cfg])
        for t, m in med.items():
            change = 100 * (m["rps"] / base[t]["rps"] - 1)
            lines.append(f"| {cfg} | {t} | {m['rps']:,.0f} | {change:+.0f}% | {m['p50']:.3f} | "
                         f"{m['p99']:.3f} |")
    lines += targets(results)
    lines += cpu_table(name, results, requests, seconds)
    if any(results.get(c) for c in ("unwind-all", "unwind-security", "instrumented-scope", "perf-dwarf",
                                    "bpf-fp")):  # a tracer's own cost: none for scope-probes alone
        lines += ["", "| configuration | tracer CPU % of a core | tracer peak RSS MB | samples | dropped "
                  "| contexts |",
                  "|---|---:|---:|---:|---:|---:|"]
    for cfg in ("unwind-all", "unwind-security", "unwind-security-raw", "instrumented-scope"):
        if results.get(cfg):
            r = results[cfg]
            lines.append(f"| {cfg} | {statistics.median(x['daemon_cpu_pct'] for x in r):.0f} | "
                         f"{max(x['daemon_rss_mb'] for x in r):.0f} | "
                         f"{statistics.median(x['samples'] for x in r):,.0f} | "
                         f"{statistics.median(x['dropped'] for x in r):,.0f} | "
                         f"{statistics.median(x['contexts'] for x in r):,.0f} |")
    if results.get("perf-dwarf"):
        r = results["perf-dwarf"]
        lines.append(f"| perf-dwarf | {statistics.median(x['perf_cpu_pct'] for x in r):.0f} | – | – | – | "
                     f"({statistics.median(x['perf_data_mb'] for x in r):.0f} MB perf.data) |")
    if results.get("bpf-fp"):
        r = results["bpf-fp"]
        cpu = statistics.median(x['fp_cpu_pct'] for x in r)
        lines.append(f"| bpf-fp | {cpu:.0f} (user space only) | – | "
                     f"{statistics.median(x['samples'] for x in r):,.0f} | – | "
                     f"({statistics.median(x['distinct_stacks'] for x in r):,.0f} stacks) |")
    depth_rows = [(cfg, r) for cfg in ("unwind-all", "bpf-fp") for r in results.get(cfg, [])[-1:]
                  if "mean_depth" in r]
    if depth_rows:
        lines += ["", "Stack depth per syscall sample (last round; frames of the service's own binary "
                  "apart):",
                  "", "| configuration | mean frames | mean frames in the service's binary | failed walks |",
                  "|---|---:|---:|---:|"]
        for cfg, r in depth_rows:
            lines.append(f"| {cfg} | {r['mean_depth']:.1f} | {r['mean_program_frames']:.1f} | "
                         f"{r.get('failed', '–')} |")
        fp = [r for cfg, r in depth_rows if cfg == "bpf-fp"]
        if fp:
            hist = ", ".join(f"{k}: {100 * v / max(1, fp[0]['samples']):.0f}%"
                             for k, v in fp[0]["program_frames_hist"].items())
            lines.append(f"\nbpf-fp: samples by number of frames in the service's binary: {hist}.")
    prof = [x for x in results.get("unwind-all", []) if x.get("bpf_runs")]
    if prof:
        def med(f: Any) -> float:
            return statistics.median(f(x) for x in prof)
        lines += ["", "Where unwind-all's time goes (`--bpf-stats`, medians over the rounds; BPF run time "
                  "from BPF_ENABLE_STATS, the service's and the daemon's CPU from /proc during the load): "
                  f"{med(lambda x: x['bpf_runs'] / x['wall']):,.0f} BPF program runs/s (the sys_enter "
                  "tracepoint fires for every process's syscalls: the other processes' runs exit early), "
                  f"{med(lambda x: x['bpf_ns'] / x['bpf_runs']):,.0f} ns per run, "
                  f"{med(lambda x: x['bpf_ns'] / max(1, x['samples'])):,.0f} ns of BPF time per sample of "
                  f"the service ({med(lambda x: x['samples'] / x['wall']):,.0f} samples/s); "
                  f"BPF time {med(lambda x: x['bpf_ns'] / 1e9 / x['wall']) * 100:.0f}% of a core against "
                  f"the service's own CPU {med(lambda x: x['service_cpu_s'] / x['wall']) * 100:.0f}% "
                  f"(which includes the BPF time: it runs in the service's syscalls) and the daemon's "
                  f"{med(lambda x: x['daemon_cpu_s'] / x['wall']) * 100:.0f}%."]
        lines += ["", *program_table(prof)]
    if results.get("instrumented-scope"):
        r = results["instrumented-scope"]
        per = requests if name != "postgres" else None
        hits = statistics.median(x["probe_hits"] for x in r)
        lines += ["", f"instrumented-scope: the daemon counted {hits:,.0f} probe hits per load (median)"
                  + (f", {hits / (per * len(r[0]['tests'])):.1f} per request" if per else "") + "."]
    if results.get("scope-probes"):
        r = results["scope-probes"][-1]
        lines += ["", f"scope-probes (last round): the plan for `scope = '{SCOPES[name]}'` has {r['probes']} "
                  f"probes ({', '.join(f'{v} {k}' for k, v in sorted(r['kinds'].items()))}); under the load "
                  f"{r['probes_fired']} of them fired, {r['hits']:,} hits"
                  + (f" ({r['hits'] / (requests * len(r['tests'])):.1f} per request)" if name != "postgres"
                     else f" ({r['hits'] / max(1, sum(t['rps'] for t in r['tests'].values()) * seconds):.1f} "
                     "per transaction)") + ", by probe (kind, the function it is in, the callee):", "",
                  "| probe kind | in function | callee | hits |", "|---|---|---|---:|"]
        lines += [f"| {k} | `{f}` | `{t}` | {c:,} |" for k, f, t, c in r["top"]]
    if results.get("instrumented-scope"):
        lines += ["", f"instrumented-scope: `scope = '{SCOPES[name]}'`, called once after the load; the top "
                  "of `ccprofctl hot` then (last round):", "", "```",
                  results["instrumented-scope"][-1]["hot"].rstrip()[:2000], "```"]
    if results.get("unwind-all"):
        lines += ["", f"Top of `ccprofctl hot` ({name}, unwind-all, last round):", "", "```",
                  results["unwind-all"][-1]["hot"].rstrip()[:3000], "```"]
    return [*lines, ""]


EXACT_LOADS = {"redis": "redis-benchmark -t get,set -n 2000 -c 4",
               "nginx": "ab -k -c 4, 1,500 requests of the 4 KB file and 500 of the 64 KB one",
               "postgres": "pgbench -C -S -c 2 -T 4: a new connection, so a forked backend, per transaction"}


def render_exactness(name: str, r: dict[str, Any]) -> list[str]:
    n = r["perf_events"]
    pct = (lambda k: f"{100 * r[k] / n:.1f}%") if n else (lambda k: "–")
    lines = [f"Exactness ({name}; {EXACT_LOADS[name]}; the daemon and `perf record -e raw_syscalls:sys_enter "
             "--call-graph dwarf` at once; each perf event paired with our sample of the same thread and "
             "syscall; the program's frames compared, bench/exactness.py):", "",
             "| perf events | our samples (dropped) | frames agree | perf chain truncated | differ "
             "| ours incomplete | unpaired |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {n:,} | {r['our_samples']:,} ({r['dropped']:,.0f}) | {r['agree']:,} ({pct('agree')}) | "
             f"{r['perf_truncated']:,} | {r['differ']:,} ({pct('differ')}) | {r['ours_incomplete']:,} | "
             f"{r['unmatched']:,} |", ""]
    if r.get("wide") and r["unmatched"]:
        w = r["wide"]
        lines += [f"Paired again within {WIDE_TOLERANCE_NS // 1000} µs instead of 50 µs (perf's and our "
                  "stamps of one syscall further apart than the tolerance): frames agree "
                  f"{w['agree']:,}, perf chain truncated {w['perf_truncated']:,}, differ {w['differ']:,}, "
                  f"ours incomplete {w['ours_incomplete']:,}, unpaired {w['unmatched']:,}.", ""]
    if r["forked"]:
        lines += [f"Processes forked by the service during the check (perf inherits its event into them): "
                  f"{r['forked']}; with samples of ours: {r['forked_seen']}; whose first sample of ours is "
                  f"`set_robust_list` (glibc's fork child's first syscall, before any program code): "
                  f"{r['forked_first_robust']}; with the same first syscall as perf: "
                  f"{r['forked_first_same']}; "
                  f"with as many syscalls as perf: {r['forked_count_same']}, fewer than perf: "
                  f"{r['forked_fewer']} (perf loses events under load: where it saw fewer, it lost "
                  "them).", ""]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", default="redis,nginx,postgres",
                    help="comma-separated: redis, nginx, postgres")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating rounds (this VM varies +-20%% run to run); 0: the exactness check only")
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--seconds", type=int, default=10, help="pgbench's -T per script")
    ap.add_argument("--no-exactness", dest="exactness", action="store_false",
                    help="skip the frame-by-frame check against perf script")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated configurations to measure, of {', '.join(CONFIGS)} "
                    "(untraced always)")
    ap.add_argument("--bpf-stats", action="store_true",
                    help="unwind-all: the daemon's BPF programs' run time per sample (BPF_ENABLE_STATS) "
                    "against the service's and the daemon's CPU")
    ap.add_argument("--section", default="services", help="README section --update-readme writes")
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args()
    configs = ["untraced", *(c for c in args.configs.split(",") if c != "untraced")]
    if set(configs) - set(CONFIGS):
        print(f"services: unknown configuration(s) {', '.join(set(configs) - set(CONFIGS))}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("services: needs root (BPF)", file=sys.stderr)
        return 2
    text = [f"Measured by `bench/services.py` on {machine_line()}.", ""]
    scope_refused: dict[str, dict[str, Any]] = {}
    for name in args.services.split(","):
        cls = SERVICES[name]
        missing = [t for t in cls.tools if not shutil.which(t)]
        if missing:
            print(f"services: {name}: {', '.join(missing)} missing: run bench/setup.sh", file=sys.stderr)
            text += [f"**{name}**: not measured ({', '.join(missing)} missing).", ""]
            continue
        results: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
        with tempfile.TemporaryDirectory(prefix=f"ccprofd-{name}-") as d:
            work = Path(d)
            svc = Postgres(work, args.seconds) if cls is Postgres else cls(work)
            try:
                if args.rounds:
                    svc.load(args.requests)  # warm-up: allocator, page cache
                for rnd in range(args.rounds):
                    # each round starts one configuration later: none always follows the same one
                    for cfg in configs[rnd % len(configs):] + configs[:rnd % len(configs)]:
                        if cfg == "untraced":
                            tests, svc_cpu, _ = timed_load(svc, args.requests)
                            r: dict[str, Any] = {"tests": tests, "service_cpu_s": svc_cpu}
                        elif cfg == "unwind-all":
                            r = run_daemon(work, svc, "all", args.requests, bpf_stats=args.bpf_stats)
                        elif cfg == "unwind-security":
                            r = run_daemon(work, svc, SECURITY, args.requests)
                        elif cfg == "unwind-security-raw":
                            with raw_syscall_attach():
                                r = run_daemon(work, svc, SECURITY, args.requests)
                        elif cfg == "instrumented-scope":
                            try:
                                r = run_daemon(work, svc, "all", args.requests, "instrumented")
                            except AssertionError as exc:  # the target failed to attach
                                why = str(exc).split("error: ")[-1][:300]
                                scope_refused[f"{name} daemon"] = {"error": why}
                                continue
                        elif cfg == "scope-probes":
                            r = scope_hits.count_hits(svc.binary, SCOPES[name],
                                                      lambda s=svc: s.load(args.requests))  # type: ignore[misc]
                            if "error" in r:  # the kernel refused a probe: no load ran
                                scope_refused[name] = r
                                continue
                            r["tests"] = r.pop("load")
                        elif cfg == "bpf-fp":
                            r = run_fpstacks(work, svc, args.requests)
                        elif shutil.which("perf"):
                            r = run_perf(work, svc, args.requests)
                        else:
                            continue
                        r["load1"] = os.getloadavg()[0]  # a shared machine: other work skews rounds
                        results[cfg].append(r)
                        print(f"{name} round {rnd + 1} {cfg} (load {r['load1']:.2f}): " + ", ".join(
                            f"{t} {m['rps']:,.0f}/s" for t, m in r["tests"].items()), file=sys.stderr)
                version = svc.version()
                exact = check_exactness(work, svc) if args.exactness and shutil.which("perf") else None
            finally:
                svc.stop()
        if args.rounds:
            text += render_service(name, version, results, args.rounds, args.requests, args.seconds)
        else:
            text += [f"**{name} {version}**", ""]
        if exact is not None:
            text += render_exactness(name, exact)
        for key, r in scope_refused.items():
            if key.split()[0] != name:
                continue
            if "refused" in r:
                each = "; ".join(f"{x[0]} probe at {x[1]} in `{x[2]}`: {x[3]}" for x in r["refused"][:10])
                text += [f"scope-probes: the plan for `scope = '{SCOPES[name]}'` has {r['probes']} probes; "
                         f"the kernel refused the link ({r['error']}); probes refused one by one with {name} "
                         f"running: {each or 'none'}.", ""]
            else:
                text += [f"instrumented-scope: the daemon's target failed: {r['error'].strip()}", ""]
    publish(args.section, "\n".join(text), args.update_readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
