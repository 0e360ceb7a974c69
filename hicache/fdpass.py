"""Handing shared-memory descriptors between engines and the daemon (SCM_RIGHTS).

ZeroMQ carries bytes only, so the daemon also listens on a Unix ``SOCK_SEQPACKET``
socket next to its own, ``<socket>.fds`` (same directory, same mode). A descriptor
travels with a random 16-byte token; the ZeroMQ message that uses it names the token::

    engine                      <socket>.fds (daemon thread)          daemon loop
    offer(fd) ─── "P"+token+fd ──> kept under token (uid, pid) ──> take(token) at register
    fetch(token) <── "K" + fd ──── kept under token  <──────────── publish(ring fd, uid)

Every exchange is one datagram each way on a fresh connection. ``"P"`` offers one
descriptor (the daemon answers ``"K"`` or ``"E"`` + a reason); ``"G"``
fetches the descriptor the daemon published under a token (answered ``"K"`` with it,
or ``"E"``). The kernel tells the daemon who sent an offer (``SO_PEERCRED``), which is
what a registration checks against: an offer is usable once, only by a registration of
the same user, and expires after :data:`OFFER_TTL_S`; each user may keep at most
:data:`MAX_OFFERS_PER_UID` offers waiting. A descriptor the daemon publishes (a
session's counter ring) waits for its fetch as long, or until the daemon withdraws it
(its session ended); at most :data:`MAX_PUBLISHED_PER_UID` of one user's and
:data:`MAX_PUBLISHED` in all wait at once — past that, ``publish`` refuses
(``RESOURCE_EXHAUSTED``) rather than let unfetched descriptors run the daemon out of
them. A descriptor handed to a process is that process's to keep: handing one over
grants access, whatever the file modes say.

Out of descriptors (``EMFILE``), ``accept`` fails while the connection stays queued,
so the listening socket stays readable: the thread stops listening for
:data:`ACCEPT_PAUSE_S` rather than spin on it (and logs that at most every
:data:`_LOG_EVERY_S`).
"""

from __future__ import annotations

import array
import errno
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hicache.errors import InvalidArgument, ResourceExhausted, Unavailable
from hicache.shm import close_all

logger = logging.getLogger(__name__)

TOKEN_BYTES = 16
OFFER_TTL_S = 60.0
MAX_OFFERS_PER_UID = 64
MAX_OFFERS = 1024
MAX_PUBLISHED_PER_UID = 64
MAX_PUBLISHED = 1024
ACCEPT_PAUSE_S = 0.5  # out of descriptors: how long the listener rests before accepting again
_LOG_EVERY_S = 10.0
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_CONNECTION_S = 2.0  # a connection that has not sent its request by then is closed
_MAX_CONNECTIONS = 64
_REQUEST_BYTES = 1 + TOKEN_BYTES
_MAX_FDS_READ = 4  # room to see (and refuse) a request with more descriptors than one
_INT = struct.calcsize("i")


def socket_path_for(zmq_socket: str | os.PathLike) -> Path:
    """The descriptor socket of the daemon whose ipc socket is ``zmq_socket``."""
    path = Path(zmq_socket)
    return path.with_name(path.name + ".fds")


@dataclass(frozen=True)
class Offer:
    """A descriptor an engine offered, and who offered it."""

    fd: int
    uid: int
    gid: int
    pid: int


