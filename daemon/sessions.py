"""Sessions: who is connected, what each holds, and for how long.

``hello`` opens a session (its id is a random 63-bit token, usable only from the
ZeroMQ connection that said hello: another peer naming it is told there is no such
session — save its own engine's next ``hello``, which names it to end it: see
:meth:`Sessions.replace`), ``register`` attaches the engine's device pool, and from
then on the session holds node locks, and private pages in its pool (the tier manager
keeps those: each pool belongs to exactly one session). An unregistered session lives
``server.register_within_s`` at most, and each peer (a user on ``ipc://``, an address on
``tcp://``; on a CURVE connection, that and the identity its key is, so that one
identity's sessions never count against another's behind the same address) may hold
``server.max_unregistered_per_peer`` of them; an identity holds at most its
``max_sessions`` sessions, registered or not (see :mod:`hicache.daemon.auth`). Every request of a
registered session renews its lease, and a request still waiting for its answer keeps
it; ``bye``, an expired lease (a killed engine), its engine's next ``hello`` (its
client gave up on it) or a drain ends it: its locks are released and its pool retired
— its private pages freed and the pool unmapped once no transfer uses it. Logs name a
session by a serial number, never by its id.

Node handles are capabilities: each session gets its own random handle for a node,
from its own ``match`` / ``insert`` / ``load``, and only that session can use it — any
other value, another session's handle included, is ``UNKNOWN_NODE``.
"""

from __future__ import annotations

import array
import itertools
import logging
import os
import secrets
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from hicache.config import ServerConfig
from hicache.daemon.auth import Identity
from hicache.errors import (
    InvalidArgument,
    InvariantBroken,
    LockUnderflow,
    ResourceExhausted,
    UnknownNode,
    UnknownSession,
)
from hicache.keys import NamespaceId
from hicache.tiers import TierManager
from hicache.tree import Node, PoolId

logger = logging.getLogger(__name__)

_LEASE_CHECK_S = 0.05  # leases are checked this often (they end at most this late)
_MAX_HANDLES = 1 << 16  # node handles a session keeps before the oldest unlocked ones are dropped


@dataclass(frozen=True)
class PeerCreds:
    """Who is at the other end of a connection, as the transport tells it: the user,
    group and process on ``ipc://``; nothing (``None``) on ``tcp://``."""

    uid: int | None
    gid: int | None
    pid: int | None
    # What the per-peer limits count by: the user on ipc://, the address on tcp://; on a
    # CURVE connection, with the identity (whose key proves it, unlike an address).
    key: str
    identity: Identity | None = None  # who the ZAP handler admitted (None: handled without a socket)
    mechanism: str = "NULL"  # CURVE or NULL
    public_key: bytes = b""  # CURVE: the client's key (Z85)
    host: str = ""  # tcp://: the peer's numeric address

    @classmethod
    def parse(cls, address: str, identity: Identity | None = None, mechanism: str = "NULL",
              public_key: bytes = b"") -> "PeerCreds":
        """libzmq's ``Peer-Address``: ``localhost:<uid>:<gid>:<pid>`` on ipc://, the
        numeric host on tcp://."""
        proven = f" as {identity.name}" if mechanism == "CURVE" and identity is not None else ""
        if address.startswith("localhost:"):
            parts = address.split(":")[1:]
            if len(parts) == 3 and all(part.isdigit() for part in parts):
                uid, gid, pid = map(int, parts)
                return cls(uid, gid, pid, f"uid:{uid}{proven}", identity, mechanism, public_key)
        return cls(None, None, None, f"{address}{proven}", identity, mechanism, public_key, address)

    @property
    def address(self) -> str:
        if self.uid is not None:
            return f"localhost:{self.uid}:{self.gid}:{self.pid}"
        return self.host or self.key


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
    pool_id: PoolId = PoolId(-1)
    locks: Counter = field(default_factory=Counter)  # node id -> locks this session holds
    locked_since: dict[int, float] = field(default_factory=dict)  # node id -> when its first lock was taken
    namespaces: dict[tuple, tuple] = field(default_factory=dict)  # (tenant, extra key) -> (namespace, its tenant)
    registering: bool = False  # a register waits for its spec's disk tier to be rebuilt
    handles: dict[int, int] = field(default_factory=dict)  # handle -> node id, oldest first
    handle_of: dict[int, int] = field(default_factory=dict)  # node id -> handle
    waiting: int = 0  # requests answered later (a load from disk): the engine is alive
    owner: "Session | None" = None  # attached to another session's engine-owned pool: that session
    attached: list["Session"] = field(default_factory=list)  # the sessions attached to this one's pool
    published: list[bytes] = field(default_factory=list)  # tokens of descriptors published for its engine


