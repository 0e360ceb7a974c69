"""Engine-owned pools: ``store`` (engine blocks -> host) and ``load_into`` (host / disk
-> blocks the engine chose).

An engine-owned pool (:mod:`hicache.foreign`) has no device residency in the tree: its
engine keeps its own device prefix cache, and hicache is the tier below it.

* :meth:`OwnedTransfers.store` copies the blocks of the pages the tree does not hold on
  host yet into new host pages (on a copy thread), and when they have landed adds them
  to the tree as host copies (then on to disk per the disk policy). The future
  completes then: from that moment the engine may reuse its blocks. Pages already on
  host are not copied; the pages before the first copied one stay pinned meanwhile, so
  the new ones always extend a host-resident path. A store may say when its engine
  stops waiting (``expired``): from then on the engine may reuse the blocks, so a store
  expired on arrival is refused, and one whose copy is done only after that caches
  nothing — the copy may have read blocks the engine had handed to another request.
  (The check runs on the owner thread after the copy landed: never early.)
* :meth:`OwnedTransfers.load_into` copies pages ``first ..`` of a locked node's path
  into the engine's blocks, layer by layer, with a ticket on the pool's layer counters
  (as a :meth:`~hicache.tiers.loads.Loads.load`). Disk-only pages are read to host
  first — those of the path before ``first`` too, which a page on host needs above it —
  and the future completes once they are there (or failed), with the number of
  pages that will land: a short or failed read shortens the load, and nothing that will
  not be written is reported as loaded. Like a store, a load_into may say when its
  engine stops waiting (``expired``): from then on the engine takes the blocks as loaded
  with nothing and may reuse them, so one expired on arrival is refused, and one whose
  reads end after that copies nothing (it would write over another request's KV). And it
  may say until when its engine waits for the layers (``copy_expired``): no layer starts
  copying after that (the engine reports the blocks as failed, and once the load is over
  may reuse them), the layers not copied are failed on the ticket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from hicache.counters import Ticket
from hicache.errors import DeadlinePassed, InvalidArgument, UnknownNode
from hicache.keys import TOKEN_BYTES, NamespaceId
from hicache.pages import PageIds
from hicache.tiers.core import Core
from hicache.tiers.devices import DevicePools, DevicePoolState
from hicache.tiers.disk import DiskTier
from hicache.tiers.loads import copy_layers, end_load
from hicache.tiers.policies import DiskPolicy
from hicache.tiers.transfers import Entry, Kind, Transfer
from hicache.tree import HOST_SLOT, Node, Tier, swa_first

logger = logging.getLogger(__name__)


class Stored(NamedTuple):
    """``node``: the deepest node of the stored prefix (``None``: nothing cached);
    ``num_copied``: pages copied from the engine's blocks; ``num_cached``: leading pages
    of the tokens now on host (the rest did not fit)."""

    node: Node | None
    num_copied: int
    num_cached: int


class LoadedInto(NamedTuple):
    """``num_loaded``: pages that land in the first blocks given, layer by layer (wait
    on ``wait``); the blocks after them get nothing."""

    num_loaded: int
    wait: tuple[Ticket, ...]


class OwnedTransfers:
    def __init__(self, core: Core, pools: DevicePools, disk: DiskTier, disk_policy: DiskPolicy) -> None:
        self.core = core
        self.pools = pools
        self.disk = disk
        self.disk_policy = disk_policy

    # -- store ---------------------------------------------------------------------

    def store(self, pool: DevicePoolState, namespace: NamespaceId, tokens: bytes, blocks: PageIds,
              expired: Callable[[], bool] | None = None) -> Future:
        """A future of :class:`Stored` (see the module docstring). ``tokens`` are
        packed and hold exactly ``len(blocks)`` whole pages; ``blocks`` are checked."""
        if expired is not None and expired():
            raise DeadlinePassed("store: its deadline passed before it arrived; nothing copied")
        core = self.core
        tree = core.tree
        future: Future = Future()
        tree.add_namespace(namespace, core.spec.page_size)
        match = tree.match(namespace, tokens, pool.pool_id)  # (a store is a use: touch)
        skip = match.num_host_pages  # the pool has no device part: this is the host prefix
        count = len(blocks) - skip
        prefix = match.last_host_node if skip else None
        if prefix is not None:
            tree.pin(prefix)  # before room is made below: the stored pages hang from it
        if count > 0 and not core.room_for(namespace, Tier.HOST, count):
            count = 0  # its tenant's host quota: not cached
        host_pages = core.alloc_host(count) if count > 0 else None
        while count > 0 and host_pages is None:  # what does not fit stays uncached
            count //= 2
            host_pages = core.alloc_host(count) if count else None
        if not count:
            if prefix is not None:
                tree.unpin(prefix)
            future.set_result(Stored(prefix, 0, skip))
            return future
        core.host_staging += count
        transfer = Transfer(Kind.BACKUP, pool.pool_id, [], prefix or tree.root(namespace))
        core.inflight.add_detached(transfer)
        core.stage(transfer, namespace, Tier.HOST, count)
        src = blocks[skip : skip + count].astype(np.int64)
        dst = host_pages.astype(np.int64)
        mover = pool.movers[0]
        end_tokens = tokens[: (skip + count) * core.spec.page_size * TOKEN_BYTES]

        def done(error: BaseException | None) -> None:
            core.inflight.remove_detached(transfer)
            core.host_staging -= count
            core.unstage(transfer, Tier.HOST)
            if prefix is not None:
                tree.unpin(prefix)
            if error is None and expired is not None and expired():
                core.host_alloc.free(host_pages)
                future.set_exception(DeadlinePassed(f"store: the copy of {count} pages ended after its deadline; "
                                                    "nothing cached"))
                return
            if error is not None:
                logger.error("store from pool %s failed: %s", pool.pool_id, error)
                core.failed(transfer, count)
                core.host_alloc.free(host_pages)
                future.set_result(Stored(prefix, 0, skip))
                return
            core.report(transfer, count)
            node, duplicates = tree.add_host_path(namespace, end_tokens, skip, host_pages)
            if len(duplicates):
                core.host_alloc.free(duplicates)
            if core.windows is not None:  # (whole blocks came: their SWA bytes outside the window count as gone)
                for n in _from_page(tree.path(node), skip):
                    tree.set_swa(n, HOST_SLOT, max(swa_first(n, HOST_SLOT),
                                                   core.windows.first_backed_up(n, 0)))
            if self.disk_policy.write_on_host:
                self.disk.write(node)
            if count > len(duplicates):
                core.remote.write(_from_page(tree.path(node), skip))
            future.set_result(Stored(node, count - len(duplicates), skip + count))

        pool.copy.run(lambda: mover.backup(src, dst), done)
        return future

    # -- load_into -----------------------------------------------------------------

    def load_into(self, pool: DevicePoolState, node: Node, blocks: PageIds, first: int,
                  expired: Callable[[], bool] | None = None,
                  copy_expired: Callable[[], bool] | None = None) -> Future:
        """A future of :class:`LoadedInto` (see the module docstring): pages ``first
        ..`` of ``node``'s path (locked by the caller) into ``blocks``."""
        if (expired is not None and expired()) or (copy_expired is not None and copy_expired()):
            raise DeadlinePassed("load_into: its deadline passed before it arrived; nothing copied")
        tree = self.core.tree
        if not tree.is_live(node):
            raise UnknownNode(f"{node!r} is not a live node")
        path = tree.path(node)
        total = sum(n.num_pages for n in path)
        if not 0 <= first <= total or first + len(blocks) > total:
            raise InvalidArgument(f"pages {first} .. {first + len(blocks) - 1} are not all in the node's path "
                                  f"of {total} pages")
        future: Future = Future()
        if not len(blocks):  # (the engine holds every page itself: no node is cut at ``first`` for none)
            future.set_result(LoadedInto(0, ()))
            return future
        segment = self._segment(node, first, len(blocks))
        loadable = []
        for n in segment:
            if n.host_pages is None and not (n.on_disk and self.disk.enabled):
                break
            loadable.append(n)
        if not loadable:
            self._short(len(blocks), 0)
            future.set_result(LoadedInto(0, ()))
            return future
        hold = loadable[-1]
        tree.lock(hold, pool.pool_id)
        # The pages before ``first`` too: the tree keeps a page on host only below a
        # parent on host, so a read of pages ``first ..`` alone lands nowhere.
        from_disk = [n for n in tree.path(hold) if n.host_pages is None]
        reads = self.disk.read(from_disk) if from_disk else []
        if not reads:
            self._start(pool, hold, first, blocks, future, copy_expired)
            return future
        left = [len(reads)]

        def read_done() -> None:
            left[0] -= 1
            if left[0] or pool.reading.pop(future, None) is None:
                return  # (reads left, or the pool retired: cancel ended it)
            if expired is not None and expired():  # the engine took it for nothing loaded
                self._short(len(blocks), 0)
                cancel()
                return
            self._start(pool, hold, first, blocks, future, copy_expired)

        def cancel() -> None:  # the pool retired first, or the engine stopped waiting: nothing loads
            tree.unlock(hold, pool.pool_id)
            future.set_result(LoadedInto(0, ()))

        pool.reading[future] = cancel
        for transfer in reads:
            transfer.waiters.append(read_done)
        return future

    def _segment(self, node: Node, first: int, count: int) -> list[Node]:
        """The nodes of ``node``'s path covering pages ``first .. first + count - 1``,
        split so that they cover exactly those pages."""
        tree = self.core.tree
        out = []
        start = 0
        for n in tree.path(node):
            end = start + n.num_pages
            if end > first and start < first + count:
                if start < first:  # the upper part (before ``first``) is split off
                    tree.split(n, first - start)
                    start = first
                if end > first + count:
                    n = tree.split(n, first + count - start)
                    end = first + count
                out.append(n)
            start = end
        return out

    def _short(self, wanted: int, loaded: int) -> None:
        if loaded < wanted:
            self.core.metrics.load_short((wanted - loaded) * self.core.spec.page_size)

    def _start(self, pool: DevicePoolState, hold: Node, first: int, blocks: PageIds, future: Future,
               copy_expired: Callable[[], bool] | None) -> None:
        """The reads are done: load what is on host from ``first`` on, in order."""
        core = self.core
        tree = core.tree
        entries = []
        start = 0
        used = 0
        for n in tree.path(hold):
            end = start + n.num_pages
            if start >= first:
                if n.host_pages is None:
                    break
                entries.append(Entry(n, n.host_pages.astype(np.int64),
                                     blocks[used : used + n.num_pages].astype(np.int64)))
                used += n.num_pages
            start = end
        windows = core.windows
        # Cut short (a lost record), the load may end where no hit may: a node end whose
        # window has no SWA bytes (a branch found from host). The engine takes the
        # blocks it is told were loaded as a hit: load up to an end that has them.
        while windows is not None and entries and not windows.usable(entries[-1].node, pool.pool_id):
            used -= len(entries.pop().dst)
        ticket = pool.counters.begin() if entries else None
        if ticket is None:  # nothing on host, or no free counter slot: nothing loads
            if entries:
                core.metrics.missed("no_counter_slot", used * core.spec.page_size)
            tree.unlock(hold, pool.pool_id)
            self._short(len(blocks), 0)
            future.set_result(LoadedInto(0, ()))
            return
        transfer = Transfer(Kind.LOAD, pool.pool_id, entries, hold, ticket=ticket,
                            from_disk=core.disk_pages_of([e.node for e in entries]))
        core.inflight.add(transfer)
        copy_layers(core.spec.num_layers, pool, transfer, self._done, copy_expired)
        self._short(len(blocks), used)
        future.set_result(LoadedInto(used, (ticket,)))

    def _done(self, transfer: Transfer, error: BaseException | None) -> None:
        end_load(self.core, self.pools[transfer.pool], transfer, error)


def _from_page(path: list[Node], first: int) -> list[Node]:
    """The nodes of ``path`` (root first) from page ``first`` on (a node boundary)."""
    pos = 0
    for i, node in enumerate(path):
        if pos >= first:
            return path[i:]
        pos += node.num_pages
    return []
