"""The systemd unit: ``systemd-analyze verify`` accepts it (as shipped and as installed), it has the
settings the issue requires, and ``ccprofd install-service`` installs it without touching an existing
configuration."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

from conftest import require_tool

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "ccprofd.service"


def unit_settings(text: str) -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return {s: dict(parser[s]) for s in parser.sections()}


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    tool = require_tool("systemd-analyze")
    return subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=120)


def test_shipped_unit_verifies_and_has_the_required_settings() -> None:
    exe = "/usr/local/bin/ccprofd"
    if not os.access(exe, os.X_OK):
        require_tool("ccprofd")  # set-up links it; without it verify would complain about ExecStart
    out = verify(UNIT)
    assert out.returncode == 0, out.stderr
    s = unit_settings(UNIT.read_text())["Service"]
    assert s["Type"] == "notify" and s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["WatchdogSec"] and s["StateDirectory"] == "ccprofd" and s["RuntimeDirectory"] == "ccprofd"
    assert s["ConfigurationDirectory"] == "ccprofd"
    assert s["ExecStart"].endswith("run --config /etc/ccprofd/ccprofd.toml")
    caps = set(s["CapabilityBoundingSet"].split())
    assert {"CAP_BPF", "CAP_PERFMON"} <= caps and "CAP_SYS_ADMIN" not in caps
    for key, value in (
        ("ProtectSystem", "strict"),
        ("ProtectHome", "read-only"),
        ("PrivateTmp", "yes"),
        ("NoNewPrivileges", "yes"),
    ):
        assert s[key] == value, key


def test_install_service_into_directories(tmp_path: Path) -> None:
    unit_dir, config_dir = tmp_path / "units", tmp_path / "etc"
    exe = "/usr/local/bin/ccprofd" if os.access("/usr/local/bin/ccprofd", os.X_OK) else sys.executable
    cmd = [
        sys.executable,
        "-m",
        "ccprofd.cli",
        "install-service",
        "--unit-dir",
        str(unit_dir),
        "--config-dir",
        str(config_dir),
        "--exec",
        exe,
        "--no-group",
        "--no-reload",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    installed = (unit_dir / "ccprofd.service").read_text()
    assert unit_settings(installed)["Service"]["ExecStart"] == f"{exe} run --config {config_dir}/ccprofd.toml"
    assert (config_dir / "ccprofd.toml").read_text() == (ROOT / "systemd" / "ccprofd.toml").read_text()
    assert verify(unit_dir / "ccprofd.service").returncode == 0
    # A second run keeps the administrator's configuration.
    (config_dir / "ccprofd.toml").write_text("# mine\n")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "kept the existing" in out.stdout
    assert (config_dir / "ccprofd.toml").read_text() == "# mine\n"
    bad = subprocess.run(
        [*cmd[:-4], "--exec", "relative/ccprofd", "--no-group", "--no-reload"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert bad.returncode == 2 and "absolute path" in bad.stderr


def runs_as_nobody(path: Path) -> bool:
    """The oracle: does ``path`` actually run for user nobody (not root, not in root's group)?"""
    setpriv = require_tool("setpriv")
    # through a shell: setpriv's own exec of the target is not checked as nobody's on this system
    out = subprocess.run([setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/bin/sh", "-c",
                          'exec "$0"', str(path)], capture_output=True, text=True, timeout=60)
    return out.returncode == 0 and out.stdout == "ok\n"


def test_client_unreachable_by_the_socket_group_is_reported() -> None:
    """Issue 15: a ccprofctl in a venv under a 0700 home cannot be run by the ccprofd group's
    members; access_problem says why, agreeing with running it as nobody, and install-service
    warns."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="ccpaccess", dir="/tmp"))
    try:
        base.chmod(0o755)
        home = base / "home"
        (home / "venv" / "bin").mkdir(parents=True)
        home.chmod(0o700)
        (home / "venv" / "bin").chmod(0o755)
        (home / "venv").chmod(0o755)
        interp = home / "venv" / "bin" / "sh"
        shutil.copy2("/bin/sh", interp)
        interp.chmod(0o755)
        client = home / "venv" / "bin" / "ccprofctl"
        client.write_text(f"#!{interp}\necho ok\n")
        client.chmod(0o755)
        (home / "venv" / "bin" / "ccprofd").write_text("#!/bin/sh\n")
        (home / "venv" / "bin" / "ccprofd").chmod(0o755)
        link = base / "ccprofctl"
        link.symlink_to(client)
        problem = f"{home} (mode 0700) is not searchable by other users"
        assert not runs_as_nobody(link)
        ccprofd = str(home / "venv" / "bin" / "ccprofd")
        out = subprocess.run(
            [sys.executable, "-m", "ccprofd.cli", "install-service", "--unit-dir", str(base / "units"),
             "--config-dir", str(base / "etc"), "--exec", ccprofd, "--no-group", "--no-reload"],
            capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stderr.startswith(f"ccprofd: warning: members of 'ccprofd' cannot run {client}: {problem}")

        from ccprofd.cli.daemon import access_problem

        assert access_problem(str(link)) == problem
        home.chmod(0o755)
        assert access_problem(str(link)) is None and runs_as_nobody(link)
        # the script is reachable, its interpreter is not
        (home / "venv" / "bin").chmod(0o700)
        outside = base / "ccprofctl2"
        outside.write_text(f"#!{interp}\necho ok\n")
        outside.chmod(0o755)
        assert access_problem(str(outside)) == (f"{home / 'venv' / 'bin'} (mode 0700) is not searchable by "
                                                "other users")
        assert not runs_as_nobody(outside)
        (home / "venv" / "bin").chmod(0o755)
        client.chmod(0o750)
        assert "is not readable and executable by other users" in str(access_problem(str(client)))
        assert not runs_as_nobody(client)
    finally:
        shutil.rmtree(base, ignore_errors=True)
