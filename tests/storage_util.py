"""Test helpers for the storage port."""

from __future__ import annotations

from collections.abc import Sequence

from hicache.storage.base import StorageBackend


def stored_run(store: StorageBackend, keys: Sequence[bytes]) -> int:
    """How many of ``keys``, from the first, ``store`` holds a record of (present in its
    metadata listing; payloads not read). O(records): for tests. A backend whose
    ``check_invariants`` holds keeps a payload for every listed key and no other."""
    listed = {key for key, _ in store.iter_metadata()}
    for i, key in enumerate(keys):
        if bytes(key) not in listed:
            return i
    return len(keys)
