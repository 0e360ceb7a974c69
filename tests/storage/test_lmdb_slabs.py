"""LmdbBackend's slab files: slot sizes, slot reuse against concurrent reads, what an
open repairs, and stores written in the legacy format (payloads inside LMDB).

Payload bytes are derived from the key and size, so any record read back is checked
without remembering what was written.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading

import lmdb
import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from hicache.storage import lmdb_backend
from hicache.storage.base import PageMeta, PageRecord
from hicache.storage.lmdb_backend import LmdbBackend, slot_bytes_for
from storage_util import stored_run

FP = hashlib.blake2b(b"slab-spec", digest_size=16).digest()
NS = hashlib.blake2b(b"slab-namespace", digest_size=16).digest()
OTHER_FP = hashlib.blake2b(b"slab-other-spec", digest_size=16).digest()


def key_of(name) -> bytes:
    return hashlib.blake2b(repr(name).encode(), digest_size=16).digest()


def content(key: bytes, size: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little") ^ size).integers(0, 256, size, dtype=np.uint8)


def tokens_of(key: bytes) -> bytes:
    return key[:8]  # two int32 token ids


def record(key: bytes, size: int) -> PageRecord:
    return PageRecord(key, content(key, size), PageMeta(namespace=NS, parent=bytes(16), tokens=tokens_of(key)))


def read(store: LmdbBackend, key: bytes, size: int) -> np.ndarray | None:
    buffer = np.full(size, 0x5A, dtype=np.uint8)
    return buffer if store.get([key], [buffer], fingerprint=FP) == [True] else None


def slab_path(store: LmdbBackend, size: int) -> str:
    return os.path.join(store.path, f"slab-{slot_bytes_for(size)}.bin")


def slab_disk_bytes(store: LmdbBackend) -> int:
    """The disk space the slab files take (their blocks, not their sizes)."""
    return sum(os.stat(os.path.join(store.path, name)).st_blocks * 512
               for name in os.listdir(store.path) if name.startswith("slab-"))


def punches_holes(directory) -> bool:
    """Whether the file system of ``directory`` punches holes (else only free tails go)."""
    path = os.path.join(directory, "probe")
    with open(path, "wb") as f:
        f.write(b"x" * 65536)
        f.flush()
        try:
            return lmdb_backend._punch_hole(f.fileno(), 0, 4096)
        finally:
            os.unlink(path)


@pytest.fixture
def open_store(tmp_path):
    opened: list[LmdbBackend] = []

    def _open(**kwargs) -> LmdbBackend:
        kwargs.setdefault("capacity_bytes", 64 << 20)
        store = LmdbBackend(tmp_path / "store", **kwargs)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


@given(st.integers(1, 1 << 40))
def test_slot_sizes_hold_the_payload_with_under_a_quarter_to_spare(size):
    slot_bytes = slot_bytes_for(size)
    assert slot_bytes >= max(size, 512)
    if size > 512:
        assert slot_bytes < size * 1.25
    if size & (size - 1) == 0 and size >= 512:
        assert slot_bytes == size
    assert slot_bytes_for(slot_bytes) == slot_bytes  # a slot size is its own class


def test_many_payload_sizes_share_a_few_slab_files(open_store):
    store = open_store()
    sizes = list(range(600, 12_600, 97))
    store.put([record(key_of(("size", size)), size) for size in sizes], fingerprint=FP).result()
    names = [n for n in os.listdir(store.path) if n.startswith("slab-")]
    # 124 sizes over 4.4 octaves: four slot sizes an octave
    assert len(names) == len({slot_bytes_for(size) for size in sizes}) <= 4 * 5
    assert all(np.array_equal(read(store, key_of(("size", s)), s), content(key_of(("size", s)), s)) for s in sizes)
    store.check_invariants()


def test_one_get_reads_adjacent_slots_of_different_sizes_and_large_payloads(open_store):
    """A run of adjacent slots (one preadv) ends with a payload shorter than its slot,
    next to megabyte payloads: each checked with its own size, a damaged one caught."""
    store = open_store()
    sizes = {key_of("full-a"): 4096, key_of("full-b"): 4096, key_of("short"): 3900, key_of("big"): 1_500_000,
             key_of("big-short"): 1_400_001}
    assert len({slot_bytes_for(size) for size in sizes.values()}) == 2
    store.put([record(key, size) for key, size in sizes.items()], fingerprint=FP).result()
    buffers = [np.full(size, 0x5A, dtype=np.uint8) for size in sizes.values()]
    assert store.get(list(sizes), buffers, fingerprint=FP) == [True] * len(sizes)
    for (key, size), buffer in zip(sizes.items(), buffers, strict=True):
        assert np.array_equal(buffer, content(key, size))
    with open(slab_path(store, 1_500_000), "r+b") as f:  # damage the big one's last piece
        f.seek(slot_bytes_for(1_500_000) * 0 + 1_499_999)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 1]))
    assert store.get(list(sizes), buffers, fingerprint=FP) == [True, True, True, False, True]
    assert store.stats().corrupt_records == 1


def test_a_get_reads_in_pieces_and_checks_each_record_whatever_piece_it_is_in(open_store):
    """Reads go in pieces of a few hundred KiB: small records several to a piece, large
    ones over several pieces. A flipped byte in a later piece, or a file that ends in the
    middle of a record, fails exactly that record."""
    store = open_store()
    small = [key_of(("small", n)) for n in range(12)]
    large = [key_of(("large", n)) for n in range(3)]
    sizes = {**{key: 100_000 for key in small}, **{key: 600_000 for key in large}}
    store.put([record(key, size) for key, size in sizes.items()], fingerprint=FP).result()
    store.flush()

    def get_all() -> list[bool]:
        buffers = [np.full(size, 0x5A, dtype=np.uint8) for size in sizes.values()]
        found = store.get(list(sizes), buffers, fingerprint=FP)
        for key, buffer, hit in zip(sizes, buffers, found, strict=True):
            assert not hit or np.array_equal(buffer, content(key, sizes[key]))
        return found

    assert get_all() == [True] * 15
    with open(slab_path(store, 100_000), "r+b") as f:  # small record 9: past the first pieces
        f.seek(slot_bytes_for(100_000) * 9 + 50_000)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x80]))
    with open(slab_path(store, 600_000), "r+b") as f:  # large record 1: in its third piece
        f.seek(slot_bytes_for(600_000) + 590_000)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x80]))
    os.truncate(slab_path(store, 600_000), slot_bytes_for(600_000) * 2 + 400_000)  # record 2 cut short
    assert get_all() == [True] * 9 + [False] + [True] * 2 + [True, False, False]
    assert store.stats().corrupt_records == 3


def test_the_writer_checks_a_record_in_pieces_as_a_get_reads_it(open_store, monkeypatch):
    """Linux returns at most ~2 GiB per read call. Here, scaled down, a read call
    returns at most 8 KiB and a get reads 4 KiB pieces: a record checked by the writer
    (a get of another spec's or with a wrong-size buffer checks it is intact; a purge
    checks again) is read in pieces too, so an intact one is kept."""
    real_preadv = os.preadv

    def capped_preadv(fd, buffers, offset):
        views, left = [], 8192
        for buffer in buffers:
            views.append(memoryview(buffer).cast("B")[:left])
            left -= len(views[-1])
            if not left:
                break
        return real_preadv(fd, views, offset)

    monkeypatch.setattr(lmdb_backend.os, "preadv", capped_preadv)
    monkeypatch.setattr(lmdb_backend, "_READ_PIECE_BYTES", 4096)
    store = open_store()
    key, size = key_of("long"), 40_000
    store.put([record(key, size)], fingerprint=FP).result()
    assert store.get([key], [np.empty(size - 1, dtype=np.uint8)], fingerprint=FP) == [False]  # another size: kept
    buffer = np.empty(size, dtype=np.uint8)
    assert store.get([key], [buffer], fingerprint=OTHER_FP) == [False]  # another spec's: kept
    store.flush()
    assert store.stats().records == 1
    assert np.array_equal(read(store, key, size), content(key, size))
    store.check_invariants()


def test_a_slot_number_past_any_file_offset_reads_as_corrupt(open_store):
    """Metadata damaged while the store is open (not by an open's checks) names a slot
    whose offset no file can have: the get reports it corrupt and the writer purges it
    without taking that slot for a free one (the slot the record had is found free by
    the next open)."""
    store = open_store()
    damaged, intact, size = key_of("damaged"), key_of("intact"), 3000
    store.put([record(damaged, size), record(intact, size)], fingerprint=FP).result()
    store.flush()
    with store._env.begin(write=True, db=store._meta_db) as txn:  # (the writer is idle)
        value = bytearray(txn.get(damaged))
        value[72 + 7] ^= 0x40  # slot + 2**62
        txn.put(damaged, bytes(value))
    buffers = [np.empty(size, dtype=np.uint8) for _ in range(2)]
    assert store.get([damaged, intact], buffers, fingerprint=FP) == [False, True]
    assert store.stats().corrupt_records == 1
    store.flush()
    assert [key for key, _ in store.iter_metadata()] == [intact]
    assert all(slab.free == [] for slab in store._slabs.values())
    store.close()
    store = open_store()
    assert np.array_equal(read(store, intact, size), content(intact, size))
    store.check_invariants()


def test_freed_slots_are_reused_lowest_first_and_open_cuts_the_file(open_store):
    size = 4096
    keys = [key_of(("slot", i)) for i in range(10)]
    store = open_store()
    store.put([record(k, size) for k in keys], fingerprint=FP).result()
    store.delete(keys[2:4] + keys[7:]).result()
    store.put([record(key_of("again"), size)], fingerprint=FP).result()
    store.flush()
    store.close()
    assert os.path.getsize(slab_path(store, size)) == 10 * size  # slot 2 taken; 3 and 7..9 free

    store = open_store()
    assert os.path.getsize(slab_path(store, size)) == 7 * size  # cut after slot 6
    store.put([record(key_of(("more", i)), size) for i in range(3)], fingerprint=FP).result()  # slots 3, 7, 8
    assert os.path.getsize(slab_path(store, size)) == 9 * size
    for key in keys[:2] + keys[4:7] + [key_of("again")] + [key_of(("more", i)) for i in range(3)]:
        assert np.array_equal(read(store, key, size), content(key, size))
    store.check_invariants()


def test_a_slot_freed_while_a_read_is_going_is_not_reused_until_it_ends(open_store):
    size = 2048
    store = open_store()
    old, new = key_of("old"), key_of("new")
    store.put([record(old, size)], fingerprint=FP).result()
    with store._gate.shared():  # a read that began before the delete (it may still use the slot)
        store.delete([old]).result()
        store.put([record(new, size)], fingerprint=FP).result()
        assert os.path.getsize(slab_path(store, size)) == 2 * size  # slot 0 held back: new took slot 1
    store.put([record(key_of("after"), size)], fingerprint=FP).result()
    assert os.path.getsize(slab_path(store, size)) == 2 * size  # slot 0 reused once the read ended
    assert np.array_equal(read(store, new, size), content(new, size))
    assert np.array_equal(read(store, key_of("after"), size), content(key_of("after"), size))
    store.check_invariants()


@pytest.mark.parametrize("fault", ["free and waiting", "waiting twice"])
def test_the_check_rejects_a_slot_that_would_be_handed_out_twice(open_store, fault):
    """(No write path is known to do this: the faults are injected.)"""
    size = 4096
    store = open_store()
    store.put([record(key_of(i), size) for i in range(3)], fingerprint=FP).result()
    with store._gate.shared():  # a read that began before the delete: its slot waits
        store.delete([key_of(1)]).result()
        store.check_invariants()
        (_, waiting), = store._freed
        if fault == "free and waiting":
            store._slabs[slot_bytes_for(size)].give([slot for _, slot in waiting])
        else:
            waiting.extend(waiting)
        with pytest.raises(AssertionError, match="twice|free and waiting"):
            store.check_invariants()


def test_slab_files_give_space_back_when_the_mix_of_payload_sizes_shifts(open_store):
    """Free slots of one size cannot hold payloads of another: as the records of the old
    size go, its file is cut, so the files hold about the capacity, not one a size."""
    capacity, batch = 1 << 20, 16
    store = open_store(capacity_bytes=capacity)
    for size in (4096, 8192, 16384):  # each phase writes the capacity twice over, in one size
        for start in range(0, 2 * capacity // size, batch):
            store.put([record(key_of((size, i)), size) for i in range(start, start + batch)],
                      fingerprint=FP).result()
        store.check_invariants()  # (after its flush, the last commit's slots are free)
        assert store.stats().bytes == capacity
        assert slab_disk_bytes(store) <= capacity + capacity // 16 + batch * size
    assert os.path.getsize(slab_path(store, 4096)) <= capacity // 16
    assert os.path.getsize(slab_path(store, 8192)) <= capacity // 16


def test_free_slots_below_a_used_one_give_their_space_back(open_store, tmp_path):
    """A record that stays (read again and again) keeps the last slot of its file: the
    free slots below it are punched out, so the file takes about that record's space."""
    if not punches_holes(tmp_path):
        pytest.skip("the file system cannot punch holes")
    capacity, batch = 1 << 20, 16
    store = open_store(capacity_bytes=capacity)
    small = [key_of(("small", i)) for i in range(capacity // 4096)]
    store.put([record(key, 4096) for key in small], fingerprint=FP).result()
    kept = small[-1]  # in the last slot
    for start in range(0, 2 * capacity // 8192, batch):
        assert read(store, kept, 4096) is not None  # the most recently used: never evicted
        store.put([record(key_of(("large", i)), 8192) for i in range(start, start + batch)],
                  fingerprint=FP).result()
    store.check_invariants()
    assert os.path.getsize(slab_path(store, 4096)) == capacity  # (not cut: its last slot is used)
    assert slab_disk_bytes(store) <= capacity + capacity // 16 + batch * 8192
    assert np.array_equal(read(store, kept, 4096), content(kept, 4096))
    store.close()
    store = open_store(capacity_bytes=capacity)  # the open punches and cuts the same way
    assert slab_disk_bytes(store) <= capacity + batch * 8192
    assert np.array_equal(read(store, kept, 4096), content(kept, 4096))
    store.check_invariants()


def test_a_slot_a_read_may_still_use_is_neither_cut_nor_punched(open_store):
    size = 4096
    store = open_store(capacity_bytes=64 * size)  # slack: four slots
    keys = [key_of(("held", i)) for i in range(16)]
    store.put([record(key, size) for key in keys], fingerprint=FP).result()
    with store._gate.shared():  # a read that began before the delete (it may still use the slots)
        store.delete(keys).result()
        store.put([record(key_of("other"), 3 * size)], fingerprint=FP).result()  # more commits
        store.flush()
        assert os.path.getsize(slab_path(store, size)) == 16 * size
        with open(slab_path(store, size), "rb") as f:
            held = np.frombuffer(f.read(), dtype=np.uint8).reshape(16, size)
        assert all(np.array_equal(held[i], content(key, size)) for i, key in enumerate(keys))
        store.check_invariants()
    store.flush()  # the read is over: the next commit frees the slots ...
    assert os.path.getsize(slab_path(store, size)) == 16 * size
    churn = [key_of(("churn", i)) for i in range(2)]
    store.put([record(key, 3 * size) for key in churn], fingerprint=FP).result()
    store.delete(churn).result()  # ... and once a round of other slots freed ends, they go
    store.flush()  # (a commit's slots are given back after its futures resolve: wait a commit more)
    assert os.path.getsize(slab_path(store, size)) == 0
    store.check_invariants()


def test_reads_never_see_a_slot_rewritten_for_another_key(open_store):
    """Readers read a changing set of keys while the writer deletes, overwrites and
    evicts: every read that reports a hit holds its key's bytes, and no read ever fails
    a checksum (which a reused slot would)."""
    size = 3000
    store = open_store(capacity_bytes=40 * size)  # full soon: puts evict
    errors: list[BaseException] = []
    stop = threading.Event()
    names = [("churn", i) for i in range(60)]

    def reader(seed: int):
        rng = np.random.default_rng(seed)
        buffers = [np.empty(size, dtype=np.uint8) for _ in range(8)]
        try:
            while not stop.is_set():
                keys = [key_of(names[i]) for i in rng.choice(len(names), 8, replace=False)]
                for key, hit, buffer in zip(keys, store.get(keys, buffers, fingerprint=FP), buffers, strict=True):
                    if hit:
                        assert np.array_equal(buffer, content(key, size)), "a hit with another key's bytes"
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    rng = np.random.default_rng(7)
    for step in range(300):
        picked = [key_of(names[i]) for i in rng.choice(len(names), 4, replace=False)]
        if step % 3 == 2:
            store.delete(picked)
        else:
            store.put([record(key, size) for key in picked], fingerprint=FP)
    store.flush()
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert store.stats().corrupt_records == 0
    store.check_invariants()


# ----- stores written before the slab files (meta format version 2) -----

_LEGACY_HEADER = struct.Struct("<4sHH16sQQ8x")
_LEGACY_META = struct.Struct("<B3xQd16s16s16sI")


def _legacy_payload(payload: bytes) -> bytes:
    header = bytearray(_LEGACY_HEADER.pack(b"HCKV", 1, 48, FP, len(payload), 0))
    digest = xxhash.xxh3_64(bytes(header[:32]))
    digest.update(payload)
    struct.pack_into("<Q", header, 32, digest.intdigest())
    return bytes(header) + payload


def write_legacy_store(path, records: dict[bytes, int], last_access_s: float = 1000.0) -> None:
    """A store as the LMDB-only format wrote it: each key's payload behind its 48-byte
    header in "payload", a 72-byte metadata record and the token ids in "meta"."""
    os.makedirs(path, exist_ok=True)
    env = lmdb.open(str(path), max_dbs=2, map_size=64 << 20)
    try:
        payload_db, meta_db = env.open_db(b"payload"), env.open_db(b"meta")
        with env.begin(write=True) as txn:
            for n, (key, size) in enumerate(records.items()):
                tokens = tokens_of(key)
                txn.put(key, _legacy_payload(content(key, size).tobytes()), db=payload_db)
                meta = _LEGACY_META.pack(2, size, last_access_s + n, NS, bytes(16), FP, len(tokens)) + tokens
                txn.put(key, meta, db=meta_db)
    finally:
        env.close()


def legacy_payload_keys(path) -> set[bytes]:
    env = lmdb.open(str(path), max_dbs=2, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(b"payload", create=False)) as txn:
            return {bytes(key) for key in txn.cursor().iternext(values=False)}
    finally:
        env.close()


def test_a_legacy_store_keeps_its_records_and_sheds_the_old_format(open_store, tmp_path):
    size = 5000
    keys = [key_of(("legacy", i)) for i in range(6)]
    write_legacy_store(tmp_path / "store", dict.fromkeys(keys, size))

    store = open_store(capacity_bytes=8 * size)
    stats = store.stats()
    assert (stats.records, stats.bytes) == (6, 6 * size)
    for key in keys:
        assert np.array_equal(read(store, key, size), content(key, size))
    # A buffer that does not fit a legacy record: that one reads as missing, alone.
    buffers = [bytearray(size - 1), np.zeros(size, dtype=np.uint8)]
    assert store.get(keys[2:4], buffers, fingerprint=FP) == [False, True]
    assert np.array_equal(buffers[1], content(keys[3], size))
    metas = dict(store.iter_metadata())
    assert all(metas[key].tokens == tokens_of(key) and metas[key].payload_size == size for key in keys)
    assert store.read_tokens(keys[:2]) == [tokens_of(k) for k in keys[:2]]
    store.check_invariants()

    # A put of a legacy key replaces it with a slab record; a delete removes both parts.
    store.put([record(keys[0], size + 8)], fingerprint=FP).result()
    store.delete([keys[1]]).result()
    # Three new records: over capacity, so the least recently used legacy records go.
    store.put([record(key_of(("new", i)), size) for i in range(3)], fingerprint=FP).result()
    store.check_invariants()
    assert np.array_equal(read(store, keys[0], size + 8), content(keys[0], size + 8))
    assert stored_run(store, [keys[1]]) == 0
    remaining = [key for key in keys[2:] if stored_run(store, [key])]
    assert len(remaining) == 8 - 1 - 3 - 1  # capacity 8 records: keys[0], three new, and these
    store.close()

    assert legacy_payload_keys(tmp_path / "store") == set(remaining)
    store = open_store(capacity_bytes=8 * size)  # the mix survives a restart
    for key in remaining + [key_of(("new", i)) for i in range(3)]:
        assert np.array_equal(read(store, key, size), content(key, size))
    assert store.stats().corrupt_records == 0
    store.check_invariants()


def test_a_damaged_legacy_payload_reads_as_missing_and_is_purged(open_store, tmp_path):
    size = 3000
    keys = [key_of(("legacy-damage", i)) for i in range(3)]
    write_legacy_store(tmp_path / "store", dict.fromkeys(keys, size))
    env = lmdb.open(str(tmp_path / "store"), max_dbs=2)
    try:
        with env.begin(write=True, db=env.open_db(b"payload")) as txn:
            value = bytearray(txn.get(keys[1]))
            value[48 + 100] ^= 0x01
            txn.put(keys[1], bytes(value))
    finally:
        env.close()

    store = open_store()
    assert read(store, keys[1], size) is None
    assert store.stats().corrupt_records == 1
    store.flush()
    assert stored_run(store, [keys[1]]) == 0
    assert (store.stats().records, store.stats().bytes) == (2, 2 * size)
    assert all(np.array_equal(read(store, k, size), content(k, size)) for k in (keys[0], keys[2]))
    store.check_invariants()


def test_open_drops_legacy_payloads_that_no_legacy_record_names(open_store, tmp_path):
    size = 1000
    keys = [key_of(("orphan", i)) for i in range(3)]
    write_legacy_store(tmp_path / "store", dict.fromkeys(keys, size))
    store = open_store()
    store.put([record(keys[0], size)], fingerprint=FP).result()  # (drops its legacy payload itself)
    store.close()
    env = lmdb.open(str(tmp_path / "store"), max_dbs=2)
    try:
        payload_db, meta_db = env.open_db(b"payload"), env.open_db(b"meta")
        with env.begin(write=True) as txn:
            txn.put(keys[0], _legacy_payload(b"x" * size), db=payload_db)  # under a slab record
            txn.delete(keys[1], db=meta_db)  # a payload without metadata
    finally:
        env.close()

    store = open_store()
    store.close()  # (the open's repairs are committed before it returns)
    assert legacy_payload_keys(tmp_path / "store") == {keys[2]}
    store = open_store()
    assert sorted(dict(store.iter_metadata())) == sorted([keys[0], keys[2]])
    assert np.array_equal(read(store, keys[0], size), content(keys[0], size))
    store.check_invariants()


def test_with_sync_a_new_slab_files_name_is_made_durable(open_store, monkeypatch):
    """``sync=True``: a record is durable once its put resolves, so the directory entry
    of a slab file made for it is too (fsync of the store's directory)."""
    from hicache.storage import lmdb_backend

    synced: list[str] = []
    real_fsync = lmdb_backend.os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(lmdb_backend.os, "fsync", fsync)
    store = open_store(sync=True)
    store.put([record(key_of("durable"), 5000)], fingerprint=FP).result()
    assert os.path.realpath(store.path) in synced
    synced.clear()
    store.put([record(key_of("again"), 5000)], fingerprint=FP).result()  # the same file: no new entry
    assert os.path.realpath(store.path) not in synced
