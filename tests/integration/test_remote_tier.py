"""The remote tier at the tier manager: two managers (two nodes) and one real Mooncake
Store. Every page a node gets from the remote tier is checked byte for byte against the
bytes its key stands for (:func:`tiers_util.expected_page`). Faults (a store that hangs
or errors mid-call) use the in-process stand-in, :class:`storage_util.InProcessMooncake`."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from hicache.metrics import Metrics
from hicache.keys import namespace_id, pack_tokens, page_keys
from hicache.tiers.config import TierConfig
from hicache.tiers.manager import TierManager
from hicache.tiers.remote import RemoteSettings
from hicache.tree import Tier
from tiers_util import SPEC, Engine

PS = SPEC.page_size
NS = namespace_id(SPEC.fingerprint)




class Node:
    def __init__(self, mooncake_store, disk=None, **settings) -> None:
        from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig

        self.store = MooncakeBackend(MooncakeConfig(master=mooncake_store.master))
        self.disk = disk
        self.metrics = Metrics()
        self.engine = Engine(num_pages=32)
        self.tm = TierManager(SPEC, host_pages=32, metrics=self.metrics, config=TierConfig(), remote=self.store,
                              storage=disk,
                              remote_settings=RemoteSettings(**{"prefetch_policy": "wait_complete", **settings}))
        self.tm.add_namespace(NS)
        self.counters = self.tm.register_pool(0, [self.engine.pool])

    def lookup(self, tokens):
        hit = self.tm.lookup(NS, tokens, 0)
        return self.tm.wait(hit) if hasattr(hit, "result") else hit

    def prefill(self, tokens):
        hit = self.lookup(tokens)
        m = hit.match
        new = self.tm.alloc(0, len(tokens) // PS - m.num_device_pages)
        pages = np.concatenate((m.device_pages, new))
        self.engine.compute(NS, tokens, pages)
        self.tm.insert(NS, tokens, 0, pages)
        return hit

    def load(self, tokens):
        """Match (remote part included), lock, load; check every page's bytes."""
        hit = self.lookup(tokens)
        self.tm.lock(hit.match.node, 0)
        loaded = self.tm.wait(self.tm.load(hit.match.node, 0))
        self.engine.wait(self.counters, loaded.wait)
        self.engine.check(NS, tokens, loaded.device_pages)
        self.tm.unlock(hit.match.node, 0)
        self.tm.check_invariants()
        return hit, loaded

    def close(self) -> None:
        self.tm.close()
        self.store.close()
        self.engine.close()
        if self.disk is not None:
            self.disk.close()


def test_pages_stored_by_one_node_load_byte_exact_on_another(mooncake_store):
    a, b = Node(mooncake_store), Node(mooncake_store)
    try:
        tokens = list(range(1000, 1000 + 10 * PS + 2))
        a.prefill(tokens)
        a.tm.flush()
        assert a.tm.remote.counts["pages_put"] == 10
        hit, loaded = b.load(tokens)
        assert hit.remote_pages == 10 and hit.match.num_host_pages == 10
        assert len(loaded.device_pages) == 10
        assert b.tm.tree.sizes(Tier.HOST).cached == 10
        # A longer request: its first ten pages are B's own now, the rest nobody has.
        longer = tokens[: 10 * PS] + list(range(5000, 5000 + 3 * PS))
        hit, _ = b.load(longer)
        assert hit.remote_pages == 0 and hit.match.num_pages == 10
        assert b.tm.remote.counts["lookup_miss"] == 1
    finally:
        a.close()
        b.close()



def test_a_purge_removes_the_pages_from_the_remote_store_too(mooncake_store):
    """Node A purges a namespace whose pages it wrote through to the remote store: they
    leave A's tiers and the store, so that node B (which never held them) misses them
    rather than fetch them back; a namespace not purged still travels."""
    a, b = Node(mooncake_store), Node(mooncake_store)
    other = namespace_id(SPEC.fingerprint, "other")
    try:
        a.tm.add_namespace(other)
        tokens = list(range(3000, 3000 + 6 * PS))
        a.prefill(tokens)
        new = a.tm.alloc(0, 6)
        a.engine.compute(other, tokens, new)
        a.tm.insert(other, tokens, 0, new)
        a.tm.flush()
        assert a.tm.remote.counts["pages_put"] == 12
        out = a.tm.purge({NS})
        assert out.left == 0 and out.device + out.host >= 6, out
        a.tm.flush()  # (the removal runs on the remote tier's write lane)
        assert out.remote.result() == 6
        assert a.store.contains(page_keys(other, tokens, PS), namespace=other) == [True] * 6
        assert a.store.contains(page_keys(NS, tokens, PS), namespace=NS) == [False] * 6
        assert b.lookup(tokens).match.num_pages == 0  # (not fetched back: gone from the store)
        a.tm.check_invariants()
    finally:
        a.close()
        b.close()


def test_a_purge_removes_every_nodes_copies_of_pages_it_no_longer_holds(mooncake_store):
    """The pages a node wrote through long ago are off its tiers (evicted) but in the
    store, and another node put pages of the same namespace (a longer prompt after the
    prefix it fetched): a purge on the first node, which holds nothing of the namespace
    any more, removes both nodes' objects — a third node misses all of them — and
    nothing of another namespace."""
    a, b, c = Node(mooncake_store), Node(mooncake_store), Node(mooncake_store)
    other = namespace_id(SPEC.fingerprint, "other")
    try:
        prefix, more = list(range(3000, 3000 + 6 * PS)), list(range(9000, 9000 + 3 * PS))
        a.prefill(prefix)
        a.tm.add_namespace(other)
        new = a.tm.alloc(0, 6)
        a.engine.compute(other, prefix, new)
        a.tm.insert(other, prefix, 0, new)
        a.tm.flush()
        a.tm.evict(Tier.DEVICE, 12, 0)
        a.tm.evict(Tier.HOST, 12)
        assert a.tm.tree.sizes(Tier.HOST).cached == 0 and a.tm.tree.sizes(Tier.DEVICE, 0).cached == 0
        assert b.load(prefix)[0].remote_pages == 6
        b.prefill(prefix + more)  # (B puts the three pages after the prefix)
        b.tm.flush()
        assert b.tm.remote.counts["pages_put"] == 3
        out = a.tm.purge({NS})
        assert (out.device, out.host, out.disk, out.left) == (0, 0, 0, 0), out
        a.tm.flush()
        assert out.remote.result() == 9
        assert c.lookup(prefix + more).match.num_pages == 0
        assert a.store.contains(page_keys(NS, prefix + more, PS), namespace=NS) == [False] * 9
        assert a.store.contains(page_keys(other, prefix, PS), namespace=other) == [True] * 6
        a.tm.check_invariants()
    finally:
        a.close()
        b.close()
        c.close()

