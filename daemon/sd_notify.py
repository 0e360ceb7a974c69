"""Telling systemd how the daemon is doing: a small sd_notify(3) client.

Under ``Type=notify`` systemd passes the address of its notification socket in
``NOTIFY_SOCKET``: a file system path, or a name in Linux's abstract namespace written
with a leading ``@``. Each notification is one ``AF_UNIX``/``SOCK_DGRAM`` datagram of
newline-separated ``KEY=VALUE`` assignments, for example ``READY=1\\nSTATUS=serving``;
the kernel attaches our credentials, which is how systemd checks ``NotifyAccess=main``.

When ``WatchdogSec=`` is set systemd also passes ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``), and expects ``WATCHDOG=1`` more often than that; sd_notify(3)
recommends every half of it, which is :attr:`Notifier.watchdog_interval_s`.

Those three variables are read in :meth:`Notifier.from_env` — the one place besides
:mod:`hicache.config` where hicache reads the environment, since they describe the
notifier's own connection to its supervisor rather than configuration. Without
``NOTIFY_SOCKET`` (not started by systemd) it returns a :class:`NullNotifier`.

Notifications are best effort: a failure to send is logged and the daemon carries on,
and sending never blocks the event loop.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from hicache.errors import InvalidArgument

logger = logging.getLogger(__name__)


class Notifier:
    """Sends notifications to the service manager's socket at ``address`` (a path, or
    ``@name`` for an abstract socket). Every method sends one datagram."""

    def __init__(self, address: str, *, watchdog_interval_s: float | None = None) -> None:
        if not address.startswith(("/", "@")):
            raise InvalidArgument(f"notify socket must be a path or @name, got {address!r}")
        self.address = address
        self.watchdog_interval_s = watchdog_interval_s
        # The abstract namespace is spelt with a leading NUL byte in the socket address.
        self._sockaddr = b"\0" + os.fsencode(address[1:]) if address.startswith("@") else os.fsencode(address)
        self._failing = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """The notifier systemd asked for through ``environ`` (default ``os.environ``):
        a :class:`Notifier` when ``NOTIFY_SOCKET`` is set, else a :class:`NullNotifier`."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if not address:
            return NullNotifier()
        if not address.startswith(("/", "@")):
            # e.g. "vsock:CID:PORT" (systemd >= 253 in virtual machines)
            logger.warning("unsupported NOTIFY_SOCKET %r; not notifying systemd", address)
            return NullNotifier()
        return cls(address, watchdog_interval_s=_watchdog_interval_s(env))

    def ready(self, status: str | None = None) -> None:
        """Start-up is complete (systemd then starts the units ordered after us)."""
        self._send("READY=1", status)

    def status(self, text: str) -> None:
        """A one-line description of the state, shown by ``systemctl status``."""
        self._send(None, text)

    def stopping(self, status: str | None = None) -> None:
        """Shutdown has begun (the drain)."""
        self._send("STOPPING=1", status)

    def watchdog(self) -> None:
        """Keep-alive ping; due every :attr:`watchdog_interval_s`."""
        self._send("WATCHDOG=1", None)

    def extend_timeout(self, timeout_s: float) -> None:
        """Ask for ``timeout_s`` more before the current start-up or stop times out (a
        long tree rebuild, a long drain); repeat before it runs out."""
        self._send(f"EXTEND_TIMEOUT_USEC={max(0, round(timeout_s * 1_000_000))}", None)

    def _send(self, assignment: str | None, status: str | None) -> None:
        lines = [] if assignment is None else [assignment]
        if status is not None:
            # A newline would end the assignment and start another one.
            lines.append("STATUS=" + " ".join(status.splitlines()))
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self._sockaddr)
        except OSError as exc:
            # A dead supervisor socket must not take the daemon down. Warn once per run
            # of failures: the watchdog would otherwise repeat it every few seconds.
            log = logger.debug if self._failing else logger.warning
            log("cannot notify systemd at %s: %s", self.address, exc)
            self._failing = True
        else:
            self._failing = False


class NullNotifier(Notifier):
    """The notifier when systemd is not watching: every method does nothing."""

    def __init__(self) -> None:
        self.address = ""
        self.watchdog_interval_s = None

    def _send(self, assignment: str | None, status: str | None) -> None:
        pass


def _watchdog_interval_s(env: Mapping[str, str]) -> float | None:
    """Half of ``WATCHDOG_USEC`` when the watchdog is meant for this process (sd_notify(3):
    ``WATCHDOG_PID`` unset or our pid), else None."""
    usec = env.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID", "")
    try:
        if pid and int(pid) != os.getpid():
            return None  # inherited from a parent that systemd watches
        value = int(usec)
    except ValueError:
        logger.warning("ignoring bad WATCHDOG_USEC=%r / WATCHDOG_PID=%r", usec, pid)
        return None
    return value / 2 / 1_000_000 if value > 0 else None
