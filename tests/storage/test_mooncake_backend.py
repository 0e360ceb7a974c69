"""MooncakeBackend against a real Mooncake Store on loopback (master + segment holder)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.keys import ROOT_PARENT_KEY, chain_page_keys, pack_tokens
from hicache.storage.base import PageBatch

PAGE_SIZE = 16
PAYLOAD = 4096
FINGERPRINT = bytes(range(16))
NAMESPACE = bytes(16)




def _backend(mooncake_store, **kw):
    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig

    return MooncakeBackend(MooncakeConfig(master=mooncake_store.master, **kw))


def _pages(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, n * PAGE_SIZE).astype(np.int32)
    packed = pack_tokens(tokens)
    keys = chain_page_keys(NAMESPACE, ROOT_PARENT_KEY, packed, PAGE_SIZE)
    source = rng.integers(0, 256, (n, PAYLOAD), dtype=np.uint8)
    parents = ROOT_PARENT_KEY + keys[:-16]
    batch = PageBatch(keys, NAMESPACE * n, parents, packed, source, np.arange(n))
    return batch, [keys[i * 16 : (i + 1) * 16] for i in range(n)], source


def test_put_get_bytes_equal_across_clients(mooncake_store):
    writer, reader = _backend(mooncake_store), _backend(mooncake_store)
    try:
        batch, keys, source = _pages(40)
        writer.register(source)
        assert writer.put_batch(batch, fingerprint=FINGERPRINT).result().written == 40
        assert reader.contains(keys + [bytes(16)], namespace=NAMESPACE) == [True] * 40 + [False]
        out = np.zeros((40, PAYLOAD), np.uint8)
        reader.register(out)
        found = reader.get(keys, [out[i] for i in range(40)], fingerprint=FINGERPRINT, namespace=NAMESPACE,
                           token_bytes=PAGE_SIZE * 4)
        assert found == [True] * 40
        assert np.array_equal(out, source)
        # Without token_bytes the reader learns the record's size from the store.
        out2 = np.zeros(PAYLOAD, np.uint8)
        assert reader.get(keys[:1], [out2], fingerprint=FINGERPRINT, namespace=NAMESPACE) == [True]
        assert np.array_equal(out2, source[0])
        assert reader.corrupt_records == 0
    finally:
        writer.close()
        reader.close()


def test_bad_records_read_as_missing_and_are_counted(mooncake_store):
    from hicache.storage.mooncake_backend import object_name

    backend = _backend(mooncake_store)
    try:
        batch, keys, source = _pages(4, seed=1)
        backend.put_batch(batch, fingerprint=FINGERPRINT).result()
        out = np.zeros((4, PAYLOAD), np.uint8)
        # Another spec's fingerprint: missing, and counted (never another spec's bytes).
        assert backend.get(keys[:1], [out[0]], fingerprint=bytes(16), namespace=NAMESPACE, token_bytes=64) == [False]
        assert backend.corrupt_records == 1
        # A flipped payload byte, written by a raw Mooncake client over the object.
        raw = backend._store
        blob = bytearray(raw.get(object_name(NAMESPACE, keys[1])))
        assert len(blob) == 96 + 64 + PAYLOAD
        blob[-1] ^= 0xFF
        assert raw.upsert(object_name(NAMESPACE, keys[1]), bytes(blob)) == 0
        # A value of the wrong size under a good key.
        assert raw.upsert(object_name(NAMESPACE, keys[2]), b"short") == 0
        found = backend.get(keys, [out[i] for i in range(4)], fingerprint=FINGERPRINT, namespace=NAMESPACE, token_bytes=64)
        assert found == [True, False, False, True]
        assert np.array_equal(out[0], source[0]) and np.array_equal(out[3], source[3])
        assert backend.corrupt_records == 3
        # A key nobody stored is missing, not corrupt.
        assert backend.get([bytes(16)], [out[0]], fingerprint=FINGERPRINT, namespace=NAMESPACE, token_bytes=64) == [False]
        assert backend.corrupt_records == 3
    finally:
        backend.close()


def test_a_purge_removes_every_object_of_its_namespaces_and_no_other(mooncake_store):
    """Objects are named by namespace: a purge removes all of a namespace's — leased
    ones too (just read by another client) — and none of another namespace's, nor a
    key of the purged namespace's that another namespace holds; ``delete`` removes
    single pages of one namespace (leased too: the lookups just asked for them)."""
    other = bytes([7]) * 16
    writer, reader = _backend(mooncake_store), _backend(mooncake_store)
    try:
        batch, keys, source = _pages(8, seed=6)
        writer.register(source)
        assert writer.put_batch(batch, fingerprint=FINGERPRINT).result().written == 8
        theirs = PageBatch(batch.keys, other * 8, batch.parents, batch.tokens, source, batch.rows)
        assert writer.put_batch(theirs, fingerprint=FINGERPRINT).result().written == 8
        out = np.zeros((8, PAYLOAD), np.uint8)
        reader.register(out)
        assert reader.get(keys, [out[i] for i in range(8)], fingerprint=FINGERPRINT, namespace=NAMESPACE,
                          token_bytes=64) == [True] * 8  # (leased now)
        assert writer.purge([NAMESPACE, bytes([9]) * 16]) == 8
        assert reader.contains(keys, namespace=NAMESPACE) == [False] * 8
        assert reader.contains(keys, namespace=other) == [True] * 8
        assert writer.purge([NAMESPACE]) == 0
        assert writer.delete(keys[:3], namespace=other).result() == 3
        assert reader.contains(keys, namespace=other) == [False] * 3 + [True] * 5
    finally:
        writer.close()
        reader.close()


def test_master_down_raises_unavailable_and_recovers(mooncake_store):
    from hicache.storage.mooncake_backend import RemoteUnavailable

    backend = _backend(mooncake_store)
    try:
        batch, keys, source = _pages(2, seed=2)
        backend.put_batch(batch, fingerprint=FINGERPRINT).result()
        mooncake_store.kill_master()
        with pytest.raises(RemoteUnavailable):
            backend.contains(keys, namespace=NAMESPACE)
        with pytest.raises(RemoteUnavailable):
            backend.purge([NAMESPACE])
        mooncake_store.start_master()
        mooncake_store.wait_segment()  # the holder re-mounts its segment on the new master
        # The new master knows nothing stored before: misses, and puts work again.
        assert backend.contains(keys, namespace=NAMESPACE) == [False, False]
        assert backend.put_batch(batch, fingerprint=FINGERPRINT).result().written == 2
        assert backend.contains(keys, namespace=NAMESPACE) == [True, True]
    finally:
        backend.close()


def test_bad_config_is_refused():
    from hicache.errors import InvalidArgument
    from hicache.storage.mooncake_backend import MooncakeConfig

    for bad in ({"master": "nohost"}, {"master": "h:1", "protocol": "udp"}, {"master": "h:1", "segment_bytes": -1}):
        with pytest.raises(InvalidArgument):
            MooncakeConfig(**bad)


def test_records_one_by_one_round_trip(mooncake_store):
    """The port's ``put`` of records (numpy, torch and bytes payloads) reads back equal."""
    import torch

    from hicache.storage.base import PageMeta, PageRecord

    backend = _backend(mooncake_store)
    try:
        batch, keys, source = _pages(3, seed=4)
        payloads = [source[0], torch.from_numpy(source[1].copy()), bytearray(source[2].tobytes())]
        records = [PageRecord(keys[i], payloads[i], PageMeta(NAMESPACE, batch.parents[16 * i : 16 * i + 16],
                                                             batch.tokens[64 * i : 64 * i + 64])) for i in range(3)]
        assert backend.put(records, fingerprint=FINGERPRINT).result().written == 3
        out = np.zeros((3, PAYLOAD), np.uint8)
        assert backend.get(keys, [out[i] for i in range(3)], fingerprint=FINGERPRINT, namespace=NAMESPACE, token_bytes=64) == [True] * 3
        assert np.array_equal(out, source)
    finally:
        backend.close()


