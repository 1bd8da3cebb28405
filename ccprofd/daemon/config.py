"""The daemon's TOML configuration: parsed with :mod:`tomllib` and validated completely at start.

Every error is one line that names the file, the line and the key (``FILE:LINE: KEY: problem``);
an unknown key is an error, so a typo never silently falls back to a default.  The result is a
plain frozen value (:class:`Config`) the service compares on ``SIGHUP`` to add, remove or restart
targets.  Schema (defaults in brackets)::

    [daemon]
    state_dir = "/var/lib/ccprofd"                    analysis/plan cache, models, durable state
    grpc_listen = "unix:///run/ccprofd/ccprofd.sock"  or "tcp://HOST:PORT" (explicit opt-in; needs TLS
                                                      off loopback unless insecure_remote = true)
    grpc_socket_mode = "0660"                         Unix socket permissions
    grpc_socket_group = "ccprofd"                     group of the socket if that group exists
    tls_cert / tls_key / tls_client_ca = PATH         TCP only; client CA => client certs required
    metrics_listen = "127.0.0.1:9464"                 Prometheus /metrics; "" disables; loopback
                                                      only unless insecure_remote = true
    insecure_remote = false                           allow plain gRPC / metrics off loopback
    top_k = 20                                        hot contexts promoted to series per round
    max_series = 200                                  exported series per target and family
    max_contexts = 10000                              context table size per target
    history_seconds = 3600, bucket_seconds = 10       resolution of GetHotContexts(since=...)
    promotion_window_seconds = 300                    "hot" means frequent within this window
    retire_after_seconds = 3600                       a series whose context was not seen for this
                                                      long leaves /metrics (0 = never; else
                                                      >= promotion_window_seconds)
    stream_queue = 10000                              per-subscriber queue of StreamSamples/Alerts
    log_level = "info"
    source_lines = true                               frames get DWARF file/line/inlined calls; the
                                                      targets' default (their own key overrides it)

    [[target]]                                        one of path / pid / cgroup
    name = "..."                                      [basename of path, "pid-N", cgroup basename]
    path = "/usr/sbin/some-service"                   an ELF file; missing: warning, the target waits
    syscalls = ["openat", "write"] | "all"            ["all"]
    perf_sample_hz = 0                                CPU-clock sampling; 0 = off
    encoding = "valence" | "pcce" | "hcce"            ["valence"]
    mode = "unwind" | "instrumented"                  ["unwind"]
    scope = "REGEX"                                   instrumented mode only
    max_probe_hits_per_sec = 0                        instrumented-mode ceiling; 0 = none
    verify = false                                    frame-pointer cross-check (instrumented)
    source_lines = true                               [daemon.source_lines] DWARF file/line per frame
    watch_ia32 = false                                unwind mode: also sample every ia32 syscall
                                                      (int $0x80), whatever syscalls says; a raw
                                                      program every syscall of the machine runs
    persist_history_seconds = 0                       save the flight recorder to STATE_DIR/history; 0 = off
    [target.anomaly]                                  (issue 7) action = "off"|"learn"|"detect"|"enforce"
    model = PATH                                      [STATE_DIR/anomaly/NAME.model.json]
    flush_seconds = 30, alert_interval_seconds = 60   learning flush; repeat of the same alert
    collapse_recursion = false, transitions = false
    granularity = "exact" | "edges" | "routines"      "edges": new combinations of learned call edges pass;
                                                      "routines": also one new call into a shared routine
                                                      (perf_sample_hz while learning: the calls CPU
                                                      samples show running count as seen for it)
    prefix_match = "sites" | "functions"              "routines": the calls before the routine's were seen
                                                      at their call sites, or (functions) at any call site
    alert_history = 16                                the thread's syscalls before an alert it carries
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccprofd.kbpf.features import sample_hz_over_limit
from ccprofd.kbpf.tracefs import tracefs_syscalls
from ccprofd.tracing.api import MODES

DEFAULT_CONFIG_PATH = "/etc/ccprofd/ccprofd.toml"
ENCODINGS = ("valence", "pcce", "hcce")
ANOMALY_ACTIONS = ("off", "learn", "detect", "enforce")
ANOMALY_GRANULARITIES = ("exact", "edges", "routines")  # anomaly.model.GRANULARITIES
ANOMALY_PREFIX_MATCHES = ("sites", "functions")  # anomaly.model.PREFIX_MATCHES


class ConfigError(Exception):
    """A configuration problem, phrased as one line ``FILE:LINE: KEY: problem``."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed listen address: ``kind`` is "unix" (``path``) or "tcp" (``host``, ``port``)."""

    kind: str
    path: str = ""
    host: str = ""
    port: int = 0

    def grpc_address(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.kind == "unix" else f"tcp://{self.grpc_address()}"


@dataclass(frozen=True, slots=True)
class AnomalyConfig:
    """``[target.anomaly]``: owned by the anomaly detector; the daemon only validates and carries it."""

    action: str = "off"
    alert_interval_seconds: float = 60.0
    collapse_recursion: bool = False
    transitions: bool = False
    granularity: str = "exact"  # anomaly.detector.DetectorOptions.granularity
    prefix_match: str = "sites"  # anomaly.detector.DetectorOptions.prefix_match
    flush_seconds: float = 30.0
    model: str | None = None  # model file; None: STATE_DIR/anomaly/TARGET.model.json
    alert_history: int = 16  # flight-recorder events before the alert's syscall each alert carries


@dataclass(frozen=True, slots=True)
class TargetConfig:
    """One ``[[target]]``: which processes to follow and how.  Equality decides restarts on reload."""

    name: str
    path: str | None = None
    pid: int | None = None
    cgroup: str | None = None
    syscalls: tuple[str, ...] | None = None  # None = all
    perf_sample_hz: int = 0
    encoding: str = "valence"
    mode: str = "unwind"
    scope: str | None = None
    max_probe_hits_per_sec: int = 0
    verify: bool = False
    source_lines: bool = True  # frames get DWARF file/line/inlined calls (TraceOptions.source_lines)
    persist_history_seconds: int = 0  # save the flight recorder's rings to state_dir this often; 0: never
    watch_ia32: bool = False  # unwind mode: sample ia32 syscalls whatever the set (TraceOptions.watch_ia32)
    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)

    @property
    def kind(self) -> str:
        return "path" if self.path is not None else "pid" if self.pid is not None else "cgroup"

    @property
    def spec(self) -> str:
        """What the target names, for humans: the path, the pid or the cgroup directory."""
        return self.path or (str(self.pid) if self.pid is not None else self.cgroup or "")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    state_dir: Path = Path("/var/lib/ccprofd")
    grpc_listen: Endpoint = Endpoint("unix", path="/run/ccprofd/ccprofd.sock")
    grpc_socket_mode: int = 0o660
    grpc_socket_group: str = "ccprofd"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    metrics_listen: tuple[str, int] | None = ("127.0.0.1", 9464)
    top_k: int = 20
    max_series: int = 200
    max_contexts: int = 10000
    history_seconds: int = 3600
    bucket_seconds: int = 10
    promotion_window_seconds: int = 300
    retire_after_seconds: int = 3600
    stream_queue: int = 10000
    log_level: str = "info"
    insecure_remote: bool = False
    source_lines: bool = True  # the targets' default