def test_write_back_puts_what_the_disk_tier_evicts(mooncake_store, tmp_path):
    """``policy = "write_back"``: nothing goes to the store until the disk tier evicts a
    page; then its record is read back, put to the store (node B gets it byte-exact) and
    deleted from the disk."""
    from hicache.errors import InvalidArgument
    from hicache.storage.lmdb_backend import LmdbBackend

    with pytest.raises(InvalidArgument):  # (nothing to write back without a disk tier)
        Node(mooncake_store, policy="write_back").close()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    a, b = Node(mooncake_store, disk=disk, policy="write_back"), Node(mooncake_store)
    try:
        prompts = [list(range(100 * i, 100 * i + 4 * PS)) for i in range(1, 4)]
        for tokens in prompts:
            a.prefill(tokens)
        a.tm.flush()
        assert a.tm.remote.counts["pages_put"] == 0  # (on disk, not evicted: not written)
        a.tm.evict(Tier.DEVICE, 32, 0)
        a.tm.evict(Tier.HOST, 32)
        a.tm.flush()
        assert a.tm.tree.sizes(Tier.DISK).cached == 12
        assert a.tm.evict(Tier.DISK, 12) == 12
        a.tm.flush()
        a.tm.check_invariants()
        assert a.tm.remote.counts["pages_put"] == 12
        assert not list(disk.iter_metadata()), "records written back stay on disk"
        for tokens in prompts:
            hit, loaded = b.load(tokens)
            assert hit.remote_pages == 4 and len(loaded.device_pages) == 4
    finally:
        a.close()
        b.close()


def test_a_write_back_leaves_the_records_of_pages_written_to_disk_again(mooncake_store, tmp_path):
    """The disk tier evicts pages that stay on host; before their write-back is done,
    host eviction writes them to disk again (the same keys). The write-back deletes the
    records it read, not the new ones: the disk tier still serves those pages."""
    from hicache.storage.lmdb_backend import LmdbBackend

    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    a = Node(mooncake_store, disk=disk, policy="write_back")
    try:
        tokens = list(range(100, 100 + 4 * PS))
        a.prefill(tokens)
        a.tm.flush()
        assert a.tm.evict(Tier.DISK, 4) == 4  # (the write-back in flight until the next poll)
        a.tm.evict(Tier.HOST, 4)  # written to disk first
        a.tm.flush()
        a.tm.check_invariants()
        assert a.tm.remote.counts["pages_put"] == 4
        assert a.tm.tree.sizes(Tier.DISK).cached == 4 and len(list(disk.iter_metadata())) == 4
        a.tm.evict(Tier.DEVICE, 32, 0)
        hit, loaded = a.load(tokens)
        assert hit.match.num_disk_pages == 4 and len(loaded.device_pages) == 4
    finally:
        a.close()


def test_remote_pages_after_a_prefix_on_disk_only(mooncake_store, tmp_path):
    """Node B holds the first pages on disk only: the remote pages after them wait for
    the disk read of that prefix, then join the tree below it; the accounts balance at
    every step and every page loads byte-exact."""
    from hicache.storage.lmdb_backend import LmdbBackend

    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    a, b = Node(mooncake_store), Node(mooncake_store, disk=disk)
    try:
        tokens = list(range(7000, 7000 + 8 * PS))
        a.prefill(tokens)
        a.tm.flush()
        b.prefill(tokens[: 4 * PS])
        b.tm.flush()
        b.tm.evict(Tier.DEVICE, 32, 0)
        b.tm.evict(Tier.HOST, 32)
        b.tm.flush()
        assert b.tm.tree.sizes(Tier.HOST).cached == 0 and b.tm.tree.sizes(Tier.DISK).cached == 4
        hit, loaded = b.load(tokens)
        assert hit.remote_pages == 4 and hit.match.num_pages == 8, hit
        assert len(loaded.device_pages) == 8
    finally:
        a.close()
        b.close()


def test_writes_over_the_queue_wait_for_room_and_all_arrive(mooncake_store):
    """A burst of write-throughs over ``write_backlog``: the writes beyond it are deferred
    (counted), started as puts finish, and every page reaches the store."""
    a, b = Node(mooncake_store, write_backlog=2), Node(mooncake_store)
    try:
        prompts = [list(range(9000 + 100 * i, 9000 + 100 * i + 4 * PS)) for i in range(4)]
        for tokens in prompts:
            a.prefill(tokens)
        a.tm.flush()
        counts = a.tm.remote.counts
        assert counts["put_deferred"] > 0 and counts["put_skipped"] == 0
        assert counts["pages_put"] == 16
        assert a.metrics.registry.get_sample_value("hicache_remote_pages_total",
                                                   {"op": "put", "result": "deferred"}) == counts["put_deferred"]
        for tokens in prompts:
            hit, _ = b.load(tokens)
            assert hit.remote_pages == 4
    finally:
        a.close()
        b.close()


def test_a_lookup_that_found_nothing_is_not_repeated_within_its_ttl(mooncake_store):
    """An engine asks again for a waiting request at every step: within ``miss_ttl_s``
    the remote tier is not asked again (counted as recent_miss); with 0 it always is."""
    a = Node(mooncake_store)
    patient, eager = Node(mooncake_store, miss_ttl_s=3600.0), Node(mooncake_store, miss_ttl_s=0.0)
    try:
        tokens = list(range(20_000, 20_000 + 4 * PS))
        for node in (patient, eager):
            assert node.lookup(tokens).match.num_pages == 0
            assert node.tm.remote.counts["lookup_miss"] == 1
        a.prefill(tokens)
        a.tm.flush()
        again = patient.lookup(tokens)
        assert again.match.num_pages == 0 and again.remote_pages == 0
        assert patient.tm.remote.counts["lookup_recent_miss"] == 1 and patient.tm.remote.counts["lookup_miss"] == 1
        assert patient.metrics.registry.get_sample_value("hicache_remote_lookups_total",
                                                         {"result": "recent_miss"}) == 1
        assert eager.lookup(tokens).remote_pages == 4
    finally:
        for node in (a, patient, eager):
            node.close()


