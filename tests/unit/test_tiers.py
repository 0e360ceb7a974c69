"""The tier manager on the CPU data plane: write policies, eviction cascade, loads."""

import threading
from contextlib import contextmanager

import numpy as np
import pytest

import hicache.tiers.manager as manager_module
from hicache.errors import InvalidArgument
from hicache.keys import namespace_id, page_keys
from hicache.tiers import TierConfig, TierManager
from hicache.tree import Place, Tier
from storage_util import bad_sector, stored_run
from tiers_util import SPEC, Engine, ManualWorkers, expected_page, watched_copyto

NS = namespace_id(SPEC.fingerprint, "tiers")
PS = SPEC.page_size


def tokens(start, pages):
    return list(range(start, start + pages * PS))


@pytest.fixture
def engine():
    e = Engine(num_pages=16)
    yield e
    e.close()


def make_tm(engine, *, host_pages=12, storage=None, metrics=None, **config):
    tm = TierManager(SPEC, host_pages=host_pages, storage=storage, metrics=metrics, config=TierConfig(**config))
    tm.add_namespace(NS)
    counters = tm.register_pool(0, [engine.pool])
    return tm, counters


def prefill(tm, engine, toks, pool=0):
    """What an engine does for a new request: match, reuse the cached prefix, compute the
    rest into private pages, insert."""
    hit = tm.match(NS, toks, pool).match
    new = tm.alloc(pool, len(toks) // PS - hit.num_device_pages)
    assert new is not None
    pages = np.concatenate((hit.device_pages, new))
    engine.compute(NS, toks, pages)
    return tm.insert(NS, toks, pool, pages)


def on_disk_beside_a_locked_prompt(tm, engine, prompts):
    """Prefill ``prompts`` and leave them on disk only (device and host copies evicted),
    then prefill and lock a three-page prompt (three host pages nobody may evict);
    returns its node."""
    for toks in prompts:
        prefill(tm, engine, toks)
        tm.flush()
    tm.evict(Tier.DEVICE, tm.pools.get(0).allocator.capacity, 0)
    tm.evict(Tier.HOST, tm.host_alloc.capacity)
    tm.flush()
    assert tm.tree.sizes(Tier.HOST).cached == 0
    other = prefill(tm, engine, tokens(500, 3)).node
    tm.flush()
    tm.lock(other, 0)
    return other


def settle(tm):
    tm.flush()
    tm.check_invariants()


def load_and_check(tm, engine, handle, toks, pool=0):
    """Match, lock and load ``toks`` into ``pool``; the pages hold its bytes."""
    node = tm.match(NS, toks, pool).match.node
    tm.lock(node, pool)
    loaded = tm.wait(tm.load(node, pool))
    engine.wait(handle, loaded.wait)
    engine.check(NS, toks, loaded.device_pages)
    tm.unlock(node, pool)
    settle(tm)


def test_write_through_backs_up_on_insert(engine):
    tm, _ = make_tm(engine, write_policy="write_through")
    toks = tokens(100, 3)
    result = prefill(tm, engine, toks)
    tm.check_invariants()
    settle(tm)
    assert result.node.host_pages is not None
    # The host copy holds the inserted bytes.
    for i, h in enumerate(result.node.host_pages):
        assert tm.host_pool.page(int(h)).numpy().tobytes() == engine.read(int(result.device_pages[i]))
    tm.close()


def test_selective_write_through_waits_for_hits(engine):
    tm, _ = make_tm(engine, write_policy="write_through_selective", write_threshold=2)
    toks = tokens(100, 3)
    node = prefill(tm, engine, toks).node  # the prefill's own match found nothing
    settle(tm)
    assert node.host_pages is None
    tm.match(NS, toks, 0)
    settle(tm)
    assert node.host_pages is None  # one hit
    tm.match(NS, toks, 0)
    settle(tm)
    assert node.host_pages is not None  # second hit
    tm.close()


def test_write_back_backs_up_only_on_eviction(engine):
    tm, handle = make_tm(engine, write_policy="write_back")
    first = tokens(100, 8)
    node = prefill(tm, engine, first).node
    settle(tm)
    assert node.host_pages is None
    # 16 device pages: a second 8-page request needs room; the first is written back.
    assert tm.alloc(0, 9) is None  # nothing is free right now...
    settle(tm)  # ...but the write-back has landed and freed the pages
    assert node.host_pages is not None and node.device_pages(0) is None
    pages = tm.alloc(0, 9)
    assert pages is not None
    tm.release(0, pages)
    hit = tm.match(NS, first, 0).match
    assert hit.num_device_pages == 0 and hit.num_host_pages == 8
    tm.lock(hit.node, 0)
    loaded = tm.wait(tm.load(hit.node, 0))
    engine.wait(handle, loaded.wait)
    engine.check(NS, first, loaded.device_pages)
    tm.unlock(hit.node, 0)
    settle(tm)
    tm.close()


def test_load_from_host_layer_by_layer_gives_the_inserted_bytes(engine):
    tm, handle = make_tm(engine)
    a, b = tokens(100, 5), tokens(500, 6)
    prefill(tm, engine, a)
    settle(tm)
    prefill(tm, engine, b)  # 11 of 16 pages
    settle(tm)
    tm.evict(Tier.DEVICE, 16, 0)
    settle(tm)
    hit = tm.match(NS, a, 0).match
    assert (hit.num_device_pages, hit.num_host_pages) == (0, 5)
    tm.lock(hit.node, 0)
    future = tm.load(hit.node, 0)
    assert future.done(), "a host-only load answers at once"
    loaded = future.result()
    assert loaded.num_loaded_pages == 5 and len(loaded.wait) == 1
    tm.check_invariants()
    # A second request sharing the path while the copy may still run waits on the same ticket.
    again = tm.match(NS, a, 0)
    assert again.match.device_pages.tolist() == loaded.device_pages.tolist()
    engine.wait(handle, loaded.wait)
    engine.check(NS, a, loaded.device_pages)
    tm.unlock(hit.node, 0)
    settle(tm)
    assert tm.match(NS, a, 0).wait == ()
    tm.close()


def test_loads_reuse_the_device_prefix_and_bring_the_rest(engine):
    tm, handle = make_tm(engine)
    shared, tail = tokens(100, 2), tokens(700, 3)
    prefill(tm, engine, shared)
    prefill(tm, engine, shared + tail)
    settle(tm)
    # Evict only the tail (a leaf) from the device.
    tm.evict(Tier.DEVICE, 1, 0)
    settle(tm)
    hit = tm.match(NS, shared + tail, 0).match
    assert (hit.num_device_pages, hit.num_host_pages) == (2, 3)
    tm.lock(hit.node, 0)
    loaded = tm.wait(tm.load(hit.node, 0))
    assert loaded.num_loaded_pages == 3 and len(loaded.device_pages) == 5
    assert loaded.device_pages[:2].tolist() == hit.device_pages.tolist()
    engine.wait(handle, loaded.wait)
    engine.check(NS, shared + tail, loaded.device_pages)
    tm.unlock(hit.node, 0)
    settle(tm)
    tm.close()


def test_host_pressure_drops_host_copies_of_device_resident_nodes(engine):
    tm, _ = make_tm(engine, host_pages=6)
    prefill(tm, engine, tokens(100, 4))
    settle(tm)
    second = prefill(tm, engine, tokens(900, 4)).node
    settle(tm)
    # Host holds 6 pages: the first request's copy went to make room for the second.
    assert second.host_pages is not None
    first = tm.match(NS, tokens(100, 4), 0).match
    assert first.num_device_pages == 4 and first.node.host_pages is None
    tm.close()


def test_private_pages_accounting_and_errors(engine):
    tm, _ = make_tm(engine)
    pages = tm.alloc(0, 4)
    acct = tm.accounting()[Place.device(0)]
    assert acct.private == 4 and acct.free == 12 and acct.total == 16
    with pytest.raises(InvalidArgument):
        tm.release(0, [pages[0], pages[0]])
    with pytest.raises(InvalidArgument):
        tm.insert(NS, tokens(1, 2), 0, [pages[0], 16])  # page 16 is not private
    with pytest.raises(InvalidArgument):
        tm.release(0, [17])
    with pytest.raises(InvalidArgument):
        tm.alloc(3, 1)  # unknown pool
    tm.release(0, pages)
    assert tm.accounting()[Place.device(0)].private == 0
    tm.check_invariants()
    with pytest.raises(InvalidArgument):
        TierConfig(write_policy="sometimes")
    tm.close()


def test_duplicates_from_a_concurrent_prefill_are_freed(engine):
    tm, _ = make_tm(engine, write_policy="write_back")
    toks = tokens(100, 3)
    a = tm.alloc(0, 3)
    b = tm.alloc(0, 3)
    engine.compute(NS, toks, a)
    engine.compute(NS, toks, b)
    tm.insert(NS, toks, 0, a)
    second = tm.insert(NS, toks, 0, b)
    assert second.duplicate_pages.tolist() == b.tolist()
    acct = tm.accounting()[Place.device(0)]
    assert acct.private == 0 and acct.free == 13
    tm.check_invariants()
    tm.close()


def test_layer_wise_load_releases_early_layers_first(engine):
    """The engine sees layer 0 complete while the last layer is still to be copied."""
    tm, handle = make_tm(engine, copy_threads=1)
    toks = tokens(100, 4)
    prefill(tm, engine, toks)
    settle(tm)
    tm.evict(Tier.DEVICE, 16, 0)
    settle(tm)
    counters = tm.pools[0].counters
    stamp = counters.complete_layer
    gate = threading.Event()

    def gated(ticket, layer):
        stamp(ticket, layer)
        if layer == 0:
            gate.wait(30)  # hold the copier after the first layer until the engine has looked

    counters.complete_layer = gated
    hit = tm.match(NS, toks, 0).match
    tm.lock(hit.node, 0)
    loaded = tm.wait(tm.load(hit.node, 0))
    (ticket,) = loaded.wait
    waiter = engine.waiter(handle)
    waiter.wait_layer(ticket, 0, timeout_s=30)
    assert not waiter.is_done(ticket, SPEC.num_layers - 1), "the last layer landed before the first was released"
    gate.set()
    waiter.wait_layer(ticket, SPEC.num_layers - 1, timeout_s=30)
    engine.check(NS, toks, loaded.device_pages)
    tm.unlock(hit.node, 0)
    settle(tm)
    tm.close()


@pytest.fixture
def store(tmp_path):
    from hicache.storage.lmdb_backend import LmdbBackend

    backend = LmdbBackend(tmp_path / "lmdb", capacity_bytes=64 * SPEC.host_page_bytes)
    yield backend
    backend.close()


def disk_pages(tm):
    return tm.tree.sizes(Tier.DISK).cached


def assert_on_disk(store, prompts):
    """Every page of every prompt has its record, with the bytes derived from its key."""
    buffer = np.empty(SPEC.host_page_bytes, dtype=np.uint8)
    for toks in prompts:
        for key in page_keys(NS, toks, PS):
            assert store.get([key], [buffer], fingerprint=SPEC.fingerprint) == [True]
            assert buffer.tobytes() == expected_page(key)


def test_disk_write_through_and_load_from_disk(engine, store):
    tm, handle = make_tm(engine, host_pages=8, storage=store)
    toks = tokens(100, 5)
    prefill(tm, engine, toks)
    settle(tm)
    assert disk_pages(tm) == 5 and store.stats().records == 5
    tm.evict(Tier.DEVICE, 16, 0)
    tm.evict(Tier.HOST, 8)
    settle(tm)
    hit = tm.match(NS, toks, 0).match
    assert (hit.num_device_pages, hit.num_host_pages, hit.num_disk_pages) == (0, 0, 5)
    settle(tm)  # the match started a prefetch: the pages are on host now
    again = tm.match(NS, toks, 0).match
    assert again.num_host_pages == 5
    tm.evict(Tier.HOST, 8)
    settle(tm)
    node = tm.match(NS, toks[:8], 0).match.node  # only the first two pages
    tm.lock(node, 0)
    loaded = tm.wait(tm.load(node, 0))
    assert loaded.num_loaded_pages == 2
    engine.wait(handle, loaded.wait)
    engine.check(NS, toks, loaded.device_pages)
    tm.unlock(node, 0)
    settle(tm)
    tm.close()


def test_a_pool_retired_while_its_load_waits_for_disk_reads_ends_the_load_and_keeps_no_lock(store):
    """The engine goes (its session's lock released, its pool retired) between a load
    and the end of the disk reads it waits for: the load ends with nothing loaded, its
    device pages and lock go with the pool, and the pages it read stay on host,
    evictable, for the next engine. (Before, the reads' end started copies into the
    unmapped pool: an exception on the owner thread, and a lock nobody held.)"""
    first, second = Engine(num_pages=16), Engine(num_pages=16)
    tm, _ = make_tm(first, host_pages=8, storage=store, prefetch_min_pages=1000)
    try:
        toks = tokens(100, 4)
        prefill(tm, first, toks)
        tm.flush()
        tm.evict(Tier.DEVICE, 16, 0)
        tm.evict(Tier.HOST, 8)
        settle(tm)
        node = tm.match(NS, toks, 0).match.node
        assert tm.tree.match(NS, toks, 0, touch=False).num_disk_pages == 4
        tm.lock(node, 0)
        future = tm.load(node, 0)
        assert not future.done()  # waits for the reads, which end on a later poll
        tm.unlock(node, 0)
        tm.retire_pool(0)
        assert future.done() and future.result().num_loaded_pages == 0
        settle(tm)  # the reads end
        assert not tm.tree.locked_pools()
        assert tm.tree.sizes(Tier.HOST).protected == 0
        handle = tm.register_pool(1, [second.pool])
        assert tm.match(NS, toks, 1).match.num_host_pages == 4
        load_and_check(tm, second, handle, toks, pool=1)
    finally:
        tm.close()
        first.close()
        second.close()


@contextmanager
def owned_pages_on_disk(store):
    """A tier manager with an engine-owned pool (id 0, its blocks' bytes all 1), whose
    three pages of prompt ``toks`` were stored from blocks 1-3 and are on disk only;
    yields ``(tm, ns, toks, buffers)`` and closes the manager."""
    import torch

    from hicache.foreign import ForeignPool
    from owned_util import OWNED_SPEC, layer_major

    layout = layer_major(8)
    buffers = [torch.zeros(a.size, dtype=torch.uint8) for a in layout.allocations]
    tm = TierManager(OWNED_SPEC, host_pages=8, storage=store, config=TierConfig(prefetch_min_pages=1000))
    try:
        ns = namespace_id(OWNED_SPEC.fingerprint, "owned")
        tm.add_namespace(ns)
        tm.register_owned_pool(0, ForeignPool(layout, buffers, [None] * len(buffers)))
        toks = list(range(7, 7 + 3 * OWNED_SPEC.page_size))
        buffers[0][:] = 1  # the engine's KV of ``toks`` in blocks 1-3 (and every other block)
        assert tm.wait(tm.store(ns, toks, 0, [1, 2, 3])).num_cached == 3
        tm.flush()
        tm.evict(Tier.HOST, 8)
        tm.flush()
        yield tm, ns, toks, buffers
    finally:
        tm.close()


def test_an_owned_pool_retired_while_its_load_into_waits_for_disk_reads_ends_the_load(store):
    """The same for an engine-owned pool's ``load_into``."""
    with owned_pages_on_disk(store) as (tm, ns, toks, _):
        tm.check_invariants()
        node = tm.match(ns, toks, 0).match.node
        assert tm.tree.match(ns, toks, 0, touch=False).num_disk_pages == 3
        tm.lock(node, 0)
        future = tm.load_into(node, 0, [4, 5, 6])
        assert not future.done()
        tm.unlock(node, 0)
        tm.retire_pool(0)
        assert future.done() and future.result().num_loaded == 0
        tm.flush()
        tm.check_invariants()
        assert not tm.tree.locked_pools() and tm.tree.sizes(Tier.HOST).protected == 0


def test_an_owned_load_into_whose_engine_stopped_waiting_during_its_disk_reads_writes_no_block(store):
    """``expired()`` says the engine gave up on the load_into (its call timed out: it
    takes the blocks as loaded with nothing, and may reuse them): one expired on
    arrival is refused before anything changes, and one whose disk reads end after
    that copies nothing into the blocks and holds nothing."""
    from hicache.errors import DeadlinePassed

    with owned_pages_on_disk(store) as (tm, ns, toks, buffers):
        buffers[0][:] = 2  # blocks 4-6 hold another request's KV now
        node = tm.match(ns, toks, 0).match.node
        tm.lock(node, 0)
        with pytest.raises(DeadlinePassed):
            tm.load_into(node, 0, [4, 5, 6], expired=lambda: True)
        answers = iter([False, True])  # in time on arrival, late when the reads are done
        future = tm.load_into(node, 0, [4, 5, 6], expired=lambda: next(answers))
        assert not future.done()  # reading from disk
        assert tm.wait(future) == (0, ())
        tm.flush()
        assert bool((buffers[0] == 2).all())  # no block was written
        tm.unlock(node, 0)
        tm.check_invariants()
        assert not tm.tree.locked_pools() and tm.tree.sizes(Tier.HOST).protected == 0


def test_a_page_the_disk_tier_evicts_while_on_host_is_written_again_with_its_tokens(engine, tmp_path):
    """The tree keeps no tokens for pages on disk and in no device pool. A disk tier of
    four pages evicts the oldest prompt while its host copy stays: its tokens are read back from the records
    first, so that when the host copy goes it is written again — the same bytes."""
    from hicache.storage.lmdb_backend import LmdbBackend

    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=4 * SPEC.host_page_bytes)
    tm, _ = make_tm(engine, host_pages=8, storage=store)
    try:
        a, b, c = tokens(100, 2), tokens(200, 2), tokens(300, 2)
        node_a = prefill(tm, engine, a).node
        settle(tm)
        assert node_a.on_disk and node_a.tokens  # (kept while on a device)
        tm.evict(Tier.DEVICE, 16, 0)
        assert node_a.host_pages is not None and node_a.tokens == b""
        prefill(tm, engine, b)
        settle(tm)
        prefill(tm, engine, c)  # the disk tier makes room: a, the oldest, goes
        settle(tm)
        assert not node_a.on_disk and node_a.host_pages is not None
        assert node_a.tokens == np.asarray(a, "<i4").tobytes()
        tm.evict(Tier.DEVICE, 16, 0)
        tm.evict(Tier.HOST, 8)  # a is written before its host copy goes
        settle(tm)
        hit = tm.tree.match(NS, a, 0, touch=False)
        assert hit.num_disk_pages == 2 and hit.node.tokens == b""
        assert_on_disk(store, [a])
    finally:
        tm.close()
        store.close()