@dataclass(frozen=True, slots=True)
class Config:
    """A validated configuration; ``warnings`` are one-line ``FILE:LINE: KEY: problem`` notes about
    settings that are accepted but risky or not usable yet (a target path that does not exist)."""

    source: str
    daemon: DaemonConfig
    targets: tuple[TargetConfig, ...]
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def target(self, name: str) -> TargetConfig | None:
        return next((t for t in self.targets if t.name == name), None)


# ------------------------------------------------------------------------------- line locator
_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*([A-Za-z0-9_-]+|"[^"]*"|'[^']*')\s*=""")


def _key_lines(text: str) -> dict[tuple[Any, ...], int]:
    """Line numbers of table headers and keys: ``(table..., key) -> line``.

    tomllib reports no positions for valid documents, so this scans the text; tables of arrays are
    indexed (``("target", 0, "mode")``).  Values spanning lines (arrays, triple-quoted strings) are
    skipped so their contents are never taken for keys."""
    lines: dict[tuple[Any, ...], int] = {}
    counts: dict[str, int] = {}
    table: tuple[Any, ...] = ()
    depth = 0
    in_triple: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        if in_triple:
            if raw.count(in_triple) % 2 == 1:
                in_triple = None
            continue
        if depth > 0:
            depth += _bracket_balance(raw)
            continue
        header = _HEADER.match(raw)
        if header:
            names = [n.strip().strip("\"'") for n in header.group(2).split(".")]
            if header.group(1) == "[[":
                key = ".".join(names)
                counts[key] = counts.get(key, -1) + 1
                table = (*names, counts[key])
            elif len(names) > 1 and names[0] in counts:
                table = (names[0], counts[names[0]], *names[1:])
            else:
                table = tuple(names)
            lines.setdefault(table, number)
            continue
        km = _KEY.match(raw)
        if km:
            lines.setdefault((*table, km.group(1).strip("\"'")), number)
            value = raw[km.end():]
            for quote in ('"""', "'''"):
                if value.count(quote) % 2 == 1:
                    in_triple = quote
            depth = max(0, _bracket_balance(value))
    return lines


