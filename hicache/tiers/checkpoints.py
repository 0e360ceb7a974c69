"""Recurrent-state checkpoints: what makes a prefix usable for a model with state layers.

A model with linear-attention / Mamba layers (a spec with :class:`~hicache.spec.StateLayer`
layers) can reuse a cached prefix only together with the recurrent state after exactly
that prefix. An engine *offers* a checkpoint at a page boundary it chooses (``insert``
with ``checkpoints``: the end of a prefill chunk, every N pages, the end of a turn): the
state in one of its device state slots is copied into a host state slot and kept on the
tree node that ends at that boundary (the tree is split there). Then:

* a match on a state spec ends at the deepest matched node with a usable checkpoint
  (:meth:`Checkpoints.usable`; the tier manager cuts matches with it): a node without one
  is never a hit end;
* a load with a state slot copies the checkpoint there before any layer's pages
  (:meth:`Checkpoints.restore`), reading it from disk first if it has no host copy (a
  read whose call fails as a whole is a miss that keeps the disk copy, and so is one
  the store could not read — until that has happened ``UNREADABLE_READS`` times in a
  row: then it is dropped and deleted, like a record found missing or bad);
* with a disk tier, every checkpoint is written through to disk (one record, keyed by
  :func:`checkpoint_key` of its boundary's page key, its metadata's parent that page key
  and its tokens empty), so a restarted daemon gets it back
  (:meth:`Checkpoints.attach_restored`);
* host state slots are a pool of their own (``host_checkpoints``): when they run out,
  the least recently used checkpoint's host copy goes (one on disk first; one that is
  nowhere else is lost, and counted — as is one whose disk record, its last copy, the
  store evicts or cannot read);
* a checkpoint never outlives its node: the tree calls :meth:`Checkpoints.forget` as it
  removes a node, which frees the host slot and deletes the disk record.

* on the device, a pool whose engine lends state slots for it (its layout's
  ``checkpoint_slots``, after the slots of its request rows) keeps copies there too: an
  offer copies the state into one as well (evicting the least recently used unpinned
  device copy when none is free), and a restore into that pool is then a copy between
  two slots of the pool. A device copy is a cache of the host / disk one: it may be the
  last copy only after the host slot went and there is no disk tier.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.errors import InvalidArgument, RecordsUnreadable
from hicache.keys import PAGE_KEY_BYTES
from hicache.pages import PageAllocator
from hicache.storage.base import PageMeta, PageRecord
from hicache.tiers.core import Core
from hicache.tiers.disk_reads import UNREADABLE_READS
from hicache.tiers.devices import DevicePoolState
from hicache.tiers.transfers import Kind, Transfer
from hicache.tree import Node

logger = logging.getLogger(__name__)


def checkpoint_key(page_key: bytes) -> bytes:
    """The disk record key of the checkpoint after the page with key ``page_key``."""
    return hashlib.blake2b(bytes(page_key), digest_size=PAGE_KEY_BYTES, person=b"hicache.ckpt").digest()


@dataclass(slots=True, eq=False)
class Checkpoint:
    """The state after ``node``'s last page. ``host``: its host state slot (-1: none);
    ``ready``: its bytes have landed; ``pins``: copies reading its host slot now;
    ``dead``: its node is gone (the slot is freed when the last pin goes);
    ``failed_reads``: reads of its disk record the store could not do, in a row."""

    node: Node
    key: bytes
    host: int = -1
    on_disk: bool = False
    ready: bool = False
    writing: bool = False
    pins: int = 0
    dead: bool = False
    device: dict[int, int] = field(default_factory=dict)  # pool id -> that pool's checkpoint slot
    failed_reads: int = 0


class Checkpoints:
    """See the module docstring. Owner thread only."""

    def __init__(self, core: Core, num_slots: int, storage=None, on_store_evicted=None, pools=None) -> None:
        if num_slots <= 0:
            raise InvalidArgument(f"a spec with state layers needs host checkpoint slots, got {num_slots}")
        self.core = core
        self.core_pools = pools  # the device pools (their checkpoint slots)
        self.storage = storage
        self.num_slots = num_slots
        self.alloc = PageAllocator.for_host(num_slots)
        self.on_host: dict[int, Checkpoint] = {}  # host slot -> checkpoint
        self.by_key: dict[bytes, Checkpoint] = {}  # disk record key -> checkpoint on disk
        self.on_device: dict[tuple[int, int], Checkpoint] = {}  # (pool id, slot) -> checkpoint
        self.on_store_evicted = on_store_evicted or (lambda keys: None)
        # checkpoints gone while their node stays: their last copy's slot taken, or their
        # disk record gone (the store evicted it, or it reads as missing) with no other copy
        self.lost = 0
        self.offered = 0
        self.restored = 0
        self.refused = 0  # offers that found no host slot (every one being read)
        self.busy = 0  # copies, reads and writes in flight
        core.tree.on_remove = self.forget

    # -- state ---------------------------------------------------------------------

    @staticmethod
    def usable(node: Node, pool_id: int | None = None) -> bool:
        """Can ``node``'s checkpoint be restored (into ``pool_id``, or any pool)?"""
        cp = node.checkpoint
        return (cp is not None and cp.ready
                and (cp.host >= 0 or cp.on_disk or (pool_id in cp.device if pool_id is not None else bool(cp.device))))

    def count(self) -> tuple[int, int, int]:
        """(checkpoints with a host copy, on disk, device copies)."""
        return len(self.on_host), len(self.by_key), len(self.on_device)

    def _view(self, slot: int) -> np.ndarray:
        size = self.core.host_pool.state_slot_bytes
        return self.core.host_pool.states[slot * size : (slot + 1) * size].numpy()

    # -- offer (device -> host) ------------------------------------------------------

    def offer(self, pool: DevicePoolState, offers: list[tuple[Node, int]]) -> Future:
        """Copy each ``(node, device state slot)`` into a host slot and keep it on its
        node; a future of how many were taken, done once the engine may reuse its
        slots. Nodes that have a checkpoint already take none."""
        future: Future = Future()
        tree = self.core.tree
        taken: list[Checkpoint] = []
        src: list[int] = []
        host_victims, device_victims = self._host_victims(), self._device_victims(pool.pool_id)
        for node, slot in offers:
            if node.checkpoint is not None or not tree.is_live(node):
                continue
            host = self._alloc_slot(host_victims)
            if host is None:
                self.refused += len(offers) - len(taken)
                break
            cp = Checkpoint(node, checkpoint_key(node.last_page_key), host=host)
            node.checkpoint = cp
            self.on_host[host] = cp
            device = self._alloc_device(pool, device_victims)
            if device is not None:
                self._add_device(cp, pool.pool_id, device)
            taken.append(cp)
            src.append(slot)
        if not taken:
            future.set_result(0)
            return future
        pinned = _pin_paths(tree, [cp.node for cp in taken])
        dst = np.array([cp.host for cp in taken], dtype=np.int64)
        src_ids = np.array(src, dtype=np.int64)
        on_device = [(s, cp.device[pool.pool_id]) for s, cp in zip(src, taken) if pool.pool_id in cp.device]
        device_src = np.array([s for s, _ in on_device], dtype=np.int64)
        device_dst = np.array([d for _, d in on_device], dtype=np.int64)
        movers = pool.movers

        def copy() -> None:
            for mover in movers:
                mover.backup_states(src_ids, dst)
                if len(device_dst):
                    mover.copy_states(device_src, device_dst)

        def done(error: BaseException | None) -> None:
            for node in pinned:
                tree.unpin(node)
            if error is not None:
                logger.error("checkpoint copy from pool %s failed: %s", pool.pool_id, error)
                for cp in taken:
                    self._drop(cp)
                future.set_result(0)
                return
            for cp in taken:
                cp.ready = True
                self._write(cp)
            self.offered += len(taken)
            future.set_result(len(taken))

        self._run(pool, taken[0].node, copy, done)
        return future

    def _run(self, pool: DevicePoolState, node: Node, copy, done) -> None:
        """``copy`` (of ``node``'s checkpoint) on the pool's copy engine, then
        ``done(error)``; the pool is not reaped meanwhile (a detached transfer of it is
        in flight)."""
        inflight = self.core.inflight
        transfer = Transfer(Kind.BACKUP, pool.pool_id, [], node)
        inflight.add_detached(transfer)
        self.busy += 1

        def finished(error: BaseException | None) -> None:
            self.busy -= 1
            inflight.remove_detached(transfer)
            done(error)

        pool.copy.run(copy, finished)

    # -- restore (host / disk -> device) ----------------------------------------------

    def restore(self, node: Node, pool: DevicePoolState, slot: int) -> Future:
        """Copy ``node``'s checkpoint into the engine's device state ``slot``; a future
        of whether it landed (``False``: no usable checkpoint, a failed read or copy —
        the engine computes the prefix itself)."""
        future: Future = Future()
        cp = node.checkpoint
        if not self.usable(node, pool.pool_id):
            future.set_result(False)
            return future
        cp.pins += 1
        if pool.pool_id in cp.device or cp.host >= 0:
            self._to_device(cp, pool, slot, future)
            return future
        host = self._alloc_slot()
        if host is None:
            self._unpin(cp)
            future.set_result(False)
            return future
        storage, key, view = self.storage, cp.key, self._view(host)
        fingerprint = self.core.spec.fingerprint

        def read() -> bool:
            return storage.get([key], [view], fingerprint=fingerprint)[0]

        def done(found, error: BaseException | None) -> None:
            self.busy -= 1
            if isinstance(error, RecordsUnreadable):
                cp.failed_reads += 1
            elif error is None:  # (a read that failed as a whole says nothing of the record)
                cp.failed_reads = 0
            if error is None and found and cp.host < 0 and not cp.dead:
                cp.host = host
                self.on_host[host] = cp
                self._to_device(cp, pool, slot, future)
                return
            self.alloc.free(np.array([host], dtype=np.int32))
            if cp.failed_reads >= UNREADABLE_READS and cp.on_disk and not cp.dead:
                # The store could not read its bytes at any of these tries (a bad
                # sector): a record no read gets, which every match would end at.
                logger.error("checkpoint record %s failed %d reads in a row: dropped and deleted", key.hex(),
                             cp.failed_reads)
                self._lose_disk(cp)
                storage.delete([key])
            elif error is not None:
                # The call failed as a whole (an I/O error, LMDB out of reader slots, the
                # store unavailable): nothing is known of the record, which stays.
                logger.error("checkpoint record %s not read (kept on disk): %s", key.hex(), error)
            elif not found:
                # Missing, corrupt (the store deletes it), or an intact record of
                # another size, read as missing at every try.
                logger.warning("checkpoint record %s unreadable: dropped", key.hex())
                self._lose_disk(cp)
            if cp.host >= 0 and not cp.dead:  # (another read brought it meanwhile)
                self._to_device(cp, pool, slot, future)
                return
            self._unpin(cp)
            future.set_result(False)

        self.busy += 1
        self.core.workers.io(read, done)
        return future

    def _to_device(self, cp: Checkpoint, pool: DevicePoolState, slot: int, future: Future) -> None:
        """The pool's own copy of ``cp`` (slot to slot), or the host one, into ``slot``."""
        dst = np.array([slot], dtype=np.int64)
        movers = pool.movers
        own = cp.device.get(pool.pool_id)
        if own is not None:
            src = np.array([own], dtype=np.int64)

            def copy() -> None:
                for mover in movers:
                    mover.copy_states(src, dst)
        else:
            src = np.array([cp.host], dtype=np.int64)

            def copy() -> None:
                for mover in movers:
                    mover.load_states(src, dst)

        def done(error: BaseException | None) -> None:
            self._unpin(cp)
            if error is not None:
                logger.error("checkpoint copy into pool %s failed: %s", pool.pool_id, error)
                future.set_result(False)
                return
            self.restored += 1
            future.set_result(True)

        self._run(pool, cp.node, copy, done)

    # -- disk ----------------------------------------------------------------------

    def _write(self, cp: Checkpoint) -> None:
        """Write ``cp`` through to disk (its host copy stays pinned until committed)."""
        storage = self.storage
        if storage is None or cp.on_disk or cp.writing or cp.host < 0:
            return
        cp.writing = True
        cp.pins += 1
        node = cp.node
        record = PageRecord(cp.key, self._view(cp.host), PageMeta(node.namespace, node.last_page_key, b""))
        fingerprint = self.core.spec.fingerprint

        def submit():
            return storage.put([record], fingerprint=fingerprint)

        def done(result, error: BaseException | None) -> None:
            self.busy -= 1
            cp.writing = False
            if error is not None:
                logger.error("checkpoint write failed: %s", error)
            elif cp.dead:
                storage.delete([cp.key])
            else:
                cp.on_disk = True
                self.by_key[cp.key] = cp
            self._unpin(cp)
            if result is not None and result.evicted:
                self.on_store_evicted(result.evicted)

        self.busy += 1
        self.core.workers.write(submit, done)

    def forget_keys(self, keys) -> None:
        """The store dropped these records (its capacity, or a bad read)."""
        if not self.by_key:
            return
        for key in keys:
            cp = self.by_key.get(bytes(key))
            if cp is not None:
                self._lose_disk(cp)

    def _lose_disk(self, cp: Checkpoint) -> None:
        """``cp``'s disk record is gone: so is ``cp`` if that was its last copy (lost)."""
        if self.by_key.get(cp.key) is cp:
            del self.by_key[cp.key]
        cp.on_disk = False
        if cp.host < 0 and not cp.device and not cp.dead:
            self.lost += 1
            self._drop(cp)

    def attach_restored(self, records: list[tuple[bytes, bytes, int]]) -> int:
        """After a rebuild: put the checkpoint records ``(key, boundary page key,
        payload size)`` back on their nodes (splitting a node to end at its boundary);
        records whose boundary is in no node, or that are not a state slot's size (the
        store would refuse every read of them: attached, such a record made its node a
        hit end whose state never comes), are deleted. Returns how many were attached."""
        tree = self.core.tree
        if not records:
            return 0
        nodes = tree.disk_nodes(parent for _, parent, _ in records)
        slot_bytes = self.core.host_pool.state_slot_bytes
        stale = []
        attached = 0
        for key, parent, size in records:
            node, last = _holder(nodes.get(parent), parent)
            if node is None or key != checkpoint_key(parent) or size != slot_bytes:
                stale.append(key)
                continue
            if last + 1 < node.num_pages:  # (the node above a split keeps the first pages)
                node = tree.split(node, last + 1)
            if node.checkpoint is not None:
                stale.append(key)
                continue
            cp = Checkpoint(node, key, on_disk=True, ready=True)
            node.checkpoint = cp
            self.by_key[key] = cp
            attached += 1
        if stale and self.storage is not None:
            logger.warning("deleting %d checkpoint records that no cached page ends or of another size than a "
                           "state slot", len(stale))
            self.storage.delete(stale)
        return attached

    # -- host slots ----------------------------------------------------------------

    def _alloc_slot(self, victims: _Victims | None = None) -> int | None:
        """A free host slot; the least recently used checkpoint no copy reads makes room
        (one on disk or on a device first: see :meth:`_host_victims`). None: every one
        is being read. ``victims``: one offer's, kept across its slots."""
        slots = self.alloc.alloc(1)
        if slots is not None:
            return int(slots[0])
        cp = (victims if victims is not None else self._host_victims()).pop()
        if cp is None:
            return None
        # The victim's slot passes straight on (freeing it and allocating again, with
        # no other slot free, gives the same slot, at two allocator calls a victim).
        slot = cp.host
        del self.on_host[slot]
        cp.host = -1
        if not (cp.on_disk or cp.device):
            self.lost += 1
            self._drop(cp)
        return slot

    def _host_victims(self) -> _Victims:
        """The checkpoints whose host slot may go, in the order they go: least recently
        used first, one that is elsewhere too (disk, a device) before one that is not;
        none being read or not yet ready."""
        return _Victims(lambda: self.on_host.values(),
                        lambda cp: (not (cp.on_disk or cp.device), cp.node.last_access),
                        lambda cp: cp.host >= 0 and not cp.pins and cp.ready)

    def _device_victims(self, pool_id: int) -> _Victims:
        """The checkpoints whose device copy in ``pool_id`` may go: least recently used
        first, none being read or not yet ready."""
        return _Victims(lambda: self.on_device.values(),
                        lambda cp: cp.node.last_access,
                        lambda cp: pool_id in cp.device and not cp.pins and cp.ready)

    def _alloc_device(self, pool: DevicePoolState, victims: _Victims | None = None) -> int | None:
        """A free checkpoint slot of the pool (the least recently used unpinned device
        copy there makes room); None: it lends none, or all are being read.
        ``victims``: one offer's, kept across its slots."""
        slots = pool.checkpoint_slots
        if slots is None:
            return None
        got = slots.alloc(1)
        if got is not None:
            return int(got[0])
        best = (victims if victims is not None else self._device_victims(pool.pool_id)).pop()
        if best is None:
            return None
        slot = best.device.pop(pool.pool_id)  # (its slot passes straight on, as on host)
        del self.on_device[(pool.pool_id, slot)]
        if not (best.host >= 0 or best.on_disk or best.device):
            self.lost += 1
            self._drop(best)
        return slot

    def _add_device(self, cp: Checkpoint, pool_id: int, slot: int) -> None:
        cp.device[pool_id] = slot
        self.on_device[(pool_id, slot)] = cp

    def _free_device(self, cp: Checkpoint, pool_id: int) -> None:
        slot = cp.device.pop(pool_id)
        del self.on_device[(pool_id, slot)]
        try:
            pool = self.core_pools[pool_id] if self.core_pools is not None else None
        except KeyError:  # (reaped: its slots went with it)
            pool = None
        if pool is not None and pool.checkpoint_slots is not None:
            pool.checkpoint_slots.free(np.array([slot], dtype=np.int32))

    def discard_pool(self, pool_id: int) -> None:
        """The pool's engine is gone: its device copies with it (the rest stays)."""
        for (owner, _), cp in list(self.on_device.items()):
            if owner == pool_id:
                self._free_device(cp, pool_id)
                if not (cp.host >= 0 or cp.on_disk or cp.device) and not cp.dead:
                    self.lost += 1
                    self._drop(cp)

    def _free_host(self, cp: Checkpoint) -> None:
        if cp.host >= 0:
            del self.on_host[cp.host]
            self.alloc.free(np.array([cp.host], dtype=np.int32))
            cp.host = -1

    def _unpin(self, cp: Checkpoint) -> None:
        cp.pins -= 1
        if cp.dead and not cp.pins:
            self._free_host(cp)
            for pool_id in list(cp.device):
                self._free_device(cp, pool_id)

    def _drop(self, cp: Checkpoint) -> None:
        """``cp`` goes from every tier and from its node."""
        if cp.node.checkpoint is cp:
            cp.node.checkpoint = None
        cp.dead = True
        if not cp.pins:
            self._free_host(cp)
            for pool_id in list(cp.device):
                self._free_device(cp, pool_id)
        if cp.on_disk:
            if self.by_key.get(cp.key) is cp:
                del self.by_key[cp.key]
            cp.on_disk = False
            if self.storage is not None:
                self.storage.delete([cp.key])

    def forget(self, node: Node) -> None:
        """``node`` leaves the tree: its checkpoint goes with it (the tree's hook)."""
        cp = node.checkpoint
        if cp is not None:
            self._drop(cp)

    # -- checks --------------------------------------------------------------------

    def check(self) -> None:
        """Invariants, for tests: every checkpoint's node is live and holds it; host
        slots are allocated exactly for the checkpoints holding them; disk keys name
        their boundary."""
        tree = self.core.tree
        holders = [n for n in tree.nodes() if n.checkpoint is not None]
        for node in holders:
            cp = node.checkpoint
            assert cp.node is node and not cp.dead, (node, cp)
            assert cp.key == checkpoint_key(node.last_page_key), node
            assert cp.host >= 0 or cp.on_disk or cp.device or not cp.ready, f"checkpoint of {node!r} lives nowhere"
        live_host = {cp.host for cp in self.on_host.values()}
        assert len(live_host) == len(self.on_host)
        for slot, cp in self.on_host.items():
            assert cp.host == slot
            assert cp.dead or (tree.is_live(cp.node) and cp.node.checkpoint is cp), cp
        assert self.alloc.num_allocated == len(self.on_host), (self.alloc.num_allocated, len(self.on_host))
        for key, cp in self.by_key.items():
            assert cp.key == key and cp.on_disk and not cp.dead and cp.node.checkpoint is cp, cp
        per_pool: dict[int, int] = {}
        for (pool_id, slot), cp in self.on_device.items():
            assert cp.device.get(pool_id) == slot, cp
            assert cp.dead or (tree.is_live(cp.node) and cp.node.checkpoint is cp), cp
            per_pool[pool_id] = per_pool.get(pool_id, 0) + 1
        for node in holders:
            for pool_id, slot in node.checkpoint.device.items():
                assert self.on_device.get((pool_id, slot)) is node.checkpoint
        if self.core_pools is not None:
            for pool in self.core_pools:
                if pool.checkpoint_slots is not None:
                    assert pool.checkpoint_slots.num_allocated == per_pool.get(pool.pool_id, 0), pool.pool_id


