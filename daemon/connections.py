"""Shedding connections before libzmq runs out of descriptors.

libzmq (4.3.5, what pyzmq bundles) aborts the whole process when its ipc listener's
``accept`` fails for want of a descriptor (``EMFILE``), so anyone who may connect could
kill the daemon by opening connections until it has none left. ZeroMQ cannot be told
to stop accepting, and unbinding an endpoint would drop every engine connected through
it. So the daemon watches its connections being accepted (a socket monitor, on a
thread of its own) and drops each new one whose descriptor is near the limit: it
``shutdown()``\\ s the connection — never ``close()``, the descriptor stays libzmq's —
and libzmq, seeing the peer gone, closes it itself. Descriptors are handed out lowest
first, so a new connection's descriptor number is at least the count of descriptors
open below it: shedding from ``limit - reserve`` keeps ``reserve`` for the daemon's own
(segments, counter rings, the store) and for the connections in flight.

Connections made before the flood are served throughout; while the flood lasts no new
engine can connect (its client retries, degraded meanwhile), and once it is gone they
can. Shedding is logged (the first, then every 1,000th) and counted as
``hicache_auth_refused_total{reason="shed"}``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
import socket
import threading
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def reserve_for(limit: int) -> int:
    """Descriptors kept from new connections under a soft limit of ``limit``."""
    return max(512, limit // 8)


def _local_address(fd: int):
    """The local address of the socket ``fd`` (a listener's, for one it accepted);
    ``None`` for anything else, or a descriptor closed meanwhile. The descriptor is not
    this process's to close: it is wrapped and let go, never closed."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return sock.getsockname() or None
    except OSError:
        return None
    finally:
        sock.detach()


class ConnectionShedder:
    """Drops new connections of ``router`` whose descriptor is within the reserve of
    the descriptor limit (read at each connection: a limit raised or lowered while the
    daemon runs counts at once)."""

    def __init__(self, router: zmq.Socket, on_shed: Callable[[], None] = lambda: None) -> None:
        # (MONITOR_STOPPED too: without it in the mask, disabling the monitor sends none)
        self._monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_LISTENING |
                                                  zmq.EVENT_MONITOR_STOPPED)
        self._stopping = threading.Event()
        self._listening: set = set()  # the local addresses of the router's listeners
        self._on_shed = on_shed
        self.shed = 0
        self._thread = threading.Thread(target=self._run, name="hicache-connections", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        monitor = self._monitor
        try:
            while True:
                try:
                    if not monitor.poll(100):
                        if self._stopping.is_set():
                            return
                        continue
                    event = parse_monitor_message(monitor.recv_multipart())
                except zmq.ZMQError:  # the context is going
                    return
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event["event"] == zmq.EVENT_LISTENING:
                    address = _local_address(int(event["value"]))
                    if address:
                        self._listening.add(address)
                elif event["event"] == zmq.EVENT_ACCEPTED:
                    self._accepted(int(event["value"]))
        finally:
            monitor.close(linger=0)

    def _accepted(self, fd: int) -> None:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit == resource.RLIM_INFINITY or fd < limit - reserve_for(limit):
            return
        # The event may be late: the connection closed meanwhile and its number reused,
        # maybe by one of libzmq's own socket pairs. Only a connection accepted by one of
        # the router's listeners is shut down (not closed: the descriptor is libzmq's, and
        # it closes it on the EOF).
        if _local_address(fd) not in self._listening or _libc.shutdown(fd, socket.SHUT_RDWR) != 0:
            return
        self.shed += 1
        self._on_shed()
        if self.shed == 1 or self.shed % 1000 == 0:
            logger.warning("descriptor %d of at most %d: shedding new connections (%d so far); engines "
                           "connected already are served", fd, limit, self.shed)

    def close(self, router: zmq.Socket, timeout_s: float = 5.0) -> None:
        """Stop watching (on the thread that owns ``router``), before ``router`` and its
        context are closed: the thread's monitor socket must be closed by the thread."""
        try:
            router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._stopping.set()  # (and should the last event not come, the next poll ends it)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the connection monitor did not stop within %.0f s", timeout_s)
