"""Anomaly detection on real services: learning curves and injected attacks (issue 14).

Per service (redis, nginx, postgres; started as bench/services.py starts them, on loopback in a
temporary directory), one ``ccprofd trace --mode unwind --format jsonl -p PID...`` is attached to
the running service (every syscall; processes it forks later, such as postgres backends, are
followed) and stays attached while the bench drives, one after another, N random *workload mixes*
(different commands, sizes, concurrency and clients: see ``*_mix`` below) and then the injected
attacks.  The samples are split by time into one file per mix (a mix's window runs from its first
request to 0.3 s after its last answer; samples in the gaps between mixes are dropped), so every
mix is judged as ``ccprofd learn --samples`` / ``ccprofd detect --samples`` (``--alert-interval 0``)
judge it, by the same Learner and Detector in this process (:func:`learn`, :func:`detect`: the
model goes through its file format before each detection; a postgres mix is up to 2 GB of samples,
read as a stream once per step for every granularity, not once per command):

* learning curve: the model learns training mixes one at a time; after k mixes, the held-out
  mixes (other random mixes of the same service) are checked, in every granularity (``exact``,
  ``--granularity edges``, ``--granularity routines``, and ``routines-functions``: routines with
  ``--prefix-match functions``), and twice more as a daemon sampling only the security set
  (bench/services.py's ``SECURITY``) would judge them: ``exact@security`` and
  ``routines-functions@security``, a model learned from those syscalls' samples and the CPU
  samples only, checking only those syscalls' samples.  A false alert is any alert on a held-out
  mix (``incomplete_context`` alerts included, counted apart).
* attacks: each attack's window is checked with the model of all training mixes; the alerts whose
  frames name the attack's code (e.g. ``rdbSave``) are reported with their call chains.

Attacks: redis ``CONFIG SET dir`` + ``CONFIG SET dbfilename`` + ``SAVE`` (writes an RDB file where
the attacker chose); nginx a directory probe (``GET /private/``, a directory without an index
file: the index module looks for ``private/index.html``), an index probe (``GET /admin/``, a
directory whose ``index.html`` no client asks for: nginx opens it after the index module's internal
redirect, an ``openat`` through a path no normal request takes) and a ``POST`` with a 64 KB body to
a static file (nginx reads and discards a body no normal client sends); postgres ``COPY (SELECT ...) TO
'/file'`` and ``SELECT lo_export(...)`` (server-side file writes by a superuser session).

Writes docs/services-anomaly.md and docs/services-anomaly-learning-curve.png (``--output X.md``: X.md
and X-learning-curve.png).
Usage (root): python bench/services_anomaly.py [--services redis,nginx,postgres] [--train 8]
[--held-out 4] [--seed 3] [--pg-seconds 12] [--pg-rate TPS] [--sample-hz N] [--keep-samples DIR]

With ``--sample-hz N`` the tracer also takes CPU samples; learning adds the calls they show running
to the model (evidence for granularity ``routines``: a path seen running, not only seen making a
syscall); detection ignores them.

The training mixes, together, ask for every request of the service's vocabulary at least once
(:func:`vocabulary`, :func:`deal`): a request no training mix made is new behaviour, not a false
alert to blame on the model.  Held-out mixes are free random mixes of the same vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import ROOT, machine_line
from services import SECURITY, Nginx, Postgres, Redis

DOCS = ROOT / "docs"
CCPROFD = [sys.executable, "-c", "from ccprofd.cli.main import main; raise SystemExit(main())"]
#: the ways each held-out mix is judged: a granularity, or ``routines-functions``: granularity
#: routines with ``--prefix-match functions``
GRANULARITIES = ("exact", "edges", "routines", "routines-functions")
#: ... and as a daemon target with ``syscalls`` = bench/services.py's security set would see the
#: service (the deployment whose cost issue 14's 2% target is about): a model learned from those
#: syscalls' samples (and the CPU samples) only, judging only those syscalls' samples
SECURITY_SUFFIX = "@security"
JUDGINGS = (*GRANULARITIES, "exact" + SECURITY_SUFFIX, "routines-functions" + SECURITY_SUFFIX)
SECURITY_NAMES = frozenset(SECURITY)


def detector_options(judged: str) -> Any:
    """The DetectorOptions of one of :data:`JUDGINGS` (every alert counted: interval 0)."""
    from ccprofd.anomaly.detector import DetectorOptions

    granularity, _, match = judged.removesuffix(SECURITY_SUFFIX).partition("-")
    return DetectorOptions(granularity=granularity, prefix_match=match or "sites", alert_interval_seconds=0)


def in_security_set(s: dict[str, Any]) -> bool:
    """Whether a daemon sampling the security set would have sample ``s`` (CPU samples: kept)."""
    return s.get("event") == "cpu" or s.get("syscall") in SECURITY_NAMES


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def ccprofd(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*CCPROFD, *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"ccprofd {' '.join(args[:4])} failed ({r.returncode}): {r.stderr.strip()[-800:]}")
    return r


# ------------------------------------------------------------------------------------ tracing
class Attached:
    """``ccprofd trace -p`` on a running service's processes, writing jsonl samples to ``out``."""

    def __init__(self, pids: list[int], out: Path, poke: Callable[[], None], mode: str = "unwind",
                 sample_hz: int = 0) -> None:
        self.out = out
        self.err = open(out.with_suffix(".err"), "w")  # noqa: SIM115 - open while tracing
        argv = [*CCPROFD, "trace", "--mode", mode, "--format", "jsonl", "--output", str(out)]
        if sample_hz:
            argv += ["--sample-hz", str(sample_hz)]
        for pid in pids:
            argv += ["-p", str(pid)]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.err)
        deadline = time.monotonic() + 600
        while not (out.exists() and out.stat().st_size):  # attached: the service's syscalls arrive
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ccprofd trace -p {pids} did not start: "
                                   f"{out.with_suffix('.err').read_text()[-800:]}")
            poke()
            time.sleep(0.5)

    def stop(self) -> str:
        time.sleep(2.0)  # the tracer drains its rings
        self.proc.send_signal(signal.SIGTERM)  # detaches, leaves the service running
        self.proc.wait(timeout=300)
        self.err.close()
        return self.out.with_suffix(".err").read_text()


