"""Device -> host: backing up a node's device pages (and its ancestors' that lack a host
copy) into host pages, per the write policy; once on host, on to disk per the disk
policy.

A backup the host tier has no room for now (its pages pinned by disk writes still
running, or locked) is *deferred*, not dropped: it is counted, kept in order, retried
whenever the manager polls (:meth:`Backups.retry`), and the device eviction backs such a
node up before it lets its device copy go — so a page the write policy wanted backed up
is never lost while it is cached somewhere. (A path longer than the whole host tier can
never be backed up at once: it is not deferred.)"""

from __future__ import annotations

import logging

import numpy as np

from hicache.tiers.core import Core
from hicache.tiers.devices import DevicePoolState, DevicePools
from hicache.tiers.disk import DiskTier
from hicache.tiers.policies import DiskPolicy
from hicache.tiers.transfers import Entry, Kind, Transfer, concat
from hicache.tree import HOST_SLOT, Node, Tier, swa_first

logger = logging.getLogger(__name__)


class Backups:
    def __init__(self, core: Core, pools: DevicePools, disk: DiskTier, disk_policy: DiskPolicy) -> None:
        self.core = core
        self.pools = pools
        self.disk = disk
        self.disk_policy = disk_policy
        self.deferred: dict[int, DevicePoolState] = {}  # node id -> its pool: backups waiting for host room
        self.over_quota = False  # the last backup was not made: its tenant's host quota

    def backup(self, pool: DevicePoolState, node: Node, *, then_drop: bool = False) -> bool:
        """Copy ``node`` and its ancestors that lack one to host; False if not now.
        ``then_drop``: drop ``node``'s device copy once it is on host (a write-back)."""
        core = self.core
        tree = core.tree
        self.over_quota = False
        path = [n for n in tree.path(node) if n.host_pages is None and not core.inflight.busy(n, Kind.BACKUP)]
        if not path or (then_drop and path[-1] is not node):
            return False
        total = sum(n.num_pages for n in path)
        # The allocation may evict host pages: not those of the ancestor this path hangs
        # from (the copy would land below a parent with no host copy, and be thrown away).
        anchor = path[0].parent
        tree.pin(anchor)
        try:
            if not core.room_for(node.namespace, Tier.HOST, total):
                self.deferred.pop(node.node_id, None)
                self.over_quota = True  # not deferred: its tenant's own pages are what must go
                return False
            host_pages = core.alloc_host(total)
        finally:
            tree.unpin(anchor)
        if host_pages is None:
            if node.node_id not in self.deferred and total <= core.host_alloc.capacity:
                self.deferred[node.node_id] = pool
                core.metrics.backup_deferred()
            return False
        self.deferred.pop(node.node_id, None)
        entries = []
        offset = 0
        windows = core.windows
        for n in path:
            src = n.device_pages(pool.pool_id)
            if src is None:  # cannot happen: device residency is closed under ancestors
                raise AssertionError(f"{n} has no pages in pool {pool.pool_id}")
            first = 0 if windows is None else windows.first_backed_up(n, swa_first(n, pool.pool_id))
            entries.append(Entry(n, src.astype(np.int64), host_pages[offset : offset + n.num_pages].astype(np.int64),
                                 first))
            offset += n.num_pages
        hold = path[-1]
        tree.lock(hold, pool.pool_id)
        transfer = Transfer(Kind.BACKUP, pool.pool_id, entries, hold)
        if then_drop:
            transfer.then_drop.add(node.node_id)
        core.inflight.add(transfer)
        core.stage(transfer, node.namespace, Tier.HOST, total)
        core.host_staging += total
        movers = pool.movers
        if windows is None:
            src_all = concat(e.src for e in entries)
            dst_all = concat(e.dst for e in entries)

            def enqueue() -> None:
                for mover in movers:
                    mover.backup(src_all, dst_all)
        else:  # the pages outside the window without their SWA layers
            (dead_src, dead_dst), (live_src, live_dst) = _split_parts(entries)
            transfer.nbytes = windows.nbytes(total, len(dead_src))

            def enqueue() -> None:
                for mover in movers:
                    if len(live_src):
                        mover.backup(live_src, live_dst)
                    if len(dead_src):
                        mover.backup(dead_src, dead_dst, without_swa=True)

        pool.copy.run(enqueue, lambda error: self._done(transfer, error))
        return True

    def is_deferred(self, node: Node) -> bool:
        return node.node_id in self.deferred

    def deferred_pages(self) -> int:
        tree = self.core.tree
        return sum(n.num_pages for node_id in self.deferred if (n := tree.find(node_id)) is not None)

    def retry(self) -> int:
        """Start the deferred backups the host tier has room for now, oldest first (the
        first that still does not fit stops the round); returns how many started."""
        started = 0
        tree = self.core.tree
        for node_id, pool in list(self.deferred.items()):
            node = tree.find(node_id)
            if node is None or pool.retired or node.device_pages(pool.pool_id) is None or node.host_pages is not None:
                del self.deferred[node_id]  # gone, or backed up meanwhile (as some other node's ancestor)
                continue
            if not self.backup(pool, node):
                if node_id in self.deferred:
                    break
                continue  # (nothing left to copy: its path is on host or on its way)
            started += 1
        return started

    def _done(self, transfer: Transfer, error: BaseException | None) -> None:
        core = self.core
        tree = core.tree
        core.inflight.remove(transfer)
        core.host_staging -= transfer.num_pages
        core.unstage(transfer, Tier.HOST)
        if error is None:
            core.report(transfer)
        pool = self.pools[transfer.pool]
        tree.unlock(transfer.hold, transfer.pool)
        pool.free_orphans(transfer)
        if error is not None:
            logger.error("backup from pool %s failed: %s", transfer.pool, error)
            core.failed(transfer)
        added = []
        for entry in transfer.entries:
            node = entry.node
            ok = (error is None and tree.is_live(node) and node.host_pages is None
                  and (node.parent.is_root or node.parent.host_pages is not None))
            if not ok:
                core.host_alloc.free(entry.dst)
                continue
            tree.add_host(node, entry.dst)
            if entry.swa:
                tree.set_swa(node, HOST_SLOT, entry.swa)
            added.append(node)
        if added and self.disk_policy.write_on_host:
            self.disk.write(added[-1])
        if added:
            core.remote.write(added)
        # A write-back's device copy goes even when its copy failed (a broken copy
        # engine must not hold the pool's pages for good): then it was the only one,
        # and the eviction counts the pages dropped from the cache.
        for entry in transfer.entries:
            node = entry.node
            if (node.node_id in transfer.then_drop and tree.is_live(node)
                    and tree.is_evictable(node, Tier.DEVICE, pool.pool_id)):
                core.misses.evicted(node, Tier.DEVICE)
                pool.allocator.free(tree.drop(node, Tier.DEVICE, pool.pool_id))


def _split_parts(entries: list[Entry]) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``(src, dst)`` of the entries' pages without SWA bytes, then of those with."""
    parts = [e.parts() for e in entries]
    return ((concat(p[0][0] for p in parts), concat(p[0][1] for p in parts)),
            (concat(p[1][0] for p in parts), concat(p[1][1] for p in parts)))
