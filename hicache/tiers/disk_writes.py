"""Host -> disk: writing a node's pages (and its ancestors' that lack a record) to the
store, with the metadata a warm restart rebuilds the tree from."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from hicache.storage.base import PageMeta, PageRecord, StorageBackend
from hicache.tiers.core import Core
from hicache.tiers.transfers import Entry, Kind, Transfer
from hicache.tree import Node

if TYPE_CHECKING:
    from hicache.tiers.disk import LocalDisk

logger = logging.getLogger(__name__)


class DiskWriter:
    def __init__(self, core: Core, storage: StorageBackend, disk: "LocalDisk") -> None:
        self.core = core
        self.storage = storage
        self.disk = disk
        self.pending = 0  # pages written and not committed yet

    def write(self, node: Node, *, then_drop_host: bool = False) -> bool:
        """Write ``node`` and its ancestors that lack a disk record (all on host)."""
        core = self.core
        tree = core.tree
        path = [n for n in tree.path(node) if not n.on_disk and not core.inflight.busy(n, Kind.DISK_WRITE)]
        if not path or any(n.host_pages is None for n in path):
            return False
        total = sum(n.num_pages for n in path)
        if not self.disk.room(total):
            return False
        records = []
        entries = []
        for n in path:
            host = n.host_pages.astype(np.int64)
            parent = n.parent.last_page_key
            page_bytes = len(n.key) // n.num_pages
            for i in range(n.num_pages):
                key = n.page_key(i)
                meta = PageMeta(n.namespace, parent, n.key[i * page_bytes : (i + 1) * page_bytes])
                records.append(PageRecord(key, core.host_pool.page(int(host[i])), meta))
                parent = key
            entries.append(Entry(n, host, host))
        hold = path[-1]
        tree.pin(hold)
        transfer = Transfer(Kind.DISK_WRITE, None, entries, hold)
        if then_drop_host:
            transfer.then_drop.add(node.node_id)
        core.inflight.add(transfer)
        self.pending += total
        future = self.storage.put(records, fingerprint=core.spec.fingerprint)
        core.completions.forward(future, lambda result, error: self._done(transfer, result, error))
        return True

    def _done(self, transfer: Transfer, result, error: BaseException | None) -> None:
        core = self.core
        tree = core.tree
        core.inflight.remove(transfer)
        if error is None:
            core.report(transfer)
        self.pending -= transfer.num_pages
        tree.unpin(transfer.hold)
        if error is not None:
            logger.error("disk write failed: %s", error)
        for entry in transfer.entries:
            node = entry.node
            if (error is None and tree.is_live(node) and not node.on_disk
                    and (node.parent.is_root or node.parent.on_disk)):
                tree.add_disk(node)
        if result is not None and result.evicted:
            self.disk.on_store_evicted(result.evicted)
        for entry in transfer.entries:
            if entry.node.node_id in transfer.then_drop:
                core.drop_host_if_evictable(entry.node)
