"""The daemon's request handling: sessions, leases, validation, and the tier managers.

:class:`Daemon` turns decoded requests into replies (or futures of replies) on the owner
thread; :mod:`hicache.daemon.server` moves bytes. Keeping the two apart lets tests drive
every request path without sockets.

Sessions: ``hello`` opens one (its id is a random 63-bit token, usable only from the
ZeroMQ connection that said hello: another peer naming it is told there is no such
session), ``register`` attaches the engine's device pool (one handle per TP rank, so a
TP group registers once and gets one answer), and from then on the session owns private
pages and node locks. An unregistered session lives ``server.register_within_s`` at most,
and each peer (a user on ``ipc://``, an address on ``tcp://``) may hold
``server.max_unregistered_per_peer`` of them. Every request of a registered session
renews its lease, and a request still waiting for its answer keeps it; ``bye``, an
expired lease (a killed engine) or a drain ends it: its locks are released, its private
pages freed, and its pool retired — unmapped once no transfer uses it. Logs name a
session by a serial number, never by its id.

Pools: a CPU pool is a sealed memfd segment its engine offered on the descriptor socket
(:mod:`hicache.fdpass`); the registration names it by token, and it is mapped only if
the user who offered it is the session's (when the transport tells), owns the segment,
and the segment is not already mapped as another pool (same device and inode). A GPU
pool's IPC handle is refused likewise if it is already registered.

Node handles are capabilities: each session gets its own random handle for a node,
from its own ``match`` / ``insert`` / ``load``, and only that session can use it — any
other value, another session's handle included, is ``UNKNOWN_NODE``.

Validation happens before anything changes: types at decode time (msgspec), then sizes,
ranges and ownership here — page ids in range and the session's own, node handles this
session's and live, token buffers whole int32s within the configured limits. Errors
come back as ``Error`` replies with a stable code and a message; a request that fails
changes nothing (a refused ``register`` leaves the session as it was).

KV specs: the first session registering a spec creates its :class:`TierManager` (host
pool sized from ``[host]``) over the daemon's one storage backend, and rebuilds that
spec's disk tier from the storage metadata; later sessions of the same spec share its
tree, host pool and disk pages. While other engines are being served, that rebuild
(seconds for a large store) runs a slice at a time between their requests, and the
registrations of the spec are answered when it is done; with nobody else to serve it
runs at once.
"""

from __future__ import annotations

import array
import gc
import itertools
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hicache import __version__
from hicache.config import DaemonConfig
from hicache import protocol as p
from hicache.errors import (
    Draining,
    ErrorCode,
    HicacheError,
    InvalidArgument,
    LockUnderflow,
    ResourceExhausted,
    SpecMismatch,
    UnknownNode,
    UnknownSession,
    VersionMismatch,
)
from hicache.fdpass import FdExchange
from hicache.jobs import Completions
from hicache.metrics import Metrics, NullMetrics
from hicache.keys import (
    PAGE_KEY_BYTES,
    ROOT_PARENT_KEY,
    TOKEN_BYTES,
    NamespaceId,
    chain_page_keys,
    key_self_test,
    namespace_id,
)
from hicache.pages import PAGE_ID_DTYPE, distinct_page_ids
from hicache.pools import DevicePool, HostPool, PoolHandle
from hicache.shm import SharedBuffer
from hicache.spec import KVSpec
from hicache.tiers import Hit, TierAccount, TierManager
from hicache.tree import Node

logger = logging.getLogger(__name__)

_LEASE_CHECK_S = 0.05  # leases are checked this often (they end at most this late)
_SNAPSHOT_S = 0.5  # the metrics' occupancy figures are at most this old
_REBUILD_SLICE_S = 0.005  # owner-thread time a background rebuild takes between two looks at the socket
_REBUILD_STEP = 256  # records a rebuild walks between two looks at the clock
_MAX_HANDLES = 1 << 16  # node handles a session keeps before the oldest unlocked ones are dropped

@dataclass(frozen=True)
class PeerCreds:
    """Who is at the other end of a connection, as the transport tells it: the user,
    group and process on ``ipc://``; nothing (``None``) on ``tcp://``."""

    uid: int | None
    gid: int | None
    pid: int | None
    key: str  # what the per-peer limits count by: the user on ipc://, the address on tcp://

    @classmethod
    def parse(cls, address: str) -> "PeerCreds":
        """libzmq's ``Peer-Address``: ``localhost:<uid>:<gid>:<pid>`` on ipc://, the
        numeric host on tcp://."""
        if address.startswith("localhost:"):
            parts = address.split(":")[1:]
            if len(parts) == 3 and all(part.isdigit() for part in parts):
                uid, gid, pid = map(int, parts)
                return cls(uid, gid, pid, f"uid:{uid}")
        return cls(None, None, None, address)


LOCAL = PeerCreds(os.getuid(), os.getgid(), os.getpid(), "local")  # requests handled without a socket


@dataclass(eq=False)
class Session:
    session_id: int
    serial: int  # what logs call it: the id is a secret
    client: str
    pid: int
    lease_deadline: float
    peer: bytes = b""  # the ZeroMQ routing id of the connection that said hello
    creds: PeerCreds = LOCAL
    manager: TierManager | None = None
    pool_id: int = -1
    locks: Counter = field(default_factory=Counter)  # node id -> locks this session holds
    locked_since: dict[int, float] = field(default_factory=dict)  # node id -> when its first lock was taken
    private: set[int] = field(default_factory=set)  # its private device pages
    namespaces: dict[str, NamespaceId] = field(default_factory=dict)
    registering: bool = False  # a register waits for its spec's disk tier to be rebuilt
    ranks: list[DevicePool] = field(default_factory=list)  # mapped, waiting for a rebuild to register
    handles: dict[int, int] = field(default_factory=dict)  # handle -> node id, oldest first
    handle_of: dict[int, int] = field(default_factory=dict)  # node id -> handle
    waiting: int = 0  # requests answered later (a load from disk): the engine is alive


