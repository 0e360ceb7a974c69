"""The storage port: what the tier manager needs from a disk (or remote) tier.

A record is one host page as is (``KVSpec.host_page_bytes`` bytes, every rank and
layer of one page), stored under its 16-byte page key, with metadata from which the
tree's disk residency is rebuilt after a restart::

    page key ──> payload   (header + host page bytes; checksum verified on every read)
             └─> metadata  (namespace, parent page key, the page's token ids, spec
                            fingerprint, payload size, last access)

Writes are asynchronous: :meth:`StorageBackend.put` (or :meth:`StorageBackend.put_batch`,
the same records as columns) and :meth:`StorageBackend.delete`
queue work for the backend's writer and return a :class:`concurrent.futures.Future`
that completes once the batch is committed (a committed batch survives the process
being killed) — the caller keeps the source pages pinned until then. Reads are
synchronous, run on the caller's thread, and never wait behind a write.

A record that fails any integrity check on read is reported missing and counted, never
returned. Backends with a byte capacity evict least-recently-used records and report
which, so the tree can forget them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import NamedTuple, Protocol, Union

import numpy as np
import torch

from hicache.keys import PAGE_KEY_BYTES  # (re-exported for backends)

# A destination the payload is copied into: a writable, contiguous byte buffer of
# exactly the payload size (a host page of the host pool, a numpy array, a bytearray).
Buffer = Union[torch.Tensor, np.ndarray, bytearray, memoryview]


class PageMeta(NamedTuple):  # (tuples: built per page on the write path, far cheaper than frozen dataclasses)
    """What the tree needs to put a page back where it was."""

    namespace: bytes  # 16-byte namespace id
    parent: bytes  # page key of the previous page (16 zero bytes for the first page)
    tokens: bytes  # the page's token ids, packed little-endian int32
    payload_size: int = 0  # set by the backend on write
    last_access_s: float = 0.0  # unix time, kept by the backend
    fingerprint: bytes = b""  # the KV spec's, set by the backend from the put


class PageRecord(NamedTuple):
    key: bytes  # 16-byte page key
    payload: Buffer  # the host page bytes (read by the writer before the future completes)
    meta: PageMeta


class PageBatch(NamedTuple):
    """Records as columns, with no Python object per page: what the disk writer puts.

    Record ``i`` is page key ``keys[16i:16i+16]``, with namespace and parent page key
    from the same 16-byte slots of ``namespaces`` and ``parents``, the ``i``-th of the
    equal slices of ``tokens``, and the payload in row ``rows[i]`` of ``source`` — a 2-D
    uint8 array, one payload per row (a host pool's pages, or their first bytes: each
    row contiguous), read by the writer before the put's future completes."""

    keys: bytes
    namespaces: bytes
    parents: bytes
    tokens: bytes
    source: np.ndarray
    rows: np.ndarray

    @property
    def num_records(self) -> int:
        return len(self.keys) // PAGE_KEY_BYTES


class PutResult(NamedTuple):
    """A committed put: how many records were written, and which keys the backend
    evicted to make room (the caller must drop their disk residency)."""

    written: int
    evicted: tuple[bytes, ...]
    refused: tuple[bytes, ...] = ()  # keys the store did not take (a remote store without room for them)


class StorageStats(NamedTuple):
    records: int
    bytes: int  # payload bytes stored (headers excluded)
    capacity_bytes: int
    map_size_bytes: int  # reserved address space / file size where that means something
    corrupt_records: int  # reads that failed an integrity check since open
    evicted_records: int  # records evicted for capacity since open
    pending_writes: int  # records queued but not committed


class StorageBackend(Protocol):
    """The port the tier manager drives. Implementations: :mod:`hicache.storage.lmdb_backend`."""

    def put(self, records: Sequence[PageRecord], *, fingerprint: bytes) -> Future[PutResult]:
        """Queue ``records`` (one spec, ``fingerprint``) for one committed batch."""

    def put_batch(self, batch: PageBatch, *, fingerprint: bytes) -> Future[PutResult]:
        """:meth:`put` of ``batch``'s records."""

    def put_batches(self, batches: Sequence[PageBatch], *, fingerprint: bytes) -> Future[PutResult]:
        """:meth:`put_batch` of several batches (payloads of different sizes) as one."""

    def get(self, keys: Sequence[bytes], buffers: Sequence[Buffer], *, fingerprint: bytes) -> list[bool]:
        """Copy each present, intact record of spec ``fingerprint`` into its buffer;
        ``False`` where a record is missing, fails a check or is not its buffer's size
        (the buffer may then hold anything) — each record judged on its own. Counts as
        an access for LRU."""

    def delete(self, keys: Sequence[bytes]) -> Future[int]:
        """Queue the deletion of ``keys``; the future gives how many existed."""

    def iter_metadata(self, batch: int | None = None) -> Iterator[tuple[bytes, PageMeta]]:
        """Every stored record's key and metadata, in key order: one consistent snapshot,
        or with ``batch`` one snapshot per ``batch`` records (records written or deleted
        meanwhile may or may not be listed; none is listed twice)."""

    def read_tokens(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The token ids each record's metadata holds (packed), ``None`` for a key that
        is not stored or unreadable: what the tree gives back to a node that leaves
        the disk tier while it stays cached elsewhere."""

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued write is committed; past ``timeout_s`` (``None``:
        no bound) raise ``TimeoutError`` (a writer that hangs)."""

    def stats(self) -> StorageStats: ...

    def close(self, timeout_s: float | None = None) -> None:
        """Commit what is queued, then release the store. Past ``timeout_s`` (``None``:
        no bound) with the writer still busy, raise ``TimeoutError``: the store is closed
        to new work, and what was queued is lost when the process exits (the store stays
        consistent: a batch is committed whole or not at all)."""
