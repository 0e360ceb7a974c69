"""The device-pool registry: the engines' pools a tier manager has adopted.

Each :class:`DevicePoolState` is one registered pool (one :class:`DevicePool` per TP
rank), or an *engine-owned* pool (one :class:`~hicache.foreign.ForeignPool` in the
engine's own layout: the engine allocates its blocks, so the pool's allocator is a
:class:`~hicache.pages.NullPageAllocator` that keeps nothing per block, the tree never
holds device pages of it, and pages only move by ``store`` and
``load_into``): its page allocator, which pages are private to its engine (allocated and not
inserted), its layer counters, the page movers between each rank and the host pool, and
the copy engine its transfers use. A pool is retired when its engine goes; it is reaped
(pages forgotten, memory unmapped) once no transfer uses it any more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from hicache.counters import LayerCounters
from hicache.errors import InvalidArgument, SpecMismatch
from hicache.foreign import ForeignMover, ForeignPool
from hicache.kernels.copy_plan import CpuCopyWorkers
from hicache.pages import NullPageAllocator, PageAllocator, PageIds, PageIdsLike, distinct_page_ids
from hicache.pools import DevicePool, HostPool
from hicache.spec import KVSpec
from hicache.tiers.copying import CopyEngine, CopyEngines
from hicache.transfer import PageMover
from hicache.tree import HiRadixTree, PoolId

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class DevicePoolState:
    pool_id: PoolId
    ranks: list[DevicePool]
    movers: list[PageMover]
    allocator: PageAllocator | NullPageAllocator
    private: np.ndarray  # bool per page id (none for an engine-owned pool: its engine has no private pages)
    counters: LayerCounters
    copy: CopyEngine
    num_private: int = 0
    staging: int = 0  # pages reserved by loads still waiting for disk reads, or held by transfers (orphans)
    retired: bool = False
    owned: bool = False  # engine-owned: see the module docstring
    name: str = ""  # an engine-owned pool's name, which the engine's other sessions attach by
    kv_events: bool = True  # has a KV event stream (an engine-owned pool may go without)
    counts_tokens: bool = True  # its tokens count in the token figures (see hicache.metrics.SpecMetrics)
    # The state slots its engine lent for checkpoints (hicache.tiers.checkpoints), if any.
    checkpoint_slots: PageAllocator | None = None
    # Loads of this pool waiting for disk reads (hicache.tiers.loads, .owned), each with
    # what ends it when the pool retires first: their holds and pages, and their answers.
    reading: dict[object, Callable[[], None]] = field(default_factory=dict)

    def checked_ids(self, pages: PageIdsLike) -> PageIds:
        """``pages`` as ids, checked: in the pool's range, none repeated."""
        return distinct_page_ids(pages, self.allocator.capacity)

    def make_private(self, ids: PageIds) -> None:
        self.private[ids] = True
        self.num_private += len(ids)

    def unmake_private(self, ids: PageIds) -> None:
        self.private[ids] = False
        self.num_private -= len(ids)

    def free_orphans(self, transfer) -> None:
        """``transfer`` is over: the pages it held out of the tree are free now."""
        orphans = transfer.take_orphans()
        if len(orphans):
            self.staging -= len(orphans)
            self.allocator.free(orphans)

    def release(self, ids: PageIds) -> None:
        """Give back private pages."""
        if not self.private[ids].all():
            raise InvalidArgument("only private pages can be released")
        self.unmake_private(ids)
        self.allocator.free(ids)

    def close(self) -> None:
        self.counters.close()
        for rank in self.ranks:
            rank.close()

    def check(self, cached: int) -> None:
        if self.owned:
            assert cached == 0 and self.allocator.num_allocated == 0 and not self.num_private, (
                self.pool_id, cached, self.allocator.num_allocated)
        self.allocator.check_invariants()
        assert self.num_private == int(self.private.sum())
        assert self.allocator.num_allocated == self.num_private + cached + self.staging, (
            self.pool_id, self.allocator.num_allocated, self.num_private, cached, self.staging)


