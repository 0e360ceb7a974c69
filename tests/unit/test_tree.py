import numpy as np
import pytest

from hicache.errors import InvalidArgument, LockUnderflow, ResidencyError, UnknownNamespace, UnknownNode
from hicache.eviction import EVICTION_POLICIES, eviction_policy
from hicache.keys import namespace_id, page_keys
from hicache.pages import PageAllocator
from hicache.tree import HiRadixTree, Tier
from tree_util import evict

NS = namespace_id(b"model-fp")
OTHER_NS = namespace_id(b"model-fp", "tenant-2")
PS = 4


def seq(*values, pages=None):
    """Tokens: the values given, or ``pages`` pages filled from values[0] upward."""
    if pages is not None:
        return list(range(values[0], values[0] + pages * PS))
    return list(values)


@pytest.fixture
def tree():
    t = HiRadixTree()
    t.add_namespace(NS, PS)
    t.add_namespace(OTHER_NS, PS)
    yield t
    t.check_invariants()


@pytest.fixture
def alloc():
    return PageAllocator.for_device(64)


def insert(tree, alloc, tokens, pool=0, ns=NS):
    pages = alloc.alloc(len(tokens) // PS)
    result = tree.insert(ns, tokens, pool, pages)
    alloc.free(result.duplicate_pages)
    return result


def test_insert_then_match_returns_the_same_pages(tree, alloc):
    tokens = seq(100, pages=5) + [1, 2]  # a partial last page is not cached
    result = insert(tree, alloc, tokens)
    assert len(result.device_pages) == 5 and result.num_prefix_pages == 0
    hit = tree.match(NS, tokens, 0)
    assert hit.device_pages.tolist() == result.device_pages.tolist()
    assert hit.num_tokens == 20 and hit.node is result.node
    assert hit.last_device_node is hit.last_host_node is hit.node
    assert not hit.device_pages.flags.writeable


def test_match_splits_a_node_when_it_ends_inside(tree, alloc):
    tokens = seq(100, pages=5)
    result = insert(tree, alloc, tokens)
    assert len(tree) == 1
    hit = tree.match(NS, tokens[:11], 0)  # 2 whole pages + 3 tokens
    assert hit.num_pages == 2 and len(tree) == 2
    assert hit.device_pages.tolist() == result.device_pages[:2].tolist()
    upper = hit.node
    assert upper.num_pages == 2 and result.node.num_pages == 3 and result.node.parent is upper
    # The lower half keeps its identity: the insert's handle still ends at page 5.
    assert b"".join(n.tokens for n in tree.path(result.node)) == np.asarray(tokens, "<i4").tobytes()
    assert b"".join(n.page_keys for n in tree.path(result.node)) == b"".join(page_keys(NS, tokens, PS))
    assert tree.match(NS, tokens, 0).node is result.node
    tree.check_invariants()


def test_match_splits_where_a_page_differs(tree, alloc):
    tokens = seq(100, pages=4)
    insert(tree, alloc, tokens)
    forked = tokens[:8] + [0, 0, 0, 0] + tokens[12:]
    hit = tree.match(NS, forked, 0)
    assert hit.num_pages == 2 and len(tree) == 2


def test_insert_returns_duplicates_of_pages_already_cached(tree, alloc):
    tokens = seq(100, pages=4)
    first = insert(tree, alloc, tokens)
    # A second request computed the same prefix privately, plus two new pages.
    longer = tokens + seq(500, pages=2)
    mine = alloc.alloc(6)
    second = tree.insert(NS, longer, 0, mine)
    assert second.duplicate_pages.tolist() == mine[:4].tolist()
    assert second.device_pages.tolist() == first.device_pages.tolist() + mine[4:].tolist()
    assert second.num_prefix_pages == 4
    alloc.free(second.duplicate_pages)
    # Reusing the matched canonical pages is not a duplicate.
    hit = tree.match(NS, longer, 0)
    third = tree.insert(NS, longer, 0, hit.device_pages)
    assert third.duplicate_pages.size == 0 and third.num_prefix_pages == 6
    # Mixed: canonical for some positions, private copies for others.
    mixed = np.concatenate((hit.device_pages[:3], alloc.alloc(3)))
    fourth = tree.insert(NS, longer, 0, mixed)
    assert fourth.duplicate_pages.tolist() == mixed[3:].tolist()
    alloc.free(fourth.duplicate_pages)
    assert alloc.num_allocated == tree.sizes(Tier.DEVICE, 0).cached == 6


def test_insert_adopts_pages_for_nodes_cached_elsewhere(tree, alloc):
    host = PageAllocator.for_host(16)
    tokens = seq(100, pages=3)
    first = insert(tree, alloc, tokens)
    tree.add_host(first.node, host.alloc(3))
    evicted = evict(tree, Tier.DEVICE, 3, 0)
    alloc.free(evicted.page_ids)
    hit = tree.match(NS, tokens, 0)
    assert hit.num_device_pages == 0 and hit.num_host_pages == 3
    again = insert(tree, alloc, tokens)
    assert again.duplicate_pages.size == 0 and again.num_prefix_pages == 0
    assert tree.match(NS, tokens, 0).device_pages.tolist() == again.device_pages.tolist()
    # Another pool gets its own copy; pool 0's stays.
    other = PageAllocator.for_device(16)
    third = insert(tree, other, tokens, pool=1)
    assert third.duplicate_pages.size == 0
    assert tree.match(NS, tokens, 1).device_pages.tolist() == third.device_pages.tolist()
    assert tree.match(NS, tokens, 0).device_pages.tolist() == again.device_pages.tolist()


def test_pools_share_host_and_disk_but_not_device_pages(tree, alloc):
    host = PageAllocator.for_host(16)
    tokens = seq(100, pages=3)
    result = insert(tree, alloc, tokens, pool=0)
    # Pool 1 cannot use pool 0's device pages...
    assert tree.match(NS, tokens, 1).num_pages == 0
    # ...but once they are backed up, engine B hits from host what engine A computed.
    tree.add_host(result.node, host.alloc(3))
    hit = tree.match(NS, tokens, 1)
    assert hit.num_device_pages == 0 and hit.num_host_pages == 3
    assert hit.last_device_node.is_root and hit.last_host_node is result.node


def test_match_reports_device_then_host_then_disk(tree, alloc):
    host = PageAllocator.for_host(16)
    a, b, c = seq(100, pages=2), seq(200, pages=3), seq(300, pages=1)
    node_a = insert(tree, alloc, a).node
    node_b = insert(tree, alloc, a + b).node
    node_c = insert(tree, alloc, a + b + c).node
    for node in (node_a, node_b):
        tree.add_host(node, host.alloc(node.num_pages))
    for node in (node_a, node_b, node_c):
        tree.pin(node)
        tree.unpin(node)
    tree.add_disk(node_a)
    tree.add_disk(node_b)
    tree.add_host(node_c, host.alloc(1))
    tree.add_disk(node_c)
    tree.drop(node_c, Tier.HOST)
    alloc.free(evict(tree, Tier.DEVICE, 4, 0).page_ids)  # c (1 page) then b (3 pages)
    hit = tree.match(NS, a + b + c, 0)
    assert (hit.num_device_pages, hit.num_host_pages, hit.num_disk_pages) == (2, 3, 1)
    assert hit.last_device_node is node_a and hit.last_host_node is node_b and hit.node is node_c


def test_eviction_never_touches_locked_paths(tree, alloc):
    shared = seq(100, pages=2)
    left = insert(tree, alloc, shared + seq(200, pages=2)).node
    right = insert(tree, alloc, shared + seq(300, pages=2)).node
    tree.lock(left, 0)
    assert tree.sizes(Tier.DEVICE, 0) == (2, 4)
    evicted = evict(tree, Tier.DEVICE, 100, 0)
    assert evicted.num_pages == 2  # only the right branch
    alloc.free(evicted.page_ids)
    assert tree.match(NS, shared + seq(200, pages=2), 0).num_pages == 4
    assert tree.match(NS, shared + seq(300, pages=2), 0).num_pages == 2
    assert not tree.is_live(right)
    tree.unlock(left, 0)
    assert tree.sizes(Tier.DEVICE, 0) == (4, 0)
    alloc.free(evict(tree, Tier.DEVICE, 100, 0).page_ids)
    assert len(tree) == 0 and alloc.num_allocated == 0


def test_locks_are_per_pool(tree, alloc):
    other = PageAllocator.for_device(16)
    tokens = seq(100, pages=2)
    node = insert(tree, alloc, tokens, pool=0).node
    insert(tree, other, tokens, pool=1)
    tree.lock(node, 0)
    evicted = evict(tree, Tier.DEVICE, 10, 1)
    assert evicted.num_pages == 2, "a lock in pool 0 does not protect pool 1's copy"
    other.free(evicted.page_ids)
    assert evict(tree, Tier.DEVICE, 10, 0).num_pages == 0
    tree.unlock(node, 0)


def test_locked_node_keeps_its_host_copy_and_disk_record(tree, alloc):
    host = PageAllocator.for_host(16)
    node = insert(tree, alloc, seq(100, pages=2)).node
    tree.add_host(node, host.alloc(2))
    tree.add_disk(node)
    tree.lock(node, 0)
    assert evict(tree, Tier.HOST, 10).num_pages == 0
    assert evict(tree, Tier.DISK, 10).num_pages == 0
    assert tree.sizes(Tier.HOST) == (0, 2) and tree.sizes(Tier.DISK) == (0, 2)
    with pytest.raises(ResidencyError):
        tree.drop(node, Tier.HOST)
    tree.unlock(node, 0)
    host.free(evict(tree, Tier.HOST, 10).page_ids)
    assert evict(tree, Tier.DISK, 10).page_keys() == page_keys(NS, seq(100, pages=2), PS)
    assert tree.is_live(node)  # still on the device


def test_evicting_device_pages_keeps_nodes_that_live_elsewhere(tree, alloc):
    tokens = seq(100, pages=3)
    node = insert(tree, alloc, tokens).node
    tree.add_disk(node)
    evicted = evict(tree, Tier.DEVICE, 3, 0)
    alloc.free(evicted.page_ids)
    assert tree.is_live(node) and not node.device_pools
    assert tree.match(NS, tokens, 0).num_disk_pages == 3


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_eviction_order(tree, alloc, policy):
    t = HiRadixTree(eviction=policy)
    t.add_namespace(NS, PS)
    nodes = {}
    for name, start, priority in (("a", 100, 2), ("b", 200, 0), ("c", 300, 1)):
        pages = alloc.alloc(1)
        nodes[name] = t.insert(NS, seq(start, pages=1), 0, pages, priority=priority).node
    # Access pattern: a is hit twice, then c once, then b once (b is most recent).
    for start in (100, 100, 300, 200):
        t.match(NS, seq(start, pages=1), 0)
    order = [n.node_id for n in t.iter_evictable(Tier.DEVICE, 0)]
    by_id = {n.node_id: k for k, n in nodes.items()}
    expected = {"lru": "acb", "lfu": "cba", "priority": "bca"}[policy]
    assert "".join(by_id[i] for i in order) == expected
    t.check_invariants()


def test_iter_evictable_reaches_parents_after_their_children(tree, alloc):
    parent = insert(tree, alloc, seq(100, pages=2)).node
    child = insert(tree, alloc, seq(100, pages=2) + seq(200, pages=1)).node
    seen = []
    for node in tree.iter_evictable(Tier.DEVICE, 0):
        seen.append(node)
        alloc.free(tree.drop(node, Tier.DEVICE, 0))
    assert seen == [child, parent] and len(tree) == 0


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_kept_eviction_order_is_always_the_policy_order(alloc, policy):
    """The order kept from one eviction to the next (entries pushed as nodes become
    leaves, left behind or re-positioned lazily) against a fresh sort of the leaves at
    every step: branches inserted, hits (keys grow), locks, host copies added and
    dropped, and evictions that skip nodes and stop early (the skipped and the last one
    keep their place)."""
    rng = np.random.default_rng(11)
    t = HiRadixTree(eviction=policy)
    t.add_namespace(NS, PS)
    key = eviction_policy(policy).key
    prefixes = [seq(1000 * i, pages=2) for i in range(4)]
    locked = []

    def check_order(slot, tier, pool):
        index = t._slots.get(slot)
        if index is None:
            return
        expected = sorted(index.leaves, key=lambda n: (key(n), n.node_id))
        assert list(t.iter_evictable(tier, pool)) == expected  # (nothing dropped: all leaves, once)
        assert list(t.iter_evictable(tier, pool)) == expected  # and the order survives the walk

    for step in range(300):
        op = rng.integers(7)
        if op <= 1:  # a branch under a random prefix
            toks = prefixes[rng.integers(4)] + seq(int(rng.integers(1, 10**6)), pages=int(rng.integers(1, 3)))
            hit = t.match(NS, toks, 0)
            new = alloc.alloc(len(toks) // PS - hit.num_device_pages)
            if new is not None:
                pages = np.concatenate((hit.device_pages, new))
                alloc.free(t.insert(NS, toks, 0, pages, priority=int(rng.integers(3))).duplicate_pages)
        elif op == 2 and len(t):  # a hit on an existing path
            node = rng.choice(sorted(t.nodes(), key=lambda n: n.node_id))
            t.match(NS, [tok for n in t.path(node) for tok in np.frombuffer(n.tokens, np.int32).tolist()]
                    if all(n.tokens for n in t.path(node)) else [], 0)
        elif op == 3 and len(t):  # lock or unlock
            if locked and rng.random() < 0.5:
                t.unlock(locked.pop(), 0)
            else:
                node = rng.choice(sorted(t.nodes(), key=lambda n: n.node_id))
                t.lock(node, 0)
                locked.append(node)
        elif op == 4 and len(t):  # host copies along a path
            node = rng.choice(sorted(t.nodes(), key=lambda n: n.node_id))
            for n in t.path(node):
                if n.host_pages is None:
                    t.add_host(n, np.arange(n.num_pages, dtype=np.int32) + 100 * n.node_id)
        else:  # an eviction from device or host that skips every other node and stops early
            tier, pool = (Tier.DEVICE, 0) if op == 5 else (Tier.HOST, None)
            slot = 0 if op == 5 else -1
            index = t._slots.get(slot)
            yielded = set()
            budget = int(rng.integers(1, 6))
            for i, node in enumerate(t.iter_evictable(tier, pool)):
                rest = [n for n in index.leaves if n.node_id not in yielded]
                assert node is min(rest, key=lambda n: (key(n), n.node_id))
                yielded.add(node.node_id)
                if i % 2 == 0 and (tier == Tier.HOST or len(node.residency) > 1):
                    dropped = t.drop(node, tier, pool)
                    if tier == Tier.DEVICE:
                        alloc.free(dropped)
                    budget -= 1
                if budget <= 0:
                    break
        t.check_invariants()
        check_order(0, Tier.DEVICE, 0)
        check_order(-1, Tier.HOST, None)


def test_namespace_isolation(tree, alloc):
    tokens = seq(100, pages=3)
    a = insert(tree, alloc, tokens, ns=NS)
    assert tree.match(OTHER_NS, tokens, 0).num_pages == 0
    b = insert(tree, alloc, tokens, ns=OTHER_NS)
    assert b.duplicate_pages.size == 0 and b.num_prefix_pages == 0
    assert set(a.device_pages.tolist()).isdisjoint(b.device_pages.tolist())
    assert a.node.page_keys != b.node.page_keys
    assert a.node.page_key_list() == page_keys(NS, tokens, PS)
    assert b.node.page_key_list() == page_keys(OTHER_NS, tokens, PS)


def test_unknown_namespace(tree, alloc):
    stranger = namespace_id(b"never-registered")
    miss = tree.match(stranger, seq(1, pages=2), 0)
    assert miss.node is None and miss.num_pages == 0
    with pytest.raises(UnknownNamespace):
        tree.insert(stranger, seq(1, pages=1), 0, [1])
    with pytest.raises(InvalidArgument):
        tree.add_namespace(NS, PS + 1)
    assert tree.add_namespace(NS, PS) is tree.root(NS)


def test_page_keys_survive_splits(tree, alloc):
    tokens = seq(100, pages=6)
    insert(tree, alloc, tokens)
    tree.match(NS, tokens[:8], 0)
    tree.match(NS, tokens[:17], 0)
    node = tree.match(NS, tokens, 0).node
    keys = b"".join(n.page_keys for n in tree.path(node))
    assert keys == b"".join(page_keys(NS, tokens, PS))


def test_restore_builds_disk_only_nodes(tree, alloc):
    tokens = seq(100, pages=4)
    node = tree.restore(NS, tokens + [7])
    assert node.on_disk and not node.device_pools and node.host_pages is None
    hit = tree.match(NS, tokens, 0)
    assert hit.num_disk_pages == 4 and hit.num_device_pages == 0
    assert tree.sizes(Tier.DISK) == (4, 0)
    # Inserting on top adopts the engine's pages; the disk record stays.
    again = insert(tree, alloc, tokens)
    assert again.duplicate_pages.size == 0 and again.node.on_disk
    assert tree.restore(NS, [1, 2]) is tree.root(NS)


def test_a_restore_under_a_restored_node_continues_its_sequence(tree, alloc):
    """``restore(under=node)`` takes the tokens after ``node``: the same tree as restoring
    each whole sequence from the root."""
    prefix, a, b = seq(100, pages=3), seq(500, pages=2), seq(900, pages=1)
    whole = HiRadixTree()
    whole.add_namespace(NS, PS)
    whole.restore(NS, prefix + a)
    whole.restore(NS, prefix + b)
    top = tree.restore(NS, prefix)
    end_a = tree.restore(NS, a, b"".join(page_keys(NS, prefix + a, PS)[3:]), under=top)
    end_b = tree.restore(NS, b, under=top)
    for tokens, end in ((prefix + a, end_a), (prefix + b, end_b)):
        hit = tree.match(NS, tokens, 0)
        assert hit.node is end and hit.num_disk_pages == len(tokens) // PS
        assert ([n.num_pages for n in tree.path(end)]
                == [n.num_pages for n in whole.path(whole.match(NS, tokens, 0).node)])
        assert b"".join(n.page_keys for n in tree.path(end)) == b"".join(page_keys(NS, tokens, PS))
    assert tree.sizes(Tier.DISK) == whole.sizes(Tier.DISK) == (6, 0)
    assert tree.restore(NS, [], under=end_b) is end_b
    on_device = insert(tree, alloc, seq(7, pages=1)).node
    for bad in (on_device, whole.match(NS, prefix, 0).node, tree.root(OTHER_NS)):
        with pytest.raises(InvalidArgument):  # not on disk; another tree's; another namespace's
            tree.restore(NS, a, under=bad)
    tree.check_invariants()
    whole.check_invariants()


def test_disk_nodes_finds_the_node_of_each_disk_page(tree, alloc):
    a, b = seq(100, pages=4), seq(100, pages=2) + seq(900, pages=3)
    node_a = insert(tree, alloc, a).node
    node_b = insert(tree, alloc, b).node  # splits a after two pages
    upper = node_b.parent
    tree.add_disk(upper)
    tree.add_disk(node_a)
    keys_a, keys_b = page_keys(NS, a, PS), page_keys(NS, b, PS)
    assert tree.disk_nodes([keys_a[0], keys_a[3], keys_b[2], b"short"]) == {keys_a[0]: upper, keys_a[3]: node_a}
    # Same first 8 bytes as a disk page, different last 8: not that page.
    twin = keys_a[1][:8] + bytes(8)
    assert tree.disk_nodes([twin]) == {}
    tree.add_disk(node_b)
    found = tree.disk_nodes(keys_a + keys_b)
    assert found == {**{k: upper for k in keys_a[:2]}, **{k: node_a for k in keys_a[2:]},
                     **{k: node_b for k in keys_b[2:]}}
    assert tree.disk_nodes(page_keys(OTHER_NS, a, PS)) == {}


def test_a_node_on_disk_keeps_no_tokens_and_still_matches_and_splits(tree, alloc):
    """Edges compare by page keys where tokens are gone: a node on disk and in no device
    pool drops its tokens (its records hold them), and is matched, split and extended
    all the same; an insert gives the nodes on its path their tokens back; a node off
    disk without them cannot be written until set_tokens (checked) or an insert."""
    a = seq(100, pages=4)
    node = insert(tree, alloc, a).node
    packed = np.asarray(a, "<i4").tobytes()
    tree.add_disk(node)
    assert node.tokens == packed and tree.writable(node)  # on a device still: kept
    alloc.free(tree.drop(node, Tier.DEVICE, 0))
    assert node.tokens == b""
    hit = tree.match(NS, a[: 2 * PS] + [1], 0)  # ends inside: splits the token-less node
    upper = hit.node
    assert hit.num_disk_pages == 2 and upper.num_pages == 2 and node.parent is upper
    assert upper.tokens == node.tokens == b""
    b = a[: 3 * PS] + seq(900, pages=2)  # diverges after three pages
    branch = insert(tree, alloc, b).node
    assert [n.tokens for n in tree.path(branch)] == [packed[: 8 * PS], packed[8 * PS : 12 * PS],
                                                     np.asarray(seq(900, pages=2), "<i4").tobytes()]
    assert node.tokens == b"" and node.num_pages == 1
    assert tree.match(NS, b, 0).node is branch and tree.match(NS, a, 0).node is node
    assert b"".join(n.page_keys for n in tree.path(node)) == b"".join(page_keys(NS, a, PS))
    tree.check_invariants()
    # Off disk while on host: without tokens it cannot be written again ...
    c = seq(500, pages=2)
    other = insert(tree, alloc, c).node
    host = PageAllocator.for_host(16)
    tree.add_host(other, host.alloc(2))
    tree.add_disk(other)
    alloc.free(tree.drop(other, Tier.DEVICE, 0))
    assert other.tokens == b""
    tree.drop(other, Tier.DISK)
    assert other.host_pages is not None and not tree.writable(other)
    packed_c = np.asarray(c, "<i4").tobytes()
    with pytest.raises(InvalidArgument):
        tree.set_tokens(other, packed_c[:-4] + b"\0\0\0\0")
    with pytest.raises(InvalidArgument):
        tree.set_tokens(other, packed_c[:4])
    tree.set_tokens(other, packed_c)
    assert other.tokens == packed_c and tree.writable(other)
    tree.check_invariants()
    other.tokens = b""  # (as if they could not be read back) ...
    del other.parent.by_tokens[packed_c[: PS * 4]]
    insert(tree, alloc, c)  # ... until an insert of those pages brings them
    assert other.tokens == packed_c and tree.writable(other)
    tree.check_invariants()


def test_discard_shortens_hits_and_returns_pages(tree, alloc):
    host = PageAllocator.for_host(16)
    a, b = seq(100, pages=2), seq(200, pages=2)
    node_a = insert(tree, alloc, a).node
    node_b = insert(tree, alloc, a + b).node
    for node in (node_a, node_b):
        tree.add_host(node, host.alloc(2))
    alloc.free(evict(tree, Tier.DEVICE, 4, 0).page_ids)
    tree.lock(node_b, 0)
    freed = tree.discard(node_a, Tier.HOST)  # e.g. the host copy turned out corrupt
    assert sorted(freed.tolist()) == list(range(4))
    host.free(freed)
    assert tree.match(NS, a + b, 0).num_pages == 0
    # The locked nodes now live nowhere; they stay until the lock goes.
    assert tree.is_live(node_b) and not node_b.residency
    tree.check_invariants()
    tree.unlock(node_b, 0)
    assert len(tree) == 0


def test_caller_errors_are_rejected(tree, alloc):
    host = PageAllocator.for_host(16)
    tokens = seq(100, pages=2)
    with pytest.raises(InvalidArgument):
        tree.insert(NS, tokens, 0, [1])  # 2 whole pages, 1 id
    with pytest.raises(InvalidArgument):
        tree.insert(NS, tokens, -1, [1, 2])
    with pytest.raises(InvalidArgument):
        tree.match(NS, tokens, "0")  # type: ignore[arg-type]
    parent = insert(tree, alloc, tokens).node
    child = insert(tree, alloc, tokens + seq(300, pages=1)).node
    with pytest.raises(LockUnderflow):
        tree.unlock(child, 0)
    tree.lock(child, 0)
    with pytest.raises(LockUnderflow):
        tree.unlock(parent, 0)  # locking a child does not lock the parent directly
    with pytest.raises(LockUnderflow):
        tree.unlock(child, 1)
    with pytest.raises(LockUnderflow):
        tree.unpin(child)
    tree.unlock(child, 0)
    with pytest.raises(ResidencyError):
        tree.add_host(child, host.alloc(1))  # parent not on host yet
    with pytest.raises(InvalidArgument):
        tree.add_host(parent, [1])  # wrong page count
    with pytest.raises(ResidencyError):
        tree.add_device(parent, 0, [9, 10])  # already resident
    with pytest.raises(ResidencyError):
        tree.drop(parent, Tier.DEVICE, 0)  # child still resident: leaf-first
    with pytest.raises(ResidencyError):
        tree.drop(parent, Tier.DISK)
    with pytest.raises(ResidencyError):
        tree.add_disk(tree.root(NS))
    with pytest.raises(InvalidArgument):
        evict(tree, Tier.DEVICE, 1)  # no pool
    with pytest.raises(InvalidArgument):
        tree.sizes(Tier.HOST, 0)
    alloc.free(evict(tree, Tier.DEVICE, 10, 0).page_ids)
    with pytest.raises(UnknownNode):
        tree.lock(child, 0)  # evicted: the handle is dead
    with pytest.raises(UnknownNode):
        tree.node(child.node_id)
    with pytest.raises(InvalidArgument):
        eviction_policy("fifo")


def test_hit_counts_and_access(tree, alloc):
    tokens = seq(100, pages=2)
    node = insert(tree, alloc, tokens).node
    for _ in range(3):
        tree.match(NS, tokens, 0)
    assert node.hit_count == 3
    before = node.last_access
    tree.match(NS, tokens, 0)
    assert node.last_access > before


def test_page_size_one(alloc):
    t = HiRadixTree()
    t.add_namespace(NS, 1)
    a = t.insert(NS, [1, 2, 3], 0, alloc.alloc(3))
    mine = alloc.alloc(3)
    b = t.insert(NS, [1, 2, 4], 0, mine)
    assert b.duplicate_pages.tolist() == mine[:2].tolist()
    assert b.device_pages.tolist() == a.device_pages[:2].tolist() + [mine[2]]
    assert len(t) == 3  # [1,2] split from [3] and [4]
    t.check_invariants()


def test_split_hook_touchless_match_and_pool_discard(alloc):
    splits = []
    t = HiRadixTree(on_split=lambda upper, lower: splits.append((upper.num_pages, lower.num_pages)))
    t.add_namespace(NS, PS)
    tokens = seq(100, pages=4)
    first_pages = alloc.alloc(4)
    node = t.insert(NS, tokens, 0, first_pages).node
    before = (node.hit_count, node.last_access)
    hit = t.match(NS, tokens[:8], 0, touch=False)
    assert splits == [(2, 2)] and hit.node.num_pages == 2
    assert (node.hit_count, node.last_access) == before and hit.node.hit_count == before[0]
    upper = t.split(node, 1)
    assert splits[-1] == (1, 1) and upper.parent is hit.node and node.parent is upper
    with pytest.raises(InvalidArgument):
        t.split(node, 1)  # a one-page node cannot be cut
    assert t.is_evictable(node, Tier.DEVICE, 0) and not t.is_evictable(upper, Tier.DEVICE, 0)
    other = PageAllocator.for_device(8)
    t.insert(NS, tokens, 1, other.alloc(4))
    freed = t.discard_pool(0)
    assert sorted(freed.tolist()) == sorted(first_pages.tolist())
    assert t.match(NS, tokens, 0).num_pages == 0 and t.match(NS, tokens, 1).num_pages == 4
    t.check_invariants()


def test_deepest_keeps_the_nodes_no_other_is_below(tree, alloc):
    # a -> b -> c, and a -> d: locking c and d holds a, b, c, d.
    pa, pb, pc, pd = (seq(v, pages=1) for v in (100, 200, 300, 500))
    insert(tree, alloc, pa + pb + pc)
    insert(tree, alloc, pa + pd)
    c = tree.match(NS, pa + pb + pc, 0).node
    b = tree.match(NS, pa + pb, 0).node
    d = tree.match(NS, pa + pd, 0).node
    a = d.parent
    assert c.parent is b and b.parent is a and a.parent.parent is None
    assert tree.deepest([a, b, c, d]) == [c, d]
    assert tree.deepest([c, a, d, b, c]) == [c, d]
    assert tree.deepest([b, a]) == [b]
    assert tree.deepest([a]) == [a] and tree.deepest([]) == []
    assert tree.deepest([d, c]) == [d, c]


def _break_lock(tree, a, b):
    a.lock_ref[99] = 1  # a lock no one took


def _break_residency(tree, a, b):
    b.residency[7] = a.residency[0]  # a pool the parent is not in, with the parent's pages too


def _break_children(tree, a, b):
    a.resident_children[0] += 1


def _break_index(tree, a, b):
    tree._slots[0].evictable += 1


def _break_registry(tree, a, b):
    del tree._nodes[b.node_id]


@pytest.mark.parametrize("breaks", [_break_lock, _break_residency, _break_children, _break_index, _break_registry])
def test_the_check_of_a_copy_finds_what_was_broken_when_it_was_made(tree, alloc, breaks):
    """A check can copy the tree (the owner's part) and check the copy later, on another
    thread (what ``check`` does): the copy is what it judges — a fault mended after
    the copy is still found, and a tree that changes a lot after a clean copy is not
    blamed for it. A child the registry does not know is found while copying."""
    a = insert(tree, alloc, seq(100, pages=3)).node
    b = insert(tree, alloc, seq(100, pages=5)).node  # (below a)
    assert b.parent is a
    clean: list = []
    tree.check_invariants(clean)
    saved = (dict(a.lock_ref), dict(b.residency), dict(a.resident_children), tree._slots[0].evictable,
             dict(tree._nodes))
    breaks(tree, a, b)
    found: list = []
    try:
        tree.check_invariants(found)  # (the registry's fault: found while copying)
    except AssertionError as exc:
        assert breaks is _break_registry and "node registry disagrees" in str(exc), exc
    a.lock_ref.clear(), a.lock_ref.update(saved[0])
    b.residency.clear(), b.residency.update(saved[1])
    a.resident_children.clear(), a.resident_children.update(saved[2])
    tree._slots[0].evictable = saved[3]
    tree._nodes.clear(), tree._nodes.update(saved[4])
    tree.check_invariants()  # (mended)
    if breaks is not _break_registry:
        (check,) = found
        with pytest.raises(AssertionError):
            check()
    for i in range(6):  # the tree moves on: the clean copy still passes
        insert(tree, alloc, seq(1000 + 100 * i, pages=2))
    evict(tree, Tier.DEVICE, 4, pool=0)
    (check,) = clean
    check()


def test_the_check_finds_a_page_held_twice(tree, alloc):
    """A device page held by two nodes, or twice by one: the check names the page and
    the nodes (the faults are injected: no tree operation is known to make them)."""
    a = insert(tree, alloc, seq(100, pages=3)).node
    b = insert(tree, alloc, seq(900, pages=2)).node
    (slot,) = a.residency
    a_pages, b_pages = a.residency[slot], b.residency[slot]
    page = int(np.frombuffer(a_pages, dtype=np.int32)[1])
    b.residency[slot] = a_pages[4:8] + b_pages[4:]
    with pytest.raises(AssertionError, match=f"page {page} of .* held by nodes ({a.node_id} and {b.node_id}|"
                                             f"{b.node_id} and {a.node_id})"):
        tree.check_invariants()
    b.residency[slot] = b_pages
    a.residency[slot] = a_pages[:8] + a_pages[4:8]
    with pytest.raises(AssertionError, match=f"page {page} of .* held by nodes {a.node_id} and {a.node_id}"):
        tree.check_invariants()
    a.residency[slot] = a_pages
    tree.check_invariants()
