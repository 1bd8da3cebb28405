"""A free loopback TCP port for a server a test or bench/services.py starts (bench/services.py
imports it with tests/ on ``sys.path``, as it does nginx_conf).  The port is free when this
returns; a server started right after binds it (another process could take it in between, which
on a test machine does not happen in practice)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port of 127.0.0.1 no socket is bound to now (the kernel's choice for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
