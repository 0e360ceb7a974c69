"""The daemon's event loop: one ROUTER socket, one owner thread.

::

    engines (DEALER/REQ) ──ipc:// / tcp://──> ROUTER ─┐
                                                       ├─ recv ─> decode -> Daemon.handle -> reply
    transfer / storage threads ──inproc:// wake ───────┘          (or a future, answered when done)

The loop blocks in one ``recv`` on the ROUTER (a poll on several descriptors costs ~15 us
a round trip here): worker threads that post a completion wake it with an empty message
from their own inproc DEALER, so it sleeps until a request or a completion arrives (or a
lease or timer is due). Requests are decoded and validated, handled, and answered on the same thread;
a request whose answer depends on a transfer (a load from disk, a match that waits for
a prefetch, a flush) is answered when its future completes. Oversize and undecodable
messages get an ``Error`` reply; nothing they carry reaches the daemon's state.

What one message can cost is bounded. A message is its body (the last frame) behind an
envelope the reply echoes: the routing id, and for a REQ socket or a proxy's hops a few
frames more — at most :data:`_MAX_ENVELOPE_FRAMES` frames of at most
:data:`_MAX_ENVELOPE_FRAME_BYTES` each (a ZeroMQ routing id's longest). A message whose
envelope is longer or larger is read to its end and dropped unread (frame by frame, its
bytes never copied: libzmq has no way to skip the rest of a message), counted (op
``envelope``, status ``DROPPED``), logged at most every :data:`_LOG_EVERY_S`, and answered
with an ``Error`` behind the routing id alone. Reading millions of frames still takes
seconds of the loop (~2 us a frame): that silence is the daemon's, so every session's
lease is extended by it and the watchdog is fed meanwhile. A body over
``max_message_bytes`` is answered without being copied. Replies wait in a connection's
queue up to :data:`_HWM` messages (``SNDHWM``): past that, a client that does not read
its replies loses the newer ones (a ROUTER drops them) instead of the daemon buffering
them without end; requests beyond ``RCVHWM`` (the same) wait in the client.

After a reply the loop goes straight back to ``recv``. Its own work — the answered
requests' bookkeeping (counts, latency, hit / miss accounting), transfer completions,
timers, lease expiry, the watchdog — is a *catch-up* that runs when the socket is idle
for a receive timeout, when a worker wakes it, and at least every ``_CATCH_UP_S`` while
requests come back to back. Run right after each send, that work (~20 us on a cold
cache) held the core the reply's way out needs — ZeroMQ's I/O thread, then the client's
— and added most of itself to every round trip (bench_rpc). The receive timeout stays as
the last catch-up set it: a short one costs every wake-up (a 1 ms timeout made a ROUTER
echo ~9 % slower). ``stats`` settles the bookkeeping first, so its counts are exact.

The loop survives whatever a peer sends: a message that cannot be decoded gets an error
reply, and anything a message makes go wrong in the handling (a bug included) is logged
and counted, and the loop goes on. Sessions are bound to the connection that said
hello (its routing id). Connections are admitted by the ZAP handler
(:mod:`hicache.daemon.auth`: CURVE keys on ``tcp://``, Unix users on ``ipc://``), which
names each in its user id; every message is read with that metadata (~1 us) and its
sender resolved against the current identities — a routing id proves nothing (a client
may pick one), and a reload may have withdrawn what admitted the connection: such a
message is dropped and counted. SIGHUP (or a ``reload`` request) re-reads ``[auth]``.

Before anything else, the server takes the state's lock
(:mod:`hicache.daemon.statelock`): a second daemon on the same socket or store exits
without touching either. Next to the ZeroMQ socket it serves the descriptor socket that
engines hand their CPU pools over on (:mod:`hicache.fdpass`).

SIGTERM (see :mod:`hicache.daemon.cli`) calls :meth:`Server.stop`: the loop tells
systemd it is stopping, closes the socket (no new requests), drains (host pages to disk
per policy, in-flight transfers finished), closes the store and returns — all within
``[server].drain_timeout_s`` (closing gets a few seconds more): what did not finish by
then (a storage that hangs) is logged, with the pages it loses, and left to the
process's exit (:attr:`Server.unfinished`).
"""

from __future__ import annotations

import errno
import gc
import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import zmq

