"""Steps that race the transfers: the same engine workload as the tier state machine,
but without waiting for backups, disk writes, prefetches and loads to land between
steps. Operations come from a seeded generator (their *outcomes* may vary with thread
timing, which is the point); what must hold whatever the timing: the invariants after
every step, exact bytes on every page a match or load hands out, and exact bytes in
every tier after each flush.
"""

import random

import pytest

from hicache.keys import namespace_id
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierConfig, TierManager
from hicache.tree import Place, Tier
from tiers_util import SPEC, Driver, Engine

PS = SPEC.page_size
NAMESPACES = [namespace_id(SPEC.fingerprint), namespace_id(SPEC.fingerprint, "tenant-2")]
STEPS = 500


def random_tokens(rng: random.Random) -> list[int]:
    blocks = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
    return [b for block in blocks for b in [block] * PS] + [7] * rng.randrange(PS)


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("disk_policy,capacity", [("write_through", "inclusive"), ("write_back", "inclusive"),
                                                  ("write_back", "exclusive")])
def test_steps_racing_transfers(tmp_path, write_policy, disk_policy, capacity):
    rng = random.Random(f"{write_policy}/{disk_policy}/{capacity}")
    engine = Engine(10)
    store = LmdbBackend(tmp_path / "db", capacity_bytes=14 * SPEC.host_page_bytes)
    tm = TierManager(SPEC, host_pages=7, storage=store,
                     config=TierConfig(write_policy=write_policy, disk_policy=disk_policy, capacity=capacity))
    for ns in NAMESPACES:
        tm.add_namespace(ns)
    driver = Driver(tm, engine, tm.register_pool(0, [engine.pool]))
    try:
        for _ in range(STEPS):
            op = rng.random()
            ns = rng.choice(NAMESPACES)
            if op < 0.25:
                driver.prefill(ns, random_tokens(rng))
            elif op < 0.45 and driver.seen:
                ns, tokens = rng.choice(driver.seen)
                driver.prefill(ns, tokens[: len(tokens) // PS * PS] + random_tokens(rng))
            elif op < 0.7 and driver.seen:
                ns, tokens = rng.choice(driver.seen)
                if rng.random() < 0.5:
                    tm.evict(Tier.DEVICE, rng.randint(1, 10), 0)
                if rng.random() < 0.3:
                    tm.evict(Tier.HOST, rng.randint(1, 7))
                driver.match_and_load(ns, tokens, keep_lock=rng.random() < 0.3)
            elif op < 0.78 and driver.locks:
                driver.unlock(rng.randrange(len(driver.locks)))
            elif op < 0.84:
                driver.hold_private(rng.randint(1, 3))
            elif op < 0.88 and driver.private:
                driver.release_private()
            elif op < 0.94:
                tier = rng.choice([Tier.DEVICE, Tier.HOST, Tier.DISK])
                tm.evict(tier, rng.randint(1, 8), 0 if tier == Tier.DEVICE else None)
            elif op < 0.98:
                tm.poll()
            else:
                driver.check_every_tier()
            tm.check_invariants()
        driver.release_everything()
        driver.check_every_tier()
        accounts = tm.accounting()
        assert accounts[Place.device(0)].private == 0 and accounts[Place.device(0)].cached_protected == 0
        assert accounts[Place(Tier.HOST)].staging == 0 and accounts[Place(Tier.HOST)].cached_protected == 0
    finally:
        tm.close()
        store.close()
        engine.close()