def test_concurrent_lookups_below_one_prefix_each_get_their_own_pages(mooncake_store):
    """Node A computed two conversations after one system prompt, S+X and S+Y. Node B,
    with nothing cached, gets both at once, and a request for S+X's first pages, as a
    router spreading a burst would send them. Each lookup gets the pages of its own
    tokens and reports those as its remote pages; S's pages are read once."""
    a, b = Node(mooncake_store), Node(mooncake_store)
    try:
        system = list(range(3000, 3000 + 2 * PS))
        sx = system + list(range(4000, 4000 + 4 * PS))
        sy = system + list(range(5000, 5000 + 4 * PS))
        a.prefill(sx)
        a.prefill(sy)
        a.tm.flush()
        assert a.tm.remote.counts["pages_put"] == 10
        # (all three in flight: nothing lands before the owner thread polls, in wait)
        lookups = [b.tm.lookup(NS, tokens, 0) for tokens in (sx, sy, sx[: 3 * PS])]
        hits = [b.tm.wait(f) for f in lookups]
        assert [(h.match.num_pages, h.remote_pages) for h in hits] == [(6, 6), (6, 6), (3, 3)]
        assert b.tm.remote.counts["pages_got"] == 10
        b.tm.check_invariants()
        for tokens in (sx, sy):
            _, loaded = b.load(tokens)
            assert len(loaded.device_pages) == 6
    finally:
        a.close()
        b.close()


def test_remote_pages_of_a_hit_cut_to_what_a_load_delivers(mooncake_store):
    """The device pool has no room for the remote pages: the hit is cut short of them,
    and so is its count of remote pages (they are part of its host pages)."""
    a, b = Node(mooncake_store), Node(mooncake_store)
    try:
        tokens = list(range(1000, 1000 + 10 * PS))
        a.prefill(tokens)
        a.tm.flush()
        b.tm.alloc(0, 28)  # (the engine's own pages: 4 free, less than the remote node's 10)
        hit = b.lookup(tokens)
        assert hit.unclipped.num_host_pages == 10 and hit.match.num_host_pages == 0
        assert hit.remote_pages == 0
    finally:
        a.close()
        b.close()


def test_a_closed_managers_host_pool_leaves_the_shared_store(mooncake_store):
    """The daemon shares one store among every spec's manager and closes a manager
    whose spec went unused (:mod:`daemon.specs`). The next manager's host pool is often
    mapped over the freed range, and Mooncake refuses a region that overlaps a registered
    one: a closed manager's host pool must leave the store with it."""
    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig

    store = MooncakeBackend(MooncakeConfig(master=mooncake_store.master))
    try:
        for host_pages in (32, 48, 64, 96, 128):
            TierManager(SPEC, host_pages=host_pages, metrics=Metrics(), config=TierConfig(), remote=store,
                        remote_settings=RemoteSettings()).close()
    finally:
        store.close()


def test_a_closed_manager_leaves_no_memory_registered_with_the_shared_store(mooncake_store):
    """Each lane thread of a manager's remote tier registers a header scratch area with
    the store the first time it calls it. The store outlives the manager (the daemon
    closes unused specs' managers): what the manager registered — host pool, scratch
    areas — leaves with it, however many managers come and go."""
    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig

    a = Node(mooncake_store)
    store = MooncakeBackend(MooncakeConfig(master=mooncake_store.master))
    try:
        tokens = list(range(7000, 7000 + 4 * PS + 1))
        a.prefill(tokens)
        a.tm.flush()
        before = store.registered_bytes
        for turn in range(3):
            engine = Engine(num_pages=32)
            tm = TierManager(SPEC, host_pages=32, metrics=Metrics(), config=TierConfig(), remote=store,
                             remote_settings=RemoteSettings(prefetch_policy="wait_complete"))
            tm.add_namespace(NS)
            tm.register_pool(0, [engine.pool])
            hit = tm.lookup(NS, tokens, 0)  # a read lane's lookup and gets
            hit = tm.wait(hit) if hasattr(hit, "result") else hit
            assert hit.remote_pages == 4, turn
            fresh = list(range(9000 + 100 * turn, 9000 + 100 * turn + 2 * PS))
            new = tm.alloc(0, 2)
            engine.compute(NS, fresh, new)
            tm.insert(NS, fresh, 0, new)
            tm.flush()  # a write lane's puts
            assert tm.remote.counts["pages_put"] == 2, turn
            assert store.registered_bytes > before
            tm.close()
            engine.close()
            assert store.registered_bytes == before, turn
    finally:
        store.close()
        a.close()


class StandInNode(Node):
    """A node whose remote store is :class:`storage_util.InProcessMooncake` (``raw``,
    shared by the nodes of one test): faults on cue, no Mooncake install needed."""

    def __init__(self, raw, disk=None, pages: int = 32, **settings) -> None:
        from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig

        self.store = MooncakeBackend(MooncakeConfig(master="127.0.0.1:1"), store=raw)
        self.disk = disk
        self.metrics = Metrics()
        self.engine = Engine(num_pages=pages)
        self.tm = TierManager(SPEC, host_pages=pages, metrics=self.metrics, config=TierConfig(), remote=self.store,
                              storage=disk,
                              remote_settings=RemoteSettings(**{"prefetch_policy": "wait_complete", **settings}))
        self.tm.add_namespace(NS)
        self.counters = self.tm.register_pool(0, [self.engine.pool])


def test_a_lookup_the_store_does_not_answer_holds_up_flush_and_close_until_their_deadline():
    """The store hangs in a lookup (its master unreachable mid-RPC). The lookup is work
    in flight like a get or a put: a flush waits for it (up to its deadline), and a
    close gives up at its deadline instead of joining the stuck thread for good (a
    daemon's stop would hang). Once the store answers, both finish."""
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    a, b = StandInNode(raw), StandInNode(raw, prefetch_policy="best_effort")
    try:
        tokens = list(range(1000, 1000 + 6 * PS))
        a.prefill(tokens)
        a.tm.flush()
        raw.hold("batch_is_exist")
        assert b.lookup(tokens).match.num_pages == 0  # (best_effort: answered, the lookup goes on)
        assert raw.entered.wait(60)
        assert not b.tm.idle()
        with pytest.raises(TimeoutError):
            b.tm.flush(timeout_s=0)
        assert b.tm.close(0) is False  # (nothing let go: the lane's thread is stuck in the store)
        raw.release()
        b.tm.flush()
        assert b.tm.remote.counts["lookup_hit"] == 1 and b.tm.remote.counts["pages_got"] == 6
        b.tm.check_invariants()
    finally:
        raw.release()
        a.close()
        b.close()


