"""The disk tier behind the tier manager: a port with two implementations.

* :class:`NoDisk` — the null object for "no disk tier" (no store, or ``disk_policy =
  "none"``): nothing is written, nothing is read, the tier is always empty;
* :class:`LocalDisk` — a :class:`~hicache.storage.base.StorageBackend` (LMDB): writes
  (:mod:`hicache.tiers.disk_writes`), reads (:mod:`hicache.tiers.disk_reads`), the warm
  restart (:mod:`hicache.tiers.rebuild`), and the tier's own capacity — the tree's disk
  LRU is evicted (and those records deleted) to keep it under the store's capacity.

Next: a chain of storage tiers (a remote tier below the local disk) behind the same port.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from hicache.errors import HicacheError
from hicache.storage.base import StorageBackend
from hicache.tiers.core import Core
from hicache.tiers.disk_reads import DiskReader
from hicache.tiers.disk_writes import DiskWriter
from hicache.tiers.rebuild import REBUILD_PROGRESS_EVERY, rebuild_steps
from hicache.tiers.transfers import Transfer
from hicache.tree import Node, Tier

logger = logging.getLogger(__name__)

# The remote tier's write-backs hold the records of at most 1/this of the disk tier's
# capacity: a store that is slow or hangs never takes the disk from new writes.
WRITE_BACK_SHARE = 2


class DiskTier(Protocol):
    enabled: bool
    storage: StorageBackend | None
    capacity_pages: int
    on_store_evicted: Callable[[Sequence[bytes]], None]

    @property
    def pending(self) -> int:
        """Pages being written (not yet committed)."""

    def write(self, node: Node, *, then_drop_host: bool = False) -> bool: ...

    @property
    def over_quota(self) -> bool:
        """Did the last :meth:`write` not start because its tenant has no disk room
        (a space quota)?"""

    @property
    def too_large(self) -> bool:
        """Did the last :meth:`write` not start because its path has more pages than
        the whole tier holds (it never will)?"""

    @property
    def write_limit(self) -> int:
        """Pages the writer's queue holds at most (0: no writer)."""

    def deferred_writes(self) -> int:
        """Pages of the writes deferred by the queue's bound."""

    def is_deferred(self, node: Node) -> bool:
        """Is a write of ``node`` deferred by the queue's bound?"""

    def retry_writes(self) -> int:
        """Start the deferred writes the queue has room for; returns how many started."""

    @property
    def committed(self) -> int:
        """Pages that reached the disk tier, ever."""

    def read(self, nodes: list[Node]) -> list[Transfer]: ...

    def prefetch(self, node: Node) -> None: ...

    def evict(self, num_pages: int, namespaces: set | None = None) -> int: ...

    def purge(self, namespaces: set) -> list[bytes]: ...

    def forget_keys(self, keys: Iterable[bytes]) -> None: ...

    def persist(self) -> int: ...

    def flush(self, timeout_s: float | None = None) -> None: ...

    def rebuild_steps(self, every: int = REBUILD_PROGRESS_EVERY,
                      checkpoints: list | None = None) -> Iterator[int]: ...


class NoDisk:
    enabled = False
    storage = None
    capacity_pages = 0
    pending = 0
    over_quota = False
    too_large = False

    def __init__(self) -> None:
        self.on_store_evicted: Callable[[Sequence[bytes]], None] = self.forget_keys

    def write(self, node: Node, *, then_drop_host: bool = False) -> bool:
        return False

    write_limit = 0
    committed = 0

    def deferred_writes(self) -> int:
        return 0

    def is_deferred(self, node: Node) -> bool:
        return False

    def retry_writes(self) -> int:
        return 0

    def read(self, nodes: list[Node]) -> list[Transfer]:
        return []

    def prefetch(self, node: Node) -> None:
        pass

    def evict(self, num_pages: int, namespaces: set | None = None) -> int:
        return 0

    def purge(self, namespaces: set) -> list[bytes]:
        return []

    def forget_keys(self, keys: Iterable[bytes]) -> None:
        pass

    def persist(self) -> int:
        return 0

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def rebuild_steps(self, every: int = REBUILD_PROGRESS_EVERY, checkpoints: list | None = None) -> Iterator[int]:
        yield from ()
        return 0


