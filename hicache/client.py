"""The client library: what an engine links to talk to the hicache daemon.

An engine's lifecycle::

    client = CacheClient(endpoint)
    client.register(spec, [pool.handle])            # once; a TP group passes every rank's handle
    m = client.match(tokens, extra_key=...)         # what is cached: device part + host / disk parts
    client.lock(m.handle)
    ld = client.load(m.handle)                      # ld.device_pages: the whole prefix to use
    new = client.alloc(num_pages)                   # private pages for the rest (None: pool full)
    ... before attention of layer i: client.wait_layer(ld.wait, i)
    r = client.insert(tokens, pages)                # the tree takes the whole pages
    client.unlock(m.handle); client.release(tail_pages)

The pages to use are ``ld.device_pages`` and the one list to wait on is ``ld.wait``: it
holds this load's tickets and those of other loads still landing in the path (what
``Match.landing`` reported, if they still are). Call ``load`` even for a prefix that is
all on the device: it is the call that says which of its pages are still landing.

Every call has a timeout. A daemon that does not answer puts the client in *degraded
mode*, and the session calls answer without it: matches miss, inserts keep their pages
private, locks and unlocks are counted here, a load loads nothing — the engine computes,
never hangs. ``alloc`` alone raises :class:`Unavailable` then (``None`` would say "the
pool is full: wait for pages", and none will come). Only the call that found the daemon
gone waits for its timeout: from then on calls answer at once, while the background
thread probes the daemon (every ``reconnect_interval_s``); once a probe is answered, the
next call reconnects. A daemon that restarted answers ``UNKNOWN_SESSION``; the client
then says hello again, re-registers the pool, and declares the pages the engine still
holds (its private pages and the pages of paths it has locked) so the new daemon never
hands them out. Node handles from before a reconnect are *orphans*: unlocking the last
lock on one gives back its pages (unless an insert adopted them meanwhile).

The background thread also sends heartbeats so that an idle engine keeps its lease (a
killed engine loses it, and the daemon takes back everything it held). They go on the
client's one session socket, between calls: the daemon accepts a session's requests only
from the connection that opened it. A heartbeat answered ``UNKNOWN_SESSION`` (a daemon
that restarted) puts an idle client in degraded mode, ready to register again at its
next call or :meth:`CacheClient.revive`. Administrative calls (``stats``, ``health``,
``flush``, ``check``) use a connection of their own.

CPU pools (``memfd`` handles) are handed to the daemon as descriptors on its descriptor
socket (:mod:`hicache.fdpass`) at each registration; the layer-counter ring comes back
the same way, read-only.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import zmq

from hicache import fdpass
from hicache.auth import ClientKeys, tenant_from_env
from hicache.counters import CountersHandle, LayerWaiter, Ticket
from hicache import protocol as p, transport
from hicache.errors import (
    ErrorCode,
    HicacheError,
    InvalidArgument,
    LoadFailed,
    LockUnderflow,
    StaleTicket,
    Unavailable,
    UnknownNode,
    WaitTimeout,
)
from hicache.keys import Tokens, key_self_test, pack_tokens
from hicache.pages import PAGE_ID_DTYPE, PageIds, PageIdsLike, as_page_ids
from hicache.foreign import OwnedPoolHandle
from hicache.pools import PoolHandle
from hicache.spec import KVSpec

logger = logging.getLogger(__name__)

_NO_PAGES = np.empty(0, dtype=PAGE_ID_DTYPE)
_MAX_PATHS = 4096  # handles whose pages the client keeps; past it, unlocked ones are forgotten


class RemoteError(HicacheError):
    """An error reply from the daemon; ``code`` is the daemon's."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        try:
            self.code = ErrorCode(code)
        except ValueError:
            self.code = ErrorCode.INTERNAL


class NodeHandle(NamedTuple):
    """A node of the daemon's tree, valid for one connection epoch."""

    node: int
    epoch: int


class Match(NamedTuple):
    handle: NodeHandle | None  # None: nothing cached (or degraded)
    device_pages: PageIds  # on the device at the time of the match (use Loaded.device_pages)
    num_host_pages: int
    num_disk_pages: int
    landing: tuple[Ticket, ...]  # loads still landing in device_pages then: Loaded.wait has them
    page_size: int
    num_remote_pages: int = 0  # of num_host_pages: brought from the remote tier for this match

    @property
    def wait(self) -> tuple[Ticket, ...]:
        """The former name of :attr:`landing`. Wait on :attr:`Loaded.wait` instead:
        it includes these tickets while they are still landing."""
        return self.landing

    @property
    def num_device_pages(self) -> int:
        return len(self.device_pages)

    @property
    def num_tokens(self) -> int:
        return (len(self.device_pages) + self.num_host_pages + self.num_disk_pages) * self.page_size


class Loaded(NamedTuple):
    handle: NodeHandle | None
    device_pages: PageIds  # the whole path: write into req_to_token
    num_loaded_pages: int
    wait: tuple[Ticket, ...]  # every load still landing in device_pages: the one list to wait on
    state: bool = False  # a load with a state slot: the handle's checkpoint is in it


class Stored(NamedTuple):
    """What a ``store`` cached: ``num_cached`` leading pages of the tokens are on host
    now (``num_copied`` of them copied from the engine's blocks by this call; the others
    were there already). The engine may reuse the blocks once it has this answer."""

    handle: NodeHandle | None
    num_copied: int
    num_cached: int


class LoadedInto(NamedTuple):
    """``num_loaded_pages``: the first blocks given that receive KV, layer by layer —
    wait on ``wait`` before reading a layer; the blocks after them get nothing.
    ``copies_end_ns`` (:func:`hicache.protocol.monotonic_ns`; ``None``: a daemon that
    does not say): no layer starts copying after it. A layer not landed by then may
    still be copying: the engine that gave up on it may reuse the blocks once the load
    is over (:meth:`CacheClient.wait_over`), not before."""

    num_loaded_pages: int
    wait: tuple[Ticket, ...]
    copies_end_ns: int | None = None


class Inserted(NamedTuple):
    handle: NodeHandle | None  # None: nothing taken (degraded): the pages are still the engine's
    device_pages: PageIds  # canonical pages of every whole page
    freed: PageIds  # duplicates the daemon took back
    num_prefix_pages: int
    num_checkpoints: int = 0  # checkpoints taken (their state slots are the engine's again)


# Rings of earlier registrations kept mapped (CacheClient._waiter_of) once their daemon
# has let go of them (nothing writes their loads' blocks any more: a ticket read stale
# there is over), so that a load that ended before the registration still reads as
# landed or failed. A ring its daemon still holds is kept whatever the count.
_RETIRED_RINGS = 4
_RCVTIMEO = int(zmq.RCVTIMEO)  # a plain int: pyzmq converts enum members on every call


def _pages(data: bytes) -> PageIds:
    return np.frombuffer(data, PAGE_ID_DTYPE)  # dtype positional: keywords cost ~0.15 us