class Sessions(Mapping[int, Session]):
    """The open sessions by id, with their leases, locks and node handles. Owner thread
    only."""

    def __init__(self, config: ServerConfig, *, clock: Callable[[], float], metrics) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.lease_s = config.lease_s
        self._by_id: dict[int, Session] = {}
        self._serials = itertools.count(1)
        self.unregistered: Counter = Counter()  # peer key -> its sessions not registered yet
        self.identity_locks: Counter = Counter()  # identity name -> locks its sessions hold
        self.identity_sessions: Counter = Counter()  # identity name -> its open sessions
        self._random: Iterator[int] = iter(())
        self.next_lease_check = 0.0
        self.on_ended: Callable[[Session], None] = lambda session: None  # after a session ended

    def __getitem__(self, session_id: int) -> Session:
        return self._by_id[session_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, peer: bytes, creds: PeerCreds, client: str, pid: int) -> Session:
        """A new, unregistered session for the connection ``peer``, within the limits
        on sessions, on its identity's and on a peer's unregistered ones."""
        config = self.config
        identity = creds.identity
        if identity is not None and identity.max_sessions:
            if self.identity_sessions[identity.name] >= identity.max_sessions:
                self.metrics.quota_refused(identity.name, "sessions")
                raise ResourceExhausted(f"identity {identity.name!r} holds its {identity.max_sessions} sessions "
                                        f"(max_sessions): end some first")
        if len(self._by_id) >= config.max_sessions:
            raise ResourceExhausted(f"too many sessions ({config.max_sessions})")
        if self.unregistered[creds.key] >= config.max_unregistered_per_peer:
            raise ResourceExhausted(f"this peer has {config.max_unregistered_per_peer} sessions that "
                                    f"have not registered; register them or let them lapse")
        session_id = secrets.randbits(63)
        while session_id in self._by_id or not session_id:
            session_id = secrets.randbits(63)
        session = Session(session_id, next(self._serials), client[:200], pid,
                          self.clock() + config.register_within_s, peer=peer, creds=creds)
        self._by_id[session_id] = session
        self.unregistered[creds.key] += 1
        if identity is not None:
            self.identity_sessions[identity.name] += 1
        logger.info("session #%d opened by %r (pid %d, peer %s)", session.serial, session.client, pid, creds.key)
        return session

    def for_request(self, session_id: int, peer: bytes, *, registered: bool = True) -> Session:
        """The session, which must have said hello on the connection ``peer``; renews a
        registered session's lease."""
        session = self._by_id.get(session_id)
        if session is None or session.peer != peer:
            raise UnknownSession("no such session on this connection (expired, or the daemon restarted)")
        if session.manager is not None:
            session.lease_deadline = self.clock() + self.lease_s
        elif registered:
            raise InvalidArgument("register the engine's pool first")
        return session

    def attach(self, session: Session, manager: TierManager, pool_id: PoolId, *,
               owner: Session | None = None) -> None:
        """The session's pool has joined ``manager`` — or, with ``owner``, the session
        joins ``owner``'s engine-owned pool: it is registered."""
        self._registered_or_gone(session)
        session.manager, session.pool_id = manager, pool_id
        if owner is not None:
            session.owner = owner
            owner.attached.append(session)

    def owner_of(self, manager: TierManager, pool_id: PoolId) -> Session | None:
        """The session that registered this pool."""
        for session in self._by_id.values():
            if session.manager is manager and session.pool_id == pool_id and session.owner is None:
                return session
        return None

    def replace(self, session_id: int, creds: PeerCreds, pid: int) -> None:
        """A ``hello`` naming the session its engine gave up on (a call not answered in
        time drops the client's connection, and the ``bye`` with it): end that session
        now, as its lease's end would, so that the engine registers its pool again at
        once — its memory, or its engine-owned pool's name, is the old session's until
        then. Only from the engine that opened it: the id is a secret only its client
        was told, and the hello must come from the same process (as the client says,
        and on ``ipc://`` as the transport tells: its user and pid) and the same peer
        and identity. Any other id ends nothing, and the hello is answered alike."""
        old = self._by_id.get(session_id)
        if old is None or old.pid != pid:
            return
        was = old.creds
        if (was.key, was.uid, was.pid, _identity(was)) != (creds.key, creds.uid, creds.pid, _identity(creds)):
            return
        self.end(old, "replaced")

    def _registered_or_gone(self, session: Session) -> None:
        """The session no longer counts against its peer's unregistered sessions."""
        key = session.creds.key
        self.unregistered[key] -= 1
        if self.unregistered[key] <= 0:
            del self.unregistered[key]

    def any_registered(self) -> bool:
        return any(s.manager is not None for s in self._by_id.values())

    def end(self, session: Session, reason: str) -> None:
        """Give back everything the session held. ``reason``: bye, lease_expired, replaced,
        shutdown, revoked (and pool_gone, for the sessions attached to its pool)."""
        if self._by_id.get(session.session_id) is not session:
            return
        for attached in list(session.attached):  # they use this session's pool: they go first
            self.end(attached, reason if reason == "shutdown" else "pool_gone")
        del self._by_id[session.session_id]
        identity = session.creds.identity
        if identity is not None:
            self.identity_sessions[identity.name] -= 1
            if self.identity_sessions[identity.name] <= 0:
                del self.identity_sessions[identity.name]
        self.metrics.session_ended(reason)
        manager = session.manager
        num_private = 0
        if manager is None:
            self._registered_or_gone(session)
        else:
            for node_id, count in session.locks.items():
                node = manager.find(node_id)
                for _ in range(count):
                    manager.unlock(node, session.pool_id)
                self._count_unlocks(session, count)
            if session.owner is not None:
                session.owner.attached.remove(session)
            else:
                num_private = manager.num_private(session.pool_id)
                manager.retire_pool(session.pool_id)
        logger.info("session #%d ended (%s): %d locks, %d private pages released", session.serial, reason,
                    sum(session.locks.values()), num_private)
        self.on_ended(session)

    def _count_unlocks(self, session: Session, count: int) -> None:
        identity = session.creds.identity
        if identity is not None:
            self.identity_locks[identity.name] -= count
            if self.identity_locks[identity.name] <= 0:
                del self.identity_locks[identity.name]

    def expire(self) -> int:
        """End the sessions whose lease has run out (checked every few milliseconds)."""
        now = self.clock()
        if now < self.next_lease_check:
            return 0
        self.next_lease_check = now + _LEASE_CHECK_S
        expired = [s for s in self._by_id.values() if s.lease_deadline < now and not s.waiting]
        for session in expired:
            self.end(session, "lease_expired")
        return len(expired)

    def hold_lease(self, session: Session) -> None:
        """Its client waits for an answer (sending nothing meanwhile): a full lease from now."""
        session.lease_deadline = max(session.lease_deadline, self.clock() + self.lease_s)

    def extend_leases(self, stalled_s: float) -> None:
        """The loop stalled for ``stalled_s`` (nobody's heartbeat was answered meanwhile):
        the silence was the daemon's, not theirs."""
        for session in self._by_id.values():
            session.lease_deadline += stalled_s

    def oldest_lock_since(self) -> float | None:
        return min((t for session in self._by_id.values() for t in session.locked_since.values()), default=None)

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

    def node(self, session: Session, handle: int) -> Node:
        """The node behind one of this session's handles."""
        node_id = session.handles.get(handle)
        node = None if node_id is None else session.manager.find(node_id)
        if node is None:
            if node_id is not None:  # the node has left the tree: so does its handle
                del session.handle_of[session.handles.pop(handle)]
            raise UnknownNode(f"no node {handle} (evicted, or never returned to this session)")
        return node

    def lock(self, session: Session, node: Node) -> None:
        identity = session.creds.identity
        if identity is not None and identity.max_locks:
            if self.identity_locks[identity.name] >= identity.max_locks:
                self.metrics.quota_refused(identity.name, "locks")
                raise ResourceExhausted(f"identity {identity.name!r} holds its {identity.max_locks} locks "
                                        f"(max_locks): unlock some first")
        session.manager.lock(node, session.pool_id)
        if identity is not None:
            self.identity_locks[identity.name] += 1
        session.locks[node.node_id] += 1
        session.locked_since.setdefault(node.node_id, self.clock())

    def unlock(self, session: Session, node: Node, handle: int) -> None:
        node_id = node.node_id
        if session.locks.get(node_id, 0) <= 0:
            raise LockUnderflow(f"this session holds no lock on node {handle}")
        session.manager.unlock(node, session.pool_id)
        self._count_unlocks(session, 1)
        session.locks[node_id] -= 1
        if not session.locks[node_id]:
            del session.locks[node_id]
            del session.locked_since[node_id]

    @staticmethod
    def require_lock(session: Session, node: Node, handle: int) -> None:
        if session.locks.get(node.node_id, 0) <= 0:
            raise LockUnderflow(f"this session holds no lock on node {handle}: lock it before loading it")

    def check_invariants(self) -> None:
        """The sessions' own bookkeeping; raises :class:`InvariantBroken` naming the
        first broken invariant."""
        held = Counter()
        for s in self._by_id.values():
            if s.creds.identity is not None and s.locks:
                held[s.creds.identity.name] += sum(s.locks.values())
        if held != self.identity_locks:
            raise InvariantBroken(f"locks per identity: counted {dict(self.identity_locks)}, held {dict(held)}")
        opened = Counter(s.creds.identity.name for s in self._by_id.values() if s.creds.identity is not None)
        if opened != self.identity_sessions:
            raise InvariantBroken(f"sessions per identity: counted {dict(self.identity_sessions)}, "
                                  f"open {dict(opened)}")
        waiting = Counter(s.creds.key for s in self._by_id.values() if s.manager is None)
        if waiting != self.unregistered:
            raise InvariantBroken(f"unregistered sessions per peer: counted {dict(self.unregistered)}, "
                                  f"open {dict(waiting)}")
        for session in self._by_id.values():
            name = f"session #{session.serial}"
            if set(session.locks) != set(session.locked_since) or any(n <= 0 for n in session.locks.values()):
                raise InvariantBroken(f"{name}: its lock counts and lock times disagree")
            if len(session.handles) != len(session.handle_of) or any(
                    session.handle_of.get(node_id) != handle for handle, node_id in session.handles.items()):
                raise InvariantBroken(f"{name}: its handles and nodes are not one-to-one")
            if session.manager is None:
                if session.locks:
                    raise InvariantBroken(f"{name} holds locks without a registered pool")
                continue
            for node_id in session.locks:
                if session.manager.find(node_id) is None:
                    raise InvariantBroken(f"{name} holds a lock on node {node_id}, which left the tree")


def _identity(creds: PeerCreds) -> str | None:
    return None if creds.identity is None else creds.identity.name