def _bracket_balance(text: str) -> int:
    text = re.sub(r'"(\\.|[^"\\])*"|\'[^\']*\'', "", text).split("#", 1)[0]
    return text.count("[") - text.count("]")


class _Checker:
    """Validates one document, collecting nothing: the first problem raises :class:`ConfigError`."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.lines = _key_lines(text)
        self.warnings: list[str] = []

    def _where(self, where: tuple[Any, ...], problem: str) -> str:
        line = None
        for cut in range(len(where), 0, -1):
            line = self.lines.get(where[:cut])
            if line is not None:
                break
        loc = f"{self.source}:{line}" if line is not None else self.source
        return f"{loc}: {_dotted(where)}: {problem}"

    def fail(self, where: tuple[Any, ...], problem: str) -> ConfigError:
        return ConfigError(self._where(where, problem))

    def warn(self, where: tuple[Any, ...], problem: str) -> None:
        self.warnings.append(self._where(where, problem))

    def table(self, value: Any, where: tuple[Any, ...], allowed: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a table, got {_tname(value)}")
        for key in value:
            if key not in allowed:
                known = ", ".join(sorted(allowed))
                raise self.fail((*where, key), f"unknown key (known keys: {known})")
        return value

    def get(self, tbl: Mapping[str, Any], where: tuple[Any, ...], key: str, kind: type | tuple[type, ...],
            default: Any) -> Any:
        if key not in tbl:
            return default
        value = tbl[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail((*where, key), f"expected {_kinds(kinds)}, got a boolean")
        if not isinstance(value, kinds):
            raise self.fail((*where, key), f"expected {_kinds(kinds)}, got {_tname(value)}")
        return value

    def positive(self, tbl: Mapping[str, Any], where: tuple[Any, ...], key: str, default: int,
                 minimum: int = 1) -> int:
        value = int(self.get(tbl, where, key, int, default))
        if value < minimum:
            raise self.fail((*where, key), f"must be >= {minimum}, got {value}")
        return value

    def choice(self, tbl: Mapping[str, Any], where: tuple[Any, ...], key: str, choices: tuple[str, ...],
               default: str) -> str:
        value = str(self.get(tbl, where, key, str, default))
        if value not in choices:
            raise self.fail((*where, key), f"expected one of {', '.join(choices)}; got {value!r}")
        return value


def _dotted(where: tuple[Any, ...]) -> str:
    out = ""
    for part in where:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _tname(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", int: "an integer", float: "a float",
            bool: "a boolean"}.get(type(value), type(value).__name__)


def _kinds(kinds: tuple[type, ...]) -> str:
    return " or ".join(_tname(k()) for k in kinds)


# ------------------------------------------------------------------------------------ parsing
_DAEMON_KEYS: dict[str, Any] = {k: None for k in (
    "state_dir", "grpc_listen", "grpc_socket_mode", "grpc_socket_group", "tls_cert", "tls_key",
    "tls_client_ca", "metrics_listen", "top_k", "max_series", "max_contexts", "history_seconds",
    "bucket_seconds", "promotion_window_seconds", "retire_after_seconds", "stream_queue", "log_level",
    "insecure_remote", "source_lines")}
_TARGET_KEYS: dict[str, Any] = {k: None for k in (
    "name", "path", "pid", "cgroup", "syscalls", "perf_sample_hz", "encoding", "mode", "scope",
    "max_probe_hits_per_sec", "verify", "anomaly", "source_lines", "persist_history_seconds", "watch_ia32")}
_ANOMALY_KEYS: dict[str, Any] = {k: None for k in (
    "action", "alert_interval_seconds", "collapse_recursion", "transitions", "granularity", "flush_seconds",
    "model", "alert_history", "prefix_match")}
_SYSCALL_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def load_config(path: str | os.PathLike[str], *,
                known_syscalls: Callable[[], frozenset[str] | None] | None = None) -> Config:
    """Read and validate ``path``; raise :class:`ConfigError` (one line) on any problem."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_config(text, source, known_syscalls=known_syscalls)