def _for_daemon(data: dict[str, Any], uuids: bool) -> dict[str, Any]:
    """A pool's (or buffer's) description as this daemon takes it: without the CUDA
    description's ``device_uuid`` unless its hello says ``device_uuids`` (an older
    daemon refuses the field, and opens the pool at the engine's index, as before)."""
    cuda = data.get("cuda_ipc")
    if cuda and not uuids and "device_uuid" in cuda:
        data["cuda_ipc"] = {k: v for k, v in cuda.items() if k != "device_uuid"}
    return data


def _as_is(reply: Any) -> Any:
    return reply


class _Call(NamedTuple):
    """A session request, not sent yet, and what becomes of its answer: the call's
    result is ``finish(reply)`` (``None``: no answer, degraded mode). Without a
    ``message`` the call is no one request: ``finish(None)`` makes it whole."""

    message: p._Request | None
    finish: Callable[[Any], Any]
    timeout_s: float | None = None
    epoch: int | None = None  # (see CacheClient._request)
    stamp: Callable[[p._Request], None] | None = None


class CacheClient:
    """One engine's session with the hicache daemon.

    Three kinds of calls, three rules for a daemon that does not answer in time:

    * ``register`` (once, at start) raises — :class:`Unavailable` when nothing answers,
      :class:`RemoteError` when the daemon refuses the pool — so the engine decides
      whether to run without a cache.
    * Session calls (``match``, ``match_many``, ``lock``, ``unlock``, ``load``,
      ``insert``, ``release``) degrade: they answer without the daemon (see the module
      docstring) and never raise :class:`Unavailable`. ``alloc`` is the exception: it
      returns ``None`` only when the pool is full (free pages, or wait, and retry) and
      raises :class:`Unavailable` at once in degraded mode (no page will come until the
      daemon is back: compute with the pages the engine holds, or hold the request).
    * Administrative calls (``stats``, ``health``, ``flush``, ``check``) always ask the
      daemon, on a connection of their own, whatever the session's state; they raise
      :class:`Unavailable` when it does not answer within their timeout, and leave the
      session as it was (no degraded mode, no reconnect).

    Caller bugs raise a :class:`HicacheError` whose ``code`` is the daemon's for the
    same mistake, whether the client or the daemon found it. For a node handle the
    check order is the same for every operation: a handle this session does not know is
    ``UNKNOWN_NODE``, then a handle it holds no lock on is ``LOCK_UNDERFLOW`` (for
    ``unlock`` and ``load``). ``unlock`` and ``load`` are checked here, against the
    locks this client counts: a handle it never handed out, or one from before a
    reconnect that it holds no lock on, raises :class:`UnknownNode`; one it handed out
    in this session but holds no lock on raises :class:`LockUnderflow`. ``lock`` asks
    the daemon (:class:`RemoteError` ``UNKNOWN_NODE`` for a handle it does not know).
    ``None`` (a miss) is accepted by ``lock``, ``unlock`` and ``load`` and does nothing.

    ``clock`` times the reconnect attempts (tests inject one); call timeouts are real
    time.

    Threads: the client's own background thread shares the session socket with the
    caller's calls safely, but the caller's calls are one caller's — serialise them.
    In particular a wait (``wait_layer``, ``wait_over``) must not run while another
    thread makes a session call or ``revive``: either may register again, which
    retires the ring the wait reads and may unmap an older one under it. (vLLM's
    connector makes every call of its worker's client, and its reviving thread's,
    under one lock.)
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 5.0,
        load_timeout_s: float = 60.0,
        name: str = "",
        heartbeat: bool = True,
        reconnect_interval_s: float = 1.0,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        server_key: str | bytes | os.PathLike | None = None,
        key_file: str | os.PathLike | None = None,
        tenant: str | None = None,
    ) -> None:
        """``server_key`` (the daemon's public key, or a file holding it) and
        ``key_file`` (this client's ``.key_secret``): CURVE on every connection (default:
        ``HICACHE_SERVER_KEY`` / ``HICACHE_CLIENT_KEY_FILE``, else plain). ``tenant``:
        the tenant the cache requests name (default ``HICACHE_TENANT``, else the
        identity's first)."""
        self.endpoint = endpoint
        self._keys = ClientKeys.load(server_key, key_file)
        self.tenant = tenant_from_env() if tenant is None else tenant
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        self.name = name or f"pid{os.getpid()}"
        self.reconnect_interval_s = reconnect_interval_s
        self._clock = clock
        self._context = context or transport.new_context()
        self._own_context = context is None
        self._socket: zmq.Socket | None = None
        self._socket_lock = threading.Lock()  # the caller's calls and the heartbeats share the socket
        self._rcvtimeo = -1
        self._admin_socket: zmq.Socket | None = None
        self._admin_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._store_deadlines = False  # the daemon honours Store.deadline_ns (its hello says so)
        self._load_unlocked = False  # the daemon honours LoadInto.unlocked (likewise)
        self._load_deadlines = False  # the daemon honours LoadInto.deadline_ns (likewise)
        self._copy_deadlines = False  # the daemon honours LoadInto.copy_deadline_ns (likewise)
        self._session = 0  # the registered session's id; 0 before the first registration
        # The session of the last hello, for the next hello to name (Hello.replaces): a
        # call not answered in time drops the connection, and with it any bye, so the
        # daemon would keep that session — the pool's memory, its name — for a lease.
        # 0: none, or a daemon that does not end sessions so.
        self._replaces = 0
        self.epoch = 0
        self._down_since: float | None = None
        self._next_retry = 0.0
        # What to register again after a reconnect: (spec, rank pools), (spec, an
        # engine-owned pool) or the name of an engine-owned pool to attach to.
        self._registration: tuple[KVSpec, list[PoolHandle]] | tuple[KVSpec, OwnedPoolHandle] | str | None = None
        self._answering = threading.Event()  # set by a probe that reached the daemon while degraded
        self.waiter: LayerWaiter | None = None
        # The rings of the registrations before this one: a load the daemon answered
        # before the pool was registered again may still be copying into the engine's
        # blocks, and stamps its layers on the ring it was given (see _waiter_of).
        self._retired: deque[LayerWaiter] = deque()
        self.page_size = 0
        self.num_pages = 0
        # The registered (or attached) pool's id, a new one after each reconnect: its KV
        # event stream's topic is ``<[events].topic><pool_id>`` (None: not registered yet).
        self.pool_id: int | None = None
        self.lease_s = 0.0
        self.max_message_bytes = 0  # the daemon's limit on a request, from its hello (0: not known)
        # What the engine holds, for re-registration after a daemon restart.
        self._private: set[int] = set()
        self._locked: Counter[NodeHandle] = Counter()
        self._paths: dict[NodeHandle, PageIds] = {}  # the pages the engine was told to use, per handle
        # Handles whose pages a load answered here must not hand out: still landing when
        # last told, or (orphans) partly taken by an insert since.
        self._stale: set[NodeHandle] = set()
        self._orphan_refs: Counter[int] = Counter()  # page -> locked orphan handles whose path has it
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._want_heartbeat = heartbeat

    def _dealer(self) -> zmq.Socket:
        """A new connection to the daemon (CURVE when the client has keys)."""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            self._keys.apply(sock)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # (not an endpoint: a socket left open would hold close()'s term for good)
            sock.close(linger=0)
            raise InvalidArgument(f"cannot connect to {self.endpoint!r}: {exc.strerror} (an endpoint is "
                                  "ipc://PATH or tcp://HOST:PORT)") from None
        return sock

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = self._dealer()
        return self._socket

    def _reset_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            self._rcvtimeo = -1

    def _call(self, message: p._Request, timeout_s: float | None = None) -> p.Reply:
        """Send one request, wait for its reply (replies to earlier, timed-out requests
        and heartbeats are dropped). Raises :class:`Unavailable` on timeout,
        :class:`RemoteError` on an error reply. A blocking ``recv`` with a receive
        timeout: a poll first would add a system call to every round trip."""
        with self._socket_lock:
            request_id = self._send_locked(message)
            return self._receive_locked(request_id,
                                        time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s))

    def _send_locked(self, message: p._Request) -> int:
        """Send ``message`` under a new request id (returned)."""
        message.id = request_id = next(self._ids)
        data = p.encode(message)
        if self.max_message_bytes and len(data) > self.max_message_bytes:
            # Refused here, at once: the daemon would refuse it too, and past four times
            # its limit drop the connection (the call would wait out its timeout).
            raise InvalidArgument(f"{message.__struct_config__.tag}: a request of {len(data)} bytes is over the "
                                  f"daemon's limit of {self.max_message_bytes} (server.max_message_bytes)")
        transport.send_frame(self._socket or self._connect(), data, 0)
        return request_id

    def _receive_locked(self, request_id: int, deadline: float) -> p.Reply:
        """The answer to request ``request_id``, by ``deadline`` (``time.monotonic``)."""
        sock = self._socket
        while True:
            # What is left (after a late answer to an earlier request, less), in whole ms
            # rounded up: never given up before ``deadline``, which a load's deadline
            # stamped before its send is not after.
            timeout_s = deadline - time.monotonic()
            if sock is None or timeout_s <= 0:
                self._reset_socket()
                raise Unavailable(f"no answer from {self.endpoint} in time")
            wanted = max(1, math.ceil(timeout_s * 1000))
            if wanted != self._rcvtimeo:
                sock.setsockopt(_RCVTIMEO, wanted)
                self._rcvtimeo = wanted
            try:
                reply = p.decode_reply(sock.recv())
            except zmq.Again:
                continue  # (given up at the top: the deadline has passed)
            if reply.id == request_id:
                break
        if isinstance(reply, p.Error):
            raise RemoteError(reply.code, reply.message)
        return reply

    def _admin(self, message: p._Request, timeout_s: float | None = None) -> p.Reply:
        """An administrative request, on the client's admin connection: a late answer or
        a timeout there never disturbs the session's connection."""
        op = message.__struct_config__.tag
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._admin_lock:
            sock = self._admin_socket
            if sock is None:
                sock = self._admin_socket = self._dealer()
            message.id = request_id = next(self._ids)
            sock.send(p.encode(message))
            deadline = time.monotonic() + timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    sock.close(linger=0)  # and with it any answer still to come
                    self._admin_socket = None
                    raise Unavailable(f"{op}: no answer from {self.endpoint} within {timeout_s:g} s")
                reply = p.decode_reply(sock.recv())
                if reply.id == request_id:
                    break
        if isinstance(reply, p.Error):
            raise RemoteError(reply.code, reply.message)
        return reply

    @property
    def degraded(self) -> bool:
        return self._down_since is not None

    @property
    def session_id(self) -> int | None:
        """The id of the daemon session this client holds now; ``None`` before the first
        registration, in degraded mode and after :meth:`close`. It changes on each
        reconnect (:attr:`epoch` counts them). Name it to the daemon's operators only:
        the daemon accepts it from this client's connection alone (and, to end it, from
        this process's next hello), and never logs it."""
        if not self._session or self._down_since is not None:
            return None
        return self._session

    def register(self, spec: KVSpec, pools: Sequence[PoolHandle]) -> None:
        """Register the engine's pool (one handle per TP rank, e.g. ``exported.handle``).
        A CPU pool's descriptor is offered to the daemon at each registration, so a
        handle made in another process must come with its ``fd`` received here (or be
        a ``cuda_ipc`` handle). Raises if the daemon refuses it (spec or key mismatch,
        a pool that is not this user's) or does not answer."""
        self._registration = (spec, list(pools))
        self._open_session(in_use=())

    def register_owned(self, spec: KVSpec, pool: OwnedPoolHandle) -> None:
        """Register an engine-owned pool (:mod:`hicache.foreign`: the engine's own blocks
        in its own layout; its ``memfd`` buffers with their descriptors in this
        process). Then ``store`` and ``load_into`` move pages; ``alloc``, ``insert``,
        ``load`` and ``release`` are refused. Raises like :meth:`register`."""
        if spec.fingerprint != pool.layout.spec.fingerprint:
            raise InvalidArgument("the pool's layout is for another spec")
        self._registration = (spec, pool)
        self._open_session(in_use=())

    def attach(self, name: str) -> None:
        """Join the engine-owned pool another session of this user registered under
        ``name`` (an engine's scheduler, beside its worker): match, lock, unlock and
        ``load_into`` on it; the worker waits on the tickets. Raises like
        :meth:`register` (``INVALID_ARGUMENT``: no such pool, yet)."""
        self._registration = name
        self._open_session(in_use=())

    def _fd_socket(self, hello: p.HelloReply) -> str:
        """The daemon's descriptor socket: next to its ipc:// socket as this process
        sees that (a container may mount it elsewhere), else where the daemon says."""
        if self.endpoint.startswith("ipc://"):
            return str(fdpass.socket_path_for(self.endpoint[len("ipc://"):]))
        return hello.fd_socket

    def _pool_messages(self, pools: list[PoolHandle], fd_socket: str, uuids: bool) -> list[p.PoolHandleMsg]:
        out = []
        for handle in pools:
            data = _for_daemon(handle.to_dict(), uuids)
            if handle.kind == "memfd":
                if handle.fd < 0:
                    raise InvalidArgument("a memfd pool handle without its descriptor in this process")
                data["token"] = fdpass.offer(fd_socket, handle.fd, timeout_s=self.timeout_s)
            out.append(p.from_dict(p.PoolHandleMsg, data))
        return out

    def _owned_message(self, pool: OwnedPoolHandle, fd_socket: str, hello: p.HelloReply) -> p.OwnedPoolMsg:
        buffers = []
        for buffer in pool.buffers:
            data = _for_daemon(buffer.to_dict(), hello.device_uuids)
            if buffer.kind == "memfd":
                if buffer.fd < 0:
                    raise InvalidArgument("a memfd buffer without its descriptor in this process")
                data["token"] = fdpass.offer(fd_socket, buffer.fd, timeout_s=self.timeout_s)
            buffers.append(data)
        message = {"layout": pool.layout.to_dict(), "buffers": buffers, "name": pool.name}
        if not pool.kv_events:
            if hello.owned_kv_events:
                message["kv_events"] = False
            else:  # (an older daemon refuses the field: the pool gets a stream of its own there)
                logger.info("the daemon at %s publishes KV events for every pool: pool %r has a stream too",
                            self.endpoint, pool.name)
        if not pool.counts_tokens:
            if hello.owned_counts_tokens:
                message["counts_tokens"] = False
            else:  # (likewise: its tokens count there)
                logger.info("the daemon at %s counts every pool's tokens: pool %r's count too",
                            self.endpoint, pool.name)
        return p.from_dict(p.OwnedPoolMsg, message)

    def _register_call(self, registration, hello: p.HelloReply, fd_socket: str, in_use: Sequence[int]) -> p.Reply:
        session = hello.session
        if isinstance(registration, str):
            return self._call(p.Attach(id=0, session=session, name=registration))
        spec, pools = registration
        owned = isinstance(pools, OwnedPoolHandle)
        # The first registration of a spec after a daemon restart rebuilds its disk tier
        # before the answer (seconds for a large store): as long as a load may take.
        return self._call(p.Register(
            id=0, session=session, spec=p.from_dict(p.KVSpecMsg, spec.to_dict()),
            fingerprint=spec.fingerprint, key_check=key_self_test(spec.fingerprint, spec.page_size),
            pools=[] if owned else self._pool_messages(pools, fd_socket, hello.device_uuids),
            in_use=np.asarray(sorted(in_use), dtype=PAGE_ID_DTYPE).tobytes(),
            owned=self._owned_message(pools, fd_socket, hello) if owned else p.UNSET,
        ), timeout_s=max(self.timeout_s, self.load_timeout_s))

    def _open_session(self, in_use: Sequence[int]) -> None:
        registration = self._registration
        try:
            hello = self._call(p.Hello(id=0, version=p.PROTOCOL_VERSION, client=self.name, pid=os.getpid(),
                                       replaces=self._replaces or p.UNSET))
        except RemoteError:
            self._replaces = 0  # answered: that session is ended, or unknown there (a daemon restarted since)
            raise
        self._replaces = hello.session if hello.replace_sessions else 0
        self.max_message_bytes = hello.max_message_bytes
        fd_socket = self._fd_socket(hello)
        try:
            reply = self._register_call(registration, hello, fd_socket, in_use)
        except RemoteError:
            try:  # the session said hello: end it now rather than let it lapse
                self._call(p.Bye(id=0, session=hello.session), timeout_s=min(self.timeout_s, 1.0))
            except (Unavailable, RemoteError):
                pass
            raise
        counters = CountersHandle.from_dict(p.as_dict(reply.counters))
        waiter = LayerWaiter(counters, fdpass.fetch(fd_socket, counters.token, timeout_s=self.timeout_s))
        self._session = hello.session
        self._store_deadlines = hello.store_deadlines
        self._load_unlocked = hello.load_unlocked
        self._load_deadlines = hello.load_deadlines
        self._copy_deadlines = hello.copy_deadlines
        self.lease_s = hello.lease_s
        self.page_size, self.num_pages = reply.page_size, reply.num_pages
        self.pool_id = reply.pool
        if self.waiter is not None:
            self._retired.append(self.waiter)
            self._drop_retired()
        self.waiter = waiter
        self.epoch += 1
        self._down_since = None
        self._answering.clear()
        self._start_heartbeat()
        logger.info("registered with %s (epoch %d)", self.endpoint, self.epoch)

    def _drop_retired(self) -> None:
        """Unmap the oldest retired rings beyond :data:`_RETIRED_RINGS` whose daemon has
        let go of them. One it still holds may have a load copying into the engine's
        blocks: unmapped, that load's ticket would be looked up on the current ring,
        read as stale there, and :meth:`wait_over` would call it over while the daemon
        still writes. (A daemon that does not say when it lets go — no
        :attr:`CountersHandle.writer_lock` — is taken at its count, as before.)"""
        excess = len(self._retired) - _RETIRED_RINGS
        for old in list(self._retired):
            if excess <= 0:
                break
            if not old.handle.writer_lock or old.writer_gone():
                self._retired.remove(old)
                old.close()
                excess -= 1

    def _request(self, message: p._Request, timeout_s: float | None = None, *,
                 epoch: int | None = None, stamp: Callable[[p._Request], None] | None = None) -> p.Reply | None:
        """A session request; ``None`` in degraded mode (the daemon is unreachable).
        ``epoch``: a request naming a node handle of that epoch, never sent in another
        (after a reconnect the handle is an orphan: ``None``). ``stamp(message)`` right
        before each send (a retry after a reconnect is sent again)."""
        return self._run(_Call(message, _as_is, timeout_s, epoch, stamp))

    def _run(self, call: _Call) -> Any:
        """Make ``call``: its result."""
        if call.message is None:
            return call.finish(None)
        if self._registration is None:
            raise InvalidArgument("register the engine's pool first")
        if self._down_since is not None and not self._try_reconnect():  # degraded: no wait
            return call.finish(None)
        return self._finish(call, self._start(call))

    def _start(self, call: _Call) -> tuple[int, float] | None:
        """Send ``call``'s request (in session: see :meth:`_run`), holding the socket until
        :meth:`_finish` has its answer: its request id and the moment to give up on it.
        ``None``: not sent, its handle is of an earlier epoch."""
        if call.epoch is not None and call.epoch != self.epoch:
            return None
        self._socket_lock.acquire()
        try:
            call.message.session = self._session
            if call.stamp is not None:
                call.stamp(call.message)
            request_id = self._send_locked(call.message)
        except BaseException:
            self._socket_lock.release()
            raise
        return request_id, time.monotonic() + (self.timeout_s if call.timeout_s is None else call.timeout_s)

    def _finish(self, call: _Call, started: tuple[int, float] | None, *, retry: bool = False) -> Any:
        """The result of a call :meth:`_start` sent (or did not: ``None``); releases the
        socket."""
        if started is None:
            return call.finish(None)
        try:
            try:
                reply = self._receive_locked(*started)
            finally:
                self._socket_lock.release()
        except Unavailable:
            self._go_down()
            return call.finish(None)
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_SESSION or retry:
                raise
            # The daemon restarted (or our lease lapsed): start over, then retry once.
            self._go_down()
            if not self._reconnect(force=True):
                return call.finish(None)
            return self._finish(call, self._start(call), retry=True)
        return call.finish(reply)

    def revive(self) -> bool:
        """Reconnect now, in degraded mode (or after a registration that failed), if the
        daemon answers again — what the next session call would do; for an engine that
        wants its pool back before its next request. True when connected."""
        if self._registration is None:
            return False
        if self._down_since is None:
            if self._session:
                return True
            self._go_down()  # never registered: try now
        return self._try_reconnect()

    def _go_down(self) -> None:
        if self._down_since is None:
            logger.warning("hicache daemon at %s unavailable: degraded mode (misses, no allocations)", self.endpoint)
            self._down_since = self._clock()
            self._next_retry = 0.0

    def _try_reconnect(self) -> bool:
        """In degraded mode: reconnect if the daemon is known to answer again (a probe
        of the background thread said so), else miss at once. Without the thread
        (``heartbeat=False``) this call probes, at most every ``reconnect_interval_s``."""
        if self._heartbeat is not None:
            return self._answering.is_set() and self._reconnect(force=True)
        return self._reconnect()

    def _reconnect(self, force: bool = False) -> bool:
        now = self._clock()
        if not force and now < self._next_retry:
            return False
        self._next_retry = now + self.reconnect_interval_s
        self._answering.clear()
        # Everything the engine still holds stays its own in the new session: its private
        # pages, and the pages of every path it holds a lock on (each counted once per
        # handle, so that the last unlock of the last handle gives a page back).
        orphans: Counter[int] = Counter()
        for handle in self._locked:
            orphans.update(set(self._paths.get(handle, _NO_PAGES).tolist()))
        in_use = self._private | set(orphans)
        try:
            self._open_session(in_use=in_use)
        except (Unavailable, RemoteError, InvalidArgument) as exc:
            logger.info("reconnect to %s failed: %s", self.endpoint, exc)
            self._go_down()
            return False
        self._private = in_use
        self._orphan_refs = orphans
        # Handles of the old session that nothing holds name nothing now.
        self._paths = {h: pages for h, pages in self._paths.items() if h in self._locked}
        self._stale.intersection_update(self._paths)
        return True

    def _tenant(self, tenant: str | None):
        """The ``tenant`` field of a request: this call's, else the client's; left out
        when neither names one (the identity's first)."""
        tenant = self.tenant if tenant is None else tenant
        return tenant if tenant else p.UNSET

    def match(self, tokens: Tokens, extra_key: str = "", *, tenant: str | None = None) -> Match:
        return self._run(self._match_call(tokens, extra_key, tenant))

    def _match_call(self, tokens: Tokens, extra_key: str, tenant: str | None) -> _Call:
        return _Call(p.Match(id=0, session=0, tokens=pack_tokens(tokens), extra_key=extra_key,
                             tenant=self._tenant(tenant)), self._match_from)

    def match_many(self, sequences: Sequence[Tokens], extra_key: str = "", *,
                   tenant: str | None = None) -> list[Match]:
        """Several lookups in one round trip (answered with what is cached now)."""
        reply = self._request(p.MatchMany(id=0, session=0, tokens=[pack_tokens(t) for t in sequences],
                                          extra_key=extra_key, tenant=self._tenant(tenant)))
        if reply is None:
            return [self._match_from(None) for _ in sequences]
        return [self._match_from(r) for r in reply.results]

    def _match_from(self, reply) -> Match:
        if reply is None or reply.node < 0:
            return Match(None, _NO_PAGES, 0, 0, (), self.page_size)
        handle = NodeHandle(reply.node, self.epoch)
        pages = _pages(reply.device_pages)
        landing = tuple(Ticket(*t) for t in reply.wait) if reply.wait else ()
        self._remember(handle, pages, landing)
        return Match(handle, pages, reply.host_pages, reply.disk_pages, landing, self.page_size,
                     reply.remote_pages)

    def _remember(self, handle: NodeHandle, pages: PageIds, landing: tuple[Ticket, ...] = ()) -> None:
        """Keep the path's pages of a handle handed out (needed if it gets locked)."""
        paths = self._paths
        if len(paths) > _MAX_PATHS:  # forget unlocked handles' pages, oldest first
            for old in [h for h in paths if h not in self._locked][: _MAX_PATHS // 2]:
                del paths[old]
                self._stale.discard(old)
        if handle not in self._locked:
            self._set_path(handle, pages, landing)

    def _set_path(self, handle: NodeHandle, pages: PageIds, landing: tuple[Ticket, ...]) -> None:
        self._paths[handle] = pages
        if landing:
            self._stale.add(handle)
        else:
            self._stale.discard(handle)

    def _not_held(self, handle: NodeHandle, op: str) -> HicacheError:
        """The error for ``op`` on a handle this client holds no lock on."""
        if handle.epoch == self.epoch and handle in self._paths:
            return LockUnderflow(f"{op}: this client holds no lock on node {handle.node}")
        return UnknownNode(f"{op}: node handle {tuple(handle)} is not one this session handed out "
                           f"(current epoch {self.epoch})")

    def lock(self, handle: NodeHandle | None) -> None:
        """Protect the handle's path. Raises :class:`RemoteError` ``UNKNOWN_NODE`` if the
        daemon does not know the handle. Without the daemon (degraded, or a handle from
        before a reconnect) the lock is counted here only: a reconnect declares the
        path's pages in use, and ``unlock`` pairs with it as usual."""
        if handle is None:
            return
        if handle.epoch == self.epoch:
            self._request(p.Lock(id=0, session=0, node=handle.node), epoch=handle.epoch)
        self._locked[handle] += 1

    def unlock(self, handle: NodeHandle | None) -> None:
        """Undo one :meth:`lock`. Raises :class:`UnknownNode` / :class:`LockUnderflow`
        (see the class docstring) for a handle this client holds no lock on, in every
        mode. The last unlock of an orphan gives its pages back."""
        if handle is None:
            return
        count = self._locked.get(handle, 0)
        if count <= 0:
            raise self._not_held(handle, "unlock")
        if count == 1:
            del self._locked[handle]
        else:
            self._locked[handle] = count - 1
        if handle.epoch == self.epoch:
            self._request(p.Unlock(id=0, session=0, node=handle.node), epoch=handle.epoch)
        elif count == 1:
            self._give_back(handle)

    def _give_back(self, handle: NodeHandle) -> None:
        """An orphan's last unlock: its pages were declared in use at the reconnect; give
        back those no other locked orphan needs and no insert adopted meanwhile."""
        done = []
        for page in set(self._paths.pop(handle, _NO_PAGES).tolist()):
            refs = self._orphan_refs.pop(page, 0) - 1
            if refs > 0:
                self._orphan_refs[page] = refs
            elif refs == 0 and page in self._private:
                done.append(page)
        self._stale.discard(handle)
        if done:
            self.release(sorted(done))

    def load(self, handle: NodeHandle | None, *, state_slot: int = 0) -> Loaded:
        """Bring the host / disk part of a locked handle's path onto the device. Use the
        answer's ``device_pages`` and wait on its ``wait`` (every load still landing in
        them). For a spec with state layers, ``state_slot`` (the request's device state
        slot) receives the handle's checkpoint before any layer: use the hit only when
        the answer's ``state`` is true and its handle is the one asked for. Without the daemon (degraded, or a handle from before a reconnect) nothing
        is loaded: the answer has the path's pages the engine was last given — none if
        they were still landing then, as nothing could be waited on — and no tickets.
        Raises :class:`UnknownNode` / :class:`LockUnderflow` for a handle this client
        holds no lock on."""
        if handle is None:
            return Loaded(None, _NO_PAGES, 0, ())
        if self._locked.get(handle, 0) <= 0:
            raise self._not_held(handle, "load")
        if handle.epoch == self.epoch:
            reply = self._request(p.Load(id=0, session=0, node=handle.node, state_slot=state_slot),
                                  timeout_s=self.load_timeout_s, epoch=handle.epoch)
            if reply is not None:
                pages = _pages(reply.device_pages)
                wait = tuple(Ticket(*t) for t in reply.wait)
                self._set_path(handle, pages, wait)  # what the engine uses now: declared on a reconnect
                loaded = NodeHandle(reply.node, self.epoch) if reply.node >= 0 else None
                if loaded is not None:
                    self._remember(loaded, pages, wait)
                return Loaded(loaded, pages, reply.loaded_pages, wait, reply.state)
        usable = _NO_PAGES if handle in self._stale else self._paths.get(handle, _NO_PAGES)
        return Loaded(handle, usable, 0, ())

    def wait_layer(self, wait: Sequence[Ticket], layer: int, *, timeout_s: float | None = None,
                   stream: Any = None) -> None:
        """Block (CPU mode) or make ``stream`` wait (GPU mode) until ``layer`` of every
        load in ``wait`` (a :attr:`Loaded.wait`) has landed."""
        for ticket in wait:
            self._waiter_of(ticket).wait_layer(ticket, layer, timeout_s=timeout_s, stream=stream)

    def _waiter_of(self, ticket: Ticket) -> LayerWaiter:
        """The ring ``ticket`` is on: the pool's now, or — a load answered before the
        pool was registered again — the ring before that still gives the ticket's load
        its slot, or remembers how it ended: the daemon may still be copying that load
        into the engine's blocks (its old pool retires once its transfers end), and
        says on that ring when it has landed or failed. Rings count from random starts,
        so a ticket is known to its own ring only. One no ring knows: the current
        ring's (which says stale) — its load is over, since a ring is unmapped only
        once its daemon let go of it (:meth:`_drop_retired`).
        A ring of a daemon that died never moves again: its loads read as not landed
        until their waits time out, never as done."""
        waiter = self.waiter
        if waiter is None:
            raise StaleTicket(f"ticket {ticket}: no pool is registered")
        if waiter.knows(ticket):
            return waiter
        for old in reversed(self._retired):
            if old.knows(ticket):
                return old
        return waiter

    def alloc(self, num_pages: int) -> PageIds | None:
        """``num_pages`` private pages; ``None`` when the pool has not that many free
        now (free some, or wait for other requests to, and retry). Raises
        :class:`Unavailable` in degraded mode, at once: no daemon, no pages."""
        reply = self._request(p.Alloc(id=0, session=0, num_pages=num_pages))
        if reply is None:
            raise Unavailable(f"alloc: the hicache daemon at {self.endpoint} is unavailable (degraded mode)")
        if num_pages and not reply.pages:
            return None
        pages = _pages(reply.pages)
        self._private.update(pages.tolist())
        return pages

    def insert(self, tokens: Tokens, pages: PageIdsLike, extra_key: str = "", *,
               tenant: str | None = None, checkpoints: Sequence[tuple[int, int]] = (),
               ends: Sequence[int] = ()) -> Inserted:
        """Give the tree the whole pages of ``tokens`` (one page id per whole page).
        ``checkpoints`` (a spec with state layers): ``(pages before it, device state
        slot)`` for each state the engine offers, page counts ascending; the answer
        comes once they are copied, and then the slots are the engine's again.
        ``ends``: page counts where a later prompt may well branch off (the system
        prompt's end, each turn's), ascending — a model with sliding-window layers
        keeps its window's bytes there (see ``hicache.tiers.windows``)."""
        ids = as_page_ids(pages)
        reply = self._request(p.Insert(id=0, session=0, tokens=pack_tokens(tokens), pages=ids.tobytes(),
                                       extra_key=extra_key, tenant=self._tenant(tenant),
                                       checkpoints=[(int(n), int(s)) for n, s in checkpoints],
                                       ends=[int(n) for n in ends]))
        if reply is None:
            return Inserted(None, ids, _NO_PAGES, 0)  # degraded: the pages stay ours
        taken = ids.tolist()
        self._private.difference_update(taken)
        if self._orphan_refs:
            adopted = {page for page in taken if self._orphan_refs.pop(page, None) is not None}
            if adopted:
                self._forget_taken(adopted)
        handle = NodeHandle(reply.node, self.epoch) if reply.node >= 0 else None
        device = _pages(reply.device_pages)
        if handle is not None:
            self._remember(handle, device)
        return Inserted(handle, device, _pages(reply.freed), reply.prefix_pages, reply.checkpoints)

    def store(self, tokens: Tokens, pages: PageIdsLike, extra_key: str = "", *,
              tenant: str | None = None) -> Stored:
        """Engine-owned pools: cache the whole pages of ``tokens`` from the engine's blocks
        ``pages`` (one per whole page, from the first). The answer comes once the copy is
        done: then the blocks may be reused. In degraded mode nothing is stored.

        A store that is not answered within ``timeout_s`` is given up (degraded mode),
        and the engine reuses the blocks; so it carries that moment as its deadline,
        and the daemon caches nothing of it once the deadline has passed (a daemon that
        was only slow would otherwise copy blocks holding other requests' KV by then)."""
        ids = as_page_ids(pages)
        # (a plain call's timeout: the copy is from memory; a daemon that is gone must
        # not hold the engine's step for a load's timeout)
        timeout_ns = max(1, int(self.timeout_s * 1000)) * 1_000_000  # (what _call waits: whole ms)

        def stamp(message: p.Store) -> None:  # (sent at once: the call's wait starts after this)
            if self._store_deadlines:
                message.deadline_ns = p.monotonic_ns() + timeout_ns

        reply = self._request(p.Store(id=0, session=0, tokens=pack_tokens(tokens), pages=ids.tobytes(),
                                      extra_key=extra_key, tenant=self._tenant(tenant)), stamp=stamp)
        if reply is None:
            return Stored(None, 0, 0)
        handle = NodeHandle(reply.node, self.epoch) if reply.node >= 0 else None
        if handle is not None:
            self._remember(handle, _NO_PAGES)
        return Stored(handle, reply.copied, reply.cached)

    def load_into(self, handle: NodeHandle | None, pages: PageIdsLike, first: int = 0, *,
                  locked: bool = True) -> LoadedInto:
        """Engine-owned pools: copy pages ``first ..`` of a locked handle's path into the
        engine's blocks ``pages``; wait on the answer's ``wait`` before reading a layer.
        Only the first ``num_loaded_pages`` blocks receive KV (a page evicted or a disk
        read failed meanwhile shortens it); in degraded mode, or for a handle from
        before a reconnect, none. Raises :class:`UnknownNode` / :class:`LockUnderflow`
        for a handle this client holds no lock on. ``locked=False``: for a handle this
        client did not lock — what the path still holds loads (the load holds it while
        it copies), in one round trip where the daemon can (else lock, load, unlock).

        A load_into not answered within ``load_timeout_s`` is given up (degraded mode:
        none loaded), and the engine may reuse the blocks; so it carries that moment as
        its deadline, and the daemon copies nothing into them once it has passed (a
        daemon that was only slow would otherwise write over another request's KV).
        Its layers get another ``load_timeout_s`` after that: ``copies_end_ns``."""
        return self._run(self._load_into_call(handle, pages, first, locked))

    def _load_into_call(self, handle: NodeHandle | None, pages: PageIdsLike, first: int, locked: bool) -> _Call:
        if handle is None:
            return _Call(None, lambda _: LoadedInto(0, ()))
        if not locked and not self._load_unlocked:
            return _Call(None, lambda _: self._lock_and_load_into(handle, pages, first))
        if locked and self._locked.get(handle, 0) <= 0:
            raise self._not_held(handle, "load_into")
        ids = as_page_ids(pages)
        if handle.epoch != self.epoch:
            return _Call(None, lambda _: LoadedInto(0, ()))
        timeout_ns = max(1, int(self.load_timeout_s * 1000)) * 1_000_000  # (whole ms: not over what the call waits)

        copies_end: list[int | None] = [None]

        def stamp(message: p.LoadInto) -> None:  # (sent at once: the call's wait starts after this)
            if self._load_deadlines:
                message.deadline_ns = p.monotonic_ns() + timeout_ns
                if self._copy_deadlines:
                    message.copy_deadline_ns = copies_end[0] = message.deadline_ns + timeout_ns

        def finish(reply) -> LoadedInto:
            if reply is None:
                return LoadedInto(0, ())
            return LoadedInto(reply.loaded_pages, tuple(Ticket(*t) for t in reply.wait), copies_end[0])

        message = p.LoadInto(id=0, session=0, node=handle.node, pages=ids.tobytes(), first=first,
                             unlocked=True if not locked else p.UNSET)
        return _Call(message, finish, self.load_timeout_s, handle.epoch, stamp)

    def _lock_and_load_into(self, handle: NodeHandle, pages: PageIdsLike, first: int) -> LoadedInto:
        """``load_into`` a handle this client did not lock, from a daemon that loads only
        locked paths."""
        self.lock(handle)
        try:
            return self.load_into(handle, pages, first)
        finally:
            self.unlock(handle)

    def wait_over(self, wait: Sequence[Ticket], *, timeout_s: float) -> bool:
        """Wait until every load in ``wait`` is over — every layer landed, or the rest
        failed, or its counter slot has moved on to a later load (on the ring it was
        answered on: one from before the pool was registered again included, see
        :meth:`_waiter_of`) — ``timeout_s`` at most for all of them; ``False`` if one may still be copying then. An engine that gave
        up on a load after its :attr:`LoadedInto.copies_end_ns` may reuse the blocks
        once this is ``True``: no layer starts copying after that moment, so what was
        copying then has ended. (GPU mode: the current stream waits for the last layer's
        event instead, so what the engine runs on it later comes after the copies.)"""
        if self.waiter is None:
            return False
        deadline = time.monotonic() + timeout_s
        for ticket in wait:
            try:
                waiter = self._waiter_of(ticket)
                waiter.wait_layer(ticket, waiter.handle.num_layers - 1,
                                  timeout_s=max(0.0, deadline - time.monotonic()))
            except (LoadFailed, StaleTicket):
                pass  # over: what had not landed failed, or the slot went to another load since
            except WaitTimeout:
                return False
        return True

    def _forget_taken(self, taken: set[int]) -> None:
        """Pages of locked orphans that an insert gave to the new daemon (adopted by its
        tree, or freed as duplicates) are the orphans' no longer: never declared again,
        never given back by their unlock (the daemon may hand them out by then)."""
        ids = np.fromiter(taken, PAGE_ID_DTYPE, len(taken))
        for handle, pages in self._paths.items():
            if handle.epoch != self.epoch:
                kept = pages[~np.isin(pages, ids)]
                if len(kept) != len(pages):
                    self._paths[handle] = kept
                    self._stale.add(handle)

    def release(self, pages: PageIdsLike) -> None:
        """Give private pages back. In degraded mode they are dropped here (the daemon
        takes them back with the old session), so a reconnect does not declare them."""
        ids = as_page_ids(pages)
        if not ids.size:
            return
        self._request(p.Release(id=0, session=0, pages=ids.tobytes()))
        self._private.difference_update(ids.tolist())

    def stats(self) -> dict[str, Any]:
        return p.as_dict(self._admin(p.Stats(id=0)).stats)

    def health(self) -> p.HealthReply:
        return self._admin(p.Health(id=0))

    def flush(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait until every host page is on disk (per the disk policy) and nothing is in
        flight; returns what the flush wrote and what is (not) durable now:
        ``written_pages``, ``on_disk_pages``, ``not_on_disk_pages``,
        ``deferred_backups``, ``seconds``."""
        figures = p.as_dict(self._admin(p.Flush(id=0), timeout_s=timeout_s))
        return {k: v for k, v in figures.items() if k not in ("op", "id")}

    def check(self) -> None:
        """Run the daemon's invariant checks; raises :class:`RemoteError` if one fails."""
        self._admin(p.Check(id=0), timeout_s=60.0)

    def reload(self) -> dict[str, int]:
        """Make the daemon re-read its ``[auth]`` (administrators only): ``identities``
        configured now, ``sessions_ended`` for identities, keys or users it dropped."""
        reply = self._admin(p.Reload(id=0))
        return {"identities": reply.identities, "sessions_ended": reply.sessions_ended}

    def purge(self, tenant: str, extra_key: str | None = None) -> dict[str, int]:
        """Forget ``tenant``'s cached pages — all of its namespaces, or the one of
        ``extra_key`` — on every tier and in the remote tier's store (administrators
        only): ``namespaces``, ``device_pages``, ``host_pages``, ``disk_pages``,
        ``remote_pages`` (removed from the store: every node's copies),
        ``left_pages`` (held by a lock or a transfer now: purge again once they are let
        go), ``remote_left_namespaces`` (the store could not be asked now: purge
        again)."""
        reply = self._admin(p.Purge(id=0, tenant=tenant, extra_key=p.UNSET if extra_key is None else extra_key),
                            timeout_s=60.0)
        return {k: v for k, v in p.as_dict(reply).items() if k not in ("op", "id")}

    def _start_heartbeat(self) -> None:
        if not self._want_heartbeat or self._heartbeat is not None:
            return
        self._heartbeat = threading.Thread(target=self._heartbeat_main, name="hicache-heartbeat", daemon=True)
        self._heartbeat.start()

    def _heartbeat_main(self) -> None:
        """Heartbeats while connected (sent between the caller's calls, on its socket:
        a call renews the lease anyway); probes of the daemon while degraded. A
        heartbeat answered ``UNKNOWN_SESSION`` (the daemon restarted, or the lease
        lapsed) puts the client in degraded mode with the daemon known to answer: the
        next call — or :meth:`revive` — registers again at once, so that an idle
        engine's pool is back before its next request (and sessions attached to it can
        attach again)."""
        ids = itertools.count(1)
        sent: dict[int, int] = {}  # heartbeat id -> the session it was sent for (answers not read yet)
        while True:
            degraded = self._down_since is not None
            pause = self.reconnect_interval_s if degraded else max(self.lease_s / 3, 0.05)
            if self._stop_heartbeat.wait(pause):
                return
            if degraded:
                if not self._answering.is_set() and self._probe():
                    self._answering.set()
                continue
            if not self._socket_lock.acquire(blocking=False):
                continue  # a call is in flight: it renews the lease, and waiting ones keep it
            try:
                sock = self._socket
                if sock is not None and self._session and self._down_since is None:
                    while sock.poll(0):  # earlier heartbeats' answers (and timed-out calls')
                        if self._session_lost(sock.recv(), sent):
                            self._go_down()
                            self._answering.set()  # (it answered: reconnect at the next call)
                            break
                    else:
                        # Never blocking, with the caller's lock held: a daemon gone long
                        # enough fills the queue, and the next call finds out.
                        heartbeat_id = next(ids) | 1 << 62
                        sock.send(p.encode(p.Heartbeat(id=heartbeat_id, session=self._session)), zmq.NOBLOCK)
                        if len(sent) >= 64:  # (answers a call's receive loop read and dropped)
                            sent.clear()
                        sent[heartbeat_id] = self._session
            except zmq.ZMQError:
                pass  # a full queue, a closed socket: a lost daemon shows on the next call
            finally:
                self._socket_lock.release()

    def _session_lost(self, frame: bytes, sent: dict[int, int]) -> bool:
        """Is ``frame`` a heartbeat's answer saying the current session is gone?"""
        try:
            reply = p.decode_reply(frame)
        except p.ProtocolError:  # (a call's late answer is the call's to judge; this one is nobody's)
            return False
        session = sent.pop(reply.id, None)
        return (session is not None and session == self._session and isinstance(reply, p.Error)
                and reply.code == ErrorCode.UNKNOWN_SESSION)

    def _probe(self) -> bool:
        """Does the daemon answer ``health``? (its own socket: the caller's is idle)"""
        try:
            sock = self._dealer()
        except zmq.ZMQError:
            return False
        try:
            sock.send(p.encode(p.Health(id=1)))
            return bool(sock.poll(int(max(self.timeout_s, 0.05) * 1000)))
        except zmq.ZMQError:
            return False
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        """End the session (the daemon releases what it still holds) and disconnect."""
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2)
        if self._session and not self.degraded:
            try:
                self._call(p.Bye(id=0, session=self._session), timeout_s=min(self.timeout_s, 2.0))
            except (Unavailable, RemoteError):
                pass
        self._session = 0
        if self.waiter is not None:
            self.waiter.close()
            self.waiter = None
        while self._retired:
            self._retired.popleft().close()
        self._reset_socket()
        with self._admin_lock:
            if self._admin_socket is not None:
                self._admin_socket.close(linger=0)
                self._admin_socket = None
        if self._own_context:
            self._context.term()

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# -- one call on several sessions -------------------------------------------------------------
#
# An engine under tensor parallelism keeps one pool per rank (vLLM's connector: each
# rank's worker registers its own), and its scheduler one session on each. Asked one by
# one, n ranks cost n round trips; here every request is sent before any answer is read,
# so the daemon answers them back to back and the caller waits about one round trip.


def _each(calls: Sequence[tuple[CacheClient, _Call]]) -> list[Any]:
    """Each call's result, or the :class:`HicacheError` it raised. The calls of clients
    in session are sent first, all of them, then their answers read in turn; the others
    (degraded mode, a call that is no one request) are made after, one by one."""
    if len(calls) == 1:  # (nothing to overlap)
        client, call = calls[0]
        try:
            return [client._run(call)]
        except HicacheError as exc:
            return [exc]
    results: list[Any] = [None] * len(calls)
    started: list[tuple[int, float] | None] = []
    later: list[int] = []
    holding: set[int] = set()  # (a client twice: its second call waits for its first's answer)
    try:
        for i, (client, call) in enumerate(calls):
            if (call.message is None or client._registration is None or client._down_since is not None
                    or id(client) in holding):
                later.append(i)
                started.append(None)
                continue
            try:
                started.append(client._start(call))
            except HicacheError as exc:  # (not sent: nothing held)
                started.append(None)
                results[i] = exc
                continue
            if started[i] is None:
                results[i] = call.finish(None)
            else:
                holding.add(id(client))
        for i, (client, call) in enumerate(calls):
            if (sent := started[i]) is not None:
                started[i] = None  # (_finish releases its socket, whatever happens)
                try:
                    results[i] = client._finish(call, sent)
                except HicacheError as exc:
                    results[i] = exc
    finally:  # (an unexpected error: the sockets of the answers not read yet go back)
        for (client, _), sent in zip(calls, started):
            if sent is not None:
                client._socket_lock.release()
    for i in later:
        client, call = calls[i]
        try:
            results[i] = client._run(call)
        except HicacheError as exc:
            results[i] = exc
    return results


def match_each(clients: Sequence[CacheClient], tokens: Tokens, extra_key: str = "", *,
               tenant: str | None = None) -> list[Match]:
    """``match(tokens, extra_key)`` on each client, about one round trip for all (see
    above). Raises the first error a match met, once every answer is in."""
    packed = pack_tokens(tokens)  # (once for all: 2,000 tokens from a list take ~0.3 ms here)
    results = _each([(c, c._match_call(packed, extra_key, tenant)) for c in clients])
    for result in results:
        if isinstance(result, HicacheError):
            raise result
    return results


def load_into_each(clients: Sequence[CacheClient], handles: Sequence[NodeHandle | None], pages: PageIdsLike,
                   first: int = 0, *, locked: bool = True) -> list[LoadedInto | HicacheError]:
    """``load_into(handles[i], pages, first, locked=locked)`` on each client ``i``, about
    one round trip for all (see above): each one's :class:`LoadedInto`, or the error it
    met — the others' loads are under way all the same, their tickets to be waited on."""
    calls: list[tuple[CacheClient, _Call]] = []
    for client, handle in zip(clients, handles, strict=True):
        try:
            calls.append((client, client._load_into_call(handle, pages, first, locked)))
        except HicacheError as exc:  # (a handle not held: no request)
            calls.append((client, _Call(None, lambda _, exc=exc: exc)))
    return _each(calls)