from hicache.auth import read_secret
from hicache.config import AuthConfig, DaemonConfig
from hicache.daemon.auth import ZAP_DOMAIN, IdentityTable, ZapHandler, parse_user_id
from hicache import protocol as p, transport
from hicache.daemon.collector import Collector
from hicache.daemon.connections import ConnectionShedder
from hicache.daemon.sd_notify import Notifier
from hicache.daemon.service import LOCAL, Daemon, PeerCreds
from hicache.daemon.statelock import StateLock
from hicache.errors import InvalidArgument
from hicache.fdpass import FdExchange, socket_path_for
from hicache.jobs import Completions

logger = logging.getLogger(__name__)

_CATCH_UP_S = 0.002  # with requests back to back, the loop catches up at least this often
_MAX_WAIT_S = 0.25
_WAKE_ID = b"\0hicache-wake-"
_MAX_PEERS = 4096  # connections whose peer is remembered; past that, relearned as they speak
# Who a connection the server does not know (any more) is: nobody — never the local
# identity that requests handled without a socket get.
_NO_PEER = PeerCreds(None, None, None, "", mechanism="NONE")
# Plain ints: pyzmq converts its enum members on every call.
_RCVMORE = int(zmq.RCVMORE)
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_SEND_MORE = _SNDMORE | _NOBLOCK
# An envelope: the routing id, then a REQ socket's empty delimiter or a proxy's hops.
_MAX_ENVELOPE_FRAMES = 8
_MAX_ENVELOPE_FRAME_BYTES = 255  # a ZeroMQ routing id is 1-255 bytes
_DISCARD_SLICE = 1 << 16  # frames of a dropped message read between two looks at the watchdog
_LOG_EVERY_S = 10.0  # dropped messages are logged at most this often
_HWM = 1000  # messages queued per connection, each way (libzmq's default)
# systemd is asked for [server].drain_timeout_s plus this at SIGTERM: closing after the
# drain (Daemon.close: a few seconds at most) and the process's exit.
_STOP_MARGIN_S = 30.0


class CannotListen(RuntimeError):
    """An address the configuration names cannot be bound: in use by another process
    (two daemons on one host with the default metrics port), or not this host's."""


def _listen(what: str, bind):
    """``bind()``, its failure told as :class:`CannotListen` naming ``what``."""
    try:
        return bind()
    except (OSError, zmq.ZMQError) as exc:
        raise CannotListen(f"cannot listen on {what}: {exc}") from None


def _is_wake(frames: list[bytes]) -> bool:
    """A worker's wake-up: an empty message from an inproc DEALER of ours."""
    return len(frames) == 2 and not frames[1] and frames[0].startswith(_WAKE_ID)