def test_an_unregistered_buffer_frees_its_range(mooncake_store):
    """Mooncake refuses a region that overlaps a registered one: a buffer unregistered
    (a closed manager's host pool) lets go of its range, now and — for a backend that
    joins the store later — when it joins (it is not registered again then)."""
    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig

    memory = np.zeros((4, PAYLOAD), np.uint8)
    joined = _backend(mooncake_store)
    lazy = MooncakeBackend(MooncakeConfig(master=mooncake_store.master), lazy=True)
    try:
        for backend in (joined, lazy):
            backend.register(memory[:2])
            backend.unregister(memory[:2])
            backend.register(memory[1:])
            assert backend.contains([bytes(16)], namespace=NAMESPACE) == [False]
    finally:
        joined.close()
        lazy.close()


def test_close_gives_up_at_its_time_limit_when_the_store_hangs():
    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig
    from storage_util import HungMooncakeStore

    store = HungMooncakeStore()
    backend = MooncakeBackend(MooncakeConfig(master="127.0.0.1:1"), store=store)
    try:
        with pytest.raises(TimeoutError):
            backend.close(0.01)
        assert store.closing.wait(60)  # the store's close was called, and is still hung
        backend.close(0.01)  # (closed already: nothing to wait for)
    finally:
        store.release.set()
