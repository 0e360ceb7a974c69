"""Recurrent-state checkpoints in the tier manager: offered with an insert, the end of
every hit for a spec with state layers, brought back into an engine's state slot from
host or disk, written through to disk, back after a restart, gone with their node."""

import numpy as np
import pytest

from hicache.errors import InvalidArgument
from hicache.keys import namespace_id
from hicache.spec import KVSpec, MHALayer, StateLayer
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierConfig, TierManager
from hicache.tiers.checkpoints import checkpoint_key
from hicache.tree import Tier
from tiers_util import Engine

SPEC = KVSpec(page_size=4, model="checkpoints-test", layers=(
    StateLayer(conv_state_shape=(2, 8), temporal_state_shape=(2, 4, 4), conv_dtype="float32"),
    MHALayer(num_kv_heads=2, head_dim=8, dtype="float16")))
NS = namespace_id(SPEC.fingerprint, "checkpoints")
PS = SPEC.page_size
STATE_SLOTS = 6


class StateEngine(Engine):
    """An engine whose pool has state slots: states are bytes derived from a label."""

    def __init__(self, num_pages: int = 32, checkpoint_slots: int = 0) -> None:
        from hicache.engine.kv_pool import export_kv_pool
        self.spec = SPEC
        self.exported = export_kv_pool(SPEC, num_pages, num_state_slots=STATE_SLOTS, checkpoint_slots=checkpoint_slots)
        self.pool = self.exported.pool
        self.waiters = {}
        self._regions = self.pool.layout.token_regions

    def _state_spans(self, slot: int):
        for r in self.pool.layout.state_regions:
            yield slice(r.offset + slot * r.unit_bytes, r.offset + (slot + 1) * r.unit_bytes)

    def set_state(self, slot: int, label: int) -> None:
        buf = self.pool.buffer.numpy()
        rng = np.random.default_rng(label)
        for span in self._state_spans(slot):
            buf[span] = rng.integers(0, 256, span.stop - span.start, dtype=np.uint8)

    def state_label(self, slot: int, labels) -> int | None:
        """Which of ``labels`` the slot holds (None: none of them)."""
        buf = self.pool.buffer.numpy()
        got = b"".join(buf[span].tobytes() for span in self._state_spans(slot))
        for label in labels:
            self.set_state(STATE_SLOTS, label)  # (the last slot as scratch)
            want = b"".join(buf[span].tobytes() for span in self._state_spans(STATE_SLOTS))
            if got == want:
                return label
        return None


@pytest.fixture
def engine():
    e = StateEngine()
    yield e
    e.close()


def make_tm(engine, *, host_pages=16, storage=None, **config):
    tm = TierManager(SPEC, host_pages=host_pages, storage=storage, config=TierConfig(**config))
    tm.add_namespace(NS)
    tm.register_pool(0, [engine.pool])
    return tm


def tokens(start, pages):
    return list(range(start, start + pages * PS))


