"""The HiRadixTree: one radix tree of cached pages, resident in three tiers.

Each node is one edge of the tree: one or more whole pages of one namespace, keyed in
its parent by its first page's key, with the residency of those pages in every tier::

    root(ns A) ── [sys prompt, 64 pages] ── [turn 1, 12 pages] ── [turn 2, 15 pages]
                  device{pool 0: ids}        device{pool 0: ids}   host: ids
                  host: ids, disk            host: ids, disk       disk
                                     └─── [other turn 1, 9 pages]
                                          disk

Residency per node: device page ids per pool (several engines share one tree; each pool
has its own page ids, locks and eviction), host page ids (shared by all pools), on-disk
(shared). Internally a residency :data:`Slot` is the pool id for a device pool (>= 0),
:data:`HOST_SLOT` or :data:`DISK_SLOT`; page ids are kept as packed little-endian int32
``bytes`` so that a match concatenates whole edges without a per-page loop. Lock
references count under a :data:`LockKey` of their own: a device pool's (which keeps that
pool's slot resident) or :data:`PIN` (a transfer's, which keeps none).

Invariants (all checked by :meth:`HiRadixTree.check_invariants`):

* Every slot's residency is closed under ancestors: a node resident in a slot has every
  ancestor resident there. A match's device part is therefore a prefix, followed by the
  host part, followed by the disk part. Removal is leaf-first per slot: only a node
  with no child resident in a slot may leave it.
* ``lock(node, pool)`` adds one reference on the node and each ancestor. A node with
  references in ``pool`` keeps its device pages in that pool; a node with any reference
  (any pool, or a transfer pin) keeps its host pages and its disk record, and is never
  removed. A node that lives in no tier and holds no reference is removed.
* Evictable and protected page counts per slot, the set of evictable leaves per slot,
  and the count of clean host pages (on host and on disk, unprotected: they can leave
  the host without a write) are maintained incrementally on every change.

Edges are compared by page keys (:mod:`hicache.keys`: a page's key names the page and
its whole prefix). A node keeps its pages' tokens while it is in a device pool or not on
disk: a node on disk and in no device pool has none (its records hold them), which is
most of a big cache's pages (256 bytes a page of 64 tokens). A walk finds a child by its
first page's tokens (a dict lookup) and compares an edge with memcmp where it can; only
at nodes without tokens does it hash the request's pages (one key to find the child,
the edge's keys to compare it) — pages a load then brings from host or disk anyway. An
insert gives a node on its path its tokens back. A node that leaves the disk tier while
cached on host gets them back from its caller (read from the store before its records
go: :meth:`HiRadixTree.set_tokens`) or stays without — then it cannot be written to disk
again, until an insert of those pages brings them.

Page ids passed in are trusted to be the caller's private pages (the session layer
checks ownership against the allocators); the tree never frees pages itself, it returns
them (duplicates from :meth:`insert`, pages from :meth:`drop`) for the caller to free.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple, NewType, Union

import numpy as np

from hicache.errors import (
    InvalidArgument,
    LockUnderflow,
    ResidencyError,
    UnknownNamespace,
    UnknownNode,
)
from hicache.eviction import EvictionPolicy, eviction_policy
from hicache.keys import (
    PAGE_KEY_BYTES,
    ROOT_PARENT_KEY,
    TOKEN_BYTES,
    NamespaceId,
    PageKey,
    Tokens,
    chain_page_keys,
    pack_tokens,
    split_page_keys,
)
from hicache.pages import PAGE_ID_DTYPE, PageIds, PageIdsLike, as_page_ids

PoolId = NewType("PoolId", int)  # a registered device pool (one engine's, in one tier manager)

Slot = NewType("Slot", int)  # a residency slot: a device pool's id (>= 0), HOST_SLOT or DISK_SLOT
HOST_SLOT = Slot(-1)
DISK_SLOT = Slot(-2)

LockKey = NewType("LockKey", int)  # what a lock reference counts under: a device pool's id, or PIN
PIN = LockKey(-3)  # transfer pins: protect host pages and the disk record, no device pool


def _kept_slot(lock_key: LockKey) -> Slot | None:
    """The device slot whose pages a lock under ``lock_key`` keeps (a pin keeps none)."""
    return Slot(lock_key) if lock_key >= 0 else None


def _lock_key(slot: Slot) -> LockKey:
    """The lock key that protects a device slot's pages."""
    return LockKey(slot)


_ID_BYTES = PAGE_ID_DTYPE.itemsize
_NO_PAGES = np.empty(0, dtype=PAGE_ID_DTYPE)
_NO_PAGES.flags.writeable = False


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        """The tier's name in stats, metrics labels and logs: ``device``, ``host``, ``disk``."""
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Place:
    """Where pages live: a tier, and for the device tier the pool. ``str()`` is its name
    in ``stats``: ``device:<pool>``, ``host``, ``disk``."""

    tier: Tier
    pool: PoolId | None = None

    @classmethod
    def device(cls, pool: PoolId) -> "Place":
        return cls(Tier.DEVICE, pool)

    def __str__(self) -> str:
        return f"device:{self.pool}" if self.tier == Tier.DEVICE else self.tier.label


Residency = Union[bytes, bool]  # packed page ids, or True for "on disk"


@dataclass(slots=True, eq=False)
class Node:
    """One edge of the tree. Read its fields; change it only through the tree."""

    node_id: int
    namespace: NamespaceId
    parent: "Node | None"
    tokens: bytes  # packed int32 token ids of its pages; b"" on disk (see the module doc)
    page_keys: bytes  # 16 bytes per page
    num_pages: int
    children: dict[bytes, "Node"]  # the child's first page key -> child
    by_tokens: dict[bytes, "Node"]  # the children that hold tokens, by their first page's tokens
    residency: dict[Slot, Residency]  # slot -> packed ids / True
    resident_children: dict[Slot, int]  # slot -> children resident in it
    lock_ref: dict[LockKey, int]  # lock key -> references at or below this node
    lock_total: int = 0
    hit_count: int = 0
    last_access: int = 0
    priority: int = 0
    # The recurrent state after its last page (hicache.tiers.checkpoints), for specs with
    # state layers; stays with this node when it is split (the node keeps its end).
    checkpoint: object = None
    # A spec with SWA layers (hicache.tiers.windows): per slot, the index of the first of
    # the node's pages whose SWA layers' bytes that slot holds (the pages before it have
    # the other layers only); a slot left out holds them all. None: every slot does.
    swa: dict | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def device_pages(self, pool: PoolId) -> PageIds | None:
        pages = self.residency.get(pool)
        return None if pages is None else np.frombuffer(pages, dtype=PAGE_ID_DTYPE)

    @property
    def host_pages(self) -> PageIds | None:
        pages = self.residency.get(HOST_SLOT)
        return None if pages is None else np.frombuffer(pages, dtype=PAGE_ID_DTYPE)

    @property
    def on_disk(self) -> bool:
        return DISK_SLOT in self.residency

    @property
    def device_pools(self) -> list[PoolId]:
        return [slot for slot in self.residency if slot >= 0]

    def page_key_list(self) -> list[PageKey]:
        return split_page_keys(self.page_keys)

    def page_key(self, i: int) -> PageKey:
        """The key of the node's ``i``-th page."""
        return PageKey(self.page_keys[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES])

    @property
    def last_page_key(self) -> PageKey:
        """The key a page right below this node chains from: its last page's key (the
        namespace's root key for a root)."""
        return PageKey(self.page_keys[-PAGE_KEY_BYTES:]) if self.num_pages else ROOT_PARENT_KEY

    def __repr__(self) -> str:
        return (
            f"Node(id={self.node_id}, pages={self.num_pages}, "
            f"residency={sorted(self.residency)}, locks={self.lock_total})"
        )


class MatchResult(NamedTuple):
    """The longest cached prefix: device part (usable now), then host, then disk.

    ``node`` is the deepest matched node (the namespace root on a miss, ``None`` when the
    namespace is unknown); ``last_device_node`` ends the device part and
    ``last_host_node`` the host part (each equal to the one before when its part is
    empty). The device part's page ids are ``device_bytes`` (packed, as they go on the
    wire: the daemon's match answers without a trip through numpy) or, read-only,
    ``device_pages``.
    """

    node: Node | None
    last_device_node: Node | None
    last_host_node: Node | None
    device_bytes: bytes
    num_host_pages: int
    num_disk_pages: int
    page_size: int

    @property
    def device_pages(self) -> PageIds:
        return np.frombuffer(self.device_bytes, PAGE_ID_DTYPE) if self.device_bytes else _NO_PAGES

    @property
    def num_device_pages(self) -> int:
        return len(self.device_bytes) // _ID_BYTES

    @property
    def num_pages(self) -> int:
        return len(self.device_bytes) // _ID_BYTES + self.num_host_pages + self.num_disk_pages

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


