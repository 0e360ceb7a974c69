"""The writer side of ``test_crash.py``: a process that fills an LmdbBackend until it is
killed, reporting every batch whose put future has resolved.

Records are pure functions of (batch id, index) — :func:`batch_records` — so the parent
can check a reported batch without having seen its bytes; the metadata's tokens are
(batch id, index), so it can also tell which batch a stored record belongs to.
"""

from __future__ import annotations

import hashlib
from collections import deque

import numpy as np

from hicache.storage.base import PageMeta, PageRecord
from hicache.storage.lmdb_backend import LmdbBackend

FINGERPRINT = hashlib.blake2b(b"crash-test-spec", digest_size=16).digest()
NAMESPACE = hashlib.blake2b(b"crash-test-namespace", digest_size=16).digest()
RECORDS_PER_BATCH = 4
READY = -1


def record_key(batch_id: int, index: int) -> bytes:
    return hashlib.blake2b(f"{batch_id}:{index}".encode(), digest_size=16).digest()


def record_content(key: bytes, size: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def record_size(key: bytes) -> int:
    return 512 + int.from_bytes(key[8:10], "little") % 12_000


def batch_records(batch_id: int) -> list[PageRecord]:
    records = []
    parent = bytes(16)
    for index in range(RECORDS_PER_BATCH):
        key = record_key(batch_id, index)
        meta = PageMeta(namespace=NAMESPACE, parent=parent, tokens=np.array([batch_id, index], dtype="<i4").tobytes())
        records.append(PageRecord(key, record_content(key, record_size(key)), meta))
        parent = key
    return records


def write_until_killed(
    path: str, first_batch_id: int, conn, map_size_bytes: int, writemap: bool, in_flight: int = 4
) -> None:
    """Open the store (in this process, after the fork), then put batches forever, keeping
    ``in_flight`` puts queued; send each batch id once its put has committed."""
    store = LmdbBackend(path, capacity_bytes=1 << 40, map_size_bytes=map_size_bytes, writemap=writemap)
    conn.send(READY)
    pending: deque = deque()
    batch_id = first_batch_id
    while True:
        while len(pending) < in_flight:
            pending.append((batch_id, store.put(batch_records(batch_id), fingerprint=FINGERPRINT)))
            batch_id += 1
        done_id, future = pending.popleft()
        future.result()
        conn.send(done_id)


# The churn writer: each step puts one batch and deletes the batch CHURN_LAG steps
# older, so the store keeps turning its space over; the payload sizes change every
# CHURN_PHASE batches (small, then large pages), so slots of the size in decline are
# freed and their space given back while the writer may be killed.
CHURN_LAG = 12
CHURN_PHASE = 24


def churn_size(batch_id: int, index: int) -> int:
    small = batch_id // CHURN_PHASE % 2 == 0
    return (600 if small else 9000) + 97 * index


def churn_records(batch_id: int) -> list[PageRecord]:
    records = []
    parent = bytes(16)
    for index in range(RECORDS_PER_BATCH):
        key = record_key(batch_id, index)
        meta = PageMeta(namespace=NAMESPACE, parent=parent, tokens=np.array([batch_id, index], dtype="<i4").tobytes())
        records.append(PageRecord(key, record_content(key, churn_size(batch_id, index)), meta))
        parent = key
    return records


def churn_until_killed(path: str, first_batch_id: int, conn, capacity_bytes: int, in_flight: int = 4) -> None:
    """Open the store (in this process), then step forever from ``first_batch_id``:
    put batch ``i`` and delete batch ``i - CHURN_LAG``, keeping ``in_flight`` steps
    queued; send ``i`` once both have committed. The store never has to evict."""
    store = LmdbBackend(path, capacity_bytes=capacity_bytes, max_batch_records=8)
    conn.send(READY)
    pending: deque = deque()
    batch_id = first_batch_id
    while True:
        while len(pending) < in_flight:
            put = store.put(churn_records(batch_id), fingerprint=FINGERPRINT)
            gone = store.delete([record_key(batch_id - CHURN_LAG, i) for i in range(RECORDS_PER_BATCH)])
            pending.append((batch_id, put, gone))
            batch_id += 1
        done_id, put, gone = pending.popleft()
        assert not put.result().evicted, "the churn store evicted: its capacity is too small"
        gone.result()
        conn.send(done_id)
