"""Sliding-window layers in the tier manager: SWA bytes outside a node's window are
neither backed up nor written to disk, a hit ends where its window's SWA bytes are,
and a restart finds which records have them."""

import numpy as np

import hicache.tiers.manager as manager_module
from hicache.errors import InvalidArgument
import pytest

from hicache.keys import namespace_id, page_keys
from hicache.spec import KVSpec, MHALayer
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierConfig, TierManager
from hicache.tree import DISK_SLOT, HOST_SLOT, Place, Tier, swa_first
from tiers_util import Engine, ManualWorkers, expected_page

WINDOW = 9  # tokens: the token after n pages reads back to page n - 2 (page size 4)
SPEC = KVSpec(page_size=4, model="windows-test", layers=(
    MHALayer(num_kv_heads=2, head_dim=8, sliding_window=WINDOW),
    MHALayer(num_kv_heads=1, head_dim=8),
    MHALayer(num_kv_heads=2, head_dim=4, dtype="float32", sliding_window=WINDOW)))
FULL = KVSpec(page_size=4, model="windows-test", layers=tuple(
    MHALayer(num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, dtype=layer.dtype) for layer in SPEC.layers))
NS = namespace_id(SPEC.fingerprint, "windows")
PS = SPEC.page_size
W = SPEC.window_pages


def test_the_spec_knows_its_window_and_puts_swa_segments_last():
    assert W == 2 and SPEC.swa_window == WINDOW and FULL.window_pages == 0
    layout = SPEC.host_page_layout()
    assert [s.layer for s in layout] == [1, 1, 0, 0, 2, 2]
    assert SPEC.kept_page_bytes == layout[2].offset == PS * 1 * 8 * 2 * 2
    assert FULL.kept_page_bytes == FULL.host_page_bytes
    assert [s.layer for s in FULL.host_page_layout()] == [0, 0, 1, 1, 2, 2]


@pytest.fixture
def engine():
    e = Engine(num_pages=32, spec=SPEC)
    yield e
    e.close()


def make_tm(engine, *, storage=None, host_pages=32, **config):
    tm = TierManager(SPEC, host_pages=host_pages, storage=storage, config=TierConfig(**config))
    tm.add_namespace(NS)
    tm.register_pool(0, [engine.pool])
    return tm


def tokens(start, pages):
    return list(range(start, start + pages * PS))


