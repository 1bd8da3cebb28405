"""Daemon configuration: every error names file, line and key; unknown keys are errors; the shipped
example parses (including its commented example targets)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import skip_or_fail

from ccprofd.daemon.config import ConfigError, Endpoint, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
SYSCALLS = frozenset({"write", "openat", "execve", "connect", "read"})


def parse(text: str) -> object:
    return parse_config(text, "/etc/ccprofd/test.toml", known_syscalls=lambda: SYSCALLS)


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(text)
    return str(info.value)


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line containing ``needle`` (computed here, independently)."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_full_config_values() -> None:
    cfg = parse("""
[daemon]
state_dir = "/var/lib/x"
grpc_listen = "tcp://127.0.0.1:50051"
metrics_listen = "[::1]:9000"
top_k = 5
max_series = 10

[[target]]
path = "/usr/sbin/some-service"
syscalls = ["openat", "execve", "connect", "write", "openat"]
perf_sample_hz = 49
encoding = "pcce"
mode = "instrumented"
scope = "^handle_"
max_probe_hits_per_sec = 1000

[target.anomaly]
action = "detect"

[[target]]
pid = 42

[[target]]
cgroup = "/sys/fs/cgroup/system.slice/x.service"
syscalls = "all"
""")
    assert cfg.daemon.grpc_listen == Endpoint("tcp", host="127.0.0.1", port=50051)  # type: ignore[attr-defined]
    assert cfg.daemon.metrics_listen == ("::1", 9000)  # type: ignore[attr-defined]
    t0, t1, t2 = cfg.targets  # type: ignore[attr-defined]
    assert (t0.name, t0.kind, t0.syscalls, t0.perf_sample_hz, t0.encoding, t0.mode, t0.scope) == (
        "some-service",
        "path",
        ("openat", "execve", "connect", "write"),
        49,
        "pcce",
        "instrumented",
        "^handle_",
    )
    assert t0.max_probe_hits_per_sec == 1000 and t0.anomaly.action == "detect"
    assert (t1.name, t1.kind, t1.pid, t1.mode, t1.syscalls) == ("pid-42", "pid", 42, "unwind", None)
    assert (t2.name, t2.kind) == ("x.service", "cgroup") and t2.anomaly.action == "off"


def test_defaults_are_the_documented_ones() -> None:
    cfg = parse("")
    d = cfg.daemon  # type: ignore[attr-defined]
    assert str(d.grpc_listen) == "unix:///run/ccprofd/ccprofd.sock"
    assert d.grpc_socket_mode == 0o660 and d.metrics_listen == ("127.0.0.1", 9464)
    assert str(d.state_dir) == "/var/lib/ccprofd" and cfg.targets == ()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "needle", "key", "problem"),
    [
        ('[daemon]\nstate_dir = "/x"\nfoo = 1\n', "foo", "daemon.foo", "unknown key"),
        (
            '[[target]]\npath = "/a"\n\n[[target]]\npath = "/b"\nmodes = "unwind"\n',
            "modes",
            "target[1].modes",
            "unknown key",
        ),
        ('[[target]]\npath = "/a"\nmode = "fast"\n', "mode", "target[0].mode", "expected one of unwind"),
        (
            '[[target]]\npath = "/a"\nsyscalls = ["write",\n  "opneat"]\n',
            "syscalls",
            "target[0].syscalls",
            "unknown syscall 'opneat'",
        ),
        ('[[target]]\npath = "relative/bin"\n', "path", "target[0].path", "absolute"),
        ('[[target]]\npath = "/a"\npid = 3\n', "pid", "target[0].pid", "more than one of"),
        ('[[target]]\nname = "x"\n', "[[target]]", "target[0]", "names none of"),
        (
            '[[target]]\npath = "/a"\nperf_sample_hz = -1\n',
            "perf_sample_hz",
            "target[0].perf_sample_hz",
            ">= 0",
        ),
        (
            '[[target]]\npath = "/a"\nperf_sample_hz = "49"\n',
            "perf_sample_hz",
            "target[0].perf_sample_hz",
            "expected an integer, got a string",
        ),
        ('[[target]]\npath = "/a"\nverify = 1\n', "verify", "target[0].verify", "expected a boolean"),
        ('[[target]]\npath = "/a"\nscope = "main"\n', "scope", "target[0].scope", "instrumented"),
        (
            '[[target]]\npath = "/a"\nmode = "instrumented"\nscope = "(("\n',
            "scope",
            "target[0].scope",
            "regular expression",
        ),
        (
            '[[target]]\npath = "/a"\n[target.anomaly]\naction = "block"\n',
            "action",
            "target[0].anomaly.action",
            "expected one of off",
        ),
        (
            '[[target]]\npath = "/a/x"\n[[target]]\npath = "/b/x"\n',
            'path = "/b/x"',
            "target[1].path",
            "duplicate target name 'x'",
        ),
        (
            '[[target]]\nname = "a"\npid = 1\n[[target]]\nname = "a"  # dup\npid = 2\n',
            "# dup",
            "target[1].name",
            "duplicate target name 'a'",
        ),
        (
            '[daemon]\ngrpc_listen = "http://x"\n',
            "grpc_listen",
            "daemon.grpc_listen",
            "unix:///PATH or tcp://",
        ),
        (
            '[daemon]\ngrpc_socket_mode = "0666"\n',
            "grpc_socket_mode",
            "daemon.grpc_socket_mode",
            "every local user",
        ),
        ('[daemon]\nmetrics_listen = "9464"\n', "metrics_listen", "daemon.metrics_listen", "HOST:PORT"),
        ("[daemon]\ntop_k = 0\n", "top_k", "daemon.top_k", ">= 1"),
        ("[daemon]\ntop_k = 30\nmax_series = 10\n", "max_series", "daemon.max_series", ">= top_k"),
        ('[daemon]\ntls_cert = "/nonexistent/cert.pem"\n', "tls_cert", "daemon.tls_cert", "no such file"),
        ('[demon]\nstate_dir = "/x"\n', "[demon]", "demon", "unknown key"),
    ],
)
def test_errors_name_file_line_and_key(text: str, needle: str, key: str, problem: str) -> None:
    message = error_of(text)
    assert "\n" not in message
    expected_line = line_of(text, needle)
    assert message.startswith(f"/etc/ccprofd/test.toml:{expected_line}: {key}: "), message
    assert problem in message


def test_toml_syntax_error_has_its_line() -> None:
    text = '[daemon]\nstate_dir = "/x"\ntop_k = = 3\n'
    message = error_of(text)
    assert message.startswith("/etc/ccprofd/test.toml:3: TOML syntax error"), message


def test_multiline_array_contents_are_not_keys() -> None:
    text = '[[target]]\npath = "/a"\nsyscalls = [\n  "write", # mode = 1\n  "read",\n]\nbogus = 1\n'
    assert error_of(text).startswith(f"/etc/ccprofd/test.toml:{line_of(text, 'bogus')}: target[0].bogus:")


def test_tls_needs_cert_and_key_together(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    text = f'[daemon]\ngrpc_listen = "tcp://127.0.0.1:1"\ntls_cert = "{cert}"\n'
    assert "tls_cert and tls_key must be given together" in error_of(text)
    text = f'[daemon]\ntls_cert = "{cert}"\ntls_key = "{cert}"\n'
    assert "tcp:// listen addresses only" in error_of(text)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^/nonexistent/ccprofd.toml: no such file$"):
        load_config("/nonexistent/ccprofd.toml")
    bad = tmp_path / "bin.toml"
    bad.write_bytes(b"\xff\xfe[daemon]")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(bad)


def test_syscall_names_checked_against_the_running_kernel() -> None:
    from ccprofd.kbpf.tracefs import tracefs_syscalls

    names = tracefs_syscalls()
    if names is None:
        skip_or_fail("tracefs not readable")
    assert {"openat", "write", "execve", "connect"} <= names
    cfg = parse_config('[[target]]\npath = "/a"\nsyscalls = ["openat", "write"]\n')
    assert cfg.targets[0].syscalls == ("openat", "write")
    with pytest.raises(ConfigError, match="unknown syscall 'nosuchcall'"):
        parse_config('[[target]]\npath = "/a"\nsyscalls = ["nosuchcall"]\n')


def test_shipped_example_config_parses_with_its_example_targets(tmp_path: Path) -> None:
    example = (ROOT / "systemd" / "ccprofd.toml").read_text()
    cfg = parse_config(example, "ccprofd.toml", known_syscalls=lambda: SYSCALLS)
    assert cfg.targets == () and cfg.daemon.metrics_listen == ("127.0.0.1", 9464)
    block = re.search(r"# BEGIN EXAMPLE TARGETS\n(.*?)# END EXAMPLE TARGETS", example, re.S)
    assert block is not None
    uncommented = "\n".join(
        line[2:] if line.startswith("# ") else line.lstrip("#") for line in block.group(1).splitlines()
    )
    cfg = parse_config(example + "\n" + uncommented, "ccprofd.toml", known_syscalls=lambda: SYSCALLS)
    assert [t.name for t in cfg.targets] == ["nginx", "api", "postgresql.service"]
    assert cfg.targets[1].scope == "^handle_request$" and cfg.targets[2].anomaly.action == "detect"
