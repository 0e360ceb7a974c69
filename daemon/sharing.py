"""Prefix sharing, on or off (for the daemon, or for some ``extra_key``s).

A policy works on a tier manager and a pool; what it returns is all the daemon needs to
answer (the daemon makes the session's node handles and the reply).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from hicache.keys import NamespaceId
from hicache.pages import PageIds
from hicache.tiers import Hit, TierManager
from hicache.tree import InsertResult, PoolId


class SharingPolicy(Protocol):
    def match(self, manager: TierManager, namespace: NamespaceId, tokens: bytes, pool_id: PoolId) -> Hit | Future | None:
        """The cached prefix (a future of it when the prefetch policy waits for the disk),
        or ``None``: nothing is shared."""

    def insert(self, manager: TierManager, pool_id: PoolId, namespace: NamespaceId, tokens: bytes,
               pages: PageIds, ends=()) -> InsertResult | None:
        """Store the whole pages of ``tokens`` (node boundaries kept after ``ends``
        pages); ``None``: not stored, the pages went back to the pool."""


class RadixSharing:
    """Prefix sharing through the tree (the normal case)."""

    def match(self, manager, namespace, tokens, pool_id):
        return manager.lookup(namespace, tokens, pool_id)

    def insert(self, manager, pool_id, namespace, tokens, pages, ends=()):
        manager.add_namespace(namespace)
        return manager.insert(namespace, tokens, pool_id, pages, ends=ends)


class NoSharing:
    """Sharing off (like SGLang's ChunkCache): every match misses, an insert just gives the
    pages back."""

    def match(self, manager, namespace, tokens, pool_id):
        return None

    def insert(self, manager, pool_id, namespace, tokens, pages, ends=()):
        manager.release(pool_id, pages)
        return None
