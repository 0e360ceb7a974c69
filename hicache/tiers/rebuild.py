"""Warm restart: the disk tier's records back into a new tree as disk-resident pages."""

from __future__ import annotations

import gc
import logging
from collections.abc import Generator, Iterator

from hicache.keys import ROOT_PARENT_KEY, TOKEN_BYTES, NamespaceId, page_key_function
from hicache.spec import KVSpec
from hicache.storage.base import StorageBackend
from hicache.tree import DISK_SLOT, HiRadixTree, Node, Tier

logger = logging.getLogger(__name__)

REBUILD_PROGRESS_EVERY = 16384  # records between two progress calls of a rebuild


def rebuild_steps(tree: HiRadixTree, storage: StorageBackend, spec: KVSpec,
                  every: int = REBUILD_PROGRESS_EVERY, checkpoints: list | None = None) -> Iterator[int]:
    """:func:`_rebuild_steps`, with the cyclic garbage collector paused while a step
    works (not between steps). A rebuild makes several objects a record that live until
    it ends; the collector's passes over them took ~20% of a rebuild, and reclaim
    nothing (the rebuild makes no reference cycles). (The daemon pauses it for the whole
    of a background rebuild already: ``hicache.daemon.specs``; this is for every other
    caller, ``TierManager.rebuild_from_storage`` first.)"""
    return _collector_paused(_rebuild_steps(tree, storage, spec, every, checkpoints))


def _collector_paused(steps: Generator[int, None, int]) -> Generator[int, None, int]:
    while True:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            done = next(steps)
        except StopIteration as stop:
            return stop.value
        finally:
            if was_enabled:
                gc.enable()
        yield done


def _rebuild_steps(tree: HiRadixTree, storage: StorageBackend, spec: KVSpec,
                   every: int, checkpoints: list | None) -> Generator[int, None, int]:
    """Put every persisted page of ``spec`` back into ``tree`` as disk-resident; records
    of this spec that no chain from a first page reaches (a page before them is gone,
    belongs to another namespace or is not a page's size) are deleted. A generator: it
    yields the records done so far every ``every`` records (reading the store's
    metadata, then walking it), and returns the pages restored. Between two steps the
    owner thread may serve other work, as long as nothing else touches this tree.

    Walks the records top-down from each sequence's first page, once each: the time is
    O(records) plus one tree restore per leaf, however long the shared prefixes are
    (walking up from every leaf instead was O(leaves x depth): 23 s for 450,000 pages
    under 1,000-page shared prompts). Each record's key is checked against its tokens
    once (a record whose key is not its tokens' is unreached, and so is everything
    below it; so is a record of another size than a page, which every read would find
    missing), and the restores take
    the checked keys: a restore under a shared prefix then compares the prefix by key
    instead of hashing its pages again (the tree keeps no tokens on disk-only nodes).

    Checkpoint records of this spec (no tokens: :mod:`hicache.tiers.checkpoints`) are
    not pages: each one's ``(key, boundary page key, payload size)`` is appended to
    ``checkpoints`` (left alone when it is ``None``)."""
    page_bytes = spec.page_size * TOKEN_BYTES
    # A page's record holds the whole host page, or (SWA) only what is kept outside the window.
    payload_sizes = {spec.host_page_bytes}
    if spec.swa_window and spec.kept_page_bytes:
        payload_sizes.add(spec.kept_page_bytes)
    fingerprint = spec.fingerprint
    metas = {}
    for done, (key, meta) in enumerate(storage.iter_metadata(batch=every), 1):
        if meta.fingerprint == fingerprint:
            if len(meta.tokens) == page_bytes:
                metas[key] = meta
            elif not meta.tokens and checkpoints is not None:
                checkpoints.append((key, meta.parent, meta.payload_size))
        if done % every == 0:
            yield done
    children: dict[bytes, list[bytes]] = {}
    for done, (key, meta) in enumerate(metas.items(), 1):
        children.setdefault(meta.parent, []).append(key)
        if done % every == 0:
            yield done
    hashes = {}  # namespace -> its page key function

    def chained(key: bytes, parent: bytes, namespace: bytes) -> bool:
        """Is ``key`` the key of its record's tokens after ``parent`` (one page's hash),
        and the record a page's size? Then the tree may take it as is, without hashing
        the path again."""
        page_key = hashes.get(namespace)
        if page_key is None:
            page_key = hashes[namespace] = page_key_function(NamespaceId(namespace))
        meta = metas[key]
        return meta.payload_size in payload_sizes and page_key(parent, meta.tokens) == key

    reached: set[bytes] = set()
    for first in children.get(ROOT_PARENT_KEY, ()):
        namespace = NamespaceId(metas[first].namespace)
        if not chained(first, ROOT_PARENT_KEY, namespace):
            continue
        tree.add_namespace(namespace, spec.page_size)
        path: list[bytes] = []  # the page tokens from the first page down to the current one
        path_keys: list[bytes] = []  # and their keys
        # (page, its depth, the restored node above it (None: the root), that node's depth)
        stack: list[tuple[bytes, int, Node | None, int]] = [(first, 0, None, 0)]
        while stack:
            key, depth, above, above_depth = stack.pop()
            reached.add(key)
            if len(reached) % every == 0:
                yield len(reached)
            del path[depth:], path_keys[depth:]
            path.append(metas[key].tokens)
            path_keys.append(key)
            below = [child for child in children.get(key, ())
                     if metas[child].namespace == namespace and chained(child, key, namespace)]
            if len(below) == 1:
                stack.append((below[0], depth + 1, above, above_depth))
                continue
            # The end of a sequence, or where sequences part: restore the pages since the
            # last such place, under its node (each page joined and walked once).
            node = tree.restore(namespace, b"".join(path[above_depth:]), b"".join(path_keys[above_depth:]), above)
            stack.extend((child, depth + 1, node, depth + 1) for child in below)
    if spec.swa_window and spec.kept_page_bytes:
        yield from _swa_from_sizes(tree, metas, spec.host_page_bytes, spec.window_pages, every)
    orphans = []
    for done, key in enumerate(metas, 1):
        if key not in reached:
            orphans.append(key)
        if done % every == 0:
            yield done
    if orphans:
        logger.warning("deleting %d disk records that no sequence reaches", len(orphans))
        storage.delete(orphans)
    # Let go of the index a batch at a time too: freeing 450,000 records at once takes
    # ~0.1 s.
    reached.clear()
    for index in (children, metas):
        for done in range(1, len(index) + 1):
            index.popitem()
            if done % every == 0:
                yield done
    return tree.sizes(Tier.DISK).cached


