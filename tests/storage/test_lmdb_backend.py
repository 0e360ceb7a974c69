"""LmdbBackend: round trips, integrity checks, LRU capacity, map growth, errors.

Payload bytes are derived from the key and size (:func:`content`), so any record read
back can be checked without remembering what was written.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from hicache.errors import HicacheError, InvalidArgument, StorageUnavailable
from hicache.storage.base import PageBatch, PageMeta, PageRecord, PutResult, StorageStats
from hicache.storage import lmdb_backend
from hicache.storage.lmdb_backend import LmdbBackend
from storage_util import stored_run

FP = hashlib.blake2b(b"spec-a", digest_size=16).digest()
OTHER_FP = hashlib.blake2b(b"spec-b", digest_size=16).digest()
NS = hashlib.blake2b(b"namespace", digest_size=16).digest()
ROOT = bytes(16)


def key_of(name) -> bytes:
    return hashlib.blake2b(repr(name).encode(), digest_size=16).digest()


def content(key: bytes, size: int) -> np.ndarray:
    seed = int.from_bytes(key[:8], "little") ^ size
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def meta_for(key: bytes, parent: bytes = ROOT, num_tokens: int = 4) -> PageMeta:
    tokens = np.frombuffer(key * num_tokens, dtype="<i4")[:num_tokens].tobytes()
    return PageMeta(namespace=NS, parent=parent, tokens=tokens)


def record(key: bytes, size: int, payload=None) -> PageRecord:
    return PageRecord(key=key, payload=content(key, size) if payload is None else payload, meta=meta_for(key))


def read(store: LmdbBackend, key: bytes, size: int, fingerprint: bytes = FP) -> np.ndarray | None:
    buffer = np.full(size, 0xA5, dtype=np.uint8)
    return buffer if store.get([key], [buffer], fingerprint=fingerprint) == [True] else None


@pytest.fixture
def open_store(tmp_path):
    """Open stores under ``tmp_path``; all are closed at teardown."""
    opened: list[LmdbBackend] = []

    def _open(name: str = "store", **kwargs) -> LmdbBackend:
        kwargs.setdefault("capacity_bytes", 64 << 20)
        store = LmdbBackend(tmp_path / name, **kwargs)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batches=st.lists(
        st.lists(st.tuples(st.integers(0, 30), st.integers(1, 70_000), st.integers(0, 16)), min_size=1, max_size=8),
        min_size=1,
        max_size=4,
    )
)
def test_round_trip_random_records(tmp_path, batches):
    path = tmp_path / uuid.uuid4().hex
    model: dict[bytes, tuple[int, PageMeta]] = {}
    with LmdbBackend(path, capacity_bytes=64 << 20) as store:
        futures = []
        for batch in batches:
            records = []
            for name, size, num_tokens in batch:
                key = key_of(name)
                meta = meta_for(key, parent=key_of(("parent", name)), num_tokens=num_tokens)
                records.append(PageRecord(key, content(key, size), meta))
                model[key] = (size, meta)
            futures.append((store.put(records, fingerprint=FP), len(records)))
        for future, num_records in futures:
            assert future.result() == PutResult(num_records, ())
        store.flush()
        store.check_invariants()

    with LmdbBackend(path, capacity_bytes=64 << 20) as store:
        listed = dict(store.iter_metadata())
        assert set(listed) == set(model)
        for key, (size, meta) in model.items():
            got = listed[key]
            assert (got.namespace, got.parent, got.tokens, got.payload_size, got.fingerprint) == (
                meta.namespace, meta.parent, meta.tokens, size, FP,
            )
            assert got.last_access_s > 0
        keys = list(model)
        buffers = [bytearray(model[key][0]) for key in keys]
        assert store.get(keys, buffers, fingerprint=FP) == [True] * len(keys)
        for key, buffer in zip(keys, buffers, strict=True):
            assert np.array_equal(np.frombuffer(buffer, dtype=np.uint8), content(key, model[key][0]))
        assert store.stats().corrupt_records == 0


def test_get_into_every_buffer_kind(open_store):
    store = open_store()
    size = 4096
    key = key_of("kinds")
    source = torch.from_numpy(content(key, size).copy()).view(torch.bfloat16)  # a typed host page
    assert store.put([PageRecord(key, source, meta_for(key))], fingerprint=FP).result().written == 1
    expected = content(key, size)
    targets = {
        "torch uint8": torch.zeros(size, dtype=torch.uint8),
        "torch float16 2-d": torch.zeros(16, size // 32, dtype=torch.float16),
        "numpy uint8": np.zeros(size, dtype=np.uint8),
        "numpy float32": np.zeros(size // 4, dtype=np.float32),
        "bytearray": bytearray(size),
        "memoryview": memoryview(bytearray(size)),
        "memoryview int32": memoryview(bytearray(size)).cast("i"),
    }
    for name, target in targets.items():
        assert store.get([key], [target], fingerprint=FP) == [True], name
        raw = target.contiguous().view(torch.uint8).numpy().reshape(-1) if isinstance(target, torch.Tensor) else (
            np.frombuffer(target, dtype=np.uint8)
        )
        assert np.array_equal(raw, expected), name


def test_put_reads_payload_sources_of_every_kind(open_store):
    store = open_store()
    size = 1024
    sources = {
        "bytes": lambda a: a.tobytes(),
        "bytearray": lambda a: bytearray(a.tobytes()),
        "memoryview": lambda a: memoryview(a.tobytes()),
        "numpy int16": lambda a: a.view(np.int16),
        "torch": lambda a: torch.from_numpy(a.copy()),
    }
    keys = []
    for name, convert in sources.items():
        key = key_of(("source", name))
        keys.append(key)
        store.put([record(key, size, payload=convert(content(key, size)))], fingerprint=FP).result()
    for key in keys:
        assert np.array_equal(read(store, key, size), content(key, size))


def _patch_file(path: str, offset: int, new: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(new)


def _find_unique(path: str, pattern: bytes) -> int:
    with open(path, "rb") as f:
        data = f.read()
    offset = data.find(pattern)
    assert offset >= 0 and data.find(pattern, offset + 1) < 0, "pattern not found exactly once"
    return offset


def _payload_with_marker(key: bytes, size: int) -> tuple[np.ndarray, bytes]:
    payload = content(key, size)
    marker = hashlib.blake2b(key, digest_size=32).digest()
    payload[:32] = np.frombuffer(marker, dtype=np.uint8)
    return payload, marker


def test_a_read_error_in_one_records_bytes_names_it_and_the_others_are_judged_on_their_own(
        open_store, tmp_path, monkeypatch):
    """The slab's bytes under one record of a get fail with EIO at every read (a bad
    sector), the other records beside it, in the same run of slots: the get reads the
    run again one record at a time, copies the others, and raises RecordsUnreadable —
    a StorageUnavailable that names the unreadable record and carries what it found of
    the others — so one bad record does not make the others of a read unknown. The
    unreadable record is neither counted corrupt nor deleted."""
    import errno

    from hicache.errors import StorageUnavailable

    size = 20_000
    keys = [key_of(("sector", i)) for i in range(4)]
    store = open_store()
    payloads = {key: _payload_with_marker(key, size) for key in keys}
    store.put([record(key, size, payload=payloads[key][0]) for key in keys], fingerprint=FP).result()
    slab = str(tmp_path / "store" / f"slab-{lmdb_backend.slot_bytes_for(size)}.bin")
    bad = _find_unique(slab, payloads[keys[2]][1]) + 100
    real_preadv = os.preadv
    slab_ino = os.stat(slab).st_ino

    def preadv(fd, buffers, offset):
        length = sum(memoryview(b).nbytes for b in buffers)
        if os.fstat(fd).st_ino == slab_ino and offset <= bad < offset + length:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(lmdb_backend.os, "preadv", preadv)
    buffers = [np.zeros(size, dtype=np.uint8) for _ in keys]
    with pytest.raises(StorageUnavailable) as raised:
        store.get(keys, buffers, fingerprint=FP)
    assert getattr(raised.value, "unreadable", None) == [2], "the get did not name the unreadable record"
    assert raised.value.found == [True, True, False, True]
    assert all(np.array_equal(buffers[i], payloads[keys[i]][0]) for i in (0, 1, 3))
    store.flush()
    assert store.stats().corrupt_records == 0
    assert sorted(k for k, _ in store.iter_metadata()) == sorted(keys)
    monkeypatch.setattr(lmdb_backend.os, "preadv", real_preadv)
    assert np.array_equal(read(store, keys[2], size), payloads[keys[2]][0])
    store.check_invariants()


def _patch_meta(store_path, key: bytes, offset: int, xor: int) -> None:
    """Flip bits of one byte of ``key``'s metadata record, in place."""
    env = lmdb.open(str(store_path), max_dbs=2)
    try:
        meta_db = env.open_db(b"meta")
        with env.begin(write=True, db=meta_db) as txn:
            value = bytearray(txn.get(key))
            value[offset] ^= xor
            txn.put(key, bytes(value))
    finally:
        env.close()


