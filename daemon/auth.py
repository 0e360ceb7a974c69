"""Who a client is: identities, and the ZAP handler that admits connections.

Every connection to the daemon's socket is admitted (or not) by a ZAP handler (libzmq's
authentication protocol, RFC 27) before any of its messages reaches the loop:

* a CURVE connection (every ``tcp://`` endpoint; ``ipc://`` too with
  ``[auth].curve_ipc``) is admitted when its client's public key is listed by an
  identity — an unknown key gets nothing, not even ``health``;
* a plain ``ipc://`` connection is known by the Unix user and group of the process at
  the other end (the kernel's, through libzmq): an identity listing that uid or gid,
  else ``[auth].default_identity`` (``""``: refused);
* a plain ``tcp://`` connection (only with ``[auth].insecure_tcp``) is the default
  identity.

The KV events sockets (:mod:`hicache.daemon.events`) are on the server's context and
ask the same handler, in domains of their own: a subscriber is admitted as above, and
then only when its identity may read what the socket carries. The PUB socket
(:data:`EVENTS_ZAP_DOMAIN`) carries every tenant's token ids, and a PUB socket cannot
keep a topic from one subscriber: ``admin`` or ``events`` identities only. An identity
with an ``events_endpoint`` has a PUB socket of its own there (:func:`own_events_domain`:
that identity alone), which carries the streams of its own tenants' engines. The replay
socket (:data:`EVENTS_REPLAY_ZAP_DOMAIN`) admits both kinds; it answers each request by
its connection's identity (the user id below), with the streams that identity reads.

The handler names the admitted connection in its ZAP reply's user id —
``<identity>|<mechanism>|<peer address>|<public key>`` — which libzmq attaches to each
message of the connection. The loop reads it from every message (not once per routing
id: a client may choose its routing id, a departed connection's included) and resolves it
against the current table, so that a reload which drops a key or a user refuses that
connection's next message.

Without an ``[auth]`` section (or with one that lists no identities) the table holds
one identity, ``default`` (tenant ``default``, administrator, no quotas), and every
``ipc://`` peer is it: a daemon configured as before behaves as before. Once identities
are listed, the built-in ``default`` that unlisted local users get (unless
``default_identity`` says otherwise) is no administrator: an operator who lists
identities grants ``admin`` by listing it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.utils.z85 as z85

from hicache.config import DEFAULT_TENANT, AuthConfig, IdentityConfig
from hicache.tiers.quotas import SpaceLimit

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by libzmq: one handler per context
ZAP_DOMAIN = b"hicache"  # set on the router so that plain connections are asked about too
EVENTS_ZAP_DOMAIN = b"hicache-events"  # the KV events PUB socket: admins and identities with events only
EVENTS_REPLAY_ZAP_DOMAIN = b"hicache-events-replay"  # those, and identities with an events_endpoint
_OWN_EVENTS_PREFIX = b"hicache-events@"  # + an identity's name: its own events socket, for it alone
_POLL_MS = 200


@dataclass(frozen=True, eq=False)
class Identity:
    """One ``[[auth.identities]]`` entry, as the daemon uses it."""

    name: str
    tenants: tuple[str, ...]
    admin: bool = False
    max_locks: int = 0
    max_sessions: int = 0  # 0: none beyond [server].max_sessions
    requests_per_s: float = 0.0
    host_pages: int = 0
    disk_pages: int = 0
    keys: frozenset[bytes] = field(default=frozenset())
    events: bool = False
    events_endpoint: str = ""  # its own KV events socket ("": none)

    @classmethod
    def from_config(cls, c: IdentityConfig, max_sessions: int = 0) -> "Identity":
        """``max_sessions``: the default of an identity that names none."""
        return cls(c.name, tuple(c.tenants), c.admin, c.max_locks, c.max_sessions or max_sessions, c.requests_per_s,
                   c.host_pages, c.disk_pages, frozenset(key.encode() for key in c.public_keys), c.events,
                   c.events_endpoint)

    @property
    def reads_events(self) -> bool:
        """May subscribe to the KV events (every tenant's blocks and token ids)."""
        return self.admin or self.events

    @property
    def event_tenants(self) -> frozenset[str] | None:
        """The tenants whose engines' streams it reads on its own events socket and
        replays — ``None``: every stream (:attr:`reads_events`; then its own socket
        carries the same streams as its tenants' only)."""
        return None if self.reads_events else frozenset(self.tenants)

    @property
    def default_tenant(self) -> str:
        return self.tenants[0]


BUILTIN_DEFAULT = Identity(DEFAULT_TENANT, (DEFAULT_TENANT,), admin=True)


class IdentityTable:
    """The identities of one configuration, by what a connection shows. Immutable: a
    reload builds a new table (the ZAP thread reads whichever is current)."""

    def __init__(self, auth: AuthConfig) -> None:
        self.auth = auth
        per_identity = auth.max_sessions_per_identity
        self.by_name: dict[str, Identity] = {c.name: Identity.from_config(c, per_identity) for c in auth.identities}
        if auth.default_identity and auth.default_identity not in self.by_name:
            if auth.default_identity != DEFAULT_TENANT:
                raise ValueError(f"[auth].default_identity {auth.default_identity!r} names no identity")
            # Beside listed identities, the built-in one is one of them: no administrator
            # (every unlisted local user would be one), and no more than its share of the
            # daemon's sessions.
            self.by_name[DEFAULT_TENANT] = (
                dataclasses.replace(BUILTIN_DEFAULT, admin=False, max_sessions=per_identity)
                if auth.identities else BUILTIN_DEFAULT)
        self.default = self.by_name.get(auth.default_identity) if auth.default_identity else None
        self.by_key = {key: identity for identity in self.by_name.values() for key in identity.keys}
        self.rated = any(identity.requests_per_s for identity in self.by_name.values())
        self.by_uid: dict[int, Identity] = {}
        self.by_gid: dict[int, Identity] = {}
        for c in auth.identities:
            for uid in c.uids:
                self.by_uid.setdefault(uid, self.by_name[c.name])
            for gid in c.gids:
                self.by_gid.setdefault(gid, self.by_name[c.name])

    @property
    def space_limits(self) -> tuple[SpaceLimit, ...]:
        """The identities' host / disk page quotas, for the tier managers."""
        return tuple(SpaceLimit(i.name, frozenset(i.tenants), i.host_pages, i.disk_pages)
                     for i in self.by_name.values() if i.host_pages or i.disk_pages)

    def resolve(self, mechanism: str, address: str, key: bytes = b"") -> Identity | None:
        """The identity of a connection with this mechanism (``CURVE`` / ``NULL``), peer
        address (``localhost:<uid>:<gid>:<pid>`` on ``ipc://``) and public key (Z85)."""
        if mechanism == "CURVE":
            return self.by_key.get(key)
        if mechanism != "NULL":
            return None
        if address.startswith("localhost:"):
            parts = address.split(":")[1:]
            if len(parts) == 3 and all(part.isdigit() for part in parts):
                uid, gid = int(parts[0]), int(parts[1])
                return self.by_uid.get(uid) or self.by_gid.get(gid) or self.default
            return None
        return self.default if self.auth.insecure_tcp else None

    def local(self, uid: int, gid: int) -> Identity | None:
        """Requests handled without a socket (tests, tools in-process): this process's user."""
        return self.by_uid.get(uid) or self.by_gid.get(gid) or self.default


def own_events_domain(name: str) -> bytes:
    """The ZAP domain of identity ``name``'s own KV events socket."""
    return _OWN_EVENTS_PREFIX + name.encode()


def user_id(identity: Identity, mechanism: str, address: str, key: bytes) -> bytes:
    return f"{identity.name}|{mechanism}|{address}|{key.decode()}".encode()


def parse_user_id(value: str) -> tuple[str, str, str, bytes] | None:
    """``(identity, mechanism, address, key)`` of a user id :func:`user_id` made."""
    parts = value.split("|")
    if len(parts) != 4:
        return None
    name, mechanism, address, key = parts
    return name, mechanism, address, key.encode()


class ZapHandler:
    """The ZAP endpoint of one ZeroMQ context, answered on a thread of its own from
    ``table()`` (read at each request: a reload takes effect at the next handshake).
    ``refused(reason)`` counts a refusal. Bind it before any endpoint that needs it:
    a CURVE handshake with no handler admits any key."""

    def __init__(self, context: zmq.Context, table: Callable[[], IdentityTable],
                 refused: Callable[[str], None] = lambda reason: None) -> None:
        self._table = table
        self._refused = refused
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="hicache-zap", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not sock.poll(_POLL_MS):
                    continue
                request = sock.recv_multipart()
            except zmq.ZMQError:
                return  # the context is going away
            try:
                sock.send_multipart(self.answer(request))
            except zmq.ZMQError:
                return

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: ``[version, request id, status, text, user id,
        metadata]``."""
        if len(request) < 6 or request[0] != b"1.0":
            version, request_id = (request + [b"1.0", b""])[:2]
            return [b"1.0", request_id, b"400", b"bad ZAP request", b"", b""]
        version, request_id, domain, address, _routing_id, mechanism_raw = request[:6]
        mechanism = mechanism_raw.decode("ascii", "replace")
        key = b""
        if mechanism == "CURVE" and len(request) >= 7 and len(request[6]) == 32:
            key = z85.encode(request[6])
        peer = address.decode("ascii", "replace")
        identity = None
        own = domain.startswith(_OWN_EVENTS_PREFIX)
        if own or domain in (ZAP_DOMAIN, EVENTS_ZAP_DOMAIN, EVENTS_REPLAY_ZAP_DOMAIN):
            identity = self._table().resolve(mechanism, peer, key)
        if identity is None:
            self._refused("unknown_key" if mechanism == "CURVE" else "unknown_user")
            logger.warning("refused a %s connection from %s%s", mechanism, peer or "?",
                           f" (key {key.decode()} is not listed)" if key else "")
            return [version, request_id, b"400", b"not allowed", b"", b""]
        if own:
            allowed = bool(identity.events_endpoint) and domain == own_events_domain(identity.name)
            why = f"the socket is {domain[len(_OWN_EVENTS_PREFIX):].decode('utf-8', 'replace')!r}'s own"
        elif domain == EVENTS_ZAP_DOMAIN:
            allowed, why = identity.reads_events, "admin or events = true"
        elif domain == EVENTS_REPLAY_ZAP_DOMAIN:
            allowed, why = identity.reads_events or bool(identity.events_endpoint), "admin, events or events_endpoint"
        else:
            allowed, why = True, ""
        if not allowed:
            self._refused("events")
            logger.warning("refused a KV events subscriber from %s: identity %r may not read the events (%s)",
                           peer or "?", identity.name, why)
            return [version, request_id, b"400", b"not allowed", b"", b""]
        return [version, request_id, b"200", b"OK", user_id(identity, mechanism, peer, key), b""]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_MS / 1000 + 1)
        self._sock.close()
