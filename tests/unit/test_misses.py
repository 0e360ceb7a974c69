"""Miss reasons at bounded memory: the eviction log against an exact record."""

import numpy as np

from hicache.keys import PAGE_KEY_BYTES, namespace_id, page_keys
from hicache.tiers import TierConfig, TierManager
from hicache.tiers.misses import WAYS, EvictionLog
from hicache.tree import Tier
from tiers_util import SPEC, Engine

PS = SPEC.page_size
OLD_WINDOW = 1 << 18  # what the ordered dict it replaced remembered


def random_keys(rng, n):
    return rng.integers(0, 256, n * PAGE_KEY_BYTES, dtype=np.uint8).tobytes()


def test_the_log_remembers_a_quarter_of_its_slots_exactly_and_the_last_tier():
    rng = np.random.default_rng(7)
    log = EvictionLog(slots=1 << 20)
    assert log.slots == 1 << 20 and log.nbytes <= 4 * (1 << 20) + (1 << 20) // WAYS
    tiers = [Tier.DEVICE, Tier.HOST, Tier.DISK]
    exact = {}
    batches = []
    for i in range((1 << 18) // 1000 + 1):  # a quarter of the slots, in batches as nodes come
        keys = random_keys(rng, 1000)
        log.record(keys, tiers[i % 3])
        batches.append((keys, tiers[i % 3]))
    # Some pages come back and leave again from another tier: the last one counts.
    for keys, tier in batches[:20]:
        again = tiers[(tiers.index(tier) + 1) % 3]
        log.record(keys[: 100 * PAGE_KEY_BYTES], again)
        batches.append((keys[: 100 * PAGE_KEY_BYTES], again))
    for keys, tier in batches:
        for j in range(0, len(keys), PAGE_KEY_BYTES):
            exact[keys[j : j + PAGE_KEY_BYTES]] = tier
    wrong = sum(log.tier(key) is not tier for key, tier in exact.items())
    assert wrong == 0
    never = random_keys(rng, 20000)
    assert all(log.tier(never[j : j + PAGE_KEY_BYTES]) is None for j in range(0, len(never), PAGE_KEY_BYTES))


def test_older_evictions_fade_within_the_stated_bound():
    rng = np.random.default_rng(8)
    log = EvictionLog(slots=1 << 16)
    first = random_keys(rng, 1 << 14)  # a quarter of the slots
    log.record(first, Tier.HOST)
    log.record(random_keys(rng, 1 << 14), Tier.DEVICE)  # then as many more: half the slots in all
    remembered = sum(log.tier(first[j : j + PAGE_KEY_BYTES]) is Tier.HOST for j in range(0, len(first), PAGE_KEY_BYTES))
    assert remembered >= 0.99 * (1 << 14)
    log.record(random_keys(rng, 1 << 18), Tier.DEVICE)  # four times the slots: the first are gone
    remembered = sum(log.tier(first[j : j + PAGE_KEY_BYTES]) is not None for j in range(0, len(first), PAGE_KEY_BYTES))
    assert remembered < 0.01 * (1 << 14)


def test_miss_reasons_stay_right_after_more_evictions_than_the_old_window():
    """300 prompts of 1000 pages through a 1000-page device pool with no backups: every
    insert evicts the prompt before it, 299,000 evicted pages in all (more than the
    2^18 the old log kept). Every page of the first prompts still reads
    ``evicted_device``; a prompt never stored reads ``never_stored``."""
    ns = namespace_id(SPEC.fingerprint, "misses")
    engine = Engine(num_pages=1000)
    # write_through_selective with a threshold no prompt reaches: nothing leaves the device
    # but by eviction.
    tm = TierManager(SPEC, host_pages=8, config=TierConfig(write_policy="write_through_selective",
                                                          write_threshold=10**6))
    tm.add_namespace(ns)
    tm.register_pool(0, [engine.pool])
    try:
        prompts = [list(range(10**6 * i, 10**6 * i + 1000 * PS)) for i in range(300)]
        for toks in prompts:
            pages = tm.alloc(0, 1000)
            assert pages is not None
            tm.insert(ns, toks, 0, pages)
        tm.check_invariants()
        evicted = sum(len(toks) // PS for toks in prompts[:-1])
        assert evicted > OLD_WINDOW
        for toks in prompts[:60]:  # the oldest 60,000 evictions: beyond the old window
            assert all(tm.miss_reason(key) == "evicted_device" for key in page_keys(ns, toks, PS))
            hit = tm.match(ns, toks, 0)
            assert hit.match.num_pages == 0
            packed = np.asarray(toks, "<i4").tobytes()
            assert tm.why_missed(ns, packed, hit.match) == "evicted_device"
        never = (np.arange(5 * PS) + 2_000_000_000).astype("<i4").tobytes()
        assert tm.why_missed(ns, never, tm.match(ns, never, 0).match) == "never_stored"
    finally:
        tm.close()
        engine.close()


def test_batched_evictions_keep_their_order_across_tiers():
    """Evictions wait in a batch until it is full, then a thread records it: a page
    that left the device, came back and left the host within one batch reads as evicted
    from the host, and the other way round; a reason sees the batches waiting or being
    recorded, newest first, and never a key made of two neighbours' halves."""
    from types import SimpleNamespace

    from hicache.tiers.misses import PENDING_KEYS, MissReasons

    rng = np.random.default_rng(3)

    def node(keys):
        return SimpleNamespace(page_keys=keys, num_pages=len(keys) // PAGE_KEY_BYTES, residency={Tier.HOST: 0})

    misses = MissReasons(slots=1 << 16)
    a, b = random_keys(rng, 3), random_keys(rng, 5)
    misses.evicted(node(a), Tier.DEVICE)
    misses.evicted(node(b), Tier.HOST)
    misses.evicted(node(a), Tier.HOST)
    misses.evicted(node(b), Tier.DEVICE)
    assert misses._log.tier(a[:PAGE_KEY_BYTES]) is None  # (waiting)
    assert [misses.reason(k[j : j + PAGE_KEY_BYTES]) for k in (a, b) for j in (0, PAGE_KEY_BYTES)] == [
        "evicted_host", "evicted_host", "evicted_device", "evicted_device"]
    many = random_keys(rng, PENDING_KEYS)
    misses.evicted(node(many), Tier.DISK)  # a full batch: to the recorder thread
    assert not misses._pending
    assert misses.reason(many[-PAGE_KEY_BYTES:]) == "evicted_disk"  # (being recorded, or in the log)
    misses.evicted(node(a), Tier.DISK)  # newer than the batch being recorded: it wins
    assert misses.reason(a[:PAGE_KEY_BYTES]) == "evicted_disk"
    misses.flush()
    assert misses._log.tier(many[-PAGE_KEY_BYTES:]) is Tier.DISK and not misses._recording
    assert misses._log.tier(a[PAGE_KEY_BYTES:2 * PAGE_KEY_BYTES]) is Tier.DISK
    assert misses.reason(b[:PAGE_KEY_BYTES]) == "evicted_device"
    c = random_keys(rng, 2)
    misses.evicted(node(c), Tier.HOST)
    straddling = c[PAGE_KEY_BYTES // 2 : PAGE_KEY_BYTES // 2 + PAGE_KEY_BYTES]
    assert misses.reason(straddling) == "never_stored" and misses.reason(c[PAGE_KEY_BYTES:]) == "evicted_host"
    misses.close()
    misses.evicted(node(many), Tier.HOST)  # after close: recorded on the caller's thread
    assert misses._log.tier(many[:PAGE_KEY_BYTES]) is Tier.HOST and not misses._recording


def test_the_log_takes_its_memory_at_the_first_eviction():
    """A tier manager that never evicts (a KV spec registered and left) holds no table."""
    log = EvictionLog(slots=1 << 20)
    key = random_keys(np.random.default_rng(9), 1)
    assert log.nbytes == 0 and log.slots == 1 << 20 and log.tier(key) is None
    log.record(key, Tier.HOST)
    assert log.tier(key) is Tier.HOST
    assert 4 * (1 << 20) <= log.nbytes <= 4 * (1 << 20) + (1 << 20) // WAYS