class _Victims:
    """Checkpoints in the order a run of evictions takes them: least ``rank`` first among
    those ``eligible``, ties to the earliest in ``entries()`` (as one scan per victim
    picked them). A heap built at the first :meth:`pop` — O(n) — then O(log n) a pop,
    so an offer that evicts for k checkpoints costs O(n + k log n), not k scans of n.

    It lives for one offer (or one eviction), while nothing makes a checkpoint
    eligible or lowers its rank: only evictions happen meanwhile, and they make
    checkpoints ineligible (their slot gone) or raise a rank (a host copy whose
    device copy went is then the last copy). A popped entry is checked against the
    checkpoint's current state: dropped if no longer eligible, pushed back if its rank
    grew."""

    __slots__ = ("_entries", "_rank", "_eligible", "_heap")

    def __init__(self, entries: Callable[[], Iterable[Checkpoint]], rank: Callable[[Checkpoint], Any],
                 eligible: Callable[[Checkpoint], bool]) -> None:
        self._entries, self._rank, self._eligible = entries, rank, eligible
        self._heap: list | None = None

    def pop(self) -> Checkpoint | None:
        rank, eligible = self._rank, self._eligible
        heap = self._heap
        if heap is None:
            heap = self._heap = [(rank(cp), order, cp) for order, cp in enumerate(self._entries()) if eligible(cp)]
            heapq.heapify(heap)
        while heap:
            was, order, cp = heap[0]
            if not eligible(cp):
                heapq.heappop(heap)
                continue
            now = rank(cp)
            if now != was:
                assert was < now, (was, now)  # (see the class docstring)
                heapq.heapreplace(heap, (now, order, cp))
                continue
            heapq.heappop(heap)
            return cp
        return None


def _pin_paths(tree, nodes: list[Node]) -> list[Node]:
    """Pin ``nodes`` while a copy reads their checkpoints, returning the nodes pinned:
    a pin holds its node's whole path, so only the deepest (an offer's holders all lie
    on its insert's path: one) — linear, where a pin per holder was quadratic."""
    pinned = tree.deepest(nodes)
    for node in pinned:
        tree.pin(node)
    return pinned


def _holder(node: Node | None, page_key: bytes) -> tuple[Node | None, int]:
    """The node holding ``page_key`` and the page's index in it: ``node`` or, after
    splits cut it, one of the nodes above it."""
    while node is not None and node.parent is not None:
        index = node.page_keys.find(page_key)
        while index > 0 and index % PAGE_KEY_BYTES:
            index = node.page_keys.find(page_key, index + 1)
        if index >= 0:
            return node, index // PAGE_KEY_BYTES
        node = node.parent
    return None, -1