def test_a_page_whose_records_the_store_dropped_on_its_own_goes_when_its_host_copy_goes(engine, store):
    """Records a (shared) store evicted on its own take the tokens with them: the node,
    still on host, cannot be written again; host eviction drops it instead of waiting
    for a write that cannot come, and an insert of those tokens makes it writable."""
    tm, _ = make_tm(engine, host_pages=8, storage=store)
    try:
        a = tokens(100, 2)
        node = prefill(tm, engine, a).node
        settle(tm)
        tm.evict(Tier.DEVICE, 16, 0)  # on host and disk: no tokens kept
        store.delete(node.page_key_list()).result()
        tm.forget_disk_keys(node.page_key_list())
        assert not node.on_disk and node.host_pages is not None and not tm.tree.writable(node)
        assert tm.evict(Tier.HOST, 8) == 2  # dropped at once: nothing to wait for
        settle(tm)
        assert tm.tree.match(NS, a, 0, touch=False).num_pages == 0
        node = prefill(tm, engine, a).node  # computed again: written again
        settle(tm)
        assert node.on_disk
        assert_on_disk(store, [a])
    finally:
        tm.close()


def test_disk_write_back_writes_only_when_host_evicts(engine, store):
    tm, _ = make_tm(engine, host_pages=4, storage=store, disk_policy="write_back")
    prefill(tm, engine, tokens(100, 3))
    settle(tm)
    assert disk_pages(tm) == 0
    tm.evict(Tier.DEVICE, 16, 0)  # host is now the only copy
    settle(tm)
    tm.evict(Tier.HOST, 4)  # written to disk first, dropped after
    settle(tm)
    hit = tm.match(NS, tokens(100, 3), 0).match
    assert hit.num_disk_pages == 3 and store.stats().records == 3
    tm.close()


def test_host_eviction_starts_only_the_writes_it_needs(engine, store):
    """Under write_back a host full of pages without a disk copy: evicting one page writes
    the oldest node alone (each write pins its path until it lands), not every node."""
    tm, _ = make_tm(engine, host_pages=8, storage=store, disk_policy="write_back")
    try:
        for start in (100, 200, 300):
            prefill(tm, engine, tokens(start, 2))
        settle(tm)
        tm.evict(Tier.DEVICE, 16, 0)
        assert tm.tree.sizes(Tier.HOST).cached == 6 and disk_pages(tm) == 0
        assert tm.evict(Tier.HOST, 1) == 0  # (freed once written)
        assert tm.disk.pending == 2
        settle(tm)
        assert disk_pages(tm) == 2 and tm.tree.sizes(Tier.HOST).cached == 4
        assert tm.tree.match(NS, tokens(100, 2), 0, touch=False).num_disk_pages == 2
        assert_on_disk(store, [tokens(100, 2)])
    finally:
        tm.close()


def test_a_write_never_evicts_the_disk_copy_of_its_own_parent(engine, tmp_path):
    """A full disk tier makes room for a page whose parent is the tier's oldest leaf:
    another node goes, not the parent (its child's records would have nowhere to hang)."""
    from hicache.storage.lmdb_backend import LmdbBackend

    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=4 * SPEC.host_page_bytes)
    tm, _ = make_tm(engine, host_pages=8, storage=store)
    try:
        p, q = tokens(100, 2), tokens(200, 2)
        for toks in (p, q):
            prefill(tm, engine, toks)
            settle(tm)
        longer = p + tokens(900, 1)
        prefill(tm, engine, longer)  # its backup, then its disk write, land at the next poll
        tm.match(NS, q, 0)  # q is used after p: p is now the disk tier's oldest leaf
        settle(tm)
        hit = tm.tree.match(NS, longer, 0, touch=False)
        assert hit.num_pages == 3 and all(n.on_disk for n in tm.tree.path(hit.node))
        assert not tm.tree.match(NS, q, 0, touch=False).node.on_disk
        assert store.stats().records == disk_pages(tm) == 3
        assert_on_disk(store, [longer])
    finally:
        tm.close()
        store.close()


@pytest.mark.parametrize("capacity_pages", [0, 2])
def test_a_prompt_larger_than_the_whole_disk_tier_is_not_written_and_its_host_copy_goes(engine, tmp_path,
                                                                                       capacity_pages, caplog):
    """[disk].capacity_bytes below one page (0 pages) or below a prompt's pages: that
    prompt can never be on disk. Its host copy goes when host evicts it — as a tenant's
    over its disk quota does — rather than waiting for a write that cannot start (the
    host tier would fill with pages nothing can evict) or failing at the store each
    time; a disk tier that holds no page of the spec is named at the start."""
    from hicache.storage.lmdb_backend import LmdbBackend

    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=max(1, capacity_pages * SPEC.host_page_bytes))
    tm, _ = make_tm(engine, host_pages=8, storage=store)
    try:
        assert ("capacity_bytes" in caplog.text) == (capacity_pages == 0)
        prefill(tm, engine, tokens(100, 4))
        settle(tm)
        tm.evict(Tier.DEVICE, 16, 0)
        assert tm.tree.sizes(Tier.HOST).cached == 4
        assert tm.evict(Tier.HOST, 8) == 4
        settle(tm)
        assert tm.tree.sizes(Tier.HOST).cached == 0 and store.stats().records == 0
        assert "disk write failed" not in caplog.text
    finally:
        tm.close()
        store.close()


def test_pages_written_after_their_parent_left_the_disk_tier_are_deleted_not_orphaned(engine, store):
    """The store drops a parent's records on its own while its child's write is in flight:
    the child's records, which the tree cannot take, are deleted when the write lands."""
    tm, _ = make_tm(engine, host_pages=8, storage=store)
    try:
        p = tokens(100, 2)
        parent = prefill(tm, engine, p).node
        settle(tm)
        prefill(tm, engine, p + tokens(900, 2))
        while not tm.disk.pending:  # the backup lands and starts the child's write
            tm.poll(0.01, limit=1)
        keys = parent.page_key_list()
        store.delete(keys).result()
        tm.forget_disk_keys(keys)
        settle(tm)
        assert disk_pages(tm) == 0 and store.stats().records == 0
        hit = tm.tree.match(NS, p + tokens(900, 2), 0, touch=False)  # still cached above
        assert hit.num_pages == 4 and all(n.host_pages is not None for n in tm.tree.path(hit.node))
    finally:
        tm.close()