def _on_disk_only(node: StandInNode, prompts) -> None:
    """Prefill ``prompts`` on ``node``, then push their pages off the device and host:
    they are on its disk only."""
    for tokens in prompts:
        node.prefill(tokens)
    node.tm.flush()
    num_pages = sum(len(t) // PS for t in prompts)
    node.tm.evict(Tier.DEVICE, num_pages, 0)
    node.tm.evict(Tier.HOST, num_pages)
    node.tm.flush()
    assert node.tm.tree.sizes(Tier.HOST).cached == 0
    assert node.tm.tree.sizes(Tier.DISK).cached == num_pages


def test_a_write_back_of_more_pages_than_its_staging_rows_puts_them_all(tmp_path):
    """The disk tier evicts a node of more pages than the write-back stages at once (at
    16-token pages, a prompt of over 1,024 tokens): the write-back goes in parts that
    fit, every page reaches the store (node B loads it byte-exact) and every record
    leaves the disk."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.tiers.remote import STAGING_PAGES
    from storage_util import InProcessMooncake

    num_pages = STAGING_PAGES + 6
    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=4 * num_pages * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, pages=num_pages + 2, policy="write_back")
    b = StandInNode(raw, pages=num_pages + 2)
    try:
        tokens = list(range(100, 100 + num_pages * PS))
        _on_disk_only(a, [tokens])
        assert a.tm.evict(Tier.DISK, num_pages) == num_pages
        a.tm.flush()
        a.tm.check_invariants()
        counts = a.tm.remote.counts
        assert (counts["pages_put"], counts["put_skipped"]) == (num_pages, 0)
        assert not list(disk.iter_metadata()), "records written back stay on disk"
        hit, loaded = b.load(tokens)
        assert hit.remote_pages == num_pages and len(loaded.device_pages) == num_pages
    finally:
        a.close()
        b.close()


def test_a_write_back_while_another_holds_the_staging_rows_waits_for_them(tmp_path):
    """A write-back fills every staging row and the store is slow to take it; the disk
    tier evicts more pages meanwhile. Those wait for rows (their records stay on disk
    until then) and reach the store once the first put is done."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.tiers.remote import STAGING_PAGES
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=4 * (STAGING_PAGES + 4) * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, pages=STAGING_PAGES + 8, policy="write_back")
    b = StandInNode(raw, pages=STAGING_PAGES + 8)
    try:
        first, second = list(range(100, 100 + STAGING_PAGES * PS)), list(range(50_000, 50_000 + 4 * PS))
        _on_disk_only(a, [first, second])
        raw.hold("batch_put_from_multi_buffers")
        assert a.tm.evict(Tier.DISK, STAGING_PAGES) == STAGING_PAGES  # (the least recent: the first)
        assert raw.entered.wait(60)
        assert a.tm.evict(Tier.DISK, 4) == 4
        disk.flush()
        assert len(list(disk.iter_metadata())) == STAGING_PAGES + 4  # (nothing deleted before it is put)
        raw.release()
        a.tm.flush()
        a.tm.check_invariants()
        counts = a.tm.remote.counts
        assert (counts["pages_put"], counts["put_skipped"]) == (STAGING_PAGES + 4, 0)
        assert not list(disk.iter_metadata())
        for tokens in (first, second):
            hit, _ = b.load(tokens)
            assert hit.remote_pages == len(tokens) // PS
    finally:
        raw.release()
        a.close()
        b.close()


