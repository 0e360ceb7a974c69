"""A purge's walk of the store for specs no tier manager serves (``StoreWalks``), over a
real LMDB store: exactly the records of its (spec, namespace) pairs go, in slices or at
once when the spec's manager is about to read the store; a store that fails says so.
And ``when_all``, which a purge's answer waits on."""

from __future__ import annotations

import pytest

from hicache.daemon import store_purge
from hicache.daemon.store_purge import StoreWalks
from hicache.jobs import Completions
from hicache.storage.base import PageMeta, PageRecord
from hicache.storage.lmdb_backend import LmdbBackend

SPEC_A, SPEC_B = bytes([1]) * 16, bytes([2]) * 16
NS_1, NS_2 = bytes([11]) * 16, bytes([12]) * 16


@pytest.fixture
def store(tmp_path):
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=1 << 24)
    for fingerprint, namespace, count in ((SPEC_A, NS_1, 5), (SPEC_A, NS_2, 3), (SPEC_B, NS_1, 4)):
        records = [PageRecord(bytes([fingerprint[0], namespace[0], i]) * 5 + b"k", bytes([i]) * 600,
                              PageMeta(namespace, bytes(16), bytes(64))) for i in range(count)]
        store.put(records, fingerprint=fingerprint).result()
    yield store
    store.close()


def _left(store) -> dict[tuple[bytes, bytes], int]:
    out: dict[tuple[bytes, bytes], int] = {}
    for _, meta in store.iter_metadata():
        out[meta.fingerprint, meta.namespace] = out.get((meta.fingerprint, meta.namespace), 0) + 1
    return out


def _drain(completions: Completions, future) -> None:
    for _ in range(1000):
        if future.done():
            return
        completions.drain(0.01)
    assert future.done()


def test_a_walk_in_slices_deletes_exactly_its_spec_namespace_pairs(store, monkeypatch):
    monkeypatch.setattr(store_purge, "WALK_STEP", 2)  # (several batches, several slices)
    ticks = iter(range(1_000_000))
    completions = Completions()
    purges = StoreWalks(store, completions, lambda: next(ticks))  # (every look at the clock: a slice over)
    done = purges.start({SPEC_A: {NS_1}})
    slices = 0
    while purges.busy:
        purges.run_slice()
        slices += 1
    assert slices > 3
    _drain(completions, done)
    assert done.result() == 5
    assert _left(store) == {(SPEC_A, NS_2): 3, (SPEC_B, NS_1): 4}


def test_find_tells_which_namespaces_hold_records_deleting_nothing(store, monkeypatch):
    """The tenant log's compaction asks which of its namespaces still hold records: a
    walk in slices that answers the pairs it was asked for and found, reads its
    question as it goes, deletes nothing, and is not run by a registration's finish."""
    monkeypatch.setattr(store_purge, "WALK_STEP", 2)
    ticks = iter(range(1_000_000))
    walks = StoreWalks(store, Completions(), lambda: next(ticks))
    wanted: dict[bytes, set[bytes]] = {SPEC_A: {NS_2, bytes(16)}}
    found = walks.find(wanted)
    walks.finish(SPEC_A)  # (nothing of it: it deletes nothing)
    assert walks.busy and not found.done()
    walks.run_slice()
    assert walks.busy and not found.done()
    wanted[SPEC_B] = {NS_1}  # (asked while it walks: spec B's records come after spec A's)
    while walks.busy:
        walks.run_slice()
    assert found.result() == {(SPEC_A, NS_2), (SPEC_B, NS_1)}
    assert _left(store) == {(SPEC_A, NS_1): 5, (SPEC_A, NS_2): 3, (SPEC_B, NS_1): 4}


def test_finish_deletes_and_commits_before_the_spec_is_read(store):
    """A registration of a spec a walk deletes from: the walk ends now and its deletes
    are committed (the spec's rebuild reads the store next); another spec's walk waits
    for its slices."""
    completions = Completions()
    purges = StoreWalks(store, completions, lambda: 0.0)
    for_b = purges.start({SPEC_B: {NS_1}})
    for_a = purges.start({SPEC_A: {NS_1, NS_2}})
    purges.finish(SPEC_A)
    assert _left(store) == {(SPEC_B, NS_1): 4}  # (no drain, no slice: committed already)
    assert purges.busy and not for_b.done()
    _drain(completions, for_a)
    assert for_a.result() == 8
    while purges.busy:
        purges.run_slice()
    _drain(completions, for_b)
    assert for_b.result() == 4 and _left(store) == {}


def test_a_store_that_fails_to_read_fails_the_walk(store, monkeypatch):
    def broken(batch=None):
        raise OSError("EIO")
        yield

    monkeypatch.setattr(store, "iter_metadata", broken)
    purges = StoreWalks(store, Completions(), lambda: 0.0)
    done = purges.start({SPEC_A: {NS_1}})
    while purges.busy:
        purges.run_slice()
    with pytest.raises(OSError):
        done.result(0)


def test_when_all_waits_for_every_future_from_any_thread_and_keeps_the_first_error():
    import threading
    from concurrent.futures import Future

    from hicache.jobs import when_all

    assert when_all([]).result(0) == []
    futures = [Future() for _ in range(8)]
    together = when_all(futures)
    threads = [threading.Thread(target=f.set_result, args=(i,)) for i, f in enumerate(futures[1:], 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not together.done()  # (the first is not done yet)
    futures[0].set_result(0)
    assert together.result(0) == list(range(8))
    failing = [Future(), Future(), Future()]
    together = when_all(failing)
    failing[1].set_exception(OSError("second"))
    failing[2].set_exception(OSError("third"))
    assert not together.done()
    failing[0].set_result(0)
    with pytest.raises(OSError, match="second"):
        together.result(0)