@pytest.mark.parametrize("capacity", ["inclusive", "exclusive"])
def test_exclusive_capacity_caches_about_host_plus_disk_pages(engine, tmp_path, capacity):
    """Twenty two-page prompts through a host tier and a disk tier of 16 pages each:
    inclusive (write-through to disk), the cache holds what the disk holds; exclusive,
    host and disk hold different pages (less the host's free sixteenth). Every cached
    page loads back with its bytes."""
    from hicache.storage.lmdb_backend import LmdbBackend

    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=16 * SPEC.host_page_bytes)
    policy = {"disk_policy": "write_back", "capacity": "exclusive"} if capacity == "exclusive" else {}
    tm, handle = make_tm(engine, host_pages=16, storage=store, **policy)
    try:
        prompts = [tokens(1000 * i, 2) for i in range(20)]
        for toks in prompts:
            prefill(tm, engine, toks)
            settle(tm)
        cached = [toks for toks in prompts if tm.tree.match(NS, toks, 0, touch=False).num_pages == 2]
        if capacity == "inclusive":
            assert tm.num_cached_pages() <= 16
        else:
            assert tm.num_cached_pages() >= 2 * 16 - 2 and tm.host_alloc.num_free >= 1
            assert cached == prompts[-len(cached):]  # the newest ones, none lost in between
        for toks in cached:
            load_and_check(tm, engine, handle, toks)
        assert store.stats().records == disk_pages(tm)
    finally:
        tm.close()
        store.close()


@pytest.mark.parametrize("capacity", ["inclusive", "exclusive"])
def test_exclusive_capacity_evicts_disk_records_of_host_pages_first(engine, tmp_path, capacity):
    """Seven prompts on disk only, then one read back from disk (host and disk hold it
    now), then a prompt whose write needs disk room. Inclusive: the disk's LRU goes —
    the oldest prompt. Exclusive: the record of the prompt read back goes (its host copy
    stays), and the disk keeps a page cached nowhere else; that prompt is written again
    when its host copy is evicted. Nothing is lost, every page loads with its bytes."""
    from hicache.storage.lmdb_backend import LmdbBackend

    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=16 * SPEC.host_page_bytes)
    policy = {"disk_policy": "write_back", "capacity": "exclusive"} if capacity == "exclusive" else {}
    tm, handle = make_tm(engine, host_pages=16, storage=store, **policy)
    pool = tm.pools.get(0)

    def to_disk_only():
        tm.evict(Tier.DEVICE, pool.allocator.capacity, 0)
        tm.evict(Tier.HOST, tm.host_alloc.capacity)
        settle(tm)

    try:
        old = [tokens(1000 * i, 2) for i in range(6)]
        read_back = tokens(9000, 2)
        for toks in old + [read_back]:
            prefill(tm, engine, toks)
            settle(tm)
        to_disk_only()
        assert disk_pages(tm) == 14 and tm.tree.sizes(Tier.HOST).cached == 0
        load_and_check(tm, engine, handle, read_back)  # disk -> host -> device: on every tier now
        (node,) = tm.tree.path(tm.tree.match(NS, read_back, 0, touch=False).node)
        assert node.on_disk and node.host_pages is not None
        for toks in (tokens(20000, 2), tokens(21000, 2)):  # written to disk: 18 pages > 16
            new = prefill(tm, engine, toks).node
            settle(tm)
            assert new.on_disk or tm.disk.write(new)  # (inclusive: written through already)
            settle(tm)
        cached = lambda toks: tm.tree.match(NS, toks, 0, touch=False).num_pages == 2  # noqa: E731
        if capacity == "inclusive":
            assert not cached(old[0])  # the disk's oldest went
            assert node.on_disk
        else:
            assert cached(old[0]) and all(cached(toks) for toks in old)
            assert not node.on_disk and node.host_pages is not None  # its record went, not a page
        assert cached(read_back)
        to_disk_only()  # the host copies are written before they go (exclusive)
        for toks in [toks for toks in old + [read_back] if cached(toks)]:
            load_and_check(tm, engine, handle, toks)
        assert cached(read_back)  # (the newest: written again, or never dropped)
        assert store.stats().records == disk_pages(tm)
    finally:
        tm.close()
        store.close()


def test_exclusive_capacity_needs_the_write_back_disk_policy():
    with pytest.raises(InvalidArgument, match="write_back"):
        TierConfig(capacity="exclusive")
    with pytest.raises(InvalidArgument, match="capacity must be one of"):
        TierConfig(capacity="sum")
    assert TierConfig(capacity="exclusive", disk_policy="write_back").exclusive


def test_concurrent_loads_of_the_same_node_share_one_transfer(engine, store):
    tm, handle = make_tm(engine, host_pages=8, storage=store)
    toks = tokens(100, 4)
    prefill(tm, engine, toks)
    settle(tm)
    tm.evict(Tier.DEVICE, 16, 0)
    tm.evict(Tier.HOST, 8)
    settle(tm)
    reads = []
    original = store.get

    def counting_get(keys, buffers, *, fingerprint):
        reads.append(len(keys))
        return original(keys, buffers, fingerprint=fingerprint)

    store.get = counting_get
    node = tm.match(NS, toks, 0).match.node  # starts a prefetch the loads will join
    tm.lock(node, 0)
    tm.lock(node, 0)
    first, second = tm.load(node, 0), tm.load(node, 0)
    a, b = tm.wait(first), tm.wait(second)
    # One disk read for the prefetch and both loads; the second load found the pages
    # on the device, still landing.
    assert reads == [4]
    assert a.device_pages.tolist() == b.device_pages.tolist()
    assert b.num_loaded_pages == 0 and set(a.wait) == set(b.wait)
    assert tm.accounting()[Place.device(0)].total == 16
    engine.wait(handle, a.wait)
    engine.check(NS, toks, a.device_pages)
    tm.unlock(node, 0)
    tm.unlock(node, 0)
    settle(tm)
    tm.close()


def test_corrupt_disk_record_shortens_the_hit_and_leaks_nothing(engine, store):
    tm, handle = make_tm(engine, host_pages=8, storage=store)
    toks = tokens(100, 5)
    prefill(tm, engine, toks)
    settle(tm)
    tm.evict(Tier.DEVICE, 16, 0)
    tm.evict(Tier.HOST, 8)
    settle(tm)
    keys = tm.match(NS, toks, 0).match.node.page_key_list()
    settle(tm)  # the prefetch of that match landed; drop it again
    tm.evict(Tier.HOST, 8)
    settle(tm)
    original = store.get

    def third_page_corrupt(ks, buffers, *, fingerprint):
        found = original(ks, buffers, fingerprint=fingerprint)
        return [ok and k != keys[2] for k, ok in zip(ks, found)]

    store.get = third_page_corrupt
    node = tm.match(NS, toks, 0).match.node
    tm.lock(node, 0)
    loaded = tm.wait(tm.load(node, 0))
    assert loaded.num_loaded_pages == 2 and len(loaded.device_pages) == 2
    engine.wait(handle, loaded.wait)
    engine.check(NS, toks, loaded.device_pages)
    tm.unlock(node, 0)
    settle(tm)
    store.get = original
    hit = tm.match(NS, toks, 0).match
    assert hit.num_pages == 2, "the pages from the corrupt one on are forgotten"
    accounts = tm.accounting()
    assert accounts[Place.device(0)].free + accounts[Place.device(0)].cached_evictable == 16
    assert accounts[Place(Tier.HOST)].staging == 0 and tm.host_alloc.num_free + accounts[Place(Tier.HOST)].cached_evictable == 8
    tm.close()


def on_disk_only(tm, engine, toks):
    """Prefill ``toks`` and evict its device and host copies: its pages are on disk only."""
    prefill(tm, engine, toks)
    settle(tm)
    tm.evict(Tier.DEVICE, 16, 0)
    tm.evict(Tier.HOST, tm.host_alloc.capacity)
    settle(tm)
    assert tm.tree.sizes(Tier.HOST).cached == 0


def load_all(tm, engine, handle, toks):
    """Match, lock and load ``toks``; the pages loaded hold its bytes. The load's result."""
    node = tm.match(NS, toks, 0).match.node
    tm.lock(node, 0)
    loaded = tm.wait(tm.load(node, 0))
    engine.wait(handle, loaded.wait)
    engine.check(NS, toks, loaded.device_pages)
    tm.unlock(node, 0)
    settle(tm)
    return loaded


def test_a_disk_read_that_raises_once_is_a_miss_and_a_later_read_serves_the_records(engine, store):
    """The read call itself fails (LMDB out of reader slots; an EIO, ENOMEM or a store
    being reopened alike): the load misses, counted, but nothing is known about the
    records — they stay on disk and in the tree, and the next read serves their bytes."""
    import lmdb

    from hicache.metrics import Metrics

    metrics = Metrics()
    # (no prefetch at a match: the load's own read is the one that fails)
    tm, handle = make_tm(engine, host_pages=8, storage=store, metrics=metrics, prefetch_min_pages=16)
    toks = tokens(100, 5)
    keys = page_keys(NS, toks, PS)
    on_disk_only(tm, engine, toks)
    original, calls = store.get, []

    def fails_once(ks, buffers, *, fingerprint):
        calls.append(list(ks))
        if len(calls) == 1:
            raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL")
        return original(ks, buffers, fingerprint=fingerprint)

    store.get = fails_once
    assert load_all(tm, engine, handle, toks).num_loaded_pages == 0
    assert calls == [keys]
    assert disk_pages(tm) == 5, "a read that failed as a whole forgot the pages on disk"
    store.flush()
    assert sorted(k for k, _ in store.iter_metadata()) == sorted(keys), "its records were deleted"
    assert metrics.missed_tokens["load_failed"] == 5 * PS
    assert metrics.missed_tokens["corrupt_record"] == 0
    assert tm.match(NS, toks, 0).match.num_disk_pages == 5
    loaded = load_all(tm, engine, handle, toks)
    assert loaded.num_loaded_pages == 5 and len(loaded.device_pages) == 5
    store.get = original
    assert_on_disk(store, [toks])
    tm.close()


def test_a_disk_read_that_meets_an_eio_keeps_its_records_and_a_later_read_serves_them(engine, store, monkeypatch):
    """Every ``preadv`` of one read fails with EIO (a disk that hiccuped): the records'
    bytes were never seen, so nothing says they are bad — the load misses, counted as
    load_failed, the records stay on disk and in the tree, and the next read serves
    their bytes."""
    import errno
    import os

    from hicache.metrics import Metrics
    from hicache.storage import lmdb_backend

    metrics = Metrics()
    # (no prefetch at a match: the load's own read is the one that fails)
    tm, handle = make_tm(engine, host_pages=8, storage=store, metrics=metrics, prefetch_min_pages=16)
    toks = tokens(100, 5)
    keys = page_keys(NS, toks, PS)
    on_disk_only(tm, engine, toks)
    real_preadv, original_get, failing, calls = os.preadv, store.get, threading.Event(), []

    def preadv(fd, buffers, offset):
        if failing.is_set():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset)

    def first_get_meets_eio(ks, buffers, *, fingerprint):
        calls.append(list(ks))
        if len(calls) == 1:
            failing.set()
        try:
            return original_get(ks, buffers, fingerprint=fingerprint)
        finally:
            failing.clear()

    monkeypatch.setattr(lmdb_backend.os, "preadv", preadv)
    store.get = first_get_meets_eio
    assert load_all(tm, engine, handle, toks).num_loaded_pages == 0
    assert calls == [keys]
    assert disk_pages(tm) == 5, "a read that met an EIO forgot the pages on disk"
    store.flush()
    assert sorted(k for k, _ in store.iter_metadata()) == sorted(keys), "its records were deleted"
    assert metrics.missed_tokens["load_failed"] == 5 * PS
    assert metrics.missed_tokens["corrupt_record"] == 0
    loaded = load_all(tm, engine, handle, toks)
    assert loaded.num_loaded_pages == 5 and len(loaded.device_pages) == 5
    store.get = original_get
    assert_on_disk(store, [toks])
    store.check_invariants()
    tm.close()


def test_an_unreadable_record_cuts_the_load_there_and_every_record_stays(engine, store, monkeypatch):
    """The third record of a five-page node sits on a bad sector (EIO), the others
    beside it in one run of slots: the load brings the two pages before it — the store
    names the unreadable record and judges the others on their own — and nothing is
    known of the unreadable one, so it and the pages after it stay on disk, a miss
    (load_failed) this time."""
    from hicache.metrics import Metrics

    metrics = Metrics()
    tm, handle = make_tm(engine, host_pages=8, storage=store, metrics=metrics, prefetch_min_pages=16)
    toks = tokens(100, 5)
    keys = page_keys(NS, toks, PS)
    on_disk_only(tm, engine, toks)
    bad_sector(monkeypatch, store, keys[2])
    loaded = load_all(tm, engine, handle, toks)
    assert loaded.num_loaded_pages == 2 and len(loaded.device_pages) == 2
    assert metrics.missed_tokens["load_failed"] == 3 * PS
    assert metrics.missed_tokens["corrupt_record"] == 0
    assert disk_pages(tm) == 5, "the unreadable record, or those after it, left the disk tier"
    match = tm.match(NS, toks, 0).match
    assert match.num_pages == 5 and match.num_disk_pages == 3
    store.flush()
    assert sorted(k for k, _ in store.iter_metadata()) == sorted(keys)
    assert store.stats().corrupt_records == 0
    store.check_invariants()
    tm.close()


