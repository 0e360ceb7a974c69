"""What the tier manager's parts share: the tree, the host pool and its allocator, the
transfers in flight, miss reasons, metrics, and the threads transfers run on.

The eviction cascade belongs to :class:`hicache.tiers.manager.TierManager`; a part that
needs host pages calls :attr:`Core.alloc_host`, which the manager sets to its own
evicting allocation.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from hicache.jobs import Completions, Workers
from hicache.pages import PageAllocator, PageIds
from hicache.pools import HostPool
from hicache.spec import KVSpec
from hicache.tiers.misses import MissReasons
from hicache.tiers.quotas import SpaceQuotas
from hicache.tiers.transfers import InFlight, Transfer
from hicache.tree import HiRadixTree, Node, Tier


_READS_REMEMBERED = 1 << 16


def _no_eviction(num_pages: int) -> PageIds | None:
    raise RuntimeError("Core.alloc_host is set by the tier manager")


@dataclass(eq=False)
class Core:
    spec: KVSpec
    tree: HiRadixTree
    host_pool: HostPool
    host_alloc: PageAllocator
    metrics: object
    completions: Completions
    workers: Workers
    inflight: InFlight
    misses: MissReasons
    host_staging: int = 0  # host pages reserved by transfers still landing
    alloc_host: Callable[[int], PageIds | None] = _no_eviction
    quotas: SpaceQuotas | None = None  # set by the tier manager
    # (namespaces, tier, pages) -> pages freed from those namespaces only: the manager's
    evict_own: Callable[[set, Tier, int], int] | None = None
    # The remote tier (hicache.tiers.remote; set by the manager): told of pages an engine
    # computed as they reach host memory (its write-through).
    remote: object = None
    # Sliding-window layers (hicache.tiers.windows; set by the manager): None without.
    windows: object = None
    # Nodes a disk read brought to host that no load has taken yet: a load counts their
    # pages as disk hits (a match's prefetch reads them before the load asks).
    read_from_disk: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # Bytes moved by finished transfers, by direction (the metrics' label): d2h, ...
    moved: dict[str, int] = field(default_factory=dict)

    def room_for(self, namespace, tier: Tier, num_pages: int) -> bool:
        """May ``num_pages`` more pages of ``namespace`` go to ``tier`` (its space quota,
        if any — see :mod:`hicache.tiers.quotas`; the manager evicts for it)?"""
        quotas = self.quotas
        if quotas is None or not quotas.active:
            return True
        return quotas.room(namespace, tier, num_pages, lambda namespaces, pages: self.evict_own(namespaces, tier, pages))

    def stage(self, transfer: Transfer, namespace, tier: Tier, num_pages: int) -> None:
        if self.quotas is not None and self.quotas.active:
            transfer.quota = (self.quotas.stage(namespace, tier, num_pages), num_pages)

    def unstage(self, transfer: Transfer, tier: Tier) -> None:
        if transfer.quota is not None and self.quotas is not None:
            self.quotas.unstage(transfer.quota[0], tier, transfer.quota[1])
            transfer.quota = None

    def report(self, transfer: Transfer, num_pages: int | None = None) -> None:
        """A transfer's bytes and time, in the transfer metrics (and :attr:`moved`)."""
        if num_pages is None and transfer.nbytes is not None:
            nbytes = transfer.nbytes
        else:
            nbytes = (transfer.num_pages if num_pages is None else num_pages) * self.spec.host_page_bytes
        seconds = time.perf_counter() - transfer.timing["submitted"]
        self.metrics.transfer(transfer.kind.value, nbytes, seconds)
        self.moved[transfer.kind.value] = self.moved.get(transfer.kind.value, 0) + nbytes

    def failed(self, transfer: Transfer, num_pages: int | None = None) -> None:
        """A transfer's pages did not reach their tier: counted by direction (the log
        line says why)."""
        self.metrics.transfer_failed(transfer.kind.value, transfer.num_pages if num_pages is None else num_pages)

    def note_read(self, node: Node) -> None:
        self.read_from_disk[node.node_id] = None
        if len(self.read_from_disk) > _READS_REMEMBERED:
            self.read_from_disk.popitem(last=False)

    def disk_pages_of(self, nodes: list[Node]) -> int:
        """Pages of ``nodes`` a disk read brought to host for this load (forgotten now)."""
        reads = self.read_from_disk
        return sum(n.num_pages for n in nodes if reads.pop(n.node_id, 0) is None)

    def drop_host_if_evictable(self, node: Node) -> None:
        """Drop ``node``'s host copy if it may go now (a write-back that finished — or
        failed: a broken disk must not pin the host tier, and the pages then leave the
        cache, counted as such)."""
        if self.tree.is_live(node) and self.tree.is_evictable(node, Tier.HOST):
            self.misses.evicted(node, Tier.HOST)
            self.host_alloc.free(self.tree.drop(node, Tier.HOST))
