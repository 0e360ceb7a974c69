"""The cache operations of a registered session: match, match_many, lock, unlock, load,
alloc, insert, release — and, for engine-owned pools, store and load_into.

Each checks its input before anything changes — token buffers whole int32s within
``server.max_tokens``, page ids in the pool's range (whose private pages the tier
manager keeps: releasing a page that is not one of them is INVALID_ARGUMENT), node
handles this session's and live — then works on the session's tier manager and pool.
Hit / miss accounting for the metrics is left for the daemon's next idle moment.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from hicache import protocol as p
from hicache.config import DEFAULT_TENANT, DaemonConfig
from hicache.daemon.sessions import Session, Sessions
from hicache.daemon.sharing import NoSharing, RadixSharing, SharingPolicy
from hicache.errors import DeadlinePassed, InvalidArgument, PermissionDenied
from hicache.keys import TOKEN_BYTES, NamespaceId, namespace_id
from hicache.tiers import Hit
from hicache.tree import Node

MAX_EXTRA_KEY = 1024  # characters
_MAX_NAMESPACES = 4096  # namespaces a session remembers


class CacheOps:
    """The handlers; ``session_of(session_id)`` is the request's registered session
    (its lease renewed), ``defer(fn, args)`` runs bookkeeping later. Owner thread only."""

    def __init__(self, config: DaemonConfig, sessions: Sessions, metrics, *,
                 session_of: Callable[[int], Session], defer: Callable[[Callable[..., None], tuple], None],
                 identities: Callable[[], object] = lambda: None, tenant_log=None,
                 on_namespace: Callable[[bytes, str], None] | None = None,
                 clock_ns: Callable[[], int] = p.monotonic_ns) -> None:
        """``identities()``: the identity table in force (its space limits go to each
        tier manager a session names a namespace on); ``tenant_log``: where the
        namespaces' tenants are kept across restarts; ``on_namespace(namespace, extra
        key)``: told of each namespace a session names (the KV events' extra keys);
        ``clock_ns``: the clock of a store's deadline (the host's ``CLOCK_MONOTONIC``)."""
        self.sessions = sessions
        self._clock_ns = clock_ns
        self._tenant_log = tenant_log
        self._on_namespace = on_namespace
        self._identities = identities
        self.metrics = metrics
        self._session = session_of
        self._defer = defer
        self._max_tokens = config.server.max_tokens
        self._max_token_bytes = config.server.max_tokens * TOKEN_BYTES
        self._max_batch = config.server.max_batch
        # One NoSharing object, whether sharing is off for the daemon or for some keys:
        # ``sharing is self._no_sharing`` tells a miss that was never stored.
        self._no_sharing = NoSharing()
        self._sharing: SharingPolicy = RadixSharing() if config.sharing.enabled else self._no_sharing
        self._no_sharing_keys = frozenset(config.sharing.disabled_extra_keys)

    def _namespace(self, session: Session, extra_key: str, tenant, *, storing: bool = False) -> NamespaceId:
        """The namespace of the session's model, a tenant its identity may use (``UNSET``
        or ``""``: its first) and the extra key; its tenant recorded if it holds pages or
        the request stores (``storing``): see :meth:`_claim`."""
        ns, owner = self._resolve(session, extra_key, tenant)
        if storing and self._sharing_for(extra_key) is not self._no_sharing:
            self._claim(session.manager, ns, owner, extra_key)
            if self._on_namespace is not None:  # (named again: the session resolved it long ago, maybe)
                self._on_namespace(ns, extra_key)
        else:
            self._claim_if_known(session.manager, ns, owner, extra_key)
        return ns

    def _resolve(self, session: Session, extra_key: str, tenant) -> tuple[NamespaceId, str]:
        """``(namespace, its tenant)``, checked against the session's identity."""
        known = session.namespaces.get((tenant, extra_key))
        if known is None:
            if len(extra_key) > MAX_EXTRA_KEY:
                raise InvalidArgument(f"extra_key is longer than {MAX_EXTRA_KEY} characters")
            identity = session.creds.identity
            name = tenant if tenant is not p.UNSET and tenant else ""
            if identity is not None:
                name = name or identity.default_tenant
                if name not in identity.tenants:
                    raise PermissionDenied(f"identity {identity.name!r} may not use tenant {name[:64]!r}")
            manager = session.manager
            ns = namespace_id(manager.spec.fingerprint, extra_key or None, name)
            table = self._identities()
            if table is not None and manager.quotas.source is not table:
                manager.set_space_limits(table.space_limits, table)
            if self._on_namespace is not None:
                self._on_namespace(ns, extra_key)
            if len(session.namespaces) >= _MAX_NAMESPACES:
                session.namespaces.clear()  # a cache: a client naming ever new extra keys does not grow it
            known = session.namespaces[(tenant, extra_key)] = (ns, name or DEFAULT_TENANT)
        return known

    def _claim(self, manager, ns: NamespaceId, tenant: str, extra_key: str) -> None:
        """The namespace's pages count as ``tenant``'s (its quotas, its occupancy), and
        after a restart too (the tenant log, which keeps its ``extra_key`` for the
        restored pages' KV events). Only for a namespace that holds pages or is about
        to: what the tree and the log keep of a namespace they keep for good, and a
        lookup naming ever new extra keys (a per-request salt, a hostile client) must
        leave nothing behind. O(1) when recorded already. The log is told each time: its
        compaction keeps what was named lately (a store under way), and a namespace it
        dropped (no page left) that holds pages again is noted again."""
        manager.assign(ns, tenant)
        if self._tenant_log is not None:
            self._tenant_log.note(manager.spec.fingerprint, ns, tenant, extra_key)

    def _claim_if_known(self, manager, ns: NamespaceId, tenant: str, extra_key: str) -> None:
        """:meth:`_claim` a namespace the tree has (a lookup may bring pages into it:
        from disk, or the remote tier)."""
        if manager.has_namespace(ns):
            self._claim(manager, ns, tenant, extra_key)

    def _tokens(self, tokens: bytes) -> bytes:
        if len(tokens) % TOKEN_BYTES:
            raise InvalidArgument(f"tokens must be packed int32 ({TOKEN_BYTES} bytes each)")
        if len(tokens) > self._max_token_bytes:
            raise InvalidArgument(f"more than {self._max_tokens} tokens in one request")
        return tokens

    def _sharing_for(self, extra_key: str) -> SharingPolicy:
        return self._no_sharing if extra_key in self._no_sharing_keys else self._sharing

    def _account_match(self, session: Session, namespace: NamespaceId, tokens: bytes, hit: Hit | None,
                       sharing_off: bool) -> None:
        """Device tokens served; what a load could not deliver now as missed
        (``no_room``); the rest of the request as missed, with the reason for its first
        missing page."""
        num_tokens = len(tokens) // TOKEN_BYTES
        metrics = session.manager.metrics  # (a TP engine's ranks but the first count no tokens)
        if not metrics.counts_tokens:
            return
        if hit is None or hit.match.node is None:
            metrics.missed("never_stored" if sharing_off else "namespace_unknown", num_tokens)
            return
        m = hit.match
        ps = m.page_size
        # Device pages are served now; host and disk pages count once a load delivers
        # them (the tier manager counts those).
        metrics.matched(m.num_device_pages * ps, 0, 0)
        full = hit.unclipped or m
        if full is not m:
            metrics.missed("no_room", (full.num_pages - m.num_pages) * ps)
        missing = num_tokens - full.num_tokens
        if not missing:
            return
        reason = session.manager.why_missed(namespace, tokens, full)
        metrics.missed(reason, missing)

    def _match_reply(self, session: Session, hit: Hit | None) -> p.MatchReply:
        node = None if hit is None else hit.match.node
        if node is None or node.parent is None:  # unknown namespace, or nothing matched
            return p.MatchReply(id=0, node=-1, device_pages=b"", host_pages=0, disk_pages=0, wait=[])
        m = hit.match
        return p.MatchReply(id=0, node=self.sessions.handle_for(session, node), device_pages=m.device_bytes,
                            host_pages=m.num_host_pages, disk_pages=m.num_disk_pages,
                            wait=[tuple(t) for t in hit.wait] if hit.wait else [],
                            remote_pages=min(hit.remote_pages, m.num_host_pages))

    def match(self, m: p.Match) -> p.MatchReply | Future:
        session = self._session(m.session)
        sharing = self._sharing_for(m.extra_key)
        sharing_off = sharing is self._no_sharing
        namespace, tenant = self._resolve(session, m.extra_key, m.tenant)
        manager = session.manager
        self._claim_if_known(manager, namespace, tenant, m.extra_key)
        tokens = self._tokens(m.tokens)
        hit = sharing.match(manager, namespace, tokens, session.pool_id)
        if isinstance(hit, Future):
            out: Future = Future()

            def answer(f: Future) -> None:
                self._claim_if_known(manager, namespace, tenant, m.extra_key)  # (pages the remote tier brought)
                self._account_match(session, namespace, tokens, f.result(), sharing_off)
                out.set_result(self._match_reply(session, f.result()))

            hit.add_done_callback(answer)
            return out
        self._claim_if_known(manager, namespace, tenant, m.extra_key)
        self._defer(self._account_match, (session, namespace, tokens, hit, sharing_off))
        return self._match_reply(session, hit)

    def match_many(self, m: p.MatchMany) -> p.MatchManyReply:
        session = self._session(m.session)
        if len(m.tokens) > self._max_batch:
            raise InvalidArgument(f"more than {self._max_batch} lookups in one batch")
        ns, tenant = self._resolve(session, m.extra_key, m.tenant)
        self._claim_if_known(session.manager, ns, tenant, m.extra_key)
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
                                         disk_pages=r.disk_pages, wait=r.wait, remote_pages=r.remote_pages))
        self._claim_if_known(session.manager, ns, tenant, m.extra_key)
        return p.MatchManyReply(id=m.id, results=results)

    def _readable(self, session: Session, handle: int) -> Node:
        """The node behind one of the session's handles, if its identity may still use
        the node's tenant: a reload may have taken the tenant from the identity since
        the handle was given (the session lives on), and the handle must not go on
        reaching that tenant's pages. (Unlocking is never refused.) O(1)."""
        node = self.sessions.node(session, handle)
        identity = session.creds.identity
        if identity is not None:
            tenant = session.manager.tenant_of(node.namespace)
            if tenant not in identity.tenants:
                raise PermissionDenied(f"identity {identity.name!r} may no longer use tenant {tenant!r}")
        return node

    def lock(self, m: p.Lock) -> p.Ok:
        session = self._session(m.session)
        self.sessions.lock(session, self._readable(session, m.node))
        return p.Ok(id=m.id)

    def unlock(self, m: p.Unlock) -> p.Ok:
        session = self._session(m.session)
        self.sessions.unlock(session, self.sessions.node(session, m.node), m.node)
        return p.Ok(id=m.id)

    def load(self, m: p.Load) -> Future:
        session = self._session(m.session)
        node = self._readable(session, m.node)
        self.sessions.require_lock(session, node, m.node)
        future = session.manager.load(node, session.pool_id, m.state_slot or None)
        out: Future = Future()

        def done(f: Future) -> None:
            error = f.exception()
            if error is not None:
                out.set_exception(error)
                return
            r = f.result()
            out.set_result(p.LoadReply(id=0, node=self.sessions.handle_for(session, r.node),
                                       device_pages=r.device_pages.tobytes(), loaded_pages=r.num_loaded_pages,
                                       wait=[tuple(t) for t in r.wait], state=r.state))

        future.add_done_callback(done)
        return out

    def alloc(self, m: p.Alloc) -> p.AllocReply:
        session = self._session(m.session)
        capacity = session.manager.num_pages(session.pool_id)
        if not 0 <= m.num_pages <= capacity:
            raise InvalidArgument(f"num_pages must be in [0, {capacity}]")
        pages = session.manager.alloc(session.pool_id, m.num_pages)
        return p.AllocReply(id=m.id, pages=b"" if pages is None else pages.tobytes())

    def insert(self, m: p.Insert) -> p.InsertReply | Future:
        session = self._session(m.session)
        tokens = self._tokens(m.tokens)
        manager = session.manager
        pages = manager.page_ids(session.pool_id, m.pages)
        if len(pages) != len(tokens) // TOKEN_BYTES // manager.spec.page_size:
            raise InvalidArgument("one page id per whole page of tokens")
        manager.check_checkpoints(session.pool_id, len(pages), m.checkpoints)  # (before anything changes)
        manager.check_ends(len(pages), m.ends)
        ends = sorted(set(m.ends) | {n for n, _ in m.checkpoints}) if m.checkpoints else m.ends
        namespace = self._namespace(session, m.extra_key, m.tenant, storing=len(pages) > 0)
        result = self._sharing_for(m.extra_key).insert(manager, session.pool_id, namespace, tokens, pages, ends)
        if result is None:  # not stored: the pages went back to the pool
            return p.InsertReply(id=m.id, node=-1, device_pages=b"", freed=pages.tobytes(), prefix_pages=0)
        reply = p.InsertReply(id=m.id, node=self.sessions.handle_for(session, result.node),
                              device_pages=result.device_pages.tobytes(), freed=result.duplicate_pages.tobytes(),
                              prefix_pages=result.num_prefix_pages)
        if not m.checkpoints:
            return reply
        out: Future = Future()

        def taken(f: Future) -> None:
            reply.checkpoints = f.result()
            out.set_result(reply)

        manager.checkpoint(result.node, session.pool_id, m.checkpoints).add_done_callback(taken)
        return out

    def release(self, m: p.Release) -> p.Ok:
        session = self._session(m.session)
        session.manager.release(session.pool_id, session.manager.page_ids(session.pool_id, m.pages))
        return p.Ok(id=m.id)

    def store(self, m: p.Store) -> Future:
        session = self._session(m.session)
        tokens = self._tokens(m.tokens)
        manager = session.manager
        self._resolve(session, m.extra_key, m.tenant)  # (a tenant the identity may not use: refused first)
        # Checked before the namespace is noted: a refused store leaves nothing behind.
        blocks = manager.store_blocks(session.pool_id, tokens, m.pages)
        if self._sharing_for(m.extra_key) is self._no_sharing:  # nothing is kept for these keys
            self._namespace(session, m.extra_key, m.tenant)
            done: Future = Future()
            done.set_result(p.StoreReply(id=m.id, node=-1, copied=0, cached=0))
            return done
        expired = self._expiry(m.deadline_ns)
        if expired is not None and expired():
            raise DeadlinePassed("store: its deadline passed before it arrived; nothing copied")
        namespace = self._namespace(session, m.extra_key, m.tenant, storing=len(blocks) > 0)
        future = manager.store(namespace, tokens, session.pool_id, blocks, expired=expired)
        out: Future = Future()

        def answer(f: Future) -> None:
            try:
                r = f.result()
                live = r.node is not None and self.sessions.get(session.session_id) is session
                node = self.sessions.handle_for(session, r.node) if live else -1
                out.set_result(p.StoreReply(id=0, node=node, copied=r.num_copied, cached=r.num_cached))
            except BaseException as exc:  # noqa: BLE001 - the request's answer
                out.set_exception(exc)

        future.add_done_callback(answer)
        return out

    def _expiry(self, deadline_ns) -> Callable[[], bool] | None:
        """A request's ``deadline_ns`` as ``expired()``: has its engine stopped waiting,
        now? (``None``: a request without one, whose engine waits for good.)"""
        if deadline_ns is p.UNSET:
            return None
        clock_ns = self._clock_ns
        return lambda: clock_ns() >= deadline_ns

    def load_into(self, m: p.LoadInto) -> Future:
        session = self._session(m.session)
        node = self._readable(session, m.node)
        if m.unlocked is not True:
            self.sessions.require_lock(session, node, m.node)
        future = session.manager.load_into(node, session.pool_id, m.pages, m.first,
                                           expired=self._expiry(m.deadline_ns),
                                           copy_expired=self._expiry(m.copy_deadline_ns))
        out: Future = Future()

        def answer(f: Future) -> None:
            error = f.exception()
            if error is not None:
                out.set_exception(error)
                return
            r = f.result()
            out.set_result(p.LoadIntoReply(id=0, loaded_pages=r.num_loaded, wait=[tuple(t) for t in r.wait]))

        future.add_done_callback(answer)
        return out