@dataclass
class Window:
    name: str
    start_ns: int
    end_ns: int = 0
    what: str = ""
    lost: int = 0  # samples the tracer reported lost in this window (its ring was full)
    path: Path | None = None  # the window's samples, one JSON line each (written by :func:`split`)
    samples: int | None = None  # lines in ``path``, when known

    def file(self) -> Path:
        assert self.path is not None, f"window {self.name}: no samples split into it"
        return self.path

    def count(self) -> int:
        if self.samples is None:
            with self.file().open("rb") as fh:
                self.samples = sum(1 for _ in fh)
        return self.samples


def timed(name: str, what: str, run: Callable[[], None]) -> Window:
    w = Window(name, time.time_ns(), what=what)
    run()
    w.end_ns = time.time_ns() + 300_000_000
    time.sleep(0.6)  # a gap: the next window starts after this one's trailing samples
    return w


def split(samples: Path, windows: list[Window], out: Path) -> None:
    """Each sample line into the file ``out/WINDOW.jsonl`` of the window its time falls in (others
    dropped), read and written as streams (a postgres run's trace is several GB); the tracer's
    ``{"event": "lost", "samples": N}`` records are counted, not kept (learn/detect read samples)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {w.name: (out / f"{w.name}.jsonl").open("w") for w in windows}
    try:
        for w in windows:
            w.path, w.samples = out / f"{w.name}.jsonl", 0
        with samples.open() as fh:
            for line in fh:
                doc = json.loads(line)
                t = doc.get("time_ns", 0)
                for w in windows:
                    if w.start_ns <= t <= w.end_ns:
                        if "syscall" in doc and "frames" in doc:
                            files[w.name].write(line if line.endswith("\n") else line + "\n")
                            w.samples = (w.samples or 0) + 1
                        elif doc.get("event") == "lost":
                            w.lost += int(doc.get("samples", 0))
                        break
    finally:
        for f in files.values():
            f.close()


# ------------------------------------------------------------------------------------ mixes
REDIS_TESTS = ("ping_inline", "ping_mbulk", "set", "get", "incr", "lpush", "rpush", "lpop", "rpop", "sadd",
               "hset", "spop", "zadd", "zpopmin", "lrange_100", "lrange_300", "mset", "xadd")
REDIS_CLI = (["info"], ["dbsize"], ["config", "get", "maxmemory"], ["type", "key:__rand_int__"],
             ["exists", "counter:__rand_int__"], ["expire", "mylist", "600"], ["ttl", "mylist"],
             ["llen", "mylist"], ["scard", "myset"], ["hgetall", "myhash"], ["client", "list"])


def vocabulary(name: str) -> list[tuple[str, Any]]:
    """A service's request vocabulary: what its clients ask of it in normal operation.  The training
    mixes, together, ask for each item at least once (:func:`deal`); held-out mixes are free random
    mixes of the same vocabulary."""
    if name == "redis":
        return [("test", t) for t in REDIS_TESTS] + [("cli", c) for c in REDIS_CLI]
    if name == "nginx":
        return [("file", f) for f in (*sorted(NGINX_FILES), "missing.html")]
    return [("script", s) for s in PG_SCRIPTS] + [("query", q) for q in PG_QUERIES]


def deal(items: list[tuple[str, Any]], mixes: int, rng: random.Random) -> list[list[tuple[str, Any]]]:
    """The vocabulary shuffled and dealt round-robin over ``mixes`` training mixes."""
    items = items[:]
    rng.shuffle(items)
    return [items[i::mixes] for i in range(mixes)]


def with_required(picked: list[Any], must: list[tuple[str, Any]], kind: str) -> list[Any]:
    """``picked`` plus the items of ``kind`` this mix must include (no repeats, order kept)."""
    out = list(picked)
    out += [x for k, x in must if k == kind and x not in out]
    return out


def redis_mix(svc: Redis, rng: random.Random, must: list[tuple[str, Any]]) -> tuple[str, Callable[[], None]]:
    tests = with_required(rng.sample(REDIS_TESTS, rng.randint(4, 8)), must, "test")
    n, c, d = rng.choice((300, 600, 1000)), rng.choice((1, 4, 10, 20)), rng.choice((3, 64, 512, 4096))
    pipe = rng.choice((1, 1, 4, 16))
    cli = with_required(rng.sample(REDIS_CLI, rng.randint(2, 5)), must, "cli")
    what = f"redis-benchmark -t {','.join(tests)} -n {n} -c {c} -d {d} -P {pipe}; redis-cli " + \
        "; ".join(" ".join(x) for x in cli)

    def run() -> None:
        subprocess.run(["redis-benchmark", "-p", str(svc.port), "-t", ",".join(tests), "-n", str(n), "-c",
                        str(c), "-d", str(d), "-P", str(pipe), "-q"], capture_output=True, check=True)
        for cmd in cli:
            subprocess.run(["redis-cli", "-p", str(svc.port), *cmd], capture_output=True, check=True)
    return what, run


def redis_attacks(svc: Redis, work: Path) -> list[tuple[str, str, Callable[[], None], tuple[str, ...]]]:
    evil = work / "evil"
    evil.mkdir()

    def run() -> None:
        for cmd in (["config", "set", "dir", str(evil)], ["config", "set", "dbfilename", "authorized_keys"],
                    ["save"]):
            out = subprocess.run(["redis-cli", "-p", str(svc.port), *cmd], capture_output=True, text=True,
                                 check=True).stdout
            if out.strip() != "OK":
                raise RuntimeError(f"redis {cmd}: {out}")
        if not (evil / "authorized_keys").exists():
            raise RuntimeError("redis SAVE wrote no file")
    return [("config-set-dir-save",
             f"`CONFIG SET dir {evil.name}/`, `CONFIG SET dbfilename authorized_keys`, `SAVE`", run,
             ("rdbSave", "configSetCommand", "saveCommand"))]


NGINX_FILES = {"index.html": 1200, "small.html": 4096, "style.css": 9000, "large.bin": 65536,
               "huge.bin": 1 << 20, "img/logo.png": 20000}


def nginx_setup(svc: Nginx) -> None:
    www = Path(str(svc.proc.args[2])).parent / "www"  # the -c conf's directory
    for name, size in NGINX_FILES.items():
        p = www / name
        p.parent.mkdir(exist_ok=True)
        p.parent.chmod(0o755)
        p.write_bytes(os.urandom(size // 2 + 1).hex().encode()[:size])
        p.chmod(0o644)
    (www / "private").mkdir()  # a directory without an index file: only the attack asks for it
    (www / "private").chmod(0o755)
    (www / "admin").mkdir()  # a directory with an index file: only the attack asks for it
    (www / "admin").chmod(0o755)
    (www / "admin" / "index.html").write_text("admin\n")
    (www / "admin" / "index.html").chmod(0o644)


def nginx_mix(svc: Nginx, rng: random.Random, must: list[tuple[str, Any]]) -> tuple[str, Callable[[], None]]:
    files = rng.sample(sorted(NGINX_FILES), rng.randint(2, 4))
    if rng.random() < 0.5:
        files.append("missing.html")  # 404s happen on every site
    files = with_required(files, must, "file")
    n, c, keep, head = rng.choice((100, 200, 400)), rng.choice((1, 5, 20)), rng.random() < 0.6, \
        rng.random() < 0.3
    what = f"ab -n {n} -c {c}{' -k' if keep else ''}{' -i' if head else ''} on /" + ", /".join(files)

    def run() -> None:
        for f in files:
            subprocess.run(["ab", "-q", "-n", str(n), "-c", str(c), *(["-k"] if keep else []),
                            *(["-i"] if head else []), f"http://127.0.0.1:{svc.port}/{f}"],
                           capture_output=True, check=True)
    return what, run


def nginx_attacks(svc: Nginx, work: Path) -> list[tuple[str, str, Callable[[], None], tuple[str, ...]]]:
    base = f"http://127.0.0.1:{svc.port}"

    def probe() -> None:
        subprocess.run(["curl", "-s", "-o", "/dev/null", f"{base}/private/"], check=True)

    def index() -> None:
        subprocess.run(["curl", "-s", "-o", "/dev/null", f"{base}/admin/"], check=True)

    def post() -> None:
        body = work / "body.bin"
        body.write_bytes(b"x" * 65536)
        subprocess.run(["curl", "-s", "-o", "/dev/null", "-X", "POST", "--data-binary", f"@{body}",
                        f"{base}/small.html"], check=True)
    return [("directory-probe", "`GET /private/` (a directory without an index file)", probe,
             ("ngx_http_index_handler", "path:/private/")),
            ("index-probe", "`GET /admin/` (a directory whose `index.html` no client asks for)", index,
             ("ngx_http_internal_redirect", "path:admin/index.html")),
            ("post-body", "`POST /small.html` with a 64 KB body", post,
             ("ngx_http_discard_request_body", "ngx_http_read_discarded_request_body",
              "ngx_http_discarded_request_body_handler"))]


PG_QUERIES = ("SELECT count(*) FROM pgbench_accounts", "SELECT * FROM pgbench_branches",
              "SELECT sum(abalance) FROM pgbench_accounts WHERE aid < 1000", "SELECT version()",
              "SELECT now()", "SELECT relname FROM pg_class LIMIT 5", "BEGIN; SELECT 1; COMMIT")


#: pgbench's built-in scripts: select-only, tpcb-like, tpcb-like without the branch/teller updates
PG_SCRIPTS = ("-S", "", "-N")
#: seconds of pgbench per script of a mix: long enough for the background work load brings with it
#: (WAL segments filled and added by the WAL writer, lock waits under concurrency, autovacuum's
#: workers and their ANALYZE) to happen in training as it does in the held-out mixes (measured:
#: 5 s left an autovacuum ANALYZE to a held-out mix, 329 alerts; 12 s did not)
PG_SECONDS = 12
#: pgbench -R: the transactions per second of each pgbench run of a mix (0: as fast as it can).  At
#: full speed postgres makes ~150,000 syscalls/s on a 2-CPU host, more than ``ccprofd trace -p``
#: writes as JSON while the load holds both CPUs: the tracer drops 30-50% of a mix's samples (counted,
#: and shown per mix), and a path run only in a dropped stretch of training is never learned.
PG_RATE = 0
#: seconds of untraced pgbench (tpcb-like, 2 clients, at PG_RATE) between the server's start and the
#: attach: a production server has been running when the daemon starts learning it, so the first
#: of each maintenance step (the first WAL segment removed, the first commit-log segment truncated)
#: is behind it.  A timed checkpoint starts every ``checkpoint_timeout`` (5 min) and ends ~90% of
#: that later (``checkpoint_completion_target``): on a server 12 minutes old, the first checkpoint
#: ends ~9.5 min after its start, near the end of 8 one-minute training mixes
PG_WARMUP = 0


def pg_rate_args() -> list[str]:
    """pgbench's ``-R PG_RATE``, or nothing at PG_RATE 0 (as fast as it can)."""
    return ["-R", str(PG_RATE)] if PG_RATE else []


