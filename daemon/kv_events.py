"""The daemon's KV events: every tier manager's residency changes, as streams of
:mod:`hicache.daemon.events` (vLLM's wire format) that routers subscribe to.

One stream per device pool (topic ``<[events].topic><pool id>``, data-parallel rank the
pool id; an engine-owned pool registered with ``kv_events=False`` has none — a TP
engine's ranks but the first, so that a router sees one stream per engine):
``BlockStored`` / ``BlockRemoved`` with medium ``GPU`` for that pool's device pages,
``CPU`` for host pages and ``STORAGE`` for disk pages. A block is a page: its hash the
low 64 bits of the page key (equal on every node of a fleet), its parent the page before
it, ``block_size`` the spec's page size, and the namespace's extra key (an engine's
cache salt / LoRA name) as the block's extra keys.

The host and disk tiers are shared by every pool of a spec; their events go to each
stream whose engine could hit them. A pool's stream shows the host and disk pages of
its identity's tenants' namespaces (the registering session's identity; a reload that
changes its tenants starts the stream over), not another tenant's: a router is not told
an engine holds blocks it cannot hit, nor given their token ids on that engine's topic.
Those tenants are the stream's scope (:attr:`EventStream.scope`): an identity that reads
its own tenants' streams (``events_endpoint``) reads the streams whose scope is within
its tenants, on a socket of its own (:meth:`EventPublisher.set_readers`).
A namespace whose tenant the daemon does not know yet (restored from disk, or fetched
from the remote tier, with no tenant on record) shows on no stream until a session
names it; then its tenant's streams announce its pages. With no identities listed (one
tenant) every stream shows every namespace.

The tree tells (:class:`ManagerEvents` is its observer) as residency changes; the events
wait in each stream's queue and go out as one batch per stream at the loop's next turn
(:meth:`KvEvents.tick`). A new stream starts with ``AllBlocksCleared`` and a snapshot of
what its pool sees (every node's pages in every tier it is in, top-down so a parent is
announced before its children); so does a stream that lost events (see
:attr:`EventStream.needs_resync`). A snapshot runs a slice of nodes per loop turn; events
of changes meanwhile interleave, which leaves a subscriber with the tree as it is. A
stream ends with ``AllBlocksCleared`` when its pool goes (its engine's bye, an expired
lease, the manager closed): nothing of that rank is cached for a router any more.

A page whose node keeps no tokens (on disk only: see :mod:`hicache.tree`) gets them from
the store's metadata for its ``BlockStored`` (routers such as Dynamo hash the tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hicache.daemon.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, EventPublisher, EventStream
from hicache.keys import NamespaceId
from hicache.tiers.manager import TierManager
from hicache.tree import DISK_SLOT, HOST_SLOT, Node, PoolId, Slot

logger = logging.getLogger(__name__)

SNAPSHOT_SLICE = 2000  # nodes a snapshot announces per loop turn
EXTRA_KEYS = 1 << 16  # namespaces named and holding no page yet whose extra key is remembered
REPLAYS_PER_TURN = 4  # replay requests answered per loop turn at most (each up to a ring of batches)


Tenants = frozenset[str] | None  # the tenants whose namespaces a stream shows (None: every namespace)


def _hashes(node: Node) -> list[int]:
    """The block hash of each page: the low 64 bits of its key (big-endian)."""
    return np.frombuffer(node.page_keys, dtype=">u8")[1::2].tolist()


class _Snapshot:
    """A stream's announcement of what its pool sees, a slice per loop turn: the
    namespaces still to walk, in order, each ``whole`` (its device pages too) or for its
    host and disk pages only (a namespace the stream has come to show since it began)."""

    def __init__(self, namespaces, whole: bool) -> None:
        self.pending: dict[NamespaceId, bool] = dict.fromkeys(namespaces, whole)
        self.steps: Iterator[None] | None = None

    def shows(self, namespace: NamespaceId) -> None:
        """The stream shows ``namespace`` from now on: its host and disk pages are
        announced, unless a walk still to come does it (one walked, or being walked,
        showed none of them: it is walked again)."""
        self.pending.setdefault(namespace, False)


class ManagerEvents:
    """One tier manager's events (the tree's observer; owner thread)."""

    def __init__(self, publisher: EventPublisher, manager: TierManager, topic: str,
                 extra_key: Callable[[bytes], str | None],
                 tenants: Callable[[TierManager, PoolId], Tenants] = lambda manager, pool_id: None) -> None:
        """``extra_key(namespace id)``: the extra key it was made with, if known (see
        :meth:`KvEvents.extra_key`); ``tenants(manager, pool id)``: the tenants whose
        namespaces the pool's engine may use (``None``: every namespace)."""
        self.publisher = publisher
        self.manager = manager
        self.topic = topic
        self.extra_key = extra_key
        self._tenants_of = tenants
        self.block_size = manager.spec.page_size
        self.streams: dict[int, EventStream] = {}  # pool id -> its stream
        self._tenants: dict[int, Tenants] = {}  # pool id -> the tenants its stream shows
        self._snapshots: dict[int, _Snapshot] = {}  # pool id -> the snapshot in progress
        manager.tree.observer = self

    # -- the tree's observer --------------------------------------------------------------

    def added(self, node: Node, slot: Slot) -> None:
        if slot >= 0:
            stream = self.streams.get(slot)
            if stream is not None:
                self._stored(stream, node, MEDIUM_GPU)
            return
        medium = MEDIUM_CPU if slot == HOST_SLOT else MEDIUM_STORAGE
        for stream in self._showing(node.namespace):
            self._stored(stream, node, medium)

    def dropped(self, node: Node, slot: Slot) -> None:
        if slot >= 0:
            stream = self.streams.get(slot)
            if stream is not None:
                stream.removed(_hashes(node), MEDIUM_GPU)
            return
        medium = MEDIUM_CPU if slot == HOST_SLOT else MEDIUM_STORAGE
        streams = self._showing(node.namespace)
        if streams:
            hashes = _hashes(node)
            for stream in streams:
                stream.removed(hashes, medium)

    def regrouped(self, namespace: NamespaceId, old: str, new: str) -> None:
        """The namespace is ``new``'s from now on (a tenant: see
        :meth:`HiRadixTree.set_group`), ``old``'s before (``""``: nobody's). A stream
        that comes to show it announces its host and disk pages; one that no longer
        does (never, as namespaces go: a namespace id is its tenant's alone) starts over."""
        for pool_id, stream in self.streams.items():
            was = self._shows(pool_id, old)
            if was == self._shows(pool_id, new):
                continue
            if was:
                self._restart(pool_id, stream)
                continue
            snapshot = self._snapshots.get(pool_id)
            if snapshot is None:
                snapshot = self._snapshots[pool_id] = self._snapshot(pool_id, stream, (namespace,), whole=False)
            else:
                snapshot.shows(namespace)

    def _showing(self, namespace: NamespaceId) -> list[EventStream]:
        """The streams that show the namespace's host and disk pages."""
        group = self.manager.tree.group_of(namespace)
        return [stream for pool_id, stream in self.streams.items() if self._shows(pool_id, group)]

    def _shows(self, pool_id: int, group: str) -> bool:
        """Does the pool's stream show the host and disk pages of a namespace of
        ``group`` (its tenant; ``""``: not known)?"""
        tenants = self._tenants[pool_id]
        return tenants is None or group in tenants

    def _stored(self, stream: EventStream, node: Node, medium: str) -> None:
        parent = None if node.parent is None or node.parent.is_root else _hashes(node.parent)[-1]
        tokens = node.tokens or self._tokens_from_store(node)
        extra = self.extra_key(node.namespace)
        stream.stored(_hashes(node), parent, np.frombuffer(tokens, dtype="<i4").tolist(), self.block_size, medium,
                      extra_keys=[[extra]] * node.num_pages if extra else None)

    def _tokens_from_store(self, node: Node) -> bytes:
        storage = self.manager.storage
        if storage is None:
            return b""
        try:
            tokens = storage.read_tokens(node.page_key_list())
        except Exception as exc:  # (a store that cannot answer: the event goes without tokens)
            logger.warning("events: cannot read the tokens of node %d: %s", node.node_id, exc)
            return b""
        return b"".join(tokens) if all(t is not None for t in tokens) else b""

    # -- streams and snapshots ------------------------------------------------------------

    def sync_pools(self) -> None:
        """A stream (and its snapshot) for each pool registered since the last call (but
        an engine-owned pool registered without one: a TP engine's ranks but the first);
        the stream of each pool retired since ends (:meth:`_end`)."""
        serving = [pool.pool_id for pool in self.manager.pools if not pool.retired and pool.kv_events]
        for pool_id in [p for p in self.streams if p not in serving]:
            self._end(pool_id)
        for pool_id in serving:
            if pool_id not in self.streams:
                stream = self.publisher.stream(f"{self.topic}{pool_id}", data_parallel_rank=pool_id)
                self.streams[pool_id] = stream
                self._tenants[pool_id] = self._tenants_of(self.manager, pool_id)
                stream.rescope(self._tenants[pool_id])
                self._restart(pool_id, stream)

    def retenant(self) -> None:
        """The identities were reloaded: a stream whose pool's tenants changed starts
        over (``AllBlocksCleared``, then a snapshot of what it shows now)."""
        for pool_id, stream in self.streams.items():
            tenants = self._tenants_of(self.manager, pool_id)
            if tenants != self._tenants[pool_id]:
                self._tenants[pool_id] = tenants
                stream.rescope(tenants)
                self._restart(pool_id, stream)

    def _end(self, pool_id: int) -> None:
        """The pool is gone (its engine said bye, its lease expired, or its manager
        closed): its stream's last batch is ``AllBlocksCleared`` — a router stops
        counting on that rank's blocks, the host and disk ones included — and the stream
        stops (pool ids are not reused: nothing speaks on its topic again)."""
        self._snapshots.pop(pool_id, None)
        self._tenants.pop(pool_id, None)
        self.publisher.end(self.streams.pop(pool_id))

    def _restart(self, pool_id: int, stream: EventStream) -> None:
        stream.cleared()
        stream.needs_resync = False
        self._snapshots[pool_id] = self._snapshot(pool_id, stream, self.manager.tree.namespaces(), whole=True)

    def _snapshot(self, pool_id: int, stream: EventStream, namespaces, *, whole: bool) -> _Snapshot:
        snapshot = _Snapshot(namespaces, whole)
        snapshot.steps = self._walk(pool_id, stream, snapshot)
        return snapshot

    def _walk(self, pool_id: int, stream: EventStream, snapshot: _Snapshot) -> Iterator[None]:
        """Announce the snapshot's namespaces, :data:`SNAPSHOT_SLICE` nodes per step:
        each node's pages in the pool (for a whole walk) and, if the stream shows the
        namespace, on host and disk."""
        tree = self.manager.tree
        done = 0
        while snapshot.pending:
            namespace = next(iter(snapshot.pending))
            whole = snapshot.pending.pop(namespace)
            shown = self._shows(pool_id, tree.group_of(namespace))
            if not tree.has_namespace(namespace) or not (whole or shown):
                continue
            seen: set[int] = set()
            stack = list(tree.root(namespace).children.values())
            while stack:
                node = stack.pop()
                if not tree.is_live(node) or node.node_id in seen:
                    continue
                # Ancestors first: a node split since its parent was walked has a new
                # upper half that no walk reaches but this one.
                path = []
                up = node
                while up.parent is not None and not up.is_root and up.node_id not in seen:
                    path.append(up)
                    up = up.parent
                for n in reversed(path):
                    seen.add(n.node_id)
                    self._announce(pool_id, stream, n, device=whole, tiers=shown)
                stack.extend(node.children.values())
                done += len(path)
                if done >= SNAPSHOT_SLICE:
                    done = 0
                    yield

    def _announce(self, pool_id: int, stream: EventStream, node: Node, *, device: bool, tiers: bool) -> None:
        for slot in node.residency:
            if slot == pool_id:
                if device:
                    self._stored(stream, node, MEDIUM_GPU)
            elif slot in (HOST_SLOT, DISK_SLOT) and tiers:
                self._stored(stream, node, MEDIUM_CPU if slot == HOST_SLOT else MEDIUM_STORAGE)

    def tick(self) -> None:
        """Streams for new pools, resyncs, and a slice of each snapshot in progress."""
        self.sync_pools()
        for pool_id, stream in self.streams.items():
            if stream.needs_resync:
                logger.warning("events: stream %r lost events; re-announcing its blocks", stream.topic)
                self._restart(pool_id, stream)
        for pool_id, snapshot in list(self._snapshots.items()):
            if next(snapshot.steps, StopIteration) is StopIteration and self._snapshots.get(pool_id) is snapshot:
                del self._snapshots[pool_id]

    def close(self) -> None:
        """The manager closed: its pools' streams end."""
        for pool_id in list(self.streams):
            self._end(pool_id)
        if self.manager.tree.observer is self:
            self.manager.tree.observer = None


