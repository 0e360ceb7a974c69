"""The daemon's request handling: decoded requests in, replies (or futures of replies) out.

:class:`Daemon` dispatches each request to its handler on the owner thread;
:mod:`hicache.daemon.server` moves bytes. Keeping the two apart lets tests drive every
request path without sockets. Beside this module: sessions, leases, locks and node
handles (:mod:`hicache.daemon.sessions`); the spec -> tier manager registry and its
disk-tier rebuilds (:mod:`hicache.daemon.specs`); ``register``
(:mod:`hicache.daemon.registration`); the cache operations of a registered session
(:mod:`hicache.daemon.cache_ops`) and prefix sharing on or off
(:mod:`hicache.daemon.sharing`); the reported figures (:mod:`hicache.daemon.snapshot`).
Here: the session lifecycle requests, the administrative ones, and driving the loop.

Validation happens before anything changes: types at decode time (msgspec), then sizes,
ranges and ownership in the handlers. Errors come back as ``Error`` replies with a
stable code and a message; a request that fails changes nothing (a refused
``register`` leaves the session as it was).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq

from hicache import __version__
from hicache import protocol as p
from hicache.config import AuthConfig, DaemonConfig, check_name
from hicache.daemon import snapshot
from hicache.daemon.auth import Identity, IdentityTable
from hicache.daemon.cache_ops import MAX_EXTRA_KEY, CacheOps
from hicache.daemon.kv_events import KvEvents
from hicache.daemon.registration import Registrar
from hicache.daemon.sessions import LOCAL, PeerCreds, Session, Sessions
from hicache.daemon.specs import Specs
from hicache.daemon.check_thread import CheckThread, broken
from hicache.daemon.tenant_log import TenantLog
from hicache.errors import (
    Draining,
    ErrorCode,
    HicacheError,
    InvalidArgument,
    InvariantBroken,
    PermissionDenied,
    ResourceExhausted,
    StorageUnavailable,
    VersionMismatch,
)
from hicache.fdpass import FdExchange
from hicache.jobs import Completions, when_all
from hicache.keys import namespace_id
from hicache.metrics import Metrics, NullMetrics

if TYPE_CHECKING:
    from hicache.daemon.events import EventPublisher
    from hicache.tiers.manager import TierManager
    from hicache.tree import PoolId

__all__ = ["LOCAL", "Daemon", "PeerCreds"]

logger = logging.getLogger(__name__)

# Transfer completions run per loop turn at most: each is O(nodes) to O(pages of one
# transfer), so a request arriving behind a backlog waits for one slice, not for all.
# (32 a slice: loop steps of up to ~40 ms in bench_scale were catch-ups; 8: the slowest
# lock 29 ms in one run against 33 and 43 in two with 32.)
COMPLETIONS_PER_POLL = 8
_UNRATED_OPS = frozenset({"heartbeat", "bye", "health"})  # never refused for an identity's request rate
_ADMIN_OPS = frozenset({"stats", "flush", "check", "reload", "purge"})
# Closing after a drain that used all of its time still gets this long: what is left to
# wait for then is the store's last commit and idle threads ending (milliseconds), unless
# something hangs.
_CLOSE_GRACE_S = 5.0
# How long the KV events' last batches (AllBlocksCleared for every stream) may take to
# reach subscribers that are behind, within the stop's deadline: a router that missed
# them keeps routing to this daemon. Bounded apart from the deadline too, so that a
# subscriber that no longer reads (a router host gone without closing its connection)
# does not hold every stop to its deadline.
_EVENTS_LINGER_S = 5.0


def _as_error(exc: BaseException) -> HicacheError:
    """What a request that raised ``exc`` is answered with (never INTERNAL for what is
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
        remote=None,
        completions: Completions | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | NullMetrics | None = None,
        fds: FdExchange | None = None,
        bind_events: bool = True,
    ) -> None:
        """``fds``: the descriptor socket engines offer their CPU pools on (without
        one, only CUDA pools can register); closed with the daemon. ``bind_events``:
        False leaves the KV events sockets to :meth:`bind_events` (the server's).
        ``metrics``: by default counted whether or not ``[metrics]`` serves them —
        ``stats`` reports the losses they count."""
        self.config = config
        self.fds = fds
        if metrics is None:
            metrics = Metrics()
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
        self._check_thread = CheckThread(storage, self.completions)  # (check's long parts)
        if remote is None and config.remote.enabled:
            from hicache.storage.mooncake_backend import MooncakeBackend

            # Joined on first use, retried while the master is unreachable: a daemon
            # starts, and serves from its own tiers, whether or not the fleet's store is up.
            remote = MooncakeBackend(config.remote.store_config(), lazy=True)
        self.remote = remote
        self.sessions = Sessions(config.server, clock=clock, metrics=metrics)
        # (what is kept across restarts besides the pages: next to them, when there is a disk tier)
        self._state_dir = config.disk.store_path if config.disk.enabled and storage is not None else None
        self.tenant_log = TenantLog(self._state_dir / "tenants" if self._state_dir is not None else None,
                                    config.disk.tenant_namespaces, extra_keys=config.events.enabled, clock=clock)
        # Called now and then during long work on the owner thread at a spec's first
        # registration (pinning its host pool, rebuilding its disk tier) with a count
        # of what is done; the server feeds the systemd watchdog from it.
        self.keepalive: Callable[[int], None] = lambda done: None
        self.specs = Specs(config, storage=storage, remote=remote, completions=self.completions, clock=clock, metrics=metrics,
                           progress=lambda done: self.keepalive(done), tenant_of=self.tenant_log.tenants_of)
        self.managers = self.specs.managers  # spec fingerprint -> its tier manager, serving
        # The connection the request being handled came from (its routing id), and how to
        # learn who is at its other end: the server's (tests without sockets: LOCAL).
        self._peer = b""
        self.peer_creds: Callable[[bytes], PeerCreds] = lambda peer: LOCAL
        # Who may connect and what each may do (see hicache.daemon.auth); replaced by a
        # reload. ``reload_source`` reads the [auth] section anew (the server's: its file).
        self.identities = self._table(config.auth)
        self.reload_source: Callable[[], AuthConfig] | None = None
        self.on_reload: Callable[[IdentityTable], None] = lambda table: None
        self._buckets: dict[str, list[float]] = {}  # identity -> [tokens, refilled at]
        metrics.identities(self.identities.by_name)
        self.draining = False
        self.counts: Counter = Counter()  # (op, status) -> requests, for stats
        self._idle_list: list[tuple[Future, Callable[[], Any]]] = []
        self._unsettled: list[tuple[Callable[..., None], tuple]] = []  # see answer()
        self.registrar = Registrar(self.sessions, self.specs, lambda: self.fds, clock,
                                   max_pool_pages=config.server.max_pool_pages)
        self.sessions.on_ended = self.registrar.session_ended
        self.events: KvEvents | None = None
        if bind_events:
            self.bind_events()
        ops = CacheOps(config, self.sessions, metrics, session_of=self._session,
                       defer=lambda fn, args: self._unsettled.append((fn, args)), identities=lambda: self.identities,
                       tenant_log=self.tenant_log,
                       on_namespace=self._namespace_made if config.events.enabled else None)
        handlers: dict[type, Callable[[Any], Any]] = {
            p.Hello: self._hello, p.Register: self._register, p.Attach: self._attach, p.Match: ops.match,
            p.MatchMany: ops.match_many, p.Lock: ops.lock, p.Unlock: ops.unlock,
            p.Load: ops.load, p.Alloc: ops.alloc, p.Insert: ops.insert,
            p.Release: ops.release, p.Store: ops.store, p.LoadInto: ops.load_into,
            p.Heartbeat: self._heartbeat, p.Bye: self._bye,
            p.Stats: self._stats, p.Health: self._health, p.Flush: self._flush, p.Check: self._check,
            p.Reload: self._reload, p.Purge: self._purge,
        }
        # request type -> (handler, op name): one lookup on the request path
        self._handlers: dict[type, tuple[Callable[[Any], Any], str]] = {
            cls: (fn, cls.__struct_config__.tag) for cls, fn in handlers.items()}
        self.refresh_snapshot()
        self.metrics.add_state_collector(lambda: self._snapshot)

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
            if self.identities.rated and op not in _UNRATED_OPS:
                self._admit(op)
            elif op in _ADMIN_OPS:
                self._require_admin(op)
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

    def dropped_message(self, stalled_s: float) -> None:
        """The server dropped a message whose envelope was over the bounds, reading it
        for ``stalled_s``: counted like a request of op ``envelope`` and status
        ``DROPPED``; nobody was answered meanwhile, so every lease is extended by it."""
        self._count("envelope", "DROPPED", 0.0)
        self.sessions.extend_leases(stalled_s)

    def error_reply(self, request_id: int, exc: HicacheError) -> p.Error:
        self._count("decode", exc.code.name, 0.0)
        return p.Error(id=request_id, code=int(exc.code), message=exc.message)

    def undecodable(self, payload: bytes, exc: p.ProtocolError) -> p.Error:
        """The reply to a message that did not decode. A ``register`` refused here drops
        the descriptors it named, as one refused after decoding does (a client retrying
        it would otherwise fill its user's waiting offers)."""
        self.registrar.drop_offers(p.register_tokens(payload))
        return self.error_reply(p.request_id(payload), exc)

    def _chain(self, future: Future, request_id: int, op: str, start: float, session: Session | None) -> Future:
        out: Future = Future()
        counted = session is not None and not future.done()
        if counted:
            session.waiting += 1  # its engine waits for this answer: its lease holds meanwhile

        def done(f: Future) -> None:
            if counted:
                session.waiting -= 1
                self.sessions.hold_lease(session)
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

    @staticmethod
    def _table(auth: AuthConfig) -> IdentityTable:
        try:
            return IdentityTable(auth)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    def creds(self, peer: bytes) -> PeerCreds:
        """Who is at the other end of ``peer``, with its identity (requests handled
        without a socket: this process's user's, or the default identity)."""
        creds = self.peer_creds(peer)
        if creds.identity is None:
            if creds.mechanism == "NONE":  # a connection the server does not know: nobody
                raise PermissionDenied("this connection is not admitted")
            uid = os.getuid() if creds.uid is None else creds.uid
            gid = os.getgid() if creds.gid is None else creds.gid
            identity = self.identities.local(uid, gid)
            if identity is None:
                raise PermissionDenied("no identity for this peer")
            creds = dataclasses.replace(creds, identity=identity)
        return creds

    def _require_admin(self, op: str) -> Identity:
        identity = self.creds(self._peer).identity
        if not identity.admin:
            raise PermissionDenied(f"{op} is for administrators; identity {identity.name!r} is not one")
        return identity

    def _admit(self, op: str) -> None:
        """The request rate of the peer's identity (a token bucket holding one second's
        worth), and the administrative ops' check."""
        identity = self._require_admin(op) if op in _ADMIN_OPS else self.creds(self._peer).identity
        rate = identity.requests_per_s
        if not rate:
            return
        now = self.clock()
        bucket = self._buckets.get(identity.name)
        if bucket is None:
            bucket = self._buckets[identity.name] = [max(1.0, rate), now]
        tokens = min(max(1.0, rate), bucket[0] + (now - bucket[1]) * rate)
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            self.metrics.quota_refused(identity.name, "requests")
            raise ResourceExhausted(f"identity {identity.name!r} is over its {rate:g} requests/s (requests_per_s)")
        bucket[0] = tokens - 1.0

    def reload_auth(self, auth: AuthConfig) -> tuple[int, int]:
        """Take a new ``[auth]``: the table the ZAP handler and every request use from
        now on; sessions whose identity, key or user it no longer allows end
        (``revoked``), the others see their identity's new tenants and quotas, and the
        KV events' subscribers are admitted anew. Returns
        ``(identities, sessions ended)``."""
        table = self._table(auth)
        ended = 0
        for session in list(self.sessions.values()):
            creds = session.creds
            old = creds.identity
            if old is None:
                continue
            now = table.resolve(creds.mechanism, creds.address, creds.public_key)
            if now is None or now.name != old.name:
                self.sessions.end(session, "revoked")
                ended += 1
                continue
            session.creds = dataclasses.replace(creds, identity=now)
            session.namespaces.clear()  # its tenants may have changed
        self.identities = table
        for manager in self.managers.values():
            manager.set_space_limits(table.space_limits, table)
        self._buckets = {name: b for name, b in self._buckets.items() if name in table.by_name}
        self.metrics.identities(table.by_name)
        self.on_reload(table)
        if self.events is not None:  # its subscribers admitted anew: one no longer allowed reads no more
            self.events.retenant()  # (and a stream whose pool's tenants changed starts over)
            try:
                self.events.publisher.rebind()
            except zmq.ZMQError as exc:
                logger.error("reload: the KV events sockets could not listen again (%s): no events until a "
                             "restart", exc)
            self._set_event_readers(self.events.publisher, table, announce=True)
        logger.info("reloaded [auth]: %d identities, %d sessions ended", len(table.by_name), ended)
        return len(table.by_name), ended

    def _reload(self, m: p.Reload) -> p.ReloadReply:
        if self.reload_source is None:
            raise InvalidArgument("this daemon was started without a configuration file: nothing to reload")
        identities, ended = self.reload_auth(self.reload_source())
        return p.ReloadReply(id=m.id, identities=identities, sessions_ended=ended)

    def _session(self, session_id: int, *, registered: bool = True) -> Session:
        return self.sessions.for_request(session_id, self._peer, registered=registered)

    def _hello(self, m: p.Hello) -> p.HelloReply:
        if m.version != p.PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol {m.version}, this daemon {p.PROTOCOL_VERSION} (hicache {__version__})")
        if self.draining:
            raise Draining("the daemon is shutting down")
        creds = self.creds(self._peer)
        if m.replaces is not p.UNSET:  # (first: the session it ends counts against no limit any more)
            self.sessions.replace(m.replaces, creds, m.pid)
        session = self.sessions.open(self._peer, creds, m.client, m.pid)
        return p.HelloReply(id=m.id, session=session.session_id, version=p.PROTOCOL_VERSION,
                            daemon=f"hicache {__version__}", lease_s=self.sessions.lease_s,
                            fd_socket=str(self.fds.path) if self.fds is not None else "", store_deadlines=True,
                            load_unlocked=True, load_deadlines=True, copy_deadlines=True, device_uuids=True,
                            owned_kv_events=True, owned_counts_tokens=True,
                            max_message_bytes=self.config.server.max_message_bytes, replace_sessions=True)

    def _register(self, m: p.Register) -> p.RegisterReply | Future:
        """See :mod:`hicache.daemon.registration`; a refused one (from any session, or
        none) drops the descriptors it named."""
        try:
            return self.registrar.register(self._session(m.session, registered=False), m)
        except BaseException:
            buffers = m.owned.buffers if m.owned is not p.UNSET else []
            self.registrar.drop_offers([part.token for part in (*m.pools, *buffers) if isinstance(part.token, bytes)])
            raise

    def _attach(self, m: p.Attach) -> p.RegisterReply:
        return self.registrar.attach(self._session(m.session, registered=False), m)

    def _heartbeat(self, m: p.Heartbeat) -> p.Ok:
        self._session(m.session, registered=False)
        return p.Ok(id=m.id)

    def _bye(self, m: p.Bye) -> p.Ok:
        self.sessions.end(self._session(m.session, registered=False), "bye")
        return p.Ok(id=m.id)

    def stats(self) -> p.DaemonStats:
        self.settle()  # the counts of requests answered since the last idle moment
        return snapshot.stats(uptime_s=self.clock() - self.started, sessions=len(self.sessions),
                              draining=self.draining, counts=self.counts, managers=self.managers,
                              storage=self.storage, losses=self.metrics.losses(),
                              events=self.events.stats() if self.events is not None else None,
                              closed_checkpoint_events=self.specs.closed_checkpoint_events)

    def _stats(self, m: p.Stats) -> p.StatsReply:
        return p.StatsReply(id=m.id, stats=self.stats())

    def _health(self, m: p.Health) -> p.HealthReply:
        return p.HealthReply(id=m.id, state="draining" if self.draining else "serving",
                             sessions=len(self.sessions), uptime_s=self.clock() - self.started, version=__version__)

    def _flush(self, m: p.Flush) -> Future:
        started = self.clock()
        written = sum(manager.disk.committed for manager in self.managers.values())
        for manager in self.managers.values():
            manager.persist()

        def reply() -> p.FlushReply:
            totals = Counter()
            for manager in self.managers.values():
                totals.update(manager.durability())
            return p.FlushReply(id=m.id, written_pages=totals["written_pages"] - written,
                                on_disk_pages=totals["on_disk_pages"], not_on_disk_pages=totals["not_on_disk_pages"],
                                deferred_backups=totals["deferred_backups"], seconds=self.clock() - started)

        return self.when_idle(reply)

    def _purge(self, m: p.Purge) -> Future:
        """``purge``: see :meth:`TierManager.purge`; the tenant's namespaces are those
        the tree or the tenant log (namespaces of this node's past: their pages may be
        in the remote tier's store only) know, or the one of ``extra_key`` whether
        known or not (another node may have stored under it). Answered once the remote
        tier's store removed theirs. Refused while a disk tier is being rebuilt (its
        records are not all in the tree yet: some would stay)."""
        tenant = check_name("tenant", m.tenant)
        extra_key = None if m.extra_key is p.UNSET else m.extra_key
        if extra_key is not None and len(extra_key) > MAX_EXTRA_KEY:  # (a string: the decoder checked)
            raise InvalidArgument(f"extra_key must be a string of at most {MAX_EXTRA_KEY} characters")
        if self.specs.rebuilding:
            raise StorageUnavailable("a disk tier is being rebuilt: purge once it is done (see hicache status)")
        totals: Counter = Counter()
        waits: list[tuple[str, int, Future]] = []  # (what, namespaces, its future)
        for manager in self.managers.values():
            namespaces, found = self._namespaces_to_purge(manager.spec.fingerprint, tenant, extra_key, manager.tree)
            totals["namespaces"] += len(found)
            if not namespaces:
                continue
            purged = manager.purge(namespaces)
            totals.update(device=purged.device, host=purged.host, disk=purged.disk, left=purged.left)
            if purged.remote is not None:
                waits.append(("remote", len(namespaces), purged.remote))
        # Specs no manager serves now (the tenant log's): the records of the namespaces it
        # knows are walked for in the store; the remote store is asked for them all.
        on_disk: dict[bytes, set[bytes]] = {}
        remote: set[bytes] = set()
        for fingerprint in self.tenant_log.fingerprints():
            if fingerprint not in self.managers:
                namespaces, found = self._namespaces_to_purge(fingerprint, tenant, extra_key)
                totals["namespaces"] += len(found)
                remote |= namespaces
                if found:
                    on_disk[fingerprint] = found
        if on_disk and self.storage is not None:
            waits.append(("disk", 0, self.specs.store_walks.start(on_disk)))
        if remote and self.remote is not None:
            waits.append(("remote", len(remote), self._remote_purge(remote)))
        what = f"tenant {tenant!r}" + ("" if extra_key is None else f" extra key {extra_key[:64]!r}")
        answer: Future = Future()

        def reply() -> None:
            for kind, count, future in waits:
                error = future.exception()
                if error is None:
                    totals[kind] += future.result()
                elif kind == "remote":
                    totals["remote_left"] += count
                    logger.error("purge of %s: the remote tier's store did not remove %d namespaces' pages: %s",
                                 what, count, error)
                else:
                    answer.set_exception(StorageUnavailable(f"purge of {what}: the store failed: {error}"))
                    return
            for tier in ("device", "host", "disk", "remote"):
                self.metrics.purged(tier, totals[tier])
            logger.warning("purge of %s: %d namespaces, pages dropped %d device, %d host, %d disk, %d from the "
                           "remote store; %d left (held)%s", what, totals["namespaces"], totals["device"],
                           totals["host"], totals["disk"], totals["remote"], totals["left"],
                           f"; {totals['remote_left']} namespaces left in the remote store" if totals["remote_left"]
                           else "")
            answer.set_result(p.PurgeReply(
                id=m.id, namespaces=totals["namespaces"], device_pages=totals["device"], host_pages=totals["host"],
                disk_pages=totals["disk"], remote_pages=totals["remote"], left_pages=totals["left"],
                remote_left_namespaces=totals["remote_left"]))

        # (each future is done on the owner thread: the remote tier's and the walk's completions)
        when_all([future for _, _, future in waits]).add_done_callback(lambda _: reply())
        return answer

    def _namespaces_to_purge(self, fingerprint: bytes, tenant: str, extra_key: str | None,
                             tree=None) -> tuple[set[bytes], set[bytes]]:
        """A purge's namespaces of one spec, and those of them this daemon knows: the
        tenant's in the spec's ``tree`` (``None``: no manager serves it) or the tenant
        log; or the extra key's, known or not."""
        logged = self.tenant_log.tenants_of(fingerprint)
        if extra_key is None:
            namespaces = {ns for ns, t in logged.items() if t == tenant}
            if tree is not None:
                namespaces |= tree.namespaces_of({tenant})
            return namespaces, namespaces
        namespaces = {namespace_id(fingerprint, extra_key or None, tenant)}
        return namespaces, {ns for ns in namespaces if ns in logged or (tree is not None and tree.has_namespace(ns))}

    def _remote_purge(self, namespaces: set[bytes]) -> Future:
        """Purge ``namespaces`` from the remote tier's store, off the owner thread (no
        tier manager's lane serves them); the future is done on the owner thread."""
        done: Future = Future()
        store = self.remote

        def run() -> None:
            try:
                removed = store.purge(sorted(namespaces))
            except Exception as exc:
                self.completions.post(lambda: done.set_exception(exc))
            else:
                self.completions.post(lambda: done.set_result(removed))

        threading.Thread(target=run, name="hicache-purge", daemon=True).start()
        return done

    def _check(self, m: p.Check) -> Future:
        """Every structure's invariants; a broken one is answered as an INTERNAL error
        naming it (the tier manager's and the store's own checks assert: what failed
        is their assertion's line). The tier managers' and the sessions' here, as
        requests leave them — but for their trees, copied here and checked off this
        thread, with the store's walk of every record (see
        :mod:`hicache.daemon.check_thread`): requests are answered meanwhile."""
        deferred: dict[bytes, list] = {}
        try:
            for fingerprint, manager in self.managers.items():
                try:
                    manager.check_invariants(deferred.setdefault(fingerprint, []))
                except AssertionError as exc:
                    raise broken(f"tier manager of spec {fingerprint.hex()}", exc) from None
            self.sessions.check_invariants()
            serving = list(self.managers.values())
            for session in self.sessions.values():
                if session.manager is not None and not any(session.manager is manager for manager in serving):
                    raise InvariantBroken(f"session #{session.serial}'s tier manager serves no spec")
        except InvariantBroken as exc:
            logger.error("check: %s", exc.message)
            raise
        reply: Future = Future()
        self._check_thread.ask(deferred).add_done_callback(
            lambda f: reply.set_exception(f.exception()) if f.exception() else reply.set_result(p.Ok(id=m.id)))
        return reply

    def when_idle(self, make_reply: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._idle_list.append((future, make_reply))
        return future

    def bind_events(self, context: zmq.Context | None = None,
                    secure: Callable[[zmq.Socket, str, bytes], None] | None = None) -> None:
        """Bind the KV events sockets ([events]; nothing when off, or bound already).
        ``context`` and ``secure``: the server's context, whose ZAP handler admits the
        subscribers, and its security options (see
        :class:`hicache.daemon.events.EventPublisher`); without them (tests) anyone who
        can open the sockets reads the events."""
        config = self.config
        if not config.events.enabled or self.events is not None:
            return
        from hicache.daemon.events import EventPublisher, StreamLedger

        endpoint, replay = config.events.endpoints(config.server.socket_path)
        # (pool ids, and so topics, count from 1 again after a restart: see StreamLedger)
        ledger = StreamLedger(self._state_dir / "events" if self._state_dir is not None else None)
        publisher = EventPublisher(endpoint, replay_endpoint=replay, hwm=config.events.hwm,
                                   max_queue_events=config.events.max_queue_events,
                                   buffer_steps=config.events.buffer_steps, context=context, secure=secure,
                                   ledger=ledger)
        self._set_event_readers(publisher, self.identities, announce=True)
        logger.info("KV events on %s (replay: %s)", publisher.endpoint, publisher.replay_endpoint or "none")
        self.events = KvEvents(publisher, config.events.topic, kept=self.tenant_log.extra_key,
                               tenants=self._pool_tenants)

    def _pool_tenants(self, manager: TierManager, pool_id: PoolId) -> frozenset[str] | None:
        """The tenants whose namespaces a pool's engine may use (its registering
        session's identity's): what its KV event stream shows of the host and disk
        tiers. ``None`` (every namespace) while no identities are listed: one tenant."""
        if not self.identities.auth.identities:
            return None
        owner = self.sessions.owner_of(manager, pool_id)
        identity = None if owner is None else owner.creds.identity
        return frozenset() if identity is None else frozenset(identity.tenants)

    def _set_event_readers(self, publisher: EventPublisher, table: IdentityTable, *, announce: bool = False) -> None:
        """Who reads which KV events (see :meth:`EventPublisher.set_readers`): the
        identities that read every stream, and those that read their own tenants'
        streams on sockets of their own (``events_endpoint``)."""
        identities = table.by_name.values() if table.auth.identities else ()
        # (without identities listed: one tenant, and whoever the handler admits reads it all)
        readers = {i.name: i.event_tenants for i in identities if i.reads_events or i.events_endpoint}
        own = {i.name: (i.events_endpoint, i.event_tenants) for i in identities if i.events_endpoint}
        publisher.set_readers(readers if identities else None, own)
        self._restrict_events(publisher)
        if announce:
            for name, endpoint in publisher.own_endpoints.items():
                logger.info("KV events of identity %r on %s", name, endpoint)

    def _restrict_events(self, publisher: EventPublisher) -> None:
        """The events' ipc:// sockets (token ids) no wider open than the server's."""
        for bound in (publisher.endpoint, publisher.replay_endpoint, *publisher.own_endpoints.values()):
            if bound and bound.startswith("ipc://"):
                os.chmod(bound[len("ipc://"):], self.config.server.socket_mode)

    def _namespace_made(self, namespace: bytes, extra_key: str) -> None:
        if self.events is not None:
            self.events.namespace(namespace, extra_key)

    def refresh_snapshot(self) -> None:
        """The figures the metrics collector serves, copied on the owner thread."""
        oldest = self.sessions.oldest_lock_since()
        self._snapshot = snapshot.occupancy(managers=self.managers.values(), sessions=len(self.sessions),
                                            oldest_lock_s=0.0 if oldest is None else self.clock() - oldest,
                                            storage=self.storage,
                                            closed_checkpoint_events=self.specs.closed_checkpoint_events)
        if self.events is not None:
            self._snapshot["events"] = self.events.stats()

    def poll(self, timeout_s: float = 0.0) -> int:
        """Run transfer completions and timers, expire leases, answer idle waiters, and
        take a slice of a background rebuild."""
        # A slice of the completions per turn: the loop answers requests between slices
        # (next_deadline says "now" while some are left).
        ran = self.completions.drain(timeout_s, COMPLETIONS_PER_POLL)
        for manager in self.managers.values():
            ran += manager.poll(0, limit=0)
        if self.events is not None:
            self.events.tick(self.managers)  # (this turn's residency changes: one batch per stream)
        self.sessions.expire()
        now = self.clock()
        if now >= self._next_snapshot:
            self._next_snapshot = now + snapshot.SNAPSHOT_S
            self.refresh_snapshot()
        if self._idle_list and all(m.idle() for m in self.managers.values()):
            if self.storage is not None:
                self.storage.flush()
            waiters, self._idle_list = self._idle_list, []
            for future, make_reply in waiters:
                future.set_result(make_reply())
        if self.specs.rebuilding:
            for session in self.specs.waiting_sessions():  # their clients wait for the answer: no heartbeats
                self.sessions.hold_lease(session)
            self.specs.run_rebuild()
        elif self.specs.store_walks.busy:
            self.specs.store_walks.run_slice()
        if self.tenant_log.wants_compaction and not self.specs.rebuilding:
            self._compact_tenant_log()
        return ran

    def _compact_tenant_log(self) -> None:
        """A tenant is at the tenant log's bound: a walk of the store (between requests)
        finds which of the namespaces the log names hold records; those with a node in
        a tree now hold pages too; the log keeps them (see
        :mod:`hicache.daemon.tenant_log`)."""
        log = self.tenant_log
        walk = self.specs.store_walks.find(log.begin_compaction())

        def walked(_: Future) -> None:  # (on the owner thread: the walk's last slice)
            error = walk.exception()
            if error is not None:
                logger.warning("tenant log compaction: the store could not be walked (%s): nothing dropped", error)
                log.abandon_compaction()
                return
            holding = walk.result()
            for manager in self.specs.all_managers():
                fingerprint = manager.spec.fingerprint
                holding.update((fingerprint, ns) for ns in manager.tree.namespaces_in_use())
            log.compact(holding, self.completions.post)

        walk.add_done_callback(walked)

    def next_deadline(self) -> float | None:
        """When :meth:`poll` next has work of its own (a lease check, a tier manager's
        timer), if ever."""
        if self.specs.rebuilding or self.specs.store_walks.busy or self.completions.pending:
            return self.clock()  # a rebuild's or a store walk's next slice, the next slice of completions
        due = [self.sessions.next_lease_check] if self.sessions else []
        due.extend(t for t in (m.next_timer() for m in self.managers.values()) if t is not None)
        return min(due, default=None)

    def drain(self, deadline: float | None = None) -> None:
        """Stop taking sessions, finish the transfers in flight, write host pages to
        disk per policy, and wait for those writes, until ``deadline`` (on
        :attr:`clock`; default: ``[server].drain_timeout_s`` from now). Finishing first
        matters: a backup still in flight becomes host pages only when it completes,
        and would otherwise miss the disk. The remote tier's calls are waited for only
        after the host pages are written: a store that hangs in a put would take the
        whole drain from the disk."""
        self.draining = True
        if deadline is None:
            deadline = self.clock() + self.config.server.drain_timeout_s
        self._flush_all(deadline, local=True)
        for manager in self.managers.values():
            manager.persist()
        self._flush_all(deadline)
        for fingerprint, manager in self.managers.items():
            figures = manager.durability()
            logger.info("drained spec %s: %d pages on disk, %d written in all, %d cached only on device / host "
                        "(lost at exit), %d backups deferred", fingerprint.hex()[:12], figures["on_disk_pages"],
                        figures["written_pages"], figures["not_on_disk_pages"], figures["deferred_backups"])

    def _flush_all(self, deadline: float, *, local: bool = False) -> None:
        def progress(writing: int, deferred: int) -> None:
            logger.info("draining: %d pages being written, %d more waiting", writing, deferred)
            self.keepalive(0)

        for manager in self.managers.values():
            remaining = max(0.0, deadline - self.clock())
            try:
                manager.flush(timeout_s=remaining, progress=progress, local=local)
            except TimeoutError:
                logger.warning("drain timed out with transfers in flight")

    def close(self, deadline: float | None = None) -> bool:
        """End the sessions, close every spec's tiers, the store and the rest. What
        waits (transfers in flight, the store's last commit, leaving the remote store)
        waits until ``deadline`` (on :attr:`clock`; default: ``[server].drain_timeout_s``
        from now), and at least :data:`_CLOSE_GRACE_S` from now: past it, what has not
        finished is logged — each spec's pages not on disk, lost — and left to the
        process's exit (a storage that hangs must not hold the stop past what systemd
        was told). The KV events' last batches get up to :data:`_EVENTS_LINGER_S` of
        what is left to reach subscribers that are behind. True when everything
        finished and was let go."""
        if deadline is None:
            deadline = self.clock() + self.config.server.drain_timeout_s
        deadline = max(deadline, self.clock() + _CLOSE_GRACE_S)
        closed = self.specs.stop_rebuilds(deadline)
        for session in list(self.sessions.values()):
            self.sessions.end(session, "shutdown")
        for fingerprint, manager in self.managers.items():
            manager.poll()
            if not manager.close(max(0.0, deadline - self.clock())):
                closed = False
                logger.error("spec %s: gave up at the stop's deadline ([server].drain_timeout_s) with transfers in "
                             "flight (%d pages being written to disk): its %d pages not on disk are lost",
                             fingerprint.hex()[:12], manager.disk.pending,
                             manager.durability()["not_on_disk_pages"])
        if self.storage is not None:
            try:
                self.storage.close(max(0.0, deadline - self.clock()))
            except TimeoutError as exc:
                closed = False
                logger.error("gave up closing the store: %s; what it had not committed is lost (the store stays "
                             "consistent)", exc)
        if self.remote is not None:
            try:
                self.remote.close(max(0.0, deadline - self.clock()))
            except TimeoutError as exc:
                closed = False
                logger.error("gave up closing the remote store: %s", exc)
        if self.events is not None:
            self.events.close(min(_EVENTS_LINGER_S, max(0.0, deadline - self.clock())))
        self.tenant_log.close()
        if self.fds is not None:
            self.fds.close()
        return closed