def parse_config(text: str, source: str = "<config>", *,
                 known_syscalls: Callable[[], frozenset[str] | None] | None = None) -> Config:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"at line (\d+)", msg)
        loc = f"{source}:{m.group(1)}" if m else source
        raise ConfigError(f"{loc}: TOML syntax error: {msg}") from None
    chk = _Checker(source, text)
    chk.table(doc, (), {"daemon": None, "target": None})
    daemon = _parse_daemon(chk, doc.get("daemon", {}))
    raw_targets = doc.get("target", [])
    if not isinstance(raw_targets, list):
        raise chk.fail(("target",), "expected an array of tables ([[target]])")
    syscall_table = (known_syscalls or tracefs_syscalls)()
    targets = tuple(_parse_target(chk, raw, i, syscall_table, daemon.source_lines)
                    for i, raw in enumerate(raw_targets))
    seen: dict[str, int] = {}
    for i, t in enumerate(targets):
        if t.name in seen:
            key = "name" if ("target", i, "name") in chk.lines else t.kind
            raise chk.fail(("target", i, key),
                           f"duplicate target name {t.name!r} (also target[{seen[t.name]}]); set name = ...")
        seen[t.name] = i
    return Config(source, daemon, targets, tuple(chk.warnings))


def _parse_daemon(chk: _Checker, raw: Any) -> DaemonConfig:
    w: tuple[Any, ...] = ("daemon",)
    tbl = chk.table(raw, w, _DAEMON_KEYS)
    d = DaemonConfig()
    state_dir = str(chk.get(tbl, w, "state_dir", str, str(d.state_dir)))
    if not os.path.isabs(state_dir):
        raise chk.fail((*w, "state_dir"), f"must be an absolute path, got {state_dir!r}")
    grpc_text = str(chk.get(tbl, w, "grpc_listen", str, str(d.grpc_listen)))
    grpc = _parse_endpoint(chk, (*w, "grpc_listen"), grpc_text)
    mode_text = chk.get(tbl, w, "grpc_socket_mode", str, "0660")
    if not re.fullmatch(r"0?[0-7]{3}", mode_text):
        raise chk.fail((*w, "grpc_socket_mode"), f'expected an octal mode such as "0660", got {mode_text!r}')
    socket_mode = int(mode_text, 8)
    if socket_mode & 0o007:
        raise chk.fail((*w, "grpc_socket_mode"),
                       f"{mode_text} gives every local user access to other processes' internals; "
                       "use 0660 or stricter")
    tls: dict[str, Path | None] = {}
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        value = chk.get(tbl, w, key, str, None)
        if value is not None and not os.path.isfile(value):
            raise chk.fail((*w, key), f"no such file: {value}")
        tls[key] = Path(value) if value is not None else None
    if (tls["tls_cert"] is None) != (tls["tls_key"] is None):
        raise chk.fail((*w, "tls_cert" if tls["tls_cert"] is None else "tls_key"),
                       "tls_cert and tls_key must be given together")
    if tls["tls_client_ca"] is not None and tls["tls_cert"] is None:
        raise chk.fail((*w, "tls_client_ca"), "client certificates need server TLS (tls_cert, tls_key)")
    if grpc.kind == "unix" and tls["tls_cert"] is not None:
        raise chk.fail((*w, "tls_cert"), "TLS applies to tcp:// listen addresses only")
    metrics_text = str(chk.get(tbl, w, "metrics_listen", str, "127.0.0.1:9464"))
    metrics = _parse_hostport(chk, (*w, "metrics_listen"), metrics_text) if metrics_text else None
    insecure = bool(chk.get(tbl, w, "insecure_remote", bool, False))
    _check_exposure(chk, w, grpc, tls["tls_cert"] is not None, tls["tls_client_ca"] is not None, metrics,
                    insecure)
    level = chk.choice(tbl, w, "log_level", ("debug", "info", "warning", "error"), d.log_level)
    bucket = chk.positive(tbl, w, "bucket_seconds", d.bucket_seconds)
    history = chk.positive(tbl, w, "history_seconds", d.history_seconds)
    if history < bucket:
        raise chk.fail((*w, "history_seconds"), f"must be >= bucket_seconds ({bucket})")
    top_k = chk.positive(tbl, w, "top_k", d.top_k)
    max_series = chk.positive(tbl, w, "max_series", d.max_series)
    if max_series < top_k:
        raise chk.fail((*w, "max_series"), f"must be >= top_k ({top_k})")
    window = chk.positive(tbl, w, "promotion_window_seconds", d.promotion_window_seconds)
    retire = chk.positive(tbl, w, "retire_after_seconds", d.retire_after_seconds, minimum=0)
    if 0 < retire < window:
        # A context still in the window would be promoted again at the next scrape: series flapping.
        raise chk.fail((*w, "retire_after_seconds"),
                       f"must be 0 (never retire) or >= promotion_window_seconds ({window})")
    return DaemonConfig(
        state_dir=Path(state_dir), grpc_listen=grpc, grpc_socket_mode=socket_mode,
        grpc_socket_group=str(chk.get(tbl, w, "grpc_socket_group", str, d.grpc_socket_group)),
        tls_cert=tls["tls_cert"], tls_key=tls["tls_key"], tls_client_ca=tls["tls_client_ca"],
        metrics_listen=metrics, top_k=top_k, max_series=max_series,
        max_contexts=chk.positive(tbl, w, "max_contexts", d.max_contexts),
        history_seconds=history, bucket_seconds=bucket,
        promotion_window_seconds=window, retire_after_seconds=retire,
        stream_queue=chk.positive(tbl, w, "stream_queue", d.stream_queue), log_level=level,
        insecure_remote=insecure, source_lines=bool(chk.get(tbl, w, "source_lines", bool, d.source_lines)))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") is reachable from this machine only."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to any interface