def test_a_record_that_stays_unreadable_is_forgotten_after_a_few_failed_reads_in_a_row(
        engine, store, monkeypatch, caplog):
    """A bad sector under the third record of a five-page node: each load brings the
    two pages before it and misses the rest, which stays on disk — until the reads of
    that node have failed ``UNREADABLE_READS`` times with no good read between. Then the
    node is forgotten on disk from the unreadable record on and its records deleted,
    counted (hicache_disk_unreadable_pages_total, miss reason unreadable_record) and
    logged once, so a match stops promising pages no load can bring and the prefix is
    computed and written again. A good read between failed ones starts the count again:
    a failure that passes keeps the records."""
    import logging

    from hicache.metrics import Metrics

    UNREADABLE_READS = 3  # (hicache.tiers.disk_reads.UNREADABLE_READS)
    metrics = Metrics()
    tm, handle = make_tm(engine, host_pages=8, storage=store, metrics=metrics, prefetch_min_pages=16)
    toks = tokens(100, 5)
    keys = page_keys(NS, toks, PS)
    on_disk_only(tm, engine, toks)
    failing = bad_sector(monkeypatch, store, keys[2])

    def off_host():
        tm.evict(Tier.DEVICE, 16, 0)
        tm.evict(Tier.HOST, tm.host_alloc.capacity)
        settle(tm)

    for _ in range(UNREADABLE_READS - 1):
        assert load_all(tm, engine, handle, toks).num_loaded_pages == 2
        off_host()
    failing.clear()  # (the sector reads again once: the failures so far were passing ones)
    assert load_all(tm, engine, handle, toks).num_loaded_pages == 5
    off_host()
    failing.set()
    for _ in range(UNREADABLE_READS - 1):
        assert load_all(tm, engine, handle, toks).num_loaded_pages == 2
        off_host()
    assert tm.match(NS, toks, 0).match.num_pages == 5, "failures a good read broke up forgot the records"
    assert metrics.missed_tokens.get("unreadable_record", 0) == 0
    with caplog.at_level(logging.WARNING):
        assert load_all(tm, engine, handle, toks).num_loaded_pages == 2
    assert tm.match(NS, toks, 0).match.num_pages == 2, "a record unreadable at every read is promised again"
    assert disk_pages(tm) == 2
    store.flush()
    assert sorted(k for k, _ in store.iter_metadata()) == sorted(keys[:2])
    assert store.stats().corrupt_records == 0
    assert metrics.registry.get_sample_value("hicache_disk_unreadable_pages_total") == 3
    assert metrics.missed_tokens.get("unreadable_record", 0) == 3 * PS
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR and "forgotten" in r.getMessage()]) == 1
    off_host()
    failing.clear()
    loaded = load_all(tm, engine, handle, toks)  # (the prefix computed and stored again)
    assert loaded.num_loaded_pages == 2
    prefill(tm, engine, toks)
    settle(tm)
    tm.flush()
    assert_on_disk(store, [toks])
    store.check_invariants()
    tm.close()


def test_a_record_flipped_on_disk_is_dropped_and_the_pages_before_it_load(engine, store):
    """A payload byte of the third page's record flipped in the slab file itself: the
    load brings the two pages before it, and the node is forgotten on disk from it on,
    its records deleted."""
    from pathlib import Path

    tm, handle = make_tm(engine, host_pages=8, storage=store, prefetch_min_pages=16)
    toks = tokens(100, 5)
    keys = page_keys(NS, toks, PS)
    on_disk_only(tm, engine, toks)
    store.flush()
    pattern = expected_page(keys[2])[:64]
    (slab,) = [p for p in Path(store.path).glob("slab-*.bin") if pattern in p.read_bytes()]
    data = slab.read_bytes()
    where = data.index(pattern) + 10
    with open(slab, "r+b") as f:
        f.seek(where)
        f.write(bytes([data[where] ^ 0x10]))
    loaded = load_all(tm, engine, handle, toks)
    assert loaded.num_loaded_pages == 2 and len(loaded.device_pages) == 2
    assert tm.match(NS, toks, 0).match.num_pages == 2
    store.flush()
    assert sorted(k for k, _ in store.iter_metadata()) == sorted(keys[:2])
    assert store.stats().corrupt_records == 1
    store.check_invariants()
    tm.close()


def test_a_record_of_another_size_than_its_page_cuts_the_node_there(engine, store):
    """An intact record of this spec whose payload is not a page's size, the third of a
    five-page node read at once (the store judges it alone, the same at every try): the
    load brings the two pages before it, and the node leaves the disk tier from it on —
    its record and those below go, rather than a failed read kept for the next, which
    would fail the same way for good. The intact records before it stay."""
    from hicache.storage.base import PageMeta, PageRecord

    tm, handle = make_tm(engine, host_pages=8, storage=store)
    toks = tokens(100, 5)
    keys = page_keys(NS, toks, PS)
    on_disk_only(tm, engine, toks)
    packed = np.asarray(toks, dtype="<i4").tobytes()
    odd = PageRecord(keys[2], np.zeros(SPEC.host_page_bytes - 8, dtype=np.uint8),
                     PageMeta(NS, keys[1], packed[2 * PS * 4 : 3 * PS * 4]))
    store.put([odd], fingerprint=SPEC.fingerprint).result()
    loaded = load_all(tm, engine, handle, toks)
    assert loaded.num_loaded_pages == 2 and len(loaded.device_pages) == 2
    assert disk_pages(tm) == 2
    store.flush()
    assert sorted(k for k, _ in store.iter_metadata()) == sorted(keys[:2])
    assert tm.match(NS, toks, 0).match.num_pages == 2
    settle(tm)
    tm.close()


def _chain_records(namespace, parent, toks):
    """Page records of ``toks`` (whole pages) chained after ``parent``, as a disk write
    stores them."""
    from hicache.keys import chain_page_keys
    from hicache.storage.base import PageMeta, PageRecord

    packed = np.asarray(toks, dtype="<i4").tobytes()
    keys = chain_page_keys(namespace, parent, packed, PS)
    records = []
    for i in range(len(toks) // PS):
        key = keys[i * 16 : (i + 1) * 16]
        records.append(PageRecord(key, np.full(SPEC.host_page_bytes, i, dtype=np.uint8),
                                  PageMeta(namespace, parent, packed[i * PS * 4 : (i + 1) * PS * 4])))
        parent = key
    return records


def test_rebuild_drops_a_record_whose_key_is_not_its_tokens_and_builds_the_tree_hashing_would(engine, tmp_path):
    """Damaged metadata: a record whose tokens do not hash to its key is not restored,
    nor anything below it, and is deleted; its siblings are. The rebuilt tree (restores
    given the checked keys) equals one restored from the tokens alone."""
    from hicache.keys import ROOT_PARENT_KEY
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.tree import HiRadixTree

    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    shared = _chain_records(NS, ROOT_PARENT_KEY, tokens(0, 3))
    kept = [_chain_records(NS, shared[-1].key, tokens(100 * i, 2)) for i in range(1, 4)]
    bad = _chain_records(NS, shared[-1].key, tokens(700, 3))
    bad[0] = bad[0]._replace(meta=bad[0].meta._replace(tokens=np.asarray(tokens(800, 1), dtype="<i4").tobytes()))
    store.put(shared + [r for seq in kept for r in seq] + bad, fingerprint=SPEC.fingerprint).result()

    tm = TierManager(SPEC, host_pages=4, storage=store)
    tm.register_pool(0, [engine.pool])
    assert tm.rebuild_from_storage() == 3 + 3 * 2
    tm.check_invariants()
    for i in range(1, 4):
        assert tm.tree.match(NS, tokens(0, 3) + tokens(100 * i, 2), 0).num_disk_pages == 5
    assert tm.tree.match(NS, tokens(0, 3) + tokens(800, 1), 0).num_disk_pages == 3
    hashed = HiRadixTree()
    hashed.add_namespace(NS, PS)
    for i in range(1, 4):
        hashed.restore(NS, tokens(0, 3) + tokens(100 * i, 2))

    def shape(tree):
        return sorted((node.page_keys, node.num_pages, node.parent.page_keys if node.parent else b"")
                      for node in tree.nodes() if node.num_pages)

    assert shape(tm.tree) == shape(hashed)
    tm.close()
    assert all(stored_run(store, [r.key]) == 0 for r in bad)
    assert all(stored_run(store, [r.key]) == 1 for r in shared + [r for seq in kept for r in seq])
    store.close()


def test_rebuild_restores_every_reachable_page_and_deletes_the_rest_at_once(engine, tmp_path, monkeypatch):
    """Records written straight into the store: two sequences sharing a first page,
    one chain whose second page is missing (everything below it is unreachable), and
    a page whose parent is in another namespace. One rebuild restores what a first
    page reaches and deletes the rest in the same pass."""
    from hicache.keys import ROOT_PARENT_KEY
    from hicache.storage.lmdb_backend import LmdbBackend

    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    chain = _chain_records
    shared = chain(NS, ROOT_PARENT_KEY, tokens(0, 2))
    left = chain(NS, shared[-1].key, tokens(100, 3))
    right = chain(NS, shared[-1].key, tokens(200, 1))
    broken = chain(NS, ROOT_PARENT_KEY, tokens(300, 4))
    other = namespace_id(SPEC.fingerprint, "someone-else")
    stray = chain(other, left[0].key, tokens(400, 1))  # a parent in NS, itself in another namespace
    written = shared + left + right + broken[:1] + broken[2:] + stray
    store.put(written, fingerprint=SPEC.fingerprint).result()

    tm = TierManager(SPEC, host_pages=4, storage=store)
    tm.register_pool(0, [engine.pool])
    import hicache.tiers.manager

    monkeypatch.setattr(hicache.tiers.manager, "REBUILD_PROGRESS_EVERY", 2)
    progress = []
    import gc

    collecting = []  # (paused while a step works:) on again between steps, and after
    assert gc.isenabled()
    assert tm.rebuild_from_storage(progress=lambda done: (progress.append(done),
                                                          collecting.append(gc.isenabled()))) == 2 + 3 + 1 + 1
    assert gc.isenabled() and all(collecting)
    # Reading the 11 records, indexing them by parent, walking the 7 reachable ones,
    # looking for the unreachable, then freeing the index of the 7 parents and the 11
    # records: a call every 2 of each.
    assert progress == [2, 4, 6, 8, 10] * 2 + [2, 4, 6] + [2, 4, 6, 8, 10] + [2, 4, 6] + [2, 4, 6, 8, 10]
    tm.check_invariants()
    # (the tree's match: the tier manager's reports only what its 4 host pages can stage)
    assert tm.tree.match(NS, tokens(0, 2) + tokens(100, 3), 0).num_disk_pages == 5
    assert tm.tree.match(NS, tokens(0, 2) + tokens(200, 1), 0).num_disk_pages == 3
    assert tm.tree.match(NS, tokens(300, 4), 0).num_disk_pages == 1
    assert other not in tm.tree.namespaces()
    tm.close()
    gone = [r.key for r in broken[2:] + stray]
    kept = [r.key for r in shared + left + right + broken[:1]]
    assert all(stored_run(store, [key]) == 0 for key in gone)
    assert all(stored_run(store, [key]) == 1 for key in kept)
    store.check_invariants()  # (and their payloads went with their metadata)
    store.close()


def test_a_restart_cuts_a_sequence_at_a_page_record_of_another_size(engine, tmp_path):
    """An intact page record of this spec whose payload is not a page's size, left in
    the store across a restart (every read of it is refused, and takes the read's other
    records with it): the rebuild restores the pages before it, which read back as
    written, and deletes it and the pages below it."""
    from hicache.storage.base import PageMeta, PageRecord
    from hicache.storage.lmdb_backend import LmdbBackend

    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    tm, _ = make_tm(engine, storage=store)
    toks = tokens(100, 5)
    keys = page_keys(NS, toks, PS)
    prefill(tm, engine, toks)
    settle(tm)
    tm.close()
    packed = np.asarray(toks, dtype="<i4").tobytes()
    odd = PageRecord(keys[3], np.zeros(SPEC.host_page_bytes - 8, dtype=np.uint8),
                     PageMeta(NS, keys[2], packed[3 * PS * 4 : 4 * PS * 4]))
    store.put([odd], fingerprint=SPEC.fingerprint).result()
    store.close()

    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    restarted = TierManager(SPEC, host_pages=12, storage=store)
    handle = restarted.register_pool(0, [engine.pool])
    assert restarted.rebuild_from_storage() == 3
    assert restarted.match(NS, toks, 0).match.num_disk_pages == 3
    loaded = load_all(restarted, engine, handle, toks)
    assert loaded.num_loaded_pages == 3
    store.flush()
    assert sorted(k for k, _ in store.iter_metadata()) == sorted(keys[:3])
    store.check_invariants()
    restarted.close()
    store.close()


def test_warm_restart_hits_what_was_persisted(engine, tmp_path):
    from hicache.storage.lmdb_backend import LmdbBackend

    other = namespace_id(SPEC.fingerprint, "other-tenant")
    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    tm, _ = make_tm(engine, storage=store)
    tm.add_namespace(other)
    a, b = tokens(100, 3), tokens(100, 3) + tokens(900, 2)
    prefill(tm, engine, a)
    prefill(tm, engine, b)
    settle(tm)
    tm.close()
    # A page another model (another spec) persisted in the same store.
    from hicache.storage.base import PageMeta, PageRecord

    foreign_ns = namespace_id(b"another-model-fingerprint")
    store.put([PageRecord(b"k" * 16, b"\x01" * SPEC.host_page_bytes,
                          PageMeta(foreign_ns, bytes(16), np.arange(PS, dtype="<i4").tobytes()))],
              fingerprint=b"f" * 16).result()
    store.close()

    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    restarted = TierManager(SPEC, host_pages=12, storage=store)
    _, handle = None, restarted.register_pool(0, [engine.pool])
    assert restarted.rebuild_from_storage() == 5
    assert foreign_ns not in restarted.tree.namespaces()
    restarted.check_invariants()
    hit = restarted.match(NS, b, 0).match
    assert (hit.num_device_pages, hit.num_disk_pages) == (0, 5)
    assert restarted.match(other, b, 0).match.num_pages == 0
    restarted.lock(hit.node, 0)
    loaded = restarted.wait(restarted.load(hit.node, 0))
    engine.wait(handle, loaded.wait)
    engine.check(NS, b, loaded.device_pages)
    restarted.unlock(hit.node, 0)
    settle(restarted)
    restarted.close()
    store.close()


@pytest.mark.parametrize("device_pages", [256, 32])
def test_write_through_under_a_full_host_tier_defers_backups_and_loses_nothing(tmp_path, device_pages):
    """40 prompts of 6 pages back to back, a 6-page host tier, write-through to host and
    disk: backups the host has no room for (its pages held by disk writes) are deferred
    and retried, device pressure backs such pages up before dropping them (an allocation
    waits meanwhile: backpressure), and after a flush every page is on disk — none lost."""
    from hicache.metrics import Metrics
    from hicache.storage.lmdb_backend import LmdbBackend

    engine = Engine(num_pages=device_pages)
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=1024 * SPEC.host_page_bytes)
    metrics = Metrics()
    tm = TierManager(SPEC, host_pages=6, storage=store, metrics=metrics, config=TierConfig())
    tm.add_namespace(NS)
    tm.register_pool(0, [engine.pool])
    try:
        for i in range(40):
            toks = tokens(1000 * i, 6)
            new = tm.alloc(0, 6)
            for _ in range(2000):  # the pool is full of pages waiting for host room: wait
                if new is not None:
                    break
                tm.poll(0.005)
                new = tm.alloc(0, 6)
            assert new is not None, "device pages never came back"
            engine.compute(NS, toks, new)
            tm.insert(NS, toks, 0, new)
            tm.check_invariants()
        tm.flush()
        tm.check_invariants()
        assert tm.deferred_backups == 0
        assert metrics.registry.get_sample_value("hicache_backups_deferred_total") > 0
        assert disk_pages(tm) == 240 and store.stats().records == 240
        tm.evict(Tier.DEVICE, device_pages, 0)
        tm.flush()
        assert sum(n.num_pages for n in tm.tree.nodes()) == 240
        assert_on_disk(store, [tokens(1000 * i, 6) for i in range(40)])  # and every page reads back
    finally:
        tm.close()
        store.close()
        engine.close()


