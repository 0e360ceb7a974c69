"""Stateful property test: the tree and its allocators against a plain dict model.

The model knows nothing about nodes or splits: it maps every cached page — named by the
tuple of tokens from the start of its sequence to the end of the page — to where that
page lives (device page id per pool, host page id, on disk). Locks and pins are the
token prefixes they were taken on. Every rule drives the tree the way the tier manager
and engines will, predicts the outcome from the model, compares, and then the whole
tree is compared page by page with the model, the tree's and allocators'
``check_invariants()`` run, and every tier's evictable / protected counts are
recomputed from the model.

Sizes are tiny (page size 1-4, a three-token alphabet, pools of a few pages) so that
sequences share prefixes, nodes split, and every tier fills up and evicts.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.keys import NamespaceId, namespace_id, page_keys
from hicache.pages import PageAllocator
from hicache.tree import PIN, HiRadixTree, Node, Tier
from tree_util import evict

NAMESPACES = [namespace_id(b"model-a"), namespace_id(b"model-a", "tenant-b")]
POOLS = [0, 1]
DEVICE_PAGES = 7
HOST_PAGES = 9

tokens_strategy = st.lists(st.integers(0, 2), max_size=22)
tiers = st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.DISK])


class PageState:
    __slots__ = ("device", "host", "disk")

    def __init__(self) -> None:
        self.device: dict[int, int] = {}
        self.host: int | None = None
        self.disk = False

    def empty(self) -> bool:
        return not self.device and self.host is None and not self.disk

    def as_tuple(self):
        return (tuple(sorted(self.device.items())), self.host, self.disk)


class TreeMachine(RuleBasedStateMachine):
    @initialize(page_size=st.integers(1, 4), policy=st.sampled_from(["lru", "lfu", "priority"]))
    def setup(self, page_size: int, policy: str) -> None:
        self.page_size = page_size
        self.tree = HiRadixTree(eviction=policy)
        for ns in NAMESPACES:
            self.tree.add_namespace(ns, page_size)
        self.device = {pool: PageAllocator.for_device(DEVICE_PAGES) for pool in POOLS}
        self.host = PageAllocator.for_host(HOST_PAGES)
        # (namespace, token prefix ending at a page boundary) -> PageState
        self.model: dict[tuple[NamespaceId, tuple[int, ...]], PageState] = {}
        # page key -> (namespace, prefix), to read evictions back
        self.by_key: dict[bytes, tuple[NamespaceId, tuple[int, ...]]] = {}
        # held references: (node, lock key, namespace, prefix of the node's end)
        self.held: list[tuple[Node, int, NamespaceId, tuple[int, ...]]] = []

    def pages_of(self, ns: NamespaceId, tokens: list[int]) -> list[tuple[int, ...]]:
        """Model names of every whole page of ``tokens``."""
        ps = self.page_size
        return [tuple(tokens[: (i + 1) * ps]) for i in range(len(tokens) // ps)]

    def state(self, ns: NamespaceId, prefix: tuple[int, ...]) -> PageState:
        key = (ns, prefix)
        if key not in self.model:
            self.model[key] = PageState()
            self.by_key[page_keys(ns, list(prefix), self.page_size)[-1]] = key
        return self.model[key]

    def prune(self) -> None:
        for key in [k for k, s in self.model.items() if s.empty()]:
            del self.model[key]

    def node_pages(self, node: Node) -> tuple[NamespaceId, list[tuple[int, ...]]]:
        return node.namespace, [self.by_key[key][1] for key in node.page_key_list()]

    def protected(self, ns: NamespaceId, prefix: tuple[int, ...], lock_key: int | None) -> bool:
        """Is the page protected by a held reference with ``lock_key`` (any when None)?"""
        n = len(prefix)
        return any(
            h_ns == ns and h_prefix[:n] == prefix and (lock_key is None or h_key == lock_key)
            for _, h_key, h_ns, h_prefix in self.held
        )

    def expected_match(self, ns: NamespaceId, tokens: list[int], pool: int):
        device, host, disk = [], 0, 0
        for prefix in self.pages_of(ns, tokens):
            page = self.model.get((ns, prefix))
            if page is None:
                break
            if pool in page.device:
                assert not host and not disk, "device part must be a prefix"
                device.append(page.device[pool])
            elif page.host is not None:
                assert not disk, "host part must precede the disk part"
                host += 1
            elif page.disk:
                disk += 1
            else:
                break
        return device, host, disk

    def evict_and_check(self, tier: Tier, num_pages: int, pool: int | None) -> int:
        before = self.tree.sizes(tier, pool)
        evicted = evict(self.tree, tier, num_pages, pool)
        keys = evicted.page_keys()
        assert len(keys) == evicted.num_pages
        if evicted.num_pages < num_pages:
            assert evicted.num_pages == before.evictable, "stopped before evicting all it could"
        else:
            assert evicted.num_pages <= before.evictable
        if tier != Tier.DISK:
            assert len(evicted.page_ids) == evicted.num_pages
        for i, page_key in enumerate(keys):
            ns, prefix = self.by_key[page_key]
            page = self.model[(ns, prefix)]
            if tier == Tier.DEVICE:
                assert not self.protected(ns, prefix, pool), "evicted a locked device page"
                assert page.device.pop(pool) == evicted.page_ids[i]
            elif tier == Tier.HOST:
                assert not self.protected(ns, prefix, None), "evicted a locked host page"
                assert page.host == evicted.page_ids[i]
                page.host = None
            else:
                assert not self.protected(ns, prefix, None), "evicted a locked disk page"
                assert page.disk
                page.disk = False
        if tier == Tier.DEVICE:
            self.device[pool].free(evicted.page_ids)
        elif tier == Tier.HOST:
            self.host.free(evicted.page_ids)
        self.prune()
        return evicted.num_pages

    def eligible(self, predicate) -> list[Node]:
        return sorted((n for n in self.tree.nodes() if predicate(n)), key=lambda n: n.node_id)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_strategy, pool=st.sampled_from(POOLS),
          reuse_prefix=st.booleans(), priority=st.integers(0, 2))
    def insert(self, ns, tokens, pool, reuse_prefix, priority):
        names = self.pages_of(ns, tokens)
        prefix_pages = self.tree.match(ns, tokens, pool).device_pages if reuse_prefix else np.empty(0, np.int32)
        need = len(names) - len(prefix_pages)
        allocator = self.device[pool]
        if need > allocator.num_free:
            self.evict_and_check(Tier.DEVICE, need - allocator.num_free, pool)
            if need > allocator.num_free:
                return
            # Eviction may have taken the prefix we matched: match again.
            if reuse_prefix:
                prefix_pages = self.tree.match(ns, tokens, pool).device_pages
                need = len(names) - len(prefix_pages)
                if need > allocator.num_free:
                    return
        mine = np.concatenate((prefix_pages, allocator.alloc(need))).astype(np.int32)
        expected_canonical, expected_dups, expected_prefix = [], [], 0
        for name, page_id in zip(names, mine.tolist()):
            page = self.model.get((ns, name))
            if page is not None and pool in page.device:
                expected_canonical.append(page.device[pool])
                expected_prefix += 1
                if page.device[pool] != page_id:
                    expected_dups.append(page_id)
            else:
                expected_canonical.append(page_id)
        result = self.tree.insert(ns, tokens, pool, mine, priority=priority)
        assert result.device_pages.tolist() == expected_canonical
        assert result.duplicate_pages.tolist() == expected_dups
        assert result.num_prefix_pages == expected_prefix
        for name, page_id in zip(names, expected_canonical):
            self.state(ns, name).device[pool] = page_id
        allocator.free(result.duplicate_pages)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_strategy, pool=st.sampled_from(POOLS),
          take_lock=st.booleans())
    def match(self, ns, tokens, pool, take_lock):
        device, host, disk = self.expected_match(ns, tokens, pool)
        result = self.tree.match(ns, tokens, pool)
        assert result.device_pages.tolist() == device
        assert (result.num_host_pages, result.num_disk_pages) == (host, disk)
        assert result.num_tokens == (len(device) + host + disk) * self.page_size
        node = result.node
        if node.is_root:
            assert result.num_pages == 0
            return
        path_keys = b"".join(n.page_keys for n in self.tree.path(node))
        assert path_keys == b"".join(page_keys(ns, tokens[: result.num_tokens], self.page_size))
        if take_lock:
            self.tree.lock(node, pool)
            self.held.append((node, pool, ns, tuple(tokens[: result.num_tokens])))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        index = data.draw(st.integers(0, len(self.held) - 1))
        node, lock_key, _, _ = self.held.pop(index)
        if lock_key == PIN:
            self.tree.unpin(node)
        else:
            self.tree.unlock(node, lock_key)
        self.prune()

    @rule(data=st.data())
    def pin(self, data):
        nodes = self.eligible(lambda n: n.residency)
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes))
        ns, names = self.node_pages(node)
        self.tree.pin(node)
        self.held.append((node, PIN, ns, names[-1]))

    @rule(tier=tiers, pool=st.sampled_from(POOLS), num_pages=st.integers(1, 6))
    def evict(self, tier, pool, num_pages):
        self.evict_and_check(tier, num_pages, pool if tier == Tier.DEVICE else None)

    @rule(data=st.data())
    def backup_to_host(self, data):
        nodes = self.eligible(
            lambda n: n.host_pages is None and (n.parent.is_root or n.parent.host_pages is not None)
            and n.residency)
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes))
        pages = self.host.alloc(node.num_pages)
        if pages is None:
            return
        self.tree.add_host(node, pages)
        ns, names = self.node_pages(node)
        for name, page_id in zip(names, pages.tolist()):
            self.model[(ns, name)].host = page_id

    @rule(data=st.data())
    def write_to_disk(self, data):
        nodes = self.eligible(
            lambda n: n.host_pages is not None and not n.on_disk and (n.parent.is_root or n.parent.on_disk))
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes))
        self.tree.add_disk(node)
        ns, names = self.node_pages(node)
        for name in names:
            self.model[(ns, name)].disk = True

    @rule(data=st.data(), pool=st.sampled_from(POOLS))
    def load_to_device(self, data, pool):
        nodes = self.eligible(
            lambda n: n.device_pages(pool) is None
            and (n.host_pages is not None or n.on_disk)
            and (n.parent.is_root or n.parent.device_pages(pool) is not None))
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes))
        pages = self.device[pool].alloc(node.num_pages)
        if pages is None:
            return
        self.tree.add_device(node, pool, pages)
        ns, names = self.node_pages(node)
        for name, page_id in zip(names, pages.tolist()):
            self.model[(ns, name)].device[pool] = page_id

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_strategy)
    def restore(self, ns, tokens):
        self.tree.restore(ns, tokens)
        for name in self.pages_of(ns, tokens):
            self.state(ns, name).disk = True

    @rule(data=st.data(), tier=tiers, pool=st.sampled_from(POOLS))
    def discard(self, data, tier, pool):
        slot_pool = pool if tier == Tier.DEVICE else None

        def resident(n: Node) -> bool:
            if tier == Tier.DEVICE:
                return n.device_pages(pool) is not None
            return n.host_pages is not None if tier == Tier.HOST else n.on_disk

        nodes = self.eligible(resident)
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes))
        ns, names = self.node_pages(node)
        first = names[0]
        freed = self.tree.discard(node, tier, slot_pool)
        expected = []
        for (p_ns, prefix), page in self.model.items():
            if p_ns != ns or prefix[: len(first)] != first:
                continue
            if tier == Tier.DEVICE and pool in page.device:
                expected.append(page.device.pop(pool))
            elif tier == Tier.HOST and page.host is not None:
                expected.append(page.host)
                page.host = None
            elif tier == Tier.DISK:
                page.disk = False
        if tier == Tier.DISK:
            assert freed is None
        else:
            assert sorted(freed.tolist()) == sorted(expected)
            (self.device[pool] if tier == Tier.DEVICE else self.host).free(freed)
        self.prune()

    @invariant()
    def tree_matches_model(self):
        if not hasattr(self, "tree"):
            return
        self.tree.check_invariants()
        self.host.check_invariants()
        for allocator in self.device.values():
            allocator.check_invariants()
        seen = {}
        for node in self.tree.nodes():
            ns, names = self.node_pages(node)
            device = {pool: node.device_pages(pool) for pool in node.device_pools}
            host = node.host_pages
            for i, name in enumerate(names):
                state = PageState()
                state.device = {pool: int(ids[i]) for pool, ids in device.items()}
                state.host = None if host is None else int(host[i])
                state.disk = node.on_disk
                if not state.empty():
                    seen[(ns, name)] = state.as_tuple()
        assert seen == {k: s.as_tuple() for k, s in self.model.items()}

    @invariant()
    def sizes_match_model(self):
        if not hasattr(self, "tree"):
            return
        for tier, pool in [(Tier.DEVICE, p) for p in POOLS] + [(Tier.HOST, None), (Tier.DISK, None)]:
            evictable = protected = 0
            for (ns, prefix), page in self.model.items():
                if tier == Tier.DEVICE:
                    resident = pool in page.device
                else:
                    resident = page.host is not None if tier == Tier.HOST else page.disk
                if not resident:
                    continue
                if self.protected(ns, prefix, pool if tier == Tier.DEVICE else None):
                    protected += 1
                else:
                    evictable += 1
            assert self.tree.sizes(tier, pool) == (evictable, protected), (tier, pool)
        # Every allocated page is cached: the test frees private pages right away.
        for pool, allocator in self.device.items():
            assert allocator.num_allocated == self.tree.sizes(Tier.DEVICE, pool).cached
        assert self.host.num_allocated == self.tree.sizes(Tier.HOST).cached

    @invariant()
    def closure_in_model(self):
        if not hasattr(self, "tree"):
            return
        ps = self.page_size
        for (ns, prefix), page in self.model.items():
            if len(prefix) == ps:
                continue
            parent = self.model.get((ns, prefix[:-ps]))
            assert parent is not None, "a cached page whose parent page is gone"
            assert set(page.device) <= set(parent.device)
            assert page.host is None or parent.host is not None
            assert not page.disk or parent.disk


TreeMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_tree_state_machine = TreeMachine.TestCase
