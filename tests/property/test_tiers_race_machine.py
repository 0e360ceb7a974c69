"""The tier manager with its transfers racing the requests, in an order hypothesis picks.

The manager's worker threads are replaced by queues that a rule runs one job at a time
(copies and writes in order, reads in any order: the real I/O pool has several threads),
and completions reach the owner only when a rule polls. So matches, loads, inserts,
evictions and splits land between a transfer's start, its copy and its completion —
deterministically. After every step the manager's invariants hold; at a settle step
every transfer lands and every page a locked hit or load handed out, and every page of
every tier, holds exactly the bytes inserted for its key.
"""

import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hicache.tiers.loads as loads_module
import hicache.tiers.manager as manager_module
from hicache.errors import LoadFailed
from hicache.keys import page_keys
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierConfig, TierManager
from hicache.tree import Tier
from tiers_util import BLOCKS, NAMESPACES, SPEC, Driver, Engine, ManualWorkers, token_sequences

PS = SPEC.page_size
DEVICE_PAGES = 10
HOST_PAGES = 7
DISK_PAGES = 14

sequences = token_sequences()


class RaceDriver(Driver):
    """:class:`Driver` that checks the pages it got only once the transfers landed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outstanding = []  # (ns, tokens, hit, load future, node locked until checked)

    def prefill(self, ns, tokens) -> None:
        hit = self.tm.match(ns, tokens, self.pool)
        node = hit.match.node
        if len(tokens) >= PS:
            self.seen.append((ns, tokens))
        self.tm.lock(node, self.pool)
        try:
            new = self.tm.alloc(self.pool, len(tokens) // PS - hit.match.num_device_pages)
            if new is None:
                return
            pages = np.concatenate((hit.match.device_pages, new))
            # Only the new pages are the engine's to write: the matched ones may still be landing.
            keys = page_keys(ns, tokens, PS)
            for key, page in zip(keys[hit.match.num_device_pages :], new):
                self.engine.write(int(page), key)
            result = self.tm.insert(ns, tokens, self.pool, pages)
        finally:
            self.tm.unlock(node, self.pool)
        assert len(result.device_pages) == len(tokens) // PS

    def match_and_load(self, ns, tokens, keep_lock: bool = True) -> None:
        """Match, lock and load; the lock stays until :meth:`check_outstanding`."""
        hit = self.tm.match(ns, tokens, self.pool)
        node = hit.match.node
        if node.is_root:
            return
        self.tm.lock(node, self.pool)
        future = self.tm.load(node, self.pool)
        self.outstanding.append((ns, tokens, hit, future, node))

    def check_outstanding(self) -> None:
        for ns, tokens, hit, future, node in self.outstanding:
            assert future.done()
            loaded = future.result()
            assert loaded.device_pages[: hit.match.num_device_pages].tolist() == hit.match.device_pages.tolist()
            try:
                self.engine.wait(self.handle, hit.wait)
                self.engine.wait(self.handle, loaded.wait)
            except LoadFailed:
                pass  # (the engine is told: it recomputes)
            else:
                self.engine.check(ns, tokens, loaded.device_pages)
            self.tm.unlock(node, self.pool)
        self.outstanding.clear()


class RaceMachine(RuleBasedStateMachine):
    @initialize(
        write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        disk_policy=st.sampled_from(["write_through", "write_back"]),
        capacity=st.sampled_from(["inclusive", "exclusive"]),
    )
    def setup(self, write_policy, disk_policy, capacity):
        self.dir = tempfile.mkdtemp(prefix="hicache-race-")
        # A parked load waits while anything is in flight, not for a wall-clock time: the
        # same steps then give the same outcome whatever the machine's speed.
        self.patches = pytest.MonkeyPatch()
        self.patches.setattr(loads_module, "LOAD_WAIT_S", 1e9)
        self.config = TierConfig(write_policy=write_policy, disk_policy=disk_policy,
                                 capacity=capacity if disk_policy == "write_back" else "inclusive")
        self.engines = [Engine(DEVICE_PAGES), Engine(DEVICE_PAGES - 3)]  # two engines of one model
        self.tm = None
        self.drivers = []
        self.start()

    def start(self):
        self.storage = LmdbBackend(self.dir, capacity_bytes=DISK_PAGES * SPEC.host_page_bytes)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(manager_module, "Workers", ManualWorkers)
            self.tm = TierManager(SPEC, host_pages=HOST_PAGES, storage=self.storage, config=self.config)
        for ns in NAMESPACES:
            self.tm.add_namespace(ns)
        self.tm.rebuild_from_storage()
        seen = self.drivers[0].seen if self.drivers else []
        self.drivers = []
        for pool, engine in enumerate(self.engines):
            handle = self.tm.register_pool(pool, [engine.pool])
            self.drivers.append(RaceDriver(self.tm, engine, handle, pool))
            self.drivers[-1].seen = seen  # (one list: either engine revisits what either saw)
        self.driver = self.drivers[0]

    def teardown(self):
        if getattr(self, "tm", None) is not None:
            self.settle()
            for driver in self.drivers:
                driver.outstanding.clear()
                driver.release_everything()
            self.settle()
            self.tm.close()
            self.storage.close()
            for engine in self.engines:
                engine.close()
        if hasattr(self, "patches"):
            self.patches.undo()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def settle(self):
        workers = self.tm.workers
        for _ in range(200):
            while workers.jobs:
                for name in ("copy", "io", "write"):
                    if workers.queues[name]:
                        workers.run(name)
            self.tm.poll()
            if not workers.jobs and self.tm.idle() and not self.tm.completions.pending:
                if not self.tm._backups.retry() + self.tm.disk.retry_writes():
                    break
        else:
            raise AssertionError("the transfers never settled")
        self.tm.disk.flush()

    @rule(which=st.integers(0, 1), ns=st.sampled_from(NAMESPACES), tokens=sequences)
    def prefill(self, which, ns, tokens):
        self.drivers[which].prefill(ns, tokens)

    @precondition(lambda self: self.driver.seen)
    @rule(which=st.integers(0, 1), data=st.data(), turn=st.lists(st.integers(0, 2), min_size=1, max_size=2))
    def next_turn(self, which, data, turn):
        ns, tokens = data.draw(st.sampled_from(self.driver.seen))
        whole = tokens[: len(tokens) // PS * PS]
        self.drivers[which].prefill(ns, whole + [t for b in turn for t in BLOCKS[b]])

    @precondition(lambda self: self.driver.seen)
    @rule(which=st.integers(0, 1), data=st.data(), cut=st.integers(0, 5))
    def revisit(self, which, data, cut):
        """An earlier sequence, or a prefix of it (a split), is matched and loaded."""
        ns, tokens = data.draw(st.sampled_from(self.driver.seen))
        self.drivers[which].match_and_load(ns, tokens[: max(PS, len(tokens) - cut * PS)])

    @rule(which=st.integers(0, 1), ns=st.sampled_from(NAMESPACES), tokens=sequences)
    def match_and_load(self, which, ns, tokens):
        self.drivers[which].match_and_load(ns, tokens)

    @rule(which=st.integers(0, 1), tier=st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.DISK]),
          num_pages=st.integers(1, 8))
    def evict(self, which, tier, num_pages):
        self.tm.evict(tier, num_pages, which if tier == Tier.DEVICE else None)

    @rule(num_pages=st.integers(1, 3))
    def hold_private(self, num_pages):
        self.driver.hold_private(num_pages)

    @precondition(lambda self: self.driver.private)
    @rule()
    def release_private(self):
        self.driver.release_private()

    @rule(name=st.sampled_from(["copy", "io", "write"]), index=st.integers(0, 3))
    def run_job(self, name, index):
        queue = self.tm.workers.queues[name]
        if queue:
            self.tm.workers.run(name, min(index, len(queue) - 1))

    @rule(name=st.sampled_from(["copy", "io", "write"]))
    def fail_job(self, name):
        if self.tm.workers.queues[name]:
            self.tm.workers.run(name, fail=True, movers=[m for d in self.drivers for m in self.tm.pools.get(d.pool).movers])

    @precondition(lambda self: self.tm.tree.sizes(Tier.DISK).cached)
    @rule(data=st.data())
    def store_drops_a_record(self, data):
        """The store loses a record on its own (its eviction, a corrupt page)."""
        nodes = sorted((n for n in self.tm.tree.nodes() if n.on_disk), key=lambda n: n.node_id)
        node = data.draw(st.sampled_from(nodes))
        key = node.page_key(data.draw(st.integers(0, node.num_pages - 1)))
        self.storage.delete([key]).result()
        self.tm.forget_disk_keys([key])

    @rule()
    def poll(self):
        self.tm.poll()

    @rule()
    def persist(self):
        self.tm.persist()

    @rule()
    def settle_and_check(self):
        self.settle()
        for driver in self.drivers:
            driver.check_outstanding()
        self.settle()  # (unlocked host pages let deferred backups start)
        for driver in self.drivers:
            driver.check_every_tier()

    @rule()
    def restart(self):
        self.settle()
        for driver in self.drivers:
            driver.check_outstanding()
            driver.release_everything()
        self.settle()  # (unlocked host pages let deferred backups start)
        self.tm.close()
        self.storage.close()
        self.start()
        self.tm.check_invariants()

    @invariant()
    def consistent(self):
        if getattr(self, "tm", None) is not None:
            self.tm.check_invariants()


RaceMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiers_race_machine = RaceMachine.TestCase