def _check_exposure(chk: _Checker, w: tuple[Any, ...], grpc: Endpoint, tls: bool, client_ca: bool,
                    metrics: tuple[str, int] | None, insecure: bool) -> None:
    """Whoever connects reads other processes' calling contexts (gRPC) or hot-context names
    (/metrics): plain TCP off loopback is refused unless ``insecure_remote = true``; plain gRPC
    on loopback is accepted with a warning (every local user can connect: the Unix socket's
    mode and group do not apply)."""
    opt_in = "set insecure_remote = true to accept this"
    if grpc.kind == "tcp" and not tls:
        if not is_loopback(grpc.host):
            problem = (f"plain TCP on {grpc.host} lets anyone who reaches this port read other processes' "
                       "calling contexts; use unix://, TLS (tls_cert, tls_key, tls_client_ca) or a "
                       "loopback address")
            if not insecure:
                raise chk.fail((*w, "grpc_listen"), f"{problem}, or {opt_in}")
            chk.warn((*w, "grpc_listen"), f"{problem} (accepted: insecure_remote = true)")
        else:
            chk.warn((*w, "grpc_listen"), "plain TCP on loopback: every local user can connect and read "
                     "other processes' calling contexts (the Unix socket's mode and group do not apply)")
    elif grpc.kind == "tcp" and not client_ca and not is_loopback(grpc.host):
        chk.warn((*w, "grpc_listen"), f"TLS without tls_client_ca on {grpc.host}: every client that reaches "
                 "this port can connect and read other processes' calling contexts")
    if metrics is not None and not is_loopback(metrics[0]):
        problem = (f"/metrics on {metrics[0] or 'every interface'} (plain HTTP, no authentication) shows "
                   "the hot calling contexts' function names to anyone who reaches this port")
        if not insecure:
            raise chk.fail((*w, "metrics_listen"), f"{problem}; use 127.0.0.1:PORT or {opt_in}")
        chk.warn((*w, "metrics_listen"), f"{problem} (accepted: insecure_remote = true)")