def test_a_slow_disk_writer_defers_writes_within_its_bound_and_loses_nothing(tmp_path):
    """A disk four times slower than the traffic: the writer's queue never holds more
    than its bound (the host tier keeps room), writes over it are deferred and counted,
    host eviction writes a page before it drops it, every page stays cached somewhere
    after every step, and after a flush every page is on disk with its bytes."""
    from hicache.metrics import Metrics
    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import SlowStore

    engine = Engine(num_pages=24)
    store = SlowStore(LmdbBackend(tmp_path / "lmdb", capacity_bytes=1024 * SPEC.host_page_bytes), 0.01)
    metrics = Metrics()
    tm = TierManager(SPEC, host_pages=12, storage=store, metrics=metrics, config=TierConfig(disk_write_backlog=4))
    tm.add_namespace(NS)
    tm.register_pool(0, [engine.pool])
    written = []
    try:
        assert tm.queues()["disk_write"] == (0, 4)
        for i in range(30):
            toks = tokens(1000 * i, 2)
            new = tm.alloc(0, 2)
            while new is None:  # device pages come back as backups land: backpressure
                tm.poll(0.005)
                new = tm.alloc(0, 2)
            engine.compute(NS, toks, new)
            tm.insert(NS, toks, 0, new)
            written.append(toks)
            tm.poll()
            tm.check_invariants()
            queued, bound = tm.queues()["disk_write"]
            assert queued <= bound
            for earlier in written:  # cached somewhere: the tree still holds the whole prompt
                # (the tree's answer: the manager's match also cuts what a load could not
                # bring now, e.g. a disk part while the host tier is pinned by writes)
                assert tm.tree.match(NS, earlier, 0, touch=False).num_tokens == len(earlier)
        assert metrics.registry.get_sample_value("hicache_disk_writes_deferred_total") > 0
        assert store.max_pages_in_flight <= 4
        tm.flush()
        tm.check_invariants()
        assert tm.queues()["disk_write_deferred"] == (0, None)
        assert disk_pages(tm) == 60 and store.stats().records == 60
        assert_on_disk(store, written)
    finally:
        tm.close()
        store.close()
        engine.close()