@dataclass(eq=False)
class _Rebuild:
    """A spec's disk tier going back into its new manager's tree, a slice at a time
    (:meth:`TierManager.rebuild_steps`), and the registrations waiting for it."""

    manager: TierManager
    steps: Iterator[int]
    started: float
    waiting: list[tuple[Session, Callable[[Any], None]]] = field(default_factory=list)
    evicted: set[bytes] = field(default_factory=set)  # store evictions meanwhile: forgotten at the end


class SharingPolicy(Protocol):
    def match(self, manager: TierManager, namespace: NamespaceId, tokens: bytes, pool: int) -> Hit | Future: ...

    def insert(self, daemon: "Daemon", session: Session, namespace: NamespaceId, tokens: bytes,
               pages: np.ndarray) -> p.InsertReply: ...


class RadixSharing:
    """Prefix sharing through the tree (the normal case)."""

    def match(self, manager, namespace, tokens, pool):
        if manager.config.prefetch_policy == "best_effort":
            return manager.match(namespace, tokens, pool)
        return manager.match_async(namespace, tokens, pool)

    def insert(self, daemon, session, namespace, tokens, pages):
        manager = session.manager
        manager.add_namespace(namespace)
        result = manager.insert(namespace, tokens, session.pool_id, pages)
        session.private.difference_update(pages.tolist())
        return p.InsertReply(
            id=0, node=daemon.handle_for(session, result.node),
            device_pages=result.device_pages.tobytes(),
            freed=result.duplicate_pages.tobytes(), prefix_pages=result.num_prefix_pages,
        )


class NoSharing:
    """Sharing off (the seeds' ChunkCache): every match misses, an insert just gives the
    pages back."""

    def match(self, manager, namespace, tokens, pool):
        return None

    def insert(self, daemon, session, namespace, tokens, pages):
        daemon.release_pages(session, pages)
        return p.InsertReply(id=0, node=-1, device_pages=b"", freed=pages.tobytes(), prefix_pages=0)


def _as_error(exc: BaseException) -> HicacheError:
    """What a request that raised ``exc`` is answered with (never INTERNAL: these are
    the request's doing)."""
    if isinstance(exc, HicacheError):
        return exc
    if isinstance(exc, RecursionError):
        return InvalidArgument("the request nests too deeply")
    return ResourceExhausted("not enough memory to handle the request")