def _parse_endpoint(chk: _Checker, where: tuple[Any, ...], text: str) -> Endpoint:
    if text.startswith("unix://"):
        path = text[len("unix://"):]
    elif text.startswith("unix:"):
        path = text[len("unix:"):]
    elif text.startswith("tcp://"):
        host, port = _parse_hostport(chk, where, text[len("tcp://"):])
        return Endpoint("tcp", host=host, port=port)
    else:
        raise chk.fail(where, f"expected unix:///PATH or tcp://HOST:PORT, got {text!r}")
    if not os.path.isabs(path):
        raise chk.fail(where, f"the Unix socket path must be absolute, got {path!r}")
    return Endpoint("unix", path=path)


def _parse_hostport(chk: _Checker, where: tuple[Any, ...], text: str) -> tuple[str, int]:
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]]*):(\d+)", text)
    if not m:
        raise chk.fail(where, f"expected HOST:PORT, got {text!r}")
    host = m.group(1) if m.group(1) is not None else m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 <= port <= 65535:
        raise chk.fail(where, f"port out of range: {port}")
    return host or "0.0.0.0", port


def _parse_target(chk: _Checker, raw: Any, index: int, syscall_table: frozenset[str] | None,
                  source_lines: bool = True) -> TargetConfig:
    w: tuple[Any, ...] = ("target", index)
    tbl = chk.table(raw, w, _TARGET_KEYS)
    chosen = [k for k in ("path", "pid", "cgroup") if k in tbl]
    if len(chosen) != 1:
        problem = "names none of" if not chosen else "names more than one of"
        raise chk.fail(w if not chosen else (*w, chosen[1]), f"a target {problem} path, pid, cgroup")
    path = chk.get(tbl, w, "path", str, None)
    if path is not None and not os.path.isabs(path):
        raise chk.fail((*w, "path"), f"must be an absolute path, got {path!r}")
    if path is not None:
        _check_present(chk, (*w, "path"), path, binary_problem(path))
    pid = chk.get(tbl, w, "pid", int, None)
    if pid is not None and pid <= 0:
        raise chk.fail((*w, "pid"), f"must be a positive process id, got {pid}")
    cgroup = chk.get(tbl, w, "cgroup", str, None)
    if cgroup is not None and not os.path.isabs(cgroup):
        raise chk.fail((*w, "cgroup"), f"must be an absolute /sys/fs/cgroup/... path, got {cgroup!r}")
    if cgroup is not None:
        _check_present(chk, (*w, "cgroup"), cgroup, cgroup_problem(cgroup))
    default_name = (os.path.basename(path) if path else f"pid-{pid}" if pid is not None
                    else os.path.basename(str(cgroup).rstrip("/")) or "cgroup")
    name = str(chk.get(tbl, w, "name", str, default_name))
    if not re.fullmatch(r"[A-Za-z0-9_.:@+-]{1,128}", name):
        raise chk.fail((*w, "name"), f"use letters, digits and _.:@+- only, got {name!r}")
    syscalls = _parse_syscalls(chk, (*w, "syscalls"), tbl.get("syscalls", "all"), syscall_table)
    mode = chk.choice(tbl, w, "mode", MODES, "unwind")
    scope = chk.get(tbl, w, "scope", str, None)
    if scope is not None:
        if mode != "instrumented":
            raise chk.fail((*w, "scope"), 'applies to mode = "instrumented" only')
        try:
            re.compile(scope)
        except re.error as exc:
            raise chk.fail((*w, "scope"), f"not a valid regular expression: {exc}") from None
    anomaly = _parse_anomaly(chk, (*w, "anomaly"), tbl.get("anomaly", {}))
    watch_ia32 = bool(chk.get(tbl, w, "watch_ia32", bool, False))
    if watch_ia32 and mode != "unwind":
        raise chk.fail((*w, "watch_ia32"), 'applies to mode = "unwind" only')
    sample_hz = chk.positive(tbl, w, "perf_sample_hz", 0, minimum=0)
    over = sample_hz_over_limit(sample_hz)
    if over is not None:
        raise chk.fail((*w, "perf_sample_hz"), over)
    return TargetConfig(
        name=name, path=path, pid=pid, cgroup=cgroup, syscalls=syscalls, perf_sample_hz=sample_hz,
        encoding=chk.choice(tbl, w, "encoding", ENCODINGS, "valence"), mode=mode, scope=scope,
        max_probe_hits_per_sec=chk.positive(tbl, w, "max_probe_hits_per_sec", 0, minimum=0),
        verify=bool(chk.get(tbl, w, "verify", bool, False)), anomaly=anomaly,
        source_lines=bool(chk.get(tbl, w, "source_lines", bool, source_lines)),
        persist_history_seconds=chk.positive(tbl, w, "persist_history_seconds", 0, minimum=0),
        watch_ia32=watch_ia32)