def test_a_match_reports_only_what_a_load_can_deliver_and_loads_count_what_they_delivered(tmp_path):
    """Five pages on disk (two nodes: 2 pages, then 3), a host tier of six of which a
    locked prompt holds three: the match reports the first node only (its disk part
    must be staged on host; clipped at a node boundary) and keeps the tree's answer
    aside; a load of it delivers exactly that, counted as disk hits once the copies
    land. With room again the whole path is reported; a load that then falls short
    (the engine took every device page) is counted as short, not as a hit."""
    from hicache.metrics import Metrics
    from hicache.storage.lmdb_backend import LmdbBackend

    engine = Engine(num_pages=16)
    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    metrics = Metrics()
    tm = TierManager(SPEC, host_pages=6, storage=store, metrics=metrics)
    tm.add_namespace(NS)
    tm.register_pool(0, [engine.pool])
    value = metrics.registry.get_sample_value

    def prefill_and_settle(toks):
        hit = tm.match(NS, toks, 0).match
        new = tm.alloc(0, len(toks) // PS - hit.num_device_pages)
        pages = np.concatenate((hit.device_pages, new))
        engine.compute(NS, toks, pages)
        node = tm.insert(NS, toks, 0, pages).node
        tm.flush()
        return node

    try:
        first, second = tokens(0, 2), tokens(0, 2) + tokens(100, 3)
        other = on_disk_beside_a_locked_prompt(tm, engine, [first, second])  # three host pages nobody may evict
        assert tm.tree.sizes(Tier.DISK).cached == 5 + 3  # (and the locked prompt)
        hit = tm.match(NS, second, 0)
        assert hit.unclipped.num_disk_pages == 5
        assert hit.match.num_disk_pages == 2 and hit.match.num_tokens == 2 * PS
        tm.lock(hit.match.node, 0)
        loaded = tm.wait(tm.load(hit.match.node, 0))
        tm.flush()
        engine.wait(tm.pools.get(0).counters, loaded.wait)
        engine.check(NS, first, loaded.device_pages)
        assert value("hicache_matched_tokens_total", {"tier": "disk"}) == 2 * PS
        assert value("hicache_load_short_tokens_total") == 0
        tm.unlock(hit.match.node, 0)
        tm.check_invariants()
        # Room for the rest now (the first node on device, host room to stage the
        # second): all of it is reported.
        hit = tm.match(NS, second, 0)
        assert hit.unclipped is None and hit.match.num_device_pages + hit.match.num_disk_pages == 5
        # The engine takes every free device page meanwhile: the load falls short.
        held = tm.alloc(0, tm.pools.get(0).allocator.num_free)
        tm.lock(hit.match.node, 0)
        loaded = tm.wait(tm.load(hit.match.node, 0))
        tm.flush()
        assert len(loaded.device_pages) == 2 and loaded.num_loaded_pages == 0
        assert value("hicache_load_short_tokens_total") == 3 * PS
        assert value("hicache_matched_tokens_total", {"tier": "disk"}) == 2 * PS  # nothing more delivered
        tm.unlock(hit.match.node, 0)
        tm.unlock(other, 0)
        tm.release(0, held)
        tm.check_invariants()
    finally:
        tm.close()
        store.close()
        engine.close()


def test_a_matched_paths_own_host_pages_make_no_room_for_its_disk_part(tmp_path):
    """Host tier of six: a locked prompt holds three, the matched path's first node the
    other three, its second node (two pages) is on disk only. The only evictable host
    pages are the path's own, which its load locks: the disk part cannot be staged, so
    the match reports the host node only, and the load delivers all it reported."""
    from hicache.metrics import Metrics
    from hicache.storage.lmdb_backend import LmdbBackend

    engine = Engine(num_pages=16)
    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    metrics = Metrics()
    tm, _ = make_tm(engine, host_pages=6, storage=store, metrics=metrics)

    def load(node):
        tm.lock(node, 0)
        loaded = tm.wait(tm.load(node, 0))
        tm.flush()
        engine.wait(tm.pools.get(0).counters, loaded.wait)
        tm.unlock(node, 0)
        return loaded

    try:
        first, second = tokens(0, 3), tokens(0, 3) + tokens(100, 2)
        other = on_disk_beside_a_locked_prompt(tm, engine, [first, second])
        load(tm.match(NS, first, 0).match.node)  # the first node back on host (and device)
        tm.evict(Tier.DEVICE, 16, 0)
        assert tm.host_alloc.num_free == 0 and tm.tree.sizes(Tier.HOST).evictable == 3
        hit = tm.match(NS, second, 0)
        assert hit.unclipped.num_disk_pages == 2
        assert (hit.match.num_host_pages, hit.match.num_disk_pages) == (3, 0)
        loaded = load(hit.match.node)
        engine.check(NS, first, loaded.device_pages)
        assert metrics.registry.get_sample_value("hicache_load_short_tokens_total") == 0
        tm.unlock(other, 0)
        tm.check_invariants()
    finally:
        tm.close()
        store.close()
        engine.close()


def test_device_pages_waiting_for_a_backup_make_no_room_for_a_load():
    """Device pool of 8, host tier of 4 held by locks; two 3-page prompts' backups are
    deferred (no host room), so their device pages cannot be dropped. The tree counts
    them evictable, but a load could not free them: a match of a host-only prompt
    reports nothing to load, not pages the load would fall short of."""
    from hicache.metrics import Metrics

    engine = Engine(num_pages=8)
    metrics = Metrics()
    tm, _ = make_tm(engine, host_pages=4, metrics=metrics)

    try:
        a, b = prefill(tm, engine, tokens(0, 2)).node, prefill(tm, engine, tokens(100, 2)).node
        tm.flush()
        tm.evict(Tier.DEVICE, 2, 0)  # a's device copy
        tm.lock(a, 0)
        tm.lock(b, 0)
        assert a.device_pools == [] and tm.host_alloc.num_free == 0
        prefill(tm, engine, tokens(200, 3)).node
        prefill(tm, engine, tokens(300, 3)).node
        tm.poll(0)
        assert tm.deferred_backups == 2 and tm.pools.get(0).allocator.num_free == 0
        hit = tm.match(NS, tokens(0, 2), 0)
        assert hit.unclipped.num_host_pages == 2 and hit.match.num_pages == 0
        assert metrics.registry.get_sample_value("hicache_load_short_tokens_total") == 0
        tm.unlock(a, 0)
        tm.unlock(b, 0)
        tm.flush()
        assert tm.deferred_backups == 0
        tm.check_invariants()
    finally:
        tm.close()
        engine.close()


def test_a_load_waits_for_device_pages_on_their_way_instead_of_falling_short():
    """Device pool of 8, full of two prompts whose backups are still copying (nothing
    may drop its only copy): a host-only prompt's load cannot have its 3 pages now (a
    match counts such pages as no room; here the load comes first, as when the room a
    match saw went before its load). It waits (counted in the ``load_waiting`` queue,
    its path locked) and once the backups land takes all 3 pages, with the inserted
    bytes, nothing short. With nothing in flight it would take what fits at once."""
    from hicache.metrics import Metrics

    engine = Engine(num_pages=8)
    metrics = Metrics()
    tm, _ = make_tm(engine, host_pages=12, metrics=metrics)
    try:
        a = prefill(tm, engine, tokens(0, 3)).node
        tm.flush()
        tm.evict(Tier.DEVICE, 3, 0)
        assert a.device_pools == [] and a.host_pages is not None
        prefill(tm, engine, tokens(100, 5))
        prefill(tm, engine, tokens(200, 3))  # (their backups start: not polled yet)
        assert tm.pools.get(0).allocator.num_free == 0 and tm.queues()["host_staging"][0] == 8
        tm.lock(a, 0)
        future = tm.load(a, 0)
        assert not future.done() and tm.queues()["load_waiting"] == (3, None)
        assert not tm.idle()
        loaded = tm.wait(future)
        engine.wait(tm.pools.get(0).counters, loaded.wait)
        assert loaded.num_loaded_pages == 3
        engine.check(NS, tokens(0, 3), loaded.device_pages)
        assert metrics.registry.get_sample_value("hicache_load_short_tokens_total") == 0
        assert tm.queues()["load_waiting"] == (0, None)
        tm.unlock(a, 0)
        tm.flush()
        tm.check_invariants()
    finally:
        tm.close()
        engine.close()


def test_a_load_waits_for_host_room_to_read_its_disk_pages_into(tmp_path):
    """Host tier of 6, all of it a prompt whose disk write is held back (its pages stay
    pinned, none clean): a disk-only prompt's load has no host page to read into now. It
    waits, and once the write lands (the pages clean, evictable) reads and delivers all
    of it, byte-exact, nothing short."""
    from hicache.metrics import Metrics
    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import SlowStore

    engine = Engine(num_pages=16)
    store = SlowStore(LmdbBackend(tmp_path / "lmdb", capacity_bytes=64 * SPEC.host_page_bytes), 0.0)
    metrics = Metrics()
    tm, _ = make_tm(engine, host_pages=6, storage=store, metrics=metrics)
    try:
        a = prefill(tm, engine, tokens(0, 2)).node
        tm.flush()
        tm.evict(Tier.DEVICE, 16, 0)
        tm.evict(Tier.HOST, 6)
        tm.flush()
        assert a.on_disk and a.host_pages is None and a.device_pools == []
        store.close_gate()
        prefill(tm, engine, tokens(100, 6))
        tm.poll(0)
        assert tm.host_alloc.num_free == 0 and tm.tree.clean_host_pages() == 0
        tm.lock(a, 0)
        future = tm.load(a, 0)
        assert not future.done() and tm.queues()["load_waiting"] == (2, None)
        store.open_gate()
        loaded = tm.wait(future)
        engine.wait(tm.pools.get(0).counters, loaded.wait)
        assert loaded.num_loaded_pages == 2
        engine.check(NS, tokens(0, 2), loaded.device_pages)
        assert metrics.registry.get_sample_value("hicache_load_short_tokens_total") == 0
        tm.unlock(a, 0)
        tm.flush()
        tm.check_invariants()
    finally:
        tm.close()
        store.close()
        engine.close()


def test_a_waiting_load_of_an_engine_that_goes_away_ends_and_holds_nothing():
    engine = Engine(num_pages=8)
    tm, _ = make_tm(engine, host_pages=12)
    try:
        a = prefill(tm, engine, tokens(0, 3)).node
        tm.flush()
        tm.evict(Tier.DEVICE, 3, 0)
        prefill(tm, engine, tokens(100, 5))
        prefill(tm, engine, tokens(200, 3))
        tm.lock(a, 0)
        future = tm.load(a, 0)
        assert not future.done()
        tm.unlock(a, 0)  # (the session's locks go first)
        tm.retire_pool(0)
        assert future.done() and future.result().num_loaded_pages == 0
        assert tm.queues()["load_waiting"] == (0, None)
        tm.flush()
        assert a.lock_total == 0
        tm.check_invariants()
    finally:
        tm.close()
        engine.close()


def test_host_pages_waiting_for_their_disk_write_make_no_room_for_a_disk_part(tmp_path):
    """Host tier of 6, the disk writer held back with a queue of 2 pages: after three
    prompts the host tier is full of pages whose writes run or wait (deferred). The tree
    counts the deferred ones evictable, but they must reach disk before they go: a match
    of a disk-only prompt reports nothing to load until the writer catches up."""
    from hicache.metrics import Metrics
    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import SlowStore

    engine = Engine(num_pages=16)
    store = SlowStore(LmdbBackend(tmp_path / "lmdb", capacity_bytes=64 * SPEC.host_page_bytes), 0.0)
    metrics = Metrics()
    tm, _ = make_tm(engine, host_pages=6, storage=store, metrics=metrics, disk_write_backlog=2)

    try:
        cold = tokens(0, 2)
        prefill(tm, engine, cold).node
        tm.flush()
        tm.evict(Tier.DEVICE, 16, 0)
        tm.evict(Tier.HOST, 6)
        store.close_gate()
        for i in range(3):
            prefill(tm, engine, tokens(100 * (i + 1), 2))
        for _ in range(200):  # the backups land; one write runs, two wait
            tm.poll(0.005)
            if tm.queues()["disk_write_deferred"][0] == 4:
                break
        assert tm.queues()["disk_write_deferred"][0] == 4 and tm.host_alloc.num_free == 0
        hit = tm.match(NS, cold, 0)
        assert hit.unclipped.num_disk_pages == 2 and hit.match.num_pages == 0
        store.open_gate()
        tm.flush()
        hit = tm.match(NS, cold, 0)
        assert hit.unclipped is None and hit.match.num_disk_pages == 2
        tm.lock(hit.match.node, 0)
        loaded = tm.wait(tm.load(hit.match.node, 0))
        tm.flush()
        engine.wait(tm.pools.get(0).counters, loaded.wait)
        engine.check(NS, cold, loaded.device_pages)
        tm.unlock(hit.match.node, 0)
        assert metrics.registry.get_sample_value("hicache_load_short_tokens_total") == 0
        tm.check_invariants()
    finally:
        tm.close()
        store.close()
        engine.close()


def test_a_store_that_refuses_a_write_leaves_the_pages_on_host_and_the_writer_clean(tmp_path):
    """A put that raises (on the write-preparation thread) reaches the writer as a
    failed write: nothing is marked on disk, its pin and queue room are given back, the
    pages stay cached on host, and the next write goes through."""
    from hicache.errors import StorageUnavailable
    from hicache.storage.lmdb_backend import LmdbBackend

    class Refusing:
        def __init__(self, inner):
            self.inner, self.refuse = inner, True

        def put_batch(self, batch, *, fingerprint):
            if self.refuse:
                raise StorageUnavailable("the disk is gone")
            return self.inner.put_batch(batch, fingerprint=fingerprint)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    engine = Engine(num_pages=16)
    store = Refusing(LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes))
    tm, _ = make_tm(engine, host_pages=12, storage=store)
    try:
        result = prefill(tm, engine, tokens(100, 3))
        settle(tm)
        assert not result.node.on_disk and result.node.host_pages is not None
        assert tm.queues()["disk_write"][0] == 0 and disk_pages(tm) == 0
        store.refuse = False
        prefill(tm, engine, tokens(100, 3) + tokens(500, 2))
        settle(tm)
        assert disk_pages(tm) == 5 and store.stats().records == 5
    finally:
        tm.close()
        store.close()
        engine.close()


