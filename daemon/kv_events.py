"""The daemon's KV events: every tier manager's residency changes, as streams of
:mod:`hicache.daemon.events` (vLLM's wire format) that routers subscribe to.

One stream per device pool (topic ``<[events].topic><pool id>``, data-parallel rank the
pool id; an engine-owned pool registered with ``kv_events=False`` has none — a TP
engine's ranks but the first, so that a router sees one stream per engine):
``BlockStored`` / ``BlockRemoved`` with medium ``GPU`` for that pool's device pages,
``CPU`` for host pages and ``STORAGE`` for disk pages — the host and disk tiers
are shared by every pool of a spec, so their events go to each of its pools' streams. A
block is a page: its hash the low 64 bits of the page key (equal on every node of a
fleet), its parent the page before it, ``block_size`` the spec's page size, and the
namespace's extra key (an engine's cache salt / LoRA name) as the block's extra keys.

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

import numpy as np

from hicache.daemon.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, EventPublisher, EventStream
from hicache.tiers.manager import TierManager
from hicache.tree import DISK_SLOT, HOST_SLOT, Node, Slot

logger = logging.getLogger(__name__)

SNAPSHOT_SLICE = 2000  # nodes a snapshot announces per loop turn
EXTRA_KEYS = 1 << 16  # namespaces named and holding no page yet whose extra key is remembered
REPLAYS_PER_TURN = 4  # replay requests answered per loop turn at most (each up to a ring of batches)


def _hashes(node: Node) -> list[int]:
    """The block hash of each page: the low 64 bits of its key (big-endian)."""
    return np.frombuffer(node.page_keys, dtype=">u8")[1::2].tolist()


class ManagerEvents:
    """One tier manager's events (the tree's observer; owner thread)."""

    def __init__(self, publisher: EventPublisher, manager: TierManager, topic: str,
                 extra_key: Callable[[bytes], str | None]) -> None:
        """``extra_key(namespace id)``: the extra key it was made with, if known (see
        :meth:`KvEvents.extra_key`)."""
        self.publisher = publisher
        self.manager = manager
        self.topic = topic
        self.extra_key = extra_key
        self.block_size = manager.spec.page_size
        self.streams: dict[int, EventStream] = {}  # pool id -> its stream
        self._snapshots: dict[int, Iterator[None]] = {}  # pool id -> the snapshot in progress
        manager.tree.observer = self

    # -- the tree's observer --------------------------------------------------------------

    def added(self, node: Node, slot: Slot) -> None:
        if slot >= 0:
            stream = self.streams.get(slot)
            if stream is not None:
                self._stored(stream, node, MEDIUM_GPU)
            return
        medium = MEDIUM_CPU if slot == HOST_SLOT else MEDIUM_STORAGE
        for stream in self.streams.values():
            self._stored(stream, node, medium)

    def dropped(self, node: Node, slot: Slot) -> None:
        if slot >= 0:
            stream = self.streams.get(slot)
            if stream is not None:
                stream.removed(_hashes(node), MEDIUM_GPU)
            return
        medium = MEDIUM_CPU if slot == HOST_SLOT else MEDIUM_STORAGE
        hashes = _hashes(node)
        for stream in self.streams.values():
            stream.removed(hashes, medium)

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
                self._restart(pool_id, stream)

    def _end(self, pool_id: int) -> None:
        """The pool is gone (its engine said bye, its lease expired, or its manager
        closed): its stream's last batch is ``AllBlocksCleared`` — a router stops
        counting on that rank's blocks, the host and disk ones included — and the stream
        stops (pool ids are not reused: nothing speaks on its topic again)."""
        self._snapshots.pop(pool_id, None)
        self.publisher.end(self.streams.pop(pool_id))

    def _restart(self, pool_id: int, stream: EventStream) -> None:
        stream.cleared()
        stream.needs_resync = False
        self._snapshots[pool_id] = self._snapshot(pool_id, stream)

    def _snapshot(self, pool_id: int, stream: EventStream) -> Iterator[None]:
        tree = self.manager.tree
        seen: set[int] = set()
        done = 0
        for namespace in tree.namespaces():
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
                    self._announce(pool_id, stream, n)
                stack.extend(node.children.values())
                done += len(path)
                if done >= SNAPSHOT_SLICE:
                    done = 0
                    yield

    def _announce(self, pool_id: int, stream: EventStream, node: Node) -> None:
        for slot in node.residency:
            if slot == pool_id:
                self._stored(stream, node, MEDIUM_GPU)
            elif slot in (HOST_SLOT, DISK_SLOT):
                self._stored(stream, node, MEDIUM_CPU if slot == HOST_SLOT else MEDIUM_STORAGE)

    def tick(self) -> None:
        """Streams for new pools, resyncs, and a slice of each snapshot in progress."""
        self.sync_pools()
        for pool_id, stream in self.streams.items():
            if stream.needs_resync:
                logger.warning("events: stream %r lost events; re-announcing its blocks", stream.topic)
                self._restart(pool_id, stream)
        for pool_id, snapshot in list(self._snapshots.items()):
            if next(snapshot, StopIteration) is StopIteration:
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
                 kept: Callable[[bytes], str | None] = lambda namespace: None) -> None:
        """``kept(namespace id)``: its extra key as kept across restarts (the tenant
        log), for the blocks a restart restored: no session has named their namespace
        to this daemon yet when they are announced."""
        self.publisher = publisher
        self._kept = kept
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
                self._managers[fingerprint] = ManagerEvents(self.publisher, manager, self.topic, self.extra_key)
        for events in self._managers.values():
            events.tick()
        self.publisher.publish()
        self.publisher.serve_replay(REPLAYS_PER_TURN)

    def stats(self) -> dict[str, int]:
        p = self.publisher
        return {"batches": p.batches_sent, "events": p.events_sent, "dropped": p.dropped}

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