def postgres_mix(svc: Postgres, rng: random.Random, must: list[tuple[str, Any]]
                 ) -> tuple[str, Callable[[], None]]:
    scripts = with_required([rng.choice(PG_SCRIPTS)] if not any(k == "script" for k, _ in must) else [],
                            must, "script")
    c = rng.choice((1, 2, 4))
    queries = with_required(rng.sample(PG_QUERIES, rng.randint(1, 3)), must, "query")
    seconds = PG_SECONDS
    rate = pg_rate_args()
    what = "; ".join(" ".join(["pgbench", s or "(tpcb-like)", "-c", str(c), "-T", str(seconds), *rate])
                     for s in scripts) + "; psql: " + "; ".join(queries)

    def run() -> None:
        for script in scripts:
            svc.pgbench(["-c", str(c), "-j", str(min(c, 2)), "-T", str(seconds), *rate,
                         *([script] if script else [])])
        for q in queries:
            psql(svc, q)
    return what, run


def psql(svc: Postgres, query: str) -> str:
    r = subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(svc.port), "-U", "postgres", "-Atc", query,
                        "postgres"], capture_output=True, text=True, cwd=svc.dir)
    if r.returncode != 0:
        raise RuntimeError(f"psql {query!r}: {r.stderr.strip()[-300:]}")
    return r.stdout