def test_a_purge_during_write_backs_leaves_nothing_of_the_namespace_in_the_store_or_on_disk(tmp_path):
    """A purge while one write-back is stuck in the store's put and another waits for
    staging rows: the waiting one's pages go now (records deleted, put nowhere); the
    stuck put lands, and the removal — queued behind it on the write lane — takes it
    out of the store. Nothing of the namespace is left anywhere; another namespace's
    write-back waiting beside it is still put."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.storage.mooncake_backend import KEY_PREFIX
    from hicache.tiers.remote import STAGING_PAGES
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=4 * (STAGING_PAGES + 8) * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, pages=STAGING_PAGES + 8, policy="write_back")
    other = namespace_id(SPEC.fingerprint, "other")
    try:
        first, second = list(range(100, 100 + STAGING_PAGES * PS)), list(range(50_000, 50_000 + 4 * PS))
        _on_disk_only(a, [first, second])
        a.tm.add_namespace(other)
        new = a.tm.alloc(0, 2)
        a.engine.compute(other, second[: 2 * PS], new)
        a.tm.insert(other, second[: 2 * PS], 0, new)
        a.tm.flush()
        a.tm.evict(Tier.DEVICE, 2, 0)
        a.tm.evict(Tier.HOST, 2)
        raw.hold("batch_put_from_multi_buffers")
        assert a.tm.evict(Tier.DISK, STAGING_PAGES) == STAGING_PAGES  # (the least recent: the first)
        assert raw.entered.wait(60)
        assert a.tm.evict(Tier.DISK, 6) == 6  # (the second prompt's and the other namespace's: waiting)
        out = a.tm.purge({NS})
        assert out.disk == 4 and out.left == 0, out
        raw.release()
        a.tm.flush()
        assert out.remote.result() == STAGING_PAGES  # (the stuck put's pages, removed after it)
        assert a.tm.remote.counts["pages_put"] == STAGING_PAGES + 2
        assert not [name for name in raw.objects if name.startswith(f"{KEY_PREFIX}{NS.hex()}/")]
        assert len([name for name in raw.objects if name.startswith(f"{KEY_PREFIX}{other.hex()}/")]) == 2
        assert not list(disk.iter_metadata())
        a.tm.check_invariants()
    finally:
        raw.release()
        a.close()


def test_pages_a_fetch_reads_while_their_namespace_is_purged_are_not_kept():
    """Node B's fetch of a namespace's pages has read them from the store, but not yet
    put them in its tree, when B purges the namespace: what it read is not kept (the
    purge would otherwise be undone by a read that began before it), and the store
    holds none."""
    import threading

    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    a, b = StandInNode(raw), StandInNode(raw, prefetch_policy="best_effort")
    read = threading.Event()
    get = raw.batch_get_into_multi_buffers

    def reading(*args):
        try:
            return get(*args)
        finally:
            read.set()

    raw.batch_get_into_multi_buffers = reading
    try:
        tokens = list(range(1000, 1000 + 6 * PS))
        a.prefill(tokens)
        a.tm.flush()
        raw.hold("batch_get_into_multi_buffers")
        assert b.lookup(tokens).match.num_pages == 0  # (best_effort: answered, the fetch goes on)
        _until(b, raw.entered.is_set)  # (the lookup's answer starts the read)
        raw.release()
        assert read.wait(60)  # (read; what lands it waits for B's owner thread)
        out = b.tm.purge({NS})
        b.tm.flush()
        assert out.remote.result() == 6
        assert b.tm.tree.sizes(Tier.HOST).cached == 0
        assert b.tm.tree.match(NS, pack_tokens(tokens), 0, touch=False).num_pages == 0
        assert b.lookup(tokens).match.num_pages == 0
        b.tm.check_invariants()
    finally:
        raw.release()
        a.close()
        b.close()


def test_write_backs_a_stop_cut_short_are_put_once_the_restarted_node_evicts_them(tmp_path):
    """The stop's drain runs out of time with a write-back stuck in the store and another
    waiting for its staging rows (the daemon gives up on the manager and closes the disk
    store): neither is put, but their records stay on disk. The restarted node rebuilds
    them as disk-resident pages, and its disk tier's next eviction of them puts them
    all — the fleet gets them late, not never."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.tiers.remote import STAGING_PAGES
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    capacity = 4 * (STAGING_PAGES + 4) * SPEC.host_page_bytes
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=capacity)
    a = StandInNode(raw, disk=disk, pages=STAGING_PAGES + 8, policy="write_back")
    first, second = list(range(100, 100 + STAGING_PAGES * PS)), list(range(50_000, 50_000 + 4 * PS))
    b = c = None
    try:
        _on_disk_only(a, [first, second])
        raw.hold("batch_put_from_multi_buffers")
        assert a.tm.evict(Tier.DISK, STAGING_PAGES) == STAGING_PAGES
        assert raw.entered.wait(60)
        assert a.tm.evict(Tier.DISK, 4) == 4  # (waits for the staging rows)
        assert a.tm.close(0) is False  # the stop gives up on it (left to the process's exit) ...
        disk.close()  # ... and closes the store
        # The restart. The old process's put never reached the fleet's store (it died
        # with the process): the fleet is a store without these pages.
        fleet = InProcessMooncake()
        disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=capacity)
        b = StandInNode(fleet, disk=disk, pages=STAGING_PAGES + 8, policy="write_back")
        assert b.tm.rebuild_from_storage() == STAGING_PAGES + 4
        b.tm.check_invariants()
        assert b.tm.evict(Tier.DISK, STAGING_PAGES + 4) == STAGING_PAGES + 4
        b.tm.flush()
        b.tm.check_invariants()
        assert (b.tm.remote.counts["pages_put"], b.tm.remote.counts["put_skipped"]) == (STAGING_PAGES + 4, 0)
        disk.flush()
        assert not list(disk.iter_metadata())
        c = StandInNode(fleet, pages=STAGING_PAGES + 8)
        for tokens in (first, second):
            hit, _ = c.load(tokens)
            assert hit.remote_pages == len(tokens) // PS
    finally:
        raw.release()  # (the old manager's lane thread ends; its callbacks are never run)
        a.store.close()
        a.engine.close()
        for node in (b, c):
            if node is not None:
                node.close()