class LocalDisk:
    enabled = True

    def __init__(self, core: Core, storage: StorageBackend, write_backlog: int, *,
                 clean_host_floor: int | None = None) -> None:
        """``write_backlog``: pages queued to the writer at most (see
        :mod:`hicache.tiers.disk_writes`). ``clean_host_floor``: unless ``None``, the
        records of pages that are on host too are evicted before any other while more
        than this many host pages are clean (exclusive capacity: the disk's room goes to
        pages cached nowhere else; such a host copy is written again if it is evicted,
        and the floor keeps host pages that can go without a write for reads from disk
        to land in)."""
        self.core = core
        self.clean_host_floor = clean_host_floor
        self.storage = storage
        capacity_bytes = storage.stats().capacity_bytes
        self.capacity_pages = capacity_bytes // core.spec.host_page_bytes
        if not self.capacity_pages:
            logger.warning("[disk].capacity_bytes (%d) is smaller than one page of spec %s (%d bytes): none of its "
                           "pages will be written to disk", capacity_bytes, core.spec.fingerprint_hex,
                           core.spec.host_page_bytes)
        self._writer = DiskWriter(core, storage, self, write_backlog)
        self._reader = DiskReader(core, storage, self)
        # Told the keys the store evicted to make room for this tree's writes. A store
        # shared by several managers (one per KV spec) needs them all told: the owner
        # replaces this with a function that calls every manager's forget_disk_keys.
        self.on_store_evicted: Callable[[Sequence[bytes]], None] = self.forget_keys

    @property
    def pending(self) -> int:
        return self._writer.pending

    def write(self, node: Node, *, then_drop_host: bool = False) -> bool:
        return self._writer.write(node, then_drop_host=then_drop_host)

    @property
    def over_quota(self) -> bool:
        return self._writer.over_quota

    @property
    def too_large(self) -> bool:
        return self._writer.too_large

    @property
    def write_limit(self) -> int:
        return self._writer.limit

    def deferred_writes(self) -> int:
        return self._writer.deferred_pages()

    def is_deferred(self, node: Node) -> bool:
        return node.node_id in self._writer.deferred

    def retry_writes(self) -> int:
        return self._writer.retry() if self._writer.deferred else 0

    @property
    def committed(self) -> int:
        return self._writer.committed

    def read(self, nodes: list[Node]) -> list[Transfer]:
        return self._reader.read(nodes)

    def prefetch(self, node: Node) -> None:
        """Start reading the disk-only part of ``node``'s path into host memory."""
        wanted = [n for n in self.core.tree.path(node) if n.host_pages is None and n.on_disk]
        if wanted:
            self._reader.read(wanted)

    def room(self, num_pages: int) -> bool:
        """Keep the tree's disk tier within capacity: evict its LRU to make room. The
        records the remote tier's write-backs hold (pages evicted on their way to its
        store) count as used until they are put — else the store, full, would evict
        them on its own and they would reach neither tier. The tree's LRU is evicted for
        the room they take too: the pages a write-back takes in turn free nothing until
        put, and a write that fits once they are is deferred (:meth:`room_coming`), but
        those the write-backs cannot take (they hold their share of the disk) are
        skipped and make room now — a store that hangs in a put never ends the puts, and
        would otherwise hold every disk write up for good."""
        if num_pages > self.capacity_pages:
            return False
        excess = self._used() + self.core.remote.held_pages + num_pages - self.capacity_pages
        if excess > 0:
            self.evict(excess)
        return self._used() + self.core.remote.held_pages + num_pages <= self.capacity_pages

    def room_coming(self, num_pages: int) -> bool:
        """After :meth:`room` found none: may ``num_pages`` fit once the writes in flight
        commit (their records can then be evicted to make room), or will they once the
        write-backs holding disk records end? Each end retries the writes that wait; one
        that finds no room then, with nothing left in flight, is given up."""
        return self.pending > 0 or (self.core.remote.held_pages > 0
                                    and self._used() + num_pages <= self.capacity_pages)

    def _used(self) -> int:
        """Pages of the tree's records and of those being written."""
        return self.core.tree.sizes(Tier.DISK).cached + self.pending

    def evict(self, num_pages: int, namespaces: set | None = None) -> int:
        """Evict the tree's disk LRU (of ``namespaces`` only, when given) and delete
        those records (one deletion for them all: each wakes the store's writer thread,
        which then takes the interpreter from the owner thread for a while); returns
        the pages freed."""
        doomed: list[bytes] = []
        # (namespace, parent key, page keys, on disk only) of each node: for a remote write-back
        leaving = []
        tree = self.core.tree
        floor = self.clean_host_floor
        written_back = self.core.remote.writes_back
        for where in (None,) if floor is None else (_on_host, None):
            for node in tree.iter_evictable(Tier.DISK, namespaces=namespaces, where=where):
                if len(doomed) >= num_pages or (where is not None and tree.clean_host_pages() <= floor):
                    break
                leaving.append((node.namespace, node.parent.last_page_key, node.page_keys, len(node.residency) == 1))
                self._drop(node, doomed, written_back=written_back)
            if len(doomed) >= num_pages:
                break
        if doomed and not self.core.remote.write_back(leaving, self.storage,
                                                      self.capacity_pages // WRITE_BACK_SHARE):
            self.storage.delete(doomed)
        return len(doomed)

    def purge(self, namespaces: set) -> list[bytes]:
        """Every disk page of ``namespaces`` that nothing protects leaves the tier and
        its records are deleted — none written back to the remote tier (see
        :meth:`TierManager.purge`). Returns their keys."""
        doomed: list[bytes] = []
        for node in self.core.tree.iter_evictable(Tier.DISK, namespaces=namespaces):
            self._drop(node, doomed, written_back=False)
        if doomed:
            self.storage.delete(doomed)
        return doomed

    def _drop(self, node: Node, doomed: list[bytes], *, written_back: bool) -> None:
        """``node`` leaves the disk tier; its keys go to ``doomed`` (to be deleted — by
        the remote tier's write-back once it has them, if it takes them).
        ``written_back``: the write-back takes them to the remote tier, which then holds
        what was their last copy here: evicted, not dropped from the cache (the
        write-back counts the pages it does not put dropped)."""
        self.core.misses.evicted(node, Tier.DISK, moving_on=written_back)
        keys = node.page_key_list()
        if not node.tokens and len(node.residency) > 1:  # cached elsewhere still: it may
            self._give_tokens_back(node, keys)  # have to be written again
        self.core.tree.drop(node, Tier.DISK)
        doomed.extend(keys)

    def _give_tokens_back(self, node: Node, keys: list[bytes]) -> None:
        """The tree keeps no tokens of a node on disk (see :mod:`hicache.tree`): read
        them from its records before they go. Without them the node cannot be written
        again (its host copy then just goes when evicted)."""
        try:
            tokens = self.storage.read_tokens(keys)
            if all(t is not None for t in tokens):
                self.core.tree.set_tokens(node, b"".join(tokens))
        except HicacheError as exc:
            logger.warning("cannot read the tokens of node %d back from the store: %s", node.node_id, exc)

    def forget_keys(self, keys: Iterable[bytes]) -> None:
        """The store dropped these records on its own (one store serves every spec,
        each of whose disk tiers counts only its own records: a write of one spec may
        evict another's): forget them, and what hangs below — evicted from disk, counted
        as :meth:`evict` counts its own; keys this tree does not hold are ignored."""
        tree = self.core.tree
        wanted = set(keys)
        hit = {id(node): node for node in tree.disk_nodes(wanted).values()}
        for node in hit.values():
            if tree.is_live(node) and node.on_disk:  # not gone with an ancestor already
                below = self._subtree(node)
                for n in below:
                    self.core.misses.evicted(n, Tier.DISK)
                tree.discard(node, Tier.DISK)
                self.storage.delete([k for n in below for k in n.page_key_list() if k not in wanted])

    def drop_bad_records(self, node: Node, reason: str = "corrupt_record") -> int:
        """A missing or corrupt record: forget ``node`` (and below) on disk, delete;
        their tokens are missed for ``reason``. Returns the pages forgotten. (A read that
        failed as a whole judges no record, and one the store could not read is judged
        only once its reads keep failing: :mod:`hicache.tiers.disk_reads`.)"""
        keys = self._subtree_keys(node)
        self.core.tree.discard(node, Tier.DISK)
        self.core.metrics.missed(reason, len(keys) * self.core.spec.page_size)
        if keys:
            self.storage.delete(keys)
        return len(keys)

    def _subtree_keys(self, node: Node) -> list[bytes]:
        return [key for n in self._subtree(node) for key in n.page_key_list()]

    @staticmethod
    def _subtree(node: Node) -> list[Node]:
        """``node`` and the nodes below it on disk (those the tree discards with it)."""
        out = []
        stack = [node]
        while stack:
            n = stack.pop()
            if n.on_disk:
                out.append(n)
                stack.extend(n.children.values())
        return out

    def persist(self) -> int:
        """Start writing every host page that has no disk record yet; returns the pages
        queued."""
        tree = self.core.tree
        queued = 0
        for node in list(tree.nodes()):
            if (tree.is_live(node) and node.host_pages is not None and not node.on_disk
                    and not any(c.host_pages is not None and not c.on_disk for c in node.children.values())):
                before = self.pending
                self.write(node)
                queued += self.pending - before
        return queued

    def flush(self, timeout_s: float | None = None) -> None:
        self.storage.flush(timeout_s)

    def rebuild_steps(self, every: int = REBUILD_PROGRESS_EVERY, checkpoints: list | None = None) -> Iterator[int]:
        """The rebuild, then the least recently used of what it restored evicted down to
        the tier's pages: records outside a window are shorter than a page, so a store
        whose capacity shrank across the restart may keep more of them than a write would
        have left (writes make room by pages)."""
        pages = yield from rebuild_steps(self.core.tree, self.storage, self.core.spec, every, checkpoints)
        excess = self.core.tree.sizes(Tier.DISK).cached - self.capacity_pages
        if excess > 0:
            evicted = self.evict(excess)
            logger.info("rebuild: %d disk pages over the tier's %d evicted", evicted, self.capacity_pages)
            pages -= evicted
        return pages


def _on_host(node: Node) -> bool:
    return node.host_pages is not None
