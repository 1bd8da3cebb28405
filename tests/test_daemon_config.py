"""Daemon configuration: every error names file, line and key; unknown keys are errors; the shipped
example parses (including its commented example targets)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
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
    assert d.retire_after_seconds == 3600 and d.promotion_window_seconds == 300
    # 0 turns retirement off; any value from the promotion window up is accepted.
    assert parse("[daemon]\nretire_after_seconds = 0\n").daemon.retire_after_seconds == 0  # type: ignore[attr-defined]
    assert parse("[daemon]\npromotion_window_seconds = 60\nretire_after_seconds = 60\n"
                 ).daemon.retire_after_seconds == 60  # type: ignore[attr-defined]
    assert d.source_lines is True
    assert parse('[[target]]\npath = "/a"\n').targets[0].watch_ia32 is False  # type: ignore[attr-defined]
    assert parse('[[target]]\npath = "/a"\nwatch_ia32 = true\n').targets[0].watch_ia32  # type: ignore[attr-defined]


def test_source_lines_default_from_daemon_and_per_target_override() -> None:
    """``source_lines``: on unless [daemon] turns it off for every target; a target's own key wins.
    The value is resolved into the target (so a reload that changes [daemon] restarts the targets
    it changes, since targets restart on inequality)."""
    cfg = parse('[[target]]\npath = "/a"\n\n[[target]]\npath = "/b"\nsource_lines = false\n')
    assert [t.source_lines for t in cfg.targets] == [True, False]  # type: ignore[attr-defined]
    cfg = parse('[daemon]\nsource_lines = false\n\n[[target]]\npath = "/a"\n\n'
                '[[target]]\npath = "/b"\nsource_lines = true\n')
    assert [t.source_lines for t in cfg.targets] == [False, True]  # type: ignore[attr-defined]


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
        ('[[target]]\npath = "/a"\nsource_lines = "yes"\n', "source_lines", "target[0].source_lines",
         "expected a boolean, got a string"),
        ('[daemon]\nsource_lines = 0\n', "source_lines", "daemon.source_lines", "expected a boolean"),
        ('[[target]]\npath = "/a"\nscope = "main"\n', "scope", "target[0].scope", "instrumented"),
        ('[[target]]\npath = "/a"\nwatch_ia32 = "yes"\n', "watch_ia32", "target[0].watch_ia32",
         "expected a boolean"),
        ('[[target]]\npath = "/a"\nmode = "instrumented"\nwatch_ia32 = true\n', "watch_ia32",
         "target[0].watch_ia32", 'applies to mode = "unwind" only'),
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
        ("[daemon]\nretire_after_seconds = -1\n", "retire_after", "daemon.retire_after_seconds", ">= 0"),
        ("[daemon]\nretire_after_seconds = 60\n", "retire_after", "daemon.retire_after_seconds",
         "0 (never retire) or >= promotion_window_seconds (300)"),
        ('[daemon]\nretire_after_seconds = "1h"\n', "retire_after", "daemon.retire_after_seconds",
         "expected an integer"),
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


# ------------------------------------------------------------- issue 15: exposure and target paths
def warnings_of(text: str) -> tuple[str, ...]:
    return parse(text).warnings  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize(
    ("daemon", "key", "problem"),
    [
        ('grpc_listen = "tcp://0.0.0.0:50051"', "daemon.grpc_listen", "plain TCP on 0.0.0.0"),
        ('grpc_listen = "tcp://:50051"', "daemon.grpc_listen", "plain TCP on 0.0.0.0"),
        ('grpc_listen = "tcp://[::]:50051"', "daemon.grpc_listen", "plain TCP on ::"),
        ('grpc_listen = "tcp://10.1.2.3:50051"', "daemon.grpc_listen", "plain TCP on 10.1.2.3"),
        ('grpc_listen = "tcp://myhost:50051"', "daemon.grpc_listen", "plain TCP on myhost"),
        ('metrics_listen = ":9464"', "daemon.metrics_listen", "/metrics on 0.0.0.0"),
        ('metrics_listen = "0.0.0.0:9464"', "daemon.metrics_listen", "/metrics on 0.0.0.0"),
        ('metrics_listen = "[::]:9464"', "daemon.metrics_listen", "/metrics on ::"),
    ],
)
def test_plain_tcp_off_loopback_is_refused_unless_explicit(daemon: str, key: str, problem: str) -> None:
    text = f"[daemon]\n# exposure\n{daemon}\n"
    message = error_of(text)
    assert message.startswith(f"/etc/ccprofd/test.toml:3: {key}: {problem}"), message
    assert "insecure_remote = true" in message
    # explicit opt-in: accepted, with the same problem as a warning on the same line
    (warning,) = warnings_of(text + "insecure_remote = true\n")
    assert warning.startswith(f"/etc/ccprofd/test.toml:3: {key}: {problem}") and "accepted" in warning


def test_plain_tcp_on_loopback_warns_and_tls_or_loopback_metrics_do_not(tmp_path: Path) -> None:
    (warning,) = warnings_of('[daemon]\ngrpc_listen = "tcp://127.0.0.1:50051"\n')
    assert warning.startswith("/etc/ccprofd/test.toml:2: daemon.grpc_listen: plain TCP on loopback")
    assert "every local user" in warning
    assert warnings_of('[daemon]\ngrpc_listen = "tcp://[::1]:1"\n')
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    tls = f'[daemon]\ngrpc_listen = "tcp://0.0.0.0:1"\ntls_cert = "{pem}"\ntls_key = "{pem}"\n'
    assert parse(tls).daemon.grpc_listen.host == "0.0.0.0"  # type: ignore[attr-defined]
    (warning,) = warnings_of(tls)  # encrypted, but anyone may connect
    assert warning.startswith("/etc/ccprofd/test.toml:2: daemon.grpc_listen: TLS without tls_client_ca")
    assert warnings_of(tls + f'tls_client_ca = "{pem}"\n') == ()
    for metrics in ("127.0.0.1:1", "localhost:1", "[::1]:1", "127.0.0.2:1", ""):
        assert warnings_of(f'[daemon]\nmetrics_listen = "{metrics}"\n') == (), metrics
    assert warnings_of("") == ()  # the defaults: Unix socket, metrics on 127.0.0.1


def test_target_path_missing_warns_directory_or_non_elf_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "later" / "prog"
    text = f'[[target]]\nname = "a"\npath = "{missing}"\n'
    (warning,) = warnings_of(text)
    assert warning == (f"/etc/ccprofd/test.toml:3: target[0].path: {missing} does not exist: the target "
                       "waits for it and attaches when it appears")
    assert "is a directory" in error_of(f'[[target]]\npath = "{tmp_path}"\n')
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\nexec true\n")
    message = error_of(f'[[target]]\nname = "s"\n\npath = "{script}"\n')
    assert message == (f"/etc/ccprofd/test.toml:4: target[0].path: {script} is not an ELF file "
                       "(a script: name its interpreter's binary)")
    data = tmp_path / "data"
    data.write_bytes(b"\x00" * 64)
    assert error_of(f'[[target]]\npath = "{data}"\n').endswith(f"{data} is not an ELF file")
    assert "not a regular file" in error_of('[[target]]\npath = "/dev/null"\n')
    true = shutil.which("true")
    assert true is not None and Path(true).read_bytes()[:4] == b"\x7fELF"
    assert warnings_of(f'[[target]]\npath = "{true}"\n') == ()


def test_target_cgroup_missing_warns_non_cgroup_is_refused(tmp_path: Path) -> None:
    missing = "/sys/fs/cgroup/ccprofd-no-such-group.service"
    (warning,) = warnings_of(f'[[target]]\ncgroup = "{missing}"\n')
    assert warning.startswith(f"/etc/ccprofd/test.toml:2: target[0].cgroup: {missing} does not exist")
    assert "not a cgroup directory" in error_of(f'[[target]]\ncgroup = "{tmp_path}"\n')


def test_run_check_prints_warnings_and_refuses_errors(tmp_path: Path) -> None:
    missing = tmp_path / "prog"
    config = tmp_path / "c.toml"
    config.write_text(f'[[target]]\npath = "{missing}"\n')

    def check() -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "ccprofd.cli", "run", "--check", "--config", str(config)]
        return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)

    ok = check()
    assert ok.returncode == 0 and ok.stdout == f"{config}: OK (1 targets, 1 warnings)\n", ok
    assert ok.stderr == (f"ccprofd: warning: {config}:2: target[0].path: {missing} does not exist: "
                         "the target waits for it and attaches when it appears\n")
    config.write_text('[daemon]\nmetrics_listen = ":9464"\n')
    bad = check()
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"ccprofd: {config}:2: daemon.metrics_listen: /metrics on 0.0.0.0")


def test_perf_sample_hz_above_the_kernel_limit_is_refused() -> None:
    limit = int(Path("/proc/sys/kernel/perf_event_max_sample_rate").read_text())
    cfg = parse(f"[[target]]\npid = 1\nperf_sample_hz = {limit}\n")
    assert cfg.targets[0].perf_sample_hz == limit  # type: ignore[attr-defined]
    message = error_of(f"[[target]]\npid = 1\nperf_sample_hz = {limit + 1}\n")
    assert message == (f"/etc/ccprofd/test.toml:3: target[0].perf_sample_hz: {limit + 1} exceeds the "
                       f"kernel's limit (kernel.perf_event_max_sample_rate = {limit})")


def test_anomaly_granularity() -> None:
    base = '[[target]]\nname = "a"\npid = 1\n[target.anomaly]\naction = "detect"\n'
    assert parse(base).targets[0].anomaly.granularity == "exact"  # type: ignore[attr-defined]
    cfg = parse(base + 'granularity = "edges"\n')
    assert cfg.targets[0].anomaly.granularity == "edges"  # type: ignore[attr-defined]
    cfg = parse(base + 'granularity = "routines"\n')
    assert cfg.targets[0].anomaly.granularity == "routines"  # type: ignore[attr-defined]
    assert error_of(base + 'granularity = "fuzzy"\n').endswith(
        "expected one of exact, edges, routines; got 'fuzzy'")
    enforce = base.replace('"detect"', '"enforce"')
    for g in ("edges", "routines"):
        assert f'"{g}" cannot be combined with transitions' in error_of(
            base + f'granularity = "{g}"\ntransitions = true\n')
        assert f'"{g}" cannot be enforced' in error_of(enforce + f'granularity = "{g}"\n')


def test_anomaly_prefix_match() -> None:
    base = '[[target]]\nname = "a"\npid = 1\n[target.anomaly]\naction = "detect"\n'
    assert parse(base).targets[0].anomaly.prefix_match == "sites"  # type: ignore[attr-defined]
    cfg = parse(base + 'granularity = "routines"\nprefix_match = "functions"\n')
    assert cfg.targets[0].anomaly.prefix_match == "functions"  # type: ignore[attr-defined]
    assert error_of(base + 'granularity = "routines"\nprefix_match = "function"\n').endswith(
        "expected one of sites, functions; got 'function'")
    for g in ("exact", "edges"):
        assert error_of(base + f'granularity = "{g}"\nprefix_match = "functions"\n') == (
            '/etc/ccprofd/test.toml:7: target[0].anomaly.prefix_match: "functions" applies to '
            'granularity = "routines" only')
    # "sites" (the default) is valid with every granularity.
    assert parse(base + 'prefix_match = "sites"\n').targets[0].anomaly.prefix_match == "sites"  # type: ignore[attr-defined]