@pytest.mark.parametrize(
    "damage",
    ["payload byte", "last payload byte", "fingerprint", "length field", "checksum", "slot"],
)
def test_damaged_record_reads_as_missing_and_is_purged(open_store, tmp_path, damage):
    size = 20_000
    keys = [key_of(("damage", i)) for i in range(5)]
    victim = keys[2]
    store = open_store()
    payloads = {}
    for key in keys:
        payload, marker = _payload_with_marker(key, size)
        payloads[key] = (payload, marker)
        store.put([record(key, size, payload=payload)], fingerprint=FP).result()
    store.put([record(key_of("spare"), size)], fingerprint=FP).result()
    store.delete([key_of("spare")]).result()  # a free slot past the records: where "slot" points
    store.close()

    slab = str(tmp_path / "store" / f"slab-{lmdb_backend.slot_bytes_for(size)}.bin")
    start = _find_unique(slab, payloads[victim][1])  # first payload byte
    if damage in ("payload byte", "last payload byte"):
        where = start + (1000 if damage == "payload byte" else size - 1)
        with open(slab, "rb") as f:
            f.seek(where)
            old = f.read(1)
        _patch_file(slab, where, bytes([old[0] ^ 0x10]))
    else:
        offset, xor = {"fingerprint": (52, 0x10), "length field": (4, 0x10), "checksum": (80, 0x10),
                       "slot": (72, 0x07)}[damage]  # (slot 2 -> 5: the free one)
        _patch_meta(tmp_path / "store", victim, offset, xor)

    store = open_store()
    assert read(store, victim, size) is None
    assert store.stats().corrupt_records == 1
    for key in keys:
        if key != victim:
            assert np.array_equal(read(store, key, size), payloads[key][0])
    store.flush()  # the writer deletes the corrupt record
    stats = store.stats()
    assert (stats.records, stats.bytes, stats.corrupt_records) == (4, 4 * size, 1)
    assert stored_run(store, [victim]) == 0
    assert victim not in dict(store.iter_metadata())
    store.check_invariants()
    # its slot is free again: the next put takes it, and every record reads back
    store.put([record(key_of("new"), size)], fingerprint=FP).result()
    assert np.array_equal(read(store, key_of("new"), size), content(key_of("new"), size))
    assert all(np.array_equal(read(store, key, size), payloads[key][0]) for key in keys if key != victim)
    store.check_invariants()


def test_a_read_that_fails_with_an_io_error_raises_and_judges_no_record(open_store, tmp_path, monkeypatch):
    """``preadv`` fails with EIO: the bytes were never seen, so the get raises
    StorageUnavailable (the caller's read fails as a whole) and every record stays,
    none counted corrupt. A record that is corrupt (a payload byte flipped) reads as
    missing, but the writer, which cannot read it again now, keeps it — its batch goes
    on — until a later check can tell, and deletes it then."""
    import errno

    from hicache.errors import StorageUnavailable

    size = 20_000
    keys = [key_of(("eio", i)) for i in range(3)]
    store = open_store()
    payloads = {}
    for key in keys:
        payloads[key] = _payload_with_marker(key, size)
        store.put([record(key, size, payload=payloads[key][0])], fingerprint=FP).result()
    real_preadv = os.preadv
    everywhere, in_writer = threading.Event(), threading.Event()

    def preadv(fd, buffers, offset):
        writer = threading.current_thread().name.startswith("hicache-lmdb-writer")
        if everywhere.is_set() or (in_writer.is_set() and writer):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(lmdb_backend.os, "preadv", preadv)
    everywhere.set()
    with pytest.raises(StorageUnavailable):
        store.get(keys, [np.empty(size, dtype=np.uint8) for _ in keys], fingerprint=FP)
    everywhere.clear()
    store.flush()
    assert store.stats().corrupt_records == 0
    assert all(np.array_equal(read(store, key, size), payloads[key][0]) for key in keys)

    victim = keys[1]
    slab = str(tmp_path / "store" / f"slab-{lmdb_backend.slot_bytes_for(size)}.bin")
    where = _find_unique(slab, payloads[victim][1]) + 1000
    with open(slab, "rb") as f:
        f.seek(where)
        old = f.read(1)
    _patch_file(slab, where, bytes([old[0] ^ 0x10]))
    in_writer.set()
    assert read(store, victim, size) is None
    store.put([record(key_of("beside"), size)], fingerprint=FP).result()
    store.flush()
    assert victim in dict(store.iter_metadata()), "a record the writer could not check again was deleted"
    in_writer.clear()
    assert read(store, victim, size) is None
    store.flush()
    assert victim not in dict(store.iter_metadata())
    assert store.stats().corrupt_records == 2
    assert all(np.array_equal(read(store, key, size), payloads[key][0]) for key in keys if key != victim)
    store.check_invariants()


