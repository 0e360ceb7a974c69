"""The remote tier below the local disk: a store shared by every node of a fleet
(Mooncake Store, :mod:`hicache.storage.mooncake_backend`).

The tree records nothing about the remote tier — it is shared, and its master leases
and evicts on its own, so what this node could record would go stale. Instead:

* **Writes** (``policy = "write_through"``): pages an engine computed on this node are
  put to the remote tier as they reach host memory (a backup, an engine's ``store``),
  from the host pages themselves, pinned until the put is done. At most ``write_backlog``
  pages are in flight; a write beyond that waits (deferred, counted, started as puts
  finish — up to :data:`MAX_DEFERRED` writes); one while the tier is down is skipped and
  counted (so are those waiting once a put fails and marks it down, and the pages of a
  waiting write that left host before it could start) — the page stays cached locally,
  or went as any evicted page, only the fleet does not get it.
  ``policy = "write_back"``: pages go to the remote tier as the local disk tier evicts
  them instead — their records read back into staging pages, put, then deleted from the
  disk (:meth:`RemoteTier.write_back`). An eviction of more pages than the staging pages
  free goes in parts: the rest wait for rows (their records stay on disk meanwhile) up
  to ``write_backlog`` pages in all, and to the share of the disk tier it leaves them
  (half); beyond that, or while the tier is down, skipped and counted the same way. A
  page written back is counted evicted from the disk tier; it is dropped from the cache
  only if it was on disk alone and is not put (skipped, or its put failed). The
  records write-backs hold count as used disk space until they are put (a write-back
  cache's dirty data: left uncounted, a disk write would overflow the store, which
  evicts its oldest records on its own — these — and they would reach neither tier): a
  disk write they are in the way of waits for their puts to end. A write-back whose
  read of its records from the local disk fails is skipped and counted alike (only the
  unreadable records where the store names them: the others are put); it says nothing
  of the remote tier, which stays up.
* **Lookups**: a match whose hit stops short of the request's whole pages asks the remote
  tier for the keys of the next pages (at most ``lookup_pages``; page keys are equal on
  every machine for the same namespace and tokens) — unless a lookup found nothing at
  that first key within ``miss_ttl_s``. The pages found from the first on
  are read into fresh host pages, checked (a record that fails reads as missing), and
  put in the tree as host-resident: a load brings them on to the device like any host
  part. The match answers per ``prefetch`` — ``best_effort`` at once (the pages are
  there for the next match), ``wait_complete`` once they landed, ``timeout`` then or
  after ``timeout_s`` — and reports how many pages the remote tier gave it.
* **Faults**: every call into the store runs on this tier's own threads (one for
  lookups and reads, one for writes); the owner thread never waits on the store. A
  failed call marks the tier down for ``retry_s`` (a log line, ``hicache_remote_up``
  0): lookups answer "miss" and writes are skipped meanwhile; the next call after that
  is the probe that brings it back. Calls queue at most ``max_queued`` deep: a slow
  store means misses, not a backlog.
* **Purges** (:meth:`RemoteTier.purge`): objects are named by namespace (see
  :mod:`hicache.storage.mooncake_backend`), so one call removes every page of the
  purged namespaces from the store — whichever node put it, held here or not. It runs
  on the write lane, behind the puts already started (their pages land, then go);
  write-backs not started yet drop those pages, and a fetch in flight keeps none.

Pages read from the remote tier join the tree only under a prefix that is on host (a
disk-only prefix is read to host first: the match's disk prefetch); a hit whose last
page is on a device only asks nothing (its pages have no host copy to hang them under).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.errors import HicacheError, InvalidArgument, RecordsUnreadable, ResidencyError, StorageUnavailable
from hicache.keys import PAGE_KEY_BYTES, ROOT_PARENT_KEY, TOKEN_BYTES, NamespaceId, chain_page_keys
from hicache.tiers.core import Core
from hicache.tiers.disk_writes import path_batch
from hicache.tiers.policies import PrefetchPolicy, prefetch_policy
from hicache.storage.base import PageBatch
from hicache.tiers.transfers import Entry, Kind, Transfer
from hicache.tree import MatchResult, Node, Tier

logger = logging.getLogger(__name__)

REMOTE_POLICIES = ("write_through", "write_back", "none")
MAX_DEFERRED = 4096  # write-through writes waiting for room in the queue, at most
MAX_ABSENT = 65536  # page keys remembered as recently absent (see RemoteTier._recently_absent)
STAGING_PAGES = 64  # write-back pages read from disk into this many staging pages at once, at most


@dataclass(frozen=True, kw_only=True)
class RemoteSettings:
    """How the tier manager uses a remote tier (``[remote]`` in the daemon's config)."""

    policy: str = "write_through"  # "write_back": pages the disk tier evicts; "none": read only
    lookup_pages: int = 256  # pages asked for after a local hit, at most
    prefetch_policy: str = "timeout"  # best_effort, wait_complete, timeout
    timeout_s: float = 0.5  # the timeout policy's wait for a match's remote pages
    retry_s: float = 2.0  # how long a failed call keeps the tier marked down
    write_backlog: int = 4096  # pages being put at most
    max_queued: int = 8  # calls queued on each of the tier's threads at most
    miss_ttl_s: float = 1.0  # a lookup that found nothing is not asked again for this long

    def __post_init__(self) -> None:
        if self.policy not in REMOTE_POLICIES:
            raise InvalidArgument(f"remote policy must be one of {', '.join(REMOTE_POLICIES)}; got {self.policy!r}")
        prefetch_policy(self.prefetch_policy, self.timeout_s)
        if self.lookup_pages < 1 or self.write_backlog < 1 or self.max_queued < 1:
            raise InvalidArgument("remote lookup_pages, write_backlog and max_queued must be >= 1")
        if self.timeout_s < 0 or self.retry_s < 0 or self.miss_ttl_s < 0:
            raise InvalidArgument("remote timeout_s, retry_s and miss_ttl_s must be >= 0")

    def prefetch(self) -> PrefetchPolicy:
        return prefetch_policy(self.prefetch_policy, self.timeout_s)


@dataclass(eq=False)
class Fetch:
    """The remote pages after one local hit, on their way to host: the request's pages
    from ``first`` on (``keys``). Requests below one hit often share their first pages
    (a system prompt), and each needs its own after them: a fetch started while another
    asks for its first ``shared`` pages (``after``) reads only the rest, and lands them
    once that one's have. ``pages``: how many of the request's pages landed in the tree,
    the shared ones included (known once ``done``)."""

    namespace: NamespaceId
    anchor: Node | None  # the deepest local node: the pages hang below it (pinned meanwhile);
    # None: the namespace is not in the tree yet (created if pages land)
    first: int  # pages of the path up to and including ``anchor``
    packed: bytes  # the request's tokens up to the last page asked for
    keys: bytes
    after: Fetch | None = None
    shared: int = 0
    done: bool = False
    purged: bool = False  # its namespace was purged meanwhile: what it reads is not kept
    pages: int = 0
    waiters: list[Callable[[], None]] = field(default_factory=list)

    @property
    def asked(self) -> bytes:
        """The keys this fetch asks the store for (those after the shared ones)."""
        return self.keys[self.shared * PAGE_KEY_BYTES :]

    @property
    def on_host(self) -> bool:
        """Is the anchor's path on host (nothing to read from disk first)?"""
        return self.anchor is None or self.anchor.is_root or self.anchor.host_pages is not None

    def finish(self, pages: int) -> None:
        self.done = True
        self.pages = pages
        for waiter in self.waiters:
            waiter()
        self.waiters.clear()


@dataclass(eq=False)
class _WriteBack:
    """Pages the disk tier evicted, on their way to the store (``policy = "write_back"``):
    their keys, and each one's namespace and parent key (concatenated, in the same
    order). ``doomed``: the records to delete once they are put — those the disk tier
    writes again meanwhile are taken out (:meth:`RemoteTier.keep_on_disk`), and put
    back if that write fails (:meth:`RemoteTier.keep_failed`). ``last``: the keys of
    pages that were on this node's disk only — dropped from the cache if not put."""

    storage: Any
    keys: list[bytes]
    namespaces: bytes
    parents: bytes
    doomed: set[bytes]
    last: set[bytes]

    def split(self, count: int) -> _WriteBack:
        """Cut off the first ``count`` pages: returned as a write-back of their own,
        this one keeps the rest. O(pages)."""
        cut = count * PAGE_KEY_BYTES
        head = self.keys[:count]
        first = _WriteBack(self.storage, head, self.namespaces[:cut], self.parents[:cut],
                           self.doomed.intersection(head), self.last.intersection(head))
        self.keys, self.namespaces, self.parents = self.keys[count:], self.namespaces[cut:], self.parents[cut:]
        self.doomed -= first.doomed
        self.last -= first.last
        return first

    def drop(self, namespaces: set[NamespaceId]) -> list[bytes]:
        """Take out the pages of ``namespaces``; returns the keys of those whose records
        it was to delete (its own: not written again meanwhile). O(pages)."""
        def slot(column: bytes, i: int) -> bytes:
            return column[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES]

        keep = [i for i in range(len(self.keys)) if slot(self.namespaces, i) not in namespaces]
        if len(keep) == len(self.keys):
            return []
        gone = set(self.keys).difference(self.keys[i] for i in keep)
        out = [k for k in self.keys if k in gone and k in self.doomed]
        self.keys = [self.keys[i] for i in keep]
        self.namespaces = b"".join(slot(self.namespaces, i) for i in keep)
        self.parents = b"".join(slot(self.parents, i) for i in keep)
        self.doomed -= gone
        self.last -= gone
        return out

    def delete_records(self) -> None:
        """Delete its records from the disk (but those written again meanwhile)."""
        self.storage.delete([k for k in self.keys if k in self.doomed])


class _DiskReadFailed(Exception):
    """A write-back's read of its records from the local disk failed (``__cause__``):
    the local store's fault, not the remote tier's."""


class _Lane:
    """One thread for store calls, with a bounded queue (owner thread submits)."""

    def __init__(self, name: str, limit: int) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._limit = limit
        self._queued = 0
        self._lock = threading.Lock()

    def submit(self, core: Core, work: Callable, done: Callable, *, bounded: bool = True) -> bool:
        """Queue ``work`` (``done(result, error)`` on the owner thread after it); False
        if the queue is full — unless ``bounded`` is off (a call that must not be shed)."""
        with self._lock:
            if bounded and self._queued >= self._limit:
                return False
            self._queued += 1

        def run():
            try:
                return work()
            finally:
                with self._lock:
                    self._queued -= 1

        core.completions.forward(self._pool.submit(run), done)
        return True

    def close(self, last: Callable[[], None] | None = None) -> None:
        """Run what is queued, then ``last`` on the lane's thread, and end the thread."""
        if last is not None:
            self._pool.submit(last)
        self._pool.shutdown(wait=True)


class NoRemote:
    enabled = False
    writes_back = False
    pending = 0
    held_pages = 0

    def write(self, nodes: list[Node]) -> None:
        pass

    def write_back(self, leaving, storage, max_held: int) -> bool:
        return False

    def keep_on_disk(self, nodes: list[Node]) -> set[bytes]:
        return set()

    def keep_failed(self, keys: set[bytes]) -> set[bytes]:
        return keys

    def fetch(self, namespace: NamespaceId, packed: bytes, result: MatchResult) -> Fetch | None:
        return None

    def drop_waiting(self, namespaces: set[NamespaceId]) -> int:
        return 0

    def purge(self, namespaces: set[NamespaceId]) -> None:
        return None

    def close(self) -> None:
        pass


class RemoteTier:
    """See the module docstring. Owner thread, except what runs on the lanes."""

    enabled = True

    def __init__(self, core: Core, store, settings: RemoteSettings) -> None:
        """``store``: a :class:`~hicache.storage.mooncake_backend.MooncakeBackend` (or
        anything with its ``contains`` / ``get`` / ``put_batch`` / ``register`` / ``unregister``
        / ``release_scratch``)."""
        self.core = core
        self.store = store
        self.settings = settings
        self.prefetch = settings.prefetch()
        self.pending = 0  # pages being put
        self.up = True
        self._down_until = 0.0
        self._reads = _Lane("hicache-remote-read", settings.max_queued)
        self._writes = _Lane("hicache-remote-write", settings.max_queued)
        # (namespace, page keys asked for) -> in flight: requests below the same local
        # prefix ask for different pages (the engine asking again for a waiting request
        # asks for the same ones)
        self._fetches: dict[tuple[bytes, bytes], Fetch] = {}
        self._token_bytes = core.spec.page_size * TOKEN_BYTES
        self._staging: np.ndarray | None = None  # write-back staging pages (see write_back)
        self._free_rows = list(range(STAGING_PAGES)) if settings.policy == "write_back" else []
        self._absent: OrderedDict[bytes, float] = OrderedDict()  # first page key -> until when it is known absent
        self._deferred: deque[tuple[int, int]] = deque()  # writes waiting for room: (deepest node id, pages)
        self._writing: list[_WriteBack] = []  # write-backs in flight
        self._waiting: deque[_WriteBack] = deque()  # write-backs waiting for staging pages, oldest first
        self._waiting_pages = 0
        # Told when write-backs let go of disk records (put, or skipped): the disk tier's
        # writes that waited for their room (the owner sets it).
        self.on_disk_freed: Callable[[], object] = lambda: None
        self.counts = dict.fromkeys(("lookup_hit", "lookup_miss", "lookup_recent_miss", "lookup_unavailable",
                                     "lookup_busy",
                                     "pages_got", "pages_missing", "pages_corrupt", "pages_put", "put_deferred",
                                     "put_skipped"), 0)
        store.register(core.host_pool.pages_array())
        core.metrics.remote_up(True)

    # -- health --------------------------------------------------------------------------

    def _usable(self) -> bool:
        return self.up or time.monotonic() >= self._down_until

    def _failed(self, op: str, error: BaseException) -> None:
        self.core.metrics.remote_error(op)
        if self.up:
            logger.warning("remote tier unreachable (%s: %s): local tiers keep serving; retrying every %.1f s",
                           op, error, self.settings.retry_s)
        self.up = False
        self._down_until = time.monotonic() + self.settings.retry_s
        self.core.metrics.remote_up(False)

    def _answered(self) -> None:
        if not self.up:
            logger.warning("remote tier reachable again")
            self.up = True
            self.core.metrics.remote_up(True)

    # -- writes --------------------------------------------------------------------------

    @property
    def writes_back(self) -> bool:
        """Does :meth:`write_back` take the pages the disk tier evicts?"""
        return self.settings.policy == "write_back"

    @property
    def held_pages(self) -> int:
        """Pages whose disk records the write-backs still hold (being put, or waiting
        for staging pages): used disk space until they are deleted."""
        return self.pending + self._waiting_pages if self.settings.policy == "write_back" else 0

    def write(self, nodes: list[Node]) -> None:
        """Put the pages of ``nodes`` (one path's, top-down, just on host) to the store."""
        if self.settings.policy != "write_through" or not nodes:
            return
        core = self.core
        tree = core.tree
        nodes = [n for n in nodes if tree.is_live(n) and n.host_pages is not None and n.tokens]
        total = sum(n.num_pages for n in nodes)
        if not total:
            return
        if not self._usable():
            self._skip_write(total)
            return
        if self.pending and self.pending + total > self.settings.write_backlog:
            self._defer(nodes, total)
            return
        hold = nodes[-1]
        parts, entries = [], []
        for n in nodes:
            host = n.host_pages.astype(np.int64)
            parts.append((n.namespace, n.parent.last_page_key, n.tokens, n.page_keys, n.num_pages, host))
            entries.append(Entry(n, host, host))
        transfer = Transfer(Kind.REMOTE_WRITE, None, entries, hold)
        store, fingerprint, host_pool = self.store, core.spec.fingerprint, core.host_pool

        def work():
            return store.put_batch(path_batch(parts, host_pool), fingerprint=fingerprint).result()

        tree.pin(hold)
        core.inflight.add(transfer)
        if not self._writes.submit(core, work, lambda result, error: self._written(transfer, result, error)):
            core.inflight.remove(transfer)
            tree.unpin(hold)
            self._skip_write(total)
            return
        self.pending += total

    def write_back(self, leaving: list[tuple[bytes, bytes, bytes, bool]], storage, max_held: int) -> bool:
        """``policy = "write_back"``: the disk tier evicts these nodes' pages —
        ``(namespace, parent key, page keys, on disk only)`` each, already out of the
        tree (counted evicted; those on disk only are dropped from the cache only if
        they are not put: :meth:`_skip_write_back`). Read their records from
        ``storage`` into staging pages and put them to the store, then delete the
        records (but those written again meanwhile: :meth:`keep_on_disk`). The pages
        the free staging pages cannot take now wait for them (as puts finish); what is
        over ``write_backlog`` or ``max_held`` (the records the disk tier lets
        write-backs hold: being put and waiting), or evicted while the tier is down, is
        skipped and its records deleted now. True if it took charge of the records
        (else the caller deletes them now). O(pages)."""
        if self.settings.policy != "write_back":
            return False
        keys = [k[i : i + PAGE_KEY_BYTES] for _, _, k, _ in leaving for i in range(0, len(k), PAGE_KEY_BYTES)]
        namespaces = b"".join(ns * (len(k) // PAGE_KEY_BYTES) for ns, _, k, _ in leaving)
        parents = b"".join(parent + k[:-PAGE_KEY_BYTES] for _, parent, k, _ in leaving)
        last = {k[i : i + PAGE_KEY_BYTES] for _, _, k, only in leaving if only
                for i in range(0, len(k), PAGE_KEY_BYTES)}
        part = _WriteBack(storage, keys, namespaces, parents, set(keys), last)
        room = min(self.settings.write_backlog, max_held) - self.held_pages if self._usable() else 0
        taken = max(0, min(room, len(keys)))
        if taken < len(keys):  # (the pages over the bound: the last ones)
            over = part
            part = over.split(taken) if taken else None
            self._skip_write_back(over)
            over.delete_records()
        if part is None:
            return True
        self._waiting.append(part)
        self._waiting_pages += taken
        self._start_write_backs()
        deferred = min(taken, self._waiting_pages)  # (the last pages waiting are this eviction's)
        if deferred:
            self.counts["put_deferred"] += deferred
            self.core.metrics.remote_pages("put", "deferred", deferred)
        return True

    def _start_write_backs(self) -> None:
        """Start the waiting write-backs, oldest first, in parts that the free staging
        pages and ``write_backlog`` have room for (at a disk eviction, and as each put
        finishes: while some wait, one is in flight, whose end starts them)."""
        while self._waiting:
            part = self._waiting[0]
            if not self._usable():
                self._waiting.popleft()
                self._waiting_pages -= len(part.keys)
                self._skip_write_back(part)
                part.delete_records()
                continue
            count = min(len(part.keys), len(self._free_rows), self.settings.write_backlog - self.pending)
            if count <= 0:
                return
            head = part.split(count) if count < len(part.keys) else self._waiting.popleft()
            self._waiting_pages -= count
            if not self._put_back(head):  # (the lane's queue is full: a put in flight ends first)
                self._waiting.appendleft(head)
                self._waiting_pages += count
                return

    def _put_back(self, part: _WriteBack) -> bool:
        """Read ``part``'s records into staging pages and put them to the store (on the
        write lane; one staging page each, free ones); False if the lane's queue is full."""
        core = self.core
        keys, namespaces, parents, storage = part.keys, part.namespaces, part.parents, part.storage
        total = len(keys)
        rows = np.array([self._free_rows.pop() for _ in range(total)], dtype=np.int64)
        staging = self._staging_area()
        store, fingerprint = self.store, core.spec.fingerprint
        transfer = Transfer(Kind.REMOTE_WRITE, None, [], None)  # (detached: its pages left the tree)
        core.inflight.add_detached(transfer)
        # What the read found unreadable: told whatever the put does after (done() runs
        # once work() has returned or raised).
        unreadable: list[RecordsUnreadable] = []

        def work():
            try:
                tokens = storage.read_tokens(keys)
                found = storage.get(keys, [staging[r] for r in rows], fingerprint=fingerprint)
            except RecordsUnreadable as exc:  # (bad sectors: the store judged the other records)
                found = exc.found
                unreadable.append(exc)
            except Exception as exc:  # (whatever the local store raises: told apart from the store's)
                raise _DiskReadFailed(str(exc)) from exc
            keep = [i for i in range(total) if found[i] and tokens[i] is not None]
            unread = {keys[i] for i in range(total) if not found[i] or tokens[i] is None}
            if not keep:
                return 0, unread
            pick = np.asarray(keep)
            batch = PageBatch(b"".join(keys[i] for i in keep),
                              b"".join(namespaces[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES] for i in keep),
                              b"".join(parents[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES] for i in keep),
                              b"".join(tokens[i] for i in keep), staging, rows[pick])
            put = store.put_batch(batch, fingerprint=fingerprint).result()
            return put.written, unread.union(put.refused)  # (what was written, and which keys were not)

        def done(result, error):
            core.inflight.remove_detached(transfer)
            self._free_rows.extend(int(r) for r in rows)
            self.pending -= total
            self._writing.remove(part)
            part.delete_records()
            for exc in unreadable:  # (their records are deleted with the others': gone, put or not)
                logger.error("write-back: %d of its %d pages skipped: %s", len(exc.unreadable), total, exc)
                core.metrics.disk_unreadable(len(exc.unreadable))
            if isinstance(error, _DiskReadFailed):  # (the store was not asked: it is not down)
                logger.error("write-back of %d pages skipped: reading their records from disk failed: %s", total,
                             error.__cause__)
                self._skip_write_back(part)
            elif error is not None:
                self._failed("put", error)
                self._skip_write_back(part)
            else:
                written, not_put = result
                self._answered()
                core.report(transfer, written)
                self.counts["pages_put"] += written
                core.metrics.remote_pages("put", "ok", written)
                if not_put:
                    self._skip_write_back(part, not_put)
            self._start_write_backs()
            self.on_disk_freed()

        if not self._writes.submit(core, work, done):
            core.inflight.remove_detached(transfer)
            self._free_rows.extend(int(r) for r in rows)
            return False
        self._writing.append(part)
        self.pending += total
        return True

    def purge(self, namespaces: set[NamespaceId]) -> Future:
        """Remove every page of ``namespaces`` from the store — the whole fleet's copies,
        whichever node put them (see :meth:`TierManager.purge`). On the write lane, so
        after every put this tier started before (its queue's bound does not apply: an
        administrator's call is not a put to shed; :meth:`drop_waiting` first takes
        the pages not started yet); fetches in flight for them keep nothing they read.
        The future (done on the owner thread): the objects removed, or the store's
        error (the tier down: not asked)."""
        future: Future = Future()
        for fetch in self._fetches.values():
            if fetch.namespace in namespaces:
                fetch.purged = True
        if not namespaces:
            future.set_result(0)
            return future
        if not self._usable():
            future.set_exception(StorageUnavailable("the remote tier is down (retried every "
                                                   f"{self.settings.retry_s:g} s)"))
            return future
        core, store = self.core, self.store
        removal = Transfer(Kind.REMOTE_WRITE, None, [], None)  # (in flight like a put: a flush waits for it)
        core.inflight.add_detached(removal)

        def done(result, error):
            core.inflight.remove_detached(removal)
            if error is not None:
                self._failed("purge", error)
                future.set_exception(error)
            else:
                self._answered()
                future.set_result(result)

        self._writes.submit(core, lambda: store.purge(sorted(namespaces)), done, bounded=False)
        return future

    def drop_waiting(self, namespaces: set[NamespaceId]) -> int:
        """Take the pages of ``namespaces`` out of the write-backs waiting for staging
        pages and delete their records (a purge: they are put nowhere); returns how
        many. O(pages waiting)."""
        dropped = 0
        for part in self._waiting:
            before = len(part.keys)
            doomed = part.drop(namespaces)
            dropped += before - len(part.keys)
            if doomed:
                part.storage.delete(doomed)
        if dropped:
            self._waiting_pages -= dropped
            self._waiting = deque(part for part in self._waiting if part.keys)
            self.on_disk_freed()
        return dropped

    def keep_on_disk(self, nodes: list[Node]) -> set[bytes]:
        """The disk tier writes ``nodes`` again (pages it evicted stayed on host): a
        write-back in flight or waiting with the same pages must not delete their new
        records (same keys) when it is done. Returns the keys taken from write-backs
        (for :meth:`keep_failed`). O(pages of ``nodes``) while a write-back is in
        flight."""
        if not self._writing:
            return set()
        keys = {k for n in nodes for k in n.page_key_list()}
        taken: set[bytes] = set()
        for part in (*self._writing, *self._waiting):
            taken |= part.doomed & keys
            part.doomed -= keys
        return taken

    def keep_failed(self, keys: set[bytes]) -> set[bytes]:
        """The disk write that :meth:`keep_on_disk` took ``keys`` for failed: their old
        records are the write-backs' again, to delete once put. Returns the keys of
        write-backs done meanwhile — their records the caller deletes now, else they
        would stay on disk, in no tier, until a restart. O(pages held)."""
        for part in (*self._writing, *self._waiting):
            held = keys.intersection(part.keys)
            part.doomed |= held
            keys = keys - held
        return keys

    def _staging_area(self) -> np.ndarray:
        """The write-back's staging pages (allocated and registered with the store once)."""
        if self._staging is None:
            self._staging = np.zeros((STAGING_PAGES, self.core.spec.host_page_bytes), dtype=np.uint8)
            self.store.register(self._staging)
        return self._staging

    def _defer(self, nodes: list[Node], pages: int) -> None:
        """The queue is full: keep the write for when it has room (oldest first, at most
        :data:`MAX_DEFERRED` writes: beyond, skipped and counted)."""
        if len(self._deferred) >= MAX_DEFERRED:
            self._skip_write(pages)
            return
        # (the deepest node and the pages of the path's end to write: a split meanwhile
        # cuts nodes, not positions)
        self._deferred.append((nodes[-1].node_id, sum(n.num_pages for n in nodes)))
        self.counts["put_deferred"] += pages
        self.core.metrics.remote_pages("put", "deferred", pages)

    def _retry_deferred(self) -> None:
        """Start the deferred writes the queue has room for (after a put finished); while
        the tier is down, skip them all (counted), as any write then — no put may end to
        retry them. Pages that left host meanwhile (nothing to put them from) are
        skipped and counted too."""
        tree = self.core.tree
        while self._deferred:
            if not self._usable():
                self._skip_write(sum(pages for _, pages in self._deferred))
                self._deferred.clear()
                return
            node_id, pages = self._deferred[0]
            node = tree.find(node_id)
            nodes: list[Node] = []
            if node is not None:
                left = pages
                for n in reversed(tree.path(node)):
                    if left <= 0:
                        break
                    nodes.insert(0, n)
                    left -= n.num_pages
            total = sum(n.num_pages for n in nodes if n.host_pages is not None and n.tokens)
            if self.pending and self.pending + total > self.settings.write_backlog:
                return
            self._deferred.popleft()
            if pages > total:  # (left host meanwhile)
                self._skip_write(pages - total)
            self.write(nodes)  # (the rest goes now)

    def _skip_write(self, pages: int) -> None:
        """Pages not put: the tier down, its queue full, or no room in the store."""
        self.counts["put_skipped"] += pages
        self.core.metrics.remote_pages("put", "skipped", pages)

    def _skip_write_back(self, part: _WriteBack, keys: set[bytes] | None = None) -> None:
        """The pages of write-back ``part`` with these ``keys`` (all of them by default)
        not put: skipped, and those that were on this node's disk only are dropped from
        the cache now — their eviction counted them evicted, not dropped (but those the
        disk tier wrote again meanwhile: cached again)."""
        self._skip_write(len(part.keys) if keys is None else len(keys))
        alone = part.last & part.doomed
        self.core.metrics.dropped(Tier.DISK, len(alone if keys is None else alone & keys))

    def _written(self, transfer: Transfer, result, error: BaseException | None) -> None:
        core = self.core
        core.inflight.remove(transfer)
        core.tree.unpin(transfer.hold)
        self.pending -= transfer.num_pages
        if error is not None:
            self._failed("put", error)
            self._skip_write(transfer.num_pages)
        else:
            self._answered()
            core.report(transfer, result.written)
            self.counts["pages_put"] += result.written
            core.metrics.remote_pages("put", "ok", result.written)
            if result.written < transfer.num_pages:  # (no segment with room: the master's call)
                self._skip_write(transfer.num_pages - result.written)
        if self._deferred:
            self._retry_deferred()

    # -- lookups and reads ---------------------------------------------------------------

    def fetch(self, namespace: NamespaceId, packed: bytes, result: MatchResult) -> Fetch | None:
        """Ask the store for the whole pages of ``packed`` after ``result``'s hit (the
        tree's full match, the request's packed tokens); ``None`` when nothing is asked."""
        core = self.core
        page_bytes = self._token_bytes
        first = result.num_pages
        whole = len(packed) // page_bytes
        anchor = result.node  # (None: a namespace this tree has no page of)
        if whole <= first:
            return None
        if anchor is not None and not anchor.is_root and anchor.host_pages is None and not anchor.on_disk:
            return None  # (device-only prefix: nothing on host to hang the pages under)
        parent_key = ROOT_PARENT_KEY if anchor is None else anchor.last_page_key
        count = min(whole - first, self.settings.lookup_pages)
        end = (first + count) * page_bytes
        keys = chain_page_keys(namespace, parent_key, packed[first * page_bytes : end], core.spec.page_size)
        key = (namespace, keys)
        fetch = self._fetches.get(key)
        if fetch is not None:
            return fetch
        if not self._usable():
            self._lookup("unavailable")
            return None
        if self._recently_absent(keys[:PAGE_KEY_BYTES]):
            self._lookup("recent_miss")
            return None
        after, shared = self._sharing(namespace, keys)
        fetch = Fetch(namespace, anchor, first, packed[:end], keys, after, shared)
        asked = fetch.asked
        if asked:
            store = self.store
            key_list = [asked[i : i + PAGE_KEY_BYTES] for i in range(0, len(asked), PAGE_KEY_BYTES)]
            # (in flight like a get: a flush waits for it, and a close gives up at its
            # deadline rather than join a lane stuck in the store)
            lookup = Transfer(Kind.REMOTE_READ, None, [], anchor)
            core.inflight.add_detached(lookup)
            if not self._reads.submit(core, lambda: store.contains(key_list, namespace=namespace),
                                      lambda found, error: self._looked_up(fetch, lookup, found, error)):
                core.inflight.remove_detached(lookup)
                self._lookup("busy")
                return None
        if anchor is not None and not anchor.is_root:
            core.tree.pin(anchor)
        self._fetches[key] = fetch
        if not asked:
            self._end(fetch, 0)  # (all its pages are another fetch's: it ends with that one)
        return fetch

    def _sharing(self, namespace: NamespaceId, keys: bytes) -> tuple[Fetch | None, int]:
        """The fetch in flight that asks for the most of the first pages of ``keys``,
        and how many (page keys chain: equal keys, equal pages before them too). O(fetches
        in flight × pages shared)."""
        best, most = None, 0
        for (other_namespace, other_keys), fetch in self._fetches.items():
            if other_namespace != namespace:
                continue
            pages = 0
            for i in range(0, min(len(keys), len(other_keys)), PAGE_KEY_BYTES):
                if keys[i : i + PAGE_KEY_BYTES] != other_keys[i : i + PAGE_KEY_BYTES]:
                    break
                pages += 1
            if pages > most:
                best, most = fetch, pages
        return best, most

    def _recently_absent(self, key: bytes) -> bool:
        """Did a lookup find nothing at this page key within ``miss_ttl_s``? (An engine's
        scheduler asks again for a waiting request at every step: one RPC per prompt
        and second, not per step.)"""
        expires = self._absent.get(key)
        if expires is None:
            return False
        if time.monotonic() < expires:
            return True
        del self._absent[key]
        return False

    def _note_absent(self, key: bytes) -> None:
        if self.settings.miss_ttl_s <= 0:
            return
        self._absent[key] = time.monotonic() + self.settings.miss_ttl_s
        self._absent.move_to_end(key)
        if len(self._absent) > MAX_ABSENT:
            self._absent.popitem(last=False)

    def _lookup(self, result: str) -> None:
        self.counts[f"lookup_{result}"] += 1
        self.core.metrics.remote_lookup(result)

    def _looked_up(self, fetch: Fetch, lookup: Transfer, found: list[bool] | None,
                   error: BaseException | None) -> None:
        self.core.inflight.remove_detached(lookup)
        if error is not None:
            self._failed("lookup", error)
            self._lookup("unavailable")
            return self._end(fetch, 0)
        self._answered()
        count = int(np.argmin(found)) if not all(found) else len(found)
        self._lookup("hit" if count else "miss")
        if not count:
            self._note_absent(fetch.asked[:PAGE_KEY_BYTES])
            return self._end(fetch, 0)
        core = self.core
        pages = core.alloc_host(count)
        while pages is None and count > 1:
            count //= 2
            pages = core.alloc_host(count)
        if pages is None:
            core.metrics.missed("no_room", count * core.spec.page_size)
            return self._end(fetch, 0)
        core.host_staging += count
        transfer = Transfer(Kind.REMOTE_READ, None, [], fetch.anchor)
        core.inflight.add_detached(transfer)
        keys = [fetch.asked[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES] for i in range(count)]
        buffers = [core.host_pool.page_array(int(h)) for h in pages]
        store, fingerprint, token_bytes = self.store, core.spec.fingerprint, self._token_bytes
        namespace = fetch.namespace

        def work():
            # (the store's count moves by this get's bad records: this tier's reads run on
            # one thread — another spec's manager sharing the store may blur it)
            before = getattr(store, "corrupt_records", 0)
            found = store.get(keys, buffers, fingerprint=fingerprint, namespace=namespace, token_bytes=token_bytes)
            return found, getattr(store, "corrupt_records", 0) - before

        def done(result, error):
            got, corrupt = result if result is not None else (None, 0)
            self._read(fetch, transfer, pages, got, corrupt, error)

        if not self._reads.submit(core, work, done):
            done(None, None)

    def _read(self, fetch: Fetch, transfer: Transfer, pages, got: list[bool] | None, corrupt: int,
              error: BaseException | None) -> None:
        core = self.core
        core.inflight.remove_detached(transfer)
        if error is not None:
            self._failed("get", error)
        elif got is not None:
            self._answered()
        got = got if got is not None and error is None else [False] * len(pages)
        good = len(got) if all(got) else int(np.argmin(got))
        self.counts["pages_got"] += good
        self.counts["pages_missing"] += len(got) - good
        self.counts["pages_corrupt"] += corrupt
        core.metrics.remote_pages("get", "hit", good)
        core.metrics.remote_pages("get", "corrupt", corrupt)
        core.metrics.remote_pages("get", "missing", len(got) - good - corrupt)
        if good:
            core.report(transfer, good)  # (a detached transfer: bytes of the pages that landed)
        core.host_alloc.free(pages[good:])
        core.host_staging -= len(pages) - good  # (the rest stay staging until they join the tree)
        self._land(fetch, pages[:good])

    def _land(self, fetch: Fetch, pages) -> None:
        """Put the landed pages in the tree below the anchor — once the anchor's path is
        on host (a disk read of it may still be landing)."""
        core = self.core
        tree = core.tree
        anchor = fetch.anchor
        if len(pages) and fetch.after is not None and not fetch.after.done:
            fetch.after.waiters.append(lambda: self._land(fetch, pages))  # (its pages hang below the shared ones)
            return
        if len(pages) and not fetch.on_host and tree.is_live(anchor):
            reads = core.inflight.on(anchor, Kind.DISK_READ)
            if reads:
                reads[0].waiters.append(lambda: self._land(fetch, pages))
                return
        landed = 0
        core.host_staging -= len(pages)
        if len(pages) and fetch.purged:  # (read before the purge removed them: not kept)
            core.host_alloc.free(pages)
        elif len(pages):
            start = fetch.first + fetch.shared
            end = (start + len(pages)) * self._token_bytes
            try:
                if anchor is None:
                    tree.add_namespace(fetch.namespace, core.spec.page_size)
                _, duplicates = tree.add_host_path(fetch.namespace, fetch.packed[:end], start, pages)
                core.host_alloc.free(duplicates)
                landed = len(pages) - len(duplicates)
            except (ResidencyError, HicacheError) as exc:  # the prefix left host meanwhile (or never landed)
                logger.debug("remote pages not kept: %s", exc)
                core.host_alloc.free(pages)
                core.metrics.missed("no_room", len(pages) * core.spec.page_size)
        self._end(fetch, landed)

    def _end(self, fetch: Fetch, pages: int) -> None:
        after = fetch.after
        if after is not None:
            if not after.done:
                after.waiters.append(lambda: self._end(fetch, pages))
                return
            pages += min(after.pages, fetch.shared)
        if fetch.anchor is not None and not fetch.anchor.is_root:
            self.core.tree.unpin(fetch.anchor)
        self._fetches.pop((fetch.namespace, fetch.keys), None)
        fetch.finish(pages)

    def close(self) -> None:
        """Stop the lanes, then take this manager's memory back from the store: the
        store is shared with other specs' managers and outlives this one. (Only after a
        drain that finished: nothing waits then. A stop whose drain ran out of time does
        not close the manager, and its write-backs in flight or waiting for staging
        pages are not put by this process; their records stay on disk, so the restarted
        daemon rebuilds them as disk-resident pages and puts them when its disk tier
        evicts them.)"""
        # (each lane's thread has its own registered scratch area in the store)
        self._reads.close(self.store.release_scratch)
        self._writes.close(self.store.release_scratch)
        self.store.unregister(self.core.host_pool.pages_array())
        if self._staging is not None:
            self.store.unregister(self._staging)
