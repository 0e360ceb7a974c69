"""A hybrid model's cache under random use: state checkpoints and sliding windows.

The spec mixes the three layer kinds (a recurrent state, an SWA layer, a full-attention
layer). An engine fills every page with bytes derived from its page key and every state
with bytes derived from the key of the page it follows (the state after a prefix is a
function of the prefix). Random prefills (match, load with a state slot, compute the
rest, insert with checkpoints at drawn page counts), evictions from every tier, flushes
and restarts run against a tier manager over LMDB. After every step:

* the manager's invariants hold — among them no checkpoint without its live node, no
  host slot, device slot (a pool that lends some) or disk record without its
  checkpoint, no SWA bytes on host or disk for a page outside its node's window;
* every hit ends at a node with a checkpoint (or is empty), and every load that
  reports its state delivered exactly the state after the hit and, for every page of
  the hit, the full-attention layer's bytes, and the SWA layer's bytes of the window.
"""

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache.engine.kv_pool import export_kv_pool
from hicache.keys import namespace_id, page_keys
from hicache.spec import KVSpec, MHALayer, StateLayer
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierConfig, TierManager
from hicache.tree import Tier

SPEC = KVSpec(page_size=2, model="hybrid-machine", layers=(
    StateLayer(conv_state_shape=(2, 4), temporal_state_shape=(2, 2, 2), conv_dtype="float32"),
    MHALayer(num_kv_heads=1, head_dim=4, sliding_window=4),
    MHALayer(num_kv_heads=1, head_dim=4)))
PS = SPEC.page_size
W = SPEC.window_pages
NS = namespace_id(SPEC.fingerprint, "hybrid")
DEVICE_PAGES = 12
HOST_PAGES = 8
DISK_PAGES = 20
ROWS = 2  # state slots 1..2: the request's; 3..: scratch for the checkpoints it offers
SCRATCH = 6
BLOCKS = [[b] * PS for b in range(3)]

sequences = st.lists(st.integers(0, 2), min_size=1, max_size=7).map(lambda bs: [t for b in bs for t in BLOCKS[b]])


def _bytes(seed: bytes, n: int) -> bytes:
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


class HybridEngine:
    def __init__(self, checkpoint_slots: int = 0) -> None:
        self.exported = export_kv_pool(SPEC, DEVICE_PAGES, num_state_slots=ROWS + SCRATCH,
                                       checkpoint_slots=checkpoint_slots)
        self.pool = self.exported.pool
        self.buf = self.pool.buffer.numpy()
        self.tokens = self.pool.layout.token_regions
        self.states = self.pool.layout.state_regions

    def _regions(self, page: int):
        for r in self.tokens:
            yield r, slice(r.offset + page * r.unit_bytes, r.offset + (page + 1) * r.unit_bytes)

    def write_page(self, page: int, key: bytes) -> None:
        for r, span in self._regions(page):
            self.buf[span] = np.frombuffer(_bytes(key + bytes([r.layer, ord(r.component)]), r.unit_bytes), np.uint8)

    def check_page(self, page: int, key: bytes, swa: bool) -> None:
        for r, span in self._regions(page):
            if SPEC.is_swa(r.layer) and not swa:
                continue
            want = _bytes(key + bytes([r.layer, ord(r.component)]), r.unit_bytes)
            assert self.buf[span].tobytes() == want, (page, r.layer, r.component)

    def _state_spans(self, slot: int):
        for r in self.states:
            yield slice(r.offset + slot * r.unit_bytes, r.offset + (slot + 1) * r.unit_bytes)

    def write_state(self, slot: int, key: bytes) -> None:
        for i, span in enumerate(self._state_spans(slot)):
            self.buf[span] = np.frombuffer(_bytes(key + bytes([i, 0xEE]), span.stop - span.start), np.uint8)

    def state(self, slot: int) -> bytes:
        return b"".join(self.buf[span].tobytes() for span in self._state_spans(slot))

    def expected_state(self, key: bytes) -> bytes:
        return b"".join(_bytes(key + bytes([i, 0xEE]), span.stop - span.start)
                        for i, span in enumerate(self._state_spans(1)))

    def close(self) -> None:
        self.exported.close()


