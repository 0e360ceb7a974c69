"""Page accounting across a tier manager's places, and the invariants that tie the tree,
the allocators and the transfers in flight together."""

from __future__ import annotations

from collections.abc import Callable

from hicache.tiers.core import Core
from hicache.tiers.devices import DevicePools
from hicache.tiers.disk import DiskTier
from hicache.tiers.results import TierAccount
from hicache.tree import Place, Tier


def accounting(core: Core, pools: DevicePools, disk: DiskTier) -> dict[Place, TierAccount]:
    """Pages per place (each device pool, host, disk) and state."""
    tree = core.tree
    out = {}
    for pool in pools:
        if pool.owned:  # the engine's blocks: not a place hicache keeps pages in
            continue
        sizes = tree.sizes(Tier.DEVICE, pool.pool_id)
        landing = core.inflight.landing(pool.pool_id)
        out[Place.device(pool.pool_id)] = TierAccount(
            pool.allocator.num_free, pool.num_private, sizes.evictable,
            sizes.protected - landing, pool.staging + landing,
        )
    sizes = tree.sizes(Tier.HOST)
    out[Place(Tier.HOST)] = TierAccount(core.host_alloc.num_free, 0, sizes.evictable, sizes.protected,
                                        core.host_staging)
    sizes = tree.sizes(Tier.DISK)
    pending = disk.pending + core.remote.held_pages  # (records on their way to the remote tier's store)
    free = disk.capacity_pages - sizes.cached - pending  # (below 0: check_invariants says so)
    out[Place(Tier.DISK)] = TierAccount(free, 0, sizes.evictable, sizes.protected, pending)
    return out


def check_invariants(core: Core, pools: DevicePools, disk: DiskTier,
                     deferred: list[Callable[[], None]] | None = None) -> None:
    """The tree's and allocators' own checks, plus the accounting between them
    (``AssertionError`` names the first that fails); ``deferred``: where the tree's
    check of what it copies goes, to run later (see :meth:`HiRadixTree.check_invariants`)."""
    tree, host_alloc = core.tree, core.host_alloc
    tree.check_invariants(deferred)
    host_alloc.check_invariants()
    host_cached = tree.sizes(Tier.HOST).cached
    assert host_alloc.num_allocated == host_cached + core.host_staging, (
        host_alloc.num_allocated, host_cached, core.host_staging)
    for pool in pools:
        pool.check(tree.sizes(Tier.DEVICE, pool.pool_id).cached)
    busy = core.inflight.pools()
    idle = [pool.pool_id for pool in pools if pool.retired and pool.pool_id not in busy]
    assert not idle, f"pools {idle} are retired and no transfer uses them, but they are still mapped"
    gone = tree.locked_pools() - {pool.pool_id for pool in pools}
    assert not gone, f"pools {sorted(gone)} are gone but hold locks"
    core.inflight.check(tree)
    for place, account in accounting(core, pools, disk).items():
        assert min(account) >= 0, (str(place), account)
        if place.tier == Tier.DEVICE:
            assert account.total == pools[place.pool].allocator.capacity, (place, account)
        elif place.tier == Tier.HOST:
            assert account.total == host_alloc.capacity, account
