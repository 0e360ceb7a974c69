"""Test helpers for the reference engines."""

import torch


def same_generation(a, b) -> None:
    """Two generations chose the same tokens from bit-identical logits."""
    assert a.tokens == b.tokens
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y), "logits differ"
