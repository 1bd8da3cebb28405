"""The systemd unit: ``systemd-analyze verify`` accepts it (as shipped and as installed), it has the
settings the issue requires, and ``ccprofd install-service`` installs it without touching an existing
configuration."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


# ------------------------------------------------------------------------------ issue 17: hardening
HARDENING = {
    "ProtectKernelTunables": "yes",
    "PrivateMounts": "yes",
    "ProtectProc": "invisible",
    "IPAddressDeny": "any",
    "IPAddressAllow": "localhost",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
}


def unit_with_exec(tmp_path: Path) -> Path:
    """The shipped unit with ExecStart on an executable that exists here (``verify`` checks it)."""
    unit = tmp_path / "ccprofd.service"
    text = UNIT.read_text().replace("ExecStart=/usr/local/bin/ccprofd", f"ExecStart={sys.executable}")
    unit.write_text(text)
    return unit


def test_unit_hardening_and_its_exposure_score(tmp_path: Path) -> None:
    """Issue 17: systemd-analyze security said 3.4 with ProtectKernelTunables, PrivateMounts,
    ProtectProc and an IP allow list unset and AF_NETLINK allowed."""
    s = unit_settings(UNIT.read_text())["Service"]
    assert {k: s.get(k) for k in HARDENING} == HARDENING
    unit = unit_with_exec(tmp_path)
    out = verify(unit)
    assert out.returncode == 0, out.stderr
    tool = require_tool("systemd-analyze")
    sec = subprocess.run([tool, "security", "--offline=yes", str(unit)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, SYSTEMD_COLORS="0"))
    score = float(sec.stdout.rsplit("Overall exposure level for ccprofd.service:", 1)[1].split()[0])
    assert score <= 2.7, sec.stdout
    good = {line.split()[1] for line in sec.stdout.splitlines() if line.startswith("✓")}
    assert {"ProtectKernelTunables=", "ProtectProc=", "RestrictAddressFamilies=~AF_NETLINK"} <= good, \
        sec.stdout


def test_install_service_warns_about_paths_the_sandbox_hides(tmp_path: Path) -> None:
    """Issue 17: install-service said nothing when ccprofd lived under /tmp, which PrivateTmp=yes
    replaces by an empty directory in the service (it fails with 203/EXEC)."""
    exe_dir = tmp_path / "venv" / "bin"
    exe_dir.mkdir(parents=True)
    exe = exe_dir / "ccprofd"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    (config_dir / "ccprofd.toml").write_text(
        '[daemon]\nstate_dir = "/srv/ccprofd"\nmetrics_listen = "0.0.0.0:9464"\ninsecure_remote = true\n'
        '[[target]]\npath = "/var/tmp/app/server"\n[[target]]\npath = "/usr/bin/gzip"\n')
    out = subprocess.run(
        [sys.executable, "-m", "ccprofd.cli", "install-service", "--unit-dir", str(tmp_path / "units"),
         "--config-dir", str(config_dir), "--exec", str(exe), "--no-group", "--no-reload"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    warnings = [ln.removeprefix("ccprofd: warning: ") for ln in out.stderr.splitlines()
                if ln.startswith("ccprofd: warning: ") and "members of" not in ln]
    assert warnings == [
        f"ExecStart needs {exe}, which PrivateTmp=yes hides from the service (it would fail with status "
        "203/EXEC): install ccprofd outside /tmp",
        f"configuration {config_dir}/ccprofd.toml is hidden by PrivateTmp=yes in the service: move it out "
        "of /tmp",
        "target[0] path /var/tmp/app/server is hidden by PrivateTmp=yes in the service: move it out of "
        "/var/tmp",
        "state_dir /srv/ccprofd is read-only under ProtectSystem=strict: use a path below /var/lib/ccprofd, "
        "/run/ccprofd or add ReadWritePaths=/srv/ccprofd in a drop-in",
        "listening on 0.0.0.0: the unit's IPAddressDeny=any drops every peer but loopback; allow the "
        "clients' addresses with IPAddressAllow= in a drop-in",
    ], out.stderr


def test_no_sandbox_warning_for_a_usual_installation(tmp_path: Path) -> None:
    from ccprofd.cli.daemon import unit_text
    from ccprofd.cli.unitpaths import sandbox_warnings

    text = unit_text("/usr/bin/python3", "/etc/ccprofd/ccprofd.toml")
    assert sandbox_warnings(text, "/usr/bin/python3", Path("/etc/ccprofd/ccprofd.toml")) == []
    # the same paths under a unit without PrivateTmp: nothing hidden
    config = tmp_path / "ccprofd.toml"
    config.write_text('[[target]]\npath = "/tmp/x"\n')
    loose = text.replace("PrivateTmp=yes", "PrivateTmp=no")
    assert sandbox_warnings(loose, "/usr/bin/python3", config) == []
    assert len(sandbox_warnings(text, "/usr/bin/python3", config)) == 2  # config file and target path


def test_bpf_cache_key_sees_kallsyms_hidden(bpf: None, tmp_path: Path) -> None:
    """ProtectKernelTunables=yes hides /proc/kallsyms, and bcc then compiles other helpers (the
    legacy bpf_probe_read): the cache key must tell the two objects apart."""
    from unit_sandbox import sandbox_prefix

    code = "from ccprofd.kbpf.objcache import environment_identity as e; print(e())"
    outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             cwd=ROOT).stdout.splitlines()
    inside = subprocess.run([*sandbox_prefix(tmp_path), sys.executable, "-c", code], capture_output=True,
                            text=True, check=True, cwd=ROOT).stdout.splitlines()
    assert outside[-1] == "kallsyms:listed" and inside[-1] == "kallsyms:empty"
    assert outside[:-1] == inside[:-1]


@pytest.mark.parametrize("mode", ["unwind", "instrumented"])
def test_daemon_works_in_the_unit_sandbox(bpf: None, workdir: str, tmp_path: Path, mode: str) -> None:
    """Issue 17: each added directive must leave BPF working.  The real daemon in the sandbox of
    tests/unit_sandbox.py (ProtectKernelTunables, PrivateMounts, ProtectProc, the capability
    bounding set, RestrictAddressFamilies without AF_NETLINK), its BPF objects compiled there (an
    empty state directory), follows a program in each mode: the same exact counts as outside, CPU samples
    included, and promtool accepts the scrape."""
    from test_daemon_metrics_e2e import check_scrape, scrape_daemon
    from unit_sandbox import sandbox_prefix

    text = scrape_daemon(workdir, tmp_path, mode, prefix=sandbox_prefix(tmp_path))
    check_scrape(text, mode)
    objects = list(Path(workdir, "state").rglob("bpf/*.json"))  # the daemon's cache: a new state_dir
    assert objects, "nothing compiled in the sandbox"
    # compiled there with kallsyms hidden: bcc used the legacy helpers (4: bpf_probe_read)
    import base64
    import json
    import struct

    helpers = set()
    for obj in objects:
        for fn in json.loads(obj.read_text())["functions"]:
            insns = base64.b64decode(fn["insns"])
            helpers |= {struct.unpack_from("<i", insns, i + 4)[0] for i in range(0, len(insns), 8)
                        if insns[i] == 0x85 and insns[i + 1] >> 4 == 0}
    assert 4 in helpers and not helpers & {112, 113, 114, 115}, sorted(helpers)


def test_unit_sandbox_still_sees_other_users_processes(tmp_path: Path) -> None:
    """ProtectProc=invisible hides other users' processes from processes that may not ptrace
    them: the daemon (root, CAP_SYS_PTRACE in its bounding set) still reads their maps."""
    from unit_sandbox import sandbox_prefix

    other = subprocess.Popen([require_tool("setpriv"), "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                              "sleep", "600"])
    try:
        code = (f"grep -o 'hidepid=[a-z]*' /proc/self/mountinfo | head -1; "
                f"stat -c %U /proc/{other.pid}; grep -c sleep /proc/{other.pid}/maps")
        out = subprocess.run([*sandbox_prefix(tmp_path), "bash", "-c", code], capture_output=True, text=True,
                             check=False)
        mount, owner, maps = out.stdout.split()
        assert (mount, owner) == ("hidepid=invisible", "nobody") and int(maps) > 0, out
    finally:
        other.kill()
        other.wait()