class KvEvents:
    """The publisher and one :class:`ManagerEvents` per tier manager (owner thread)."""

    def __init__(self, publisher: EventPublisher, topic: str = "",
                 kept: Callable[[bytes], str | None] = lambda namespace: None,
                 tenants: Callable[[TierManager, PoolId], Tenants] = lambda manager, pool_id: None) -> None:
        """``kept(namespace id)``: its extra key as kept across restarts (the tenant
        log), for the blocks a restart restored: no session has named their namespace
        to this daemon yet when they are announced. ``tenants(manager, pool id)``: the
        tenants whose namespaces the pool's stream shows (``None``: every namespace)."""
        self.publisher = publisher
        self._kept = kept
        self._tenants = tenants
        self.topic = topic
        # The extra keys of the namespaces that hold pages: kept as long as the trees
        # keep those namespaces (for good), since their blocks may be announced any time.
        self.extra_keys: dict[bytes, str] = {}
        self._named: dict[bytes, str] = {}  # of namespaces named and holding no page yet: the last EXTRA_KEYS
        self._managers: dict[bytes, ManagerEvents] = {}

    def namespace(self, namespace: bytes, extra_key: str) -> None:
        """A namespace the daemon made (or a session stores under), and its extra key
        (the events' ``extra_keys``). Until one of its blocks is announced only the last
        :data:`EXTRA_KEYS` are remembered: a client naming ever new extra keys does not
        grow the daemon, nor pushes out the key of a namespace in use. O(1)."""
        if not extra_key or namespace in self.extra_keys:
            return
        self._named.pop(namespace, None)  # (named again: the newest)
        self._named[namespace] = extra_key
        if len(self._named) > EXTRA_KEYS:
            del self._named[next(iter(self._named))]

    def extra_key(self, namespace: bytes) -> str | None:
        """The extra key of a namespace whose block is being announced, if known (named
        by a session, or kept across a restart; it holds pages from now on: its key is
        kept). O(1)."""
        found = self.extra_keys.get(namespace)
        if found is None:
            found = self._named.pop(namespace, None) or self._kept(namespace)
            if found is not None:
                self.extra_keys[namespace] = found
        return found

    def tick(self, managers: dict[bytes, TierManager]) -> None:
        """The loop's turn: observe new managers (and stop observing closed ones),
        advance streams and snapshots, send the batches, answer replay requests."""
        for fingerprint in [fp for fp, events in self._managers.items() if managers.get(fp) is not events.manager]:
            self._managers.pop(fingerprint).close()  # a manager closed (its spec unused; see hicache.daemon.specs)
        for fingerprint, manager in managers.items():
            if fingerprint not in self._managers:
                self._managers[fingerprint] = ManagerEvents(self.publisher, manager, self.topic, self.extra_key,
                                                            self._tenants)
        for events in self._managers.values():
            events.tick()
        self.publisher.publish()
        self.publisher.serve_replay(REPLAYS_PER_TURN)

    def retenant(self) -> None:
        """The identities were reloaded: see :meth:`ManagerEvents.retenant`."""
        for events in self._managers.values():
            events.retenant()

    def stats(self) -> dict[str, Any]:
        p = self.publisher
        return {"batches": p.batches_sent, "events": p.events_sent, "dropped": p.dropped,
                "subscribers": p.subscribers()}

    def close(self, linger_s: float = 0.0) -> None:
        """Every stream ends (the daemon's tiers serve nothing while it is down; a
        daemon that comes back starts its streams over). ``linger_s``: how long those
        last batches may take to reach subscribers that are behind (see
        :meth:`EventPublisher.close`)."""
        for events in self._managers.values():
            events.close()
        self.publisher.end_left()
        self.publisher.publish()
        self.publisher.close(linger_s)