class InsertResult(NamedTuple):
    """``device_pages``: the canonical pages of every whole page of the key (read-only).
    ``duplicate_pages``: the caller's pages whose content the pool already had cached;
    the caller frees them. ``num_prefix_pages``: pages already cached in the pool."""

    node: Node
    device_pages: PageIds
    duplicate_pages: PageIds
    num_prefix_pages: int


class TierSizes(NamedTuple):
    evictable: int
    protected: int

    @property
    def cached(self) -> int:
        return self.evictable + self.protected


@dataclass(slots=True, eq=False)
class _SlotIndex:
    """Per-slot bookkeeping: unprotected leaves of this slot (also by namespace, so that
    a space quota's eviction looks at its own only), and page counts.

    ``heap`` keeps the leaves in eviction order from one eviction to the next: an
    entry ``(key, node id, sequence)`` is pushed when a node becomes a leaf, and left in
    place when it stops being one or its key grows (every policy's key only grows: a
    hit, an access, a higher priority); :meth:`HiRadixTree.iter_evictable` drops or
    re-positions such entries as it meets them. Rebuilding the order from the leaves on
    every eviction cost 3-11 ms at ~2,500 disk leaves (a cache miss or two a node), on
    every disk write that needed room. (An entry holds the node's id, not the node: a
    tuple of numbers the cyclic collector stops tracking, where a tuple holding a node
    stays tracked — tens of thousands of them, walked by every collection.)"""

    leaves: set[Node]
    key: Callable[[Node], Any]
    nodes: dict[int, Node]  # the tree's, by id
    evictable: int = 0
    protected: int = 0
    by_ns: dict[NamespaceId, set[Node]] = field(default_factory=dict)
    heap: list[tuple[Any, int, int]] = field(default_factory=list)
    pushed: int = 0  # entries ever pushed: a sequence, so that no two entries are equal

    def add_leaf(self, node: Node) -> None:
        if node in self.leaves:
            return
        self.leaves.add(node)
        self.push(node)
        own = self.by_ns.get(node.namespace)
        if own is None:
            own = self.by_ns[node.namespace] = set()
        own.add(node)

    def discard_leaf(self, node: Node) -> None:
        if node in self.leaves:
            self.leaves.remove(node)
            own = self.by_ns[node.namespace]
            own.remove(node)
            if not own:
                del self.by_ns[node.namespace]

    def push(self, node: Node) -> None:
        self.pushed += 1
        heapq.heappush(self.heap, (self.key(node), node.node_id, self.pushed))
        if len(self.heap) > 2 * len(self.leaves) + 64:  # mostly entries left behind: start over
            self.rebuild()

    def rebuild(self) -> None:
        key = self.key
        self.heap = [(key(n), n.node_id, i) for i, n in enumerate(self.leaves, self.pushed + 1)]
        self.pushed += len(self.heap)
        heapq.heapify(self.heap)


@dataclass(slots=True, frozen=True)
class _Namespace:
    root: Node
    page_size: int
    page_bytes: int


def _child(node: Node, page: bytes, page_size: int) -> "Node | None":
    """``node``'s child whose first page is ``page`` (packed tokens): by its tokens —
    a dict lookup — or, among the children that keep no tokens (on disk), by the page's
    key (one hash)."""
    child = node.by_tokens.get(page)
    if child is None and len(node.by_tokens) < len(node.children):
        child = node.children.get(chain_page_keys(node.namespace, node.last_page_key, page, page_size))
    return child


