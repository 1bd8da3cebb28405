"""``ccprofd run`` and ``ccprofd install-service``: the daemon's sub-commands (registered by
:mod:`ccprofd.cli`).  Exit status: 0 success, 2 bad configuration or usage, 1 other failure."""

from __future__ import annotations

import argparse
import grp
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from ccprofd.daemon.config import DEFAULT_CONFIG_PATH, ConfigError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
SOCKET_GROUP = "ccprofd"


def add_daemon_commands(sub: Any) -> None:
    run = sub.add_parser(
        "run", help="run the daemon in the foreground (systemd supervises it)",
        description="Follow the configured targets, aggregate hot calling contexts, serve gRPC (ccprofctl) "
                    "and Prometheus /metrics. SIGHUP reloads the configuration (a bad one is rejected and "
                    "the running one kept), SIGUSR1 writes every thread's stack to the log, SIGTERM/SIGINT "
                    "detach every probe and exit. Speaks systemd's "
                    "notify protocol when $NOTIFY_SOCKET is set.")
    run.add_argument("--config", default=DEFAULT_CONFIG_PATH, metavar="FILE",
                     help=f"TOML configuration (default {DEFAULT_CONFIG_PATH})")
    run.add_argument("--check", action="store_true", help="validate the configuration and exit")
    # Test seam: replace the tracer by another SampleSource factory (MODULE:FUNCTION).
    run.add_argument("--source-factory", default=None, help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)

    inst = sub.add_parser(
        "install-service", help="install the systemd unit, the example configuration and the socket group",
        description="Write ccprofd.service (ExecStart pointing at this ccprofd) to the unit directory, "
                    "copy the documented example configuration unless one exists, create the system "
                    f"group '{SOCKET_GROUP}' that may use the gRPC socket, and reload systemd if it runs.")
    inst.add_argument("--unit-dir", default="/etc/systemd/system", type=Path,
                      help="where ccprofd.service is written (default /etc/systemd/system)")
    inst.add_argument("--config-dir", default="/etc/ccprofd", type=Path,
                      help="where the example ccprofd.toml is copied unless one exists "
                           "(default /etc/ccprofd)")
    inst.add_argument("--exec", dest="executable", default=None,
                      help="ccprofd executable for ExecStart (default: this one)")
    inst.add_argument("--no-group", action="store_true", help=f"do not create the '{SOCKET_GROUP}' group")
    inst.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
    inst.set_defaults(func=cmd_install_service)


def cmd_run(args: argparse.Namespace) -> int:
    from ccprofd.daemon.config import load_config

    try:
        if args.check:
            config = load_config(args.config)
            for warning in config.warnings:
                print(f"ccprofd: warning: {warning}", file=sys.stderr)
            print(f"{args.config}: OK ({len(config.targets)} targets"
                  + (f", {len(config.warnings)} warnings)" if config.warnings else ")"))
            return EXIT_OK
        from ccprofd.daemon.service import run_daemon
        from ccprofd.daemon.source import load_factory
        from ccprofd.export.servers import standard_servers

        factory = load_factory(args.source_factory) if args.source_factory else None
        return run_daemon(args.config, factory, servers=standard_servers())
    except ConfigError as exc:
        print(f"ccprofd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as exc:  # tracer missing, gRPC endpoint unusable
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"ccprofd: {text}", file=sys.stderr)
        return EXIT_FAILURE


def unit_text(executable: str, config_path: str) -> str:
    """The shipped unit with ExecStart pointing at ``executable`` and ``config_path``."""
    text = (SYSTEMD_DIR / "ccprofd.service").read_text()
    return re.sub(r"^ExecStart=.*$", f"ExecStart={executable} run --config {config_path}", text, flags=re.M)


def access_problem(path: str) -> str | None:
    """Why a user who is neither root nor in root's group (a member of the socket group) cannot
    run ``path``: the first directory on the way that others may not search, or the file itself
    not readable/executable by them (symlinks followed, and a script's ``#!`` interpreter too).
    None when they can."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"{real}: {exc.strerror}"
    for d in reversed(Path(real).parents):  # from / down
        mode = os.stat(d).st_mode
        if not mode & stat.S_IXOTH:
            return f"{d} (mode {stat.S_IMODE(mode):04o}) is not searchable by other users"
    if not (st.st_mode & stat.S_IXOTH and st.st_mode & stat.S_IROTH):
        return f"{real} (mode {stat.S_IMODE(st.st_mode):04o}) is not readable and executable by other users"
    try:
        with open(real, "rb") as fh:
            first = fh.readline(4096)
    except OSError:
        return None
    if first.startswith(b"#!"):
        interpreter = first[2:].decode(errors="replace").split()
        if interpreter and interpreter[0] != path and os.path.isabs(interpreter[0]):
            return access_problem(interpreter[0])
    return None


def client_path(ccprofd_exe: str) -> str | None:
    """The ``ccprofctl`` installed beside ``ccprofd_exe`` (the same venv), else the one on PATH."""
    beside = os.path.join(os.path.dirname(ccprofd_exe), "ccprofctl")
    return beside if os.access(beside, os.X_OK) else shutil.which("ccprofctl")


def cmd_install_service(args: argparse.Namespace) -> int:
    if not (SYSTEMD_DIR / "ccprofd.service").is_file():
        print(f"ccprofd: the unit template is missing ({SYSTEMD_DIR}/ccprofd.service)", file=sys.stderr)
        return EXIT_FAILURE
    exe = args.executable or shutil.which("ccprofd") or os.path.abspath(sys.argv[0])
    if not os.path.isabs(exe) or not os.access(exe, os.X_OK):
        print(f"ccprofd: --exec must be an absolute path of an executable, got {exe!r}", file=sys.stderr)
        return EXIT_USAGE
    config = args.config_dir / "ccprofd.toml"
    args.unit_dir.mkdir(parents=True, exist_ok=True)
    unit = args.unit_dir / "ccprofd.service"
    tmp = unit.with_suffix(".service.tmp")
    text = unit_text(exe, str(config))
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, unit)
    print(f"installed {unit} (ExecStart={exe})")
    args.config_dir.mkdir(parents=True, exist_ok=True)
    if config.exists():
        print(f"kept the existing {config}")
    else:
        shutil.copyfile(SYSTEMD_DIR / "ccprofd.toml", config)
        config.chmod(0o644)
        print(f"installed the example configuration {config} (no targets yet: edit it)")
    if not args.no_group:
        try:
            grp.getgrnam(SOCKET_GROUP)
            print(f"group {SOCKET_GROUP} exists")
        except KeyError:
            subprocess.run(["groupadd", "--system", SOCKET_GROUP], check=True)
            print(f"created the system group {SOCKET_GROUP} (members may use ccprofctl)")
    client = client_path(exe)
    problem = access_problem(client) if client else None
    if client and problem:
        print(f"ccprofd: warning: members of '{SOCKET_GROUP}' cannot run {client}: {problem}; install the "
              "client where they can (see the README, \"ccprofctl for the ccprofd group\")", file=sys.stderr)
    from ccprofd.cli.unitpaths import sandbox_warnings

    for warning in sandbox_warnings(text, exe, config):
        print(f"ccprofd: warning: {warning}", file=sys.stderr)
    if not args.no_reload and os.path.isdir("/run/systemd/system"):
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        print("systemctl daemon-reload done; start with: systemctl enable --now ccprofd")
    else:
        print("systemd is not running here: start it later with systemctl enable --now ccprofd")
    return EXIT_OK