def test_a_write_back_over_its_backlog_puts_what_fits_and_deletes_the_rest(tmp_path):
    """An eviction of more pages than ``write_backlog``: the pages that fit are put in
    parts of the staging pages, the rest are skipped (counted) — and no record of either
    stays on disk, out of the tree."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.tiers.remote import STAGING_PAGES
    from storage_util import InProcessMooncake

    num_pages, backlog = STAGING_PAGES + 10, STAGING_PAGES + 4
    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=4 * num_pages * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, pages=num_pages + 2, policy="write_back", write_backlog=backlog)
    try:
        _on_disk_only(a, [list(range(100, 100 + num_pages * PS))])
        assert a.tm.evict(Tier.DISK, num_pages) == num_pages
        a.tm.flush()
        a.tm.check_invariants()
        counts = a.tm.remote.counts
        assert (counts["pages_put"], counts["put_deferred"], counts["put_skipped"]) == (backlog, 4, 6)
        assert len(raw.objects) == backlog
        # (all evicted from disk; the skipped ones, on its disk only, dropped from the cache)
        assert a.metrics.registry.get_sample_value("hicache_evicted_pages_total", {"tier": "disk"}) == num_pages
        assert a.metrics.registry.get_sample_value("hicache_pages_dropped_total", {"tier": "disk"}) == 6
        disk.flush()
        assert not list(disk.iter_metadata())
    finally:
        a.close()


def test_pages_a_write_back_puts_are_evicted_from_disk_not_dropped_from_the_cache(tmp_path):
    """The disk tier evicts pages on disk only and the write-back puts them: they are
    evicted from disk, not dropped — the remote tier holds them (another node loads
    them). Pages whose put fails are dropped then: those on disk only, not those whose
    host copy stays. Every page is counted evicted from disk either way."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=64 * SPEC.host_page_bytes)
    a, b = StandInNode(raw, disk=disk, policy="write_back", retry_s=3600.0), StandInNode(raw)

    def counted(name):
        return a.metrics.registry.get_sample_value(name, {"tier": "disk"})

    try:
        put = list(range(100, 100 + 4 * PS))
        _on_disk_only(a, [put])
        assert a.tm.evict(Tier.DISK, 4) == 4
        a.tm.flush()
        assert a.tm.remote.counts["pages_put"] == 4
        assert (counted("hicache_evicted_pages_total"), counted("hicache_pages_dropped_total")) == (4, 0)
        hit, _ = b.load(put)
        assert hit.remote_pages == 4
        failing, kept = list(range(5000, 5000 + 3 * PS)), list(range(9000, 9000 + 2 * PS))
        _on_disk_only(a, [failing])
        a.prefill(kept)  # (on the device, on host and on disk)
        a.tm.flush()
        raw.batch_put_from_multi_buffers = lambda names, all_ptrs, all_sizes: [-900] * len(names)  # (RPC failed)
        assert a.tm.evict(Tier.DISK, 5) == 5  # (the least recent first: failing's 3, then kept's 2)
        a.tm.flush()
        a.tm.check_invariants()
        assert a.tm.remote.counts["put_skipped"] == 5
        assert (counted("hicache_evicted_pages_total"), counted("hicache_pages_dropped_total")) == (9, 3)
        assert a.tm.tree.sizes(Tier.HOST).cached == 2
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("refused", ["alone", "shared"])
def test_a_write_back_the_store_takes_part_of_drops_only_the_refused_pages_on_disk_alone(tmp_path, refused):
    """The store has no room for some objects of a write-back (Mooncake's "no space"
    for them, the rest put): the pages it refused are skipped, and dropped from the
    cache only where they were on this node's disk alone — not those with a host copy
    (which a count of the refused pages alone would have taken for pages on disk
    only)."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.storage.mooncake_backend import object_name
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=64 * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, policy="write_back", retry_s=3600.0)
    try:
        prompts = {"alone": list(range(5000, 5000 + 3 * PS)), "shared": list(range(9000, 9000 + 2 * PS))}
        _on_disk_only(a, [prompts["alone"]])
        a.prefill(prompts["shared"])  # (on the device, on host and on disk)
        a.tm.flush()
        no_room = {object_name(NS, key) for key in page_keys(NS, prompts[refused], PS)}
        put = raw.batch_put_from_multi_buffers

        def partly(names, all_ptrs, all_sizes):
            took = [i for i, name in enumerate(names) if name not in no_room]
            put([names[i] for i in took], [all_ptrs[i] for i in took], [all_sizes[i] for i in took])
            return [-200 if name in no_room else 0 for name in names]  # (-200: no segment has room)

        raw.batch_put_from_multi_buffers = partly
        assert a.tm.evict(Tier.DISK, 5) == 5  # (one write-back: alone's 3, then shared's 2)
        a.tm.flush()
        a.tm.check_invariants()
        skipped = len(prompts[refused]) // PS
        assert (a.tm.remote.counts["pages_put"], a.tm.remote.counts["put_skipped"]) == (5 - skipped, skipped)
        assert len(raw.objects) == 5 - skipped
        dropped = a.metrics.registry.get_sample_value("hicache_pages_dropped_total", {"tier": "disk"})
        assert dropped == (skipped if refused == "alone" else 0)
        assert a.tm.tree.sizes(Tier.HOST).cached == 2
    finally:
        a.close()


def _until(node: StandInNode, done) -> None:
    """Run ``node``'s completions until ``done()`` holds (its flush would wait for a
    put the test holds in the store)."""
    for _ in range(6000):
        if done():
            return
        node.tm.poll(0.01)
    assert done(), "the tier manager never got there"


def test_records_waiting_for_their_write_back_are_not_evicted_by_new_disk_writes(tmp_path):
    """The disk tier evicts more pages than one put takes while the store is slow to
    take them: their records stay on disk until they are put (some wait for staging
    rows). New pages that would overflow the disk meanwhile wait for those puts, rather
    than have the LMDB store evict its oldest records on its own — the waiting ones,
    which would then reach neither tier. Once the store answers, every evicted page is
    put, none skipped, the store evicted nothing and the new pages are on disk."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.tiers.remote import STAGING_PAGES
    from storage_util import InProcessMooncake

    num_old = STAGING_PAGES + 4
    capacity = 2 * num_old + 8
    num_new = capacity - num_old + 4  # (the old records and the new pages overflow the store by 4)
    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=capacity * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, pages=num_new + 8, policy="write_back")
    b = StandInNode(raw, pages=num_old + 8)
    try:
        first, second = list(range(100, 100 + STAGING_PAGES * PS)), list(range(50_000, 50_000 + 4 * PS))
        _on_disk_only(a, [first, second])
        raw.hold("batch_put_from_multi_buffers")
        assert a.tm.evict(Tier.DISK, STAGING_PAGES) == STAGING_PAGES
        assert raw.entered.wait(60)
        assert a.tm.evict(Tier.DISK, 4) == 4  # (waits for the staging rows)
        new = list(range(90_000, 90_000 + num_new * PS))
        a.prefill(new)
        _until(a, lambda: a.tm.tree.sizes(Tier.HOST).cached == num_new and not a.tm.disk.pending)
        raw.release()
        a.tm.flush()
        a.tm.check_invariants()
        counts = a.tm.remote.counts
        assert (counts["pages_put"], counts["put_skipped"]) == (num_old, 0)
        assert disk.stats().evicted_records == 0
        assert a.tm.tree.sizes(Tier.DISK).cached == num_new
        disk.flush()
        assert len(list(disk.iter_metadata())) == num_new
        for tokens in (first, second):
            hit, _ = b.load(tokens)
            assert hit.remote_pages == len(tokens) // PS
    finally:
        raw.release()
        a.close()
        b.close()


def test_write_backs_hold_at_most_half_the_disk_and_a_store_gone_down_lets_go_of_theirs(tmp_path):
    """The records write-backs hold count as used disk space, but never stop disk writes
    for good. A store that hangs: write-backs take at most half the disk tier (the rest
    is skipped, its records deleted), so new pages still fit beside them and are written
    while the put hangs; a write that does not fit evicts the tree's LRU, which the
    write-backs cannot take (skipped). Once the store fails the put (the tier is down),
    the write-backs waiting for staging rows are skipped too. The LMDB store never
    evicts on its own."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.tiers.remote import STAGING_PAGES
    from storage_util import InProcessMooncake

    half = STAGING_PAGES + 8
    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=2 * half * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, pages=2 * half + 8, policy="write_back")
    try:
        _on_disk_only(a, [list(range(100, 100 + (half + 8) * PS))])

        def put_fails(names, all_ptrs, all_sizes):  # (once the test lets it go)
            raw._wait("batch_put_from_multi_buffers")
            return [-900] * len(names)  # (Mooncake's "the RPC failed")

        raw.batch_put_from_multi_buffers = put_fails
        raw.hold("batch_put_from_multi_buffers")
        assert a.tm.evict(Tier.DISK, half + 8) == half + 8  # (STAGING_PAGES put, 8 wait for rows)
        assert raw.entered.wait(60)
        counts = a.tm.remote.counts
        assert counts["put_skipped"] == 8  # (over half the disk: deleted now)
        beside = list(range(20_000, 20_000 + half * PS))
        a.prefill(beside)
        _until(a, lambda: a.tm.tree.sizes(Tier.DISK).cached == half)
        after = list(range(40_000, 40_000 + 8 * PS))
        a.prefill(after)  # (the disk is full: beside, the LRU, makes room, skipped)
        _until(a, lambda: a.tm.tree.sizes(Tier.DISK).cached == 8 and not a.tm.disk.pending)
        assert a.tm.disk.deferred_writes() == 0
        assert counts["put_skipped"] == 8 + half
        raw.release()
        a.tm.flush()
        a.tm.check_invariants()
        assert not a.tm.remote.up
        assert (counts["pages_put"], counts["put_skipped"]) == (0, 2 * half + 8)
        assert a.tm.tree.sizes(Tier.DISK).cached == 8
        assert disk.stats().evicted_records == 0
        disk.flush()
        assert len(list(disk.iter_metadata())) == 8
    finally:
        raw.release()
        a.close()


def test_a_write_back_whose_disk_read_fails_leaves_the_remote_tier_up(tmp_path):
    """The write-back's read of its records from the local LMDB store raises (out of
    reader slots): that write-back fails — its pages skipped, counted — but the store
    did nothing wrong: the remote tier stays up, and the next eviction's pages are put
    (not skipped for ``retry_s`` as if the fleet's store were down)."""
    import lmdb

    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=64 * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, policy="write_back", retry_s=3600.0)
    b = StandInNode(raw)
    try:
        first, second = list(range(100, 100 + 6 * PS)), list(range(50_000, 50_000 + 4 * PS))
        _on_disk_only(a, [first, second])
        original, calls = disk.get, []

        def fails_once(keys, buffers, *, fingerprint):
            calls.append(len(keys))
            if len(calls) == 1:
                raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL")
            return original(keys, buffers, fingerprint=fingerprint)

        disk.get = fails_once
        assert a.tm.evict(Tier.DISK, 6) == 6  # (the least recent: the first)
        a.tm.flush()
        assert calls == [6]
        counts = a.tm.remote.counts
        assert (counts["pages_put"], counts["put_skipped"]) == (0, 6)
        assert a.tm.remote.up
        assert a.metrics.registry.get_sample_value("hicache_remote_up") == 1
        assert a.tm.evict(Tier.DISK, 4) == 4
        a.tm.flush()
        a.tm.check_invariants()
        assert (counts["pages_put"], counts["put_skipped"]) == (4, 6)
        hit, _ = b.load(second)
        assert hit.remote_pages == 4
    finally:
        a.close()
        b.close()


