"""Evicting from a bare tree (no tier manager): what the tree tests and the trace
benchmark's flat-LRU baseline need, built on the tree's public eviction order."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hicache.keys import PageKey, split_page_keys
from hicache.pages import PAGE_ID_DTYPE, PageIds
from hicache.tree import HiRadixTree, PoolId, Tier


class Evicted(NamedTuple):
    """What an eviction removed from one tier. ``page_ids`` are the freed device or host
    pages (empty for the disk tier); :meth:`page_keys` the keys of every evicted page."""

    num_pages: int
    page_ids: PageIds
    key_blobs: tuple[bytes, ...]

    def page_keys(self) -> list[PageKey]:
        return split_page_keys(b"".join(self.key_blobs))


def evict(tree: HiRadixTree, tier: Tier, num_pages: int, pool: PoolId | None = None) -> Evicted:
    """Drop at least ``num_pages`` pages from one tier (fewer if not enough are
    evictable), unprotected leaves first in policy order."""
    freed = 0
    ids: list[PageIds] = []
    key_blobs: list[bytes] = []
    if num_pages > 0:
        for node in tree.iter_evictable(tier, pool):
            freed += node.num_pages
            key_blobs.append(node.page_keys)
            pages = tree.drop(node, tier, pool)
            if pages is not None:
                ids.append(pages)
            if freed >= num_pages:
                break
    else:
        tree.sizes(tier, pool)  # the same argument checks as an eviction
    page_ids = np.concatenate(ids) if ids else np.empty(0, dtype=PAGE_ID_DTYPE)
    return Evicted(freed, page_ids, tuple(key_blobs))