class Problem(str):
    """Why a target's path or cgroup cannot be followed now; ``waits``: it may appear later (it
    does not exist, or cannot be read by whoever runs ``--check``), so the target waits for it;
    otherwise the configuration is wrong (a directory, a script)."""

    waits: bool

    def __new__(cls, text: str, waits: bool) -> Problem:
        obj = super().__new__(cls, text)
        obj.waits = waits
        return obj


ELF_MAGIC = b"\x7fELF"


def binary_problem(path: str) -> Problem | None:
    """None when ``path`` is a regular ELF file that can be read, else what is wrong with it."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return Problem("does not exist", waits=True)
        return Problem(f"cannot be examined: {exc.strerror}", waits=True)
    if stat.S_ISDIR(st.st_mode):
        return Problem("is a directory, not an ELF executable", waits=False)
    if not stat.S_ISREG(st.st_mode):
        return Problem("is not a regular file, not an ELF executable", waits=False)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        return Problem(f"cannot be read: {exc.strerror}", waits=True)
    if magic != ELF_MAGIC:
        hint = " (a script: name its interpreter's binary)" if magic[:2] == b"#!" else ""
        return Problem(f"is not an ELF file{hint}", waits=False)
    return None


def cgroup_problem(cgroup: str) -> Problem | None:
    """None when ``cgroup`` is a cgroup directory (it lists ``cgroup.procs``)."""
    if not os.path.exists(cgroup):
        return Problem("does not exist", waits=True)
    if not os.path.isfile(os.path.join(cgroup, "cgroup.procs")):
        return Problem("is not a cgroup directory (no cgroup.procs)", waits=False)
    return None


def _check_present(chk: _Checker, where: tuple[Any, ...], spec: str, problem: Problem | None) -> None:
    """A target's path or cgroup that is not there yet: a warning (the daemon waits for it); one
    that can never be followed as it is (a directory, a script): an error."""
    if problem is not None and problem.waits:
        chk.warn(where, f"{spec} {problem}: the target waits for it and attaches when it appears")
    elif problem is not None:
        raise chk.fail(where, f"{spec} {problem}")


def _parse_syscalls(chk: _Checker, where: tuple[Any, ...], value: Any,
                    table: frozenset[str] | None) -> tuple[str, ...] | None:
    if value == "all":
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise chk.fail(where, 'expected "all" or a non-empty array of syscall names')
    for name in value:
        if not _SYSCALL_NAME.match(name) or (table is not None and name not in table):
            raise chk.fail(where, f"unknown syscall {name!r}")
    return tuple(dict.fromkeys(value))


def _parse_anomaly(chk: _Checker, where: tuple[Any, ...], raw: Any) -> AnomalyConfig:
    tbl = chk.table(raw, where, _ANOMALY_KEYS)
    d = AnomalyConfig()

    def seconds(key: str, default: float) -> float:
        value = float(chk.get(tbl, where, key, (int, float), default))
        if value <= 0:
            raise chk.fail((*where, key), f"must be > 0, got {value}")
        return value

    model = chk.get(tbl, where, "model", str, None)
    if model is not None and not os.path.isabs(model):
        raise chk.fail((*where, "model"), f"must be an absolute path, got {model!r}")
    granularity = chk.choice(tbl, where, "granularity", ANOMALY_GRANULARITIES, d.granularity)
    action = chk.choice(tbl, where, "action", ANOMALY_ACTIONS, d.action)
    transitions = bool(chk.get(tbl, where, "transitions", bool, d.transitions))
    if granularity != "exact" and transitions:
        raise chk.fail((*where, "granularity"), f"\"{granularity}\" cannot be combined with transitions = "
                       "true (transitions are learned between exact contexts)")
    if granularity != "exact" and action == "enforce":
        raise chk.fail((*where, "granularity"), f"\"{granularity}\" cannot be enforced (the kernel-side "
                       "enforcer checks exact contexts): use action = \"detect\"")
    prefix_match = chk.choice(tbl, where, "prefix_match", ANOMALY_PREFIX_MATCHES, d.prefix_match)
    if prefix_match != "sites" and granularity != "routines":
        raise chk.fail((*where, "prefix_match"), f"\"{prefix_match}\" applies to granularity = "
                       "\"routines\" only")
    alert_history = chk.get(tbl, where, "alert_history", int, d.alert_history)
    if isinstance(alert_history, bool) or not 0 <= alert_history <= 4096:
        raise chk.fail((*where, "alert_history"), f"must be an integer from 0 to 4096, got {alert_history!r}")
    return AnomalyConfig(
        model=model, granularity=granularity, prefix_match=prefix_match, alert_history=alert_history,
        action=action,
        alert_interval_seconds=seconds("alert_interval_seconds", d.alert_interval_seconds),
        collapse_recursion=bool(chk.get(tbl, where, "collapse_recursion", bool, d.collapse_recursion)),
        transitions=transitions,
        flush_seconds=seconds("flush_seconds", d.flush_seconds))