def postgres_attacks(svc: Postgres, work: Path) -> list[tuple[str, str, Callable[[], None], tuple[str, ...]]]:
    out = svc.dir / "copied.txt"
    lo = svc.dir / "lo.txt"

    def lo_export() -> None:
        # two statements: an object created in the statement that exports it is not visible to lo_export
        oid = psql(svc, "SELECT lo_from_bytea(0, 'ssh-rsa AAAA attacker')").strip()
        psql(svc, f"SELECT lo_export({oid}, '{lo}')")
    return [("copy-to-file", "`COPY (SELECT ...) TO 'file'`",
             lambda: psql(svc, f"COPY (SELECT 'ssh-rsa AAAA attacker') TO '{out}'") and None,
             ("BeginCopyTo", "DoCopy", "AllocateFile")),
            ("lo-export", "`SELECT lo_from_bytea(0, ...)`, then `SELECT lo_export(OID, 'file')`", lo_export,
             ("be_lo_export", "lo_export"))]


SERVICES: dict[str, tuple[type, Callable[..., Any], Callable[..., Any]]] = {
    "redis": (Redis, redis_mix, redis_attacks),
    "nginx": (Nginx, nginx_mix, nginx_attacks),
    "postgres": (Postgres, postgres_mix, postgres_attacks),
}


# ------------------------------------------------------------------------------------ judging
def targeted(paths: list[Path]) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    """Each sample of the files (one after the other, as one file) with its target, as
    ``ccprofd learn/detect --samples`` tell them apart (the outermost frame's module; a sample without
    frames belongs to the only target, if there is one), read as a stream: a postgres mix is ~2 GB."""
    from ccprofd.cli.anomaly import _target_of

    targets: set[tuple[str, str]] = set()
    frameless: list[dict[str, Any]] = []
    for path in paths:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                s = json.loads(line)
                t = _target_of(s)
                if t is None:
                    frameless.append(s)
                else:
                    targets.add(t)
                    yield t, s
    if len(targets) == 1:  # judged last: no transitions are checked, so the order does not matter
        only = next(iter(targets))
        yield from ((only, s) for s in frameless)


def learn(models: Any, path: Path, secure: Any = None) -> None:
    """What ``ccprofd learn --model FILE --samples PATH`` does to FILE's models: one learning run per
    target (the same Learner), merged into ``models``; and, in the same pass, into ``secure`` from
    the samples :func:`in_security_set` keeps (as ``learn`` would on a security-set daemon's)."""
    from ccprofd.anomaly.model import Learner, TargetModel

    learners: dict[tuple[str, bool], Learner] = {}
    for (bid, tpath), s in targeted([path]):
        for sec in (False, True) if secure is not None and in_security_set(s) else (False,):
            if (bid, sec) not in learners:
                learners[(bid, sec)] = Learner(TargetModel(bid, tpath))
            learners[(bid, sec)].observe(s)
    for (_, sec), learner in learners.items():
        (secure if sec else models).target(learner.model.build_id, learner.model.path).merge(learner.model)


def detect(models: Any, paths: list[Path], secure: Any = None) -> dict[str, list[dict[str, Any]]]:
    """Per judging, the alerts ``ccprofd detect --samples S --granularity G --alert-interval 0``
    writes for the files (same Detector; the model through its file format and back; one pass):
    :data:`GRANULARITIES` with ``models``, the security-set ones with ``secure`` on the samples
    :func:`in_security_set` keeps (none without ``secure``)."""
    from ccprofd.anomaly.detector import Detector
    from ccprofd.anomaly.model import ModelSet, TargetModel

    loaded = ModelSet.from_dict(json.loads(json.dumps(models.to_dict())))
    loaded_sec = ModelSet.from_dict(json.loads(json.dumps(secure.to_dict()))) if secure is not None else None
    judgings = JUDGINGS if secure is not None else GRANULARITIES
    detectors: dict[tuple[str, str], Detector] = {}
    out: dict[str, list[dict[str, Any]]] = {g: [] for g in judgings}
    for (bid, tpath), s in targeted(paths):
        sec_sample = in_security_set(s)
        for g in judgings:
            sec = g.endswith(SECURITY_SUFFIX)
            if sec and not sec_sample:
                continue
            det = detectors.get((bid, g))
            if det is None:  # (a security-set model may have learned nothing of a target: empty)
                src = loaded_sec if sec and loaded_sec is not None else loaded
                model = src.targets.get(bid) or TargetModel(bid, tpath)
                det = detectors[(bid, g)] = Detector(model, detector_options(g))
            out[g] += [json.loads(a.to_json()) for a in det.check(s)]
    return out


