"""The hybrid reference model (issue 20): chunked prefill, checkpoints and the sliding
window — what a cache of a hybrid model must restore, and what it may drop."""

import numpy as np
import pytest
import torch

from hicache.engine.hybrid_reference import HybridCache, HybridConfig, HybridTransformer

CONFIG = HybridConfig(seed=2)


@pytest.fixture(scope="module")
def model():
    return HybridTransformer(CONFIG)


def prompt(seed, n):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab, n).tolist()


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), "logits differ"


def test_chunked_prefill_is_bit_identical(model):
    tokens = prompt(0, 70)
    whole = model.prefill(tokens, HybridCache.empty(CONFIG))
    for chunk in (1, 5, 16, 33):
        same(model.prefill(tokens, HybridCache.empty(CONFIG), chunk), whole)


@pytest.mark.parametrize("at_page", [3, 4])
def test_resuming_from_a_checkpoint_with_the_window_cut_is_bit_identical(model, at_page):
    """A checkpoint at a page boundary, the swa layer's pages before the window dropped:
    conversations branching at the checkpoint, and going on past it, generate exactly
    what runs from scratch do."""
    base = prompt(1, at_page * CONFIG.page_size)
    cache = HybridCache.empty(CONFIG)
    model.prefill(base, cache)
    saved = cache.checkpoint()
    resumed_len = []
    for branch in (3, 17, 40):
        tokens = base + prompt(100 + branch, branch)
        resumed = saved.resume(CONFIG)
        resumed_len.append(len(resumed.keys[0]))
        got = model.generate(tokens, 6, resumed, chunk=7)
        want = model.generate(tokens, 6, HybridCache.empty(CONFIG))
        assert got[0] == want[0]
        same(got[1], want[1])
    # The window cut was real: the swa layer kept fewer positions than the full one.
    assert all(n < at_page * CONFIG.page_size for n in resumed_len)
    assert len(saved.keys[1]) == at_page * CONFIG.page_size


def test_a_prefix_without_its_state_is_wrong(model):
    """The KV of the attention layers alone is not a usable prefix: without the linear
    layer's state after exactly those tokens the logits change (a hit must end at a
    checkpoint)."""
    base = prompt(2, 2 * CONFIG.page_size)
    tokens = base + prompt(3, 9)
    cache = HybridCache.empty(CONFIG)
    model.prefill(base, cache)
    stateless = cache.resume(CONFIG)
    stateless.conv.zero_()
    stateless.temporal.zero_()
    want = model.prefill(tokens, HybridCache.empty(CONFIG))[len(base):]
    got = model.prefill(tokens, stateless)
    assert not torch.equal(got[-1], want[-1])
    # ... and a state from another length of the same tokens is wrong too.
    shorter = HybridCache.empty(CONFIG)
    model.prefill(base[:-1], shorter)
    mixed = cache.resume(CONFIG)
    mixed.temporal = shorter.temporal.clone()
    assert not torch.equal(model.prefill(tokens, mixed)[-1], want[-1])


def test_the_window_is_needed_within_itself(model):
    """Dropping a page the window still covers is a bug the model refuses, not garbage."""
    base = prompt(4, 3 * CONFIG.page_size)
    cache = HybridCache.empty(CONFIG)
    model.prefill(base, cache)
    broken = cache.resume(CONFIG)
    cut = CONFIG.page_size
    broken.keys[0] = broken.keys[0][cut:]
    broken.values[0] = broken.values[0][cut:]
    broken.first[0] += cut
    with pytest.raises(RuntimeError, match="swa layer needs"):
        model.step(5, broken)


def test_the_spec_describes_the_three_layer_kinds():
    spec = CONFIG.spec
    assert spec.state_bytes == (CONFIG.conv_kernel - 1) * CONFIG.hidden * 4 + CONFIG.num_heads * CONFIG.head_dim ** 2 * 4
    assert spec.layers[1].sliding_window == CONFIG.window and spec.layers[2].sliding_window == 0
    assert HybridConfig(seed=2, window=32).spec.fingerprint != spec.fingerprint