def _swa_from_sizes(tree: HiRadixTree, metas: dict, full_bytes: int, window_pages: int,
                    every: int) -> Iterator[int]:
    """A spec with SWA layers: which restored pages have their SWA bytes (a record of a
    whole host page) and which not (a shorter one: hicache.tiers.windows). A restored
    node may join several that were written (a child shorter than the window joins its
    parent's run of such pages), so nodes are cut where a run of pages with them ends
    and, inside a run longer than the window, every ``window_pages`` pages before its
    end: each node then holds those pages for its last ``window_pages`` at most, as
    when they were written."""
    done = 0
    for node in [n for n in tree.nodes() if n.on_disk]:
        live = [metas[key].payload_size == full_bytes for key in node.page_key_list()]
        done += len(live)
        if done >= every:
            done = 0
            yield len(metas)
        if all(live) and len(live) <= window_pages:
            continue
        ends = []  # where the pieces end (the node's own end last)
        i = 0
        while i < len(live):
            if not live[i]:
                i += 1
                continue
            j = i
            while j < len(live) and live[j]:
                j += 1
            if window_pages:
                ends.extend(range(j - window_pages, i, -window_pages))
            ends.append(j)
            i = j
        start = 0
        for end in sorted(set(ends) - {len(live)}):
            upper = tree.split(node, end - start)
            tree.set_swa(upper, DISK_SLOT, _first_kept(live[start:end], window_pages))
            start = end
        tree.set_swa(node, DISK_SLOT, _first_kept(live[start:], window_pages))


def _first_kept(live: list[bool], window_pages: int) -> int:
    """A piece's first page whose SWA bytes count (the first with them; never one
    before its last ``window_pages``)."""
    first = next((i for i, ok in enumerate(live) if ok), len(live))
    return max(first, len(live) - window_pages)