def _connect(path: str | os.PathLike, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    try:
        sock.connect(os.fspath(path))
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot reach the daemon's descriptor socket {path}: {exc.strerror or exc}") from None
    return sock


def _answer(data: bytes) -> None:
    if data[:1] == b"K":
        return
    if data[:1] == b"E":
        raise InvalidArgument(data[1:].decode("utf-8", "replace"))
    raise Unavailable("no answer on the descriptor socket")


def offer(path: str | os.PathLike, fd: int, *, timeout_s: float = 5.0) -> bytes:
    """Hand ``fd`` to the daemon (a copy: ``fd`` stays yours); returns the token a
    registration names it by."""
    token = secrets.token_bytes(TOKEN_BYTES)
    with _connect(path, timeout_s) as sock:
        try:
            socket.send_fds(sock, [b"P" + token], [fd])
            _answer(sock.recv(256))
        except OSError as exc:
            raise Unavailable(f"descriptor socket {path}: {exc}") from None
    return token


def fetch(path: str | os.PathLike, token: bytes, *, timeout_s: float = 5.0) -> int:
    """The descriptor the daemon published under ``token`` (yours to close)."""
    with _connect(path, timeout_s) as sock:
        try:
            sock.send(b"G" + bytes(token))
            data, fds, _, _ = socket.recv_fds(sock, 256, 1)
        except OSError as exc:
            raise Unavailable(f"descriptor socket {path}: {exc}") from None
    if data[:1] == b"K" and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    _answer(data or b"")
    raise Unavailable("the daemon answered without a descriptor")


class FdExchange:
    """The daemon's side: a thread that keeps offered descriptors until a registration
    takes them, and hands out the ones the daemon published. ``take``, ``publish`` and
    ``close`` are for the daemon's loop; the private methods run on the thread."""

    def __init__(self, path: str | os.PathLike, *, mode: int = 0o660,
                 clock=time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._offers: dict[bytes, tuple[Offer, float]] = {}
        self._published: dict[bytes, tuple[int, int | None, float]] = {}  # token -> fd, uid allowed, expiry
        self._stop = False
        self._paused_until: float | None = None  # out of descriptors: the listener rests until then
        self._accept_failures = 0
        self._next_accept_log = 0.0
        if self.path.is_socket():
            self.path.unlink()  # a stale one (the caller holds the daemon's lock)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(os.fspath(self.path))
        os.chmod(self.path, mode)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="hicache-fds", daemon=True)
        self._thread.start()

    def take(self, token: bytes) -> Offer | None:
        """The offer under ``token``, removed (the caller owns its descriptors now)."""
        with self._lock:
            entry = self._offers.pop(bytes(token), None)
        if entry is None:
            return None
        offer_, expiry = entry
        if expiry <= self._clock():  # (the thread would have dropped it on its next turn)
            close_all((offer_.fd,))
            return None
        return offer_

    def publish(self, fd: int, *, uid: int | None = None) -> bytes:
        """Keep ``fd`` (taken over) for one fetch by ``uid`` (anyone when ``None``).
        Over :data:`MAX_PUBLISHED_PER_UID` or :data:`MAX_PUBLISHED` waiting, raises
        :class:`ResourceExhausted` (``fd`` closed)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        self._expire(self._clock())
        with self._lock:
            waiting = self._published.values()
            if len(waiting) >= MAX_PUBLISHED or sum(entry[1] == uid for entry in waiting) >= MAX_PUBLISHED_PER_UID:
                close_all((fd,))
                raise ResourceExhausted("too many descriptors published and not yet fetched (counter rings of "
                                        "registrations whose engines did not fetch them)")
            self._published[token] = (fd, uid, self._clock() + OFFER_TTL_S)
        return token

    def withdraw(self, token: bytes) -> None:
        """Close the descriptor published under ``token`` if it was not fetched (its
        session ended)."""
        with self._lock:
            entry = self._published.pop(bytes(token), None)
        if entry is not None:
            close_all((entry[0],))

    @property
    def num_published(self) -> int:
        with self._lock:
            return len(self._published)

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with self._lock:
            for offer_, _ in self._offers.values():
                close_all((offer_.fd,))
            for fd, _, _ in self._published.values():
                close_all((fd,))
            self._offers.clear()
            self._published.clear()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        deadlines: dict[socket.socket, float] = {}
        try:
            while not self._stop:
                now = self._clock()
                if self._paused_until is not None and now >= self._paused_until:
                    self._paused_until = None
                    selector.register(self._listener, selectors.EVENT_READ, None)
                resume = [] if self._paused_until is None else [self._paused_until - now]
                timeout = min([d - now for d in deadlines.values()] + resume + [1.0])
                for key, _ in selector.select(max(0.0, timeout)):
                    if key.fileobj is self._listener:
                        if not self._accept(selector, deadlines):
                            selector.unregister(self._listener)
                            self._paused_until = self._clock() + ACCEPT_PAUSE_S
                    elif key.fileobj in deadlines:
                        conn = key.fileobj
                        selector.unregister(conn)
                        del deadlines[conn]
                        self._serve(conn)
                now = self._clock()
                for conn in [c for c, d in deadlines.items() if d <= now]:
                    selector.unregister(conn)
                    del deadlines[conn]
                    conn.close()
                self._expire(now)
        except Exception:  # a bug: descriptors stop flowing, the daemon keeps serving
            logger.exception("descriptor exchange stopped")
        finally:
            for conn in deadlines:
                conn.close()
            selector.close()

    def _accept(self, selector: selectors.BaseSelector, deadlines: dict) -> bool:
        """Accept what is queued; False when out of descriptors (the connection stays
        queued: the caller stops listening for a moment)."""
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:
                    logger.warning("descriptor socket: accept failed: %s", exc)
                    return True
                self._accept_failures += 1
                now = self._clock()
                if now >= self._next_accept_log:
                    logger.warning("descriptor socket: out of descriptors (%s), not accepting for %.1f s "
                                   "(%d time(s) since the last warning)", exc.strerror, ACCEPT_PAUSE_S,
                                   self._accept_failures)
                    self._accept_failures = 0
                    self._next_accept_log = now + _LOG_EVERY_S
                return False
            if len(deadlines) >= _MAX_CONNECTIONS:
                conn.close()
                continue
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ, None)
            deadlines[conn] = self._clock() + _CONNECTION_S

    def _serve(self, conn: socket.socket) -> None:
        received: list[int] = []
        try:
            data, received = self._receive(conn)
            ucred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 3 * _INT)
            pid, uid, gid = struct.unpack("iII", ucred)  # pid_t, uid_t, gid_t
            kind, token = data[:1], data[1:]
            if len(data) != _REQUEST_BYTES or kind not in (b"P", b"G"):
                raise InvalidArgument("a request is 'P' or 'G' and a 16-byte token")
            if kind == b"P":
                if len(received) != 1:
                    raise InvalidArgument("an offer carries exactly one descriptor")
                self._keep(token, Offer(received[0], uid, gid, pid))
                received = []
                conn.send(b"K")
                return
            fd = self._hand_out(token, uid)
            try:
                socket.send_fds(conn, [b"K"], [fd])
            finally:
                os.close(fd)
        except (InvalidArgument, ResourceExhausted) as exc:
            self._refuse(conn, exc.message)
        except OSError:
            pass  # the peer went away
        finally:
            close_all(received)
            conn.close()

    @staticmethod
    def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
        fds = array.array("i")
        data, ancillary, flags, _ = conn.recvmsg(_REQUEST_BYTES + 1, socket.CMSG_SPACE(_MAX_FDS_READ * _INT))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % _INT])
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            close_all(fds)
            raise InvalidArgument(f"one descriptor and {_REQUEST_BYTES} bytes in a request")
        return data, list(fds)

    def _keep(self, token: bytes, offer_: Offer) -> None:
        self._expire(self._clock())
        with self._lock:
            if token in self._offers:
                raise InvalidArgument("this token is taken")
            if len(self._offers) >= MAX_OFFERS or \
                    sum(o.uid == offer_.uid for o, _ in self._offers.values()) >= MAX_OFFERS_PER_UID:
                raise ResourceExhausted("too many descriptors offered and not yet registered")
            self._offers[token] = (offer_, self._clock() + OFFER_TTL_S)

    def _hand_out(self, token: bytes, uid: int) -> int:
        self._expire(self._clock())
        with self._lock:
            entry = self._published.get(token)
            if entry is None or (entry[1] is not None and entry[1] != uid):
                raise InvalidArgument("nothing published under this token for this user")
            del self._published[token]
        return entry[0]

    @staticmethod
    def _refuse(conn: socket.socket, message: str) -> None:
        try:
            conn.send(b"E" + message.encode()[:200])
        except OSError:
            pass

    def _expire(self, now: float) -> None:
        with self._lock:
            for token in [t for t, (_, expiry) in self._offers.items() if expiry <= now]:
                offer_, _ = self._offers.pop(token)
                close_all((offer_.fd,))
            for token in [t for t, (_, _, expiry) in self._published.items() if expiry <= now]:
                close_all((self._published.pop(token)[0],))
