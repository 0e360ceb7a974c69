"""The reference engine through every tier: logits bit-identical to caching disabled.

One conversation goes on turn after turn while other requests push its pages out of
the device (write-through keeps them on host), then out of the host (to disk), then the
daemon restarts. Each turn is generated twice — through hicache and by an engine with
caching disabled — and every generated token's logits must be the same bits.
"""

import numpy as np
import pytest

from daemon_util import DaemonProcess
from engine_util import same_generation
from hicache.client import CacheClient
from hicache.engine.reference import ModelConfig, ReferenceEngine, TinyTransformer

CONFIG = ModelConfig(seed=3)


def prompt(rng, n):
    return rng.integers(0, CONFIG.vocab, size=n).tolist()


@pytest.fixture(scope="module")
def model():
    return TinyTransformer(CONFIG)




def test_logits_are_bit_identical_through_every_tier(tmp_path, model):
    daemon = DaemonProcess(tmp_path, host={"ratio": 2.0}, disk={"capacity_bytes": 64 << 20}).start()
    cached = ReferenceEngine(model, num_pages=40,
                             client=CacheClient(daemon.endpoint, timeout_s=2.0, reconnect_interval_s=0.1))
    plain = ReferenceEngine(model, num_pages=200)
    rng = np.random.default_rng(0)
    try:
        conversation = prompt(rng, 90)
        seen = set()

        def turn(new_tokens):
            nonlocal conversation
            conversation = conversation + prompt(rng, new_tokens)
            got = cached.generate(conversation, 8)
            want = plain.generate(conversation, 8)
            same_generation(got, want)
            assert want.cached_tokens == 0
            conversation = conversation + got.tokens
            seen.update(tier for tier, n in got.from_tier.items() if n)
            return got

        first = turn(0)
        assert first.cached_tokens == 0
        assert turn(20).from_tier["device"] > 0

        def crowd(n):  # other requests that need the device (and, in turn, the host) pages
            for _ in range(n):
                cached.generate(prompt(rng, 200), 2)

        crowd(4)  # 4 x 13 pages > the 40-page device pool: the conversation is least recent
        cached.client.flush()
        host_turn = turn(20)
        assert host_turn.from_tier["host"] > 0, host_turn.from_tier
        crowd(8)  # and now through the 80-page host pool as well
        cached.client.flush()
        disk_turn = turn(20)
        assert disk_turn.from_tier["disk"] > 0, disk_turn.from_tier
        cached.client.flush()
        daemon.stop()
        daemon.start()
        restarted = turn(20)  # the client reconnects; the prefix comes back from disk
        assert restarted.cached_tokens > 0 and restarted.from_tier["disk"] > 0, restarted.from_tier
        assert seen >= {"device", "host", "disk"}
        cached.client.check()
    finally:
        cached.close()
        plain.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0