def test_a_slab_file_cut_short_drops_the_records_past_its_end_on_open(open_store, tmp_path):
    size = 10_000
    keys = [key_of(("trunc", i)) for i in range(4)]
    store = open_store()
    store.put([record(key, size) for key in keys], fingerprint=FP).result()
    store.close()
    slot_bytes = lmdb_backend.slot_bytes_for(size)
    os.truncate(tmp_path / "store" / f"slab-{slot_bytes}.bin", 2 * slot_bytes + size - 1)  # slot 2 one byte short

    store = open_store()
    assert stored_run(store, keys) == 2
    assert [read(store, key, size) is not None for key in keys] == [True, True, False, False]
    assert store.stats().corrupt_records == 0  # dropped on open, before any read
    assert (store.stats().records, store.stats().bytes) == (2, 2 * size)
    store.check_invariants()
    store.put([record(key, size) for key in keys[2:]], fingerprint=FP).result()
    assert all(np.array_equal(read(store, key, size), content(key, size)) for key in keys)
    store.check_invariants()


def test_an_index_file_cut_short_is_refused_on_open_not_a_bus_error(open_store, tmp_path):
    """A data.mdb shorter than the pages its meta page names (a machine crash without
    sync, a copy cut short) is a store that cannot be opened: StorageUnavailable, as
    for a file that is no LMDB file at all. Opened in a child process: a mapping read
    past the end of the file is SIGBUS, which would take the test run with it."""
    store = open_store()
    store.put([record(key_of(("index", i)), 700) for i in range(200)], fingerprint=FP).result()
    store.close()
    data = tmp_path / "store" / "data.mdb"
    env = lmdb.open(str(tmp_path / "store"), max_dbs=2, readonly=True)
    try:
        page_bytes, last_page = env.stat()["psize"], env.info()["last_pgno"]
    finally:
        env.close()
    assert last_page > 2
    os.truncate(data, 2 * page_bytes)  # the two meta pages only
    opener = ("from hicache.errors import StorageUnavailable\n"
              "from hicache.storage.lmdb_backend import LmdbBackend\n"
              "try:\n"
              f"    LmdbBackend({str(tmp_path / 'store')!r}, capacity_bytes=1 << 20).close()\n"
              "except StorageUnavailable as exc:\n"
              "    print(exc)\n")
    child = subprocess.run([sys.executable, "-c", opener], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "data.mdb" in child.stdout and "damaged" in child.stdout, child.stdout


def two_records_naming_one_slot(open_store, tmp_path):
    """A closed store of three records of one size, the second's slot patched to the
    first's. Returns the keys and the size."""
    size = 3000
    keys = [key_of(("shared", i)) for i in range(3)]
    store = open_store()
    store.put([record(key, size) for key in keys], fingerprint=FP).result()
    store.close()
    _patch_meta(tmp_path / "store", keys[1], 72, 0x01)  # slot 1 -> 0, keys[0]'s
    return keys, size


def test_two_records_naming_one_slot_are_both_dropped_on_open(open_store, tmp_path):
    keys, size = two_records_naming_one_slot(open_store, tmp_path)

    store = open_store()
    assert sorted(dict(store.iter_metadata())) == [keys[2]]
    assert np.array_equal(read(store, keys[2], size), content(keys[2], size))
    store.check_invariants()
    store.put([record(key, size) for key in keys[:2]], fingerprint=FP).result()
    assert all(np.array_equal(read(store, key, size), content(key, size)) for key in keys)
    store.check_invariants()


def test_an_open_whose_start_up_commit_fails_is_refused(open_store, tmp_path, monkeypatch):
    """The open drops two records that name one slot and counts the slot free; the
    commit that deletes them fails (ENOSPC). The open fails too, rather than run with
    them still naming the slot it hands out: a record put there would be dropped with
    them at the next open. Opened again once the commit can succeed, nothing is lost."""
    keys, size = two_records_naming_one_slot(open_store, tmp_path)
    opened = LmdbBackend._open_env

    def open_on_a_full_disk(self):
        work = opened(self)
        self._env = FailingCommits(self._env, lmdb.DiskError("No space left on device"))
        return work

    monkeypatch.setattr(LmdbBackend, "_open_env", open_on_a_full_disk)
    with pytest.raises(StorageUnavailable, match="start-up"):
        open_store()
    monkeypatch.undo()

    store = open_store()
    store.put([record(key_of("new"), size)], fingerprint=FP).result()
    store.close()
    store = open_store()
    assert sorted(dict(store.iter_metadata())) == sorted([keys[2], key_of("new")])
    assert np.array_equal(read(store, key_of("new"), size), content(key_of("new"), size))
    assert np.array_equal(read(store, keys[2], size), content(keys[2], size))
    store.check_invariants()


@pytest.mark.parametrize("unreadable", [b"\x09garbage", b"", b"\x02"], ids=["unknown version", "empty", "short"])
def test_open_drops_orphan_payloads_and_unreadable_metadata(open_store, tmp_path, unreadable):
    keys = [key_of(("orphan", i)) for i in range(4)]
    store = open_store()
    store.put([record(k, 700) for k in keys], fingerprint=FP).result()
    store.close()
    env = lmdb.open(str(tmp_path / "store"), max_dbs=2)
    try:
        meta_db = env.open_db(b"meta")
        with env.begin(write=True, db=meta_db) as txn:
            txn.delete(keys[0])  # payload without metadata
            txn.put(keys[1], unreadable)
    finally:
        env.close()
    store = open_store()
    assert sorted(dict(store.iter_metadata())) == sorted(keys[2:])
    assert stored_run(store, keys[:2]) == 0
    assert store.stats().bytes == 1400
    store.check_invariants()


def test_opening_an_open_store_again_in_one_process_is_refused(open_store):
    store = open_store()
    with pytest.raises(HicacheError, match="already open"):
        LmdbBackend(store.path, capacity_bytes=1 << 20)
    assert list(store.iter_metadata()) == []  # the first one still reads


def test_wrong_fingerprint_reads_as_missing_and_keeps_the_record(open_store):
    store = open_store()
    key = key_of("fp")
    store.put([record(key, 3000)], fingerprint=FP).result()
    assert read(store, key, 3000, fingerprint=OTHER_FP) is None
    assert store.stats().corrupt_records == 1
    store.flush()
    assert np.array_equal(read(store, key, 3000), content(key, 3000))
    assert store.stats().records == 1


def test_sync_mode_round_trip(open_store):
    store = open_store(sync=True)
    keys = [key_of(("sync", i)) for i in range(3)]
    store.put([record(k, 5000) for k in keys], fingerprint=FP).result()
    assert all(np.array_equal(read(store, k, 5000), content(k, 5000)) for k in keys)


def test_missing_keys_are_not_corrupt(open_store):
    store = open_store()
    key = key_of("present")
    store.put([record(key, 100)], fingerprint=FP).result()
    buffers = [bytearray(100), bytearray(100), bytearray(100)]
    assert store.get([key_of("absent"), key, key_of("absent2")], buffers, fingerprint=FP) == [False, True, False]
    assert store.stats().corrupt_records == 0


def test_a_record_of_another_size_than_its_buffer_reads_as_missing_alone_and_is_kept(open_store):
    """A buffer that does not fit its record (the caller's idea of the record's size is
    wrong for that one): that record reads as missing, counted, and is kept — the other
    records of the get are judged on their own and copied."""
    store = open_store()
    keys = [key_of(("sizes", i)) for i in range(4)]
    store.put([record(key, 256) for key in keys[:2]] + [record(keys[2], 200), record(keys[3], 256)],
              fingerprint=FP).result()
    buffers = [np.zeros(256, dtype=np.uint8) for _ in keys]
    assert store.get(keys, buffers, fingerprint=FP) == [True, True, False, True]
    for i in (0, 1, 3):
        assert np.array_equal(buffers[i], content(keys[i], 256)), i
    assert store.stats().corrupt_records == 1
    for size in (199, 201):
        assert store.get([keys[2]], [bytearray(size)], fingerprint=FP) == [False]
    store.flush()
    assert store.stats().records == 4
    assert np.array_equal(read(store, keys[2], 200), content(keys[2], 200))
    store.check_invariants()


class FakeClock:
    """A clock that never advances: access order must not depend on its resolution."""

    def __call__(self) -> float:
        return 1_700_000_000.0


def _put(store, names, size=1000):
    return store.put([record(key_of(n), size) for n in names], fingerprint=FP).result()


def test_lru_eviction_order_and_gets_refresh(open_store):
    store = open_store(capacity_bytes=4000, clock=FakeClock())
    for name in "abcd":
        assert _put(store, name) == PutResult(1, ())
    assert read(store, key_of("a"), 1000) is not None  # a is now the most recent
    assert _put(store, "e") == PutResult(1, (key_of("b"),))
    assert _put(store, "fg") == PutResult(2, (key_of("c"), key_of("d")))
    stats = store.stats()
    assert (stats.records, stats.bytes, stats.evicted_records) == (4, 4000, 3)
    assert stored_run(store, [key_of(n) for n in "aefg"]) == 4
    assert stored_run(store, [key_of("b")]) == 0
    store.check_invariants()


def test_overwrite_counts_the_size_change(open_store):
    store = open_store(capacity_bytes=4000)
    _put(store, "ab")
    assert _put(store, "a", size=2500) == PutResult(1, ())
    assert store.stats().bytes == 3500
    assert _put(store, "c", size=1000) == PutResult(1, (key_of("b"),))
    store.check_invariants()


def test_restart_keeps_the_lru_order(open_store):
    clock = FakeClock()
    store = open_store(capacity_bytes=4000, clock=clock)
    for name in "abcd":
        _put(store, name)
    read(store, key_of("b"), 1000)
    read(store, key_of("a"), 1000)  # order now: c d b a
    store.close()
    store = open_store(capacity_bytes=4000, clock=clock)
    assert _put(store, "e") == PutResult(1, (key_of("c"),))
    assert _put(store, "f") == PutResult(1, (key_of("d"),))
    assert _put(store, "g") == PutResult(1, (key_of("b"),))
    store.check_invariants()


def test_access_times_are_persisted_lazily(open_store):
    times = iter(float(t) for t in range(1000, 2000))
    store = open_store(clock=lambda: next(times))
    _put(store, "ab")
    before = {k: m.last_access_s for k, m in store.iter_metadata()}
    read(store, key_of("a"), 1000)
    assert {k: m.last_access_s for k, m in store.iter_metadata()} == before  # not one write per read
    store.flush()
    after = {k: m.last_access_s for k, m in store.iter_metadata()}
    assert after[key_of("a")] > before[key_of("a")] and after[key_of("b")] == before[key_of("b")]


def test_a_read_of_a_replaced_record_does_not_age_its_successor(open_store, monkeypatch):
    """A read of ``b``'s old record that ends while the writer applies a put of ``a``
    then ``b`` records a time before the put's: ``b`` stays newer than ``a`` in memory,
    once persisted and after a restart."""
    times = iter(float(t) for t in range(1000, 2000))
    store = open_store(capacity_bytes=3000, clock=lambda: next(times))
    _put(store, "b")
    real_put = store._write_put

    def read_first(txn, op, state):  # (the read ends after this batch took the recorded times)
        if key_of("a") in op.sizes:
            assert read(store, key_of("b"), 1000) is not None
        return real_put(txn, op, state)

    monkeypatch.setattr(store, "_write_put", read_first)
    _put(store, "ab")
    monkeypatch.undo()
    assert store.lru_keys() == [key_of("a"), key_of("b")]
    store.flush()  # persists the read's time, if it were newer
    assert store.lru_keys() == [key_of("a"), key_of("b")]
    store.close()
    store = open_store(capacity_bytes=3000)
    assert store.lru_keys() == [key_of("a"), key_of("b")]
    assert _put(store, "cd") == PutResult(2, (key_of("a"),))
    store.check_invariants()


def test_reopening_with_a_smaller_capacity_evicts_the_oldest(open_store):
    store = open_store(capacity_bytes=10_000, clock=FakeClock())
    for name in "abcde":
        _put(store, name)
    store.close()
    store = open_store(capacity_bytes=3000)
    assert sorted(dict(store.iter_metadata())) == sorted(key_of(n) for n in "cde")
    assert store.stats().evicted_records == 2
    store.check_invariants()


def test_too_large_puts_are_rejected(open_store):
    store = open_store(capacity_bytes=4000)
    with pytest.raises(InvalidArgument):
        _put(store, "a", size=4001)
    with pytest.raises(InvalidArgument):
        _put(store, "abc", size=1500)
    assert _put(store, "abcd", size=1000) == PutResult(4, ())


class LruModel(RuleBasedStateMachine):
    """The backend against an ordered dict, through puts, gets, deletes and restarts."""

    CAPACITY = 10_000
    root = ""  # set per test run

    def __init__(self):
        super().__init__()
        self.path = os.path.join(self.root, uuid.uuid4().hex)
        self.store = LmdbBackend(self.path, capacity_bytes=self.CAPACITY, clock=FakeClock())
        self.model: OrderedDict[bytes, int] = OrderedDict()

    names = st.integers(0, 12)

    @rule(items=st.lists(st.tuples(names, st.integers(1, 4000)), min_size=1, max_size=4))
    def put(self, items):
        sizes: dict[bytes, int] = {}
        for name, size in items:
            sizes[key_of(name)] = size
        if sum(sizes.values()) > self.CAPACITY:
            with pytest.raises(InvalidArgument):
                self.store.put([record(key_of(n), s) for n, s in items], fingerprint=FP)
            return
        result = self.store.put([record(key_of(n), s) for n, s in items], fingerprint=FP).result()
        total = sum(self.model.values())
        for key, size in sizes.items():
            total += size - self.model.get(key, 0)
        evicted = []
        for key in list(self.model):
            if total <= self.CAPACITY:
                break
            if key not in sizes:
                evicted.append(key)
                total -= self.model.pop(key)
        for name, size in items:
            self.model.pop(key_of(name), None)
            self.model[key_of(name)] = size
        assert result == PutResult(len(items), tuple(evicted))

    @rule(names=st.lists(names, min_size=1, max_size=4))
    def get(self, names):
        keys = [key_of(n) for n in names]
        buffers = [np.zeros(self.model.get(k, 1), dtype=np.uint8) for k in keys]
        found = self.store.get(keys, buffers, fingerprint=FP)
        assert found == [k in self.model for k in keys]
        for key, buffer, hit in zip(keys, buffers, found, strict=True):
            if hit:
                assert np.array_equal(buffer, content(key, self.model[key]))
                self.model.move_to_end(key)

    @rule(names=st.lists(names, min_size=1, max_size=3, unique=True))
    def delete(self, names):
        keys = [key_of(n) for n in names]
        assert self.store.delete(keys).result() == sum(k in self.model for k in keys)
        for key in keys:
            self.model.pop(key, None)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = LmdbBackend(self.path, capacity_bytes=self.CAPACITY, clock=FakeClock())

    @invariant()
    def matches_model(self):
        self.store.check_invariants()
        assert self.store.lru_keys() == list(self.model)
        assert self.store.stats().bytes == sum(self.model.values())
        assert stored_run(self.store, list(self.model)) == len(self.model)

    def teardown(self):
        self.store.close()


@pytest.mark.parametrize("victims", [1024, 1], ids=["whole-store-scans", "one-candidate-a-scan"])
def test_lru_state_machine(tmp_path, monkeypatch, victims):
    # With one candidate a scan, candidates go stale (read, rewritten, deleted) between
    # evictions and the queue runs dry inside a batch: the order must stay exact.
    monkeypatch.setattr(lmdb_backend, "_VICTIMS_MIN", victims)

    class Machine(LruModel):
        root = str(tmp_path)

    run_state_machine_as_test(Machine, settings=settings(max_examples=30, stateful_step_count=30, deadline=None))


def _token_heavy(key: bytes, size: int) -> PageRecord:
    """A record whose metadata (1,000 token ids) outweighs its payload: it fills the map."""
    return PageRecord(key=key, payload=content(key, size), meta=meta_for(key, num_tokens=1000))


@pytest.mark.parametrize("writemap", [False, True])
def test_map_grows_instead_of_failing(open_store, writemap):
    store = open_store(capacity_bytes=64 << 20, map_size_bytes=1 << 20, writemap=writemap)
    initial = store.stats().map_size_bytes
    keys = [key_of(("grow", i)) for i in range(2000)]
    futures = [store.put([_token_heavy(k, 600) for k in keys[i : i + 100]], fingerprint=FP)
               for i in range(0, 2000, 100)]
    assert all(f.result().written == 100 for f in futures)
    stats = store.stats()
    assert stats.map_size_bytes >= 8 * initial and stats.records == 2000
    assert all(np.array_equal(read(store, k, 600), content(k, 600)) for k in keys)
    assert store.read_tokens(keys[:3]) == [meta_for(k, num_tokens=1000).tokens for k in keys[:3]]
    store.check_invariants()


@pytest.mark.parametrize("writemap", [False, True])
def test_reads_run_while_the_writer_commits_and_grows_the_map(open_store, writemap):
    store = open_store(capacity_bytes=64 << 20, map_size_bytes=1 << 20, writemap=writemap)
    size = 30_000
    first = [key_of(("c", i)) for i in range(20)]
    store.put([record(k, size) for k in first], fingerprint=FP).result()
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader():
        buffer = np.empty(size, dtype=np.uint8)
        try:
            while not stop.is_set():
                for key in first:
                    assert store.get([key], [buffer], fingerprint=FP) == [True]
                    assert np.array_equal(buffer, content(key, size))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    futures = [store.put([_token_heavy(key_of(("w", i, j)), size) for j in range(8)], fingerprint=FP)
               for i in range(60)]
    for f in futures:
        f.result()
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert store.stats().map_size_bytes > 1 << 20
    store.check_invariants()


@pytest.mark.parametrize("fail_at", ["after the slab write", "in the slab write"])
def test_a_failed_batch_fails_its_futures_and_leaves_the_store_consistent(open_store, monkeypatch, fail_at):
    store = open_store()
    _put(store, "ab")
    real_write = store._write_payloads
    real_pwritev = os.pwritev

    def failing_after(*args):
        real_write(*args)  # slots taken and written, then the batch fails
        raise OSError("disk on fire")

    def failing_pwritev(fd, buffers, offset):
        real_pwritev(fd, [memoryview(buffers[0])[:10]], offset)  # a short write, then the failure
        raise OSError("disk on fire")

    if fail_at == "after the slab write":
        monkeypatch.setattr(store, "_write_payloads", failing_after)
    else:
        monkeypatch.setattr(lmdb_backend.os, "pwritev", failing_pwritev)
    future = store.put([record(key_of("c"), 1000), record(key_of("d"), 1000)], fingerprint=FP)
    with pytest.raises(OSError, match="disk on fire"):
        future.result()
    store.check_invariants()
    assert stored_run(store, [key_of("c")]) == 0
    monkeypatch.undo()
    assert _put(store, "cd") == PutResult(2, ())
    assert stored_run(store, [key_of(n) for n in "abcd"]) == 4
    assert all(np.array_equal(read(store, key_of(n), 1000), content(key_of(n), 1000)) for n in "abcd")
    store.check_invariants()
    assert store.stats().pending_writes == 0
    # the failed batch's slots were given back: the slab holds four slots, not six
    assert os.path.getsize(os.path.join(store.path, "slab-1024.bin")) <= 4 * 1024


class _CommitFailing:
    """A write transaction whose commit fails as LMDB's does: the transaction is aborted."""

    def __init__(self, txn, exc: BaseException) -> None:
        self._txn, self._exc = txn, exc

    def __getattr__(self, name: str):
        return getattr(self._txn, name)

    def commit(self) -> None:
        self._txn.abort()
        raise self._exc


class FailingCommits:
    """An ``lmdb.Environment`` whose next ``num_failures`` write transactions fail to commit."""

    def __init__(self, env, exc: BaseException, num_failures: int = 1) -> None:
        self._env, self._exc, self.num_failures = env, exc, num_failures

    def __getattr__(self, name: str):
        return getattr(self._env, name)

    def begin(self, *args, **kwargs):
        txn = self._env.begin(*args, **kwargs)
        if kwargs.get("write") and self.num_failures:
            self.num_failures -= 1
            return _CommitFailing(txn, self._exc)
        return txn


@pytest.mark.parametrize("exc", [lmdb.DiskError("No space left on device"),
                                 lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL")], ids=["enospc", "map-full"])
def test_a_failed_commit_gives_back_the_slots_its_batch_took(open_store, monkeypatch, exc):
    """ENOSPC fails the batch; MapFullError at the commit grows the map and retries it.
    Either way the slots the failed attempt wrote are free again, not lost."""
    store = open_store()
    _put(store, "a")
    monkeypatch.setattr(store, "_env", FailingCommits(store._env, exc))
    future = store.put([record(key_of(n), 1000) for n in "bcde"], fingerprint=FP)
    if isinstance(exc, lmdb.MapFullError):
        assert future.result() == PutResult(4, ())
    else:
        with pytest.raises(lmdb.DiskError):
            future.result()
        assert _put(store, "bcde") == PutResult(4, ())
    store.check_invariants()
    assert all(np.array_equal(read(store, key_of(n), 1000), content(key_of(n), 1000)) for n in "abcde")
    assert os.path.getsize(os.path.join(store.path, "slab-1024.bin")) <= 5 * 1024  # the slots were reused


def test_a_failed_commit_keeps_the_eviction_order(open_store, monkeypatch):
    """The failed batch evicted the oldest record, which the abort kept: the next batch
    evicts it again, not the next oldest."""
    store = open_store(capacity_bytes=4000, clock=FakeClock())
    for name in "abcd":
        _put(store, name)
    monkeypatch.setattr(store, "_env", FailingCommits(store._env, lmdb.DiskError("No space left on device")))
    with pytest.raises(lmdb.DiskError):
        _put(store, "e")
    assert _put(store, "f") == PutResult(1, (key_of("a"),))
    store.check_invariants()


def test_pending_writes_and_flush(open_store, monkeypatch):
    store = open_store()
    release = threading.Event()
    entered = threading.Event()
    real_write = store._write_batch

    def blocked(batch, access):
        entered.set()
        release.wait()
        return real_write(batch, access)

    monkeypatch.setattr(store, "_write_batch", blocked)
    first = store.put([record(key_of("p0"), 100)], fingerprint=FP)
    entered.wait()
    second = store.put([record(key_of(("p", i)), 100) for i in range(3)], fingerprint=FP)
    assert store.stats().pending_writes == 4
    release.set()
    store.flush()
    assert first.done() and second.done()
    assert store.stats().pending_writes == 0 and store.stats().records == 4


@pytest.mark.parametrize("outcome", ["committed", "failed"])
def test_a_cancelled_future_leaves_its_batch_and_the_store_alone(open_store, monkeypatch, outcome):
    """A caller cancels a put's future while it is queued: the writer resolves the rest
    of that batch as usual (the cancelled put is applied all the same) and goes on."""
    store = open_store()
    release, entered = threading.Event(), threading.Event()
    real_write, real_payloads = store._write_batch, store._write_payloads

    def blocked(batch, access):
        entered.set()
        release.wait()
        return real_write(batch, access)

    def failing(keys, *args):  # the second batch only
        if key_of("first") in keys:
            return real_payloads(keys, *args)
        raise OSError("disk on fire")

    monkeypatch.setattr(store, "_write_batch", blocked)
    first = store.put([record(key_of("first"), 100)], fingerprint=FP)
    entered.wait()
    cancelled = store.put([record(key_of("cancelled"), 100)], fingerprint=FP)
    other = store.put([record(key_of("other"), 100)], fingerprint=FP)  # (one batch with the cancelled)
    assert cancelled.cancel()
    if outcome == "failed":
        monkeypatch.setattr(store, "_write_payloads", failing)
    release.set()
    assert first.result() == PutResult(1, ())
    if outcome == "failed":
        with pytest.raises(OSError, match="disk on fire"):
            other.result()
    else:
        assert other.result() == PutResult(1, ())
    monkeypatch.undo()
    assert _put(store, ["after"]) == PutResult(1, ())  # the writer still runs
    expected = ["first", "after"] + (["cancelled", "other"] if outcome == "committed" else [])
    assert sorted(dict(store.iter_metadata())) == sorted(key_of(n) for n in expected)
    store.check_invariants()


def test_a_check_reads_one_commit_whatever_is_committed_while_it_reads(open_store, monkeypatch):
    """The daemon's writers do not stop for a check: a write committed while the check
    reads the store is not a broken invariant, and not a reason to read again (a large
    store under steady writes would never be read whole between two commits). The check
    reads the store and the writer's index as one commit left them."""
    store = open_store()
    _put(store, "ab")
    real_read = store._read_index
    reads = []

    def read_while_a_write_commits(*args):
        _put(store, [("during", len(reads))])  # committed, index updated: during the read
        reads.append(real_read(*args))
        return reads[-1]

    monkeypatch.setattr(store, "_read_index", read_while_a_write_commits)
    store.check_invariants()
    assert len(reads) == 1 and reads[0][0] == 2  # (records a and b: not the one written meanwhile)
    monkeypatch.undo()
    assert store.stats().records == 3
    store.check_invariants()


def test_a_check_waits_for_the_commit_under_way_and_reads_what_it_left(open_store, monkeypatch):
    """A commit that is in the store but not yet in the writer's index when the check
    would read: the check reads once the commit ended, store and index both with it."""
    store = open_store()
    _put(store, "ab")
    committed, release = threading.Event(), threading.Event()
    real_write, real_read, real_flush = store._write_batch, store._read_index, store.flush
    reads = []

    def write_then_hold(batch, access):
        result = real_write(batch, access)
        if any(getattr(op, "parts", None) for op in batch) and not committed.is_set():
            committed.set()  # in the store, not yet in the index
            release.wait()
        return result

    def flush_then_write(*args, **kwargs):  # (the check's own flush: then a write it did not wait for)
        real_flush(*args, **kwargs)
        store.put([record(key_of("c"), 1000)], fingerprint=FP)
        committed.wait()

    def read(*args):
        reads.append((release.is_set(), real_read(*args)))
        return reads[-1][1]

    monkeypatch.setattr(store, "_write_batch", write_then_hold)
    monkeypatch.setattr(store, "_read_index", read)
    monkeypatch.setattr(store, "flush", flush_then_write)
    with ThreadPoolExecutor(1) as pool:
        checked = pool.submit(store.check_invariants)
        committed.wait()
        release.set()
        checked.result()
    assert reads and all(released for released, _ in reads)
    assert reads[-1][1][0] == 3  # (a, b and c)
    monkeypatch.undo()
    store.check_invariants()


def test_a_close_stops_a_check_that_is_reading(open_store, monkeypatch):
    """The check's read holds the store open (a close waits for reads): it looks for a
    close now and then, and stops with StorageUnavailable, so the close does not wait
    for a walk of every record."""
    store = open_store()
    _put(store, "abc")
    monkeypatch.setattr(lmdb_backend, "_CHECK_LOOK_EVERY", 1)
    reading, real_fields = threading.Event(), lmdb_backend._meta_fields

    def fields_then_wait_for_the_close(value):
        if threading.current_thread().name == "check" and not reading.is_set():
            reading.set()
            while not store._closing:
                threading.Event().wait(0.001)
        return real_fields(value)

    monkeypatch.setattr(lmdb_backend, "_meta_fields", fields_then_wait_for_the_close)
    outcome = []

    def check():
        try:
            store.check_invariants()
        except StorageUnavailable as exc:
            outcome.append(exc)

    checking = threading.Thread(target=check, name="check")
    checking.start()
    reading.wait()
    store.close()
    checking.join()
    assert len(outcome) == 1 and "the check stopped" in str(outcome[0])


def test_a_check_that_is_reading_makes_way_for_a_map_resize(open_store, monkeypatch):
    """A map resize waits for every read, and the check's is a walk of every record: it
    looks now and then for a resize waiting, gives its read up, and reads again once the
    map has grown — the writer is not held up for a walk of the store."""
    store = open_store()
    _put(store, "abcd")
    store.flush()
    monkeypatch.setattr(lmdb_backend, "_CHECK_LOOK_EVERY", 1)
    reading, resumed, real_fields = threading.Event(), threading.Event(), lmdb_backend._meta_fields
    events = []

    def fields_then_wait(value):
        if threading.current_thread().name == "check" and not reading.is_set():
            reading.set()  # (the read holds the gate: a resize now waits for it)
            resumed.wait()
        return real_fields(value)

    def read(*args):
        events.append(store._env.info()["map_size"])  # (the map the read sees)
        return real_read(*args)

    real_read = store._read_index
    monkeypatch.setattr(lmdb_backend, "_meta_fields", fields_then_wait)
    monkeypatch.setattr(store, "_read_index", read)
    size = store._map_size
    outcome = []
    checking = threading.Thread(target=lambda: outcome.append(store.check_invariants()), name="check")
    checking.start()
    reading.wait()
    growing = threading.Thread(target=store._grow_map)
    growing.start()
    try:
        for _ in range(60_000):  # (until the resize waits for the check's read)
            if store._gate.wanted:
                break
            threading.Event().wait(0.001)
        assert store._gate.wanted, "the resize never came to the gate"
    finally:
        resumed.set()
    growing.join()
    checking.join()
    assert outcome == [None]  # (the check passed)
    assert events == [size, 2 * size] and store._map_size == 2 * size  # (read, gave way, read the grown map)
    monkeypatch.undo()
    store.check_invariants()


def test_batches_preserve_queue_order(open_store):
    store = open_store(max_batch_records=3)
    futures = [store.put([record(key_of("k"), 100 + i)], fingerprint=FP) for i in range(10)]
    futures.append(store.delete([key_of("k"), key_of("never")]))
    futures.append(store.put([record(key_of("k"), 777)], fingerprint=FP))
    assert [f.result() for f in futures[:10]] == [PutResult(1, ())] * 10
    assert futures[10].result() == 1
    assert futures[11].result() == PutResult(1, ())
    assert np.array_equal(read(store, key_of("k"), 777), content(key_of("k"), 777))
    store.check_invariants()


def test_delete_answers_how_many_existed(open_store):
    store = open_store()
    keys = [key_of(("run", i)) for i in range(6)]
    store.put([record(k, 500) for k in keys[:4]], fingerprint=FP).result()
    assert stored_run(store, keys) == 4
    assert stored_run(store, []) == 0
    assert stored_run(store, [keys[5]] + keys) == 0
    assert store.delete([keys[1], keys[5]]).result() == 1
    assert stored_run(store, keys) == 1
    assert store.delete([]).result() == 0
    assert store.stats().records == 3
    store.check_invariants()


def test_bad_arguments(open_store):
    store = open_store()
    key = key_of("args")
    store.put([record(key, 256)], fingerprint=FP).result()
    for buffer in (np.zeros(128, dtype=np.int32)[::2], b"x" * 256,
                   torch.zeros(16, 16, dtype=torch.uint8).t(), torch.zeros(256, dtype=torch.uint8, device="meta")):
        with pytest.raises(InvalidArgument):
            store.get([key], [buffer], fingerprint=FP)
    readonly = np.zeros(256, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(InvalidArgument):
        store.get([key], [readonly], fingerprint=FP)
    with pytest.raises(InvalidArgument):
        store.get([key], [bytearray(256), bytearray(256)], fingerprint=FP)
    with pytest.raises(InvalidArgument):
        store.get([b"short"], [bytearray(256)], fingerprint=FP)
    with pytest.raises(InvalidArgument):
        store.get([key], [bytearray(256)], fingerprint=b"short")
    with pytest.raises(InvalidArgument):
        store.put([PageRecord(b"short", b"x", meta_for(key))], fingerprint=FP)
    with pytest.raises(InvalidArgument):
        store.put([PageRecord(key, b"", meta_for(key))], fingerprint=FP)
    with pytest.raises(InvalidArgument):
        store.put([PageRecord(key, b"x", PageMeta(NS, ROOT, b"abc"))], fingerprint=FP)
    with pytest.raises(InvalidArgument):
        store.put([PageRecord(key, b"x", PageMeta(NS[:4], ROOT, b""))], fingerprint=FP)
    with pytest.raises(InvalidArgument):
        store.put([record(key, 10)], fingerprint=FP[:8])
    with pytest.raises(InvalidArgument):
        LmdbBackend(store.path + "-x", capacity_bytes=0)
    assert store.put([], fingerprint=FP).result() == PutResult(0, ())
    assert store.stats().records == 1


def test_use_after_close_raises(open_store):
    store = open_store()
    _put(store, "a")
    store.close()
    store.close()  # idempotent
    key = key_of("a")
    calls = [
        lambda: store.put([record(key, 10)], fingerprint=FP),
        lambda: store.get([key], [bytearray(1000)], fingerprint=FP),
        lambda: store.delete([key]),
        lambda: store.iter_metadata(),
        lambda: store.flush(),
        lambda: store.stats(),
    ]
    for call in calls:
        with pytest.raises(HicacheError, match="closed"):
            call()


def test_close_commits_what_is_queued(open_store, tmp_path):
    store = open_store()
    futures = [store.put([record(key_of(("q", i)), 2000)], fingerprint=FP) for i in range(50)]
    store.close()
    assert all(f.result().written == 1 for f in futures)
    store = open_store()
    assert store.stats() == StorageStats(50, 100_000, 64 << 20, store.stats().map_size_bytes, 0, 0, 0)


def test_flush_from_a_done_callback_is_refused(open_store):
    store = open_store()
    seen: list[BaseException] = []

    def callback(_future):
        try:
            store.flush()
        except HicacheError as exc:
            seen.append(exc)

    store.put([record(key_of("cb"), 10)], fingerprint=FP).add_done_callback(callback)
    store.flush()
    assert len(seen) == 1 and "writer thread" in str(seen[0])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_use_after_fork_raises(open_store):
    store = open_store()
    _put(store, "a")
    pid = os.fork()
    if pid == 0:  # the child: must refuse, never touch the parent's environment
        try:
            store.stats()
        except HicacheError as exc:
            os._exit(0 if "fork" in str(exc) else 2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert stored_run(store, [key_of("a")]) == 1


def test_metadata_in_batches_lists_every_record_once(open_store):
    """Read a batch at a time (each from its own snapshot), the listing is the snapshot's
    for every batch size; records deleted between batches are simply not listed, and
    none is listed twice."""
    store = open_store()
    keys = [key_of(i) for i in range(23)]
    store.put([record(key, 64) for key in keys], fingerprint=FP).result()
    store.flush()
    whole = [key for key, _ in store.iter_metadata()]
    assert sorted(whole) == sorted(keys)
    for batch in (1, 2, 5, 22, 23, 24, 1000):
        assert [key for key, _ in store.iter_metadata(batch=batch)] == whole, batch
    for bad in (0, -1, 2.5, "4"):
        with pytest.raises(InvalidArgument):
            store.iter_metadata(batch=bad)
    listed = []
    doomed = whole[10:15]
    for i, (key, _) in enumerate(store.iter_metadata(batch=4)):
        listed.append(key)
        if i == 7:  # in the middle of the second batch: the next batches no longer hold these
            store.delete(doomed).result()
            store.flush()
    assert len(listed) == len(set(listed))
    assert listed == [key for key in whole if key not in doomed or whole.index(key) < 8]


def _batch_of(keys: list[bytes], pool: np.ndarray, rows, parents=None, num_tokens: int = 4) -> PageBatch:
    metas = [meta_for(key, ROOT if parents is None else parents[i], num_tokens) for i, key in enumerate(keys)]
    return PageBatch(b"".join(keys), b"".join(m.namespace for m in metas), b"".join(m.parent for m in metas),
                     b"".join(m.tokens for m in metas), pool, np.asarray(rows))


def test_put_batch_stores_what_put_stores(open_store):
    """The columnar put (the disk writer's) writes the same records as ``put``: payloads
    from the named rows of the source, in any order, and byte-equal metadata."""
    size = 3000
    keys = [key_of(("b", i)) for i in range(6)]
    pool = np.stack([content(key_of(("row", r)), size) for r in range(10)])
    rows = [7, 2, 9, 0, 2, 5]  # (a row may feed two records)
    parents = [ROOT] + keys[:-1]
    by_batch, by_records = open_store("batch"), open_store("records")
    assert by_batch.put_batch(_batch_of(keys, pool, rows, parents), fingerprint=FP).result() == PutResult(6, ())
    by_records.put([PageRecord(k, pool[r].copy(), meta_for(k, p)) for k, r, p in zip(keys, rows, parents)],
                   fingerprint=FP).result()
    for key, row in zip(keys, rows):
        assert np.array_equal(read(by_batch, key, size), pool[row])
    strip = lambda meta: meta._replace(last_access_s=0.0)  # noqa: E731
    assert ([(k, strip(m)) for k, m in by_batch.iter_metadata()]
            == [(k, strip(m)) for k, m in by_records.iter_metadata()])
    assert by_batch.stats()[:3] == by_records.stats()[:3] == (6, 6 * size, 64 << 20)
    by_batch.check_invariants()


def test_put_batch_rejects_malformed_columns_and_changes_nothing(open_store):
    store = open_store()
    keys = [key_of(("m", i)) for i in range(3)]
    pool = np.zeros((4, 100), dtype=np.uint8)
    good = _batch_of(keys, pool, [0, 1, 2])
    bad = [
        good._replace(rows=np.array([0, 1, 4])),  # outside the source
        good._replace(rows=np.array([0, -1, 2])),
        good._replace(rows=np.array([0, 1])),  # not one per record
        good._replace(rows=np.array([0.0, 1.0, 2.0])),
        good._replace(keys=good.keys[:-1]),  # not whole keys
        good._replace(parents=good.parents[:16]),
        good._replace(tokens=good.tokens[:-1]),  # not int32 ids, as many each
        good._replace(keys="not bytes"),
        good._replace(source=pool.astype(np.int16)),
        good._replace(source=pool[:, ::2]),  # rows not contiguous
        good._replace(source=np.zeros((4, 0), dtype=np.uint8)),
        good._replace(source=pool.reshape(-1)),  # not 2-D
    ]
    for batch in bad:
        with pytest.raises(InvalidArgument):
            store.put_batch(batch, fingerprint=FP)
    with pytest.raises(InvalidArgument):
        store.put_batch(good, fingerprint=b"short")
    assert store.stats().records == 0 and store.stats().pending_writes == 0
    assert store.put_batch(good._replace(keys=b"", namespaces=b"", parents=b"", tokens=b"", rows=np.array([], int)),
                           fingerprint=FP).result() == PutResult(0, ())
    assert store.put_batch(good, fingerprint=FP).result() == PutResult(3, ())
    store.check_invariants()


def test_put_batches_of_whole_rows_and_of_their_first_bytes_in_one_commit(open_store):
    """Pages with and without their SWA part (hicache.tiers.windows): one batch from the
    whole rows, one from each row's first bytes (a view whose rows are not back to
    back), committed together; each record reads back as its bytes."""
    store = open_store()
    size, kept = 3000, 1200
    pool = np.stack([content(key_of(("row", r)), size) for r in range(8)])
    whole = [key_of(("whole", i)) for i in range(3)]
    short = [key_of(("short", i)) for i in range(4)]
    assert not pool[:, :kept].flags.c_contiguous
    result = store.put_batches([_batch_of(whole, pool, [1, 4, 6]), _batch_of(short, pool[:, :kept], [0, 2, 3, 7])],
                               fingerprint=FP).result()
    assert result == PutResult(7, ())
    for key, row in zip(whole, [1, 4, 6]):
        assert np.array_equal(read(store, key, size), pool[row])
    for key, row in zip(short, [0, 2, 3, 7]):
        assert np.array_equal(read(store, key, kept), pool[row, :kept])
    assert store.stats().bytes == 3 * size + 4 * kept
    # A whole record over a short one (a rewrite once the SWA part is back): sizes add up.
    assert store.put_batch(_batch_of(short[:1], pool, [0]), fingerprint=FP).result() == PutResult(1, ())
    assert np.array_equal(read(store, short[0], size), pool[0])
    assert store.stats().bytes == 4 * size + 3 * kept and store.stats().records == 7
    store.check_invariants()
