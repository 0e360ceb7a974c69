"""Load orchestration: the host / disk part of a matched path into a device pool.

:meth:`Loads.load` reserves device pages for the part of the path below the pool's
device part that lives on host or disk (shortening it until the pages fit), reads the
disk-only nodes to host first, then copies host -> device layer by layer through the
pool's copy engine, stamping the load's ticket on the layer counters as each layer
lands. Its future completes as soon as the pages are reserved and the copies started —
or, with disk pages, once they are in host memory, so that a failed read shortens the
hit instead of handing out pages that will never be written.

A load whose device pages are not free *now* but on their way — evictions wait for
backups still copying, or for host room that disk writes still hold — or whose disk pages
have no host room to be read into yet, is *parked* rather than shortened: it keeps its path locked and is tried again as transfers finish (each
time the pool's room changed), up to :data:`LOAD_WAIT_S`; only then, or when nothing is
in flight that could free a page, does it take what fits. A match promised the pages
from its count of what eviction can free; the writer falling behind the traffic delays
the load instead of cutting it short (backpressure on the engine, not recomputed pages).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from hicache.errors import DeadlinePassed, UnknownNode
from hicache.pages import PAGE_ID_DTYPE, PageIds
from hicache.tiers.core import Core
from hicache.tiers.devices import DevicePoolState, DevicePools
from hicache.tiers.disk import DiskTier
from hicache.tiers.results import LoadResult, LoadTiming
from hicache.tiers.transfers import Entry, Kind, Transfer, concat
from hicache.tree import HOST_SLOT, Node, Tier

logger = logging.getLogger(__name__)

LOAD_WAIT_S = 2.0  # how long a load may wait for device pages on their way before it takes what fits


@dataclass(eq=False)
class _Pending:
    pool: DevicePoolState
    segment: list[Node]  # nodes to bring to the device (the last one is locked)
    pages: np.ndarray  # reserved device pages for the segment
    future: Future
    wanted: int  # pages of the requested node's path: what the match reported
    reads_left: int = 0


@dataclass(eq=False)
class _Parked:
    node: Node  # locked in the pool while it waits
    pool: DevicePoolState
    future: Future
    deadline: float
    pages: int  # device pages it waits for


def copy_layers(num_layers: int, pool: DevicePoolState, transfer: Transfer,
                done: Callable[[Transfer, BaseException | None], None],
                expired: Callable[[], bool] | None = None) -> None:
    """Run a load's host -> pool copies layer by layer through the pool's copy engine,
    stamping the transfer's ticket on the layer counters as each layer lands, and the
    rest failed if a copy raises — as soon as no copy of it runs any more (the copy
    engine's ``load_failed``; else :func:`end_load`); ``done(transfer, error)`` on the
    owner thread at the end. ``transfer.timing`` gets the first and last layers' instants.
    ``expired()``: the engine no longer waits for the layers (and may reuse the blocks
    once the load is over): no layer starts copying after that — the load ends there
    with :class:`~hicache.errors.DeadlinePassed`, its other layers failed."""
    src = concat(e.src for e in transfer.entries)
    dst = concat(e.dst for e in transfer.entries)
    counters, movers, engine, ticket = pool.counters, pool.movers, pool.copy, transfer.ticket
    timing = transfer.timing
    timing["start"] = time.perf_counter()
    last_layer = num_layers - 1

    def on_layer(layer: int) -> None:
        engine.layer_done(counters, ticket, layer)
        if engine.timed:
            if layer == 0:
                timing["first"] = time.perf_counter()
            if layer == last_layer:
                timing["last"] = time.perf_counter()

    def proceed() -> None:
        if expired():
            raise DeadlinePassed(f"load {ticket}: its engine stopped waiting for the layers before they were all "
                                 "copied; the rest were not")

    gate = proceed if expired is not None else None

    def enqueue() -> None:
        try:
            if len(movers) == 1:
                movers[0].load(src, dst, on_layer=on_layer, proceed=gate)
            else:
                for layer in range(num_layers):
                    if gate is not None:
                        gate()
                    for mover in movers:
                        if mover.has_layer(layer):
                            mover.load_layer(src, dst, layer)
                    on_layer(layer)
        except BaseException:
            engine.load_failed(counters, ticket)
            raise

    engine.run(enqueue, lambda error: done(transfer, error))


def end_load(core: Core, pool: DevicePoolState, transfer: Transfer, error: BaseException | None,
             on_error: Callable[[], None] | None = None) -> None:
    """A load's copies are over (owner thread): its layers stamped complete, or, failed,
    every layer not landed stamped failed — only now, when no copy of it runs any more:
    an engine takes a failed ticket for a load that is over (it may reuse the blocks);
    its hold released, its ticket's slot given back; ``on_error()`` undoes what the
    failed load had claimed, before the hold goes."""
    core.inflight.remove(transfer)
    if error is None:
        pool.copy.load_done(pool.counters, transfer.ticket, core.spec.num_layers)
        core.report(transfer)
        ps = core.spec.page_size  # delivered: these hits count now (see hicache.metrics)
        core.metrics.matched(0, (transfer.num_pages - transfer.from_disk) * ps, transfer.from_disk * ps)
    else:
        if isinstance(error, DeadlinePassed):  # (its engine recomputes the blocks: nothing is wrong here)
            logger.warning("load into pool %s cut short: %s", transfer.pool, error)
        else:
            logger.error("load into pool %s failed: %s", transfer.pool, error)
        pool.counters.fail(transfer.ticket)
        core.metrics.missed("load_failed", transfer.num_pages * core.spec.page_size)
        if on_error is not None:
            on_error()
    core.tree.unlock(transfer.hold, transfer.pool)
    pool.counters.finish(transfer.ticket)
    pool.free_orphans(transfer)


class Loads:
    def __init__(self, core: Core, pools: DevicePools, disk: DiskTier,
                 alloc_device: Callable[[DevicePoolState, int], PageIds | None]) -> None:
        self.core = core
        self.pools = pools
        self.disk = disk
        self._alloc_device = alloc_device
        self.on_timing: Callable[[LoadTiming], None] | None = None  # told of each timed load (benchmarks)
        self.parked: list[_Parked] = []  # loads waiting for device pages on their way, oldest first
        self._room_tried: tuple | None = None  # the pools' room at the last retry of the parked loads

    def load(self, node: Node, pool: DevicePoolState) -> Future:
        """A future of :class:`LoadResult` (see the module docstring)."""
        tree = self.core.tree
        if not tree.is_live(node):
            raise UnknownNode(f"{node!r} is not a live node")
        future: Future = Future()
        self._try(node, pool, future, time.monotonic() + LOAD_WAIT_S)
        return future

    def _try(self, node: Node, pool: DevicePoolState, future: Future, deadline: float) -> None:
        """Start the load, park it (see the module docstring), or answer it at once."""
        tree = self.core.tree
        path = tree.path(node)
        device_len = 0
        while device_len < len(path) and path[device_len].device_pages(pool.pool_id) is not None:
            device_len += 1
        segment = []
        for n in path[device_len:]:
            if n.host_pages is None and not (n.on_disk and self.disk.enabled):
                break
            segment.append(n)
        # Disk-only pages are read into host pages first: free ones, or clean ones that
        # eviction can drop (the segment's own excepted: its load locks them).
        staged = sum(n.num_pages for n in segment if n.host_pages is None)
        if staged and self._may_wait(deadline):
            own = sum(n.num_pages for n in segment if n.host_pages is not None)
            if staged > self.core.host_alloc.num_free + max(0, tree.clean_host_pages() - own):
                self._park(node, pool, future, deadline, segment)
                return
        pages = None
        while segment:
            pages = self._alloc_device(pool, sum(n.num_pages for n in segment))
            if pages is not None:
                break
            if self._may_wait(deadline):  # room may be on its way (the eviction may have started it)
                self._park(node, pool, future, deadline, segment)
                return
            segment.pop()
        wanted = sum(n.num_pages for n in path)
        if not segment:
            future.set_result(self._device_only(pool, path[:device_len], node, wanted))
            return
        tree.lock(segment[-1], pool.pool_id)
        pool.staging += len(pages)
        pending = _Pending(pool, segment, pages, future, wanted)
        from_disk = [n for n in segment if n.host_pages is None]
        reads = self.disk.read(from_disk) if from_disk else []
        if not reads:
            self._start(pending)
            return
        pending.reads_left = len(reads)
        pool.reading[pending] = lambda: self._cancel(pending)
        for transfer in reads:
            transfer.waiters.append(lambda: self._read_done(pending))

    def _may_wait(self, deadline: float) -> bool:
        return bool(self.core.inflight) and time.monotonic() < deadline

    def _park(self, node: Node, pool: DevicePoolState, future: Future, deadline: float,
              segment: list[Node]) -> None:
        self.core.tree.lock(node, pool.pool_id)
        self.parked.append(_Parked(node, pool, future, deadline, sum(n.num_pages for n in segment)))

    def retry_parked(self) -> int:
        """Try the parked loads again, oldest first, if a pool's room changed since the
        last try (or one's time is up); returns how many left the queue."""
        if not self.parked:
            return 0
        tree = self.core.tree
        room = self._room()
        if room == self._room_tried and time.monotonic() < self.parked[0].deadline and self.core.inflight:
            return 0
        parked, self.parked = self.parked, []
        for item in parked:
            tree.unlock(item.node, item.pool.pool_id)
            try:
                self._try(item.node, item.pool, item.future, item.deadline)
            except BaseException as exc:  # (a bug: fail the load, not the loop)
                item.future.set_exception(exc)
        self._room_tried = self._room()
        return len(parked) - len(self.parked)

    def _room(self) -> tuple:
        """What decides whether a parked load fits: its pool's free and evictable pages,
        and the host tier's (a backup landing lets a device page go without a copy)."""
        core = self.core
        tree = core.tree
        return (tuple((p.pool.allocator.num_free, tree.sizes(Tier.DEVICE, p.pool.pool_id).evictable)
                      for p in self.parked),
                core.host_alloc.num_free, tree.sizes(Tier.HOST), tree.clean_host_pages())

    def parked_pages(self) -> int:
        return sum(item.pages for item in self.parked)

    def cancel_parked(self, pool: DevicePoolState) -> None:
        """The pool's engine is gone: its parked loads end with the device part only."""
        keep = []
        for item in self.parked:
            if item.pool is not pool:
                keep.append(item)
                continue
            self.core.tree.unlock(item.node, pool.pool_id)
            item.future.set_result(self._device_only(pool, [], self.core.tree.root(item.node.namespace), 0))
        self.parked = keep

    def _read_done(self, pending: _Pending) -> None:
        pending.reads_left -= 1
        if pending.reads_left == 0 and pending.pool.reading.pop(pending, None) is not None:
            self._start(pending)  # (else the pool retired meanwhile: _cancel ended it)

    def _cancel(self, pending: _Pending) -> None:
        """The pool retired while the load waited for its reads: its hold and device
        pages go, and it ends with nothing loaded (its engine is gone)."""
        pool = pending.pool
        hold = pending.segment[-1]
        self.core.tree.unlock(hold, pool.pool_id)
        pool.staging -= len(pending.pages)
        pool.allocator.free(pending.pages)
        pending.future.set_result(self._device_only(pool, [], hold, 0))

    def _start(self, pending: _Pending) -> None:
        core = self.core
        tree = core.tree
        pool = pending.pool
        hold = pending.segment[-1]
        # Look at the path again: reads may have split nodes (a corrupt page keeps the
        # pages before it) or failed, and another load may have brought some nodes to
        # the device meanwhile. Load what is on host right below the device part; the
        # rest shortens the hit.
        path = tree.path(hold)
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
            if to_load:  # (every counter slot holds a load in flight)
                pool.allocator.free(pending.pages[:used])
                core.metrics.missed("no_counter_slot", used * core.spec.page_size)
            tree.unlock(hold, pool.pool_id)
            pending.future.set_result(self._device_only(pool, path[:first], hold, pending.wanted))
            return
        entries = []
        offset = 0
        for n in to_load:
            dst = pending.pages[offset : offset + n.num_pages]
            offset += n.num_pages
            tree.add_device(n, pool.pool_id, dst)
            if n.swa and HOST_SLOT in n.swa:  # (the copy holds the SWA bytes the host copy does)
                tree.set_swa(n, pool.pool_id, n.swa[HOST_SLOT])
            entries.append(Entry(n, n.host_pages.astype(np.int64), dst.astype(np.int64)))
        # The lock taken at load() covers the whole segment; the transfer keeps it.
        transfer = Transfer(Kind.LOAD, pool.pool_id, entries, hold, ticket=ticket,
                            from_disk=core.disk_pages_of(to_load))
        core.inflight.add(transfer)
        self._copy(pool, transfer)
        pending.future.set_result(self._result(pool, path[:keep], used, path[keep - 1], pending.wanted))

    def _copy(self, pool: DevicePoolState, transfer: Transfer) -> None:
        copy_layers(self.core.spec.num_layers, pool, transfer, self._done)

    def _done(self, transfer: Transfer, error: BaseException | None) -> None:
        core = self.core
        tree = core.tree
        pool = self.pools[transfer.pool]

        def undo() -> None:  # the pages that will never be written leave the tree
            first = transfer.entries[0].node
            if tree.is_live(first) and first.device_pages(transfer.pool) is not None:
                # (and what hangs below them: loads and backups of it may still be
                # copying, so their pages go free only as those end)
                gone = tree.discard(first, Tier.DEVICE, transfer.pool)
                free = core.inflight.hold_back(transfer.pool, gone)
                pool.staging += len(gone) - len(free)  # (see DevicePoolState.free_orphans)
                pool.allocator.free(free)

        end_load(core, pool, transfer, error, undo)
        timing = transfer.timing
        if error is None and "last" in timing:
            core.metrics.first_layer(timing["first"] - timing["start"])
            if self.on_timing is not None:
                self.on_timing(LoadTiming(transfer.num_pages, transfer.num_pages * core.spec.host_page_bytes,
                                          timing["start"], timing["first"], timing["last"]))

    def _device_only(self, pool: DevicePoolState, device: list[Node], node: Node, wanted: int) -> LoadResult:
        """A load that brought nothing: the device part of ``node``'s path."""
        last = device[-1] if device else self.core.tree.root(node.namespace)
        return self._result(pool, device, 0, last, wanted)

    def _result(self, pool: DevicePoolState, nodes: list[Node], loaded: int, last: Node, wanted: int) -> LoadResult:
        """The answer; what falls short of ``wanted`` pages is counted
        (``hicache_load_short_tokens_total``)."""
        windows = self.core.windows
        if windows is not None and nodes and not windows.usable(nodes[-1], pool.pool_id):
            # A load cut short (device room, a failed read) may end where no hit may: a
            # node end whose window has no SWA bytes here (a branch found from host). The
            # engine would read that window: hand out the pages up to an end that has it.
            nodes = list(nodes)
            while nodes and not windows.usable(nodes[-1], pool.pool_id):
                loaded = max(0, loaded - nodes.pop().num_pages)
            last = nodes[-1] if nodes else self.core.tree.root(last.namespace)
        parts = [n.device_pages(pool.pool_id) for n in nodes]
        pages = np.concatenate(parts) if parts else np.empty(0, dtype=PAGE_ID_DTYPE)
        if len(pages) < wanted:
            self.core.metrics.load_short((wanted - len(pages)) * self.core.spec.page_size)
        return LoadResult(last, pages, loaded, self.core.inflight.tickets_on(last, pool.pool_id))