class Daemon:
    """See the module docstring. Owner thread only."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        storage=None,
        completions: Completions | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | NullMetrics | None = None,
        fds: FdExchange | None = None,
    ) -> None:
        """``fds``: the descriptor socket engines offer their CPU pools on (without
        one, only CUDA pools can register); closed with the daemon."""
        self.config = config
        self.fds = fds
        if metrics is None:
            metrics = Metrics() if config.metrics.enabled else NullMetrics()
        self.metrics = metrics
        self._snapshot: dict[str, Any] = {}
        self._next_snapshot = 0.0
        self.clock = clock
        self.started = clock()
        self.completions = completions or Completions()
        if storage is None and config.disk.enabled:
            from hicache.storage.lmdb_backend import LmdbBackend

            config.disk.store_path.mkdir(mode=0o700, parents=True, exist_ok=True)
            storage = LmdbBackend(config.disk.store_path, capacity_bytes=config.disk.capacity_bytes,
                                  sync=config.disk.sync)
        self.storage = storage
        self.managers: dict[bytes, TierManager] = {}
        self._rebuilds: dict[bytes, _Rebuild] = {}  # spec fingerprint -> its rebuild in the background
        self._gc_was_enabled = False  # automatic collection, before background rebuilds paused it
        self.sessions: dict[int, Session] = {}
        self._serials = itertools.count(1)
        self._unregistered: Counter = Counter()  # peer key -> its sessions not registered yet
        # The connection the request being handled came from (its routing id), and how to
        # learn who is at its other end: the server's (tests without sockets: LOCAL).
        self._peer = b""
        self.peer_creds: Callable[[bytes], PeerCreds] = lambda peer: LOCAL
        self._random: Iterator[int] = iter(())
        self._pool_ids = itertools.count(1)
        self.draining = False
        self.counts: Counter = Counter()  # (op, status) -> requests, for stats
        # One NoSharing object, whether sharing is off for the daemon or for some keys:
        # ``sharing is self._no_sharing`` tells a miss that was never stored.
        self._no_sharing = NoSharing()
        self._sharing: SharingPolicy = RadixSharing() if config.sharing.enabled else self._no_sharing
        self._no_sharing_keys = frozenset(config.sharing.disabled_extra_keys)
        self._idle_list: list[tuple[Future, Callable[[], Any]]] = []
        self._unsettled: list[tuple[Callable[..., None], tuple]] = []  # see answer()
        # Called now and then during long work on the owner thread at a spec's first
        # registration (pinning its host pool, rebuilding its disk tier) with a count
        # of what is done; the server feeds the systemd watchdog from it.
        self.keepalive: Callable[[int], None] = lambda done: None
        self._next_lease_check = 0.0
        handlers: dict[type, Callable[[Any], Any]] = {
            p.Hello: self._hello, p.Register: self._register, p.Match: self._match,
            p.MatchMany: self._match_many, p.Lock: self._lock, p.Unlock: self._unlock,
            p.Load: self._load, p.Alloc: self._alloc, p.Insert: self._insert,
            p.Release: self._release, p.Heartbeat: self._heartbeat, p.Bye: self._bye,
            p.Stats: self._stats, p.Health: self._health, p.Flush: self._flush, p.Check: self._check,
        }
        # request type -> (handler, op name): one lookup on the request path
        self._handlers: dict[type, tuple[Callable[[Any], Any], str]] = {
            cls: (fn, cls.__struct_config__.tag) for cls, fn in handlers.items()}
        self._lease_s = config.server.lease_s
        self._max_token_bytes = config.server.max_tokens * TOKEN_BYTES
        self.refresh_snapshot()
        self.metrics.add_state_collector(lambda: self._snapshot)

    # ------------------------------------------------------------------ dispatch

    def handle(self, request: p.Request, peer: bytes = b"") -> p.Reply | Future:
        """One decoded request -> its reply, or a future of it (on the owner thread),
        with its bookkeeping done."""
        reply = self.answer(request, peer)
        self.settle()
        return reply

    def answer(self, request: p.Request, peer: bytes = b"") -> p.Reply | Future:
        """Like :meth:`handle`, but the bookkeeping that does not change the answer
        (request counts and latency, hit / miss accounting) waits for :meth:`settle`,
        which the server calls at its next idle moment (see :mod:`hicache.daemon.server`);
        the latency recorded is the answer's, taken now. ``peer``: the routing id of the
        connection it came on (sessions are bound to theirs)."""
        handler, op = self._handlers[type(request)]
        start = time.perf_counter()
        self._peer = peer
        try:
            reply = handler(request)
        except (HicacheError, RecursionError, MemoryError) as exc:
            error = _as_error(exc)
            self._unsettled.append((self._count, (op, error.code.name, time.perf_counter() - start)))
            return p.Error(id=request.id, code=int(error.code), message=error.message)
        except Exception as exc:  # a bug: answer it, log it, keep serving
            logger.exception("internal error handling %s", op)
            self._unsettled.append((self._count, (op, "INTERNAL", time.perf_counter() - start)))
            return p.Error(id=request.id, code=int(ErrorCode.INTERNAL), message=f"internal error: {exc}")
        if isinstance(reply, Future):
            return self._chain(reply, request.id, op, start, self.sessions.get(getattr(request, "session", 0)))
        self._unsettled.append((self._count, (op, "OK", time.perf_counter() - start)))
        reply.id = request.id
        return reply

    def settle(self) -> None:
        """Run the bookkeeping that :meth:`answer` left for later."""
        unsettled, self._unsettled = self._unsettled, []
        for fn, args in unsettled:
            fn(*args)

    def _count(self, op: str, status: str, seconds: float) -> None:
        self.counts[(op, status)] += 1
        self.metrics.request(op, status, seconds)

    def dropped(self) -> None:
        """The loop dropped what it was doing (a bug it survived): counted like a request
        of op ``loop`` and status ``DROPPED`` (``stats`` and the requests metric)."""
        self._count("loop", "DROPPED", 0.0)

    def error_reply(self, request_id: int, exc: HicacheError) -> p.Error:
        self._count("decode", exc.code.name, 0.0)
        return p.Error(id=request_id, code=int(exc.code), message=exc.message)

    def _chain(self, future: Future, request_id: int, op: str, start: float, session: Session | None) -> Future:
        out: Future = Future()
        counted = session is not None and not future.done()
        if counted:
            session.waiting += 1  # its engine waits for this answer: its lease holds meanwhile

        def done(f: Future) -> None:
            if counted:
                session.waiting -= 1
                session.lease_deadline = max(session.lease_deadline, self.clock() + self._lease_s)
            error = f.exception()
            if error is None:
                reply = f.result()
                reply.id = request_id
                self._count(op, "OK", time.perf_counter() - start)
            else:
                code = error.code if isinstance(error, HicacheError) else ErrorCode.INTERNAL
                self._count(op, code.name, time.perf_counter() - start)
                reply = p.Error(id=request_id, code=int(code), message=str(error))
            out.set_result(reply)

        future.add_done_callback(done)
        return out

    # ------------------------------------------------------------------ sessions

    def _session(self, session_id: int, *, registered: bool = True) -> Session:
        """The request's session, which must have said hello on the same connection;
        renews a registered session's lease."""
        session = self.sessions.get(session_id)
        if session is None or session.peer != self._peer:
            raise UnknownSession("no such session on this connection (expired, or the daemon restarted)")
        if session.manager is not None:
            session.lease_deadline = self.clock() + self._lease_s
        elif registered:
            raise InvalidArgument("register the engine's pool first")
        return session

    def _hello(self, m: p.Hello) -> p.HelloReply:
        if m.version != p.PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol {m.version}, this daemon {p.PROTOCOL_VERSION} (hicache {__version__})")
        if self.draining:
            raise Draining("the daemon is shutting down")
        server = self.config.server
        if len(self.sessions) >= server.max_sessions:
            raise ResourceExhausted(f"too many sessions ({server.max_sessions})")
        creds = self.peer_creds(self._peer)
        if self._unregistered[creds.key] >= server.max_unregistered_per_peer:
            raise ResourceExhausted(f"this peer has {server.max_unregistered_per_peer} sessions that "
                                    f"have not registered; register them or let them lapse")
        session_id = secrets.randbits(63)
        while session_id in self.sessions or not session_id:
            session_id = secrets.randbits(63)
        session = Session(session_id, next(self._serials), m.client[:200], m.pid,
                          self.clock() + server.register_within_s, peer=self._peer, creds=creds)
        self.sessions[session_id] = session
        self._unregistered[creds.key] += 1
        logger.info("session #%d opened by %r (pid %d, peer %s)", session.serial, session.client, m.pid, creds.key)
        return p.HelloReply(id=m.id, session=session_id, version=p.PROTOCOL_VERSION,
                            daemon=f"hicache {__version__}", lease_s=self._lease_s,
                            fd_socket=str(self.fds.path) if self.fds is not None else "")

    def _register(self, m: p.Register) -> p.RegisterReply | Future:
        """Everything is checked and mapped before the session changes: a refused
        registration leaves it unregistered, as it was (and free to try again), and
        drops the descriptors it named (the engine offers them again with its retry)."""
        try:
            return self._register_checked(m)
        except BaseException:
            if self.fds is not None:
                for handle in m.pools:
                    token = handle.get("token") if isinstance(handle, dict) else None
                    offer = self.fds.take(token) if isinstance(token, bytes) else None
                    if offer is not None:
                        os.close(offer.fd)
            raise

    def _register_checked(self, m: p.Register) -> p.RegisterReply | Future:
        session = self._session(m.session, registered=False)
        if session.manager is not None or session.registering:
            raise InvalidArgument("this session has registered its pool already")
        spec = KVSpec.from_dict(m.spec)
        if spec.fingerprint != m.fingerprint:
            raise SpecMismatch("the spec's fingerprint differs between client and daemon (versions differ?)")
        if m.key_check != key_self_test(spec.fingerprint, spec.page_size):
            raise SpecMismatch("page keys differ between client and daemon: they could never share a page")
        if len(m.pools) != spec.tp_size:
            raise InvalidArgument(f"a TP group of {spec.tp_size} registers {spec.tp_size} pool handles, "
                                  f"got {len(m.pools)}")
        handles = [PoolHandle.from_dict(handle) for handle in m.pools]
        ranks: list[DevicePool] = []
        try:
            for handle in handles:
                ranks.append(DevicePool.attach(handle, expected=spec, segment=lambda h: self._segment(session, h)))
                self._refuse_mapped_twice(ranks)
            in_use = distinct_page_ids(m.in_use, ranks[0].num_pages)  # pages a re-registering engine uses
            manager = self._manager_for(spec, ranks[0].num_pages)
        except BaseException:
            for rank in ranks:
                rank.close()
            raise
        if manager is not None:
            return self._attach(session, m.id, spec, ranks, in_use, manager)
        # The spec's disk tier is being rebuilt between other engines' requests: answer
        # when it is back.
        session.registering = True
        session.ranks = ranks
        out: Future = Future()

        def rebuilt(result: Any) -> None:
            session.registering = False
            session.ranks = []
            if isinstance(result, TierManager) and self.sessions.get(session.session_id) is not session:
                result = UnknownSession(f"session #{session.serial} ended while its spec was rebuilt")
            if not isinstance(result, TierManager):
                for rank in ranks:
                    rank.close()
                out.set_exception(result)
                return
            try:
                out.set_result(self._attach(session, m.id, spec, ranks, in_use, result))
            except BaseException as exc:  # _attach closed the ranks
                out.set_exception(exc)

        self._rebuilds[spec.fingerprint].waiting.append((session, rebuilt))
        return out

    def _segment(self, session: Session, handle: PoolHandle) -> SharedBuffer:
        """Map the memfd segment offered under ``handle.token``: only if the user who
        offered it is the session's (when the transport says who that is) and owns it."""
        offer = self.fds.take(handle.token) if self.fds is not None else None
        if offer is None:
            raise InvalidArgument("no descriptor was offered under this pool's token (offer it on the "
                                  "descriptor socket first; an offer is used once and expires)")
        uid = session.creds.uid
        if uid is not None and offer.uid != uid:
            os.close(offer.fd)
            raise InvalidArgument(f"the pool's descriptor was offered by uid {offer.uid}, not by the session's user")
        return SharedBuffer.attach(offer.fd, handle.nbytes, uid=offer.uid)

    def _refuse_mapped_twice(self, ranks: list[DevicePool]) -> None:
        """A pool's memory may be mapped as one pool only: not as another session's
        (the same segment under another token), nor twice in one TP group."""
        new = ranks[-1].segment_id
        if new is None:
            return
        mapped = [rank.segment_id for rank in ranks[:-1]]
        mapped += [pool.segment_id for manager in self._all_managers() for pool in manager.device_pools()]
        mapped += [rank.segment_id for s in self.sessions.values() for rank in s.ranks]
        if new in mapped:
            raise InvalidArgument("this memory is already registered as a pool")

    def _all_managers(self) -> list[TierManager]:
        return [*self.managers.values(), *(rebuild.manager for rebuild in self._rebuilds.values())]

    def _attach(self, session: Session, request_id: int, spec: KVSpec, ranks: list[DevicePool],
                in_use: np.ndarray, manager: TierManager) -> p.RegisterReply:
        """The end of a registration: the session's pool joins its spec's manager."""
        pool_id = next(self._pool_ids)
        try:
            counters = manager.register_pool(pool_id, ranks)
        except BaseException:
            for rank in ranks:
                rank.close()
            raise
        if in_use.size:
            manager.reserve(pool_id, in_use)  # checked: cannot fail
            session.private.update(in_use.tolist())
        token = self.fds.publish(counters.reader_fd(), uid=session.creds.uid) if self.fds is not None else b""
        self._registered_or_gone(session)
        session.manager, session.pool_id = manager, pool_id
        logger.info("session #%d registered pool %d: %d pages, spec %s", session.serial, pool_id,
                    ranks[0].num_pages, spec.fingerprint_hex)
        return p.RegisterReply(id=request_id, pool=pool_id, counters=counters.handle(token).to_dict(),
                               page_size=spec.page_size, num_pages=ranks[0].num_pages)

    def _manager_for(self, spec: KVSpec, device_pages: int) -> TierManager | None:
        """The spec's manager; a new one at its first registration, whose disk tier is
        rebuilt now when no registered engine is waiting to be served, else in the
        background (then ``None``: the registration waits for :meth:`_run_rebuild`)."""
        manager = self.managers.get(spec.fingerprint)
        if manager is not None or spec.fingerprint in self._rebuilds:
            return manager
        started = self.clock()
        host = self.config.host
        if host.bytes:
            host_pages = HostPool.num_pages_for(spec, nbytes=host.bytes)
        else:
            host_pages = HostPool.num_pages_for(spec, ratio=host.ratio, device_pages=device_pages)
        used = sum(m.host_pool.nbytes for m in self._all_managers())
        if used + host_pages * spec.host_page_bytes > host.limit_bytes:
            raise ResourceExhausted(
                f"a host pool of {host_pages * spec.host_page_bytes} bytes for this spec would take the host "
                f"tier past [host].max_bytes ({host.limit_bytes} bytes, {used} in use)")
        manager = TierManager(spec, host_pages=host_pages, storage=self.storage, config=self.config.tiers,
                              completions=self.completions, clock=self.clock, metrics=self.metrics,
                              progress=self.keepalive)
        manager.on_store_evicted = self._store_evicted
        if self.storage is not None and any(s.manager is not None for s in self.sessions.values()):
            if not self._rebuilds:
                self._pause_gc()
            self._rebuilds[spec.fingerprint] = _Rebuild(manager, manager.rebuild_steps(_REBUILD_STEP), started)
            manager = None
        else:
            collecting = gc.isenabled()  # see _pause_gc: nothing else to serve, but the same full collections
            gc.disable()
            try:
                restored = manager.rebuild_from_storage(progress=self.keepalive)
            finally:
                if collecting:
                    gc.enable()
            self.managers[spec.fingerprint] = manager
            logger.info("spec %s: host pool of %d pages, %d disk pages restored in %.1f s",
                        spec.fingerprint_hex, host_pages, restored, self.clock() - started)
        # Pinning the host pool (and a rebuild done at once) stalls the loop: nobody's
        # heartbeat was answered meanwhile, so the silence was ours, not theirs.
        stalled = self.clock() - started
        for session in self.sessions.values():
            session.lease_deadline += stalled
        return manager

    def _pause_gc(self) -> None:
        """A rebuild allocates an object per record (450,000 for a large store): each of
        the several full collections that triggers walks them all, ~0.2 s during which
        no request is answered. Collection waits until the rebuilds are done (the cyclic
        garbage of a few seconds of serving is small)."""
        self._gc_was_enabled = gc.isenabled()
        gc.disable()

    def _resume_gc(self) -> None:
        if not self._rebuilds and self._gc_was_enabled:
            gc.enable()

    def _run_rebuild(self) -> None:
        """One slice of the oldest background rebuild; at its end the manager starts
        serving and the registrations waiting for it are answered."""
        fingerprint, rebuild = next(iter(self._rebuilds.items()))
        now = self.clock()
        for session, _ in rebuild.waiting:  # their clients wait for the answer: no heartbeats
            session.lease_deadline = max(session.lease_deadline, now + self._lease_s)
        deadline = now + _REBUILD_SLICE_S
        try:
            while True:  # at least one step a slice, however coarse the clock
                next(rebuild.steps)
                if self.clock() >= deadline:
                    return
        except StopIteration as finished:
            restored = finished.value
            error = None
        except Exception as exc:  # a store that fails to read: refuse the registrations, keep serving
            logger.exception("rebuilding the disk tier of spec %s failed", rebuild.manager.spec.fingerprint_hex)
            error = exc
        del self._rebuilds[fingerprint]
        self._resume_gc()
        if error is not None:
            rebuild.manager.close()
            for _, answer in rebuild.waiting:
                answer(error)
            return
        if rebuild.evicted:
            rebuild.manager.forget_disk_keys(rebuild.evicted)
        self.managers[fingerprint] = rebuild.manager
        logger.info("spec %s: %d disk pages restored in %.1f s, between other engines' requests",
                    rebuild.manager.spec.fingerprint_hex, restored, self.clock() - rebuild.started)
        for _, answer in rebuild.waiting:
            answer(rebuild.manager)

    def end_session(self, session: Session, reason: str) -> None:
        """Give back everything the session held. ``reason``: bye, lease_expired, shutdown."""
        if self.sessions.pop(session.session_id, None) is None:
            return
        self.metrics.session_ended(reason)
        manager = session.manager
        if manager is None:
            self._registered_or_gone(session)
        else:
            for node_id, count in session.locks.items():
                node = manager.tree.node(node_id)
                for _ in range(count):
                    manager.unlock(node, session.pool_id)
            if session.private:
                manager.release(session.pool_id, np.fromiter(session.private, dtype=PAGE_ID_DTYPE))
            manager.retire_pool(session.pool_id)
        logger.info("session #%d ended (%s): %d locks, %d private pages released", session.serial, reason,
                    sum(session.locks.values()), len(session.private))

    def _registered_or_gone(self, session: Session) -> None:
        """The session no longer counts against its peer's unregistered sessions."""
        key = session.creds.key
        self._unregistered[key] -= 1
        if self._unregistered[key] <= 0:
            del self._unregistered[key]

    def expire_leases(self) -> int:
        now = self.clock()
        if now < self._next_lease_check:
            return 0
        self._next_lease_check = now + _LEASE_CHECK_S
        expired = [s for s in self.sessions.values() if s.lease_deadline < now and not s.waiting]
        for session in expired:
            self.end_session(session, "lease_expired")
        return len(expired)

    def _store_evicted(self, keys: Sequence[bytes]) -> None:
        """The store (one for every KV spec) evicted records to make room for one
        manager's writes: each manager forgets those of its own tree."""
        for manager in self.managers.values():
            manager.forget_disk_keys(keys)
        for rebuild in self._rebuilds.values():  # a key may be restored after this: forget it again at the end
            rebuild.evicted.update(keys)
            rebuild.manager.forget_disk_keys(keys)

    def next_deadline(self) -> float | None:
        """When :meth:`poll` next has work of its own (a lease check, a tier manager's
        timer), if ever."""
        if self._rebuilds:
            return self.clock()  # a rebuild's next slice
        due = [self._next_lease_check] if self.sessions else []
        due.extend(t for t in (m.next_timer() for m in self.managers.values()) if t is not None)
        return min(due, default=None)

    # ------------------------------------------------------------------ cache ops

    def _namespace(self, session: Session, extra_key: str) -> NamespaceId:
        ns = session.namespaces.get(extra_key)
        if ns is None:
            if len(extra_key) > 1024:
                raise InvalidArgument("extra_key is longer than 1024 characters")
            ns = namespace_id(session.manager.spec.fingerprint, extra_key or None)
            session.namespaces[extra_key] = ns
        return ns

    def _tokens(self, tokens: bytes) -> bytes:
        if len(tokens) % TOKEN_BYTES:
            raise InvalidArgument(f"tokens must be packed int32 ({TOKEN_BYTES} bytes each)")
        if len(tokens) > self._max_token_bytes:
            raise InvalidArgument(f"more than {self.config.server.max_tokens} tokens in one request")
        return tokens

    def _sharing_for(self, extra_key: str) -> SharingPolicy:
        return self._no_sharing if extra_key in self._no_sharing_keys else self._sharing

    def _account_match(self, session: Session, namespace: NamespaceId, tokens: bytes, hit: Hit | None,
                       sharing_off: bool) -> None:
        """Matched tokens by tier; the rest of the request as missed, with the reason
        for its first missing page."""
        num_tokens = len(tokens) // TOKEN_BYTES
        if hit is None or hit.match.node is None:
            self.metrics.missed("never_stored" if sharing_off else "namespace_unknown", num_tokens)
            return
        m = hit.match
        ps = m.page_size
        self.metrics.matched(m.num_device_pages * ps, m.num_host_pages * ps, m.num_disk_pages * ps)
        missing = num_tokens - m.num_tokens
        if not missing:
            return
        reason = "never_stored"
        if missing >= ps:
            node = m.node
            parent = node.page_keys[-PAGE_KEY_BYTES:] if node.num_pages else ROOT_PARENT_KEY
            start = m.num_tokens * TOKEN_BYTES
            first = chain_page_keys(namespace, parent, tokens[start : start + ps * TOKEN_BYTES], ps)
            reason = session.manager.miss_reason(first)
        self.metrics.missed(reason, missing)

    def _match_reply(self, session: Session, hit: Hit | None) -> p.MatchReply:
        node = None if hit is None else hit.match.node
        if node is None or node.parent is None:  # unknown namespace, or nothing matched
            return p.MatchReply(id=0, node=-1, device_pages=b"", host_pages=0, disk_pages=0, wait=[])
        m = hit.match
        return p.MatchReply(id=0, node=self.handle_for(session, node), device_pages=m.device_bytes,
                            host_pages=m.num_host_pages, disk_pages=m.num_disk_pages,
                            wait=[tuple(t) for t in hit.wait] if hit.wait else [])

    def _match(self, m: p.Match):
        session = self._session(m.session)
        sharing = self._sharing_for(m.extra_key)
        sharing_off = sharing is self._no_sharing
        namespace = self._namespace(session, m.extra_key)
        tokens = self._tokens(m.tokens)
        hit = sharing.match(session.manager, namespace, tokens, session.pool_id)
        if isinstance(hit, Future):
            out: Future = Future()

            def answer(f: Future) -> None:
                self._account_match(session, namespace, tokens, f.result(), sharing_off)
                out.set_result(self._match_reply(session, f.result()))

            hit.add_done_callback(answer)
            return out
        self._unsettled.append((self._account_match, (session, namespace, tokens, hit, sharing_off)))
        return self._match_reply(session, hit)

    def _match_many(self, m: p.MatchMany) -> p.MatchManyReply:
        session = self._session(m.session)
        if len(m.tokens) > self.config.server.max_batch:
            raise InvalidArgument(f"more than {self.config.server.max_batch} lookups in one batch")
        ns = self._namespace(session, m.extra_key)
        sharing = self._sharing_for(m.extra_key)
        sharing_off = sharing is self._no_sharing
        batch = [self._tokens(tokens) for tokens in m.tokens]  # all checked before any is looked up
        results = []
        for tokens in batch:
            hit = sharing.match(session.manager, ns, tokens, session.pool_id)
            if isinstance(hit, Future):  # batches answer with what is cached now
                hit = session.manager.match(ns, tokens, session.pool_id)
            self._account_match(session, ns, tokens, hit, sharing_off)
            r = self._match_reply(session, hit)
            results.append(p.MatchResult(node=r.node, device_pages=r.device_pages, host_pages=r.host_pages,
                                         disk_pages=r.disk_pages, wait=r.wait))
        return p.MatchManyReply(id=m.id, results=results)

    def handle_for(self, session: Session, node: Node) -> int:
        """The session's handle for ``node`` (-1 for a root: nothing matched). A node
        keeps one handle per session; a new one is a random 63-bit number, so that a
        handle is as hard to guess as a session id. The oldest handles of unlocked
        nodes are forgotten past :data:`_MAX_HANDLES` (using one then is UNKNOWN_NODE,
        like using a handle of an evicted node)."""
        if node.parent is None:
            return -1
        handle = session.handle_of.get(node.node_id)
        if handle is not None:
            return handle
        if len(session.handles) >= _MAX_HANDLES:
            self._forget_handles(session)
        handle = self._random_handle()
        while handle in session.handles:
            handle = self._random_handle()
        session.handles[handle] = node.node_id
        session.handle_of[node.node_id] = handle
        return handle

    def _random_handle(self) -> int:
        value = next(self._random, None)
        if value is None:  # urandom by the batch: a call per handle costs ~1.5 us
            self._random = iter(array.array("Q", os.urandom(8 * 1024)))
            value = next(self._random)
        return (value >> 1) or 1

    @staticmethod
    def _forget_handles(session: Session) -> None:
        """Drop the older half of the handles of nodes this session has not locked."""
        unlocked = [h for h, node_id in session.handles.items() if node_id not in session.locks]
        for handle in unlocked[: max(1, len(session.handles) // 2)]:
            del session.handle_of[session.handles.pop(handle)]

    def _node(self, session: Session, handle: int) -> Node:
        """The node behind one of this session's handles."""
        node_id = session.handles.get(handle)
        node = None if node_id is None else session.manager.tree.find(node_id)
        if node is None:
            if node_id is not None:  # the node has left the tree: so does its handle
                del session.handle_of[session.handles.pop(handle)]
            raise UnknownNode(f"no node {handle} (evicted, or never returned to this session)")
        return node

    def _lock(self, m: p.Lock) -> p.Ok:
        session = self._session(m.session)
        node = self._node(session, m.node)
        session.manager.lock(node, session.pool_id)
        session.locks[node.node_id] += 1
        session.locked_since.setdefault(node.node_id, self.clock())
        return p.Ok(id=m.id)

    def _unlock(self, m: p.Unlock) -> p.Ok:
        session = self._session(m.session)
        node = self._node(session, m.node)
        node_id = node.node_id
        if session.locks.get(node_id, 0) <= 0:
            raise LockUnderflow(f"this session holds no lock on node {m.node}")
        session.manager.unlock(node, session.pool_id)
        session.locks[node_id] -= 1
        if not session.locks[node_id]:
            del session.locks[node_id]
            del session.locked_since[node_id]
        return p.Ok(id=m.id)

    def _load(self, m: p.Load) -> Future:
        session = self._session(m.session)
        node = self._node(session, m.node)
        if session.locks.get(node.node_id, 0) <= 0:
            raise LockUnderflow(f"this session holds no lock on node {m.node}: lock it before loading it")
        future = session.manager.load(node, session.pool_id)
        out: Future = Future()

        def done(f: Future) -> None:
            error = f.exception()
            if error is not None:
                out.set_exception(error)
                return
            r = f.result()
            out.set_result(p.LoadReply(id=0, node=self.handle_for(session, r.node),
                                       device_pages=r.device_pages.tobytes(), loaded_pages=r.num_loaded_pages,
                                       wait=[tuple(t) for t in r.wait]))

        future.add_done_callback(done)
        return out

    def _alloc(self, m: p.Alloc) -> p.AllocReply:
        session = self._session(m.session)
        capacity = session.manager.num_pages(session.pool_id)
        if not 0 <= m.num_pages <= capacity:
            raise InvalidArgument(f"num_pages must be in [0, {capacity}]")
        pages = session.manager.alloc(session.pool_id, m.num_pages)
        if pages is None:
            return p.AllocReply(id=m.id, pages=b"")
        session.private.update(pages.tolist())
        return p.AllocReply(id=m.id, pages=pages.tobytes())

    def _page_ids(self, session: Session, data: bytes) -> np.ndarray:
        return session.manager.page_ids(session.pool_id, data)

    def _insert(self, m: p.Insert) -> p.InsertReply:
        session = self._session(m.session)
        tokens = self._tokens(m.tokens)
        pages = self._page_ids(session, m.pages)
        if len(pages) != len(tokens) // TOKEN_BYTES // session.manager.spec.page_size:
            raise InvalidArgument("one page id per whole page of tokens")
        reply = self._sharing_for(m.extra_key).insert(self, session, self._namespace(session, m.extra_key),
                                                      tokens, pages)
        reply.id = m.id
        return reply

    def release_pages(self, session: Session, pages: np.ndarray) -> None:
        foreign = [int(x) for x in pages.tolist() if int(x) not in session.private]
        if foreign:
            raise InvalidArgument(f"page {foreign[0]} is not a private page of this session")
        session.manager.release(session.pool_id, pages)
        session.private.difference_update(pages.tolist())

    def _release(self, m: p.Release) -> p.Ok:
        session = self._session(m.session)
        self.release_pages(session, self._page_ids(session, m.pages))
        return p.Ok(id=m.id)

    def _heartbeat(self, m: p.Heartbeat) -> p.Ok:
        self._session(m.session, registered=False)
        return p.Ok(id=m.id)

    def _bye(self, m: p.Bye) -> p.Ok:
        self.end_session(self._session(m.session, registered=False), "bye")
        return p.Ok(id=m.id)

    # ------------------------------------------------------------------ admin

    def stats(self) -> dict[str, Any]:
        self.settle()  # the counts of requests answered since the last idle moment
        out: dict[str, Any] = {
            "version": __version__,
            "uptime_s": self.clock() - self.started,
            "sessions": len(self.sessions),
            "draining": self.draining,
            "requests": {f"{op}/{status}": n for (op, status), n in sorted(self.counts.items())},
            "specs": {},
        }
        for fingerprint, manager in self.managers.items():
            out["specs"][fingerprint.hex()] = {
                tier: account._asdict() for tier, account in manager.accounting().items()
            } | {"nodes": len(manager.tree)}
        if self.storage is not None:
            out["storage"] = self.storage.stats()._asdict()
        return out

    def _stats(self, m: p.Stats) -> p.StatsReply:
        return p.StatsReply(id=m.id, stats=self.stats())

    def _health(self, m: p.Health) -> p.HealthReply:
        return p.HealthReply(id=m.id, state="draining" if self.draining else "serving",
                             sessions=len(self.sessions), uptime_s=self.clock() - self.started, version=__version__)

    def _flush(self, m: p.Flush) -> Future:
        for manager in self.managers.values():
            manager.persist()
        return self.when_idle(lambda: p.Ok(id=m.id))

    def _check(self, m: p.Check) -> p.Ok:
        for manager in self.managers.values():
            manager.check_invariants()
        if self.storage is not None and hasattr(self.storage, "check_invariants"):
            self.storage.check_invariants()
        for session in self.sessions.values():
            if session.manager is not None:
                account = session.manager.accounting()[f"device:{session.pool_id}"]
                assert account.private == len(session.private), (session.session_id, account, len(session.private))
        return p.Ok(id=m.id)

    # ------------------------------------------------------------------ driving

    def when_idle(self, make_reply: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._idle_list.append((future, make_reply))
        return future

    def refresh_snapshot(self) -> None:
        """The figures the metrics collector serves, copied on the owner thread (the
        scrape runs on the HTTP thread and must not walk live structures)."""
        pages: dict[str, dict[str, int]] = {tier: dict.fromkeys(TierAccount._fields, 0)
                                            for tier in ("device", "host", "disk")}
        for manager in self.managers.values():
            for name, account in manager.accounting().items():
                tier = pages["device" if name.startswith("device:") else name]
                for state, value in account._asdict().items():
                    tier[state] += value
        storage = self.storage.stats()._asdict() if self.storage is not None else None
        mode = "gpu" if any(pool.device.type == "cuda" for m in self.managers.values() for pool in m.device_pools())\
            else "cpu"
        oldest = min((t for session in self.sessions.values() for t in session.locked_since.values()), default=None)
        self._snapshot = {
            "pages": pages, "sessions": len(self.sessions), "storage": storage,
            "oldest_lock_s": 0.0 if oldest is None else self.clock() - oldest,
            "build": {"version": __version__, "protocol_version": p.PROTOCOL_VERSION, "mode": mode},
        }

    def poll(self, timeout_s: float = 0.0) -> int:
        """Run transfer completions and timers, expire leases, answer idle waiters, and
        take a slice of a background rebuild."""
        ran = self.completions.drain(timeout_s)
        for manager in self.managers.values():
            ran += manager.poll(0)
        self.expire_leases()
        now = self.clock()
        if now >= self._next_snapshot:
            self._next_snapshot = now + _SNAPSHOT_S
            self.refresh_snapshot()
        if self._idle_list and all(m.idle() for m in self.managers.values()):
            if self.storage is not None:
                self.storage.flush()
            waiters, self._idle_list = self._idle_list, []
            for future, make_reply in waiters:
                future.set_result(make_reply())
        if self._rebuilds:
            self._run_rebuild()
        return ran

    def drain(self) -> None:
        """Stop taking sessions, finish the transfers in flight, write host pages to
        disk per policy, and wait for those writes. Finishing first matters: a backup
        still in flight becomes host pages only when it completes, and would otherwise
        miss the disk."""
        self.draining = True
        deadline = self.clock() + self.config.server.drain_timeout_s
        self._flush_all(deadline)
        for manager in self.managers.values():
            manager.persist()
        self._flush_all(deadline)

    def _flush_all(self, deadline: float) -> None:
        for manager in self.managers.values():
            remaining = max(0.0, deadline - self.clock())
            try:
                manager.flush(timeout_s=remaining)
            except TimeoutError:
                logger.warning("drain timed out with transfers in flight")

    def close(self) -> None:
        for rebuild in self._rebuilds.values():
            rebuild.manager.close()
            for _, answer in rebuild.waiting:
                answer(Draining("the daemon shut down before the spec's disk tier was rebuilt"))
        self._rebuilds.clear()
        self._resume_gc()
        for session in list(self.sessions.values()):
            self.end_session(session, "shutdown")
        for manager in self.managers.values():
            manager.poll()
            manager.close()
        if self.storage is not None:
            self.storage.close()
        if self.fds is not None:
            self.fds.close()