class Server:
    def __init__(self, config: DaemonConfig, *, notifier: Notifier | None = None,
                 context: zmq.Context | None = None, daemon: Daemon | None = None,
                 config_path: str | os.PathLike | None = None) -> None:
        """``config_path``: the file ``config`` came from, re-read (its ``[auth]``) on
        SIGHUP or a ``reload`` request."""
        self.config = config
        # The daemon's CURVE key pair, read (and checked) before anything is opened.
        self._server_keys = read_secret(config.auth.secret_key_file) if config.auth.curve else None
        self._state_lock = StateLock.for_config(config)  # before the store is opened
        self._context = context or transport.new_context()
        self._own_context = context is None
        self._wake_endpoint = f"inproc://hicache-wake-{id(self)}"
        self._wake_sockets = threading.local()
        self._wakers: list[zmq.Socket] = []
        self._wakers_lock = threading.Lock()
        try:
            # Its KV events sockets bind in bind(), behind the ZAP handler.
            self.daemon = daemon or Daemon(config, completions=Completions(wakeup=self._wake), bind_events=False)
        except BaseException:
            self._state_lock.release()
            raise
        self.notifier = notifier or Notifier.from_env()
        self.daemon.keepalive = self._keepalive
        self._peers: dict[bytes, PeerCreds] = {}  # routing id -> who is at the other end
        self._users: dict[bytes, str] = {}  # routing id -> the ZAP user id its creds were learned from
        # (b"": a request handled in this process, not from a socket — a ROUTER never
        # gives a connection an empty routing id)
        self.daemon.peer_creds = lambda peer: self._peers.get(peer, _NO_PEER) if peer else LOCAL
        self.daemon.on_reload = self._relearn_peers
        if config_path is not None:
            self.daemon.reload_source = lambda: self._reread_auth(config_path)
        self._reload_requested = False
        self._zap: ZapHandler | None = None
        self._next_watchdog = 0.0
        self._router: zmq.Socket | None = None
        self._shedder: ConnectionShedder | None = None  # (watching the router's connections)
        self._ready: deque[tuple[list[bytes], p.Reply]] = deque()
        self._dropped_since_log = 0  # messages dropped (see _drop) since the last log line
        self._next_drop_log = 0.0
        self._stop = False
        # The pipe stop() and request_reload() nudge the loop through (see _nudge): a
        # nudge before the loop serves waits there. Each end -1 once closed.
        self._nudges, self._nudge_fd = os.pipe()
        os.set_blocking(self._nudge_fd, False)
        # Set by the stop when something did not finish by its deadline (a transfer stuck
        # in a storage that hangs): its threads are left running, for the process's exit.
        self.unfinished = False
        self.endpoints: list[str] = []
        self._http = None
        self.metrics_url = ""
        self.collector = Collector()

    def _wake(self) -> None:
        """From any thread: make the loop's blocking recv return."""
        sock = getattr(self._wake_sockets, "socket", None)
        if sock is None:
            try:
                sock = self._context.socket(zmq.DEALER)
            except zmq.ZMQError:  # out of descriptors: the loop's receive timeout wakes it soon
                return
            sock.setsockopt(zmq.ROUTING_ID, _WAKE_ID + str(threading.get_ident()).encode())
            sock.setsockopt(zmq.SNDHWM, 1)  # one pending wake-up is enough
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._wake_endpoint)
            self._wake_sockets.socket = sock
            with self._wakers_lock:
                self._wakers.append(sock)
        try:
            sock.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a wake-up is already queued, or we are shutting down

    def _secure(self, sock: zmq.Socket, endpoint: str, domain: bytes | None = ZAP_DOMAIN) -> bool:
        """Set ``sock``'s security for binding ``endpoint`` (options apply to the
        endpoints bound after they are set): CURVE on ``tcp://`` (and ``ipc://`` with
        ``curve_ipc``) when the daemon has a key pair, and the ZAP domain that has the
        handler ask about plain connections too (``None``: none, nobody is asked). True
        when CURVE."""
        curve = self._server_keys is not None and (endpoint.startswith("tcp://") or self.config.auth.curve_ipc)
        sock.setsockopt(zmq.CURVE_SERVER, int(curve))
        if curve:
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._server_keys[1])
        if domain is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, domain)
        return curve

    def _secure_events(self, sock: zmq.Socket, endpoint: str, domain: bytes) -> None:
        """The KV events sockets: as the server's, in ``domain`` (the events' own ZAP
        domains: see :mod:`hicache.daemon.auth`) — but a plain ``tcp://`` endpoint
        (``[events].insecure_tcp``) asks nobody: whoever reaches it reads (and replays)
        the events, as its setting says. (Such a socket gets no ZAP domain at all:
        libzmq 4.3.5 refuses to set an empty one. An identity's own events socket is
        never one: its tcp:// needs CURVE.)"""
        plain_tcp = endpoint.startswith("tcp://") and self._server_keys is None
        self._secure(sock, endpoint, None if plain_tcp else domain)
        if plain_tcp:
            logger.warning("KV events on %s with NO AUTHENTICATION ([events].insecure_tcp): whoever reaches it "
                           "reads every tenant's token ids", endpoint)

    def bind(self) -> list[str]:
        """Listen on every endpoint the configuration names (and serve the metrics).
        Raises :class:`CannotListen` having let go of everything, the state's lock
        included: the daemon does not start half-listening."""
        try:
            return self._bind()
        except CannotListen:
            self._abandon()
            raise

    def _bind(self) -> list[str]:
        # The ZAP handler first: a CURVE handshake with no handler admits any key.
        self._zap = ZapHandler(self._context, lambda: self.daemon.identities, self.daemon.metrics.auth_refused)
        events = self.config.events
        _listen(f"the KV events endpoints ({events.endpoint or 'default'}, {events.replay_endpoint or 'default'})",
                lambda: self.daemon.bind_events(self._context, self._secure_events))
        router = self._router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        # Messages a little over the limit still get an error reply; far over, the peer
        # is disconnected by the transport before we buffer them.
        router.setsockopt(zmq.MAXMSGSIZE, 4 * self.config.server.max_message_bytes)
        # Per connection. A ROUTER drops a reply to a connection whose queue is full (no
        # ROUTER_MANDATORY): a client that never reads cannot make the daemon buffer
        # its replies without end. A full receive queue makes the client wait.
        router.setsockopt(zmq.RCVHWM, _HWM)
        router.setsockopt(zmq.SNDHWM, _HWM)
        socket_path = self.config.server.socket_path
        if socket_path.exists():
            socket_path.unlink()  # a stale socket from a daemon that died (we hold the state's lock)
        fd_path = socket_path_for(socket_path)
        self.daemon.fds = _listen(f"the descriptor socket {fd_path} (beside [server].socket)",
                                  lambda: FdExchange(fd_path, mode=self.config.server.socket_mode))
        router.bind(self._wake_endpoint)
        self._shedder = ConnectionShedder(router, lambda: self.daemon.metrics.auth_refused("shed"))
        for endpoint in self.config.server.endpoints:
            curve = self._secure(router, endpoint)
            _listen(endpoint, lambda: router.bind(endpoint))
            self.endpoints.append(router.getsockopt(zmq.LAST_ENDPOINT).decode())
            logger.info("listening on %s (%s)", self.endpoints[-1], "CURVE" if curve else
                        "Unix users" if endpoint.startswith("ipc://") else "NO AUTHENTICATION: insecure_tcp")
        os.chmod(socket_path, self.config.server.socket_mode)
        metrics = self.config.metrics
        if metrics.enabled and self.daemon.metrics.registry is not None:
            self._http = _listen(f"metrics address {metrics.address}:{metrics.port}",
                                 lambda: self.daemon.metrics.serve(metrics.address, metrics.port))
            self.metrics_url = f"http://{metrics.address}:{self._http.server_port}/metrics"
        return self.endpoints

    def _abandon(self) -> None:
        """Undo a bind that failed half-way: nothing was served, so nothing to drain."""
        self._close_router()
        self.daemon.close()
        self.config.server.socket_path.unlink(missing_ok=True)  # no socket for engines to find
        self.close()

    def stop(self) -> None:
        """Ask the loop to drain and return (safe from a signal handler)."""
        self._stop = True
        self._nudge()

    def _nudge(self) -> None:
        """Make the loop's blocking recv return, from a signal handler too. The handler
        runs on the loop's own thread between two bytecodes — maybe in the middle of a
        send on that thread's wake-up socket — so it only writes a byte to a pipe; a
        thread of ours reads it and wakes the loop (:meth:`_relay_nudges`). Before, a
        SIGTERM was seen once the recv timed out (pyzmq retries a recv a signal
        interrupted): up to ``_MAX_WAIT_S`` later."""
        fd = self._nudge_fd
        if fd >= 0:
            try:
                os.write(fd, b"\0")
            except OSError:  # full: a nudge is pending already
                pass

    def _relay_nudges(self, fd: int) -> None:
        try:
            while os.read(fd, 64):
                self._wake()
        finally:
            os.close(fd)

    def serve_forever(self) -> None:
        if self._router is None:
            self.bind()
        router = self._router
        self.collector.install()  # start-up's objects out of every later full collection
        self.daemon.specs.on_settled = gc.freeze  # (and each tier manager's, once it serves)
        self.notifier.ready(status=f"serving on {', '.join(self.endpoints)}")
        logger.info("serving on %s", ", ".join(self.endpoints))
        nudges, self._nudges = self._nudges, -1  # (the relay's to close)
        relay = threading.Thread(target=self._relay_nudges, args=(nudges,), name="hicache-nudges", daemon=True)
        relay.start()
        try:
            self._loop(router)
        finally:
            self._close_nudges()  # the relay reads the end, and returns
            relay.join()
        self._shutdown()

    def _close_nudges(self) -> None:
        for name in ("_nudge_fd", "_nudges"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)  # (first: a signal after this writes nothing)
                os.close(fd)

    def _loop(self, router: zmq.Socket) -> None:
        timeout_ms = -2
        behind = False  # replies sent since the last catch-up: bookkeeping owed
        catch_up_at = 0.0
        while not self._stop:
            if not behind:
                wanted = self._timeout_ms()
                if wanted != timeout_ms:
                    router.setsockopt(zmq.RCVTIMEO, wanted)
                    timeout_ms = wanted
            try:
                frames = self._recv(router, 0)
            except zmq.Again:
                frames = None
            except zmq.ZMQError as exc:  # EINTR from a signal: loop and look at _stop
                if exc.errno != errno.EINTR:
                    raise
                frames = None
            if self._reload_requested:
                self._reload_requested = False
                self._fenced(self._reload, router)
                if frames is not None and not _is_wake(frames) and frames[0] not in self._peers:
                    frames = None  # in hand from a connection the reload just refused
            if frames is not None and self._fenced(self._handle, router, frames):
                # Answered. Its bookkeeping waits for an idle moment: run right after the
                # send, it holds a core the reply's way out needs (see the module doc).
                if self._ready:
                    self._send_ready(router)  # a request that completed another's future
                if not behind:
                    behind = True
                    catch_up_at = time.monotonic() + _CATCH_UP_S
                    continue
                if time.monotonic() < catch_up_at:
                    continue
            # Idle, a wake-up, an answer still to come, or requests back to back for _CATCH_UP_S.
            self._fenced(self._catch_up, router)
            behind = False

    def _fenced(self, step, router: zmq.Socket, *args) -> bool:
        """Run one step of the loop; whatever it raises is logged and counted, and the
        loop goes on (the daemon fences each request's handling already: what gets here
        is a bug, which must not take every engine's cache down with it)."""
        try:
            return step(router, *args)
        except Exception:
            logger.exception("the loop dropped what it was doing (%s)", step.__name__)
            self.daemon.dropped()
            return False

    def _catch_up(self, router: zmq.Socket) -> None:
        """The loop's own work: the answered requests' bookkeeping, transfer completions
        and timers (and the replies they make ready), lease expiry, the watchdog."""
        self.daemon.settle()
        self.daemon.poll()
        self._send_ready(router)
        self._keepalive(0)
        self.collector.tick()

    def _feed_watchdog(self, interval_s: float) -> None:
        self.notifier.watchdog()
        self._next_watchdog = time.monotonic() + interval_s

    def _keepalive(self, done: int) -> None:
        """Feed the watchdog when due: every loop turn, and from long work on the loop
        thread (a rebuild at once, pinning a host pool) as it reports progress, so that
        systemd does not take it for a hung loop."""
        interval_s = self.notifier.watchdog_interval_s
        if interval_s is not None and time.monotonic() >= self._next_watchdog:
            self._feed_watchdog(interval_s)

    def _timeout_ms(self) -> int:
        """How long the next recv may block: until the next lease or timer is due,
        rounded up to a step of 50 ms (a lease ends a little late, but the receive
        timeout does not change — a system call — on every request). 0 only when
        something is due now: rounding down would make every wait shorter than a step
        a busy poll."""
        if self._ready:
            return 0
        wait = _MAX_WAIT_S
        deadline = self.daemon.next_deadline()
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - self.daemon.clock()))
        return math.ceil(wait * 20) * 50

    def _recv(self, router: zmq.Socket, flags: int) -> list | None:
        """One message's frames, or ``None`` for a message nobody admitted or one
        dropped (see the module docstring). A DEALER's request arrives as [identity,
        body]: two receives and one look at RCVMORE, where ``recv_multipart`` makes two
        of each plus its own Python frame — each call into pyzmq costs microseconds on a
        cold cache, ~17 us a round trip in all here (bench_rpc: a REP echo and a ROUTER
        echo read this way take the same time). A REQ envelope (or a proxy's) reads on
        frame by frame. The body is read as a ``Frame`` for its metadata: the ZAP user
        id, who sent it; it is copied out only when within ``max_message_bytes`` (an
        oversize body stays a ``Frame``, whose length is all that is read of it)."""
        identity = router.recv(flags)
        frame = router.recv(flags, copy=False)
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:  # no handshake: inproc, a worker's wake-up
            user = None
        if router.getsockopt(_RCVMORE):
            frames = self._recv_envelope(router, flags, identity, frame)
        else:
            frames = [identity, self._body(frame)]
        if user is None:
            return frames if type(frames) is list and _is_wake(frames) else None
        if self._users.get(identity) != user and not self._learn_peer(identity, user):
            return None
        if type(frames) is not list:  # dropped: answered (a connection admitted) alone
            self._send(router, [identity], frames)
            return None
        return frames

    def _body(self, frame: zmq.Frame) -> bytes | zmq.Frame:
        return frame.bytes if len(frame) <= self.config.server.max_message_bytes else frame

    def _recv_envelope(self, router: zmq.Socket, flags: int, identity: bytes,
                       frame: zmq.Frame) -> list | p.Error:
        """The rest of a message of more than one frame after ``identity``, ``frame``
        its first: the envelope and the body — or, when the envelope is over the bounds,
        the error that answers it, the message read to its end and dropped."""
        frames: list = [identity]
        while True:
            if len(frames) >= _MAX_ENVELOPE_FRAMES or len(frame) > _MAX_ENVELOPE_FRAME_BYTES:
                return self._drop(router, len(frames))
            frames.append(frame.bytes)
            frame = router.recv(flags, copy=False)
            if not router.getsockopt(_RCVMORE):
                frames.append(self._body(frame))
                return frames

    def _drop(self, router: zmq.Socket, num_read: int) -> p.Error:
        """Read the rest of a message whose envelope is over the bounds (``num_read``
        of its frames read) and drop it: a frame at a time, never copied (a multipart
        message is consumed whole, or the next receive would return the rest of this
        one). Counted and logged now and then; the time it took is added to every
        session's lease (nobody else was answered meanwhile). Returns its answer."""
        started = time.monotonic()
        recv, more = router.recv, router.getsockopt
        num_frames = num_read
        while more(_RCVMORE):
            recv(0, copy=False)
            num_frames += 1
            if not num_frames % _DISCARD_SLICE:
                self._keepalive(num_frames)
        now = time.monotonic()
        self.daemon.dropped_message(now - started)
        self._dropped_since_log += 1
        if now >= self._next_drop_log:
            logger.warning("dropped %d message(s) with an envelope over %d frames of %d bytes (the last: %d frames, "
                           "read in %.2f s)", self._dropped_since_log, _MAX_ENVELOPE_FRAMES - 1,
                           _MAX_ENVELOPE_FRAME_BYTES, num_frames, now - started)
            self._dropped_since_log = 0
            self._next_drop_log = now + _LOG_EVERY_S
        error = InvalidArgument(f"a message of {num_frames} frames: a request is one frame, behind at most "
                                f"{_MAX_ENVELOPE_FRAMES - 1} envelope frames of {_MAX_ENVELOPE_FRAME_BYTES} bytes")
        return p.Error(id=0, code=int(error.code), message=error.message)

    def _learn_peer(self, identity: bytes, user: str) -> bool:
        """Who sent a message on connection ``identity``, from the ZAP user id it came
        with, under the identities configured now: False (and counted) when they no
        longer allow it."""
        if len(self._peers) >= _MAX_PEERS:
            self._forget_peers()
        self._users.pop(identity, None)
        self._peers.pop(identity, None)
        parsed = parse_user_id(user)
        allowed = None
        if parsed is not None:
            name, mechanism, address, key = parsed
            allowed = self.daemon.identities.resolve(mechanism, address, key)
        if allowed is None or allowed.name != name:
            self.daemon.metrics.auth_refused("revoked")
            return False
        self._users[identity] = user
        self._peers[identity] = PeerCreds.parse(address, allowed, mechanism, key)
        return True

    def _forget_peers(self) -> None:
        self._users.clear()
        self._peers.clear()

    def _relearn_peers(self, table: IdentityTable) -> None:
        """A reload: every known connection resolved anew (the message in hand too);
        those no longer allowed are forgotten, and their next message refused."""
        for identity, user in list(self._users.items()):
            self._learn_peer(identity, user)

    def _reread_auth(self, config_path: str | os.PathLike) -> AuthConfig:
        """The file's ``[auth]`` anew, for a reload — refused when it changes what the
        sockets were bound with (``curve_ipc``, the daemon's key pair): only a restart
        applies those, and a reload that answered success would leave the operator
        believing, say, that ipc:// peers now need CURVE while plain ones still get in."""
        auth = DaemonConfig.load(config_path).auth
        if auth.curve_ipc != self.config.auth.curve_ipc:
            raise InvalidArgument("[auth].curve_ipc changed: the sockets were bound with it, only a restart applies "
                                  "it (nothing reloaded)")
        if (read_secret(auth.secret_key_file) if auth.curve else None) != self._server_keys:
            raise InvalidArgument("[auth].secret_key_file changed (the daemon's key pair): the sockets were bound "
                                  "with it, only a restart applies it (nothing reloaded)")
        return auth

    def request_reload(self) -> None:
        """SIGHUP: re-read ``[auth]`` at the loop's next turn (safe from a signal handler)."""
        self._reload_requested = True
        self._nudge()

    def _reload(self, router: zmq.Socket) -> bool:
        if self.daemon.reload_source is None:
            logger.warning("reload asked for, but the daemon was started without a configuration file")
            return False
        try:
            self.daemon.reload_auth(self.daemon.reload_source())
        except Exception as exc:  # a bad file: keep serving with what we have
            logger.error("reload failed, keeping the identities in force: %s", exc)
        return False

    def _handle(self, router: zmq.Socket, frames: list[bytes]) -> bool:
        """Answer one message (or send its future's reply when it is done). True when
        the loop's catch-up may wait: False for a worker's wake-up, for frames nobody
        can be answered on, and for an answer still to come (it may wait on a timer the
        handler set, which the receive timeout must then allow for)."""
        if len(frames) < 2:
            return False  # no identity: cannot answer
        envelope, payload = frames[:-1], frames[-1]
        if _is_wake(frames):
            return False  # a worker's wake-up: the loop polls the daemon next
        limit = self.config.server.max_message_bytes
        if len(payload) > limit:
            # Answered with its id when that can be read without decoding it, so that
            # its client's call fails at once, not at its timeout.
            error = InvalidArgument(f"message of {len(payload)} bytes exceeds the limit of {limit}")
            self._send(router, envelope, self.daemon.error_reply(p.peek_request_id(payload), error))
            return True
        try:
            request = p.decode_request(payload)
        except p.ProtocolError as exc:
            self._send(router, envelope, self.daemon.undecodable(payload, exc))
            return True
        reply = self.daemon.answer(request, envelope[0])
        if isinstance(reply, Future):
            if not reply.done():
                reply.add_done_callback(lambda f: self._ready.append((envelope, f.result())))
                return False
            reply = reply.result()
        self._send(router, envelope, reply)
        return True

    def _send_ready(self, router: zmq.Socket) -> None:
        while self._ready:
            envelope, reply = self._ready.popleft()
            self._send(router, envelope, reply)

    def _send(self, router: zmq.Socket, envelope: list[bytes], reply: p.Reply) -> None:
        data = p.encode(reply)
        try:
            # Frame by frame (see _recv); a multipart message is queued whole or not at
            # all, so only the first frame can meet a full queue.
            for frame in envelope:
                transport.send_frame(router, frame, _SEND_MORE)
            transport.send_frame(router, data, _NOBLOCK)
        except zmq.Again:
            logger.warning("dropping a reply: the client's queue is full")

    def _shutdown(self) -> None:
        """The stop: one deadline, ``[server].drain_timeout_s`` from now, for the drain
        and for closing every spec's tiers and the store after it (which get a few
        seconds more if the drain used it all); systemd is asked for that plus
        :data:`_STOP_MARGIN_S`, so TimeoutStopSec= need not track it. What did not finish
        by then is logged and left behind (:attr:`unfinished`); the socket goes in any case."""
        drain_s = self.config.server.drain_timeout_s
        self.notifier.stopping()
        self.notifier.extend_timeout(drain_s + _STOP_MARGIN_S)
        deadline = self.daemon.clock() + drain_s
        logger.info("draining")
        self._close_router()
        try:
            self.daemon.drain(deadline)
            self.unfinished = not self.daemon.close(deadline)
        finally:
            if self._http is not None:
                self._http.shutdown()
            Path(self.config.server.socket_path).unlink(missing_ok=True)
            # Left behind, a stuck writer still has the store: the state's lock stays
            # held until the process exits, so that no new daemon opens it meanwhile.
            self.close(release_lock=not self.unfinished)
        if self.unfinished:
            logger.warning("stopped, leaving what did not finish to the process's exit")
        else:
            logger.info("stopped")

    def _close_router(self) -> None:
        if self._shedder is not None:
            self._shedder.close(self._router)
            self._shedder = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None

    def close(self, *, release_lock: bool = True) -> None:
        """Let go of the wake-up sockets, the context (if ours) and the state's lock
        (the end of :meth:`serve_forever`; for a server that never served, after its
        daemon was closed)."""
        self.collector.uninstall()
        self._close_nudges()
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        with self._wakers_lock:
            for sock in self._wakers:
                sock.close(linger=0)
            self._wakers.clear()
        if self._own_context:
            self._context.destroy(linger=0)
        if release_lock:
            self._state_lock.release()