def test_a_write_back_puts_the_records_beside_one_on_a_bad_sector(tmp_path, monkeypatch):
    """The third of the six records a write-back reads sits on a bad sector (EIO): the
    five the store could read are put, the unreadable one alone is skipped (counted,
    dropped from the cache: it was on this disk only), and no record stays on disk out
    of the tree. Another node loads the pages before the gap from the remote tier."""
    from hicache.keys import page_keys
    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import InProcessMooncake, bad_sector

    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=64 * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, policy="write_back", retry_s=3600.0)
    b = StandInNode(raw)
    try:
        tokens = list(range(100, 100 + 6 * PS))
        _on_disk_only(a, [tokens])
        bad_sector(monkeypatch, disk, page_keys(NS, tokens, PS)[2])
        assert a.tm.evict(Tier.DISK, 6) == 6
        a.tm.flush()
        a.tm.check_invariants()
        counts = a.tm.remote.counts
        assert (counts["pages_put"], counts["put_skipped"]) == (5, 1)
        assert len(raw.objects) == 5
        assert a.metrics.registry.get_sample_value("hicache_pages_dropped_total", {"tier": "disk"}) == 1
        assert a.metrics.registry.get_sample_value("hicache_disk_unreadable_pages_total") == 1
        assert a.tm.remote.up
        disk.flush()
        assert not list(disk.iter_metadata())
        hit, loaded = b.load(tokens)
        assert hit.remote_pages == 2 and len(loaded.device_pages) == 2
    finally:
        a.close()
        b.close()


def test_a_write_back_whose_put_fails_still_counts_and_logs_its_record_on_a_bad_sector(tmp_path, monkeypatch,
                                                                                        caplog):
    """The third of the six records a write-back reads sits on a bad sector, and the
    store fails the put of the other five. All six are skipped (their records deleted),
    and the unreadable one is still told apart as the disk's fault: counted in
    hicache_disk_unreadable_pages_total and logged, as when the put succeeds."""
    from hicache.keys import page_keys
    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import InProcessMooncake, bad_sector

    raw = InProcessMooncake()
    raw.batch_put_from_multi_buffers = lambda names, all_ptrs, all_sizes: [-900] * len(names)  # (RPC failed)
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=64 * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, policy="write_back", retry_s=3600.0)
    try:
        tokens = list(range(100, 100 + 6 * PS))
        _on_disk_only(a, [tokens])
        bad_sector(monkeypatch, disk, page_keys(NS, tokens, PS)[2])
        caplog.set_level(logging.ERROR, logger="hicache.tiers.remote")
        assert a.tm.evict(Tier.DISK, 6) == 6
        a.tm.flush()
        a.tm.check_invariants()
        counts = a.tm.remote.counts
        assert (counts["pages_put"], counts["put_skipped"]) == (0, 6)
        assert not raw.objects and not a.tm.remote.up
        assert a.metrics.registry.get_sample_value("hicache_pages_dropped_total", {"tier": "disk"}) == 6
        assert a.metrics.registry.get_sample_value("hicache_disk_unreadable_pages_total") == 1
        assert [r for r in caplog.records if r.levelno == logging.ERROR and "1 of its 6 pages" in r.getMessage()]
        disk.flush()
        assert not list(disk.iter_metadata())
    finally:
        a.close()


def test_a_store_that_hangs_with_write_backs_holding_half_the_disk_stops_no_disk_write(tmp_path):
    """The store hangs in a put (no answer, no error) while write-backs hold their half
    of the disk tier, and the tree's own pages fill the other half. A new page is still
    written to disk: the disk tier evicts its own LRU for it — the write-backs cannot
    take more, so those pages are skipped (counted, their records deleted) and make room
    at once — rather than wait for puts that may never end (meanwhile every disk write
    would wait, and the host pages that wait for their disk write before they may go
    would fill the host tier). The LMDB store never evicts on its own, and once the
    store answers, the write-backs' pages are put."""
    from hicache.storage.lmdb_backend import LmdbBackend
    from hicache.tiers.remote import STAGING_PAGES
    from storage_util import InProcessMooncake

    half = STAGING_PAGES + 8
    raw = InProcessMooncake()
    disk = LmdbBackend(tmp_path / "lmdb", capacity_bytes=2 * half * SPEC.host_page_bytes)
    a = StandInNode(raw, disk=disk, pages=2 * half + 8, policy="write_back")
    try:
        _on_disk_only(a, [list(range(100, 100 + (half + 8) * PS))])
        raw.hold("batch_put_from_multi_buffers")
        assert a.tm.evict(Tier.DISK, half + 8) == half + 8  # (STAGING_PAGES put, 8 wait for rows, 8 skipped)
        assert raw.entered.wait(60)
        assert a.tm.remote.held_pages == half
        beside = list(range(20_000, 20_000 + half * PS))
        a.prefill(beside)
        _until(a, lambda: a.tm.tree.sizes(Tier.DISK).cached == half)
        after = list(range(40_000, 40_000 + 8 * PS))
        a.prefill(after)  # (the disk is full: the tree's LRU, beside, makes room)
        _until(a, lambda: not a.tm.disk.pending and (a.tm.disk.deferred_writes()
                                                     or a.tm.tree.sizes(Tier.DISK).cached != half))
        assert a.tm.disk.deferred_writes() == 0
        assert a.tm.tree.sizes(Tier.DISK).cached == 8
        counts = a.tm.remote.counts
        assert (counts["pages_put"], counts["put_skipped"]) == (0, 8 + half)
        a.tm.check_invariants()
        raw.release()
        a.tm.flush()
        a.tm.check_invariants()
        assert (counts["pages_put"], counts["put_skipped"]) == (half, 8 + half)
        assert disk.stats().evicted_records == 0
        disk.flush()
        assert len(list(disk.iter_metadata())) == 8
    finally:
        raw.release()
        a.close()


