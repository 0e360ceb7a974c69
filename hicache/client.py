"""The client library: what an engine links to talk to the hicache daemon.

The lifecycle of DESIGN.md::

    client = CacheClient(endpoint)
    client.register(spec, [pool.handle])            # once; a TP group passes every rank's handle
    m = client.match(tokens, extra_key=...)         # device pages usable now (+ host / disk)
    client.lock(m.handle)
    ld = client.load(m.handle)                      # the host / disk part, layer by layer
    new = client.alloc(num_pages)                   # private pages for the rest
    ... before attention of layer i: client.wait_layer(ld.wait, i)
    r = client.insert(tokens, pages)                # the tree takes the whole pages
    client.unlock(m.handle); client.release(tail_pages)

Every call has a timeout. A daemon that does not answer puts the client in *degraded
mode*: matches miss, allocations return ``None``, inserts keep their pages private —
the engine computes, never hangs. Only the call that found the daemon gone waits for
its timeout: from then on calls answer at once, while the background thread probes
the daemon (every ``reconnect_interval_s``); once a probe is answered, the next call
reconnects. A daemon that restarted answers ``UNKNOWN_SESSION``; the client then says
hello again, re-registers the pool, and declares the pages the engine still holds (its
private pages and the pages of paths it has locked) so the new daemon never hands them
out. Node handles from before a reconnect are *orphans*: unlocking the last one gives
back its pages (unless an insert adopted them meanwhile).

The background thread also sends heartbeats so that an idle engine keeps its lease (a
killed engine loses it, and the daemon takes back everything it held). They go on the
client's one socket, between calls: the daemon accepts a session's requests only from
the connection that opened it.

CPU pools (``memfd`` handles) are handed to the daemon as descriptors on its descriptor
socket (:mod:`hicache.fdpass`) at each registration; the layer-counter ring comes back
the same way, read-only.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter
from typing import Any, NamedTuple, Sequence

import numpy as np
import zmq

from hicache import fdpass
from hicache.counters import CountersHandle, LayerWaiter, Ticket
from hicache import protocol as p, transport
from hicache.errors import ErrorCode, HicacheError, InvalidArgument, Unavailable
from hicache.keys import Tokens, key_self_test, pack_tokens
from hicache.pages import PAGE_ID_DTYPE, PageIds, PageIdsLike, as_page_ids
from hicache.pools import PoolHandle
from hicache.spec import KVSpec

logger = logging.getLogger(__name__)

_NO_PAGES = np.empty(0, dtype=PAGE_ID_DTYPE)


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
    device_pages: PageIds
    num_host_pages: int
    num_disk_pages: int
    wait: tuple[Ticket, ...]
    page_size: int

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
    wait: tuple[Ticket, ...]


class Inserted(NamedTuple):
    handle: NodeHandle | None
    device_pages: PageIds  # canonical pages of every whole page
    freed: PageIds  # duplicates the daemon took back
    num_prefix_pages: int


_RCVTIMEO = int(zmq.RCVTIMEO)  # a plain int: pyzmq converts enum members on every call


def _pages(data: bytes) -> PageIds:
    return np.frombuffer(data, PAGE_ID_DTYPE)  # dtype positional: keywords cost ~0.15 us


class CacheClient:
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
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        self.name = name or f"pid{os.getpid()}"
        self.reconnect_interval_s = reconnect_interval_s
        self._context = context or transport.new_context()
        self._own_context = context is None
        self._socket: zmq.Socket | None = None
        self._socket_lock = threading.Lock()  # the caller's calls and the heartbeats share the socket
        self._rcvtimeo = -1
        self._ids = itertools.count(1)
        self._session = 0
        self.epoch = 0
        self._down_since: float | None = None
        self._next_retry = 0.0
        self._registration: tuple[KVSpec, list[PoolHandle]] | None = None
        self._answering = threading.Event()  # set by a probe that reached the daemon while degraded
        self.waiter: LayerWaiter | None = None
        self.page_size = 0
        self.num_pages = 0
        self.lease_s = 0.0
        # What the engine holds, for re-registration after a daemon restart.
        self._private: set[int] = set()
        self._locked: Counter[NodeHandle] = Counter()
        self._paths: dict[NodeHandle, PageIds] = {}  # device pages of handles handed out
        self._orphan_refs: Counter[int] = Counter()
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._want_heartbeat = heartbeat

    # ------------------------------------------------------------------ transport

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self._socket = sock
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
            return self._call_locked(message, timeout_s)

    def _call_locked(self, message: p._Request, timeout_s: float | None) -> p.Reply:
        message.id = request_id = next(self._ids)
        sock = self._socket or self._connect()
        transport.send_frame(sock, p.encode(message), 0)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            wanted = max(1, int(timeout_s * 1000))
            if wanted != self._rcvtimeo:
                sock.setsockopt(_RCVTIMEO, wanted)
                self._rcvtimeo = wanted
            try:
                reply = p.decode_reply(sock.recv())
            except zmq.Again:
                self._reset_socket()
                raise Unavailable(f"no answer from {self.endpoint} in time") from None
            if reply.id == request_id:
                break
            timeout_s = deadline - time.monotonic()  # a late answer to an earlier request
            if timeout_s <= 0:
                self._reset_socket()
                raise Unavailable(f"no answer from {self.endpoint} in time")
        if isinstance(reply, p.Error):
            raise RemoteError(reply.code, reply.message)
        return reply

    # ------------------------------------------------------------------ sessions

    @property
    def degraded(self) -> bool:
        return self._down_since is not None

    def register(self, spec: KVSpec, pools: Sequence[PoolHandle]) -> None:
        """Register the engine's pool (one handle per TP rank, e.g. ``exported.handle``).
        A CPU pool's descriptor is offered to the daemon at each registration, so a
        handle made in another process must come with its ``fd`` received here (or be
        a ``cuda_ipc`` handle). Raises if the daemon refuses it (spec or key mismatch,
        a pool that is not this user's) or does not answer."""
        self._registration = (spec, list(pools))
        self._open_session(in_use=())

    def _fd_socket(self, hello: p.HelloReply) -> str:
        """The daemon's descriptor socket: next to its ipc:// socket as this process
        sees that (a container may mount it elsewhere), else where the daemon says."""
        if self.endpoint.startswith("ipc://"):
            return str(fdpass.socket_path_for(self.endpoint[len("ipc://"):]))
        return hello.fd_socket

    def _pool_messages(self, pools: list[PoolHandle], fd_socket: str) -> list[p.PoolHandleMsg]:
        out = []
        for handle in pools:
            data = handle.to_dict()
            if handle.kind == "memfd":
                if handle.fd < 0:
                    raise InvalidArgument("a memfd pool handle without its descriptor in this process")
                data["token"] = fdpass.offer(fd_socket, handle.fd, timeout_s=self.timeout_s)
            out.append(p.from_dict(p.PoolHandleMsg, data))
        return out

    def _open_session(self, in_use: Sequence[int]) -> None:
        spec, pools = self._registration
        hello = self._call(p.Hello(id=0, version=p.PROTOCOL_VERSION, client=self.name, pid=os.getpid()))
        self._session = hello.session
        self.lease_s = hello.lease_s
        fd_socket = self._fd_socket(hello)
        # The first registration of a spec after a daemon restart rebuilds its disk tier
        # before the answer (seconds for a large store): as long as a load may take.
        reply = self._call(p.Register(
            id=0, session=self._session, spec=p.from_dict(p.KVSpecMsg, spec.to_dict()), fingerprint=spec.fingerprint,
            key_check=key_self_test(spec.fingerprint, spec.page_size), pools=self._pool_messages(pools, fd_socket),
            in_use=np.asarray(sorted(in_use), dtype=PAGE_ID_DTYPE).tobytes(),
        ), timeout_s=max(self.timeout_s, self.load_timeout_s))
        counters = CountersHandle.from_dict(p.as_dict(reply.counters))
        waiter = LayerWaiter(counters, fdpass.fetch(fd_socket, counters.token, timeout_s=self.timeout_s))
        self.page_size, self.num_pages = reply.page_size, reply.num_pages
        if self.waiter is not None:
            self.waiter.close()
        self.waiter = waiter
        self.epoch += 1
        self._down_since = None
        self._answering.clear()
        self._start_heartbeat()
        logger.info("registered with %s (epoch %d)", self.endpoint, self.epoch)

    def _request(self, message: p._Request, timeout_s: float | None = None) -> p.Reply | None:
        """A session request; ``None`` in degraded mode (the daemon is unreachable)."""
        if self._registration is None:
            raise InvalidArgument("register the engine's pool first")
        if self._down_since is not None and not self._try_reconnect():  # degraded: no wait
            return None
        for retry in (False, True):
            message.session = self._session
            try:
                return self._call(message, timeout_s)
            except Unavailable:
                self._go_down()
                return None
            except RemoteError as exc:
                if exc.code != ErrorCode.UNKNOWN_SESSION or retry:
                    raise
            # The daemon restarted (or our lease lapsed): start over, then retry once.
            self._go_down()
            if not self._reconnect(force=True):
                return None
        return None

    def _go_down(self) -> None:
        if self._down_since is None:
            logger.warning("hicache daemon at %s unavailable: degraded mode (misses, no allocations)", self.endpoint)
            self._down_since = time.monotonic()
            self._next_retry = 0.0

    def _try_reconnect(self) -> bool:
        """In degraded mode: reconnect if the daemon is known to answer again (a probe
        of the background thread said so), else miss at once. Without the thread
        (``heartbeat=False``) this call probes, at most every ``reconnect_interval_s``."""
        if self._heartbeat is not None:
            return self._answering.is_set() and self._reconnect(force=True)
        return self._reconnect()

    def _reconnect(self, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now < self._next_retry:
            return False
        self._next_retry = now + self.reconnect_interval_s
        self._answering.clear()
        # Everything the engine still holds stays its own in the new session.
        orphans = Counter()
        for handle, count in self._locked.items():
            for page in self._paths.get(handle, _NO_PAGES).tolist():
                orphans[page] += count
        in_use = self._private | set(orphans)
        try:
            self._open_session(in_use=in_use)
        except (Unavailable, RemoteError, InvalidArgument) as exc:
            logger.info("reconnect to %s failed: %s", self.endpoint, exc)
            self._go_down()
            return False
        self._private = in_use
        self._orphan_refs.update(orphans)
        return True

    # ------------------------------------------------------------------ cache operations

    def match(self, tokens: Tokens, extra_key: str = "") -> Match:
        reply = self._request(p.Match(id=0, session=0, tokens=pack_tokens(tokens), extra_key=extra_key))
        return self._match_from(reply)

    def match_many(self, sequences: Sequence[Tokens], extra_key: str = "") -> list[Match]:
        """Several lookups in one round trip (answered with what is cached now)."""
        reply = self._request(p.MatchMany(id=0, session=0, tokens=[pack_tokens(t) for t in sequences],
                                          extra_key=extra_key))
        if reply is None:
            return [self._match_from(None) for _ in sequences]
        return [self._match_from(r) for r in reply.results]

    def _match_from(self, reply) -> Match:
        if reply is None or reply.node < 0:
            return Match(None, _NO_PAGES, 0, 0, (), self.page_size)
        handle = NodeHandle(reply.node, self.epoch)
        pages = _pages(reply.device_pages)
        self._remember(handle, pages)
        wait = tuple(Ticket(*t) for t in reply.wait) if reply.wait else ()
        return Match(handle, pages, reply.host_pages, reply.disk_pages, wait, self.page_size)

    def _remember(self, handle: NodeHandle, pages: PageIds) -> None:
        """Keep the path's pages of a handle handed out (needed if it gets locked)."""
        paths = self._paths
        if len(paths) > 4096:  # forget unlocked handles' pages, oldest first
            for old in [h for h in paths if h not in self._locked][:2048]:
                del paths[old]
        if handle not in self._locked:
            paths[handle] = pages

    def lock(self, handle: NodeHandle | None) -> None:
        if handle is None:
            return
        if handle.epoch == self.epoch and not self.degraded:
            self._request(p.Lock(id=0, session=0, node=handle.node))
        # Counted even when the daemon is unreachable: the engine uses the path's pages,
        # so a reconnect must declare them in use.
        self._locked[handle] += 1

    def unlock(self, handle: NodeHandle | None) -> None:
        if handle is None or self._locked[handle] <= 0:
            if handle is not None and not self._locked[handle]:
                del self._locked[handle]
            return
        self._locked[handle] -= 1
        last = self._locked[handle] == 0
        if last:
            del self._locked[handle]
        if handle.epoch == self.epoch:
            self._request(p.Unlock(id=0, session=0, node=handle.node))
            return
        # An orphan from before a reconnect: its pages were declared in use; give them
        # back once no orphan needs them and no insert adopted them.
        if last:
            done = []
            for page in self._paths.pop(handle, _NO_PAGES).tolist():
                self._orphan_refs[page] -= 1
                if self._orphan_refs[page] <= 0:
                    del self._orphan_refs[page]
                    if page in self._private:
                        done.append(page)
            if done:
                self.release(done)

    def load(self, handle: NodeHandle | None) -> Loaded:
        if handle is None or handle.epoch != self.epoch:
            return Loaded(handle, self._paths.get(handle, _NO_PAGES) if handle else _NO_PAGES, 0, ())
        reply = self._request(p.Load(id=0, session=0, node=handle.node), timeout_s=self.load_timeout_s)
        if reply is None:
            return Loaded(handle, self._paths.get(handle, _NO_PAGES), 0, ())
        pages = _pages(reply.device_pages)
        loaded = NodeHandle(reply.node, self.epoch)
        self._paths[handle] = pages if reply.node == handle.node else self._paths.get(handle, pages)
        self._remember(loaded, pages)
        return Loaded(loaded, pages, reply.loaded_pages, tuple(Ticket(*t) for t in reply.wait))

    def wait_layer(self, wait: Sequence[Ticket], layer: int, *, timeout_s: float | None = None,
                   stream: Any = None) -> None:
        """Block (CPU mode) or make ``stream`` wait (GPU mode) until ``layer`` of every
        load in ``wait`` has landed."""
        for ticket in wait:
            self.waiter.wait_layer(ticket, layer, timeout_s=timeout_s, stream=stream)

    def alloc(self, num_pages: int) -> PageIds | None:
        reply = self._request(p.Alloc(id=0, session=0, num_pages=num_pages))
        if reply is None or (num_pages and not reply.pages):
            return None
        pages = _pages(reply.pages)
        self._private.update(pages.tolist())
        return pages

    def insert(self, tokens: Tokens, pages: PageIdsLike, extra_key: str = "") -> Inserted:
        ids = as_page_ids(pages)
        reply = self._request(p.Insert(id=0, session=0, tokens=pack_tokens(tokens), pages=ids.tobytes(),
                                       extra_key=extra_key))
        if reply is None:
            return Inserted(None, ids, _NO_PAGES, 0)  # degraded: the pages stay ours
        for page in ids.tolist():
            self._private.discard(page)
            self._orphan_refs.pop(page, None)
        handle = NodeHandle(reply.node, self.epoch) if reply.node >= 0 else None
        device = _pages(reply.device_pages)
        if handle is not None:
            self._remember(handle, device)
        return Inserted(handle, device, _pages(reply.freed), reply.prefix_pages)

    def release(self, pages: PageIdsLike) -> None:
        ids = as_page_ids(pages)
        if not ids.size:
            return
        if self._request(p.Release(id=0, session=0, pages=ids.tobytes())) is not None:
            self._private.difference_update(ids.tolist())

    # ------------------------------------------------------------------ admin (no session needed)

    def stats(self) -> dict[str, Any]:
        return p.as_dict(self._call(p.Stats(id=0)).stats)

    def health(self) -> p.HealthReply:
        return self._call(p.Health(id=0))

    def flush(self, timeout_s: float = 120.0) -> None:
        self._call(p.Flush(id=0), timeout_s=timeout_s)

    def check(self) -> None:
        """Run the daemon's invariant checks; raises :class:`RemoteError` if one fails."""
        self._call(p.Check(id=0), timeout_s=60.0)

    # ------------------------------------------------------------------ heartbeat and close

    def _start_heartbeat(self) -> None:
        if not self._want_heartbeat or self._heartbeat is not None:
            return
        self._heartbeat = threading.Thread(target=self._heartbeat_main, name="hicache-heartbeat", daemon=True)
        self._heartbeat.start()

    def _heartbeat_main(self) -> None:
        """Heartbeats while connected (sent between the caller's calls, on its socket:
        a call renews the lease anyway); probes of the daemon while degraded."""
        ids = itertools.count(1)
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
                    while sock.poll(0):
                        sock.recv()  # earlier heartbeats' answers (and timed-out calls')
                    # Never blocking, with the caller's lock held: a daemon gone long
                    # enough fills the queue, and the next call finds out.
                    sock.send(p.encode(p.Heartbeat(id=next(ids) | 1 << 62, session=self._session)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a full queue, a closed socket: a lost daemon shows on the next call
            finally:
                self._socket_lock.release()

    def _probe(self) -> bool:
        """Does the daemon answer ``health``? (its own socket: the caller's is idle)"""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
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
        if self.waiter is not None:
            self.waiter.close()
            self.waiter = None
        self._reset_socket()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
