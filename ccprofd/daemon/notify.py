"""systemd's notify protocol (sd_notify(3)) without libsystemd: datagrams to ``$NOTIFY_SOCKET``.

``READY=1`` once every target is attached, ``WATCHDOG=1`` keep-alives at half of
``$WATCHDOG_USEC`` from the main loop (so a stuck loop stops them and systemd restarts the daemon),
``RELOADING=1``/``READY=1`` around a reload and ``STOPPING=1`` at shutdown.  Without
``$NOTIFY_SOCKET`` every call is a no-op, so the daemon runs the same outside systemd.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        self.watchdog_usec = 0
        wd = env.get("WATCHDOG_USEC", "")
        wd_pid = env.get("WATCHDOG_PID", "")
        if wd.isdigit() and int(wd) > 0 and (not wd_pid or wd_pid == str(os.getpid())):
            self.watchdog_usec = int(wd)
        self._last_ping = 0.0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between keep-alives (half the watchdog timeout), or None without a watchdog."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False when there is no socket or it failed."""
        if self.address is None:
            return False
        target = self.address
        if target.startswith("@"):
            target = "\0" + target[1:]  # abstract namespace
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(assignments).encode(), target)
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", f"MAINPID={os.getpid()}", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog_due(self, now: float | None = None) -> bool:
        interval = self.watchdog_interval
        if interval is None:
            return False
        now = time.monotonic() if now is None else now
        return now - self._last_ping >= interval

    def watchdog(self, now: float | None = None) -> bool:
        self._last_ping = time.monotonic() if now is None else now
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
