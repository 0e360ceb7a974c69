"""Disk -> host: reading nodes' records into host pages on the I/O threads. A record
that is missing, fails its checksum or is not its page's size (the store judges each
record of a read on its own) cuts the node there: the pages before it stay, the rest is
forgotten on disk (and deleted). A record whose bytes the store could not read (an I/O
error there: it names the record, :class:`~hicache.errors.RecordsUnreadable`, and
judges the others) cuts the node there too, but says nothing about the record: the
pages before it load, it and the rest are a miss this time and stay on disk for the
next read — unless the reads of that node have now failed :data:`UNREADABLE_READS`
times in a row (a bad sector, not a hiccup): then it is forgotten on disk from that
record on, like a corrupt one, so matches stop promising pages no read can bring and
the prefix is computed and written again. So does a read whose call fails as a whole (LMDB out of reader slots, the
store unavailable, no memory): its pages are a miss, and stay."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from hicache.errors import RecordsUnreadable
from hicache.storage.base import StorageBackend
from hicache.tiers.core import Core
from hicache.tiers.transfers import Entry, Kind, Transfer
from hicache.tree import DISK_SLOT, HOST_SLOT, HiRadixTree, Node, swa_first

if TYPE_CHECKING:
    from hicache.tiers.disk import LocalDisk

logger = logging.getLogger(__name__)

# Failed reads of a node's first record in a row, with no good read between, after
# which the record counts as bad rather than unread.
UNREADABLE_READS = 3
# Nodes whose failed reads are counted at most; past it, those gone from the disk tier
# are dropped from the count, then the oldest (a node read again fails at most
# UNREADABLE_READS times more before it goes).
_MAX_COUNTED_NODES = 1024


class DiskReader:
    def __init__(self, core: Core, storage: StorageBackend, disk: "LocalDisk") -> None:
        self.core = core
        self.storage = storage
        self.disk = disk
        self._failed_reads: dict[int, int] = {}  # node id -> failed reads in a row (see _unreadable)

    def read(self, nodes: list[Node]) -> list[Transfer]:
        """Bring disk-only ``nodes`` (a top-down run of one path) to host; returns the
        transfers to wait for (reads already in flight included)."""
        core = self.core
        waiting: list[Transfer] = []
        fresh = []
        for n in nodes:
            busy = core.inflight.on(n, Kind.DISK_READ)
            if busy:
                waiting.extend(t for t in busy if t not in waiting)
            elif n.host_pages is None and n.on_disk:
                fresh.append(n)
        if not fresh:
            return waiting
        # The allocation may evict, and write host pages to disk to do so: the room that
        # makes on disk must not be these records (nor the host copies above them).
        anchor = fresh[-1]
        core.tree.pin(anchor)
        try:
            while fresh:
                pages = core.alloc_host(sum(n.num_pages for n in fresh))
                if pages is not None:
                    break
                fresh.pop()
        finally:
            core.tree.unpin(anchor)
        if not fresh:
            return waiting
        entries = []
        offset = 0
        for n in fresh:
            dst = pages[offset : offset + n.num_pages].astype(np.int64)
            entries.append(Entry(n, np.arange(offset, offset + n.num_pages), dst))
            offset += n.num_pages
        hold = fresh[-1]
        core.tree.pin(hold)
        transfer = Transfer(Kind.DISK_READ, None, entries, hold)
        core.inflight.add(transfer)
        core.host_staging += len(pages)
        keys = [k for n in fresh for k in n.page_key_list()]
        buffers = [core.host_pool.page_array(int(h)) for h in pages]
        if core.windows is not None:  # records of pages outside the window: no SWA part
            kept = core.windows.kept_bytes
            offset = 0
            for n in fresh:
                for i in range(offset, offset + swa_first(n, DISK_SLOT)):
                    buffers[i] = buffers[i][:kept]
                offset += n.num_pages
        storage = self.storage
        fingerprint = core.spec.fingerprint

        def work() -> list[bool]:
            return storage.get(keys, buffers, fingerprint=fingerprint)

        core.workers.io(work, lambda found, error: self._done(transfer, found, error))
        waiting.append(transfer)
        return waiting

    def _done(self, transfer: Transfer, found: list[bool] | None, error: BaseException | None) -> None:
        core = self.core
        tree = core.tree
        core.inflight.remove(transfer)
        core.host_staging -= transfer.num_pages
        unreadable: set[int] = set()
        if isinstance(error, RecordsUnreadable):  # (the others are judged: cut at the first)
            found, unreadable, error = error.found, set(error.unreadable), None
        if found is not None:
            core.report(transfer, sum(found))
        tree.unpin(transfer.hold)
        if error is not None:
            logger.error("disk read of %d pages failed (their records stay on disk): %s", transfer.num_pages, error)
            core.metrics.missed("load_failed", transfer.num_pages * core.spec.page_size)
            for entry in transfer.entries:
                core.host_alloc.free(entry.dst)
            transfer.finished()
            return
        failed = False
        offset = 0
        for entry in transfer.entries:
            node = entry.node
            n = len(entry.dst)
            ok = np.asarray(found[offset : offset + n], dtype=bool)
            start = offset
            offset += n
            usable = (not failed and tree.is_live(node) and node.host_pages is None
                      and (node.parent.is_root or node.parent.host_pages is not None))
            good = n if ok.all() else int(np.argmin(ok))
            kept = good < n and start + good in unreadable  # (nothing is known of it)
            if not usable or good == 0:
                core.host_alloc.free(entry.dst)
                if usable and kept:
                    self._unreadable(transfer, node, start)
                elif usable and node.on_disk:
                    self.disk.drop_bad_records(node)
                failed = True
                continue
            if good < n:
                # The first good pages stay: cut the node there; the rest is forgotten,
                # or left on disk if its first record could not be read.
                upper = tree.split(node, good)
                tree.add_host(upper, entry.dst[:good])
                _same_swa(tree, upper)
                core.host_alloc.free(entry.dst[good:])
                if kept:
                    self._failed_reads.pop(node.node_id, None)  # (its first record was read: it starts here now)
                    self._unreadable(transfer, node, start + good)
                else:
                    self.disk.drop_bad_records(node)
                failed = True
                continue
            tree.add_host(node, entry.dst)
            _same_swa(tree, node)
            core.note_read(node)
            self._failed_reads.pop(node.node_id, None)
        transfer.finished()

    def _unreadable(self, transfer: Transfer, node: Node, at: int) -> None:
        """The first record of ``node``, page ``at`` of ``transfer``, could not be read:
        the pages from it on are a miss this time, and stay on disk — unless this is the
        :data:`UNREADABLE_READS`-th failed read of ``node`` in a row: then it is forgotten
        on disk (and below), its records deleted, and that is logged once."""
        core = self.core
        failures = self._failed_reads.pop(node.node_id, 0) + 1
        if failures >= UNREADABLE_READS:
            num_pages = self.disk.drop_bad_records(node, "unreadable_record")
            core.metrics.disk_unreadable(num_pages)
            logger.error("disk read: the first record of node %d failed %d reads in a row: %d pages forgotten on "
                         "disk (their records deleted), to be computed again", node.node_id, failures, num_pages)
            return
        self._count(node.node_id, failures)
        logger.warning("disk read: the first record of node %d could not be read (kept on disk, %d failed reads in "
                       "a row): %d pages not loaded", node.node_id, failures, transfer.num_pages - at)
        core.metrics.missed("load_failed", (transfer.num_pages - at) * core.spec.page_size)

    def _count(self, node_id: int, failures: int) -> None:
        """Note ``failures`` for node ``node_id``, within :data:`_MAX_COUNTED_NODES`."""
        counted = self._failed_reads
        if len(counted) >= _MAX_COUNTED_NODES:
            tree = self.core.tree
            for gone in [i for i in counted if (n := tree.find(i)) is None or not n.on_disk]:
                del counted[gone]
            while len(counted) >= _MAX_COUNTED_NODES:
                del counted[next(iter(counted))]
        counted[node_id] = failures


def _same_swa(tree: HiRadixTree, node: Node) -> None:
    """The host copy read from disk holds the SWA bytes the records did."""
    first = swa_first(node, DISK_SLOT)
    if first:
        tree.set_swa(node, HOST_SLOT, first)