def prefill(tm, engine, toks):
    hit = tm.match(NS, toks, 0).match
    new = tm.alloc(0, len(toks) // PS - hit.num_device_pages)
    pages = np.concatenate((hit.device_pages, new))
    engine.compute(NS, toks, pages)
    result = tm.insert(NS, toks, 0, pages)
    tm.flush()
    tm.check_invariants()
    return result


def host_bytes(tm, page):
    return tm.host_pool.page(int(page)).numpy().tobytes()


def check_host_copy(tm, node, keys):
    """The host copy holds every page's full-attention bytes, and SWA bytes exactly for
    the pages the tree says it does."""
    kept = SPEC.kept_page_bytes
    first = swa_first(node, HOST_SLOT)
    for i, (key, page) in enumerate(zip(keys, node.host_pages)):
        want = reordered(key)
        got = host_bytes(tm, page)
        assert got[:kept] == want[:kept], i
        if i >= first:
            assert got == want, i


def reordered(key):
    """A page's bytes in host-page order (the engine writes them in layer order)."""
    data = expected_page(key, SPEC)
    by_layer = {}
    offset = 0
    for layer in range(SPEC.num_layers):
        by_layer[layer] = data[offset : offset + SPEC.page_bytes(layer)]
        offset += SPEC.page_bytes(layer)
    order = sorted(range(SPEC.num_layers), key=lambda i: (SPEC.is_swa(i), i))
    return b"".join(by_layer[i] for i in order)


def test_a_backup_copies_swa_bytes_of_the_window_only(engine):
    tm = make_tm(engine)
    toks = tokens(100, 7)
    node = prefill(tm, engine, toks).node
    assert swa_first(node, HOST_SLOT) == 7 - W
    check_host_copy(tm, node, page_keys(NS, toks, PS))
    dead = SPEC.host_page_bytes - SPEC.kept_page_bytes
    assert tm._core.moved["d2h"] == 7 * SPEC.host_page_bytes - (7 - W) * dead
    # A longer prompt below it: its own node's window, nothing more of the parent.
    child = prefill(tm, engine, toks + tokens(900, 3)).node
    assert swa_first(child, HOST_SLOT) == 3 - W and swa_first(node, HOST_SLOT) == 7 - W
    tm.close()


def test_a_hit_ends_where_its_window_has_swa_bytes(engine):
    tm = make_tm(engine)
    toks = tokens(200, 7)
    prefill(tm, engine, toks)
    # On the device (whole pages): any page boundary ends a hit.
    assert tm.match(NS, toks[: 4 * PS], 0).match.num_pages == 4
    tm.evict(Tier.DEVICE, 32, 0)
    tm.check_invariants()
    # From host: the node's end keeps its window; an end cut inside the node (a branch
    # found later) has lost its window's SWA bytes: the hit falls back to nothing.
    assert tm.match(NS, toks, 0).match.num_pages == 7
    assert tm.match(NS, toks[: 4 * PS] + tokens(700, 2), 0).match.node.parent is None
    # A node end whose window reaches into its parent: the parent's last pages serve.
    prefill(tm, engine, toks + tokens(800, 1))
    tm.evict(Tier.DEVICE, 32, 0)
    assert tm.match(NS, toks + tokens(800, 1), 0).match.num_pages == 8
    tm.check_invariants()
    tm.close()


def load_from_a_window_cut_host_copy(tm, engine, toks):
    """Prefill ``toks``, evict its device pages (the host copy keeps the last window's
    SWA bytes only), then match, lock and load it back: the hit and the load, landed."""
    prefill(tm, engine, toks)
    tm.evict(Tier.DEVICE, 32, 0)
    hit = tm.match(NS, toks, 0).match
    tm.lock(hit.node, 0)
    loaded = tm.wait(tm.load(hit.node, 0))
    engine.wait(tm.pools.get(0).counters, loaded.wait)
    return hit, loaded


def test_loads_from_a_window_cut_host_copy_give_the_window_its_bytes(engine):
    tm = make_tm(engine)
    toks = tokens(300, 6)
    hit, loaded = load_from_a_window_cut_host_copy(tm, engine, toks)
    keys = page_keys(NS, toks, PS)
    for i in range(6 - W, 6):  # the window: every layer, every byte
        assert engine.read(int(loaded.device_pages[i])) == expected_page(keys[i], SPEC)
    assert swa_first(hit.node, 0) == 6 - W
    tm.unlock(hit.node, 0)
    tm.check_invariants()
    tm.close()


def test_disk_records_outside_the_window_are_shorter_and_a_restart_knows_them(engine, tmp_path):
    path = tmp_path / "lmdb"
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    a = tokens(400, 6)
    b = a[: 3 * PS] + tokens(600, 4)  # branches off a after page 3 (a device hit: whole pages)
    prefill(tm, engine, a)
    prefill(tm, engine, b)
    keys_a, keys_b = page_keys(NS, a, PS), page_keys(NS, b, PS)
    sizes = {}
    for key in keys_a + keys_b:
        meta = next(m for k, m in store.iter_metadata() if k == key)
        sizes[key] = meta.payload_size
    # Each node's last W pages whole: a's first node (3 pages, cut by b's insert after
    # its backup: its window's records rewritten whole from the device copy), a's second
    # and b's.
    full, kept = SPEC.host_page_bytes, SPEC.kept_page_bytes
    assert [sizes[k] for k in keys_a] == [kept, full, full, kept, full, full]
    assert [sizes[k] for k in keys_b[3:]] == [kept, kept, full, full]
    stored = tm._core.moved["host_to_disk"]
    assert stored == 6 * kept + 4 * full + 2 * full  # (the rewrite of the two)
    tm.close()
    store.close()
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    assert tm.rebuild_from_storage() == 10
    tm.check_invariants()
    assert tm.match(NS, a, 0).match.num_pages == 6
    assert tm.match(NS, b, 0).match.num_pages == 7
    assert tm.match(NS, a[: 3 * PS] + tokens(999, 1), 0).match.num_pages == 3  # (the branch point)
    assert tm.match(NS, a[: 2 * PS] + tokens(999, 1), 0).match.node.parent is None  # (no window there)
    for toks in (a, b):
        hit = tm.match(NS, toks, 0).match
        tm.lock(hit.node, 0)
        loaded = tm.wait(tm.load(hit.node, 0))
        engine.wait(tm.pools.get(0).counters, loaded.wait)
        keys = page_keys(NS, toks, PS)
        n = len(keys)
        for i in range(n - W, n):
            assert engine.read(int(loaded.device_pages[i])) == expected_page(keys[i], SPEC)
        tm.unlock(hit.node, 0)
    for node in tm.tree.nodes():
        if node.host_pages is not None:
            assert swa_first(node, HOST_SLOT) == swa_first(node, DISK_SLOT)
    tm.check_invariants()
    tm.close()
    store.close()


def test_a_restart_cuts_a_run_of_swa_pages_longer_than_the_window(engine, tmp_path):
    """A child shorter than the window joins its parent's SWA run into one restored
    node: it is cut so that no node holds SWA bytes outside its window, and both old
    ends still serve hits (the hypothesis machine found this)."""
    path = tmp_path / "lmdb"
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    parent = tokens(100, 4)
    prefill(tm, engine, parent)
    prefill(tm, engine, parent + tokens(900, 1))
    tm.close()
    store.close()
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    assert tm.rebuild_from_storage() == 5
    tm.check_invariants()  # (the window's invariant included)
    assert [n.num_pages for n in tm.tree.path(tm.match(NS, parent + tokens(900, 1), 0).match.node)] == [3, 2]
    assert tm.match(NS, parent + tokens(900, 1), 0).match.num_pages == 5
    tm.close()
    store.close()


def test_a_restart_into_a_smaller_disk_tier_evicts_down_to_its_page_capacity(engine, tmp_path):
    """Records outside a window are shorter, so a store whose capacity shrank across a
    restart can keep more of them than the tier's pages (its bytes over a whole page's)
    allow. The rebuild evicts the least recently used down to that capacity, as a write
    would have: the account never says more disk pages than the tier has, and the store
    keeps exactly the records the tree restored."""
    path = tmp_path / "lmdb"
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    prefill(tm, engine, tokens(400, 10))
    tm.close()
    store.close()
    store = LmdbBackend(path, capacity_bytes=(10 - W) * SPEC.kept_page_bytes + W * SPEC.host_page_bytes)
    try:
        tm = make_tm(engine, storage=store)
        assert store.stats().records == 10 > tm.disk.capacity_pages
        tm.rebuild_from_storage()
        disk = tm.accounting()[Place(Tier.DISK)]
        assert tm.tree.sizes(Tier.DISK).cached <= tm.disk.capacity_pages and disk.free >= 0
        tm.flush()
        assert store.stats().records == tm.tree.sizes(Tier.DISK).cached
        tm.check_invariants()
        tm.close()
    finally:
        store.close()


def test_a_branch_found_while_on_device_keeps_its_window_on_host_and_disk(engine, tmp_path):
    """Two prompts sharing a prefix: the second splits the first's node after its backup
    and disk write. The new end's window gets its SWA bytes from the device copy (host
    copy topped up, records rewritten whole), so the shared prefix stays a hit from host,
    from disk and after a restart."""
    path = tmp_path / "lmdb"
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    shared = tokens(100, 5)
    first = shared + tokens(500, 3)
    prefill(tm, engine, first)
    node = tm.match(NS, first, 0).match.node
    assert swa_first(node, HOST_SLOT) == 8 - W and swa_first(node, DISK_SLOT) == 8 - W
    prefill(tm, engine, shared + tokens(700, 2))  # splits after page 5: a top-up follows
    upper = tm.match(NS, shared, 0).match.node
    assert upper.num_pages == 5
    assert swa_first(upper, HOST_SLOT) == 5 - W and swa_first(upper, DISK_SLOT) == 5 - W
    keys = page_keys(NS, shared, PS)
    check_host_copy(tm, upper, keys)
    sizes = {k: m.payload_size for k, m in store.iter_metadata()}
    assert [sizes[k] for k in keys] == [SPEC.kept_page_bytes] * (5 - W) + [SPEC.host_page_bytes] * W
    tm.evict(Tier.DEVICE, 32, 0)
    assert tm.match(NS, shared + tokens(900, 1), 0).match.num_pages == 5  # from host
    tm.evict(Tier.HOST, 32)
    tm.flush()
    assert tm.match(NS, shared + tokens(900, 1), 0).match.num_pages == 5  # from disk
    tm.check_invariants()
    tm.close()
    store.close()
    store = LmdbBackend(path, capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    tm.rebuild_from_storage()
    tm.check_invariants()
    assert tm.match(NS, shared + tokens(900, 1), 0).match.num_pages == 5  # after a restart
    hit = tm.match(NS, shared, 0).match
    tm.lock(hit.node, 0)
    loaded = tm.wait(tm.load(hit.node, 0))
    engine.wait(tm.pools.get(0).counters, loaded.wait)
    for i in range(5 - W, 5):
        assert engine.read(int(loaded.device_pages[i])) == expected_page(keys[i], SPEC)
    tm.unlock(hit.node, 0)
    tm.close()
    store.close()


def test_ends_an_engine_offers_keep_their_windows_for_branches_found_later(engine):
    tm = make_tm(engine)
    system = tokens(100, 4)
    first = system + tokens(500, 5)
    hit = tm.match(NS, first, 0).match
    pages = tm.alloc(0, 9)
    engine.compute(NS, first, pages)
    for bad in ([0], [10], [4, 4], [5, 2], ["4"], [4.0]):
        with pytest.raises(InvalidArgument):
            tm.insert(NS, first, 0, pages, ends=bad)
    assert hit.node.parent is None and tm.num_private(0) == 9  # (refused before anything changed)
    tm.insert(NS, first, 0, pages, ends=[4])
    tm.flush()
    upper = tm.match(NS, system, 0).match.node
    assert upper.num_pages == 4 and swa_first(upper, HOST_SLOT) == 4 - W
    tm.evict(Tier.DEVICE, 32, 0)
    # A branch at the system prompt's end, found once the pages left the device: a hit.
    assert tm.match(NS, system + tokens(900, 2), 0).match.num_pages == 4
    tm.check_invariants()
    tm.close()


@pytest.mark.parametrize("reading", [False, True])
def test_an_insert_whose_window_the_pool_caches_without_swa_bytes_hands_out_whole_pages(engine, reading):
    """A device copy loaded from a window-cut host copy lacks the SWA bytes of its pages
    before the node's window. A prompt that ends inside that node (a branch found from
    host) is no hit there, so the engine computes it; its insert must not swap its
    whole pages for the cached ones: the engine goes on reading the insert's window
    through the canonical pages (req_to_token), and the next such prompt must hit.
    ``reading``: a request still holds the whole node (its lock) meanwhile: the pages
    it reads stay allocated until it unlocks."""
    tm = make_tm(engine)
    toks = tokens(600, 6)
    keys = page_keys(NS, toks, PS)
    hit, loaded = load_from_a_window_cut_host_copy(tm, engine, toks)
    if not reading:
        tm.unlock(hit.node, 0)
    tm.flush()  # (the load is over)
    assert swa_first(hit.node, 0) == 6 - W  # (the pages before the window: no SWA bytes)
    branch = toks[: 4 * PS]
    assert tm.match(NS, branch + tokens(900, 1), 0).match.node.parent is None
    pages = tm.alloc(0, 4)
    engine.compute(NS, branch, pages)
    result = tm.insert(NS, branch, 0, pages)
    for i in range(4 - W, 4):  # the engine's window after the insert: every byte
        assert engine.read(int(result.device_pages[i])) == expected_page(keys[i], SPEC), i
    allocator = tm.pools.get(0).allocator
    free = allocator.num_free
    if reading:  # the reader's pages are none of the free ones, and none of the insert's
        tm.flush()
        assert allocator.num_free == free
        assert not set(loaded.device_pages[:4].tolist()) & set(result.device_pages.tolist())
        tm.check_invariants()
        tm.unlock(hit.node, 0)
        tm.poll()  # (the owner loop's next turn)
    tm.flush()
    tm.check_invariants()
    assert allocator.num_free == free + (4 if reading else 0)
    again = tm.match(NS, branch + tokens(900, 1), 0).match
    assert again.num_pages == 4 and again.num_device_pages == 4
    assert list(again.device_pages) == list(result.device_pages)
    tm.close()


def test_a_load_cut_short_for_device_room_ends_where_a_window_has_its_bytes(engine):
    tm = make_tm(engine)
    toks = tokens(500, 6)
    prefill(tm, engine, toks)
    tm.evict(Tier.DEVICE, 32, 0)
    # A branch after page 3, found from host: the node is cut there, and that end has no
    # SWA bytes in its window on host (no hit ends there).
    assert tm.match(NS, toks[: 3 * PS] + tokens(900, 2), 0).match.node.parent is None
    hit = tm.match(NS, toks, 0).match
    assert hit.num_pages == 6 and [n.num_pages for n in tm.tree.path(hit.node)] == [3, 3]
    tm.lock(hit.node, 0)
    # The pool's room shrank after the match: the load takes what fits (3 pages).
    held = tm.alloc(0, tm.pools.get(0).allocator.num_free - 3)
    loaded = tm.wait(tm.load(hit.node, 0))
    engine.wait(tm.pools.get(0).counters, loaded.wait)
    # What it hands out is a hit: its window has every byte.
    n = len(loaded.device_pages)
    keys = page_keys(NS, toks, PS)
    for i in range(max(0, n - W), n):
        assert engine.read(int(loaded.device_pages[i])) == expected_page(keys[i], SPEC), (n, i)
    tm.unlock(hit.node, 0)
    tm.release(0, held)
    tm.flush()
    tm.check_invariants()
    tm.close()


def test_a_load_into_cut_short_by_a_lost_record_ends_where_a_window_has_its_bytes(tmp_path):
    """The same for an engine-owned pool's ``load_into``: what it says it loaded is a hit."""
    import torch

    from hicache.foreign import ForeignPool
    from owned_util import layer_major

    spec = KVSpec(page_size=4, model="windows-owned", layout="test/opaque-blocks", layers=(
        MHALayer(num_kv_heads=2, head_dim=8, sliding_window=WINDOW), MHALayer(num_kv_heads=2, head_dim=8)))
    layout = layer_major(16, spec)
    buffers = [torch.zeros(a.size, dtype=torch.uint8) for a in layout.allocations]
    bb = layout.block_bytes

    def block(layer, i):
        a, j = layout.where[layer]
        start = layout.allocations[a].layer_offset(j) + i * layout.allocations[a].block_stride
        return buffers[a].numpy()[start : start + bb]

    rng = np.random.default_rng(5)
    for i in range(1, 7):
        for layer in range(2):
            block(layer, i)[:] = rng.integers(0, 256, bb, dtype=np.uint8)
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * spec.host_page_bytes)
    tm = TierManager(spec, host_pages=16, storage=store, config=TierConfig(prefetch_min_pages=1000))
    try:
        ns = namespace_id(spec.fingerprint, "owned")
        tm.add_namespace(ns)
        tm.register_owned_pool(0, ForeignPool(layout, buffers, [None] * len(buffers)))
        toks = tokens(100, 6)
        assert tm.wait(tm.store(ns, toks, 0, [1, 2, 3, 4, 5, 6])).num_cached == 6
        tm.flush()
        # A branch after page 3, found later: that end has no window on host or disk.
        assert tm.match(ns, toks[: 3 * PS] + tokens(900, 2), 0).match.node.parent is None
        tm.evict(Tier.HOST, 16)
        tm.flush()
        hit = tm.match(ns, toks, 0).match
        assert hit.num_disk_pages == 6 and [n.num_pages for n in tm.tree.path(hit.node)] == [3, 3]
        store.delete(hit.node.page_key_list()).result()  # the last node's records are lost
        tm.lock(hit.node, 0)
        loaded = tm.wait(tm.load_into(hit.node, 0, [7, 8, 9, 10, 11, 12]))
        tm.flush()
        n = loaded.num_loaded
        for i in range(max(0, n - W), n):  # the window of what it loaded: the SWA layer's bytes too
            assert (block(0, 7 + i) == block(0, 1 + i)).all(), (n, i)
        tm.unlock(hit.node, 0)
        tm.check_invariants()
    finally:
        tm.close()
        store.close()


def test_top_ups_for_many_new_ends_on_one_path_lock_and_pin_it_once(engine, tmp_path, monkeypatch):
    # An insert with an end after every page of a node already backed up and written:
    # every new end's window is topped up from the device and its records rewritten.
    # Each top-up locking (and each rewrite pinning) its own node walks the path again
    # from each end: quadratic in the ends of one insert, seconds at thousands.
    n = 12
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    toks = tokens(100, n)
    prefill(tm, engine, toks)
    tree = tm.tree
    walked = {"lock": 0, "unlock": 0, "pin": 0, "unpin": 0}
    for name in walked:
        original = getattr(tree, name)

        def counting(node, *args, original=original, name=name):
            walked[name] += len(tree.path(node))
            return original(node, *args)

        monkeypatch.setattr(tree, name, counting)
    hit = tm.match(NS, toks, 0).match
    tm.insert(NS, toks, 0, hit.device_pages, ends=list(range(1, n + 1)))
    tm.flush()
    monkeypatch.undo()
    assert tm.windows.topped_up == n - W  # (the last W pages had theirs)
    keys = page_keys(NS, toks, PS)
    path = tree.path(tm.match(NS, toks, 0).match.node)
    assert [node.num_pages for node in path] == [1] * n
    for i, node in enumerate(path):
        assert swa_first(node, HOST_SLOT) == 0 and swa_first(node, DISK_SLOT) == 0, i
        check_host_copy(tm, node, keys[i : i + 1])
    sizes = {k: m.payload_size for k, m in store.iter_metadata()}
    assert [sizes[k] for k in keys] == [SPEC.host_page_bytes] * n
    assert walked["lock"] == walked["unlock"] and walked["pin"] == walked["unpin"]
    assert walked["lock"] <= 2 * n and walked["pin"] <= 2 * n, walked  # (one per end: n * (n - 1) / 2 each)
    tm.check_invariants()
    tm.close()
    store.close()


def manual_step(tm, name="copy", **kwargs):
    """Run one queued job of :class:`ManualWorkers`, then its completion."""
    tm.workers.run(name, **kwargs)
    tm.poll()
    tm.check_invariants()


def test_a_failed_load_frees_no_page_that_a_top_up_still_reads(engine, monkeypatch):
    """A top-up copies a new end's window from the device copy to host. A load above
    that node that fails drops the node's device copy with its own: the pages the
    top-up still reads must not go to another request before it has read them — the
    host copy would take that request's bytes for the window's, and serve them."""
    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    tm = make_tm(engine, host_pages=64)  # (room for everything: nothing leaves host)
    workers = tm.workers
    a, n = tokens(100, 3), tokens(500, 4)
    for toks in (a, a + n):  # two nodes, backed up, then on host only
        hit = tm.match(NS, toks, 0).match
        new = tm.alloc(0, len(toks) // PS - hit.num_device_pages)
        pages = np.concatenate((hit.device_pages, new))
        engine.compute(NS, toks, pages)
        tm.insert(NS, toks, 0, pages)
        manual_step(tm)  # the write-through backup
    tm.evict(Tier.DEVICE, 32, 0)
    tm.check_invariants()
    # A load of the first node; meanwhile the engine computes the second one again and
    # inserts it with a new end after its first page: that end's window needs a top-up.
    upper_a = tm.match(NS, a, 0).match.node
    tm.lock(upper_a, 0)
    tm.load(upper_a, 0).result()
    new = tm.alloc(0, 4)
    keys = page_keys(NS, a + n, PS)
    for key, page in zip(keys[3:], new):
        engine.write(int(page), key)
    tm.insert(NS, a + n, 0, np.concatenate((tm.match(NS, a, 0).match.device_pages, new)), ends=[4])
    tm.poll()  # the top-up starts (queued behind the load's copy)
    end = tm.match(NS, a + n[:PS], 0).match.node
    assert end.num_pages == 1 and workers.queues["copy"] and tm.windows.busy == 1
    manual_step(tm, fail=True, movers=tm.pools.get(0).movers)  # the load's copies fail
    assert end.device_pages(0) is None
    # Another request takes every free page while the top-up's copy is still queued.
    other = tokens(900, tm.pools.get(0).allocator.num_free)
    pages = tm.alloc(0, len(other) // PS)
    engine.compute(NS, other, pages)
    tm.insert(NS, other, 0, pages)
    while workers.jobs:
        manual_step(tm)
    check_host_copy(tm, end, keys[3:4])
    tm.unlock(upper_a, 0)
    tm.check_invariants()
    tm.close()


def test_a_pool_is_not_reaped_while_a_top_up_reads_it(engine, monkeypatch):
    """The engine goes while a top-up's copy from its pool is queued: the pool (its
    memory, the top-up's lock in it) stays until the copy is done."""
    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    tm = make_tm(engine)
    toks = tokens(100, 6)
    pages = tm.alloc(0, 6)
    engine.compute(NS, toks, pages)
    tm.insert(NS, toks, 0, pages)
    manual_step(tm)  # the write-through backup
    tm.insert(NS, toks, 0, tm.match(NS, toks, 0).match.device_pages, ends=[3])
    tm.poll()
    assert tm.windows.busy == 1
    tm.retire_pool(0)
    tm.check_invariants()
    while tm.workers.jobs:
        manual_step(tm)
    tm.check_invariants()
    assert tm.pools.any_retired() is False
    tm.close()


def run_all(tm):
    """Every queued job of :class:`ManualWorkers` and what follows, in order."""
    while tm.workers.jobs or not tm.idle():
        for name in ("copy", "io", "write"):
            if tm.workers.queues[name]:
                manual_step(tm, name)
        tm.poll()


def test_splits_while_a_top_up_and_a_rewrite_run_leave_each_end_its_window(engine, tmp_path, monkeypatch):
    """New ends cut a node while the top-up of its window is queued, and again while the
    rewrite of its records is: each part records only the SWA bytes it got (host and
    disk), every end keeps serving hits from host and from disk, and the records the
    tree says are whole are."""
    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    workers = tm.workers
    toks = tokens(100, 8)
    pages = tm.alloc(0, 8)
    engine.compute(NS, toks, pages)
    tm.insert(NS, toks, 0, pages)
    run_all(tm)  # the backup and the disk write: the window (pages 6, 7) whole

    def cut(end):
        tm.insert(NS, toks, 0, tm.match(NS, toks, 0).match.device_pages, ends=[end])
        tm.check_invariants()

    cut(5)
    tm.poll()  # the top-up of pages 3, 4 is queued
    assert len(workers.queues["copy"]) == 1 and tm.windows.busy == 1
    cut(4)  # cuts the node it tops up: page 4 is a node of its own now
    manual_step(tm, "copy")
    top, four = tm.tree.path(tm.match(NS, toks[: 5 * PS], 0).match.node)
    assert swa_first(four, HOST_SLOT) == 0 and swa_first(top, HOST_SLOT) == 3  # (what each got)
    tm.poll()  # the rewrite of page 4's record, another top-up of the first node's window
    while workers.queues["copy"]:
        manual_step(tm, "copy")
    assert workers.queues["write"]
    cut(3)  # cuts the first node while its records' rewrite is queued
    run_all(tm)
    keys = page_keys(NS, toks, PS)
    path = tm.tree.path(tm.match(NS, toks, 0).match.node)
    assert [n.num_pages for n in path] == [3, 1, 1, 3]
    sizes = {k: m.payload_size for k, m in store.iter_metadata()}
    start = 0
    for node in path:
        check_host_copy(tm, node, keys[start : start + node.num_pages])
        for i in range(swa_first(node, DISK_SLOT), node.num_pages):  # (the tree says whole: they are)
            assert sizes[keys[start + i]] == SPEC.host_page_bytes, (node, i)
        start += node.num_pages
    for tier in (Tier.DEVICE, Tier.HOST):
        tm.evict(tier, 64, 0 if tier == Tier.DEVICE else None)
        run_all(tm)
        for end in (3, 4, 5, 8):
            assert tm.match(NS, toks[: end * PS] + tokens(900, 1), 0).match.num_pages == end, (tier, end)
    hit = tm.match(NS, toks[: 4 * PS], 0).match
    tm.lock(hit.node, 0)
    loaded = tm.load(hit.node, 0)
    run_all(tm)
    loaded = loaded.result()
    run_all(tm)
    for i in range(4 - W, 4):
        assert engine.read(int(loaded.device_pages[i])) == expected_page(keys[i], SPEC)
    tm.unlock(hit.node, 0)
    tm.check_invariants()
    tm.close()
    store.close()


def test_a_rewrite_whose_records_the_store_dropped_meanwhile_leaves_none_behind(engine, tmp_path, monkeypatch):
    """The store drops a node's records on its own (it evicted them for another write)
    while the rewrite of the node's window is queued: what the rewrite writes then is
    no record the tree knows, and must not stay in the store."""
    monkeypatch.setattr(manager_module, "Workers", ManualWorkers)
    store = LmdbBackend(tmp_path / "lmdb", capacity_bytes=256 * SPEC.host_page_bytes)
    tm = make_tm(engine, storage=store)
    toks = tokens(100, 6)
    pages = tm.alloc(0, 6)
    engine.compute(NS, toks, pages)
    tm.insert(NS, toks, 0, pages)
    run_all(tm)
    tm.insert(NS, toks, 0, tm.match(NS, toks, 0).match.device_pages, ends=[3])
    tm.poll()
    manual_step(tm, "copy")  # the top-up; its node's rewrite is queued next
    assert tm.workers.queues["write"]
    upper = tm.match(NS, toks[: 3 * PS], 0).match.node
    keys = upper.page_key_list()
    store.delete(keys).result()
    tm.forget_disk_keys(keys)
    tm.check_invariants()
    run_all(tm)
    tm.flush()
    assert store.stats().records == tm.tree.sizes(Tier.DISK).cached
    tm.close()
    store.close()
