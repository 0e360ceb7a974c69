"""Transfers in flight, and the registry that finds them by node.

A :class:`Transfer` moves the pages of one or more nodes of one path between two tiers
(:class:`Kind`); it holds an internal tree lock or pin on its deepest node (``hold``)
so nothing it reads or writes is evicted under it. :class:`InFlight` indexes the
transfers by node id, follows node splits (a transfer's per-node entries are cut with
the node), and answers the questions the manager asks of them: is this node already
being backed up, which loads are still landing in this path, how many pages of a pool
are landing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from hicache.counters import Ticket
from hicache.tree import HiRadixTree, Node, PoolId

logger = logging.getLogger(__name__)


class Kind(Enum):
    BACKUP = "d2h"  # device -> host (the value: the metrics' direction label)
    LOAD = "h2d"  # host -> device
    DISK_READ = "disk_to_host"
    DISK_WRITE = "host_to_disk"
    REMOTE_READ = "remote_to_host"
    REMOTE_WRITE = "host_to_remote"


_REMOTE = (Kind.REMOTE_READ, Kind.REMOTE_WRITE)


@dataclass(eq=False)
class Entry:
    node: Node
    src: np.ndarray  # per page of the node: source page id (or host page)
    dst: np.ndarray  # per page of the node: destination page id
    # A spec with SWA layers: the first page whose SWA bytes move (the ones before move
    # without them; hicache.tiers.windows).
    swa: int = 0

    def parts(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """``(src, dst)`` of the pages without SWA bytes, then of those with."""
        k = self.swa
        return (self.src[:k], self.dst[:k]), (self.src[k:], self.dst[k:])


@dataclass(eq=False)
class Transfer:
    kind: Kind
    pool: PoolId | None
    entries: list[Entry]
    hold: Node  # the node whose internal lock / pin protects the transfer
    ticket: Ticket | None = None
    waiters: list[Callable[[], None]] = field(default_factory=list)
    then_drop: set[int] = field(default_factory=set)  # node ids to drop from the source tier after
    timing: dict[str, float] = field(default_factory=dict)
    from_disk: int = 0  # a load: how many of its pages were read from disk for it
    quota: "tuple[str, int] | None" = None  # (group, pages) staged against a space quota (hicache.tiers.quotas)
    nbytes: int | None = None  # bytes it moves, when not whole host pages (SWA parts left out)
    # Device pages it copies that left the tree while it ran (a failed load above them:
    # InFlight.hold_back): not free until it ends, since its copy still uses them.
    orphans: list[np.ndarray] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum(len(e.dst) for e in self.entries)

    def take_orphans(self) -> np.ndarray:
        """The :attr:`orphans`, handed over once (the transfer is over)."""
        orphans, self.orphans = concat(self.orphans), []
        return orphans

    def split(self, upper: Node, lower: Node) -> None:
        for i, entry in enumerate(self.entries):
            if entry.node is lower:
                k = upper.num_pages
                self.entries[i : i + 1] = [
                    Entry(upper, entry.src[:k], entry.dst[:k], min(entry.swa, k)),
                    Entry(lower, entry.src[k:], entry.dst[k:], max(0, entry.swa - k)),
                ]
                if lower.node_id in self.then_drop:
                    self.then_drop.add(upper.node_id)
                return

    def finished(self) -> None:
        """Run the callbacks waiting for this transfer (whatever its outcome). One that
        raises (a bug) is logged, and the others still run: each is another load."""
        for waiter in self.waiters:
            try:
                waiter()
            except Exception:  # noqa: BLE001
                logger.exception("a callback of a %s transfer failed", self.kind.name)


def concat(parts: Iterable[np.ndarray]) -> np.ndarray:
    parts = list(parts)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class InFlight:
    """Transfers by node id (see the module docstring). Owner thread only."""

    def __init__(self) -> None:
        self._by_node: dict[int, list[Transfer]] = {}
        self._detached: list[Transfer] = []  # transfers of no node yet (an engine's store)

    def __bool__(self) -> bool:
        return bool(self._by_node) or bool(self._detached)

    def local(self) -> bool:
        """Is a transfer between this node's own tiers in flight (the remote tier's
        calls aside)? O(transfers)."""
        return any(t.kind not in _REMOTE for t in (*self._distinct(), *self._detached))

    def add_detached(self, transfer: Transfer) -> None:
        """A transfer whose pages belong to no node while it runs (they join the tree
        when it lands); it keeps its pool from being reaped, like any other."""
        transfer.timing.setdefault("submitted", time.perf_counter())
        self._detached.append(transfer)

    def remove_detached(self, transfer: Transfer) -> None:
        self._detached.remove(transfer)

    def add(self, transfer: Transfer) -> None:
        transfer.timing.setdefault("submitted", time.perf_counter())
        for entry in transfer.entries:
            self._by_node.setdefault(entry.node.node_id, []).append(transfer)

    def remove(self, transfer: Transfer) -> None:
        for entry in transfer.entries:
            transfers = self._by_node.get(entry.node.node_id)
            if transfers and transfer in transfers:
                transfers.remove(transfer)
                if not transfers:
                    del self._by_node[entry.node.node_id]

    def on_split(self, upper: Node, lower: Node) -> None:
        """The tree cut ``lower``: its first pages are now ``upper``."""
        transfers = self._by_node.get(lower.node_id)
        if not transfers:
            return
        for transfer in transfers:
            transfer.split(upper, lower)
        self._by_node[upper.node_id] = list(transfers)

    def on(self, node: Node, kind: Kind) -> list[Transfer]:
        """The transfers of ``kind`` that move ``node``'s pages."""
        return [t for t in self._by_node.get(node.node_id, ()) if t.kind == kind]

    def busy(self, node: Node, kind: Kind) -> bool:
        return any(t.kind == kind for t in self._by_node.get(node.node_id, ()))

    def tickets_on(self, node: Node | None, pool: PoolId) -> tuple[Ticket, ...]:
        """Tickets of loads still landing in ``node``'s path in the pool, root first."""
        if node is None or not self._by_node:
            return ()
        tickets = []
        while node is not None and node.parent is not None:
            for transfer in self._by_node.get(node.node_id, ()):
                if transfer.kind == Kind.LOAD and transfer.pool == pool and transfer.ticket not in tickets:
                    tickets.append(transfer.ticket)
            node = node.parent
        return tuple(reversed(tickets))

    def _distinct(self) -> Iterator[Transfer]:
        seen: set[int] = set()
        for transfers in self._by_node.values():
            for transfer in transfers:
                if id(transfer) not in seen:
                    seen.add(id(transfer))
                    yield transfer

    def landing(self, pool: PoolId) -> int:
        """Device pages of the pool, cached in the tree, that loads in flight are still
        writing (orphans are not cached: the pool counts them as staging)."""
        if not self._by_node:
            return 0
        return sum(t.num_pages - sum(len(o) for o in t.orphans)
                   for t in self._distinct() if t.kind == Kind.LOAD and t.pool == pool)

    def hold_back(self, pool: PoolId, pages: np.ndarray) -> np.ndarray:
        """Of device ``pages`` of ``pool`` that just left the tree, the ones a load in
        flight still copies into, or a backup still copies from, become that
        transfer's :attr:`~Transfer.orphans` (freed when it ends: another request must
        not get a page a copy still writes or reads); returns the others, free now."""
        if not len(pages) or not self._by_node:
            return pages
        for transfer in self._distinct():
            if transfer.pool != pool or transfer.kind not in (Kind.LOAD, Kind.BACKUP):
                continue
            used = concat(e.dst if transfer.kind == Kind.LOAD else e.src for e in transfer.entries)
            mine = np.isin(pages, used)
            if mine.any():
                transfer.orphans.append(pages[mine])
                pages = pages[~mine]
        return pages

    def pools(self) -> set[PoolId | None]:
        """The pools some transfer in flight uses."""
        return {t.pool for t in self._distinct()} | {t.pool for t in self._detached}

    def check(self, tree: HiRadixTree) -> None:
        """Every node id indexed is a live node that one of its transfers moves."""
        for node_id, transfers in self._by_node.items():
            node = tree.node(node_id)
            for transfer in transfers:
                assert any(e.node is node for e in transfer.entries), (node, transfer.kind)