def _edge_pages(node: Node, child: Node, packed: bytes, pos: int, page_bytes: int, page_size: int,
                page_keys: bytes | None = None) -> int:
    """How many of ``child``'s pages equal the request's from byte ``pos`` of ``packed``
    (its first page is known to). With its tokens: memcmp (binary search inside the
    edge); without (on disk): the request's page keys, chained from ``node``'s last —
    or taken from ``page_keys`` (the keys of all of ``packed``'s pages) when the caller
    has them."""
    if child.tokens:
        if packed.startswith(child.tokens, pos):
            return child.num_pages
        return HiRadixTree._common_pages(packed, pos, child.tokens, page_bytes)
    end = min(len(packed), pos + child.num_pages * page_bytes)
    end -= (end - pos) % page_bytes
    if page_keys is not None:
        keys = page_keys[pos // page_bytes * PAGE_KEY_BYTES : end // page_bytes * PAGE_KEY_BYTES]
    else:
        keys = chain_page_keys(child.namespace, node.last_page_key, packed[pos:end], page_size)
    if child.page_keys.startswith(keys) and len(keys) == len(child.page_keys):
        return child.num_pages
    return HiRadixTree._common_pages(keys, 0, child.page_keys, PAGE_KEY_BYTES)


class HiRadixTree:
    """See the module docstring. Not thread-safe: one owner thread drives it."""

    def __init__(
        self,
        *,
        eviction: str | EvictionPolicy = "lru",
        on_split: Callable[[Node, Node], None] | None = None,
    ) -> None:
        """``on_split(upper, lower)`` is called after a node is cut in two (``lower`` is
        the original node, ``upper`` the new one holding its first pages), so that an
        owner tracking transfers per node can extend them to the new node."""
        self._policy = eviction_policy(eviction) if isinstance(eviction, str) else eviction
        self._on_split = on_split
        self._namespaces: dict[NamespaceId, _Namespace] = {}
        self._nodes: dict[int, Node] = {}
        self._next_id = 0
        self._tick = 0
        self._slots: dict[Slot, _SlotIndex] = {HOST_SLOT: _SlotIndex(set(), self._policy.key, self._nodes),
                                               DISK_SLOT: _SlotIndex(set(), self._policy.key, self._nodes)}
        self._clean_host = 0  # see clean_host_pages
        # Host and disk pages per namespace, and per group of namespaces (a tenant: see
        # set_group; "" = none assigned), for space quotas and occupancy figures.
        self._ns_pages: dict[NamespaceId, list[int]] = {}
        self._group_of: dict[NamespaceId, str] = {}
        self._group_pages: dict[str, list[int]] = {}
        self._direct_locks: dict[tuple[int, LockKey], int] = {}
        # Told of every residency change — ``added(node, slot)`` (tokens still on the
        # node), ``dropped(node, slot)`` — and of each namespace's new group —
        # ``regrouped(namespace, old, new)`` — by the daemon's KV events (see
        # hicache.daemon.kv_events); None: nobody listens.
        self.observer = None
        # Told of each node with a checkpoint as it leaves the tree (a checkpoint never
        # outlives its node): hicache.tiers.checkpoints.Checkpoints.forget.
        self.on_remove: Callable[[Node], None] | None = None


    def add_namespace(self, namespace: NamespaceId, page_size: int) -> Node:
        """Create the namespace's root (idempotent for the same page size)."""
        if not isinstance(namespace, bytes) or len(namespace) != PAGE_KEY_BYTES:
            raise InvalidArgument(f"namespace id must be {PAGE_KEY_BYTES} bytes")
        if not isinstance(page_size, int) or page_size <= 0:
            raise InvalidArgument(f"page_size must be a positive int, got {page_size!r}")
        entry = self._namespaces.get(namespace)
        if entry is not None:
            if entry.page_size != page_size:
                raise InvalidArgument(
                    f"namespace {namespace.hex()} has page size {entry.page_size}, not {page_size}"
                )
            return entry.root
        root = self._make_node(namespace, None, b"", b"", 0)
        self._namespaces[namespace] = _Namespace(root, page_size, page_size * TOKEN_BYTES)
        return root

    def namespaces(self) -> list[NamespaceId]:
        return list(self._namespaces)

    def has_namespace(self, namespace: NamespaceId) -> bool:
        """Whether the namespace has a root (something was stored in it once). O(1)."""
        return namespace in self._namespaces

    def page_size(self, namespace: NamespaceId) -> int:
        return self._namespace(namespace).page_size

    def root(self, namespace: NamespaceId) -> Node:
        return self._namespace(namespace).root


    def match(self, namespace: NamespaceId, tokens: Tokens, pool: PoolId, *, touch: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens`` as seen from ``pool``.

        Splits the last node when the match ends inside it, and (unless ``touch`` is
        false) marks every matched node accessed and hit. Hashes the request's pages as
        the walk needs them: one page key per node reached (its first page, chained from
        its parent's last), and the edges of nodes on disk (which keep no tokens); edges
        with tokens are compared with memcmp. O(depth) dict lookups.
        """
        self._check_pool(pool)
        packed = pack_tokens(tokens)
        entry = self._namespaces.get(namespace)
        if entry is None:
            return MatchResult(None, None, None, b"", 0, 0, 0)
        page_bytes, page_size = entry.page_bytes, entry.page_size
        end = len(packed) - len(packed) % page_bytes
        self._tick += 1
        tick = self._tick
        node = last_device = last_host = entry.root
        device: list[bytes] = []
        num_host = num_disk = 0
        pos = 0
        while pos < end:
            child = node.by_tokens.get(packed[pos : pos + page_bytes])  # (_child, inline: the hot loop)
            if child is None:
                child = _child(node, packed[pos : pos + page_bytes], page_size)
                if child is None:
                    break
            res = child.residency
            pages = res.get(pool)
            if pages is None and HOST_SLOT not in res and DISK_SLOT not in res:
                break
            partial = not (child.tokens and packed.startswith(child.tokens, pos))  # (the common case, inline)
            if partial:
                equal = _edge_pages(node, child, packed, pos, page_bytes, page_size)
                partial = equal < child.num_pages
                if partial:
                    child = self._split(child, equal)
                res = child.residency
                pages = res.get(pool)
            pos += child.num_pages * page_bytes
            if touch:
                child.last_access = tick
                child.hit_count += 1
            if pages is not None:
                device.append(pages)
                last_device = last_host = child
            elif HOST_SLOT in res:
                num_host += child.num_pages
                last_host = child
            else:
                num_disk += child.num_pages
            node = child
            if partial:
                break
        return MatchResult(node, last_device, last_host, b"".join(device), num_host, num_disk, entry.page_size)

    def insert(
        self,
        namespace: NamespaceId,
        tokens: Tokens,
        pool: PoolId,
        device_pages: PageIdsLike,
        *,
        priority: int = 0,
    ) -> InsertResult:
        """Cache the whole pages of ``tokens``, whose KV is in ``device_pages`` of ``pool``.

        ``device_pages`` has one id per whole page (a partial last page stays with the
        caller). Where the pool already caches a page, the tree keeps its copy and the
        caller's page is returned in ``duplicate_pages`` (unless it *is* the cached page,
        e.g. it came from a match); everywhere else the caller's page becomes the pool's
        cached copy — also for nodes cached only on host, on disk or in other pools.
        """
        entry = self._namespace(namespace)
        self._check_pool(pool)
        key = pack_tokens(tokens)
        page_size = entry.page_size
        num_pages = len(key) // entry.page_bytes
        ids = as_page_ids(device_pages)
        if len(ids) != num_pages:
            raise InvalidArgument(
                f"{len(key) // TOKEN_BYTES} tokens make {num_pages} whole pages of {page_size}, "
                f"but {len(ids)} device pages were given"
            )
        if not num_pages:
            return InsertResult(entry.root, _NO_PAGES, _NO_PAGES, 0)
        pages = ids.tobytes()
        path = self._path(entry, key[: num_pages * entry.page_bytes])
        canonical: list[bytes] = []
        duplicates: list[tuple[bytes, bytes]] = []
        num_prefix = 0
        offset = 0
        for node in path:
            mine = pages[offset : offset + node.num_pages * _ID_BYTES]
            offset += len(mine)
            if priority > node.priority:
                node.priority = priority
            cached = node.residency.get(pool)
            if cached is None:
                self._add_residency(node, pool, mine)
                canonical.append(mine)
            else:
                num_prefix += node.num_pages
                canonical.append(cached)
                if cached != mine:
                    duplicates.append((cached, mine))
        dup_pages = _NO_PAGES
        if duplicates:
            parts = []
            for cached, mine in duplicates:
                theirs = np.frombuffer(cached, dtype=PAGE_ID_DTYPE)
                ours = np.frombuffer(mine, dtype=PAGE_ID_DTYPE)
                parts.append(ours[theirs != ours])
            dup_pages = np.concatenate(parts)
        return InsertResult(
            path[-1],
            np.frombuffer(b"".join(canonical), dtype=PAGE_ID_DTYPE),
            dup_pages,
            num_prefix,
        )

    def restore(self, namespace: NamespaceId, tokens: Tokens, page_keys: bytes | None = None,
                under: Node | None = None) -> Node:
        """Mark every whole page of ``tokens`` as on disk, creating nodes as needed.

        This is how a restarted daemon rebuilds its disk tier from storage metadata.
        ``page_keys``, if given, are the chained keys of those pages (16 bytes each; the
        caller has checked them): the path is then compared by key without hashing the
        pages again — O(new pages) rather than O(pages) a restore. ``under``: a live
        node of ``namespace`` on disk (one an earlier restore returned) that ``tokens``
        follow, instead of the root — so many sequences under one long prefix cost
        their own pages, not the prefix's again. Returns the deepest node (``under``,
        or the root, when there is no whole page).
        """
        entry = self._namespace(namespace)
        key = pack_tokens(tokens)
        key = key[: len(key) - len(key) % entry.page_bytes]
        if under is not None and not (self.is_live(under) and under.namespace == namespace
                                      and DISK_SLOT in under.residency):
            raise InvalidArgument(f"node {under.node_id} is not a live node of this namespace on disk")
        if not key:
            return entry.root if under is None else under
        if page_keys is not None and len(page_keys) != len(key) // entry.page_bytes * PAGE_KEY_BYTES:
            raise InvalidArgument(f"{len(page_keys)} bytes of page keys for {len(key) // entry.page_bytes} pages")
        path = self._path(entry, key, page_keys, under)
        for node in path:
            if DISK_SLOT not in node.residency:
                self._add_residency(node, DISK_SLOT, True)
            self._settle_tokens(node)
        return path[-1]


    def add_host_path(self, namespace: NamespaceId, tokens: Tokens, first: int,
                      host_pages: PageIdsLike) -> tuple[Node, PageIds]:
        """Record host copies of the whole pages ``first ..`` of ``tokens`` (an engine's
        ``store``), creating nodes as needed. The pages before ``first`` must be on host
        already. Where a node has a host copy, it keeps it and the given pages come back
        as duplicates for the caller to free. Returns the deepest node and the
        duplicates."""
        entry = self._namespace(namespace)
        key = pack_tokens(tokens)
        key = key[: len(key) - len(key) % entry.page_bytes]
        ids = as_page_ids(host_pages)
        if not 0 <= first or len(key) // entry.page_bytes != first + len(ids):
            raise InvalidArgument(f"{len(key) // entry.page_bytes} whole pages of tokens, but host pages were "
                                  f"given for {len(ids)} pages after the first {first}")
        if not len(key):
            return entry.root, _NO_PAGES
        walked, end = self._path_existing(entry, key[: first * entry.page_bytes])
        start = 0
        for node in walked:
            if HOST_SLOT not in node.residency:
                raise ResidencyError(f"page {start} is not on host: the pages before a stored one must be")
            start += node.num_pages
        if end < first:  # (checked before anything changes: the caller may carry on)
            raise ResidencyError(f"only {end} of the {first} pages before the stored ones are cached")
        path = self._path(entry, key)
        duplicates = []
        pos = 0
        for node in path:
            start = pos
            pos += node.num_pages
            if pos <= first:
                continue
            if start < first:  # a node on host across the boundary: the stored part is a duplicate
                # (the front part is no node of the path: its tokens are settled here)
                self._settle_tokens(self._split(node, first - start))
                start = first
            mine = ids[start - first : pos - first]
            if HOST_SLOT in node.residency:
                duplicates.append(mine)
            else:
                self._add_checked(node, HOST_SLOT, mine)
        for node in path:
            self._settle_tokens(node)
        return path[-1], (np.concatenate(duplicates) if duplicates else _NO_PAGES)

    def _path_existing(self, entry: _Namespace, packed: bytes) -> tuple[list[Node], int]:
        """The existing nodes along ``packed`` (whole pages), without changing the tree,
        and how many of its pages they hold: the last node may reach past it, or leave
        it inside (the walk stops where the tree does)."""
        page_bytes, page_size = entry.page_bytes, entry.page_size
        node = entry.root
        path = []
        pos = 0
        while pos < len(packed):
            child = _child(node, packed[pos : pos + page_bytes], page_size)
            if child is None:
                break
            path.append(child)
            equal = _edge_pages(node, child, packed, pos, page_bytes, page_size)
            if equal < child.num_pages:
                return path, pos // page_bytes + equal
            pos += child.num_pages * page_bytes
            node = child
        return path, pos // page_bytes

    def lock(self, node: Node, pool: PoolId) -> None:
        """Protect ``node``'s path: its device pages in ``pool``, and its host pages and
        disk record. Locking a root is a no-op. O(depth)."""
        self._check_live(node)
        self._check_pool(pool)
        self._acquire(node, LockKey(pool))

    def unlock(self, node: Node, pool: PoolId) -> None:
        """Undo one :meth:`lock` of the same node and pool."""
        self._check_live(node)
        self._check_pool(pool)
        self._release(node, LockKey(pool))

    def pin(self, node: Node) -> None:
        """Protect ``node``'s path on host and disk while a transfer reads or writes it."""
        self._check_live(node)
        self._acquire(node, PIN)

    def unpin(self, node: Node) -> None:
        self._check_live(node)
        self._release(node, PIN)

    def _acquire(self, node: Node, lock_key: LockKey) -> None:
        if node.parent is None:
            return
        kept = _kept_slot(lock_key)
        held = (node.node_id, lock_key)
        self._direct_locks[held] = self._direct_locks.get(held, 0) + 1
        while node.parent is not None:
            count = node.lock_ref.get(lock_key, 0)
            node.lock_ref[lock_key] = count + 1
            if count == 0 and kept is not None and kept in node.residency:
                self._protect(node, kept)
            node.lock_total += 1
            if node.lock_total == 1:
                if HOST_SLOT in node.residency and DISK_SLOT in node.residency:
                    self._clean_host -= node.num_pages
                if HOST_SLOT in node.residency:
                    self._protect(node, HOST_SLOT)
                if DISK_SLOT in node.residency:
                    self._protect(node, DISK_SLOT)
            node = node.parent

    def _release(self, node: Node, lock_key: LockKey) -> None:
        if node.parent is None:
            return
        kept = _kept_slot(lock_key)
        held = (node.node_id, lock_key)
        count = self._direct_locks.get(held, 0)
        if count == 0:
            what = "pinned" if lock_key == PIN else f"locked in pool {lock_key}"
            raise LockUnderflow(f"node {node.node_id} is not {what}")
        if count == 1:
            del self._direct_locks[held]
        else:
            self._direct_locks[held] = count - 1
        while node.parent is not None:
            parent = node.parent
            count = node.lock_ref[lock_key] - 1
            if count:
                node.lock_ref[lock_key] = count
            else:
                del node.lock_ref[lock_key]
                if kept is not None and kept in node.residency:
                    self._unprotect(node, kept)
            node.lock_total -= 1
            if node.lock_total == 0:
                if HOST_SLOT in node.residency and DISK_SLOT in node.residency:
                    self._clean_host += node.num_pages
                if HOST_SLOT in node.residency:
                    self._unprotect(node, HOST_SLOT)
                if DISK_SLOT in node.residency:
                    self._unprotect(node, DISK_SLOT)
                if not node.residency:
                    self._remove(node)
            node = parent


    def add_device(self, node: Node, pool: PoolId, pages: PageIdsLike) -> None:
        """Record that ``node``'s pages are now in ``pool`` at ``pages`` (e.g. a load)."""
        self._check_pool(pool)
        self._add_checked(node, pool, pages)

    def add_host(self, node: Node, pages: PageIdsLike) -> None:
        """Record a host copy of ``node`` at host ``pages`` (a finished backup)."""
        self._add_checked(node, HOST_SLOT, pages)

    def add_disk(self, node: Node) -> None:
        """Record that ``node``'s pages are on disk (a finished write)."""
        self._add_checked(node, DISK_SLOT, None)

    def drop(self, node: Node, tier: Tier, pool: PoolId | None = None) -> PageIds | None:
        """Remove ``node`` from one tier as eviction would: it must be resident there,
        unprotected and a leaf of that tier. Returns the freed page ids (``None`` for
        disk). A node left in no tier is removed from the tree."""
        self._check_live(node)
        slot = self._slot(tier, pool)
        if slot not in node.residency:
            raise ResidencyError(f"node {node.node_id} is not resident in {_slot_name(slot)}")
        if self._is_protected(node, slot):
            raise ResidencyError(f"node {node.node_id} is protected in {_slot_name(slot)}")
        return _as_ids(self._drop_residency(node, slot))

    def discard(self, node: Node, tier: Tier, pool: PoolId | None = None) -> PageIds | None:
        """Forget ``node`` and its whole subtree in one tier, protected or not: for data
        that is gone (a corrupt disk record, an unmapped pool). Returns the page ids
        that were recorded there (``None`` for disk). Locked nodes that end up in no
        tier stay in the tree, unusable, until their last lock is released."""
        self._check_live(node)
        slot = self._slot(tier, pool)
        order = []
        stack = [node] if slot in node.residency else []
        while stack:
            current = stack.pop()
            order.append(current)
            stack.extend(c for c in current.children.values() if slot in c.residency)
        freed = [self._drop_residency(n, slot) for n in reversed(order)]
        if slot == DISK_SLOT:
            return None
        return np.frombuffer(b"".join(freed), dtype=PAGE_ID_DTYPE) if freed else _NO_PAGES

    def split(self, node: Node, num_pages: int) -> Node:
        """Cut ``node`` after its first ``num_pages`` pages; returns the new upper node
        (``node`` keeps the rest, and its locks and handles)."""
        self._check_live(node)
        if node.parent is None or not 0 < num_pages < node.num_pages:
            raise InvalidArgument(f"cannot split {node!r} after {num_pages} pages")
        return self._split(node, num_pages)

    def is_evictable(self, node: Node, tier: Tier, pool: PoolId | None = None) -> bool:
        """Would eviction of ``tier`` consider ``node`` now (resident, unprotected leaf)?"""
        index = self._slots.get(self._slot(tier, pool))
        return index is not None and node in index.leaves

    def locked_pools(self) -> set[PoolId]:
        """The pools that hold a lock on some node (pins not counted)."""
        return {PoolId(lock_key) for (_, lock_key) in self._direct_locks if lock_key >= 0}

    def discard_pool(self, pool: PoolId) -> PageIds:
        """Forget every device page of ``pool`` (an engine went away); returns them."""
        self._check_pool(pool)
        freed = []
        for entry in self._namespaces.values():
            for child in list(entry.root.children.values()):
                if pool in child.residency:
                    freed.append(self.discard(child, Tier.DEVICE, pool))
        return np.concatenate(freed) if freed else _NO_PAGES

    def iter_evictable(self, tier: Tier, pool: PoolId | None = None, *,
                       namespaces: "set[NamespaceId] | frozenset[NamespaceId] | None" = None,
                       where: Callable[[Node], bool] | None = None) -> Iterator[Node]:
        """Unprotected leaves of one tier in eviction order (the policy's smallest key
        first). A parent that becomes a leaf because the consumer dropped its last
        resident child is yielded in its turn. The order is kept between calls (see
        :class:`_SlotIndex`): a call costs O((k + s) log L) for k nodes taken, s stale
        entries met and L leaves. ``namespaces``: only theirs; ``where``: only those it
        accepts — with either, the order is built for the call, O(L log L)."""
        slot = self._slot(tier, pool)
        index = self._slots.get(slot)
        if index is None:
            return
        if namespaces is None and where is None:
            yield from _iter_leaves(index)
            return
        key = self._policy.key
        if namespaces is None:
            leaves: Iterable[Node] = index.leaves
        else:
            leaves = [n for ns in namespaces for n in index.by_ns.get(ns, ())]
        heap = [(key(n), n.node_id, n) for n in leaves if where is None or where(n)]
        heapq.heapify(heap)
        while heap:
            node = heapq.heappop(heap)[2]
            if node not in index.leaves:
                continue
            parent = node.parent
            yield node
            if parent is not None and parent in index.leaves and (where is None or where(parent)):
                heapq.heappush(heap, (key(parent), parent.node_id, parent))

    def set_group(self, namespace: NamespaceId, group: str) -> bool:
        """Count ``namespace``'s host and disk pages under ``group`` (a tenant) from now
        on, those it holds already included; False when it was ``group``'s already.
        Kept for good (a namespace's group is what its pages would count under, pages or
        not): name only namespaces that hold pages, or are about to."""
        old = self._group_of.get(namespace, "")
        if old == group:
            return False
        if group:
            self._group_of[namespace] = group
        else:
            self._group_of.pop(namespace, None)
        counts = self._ns_pages.get(namespace)
        if counts is not None:
            before = self._group_pages.setdefault(old, [0, 0])
            after = self._group_pages.setdefault(group, [0, 0])
            for i in (0, 1):
                before[i] -= counts[i]
                after[i] += counts[i]
        if self.observer is not None:
            self.observer.regrouped(namespace, old, group)
        return True

    def group_of(self, namespace: NamespaceId) -> str:
        return self._group_of.get(namespace, "")

    def group_pages(self, group: str) -> tuple[int, int]:
        """``(host pages, disk pages)`` cached for ``group``'s namespaces. O(1)."""
        counts = self._group_pages.get(group)
        return (0, 0) if counts is None else (counts[0], counts[1])

    def groups(self) -> dict[str, tuple[int, int]]:
        """Every group's ``(host pages, disk pages)`` (``""``: namespaces of no group)."""
        return {group: (c[0], c[1]) for group, c in self._group_pages.items() if c[0] or c[1] or group}

    def namespaces_of(self, groups: "set[str] | frozenset[str]") -> set[NamespaceId]:
        return {ns for ns, group in self._group_of.items() if group in groups}

    def namespaces_in_use(self) -> set[NamespaceId]:
        """The namespaces with a node now (pages in some tier, or on their way).
        O(namespaces)."""
        return {ns for ns, entry in self._namespaces.items() if entry.root.children}

    def _count(self, namespace: NamespaceId, slot: Slot, delta: int) -> None:
        i = 0 if slot == HOST_SLOT else 1
        counts = self._ns_pages.get(namespace)
        if counts is None:
            counts = self._ns_pages[namespace] = [0, 0]
        counts[i] += delta
        name = self._group_of.get(namespace, "")
        group = self._group_pages.get(name)
        if group is None:
            group = self._group_pages[name] = [0, 0]
        group[i] += delta

    def clean_host_pages(self) -> int:
        """Unprotected host pages that are on disk too: host copies that can go without
        a write first (leaf order permitting). O(1)."""
        return self._clean_host

    def sizes(self, tier: Tier, pool: PoolId | None = None) -> TierSizes:
        """Evictable and protected page counts of one tier. O(1)."""
        index = self._slots.get(self._slot(tier, pool))
        if index is None:
            return TierSizes(0, 0)
        return TierSizes(index.evictable, index.protected)

    def node(self, node_id: int) -> Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise UnknownNode(f"no node {node_id}") from None

    def find(self, node_id: int) -> Node | None:
        """The live node with this id, if any (ids are never reused)."""
        return self._nodes.get(node_id)

    def nodes(self) -> Iterator[Node]:
        """Every live non-root node."""
        return (n for n in self._nodes.values() if n.parent is not None)

    def disk_nodes(self, page_keys: Iterable[bytes]) -> dict[PageKey, Node]:
        """The nodes that hold these pages on disk, by page key (keys on no node's disk
        pages are left out). No per-page index is kept (it would cost ~100 bytes a
        page): the on-disk nodes' keys are scanned, vectorized over pages — O(nodes +
        pages), for the rare record a store drops on its own."""
        wanted = {bytes(key) for key in page_keys if len(key) == PAGE_KEY_BYTES}
        if not wanted:
            return {}
        nodes = [n for n in self._nodes.values() if DISK_SLOT in n.residency]
        if not nodes:
            return {}
        table = np.frombuffer(b"".join(n.page_keys for n in nodes), dtype="<u8").reshape(-1, 2)
        probe = np.frombuffer(b"".join(wanted), dtype="<u8").reshape(-1, 2)
        candidates = np.flatnonzero(np.isin(table[:, 0], probe[:, 0]))
        if not len(candidates):
            return {}
        ends = np.cumsum([n.num_pages for n in nodes])
        found: dict[PageKey, Node] = {}
        for index in candidates.tolist():
            key = table[index].tobytes()
            if key in wanted:
                found[PageKey(key)] = nodes[int(np.searchsorted(ends, index, side="right"))]
        return found

    def __len__(self) -> int:
        return len(self._nodes) - len(self._namespaces)

    def path(self, node: Node) -> list[Node]:
        """The nodes from below the root down to ``node``."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def deepest(self, nodes: Iterable[Node]) -> list[Node]:
        """The nodes of ``nodes`` that none of the others is below, each once, in the
        order given: a lock or pin of each holds all of ``nodes`` (one holds its whole
        path). O(nodes on their paths, once each), where a lock or pin per node walks
        every path from each: quadratic for the ends one insert cuts along its path."""
        nodes = list(nodes)
        walked: set[int] = set()
        above: set[int] = set()  # nodes with one of ``nodes`` below them
        for node in nodes:
            if node.node_id in walked:
                continue
            walked.add(node.node_id)
            up = node.parent
            while up is not None and up.parent is not None:
                above.add(up.node_id)
                if up.node_id in walked:  # (what is above it is marked already)
                    break
                walked.add(up.node_id)
                up = up.parent
        out: dict[int, Node] = {}
        for node in nodes:
            if node.node_id not in above:
                out.setdefault(node.node_id, node)
        return list(out.values())

    def set_tokens(self, node: Node, tokens: bytes) -> None:
        """Give ``node`` back the tokens of its pages (read from the store before its
        records go, while it stays cached elsewhere); checked against its page keys."""
        self._check_live(node)
        entry = self._namespace(node.namespace)
        if len(tokens) != node.num_pages * entry.page_bytes or chain_page_keys(
                node.namespace, node.parent.last_page_key, tokens, entry.page_size) != node.page_keys:
            raise InvalidArgument(f"these are not the tokens of node {node.node_id}'s pages")
        if not node.tokens:
            self._give_tokens(node, bytes(tokens), entry.page_bytes)

    def _give_tokens(self, node: Node, tokens: bytes, page_bytes: int) -> None:
        node.tokens = tokens
        node.parent.by_tokens[tokens[:page_bytes]] = node  # type: ignore[union-attr]

    def writable(self, node: Node) -> bool:
        """Can ``node``'s path be written to disk: does every node on it that is not on
        disk hold its tokens?"""
        return all(n.tokens for n in self.path(node) if DISK_SLOT not in n.residency)

    def set_swa(self, node: Node, slot: Slot, first: int) -> None:
        """Record that ``slot``'s copy of ``node`` holds SWA layers' bytes for its pages
        ``first ..`` only (``0``: all of them)."""
        if slot not in node.residency:
            raise ResidencyError(f"node {node.node_id} is not resident in {_slot_name(slot)}")
        if not 0 <= first <= node.num_pages:
            raise InvalidArgument(f"first SWA page {first} outside node {node.node_id}'s {node.num_pages}")
        if first:
            if node.swa is None:
                node.swa = {}
            node.swa[slot] = first
        elif node.swa and slot in node.swa:
            del node.swa[slot]

    def replace_device(self, node: Node, pool: PoolId, pages: PageIdsLike) -> PageIds:
        """Give ``node``'s copy in ``pool`` other pages holding the same bytes and more
        (an SWA spec's whole pages for a copy without some SWA bytes: :attr:`Node.swa`
        forgets the pool); returns the pages it had, which the caller frees once no one
        reads them. Counts and eviction order stay: the node keeps its place."""
        self._check_pool(pool)
        old = node.residency.get(pool)
        if old is None:
            raise ResidencyError(f"node {node.node_id} is not resident in {_slot_name(pool)}")
        ids = as_page_ids(pages)
        if len(ids) != node.num_pages:
            raise InvalidArgument(f"node {node.node_id} has {node.num_pages} pages, got {len(ids)} ids")
        node.residency[pool] = ids.tobytes()
        self.set_swa(node, pool, 0)
        return np.frombuffer(old, dtype=PAGE_ID_DTYPE)

    def is_live(self, node: Node) -> bool:
        return self._nodes.get(node.node_id) is node


    def _namespace(self, namespace: NamespaceId) -> _Namespace:
        entry = self._namespaces.get(namespace)
        if entry is None:
            shown = namespace.hex() if isinstance(namespace, bytes) else repr(namespace)
            raise UnknownNamespace(f"namespace {shown} is not registered")
        return entry

    @staticmethod
    def _check_pool(pool: PoolId) -> None:
        if type(pool) is not int or pool < 0:
            raise InvalidArgument(f"pool id must be a non-negative int, got {pool!r}")

    def _check_live(self, node: Node) -> None:
        if not isinstance(node, Node) or self._nodes.get(node.node_id) is not node:
            raise UnknownNode(f"{node!r} is not a live node of this tree")

    def _slot(self, tier: Tier, pool: PoolId | None) -> Slot:
        if tier == Tier.DEVICE:
            if pool is None:
                raise InvalidArgument("the device tier needs a pool id")
            self._check_pool(pool)
            return Slot(pool)
        if pool is not None:
            raise InvalidArgument(f"the {Tier(tier).name.lower()} tier is shared; pass no pool")
        if tier == Tier.HOST:
            return HOST_SLOT
        if tier == Tier.DISK:
            return DISK_SLOT
        raise InvalidArgument(f"unknown tier {tier!r}")

    def _is_protected(self, node: Node, slot: Slot) -> bool:
        return _protected(node.lock_ref, node.lock_total, slot)

    def _make_node(
        self, namespace: NamespaceId, parent: Node | None, key: bytes, page_keys: bytes, num_pages: int
    ) -> Node:
        node = Node(self._next_id, namespace, parent, key, page_keys, num_pages, {}, {}, {}, {}, {})
        self._next_id += 1
        self._nodes[node.node_id] = node
        return node

    def _path(self, entry: _Namespace, key: bytes, page_keys: bytes | None = None,
              start: Node | None = None) -> list[Node]:
        """The nodes that cover ``key`` (packed tokens, whole pages) exactly, splitting
        the last existing node or adding a new one at the end as needed; all marked
        accessed. A node on the way that keeps no tokens gets them from ``key``: the
        caller settles them once it has changed the residencies. ``page_keys``: as in
        :meth:`restore`. ``start``: the node ``key`` follows (the root if None)."""
        self._tick += 1
        tick = self._tick
        page_bytes, page_size = entry.page_bytes, entry.page_size
        node = entry.root if start is None else start
        namespace = node.namespace
        end = len(key)
        path = []
        pos = 0
        while pos < end:
            child = _child(node, key[pos : pos + page_bytes], page_size)
            if child is None:
                tail = key[pos:]
                tail_keys = (page_keys[pos // page_bytes * PAGE_KEY_BYTES :] if page_keys is not None
                             else chain_page_keys(namespace, node.last_page_key, tail, page_size))
                child = self._make_node(namespace, node, tail, tail_keys, len(tail) // page_bytes)
                node.children[child.page_keys[:PAGE_KEY_BYTES]] = child
                node.by_tokens[tail[:page_bytes]] = child
                pos = end
            else:
                if not (child.tokens and key.startswith(child.tokens, pos)):
                    equal = _edge_pages(node, child, key, pos, page_bytes, page_size, page_keys)
                    if equal < child.num_pages:
                        child = self._split(child, equal)
                if not child.tokens:  # (the caller settles them: see _settle_tokens)
                    self._give_tokens(child, key[pos : pos + child.num_pages * page_bytes], page_bytes)
                pos += child.num_pages * page_bytes
            child.last_access = tick
            path.append(child)
            node = child
        return path

    @staticmethod
    def _common_pages(key, pos: int, edge: bytes, page_bytes: int) -> int:
        """Whole pages (units of ``page_bytes``) of ``edge`` equal to ``key[pos:]``,
        knowing the first is equal and the whole edge is not. Binary search: O(log
        pages) memcmps."""
        lo = 1
        hi = min(len(edge), len(key) - pos) // page_bytes
        view = memoryview(edge)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key.startswith(view[: mid * page_bytes], pos):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cut ``node`` after ``num_pages`` pages; the new upper node is returned and
        ``node`` (which handles and locks point at) keeps the lower part."""
        cut = num_pages * self._namespaces[node.namespace].page_bytes
        ids_cut = num_pages * _ID_BYTES
        keys_cut = num_pages * PAGE_KEY_BYTES
        parent = node.parent
        page_bytes = self._namespaces[node.namespace].page_bytes
        upper = self._make_node(node.namespace, parent, node.tokens[:cut], node.page_keys[:keys_cut], num_pages)
        upper.children[node.page_keys[keys_cut : keys_cut + PAGE_KEY_BYTES]] = node
        if node.tokens:
            upper.by_tokens[node.tokens[cut : cut + page_bytes]] = node
            parent.by_tokens[node.tokens[:page_bytes]] = upper  # type: ignore[union-attr]
        for slot, value in node.residency.items():
            if value is True:
                upper.residency[slot] = True
            else:
                upper.residency[slot] = value[:ids_cut]
                node.residency[slot] = value[ids_cut:]
            upper.resident_children[slot] = 1
        if node.swa:  # (each part keeps the SWA bytes it had: the first index, cut)
            upper.swa = {slot: min(first, num_pages) for slot, first in node.swa.items()}
            node.swa = {slot: first - num_pages for slot, first in node.swa.items() if first > num_pages} or None
        upper.lock_ref.update(node.lock_ref)
        upper.lock_total = node.lock_total
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        upper.priority = node.priority
        parent.children[node.page_keys[:PAGE_KEY_BYTES]] = upper  # type: ignore[union-attr]
        node.parent = upper
        node.tokens = node.tokens[cut:]
        node.page_keys = node.page_keys[keys_cut:]
        node.num_pages -= num_pages
        if self._on_split is not None:
            self._on_split(upper, node)
        return upper

    def _slot_index(self, slot: Slot) -> _SlotIndex:
        index = self._slots.get(slot)
        if index is None:
            index = self._slots[slot] = _SlotIndex(set(), self._policy.key, self._nodes)
        return index

    def _add_checked(self, node: Node, slot: Slot, pages: PageIdsLike | None) -> None:
        self._check_live(node)
        if node.parent is None:
            raise ResidencyError("the root holds no pages")
        if slot in node.residency:
            raise ResidencyError(f"node {node.node_id} is already resident in {_slot_name(slot)}")
        parent = node.parent
        if parent.parent is not None and slot not in parent.residency:
            raise ResidencyError(
                f"node {node.node_id}'s parent is not resident in {_slot_name(slot)} "
                "(residency is closed under ancestors: add the parent first)"
            )
        value: Residency = True
        if pages is not None:
            ids = as_page_ids(pages)
            if len(ids) != node.num_pages:
                raise InvalidArgument(f"node {node.node_id} has {node.num_pages} pages, got {len(ids)} ids")
            value = ids.tobytes()
        self._add_residency(node, slot, value)

    def _add_residency(self, node: Node, slot: Slot, value: Residency) -> None:
        index = self._slot_index(slot)
        parent = node.parent
        if parent.parent is not None:  # type: ignore[union-attr]
            count = parent.resident_children.get(slot, 0)  # type: ignore[union-attr]
            parent.resident_children[slot] = count + 1  # type: ignore[union-attr]
            if count == 0:
                index.discard_leaf(parent)  # type: ignore[arg-type]
        node.residency[slot] = value
        if slot < 0:
            self._count(node.namespace, slot, node.num_pages)
            if HOST_SLOT in node.residency and DISK_SLOT in node.residency and not node.lock_total:
                self._clean_host += node.num_pages
        if self.observer is not None:
            self.observer.added(node, slot)
        if slot == DISK_SLOT:
            self._settle_tokens(node)
        if self._is_protected(node, slot):
            index.protected += node.num_pages
        else:
            index.evictable += node.num_pages
            index.add_leaf(node)

    def _drop_residency(self, node: Node, slot: Slot) -> Residency:
        if node.resident_children.get(slot):
            raise ResidencyError(
                f"node {node.node_id} has children resident in {_slot_name(slot)}; drop them first"
            )
        index = self._slots[slot]
        if slot < 0 and HOST_SLOT in node.residency and DISK_SLOT in node.residency and not node.lock_total:
            self._clean_host -= node.num_pages
        value = node.residency.pop(slot)
        if node.swa and slot in node.swa:
            del node.swa[slot]
        if self.observer is not None:
            self.observer.dropped(node, slot)
        if slot < 0:
            self._count(node.namespace, slot, -node.num_pages)
        if self._is_protected(node, slot):
            index.protected -= node.num_pages
        else:
            index.evictable -= node.num_pages
            index.discard_leaf(node)
        parent = node.parent
        if parent.parent is not None:  # type: ignore[union-attr]
            count = parent.resident_children[slot] - 1  # type: ignore[union-attr]
            if count:
                parent.resident_children[slot] = count  # type: ignore[union-attr]
            else:
                del parent.resident_children[slot]  # type: ignore[union-attr]
                if not self._is_protected(parent, slot):  # type: ignore[arg-type]
                    index.add_leaf(parent)  # type: ignore[arg-type]
        if not node.residency and not node.lock_total:
            self._remove(node)
        elif slot >= 0:
            self._settle_tokens(node)
        return value

    def _settle_tokens(self, node: Node) -> None:
        """Drop ``node``'s tokens if it is on disk and in no device pool (see the module
        docstring: matches on device pages stay a memcmp)."""
        if node.tokens and DISK_SLOT in node.residency and not any(slot >= 0 for slot in node.residency):
            del node.parent.by_tokens[node.tokens[: len(node.tokens) // node.num_pages]]  # type: ignore[union-attr]
            node.tokens = b""

    def _protect(self, node: Node, slot: Slot) -> None:
        index = self._slots[slot]
        index.evictable -= node.num_pages
        index.protected += node.num_pages
        index.discard_leaf(node)

    def _unprotect(self, node: Node, slot: Slot) -> None:
        index = self._slots[slot]
        index.protected -= node.num_pages
        index.evictable += node.num_pages
        if not node.resident_children.get(slot):
            index.add_leaf(node)

    def _remove(self, node: Node) -> None:
        # Only reached for a node in no tier and without references; its children, which
        # could live nowhere either, were removed before it (leaf-first).
        assert not node.children, node
        parent = node.parent
        del parent.children[node.page_keys[:PAGE_KEY_BYTES]]  # type: ignore[union-attr]
        if node.tokens:
            del parent.by_tokens[node.tokens[: len(node.tokens) // node.num_pages]]  # type: ignore[union-attr]
        del self._nodes[node.node_id]
        if node.checkpoint is not None and self.on_remove is not None:
            self.on_remove(node)

    def check_invariants(self, deferred: "list[Callable[[], None]] | None" = None) -> None:
        """Verify every structure against a full walk. O(nodes + pages). The structures
        are copied first (:meth:`_snapshot`: what the tree's owner must wait for), then
        checked (most of the time, the page keys' hashes among it): now, or —
        ``deferred`` given — by the callable appended to it, on any thread, later,
        whatever the tree does meanwhile."""
        snapshot = self._snapshot()
        if deferred is None:
            _check_snapshot(snapshot)
        else:
            deferred.append(lambda: _check_snapshot(snapshot))

    def _snapshot(self) -> "_Snapshot":
        """What :func:`_check_snapshot` checks, as it is now: each node's fields with
        nodes named by id (dicts and tuples of numbers and bytes, which the cyclic
        collector leaves alone), the indexes, the counts. Each child is the registry's
        node of its id (checked here: ids stand for nodes from now on)."""
        nodes: dict[int, _View] = {}
        registry = self._nodes
        view, none = tuple.__new__, _NONE  # (a _View without its constructor's Python frame: ~3 µs a node in all)
        was_enabled = gc.isenabled()
        gc.disable()  # (the views are tuples of numbers, bytes and such dicts: the next collection lets them go)
        try:
            for node_id, node in registry.items():
                if node.children:
                    children: dict[bytes, int] = {}
                    for first, child in node.children.items():
                        assert registry.get(child.node_id) is child, f"node registry disagrees with the tree at {child}"
                        children[first] = child.node_id
                else:
                    children = none
                by_tokens = {t: c.node_id for t, c in node.by_tokens.items()} if node.by_tokens else none
                parent = node.parent
                nodes[node_id] = view(_View, (
                    node.namespace, -1 if parent is None else parent.node_id, node.tokens, node.page_keys,
                    node.num_pages, children, by_tokens, dict(node.residency) if node.residency else none,
                    dict(node.resident_children) if node.resident_children else none,
                    dict(node.lock_ref) if node.lock_ref else none, node.lock_total))
        finally:
            if was_enabled:
                gc.enable()
        slots = {}
        for slot, index in self._slots.items():
            slots[slot] = _SlotView(
                index.evictable, index.protected, {n.node_id for n in index.leaves},
                {ns: {n.node_id for n in leaves} for ns, leaves in index.by_ns.items()}, list(index.heap),
                {n.node_id: index.key(n) for n in index.leaves})
        return _Snapshot(
            nodes, [(ns, entry.root.node_id, entry.page_size, entry.page_bytes) for ns, entry in self._namespaces.items()],
            dict(self._direct_locks), slots, self._clean_host, {ns: list(c) for ns, c in self._ns_pages.items()},
            {g: list(c) for g, c in self._group_pages.items()}, dict(self._group_of))


_NONE: dict = {}  # a snapshot's empty dicts (never changed)


class _View(NamedTuple):
    """A node as :meth:`HiRadixTree._snapshot` found it; other nodes by id."""

    namespace: NamespaceId
    parent: int  # -1: a root
    tokens: bytes
    page_keys: bytes
    num_pages: int
    children: dict[bytes, int]
    by_tokens: dict[bytes, int]
    residency: dict[Slot, Residency]
    resident_children: dict[Slot, int]
    lock_ref: dict[LockKey, int]
    lock_total: int


class _SlotView(NamedTuple):
    evictable: int
    protected: int
    leaves: set[int]
    by_ns: dict[NamespaceId, set[int]]
    heap: list[tuple[Any, int, int]]
    keys: dict[int, Any]  # each leaf's eviction key


class _Snapshot(NamedTuple):
    nodes: dict[int, _View]
    namespaces: list[tuple[NamespaceId, int, int, int]]  # (namespace, root's id, page size, page bytes)
    direct_locks: dict[tuple[int, LockKey], int]
    slots: dict[Slot, _SlotView]
    clean_host: int
    ns_pages: dict[NamespaceId, list[int]]
    group_pages: dict[str, list[int]]
    group_of: dict[NamespaceId, str]


def _check_snapshot(snap: _Snapshot) -> None:
    """:meth:`HiRadixTree.check_invariants` of a snapshot (any thread)."""
    views = snap.nodes
    seen: set[int] = set()
    expected_locks: dict[int, dict[LockKey, int]] = {}
    for (node_id, lock_key), count in snap.direct_locks.items():
        assert count > 0, (node_id, lock_key, count)
        assert node_id in views, f"direct lock on dead node {node_id}"
        expected_locks.setdefault(node_id, {})[lock_key] = count
    sizes: dict[Slot, list[int]] = {}
    leaves: dict[Slot, set[int]] = {}
    owners: dict[Slot, list[tuple[bytes, int]]] = {}  # slot -> (page ids, node id) of each node there
    for namespace, root_id, page_size, page_bytes in snap.namespaces:
        root = views.get(root_id)
        assert root is not None, f"the root of namespace {namespace.hex()} is not in the node registry"
        assert root.parent == -1 and root.num_pages == 0 and not root.residency
        assert root.namespace == namespace
        assert not root.lock_ref and root.lock_total == 0
        seen.add(root_id)
        for first, child in root.children.items():
            assert views[child].page_keys[:PAGE_KEY_BYTES] == first
        assert root.by_tokens == {views[c].tokens[:page_bytes]: c for c in root.children.values() if views[c].tokens}
        # Post-order walk so that lock references can be summed from the children.
        stack: list[tuple[int, bool]] = [(c, False) for c in root.children.values()]
        while stack:
            node_id, children_done = stack.pop()
            if not children_done:
                stack.append((node_id, True))
                stack.extend((c, False) for c in views[node_id].children.values())
                continue
            _check_node(views, node_id, page_size, page_bytes, expected_locks, sizes, leaves, owners)
            assert node_id not in seen, f"node {node_id} reached twice"
            seen.add(node_id)
    assert seen == views.keys(), "node registry disagrees with the tree"
    for slot, held in owners.items():
        _check_owned_once(slot, held)
    for slot, index in snap.slots.items():
        evictable, protected = sizes.get(slot, (0, 0))
        assert (index.evictable, index.protected) == (evictable, protected), (
            _slot_name(slot), (index.evictable, index.protected), (evictable, protected))
        assert index.leaves == leaves.get(slot, set()), f"evictable leaves of {_slot_name(slot)}"
        first_key: dict[int, Any] = {}  # each leaf's smallest key in the kept order: never above its own
        for key, node_id, _ in index.heap:
            if node_id not in first_key or key < first_key[node_id]:
                first_key[node_id] = key
        assert all(n in first_key and not index.keys[n] < first_key[n] for n in index.leaves), (
            f"eviction order of {_slot_name(slot)}")
        by_ns: dict[NamespaceId, set[int]] = {}
        for leaf in index.leaves:
            by_ns.setdefault(views[leaf].namespace, set()).add(leaf)
        assert index.by_ns == by_ns, f"evictable leaves of {_slot_name(slot)} by namespace"
    for slot in sizes:
        assert slot in snap.slots, _slot_name(slot)
    clean = sum(v.num_pages for v in views.values()
                if HOST_SLOT in v.residency and DISK_SLOT in v.residency and not v.lock_total)
    assert snap.clean_host == clean, ("clean host pages", snap.clean_host, clean)
    per_ns: dict[NamespaceId, list[int]] = {}
    per_group: dict[str, list[int]] = {}
    for v in views.values():
        for slot, i in ((HOST_SLOT, 0), (DISK_SLOT, 1)):
            if slot in v.residency:
                per_ns.setdefault(v.namespace, [0, 0])[i] += v.num_pages
                per_group.setdefault(snap.group_of.get(v.namespace, ""), [0, 0])[i] += v.num_pages
    assert {ns: c for ns, c in snap.ns_pages.items() if any(c)} == per_ns, "host / disk pages per namespace"
    assert {g: c for g, c in snap.group_pages.items() if any(c)} == per_group, "host / disk pages per group"


def _check_node(views: dict[int, _View], node_id: int, page_size: int, page_bytes: int,
                expected_locks: dict[int, dict[LockKey, int]], sizes: dict[Slot, list[int]],
                leaves: dict[Slot, set[int]], owners: dict[Slot, list[tuple[bytes, int]]]) -> None:
    node = views[node_id]
    parent = views.get(node.parent)
    what = f"node {node_id}"
    assert parent is not None and parent.children.get(node.page_keys[:PAGE_KEY_BYTES]) == node_id, what
    assert node.namespace == parent.namespace, what
    assert node.num_pages > 0 and len(node.page_keys) == node.num_pages * PAGE_KEY_BYTES, what
    if DISK_SLOT in node.residency and not any(slot >= 0 for slot in node.residency):
        assert not node.tokens, f"node {node_id} is on disk only and keeps its tokens"
    if node.tokens:
        assert len(node.tokens) == node.num_pages * page_bytes, what
        parent_key = parent.page_keys[-PAGE_KEY_BYTES:] if parent.num_pages else ROOT_PARENT_KEY
        assert node.page_keys == chain_page_keys(node.namespace, parent_key, node.tokens, page_size), (
            f"page keys of node {node_id} do not chain from its parent")
    for first, child in node.children.items():
        assert views[child].page_keys[:PAGE_KEY_BYTES] == first and views[child].parent == node_id, child
    assert node.by_tokens == {views[c].tokens[:page_bytes]: c for c in node.children.values() if views[c].tokens}, what
    # Lock references: own direct locks plus the children's references.
    locks = dict(expected_locks.get(node_id, {}))
    for child in node.children.values():
        for lock_key, count in views[child].lock_ref.items():
            locks[lock_key] = locks.get(lock_key, 0) + count
    assert node.lock_ref == locks, (what, node.lock_ref, locks)
    assert node.lock_total == sum(locks.values()), what
    assert all(count > 0 for count in node.lock_ref.values()), what
    # Residency: closure under ancestors, child counts, sizes, leaves, unique pages.
    assert node.residency or node.lock_total, f"node {node_id} lives nowhere"
    for slot, value in node.residency.items():
        if parent.parent != -1:
            assert slot in parent.residency, f"{what} resident in {_slot_name(slot)}, parent not"
        if slot == DISK_SLOT:
            assert value is True, what
        else:
            assert slot >= HOST_SLOT and isinstance(value, bytes), what
            assert len(value) == node.num_pages * _ID_BYTES, what
            owners.setdefault(slot, []).append((value, node_id))
        protected = _protected(node.lock_ref, node.lock_total, slot)
        counts = sizes.setdefault(slot, [0, 0])
        counts[1 if protected else 0] += node.num_pages
        resident_children = sum(1 for c in node.children.values() if slot in views[c].residency)
        assert node.resident_children.get(slot, 0) == resident_children, (what, slot)
        if not protected and not resident_children:
            leaves.setdefault(slot, set()).add(node_id)
    for slot, count in node.resident_children.items():
        assert count > 0 and slot in node.residency, (what, slot, count)


def _protected(lock_ref: dict[LockKey, int], lock_total: int, slot: Slot) -> bool:
    """Whether a node of these locks is kept in ``slot``: a device pool's by a lock of
    that pool, host and disk by any lock."""
    if slot >= 0:
        return _lock_key(slot) in lock_ref
    return lock_total > 0


def _check_owned_once(slot: int, held: list[tuple[bytes, int]]) -> None:
    """No page of ``slot`` is held by two nodes (``held``: each node's page ids there, with
    the node's id). Counted at once: a host tier of a million pages in milliseconds."""
    pages = np.frombuffer(b"".join(ids for ids, _ in held), dtype=PAGE_ID_DTYPE)
    ordered = np.sort(pages, kind="stable")
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(twice):
        page = int(twice[0])
        nodes = [node_id for ids, node_id in held if page in np.frombuffer(ids, dtype=PAGE_ID_DTYPE)]
        nodes = nodes if len(nodes) > 1 else nodes * 2  # (twice in one node)
        raise AssertionError(f"page {page} of {_slot_name(slot)} held by nodes {nodes[0]} and {nodes[1]}")


def _iter_leaves(index: _SlotIndex) -> Iterator[Node]:
    """:meth:`HiRadixTree.iter_evictable` over ``index``'s kept order: entries of nodes
    no longer leaves go, entries whose key grew move down; a node the consumer did not
    evict (skipped, or the last one yielded when it stopped) gets its entry back. A
    parent that becomes a leaf meanwhile is pushed by the tree (``add_leaf``)."""
    heap, leaves, key, nodes = index.heap, index.leaves, index.key, index.nodes
    kept: list[tuple[Any, int, int]] = []  # yielded, still leaves: pushed back at the end
    seen: set[int] = set()
    try:
        while heap:
            entry = heap[0]
            node = nodes.get(entry[1])
            if node is None or node not in leaves or entry[1] in seen:
                heapq.heappop(heap)  # (an entry left behind, or a second one of a node met already)
                continue
            current = key(node)
            if current != entry[0]:
                index.pushed += 1
                heapq.heapreplace(heap, (current, entry[1], index.pushed))
                continue
            heapq.heappop(heap)
            seen.add(entry[1])
            kept.append(entry)
            yield node
            heap = index.heap  # (a push may have rebuilt it)
    finally:
        for entry in kept:
            node = nodes.get(entry[1])
            if node is not None and node in leaves:
                heapq.heappush(index.heap, entry)


def swa_first(node: Node, slot: Slot) -> int:
    """The first of ``node``'s pages whose SWA layers' bytes ``slot``'s copy holds (see
    :attr:`Node.swa`)."""
    return node.swa.get(slot, 0) if node.swa else 0


def _slot_name(slot: Slot) -> str:
    if slot == HOST_SLOT:
        return "the host tier"
    if slot == DISK_SLOT:
        return "the disk tier"
    return f"device pool {slot}"


def _as_ids(value: Residency) -> PageIds | None:
    if value is True:
        return None
    return np.frombuffer(value, dtype=PAGE_ID_DTYPE)  # type: ignore[arg-type]