@pytest.mark.parametrize("retry_s", [0.0, 3600.0])
def test_a_write_through_deferred_behind_a_put_that_fails_is_put_or_skipped(retry_s):
    """A write waits for room in the queue behind a put, which fails (the store answers
    with an error: the tier is marked down for ``retry_s``). The write does not wait for
    another put's end — maybe never, with no more traffic: flush returns without it —
    but goes as the probe once the tier may be asked again (retry_s 0: its pages reach
    the store), or is skipped and counted like any write while the tier is down."""
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    answer = raw.batch_put_from_multi_buffers
    calls = []

    def fails_once(names, all_ptrs, all_sizes):
        raw._wait("batch_put_from_multi_buffers")
        calls.append(len(names))
        return [-900] * len(names) if len(calls) == 1 else answer(names, all_ptrs, all_sizes)

    raw.batch_put_from_multi_buffers = fails_once
    a = StandInNode(raw, write_backlog=2, retry_s=retry_s)
    try:
        counts = _deferred_behind_a_held_put(a, raw)
        raw.release()
        a.tm.flush()
        a.tm.check_invariants()
        assert (counts["pages_put"], counts["put_skipped"]) == ((2, 2) if retry_s == 0 else (0, 4))
        assert len(raw.objects) == counts["pages_put"]
    finally:
        raw.release()
        a.close()


def _deferred_behind_a_held_put(a: StandInNode, raw) -> dict:
    """Node ``a`` (a write backlog of 2) puts a 2-page prompt, which the store holds in
    its put; a second prompt's write-through is deferred behind it. The tier's counts."""
    raw.hold("batch_put_from_multi_buffers")
    a.prefill(list(range(100, 100 + 2 * PS)))
    _until(a, raw.entered.is_set)
    a.prefill(list(range(5000, 5000 + 2 * PS)))  # (over the backlog: deferred)
    counts = a.tm.remote.counts
    _until(a, lambda: counts["put_deferred"] == 2)
    return counts


def test_a_deferred_write_through_whose_pages_left_host_is_counted_skipped():
    """A write waits for room in the queue behind a put the store is slow to take; its
    pages leave the host meanwhile (host eviction: nothing to put them from). When the
    put ends, they are counted skipped — every deferred page ends put or skipped."""
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    a = StandInNode(raw, write_backlog=2)
    try:
        counts = _deferred_behind_a_held_put(a, raw)
        a.tm.evict(Tier.DEVICE, 32, 0)
        assert a.tm.evict(Tier.HOST, 2) == 2  # (the deferred pages: the others are being put)
        raw.release()
        a.tm.flush()
        a.tm.check_invariants()
        assert (counts["pages_put"], counts["put_deferred"], counts["put_skipped"]) == (2, 2, 2)
        assert a.metrics.registry.get_sample_value("hicache_remote_pages_total",
                                                   {"op": "put", "result": "skipped"}) == 2
        assert len(raw.objects) == 2
    finally:
        raw.release()
        a.close()


@pytest.mark.parametrize("put_first", [True, False])
def test_records_a_failed_disk_write_kept_from_a_write_back_are_deleted(tmp_path, put_first):
    """The disk tier evicts pages that stay on host, and host eviction writes them to
    disk again while their write-back holds the old records (which it then leaves).
    That disk write fails: the tree has no record of the pages, so the old records go
    too — whether the write-back is done before the failure or after — instead of
    staying in the store, out of the tree, until a restart rebuilds them."""
    import threading

    from hicache.errors import StorageUnavailable
    from hicache.storage.lmdb_backend import LmdbBackend
    from storage_util import InProcessMooncake

    class Refusing:
        """Fails a put once ``fail`` is set (while ``refuse`` is)."""

        def __init__(self, inner):
            self.inner, self.refuse, self.fail = inner, False, threading.Event()

        def put_batch(self, batch, *, fingerprint):
            if self.refuse:
                assert self.fail.wait(60)
                raise StorageUnavailable("the disk is gone")
            return self.inner.put_batch(batch, fingerprint=fingerprint)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    raw = InProcessMooncake()
    lmdb_store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    disk = Refusing(lmdb_store)
    a = StandInNode(raw, disk=disk, policy="write_back")
    try:
        tokens = list(range(100, 100 + 4 * PS))
        a.prefill(tokens)
        a.tm.flush()
        raw.hold("batch_put_from_multi_buffers")
        assert a.tm.evict(Tier.DISK, 4) == 4
        assert raw.entered.wait(60)  # (the write-back has read the records: its put hangs)
        disk.refuse = True
        a.tm.evict(Tier.HOST, 4)  # written to disk first: the write will fail
        assert a.tm.disk.pending == 4
        if put_first:
            raw.release()
            _until(a, lambda: a.tm.remote.counts["pages_put"] == 4)
        disk.fail.set()
        _until(a, lambda: not a.tm.disk.pending)
        raw.release()
        a.tm.flush()
        a.tm.check_invariants()
        assert a.tm.remote.counts["pages_put"] == 4
        assert a.tm.tree.sizes(Tier.DISK).cached == 0
        lmdb_store.flush()
        assert len(list(lmdb_store.iter_metadata())) == 0, "records of pages no tier knows stay on disk"
    finally:
        raw.release()
        disk.fail.set()
        a.close()
