"""The tier manager: one tree, device pools, the host pool and storage, driven as one.

What it does, on the owner thread (the only thread that touches the tree, the
allocators and the registries below):

* **alloc / insert / release** — private device pages for sessions, the tree taking the
  whole pages of an insert (duplicates freed), private pages released;
* **backup device -> host** by the write policy (``write_through``: on insert;
  ``write_through_selective``: on the N-th hit; ``write_back``: when a page is about to
  be evicted from the device), and **host -> disk** by the disk policy
  (``write_through``: once on host; ``write_back``: before a host copy is dropped;
  ``none``);
* **eviction cascade** — device pressure drops device copies that live elsewhere (or
  writes them back first); host pressure drops host copies (writing them to disk first
  under ``write_back``); the disk is kept under its capacity by evicting the tree's disk
  LRU and deleting those records. A node that lives nowhere leaves the tree;
* **load** — reserve device pages for the host / disk part of a matched path, bring disk
  pages to host first, then copy host -> device layer by layer, stamping the load's
  ticket on the layer counters as each layer lands. The reply (a future) comes as soon
  as the pages are reserved and the copies started — or, for disk pages, once they are
  in host memory, so that a failed read shortens the hit instead of handing out pages
  that will never be written. Loads of nodes already in flight share that transfer;
* **prefetch** — a match whose prefix continues on disk starts disk -> host at once
  (``best_effort``), or answers after it (``wait_complete``) or after at most a timeout
  (``timeout``);
* **warm restart** — :meth:`TierManager.rebuild_from_storage` puts every persisted page
  back into the tree as disk-resident.

Transfers run on worker threads and report back through :class:`hicache.jobs.Completions`;
:meth:`TierManager.poll` runs those completions. A transfer holds an internal tree lock
(or pin) on the deepest node it touches, so nothing it reads or writes is evicted under
it; its per-node entries follow node splits (``on_split``).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from hicache.counters import LayerCounters, Ticket
from hicache.errors import InvalidArgument, SpecMismatch, UnknownNode
from hicache.jobs import Completions, Workers
from hicache.keys import (
    PAGE_KEY_BYTES, ROOT_PARENT_KEY, TOKEN_BYTES, NamespaceId, Tokens, chain_page_keys, pack_tokens,
)
from hicache.kernels.page_copy import CpuCopyWorkers
from hicache.metrics import NullMetrics
from hicache.pages import PAGE_ID_DTYPE, PageAllocator, PageIds, PageIdsLike, distinct_page_ids
from hicache.pools import DevicePool, HostPool
from hicache.spec import KVSpec
from hicache.storage.base import PageMeta, PageRecord, StorageBackend
from hicache.transfer import PageMover
from hicache.tree import HiRadixTree, InsertResult, MatchResult, Node, Place, PoolId, Tier

logger = logging.getLogger(__name__)

REBUILD_PROGRESS_EVERY = 16384  # records between two progress calls of rebuild_from_storage

_EVICTED_MEMORY = 1 << 18  # page keys remembered for miss reasons (~30 MiB at most)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DISK_POLICIES = ("write_through", "write_back", "none")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    write_policy: str = "write_through"
    write_threshold: int = 1  # hits before a write_through_selective backup
    disk_policy: str = "write_through"
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 0.05
    prefetch_min_pages: int = 1
    counter_slots: int = 64  # concurrent loads per pool
    eviction: str = "lru"
    copy_threads: int = 2  # CPU copy threads inside a transfer
    io_threads: int = 2  # storage readers

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("write_policy", self.write_policy, WRITE_POLICIES),
            ("disk_policy", self.disk_policy, DISK_POLICIES),
            ("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES),
        ):
            if value not in allowed:
                raise InvalidArgument(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if self.write_threshold < 1 or self.prefetch_min_pages < 1 or self.counter_slots < 1:
            raise InvalidArgument("write_threshold, prefetch_min_pages and counter_slots must be >= 1")
        if self.prefetch_timeout_s < 0:
            raise InvalidArgument("prefetch_timeout_s must be >= 0")


class Hit(NamedTuple):
    """A match, plus the tickets of loads still landing in its device part."""

    match: MatchResult
    wait: tuple[Ticket, ...]


class LoadResult(NamedTuple):
    """``device_pages``: every page of the path from the root to ``node`` in the pool
    (what the engine writes into its req_to_token row); the last ``num_loaded_pages`` of
    them arrive layer by layer — wait on every ticket in ``wait`` before reading a
    layer."""

    node: Node
    device_pages: PageIds
    num_loaded_pages: int
    wait: tuple[Ticket, ...]


class TierAccount(NamedTuple):
    free: int
    private: int
    cached_evictable: int
    cached_protected: int
    staging: int

    @property
    def total(self) -> int:
        return sum(self)


class LoadTiming(NamedTuple):
    """One finished CPU-mode load, as the copy threads saw it (``time.perf_counter``
    instants): copies started, layer 0 stamped complete, last layer stamped complete."""

    num_pages: int
    num_bytes: int
    started_at: float
    first_layer_at: float
    last_layer_at: float

    @property
    def first_layer_s(self) -> float:
        return self.first_layer_at - self.started_at

    @property
    def full_s(self) -> float:
        return self.last_layer_at - self.started_at


@dataclass(eq=False)
class _Entry:
    node: Node
    src: np.ndarray  # per page of the node: source page id (or host page)
    dst: np.ndarray  # per page of the node: destination page id


@dataclass(eq=False)
class _Transfer:
    kind: str  # "backup", "load", "disk_read", "disk_write"
    pool: int | None
    entries: list[_Entry]
    hold: Node  # the node whose internal lock / pin protects the transfer
    ticket: Ticket | None = None
    waiters: list[Callable[[], None]] = field(default_factory=list)
    then_drop: set[int] = field(default_factory=set)  # node ids to drop from the source tier after
    timing: dict[str, float] = field(default_factory=dict)

    @property
    def num_pages(self) -> int:
        return sum(len(e.dst) for e in self.entries)

    def split(self, upper: Node, lower: Node) -> None:
        for i, entry in enumerate(self.entries):
            if entry.node is lower:
                k = upper.num_pages
                self.entries[i : i + 1] = [
                    _Entry(upper, entry.src[:k], entry.dst[:k]),
                    _Entry(lower, entry.src[k:], entry.dst[k:]),
                ]
                if lower.node_id in self.then_drop:
                    self.then_drop.add(upper.node_id)
                return


@dataclass(eq=False)
class _Pool:
    pool_id: int
    ranks: list[DevicePool]
    movers: list[PageMover]
    allocator: PageAllocator
    private: np.ndarray  # bool per page id
    counters: LayerCounters
    num_private: int = 0
    staging: int = 0  # pages reserved by loads still waiting for disk reads
    retired: bool = False


@dataclass(eq=False)
class _PendingLoad:
    pool: _Pool
    segment: list[Node]  # nodes to bring to the device (the last one is locked)
    pages: np.ndarray  # reserved device pages for the segment
    future: Future
    reads_left: int = 0


def _concat(parts: Iterable[np.ndarray]) -> np.ndarray:
    parts = list(parts)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class TierManager:
    """See the module docstring. All methods run on the owner thread."""

    def __init__(
        self,
        spec: KVSpec,
        *,
        host_pages: int,
        storage: StorageBackend | None = None,
        config: TierConfig | None = None,
        completions: Completions | None = None,
        clock: Callable[[], float] = time.monotonic,
        pinned_host: bool | None = None,
        metrics=None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``progress`` is called now and then while the host pool is pinned (seconds
        for a large one), with the bytes done."""
        self.spec = spec
        self.metrics = metrics if metrics is not None else NullMetrics()
        # page key -> the tier it was last evicted from (bounded), to tell a miss's reason
        self.recently_evicted: OrderedDict[bytes, str] = OrderedDict()
        self.config = config or TierConfig()
        if self.config.disk_policy != "none" and storage is None:
            self.config = dataclasses.replace(self.config, disk_policy="none")
        self.tree = HiRadixTree(eviction=self.config.eviction, on_split=self._on_split)
        self.host_pool = HostPool(spec, host_pages, pinned=pinned_host, progress=progress)
        self.host_alloc = PageAllocator.for_host(host_pages)
        self.storage = storage if self.config.disk_policy != "none" else None
        self.completions = completions or Completions()
        self.workers = Workers(self.completions, io_threads=self.config.io_threads)
        self._copy_workers = CpuCopyWorkers(self.config.copy_threads) if self.config.copy_threads > 1 else None
        self._clock = clock
        self._pools: dict[int, _Pool] = {}
        self._by_node: dict[int, list[_Transfer]] = {}
        self._host_staging = 0
        self._disk_pending = 0
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        # Told the keys the store evicted to make room for this manager's writes. A store
        # shared by several managers (one per KV spec) needs them all told: the owner
        # replaces this with a function that calls every manager's forget_disk_keys.
        self.on_store_evicted: Callable[[Sequence[bytes]], None] = self.forget_disk_keys
        self._timer_seq = itertools.count()
        self._streams: dict[torch.device, object] = {}
        self.load_timings: deque[LoadTiming] = deque(maxlen=256)  # recent loads, newest last
        stats = self.storage.stats() if self.storage is not None else None
        self.disk_capacity_pages = stats.capacity_bytes // spec.host_page_bytes if stats else 0

    # ------------------------------------------------------------------ set-up

    def add_namespace(self, namespace: NamespaceId) -> Node:
        return self.tree.add_namespace(namespace, self.spec.page_size)

    def register_pool(self, pool_id: int, ranks: list[DevicePool]) -> LayerCounters:
        """Adopt an engine's device pool (one :class:`DevicePool` per TP rank, in rank
        order). Returns the pool's layer counters, whose handle goes to the engine."""
        if pool_id in self._pools:
            raise InvalidArgument(f"pool {pool_id} is already registered")
        if len(ranks) != self.spec.tp_size:
            raise InvalidArgument(f"the spec has TP size {self.spec.tp_size}, got {len(ranks)} rank pools")
        num_pages = ranks[0].num_pages
        for rank, pool in enumerate(ranks):
            if pool.spec.fingerprint != self.spec.fingerprint:
                raise SpecMismatch(f"rank {rank}'s pool has another KV spec")
            if pool.rank != rank or pool.num_pages != num_pages:
                raise InvalidArgument("rank pools must be given in rank order with equal page counts")
        movers = [PageMover(pool, self.host_pool, workers=self._copy_workers) for pool in ranks]
        device = ranks[0].device
        counters = LayerCounters(
            self.config.counter_slots, self.spec.num_layers,
            cuda_device=device.index or 0 if device.type == "cuda" else None,
        )
        self._pools[pool_id] = _Pool(
            pool_id, ranks, movers, PageAllocator.for_device(num_pages),
            np.zeros(num_pages + 1, dtype=bool), counters,
        )
        return counters

    def _pool(self, pool_id: int) -> _Pool:
        try:
            pool = self._pools[pool_id]
        except (KeyError, TypeError):
            raise InvalidArgument(f"pool {pool_id!r} is not registered") from None
        if pool.retired:
            raise InvalidArgument(f"pool {pool_id} has been unregistered")
        return pool

    def find(self, node_id: int) -> Node | None:
        """The live node with this id, if any."""
        return self.tree.find(node_id)

    def num_private(self, pool_id: PoolId) -> int:
        """The pool's private pages (its engine's, allocated and not inserted)."""
        return self._pool(pool_id).num_private

    @property
    def host_bytes(self) -> int:
        return self.host_pool.nbytes

    def device_pools(self) -> list[DevicePool]:
        """Every registered rank pool (for reporting)."""
        return [rank for pool in self._pools.values() for rank in pool.ranks]

    def num_pages(self, pool_id: int) -> int:
        return self._pool(pool_id).allocator.capacity

    def retire_pool(self, pool_id: int) -> None:
        """The engine is gone: refuse new work for its pool, and once no transfer uses
        the pool any more, forget its pages and unmap it (see :meth:`poll`). The caller
        has released the session's locks and private pages."""
        pool = self._pool(pool_id)
        pool.retired = True
        self._reap_pools()

    def _reap_pools(self) -> None:
        busy = {t.pool for ts in self._by_node.values() for t in ts}
        for pool_id, pool in list(self._pools.items()):
            if not pool.retired or pool_id in busy:
                continue
            pool.allocator.free(self.tree.discard_pool(pool_id))
            if pool.num_private:
                pool.allocator.free(np.flatnonzero(pool.private))
            del self._pools[pool_id]
            pool.counters.close()
            for rank in pool.ranks:
                rank.close()
            logger.info("pool %s unregistered", pool_id)

    def reserve(self, pool_id: int, pages: PageIdsLike) -> None:
        """Make specific pages private (an engine re-registering with pages its running
        requests still use)."""
        pool = self._pool(pool_id)
        ids = self._checked_ids(pool, pages)
        pool.allocator.take(ids)
        pool.private[ids] = True
        pool.num_private += len(ids)

    # ------------------------------------------------------------------ private pages

    def alloc(self, pool_id: int, num_pages: int) -> PageIds | None:
        """``num_pages`` private device pages (evicting cached pages if needed), or
        ``None`` when the pool cannot provide them now."""
        pool = self._pool(pool_id)
        if num_pages < 0:
            raise InvalidArgument(f"cannot allocate {num_pages} pages")
        pages = self._device_alloc(pool, num_pages)
        if pages is None:
            return None
        pool.private[pages] = True
        pool.num_private += len(pages)
        return pages

    def release(self, pool_id: int, pages: PageIdsLike) -> None:
        """Give back private pages that were never inserted."""
        pool = self._pool(pool_id)
        ids = self._checked_ids(pool, pages)
        if not pool.private[ids].all():
            raise InvalidArgument("only private pages can be released")
        pool.private[ids] = False
        pool.num_private -= len(ids)
        pool.allocator.free(ids)

    def page_ids(self, pool_id: int, pages: PageIdsLike) -> PageIds:
        """``pages`` as ids, checked: in the pool's range, none repeated."""
        return self._checked_ids(self._pool(pool_id), pages)

    @staticmethod
    def _checked_ids(pool: _Pool, pages: PageIdsLike) -> PageIds:
        return distinct_page_ids(pages, pool.allocator.capacity)

    # ------------------------------------------------------------------ match / insert / locks

    def match(self, namespace: NamespaceId, tokens: Tokens, pool_id: int) -> Hit:
        """Longest cached prefix as seen from the pool; starts a disk prefetch of its disk
        part and, under ``write_through_selective``, backs up pages hit often enough."""
        pool = self._pool(pool_id)
        result = self.tree.match(namespace, tokens, pool_id)
        if result.node is None or result.node.parent is None:  # unknown namespace, or nothing matched
            return Hit(result, ())
        if self.config.write_policy == "write_through_selective" and result.num_device_pages:
            # Hit counts only grow towards the root: back up from the deepest node that
            # reached the threshold (its ancestors without a host copy come along).
            node = result.last_device_node
            while not node.is_root and node.host_pages is None:
                if node.hit_count >= self.config.write_threshold:
                    self._backup(pool, node)
                    break
                node = node.parent
        if (self.storage is not None and result.num_disk_pages >= self.config.prefetch_min_pages):
            self._prefetch(result.node)
        # (no transfer in flight, the common case: not even the call)
        return Hit(result, self._tickets_on(result.last_device_node, pool_id) if self._by_node else ())

    def lookup(self, namespace: NamespaceId, tokens: Tokens, pool_id: PoolId) -> Hit | Future:
        """:meth:`match` when the prefetch policy answers at once, else
        :meth:`match_async`'s future."""
        if self.config.prefetch_policy == "best_effort":
            return self.match(namespace, tokens, pool_id)
        return self.match_async(namespace, tokens, pool_id)

    def match_async(self, namespace: NamespaceId, tokens: Tokens, pool_id: int) -> Future:
        """:meth:`match` under the prefetch policy: ``best_effort`` answers now;
        ``wait_complete`` once the disk part is in host memory; ``timeout`` then, or
        after ``prefetch_timeout_s``, whichever comes first."""
        hit = self.match(namespace, tokens, pool_id)
        future: Future = Future()
        if self.config.prefetch_policy == "best_effort" or not hit.match.num_disk_pages or self.storage is None:
            future.set_result(hit)
            return future
        packed = pack_tokens(tokens)

        def answer() -> None:
            if not future.done():
                result = self.tree.match(namespace, packed, pool_id, touch=False)
                future.set_result(Hit(result, self._tickets_on(result.last_device_node, pool_id)))

        reads = [t for n in self.tree.path(hit.match.node) for t in self._by_node.get(n.node_id, ())
                 if t.kind == "disk_read"]
        if not reads:
            answer()
            return future
        remaining = [len(reads)]

        def one_done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                answer()

        for transfer in reads:
            transfer.waiters.append(one_done)
        if self.config.prefetch_policy == "timeout":
            self._add_timer(self.config.prefetch_timeout_s, answer)
        return future

    def lock(self, node: Node, pool_id: int) -> None:
        self._pool(pool_id)
        self.tree.lock(node, pool_id)

    def unlock(self, node: Node, pool_id: int) -> None:
        self._pool(pool_id)
        self.tree.unlock(node, pool_id)

    def insert(self, namespace: NamespaceId, tokens: Tokens, pool_id: int, pages: PageIdsLike) -> InsertResult:
        """The tree takes the whole pages of ``tokens``. Each page is either one of the
        session's private pages or the pool's cached page for that position (from a
        match); private pages that duplicate cached ones are freed."""
        pool = self._pool(pool_id)
        ids = self._checked_ids(pool, pages)
        packed = pack_tokens(tokens)
        private = pool.private[ids]
        if not private.all():
            cached = self.tree.match(namespace, packed, pool_id, touch=False).device_pages
            positions = np.flatnonzero(~private)
            beyond = positions >= len(cached)
            if beyond.any() or (ids[positions] != cached[positions]).any():
                raise InvalidArgument("a page is neither private nor the cached page at its position")
        result = self.tree.insert(namespace, packed, pool_id, ids)
        taken = ids[private]
        pool.private[taken] = False
        pool.num_private -= len(taken)
        pool.allocator.free(result.duplicate_pages)
        if self.config.write_policy == "write_through" and result.node.host_pages is None:
            self._backup(pool, result.node)
        return result

    # ------------------------------------------------------------------ load

    def load(self, node: Node, pool_id: int) -> Future:
        """Bring the host / disk part of ``node``'s path into the pool; a future of
        :class:`LoadResult` (see the module docstring for when it completes)."""
        pool = self._pool(pool_id)
        if not self.tree.is_live(node):
            raise UnknownNode(f"{node!r} is not a live node")
        future: Future = Future()
        path = self.tree.path(node)
        device_len = 0
        while device_len < len(path) and path[device_len].device_pages(pool_id) is not None:
            device_len += 1
        segment = []
        for n in path[device_len:]:
            if n.host_pages is None and not n.on_disk:
                break
            if n.host_pages is None and self.storage is None:
                break
            segment.append(n)
        pages = None
        while segment:
            pages = self._device_alloc(pool, sum(n.num_pages for n in segment))
            if pages is not None:
                break
            segment.pop()
        if not segment:
            future.set_result(self._device_only(pool, path[:device_len], node))
            return future
        self.tree.lock(segment[-1], pool_id)
        pool.staging += len(pages)
        pending = _PendingLoad(pool, segment, pages, future)
        from_disk = [n for n in segment if n.host_pages is None]
        if from_disk:
            reads = self._read_from_disk(from_disk)
            pending.reads_left = len(reads)
            for transfer in reads:
                transfer.waiters.append(lambda: self._read_for_load_done(pending))
            if not reads:
                self._start_load(pending)
        else:
            self._start_load(pending)
        return future

    def _read_for_load_done(self, pending: _PendingLoad) -> None:
        pending.reads_left -= 1
        if pending.reads_left == 0:
            self._start_load(pending)

    def _start_load(self, pending: _PendingLoad) -> None:
        pool = pending.pool
        hold = pending.segment[-1]
        # Look at the path again: reads may have split nodes (a corrupt page keeps the
        # pages before it) or failed, and another load may have brought some nodes to
        # the device meanwhile. Load what is on host right below the device part; the
        # rest shortens the hit.
        path = self.tree.path(hold)
        first = 0
        while first < len(path) and path[first].device_pages(pool.pool_id) is not None:
            first += 1
        keep = first
        while keep < len(path) and path[keep].host_pages is not None and path[keep].device_pages(pool.pool_id) is None:
            keep += 1
        to_load = path[first:keep]
        used = sum(n.num_pages for n in to_load)
        if used > len(pending.pages):  # a node split off above the segment: load less
            while to_load and sum(n.num_pages for n in to_load) > len(pending.pages):
                to_load.pop()
                keep -= 1
            used = sum(n.num_pages for n in to_load)
        pool.staging -= len(pending.pages)
        if used < len(pending.pages):
            pool.allocator.free(pending.pages[used:])
        ticket = pool.counters.begin() if to_load else None
        if ticket is None:
            if to_load:
                pool.allocator.free(pending.pages[:used])
            self.tree.unlock(hold, pool.pool_id)
            pending.future.set_result(self._device_only(pool, path[:first], hold))
            return
        entries = []
        offset = 0
        for n in to_load:
            dst = pending.pages[offset : offset + n.num_pages]
            offset += n.num_pages
            self.tree.add_device(n, pool.pool_id, dst)
            entries.append(_Entry(n, n.host_pages.astype(np.int64), dst.astype(np.int64)))
        # The lock taken at load() covers the whole segment; the transfer keeps it.
        transfer = _Transfer("load", pool.pool_id, entries, hold, ticket=ticket)
        self._register(transfer)
        src = _concat(e.src for e in entries)
        dst = _concat(e.dst for e in entries)
        counters = pool.counters
        movers = pool.movers
        cuda = pool.ranks[0].device.type == "cuda"

        timing = transfer.timing
        timing["start"] = time.perf_counter()
        last_layer = self.spec.num_layers - 1

        def on_layer(layer: int) -> None:
            if cuda:
                counters.events.record(ticket, layer, torch.cuda.current_stream())
            else:
                counters.complete_layer(ticket, layer)
                if layer == 0:
                    timing["first"] = time.perf_counter()
                if layer == last_layer:
                    timing["last"] = time.perf_counter()

        def enqueue() -> None:
            try:
                if len(movers) == 1:
                    movers[0].load(src, dst, on_layer=on_layer)
                else:
                    for layer in range(self.spec.num_layers):
                        for mover in movers:
                            if mover.has_layer(layer):
                                mover.load_layer(src, dst, layer)
                        on_layer(layer)
            except BaseException:
                counters.fail(ticket)
                raise

        self._run_copy(pool, enqueue, lambda error: self._load_done(transfer, error))
        pending.future.set_result(self._load_result(pool, path[:keep], used, path[keep - 1]))

    def _load_done(self, transfer: _Transfer, error: BaseException | None) -> None:
        self._unregister(transfer)
        pool = self._pools[transfer.pool]
        if error is None and pool.ranks[0].device.type == "cuda":
            for layer in range(self.spec.num_layers):  # the events were the engine's signal
                pool.counters.complete_layer(transfer.ticket, layer)
        if error is None:
            self._report(transfer, "h2d")
        else:
            logger.error("load into pool %s failed: %s", transfer.pool, error)
            self.metrics.missed("load_failed", transfer.num_pages * self.spec.page_size)
            first = transfer.entries[0].node
            if self.tree.is_live(first) and first.device_pages(transfer.pool) is not None:
                pool.allocator.free(self.tree.discard(first, Tier.DEVICE, transfer.pool))
        self.tree.unlock(transfer.hold, transfer.pool)
        pool.counters.finish(transfer.ticket)
        timing = transfer.timing
        if error is None and "last" in timing:
            self.load_timings.append(LoadTiming(
                transfer.num_pages, transfer.num_pages * self.spec.host_page_bytes,
                timing["start"], timing["first"], timing["last"]))
            self.metrics.first_layer(timing["first"] - timing["start"])

    def _device_only(self, pool: _Pool, device: list[Node], node: Node) -> LoadResult:
        """A load that brought nothing: the device part of ``node``'s path."""
        last = device[-1] if device else self.tree.root(node.namespace)
        return self._load_result(pool, device, 0, last)

    def _load_result(self, pool: _Pool, nodes: list[Node], loaded: int, last: Node) -> LoadResult:
        parts = [n.device_pages(pool.pool_id) for n in nodes]
        pages = np.concatenate(parts) if parts else np.empty(0, dtype=PAGE_ID_DTYPE)
        return LoadResult(last, pages, loaded, self._tickets_on(last, pool.pool_id))

    def _run_copy(self, pool: _Pool, enqueue: Callable[[], None], done: Callable[[BaseException | None], None]) -> None:
        """CPU pools: run the copies on the transfer thread. CUDA pools: enqueue them now,
        on this thread and the manager's stream (so every layer's event is recorded
        before the caller replies), and let the transfer thread wait for the end."""
        if pool.ranks[0].device.type != "cuda":
            self.workers.copy(enqueue, lambda _, error: done(error))
            return
        stream = self._stream(pool.ranks[0].device)
        try:
            with torch.cuda.stream(stream):
                enqueue()
                finished = torch.cuda.Event()
                finished.record(stream)
        except BaseException as exc:  # noqa: BLE001 - reported through done()
            failure = exc
            self.completions.post(lambda: done(failure))
            return
        self.workers.copy(finished.synchronize, lambda _, error: done(error))

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _tickets_on(self, node: Node | None, pool_id: int) -> tuple[Ticket, ...]:
        """Tickets of loads still landing in ``node``'s path in the pool."""
        if node is None or not self._by_node:
            return ()
        tickets = []
        while node is not None and node.parent is not None:
            for transfer in self._by_node.get(node.node_id, ()):
                if transfer.kind == "load" and transfer.pool == pool_id and transfer.ticket not in tickets:
                    tickets.append(transfer.ticket)
            node = node.parent
        return tuple(reversed(tickets))

    # ------------------------------------------------------------------ device -> host

    def _backup(self, pool: _Pool, node: Node, *, then_drop: bool = False) -> bool:
        """Copy ``node`` and its ancestors that lack one to host; False if not now."""
        path = [n for n in self.tree.path(node) if n.host_pages is None and not self._busy(n, "backup")]
        if not path or (then_drop and path[-1] is not node):
            return False
        total = sum(n.num_pages for n in path)
        host_pages = self._host_alloc(total)
        if host_pages is None:
            return False
        entries = []
        offset = 0
        for n in path:
            src = n.device_pages(pool.pool_id)
            if src is None:  # cannot happen: device residency is closed under ancestors
                raise AssertionError(f"{n} has no pages in pool {pool.pool_id}")
            entries.append(_Entry(n, src.astype(np.int64), host_pages[offset : offset + n.num_pages].astype(np.int64)))
            offset += n.num_pages
        hold = path[-1]
        self.tree.lock(hold, pool.pool_id)
        transfer = _Transfer("backup", pool.pool_id, entries, hold)
        if then_drop:
            transfer.then_drop.add(node.node_id)
        self._register(transfer)
        self._host_staging += total
        src_all = _concat(e.src for e in entries)
        dst_all = _concat(e.dst for e in entries)
        movers = pool.movers

        def enqueue() -> None:
            for mover in movers:
                mover.backup(src_all, dst_all)

        self._run_copy(pool, enqueue, lambda error: self._backup_done(transfer, error))
        return True

    def _backup_done(self, transfer: _Transfer, error: BaseException | None) -> None:
        self._unregister(transfer)
        self._host_staging -= transfer.num_pages
        if error is None:
            self._report(transfer, "d2h")
        pool = self._pools[transfer.pool]
        self.tree.unlock(transfer.hold, transfer.pool)
        if error is not None:
            logger.error("backup from pool %s failed: %s", transfer.pool, error)
        added = []
        for entry in transfer.entries:
            node = entry.node
            ok = (error is None and self.tree.is_live(node) and node.host_pages is None
                  and (node.parent.is_root or node.parent.host_pages is not None))
            if not ok:
                self.host_alloc.free(entry.dst)
                continue
            self.tree.add_host(node, entry.dst)
            added.append(node)
        if added and self.config.disk_policy == "write_through":
            self._write_disk(added[-1])
        for entry in transfer.entries:
            if entry.node.node_id in transfer.then_drop:
                self._drop_if_evictable(entry.node, Tier.DEVICE, pool)

    def _drop_if_evictable(self, node: Node, tier: Tier, pool: _Pool | None) -> None:
        pool_id = pool.pool_id if tier == Tier.DEVICE else None
        if not self.tree.is_live(node) or not self.tree.is_evictable(node, tier, pool_id):
            return
        freed = self.tree.drop(node, tier, pool_id)
        if tier == Tier.DEVICE:
            pool.allocator.free(freed)
        elif tier == Tier.HOST:
            self.host_alloc.free(freed)

    # ------------------------------------------------------------------ host -> disk

    def _write_disk(self, node: Node, *, then_drop_host: bool = False) -> bool:
        """Write ``node`` and its ancestors that lack a disk record (all on host)."""
        if self.storage is None:
            return False
        path = [n for n in self.tree.path(node) if not n.on_disk and not self._busy(n, "disk_write")]
        if not path or any(n.host_pages is None for n in path):
            return False
        total = sum(n.num_pages for n in path)
        if not self._disk_room(total):
            return False
        records = []
        entries = []
        for n in path:
            host = n.host_pages.astype(np.int64)
            parent = n.parent.page_keys[-PAGE_KEY_BYTES:] if not n.parent.is_root else ROOT_PARENT_KEY
            page_bytes = len(n.key) // n.num_pages
            for i in range(n.num_pages):
                key = n.page_keys[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES]
                meta = PageMeta(n.namespace, parent, n.key[i * page_bytes : (i + 1) * page_bytes])
                records.append(PageRecord(key, self.host_pool.page(int(host[i])), meta))
                parent = key
            entries.append(_Entry(n, host, host))
        hold = path[-1]
        self.tree.pin(hold)
        transfer = _Transfer("disk_write", None, entries, hold)
        if then_drop_host:
            transfer.then_drop.add(node.node_id)
        self._register(transfer)
        self._disk_pending += total
        future = self.storage.put(records, fingerprint=self.spec.fingerprint)
        self.completions.forward(future, lambda result, error: self._write_disk_done(transfer, result, error))
        return True

    def _write_disk_done(self, transfer: _Transfer, result, error: BaseException | None) -> None:
        self._unregister(transfer)
        if error is None:
            self._report(transfer, "host_to_disk")
        self._disk_pending -= transfer.num_pages
        self.tree.unpin(transfer.hold)
        if error is not None:
            logger.error("disk write failed: %s", error)
        for entry in transfer.entries:
            node = entry.node
            if (error is None and self.tree.is_live(node) and not node.on_disk
                    and (node.parent.is_root or node.parent.on_disk)):
                self.tree.add_disk(node)
        if result is not None and result.evicted:
            self.on_store_evicted(result.evicted)
        for entry in transfer.entries:
            if entry.node.node_id in transfer.then_drop:
                self._drop_if_evictable(entry.node, Tier.HOST, None)

    def _disk_room(self, num_pages: int) -> bool:
        """Keep the tree's disk tier within capacity: evict its LRU to make room."""
        if not self.disk_capacity_pages:
            return True
        if num_pages > self.disk_capacity_pages:
            return False
        used = self.tree.sizes(Tier.DISK).cached + self._disk_pending
        excess = used + num_pages - self.disk_capacity_pages
        if excess > 0:
            used -= self._evict_disk(excess)
        return used + num_pages <= self.disk_capacity_pages

    def forget_disk_keys(self, keys: Iterable[bytes]) -> None:
        """The store dropped these records on its own: forget them (and what hangs below);
        keys this tree does not hold are ignored."""
        wanted = set(keys)
        hit = {id(node): node for key in wanted if (node := self.tree.disk_node(key)) is not None}
        for node in hit.values():
            if self.tree.is_live(node) and node.on_disk:  # not gone with an ancestor already
                below = self._subtree_disk_keys(node)
                self.tree.discard(node, Tier.DISK)
                self.storage.delete([k for k in below if k not in wanted])

    def _subtree_disk_keys(self, node: Node) -> list[bytes]:
        keys = []
        stack = [node]
        while stack:
            n = stack.pop()
            if n.on_disk:
                keys.extend(n.page_key_list())
                stack.extend(n.children.values())
        return keys

    # ------------------------------------------------------------------ disk -> host

    def _prefetch(self, node: Node) -> None:
        wanted = [n for n in self.tree.path(node) if n.host_pages is None and n.on_disk]
        if wanted:
            self._read_from_disk(wanted)

    def _read_from_disk(self, nodes: list[Node]) -> list[_Transfer]:
        """Bring disk-only ``nodes`` (a top-down run of one path) to host; returns the
        transfers to wait for (reads already in flight included)."""
        waiting = []
        fresh = []
        for n in nodes:
            busy = [t for t in self._by_node.get(n.node_id, ()) if t.kind == "disk_read"]
            if busy:
                waiting.extend(t for t in busy if t not in waiting)
            elif n.host_pages is None and n.on_disk:
                fresh.append(n)
        while fresh:
            pages = self._host_alloc(sum(n.num_pages for n in fresh))
            if pages is not None:
                break
            fresh.pop()
        if not fresh:
            return waiting
        entries = []
        offset = 0
        for n in fresh:
            dst = pages[offset : offset + n.num_pages].astype(np.int64)
            entries.append(_Entry(n, np.arange(offset, offset + n.num_pages), dst))
            offset += n.num_pages
        hold = fresh[-1]
        self.tree.pin(hold)
        transfer = _Transfer("disk_read", None, entries, hold)
        self._register(transfer)
        self._host_staging += len(pages)
        keys = [k for n in fresh for k in n.page_key_list()]
        buffers = [self.host_pool.page(int(h)) for h in pages]
        storage = self.storage
        fingerprint = self.spec.fingerprint

        def work() -> list[bool]:
            return storage.get(keys, buffers, fingerprint=fingerprint)

        self.workers.io(work, lambda found, error: self._read_done(transfer, found, error))
        waiting.append(transfer)
        return waiting

    def _read_done(self, transfer: _Transfer, found: list[bool] | None, error: BaseException | None) -> None:
        self._unregister(transfer)
        self._host_staging -= transfer.num_pages
        if found is not None:
            self._report(transfer, "disk_to_host", sum(found))
        self.tree.unpin(transfer.hold)
        if error is not None:
            logger.error("disk read failed: %s", error)
        found = found if found is not None else []
        failed = False
        offset = 0
        for entry in transfer.entries:
            node = entry.node
            n = len(entry.dst)
            ok = np.asarray(found[offset : offset + n], dtype=bool) if error is None else np.zeros(n, bool)
            offset += n
            usable = (not failed and self.tree.is_live(node) and node.host_pages is None
                      and (node.parent.is_root or node.parent.host_pages is not None))
            good = n if ok.all() else int(np.argmin(ok))
            if not usable or good == 0:
                self.host_alloc.free(entry.dst)
                if usable and node.on_disk:
                    self._drop_bad_records(node)
                failed = True
                continue
            if good < n:
                # The first good pages stay: cut the node there, forget the rest.
                upper = self.tree.split(node, good)
                self.tree.add_host(upper, entry.dst[:good])
                self.host_alloc.free(entry.dst[good:])
                self._drop_bad_records(node)
                failed = True
                continue
            self.tree.add_host(node, entry.dst)
        for waiter in transfer.waiters:
            waiter()

    def _drop_bad_records(self, node: Node) -> None:
        """A missing or corrupt record: forget ``node`` (and below) on disk, delete."""
        keys = self._subtree_disk_keys(node)
        self.tree.discard(node, Tier.DISK)
        self.metrics.missed("corrupt_record", len(keys) * self.spec.page_size)
        if keys:
            self.storage.delete(keys)

    # ------------------------------------------------------------------ allocation and eviction

    def _device_alloc(self, pool: _Pool, num_pages: int) -> PageIds | None:
        pages = pool.allocator.alloc(num_pages)
        if pages is None:
            self._evict_device(pool, num_pages - pool.allocator.num_free)
            pages = pool.allocator.alloc(num_pages)
        return pages

    def _host_alloc(self, num_pages: int) -> PageIds | None:
        pages = self.host_alloc.alloc(num_pages)
        if pages is None:
            self._evict_host(num_pages - self.host_alloc.num_free)
            pages = self.host_alloc.alloc(num_pages)
        return pages

    def _evict_device(self, pool: _Pool, num_pages: int) -> int:
        """Free at least ``num_pages`` device pages if possible (write-backs started
        here free theirs later). Returns the pages freed now."""
        freed = 0
        write_back = self.config.write_policy == "write_back"
        for node in self.tree.iter_evictable(Tier.DEVICE, pool.pool_id):
            if freed >= num_pages:
                break
            if write_back and node.host_pages is None and not node.on_disk:
                self._backup(pool, node, then_drop=True)
                continue
            self._record_evicted(node, "device")
            pages = self.tree.drop(node, Tier.DEVICE, pool.pool_id)
            pool.allocator.free(pages)
            freed += len(pages)
        return freed

    def _evict_host(self, num_pages: int) -> int:
        freed = 0
        write_back = self.config.disk_policy == "write_back"
        for node in self.tree.iter_evictable(Tier.HOST):
            if freed >= num_pages:
                break
            if write_back and not node.on_disk and not node.device_pools:
                self._write_disk(node, then_drop_host=True)
                continue
            self._record_evicted(node, "host")
            pages = self.tree.drop(node, Tier.HOST)
            self.host_alloc.free(pages)
            freed += len(pages)
        return freed

    def _evict_disk(self, num_pages: int) -> int:
        freed = 0
        for node in self.tree.iter_evictable(Tier.DISK):
            if freed >= num_pages:
                break
            self._record_evicted(node, "disk")
            keys = node.page_key_list()
            self.tree.drop(node, Tier.DISK)
            self.storage.delete(keys)
            freed += len(keys)
        return freed

    def evict(self, tier: Tier, num_pages: int, pool_id: int | None = None) -> int:
        """Evict from one tier on request; returns the pages freed now."""
        if tier == Tier.DEVICE:
            return self._evict_device(self._pool(pool_id), num_pages)
        if tier == Tier.HOST:
            return self._evict_host(num_pages)
        return self._evict_disk(num_pages) if self.storage is not None else 0

    # ------------------------------------------------------------------ warm restart

    def rebuild_from_storage(self, progress: Callable[[int], None] | None = None) -> int:
        """Put every persisted page of this spec back into the tree as disk-resident;
        records of this spec that no chain from a first page reaches (a page before
        them is gone, or belongs to another namespace) are deleted. Returns the pages
        restored.

        Walks the records top-down from each sequence's first page, once each: the
        time is O(records) plus one tree restore per leaf, however long the shared
        prefixes are (walking up from every leaf instead was O(leaves x depth): 23 s
        for 450,000 pages under 1,000-page shared prompts). ``progress(records
        done)`` is called every :data:`REBUILD_PROGRESS_EVERY` records, so that a
        caller on an event loop can keep its watchdog fed through a long rebuild
        (the daemon instead runs :meth:`rebuild_steps` a slice at a time)."""
        steps = self.rebuild_steps(REBUILD_PROGRESS_EVERY)
        while True:
            try:
                done = next(steps)
            except StopIteration as finished:
                return finished.value
            if progress is not None:
                progress(done)

    def rebuild_steps(self, every: int = REBUILD_PROGRESS_EVERY) -> Iterator[int]:
        """:meth:`rebuild_from_storage` as a generator: it yields the records done so far
        every ``every`` records (reading the store's metadata, then walking it), and
        returns the pages restored. Between two steps the owner thread may serve other
        work, as long as nothing else touches this manager's tree."""
        if self.storage is None:
            return 0
        page_bytes = self.spec.page_size * 4
        fingerprint = self.spec.fingerprint
        metas = {}
        for done, (key, meta) in enumerate(self.storage.iter_metadata(batch=every), 1):
            if meta.fingerprint == fingerprint and len(meta.tokens) == page_bytes:
                metas[key] = meta
            if done % every == 0:
                yield done
        children: dict[bytes, list[bytes]] = {}
        for done, (key, meta) in enumerate(metas.items(), 1):
            children.setdefault(meta.parent, []).append(key)
            if done % every == 0:
                yield done
        reached: set[bytes] = set()
        for first in children.get(ROOT_PARENT_KEY, ()):
            namespace = NamespaceId(metas[first].namespace)
            self.add_namespace(namespace)
            path: list[bytes] = []  # the page tokens from the first page down to the current one
            stack = [(first, 0)]
            while stack:
                key, depth = stack.pop()
                reached.add(key)
                if len(reached) % every == 0:
                    yield len(reached)
                del path[depth:]
                path.append(metas[key].tokens)
                below = [child for child in children.get(key, ()) if metas[child].namespace == namespace]
                if below:
                    stack.extend((child, depth + 1) for child in below)
                else:  # the end of a sequence: restore the whole path in one go
                    self.tree.restore(namespace, b"".join(path))
        orphans = []
        for done, key in enumerate(metas, 1):
            if key not in reached:
                orphans.append(key)
            if done % every == 0:
                yield done
        if orphans:
            logger.warning("deleting %d disk records that no sequence reaches", len(orphans))
            self.storage.delete(orphans)
        # Let go of the index a batch at a time too: freeing 450,000 records at once
        # takes ~0.1 s.
        reached.clear()
        for index in (children, metas):
            for done in range(1, len(index) + 1):
                index.popitem()
                if done % every == 0:
                    yield done
        return self.tree.sizes(Tier.DISK).cached

    # ------------------------------------------------------------------ driving

    def poll(self, timeout_s: float = 0.0) -> int:
        """Run completed transfers' callbacks and due timers (owner thread)."""
        ran = self.completions.drain(timeout_s)
        if ran and any(pool.retired for pool in self._pools.values()):
            self._reap_pools()
        now = self._clock()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            fn()
            ran += 1
        return ran

    def wait(self, future: Future, timeout_s: float = 60.0):
        """Poll until ``future`` is done; return its result (tests and draining)."""
        deadline = time.monotonic() + timeout_s
        while not future.done():
            if time.monotonic() > deadline:
                raise TimeoutError("the tier manager did not finish in time")
            self.poll(0.01)
        return future.result()

    def idle(self) -> bool:
        return not self._by_node and not self._disk_pending

    def persist(self) -> int:
        """Start writing every host page that has no disk record yet (a draining daemon
        keeps what it can); returns the pages queued."""
        if self.storage is None:
            return 0
        queued = 0
        for node in list(self.tree.nodes()):
            if (self.tree.is_live(node) and node.host_pages is not None and not node.on_disk
                    and not any(c.host_pages is not None and not c.on_disk for c in node.children.values())):
                before = self._disk_pending
                self._write_disk(node)
                queued += self._disk_pending - before
        return queued

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until no transfer is in flight and storage has committed everything."""
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() > deadline:
                raise TimeoutError("transfers still in flight")
            self.poll(0.01)
        if self.storage is not None:
            self.storage.flush()

    def next_timer(self) -> float | None:
        """When the earliest timer is due (on this manager's clock), if any."""
        return self._timers[0][0] if self._timers else None

    def _add_timer(self, delay_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (self._clock() + delay_s, next(self._timer_seq), fn))

    def close(self) -> None:
        self.flush()
        self.workers.close()
        if self._copy_workers is not None:
            self._copy_workers.close()
        for pool in self._pools.values():
            pool.counters.close()
        self.host_pool.close()

    # ------------------------------------------------------------------ bookkeeping

    def _busy(self, node: Node, kind: str) -> bool:
        return any(t.kind == kind for t in self._by_node.get(node.node_id, ()))

    def _register(self, transfer: _Transfer) -> None:
        transfer.timing.setdefault("submitted", time.perf_counter())
        for entry in transfer.entries:
            self._by_node.setdefault(entry.node.node_id, []).append(transfer)

    def _report(self, transfer: _Transfer, direction: str, num_pages: int | None = None) -> None:
        pages = transfer.num_pages if num_pages is None else num_pages
        seconds = time.perf_counter() - transfer.timing["submitted"]
        self.metrics.transfer(direction, pages * self.spec.host_page_bytes, seconds)

    def _record_evicted(self, node: Node, tier: str) -> None:
        keys = node.page_keys
        evicted = self.recently_evicted
        for i in range(0, len(keys), PAGE_KEY_BYTES):
            key = keys[i : i + PAGE_KEY_BYTES]
            evicted[key] = tier
            evicted.move_to_end(key)
        while len(evicted) > _EVICTED_MEMORY:
            evicted.popitem(last=False)
        self.metrics.evicted(tier, node.num_pages)

    def why_missed(self, namespace: NamespaceId, tokens: bytes, match: MatchResult) -> str:
        """Why the first page after ``match`` (a match of ``tokens``, packed) is not
        cached: :meth:`miss_reason` of its page key; ``never_stored`` for a partial page."""
        ps = match.page_size
        start = match.num_tokens * TOKEN_BYTES
        page = tokens[start : start + ps * TOKEN_BYTES]
        if len(page) < ps * TOKEN_BYTES or match.node is None:
            return "never_stored"
        return self.miss_reason(chain_page_keys(namespace, match.node.last_page_key, page, ps))

    def miss_reason(self, page_key: bytes) -> str:
        """Why the page with this key is not cached: ``evicted_<tier>`` if it was
        evicted recently (from the tier it left last), else ``never_stored``."""
        tier = self.recently_evicted.get(page_key)
        return f"evicted_{tier}" if tier else "never_stored"

    def _unregister(self, transfer: _Transfer) -> None:
        for entry in transfer.entries:
            transfers = self._by_node.get(entry.node.node_id)
            if transfers and transfer in transfers:
                transfers.remove(transfer)
                if not transfers:
                    del self._by_node[entry.node.node_id]

    def _on_split(self, upper: Node, lower: Node) -> None:
        transfers = self._by_node.get(lower.node_id)
        if not transfers:
            return
        for transfer in transfers:
            transfer.split(upper, lower)
        self._by_node[upper.node_id] = list(transfers)

    def accounting(self) -> dict[Place, TierAccount]:
        """Pages per place (each device pool, host, disk) and state."""
        out = {}
        for pool_id, pool in self._pools.items():
            sizes = self.tree.sizes(Tier.DEVICE, pool_id)
            landing = sum(len(e.dst) for ts in self._by_node.values() for t in set(ts)
                          if t.kind == "load" and t.pool == pool_id for e in t.entries) if self._by_node else 0
            out[Place.device(pool_id)] = TierAccount(
                pool.allocator.num_free, pool.num_private, sizes.evictable,
                sizes.protected - landing, pool.staging + landing,
            )
        sizes = self.tree.sizes(Tier.HOST)
        out[Place(Tier.HOST)] = TierAccount(self.host_alloc.num_free, 0, sizes.evictable, sizes.protected, self._host_staging)
        sizes = self.tree.sizes(Tier.DISK)
        free = max(0, self.disk_capacity_pages - sizes.cached - self._disk_pending)
        out[Place(Tier.DISK)] = TierAccount(free, 0, sizes.evictable, sizes.protected, self._disk_pending)
        return out

    def check_invariants(self) -> None:
        """The tree's and allocators' own checks, plus the accounting between them."""
        self.tree.check_invariants()
        self.host_alloc.check_invariants()
        host_cached = self.tree.sizes(Tier.HOST).cached
        assert self.host_alloc.num_allocated == host_cached + self._host_staging, (
            self.host_alloc.num_allocated, host_cached, self._host_staging)
        for pool_id, pool in self._pools.items():
            pool.allocator.check_invariants()
            cached = self.tree.sizes(Tier.DEVICE, pool_id).cached
            assert pool.num_private == int(pool.private.sum())
            assert pool.allocator.num_allocated == pool.num_private + cached + pool.staging, (
                pool_id, pool.allocator.num_allocated, pool.num_private, cached, pool.staging)
        for node_id, transfers in self._by_node.items():
            node = self.tree.node(node_id)
            for transfer in transfers:
                assert any(e.node is node for e in transfer.entries), (node, transfer.kind)
        accounts = self.accounting()
        for place, account in accounts.items():
            if place.tier == Tier.DEVICE:
                assert account.total == self._pools[place.pool].allocator.capacity, (place, account)
        assert accounts[Place(Tier.HOST)].total == self.host_alloc.capacity, accounts[Place(Tier.HOST)]


    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, not counting namespace roots (for stats)."""
        return len(self.tree)
