"""Space quotas in the tier manager: a tenant over its host or disk quota makes room
among its own pages, never another tenant's; what cannot be made room for is not copied
(and counted); pages on their way count; invariants after every step."""

import numpy as np
import pytest

from hicache.keys import namespace_id
from hicache.tiers import TierConfig, TierManager
from hicache.tiers.quotas import SpaceLimit
from hicache.tree import Tier
from test_tiers import store, tokens  # noqa: F401 (store: a fixture, a 64-page LMDB store)
from tiers_util import SPEC, Engine

PS = SPEC.page_size
NA = namespace_id(SPEC.fingerprint, None, "a")
NA2 = namespace_id(SPEC.fingerprint, "lora", "a")  # a second namespace of tenant a
NB = namespace_id(SPEC.fingerprint, None, "b")


@pytest.fixture
def engine():
    e = Engine(num_pages=32)
    yield e
    e.close()


def make_tm(engine, limits, *, host_pages=16, storage=None, **config):
    tm = TierManager(SPEC, host_pages=host_pages, storage=storage, config=TierConfig(**config))
    for ns, tenant in ((NA, "a"), (NA2, "a"), (NB, "b")):
        tm.add_namespace(ns)
        tm.assign(ns, tenant)
    tm.register_pool(0, [engine.pool])
    tm.set_space_limits(limits)
    return tm


def prefill(tm, engine, ns, toks):
    hit = tm.match(ns, toks, 0).match
    new = tm.alloc(0, len(toks) // PS - hit.num_device_pages)
    assert new is not None
    pages = np.concatenate((hit.device_pages, new))
    engine.compute(ns, toks, pages)
    result = tm.insert(ns, toks, 0, pages)
    tm.check_invariants()
    return result


def settle(tm):
    tm.flush()
    tm.check_invariants()


def host(tm, group):
    return tm.tree.group_pages(group)[0]


def disk(tm, group):
    return tm.tree.group_pages(group)[1]


def test_over_its_host_quota_a_tenant_makes_room_among_its_own_pages(engine):
    tm = make_tm(engine, [SpaceLimit("ia", frozenset({"a"}), host_pages=4)])
    prefill(tm, engine, NB, tokens(1000, 6))
    settle(tm)
    assert (host(tm, "a"), host(tm, "b")) == (0, 6)
    first = prefill(tm, engine, NA, tokens(100, 3)).node
    settle(tm)
    assert host(tm, "a") == 3
    second = prefill(tm, engine, NA2, tokens(200, 3)).node  # another namespace of the same tenant
    settle(tm)
    assert host(tm, "a") == 3 and second.host_pages is not None and first.host_pages is None
    assert host(tm, "b") == 6  # never another tenant's
    assert not tm.quotas.refused
    # Counted per namespace and per tenant through splits, drops and re-adds.
    prefill(tm, engine, NA2, tokens(200, 2) + tokens(900, 1))  # splits `second`
    settle(tm)
    assert host(tm, "a") <= 4 and host(tm, "b") == 6
    tm.close()


def test_what_cannot_make_room_is_not_copied_and_is_counted(engine):
    tm = make_tm(engine, [SpaceLimit("ia", frozenset({"a"}), host_pages=4)])
    locked = prefill(tm, engine, NA, tokens(100, 3)).node
    settle(tm)
    tm.lock(locked, 0)  # its host copy may not go
    node = prefill(tm, engine, NA, tokens(300, 2)).node
    settle(tm)
    assert node.host_pages is None and host(tm, "a") == 3
    assert tm.quotas.refused[("ia", Tier.HOST)] == 1
    assert not tm._backups.deferred  # not retried: only its own pages would make room
    prefill(tm, engine, NB, tokens(1000, 8))  # another tenant is not affected
    settle(tm)
    assert host(tm, "b") == 8
    tm.unlock(locked, 0)
    tm.close()


def test_write_back_over_quota_drops_the_device_copy_instead_of_holding_it(engine):
    tm = make_tm(engine, [SpaceLimit("ia", frozenset({"a"}), host_pages=2)], write_policy="write_back")
    node = prefill(tm, engine, NA, tokens(100, 3)).node
    other = prefill(tm, engine, NB, tokens(1000, 3)).node
    settle(tm)
    freed = tm.evict(Tier.DEVICE, 32, 0)
    settle(tm)
    assert not tm.tree.is_live(node)  # three pages never fit a quota of two: gone, not stuck
    assert other.host_pages is not None and host(tm, "b") == 3
    assert freed >= 3 and tm.quotas.refused[("ia", Tier.HOST)] >= 1
    tm.close()


def test_pages_on_their_way_count(engine):
    """Two backups of tenant a in flight at once: the second sees the first's pages
    (staged, not yet on host) and may not overrun the quota."""
    tm = make_tm(engine, [SpaceLimit("ia", frozenset({"a"}), host_pages=3)])
    prefill(tm, engine, NA, tokens(100, 2))
    prefill(tm, engine, NA, tokens(200, 2))  # no poll between: the first is still copying
    assert tm.quotas.staged[("a", Tier.HOST)] == 2
    settle(tm)
    assert host(tm, "a") == 2 and not tm.quotas.staged
    tm.close()


def test_over_its_disk_quota_a_tenant_evicts_its_own_records(engine, store):
    tm = make_tm(engine, [SpaceLimit("ia", frozenset({"a"}), disk_pages=4)], storage=store)
    prefill(tm, engine, NB, tokens(1000, 5))
    first = prefill(tm, engine, NA, tokens(100, 3)).node
    settle(tm)
    assert (disk(tm, "a"), disk(tm, "b")) == (3, 5)
    second = prefill(tm, engine, NA, tokens(200, 3)).node
    settle(tm)
    assert second.on_disk and not first.on_disk
    assert (disk(tm, "a"), disk(tm, "b")) == (3, 5)
    assert store.stats().records == 8  # the store agrees: a's old records were deleted
    tm.close()


def test_no_limit_for_a_tenant_means_none_and_limits_can_change(engine):
    tm = make_tm(engine, [SpaceLimit("ib", frozenset({"b"}), host_pages=2)])
    prefill(tm, engine, NA, tokens(100, 6))
    settle(tm)
    assert host(tm, "a") == 6
    tm.set_space_limits([SpaceLimit("ia", frozenset({"a"}), host_pages=2)])
    prefill(tm, engine, NA, tokens(300, 2))
    settle(tm)
    assert host(tm, "a") == 2  # its old pages made room
    tm.set_space_limits([])
    prefill(tm, engine, NA, tokens(500, 4))
    settle(tm)
    assert host(tm, "a") == 6
    tm.close()