def test_flush_reports_progress_while_writes_wait_and_durability_at_the_end(tmp_path):
    """A flush behind a stopped disk reports (pages being written, pages waiting) as it
    waits — a draining daemon logs those — and ``durability`` then says what is on disk
    and what is cached only above it."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import SlowStore

    engine = Engine(num_pages=16)
    store = SlowStore(LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes), 0.0)
    tm, _ = make_tm(engine, host_pages=12, storage=store, disk_write_backlog=2)
    try:
        store.close_gate()
        for i in range(3):
            prefill(tm, engine, tokens(1000 * i, 2))
        reports = []

        def progress(writing, waiting):
            reports.append((writing, waiting))
            if writing + waiting == 6:  # the backups have landed: every write queued or waiting
                store.open_gate()

        tm.flush(progress=progress, every_s=0.0)
        assert (2, 4) in reports  # two pages at the writer's bound, four waiting
        figures = tm.durability()
        assert figures == {"written_pages": 6, "on_disk_pages": 6, "not_on_disk_pages": 0, "deferred_backups": 0}
    finally:
        tm.close()
        store.close()
        engine.close()


def owned_tm(host_pages: int, spec=None, **manager_args):
    """A tier manager with one engine-owned pool of 8 blocks (vLLM's CPU layout) as pool
    0, and its namespace (``spec``: OWNED_SPEC's unless given)."""
    import torch

    from hicache.foreign import ForeignPool
    from owned_util import OWNED_SPEC, layer_major

    spec = spec or OWNED_SPEC
    layout = layer_major(8, spec)
    buffers = [torch.zeros(a.size, dtype=torch.uint8) for a in layout.allocations]
    tm = TierManager(spec, host_pages=host_pages, **manager_args)
    ns = namespace_id(spec.fingerprint, "owned")
    tm.add_namespace(ns)
    tm.register_owned_pool(0, ForeignPool(layout, buffers, [None] * len(buffers)))
    return tm, ns


def test_an_owned_store_whose_engine_stopped_waiting_caches_nothing():
    """``expired()`` says the engine gave up on the store (and may reuse its blocks):
    on arrival, the store is refused before anything changes; once the copy is done,
    its pages are not cached (they may hold another request's KV by then) and go back
    to the host pool."""
    from hicache.errors import DeadlinePassed
    from owned_util import OWNED_SPEC

    tm, ns = owned_tm(host_pages=8)
    try:
        toks = list(range(7, 7 + 3 * OWNED_SPEC.page_size))
        free = tm.host_alloc.num_free
        with pytest.raises(DeadlinePassed):
            tm.store(ns, toks, 0, [1, 2, 3], expired=lambda: True)
        answers = iter([False, True])  # in time on arrival, late when the copy is done
        with pytest.raises(DeadlinePassed):
            tm.wait(tm.store(ns, toks, 0, [1, 2, 3], expired=lambda: next(answers)))
        tm.flush()
        tm.check_invariants()
        assert tm.tree.match(ns, toks, 0, touch=False).num_host_pages == 0
        assert tm.host_alloc.num_free == free
        assert tm.wait(tm.store(ns, toks, 0, [1, 2, 3], expired=lambda: False)).num_cached == 3
    finally:
        tm.close()


def assert_layers_landed(counters, loaded, num_layers: int, landed) -> None:
    """The load ``loaded`` (one ticket) reads as landed at the layers of ``landed`` and
    failed at every other, on ``counters``' ring."""
    from hicache.errors import LoadFailed

    (ticket,) = loaded.wait
    waiter = counters.waiter()
    try:
        for layer in range(num_layers):
            if layer in landed:
                assert waiter.is_done(ticket, layer)
            else:
                with pytest.raises(LoadFailed):
                    waiter.is_done(ticket, layer)
    finally:
        waiter.close()


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_an_owned_store_or_load_into_whose_copy_fails_on_one_thread_leaves_no_half_copied_page(fail_at,
                                                                                             monkeypatch):
    """Three copy threads, each given a share (the blocks out of order: one strided copy
    a page); the ``fail_at``-th strided copy raises. A store caches none of its pages (some were not copied) and gives its host pages
    back; a load_into stamps complete only the layers that landed on every thread, the
    others failed, and the pages stay cached for a later load."""
    import torch

    from hicache.kernels import page_copy
    from hicache.kernels.copy_plan import CpuCopyWorkers
    from owned_util import OWNED_SPEC

    monkeypatch.setattr(manager_module, "CpuCopyWorkers", lambda n: CpuCopyWorkers(n, min_bytes_per_thread=1))
    tm, ns = owned_tm(host_pages=8, config=TierConfig(copy_threads=3))
    copyto = np.copyto
    lock = threading.Lock()
    calls = [0]

    def failing_copyto(dst, src):
        with lock:
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("copy failed")
        copyto(dst, src)

    try:
        toks = list(range(7, 7 + 6 * OWNED_SPEC.page_size))
        pool = tm.pools.get(0)
        blocks = pool.movers[0].pool.buffers[0].view(OWNED_SPEC.num_layers, 8, -1)
        blocks[:] = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)  # block b holds b
        order = [6, 4, 2, 1, 3, 5]
        free = tm.host_alloc.num_free
        monkeypatch.setattr(page_copy.np, "copyto", failing_copyto)
        stored = tm.wait(tm.store(ns, toks, 0, order))
        tm.flush()
        tm.check_invariants()
        assert (stored.num_copied, stored.num_cached) == (0, 0)
        assert tm.tree.match(ns, toks, 0, touch=False).num_host_pages == 0 and tm.host_alloc.num_free == free
        monkeypatch.setattr(page_copy.np, "copyto", copyto)
        assert tm.wait(tm.store(ns, toks, 0, order)).num_cached == 6
        counters = pool.counters
        stamp = counters.complete_layer
        landed = []

        def stamped(ticket, layer):
            assert bool((blocks[layer, 1:7] == torch.arange(1, 7, dtype=torch.uint8).view(6, 1)).all()), layer
            stamp(ticket, layer)
            landed.append(layer)

        counters.complete_layer = stamped
        blocks[:] = 0
        node = tm.match(ns, toks, 0).match.node
        tm.lock(node, 0)
        calls[0] = 0
        monkeypatch.setattr(page_copy.np, "copyto", failing_copyto)
        loaded = tm.wait(tm.load_into(node, 0, order))
        tm.flush()
        assert_layers_landed(counters, loaded, OWNED_SPEC.num_layers, landed)
        assert landed == list(range(len(landed))) and len(landed) < OWNED_SPEC.num_layers
        tm.unlock(node, 0)
        tm.check_invariants()
        assert tm.tree.match(ns, toks, 0, touch=False).num_host_pages == 6
    finally:
        tm.close()


def test_an_owned_load_into_starts_no_layer_after_its_engine_stopped_waiting_for_the_layers():
    """``copy_expired()`` says the engine no longer waits for the layers (it reports the
    blocks as failed loads and, once the load is over, may hand them to another
    request): a copy it began before then ends, no later layer starts — on any copy
    thread — and the layers not copied fail on the ticket, so that the engine can tell
    the load is over. Here the deadline passes as layer 0 lands."""
    from hicache.errors import DeadlinePassed, LoadFailed
    from owned_util import OWNED_SPEC

    tm, ns = owned_tm(host_pages=8)
    try:
        toks = list(range(7, 7 + 3 * OWNED_SPEC.page_size))
        pool = tm.pools.get(0)
        blocks = pool.movers[0].pool.buffers[0].view(OWNED_SPEC.num_layers, 8, -1)
        blocks[:] = 1  # the engine's KV of ``toks`` in blocks 1-3 (and every other block)
        assert tm.wait(tm.store(ns, toks, 0, [1, 2, 3])).num_cached == 3
        blocks[:, 4:7] = 2  # blocks 4-6 hold what they held before
        counters = pool.counters
        stamp = counters.complete_layer
        landed = []

        def stamped(ticket, layer):
            stamp(ticket, layer)
            landed.append(layer)

        counters.complete_layer = stamped
        node = tm.match(ns, toks, 0).match.node
        tm.lock(node, 0)
        with pytest.raises(DeadlinePassed):  # expired on arrival: refused, nothing held
            tm.load_into(node, 0, [4, 5, 6], copy_expired=lambda: True)
        loaded = tm.wait(tm.load_into(node, 0, [4, 5, 6], copy_expired=lambda: 0 in landed))
        assert loaded.num_loaded == 3
        tm.flush()  # (the copies ended)
        (ticket,) = loaded.wait
        waiter = counters.waiter()
        try:
            assert waiter.is_done(ticket, 0)
            with pytest.raises(LoadFailed):
                waiter.is_done(ticket, OWNED_SPEC.num_layers - 1)
        finally:
            waiter.close()
        assert landed == [0]
        assert bool((blocks[0, 4:7] == 1).all())  # the layer copied before the deadline
        assert bool((blocks[-1, 4:7] == 2).all())  # no layer started after it
        tm.unlock(node, 0)
        tm.check_invariants()
        assert not tm.tree.locked_pools() and tm.tree.sizes(Tier.HOST).protected == 0
        # the pages are still cached: a load in time gets them all
        blocks[:, 4:7] = 2
        tm.lock(node, 0)
        loaded = tm.wait(tm.load_into(node, 0, [4, 5, 6], copy_expired=lambda: False))
        tm.flush()
        assert bool((blocks[:, 4:7] == 1).all())
        tm.unlock(node, 0)
        tm.check_invariants()
    finally:
        tm.close()


@pytest.mark.parametrize("k", [0, 2, 4])
def test_an_owned_load_into_over_three_copy_threads_starts_no_layer_on_any_after_its_deadline(k, monkeypatch):
    """Three copy threads each copy a share of the blocks through every layer; the
    engine stops waiting as layer ``k`` lands (stamped by the last thread to finish it).
    Each thread asks before each layer and starts none once told: no thread copies a
    layer after the one it had been cleared for, so with the threads abreast (here none
    starts a layer before the one before it has landed) nothing after layer ``k + 1``
    is copied. The load's other layers are stamped failed only once no thread copies
    any more (the engine then may reuse the blocks)."""
    import torch

    from hicache.kernels import page_copy
    from hicache.kernels.copy_plan import CpuCopyWorkers
    from hicache.spec import KVSpec

    spec = KVSpec.mha(num_layers=6, num_kv_heads=2, head_dim=16, page_size=8, dtype="bfloat16",
                      model="test/owned-six", layout="test/opaque-blocks")
    monkeypatch.setattr(manager_module, "CpuCopyWorkers", lambda n: CpuCopyWorkers(n, min_bytes_per_thread=1))
    tm, ns = owned_tm(host_pages=8, spec=spec, config=TierConfig(copy_threads=3))
    try:
        toks = list(range(7, 7 + 6 * spec.page_size))
        pool = tm.pools.get(0)
        buffer = pool.movers[0].pool.buffers[0]
        blocks = buffer.view(spec.num_layers, 8, -1)
        blocks[:] = 1  # the engine's KV of ``toks`` in blocks 1-6
        assert tm.wait(tm.store(ns, toks, 0, [1, 2, 3, 4, 5, 6])).num_cached == 6
        blocks[:] = 2  # what the blocks hold before the load
        layer_bytes = blocks[0].numel()
        counters = pool.counters
        stamp, fail = counters.complete_layer, counters.fail
        changed = threading.Condition()
        events, landed, active = [], [], [0]

        def stamped(ticket, layer):
            stamp(ticket, layer)
            with changed:
                landed.append(layer)
                changed.notify_all()

        def failed(ticket):
            with changed:
                events.append(("fail", active[0]))
            fail(ticket)

        def expired():
            with changed:
                late = k in landed
                events.append(("asked", threading.get_ident(), late))
            return late

        copyto = np.copyto

        def abreast(dst, src):
            layer = (dst.__array_interface__["data"][0] - buffer.data_ptr()) // layer_bytes
            # (the threads abreast; past the deadline, nothing to wait for: a layer
            # started then must show, not hang)
            changed.wait_for(lambda: layer == 0 or layer - 1 in landed or k in landed)
            events.append(("copy", threading.get_ident(), layer))

        layer_copy = watched_copyto(changed, active, abreast)

        counters.complete_layer, counters.fail = stamped, failed
        node = tm.match(ns, toks, 0).match.node
        tm.lock(node, 0)
        monkeypatch.setattr(page_copy.np, "copyto", layer_copy)
        loaded = tm.wait(tm.load_into(node, 0, [6, 5, 4, 3, 2, 1], copy_expired=expired))
        tm.flush()
        monkeypatch.setattr(page_copy.np, "copyto", copyto)
        copies = [e for e in events if e[0] == "copy"]
        threads = {e[1] for e in copies}
        assert len(threads) == 3
        assert landed == list(range(k + 1))
        for thread in threads:  # a layer copied for each clearance, none after the refusal
            mine = [e for e in events if e[0] != "fail" and e[1] == thread]
            answers = [e[2] for e in mine if e[0] == "asked"]
            cleared = answers.count(False)  # (all of them: a thread cleared for the last layer is refused none)
            assert answers == [False] * cleared + [True] * (cleared < spec.num_layers)
            assert k + 1 <= cleared <= k + 2
            assert {e[2] for e in mine if e[0] == "copy"} == set(range(cleared))
            assert mine[-1][0] == "asked" or cleared == spec.num_layers
        assert max(e[2] for e in copies) <= k + 1
        fails = [i for i, e in enumerate(events) if e[0] == "fail"]
        assert fails and all(events[i][1] == 0 for i in fails) and fails[0] > events.index(copies[-1])
        assert bool((blocks[: k + 1, 1:7] == 1).all())
        assert bool((blocks[k + 2 :] == 2).all())
        assert_layers_landed(counters, loaded, spec.num_layers, range(k + 1))
        tm.unlock(node, 0)
        tm.check_invariants()
        assert tm.tree.match(ns, toks, 0, touch=False).num_host_pages == 6
    finally:
        tm.close()


@pytest.mark.parametrize("ends", [list(range(1, 65)), [3, 10, 11, 40, 64], [1, 63], [64], list(range(2, 64, 2))])
def test_an_insert_cuts_its_path_at_its_ends_copying_each_page_a_few_times(ends, monkeypatch):
    # Cutting a node at each end in turn copies what is below the cut again each time
    # (quadratic bytes: 0.3-0.4 s from one insert of a million tokens with 4096 ends).
    engine = Engine(num_pages=80)
    try:
        tm, _ = make_tm(engine, host_pages=80)
        n = 64
        toks = list(range(1000, 1000 + n * PS))
        pages = tm.alloc(0, n)
        engine.compute(NS, toks, pages)
        tree = tm.tree
        copied = [0]
        original = tree.split

        def counting(node, num_pages):
            copied[0] += node.num_pages
            return original(node, num_pages)

        monkeypatch.setattr(tree, "split", counting)
        result = tm.insert(NS, toks, 0, pages, ends=ends)
        path = tree.path(result.node)
        bounds = list(np.cumsum([node.num_pages for node in path]))
        assert bounds == sorted(set(ends) | {n})
        assert np.array_equal(np.concatenate([node.device_pages(0) for node in path]), pages)
        assert copied[0] <= n * (2 + int(np.log2(n))), copied[0]  # (in turn: n * (n - 1) / 2)
        tm.check_invariants()
        tm.close()
    finally:
        engine.close()


def on_host_only_by_hand(tm, engine, toks):
    """Prefill ``toks`` on a manager whose workers run by hand (``ManualWorkers``), run
    its write-through backup and push its pages off the device: on host only."""
    prefill(tm, engine, toks)
    tm.workers.run("copy")  # the write-through backup
    tm.poll()
    tm.evict(Tier.DEVICE, 16, 0)


def test_a_failed_load_frees_no_page_that_a_later_load_still_writes(engine, monkeypatch):
    """Two loads in flight, the second below the first: when the first fails, the pages
    the second is still copying into must not go to another request before it lands."""
    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    tm, handle = make_tm(engine, host_pages=8)
    workers = tm.workers
    toks = tokens(100, 4)
    on_host_only_by_hand(tm, engine, toks)
    assert tm.tree.sizes(Tier.HOST).cached == 4 and tm.tree.sizes(Tier.DEVICE, 0).cached == 0
    upper = tm.match(NS, toks[: 2 * PS], 0).match.node
    tm.lock(upper, 0)
    first = tm.load(upper, 0).result()
    lower = tm.match(NS, toks, 0).match.node
    tm.lock(lower, 0)
    second = tm.load(lower, 0).result()
    assert first.num_loaded_pages == 2 and second.num_loaded_pages == 2
    workers.run("copy", fail=True, movers=tm.pools.get(0).movers)  # the first load's copies fail
    tm.poll()
    tm.check_invariants()
    # Another request takes every free page, while the second load's copies still run.
    num_free = tm.pools.get(0).allocator.num_free
    other = tokens(900, num_free)
    computed = prefill(tm, engine, other).device_pages
    workers.run("copy")  # the second load's copies land
    tm.poll()
    engine.check(NS, other, computed)
    tm.unlock(lower, 0)
    tm.unlock(upper, 0)
    while workers.jobs:
        workers.run("copy")
        tm.poll()
    tm.check_invariants()
    engine.check(NS, other, tm.match(NS, other, 0).match.device_pages)


def no_counter_slot_tokens(metrics) -> float:
    return metrics.registry.get_sample_value("hicache_missed_tokens_total", {"reason": "no_counter_slot"})


def test_a_load_with_every_counter_slot_in_use_loads_nothing_and_is_counted(engine, monkeypatch):
    """A pool's loads in flight at once are bounded by its counter slots: one more
    loads nothing (its pages are recomputed). The operator sees why —
    ``hicache_missed_tokens_total{reason="no_counter_slot"}`` — instead of a
    ``load_short`` with no reason."""
    from hicache.metrics import Metrics

    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    metrics = Metrics()
    tm, _ = make_tm(engine, host_pages=8, metrics=metrics, counter_slots=1)
    workers = tm.workers
    toks = tokens(100, 4)
    on_host_only_by_hand(tm, engine, toks)
    upper = tm.match(NS, toks[: 2 * PS], 0).match.node
    tm.lock(upper, 0)
    first = tm.load(upper, 0).result()
    lower = tm.match(NS, toks, 0).match.node
    tm.lock(lower, 0)
    second = tm.load(lower, 0).result()  # the first holds the only slot
    assert first.num_loaded_pages == 2 and second.num_loaded_pages == 0 and len(second.device_pages) == 2
    assert no_counter_slot_tokens(metrics) == 2 * PS
    workers.run("copy")
    tm.poll()
    tm.check_invariants()
    tm.unlock(lower, 0)
    tm.unlock(upper, 0)
    tm.close()


def test_an_owned_load_into_with_every_counter_slot_in_use_loads_nothing_and_is_counted(monkeypatch):
    """The same for an engine-owned pool's ``load_into`` (a vLLM step that starts more
    loads than the pool has counter slots)."""
    from hicache.metrics import Metrics
    from owned_util import OWNED_SPEC

    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    metrics = Metrics()
    tm, ns = owned_tm(host_pages=8, metrics=metrics, config=TierConfig(counter_slots=1))
    workers = tm.workers
    try:
        toks = list(range(7, 7 + 3 * OWNED_SPEC.page_size))
        stored = tm.store(ns, toks, 0, [1, 2, 3])
        workers.run("copy")
        tm.poll()
        assert stored.result().num_cached == 3
        node = tm.match(ns, toks, 0).match.node
        tm.lock(node, 0)
        first = tm.load_into(node, 0, [4, 5, 6]).result()
        second = tm.load_into(node, 0, [7]).result()  # the first holds the only slot
        assert first.num_loaded == 3 and (second.num_loaded, second.wait) == (0, ())
        assert no_counter_slot_tokens(metrics) == OWNED_SPEC.page_size
        workers.run("copy")
        tm.poll()
        tm.unlock(node, 0)
        tm.check_invariants()
    finally:
        tm.close()


def test_an_owned_store_keeps_the_host_prefix_it_continues():
    """A store of pages that continue a prefix on host: the host pages it allocates
    are never found by evicting that prefix (the stored pages would hang from nothing)."""
    from owned_util import OWNED_SPEC

    tm, ns = owned_tm(host_pages=4)
    try:
        ps = OWNED_SPEC.page_size
        prefix = list(range(7, 7 + 2 * ps))
        other = list(range(1000, 1000 + 2 * ps))
        assert tm.wait(tm.store(ns, prefix, 0, [1, 2])).num_cached == 2
        assert tm.wait(tm.store(ns, other, 0, [3, 4])).num_cached == 2
        held = tm.match(ns, other, 0).match.node
        tm.lock(held, 0)  # the host tier is full, and only the prefix may go
        longer = prefix + list(range(50, 50 + 2 * ps))
        stored = tm.wait(tm.store(ns, longer, 0, [1, 2, 5, 6]))
        tm.flush()
        tm.check_invariants()
        assert stored.num_copied == 0 and stored.num_cached == 2
        assert tm.match(ns, longer, 0).match.num_host_pages == 2
        tm.unlock(held, 0)
    finally:
        tm.close()


def test_a_prefetch_keeps_the_disk_records_it_reads_while_it_makes_host_room(engine, tmp_path):
    """A match's prefetch allocates host pages for its disk-only nodes; the eviction
    that makes that room may write a host page to disk, and the room that write makes
    on disk must not be those nodes' records (a read of nodes gone from the tree)."""
    from hicache.storage.lmdb_backend import LmdbBackend

    storage = LmdbBackend(tmp_path / "lmdb", capacity_bytes=4 * SPEC.host_page_bytes)
    tm, _ = make_tm(engine, host_pages=4, storage=storage, disk_policy="write_back", eviction="lfu")
    try:
        sequence = tokens(100, 2)
        prefill(tm, engine, sequence[:PS])
        prefill(tm, engine, sequence)  # two nodes of one page
        settle(tm)
        tm.evict(Tier.DEVICE, 16, 0)
        for _ in range(2):  # written to disk (write-back), then dropped from host
            tm.evict(Tier.HOST, 4)
            settle(tm)
        assert tm.tree.sizes(Tier.DISK).cached == 2 and tm.tree.sizes(Tier.HOST).cached == 0
        clean, parent = tokens(200, 1), tokens(300, 1)
        prefill(tm, engine, clean)
        prefill(tm, engine, parent)
        settle(tm)
        tm.persist()  # both on host and on disk: the disk tier is full
        settle(tm)
        prefill(tm, engine, tokens(300, 3))  # two pages on host only, below parent
        settle(tm)
        tm.evict(Tier.DEVICE, 16, 0)
        for _ in range(4):  # often hit: the disk tier's least frequently used are the sequence's
            tm.match(NS, clean, 0)
        assert tm.host_alloc.num_free == 0 and tm.tree.sizes(Tier.DISK).cached == 4
        hit = tm.match(NS, sequence, 0)  # its prefetch makes host room: clean goes, the rest is written
        assert hit.match.num_disk_pages == 2
        settle(tm)
        loaded = tm.match(NS, sequence, 0).match
        assert loaded.num_host_pages + loaded.num_disk_pages == 2
    finally:
        tm.close()
        storage.close()


def test_a_disk_write_that_other_writes_in_flight_hold_the_room_for_waits_for_them(engine, tmp_path, monkeypatch):
    """The disk tier holds six pages; a four-page prompt's write is in flight when the
    next prompt's four pages are to be written. There is no room now (the write in
    flight holds it, and nothing committed can be evicted yet), but there will be once
    it commits: the write is deferred, counted, and started then — it makes its room by
    evicting the first prompt, and the pages reach the disk with no other write of
    them (a crash afterwards keeps them)."""
    from hicache.metrics import Metrics
    from hicache.storage.lmdb_backend import LmdbBackend

    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=6 * SPEC.host_page_bytes)
    metrics = Metrics()
    tm, _ = make_tm(engine, storage=store, metrics=metrics, disk_write_backlog=64)  # (the queue has room)
    workers = tm.workers
    try:
        first, second = tokens(100, 4), tokens(500, 4)
        for toks in (first, second):
            prefill(tm, engine, toks)
            workers.run("copy")  # the write-through backup; its disk write starts as it lands
            tm.poll()
        assert len(workers.queues["write"]) == 1 and tm.disk.pending == 4
        assert tm.disk.deferred_writes() == 4
        assert metrics.registry.get_sample_value("hicache_disk_writes_deferred_total") == 1
        while workers.queues["write"]:
            workers.run("write")
            tm.poll()
        tm.check_invariants()
        assert tm.tree.match(NS, second, 0, touch=False).node.on_disk
        assert sorted(k for k, _ in store.iter_metadata()) == sorted(page_keys(NS, second, PS))
        assert_on_disk(store, [second])
    finally:
        tm.close()
        store.close()