def chain(a: dict[str, Any], n: int = 6) -> str:
    """The innermost ``n`` frames of the alert's context, outermost first."""
    return " > ".join(str(f.get("function")) for f in a.get("frames", [])[-n:]) or "(no frame)"


def names_any(a: dict[str, Any], names: tuple[str, ...]) -> bool:
    """Whether the alert's chain names one of the attack's functions, or (``path:TEXT``) its path
    argument contains TEXT (a static function of a stripped binary has no name to look for)."""
    path = str(a.get("args", {}).get("path", ""))
    return any(f.get("function") in names for f in a.get("frames", [])) or \
        any(n.startswith("path:") and n[5:] in path for n in names)


def run_service(name: str, opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    cls, mix, attacks = SERVICES[name]
    rng = random.Random(f"{opts.seed}-{name}")
    if cls is Redis:  # CONFIG SET dir/dbfilename are protected since redis 7: the attack needs them open,
        # as on the many servers configured before 7 or with this switch
        svc = Redis(work / name, ("--enable-protected-configs", "yes"))
    else:
        svc = cls(work / name) if cls is not Postgres else cls(work / name, 2)
    try:
        if cls is Nginx:
            nginx_setup(svc)
        if cls is Postgres and opts.pg_warmup:
            print(f"postgres: {opts.pg_warmup} s of untraced pgbench before the attach", file=sys.stderr)
            svc.pgbench(["-c", "2", "-j", "2", "-T", str(opts.pg_warmup), *pg_rate_args()])
        poke = {"redis": lambda: subprocess.run(["redis-cli", "-p", str(svc.port), "ping"],
                                                capture_output=True),
                "nginx": lambda: subprocess.run(["curl", "-s", "-o", "/dev/null",
                                                 f"http://127.0.0.1:{svc.port}/index.html"]),
                "postgres": lambda: psql(svc, "SELECT 1")}[name]
        samples = work / name / "samples.jsonl"
        t0 = time.monotonic()
        for attempt in range(5):  # a postgres child (autovacuum worker, ...) may exit before the attach
            try:
                tracer = Attached([p for p in svc.pids() if os.path.exists(f"/proc/{p}")], samples, poke,
                                  sample_hz=opts.sample_hz)
                break
            except RuntimeError as exc:
                if "no process" not in str(exc) or attempt == 4:
                    raise
        attach_s = time.monotonic() - t0
        windows: list[Window] = []
        dealt = deal(vocabulary(name), opts.train, rng)
        for i in range(opts.train + opts.held_out):
            what, run = mix(svc, rng, dealt[i] if i < opts.train else [])
            windows.append(timed(f"mix{i:02d}", what, run))
            print(f"{name} mix {i + 1}: {what}", file=sys.stderr)
        attack_windows = []
        for tag, what, run, names in attacks(svc, work / name):
            failed: list[str] = []

            def attempt(run: Callable[[], None] = run, failed: list[str] = failed) -> None:
                try:
                    run()
                except RuntimeError as exc:  # judged all the same: the attempt made its syscalls
                    failed.append(str(exc))
            attack_windows.append((timed(tag, what, attempt), names))
            if failed:
                attack_windows[-1][0].what += f" (the service refused it: {failed[0]})"
            print(f"{name} attack {tag}", file=sys.stderr)
        trace_err = tracer.stop()
        version = svc.version()
        checkpoints = (svc.checkpoints("starting"), svc.checkpoints()) if cls is Postgres else None
    finally:
        svc.stop()
    kept = Path(opts.keep_samples) / name if opts.keep_samples else None
    split(samples, windows + [w for w, _ in attack_windows], kept or work / name / "windows")
    meta = {"name": name, "version": version, "measured": f"{machine_line()}, load average {loadavg()}",
            "mixes": [(w.name, w.what, w.count(), w.lost) for w in windows], "attach_s": attach_s,
            "sample_hz": opts.sample_hz,
            "trace_err": trace_err.strip()[-400:], "train": opts.train, "held": opts.held_out}
    if checkpoints is not None:  # where the checkpoints began and ended: warm-up, which mix, a gap
        began, ended = checkpoints

        def per_mix(times: list[int]) -> list[int]:
            return [sum(1 for t in times if w.start_ns <= t <= w.end_ns) for w in windows]
        meta["warmup_s"] = opts.pg_warmup
        meta["checkpoints_before"] = sum(1 for t in ended if t < windows[0].start_ns)
        meta["checkpoints_per_mix"] = per_mix(ended)
        meta["checkpoint_starts_per_mix"] = per_mix(began)
    if kept is not None:  # every window's samples are split there: what judging again offline needs
        (kept / "windows.json").write_text(json.dumps(
            [{"name": w.name, "what": w.what, "start_ns": w.start_ns, "end_ns": w.end_ns,
              "train": i < opts.train} for i, w in enumerate(windows)]
            + [{"name": w.name, "what": w.what, "start_ns": w.start_ns, "end_ns": w.end_ns, "attack": True,
                "names": list(n)} for w, n in attack_windows]))
        (kept / "meta.json").write_text(json.dumps(meta))
    samples.unlink()  # every sample judged is in a window's file: the whole trace would double the disk
    return {**meta, **judge(name, windows, attack_windows, opts.train, work)}


def kept_windows(kept: Path) -> tuple[list[Window], list[tuple[Window, tuple[str, ...]]], int]:
    """The windows a ``--keep-samples`` run wrote (training and held-out mixes, attacks with the
    names their alerts are checked for) and the number of training mixes."""
    wins, attacks, train = [], [], 0
    for d in json.loads((kept / "windows.json").read_text()):
        w = Window(d["name"], int(d["start_ns"]), int(d["end_ns"]), d["what"],
                   path=kept / f"{d['name']}.jsonl")
        if d.get("attack"):
            attacks.append((w, tuple(d["names"])))
        else:
            wins.append(w)
            train += bool(d.get("train"))
    return wins, attacks, train


def judge_kept(name: str, kept: Path, meta_json: Path | None, work: Path) -> dict[str, Any]:
    """Judge again, with this ccprofd, the samples a ``--keep-samples`` run kept (the detector changed,
    the services' behaviour did not need to be traced again).  The run's description (version,
    mixes, tracer messages) comes from its meta.json, else from its ``--keep`` result file."""
    meta_path = kept / "meta.json"
    if not meta_path.exists():
        if meta_json is None or not meta_json.exists():
            raise SystemExit(f"services_anomaly: {kept} has no meta.json and no kept result {meta_json}")
        meta_path = meta_json
    meta = {k: v for k, v in json.loads(meta_path.read_text()).items()
            if k not in ("curve", "attacks", "residual")}
    windows, attack_windows, train = kept_windows(kept)
    meta["judged"] = f"{machine_line()}, load average {loadavg()}"
    return {**meta, **judge(name, windows, attack_windows, train, work)}


def judge(name: str, windows: list[Window], attack_windows: list[tuple[Window, tuple[str, ...]]],
          n_train: int, work: Path) -> dict[str, Any]:
    """The learning curve (training mixes learned one at a time, held-out mixes detected after each,
    in every granularity) and the attacks' alerts with the model of all training mixes."""
    from ccprofd.anomaly.model import ModelSet

    (work / name).mkdir(parents=True, exist_ok=True)
    train, held = windows[:n_train], windows[n_train:]
    held_files = [w.file() for w in held]  # one detect per step; alerts told apart by time
    model, secure = ModelSet(), ModelSet()
    curve: list[dict[str, Any]] = []
    residual: dict[str, dict[tuple[str, str, str], int]] = {g: {} for g in JUDGINGS}
    for k, w in enumerate(train, start=1):
        learn(model, w.file(), secure)
        row: dict[str, Any] = {"k": k, "contexts": sum(len(t.contexts) for t in model.targets.values()),
                               "contexts_security": sum(len(t.contexts) for t in secure.targets.values())}
        alerts = detect(model, held_files, secure)
        for g in JUDGINGS:
            every = alerts[g]
            found = [[a for a in every if w.start_ns <= a["time_ns"] <= w.end_ns] for w in held]
            assert sum(map(len, found)) == len(every), "an alert outside every held-out window"
            row[f"mixes_{g}"] = sum(1 for f in found if f) / len(held)
            row[f"alerts_{g}"] = sum(len(f) for f in found)
            row[f"incomplete_{g}"] = sum(1 for f in found for a in f if a["kind"] == "incomplete_context")
            if k == len(train):
                for a in (a for f in found for a in f):
                    key = (a["kind"], a["syscall"], chain(a, 4))
                    residual[g][key] = residual[g].get(key, 0) + 1
        curve.append(row)
        print(f"{name} k={k}: {row}", file=sys.stderr, flush=True)
    attacked: list[dict[str, Any]] = []
    for w, names in attack_windows:
        alerts = detect(model, [w.file()], secure)
        for g in JUDGINGS:
            found = alerts[g]
            hits = [a for a in found if names_any(a, names)]
            attacked.append({"attack": w.name, "what": w.what, "granularity": g, "alerts": len(found),
                             "samples": w.count(), "hits": hits, "names": names,
                             "others": [a for a in found if not names_any(a, names)]})
    return {"curve": curve, "attacks": attacked,
            "residual": {g: [[*k, n] for k, n in r.items()] for g, r in residual.items()}}


# ------------------------------------------------------------------------------------ report
def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        ks = [row["k"] for row in r["curve"]]
        styles = (("exact", "o-"), ("edges", "D--"), ("routines", "s:"), ("routines-functions", "^-."),
                  ("exact@security", "v-"), ("routines-functions@security", "x--"))
        for g, style in styles:
            if f"mixes_{g}" not in r["curve"][0]:
                continue
            ax.plot(ks, [100 * row[f"mixes_{g}"] for row in r["curve"]], style,
                    label=f"held-out mixes with an alert ({g})")
        ax.set_title(f"{r['name']} {r['version']}: {r['held']} held-out mixes")
        ax.set_xlabel("training mixes")
        ax.set_ylabel("false alerts (% of held-out mixes)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    # one legend for all panels, below them: inside a panel it covered the curves (six judgings)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=100)


#: What the alerts of an attack mean where the binary does not say it (checked by hand)
NOTES = {"nginx": (
    "`GET /private/`: nginx 1.22's `ngx_http_index_handler` is static, so the stripped binary names "
    "it `sub_b24c0` (Debian 1.22.1-9 build; identified with `objdump -d`: the function loads the "
    "index module's strings `open index \"%V\"` and `\"%s\" is not found`). Its alerts are the "
    "attack: `newfstatat` of `private/index.html` through `ngx_http_core_content_phase > sub_b24c0 > "
    "ngx_open_cached_file` (the file does not exist, so nginx never opens it) and the error log "
    "`write` of the 403 (`ngx_log_error_core` from `ngx_http_core_content_phase`). `GET /admin/`: "
    "the same `sub_b24c0` finds `admin/index.html` (`newfstatat`) and hands the request to "
    "`ngx_http_internal_redirect`, under which the static module opens the file: `openat` through "
    "`sub_b24c0 > ngx_http_internal_redirect > ngx_http_handler > ngx_http_core_run_phases > ... > "
    "ngx_open_cached_file`, where every normal request's `openat` comes straight from the first "
    "`ngx_http_core_run_phases` (checked by hand with `ccprofd trace -p WORKER` on this build, "
    "2026-11-27)."),
    "postgres": (
    "A checkpoint's last steps depend on what happened since the previous one started, not on the "
    "mix it ends in. One of them is the `unlink` in `SyncPostCheckpoint`: every pgbench run without "
    "`-n` starts with `TRUNCATE pgbench_history` (a new file for the table), and the first checkpoint "
    "to start after it unlinks the old file when it ends. Checked with `strace -e unlink -p CHECKPOINTER` "
    "around `pgbench -T 2` and a `CHECKPOINT` (2026-11-27): one `base/5/NNNNN` unlink after each pgbench "
    "run of any script, none with `-n`. A training period learns that path only if a checkpoint ends in "
    "it that started after a pgbench run.")}


def markdown(results: list[dict[str, Any]], opts: argparse.Namespace, load: str,
             png: str = "services-anomaly-learning-curve.png") -> str:
    lines = ["# Anomaly detection on real services: learning curves and injected attacks", "",
             f"Generated by `python bench/services_anomaly.py --services {opts.services} --train "
             f"{opts.train} --held-out {opts.held_out} --seed {opts.seed} --pg-seconds {opts.pg_seconds}"
             f"{f' --pg-rate {opts.pg_rate}' if opts.pg_rate else ''}"
             f"{f' --pg-warmup {opts.pg_warmup}' if opts.pg_warmup else ''}"
             f"{f' --sample-hz {opts.sample_hz}' if opts.sample_hz else ''}"
             f"{' --keep-samples DIR' if opts.keep_samples else ''}"
             f"{'`, then judged again by `--judge-kept DIR' if opts.judge_kept else ''}` "
             f"(rendered on {machine_line()}, "
             f"load average {load}; the machine is shared, see each service's line). Unwind mode, every "
             "syscall, one "
             "`ccprofd trace -p` attached to the running service for all its mixes, the samples split by "
             "time into one file per mix, judged as `ccprofd learn --samples` and `ccprofd detect "
             "--samples --alert-interval 0` judge them (the same Learner and Detector, in the bench's "
             "process) in each granularity (`exact`, `edges`, `routines`, and `routines-functions`: "
             "`routines` with `--prefix-match functions`; see docs/anomaly.md), and as a daemon sampling "
             f"only the security set ({', '.join(SECURITY)}) would judge them: `exact@security` and "
             "`routines-functions@security`, a model learned from those syscalls' samples and the CPU "
             "samples only, checking only those syscalls' samples. A false alert is any "
             "alert on a held-out mix (another random mix of the same service); `incomplete_context` alerts "
             "(the unwinder could not finish a chain) count too and are shown apart. The training mixes, "
             "together, ask for every request of the service's vocabulary at least once (redis' tests "
             "and redis-cli commands, nginx's files and the 404, postgres' pgbench scripts and psql "
             "queries, dealt round-robin); held-out mixes are free random mixes of the same "
             "vocabulary. `ccprofd detect` judges a syscall made under a signal handler by the "
             "handler's chain (frames outward of the trampoline are where the signal landed).", "",
             f"![services learning curves]({png})", ""]
    for r in results:
        last = r["curve"][-1]
        grans = [g for g in JUDGINGS if f"mixes_{g}" in last]
        judged = f" Judged again from the kept samples on {r['judged']}." if r.get("judged") else ""
        attach = f"{r['attach_s']:.0f} s" if r.get("attach_s") is not None else "? s, not recorded"
        cpu = (f" CPU samples at {r['sample_hz']} Hz too (counted in each mix's samples; learning adds "
               "the calls they show running, detection ignores them)." if r.get("sample_hz") else "")
        lines += [f"## {r['name']} {r['version']}", "", f"Measured on {r.get('measured', '?')}.{judged}{cpu}",
                  "", f"Mixes (samples in the mix's window; training first, then held-out; attached in "
                  f"{attach}):",
                  ""]
        ended = r.get("checkpoints_per_mix")
        began = r.get("checkpoint_starts_per_mix")  # (not recorded before 2026-11-27 01:20)
        if ended is not None:
            lines[-2:-2] = [f"The server ran {r.get('warmup_s', 0)} s of untraced pgbench before the attach; "
                            f"{r['checkpoints_before']} checkpoint(s) ended before the first mix (from the "
                            "server's log; each mix says how many ended in its window).", ""]
        lines += [f"* {n}{' (held-out)' if i >= r['train'] else ''}: {what} — {count:,} samples"
                  + (f", {lost:,} lost by the tracer (ring full)" if lost else "")
                  + (f"; {began[i]} checkpoint(s) started" if began is not None else "")
                  + (f"; {ended[i]} checkpoint(s) ended" if ended is not None else "")
                  for i, (n, what, count, lost) in enumerate(r["mixes"])]
        lines += ["", "| training mixes | contexts | "
                  + " | ".join(f"held-out mixes alerted ({g}) | alerts ({g}) | of them incomplete"
                               for g in grans)
                  + " |", "|---:|---:|" + "---:|---:|---:|" * len(grans)]
        for row in r["curve"]:
            lines.append(f"| {row['k']} | {row['contexts']:,} | " + " | ".join(
                f"{100 * row[f'mixes_{g}']:.0f}% | {row[f'alerts_{g}']:,} | {row[f'incomplete_{g}']:,}"
                for g in grans) + " |")
        lines += ["", f"After {last['k']} training mixes: " + ", ".join(
            f"{100 * last[f'mixes_{g}']:.0f}% ({g})" for g in grans)
            + " of held-out mixes with a false alert; target 0%.", ""]
        for g in grans:
            if r["residual"].get(g):
                lines += [f"False alerts left after {last['k']} mixes ({g}; innermost frames):", "",
                          "| kind | syscall | innermost frames | alerts |", "|---|---|---|---:|"]
                for kind, sc, ch, n in sorted(r["residual"][g], key=lambda x: -x[3])[:12]:
                    lines.append(f"| {kind} | {sc} | {ch} | {n} |")
                lines.append("")
        lines += ["Injected attacks (the attack's window checked with the model of all training mixes):", "",
                  "| attack | granularity | samples | alerts | alerts naming the attack's code | "
                  "example: syscall, path, call chain (innermost 6 frames) |",
                  "|---|---|---:|---:|---:|---|"]
        for a in r["attacks"]:
            ex = next((h for h in a["hits"] if h["syscall"] == "openat"), a["hits"][0] if a["hits"] else None)
            example = (f"{ex['syscall']} {ex.get('args', {}).get('path', '')}: {chain(ex)}".replace("|", "/")
                       if ex else f"none names {', '.join(a['names'])}")
            lines.append(f"| {a['what']} | {a['granularity']} | {a['samples']:,} | {a['alerts']} | "
                         f"{len(a['hits'])} | {example} |")
        lines.append("")
        for a in r["attacks"]:
            seen: dict[tuple[str, str, str], int] = {}
            for h in a["hits"] + a.get("others", []):
                key = (h["syscall"], str(h.get("args", {}).get("path", "")), chain(h, 8))
                seen[key] = seen.get(key, 0) + 1
            if seen:
                lines += [f"Distinct alerted chains of {a['what']} ({a['granularity']}; innermost 8 "
                          "frames; all alerts of the attack's window):", "",
                          "| syscall | path | call chain | alerts |", "|---|---|---|---:|"]
                lines += [f"| {sc} | {p} | {ch} | {n} |" for (sc, p, ch), n in
                          sorted(seen.items(), key=lambda x: (x[0][0] != "openat", -x[1]))[:12]]
                lines.append("")
        if r["name"] in NOTES:
            lines += [NOTES[r["name"]], ""]
        if r["trace_err"]:
            lines += ["`ccprofd trace` said at exit:", "", "```", r["trace_err"], "```", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", default="redis,nginx,postgres")
    ap.add_argument("--train", type=int, default=8)
    ap.add_argument("--held-out", type=int, default=4)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--output", default=str(DOCS / "services-anomaly.md"))
    ap.add_argument("--keep", default="/tmp/ccprofd-services-anomaly",
                    help="each service's results are kept in DIR/NAME.json and reused by the next run "
                    "(delete them to measure again)")
    ap.add_argument("--keep-samples", default="", metavar="DIR",
                    help="also keep each window's samples (DIR/NAME/WINDOW.jsonl)")
    ap.add_argument("--judge-kept", default="", metavar="DIR",
                    help="trace nothing: judge again, with this ccprofd, the samples an earlier "
                    "--keep-samples DIR run kept (its description from DIR/NAME/meta.json, else from the "
                    "--keep result file)")
    ap.add_argument("--pg-seconds", type=int, default=PG_SECONDS,
                    help="seconds of pgbench per script of a postgres mix")
    ap.add_argument("--pg-rate", type=int, default=PG_RATE, metavar="TPS",
                    help="pgbench -R TPS for each pgbench run of a postgres mix (0: unlimited); a rate "
                         "the tracer keeps up with loses no training samples")
    ap.add_argument("--pg-warmup", type=int, default=PG_WARMUP, metavar="SECONDS",
                    help="seconds of untraced pgbench after the postgres server starts and before the "
                         "tracer attaches (a server that has run through its first checkpoints)")
    ap.add_argument("--sample-hz", type=int, default=0, metavar="N",
                    help="also take CPU samples at N Hz: learning adds the calls they show running "
                         "(evidence for granularity routines; detection ignores them)")
    opts = ap.parse_args()
    globals()["PG_SECONDS"] = opts.pg_seconds
    globals()["PG_RATE"] = opts.pg_rate
    if os.geteuid() != 0:
        print("services_anomaly: needs root (BPF)", file=sys.stderr)
        return 2
    load = loadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="ccprofd-svc-anomaly-") as d:
        Path(d).chmod(0o755)  # nginx's workers and postgres run as other users
        keep = Path(opts.keep)
        keep.mkdir(parents=True, exist_ok=True)
        for name in opts.services.split(","):
            kept = keep / f"{name}.json"
            if opts.judge_kept:
                results.append(judge_kept(name, Path(opts.judge_kept) / name, kept, Path(d)))
                continue
            settings = {"train": opts.train, "held": opts.held_out, "seed": opts.seed,
                        "sample_hz": opts.sample_hz}
            if name == "postgres":  # (the other services' kept results stand whatever these are)
                settings |= {"pg_seconds": opts.pg_seconds, "pg_rate": opts.pg_rate,
                             "pg_warmup": opts.pg_warmup}
            if kept.exists():
                earlier = json.loads(kept.read_text())
                if {k: earlier.get("settings", {}).get(k, 0) for k in settings} == settings:
                    results.append(earlier)
                    continue
                print(f"services_anomaly: {kept} was measured with other settings "
                      f"({earlier.get('settings')}): measuring again", file=sys.stderr)
            (Path(d) / name).mkdir()
            results.append({**run_service(name, opts, Path(d)), "settings": settings})
            kept.write_text(json.dumps(results[-1]))
    out = Path(opts.output)
    png = out.with_name(f"{out.stem}-learning-curve.png")
    plot(results, png)
    text = markdown(results, opts, load, png.name)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