class DevicePools:
    """See the module docstring. Owner thread only."""

    def __init__(self, spec: KVSpec, host_pool: HostPool, engines: CopyEngines, *, counter_slots: int,
                 copy_workers: CpuCopyWorkers | None) -> None:
        self.spec = spec
        self._host_pool = host_pool
        self._engines = engines
        self._counter_slots = counter_slots
        self._copy_workers = copy_workers
        self._pools: dict[PoolId, DevicePoolState] = {}

    def register(self, pool_id: PoolId, ranks: list[DevicePool]) -> DevicePoolState:
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
        layouts = {(pool.layout.num_state_slots, pool.layout.checkpoint_slots) for pool in ranks}
        if len(layouts) != 1:
            raise InvalidArgument("rank pools must have equal state regions")
        movers = [PageMover(pool, self._host_pool, workers=self._copy_workers) for pool in ranks]
        device = ranks[0].device
        counters = LayerCounters(
            self._counter_slots, self.spec.num_layers,
            cuda_device=device.index or 0 if device.type == "cuda" else None,
        )
        state = DevicePoolState(pool_id, ranks, movers, PageAllocator.for_device(num_pages),
                                np.zeros(num_pages + 1, dtype=bool), counters, self._engines.for_device(device))
        layout = ranks[0].layout
        if layout.checkpoint_slots:
            state.checkpoint_slots = PageAllocator(layout.checkpoint_slots, first_page_id=layout.num_state_slots + 1)
        self._pools[pool_id] = state
        return state

    def register_owned(self, pool_id: PoolId, pool: ForeignPool, name: str = "", *,
                       kv_events: bool = True, counts_tokens: bool = True) -> DevicePoolState:
        """An engine-owned pool (see the module docstring)."""
        if pool_id in self._pools:
            raise InvalidArgument(f"pool {pool_id} is already registered")
        if pool.spec.fingerprint != self.spec.fingerprint:
            raise SpecMismatch("the pool has another KV spec")
        if name and self.named(name) is not None:
            raise InvalidArgument(f"a pool named {name!r} is registered already")
        device = pool.device
        counters = LayerCounters(
            self._counter_slots, self.spec.num_layers,
            cuda_device=device.index or 0 if device.type == "cuda" else None,
        )
        mover = ForeignMover(pool, self._host_pool, workers=self._copy_workers)
        # Nothing per block: the engine allocates them, and may claim billions of them.
        state = DevicePoolState(pool_id, [pool], [mover], NullPageAllocator(pool.num_pages),
                                np.zeros(0, dtype=bool), counters, self._engines.for_device(device),
                                owned=True, name=name, kv_events=kv_events, counts_tokens=counts_tokens)
        self._pools[pool_id] = state
        return state

    def named(self, name: str) -> DevicePoolState | None:
        """The serving engine-owned pool of this name, if any ("" names none)."""
        if not name:
            return None
        for pool in self._pools.values():
            if pool.owned and pool.name == name and not pool.retired:
                return pool
        return None

    def get(self, pool_id: PoolId) -> DevicePoolState:
        """A registered pool that still takes work."""
        try:
            pool = self._pools[pool_id]
        except (KeyError, TypeError):
            raise InvalidArgument(f"pool {pool_id!r} is not registered") from None
        if pool.retired:
            raise InvalidArgument(f"pool {pool_id} has been unregistered")
        return pool

    def any_retired(self) -> bool:
        return any(pool.retired for pool in self._pools.values())

    def reap(self, busy: set[PoolId | None], tree: HiRadixTree) -> None:
        """Forget and unmap the retired pools no transfer uses any more."""
        for pool_id, pool in list(self._pools.items()):
            if not pool.retired or pool_id in busy:
                continue
            pool.allocator.free(tree.discard_pool(pool_id))
            if pool.num_private:
                pool.allocator.free(np.flatnonzero(pool.private))
            del self._pools[pool_id]
            pool.close()
            logger.info("pool %s unregistered", pool_id)

    def __iter__(self) -> Iterator[DevicePoolState]:
        return iter(list(self._pools.values()))

    def __getitem__(self, pool_id: PoolId) -> DevicePoolState:
        """A registered pool, retired or not (a transfer finishing for it)."""
        return self._pools[pool_id]

    def ranks(self) -> list[DevicePool]:
        return [rank for pool in self._pools.values() for rank in pool.ranks]

    def close(self) -> None:
        self._engines.close()  # (their threads first: nothing they enqueue reaches a ring closed below)
        for pool in self._pools.values():
            pool.counters.close()
