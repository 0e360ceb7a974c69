"""The slot-assignment kernels against their torch references and a plain-Python model.

Outputs are pre-filled with poison so that a slot the kernel never writes fails the
comparison. Without CUDA the kernels run in the Triton interpreter (tests/conftest.py).
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import InvalidArgument
from hicache.kernels.slot_alloc import (
    DECODE_BLOCK,
    EXTEND_BLOCK,
    alloc_decode,
    alloc_decode_torch,
    alloc_decode_triton,
    alloc_extend,
    alloc_extend_torch,
    alloc_extend_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7777


def model_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size):
    """Slots segment by segment; ``None`` when the free pages run out."""
    slots, used = [], 0
    for prefix, seq, last in zip(prefix_lens, seq_lens, last_loc, strict=True):
        new_page_start = prefix
        while new_page_start < seq and new_page_start % page_size:  # segment 1: the prefix's last page
            slots.append(last + 1 + new_page_start - prefix)
            new_page_start += 1
        for pos in range(new_page_start, seq):  # segments 2 and 3: new pages
            if pos % page_size == 0:
                if used == len(free_pages):
                    return None
                page = free_pages[used]
                used += 1
            slots.append(page * page_size + pos % page_size)
    return slots, used


def model_decode(seq_lens, last_loc, free_pages, page_size):
    slots, used = [], 0
    for seq, last in zip(seq_lens, last_loc, strict=True):
        if (seq - 1) % page_size:
            slots.append(last + 1)
        elif used == len(free_pages):
            return None
        else:
            slots.append(free_pages[used] * page_size)
            used += 1
    return slots, used


def last_locs(lens, page_size, rng, aligned=-1):
    """A slot consistent with each length (the slot of position len - 1), for lengths that
    end inside a page; ``aligned`` otherwise."""
    return [rng.randrange(1000, 2000) * page_size + (n - 1) % page_size if n % page_size else aligned for n in lens]


def tensor(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def poison(n):
    return torch.full((n,), POISON, dtype=torch.int64, device=DEVICE)


def free_page_layouts(pages):
    """The same page ids as a plain int64 tensor and as a strided int32 view."""
    plain = tensor(pages)
    spread = torch.full((2 * len(pages),), -5, dtype=torch.int32, device=DEVICE)
    spread[::2] = plain.to(torch.int32)
    return {"int64": plain, "strided_int32": spread[::2]}


def run_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size, dtype=torch.int64):
    """Both implementations on poisoned outputs; checks them against the model."""
    expected = model_extend(prefix_lens, seq_lens, last_loc, free_pages.tolist(), page_size)
    assert expected is not None
    args = (tensor(prefix_lens, dtype), tensor(seq_lens, dtype), tensor(last_loc, dtype), free_pages, page_size)
    results = []
    for impl in (alloc_extend_triton, alloc_extend_torch):
        out = poison(len(expected[0]))
        result = impl(*args, out=out)
        assert result.slots is out
        assert (result.slots.tolist(), result.num_pages) == expected, impl.__name__
        results.append(result.slots)
    assert torch.equal(*results)
    return expected


EXTEND_CASES = {
    # page_size, prefix_lens, seq_lens
    "page_size_1": (1, [0, 5, 3, 7], [4, 5, 10, 8]),
    "page_size_3": (3, [0, 2, 3, 4, 7, 5], [2, 3, 9, 5, 20, 5]),
    # A request longer than EXTEND_BLOCK and needing many pages; seq_len == prefix_len
    # at a page boundary and inside a page.
    "page_size_16": (16, [0, 16, 5, 30, 17, 33], [600, 16, 700, 31, 17, 48]),
    "empty_batch": (4, [], []),
    "nothing_to_extend": (4, [3, 8, 0], [3, 8, 0]),
}


@pytest.mark.parametrize("layout", ["int64", "strided_int32"])
@pytest.mark.parametrize("case", sorted(EXTEND_CASES))
def test_alloc_extend_matches_reference_and_model(case, layout):
    page_size, prefix_lens, seq_lens = EXTEND_CASES[case]
    rng = random.Random(case)
    needed = sum(-(-s // page_size) - -(-p // page_size) for p, s in zip(prefix_lens, seq_lens, strict=True))
    pages = rng.sample(range(1, 3 * needed + 10), needed + 3)  # unsorted, gaps, spare pages
    free_pages = free_page_layouts(pages)[layout]
    slots, num_pages = run_extend(prefix_lens, seq_lens, last_locs(prefix_lens, page_size, rng), free_pages, page_size)
    assert num_pages == needed
    if case == "page_size_16":
        assert max(s - p for p, s in zip(prefix_lens, seq_lens, strict=True)) > EXTEND_BLOCK


def test_alloc_extend_segments_on_the_docstring_example():
    slots, num_pages = run_extend([6], [17], [41], tensor([7, 3, 9, 5]), 4)
    assert slots == [42, 43, 28, 29, 30, 31, 12, 13, 14, 15, 36] and num_pages == 3


def test_alloc_extend_ignores_last_loc_for_page_aligned_prefixes():
    free_pages = tensor([5, 2])
    junk = run_extend([0, 4], [3, 6], [123456, -99], free_pages, 4)
    assert junk == run_extend([0, 4], [3, 6], [-1, -1], free_pages, 4)


def test_alloc_extend_int32_inputs_and_a_large_batch():
    rng = random.Random(7)
    page_size = 3
    prefix_lens = [rng.randrange(0, 12) for _ in range(300)]
    seq_lens = [p + rng.randrange(0, 5) for p in prefix_lens]
    needed = sum(-(-s // page_size) - -(-p // page_size) for p, s in zip(prefix_lens, seq_lens, strict=True))
    free_pages = tensor(rng.sample(range(10_000), needed), torch.int32)
    run_extend(prefix_lens, seq_lens, last_locs(prefix_lens, page_size, rng), free_pages, page_size, torch.int32)


def test_alloc_extend_dispatcher_uses_the_device_implementation():
    args = (tensor([2, 0]), tensor([9, 4]), tensor([17, -1]), tensor([5, 8, 6]), 4)
    slots, num_pages = alloc_extend(*args)
    assert slots.tolist() == [18, 19, 20, 21, 22, 23, 32, 24, 25, 26, 27] and num_pages == 3


@st.composite
def extend_batches(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    lens = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=6))
    prefix_lens = [p for p, _ in lens]
    seq_lens = [p + e for p, e in lens]
    needed = sum(-(-s // page_size) - -(-p // page_size) for p, s in zip(prefix_lens, seq_lens, strict=True))
    pages = draw(st.lists(st.integers(0, 10_000), min_size=needed, max_size=needed + 2, unique=True))
    last_loc = [
        draw(st.integers(0, 10_000)) * page_size + (p - 1) % page_size if p % page_size else -1 for p in prefix_lens
    ]
    return prefix_lens, seq_lens, last_loc, pages, page_size


@settings(max_examples=50, deadline=None)
@given(extend_batches(), st.sampled_from(["int64", "strided_int32"]))
def test_alloc_extend_random_batches(batch, layout):
    prefix_lens, seq_lens, last_loc, pages, page_size = batch
    run_extend(prefix_lens, seq_lens, last_loc, free_page_layouts(pages)[layout], page_size)


def run_decode(seq_lens, last_loc, free_pages, page_size, dtype=torch.int64):
    expected = model_decode(seq_lens, last_loc, free_pages.tolist(), page_size)
    assert expected is not None
    results = []
    for impl in (alloc_decode_triton, alloc_decode_torch):
        out = poison(len(seq_lens))
        result = impl(tensor(seq_lens, dtype), tensor(last_loc, dtype), free_pages, page_size, out=out)
        assert result.slots is out
        assert (result.slots.tolist(), result.num_pages) == expected, impl.__name__
        results.append(result.slots)
    assert torch.equal(*results)
    return expected


@pytest.mark.parametrize("layout", ["int64", "strided_int32"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_alloc_decode_matches_reference_and_model(page_size, layout):
    rng = random.Random(page_size)
    # Larger than DECODE_BLOCK, so the kernel runs several programs.
    seq_lens = [rng.randrange(1, 4 * page_size + 2) for _ in range(DECODE_BLOCK + 37)]
    last_loc = last_locs([s - 1 for s in seq_lens], page_size, rng, aligned=-1)
    needed = sum((s - 1) % page_size == 0 for s in seq_lens)
    free_pages = free_page_layouts(rng.sample(range(1, 10 * needed), needed + 1))[layout]
    slots, num_pages = run_decode(seq_lens, last_loc, free_pages, page_size)
    assert num_pages == needed


def test_alloc_decode_small_cases():
    assert run_decode([], [], tensor([3]), 4) == ([], 0)
    assert run_decode([5, 3, 1, 8], [-1, 21, -1, 46], tensor([7, 3, 9]), 4) == ([28, 22, 12, 47], 2)
    assert run_decode([2, 3], [40, 41], tensor([], torch.int32), 4) == ([41, 42], 0)


def test_alloc_decode_dispatcher_uses_the_device_implementation():
    assert alloc_decode(tensor([5, 2]), tensor([-1, 8]), tensor([6]), 4).slots.tolist() == [24, 9]


@settings(max_examples=50, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 3, 16]),
    seq_lens=st.lists(st.integers(1, 40), max_size=8),
    data=st.data(),
)
def test_alloc_decode_random_batches(page_size, seq_lens, data):
    needed = sum((s - 1) % page_size == 0 for s in seq_lens)
    pages = data.draw(st.lists(st.integers(0, 10_000), min_size=needed, max_size=needed + 2, unique=True))
    last_loc = [
        -1 if (s - 1) % page_size == 0 else data.draw(st.integers(0, 10_000)) * page_size + (s - 2) % page_size
        for s in seq_lens
    ]
    layout = data.draw(st.sampled_from(["int64", "strided_int32"]))
    run_decode(seq_lens, last_loc, free_page_layouts(pages)[layout], page_size)


EXTEND_ERRORS = {
    # prefix_lens, seq_lens, last_loc, free_pages, page_size; page_size 4 unless given
    "too_few_free_pages": ([0, 2], [4, 9], [-1, 5], [1, 2], 4),
    "no_free_pages": ([0], [1], [-1], [], 4),
    "seq_len_below_prefix_len": ([4, 6], [8, 5], [-1, 5], [1, 2, 3], 4),
    "negative_prefix_len": ([-1], [3], [-1], [1], 4),
    "last_loc_at_wrong_offset": ([2], [5], [6], [1], 4),
    "last_loc_missing": ([2], [5], [-1], [1], 4),
    "negative_page_id": ([0], [3], [-1], [-2], 4),
    "mismatched_lengths": ([0, 0], [3], [-1], [1], 4),
    "page_size_zero": ([0], [3], [-1], [1], 0),
    "page_size_not_int": ([0], [3], [-1], [1], 4.0),
}


@pytest.mark.parametrize("impl", [alloc_extend_triton, alloc_extend_torch])
@pytest.mark.parametrize("case", sorted(EXTEND_ERRORS))
def test_alloc_extend_rejects_bad_batches_before_writing(impl, case):
    prefix_lens, seq_lens, last_loc, pages, page_size = EXTEND_ERRORS[case]
    out = poison(max(sum(seq_lens) - sum(prefix_lens), 0))
    with pytest.raises(InvalidArgument):
        impl(tensor(prefix_lens), tensor(seq_lens), tensor(last_loc), tensor(pages), page_size, out=out)
    assert (out == POISON).all()


@pytest.mark.parametrize("impl", [alloc_extend_triton, alloc_extend_torch])
def test_alloc_extend_rejects_bad_tensors(impl):
    ok = tensor([0])
    with pytest.raises(InvalidArgument):
        impl(ok.float(), tensor([3]), ok, tensor([1]), 4)
    with pytest.raises(InvalidArgument):
        impl(ok.reshape(1, 1), tensor([[3]]), ok.reshape(1, 1), tensor([1]), 4)
    with pytest.raises(InvalidArgument):
        impl(ok, tensor([3]), ok, tensor([1]), 4, out=poison(2))  # wrong length
    with pytest.raises(InvalidArgument):
        impl(ok, tensor([3]), ok, tensor([1]), 4, out=poison(3).int())


DECODE_ERRORS = {
    # seq_lens, last_loc, free_pages, page_size
    "too_few_free_pages": ([1, 5, 2], [-1, -1, 40], [3], 4),
    "zero_seq_len": ([0], [-1], [3], 4),
    "last_loc_at_wrong_offset": ([3], [40], [3], 4),
    "last_loc_missing": ([2], [-1], [3], 4),
    "mismatched_lengths": ([1, 2], [-1], [3], 4),
    "page_size_zero": ([1], [-1], [3], 0),
}


@pytest.mark.parametrize("impl", [alloc_decode_triton, alloc_decode_torch])
@pytest.mark.parametrize("case", sorted(DECODE_ERRORS))
def test_alloc_decode_rejects_bad_batches_before_writing(impl, case):
    seq_lens, last_loc, pages, page_size = DECODE_ERRORS[case]
    out = poison(len(seq_lens))
    with pytest.raises(InvalidArgument):
        impl(tensor(seq_lens), tensor(last_loc), tensor(pages), page_size, out=out)
    assert (out == POISON).all()
