"""An in-process fake of the hicache daemon, for tests of :class:`hicache.client.CacheClient`.

A real ZeroMQ ROUTER socket on ``ipc://`` (served by a thread), a real descriptor
exchange (:class:`hicache.fdpass.FdExchange`) next to it and a real layer-counter ring,
so the client runs its own code paths end to end; behind them a small model of one
engine's pool instead of the tier manager::

    entries   whole-page token prefix -> device page (None: not on the device, "host")
    free      page ids 1..num_pages no one holds
    sessions  id -> connection identity, private pages, locks and node handles

A test scripts it: ``script(op, action)`` answers the next ``op`` request with an
action — :data:`DROP` (no answer), :data:`HOLD` (the answer waits for
:meth:`release_held`), an ``ErrorCode``, or a callable taking the request and
returning a reply —; ``down()`` / ``up()`` drop every request (probes included) while
down; ``restart()`` forgets sessions and device pages as a restarted daemon does
(entries stay, as disk pages do), so old session ids are answered ``UNKNOWN_SESSION``.
``received`` records every request in arrival order with the connection it came on, so
tests assert the order of events rather than durations.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq

from hicache import fdpass
from hicache import protocol as p
from hicache.counters import LayerCounters, Ticket
from hicache.errors import ErrorCode
from hicache.spec import KVSpec

DROP = "drop"
HOLD = "hold"
TOKEN_BYTES = 4


class FakeClock:
    """A clock tests move by hand (the client times its reconnect attempts with it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Received:
    identity: bytes
    message: Any

    @property
    def op(self) -> str:
        return self.message.__struct_config__.tag


@dataclass
class _Session:
    identity: bytes
    registered: bool = False
    private: set[int] = field(default_factory=set)
    locks: Counter = field(default_factory=Counter)  # prefix -> count
    handles: dict[int, bytes] = field(default_factory=dict)  # handle -> prefix
    handle_of: dict[bytes, int] = field(default_factory=dict)


class _Refused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class FakeDaemon:
    def __init__(self, directory: Path, *, lease_s: float = 30.0, num_slots: int = 64,
                 max_message_bytes: int = 0, replace_sessions: bool = False, device_uuids: bool = False) -> None:
        """``max_message_bytes``: the limit its hello says (0: none said, as older daemons).
        ``replace_sessions``: its hello says it ends the session a hello names
        (``Hello.replaces``; the fake only records it). ``device_uuids``: its hello says
        it takes a CUDA description's ``device_uuid`` (the fake registers no CUDA pool)."""
        self.device_uuids = device_uuids
        self.path = Path(directory) / "fake.sock"
        self.endpoint = f"ipc://{self.path}"
        self.lease_s = lease_s
        self.max_message_bytes = max_message_bytes
        self.replace_sessions = replace_sessions
        self.num_slots = num_slots
        self.fds = fdpass.FdExchange(fdpass.socket_path_for(self.path))
        self.received: list[Received] = []
        self.errors: list[BaseException] = []  # the fake's own bugs: a test fixture asserts none
        self.lock = threading.RLock()  # the loop holds it while it answers a request
        self.is_down = False
        self.restarts = 0
        self.entries: dict[bytes, int | None] = {}
        self.page_size = 0
        self.num_layers = 0
        self.num_pages = 0
        self.counters: LayerCounters | None = None
        self._old_counters: list[LayerCounters] = []
        self.landing: list[tuple[bytes, Ticket]] = []  # loads still landing: (deepest prefix, ticket)
        self._reset_pool()
        self.sessions: dict[int, _Session] = {}
        self._scripts: dict[str, deque] = {}
        self._ids = itertools.count(1 << 40)  # session ids and node handles: the same in every run
        self._held: list[tuple[bytes, bytes]] = []
        self._outbox: deque[tuple[bytes, bytes]] = deque()
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-hicache", daemon=True)
        self._thread.start()
        if not self._bound.wait(10):
            raise RuntimeError("the fake daemon did not bind")

    # ------------------------------------------------------------------ the test's side

    def script(self, op: str, action: Any) -> None:
        """Answer the next ``op`` request with ``action`` (see the module docstring)."""
        with self.lock:
            self._scripts.setdefault(op, deque()).append(action)

    def down(self) -> None:
        with self.lock:
            self.is_down = True

    def up(self) -> None:
        with self.lock:
            self.is_down = False

    def restart(self) -> None:
        """As a daemon killed and started again: no sessions, nothing on the device, a
        new counter ring; cached prefixes stay (on disk), off the device."""
        with self.lock:
            self.sessions.clear()
            self.landing.clear()
            self._reset_pool()
            self.restarts += 1

    def release_held(self) -> None:
        """Send the answers held back by :data:`HOLD`, late."""
        with self.lock:
            self._outbox.extend(self._held)
            self._held.clear()

    def ops(self, since: int = 0) -> list[str]:
        with self.lock:
            return [r.op for r in self.received[since:]]

    def count(self) -> int:
        with self.lock:
            return len(self.received)

    def last(self, op: str) -> Received:
        with self.lock:
            return [r for r in self.received if r.op == op][-1]

    def session_of(self, identity: bytes) -> list[int]:
        with self.lock:
            return [sid for sid, s in self.sessions.items() if s.identity == identity]

    def land(self, tokens: list[int]) -> Ticket:
        """Start a load that is still landing in the path of ``tokens`` (already cached on
        the device): its ticket shows in matches and loads of that path until
        :meth:`complete`."""
        with self.lock:
            prefix = np.asarray(tokens, "<i4").tobytes()
            assert self.entries.get(prefix) is not None, "land on a cached device path"
            ticket = self.counters.begin()
            self.landing.append((prefix, ticket))
            return ticket

    def complete(self, ticket: Ticket) -> None:
        with self.lock:
            for layer in range(self.num_layers):
                self.counters.complete_layer(ticket, layer)
            self.counters.finish(ticket)
            self.landing = [(pre, t) for pre, t in self.landing if t != ticket]

    def evict(self) -> int:
        """Take every device page no lock covers off the device, deepest first (a path
        on the device stays closed under its ancestors)."""
        with self.lock:
            locked = [pre for s in self.sessions.values() for pre, n in s.locks.items() if n > 0]
            landing = [pre for pre, _ in self.landing]
            evicted = 0
            for prefix in sorted(self.entries, key=len, reverse=True):
                page = self.entries[prefix]
                if page is None or any(held.startswith(prefix) for held in locked + landing):
                    continue
                self.entries[prefix] = None
                self.free.add(page)
                evicted += 1
            return evicted

    def check(self) -> None:
        """Every page is free, private to one session or cached: never two of these."""
        with self.lock:
            holders = [self.free, *(s.private for s in self.sessions.values()),
                       {page for page in self.entries.values() if page is not None}]
            seen: set[int] = set()
            for held in holders:
                assert not (held & seen), f"pages held twice: {sorted(held & seen)}"
                seen |= held
            assert seen == set(range(1, self.num_pages + 1)) or not self.num_pages, "pages lost"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._context.term()
        self.fds.close()
        for counters in [self.counters, *self._old_counters]:
            if counters is not None:
                counters.close()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(5):
                    identity, payload = sock.recv_multipart()
                    with self.lock:
                        reply = self._answer(identity, payload)
                    if reply is not None:
                        sock.send_multipart([identity, reply])
                with self.lock:
                    outbox, self._outbox = list(self._outbox), deque()
                for identity, reply in outbox:
                    sock.send_multipart([identity, reply])
        finally:
            sock.close(linger=0)

    def _answer(self, identity: bytes, payload: bytes) -> bytes | None:
        try:
            message = p.decode_request(payload)
        except p.ProtocolError as exc:
            return p.encode(p.Error(id=p.request_id(payload), code=ErrorCode.INVALID_ARGUMENT, message=str(exc)))
        self.received.append(Received(identity, message))
        if self.is_down:
            return None
        op = message.__struct_config__.tag
        queue = self._scripts.get(op)
        action = queue.popleft() if queue else None
        if action == DROP:
            return None
        if isinstance(action, ErrorCode):
            return p.encode(p.Error(id=message.id, code=action, message=f"scripted {action.name}"))
        try:
            reply = action(message) if callable(action) else self._handle(identity, message)
        except _Refused as exc:
            reply = p.Error(id=message.id, code=exc.code, message=exc.message)
        except Exception as exc:  # noqa: BLE001 - a bug of the fake: answered, and kept for the test
            self.errors.append(exc)
            reply = p.Error(id=message.id, code=ErrorCode.INTERNAL, message=repr(exc))
        reply.id = message.id
        if action == HOLD:
            self._held.append((identity, p.encode(reply)))
            return None
        return p.encode(reply)

    # ------------------------------------------------------------------ the model

    def _reset_pool(self) -> None:
        self.free = set(range(1, self.num_pages + 1))
        for prefix in self.entries:
            self.entries[prefix] = None
        if self.counters is not None:
            self._old_counters.append(self.counters)  # a client may still map it
            self.counters = None

    def _session(self, identity: bytes, session_id: int, *, registered: bool = True) -> _Session:
        session = self.sessions.get(session_id)
        if session is None or session.identity != identity:
            raise _Refused(ErrorCode.UNKNOWN_SESSION, "no such session on this connection")
        if registered and not session.registered:
            raise _Refused(ErrorCode.INVALID_ARGUMENT, "register the engine's pool first")
        return session

    def _handle(self, identity: bytes, m: Any) -> Any:
        handler: Callable = getattr(self, f"_{m.__struct_config__.tag}")
        return handler(identity, m)

    def _hello(self, identity: bytes, m: p.Hello) -> p.HelloReply:
        if m.version != p.PROTOCOL_VERSION:
            raise _Refused(ErrorCode.VERSION_MISMATCH, "protocol version")
        session_id = next(self._ids)
        self.sessions[session_id] = _Session(identity)
        return p.HelloReply(id=0, session=session_id, version=p.PROTOCOL_VERSION, daemon="fake",
                            lease_s=self.lease_s, fd_socket="", max_message_bytes=self.max_message_bytes,
                            replace_sessions=self.replace_sessions, device_uuids=self.device_uuids)

    def _register(self, identity: bytes, m: p.Register) -> p.RegisterReply:
        session = self._session(identity, m.session, registered=False)
        spec = KVSpec.from_dict(p.as_dict(m.spec))
        (pool,) = m.pools
        if pool.kind != "memfd":
            raise _Refused(ErrorCode.INVALID_ARGUMENT, "the fake registers memfd pools only")
        offer = self.fds.take(pool.token)
        if offer is None:
            raise _Refused(ErrorCode.INVALID_ARGUMENT, "no descriptor offered under this token")
        os.close(offer.fd)
        # One engine's pool: a registration of it replaces any older session's (as the
        # daemon's does once that session's lease ran out), device pages and all.
        for old_id in [sid for sid, s in self.sessions.items() if s.registered]:
            del self.sessions[old_id]
        self.page_size, self.num_layers = spec.page_size, spec.num_layers
        self.num_pages = pool.layout.num_pages
        self.landing.clear()
        self._reset_pool()
        self.counters = LayerCounters(self.num_slots, self.num_layers)
        in_use = set(np.frombuffer(m.in_use, "<i4").tolist())
        if not in_use <= self.free:
            raise _Refused(ErrorCode.INVALID_ARGUMENT, "in_use names pages outside the pool")
        self.free -= in_use
        session.private |= in_use
        session.registered = True
        token = self.fds.publish(self.counters.reader_fd())
        return p.RegisterReply(id=0, pool=1, counters=p.from_dict(p.CountersMsg, self.counters.handle(token).to_dict()),
                               page_size=self.page_size, num_pages=self.num_pages)

    def _prefixes(self, tokens: bytes) -> list[bytes]:
        step = self.page_size * TOKEN_BYTES
        return [tokens[:end] for end in range(step, len(tokens) - len(tokens) % step + 1, step)]

    def _handle_for(self, session: _Session, prefix: bytes) -> int:
        handle = session.handle_of.get(prefix)
        if handle is None:
            handle = next(self._ids)
            session.handles[handle] = prefix
            session.handle_of[prefix] = handle
        return handle

    def _path(self, prefix: bytes) -> list[bytes]:
        return [pre for pre in self._prefixes(prefix) if pre in self.entries]

    def _tickets_on(self, prefix: bytes) -> list[tuple[int, int]]:
        return [tuple(t) for pre, t in self.landing if prefix.startswith(pre) or pre.startswith(prefix)]

    def _lookup(self, session: _Session, tokens: bytes) -> p.MatchResult:
        path = []
        for prefix in self._prefixes(tokens):
            if prefix not in self.entries:
                break
            path.append(prefix)
        if not path:
            return p.MatchResult(node=-1, device_pages=b"", host_pages=0, disk_pages=0, wait=[])
        device = []
        for prefix in path:
            if self.entries[prefix] is None:
                break
            device.append(self.entries[prefix])
        last_device = path[len(device) - 1] if device else b""
        return p.MatchResult(node=self._handle_for(session, path[-1]),
                             device_pages=np.asarray(device, "<i4").tobytes(),
                             host_pages=len(path) - len(device), disk_pages=0,
                             wait=self._tickets_on(last_device) if device else [])

    def _match(self, identity: bytes, m: p.Match) -> p.MatchReply:
        r = self._lookup(self._session(identity, m.session), m.tokens)
        return p.MatchReply(id=0, node=r.node, device_pages=r.device_pages, host_pages=r.host_pages,
                            disk_pages=r.disk_pages, wait=r.wait)

    def _match_many(self, identity: bytes, m: p.MatchMany) -> p.MatchManyReply:
        session = self._session(identity, m.session)
        return p.MatchManyReply(id=0, results=[self._lookup(session, tokens) for tokens in m.tokens])

    def _node(self, session: _Session, handle: int) -> bytes:
        prefix = session.handles.get(handle)
        if prefix is None or prefix not in self.entries:
            raise _Refused(ErrorCode.UNKNOWN_NODE, f"no node {handle}")
        return prefix

    def _lock(self, identity: bytes, m: p.Lock) -> p.Ok:
        session = self._session(identity, m.session)
        session.locks[self._node(session, m.node)] += 1
        return p.Ok(id=0)

    def _locked(self, session, handle: int):
        """The node behind ``handle``, which this session must hold a lock on."""
        prefix = self._node(session, handle)
        if session.locks[prefix] <= 0:
            raise _Refused(ErrorCode.LOCK_UNDERFLOW, f"no lock on node {handle}")
        return prefix

    def _unlock(self, identity: bytes, m: p.Unlock) -> p.Ok:
        session = self._session(identity, m.session)
        session.locks[self._locked(session, m.node)] -= 1
        return p.Ok(id=0)

    def _load(self, identity: bytes, m: p.Load) -> p.LoadReply:
        session = self._session(identity, m.session)
        prefix = self._locked(session, m.node)
        path = self._path(prefix)
        loaded = 0
        for pre in path:
            if self.entries[pre] is None:
                if not self.free:
                    break
                self.entries[pre] = min(self.free)
                self.free.discard(self.entries[pre])
                loaded += 1
        device = [self.entries[pre] for pre in path if self.entries[pre] is not None]
        last = path[len(device) - 1] if device else b""
        wait = self._tickets_on(last) if device else []
        if loaded:
            ticket = self.counters.begin()
            for layer in range(self.num_layers):
                self.counters.complete_layer(ticket, layer)
            self.counters.finish(ticket)
            wait.append(tuple(ticket))
        return p.LoadReply(id=0, node=self._handle_for(session, last) if device else -1,
                           device_pages=np.asarray(device, "<i4").tobytes(), loaded_pages=loaded, wait=wait)

    def _alloc(self, identity: bytes, m: p.Alloc) -> p.AllocReply:
        session = self._session(identity, m.session)
        if not 0 <= m.num_pages <= self.num_pages:
            raise _Refused(ErrorCode.INVALID_ARGUMENT, "num_pages")
        if m.num_pages > len(self.free):
            return p.AllocReply(id=0, pages=b"")
        pages = sorted(self.free)[: m.num_pages]
        self.free -= set(pages)
        session.private |= set(pages)
        return p.AllocReply(id=0, pages=np.asarray(pages, "<i4").tobytes())

    def _insert(self, identity: bytes, m: p.Insert) -> p.InsertReply:
        session = self._session(identity, m.session)
        pages = np.frombuffer(m.pages, "<i4").tolist()
        prefixes = self._prefixes(m.tokens)
        if len(pages) != len(prefixes) or len(set(pages)) != len(pages):
            raise _Refused(ErrorCode.INVALID_ARGUMENT, "one distinct page id per whole page of tokens")
        for prefix, page in zip(prefixes, pages):
            if page not in session.private and self.entries.get(prefix) != page:
                raise _Refused(ErrorCode.INVALID_ARGUMENT, f"page {page} is neither private nor cached there")
        canonical, freed, existing = [], [], 0
        for prefix, page in zip(prefixes, pages):
            cached = self.entries.get(prefix)
            existing += prefix in self.entries
            if cached is None:
                self.entries[prefix] = cached = page
            if page in session.private:
                session.private.discard(page)
                if page != cached:
                    self.free.add(page)
                    freed.append(page)
            canonical.append(cached)
        return p.InsertReply(id=0, node=self._handle_for(session, prefixes[-1]) if prefixes else -1,
                             device_pages=np.asarray(canonical, "<i4").tobytes(),
                             freed=np.asarray(freed, "<i4").tobytes(), prefix_pages=existing)

    def _release(self, identity: bytes, m: p.Release) -> p.Ok:
        session = self._session(identity, m.session)
        pages = set(np.frombuffer(m.pages, "<i4").tolist())
        if not pages <= session.private:
            raise _Refused(ErrorCode.INVALID_ARGUMENT, f"pages {sorted(pages - session.private)} are not private")
        session.private -= pages
        self.free |= pages
        return p.Ok(id=0)

    def _heartbeat(self, identity: bytes, m: p.Heartbeat) -> p.Ok:
        self._session(identity, m.session, registered=False)
        return p.Ok(id=0)

    def _bye(self, identity: bytes, m: p.Bye) -> p.Ok:
        session = self._session(identity, m.session, registered=False)
        self.free |= session.private
        del self.sessions[m.session]
        return p.Ok(id=0)

    def _stats(self, identity: bytes, m: p.Stats) -> p.StatsReply:
        return p.StatsReply(id=0, stats=p.DaemonStats(version="fake", uptime_s=0.0, sessions=len(self.sessions),
                                                     draining=False, requests={}, specs={}))

    def _health(self, identity: bytes, m: p.Health) -> p.HealthReply:
        return p.HealthReply(id=0, state="serving", sessions=len(self.sessions), uptime_s=0.0, version="fake")

    def _flush(self, identity: bytes, m: p.Flush) -> p.Ok:
        return p.Ok(id=0)

    def _check(self, identity: bytes, m: p.Check) -> p.Ok:
        try:
            self.check()
        except AssertionError as exc:
            raise _Refused(ErrorCode.INTERNAL, str(exc)) from None
        return p.Ok(id=0)
