"""Sliding-window layers: what of an SWA layer's pages a hit needs, and what is dropped.

For an SWA layer, the token after a cached prefix of ``n`` pages attends back to
position ``n * page_size - window + 1`` only: a hit ending after ``n`` pages needs that
layer's bytes of its last :attr:`~hicache.spec.KVSpec.window_pages` pages (``W``), and
of no page before. The tree's node ends are the hit ends it knows (where inserts ended,
where paths branch, where checkpoints are), so:

* a backup (device -> host) copies the SWA layers' segments only for a node's last
  ``W`` pages; the pages before get the other layers only (the host page's SWA part is
  left as it was: never read). A disk write writes what the host copy holds: records of
  the pages without SWA bytes are the host page's first
  :attr:`~hicache.spec.KVSpec.kept_page_bytes` (the SWA segments come last);
* the tree records per node and slot from which page on its copy holds SWA bytes
  (:attr:`hicache.tree.Node.swa`, cut along with the node by a split). Device copies
  the engine computed hold all; one loaded from host or disk holds what its source did
  — until an insert of pages the engine computed for that node replaces it
  (:meth:`Windows.take_whole`: the engine reads on through the insert's pages);
* a match ends at the deepest node end whose window — the last ``W`` pages before it,
  from wherever a load would take each page (the pool, host, disk) — has its SWA bytes
  (:meth:`Windows.usable`): a mid-edge end found later (a branch after a backup) may
  have lost them, and the hit falls back to an earlier end;
* a split makes a new node end (a branch found after the backup: two conversations
  sharing a system prompt): while a device copy still holds the window's SWA bytes, they
  are copied to the host copy (and its disk records rewritten whole) — a *top-up*
  (:meth:`Windows.top_up`), so that the branch point keeps serving hits from host and
  disk;
* after a restart, each page's record size tells whether it has its SWA bytes; nodes
  are cut where a run of such pages ends, so that each node's holds a suffix again.

Invariant (:meth:`Windows.check`): on host and disk, no node holds SWA bytes of a page
before its last ``W`` — pages outside every window are never backed up or written.
Device pages are the engine's: whole pages, all layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from hicache.keys import PAGE_KEY_BYTES
from hicache.spec import KVSpec
from hicache.storage.base import PageBatch
from hicache.tiers.transfers import Entry, Kind, Transfer, concat
from hicache.tree import DISK_SLOT, HOST_SLOT, HiRadixTree, MatchResult, Node, swa_first

logger = logging.getLogger(__name__)


def cut_match(tree: HiRadixTree, result: MatchResult, pool_id: int, usable: Callable[[Node], bool]) -> MatchResult:
    """``result`` cut back to its deepest node for which ``usable(node)`` holds (nothing
    matched when none does), its parts counted again."""
    node = result.node
    if node is None or node.parent is None:
        return result
    end = node
    while end.parent is not None and not usable(end):
        end = end.parent
    if end is node:
        return result
    root = tree.root(node.namespace)
    if end is root:
        return MatchResult(root, root, root, b"", 0, 0, result.page_size)
    device: list[bytes] = []
    host = disk = 0
    last_device = last_host = root
    for n in tree.path(end):
        pages = n.residency.get(pool_id)
        if pages is not None:
            device.append(pages)
            last_device = last_host = n
        elif HOST_SLOT in n.residency:
            host += n.num_pages
            last_host = n
        else:
            disk += n.num_pages
    return MatchResult(end, last_device, last_host, b"".join(device), host, disk, result.page_size)


class Windows:
    """See the module docstring (a spec with SWA layers)."""

    def __init__(self, spec: KVSpec, core=None, pools=None, storage=None, on_store_evicted=None) -> None:
        self.pages = spec.window_pages  # W
        self.page_bytes = spec.host_page_bytes
        self.kept_bytes = spec.kept_page_bytes
        self.core = core
        self.pools = pools
        self.storage = storage
        self.on_store_evicted = on_store_evicted or (lambda keys: None)
        self.split: list[Node] = []  # new node ends since the last top_up()
        # Device copies an insert's whole pages replaced while a lock covered them:
        # (pool, node, old pages), freed by release() once none does.
        self.superseded: list[tuple[object, Node, np.ndarray]] = []
        self.busy = 0  # top-up copies and rewrites in flight
        self.topped_up = 0  # node ends whose window a top-up gave back its SWA bytes

    # -- top-ups -------------------------------------------------------------------

    def note_split(self, upper: Node) -> None:
        """The tree cut a node: ``upper``'s end is new (looked at by :meth:`top_up`)."""
        self.split.append(upper)

    def top_up(self) -> int:
        """Start the top-ups the node ends made since the last call need; returns how
        many started (owner thread, between requests). An end whose backup or disk write
        is still in flight is looked at again later: what that transfer lands was cut
        to the node as it was when it started. Each end once (one may be listed twice:
        waiting for its top-up, and again as that lands; a copy with a page twice is
        refused)."""
        pending, self.split = list({node.node_id: node for node in self.split}.values()), []
        started = 0
        copies: dict[int, list[Entry]] = {}
        rewrites: list[tuple[Node, int]] = []
        for node in pending:
            outcome = self._top_up(node, copies, rewrites)
            if outcome is None:
                self.split.append(node)
            else:
                started += outcome
        for pool_id, wanted in copies.items():
            self._copy(self.pools[pool_id], wanted)
        if rewrites:
            self._rewrite(rewrites)
        return started

    def _top_up(self, node: Node, copies: dict, rewrites: list) -> bool | None:
        """What ``node``'s window needs: True (a copy into ``copies`` or a rewrite into
        ``rewrites``, started by :meth:`top_up`), False (nothing to do), or None (a
        transfer of it is in flight: ask again later)."""
        core, tree = self.core, self.core.tree
        if not tree.is_live(node):
            return False
        first = max(0, node.num_pages - self.pages)
        inflight = core.inflight
        if HOST_SLOT in node.residency and swa_first(node, HOST_SLOT) <= first:
            if node.on_disk and swa_first(node, DISK_SLOT) > first:
                if self.storage is None or not node.tokens or inflight.busy(node, Kind.DISK_WRITE):
                    return False
                rewrites.append((node, first))
                return True
            return None if inflight.busy(node, Kind.DISK_WRITE) else False
        if inflight.busy(node, Kind.BACKUP) or inflight.busy(node, Kind.DISK_WRITE):
            return None
        if HOST_SLOT not in node.residency:
            return False  # (a backup from now on keeps the window by itself)
        pool = next((self.pools[p] for p in node.device_pools
                     if swa_first(node, p) <= first and not self.pools[p].retired and not self.pools[p].owned), None)
        if pool is None:
            return False
        # (the whole node, its SWA bytes from ``first`` on: an entry a split cuts right)
        copies.setdefault(pool.pool_id, []).append(Entry(node, node.device_pages(pool.pool_id).astype(np.int64),
                                                         node.host_pages.astype(np.int64), first))
        return True

    def _copy(self, pool, wanted: list[Entry]) -> None:
        """Copy the SWA bytes of ``wanted`` — each a node's device and host pages, and
        the first page whose SWA bytes move — from the pool to host in one job, the
        nodes locked in the pool meanwhile (the deepest only: one lock holds its path; a
        lock per node walked the path from each). The job is a transfer in flight (of
        several paths, maybe, held by those locks): a failed load that drops the device
        pages it reads holds them back until it is done, and the pool is not reaped
        under it."""
        core, tree = self.core, self.core.tree
        locked = tree.deepest(entry.node for entry in wanted)
        for node in locked:
            tree.lock(node, pool.pool_id)
        src = concat(entry.src[entry.swa :] for entry in wanted)
        dst = concat(entry.dst[entry.swa :] for entry in wanted)
        transfer = Transfer(Kind.BACKUP, pool.pool_id, wanted, locked[0])
        core.inflight.add(transfer)
        self.busy += 1
        movers = pool.movers

        def copy() -> None:
            for mover in movers:
                mover.backup(src, dst, only_swa=True)

        def done(error: BaseException | None) -> None:
            self.busy -= 1
            core.inflight.remove(transfer)
            for node in locked:
                tree.unlock(node, pool.pool_id)
            pool.free_orphans(transfer)
            if error is not None:
                logger.error("SWA top-up from pool %s failed: %s", pool.pool_id, error)
                return
            core.moved["d2h"] = core.moved.get("d2h", 0) + len(dst) * (self.page_bytes - self.kept_bytes)
            for entry in transfer.entries:  # (cut along with their nodes by splits meanwhile)
                node = entry.node
                if not tree.is_live(node) or node.host_pages is None:
                    continue
                if swa_first(node, HOST_SLOT) > entry.swa:
                    tree.set_swa(node, HOST_SLOT, entry.swa)
                    self.topped_up += 1
                self.split.append(node)  # (its disk records next)

        pool.copy.run(copy, done)

    def _rewrite(self, rewrites: list[tuple[Node, int]]) -> None:
        """Write each ``(node, first)``'s pages ``first ..`` whole again (their records
        lacked SWA): a write per node, the nodes pinned until the last is done (the
        deepest only, as in :meth:`_copy`). Each write is a disk write in flight of its
        node (cut along with it by a split; no other write of it starts meanwhile), and
        what it wrote for a node that left the disk tier meanwhile (the store dropped
        its records) is deleted, never orphaned."""
        core, tree, storage = self.core, self.core.tree, self.storage
        pinned = tree.deepest(node for node, _ in rewrites)
        for node in pinned:
            tree.pin(node)
        left = [len(rewrites)]
        fingerprint = core.spec.fingerprint
        for node, first in rewrites:
            count = node.num_pages - first
            keys = node.page_keys[first * PAGE_KEY_BYTES :]
            before = node.page_keys[(first - 1) * PAGE_KEY_BYTES : first * PAGE_KEY_BYTES] if first else \
                node.parent.last_page_key
            page_tokens = len(node.tokens) // node.num_pages
            host = node.host_pages.astype(np.int64)
            batch = PageBatch(keys, node.namespace * count, before + keys[:-PAGE_KEY_BYTES],
                              node.tokens[first * page_tokens :], core.host_pool.pages_array(), host[first:])
            transfer = Transfer(Kind.DISK_WRITE, None, [Entry(node, host, host, first)], node)
            core.inflight.add(transfer)
            self.busy += 1

            def done(result, error: BaseException | None, transfer=transfer, count=count) -> None:
                self.busy -= 1
                core.inflight.remove(transfer)
                left[0] -= 1
                if not left[0]:
                    for held in pinned:
                        tree.unpin(held)
                if error is not None:
                    logger.error("SWA record rewrite failed: %s", error)
                else:
                    core.moved["host_to_disk"] = core.moved.get("host_to_disk", 0) + count * self.page_bytes
                    unknown = []  # (records of pages first .. of each part)
                    for entry in transfer.entries:
                        node = entry.node
                        if not tree.is_live(node):
                            continue
                        if not node.on_disk:
                            unknown.extend(node.page_key_list()[entry.swa :])
                        elif swa_first(node, DISK_SLOT) > entry.swa:
                            tree.set_swa(node, DISK_SLOT, entry.swa)
                    if unknown:
                        logger.warning("%d pages rewritten whose records left the disk tier meanwhile: deleted",
                                       len(unknown))
                        storage.delete(unknown)
                if result is not None and result.evicted:
                    self.on_store_evicted(result.evicted)

            core.workers.write(lambda batch=batch: storage.put_batch(batch, fingerprint=fingerprint), done)

    # -- inserts of whole pages -------------------------------------------------------

    def take_whole(self, pool, node: Node, ids: np.ndarray, private: np.ndarray) -> np.ndarray:
        """An insert of ``ids`` into ``pool`` ended at ``node`` (``private``: per page,
        the engine computed it). Where the pool's copy of a node of its path lacks SWA
        bytes (loaded from a window-cut host copy) and the engine computed that node's
        pages itself, the engine's whole pages become the pool's copy: the engine goes on
        reading the insert's window through the pages the insert hands back, and a copy
        without them would end no hit there. Returns the engine's pages taken so. The
        old copy is freed now or, while a lock in the pool covers it (a request reading
        it, a transfer), held as the pool's staging until none does (:meth:`release`)."""
        tree = self.core.tree
        taken = []
        offset = 0
        for n in tree.path(node):
            mine, computed = ids[offset : offset + n.num_pages], private[offset : offset + n.num_pages]
            offset += n.num_pages
            if not swa_first(n, pool.pool_id) or not computed.all():
                continue
            old = tree.replace_device(n, pool.pool_id, mine)
            taken.append(mine)
            if n.lock_ref.get(pool.pool_id):
                pool.staging += len(old)
                self.superseded.append((pool, n, old))
            else:
                pool.allocator.free(old)
        return concat(taken)

    def release(self) -> None:
        """Free the copies :meth:`take_whole` replaced that no lock in their pool covers
        any more (owner thread, between requests): a lock taken below the node after the
        swap holds them too, until it goes. O(copies held)."""
        tree = self.core.tree
        held = []
        for pool, node, old in self.superseded:
            if tree.is_live(node) and node.lock_ref.get(pool.pool_id):
                held.append((pool, node, old))
                continue
            pool.staging -= len(old)
            pool.allocator.free(old)
        self.superseded = held

    # -- sizes and checks -------------------------------------------------------------

    def first_backed_up(self, node: Node, source_first: int) -> int:
        """The first of ``node``'s pages whose SWA bytes a copy from a source holding
        them from ``source_first`` on keeps: its last ``W`` pages at most."""
        return max(source_first, node.num_pages - self.pages)

    def nbytes(self, num_pages: int, num_without_swa: int) -> int:
        """Bytes of ``num_pages`` host pages, ``num_without_swa`` of them without SWA."""
        return num_pages * self.page_bytes - num_without_swa * (self.page_bytes - self.kept_bytes)

    def usable(self, node: Node, pool_id: int) -> bool:
        """Has the window before ``node``'s end its SWA bytes, each page where a load for
        ``pool_id`` would take it from?"""
        need = self.pages
        n = node
        while need > 0 and n.parent is not None:
            take = min(need, n.num_pages)
            residency = n.residency
            slot = pool_id if pool_id in residency else HOST_SLOT if HOST_SLOT in residency else DISK_SLOT
            if swa_first(n, slot) > n.num_pages - take:
                return False
            need -= take
            n = n.parent
        return True

    def check(self, tree: HiRadixTree) -> None:
        """The invariant of the module docstring, and ``Node.swa`` only for slots the
        node is resident in, within its pages."""
        for node in tree.nodes():
            for slot, first in (node.swa or {}).items():
                assert slot in node.residency, (node, slot)
                assert 0 < first <= node.num_pages, (node, slot, first)
            for slot in (HOST_SLOT, DISK_SLOT):
                if slot in node.residency:
                    assert swa_first(node, slot) >= node.num_pages - self.pages, (
                        f"{node!r} holds SWA bytes of a page outside every window in slot {slot}")
