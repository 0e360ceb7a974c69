"""End to end on the CPU data plane: the tier manager over a shared-memory device pool, a
host pool and LMDB in a temporary directory, all small enough that every tier evicts.

An engine fills every page it computes with bytes derived from the page's key. Random
sequences of prefill (match, alloc, compute, insert), match + lock + load, unlock,
release, eviction, flush and daemon restart run against it; after every step the tier
manager's invariants hold, every page a match or a load hands out holds exactly the
bytes inserted for its key once its tickets are waited on, and after each flush every
page of every tier — device, host, disk — does too.

Transfers settle between steps; tests/integration/test_tiers_stress.py runs steps that
race them. What a step draws never depends on the tiers' state: the order in which
transfers complete (copy threads, the disk writer) can change what the tiers hold after
a flush, and hypothesis replays an example expecting the same draws — so the driver's
lists grow with every call whatever its outcome (see ``tiers_util.Driver``).
"""

import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierConfig, TierManager
from hicache.tree import Tier
from tiers_util import BLOCKS, NAMESPACES, SPEC, Driver, Engine, token_sequences

PS = SPEC.page_size
DEVICE_PAGES = 10
HOST_PAGES = 7
DISK_PAGES = 14

sequences = token_sequences()


class TiersMachine(RuleBasedStateMachine):
    @initialize(
        write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        disk_policy=st.sampled_from(["write_through", "write_back"]),
        copy_threads=st.sampled_from([1, 2]),
        capacity=st.sampled_from(["inclusive", "exclusive"]),
    )
    def setup(self, write_policy, disk_policy, copy_threads, capacity):
        self.dir = tempfile.mkdtemp(prefix="hicache-tiers-")
        self.config = TierConfig(write_policy=write_policy, disk_policy=disk_policy, copy_threads=copy_threads,
                                 capacity=capacity if disk_policy == "write_back" else "inclusive")
        self.engine = Engine(DEVICE_PAGES)
        self.storage = None
        self.tm = None
        self.driver = None
        self.start()

    def start(self):
        self.storage = LmdbBackend(self.dir, capacity_bytes=DISK_PAGES * SPEC.host_page_bytes)
        self.tm = TierManager(SPEC, host_pages=HOST_PAGES, storage=self.storage, config=self.config)
        for ns in NAMESPACES:
            self.tm.add_namespace(ns)
        handle = self.tm.register_pool(0, [self.engine.pool])
        self.tm.rebuild_from_storage()
        seen = self.driver.seen if getattr(self, "driver", None) else []
        self.driver = Driver(self.tm, self.engine, handle)
        self.driver.seen = seen

    def teardown(self):
        if getattr(self, "tm", None) is not None:
            self.tm.close()
            self.storage.close()
            self.engine.close()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=sequences)
    def prefill(self, ns, tokens):
        self.driver.prefill(ns, tokens)

    @precondition(lambda self: self.driver.seen)
    @rule(data=st.data(), turn=st.lists(st.integers(0, 2), min_size=1, max_size=2))
    def next_turn(self, data, turn):
        """A conversation goes on: an earlier sequence plus new blocks."""
        ns, tokens = data.draw(st.sampled_from(self.driver.seen))
        whole = tokens[: len(tokens) // PS * PS]
        self.driver.prefill(ns, whole + [t for b in turn for t in BLOCKS[b]])

    @precondition(lambda self: self.driver.seen)
    @rule(data=st.data(), keep_lock=st.booleans(), pressure=st.sampled_from([(), ("device",), ("device", "host")]))
    def revisit(self, data, keep_lock, pressure):
        """An earlier sequence comes back, from wherever its pages are now — after the
        device (and the host) had to make room, so that it comes from host or disk."""
        ns, tokens = data.draw(st.sampled_from(self.driver.seen))
        for tier in pressure:
            if tier == "device":
                self.tm.evict(Tier.DEVICE, DEVICE_PAGES, 0)
            else:
                self.tm.flush()  # let write-backs land, then empty the host too
                self.tm.evict(Tier.HOST, HOST_PAGES)
        self.driver.match_and_load(ns, tokens, keep_lock)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=sequences, keep_lock=st.booleans())
    def match_and_load(self, ns, tokens, keep_lock):
        self.driver.match_and_load(ns, tokens, keep_lock)

    @precondition(lambda self: self.driver.locks)
    @rule(data=st.data())
    def unlock(self, data):
        self.driver.unlock(data.draw(st.integers(0, len(self.driver.locks) - 1)))

    @rule(num_pages=st.integers(1, 3))
    def hold_private(self, num_pages):
        self.driver.hold_private(num_pages)

    @precondition(lambda self: self.driver.private)
    @rule()
    def release_private(self):
        self.driver.release_private()

    @rule(tier=st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.DISK]), num_pages=st.integers(1, 8))
    def evict(self, tier, num_pages):
        self.tm.evict(tier, num_pages, 0 if tier == Tier.DEVICE else None)

    @rule(ns=st.sampled_from(NAMESPACES))
    def purge(self, ns):
        """A tenant's namespace forgotten: every page of it that no lock holds leaves
        every tier (its disk records with it: a restart brings none back); what stays is
        exactly the locked paths', and the other namespaces keep every page."""
        others = {n.node_id: dict(n.residency) for n in self.tm.tree.nodes() if n.namespace != ns}
        out = self.tm.purge({ns})
        left = [n for n in self.tm.tree.nodes() if n.namespace == ns and n.residency]
        assert all(n.lock_total > 0 for n in left), [(n.node_id, n.residency) for n in left]
        assert out.left == sum(n.num_pages for n in left)
        assert {n.node_id: dict(n.residency) for n in self.tm.tree.nodes() if n.namespace != ns} == others
        if not left:
            self.tm.flush()
            assert not any(meta.namespace == ns for _, meta in self.storage.iter_metadata()), "a record stayed"

    @rule()
    def flush_and_check_every_tier(self):
        self.driver.check_every_tier()

    @rule()
    def restart(self):
        """The daemon goes away and comes back: device contents are forgotten (the engine
        keeps its pool), disk pages come back through the metadata."""
        self.driver.release_everything()
        self.tm.close()
        self.storage.close()
        self.start()
        self.tm.check_invariants()
        for node in self.tm.tree.nodes():
            assert node.on_disk and node.host_pages is None and not node.device_pools

    @invariant()
    def consistent(self):
        if getattr(self, "tm", None) is not None:
            self.tm.check_invariants()
            # Let every transfer land before the next step (each step starts settled;
            # tests/integration/test_tiers_stress.py covers steps racing transfers).
            self.tm.flush()
            self.tm.check_invariants()


TiersMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiers_state_machine = TiersMachine.TestCase
