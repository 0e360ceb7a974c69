"""The tier manager: one tree, device pools, the host pool and a disk tier, driven as one.

:class:`TierManager` is the facade the daemon (and tests, benchmarks) use, on the owner
thread — the only thread that touches the tree, the allocators and the registries. It
wires the parts together and keeps the **eviction cascade**: device pressure drops
device copies that live elsewhere (or backs them up first under the ``write_back``
write policy); host pressure drops host copies (writing them to disk first under the
``write_back`` disk policy); the disk tier keeps itself under the store's capacity. A
node that lives nowhere leaves the tree. The parts (see ``docs/architecture.md``):

* :mod:`~hicache.tiers.devices` — the engines' pools: allocators, private pages, counters;
* :mod:`~hicache.tiers.loads` — host / disk -> device, layer by layer;
* :mod:`~hicache.tiers.owned` — engine-owned pools: ``store`` and ``load_into``;
* :mod:`~hicache.tiers.backups` — device -> host per the write policy;
* :mod:`~hicache.tiers.disk` — the disk tier (or none): writes, reads, prefetch, rebuild;
* :mod:`~hicache.tiers.copying` — CPU and CUDA copy engines;
* :mod:`~hicache.tiers.transfers` — the transfers in flight, by node;
* :mod:`~hicache.tiers.misses` — why a page is not cached;
* :mod:`~hicache.tiers.policies` — write, disk and prefetch policies.

Transfers run on worker threads and report back through :class:`hicache.jobs.Completions`;
:meth:`TierManager.poll` runs those completions and due timers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future

import numpy as np

from hicache.counters import LayerCounters
from hicache.errors import InvalidArgument
from hicache.jobs import Completions, Workers
from hicache.keys import TOKEN_BYTES, NamespaceId, PageKey, Tokens, pack_tokens
from hicache.kernels.copy_plan import CpuCopyWorkers
from hicache.metrics import NullMetrics, SpecMetrics
from hicache.pages import PageAllocator, PageIds, PageIdsLike
from hicache.pools import DevicePool, HostPool
from hicache.spec import KVSpec
from hicache.storage.base import StorageBackend
from hicache.tiers.accounts import accounting, check_invariants
from hicache.tiers.backups import Backups
from hicache.tiers.checkpoints import Checkpoints
from hicache.tiers.config import TierConfig
from hicache.tiers.copying import CopyEngines
from hicache.tiers.core import Core
from hicache.tiers.devices import DevicePools, DevicePoolState
from hicache.foreign import ForeignPool
from hicache.tiers.disk import DiskTier, LocalDisk, NoDisk
from hicache.tiers.loads import Loads
from hicache.tiers.misses import MissReasons
from hicache.tiers.owned import OwnedTransfers
from hicache.tiers.rebuild import REBUILD_PROGRESS_EVERY
from hicache.tiers.prefetch import answer_after
from hicache.tiers.quotas import SpaceQuotas
from hicache.tiers.remote import NoRemote, RemoteSettings, RemoteTier
from hicache.tiers.results import Hit, LoadTiming, Purged, TierAccount
from hicache.tiers.timers import Timers
from hicache.tiers.transfers import InFlight, Kind
from hicache.tiers.windows import Windows, cut_match
from hicache.tree import HiRadixTree, InsertResult, MatchResult, Node, Place, PoolId, Tier

logger = logging.getLogger(__name__)

FREE_HOST_SHARE = 16  # exclusive capacity: a sixteenth of the host tier kept free


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
        remote=None,
        remote_settings: RemoteSettings | None = None,
    ) -> None:
        """``progress`` is called now and then while the host pool is pinned (seconds
        for a large one), with the bytes done. ``remote``: the remote tier's store
        (:class:`~hicache.storage.mooncake_backend.MooncakeBackend`), used per
        ``remote_settings`` (see :mod:`hicache.tiers.remote`)."""
        self.spec = spec
        self.config = config or TierConfig()
        self.metrics = SpecMetrics(metrics if metrics is not None else NullMetrics())
        self.writes = self.config.writes()
        self.disk_policy = self.config.disk()
        self.prefetch = self.config.prefetch()
        inflight = InFlight()
        self.windows: Windows | None = None  # (set below, for a spec with SWA layers)
        self.tree = HiRadixTree(eviction=self.config.eviction, on_split=self._on_split)
        checkpoint_slots = self.config.checkpoint_slots(spec, host_pages)
        self.host_pool = HostPool(spec, host_pages, num_state_slots=checkpoint_slots, pinned=pinned_host,
                                  progress=progress)
        self.host_alloc = PageAllocator.for_host(host_pages)
        self.completions = completions or Completions()
        self.workers = Workers(self.completions, io_threads=self.config.io_threads)
        self._copy_workers = CpuCopyWorkers(self.config.copy_threads) if self.config.copy_threads > 1 else None
        self._core = Core(spec, self.tree, self.host_pool, self.host_alloc, self.metrics, self.completions,
                          self.workers, inflight, MissReasons(self.metrics, self.config.eviction_log_slots), alloc_host=self._host_alloc)
        self._inflight = inflight
        self.quotas = self._core.quotas = SpaceQuotas(self.tree, self.metrics.quota_refused)
        self._core.evict_own = self._evict_own
        backlog = self.config.disk_write_backlog or max(1, host_pages // 2)
        self.disk: DiskTier = (LocalDisk(self._core, storage, backlog, clean_host_floor=(
            host_pages // FREE_HOST_SHARE if self.config.exclusive else None))
                               if storage is not None and self.disk_policy.enabled else NoDisk())
        remote_settings = remote_settings or RemoteSettings()
        if remote is not None and remote_settings.policy == "write_back" and not self.disk.enabled:
            raise InvalidArgument('the remote policy "write_back" writes pages the disk tier evicts: it needs a '
                                  'disk tier (without one, use "write_through")')
        swa = bool(spec.swa_window and spec.kept_page_bytes)
        if remote is not None and (checkpoint_slots or swa):
            # (the remote tier keeps whole pages and no checkpoints)
            logger.warning("the remote tier is off for KV spec %s: it has state or sliding-window layers",
                           spec.fingerprint_hex)
            remote = None
        self.remote = RemoteTier(self._core, remote, remote_settings) if remote is not None else NoRemote()
        self._core.remote = self.remote
        if remote is not None:  # (disk writes that waited for the room write-backs held)
            self.remote.on_disk_freed = self.disk.retry_writes
        # Recurrent-state checkpoints, for a spec with state layers (None otherwise).
        self.checkpoints: Checkpoints | None = None
        if checkpoint_slots:
            self.checkpoints = Checkpoints(self._core, checkpoint_slots, self.disk.storage,
                                           lambda keys: self.disk.on_store_evicted(keys))
        self.pools = DevicePools(spec, self.host_pool, CopyEngines(self.workers, self.completions),
                                 counter_slots=self.config.counter_slots, copy_workers=self._copy_workers)
        if self.checkpoints is not None:
            self.checkpoints.core_pools = self.pools
        # Sliding-window layers: what of their pages is kept (None: a spec without them,
        # or with nothing else: a page without its SWA part would be no bytes at all).
        if swa:
            self.windows = self._core.windows = Windows(spec, self._core, self.pools, self.disk.storage,
                                                        lambda keys: self.disk.on_store_evicted(keys))
        # (checkpoint records among the evicted keys too, until an owner replaces it)
        self.disk.on_store_evicted = self.forget_disk_keys
        self._backups = Backups(self._core, self.pools, self.disk, self.disk_policy)
        self._loads = Loads(self._core, self.pools, self.disk, self._device_alloc)
        self._owned = OwnedTransfers(self._core, self.pools, self.disk, self.disk_policy)
        self._timers = Timers(clock)
        self._host_room_tried: tuple[int, int] | None = None  # the host tier when backups were last retried

    @property
    def storage(self) -> StorageBackend | None:
        return self.disk.storage

    @property
    def on_store_evicted(self) -> Callable[[Sequence[bytes]], None]:
        """Told the keys the store evicted to make room for this manager's writes. A
        store shared by several managers (one per KV spec) needs them all told: the
        owner sets this to a function that calls every manager's :meth:`forget_disk_keys`."""
        return self.disk.on_store_evicted

    @on_store_evicted.setter
    def on_store_evicted(self, fn: Callable[[Sequence[bytes]], None]) -> None:
        self.disk.on_store_evicted = fn

    @property
    def on_load_timing(self) -> Callable[[LoadTiming], None] | None:
        """Told of each finished CPU-mode load's layer timings (benchmarks)."""
        return self._loads.on_timing

    @on_load_timing.setter
    def on_load_timing(self, fn: Callable[[LoadTiming], None] | None) -> None:
        self._loads.on_timing = fn

    @property
    def host_bytes(self) -> int:
        return self.host_pool.nbytes

    def add_namespace(self, namespace: NamespaceId) -> Node:
        return self.tree.add_namespace(namespace, self.spec.page_size)

    def has_namespace(self, namespace: NamespaceId) -> bool:
        return self.tree.has_namespace(namespace)

    def find(self, node_id: int) -> Node | None:
        """The live node with this id, if any."""
        return self.tree.find(node_id)

    @property
    def num_nodes(self) -> int:
        return len(self.tree)

    def num_cached_pages(self) -> int:
        """Distinct pages in the tree, in whatever tiers (O(nodes): for stats)."""
        return sum(n.num_pages for n in self.tree.nodes())

    def register_pool(self, pool_id: PoolId, ranks: list[DevicePool]) -> LayerCounters:
        """Adopt an engine's device pool (one :class:`DevicePool` per TP rank, in rank
        order). Returns the pool's layer counters, whose handle goes to the engine."""
        counters = self.pools.register(pool_id, ranks).counters
        self._count_tokens()
        return counters

    def register_owned_pool(self, pool_id: PoolId, pool: ForeignPool, name: str = "", *,
                            kv_events: bool = True, counts_tokens: bool = True) -> LayerCounters:
        """Adopt an engine-owned pool (:mod:`hicache.foreign`): the engine keeps its
        blocks; pages move only by :meth:`store` and :meth:`load_into`. ``kv_events``:
        whether the pool has a KV event stream (:mod:`hicache.daemon.kv_events`);
        ``counts_tokens``: whether its tokens count in the token figures (see
        :class:`~hicache.metrics.SpecMetrics`)."""
        counters = self.pools.register_owned(pool_id, pool, name, kv_events=kv_events,
                                             counts_tokens=counts_tokens).counters
        self._count_tokens()
        return counters

    def _count_tokens(self) -> None:
        """The spec's tokens count while one of its serving pools' does; with none
        serving, as they did (the transfers of a pool gone still end, and count so)."""
        serving = [pool.counts_tokens for pool in self.pools if not pool.retired]
        if serving:
            self.metrics.counts_tokens = any(serving)

    def owned_pool(self, name: str) -> PoolId | None:
        """The serving engine-owned pool registered under ``name``, if any."""
        pool = self.pools.named(name)
        return None if pool is None else pool.pool_id

    def is_owned(self, pool_id: PoolId) -> bool:
        return self.pools.get(pool_id).owned

    def _native(self, pool_id: PoolId) -> DevicePoolState:
        pool = self.pools.get(pool_id)
        if pool.owned:
            raise InvalidArgument("the engine owns this pool's blocks: use store and load_into")
        return pool

    def _owned_pool(self, pool_id: PoolId) -> DevicePoolState:
        pool = self.pools.get(pool_id)
        if not pool.owned:
            raise InvalidArgument("store and load_into are for engine-owned pools (this pool's pages are "
                                  "hicache's: use alloc, insert and load)")
        return pool

    def store(self, namespace: NamespaceId, tokens: Tokens, pool_id: PoolId, blocks: PageIdsLike, *,
              expired: Callable[[], bool] | None = None) -> Future:
        """Copy the engine's blocks of the whole pages of ``tokens`` that are not on host
        yet into host pages, and cache them; a future of
        :class:`~hicache.tiers.owned.Stored`, done once the engine may reuse the blocks.
        ``expired()``: the engine no longer waits (it may reuse the blocks): raises
        :class:`~hicache.errors.DeadlinePassed` if so now, and the future fails with it
        (nothing cached) if so when the copy is done."""
        pool = self._owned_pool(pool_id)
        ids = self.store_blocks(pool_id, tokens, blocks)
        packed = pack_tokens(tokens)
        return self._owned.store(pool, namespace, packed[: len(ids) * self.spec.page_size * TOKEN_BYTES], ids,
                                 expired)

    def store_blocks(self, pool_id: PoolId, tokens: Tokens, blocks: PageIdsLike) -> PageIds:
        """The blocks of a :meth:`store`, checked as it checks them (an engine-owned
        pool's, in range, none twice, one per whole page of ``tokens``), changing
        nothing: for a caller with its own bookkeeping to do only for a store that
        will run."""
        ids = self._owned_pool(pool_id).checked_ids(blocks)
        if len(ids) != len(pack_tokens(tokens)) // TOKEN_BYTES // self.spec.page_size:
            raise InvalidArgument("one block per whole page of tokens")
        return ids

    def load_into(self, node: Node, pool_id: PoolId, blocks: PageIdsLike, first: int = 0, *,
                  expired: Callable[[], bool] | None = None,
                  copy_expired: Callable[[], bool] | None = None) -> Future:
        """Copy pages ``first ..`` of ``node``'s path (host / disk) into the engine's
        ``blocks``; a future of :class:`~hicache.tiers.owned.LoadedInto`.
        ``expired()``: the engine no longer waits (it takes the blocks as loaded with
        nothing, and may reuse them): raises :class:`~hicache.errors.DeadlinePassed` if
        so now, and nothing is copied if so when the disk reads are done.
        ``copy_expired()``: the engine no longer waits for the layers: raises likewise
        if so now, and no layer starts copying once it is."""
        pool = self._owned_pool(pool_id)
        ids = pool.checked_ids(blocks)
        if type(first) is not int or first < 0:
            raise InvalidArgument(f"first must be a non-negative int, got {first!r}")
        return self._owned.load_into(pool, node, ids, first, expired, copy_expired)

    def retire_pool(self, pool_id: PoolId) -> None:
        """The engine is gone: refuse new work for its pool, and once no transfer uses
        the pool any more, forget its pages (private ones included) and unmap it (see
        :meth:`poll`). The caller has released the session's locks."""
        pool = self.pools.get(pool_id)
        pool.retired = True
        self._count_tokens()
        if self.checkpoints is not None:
            self.checkpoints.discard_pool(pool_id)
        self._loads.cancel_parked(pool)
        reading, pool.reading = pool.reading, {}
        for cancel in reading.values():
            cancel()
        self.pools.reap(self._inflight.pools(), self.tree)

    def device_pools(self) -> list[DevicePool]:
        """Every registered rank pool (for reporting)."""
        return self.pools.ranks()

    def num_pages(self, pool_id: PoolId) -> int:
        return self.pools.get(pool_id).allocator.capacity

    def num_private(self, pool_id: PoolId) -> int:
        """The pool's private pages (its engine's, allocated and not inserted)."""
        return self.pools.get(pool_id).num_private

    def page_ids(self, pool_id: PoolId, pages: PageIdsLike) -> PageIds:
        """``pages`` as ids, checked: in the pool's range, none repeated."""
        return self.pools.get(pool_id).checked_ids(pages)

    def reserve(self, pool_id: PoolId, pages: PageIdsLike) -> None:
        """Make specific pages private (an engine re-registering with pages its running
        requests still use)."""
        pool = self._native(pool_id)
        ids = pool.checked_ids(pages)
        pool.allocator.take(ids)
        pool.make_private(ids)

    def alloc(self, pool_id: PoolId, num_pages: int) -> PageIds | None:
        """``num_pages`` private device pages (evicting cached pages if needed), or
        ``None`` when the pool cannot provide them now."""
        pool = self._native(pool_id)
        if num_pages < 0:
            raise InvalidArgument(f"cannot allocate {num_pages} pages")
        pages = self._device_alloc(pool, num_pages)
        if pages is not None:
            pool.make_private(pages)
        return pages

    def release(self, pool_id: PoolId, pages: PageIdsLike) -> None:
        """Give back private pages that were never inserted."""
        pool = self._native(pool_id)
        pool.release(pool.checked_ids(pages))

    def match(self, namespace: NamespaceId, tokens: Tokens, pool_id: PoolId) -> Hit:
        """Longest cached prefix as seen from the pool; starts a disk prefetch of its disk
        part, and backs up what the write policy wants backed up after a hit."""
        pool = self.pools.get(pool_id)
        result = self.tree.match(namespace, tokens, pool_id)
        if result.node is None or result.node.parent is None:  # unknown namespace, or nothing matched
            return Hit(result, ())
        if self.writes.backs_up_on_hit and not pool.owned:
            node = self.writes.after_hit(result)
            if node is not None:
                self._backups.backup(pool, node)
        # (no transfer in flight, the common case: not even the call)
        hit = self._hit(result, pool, self._inflight.tickets_on(result.last_device_node, pool_id)
                        if self._inflight else ())
        if hit.match.num_disk_pages >= self.config.prefetch_min_pages:
            self.disk.prefetch(hit.match.node)
        return hit

    def _hit(self, result: MatchResult, pool: DevicePoolState, wait) -> Hit:
        """The answer to a match: what a load can deliver of ``result`` (and ``result``
        itself aside when that is less). For a spec with state layers both end at a
        node with a checkpoint."""
        usable = self._hit_end(pool.pool_id)
        if usable is not None:
            result = cut_match(self.tree, result, pool.pool_id, usable)
            clipped = cut_match(self.tree, self._deliverable(result, pool), pool.pool_id, usable)
            return Hit(clipped, wait, None if clipped is result else result)
        clipped = self._deliverable(result, pool)
        return Hit(clipped, wait, None if clipped is result else result)

    def _on_split(self, upper: Node, lower: Node) -> None:
        self._inflight.on_split(upper, lower)
        if self.windows is not None:
            self.windows.note_split(upper)

    def _hit_end(self, pool_id: PoolId) -> Callable[[Node], bool] | None:
        """What a node must have to end a hit (None: any node may): a usable checkpoint
        (a spec with state layers), its window's SWA bytes (one with SWA layers)."""
        checkpoints, windows = self.checkpoints, self.windows
        if checkpoints is None and windows is None:
            return None
        if windows is None:
            return lambda node: checkpoints.usable(node, pool_id)
        if checkpoints is None:
            return lambda node: windows.usable(node, pool_id)
        return lambda node: checkpoints.usable(node, pool_id) and windows.usable(node, pool_id)

    def _deliverable(self, result: MatchResult, pool: DevicePoolState) -> MatchResult:
        """The part of ``result`` a load can deliver now, cut at a node boundary: its
        host and disk part must fit in the pool's free and evictable pages (not for an
        engine-owned pool: the engine brings the blocks), its disk part in the host
        tier's free pages and those that can go without a write (it is staged there).
        ``result`` itself when all of it fits (the common case: a few O(1) counts)."""
        extra = result.num_host_pages + result.num_disk_pages
        if not extra:
            return result
        # Evictable pages that eviction cannot free now do not count: the path's own
        # (its load locks them), device pages whose backup waits for host room, host
        # pages without a disk copy (each must be copied first).
        room = extra
        if not pool.owned:
            device = self.tree.sizes(Tier.DEVICE, pool.pool_id)
            stuck = self._backups.deferred_pages() if self._backups.deferred else 0
            room = pool.allocator.num_free + max(0, device.evictable - result.num_device_pages - stuck)
        if result.num_disk_pages:
            clean = self.tree.clean_host_pages()
            host_room = self.host_alloc.num_free + max(0, clean - result.num_host_pages)
            room = min(room, result.num_host_pages + host_room)
        if room >= extra:
            return result
        node = last_host = result.last_device_node
        host = disk = 0
        for n in self.tree.path(result.node):
            if n.device_pages(pool.pool_id) is not None:
                continue  # (the device part: a prefix of the path)
            if host + disk + n.num_pages > room:
                break
            if n.host_pages is not None:
                host += n.num_pages
                last_host = n
            else:
                disk += n.num_pages
            node = n
        return MatchResult(node, result.last_device_node, last_host, result.device_bytes, host, disk,
                           result.page_size)

    def lookup(self, namespace: NamespaceId, tokens: Tokens, pool_id: PoolId) -> Hit | Future:
        """:meth:`match` when the prefetch policy answers at once, else
        :meth:`match_async`'s future."""
        if not self.prefetch.waits and not self.remote.enabled:
            return self.match(namespace, tokens, pool_id)
        return self.match_async(namespace, tokens, pool_id)

    def match_async(self, namespace: NamespaceId, tokens: Tokens, pool_id: PoolId) -> Future:
        """:meth:`match` under the prefetch policy: ``best_effort`` answers now;
        ``wait_complete`` once the disk part is in host memory; ``timeout`` then, or
        after ``prefetch_timeout_s``, whichever comes first. With a remote tier, pages
        after the local hit are asked for there (:meth:`RemoteTier.fetch`), and the
        remote tier's own prefetch policy governs the wait (for its pages and the disk
        part both)."""
        hit = self.match(namespace, tokens, pool_id)
        pool = self.pools.get(pool_id)
        future: Future = Future()
        packed = pack_tokens(tokens)
        fetch = self.remote.fetch(namespace, packed, hit.unclipped or hit.match) if self.remote.enabled else None
        if fetch is not None and not fetch.on_host:
            self.disk.prefetch(fetch.anchor)  # (the pages hang below it: its path goes to host first)
        waits_disk = self.prefetch.waits and hit.match.num_disk_pages and self.disk.enabled
        waits_remote = fetch is not None and self.remote.prefetch.waits
        if not waits_disk and not waits_remote:
            future.set_result(hit)
            return future

        def answer() -> None:
            if not future.done():
                result = self.tree.match(namespace, packed, pool_id, touch=False)
                tickets = self._inflight.tickets_on(result.last_device_node, pool_id)
                landed = self._hit(result, pool, tickets)
                # (the fetch's pages are the path's from fetch.first on; a hit that a
                # load cannot deliver whole is cut short of some of them)
                remote = 0
                if fetch is not None and fetch.done:
                    remote = max(0, min(fetch.pages, landed.match.num_pages - fetch.first))
                future.set_result(landed._replace(remote_pages=remote))

        end = fetch.anchor if fetch is not None else hit.match.node
        path = self.tree.path(end) if end is not None else []
        waits: list = [t for n in path for t in self._inflight.on(n, Kind.DISK_READ)]
        if waits_remote:
            waits.append(fetch)
        answer_after(waits, answer, self.remote.prefetch if waits_remote else self.prefetch, self._timers)
        return future

    def lock(self, node: Node, pool_id: PoolId) -> None:
        self.pools.get(pool_id)
        self.tree.lock(node, pool_id)

    def unlock(self, node: Node, pool_id: PoolId) -> None:
        self.pools.get(pool_id)
        self.tree.unlock(node, pool_id)

    def insert(self, namespace: NamespaceId, tokens: Tokens, pool_id: PoolId, pages: PageIdsLike, *,
               ends: Sequence[int] = ()) -> InsertResult:
        """The tree takes the whole pages of ``tokens``. Each page is either one of the
        session's private pages or the pool's cached page for that position (from a
        match); private pages that duplicate cached ones are freed. ``ends``: page
        counts where a later match may well end (a system prompt's end, a turn's, a
        checkpoint's), ascending: the tree keeps a node boundary there — for a spec
        with SWA layers, the window before it keeps its SWA bytes on host and disk."""
        pool = self._native(pool_id)
        ids = pool.checked_ids(pages)
        self.check_ends(len(ids), ends)
        packed = pack_tokens(tokens)
        private = pool.private[ids]
        if not private.all():
            cached = self.tree.match(namespace, packed, pool_id, touch=False).device_pages
            positions = np.flatnonzero(~private)
            beyond = positions >= len(cached)
            if beyond.any() or (ids[positions] != cached[positions]).any():
                raise InvalidArgument("a page is neither private nor the cached page at its position")
        result = self.tree.insert(namespace, packed, pool_id, ids)
        pool.unmake_private(ids[private])
        if self.windows is not None and len(result.duplicate_pages):
            taken = self.windows.take_whole(pool, result.node, ids, private)
            if len(taken):  # (the engine's pages, whole, in place of a copy without SWA bytes)
                result = result._replace(device_pages=np.where(np.isin(ids, taken), ids, result.device_pages),
                                         duplicate_pages=result.duplicate_pages[
                                             ~np.isin(result.duplicate_pages, taken)])
        pool.allocator.free(result.duplicate_pages)
        if ends:
            self._cut_at(result.node, ends)  # (before the backup below: it keeps each end's window)
        node = self.writes.after_insert(result.node)
        if node is not None:
            self._backups.backup(pool, node)
        return result

    def check_checkpoints(self, pool_id: PoolId, num_pages: int, checkpoints: Sequence[tuple[int, int]]) -> None:
        """Raise ``InvalidArgument`` unless ``checkpoints`` — ``(pages before it, device
        state slot)`` pairs — can go with an insert of ``num_pages`` whole pages: a spec
        with state layers, page counts ascending in ``1 .. num_pages``, slots in the
        pool's state region (slot 0 is its padding)."""
        if not checkpoints:
            return
        if self.checkpoints is None:
            raise InvalidArgument("checkpoints are for specs with state layers; this spec has none")
        pool = self._native(pool_id)
        slots = pool.ranks[0].layout.num_state_slots
        last = 0
        for item in checkpoints:
            if (not isinstance(item, (tuple, list)) or len(item) != 2
                    or any(type(v) is not int for v in item)):
                raise InvalidArgument("a checkpoint is a pair of ints: (pages before it, device state slot)")
            pages, slot = item
            if not last < pages <= num_pages:
                raise InvalidArgument(f"checkpoint page counts must ascend within 1 .. {num_pages}; got {pages} "
                                      f"after {last}")
            if not 1 <= slot <= slots:
                raise InvalidArgument(f"state slot {slot} outside the pool's 1 .. {slots}")
            last = pages

    def checkpoint(self, node: Node, pool_id: PoolId, checkpoints: Sequence[tuple[int, int]]) -> Future:
        """Keep the engine's states as checkpoints on ``node``'s path (an insert's
        node): ``(pages before it, device state slot)`` pairs, checked by
        :meth:`check_checkpoints`. A future of how many were taken, done once the
        engine may reuse its state slots."""
        self.check_checkpoints(pool_id, sum(n.num_pages for n in self.tree.path(node)), checkpoints)
        if not checkpoints:
            done: Future = Future()
            done.set_result(0)
            return done
        holders = self._cut_at(node, [pages for pages, _ in checkpoints])
        return self.checkpoints.offer(self._native(pool_id), list(zip(holders, (slot for _, slot in checkpoints))))

    @staticmethod
    def check_ends(num_pages: int, ends: Sequence[int]) -> None:
        """Raise ``InvalidArgument`` unless ``ends`` ascend within ``1 .. num_pages``."""
        last = 0
        for end in ends:
            if type(end) is not int or not last < end <= num_pages:
                raise InvalidArgument(f"ends must be ints ascending within 1 .. {num_pages}; got {end!r} after {last}")
            last = end

    def _cut_at(self, node: Node, ends: Sequence[int]) -> list[Node]:
        """The nodes of ``node``'s path that end after each of ``ends`` pages (ascending),
        splitting nodes so that they do."""
        out: list[Node] = []
        wanted = list(ends)
        i = start = 0
        for n in self.tree.path(node):
            if i == len(wanted):
                break
            end = start + n.num_pages
            j = i
            while j < len(wanted) and wanted[j] <= end:
                j += 1
            cuts = [pages - start for pages in wanted[i:j]]
            whole = bool(cuts) and cuts[-1] == n.num_pages
            out += self._split_at(n, cuts[:-1] if whole else cuts)
            if whole:
                out.append(n)
            i, start = j, end
        return out

    def _split_at(self, node: Node, cuts: list[int]) -> list[Node]:
        """Split ``node`` after each of ``cuts`` pages (ascending, inside it); the new
        nodes ending there, in order (``node`` keeps the last part). The middle cut
        first, then each half: a split copies the bytes of the node it cuts, so cutting
        in turn from the front copied the rest again per cut (quadratic); halving copies
        each page O(log cuts) times."""
        if not cuts:
            return []
        mid = len(cuts) // 2
        upper = self.tree.split(node, cuts[mid])
        return ([*self._split_at(upper, cuts[:mid]), upper]
                + self._split_at(node, [pages - cuts[mid] for pages in cuts[mid + 1 :]]))

    def load(self, node: Node, pool_id: PoolId, state_slot: int | None = None) -> Future:
        """Bring the host / disk part of ``node``'s path into the pool; a future of
        :class:`~hicache.tiers.results.LoadResult` (see :mod:`hicache.tiers.loads`).
        With ``state_slot`` (a spec with state layers), ``node``'s checkpoint is copied
        into that device state slot first (``LoadResult.state``)."""
        pool = self._native(pool_id)
        if state_slot is None:
            return self._loads.load(node, pool)
        if self.checkpoints is None:
            raise InvalidArgument("a state slot is for specs with state layers; this spec has none")
        slots = pool.ranks[0].layout.num_state_slots
        if type(state_slot) is not int or not 1 <= state_slot <= slots:
            raise InvalidArgument(f"state slot {state_slot!r} outside the pool's 1 .. {slots}")
        out: Future = Future()

        def loaded(f: Future, restored: bool) -> None:
            error = f.exception()
            if error is not None:
                out.set_exception(error)
                return
            r = f.result()
            out.set_result(r._replace(state=restored and r.node is node))

        def state_done(f: Future) -> None:
            restored = f.result()
            try:
                future = self._loads.load(node, pool)
            except BaseException as exc:  # noqa: BLE001 - the request's answer
                out.set_exception(exc)
                return
            future.add_done_callback(lambda g: loaded(g, restored))

        self.checkpoints.restore(node, pool, state_slot).add_done_callback(state_done)
        return out

    def _device_alloc(self, pool: DevicePoolState, num_pages: int) -> PageIds | None:
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
        if self.config.exclusive:
            self._keep_host_free()
        return pages

    def _keep_host_free(self) -> None:
        """Exclusive capacity: evict the host's oldest pages ahead of need (writing those
        without a disk copy first) while fewer than 1 / :data:`FREE_HOST_SHARE` of its
        pages are free or being written (see :class:`~hicache.tiers.config.TierConfig`)."""
        short = self.host_alloc.capacity // FREE_HOST_SHARE - self.host_alloc.num_free - self.disk.pending
        if short > 0:
            self._evict_host(short)

    def _evict_device(self, pool: DevicePoolState, num_pages: int) -> int:
        """Free at least ``num_pages`` device pages if possible (write-backs started
        here free theirs later). Returns the pages freed now."""
        freed = 0
        back_up = self.writes.backup_before_evict
        with pool.allocator.free_group():  # (one release of every node's pages)
            for node in self.tree.iter_evictable(Tier.DEVICE, pool.pool_id):
                if freed >= num_pages:
                    break
                if (back_up or self._backups.is_deferred(node)) and node.host_pages is None and not node.on_disk:
                    if self._backups.backup(pool, node, then_drop=True) or not self._backups.over_quota:
                        continue
                    # its tenant has no host room: the device copy just goes
                freed += self._drop_device(pool, node)
        return freed

    def _drop_device(self, pool: DevicePoolState, node: Node) -> int:
        self._core.misses.evicted(node, Tier.DEVICE)
        pages = self.tree.drop(node, Tier.DEVICE, pool.pool_id)
        pool.allocator.free(pages)
        return len(pages)

    def _evict_host(self, num_pages: int, namespaces: set | None = None) -> int:
        """Free at least ``num_pages`` host pages if possible (of ``namespaces`` only,
        when given); returns the pages freed now. Pages that have a disk copy go first;
        a page without one is written before it is dropped (:meth:`_write_before_drop`),
        so that it is freed later (and counts towards ``num_pages``: no more writes start
        than needed)."""
        with self.host_alloc.free_group():  # (one release of every node's pages)
            return self._evict_host_nodes(num_pages, namespaces)

    def _evict_own(self, namespaces: set, tier: Tier, num_pages: int) -> int:
        """A space quota's room: ``num_pages`` of these namespaces' own pages."""
        if tier == Tier.HOST:
            return self._evict_host(num_pages, namespaces)
        return self.disk.evict(num_pages, namespaces)

    def set_space_limits(self, limits, source: object = None) -> None:
        """The space quotas in force (:class:`hicache.tiers.quotas.SpaceLimit`), made
        from ``source`` (kept to tell when they are out of date)."""
        self.quotas.set_limits(limits, source)

    def assign(self, namespace: NamespaceId, group: str) -> bool:
        """``namespace`` is a tenant's: its pages count under that tenant's quotas
        (False: it was already). Kept for good: see :meth:`HiRadixTree.set_group`."""
        return self.tree.set_group(namespace, group)

    def tenant_of(self, namespace: NamespaceId) -> str:
        """The tenant :meth:`assign` gave ``namespace`` (``""``: none). O(1)."""
        return self.tree.group_of(namespace)

    def _evict_host_nodes(self, num_pages: int, namespaces: set | None = None) -> int:
        freed = 0
        later = []
        for node in self.tree.iter_evictable(Tier.HOST, namespaces=namespaces):
            if freed >= num_pages:
                return freed
            if not node.on_disk and self.disk.enabled:
                later.append(node)
                continue
            freed += self._drop_host(node)
        coming = 0
        for node in later:
            if freed + coming >= num_pages:
                break
            if not (self.tree.is_live(node) and self.tree.is_evictable(node, Tier.HOST)):
                continue
            if self._write_before_drop(node):
                if self.disk.write(node, then_drop_host=True) or self.disk.is_deferred(node):
                    coming += node.num_pages
                elif self.disk.over_quota or self.disk.too_large:  # no disk room for it: the host copy just goes
                    freed += self._drop_host(node)
            else:
                freed += self._drop_host(node)
        return freed

    def _write_before_drop(self, node: Node) -> bool:
        """Must ``node``'s host copy reach disk before it goes? Under ``write_through``
        to disk it should be there already (its write was deferred): yes. Under
        ``write_back``: when no device holds it either — and with exclusive capacity
        always (a device drops its copy without a backup unless the write policy is
        ``write_back``: the page would be lost)."""
        if node.on_disk or not self.disk.enabled or not self.tree.writable(node):
            return False  # (a path that cannot be written: its host copy just goes)
        return (self.disk_policy.write_on_host or self.config.exclusive
                or (self.disk_policy.write_before_drop and not node.device_pools))

    def _drop_host(self, node: Node) -> int:
        self._core.misses.evicted(node, Tier.HOST)
        pages = self.tree.drop(node, Tier.HOST)
        self.host_alloc.free(pages)
        return len(pages)

    def evict(self, tier: Tier, num_pages: int, pool_id: PoolId | None = None) -> int:
        """Evict from one tier on request; returns the pages freed now."""
        if tier == Tier.DEVICE:
            return self._evict_device(self.pools.get(pool_id), num_pages)
        if tier == Tier.HOST:
            return self._evict_host(num_pages)
        return self.disk.evict(num_pages)

    def purge(self, namespaces: set[NamespaceId]) -> Purged:
        """Forget ``namespaces`` (a tenant's data to be deleted): every page of theirs
        that nothing holds now leaves every tier — each device pool of hicache's own, host,
        disk (its records deleted, those waiting to be written back to the remote tier
        too) — none of it written anywhere first, and the remote tier's store removes
        every page of theirs, whichever node of the fleet put it (:meth:`RemoteTier.purge`:
        ``namespaces`` this tree never held too). Pages that a lock or a transfer holds
        stay (``left``): a purge again, once they are let go, takes them."""
        tree = self.tree
        out = Purged()
        for pool in self.pools:
            if pool.owned or pool.retired:
                continue
            with pool.allocator.free_group():
                for node in tree.iter_evictable(Tier.DEVICE, pool.pool_id, namespaces=namespaces):
                    out.device += self._drop_device(pool, node)
        with self.host_alloc.free_group():
            for node in tree.iter_evictable(Tier.HOST, namespaces=namespaces):
                out.host += self._drop_host(node)
        out.disk = len(self.disk.purge(namespaces)) + self.remote.drop_waiting(namespaces)
        out.remote = self.remote.purge(namespaces)
        for namespace in namespaces:
            if tree.has_namespace(namespace):
                stack = list(tree.root(namespace).children.values())
                while stack:
                    node = stack.pop()
                    out.left += node.num_pages if node.residency else 0
                    stack.extend(node.children.values())
        return out

    def forget_disk_keys(self, keys: Iterable[bytes]) -> None:
        """The store dropped these records on its own: forget them (and what hangs
        below); keys this tree does not hold are ignored."""
        keys = list(keys)
        self.disk.forget_keys(keys)
        if self.checkpoints is not None:  # (the store evicts checkpoint records like pages)
            self.checkpoints.forget_keys(keys)

    def miss_reason(self, page_key: PageKey) -> str:
        """Why the page with this key is not cached: ``evicted_<tier>`` if it was
        evicted recently (from the tier it left last), else ``never_stored``."""
        return self._core.misses.reason(page_key)

    def why_missed(self, namespace: NamespaceId, tokens: bytes, match: MatchResult) -> str:
        """:meth:`miss_reason` of the first page after ``match`` (a match of the packed
        ``tokens``); ``never_stored`` for a partial page."""
        return self._core.misses.after(namespace, tokens, match)

    def rebuild_from_storage(self, progress: Callable[[int], None] | None = None) -> int:
        """Put every persisted page of this spec back into the tree as disk-resident
        (see :func:`hicache.tiers.rebuild.rebuild_steps`); returns the pages restored.
        ``progress(records done)`` is called every :data:`REBUILD_PROGRESS_EVERY`
        records, so that a caller on an event loop can keep its watchdog fed through a
        long rebuild (the daemon instead runs :meth:`rebuild_steps` a slice at a time)."""
        steps = self.rebuild_steps(REBUILD_PROGRESS_EVERY)
        while True:
            try:
                done = next(steps)
            except StopIteration as finished:
                return finished.value
            if progress is not None:
                progress(done)

    def rebuild_steps(self, every: int = REBUILD_PROGRESS_EVERY) -> Iterator[int]:
        """:meth:`rebuild_from_storage` as a generator of the records done so far."""
        if self.checkpoints is None:
            return self.disk.rebuild_steps(every)
        return self._rebuild_with_checkpoints(every)

    def _rebuild_with_checkpoints(self, every: int) -> Iterator[int]:
        records: list[tuple[bytes, bytes, int]] = []
        pages = yield from self.disk.rebuild_steps(every, records)
        attached = self.checkpoints.attach_restored(records)
        logger.info("rebuild: %d checkpoints back on their pages", attached)
        return pages

    def poll(self, timeout_s: float = 0.0, limit: int | None = None) -> int:
        """Run completed transfers' callbacks (at most ``limit``; 0: none, for an owner
        that drains them itself) and due timers (owner thread)."""
        ran = self.completions.drain(timeout_s, limit)
        # Whoever drained them (the daemon drains the completions it shares with every
        # manager itself: ``limit=0``), a retired pool's last transfer may have ended.
        if self.pools.any_retired():
            self.pools.reap(self._inflight.pools(), self.tree)
        if self._backups.deferred:
            ran += self._retry_backups()
        if self._loads.parked:
            ran += self._loads.retry_parked()
        if self.windows is not None:
            if self.windows.split:
                ran += self.windows.top_up()
            if self.windows.superseded:
                self.windows.release()
        return ran + self._timers.run_due()

    def _retry_backups(self) -> int:
        """Retry the deferred backups if the host tier changed since the last try (its
        free or evictable pages: the owner of the completions may be the daemon, so a
        transfer's end is not seen here). O(1) when nothing changed."""
        room = (self.host_alloc.num_free, self.tree.sizes(Tier.HOST).evictable)
        if room == self._host_room_tried:
            return 0
        started = self._backups.retry()
        self._host_room_tried = (self.host_alloc.num_free, self.tree.sizes(Tier.HOST).evictable)
        return started

    def wait(self, future: Future, timeout_s: float = 60.0):
        """Poll until ``future`` is done; return its result (tests and draining)."""
        deadline = time.monotonic() + timeout_s
        while not future.done():
            if time.monotonic() > deadline:
                raise TimeoutError("the tier manager did not finish in time")
            self.poll(0.01)
        return future.result()

    def idle(self, *, local: bool = False) -> bool:
        """Is nothing in flight? ``local``: nothing between this node's own tiers — the
        remote tier's calls aside (a store that hangs in one holds up no disk write)."""
        busy = self._inflight.local() if local else bool(self._inflight)
        return (not busy and not self.disk.pending and not self._loads.parked
                and not (self.checkpoints is not None and self.checkpoints.busy)
                and not (self.windows is not None and (self.windows.busy or self.windows.split)))

    @property
    def deferred_backups(self) -> int:
        """Backups waiting for room in the host tier."""
        return len(self._backups.deferred)

    def durability(self) -> dict[str, int]:
        """What is on disk and what is not (O(nodes): for ``flush`` and drain):
        ``written_pages`` (pages that reached the disk tier, ever), ``on_disk_pages``,
        ``not_on_disk_pages`` (cached on device or host only: a crash loses them — by
        policy, or while their backup or write waits for room), ``deferred_backups``."""
        missing = sum(n.num_pages for n in self.tree.nodes() if not n.on_disk) if self.disk.enabled else 0
        return {"written_pages": self.disk.committed, "on_disk_pages": self.tree.sizes(Tier.DISK).cached,
                "not_on_disk_pages": missing, "deferred_backups": len(self._backups.deferred)}

    def queues(self) -> dict[str, tuple[int, int | None]]:
        """The queues between the tiers: name -> (pages in it, its bound or None).
        ``backup_deferred`` / ``disk_write_deferred``: work waiting for room (retried,
        never dropped while the page is cached); ``host_staging``: host pages reserved
        by backups and disk reads landing; ``disk_write``: pages written and not yet
        committed; ``load_waiting``: device pages that parked loads wait for (see
        :mod:`hicache.tiers.loads`)."""
        return {
            "backup_deferred": (self._backups.deferred_pages(), None),
            "host_staging": (self._core.host_staging, self.host_alloc.capacity),
            "disk_write": (self.disk.pending, self.disk.write_limit if self.disk.enabled else None),
            "disk_write_deferred": (self.disk.deferred_writes(), None),
            "load_waiting": (self._loads.parked_pages(), None),
        }

    def persist(self) -> int:
        """Start writing every host page that has no disk record yet (a draining daemon
        keeps what it can), after starting the deferred backups that fit; returns the
        pages queued to disk."""
        self._backups.retry()
        return self.disk.persist()

    def flush(self, timeout_s: float = 60.0, progress: Callable[[int, int], None] | None = None,
              every_s: float = 2.0, *, local: bool = False) -> None:
        """Wait until no transfer is in flight and storage has committed everything.
        ``progress(pages being written, pages of writes deferred)`` is called every
        ``every_s`` while it waits (a draining daemon logs it). ``local``: the remote
        tier's calls are not waited for (see :meth:`idle`). ``TimeoutError`` past
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        report_at = time.monotonic() + every_s
        while True:
            while not self.idle(local=local):
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError("transfers still in flight")
                if progress is not None and now >= report_at:
                    progress(self.disk.pending, self.disk.deferred_writes())
                    report_at = now + every_s
                self.poll(0.01)
            # Deferred backups that fit now start; those that still do not (host pages
            # held by locks) are left for later: they are not in flight.
            if not self._backups.retry() + self.disk.retry_writes():
                break
        # (the store is shared with other specs: a write of theirs that hangs holds this up)
        self.disk.flush(max(0.0, deadline - time.monotonic()))

    def next_timer(self) -> float | None:
        """When the earliest timer is due (on this manager's clock), if any."""
        return self._timers.next_due()

    def add_timer(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` from :meth:`poll` once ``delay_s`` has passed on this manager's clock."""
        self._timers.add(delay_s, fn)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Finish the transfers in flight (within ``timeout_s``), then let go of the
        threads and the memory. True when closed; False when the transfers did not
        finish in time (a storage that hangs): then nothing is let go — a transfer
        that resumed would read or write freed memory, and a stuck thread cannot be
        joined — and it is all left to the process's exit."""
        try:
            self.flush(timeout_s)
        except TimeoutError:
            return False
        self._core.misses.close()
        self.remote.close()
        self.workers.close()
        if self._copy_workers is not None:
            self._copy_workers.close()
        self.pools.close()
        self.host_pool.close()
        return True

    def accounting(self) -> dict[Place, TierAccount]:
        """Pages per place (each device pool, host, disk) and state."""
        return accounting(self._core, self.pools, self.disk)

    def check_invariants(self, deferred: list[Callable[[], None]] | None = None) -> None:
        """The tree's and allocators' own checks, plus the accounting between them
        (``deferred``: the tree's check of its copy goes there, to run later, on any
        thread; see :meth:`HiRadixTree.check_invariants`)."""
        check_invariants(self._core, self.pools, self.disk, deferred)
        if self.checkpoints is not None:
            self.checkpoints.check()
        if self.windows is not None:
            self.windows.check(self.tree)
