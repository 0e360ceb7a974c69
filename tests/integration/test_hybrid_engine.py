"""The hybrid reference engine (linear attention + sliding window + full attention)
through every tier: logits bit-identical to caching disabled.

Checkpoints come every 4 pages and at the end of each turn; prompts are prefilled in
chunks. Conversations branch at a checkpoint, between two (the hit falls back to the one
before), and before the first (no hit at all: KV without its state is no use); then the
conversation's pages are pushed from the device to host, to disk, and the daemon
restarts. Every request is generated twice — through hicache and with caching disabled
— and every generated token's logits must be the same bits.
"""

import numpy as np
import pytest

from daemon_util import DaemonProcess
from engine_util import same_generation
from hicache.client import CacheClient
from hicache.engine.hybrid_engine import HybridReferenceEngine
from hicache.engine.hybrid_reference import HybridConfig, HybridTransformer

CONFIG = HybridConfig(seed=5, page_size=16, window=24)
PS = CONFIG.page_size
CHUNK = 2 * PS
EVERY = 4  # pages between two checkpoints


def prompt(rng, n):
    return rng.integers(0, CONFIG.vocab, size=n).tolist()


@pytest.fixture(scope="module")
def model():
    return HybridTransformer(CONFIG)




def test_hybrid_logits_are_bit_identical_through_every_tier_and_branch(tmp_path, model):
    daemon = DaemonProcess(tmp_path, host={"ratio": 2.0}, disk={"capacity_bytes": 64 << 20}).start()
    cached = HybridReferenceEngine(model, num_pages=48,
                                   client=CacheClient(daemon.endpoint, timeout_s=2.0, reconnect_interval_s=0.1))
    plain = HybridReferenceEngine(model, num_pages=200)
    rng = np.random.default_rng(1)
    seen = set()

    def run(tokens, new=6, chunk=CHUNK):
        got = cached.generate(tokens, new, chunk=chunk, checkpoint_every=EVERY)
        want = plain.generate(tokens, new, chunk=chunk)
        same_generation(got, want)
        assert want.cached_tokens == 0
        seen.update(tier for tier, n in got.from_tier.items() if n)
        return got

    try:
        base = prompt(rng, 100)
        first = run(base)
        assert first.cached_tokens == 0
        # Prefill chunks end at pages 2, 4, 6; the turn's K / V ends in page 7 (105 tokens):
        # checkpoints after 4 pages (every 4) and 6 (the last boundary reached).
        assert first.checkpoints == [4, 6]
        assert run(base[: 4 * PS] + prompt(rng, 30)).cached_tokens == 4 * PS  # at a checkpoint
        assert run(base[: 5 * PS + 3] + prompt(rng, 30)).cached_tokens == 4 * PS  # after one, before the next
        assert run(base[: 3 * PS] + prompt(rng, 30)).cached_tokens == 0  # before the first
        # Chunks that end no page (21 tokens: 21, 42, .., 90): a checkpoint only where a
        # decode step ends a page (96 tokens), none after 4 pages.
        odd = run(prompt(rng, 90), new=10, chunk=PS + 5)
        assert odd.checkpoints == [6]

        conversation = base + first.tokens

        def turn(new_tokens):
            nonlocal conversation
            conversation = conversation + prompt(rng, new_tokens)
            got = run(conversation)
            conversation = conversation + got.tokens
            return got

        assert turn(20).from_tier["device"] > 0

        def crowd(n):  # other requests that need the device (and, in turn, the host) pages
            for _ in range(n):
                cached.generate(prompt(rng, 160), 2, chunk=CHUNK, checkpoint_every=EVERY)

        crowd(4)
        cached.client.flush()
        host_turn = turn(20)
        assert host_turn.from_tier["host"] > 0, host_turn.from_tier
        crowd(10)
        cached.client.flush()
        disk_turn = turn(20)
        assert disk_turn.from_tier["disk"] > 0, disk_turn.from_tier
        cached.client.flush()
        daemon.stop()
        daemon.start()
        restarted = turn(20)  # the client reconnects; prefix and checkpoint come back from disk
        assert restarted.cached_tokens > 0 and restarted.from_tier["disk"] > 0, restarted.from_tier
        assert seen >= {"device", "host", "disk"}
        cached.client.check()
    finally:
        cached.close()
        plain.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0
