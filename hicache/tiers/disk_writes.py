"""Host -> disk: writing a node's pages (and its ancestors' that lack a record) to the
store, with the metadata a warm restart rebuilds the tree from.

The writer's queue is bounded: at most ``limit`` pages written and not yet committed
(their host pages are pinned until then, so an unbounded queue pins the whole host tier
when the disk is slower than the traffic). A write beyond the bound is *deferred*, not
dropped: counted (``hicache_disk_writes_deferred_total``), kept in order and started as
earlier writes commit; host eviction writes such a page before it lets its host copy go.
A write whose room other writes in flight or the remote tier's write-backs hold
(records on their way to its store: :meth:`hicache.tiers.disk.LocalDisk.room`) is
deferred the same way, and started as those end: a write-through's pages reach the disk
without waiting for another write of them (or for their host copy to go).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from hicache.keys import PAGE_KEY_BYTES
from hicache.storage.base import PageBatch, StorageBackend
from hicache.tiers.core import Core
from hicache.tiers.transfers import Entry, Kind, Transfer
from hicache.tree import DISK_SLOT, HOST_SLOT, Node, Tier, swa_first

if TYPE_CHECKING:
    from hicache.tiers.disk import LocalDisk

logger = logging.getLogger(__name__)


class DiskWriter:
    def __init__(self, core: Core, storage: StorageBackend, disk: "LocalDisk", limit: int) -> None:
        self.core = core
        self.storage = storage
        self.disk = disk
        self.limit = max(1, limit)  # pages queued (written, not committed) at most
        self.pending = 0  # pages written and not committed yet
        self.over_quota = False  # the last write did not start: its tenant's disk quota
        self.too_large = False  # the last write did not start: more pages than the whole tier holds
        self.committed = 0  # pages that reached the disk tier, ever
        self.deferred: OrderedDict[int, bool] = OrderedDict()  # node id -> then_drop_host: over the bound

    def write(self, node: Node, *, then_drop_host: bool = False) -> bool:
        """Write ``node`` and its ancestors that lack a disk record (all on host);
        False if not now (deferred when only the queue's bound is in the way)."""
        core = self.core
        tree = core.tree
        self.over_quota = self.too_large = False
        path = [n for n in tree.path(node) if not n.on_disk and not core.inflight.busy(n, Kind.DISK_WRITE)]
        if not path or any(n.host_pages is None or not n.tokens for n in path):
            # Nothing to write, or nothing that can be: a page not on host, or one whose
            # tokens went with a disk record it lost (see hicache.tree).
            self.deferred.pop(node.node_id, None)
            return False
        total = sum(n.num_pages for n in path)
        if total > self.disk.capacity_pages:  # ([disk].capacity_bytes too small for it: never written)
            self.deferred.pop(node.node_id, None)
            self.too_large = True
            return False
        if self.pending and self.pending + total > self.limit:  # (a path over the bound goes alone)
            self._defer(node, then_drop_host)
            return False
        hold = path[-1]
        tree.pin(hold)  # before room() evicts: the path's ancestors on disk must stay
        if not core.room_for(node.namespace, Tier.DISK, total):
            tree.unpin(hold)
            self.deferred.pop(node.node_id, None)
            self.over_quota = True
            return False
        if not self.disk.room(total):
            tree.unpin(hold)
            if self.disk.room_coming(total):  # (writes in flight or the remote tier's write-backs hold it)
                self._defer(node, then_drop_host)
            else:
                self.deferred.pop(node.node_id, None)
            return False
        self.deferred.pop(node.node_id, None)
        # Only O(nodes) here; the records (O(pages)) are built on the write-preparation
        # thread from what the path holds now — its host pages stay pinned until done.
        entries = []
        parts = []
        for n in path:
            host = n.host_pages.astype(np.int64)
            parts.append((n.namespace, n.parent.last_page_key, n.tokens, n.page_keys, n.num_pages, host))
            entries.append(Entry(n, host, host, swa_first(n, HOST_SLOT)))  # (what the host copy holds)
        transfer = Transfer(Kind.DISK_WRITE, None, entries, hold)
        if then_drop_host:
            transfer.then_drop.add(node.node_id)
        core.inflight.add(transfer)
        core.stage(transfer, node.namespace, Tier.DISK, total)
        self.pending += total
        storage, fingerprint, host_pool = self.storage, core.spec.fingerprint, core.host_pool

        windows = core.windows
        dead = [e.swa for e in entries] if windows is not None and any(e.swa for e in entries) else None
        if dead is None:
            def submit():
                return storage.put_batch(path_batch(parts, host_pool), fingerprint=fingerprint)
        else:  # the pages outside the window without their SWA part: shorter records
            transfer.nbytes = windows.nbytes(total, sum(dead))
            kept = windows.kept_bytes

            def submit():
                mask = np.concatenate([np.arange(p[4]) < k for p, k in zip(parts, dead)])
                return storage.put_batches(split_batch(path_batch(parts, host_pool), mask, kept),
                                           fingerprint=fingerprint)

        reclaimed = core.remote.keep_on_disk(path)
        core.workers.write(submit, lambda result, error: self._done(transfer, result, error, reclaimed))
        return True

    def _defer(self, node: Node, then_drop_host: bool) -> None:
        """Keep the write of ``node`` for when the disk has room for it (counted once)."""
        if node.node_id not in self.deferred:
            self.deferred[node.node_id] = then_drop_host
            self.core.metrics.disk_write_deferred()
        elif then_drop_host:
            self.deferred[node.node_id] = True

    def _done(self, transfer: Transfer, result, error: BaseException | None, reclaimed: set[bytes]) -> None:
        """``reclaimed``: keys of old records a remote write-back left to this write
        (:meth:`~hicache.tiers.remote.RemoteTier.keep_on_disk`)."""
        core = self.core
        tree = core.tree
        core.inflight.remove(transfer)
        if error is None:
            core.report(transfer)
        self.pending -= transfer.num_pages
        core.unstage(transfer, Tier.DISK)
        tree.unpin(transfer.hold)
        if error is not None:
            logger.error("disk write failed: %s", error)
            core.failed(transfer)
            if reclaimed:  # (the old records, which this write did not replace)
                self._drop_reclaimed(reclaimed)
        unknown = []  # records written that the tree cannot take: deleted, never orphaned
        for entry in transfer.entries:
            node = entry.node
            if error is not None or not tree.is_live(node) or node.on_disk:
                continue
            if node.parent.is_root or node.parent.on_disk:
                tree.add_disk(node)
                if entry.swa:
                    tree.set_swa(node, DISK_SLOT, entry.swa)
                self.committed += node.num_pages
            else:
                unknown.extend(node.page_key_list())
        if unknown:
            logger.warning("%d pages written whose parent left the disk tier meanwhile: deleted", len(unknown))
            self.storage.delete(unknown)
        if result is not None and result.evicted:
            self.disk.on_store_evicted(result.evicted)
        for entry in transfer.entries:
            if entry.node.node_id in transfer.then_drop:
                core.drop_host_if_evictable(entry.node)
        if self.deferred:
            self.retry()

    def _drop_reclaimed(self, reclaimed: set[bytes]) -> None:
        """A failed write's old records that a write-back left to it: back to the
        write-backs that still hold them; those of write-backs done meanwhile are
        deleted now (but any the tree has on disk again). O(nodes + pages): rare."""
        orphans = self.core.remote.keep_failed(reclaimed)
        if orphans:
            on_disk = self.core.tree.disk_nodes(orphans)
            self.storage.delete([k for k in orphans if k not in on_disk])

    def retry(self) -> int:
        """Start the deferred writes the queue has room for now, oldest first; returns
        how many started."""
        started = 0
        tree = self.core.tree
        for node_id, then_drop_host in list(self.deferred.items()):
            node = tree.find(node_id)
            if node is None or node.on_disk or node.host_pages is None:
                del self.deferred[node_id]  # gone, or written meanwhile (as some other node's ancestor)
                continue
            if self.write(node, then_drop_host=then_drop_host):
                started += 1
            elif node_id in self.deferred:
                break  # the queue is full again
        return started

    def deferred_pages(self) -> int:
        tree = self.core.tree
        return sum(n.num_pages for node_id in self.deferred if (n := tree.find(node_id)) is not None)


def path_batch(parts, host_pool) -> PageBatch:
    """The store's records for a path's nodes, ``(namespace, parent key, tokens, page
    keys, pages, host page ids)`` each, as columns: joins of what the nodes hold, no
    object per page (write-preparation thread)."""
    keys = b"".join(p[3] for p in parts)
    namespaces = b"".join(namespace * num_pages for namespace, _, _, _, num_pages, _ in parts)
    # A page's parent is the page before it: the node's parent's last page for its first.
    parents = b"".join(parent + page_keys[:-PAGE_KEY_BYTES] for _, parent, _, page_keys, _, _ in parts)
    tokens = b"".join(p[2] for p in parts)
    rows = np.concatenate([p[5] for p in parts])
    return PageBatch(keys, namespaces, parents, tokens, host_pool.pages_array(), rows)


def split_batch(batch: PageBatch, without_swa: np.ndarray, kept_bytes: int) -> list[PageBatch]:
    """``batch`` as two: the records of the pages with their SWA bytes, then those
    without (``without_swa[i]``), whose payloads are the first ``kept_bytes`` of each
    row (hicache.tiers.windows)."""
    n = batch.num_records
    columns = [np.frombuffer(c, dtype=np.uint8).reshape(n, -1)
               for c in (batch.keys, batch.namespaces, batch.parents, batch.tokens)]
    out = []
    for mask, source in ((~without_swa, batch.source), (without_swa, batch.source[:, :kept_bytes])):
        if mask.any():
            keys, namespaces, parents, tokens = (c[mask].tobytes() for c in columns)
            out.append(PageBatch(keys, namespaces, parents, tokens, source, batch.rows[mask]))
    return out
