"""What the unit's sandbox hides from the daemon: ``install-service`` warns about the paths it
installs or that the configuration names which ``PrivateTmp=``/``ProtectHome=`` hide (the unit
then fails with status 203/EXEC, or a target waits forever for a path it cannot see), that
``ProtectSystem=strict``/``ProtectHome=read-only`` make read-only while the daemon must write
them, and listen addresses ``IPAddressDeny=``/``IPAddressAllow=`` drop.

The directives are read from the unit text being installed (systemd's spelling: yes/true/1/on),
so a changed unit changes the warnings.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

_TRUE = ("1", "yes", "true", "on")
TMP_DIRS = ("/tmp", "/var/tmp")
HOME_DIRS = ("/home", "/root", "/run/user")


def service_settings(unit_text: str) -> dict[str, str]:
    """``[Service]`` key -> value (the last assignment wins, as in systemd for these keys)."""
    out: dict[str, str] = {}
    section = ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _under(path: str, prefixes: Iterable[str]) -> str | None:
    for p in prefixes:
        if path == p or path.startswith(p.rstrip("/") + "/"):
            return p
    return None


def _hidden(s: Mapping[str, str]) -> list[tuple[str, str]]:
    """(prefix, directive) of the directories the unit replaces by empty ones."""
    out = []
    if s.get("PrivateTmp", "").lower() in _TRUE:
        out += [(p, "PrivateTmp=yes") for p in TMP_DIRS]
    home = s.get("ProtectHome", "").lower()
    if home in (*_TRUE, "tmpfs"):
        out += [(p, f"ProtectHome={s['ProtectHome']}") for p in HOME_DIRS]
    return out


def _writable(s: Mapping[str, str]) -> tuple[list[str], str] | None:
    """The directories the daemon may write under ``ProtectSystem=strict`` (None: not strict)."""
    if s.get("ProtectSystem", "").lower() != "strict":
        return None
    dirs = []
    for key, base in (("StateDirectory", "/var/lib"), ("RuntimeDirectory", "/run"),
                      ("CacheDirectory", "/var/cache"), ("LogsDirectory", "/var/log")):
        dirs += [f"{base}/{d}" for d in s.get(key, "").split()]
    dirs += [p.lstrip("-") for p in s.get("ReadWritePaths", "").split()]
    if s.get("PrivateTmp", "").lower() in _TRUE:
        dirs += list(TMP_DIRS)  # private, but writable
    return dirs, "ProtectSystem=strict"


def executable_chain(path: str) -> Iterator[str]:
    """``path``, where its symlinks lead, and the same for a script's ``#!`` interpreter: every
    file the kernel opens to start it."""
    seen: set[str] = set()
    todo = [path]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        yield p
        real = os.path.realpath(p)
        if real != p:
            todo.append(real)
            continue
        try:
            with open(real, "rb") as fh:
                first = fh.readline(4096)
        except OSError:
            continue
        if first.startswith(b"#!"):
            words = first[2:].decode(errors="replace").split()
            if words and os.path.isabs(words[0]):
                todo.append(words[0])


def _config_paths(config: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """From an existing configuration: paths read (what, path), paths written (what, path), and
    TCP hosts listened on.  A configuration that does not parse gives nothing (``ccprofd run
    --check`` reports it)."""
    try:
        data: dict[str, Any] = tomllib.loads(config.read_text())
    except (OSError, ValueError):
        return [], [], []
    daemon = data.get("daemon") if isinstance(data.get("daemon"), dict) else {}
    assert isinstance(daemon, dict)
    read: list[tuple[str, str]] = []
    written: list[tuple[str, str]] = [("state_dir", str(daemon.get("state_dir", "/var/lib/ccprofd")))]
    hosts: list[str] = []
    grpc = str(daemon.get("grpc_listen", "unix:///run/ccprofd/ccprofd.sock"))
    if grpc.startswith("unix://"):
        written.append(("grpc_listen socket", grpc[len("unix://"):]))
    elif grpc.startswith("tcp://"):
        hosts.append(grpc[len("tcp://"):].rpartition(":")[0])
    metrics = str(daemon.get("metrics_listen", "127.0.0.1:9464"))
    if metrics:
        hosts.append(metrics.rpartition(":")[0])
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        if isinstance(daemon.get(key), str):
            read.append((key, daemon[key]))
    targets = data.get("target") if isinstance(data.get("target"), list) else []
    assert isinstance(targets, list)
    for i, t in enumerate(targets):
        if isinstance(t, dict) and isinstance(t.get("path"), str):
            read.append((f"target[{i}] path", t["path"]))
    return read, written, hosts


def _loopback_only(s: Mapping[str, str]) -> bool:
    return s.get("IPAddressDeny", "").split() == ["any"] and \
        set(s.get("IPAddressAllow", "").split()) <= {"localhost", "127.0.0.0/8", "::1/128"}


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or "" (every interface): not provably loopback


def sandbox_warnings(unit_text: str, executable: str, config: Path) -> list[str]:
    """One line per path the installed unit would hide or make read-only, and per listen
    address it would drop."""
    s = service_settings(unit_text)
    hidden = _hidden(s)
    out = []
    for p in executable_chain(executable):
        prefix = _under(p, [h for h, _ in hidden])
        if prefix:
            why = dict(hidden)[prefix]
            out.append(f"ExecStart needs {p}, which {why} hides from the service (it would fail with "
                       f"status 203/EXEC): install ccprofd outside {prefix}")
    read, written, hosts = _config_paths(config)
    for what, p in [("configuration", str(config)), *read, *written]:
        prefix = _under(p, [h for h, _ in hidden])
        if prefix:
            out.append(f"{what} {p} is hidden by {dict(hidden)[prefix]} in the service: move it out of "
                       f"{prefix}")
    writable = _writable(s)
    for what, p in written:
        if _under(p, [h for h, _ in hidden]):
            continue
        if writable is not None and not _under(p, writable[0]):
            out.append(f"{what} {p} is read-only under {writable[1]}: use a path below "
                       f"{', '.join(writable[0][:2])} or add ReadWritePaths={p} in a drop-in")
        elif s.get("ProtectHome", "").lower() == "read-only" and _under(p, HOME_DIRS):
            out.append(f"{what} {p} is read-only under ProtectHome=read-only")
    if _loopback_only(s):
        for host in hosts:
            if not _is_loopback(host):
                out.append(f"listening on {host or 'every interface'}: the unit's IPAddressDeny=any "
                           "drops every peer but loopback; allow the clients' addresses with "
                           "IPAddressAllow= in a drop-in")
    return out