class HybridMachine(RuleBasedStateMachine):
    @initialize(write_policy=st.sampled_from(["write_through", "write_back"]),
                disk_policy=st.sampled_from(["write_through", "write_back"]),
                host_checkpoints=st.sampled_from([1, 3, 16]), device_checkpoints=st.sampled_from([0, 2]))
    def setup(self, write_policy, disk_policy, host_checkpoints, device_checkpoints):
        self.dir = tempfile.mkdtemp(prefix="hicache-hybrid-")
        self.config = TierConfig(write_policy=write_policy, disk_policy=disk_policy,
                                 host_checkpoints=host_checkpoints)
        self.engine = HybridEngine(device_checkpoints)
        self.hits = 0
        self.seen: list[list[int]] = []  # every prompt prefilled (whatever came of it)
        self.start()

    def start(self):
        self.storage = LmdbBackend(self.dir, capacity_bytes=DISK_PAGES * SPEC.host_page_bytes)
        self.tm = TierManager(SPEC, host_pages=HOST_PAGES, storage=self.storage, config=self.config)
        self.tm.add_namespace(NS)
        self.tm.register_pool(0, [self.engine.pool])
        self.tm.rebuild_from_storage()

    def teardown(self):
        if getattr(self, "tm", None) is not None:
            self.tm.close()
            self.storage.close()
            self.engine.close()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def _load(self, tokens):
        """Match and load with state slot 1; check what came. Returns (node, pages)."""
        tm, engine = self.tm, self.engine
        hit = tm.match(NS, tokens, 0).match
        node = hit.node
        if node.parent is None:
            return node, np.empty(0, np.int32)
        assert node.checkpoint is not None, "a hit ends at a node without a checkpoint"
        tm.lock(node, 0)
        engine.write_state(1, b"stale state")
        loaded = tm.wait(tm.load(node, 0, state_slot=1))
        for ticket in loaded.wait:
            waiter = tm.pools.get(0).counters.waiter()
            for layer in range(SPEC.num_layers):
                waiter.wait_layer(ticket, layer, timeout_s=30)
            waiter.close()
        if not loaded.state:  # (a checkpoint lost meanwhile: the engine starts over)
            return node, None
        keys = page_keys(NS, tokens, PS)
        n = len(loaded.device_pages)
        assert n == hit.num_pages
        for i, page in enumerate(loaded.device_pages):
            engine.check_page(int(page), keys[i], swa=i >= n - W)
        assert engine.state(1) == engine.expected_state(keys[n - 1])
        self.hits += 1
        return node, loaded.device_pages

    @rule(tokens=sequences, marks=st.sets(st.integers(0, 7), max_size=3))
    def prefill(self, tokens, marks):
        self.seen.append(tokens)
        tm, engine = self.tm, self.engine
        node, prefix = self._load(tokens)
        if prefix is None:
            prefix = np.empty(0, np.int32)
        try:
            total = len(tokens) // PS
            new = tm.alloc(0, total - len(prefix))
            if new is None:
                return
            pages = np.concatenate((prefix, new)).astype(np.int32)
            keys = page_keys(NS, tokens, PS)
            for i in range(len(prefix), total):
                engine.write_page(int(pages[i]), keys[i])
            result = tm.insert(NS, tokens, 0, pages)
            for i in range(max(0, total - W), total):  # (the engine reads on through the canonical pages)
                engine.check_page(int(result.device_pages[i]), keys[i], swa=True)
            offers = []
            # Checkpoints where drawn, and at the end unless told not to (mark 0).
            ends = marks - {0} | ({total} if 0 not in marks else set())
            for slot, n in enumerate(sorted(m for m in ends if len(prefix) < m <= total), ROWS + 1):
                engine.write_state(slot, keys[n - 1])
                offers.append((n, slot))
            tm.wait(tm.checkpoint(result.node, 0, offers))
        finally:
            if node.parent is not None:
                tm.unlock(node, 0)

    @rule(tokens=sequences)
    def match_and_load(self, tokens):
        node, _ = self._load(tokens)
        if node.parent is not None:
            self.tm.unlock(node, 0)

    @rule(index=st.integers(0, 1 << 16), cut=st.integers(0, 7), more=sequences, marks=st.sets(st.integers(0, 7), max_size=3))
    def continue_or_branch(self, index, cut, more, marks):
        """A prompt that shares a prefix with one seen before: cut after ``cut`` pages
        (0: none — the whole prompt, a next turn), then more tokens."""
        if self.seen:
            before = self.seen[index % len(self.seen)]
            self.prefill((before[: cut * PS] if cut else before) + more, marks)

    @rule(tier=st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.DISK]), pages=st.integers(1, 8))
    def evict(self, tier, pages):
        self.tm.evict(tier, pages, 0 if tier == Tier.DEVICE else None)

    @rule()
    def flush(self):
        self.tm.flush()

    @rule()
    def restart(self):
        self.tm.close()
        self.storage.close()
        self.start()

    @invariant()
    def invariants_hold(self):
        if getattr(self, "tm", None) is not None:
            self.tm.flush()
            self.tm.check_invariants()


TestHybrid = HybridMachine.TestCase
TestHybrid.settings = settings(max_examples=100, stateful_step_count=25, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])