def prefill(tm, engine, toks, checkpoints=(), pool_id=0):
    """Compute ``toks`` into new pages, insert them with ``(pages, label)`` checkpoints
    (each label's state written into its own slot first)."""
    hit = tm.match(NS, toks, pool_id).match
    new = tm.alloc(pool_id, len(toks) // PS - hit.num_device_pages)
    pages = np.concatenate((hit.device_pages, new))
    engine.compute(NS, toks, pages)
    result = tm.insert(NS, toks, pool_id, pages)
    offers = []
    for slot, (num_pages, label) in enumerate(checkpoints, 1):
        engine.set_state(slot, label)
        offers.append((num_pages, slot))
    taken = tm.wait(tm.checkpoint(result.node, pool_id, offers))
    tm.check_invariants()
    return result, taken


def load_state(tm, engine, toks, slot=1, pool_id=0):
    """Match, lock, load with a state slot; returns (pages hit, state landed, result)."""
    engine.set_state(slot, 999)
    hit = tm.match(NS, toks, pool_id)
    node = hit.match.node
    if node.parent is None:
        return 0, False, None
    tm.lock(node, pool_id)
    loaded = tm.wait(tm.load(node, pool_id, state_slot=slot))
    engine.wait(tm.pools.get(pool_id).counters, loaded.wait)
    engine.check(NS, toks, loaded.device_pages)
    tm.unlock(node, pool_id)
    tm.check_invariants()
    return len(loaded.device_pages), loaded.state, loaded


def test_a_hit_ends_at_the_deepest_checkpoint_and_brings_its_state(engine):
    tm = make_tm(engine)
    toks = tokens(100, 6)
    _, taken = prefill(tm, engine, toks, [(2, 11), (5, 12)])
    assert taken == 2
    # The tree was cut at both boundaries: the checkpoints sit on node ends.
    assert [n.num_pages for n in tm.tree.path(tm.match(NS, toks, 0).match.node)] == [2, 3]
    assert tm.match(NS, toks, 0).match.num_pages == 5  # page 6 has no checkpoint after it
    for length, want_pages, label in ((6, 5, 12), (5, 5, 12), (4, 2, 11), (3, 2, 11), (2, 2, 11)):
        pages, state, _ = load_state(tm, engine, toks[: length * PS])
        assert (pages, state) == (want_pages, True), length
        assert engine.state_label(1, [11, 12]) == label
    # Before the first checkpoint: no hit at all (KV without its state is no use).
    assert tm.match(NS, toks[: PS], 0).match.node.parent is None
    tm.close()


def test_a_checkpoint_is_offered_once_and_slots_and_page_counts_are_checked(engine):
    tm = make_tm(engine)
    toks = tokens(200, 3)
    result, taken = prefill(tm, engine, toks, [(3, 1)])
    assert taken == 1
    assert tm.wait(tm.checkpoint(result.node, 0, [(3, 2)])) == 0  # has one already: kept
    for bad in ([(0, 1)], [(4, 1)], [(2, 1), (2, 2)], [(3, 0)], [(3, STATE_SLOTS + 1)], [(1,)], [("1", 1)],
                [(1.0, 1)], [(True, 1)]):
        with pytest.raises(InvalidArgument):
            tm.checkpoint(result.node, 0, bad)
    node = tm.match(NS, toks, 0).match.node
    tm.lock(node, 0)
    with pytest.raises(InvalidArgument):
        tm.load(node, 0, state_slot=STATE_SLOTS + 1)
    tm.unlock(node, 0)
    tm.check_invariants()
    tm.close()


def test_a_spec_without_state_layers_takes_no_checkpoint():
    from tiers_util import SPEC as PLAIN
    plain = Engine(num_pages=8)
    tm = TierManager(PLAIN, host_pages=8)
    ns = namespace_id(PLAIN.fingerprint, "plain")
    tm.add_namespace(ns)
    tm.register_pool(0, [plain.pool])
    assert tm.checkpoints is None and tm.host_pool.num_state_slots == 0
    with pytest.raises(InvalidArgument):
        tm.check_checkpoints(0, 2, [(1, 1)])
    tm.close()
    plain.close()


@pytest.fixture
def store(tmp_path):
    backend = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    yield backend
    backend.close()


def test_checkpoints_are_written_through_and_come_back_from_disk(engine, store):
    tm = make_tm(engine, storage=store, host_checkpoints=2)
    prompts = [tokens(1000 * i, 3) for i in range(1, 5)]
    for label, toks in enumerate(prompts, 1):
        prefill(tm, engine, toks, [(3, label)])
        tm.flush()  # (a host slot whose checkpoint is being written cannot be taken)
    # Four checkpoints, two host slots: the older two live on disk only.
    on_host, on_disk, _ = tm.checkpoints.count()
    assert (on_host, on_disk) == (2, 4)
    tm.evict(Tier.DEVICE, 32, 0)
    tm.evict(Tier.HOST, 16)
    tm.flush()
    for label, toks in enumerate(prompts, 1):
        pages, state, _ = load_state(tm, engine, toks)
        assert (pages, state) == (3, True)
        assert engine.state_label(1, range(1, 5)) == label
    tm.check_invariants()
    tm.close()


def test_a_restarted_manager_gets_its_checkpoints_back(engine, tmp_path):
    path = tmp_path / "lmdb"
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    a, b = tokens(100, 5), tokens(100, 2) + tokens(900, 3)  # b branches off a after page 2
    prefill(tm, engine, a, [(2, 21), (5, 22)])
    prefill(tm, engine, b, [(4, 23)])
    tm.flush()
    tm.close()
    store.close()
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    assert tm.rebuild_from_storage() == 8
    tm.check_invariants()
    assert tm.checkpoints.count() == (0, 3, 0)
    for toks, want_pages, label in ((a, 5, 22), (a[: 4 * PS], 2, 21), (b, 4, 23), (b[: 3 * PS], 2, 21)):
        pages, state, _ = load_state(tm, engine, toks)
        assert (pages, state) == (want_pages, True)
        assert engine.state_label(1, [21, 22, 23]) == label
    tm.close()
    store.close()


@pytest.mark.parametrize("left", ["another size", "no pages"])
def test_a_restart_drops_a_checkpoint_record_it_cannot_restore(engine, tmp_path, left):
    """Left in the store across a restart: a checkpoint record of another size than a
    state slot (intact: the store would refuse every read of it), or one whose pages'
    records are gone. The rebuild attaches neither — its node is no hit end — and
    deletes it; the good checkpoint beside it comes back."""
    from hicache.storage.base import PageMeta, PageRecord

    path = tmp_path / "lmdb"
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    a, b = tokens(100, 2), tokens(500, 3)
    prefill(tm, engine, a, [(2, 71)])
    prefill(tm, engine, b, [(3, 72)])
    tm.flush()
    boundary = tm.match(NS, a, 0).match.node.last_page_key
    page_keys = tm.match(NS, a, 0).match.node.page_key_list()
    tm.close()
    key = checkpoint_key(boundary)
    if left == "another size":
        odd = PageRecord(key, np.zeros(tm.host_pool.state_slot_bytes - 8, np.uint8), PageMeta(NS, boundary, b""))
        store.put([odd], fingerprint=SPEC.fingerprint).result()
    else:
        store.delete(page_keys).result()
    store.close()

    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    tm.rebuild_from_storage()
    tm.flush()
    tm.check_invariants()
    assert tm.checkpoints.count() == (0, 1, 0)
    assert tm.match(NS, a, 0).match.node.parent is None
    assert store.read_tokens([key]) == [None]  # the record is deleted
    pages, state, _ = load_state(tm, engine, b)
    assert (pages, state) == (3, True) and engine.state_label(1, [71, 72]) == 72
    tm.close()
    store.close()


def test_a_checkpoint_goes_with_its_node_from_every_tier(engine, store):
    tm = make_tm(engine, storage=store)
    toks = tokens(300, 2)
    result, _ = prefill(tm, engine, toks, [(2, 31)])
    tm.flush()
    node = result.node
    key = checkpoint_key(node.last_page_key)
    assert tm.checkpoints.count() == (1, 1, 0)
    tm.evict(Tier.DEVICE, 32, 0)
    tm.evict(Tier.HOST, 16)
    tm.evict(Tier.DISK, 16)
    tm.flush()
    assert not tm.tree.is_live(node)
    assert tm.checkpoints.count() == (0, 0, 0)
    assert tm.checkpoints.alloc.num_allocated == 0
    assert store.get([key], [bytearray(tm.host_pool.state_slot_bytes)], fingerprint=SPEC.fingerprint) == [False]
    tm.check_invariants()
    tm.close()


def test_a_lost_checkpoint_record_makes_the_hit_shorter_not_wrong(engine, store):
    tm = make_tm(engine, storage=store, host_checkpoints=1)
    toks = tokens(400, 4)
    prefill(tm, engine, toks[: 2 * PS], [(2, 41)])
    tm.flush()
    prefill(tm, engine, toks, [(4, 42)])  # one host slot: the first goes to disk only
    tm.flush()
    assert tm.checkpoints.count() == (1, 2, 0)
    deep = tm.match(NS, toks, 0).match.node
    shallow = deep.parent
    store.delete([checkpoint_key(shallow.last_page_key)]).result()
    tm.evict(Tier.DEVICE, 32, 0)
    tm.evict(Tier.HOST, 16)
    tm.flush()
    # The shallow checkpoint's record is gone: restoring it fails, and the node no
    # longer counts as a hit end.
    pages, state, _ = load_state(tm, engine, toks[: 3 * PS])
    assert (pages, state) == (2, False)
    assert tm.match(NS, toks[: 3 * PS], 0).match.node.parent is None
    pages, state, _ = load_state(tm, engine, toks)
    assert (pages, state) == (4, True) and engine.state_label(1, [41, 42]) == 42
    tm.close()


def _a_on_disk_only(tm, engine):
    """Prompts a and b with checkpoints (labels 61, 62), written to disk; the manager's
    one host slot holds b's, so a's is on disk only. (a, b, a's checkpoint key)."""
    a, b = tokens(100, 2), tokens(500, 2)
    prefill(tm, engine, a, [(2, 61)])
    tm.flush()
    prefill(tm, engine, b, [(2, 62)])
    tm.flush()
    assert tm.checkpoints.count() == (1, 2, 0)
    return a, b, checkpoint_key(tm.match(NS, a, 0).match.node.last_page_key)


def test_a_checkpoint_read_that_raises_once_is_a_miss_and_keeps_the_record(engine, store):
    """The read of a checkpoint's disk record fails as a whole (LMDB out of reader
    slots; an EIO alike): that restore misses, but nothing is known about the record —
    the checkpoint stays on disk and its node a hit end, and the next restore brings
    its state."""
    import lmdb

    tm = make_tm(engine, storage=store, host_checkpoints=1)
    a, b, key = _a_on_disk_only(tm, engine)
    original, calls = store.get, []

    def fails_once(keys, buffers, *, fingerprint):
        if list(keys) == [key]:
            calls.append(key)
            if len(calls) == 1:
                raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL")
        return original(keys, buffers, fingerprint=fingerprint)

    store.get = fails_once
    pages, state, _ = load_state(tm, engine, a)
    assert (pages, state) == (2, False) and len(calls) == 1
    assert tm.checkpoints.count()[1] == 2, "a read that failed as a whole lost the checkpoint's disk copy"
    assert tm.match(NS, a, 0).match.num_pages == 2
    pages, state, _ = load_state(tm, engine, a)
    assert (pages, state) == (2, True) and engine.state_label(1, [61, 62]) == 61
    store.get = original
    tm.check_invariants()
    tm.close()


def test_a_checkpoint_record_unreadable_at_every_read_is_dropped_after_a_few_reads_in_a_row(engine, store):
    """The store cannot read a checkpoint's record (an I/O error on its bytes, named by
    the get: RecordsUnreadable) at every try: each restore misses and keeps the record,
    until 3 reads in a row have failed with no good one between — then the checkpoint's
    disk copy goes (its record deleted, the checkpoint counted lost) and its node is no
    hit end, instead of every later match ending there and every restore failing. A
    good read between failed ones starts the count again."""
    from hicache.errors import RecordsUnreadable

    tm = make_tm(engine, storage=store, host_checkpoints=1)
    a, b, key = _a_on_disk_only(tm, engine)
    original, failing = store.get, [True]

    def bad_sector(keys, buffers, *, fingerprint):
        if key in keys and failing[0]:
            raise RecordsUnreadable("an I/O error", [False] * len(keys), [list(keys).index(key)])
        return original(keys, buffers, fingerprint=fingerprint)

    def restore_b():  # (b's checkpoint takes the host slot back, so a's is on disk only again)
        assert load_state(tm, engine, b)[:2] == (2, True)

    store.get = bad_sector
    for _ in range(2):
        assert load_state(tm, engine, a)[:2] == (2, False)
    failing[0] = False
    assert load_state(tm, engine, a)[:2] == (2, True)
    restore_b()
    failing[0] = True
    for _ in range(2):
        assert load_state(tm, engine, a)[:2] == (2, False)
    assert tm.checkpoints.count()[1] == 2, "failures a good read broke up dropped the checkpoint"
    assert load_state(tm, engine, a)[:2] == (2, False)
    assert tm.checkpoints.count()[1] == 1, "a checkpoint record unreadable at every read stays a hit end"
    assert tm.match(NS, a, 0).match.node.parent is None
    assert tm.checkpoints.lost == 1
    store.get = original
    store.flush()
    assert key not in dict(store.iter_metadata()), "the unreadable record was kept in the store"
    tm.check_invariants()
    tm.close()


def test_a_checkpoint_record_of_another_size_is_dropped_not_read_again_and_again(engine, store):
    """An intact record under a checkpoint's key whose payload is not a state slot's
    size (the store reads it as missing, the same at every try): the
    checkpoint's disk copy goes, and its node is no hit end."""
    from hicache.storage.base import PageMeta, PageRecord

    tm = make_tm(engine, storage=store, host_checkpoints=1)
    a, b = tokens(100, 2), tokens(500, 2)
    prefill(tm, engine, a, [(2, 61)])
    tm.flush()
    prefill(tm, engine, b, [(2, 62)])  # one host slot: a's checkpoint is on disk only
    tm.flush()
    node = tm.match(NS, a, 0).match.node
    odd = PageRecord(checkpoint_key(node.last_page_key), np.zeros(tm.host_pool.state_slot_bytes - 8, np.uint8),
                     PageMeta(NS, node.last_page_key, b""))
    store.put([odd], fingerprint=SPEC.fingerprint).result()
    pages, state, _ = load_state(tm, engine, a)
    assert (pages, state) == (2, False)
    assert tm.checkpoints.count()[1] == 1
    assert tm.match(NS, a, 0).match.node.parent is None
    tm.check_invariants()
    tm.close()


def test_a_pool_that_lends_state_slots_keeps_device_copies_and_restores_from_them(tmp_path):
    engine = StateEngine(checkpoint_slots=2)
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    try:
        tm = make_tm(engine, storage=store, host_checkpoints=1)
        prompts = [tokens(1000 * i, 2) for i in range(1, 4)]
        for label, toks in enumerate(prompts, 1):
            prefill(tm, engine, toks, [(2, label)])
            tm.flush()
        # Three checkpoints, two device slots (the first's device copy made room for the
        # third's), one host slot (the newest), all three on disk.
        assert tm.checkpoints.count() == (1, 3, 2)
        slots = tm.pools.get(0).checkpoint_slots
        assert slots.num_free == 0
        first, second, third = (tm.match(NS, toks, 0).match.node.checkpoint for toks in prompts)
        assert not first.device and set(second.device.values()) | set(third.device.values()) == {7, 8}
        # The second: from its device copy (slot to slot), whatever the host holds.
        tm.evict(Tier.HOST, 16)
        for label, toks in enumerate(prompts, 1):
            pages, state, _ = load_state(tm, engine, toks, slot=2)
            assert (pages, state) == (2, True) and engine.state_label(2, [1, 2, 3]) == label
        assert tm.checkpoints.restored == 3
        # Its engine gone, the pool's device copies go; the disk ones stay.
        tm.retire_pool(0)
        tm.flush()
        assert tm.checkpoints.count()[2] == 0
        tm.check_invariants()
        tm.close()
    finally:
        store.close()
        engine.close()


def test_without_a_disk_tier_a_device_copy_keeps_a_checkpoint_the_host_lets_go():
    lending = StateEngine(checkpoint_slots=2)
    try:
        tm = make_tm(lending, host_checkpoints=1)
        a, b = tokens(100, 2), tokens(500, 2)
        prefill(tm, lending, a, [(2, 51)])
        prefill(tm, lending, b, [(2, 52)])  # the host slot goes to b's: a's lives on the device
        assert tm.checkpoints.lost == 0 and tm.checkpoints.count() == (1, 0, 2)
        pages, state, _ = load_state(tm, lending, a, slot=2)
        assert (pages, state) == (2, True) and lending.state_label(2, [51, 52]) == 51
        tm.close()
    finally:
        lending.close()


def test_a_checkpoint_held_only_by_another_pools_device_is_no_state_and_evicts_nothing(engine):
    # a's checkpoint lives only in pool 0's device slot; c's only in the host slot. A
    # load into pool 1 (which cannot read pool 0's slots) that asks for a's state gets
    # none, and must not throw c's checkpoint out of the host to make room for a read
    # of a copy that is on no disk.
    lending = StateEngine(checkpoint_slots=2)
    try:
        tm = make_tm(lending, host_checkpoints=1)
        tm.register_pool(1, [engine.pool])
        a, b, c = tokens(100, 2), tokens(500, 2), tokens(900, 2)
        prefill(tm, lending, a, [(2, 51)])
        prefill(tm, lending, b, [(2, 52)])
        prefill(tm, engine, c, [(2, 53)], pool_id=1)
        node = tm.match(NS, a, 0).match.node
        cp_a, cp_c = node.checkpoint, tm.match(NS, c, 1).match.node.checkpoint
        assert cp_a.host < 0 and 1 not in cp_a.device and cp_c.host >= 0 and not cp_c.device
        tm.lock(node, 1)
        loaded = tm.wait(tm.load(node, 1, state_slot=2))
        tm.unlock(node, 1)
        assert loaded.state is False
        assert tm.checkpoints.lost == 0 and cp_c.host >= 0
        tm.check_invariants()
        pages, state, _ = load_state(tm, engine, c, slot=2, pool_id=1)
        assert (pages, state) == (2, True) and engine.state_label(2, [53]) == 53
        tm.close()
    finally:
        lending.close()


def test_a_checkpoint_record_the_store_evicts_ends_no_hit(engine, tmp_path):
    # A store with room for a few records: each new prompt's writes evict the oldest,
    # checkpoint records among them.
    store = LmdbBackend(tmp_path / "small", capacity_bytes=8 * SPEC.host_page_bytes)
    try:
        tm = make_tm(engine, storage=store, host_checkpoints=1)
        prompts = [tokens(1000 * i, 2) for i in range(1, 6)]
        for label, toks in enumerate(prompts, 1):
            prefill(tm, engine, toks, [(2, label)])
            tm.flush()
        buf = bytearray(tm.host_pool.state_slot_bytes)
        stored = [store.get([key], [buf], fingerprint=SPEC.fingerprint)[0] for key in tm.checkpoints.by_key]
        assert all(stored) and len(stored) < len(prompts)
        tm.check_invariants()
        # Those whose record went while on disk only are lost, and counted so.
        held = sum(1 for toks in prompts if tm.match(NS, toks, 0).match.node.parent is not None)
        assert held < len(prompts) and tm.checkpoints.lost == len(prompts) - held
        # Every hit brings its state: one whose checkpoint is gone is no hit.
        for label, toks in enumerate(prompts, 1):
            pages, state, _ = load_state(tm, engine, toks)
            assert (pages, state) in ((0, False), (2, True)), label
            if state:
                assert engine.state_label(1, [label]) == label
        tm.close()
    finally:
        store.close()


def _reference_offer(ckpts, host_order, device_order, free_host, free_device, num_offers):
    """What an offer of ``num_offers`` new checkpoints does to ``ckpts`` (the host and
    device copies of the pool's old checkpoints), one offer at a time: the host slot
    of the least recently used checkpoint no copy reads (one elsewhere too first) makes
    room, then the device slot of the least recently used one. Ties go to the earlier
    in ``host_order`` / ``device_order``. Returns (host, device, dropped) per old checkpoint."""
    state = {id(cp): {"host": cp.host >= 0, "device": bool(cp.device), "dropped": False} for cp in ckpts}
    eligible = [cp for cp in ckpts if not cp.pins and cp.ready]
    taken = 0
    for _ in range(num_offers):
        if not free_host:
            candidates = [cp for cp in eligible if state[id(cp)]["host"]]
            if not candidates:
                break
            victim = min(candidates, key=lambda cp: (not (cp.on_disk or state[id(cp)]["device"]),
                                                     cp.node.last_access, host_order.index(cp)))
            s = state[id(victim)]
            s["host"] = False
            if not (victim.on_disk or s["device"]):
                s["dropped"] = True
            free_host += 1
        free_host -= 1
        taken += 1
        if free_device:
            free_device -= 1
            continue
        candidates = [cp for cp in eligible if state[id(cp)]["device"]]
        if not candidates:
            continue
        victim = min(candidates, key=lambda cp: (cp.node.last_access, device_order.index(cp)))
        s = state[id(victim)]
        s["device"] = False
        if not (s["host"] or victim.on_disk):
            s["dropped"] = True
    return [(s["host"], s["device"], s["dropped"]) for s in state.values()], taken


@pytest.mark.parametrize("seed", range(40))
def test_an_offer_that_evicts_picks_the_victims_one_at_a_time_would(tmp_path, seed):
    # Full host and device checkpoint slots; old checkpoints pinned, unready, on disk or
    # not, with device copies or not, and last accesses that tie: the checkpoints an
    # offer evicts are those of the reference (least recently used first, one that is
    # elsewhere too before one that is not, never one pinned or not ready).
    rng = np.random.default_rng(seed)
    lending = StateEngine(checkpoint_slots=3)
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    try:
        tm = make_tm(lending, storage=store, host_checkpoints=6)
        for label in range(1, 7):
            prefill(tm, lending, tokens(1000 * label, 1), [(1, label)])
            tm.flush()
        cps = tm.checkpoints
        old = list(cps.on_host.values())
        assert len(old) == 6 and cps.alloc.num_free == 0
        base = max(cp.node.last_access for cp in old)  # (a node's last access only grows)
        for cp in old:
            cp.node.last_access = base + int(rng.integers(0, 3))
            if rng.random() < 0.4:
                cps.forget_keys([cp.key])  # (the store dropped its record)
        held = [cp for cp in old if rng.random() < 0.2]
        unready = [cp for cp in old if cp not in held and rng.random() < 0.15]
        for cp in held:
            cp.pins += 1
        for cp in unready:
            cp.ready = False
        num_offers = int(rng.integers(1, 5))
        want, want_taken = _reference_offer(old, list(cps.on_host.values()),
                                            [cp for cp in cps.on_device.values()],
                                            cps.alloc.num_free, tm.pools.get(0).checkpoint_slots.num_free, num_offers)
        lost_before = cps.lost
        toks = tokens(50_000, 4)
        hit = tm.match(NS, toks, 0).match
        pages = np.concatenate((hit.device_pages, tm.alloc(0, 4 - hit.num_device_pages)))
        lending.compute(NS, toks, pages)
        node = tm.insert(NS, toks, 0, pages).node
        for slot in range(1, num_offers + 1):
            lending.set_state(slot, 100 + slot)
        taken = tm.wait(tm.checkpoint(node, 0, [(i, i) for i in range(1, num_offers + 1)]))
        assert taken == want_taken
        got = [(cp.host >= 0, bool(cp.device), cp.dead) for cp in old]
        assert got == want, (seed, got, want)
        assert cps.lost - lost_before == sum(dropped for _, _, dropped in want)
        for cp in held:
            cp.pins -= 1
        for cp in unready:
            cp.ready = True
        tm.flush()
        tm.check_invariants()
        tm.close()
    finally:
        store.close()
        lending.close()


class _CountingDict(dict):
    """A dict that counts the entries its iterations hand out."""

    examined = 0

    def _count(self, it):
        for item in it:
            type(self).examined += 1
            yield item

    def __iter__(self):
        return self._count(super().__iter__())

    def values(self):
        return self._count(super().values())

    def items(self):
        return self._count(super().items())


def test_an_offer_that_evicts_many_checkpoints_looks_at_each_old_one_about_once(monkeypatch):
    # A hostile insert offers as many checkpoints as fit: evicting one host copy and one
    # device copy for each must not rescan every checkpoint per victim (seconds of the
    # owner thread at thousands of slots).
    n = 24
    lending = StateEngine(num_pages=2 * n + 4, checkpoint_slots=n)
    try:
        tm = make_tm(lending, host_checkpoints=n)
        nodes = []
        for start in (100, 100_000):
            toks = tokens(start, n)
            pages = tm.alloc(0, n)
            lending.compute(NS, toks, pages)
            nodes.append(tm.insert(NS, toks, 0, pages).node)
        lending.set_state(1, 1)
        assert tm.wait(tm.checkpoint(nodes[0], 0, [(i, 1) for i in range(1, n + 1)])) == n
        cps = tm.checkpoints
        assert cps.count() == (n, 0, n)
        counted = type("Counting", (_CountingDict,), {"examined": 0})
        cps.on_host = counted(cps.on_host)
        cps.on_device = counted(cps.on_device)
        future = tm.checkpoint(nodes[1], 0, [(i, 1) for i in range(1, n + 1)])
        examined = counted.examined
        assert tm.wait(future) == n
        assert cps.lost == n
        assert examined <= 4 * n, examined  # (a rescan per victim: about 2 * n * n)
        cps.on_host, cps.on_device = dict(cps.on_host), dict(cps.on_device)
        tm.check_invariants()
        tm.close()
    finally:
        lending.close()


def test_an_offer_pins_its_path_once_not_once_per_checkpoint(engine, monkeypatch):
    # The checkpoints of one insert lie on one path: pinning each holder walks the path
    # again from each one (quadratic in the checkpoints), where one pin of the deepest
    # holds them all.
    n = 16
    tm = make_tm(engine)
    toks = tokens(100, n)
    pages = tm.alloc(0, n)
    engine.compute(NS, toks, pages)
    node = tm.insert(NS, toks, 0, pages).node
    walked = {"pin": 0, "unpin": 0}
    tree = tm.tree
    for name in walked:
        original = getattr(tree, name)

        def counting(node, original=original, name=name):
            walked[name] += len(tree.path(node))
            return original(node)

        monkeypatch.setattr(tree, name, counting)
    assert tm.wait(tm.checkpoint(node, 0, [(i, 1) for i in range(1, n + 1)])) == n
    assert walked["pin"] == walked["unpin"] <= n, walked  # (one pin per holder: n * (n + 1) / 2)
    tm.check_invariants()
    tm.close()