def test_a_write_back_whose_copy_fails_counts_the_device_pages_it_drops(engine, monkeypatch):
    """Under write_back a device eviction backs a page up first and drops its device
    copy once the backup lands. When the copy fails the device copy still goes (a
    broken copy engine must not hold the pool's pages for good), and with it the only
    copy: those pages are counted as evicted from the device and dropped from the cache,
    and a match that misses them says evicted_device. A write-back that lands counts
    its device copies as evicted, not dropped."""
    from hicache.metrics import Metrics

    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    metrics = Metrics()
    tm, _ = make_tm(engine, metrics=metrics, write_policy="write_back")
    workers = tm.workers

    def counted(name):
        return {tier: metrics.registry.get_sample_value(name, {"tier": tier}) for tier in ("device", "host")}

    first, second = tokens(100, 8), tokens(300, 8)
    prefill(tm, engine, first)
    assert tm.alloc(0, 9) is None  # the write-back of first starts
    workers.run("copy", fail=True, movers=tm.pools.get(0).movers)
    tm.poll()
    tm.check_invariants()
    assert tm.tree.match(NS, first, 0, touch=False).num_pages == 0
    assert counted("hicache_evicted_pages_total") == {"device": 8, "host": 0}
    assert counted("hicache_pages_dropped_total") == {"device": 8, "host": 0}
    assert tm.miss_reason(page_keys(NS, first, PS)[0]) == "evicted_device"

    prefill(tm, engine, second)
    assert tm.alloc(0, 9) is None  # the write-back of second starts, and lands
    workers.run("copy")
    tm.poll()
    tm.check_invariants()
    assert tm.tree.match(NS, second, 0, touch=False).num_host_pages == 8
    assert counted("hicache_evicted_pages_total") == {"device": 16, "host": 0}
    assert counted("hicache_pages_dropped_total") == {"device": 8, "host": 0}
    tm.close()


def test_a_disk_write_before_a_host_drop_that_fails_counts_the_host_pages_it_drops(engine, store, monkeypatch):
    """Under the write_back disk policy a host eviction writes a page that is nowhere
    else to disk first and drops its host copy once the write is done. When the write
    fails the host copy still goes (a broken disk must not pin the host tier), and with
    it the only copy: those pages are counted as evicted from host and dropped from the
    cache, and a match that misses them says evicted_host. A write that lands counts
    its host copies as evicted, not dropped."""
    from hicache.metrics import Metrics

    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    metrics = Metrics()
    tm, _ = make_tm(engine, storage=store, metrics=metrics, disk_policy="write_back")
    workers = tm.workers

    def counted(name):
        return {tier: metrics.registry.get_sample_value(name, {"tier": tier}) for tier in ("host", "disk")}

    def written_back(toks, *, fail):
        prefill(tm, engine, toks)
        workers.run("copy")  # the backup to host
        tm.poll()
        tm.evict(Tier.DEVICE, 16, 0)  # host is now the only copy
        tm.evict(Tier.HOST, 12)  # written to disk first
        workers.run("write", fail=fail)
        tm.poll()
        tm.check_invariants()

    first, second = tokens(100, 3), tokens(300, 3)
    written_back(first, fail=True)
    assert tm.tree.match(NS, first, 0, touch=False).num_pages == 0
    assert counted("hicache_evicted_pages_total") == {"host": 3, "disk": 0}
    assert counted("hicache_pages_dropped_total") == {"host": 3, "disk": 0}
    assert tm.miss_reason(page_keys(NS, first, PS)[0]) == "evicted_host"

    written_back(second, fail=False)
    assert tm.tree.match(NS, second, 0, touch=False).num_disk_pages == 3
    assert counted("hicache_evicted_pages_total") == {"host": 6, "disk": 0}
    assert counted("hicache_pages_dropped_total") == {"host": 3, "disk": 0}
    tm.close()


def test_pages_whose_records_a_shared_store_evicts_for_another_spec_are_counted_evicted_from_disk(engine, tmp_path):
    """One LMDB store serves every KV spec, and each spec's disk tier counts only its
    own records: a write of one spec can have the store evict another's records on its
    own. Those pages leave that spec's disk tier, and the cache with it when they were
    on disk only: counted as evicted from disk and dropped from the cache, as the disk
    tier's own evictions are, and a match that misses them says evicted_disk."""
    import dataclasses

    from hicache.metrics import Metrics
    from hicache.storage.lmdb_backend import LmdbBackend

    other_spec = dataclasses.replace(SPEC, model="tiers-test-other")
    other_ns = namespace_id(other_spec.fingerprint, "tiers")
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=4 * SPEC.host_page_bytes)
    metrics = Metrics()
    tm, _ = make_tm(engine, host_pages=8, storage=store, metrics=metrics)
    other_engine = Engine(num_pages=16, spec=other_spec)
    other = TierManager(other_spec, host_pages=8, storage=store, metrics=metrics)
    other.add_namespace(other_ns)
    other.register_pool(0, [other_engine.pool])
    for manager in (tm, other):  # (as the daemon's Specs does)
        manager.on_store_evicted = lambda keys: (tm.forget_disk_keys(keys), other.forget_disk_keys(keys))

    def counted(name):
        return metrics.registry.get_sample_value(name, {"tier": "disk"})

    try:
        a = tokens(100, 4)
        prefill(tm, engine, a)
        settle(tm)
        tm.evict(Tier.DEVICE, 16, 0)
        tm.evict(Tier.HOST, 8)  # a is on disk only, the whole store
        settle(tm)
        assert tm.tree.match(NS, a, 0, touch=False).num_disk_pages == 4

        b = tokens(900, 2)
        pages = other.alloc(0, 2)
        other_engine.compute(other_ns, b, pages)
        other.insert(other_ns, b, 0, pages)
        settle(other)  # its write has the store evict a's records
        settle(tm)
        assert other.tree.match(other_ns, b, 0, touch=False).node.on_disk
        assert tm.tree.match(NS, a, 0, touch=False).num_pages == 0
        assert counted("hicache_evicted_pages_total") == 4
        assert counted("hicache_pages_dropped_total") == 4
        assert tm.miss_reason(page_keys(NS, a, PS)[0]) == "evicted_disk"
    finally:
        other.close()
        tm.close()
        other_engine.close()
        store.close()
