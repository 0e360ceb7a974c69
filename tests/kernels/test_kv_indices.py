"""The CSR kv_indices kernels against their torch references and a plain-Python model.

Outputs are pre-filled with poison so that an entry the kernel never writes fails the
comparison. Without CUDA the kernels run in the Triton interpreter (tests/conftest.py).
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import InvalidArgument
from hicache.kernels.kv_indices import (
    BLOCK,
    build_kv_indices,
    build_kv_indices_torch,
    build_kv_indices_triton,
    build_kv_page_indices,
    build_kv_page_indices_torch,
    build_kv_page_indices_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7777


def model(table, rows, kv_lens, kv_start, page_size=None):
    """(indptr, indices) by a loop; ``page_size`` None for the token variant."""
    indptr, indices = [0], []
    for row, length, start in zip(rows, kv_lens, kv_start, strict=True):
        if page_size is None:
            indices += [table[row][start + j] for j in range(length)]
        else:
            indices += [table[row][start + j * page_size] // page_size for j in range(-(-length // page_size))]
        indptr.append(len(indices))
    return indptr, indices


def tensor(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def random_table(num_rows, max_context_len, rng):
    values = [[rng.randrange(0, 2**31 - 1) for _ in range(max_context_len)] for _ in range(num_rows)]
    return tensor(values, torch.int32)


def run(table, rows, kv_lens, kv_start=None, page_size=None, dtype=torch.int64):
    """Both implementations on poisoned outputs, checked against the model."""
    starts = kv_start if kv_start is not None else [0] * len(rows)
    expected = model(table.tolist(), rows, kv_lens, starts, page_size)
    args = [table, tensor(rows, dtype), tensor(kv_lens, dtype)]
    if page_size is None:
        impls = (build_kv_indices_triton, build_kv_indices_torch)
    else:
        impls = (build_kv_page_indices_triton, build_kv_page_indices_torch)
        args.append(page_size)
    if kv_start is not None:
        args.append(tensor(kv_start, dtype))
    results = []
    for impl in impls:
        out = torch.full((len(expected[1]),), POISON, dtype=torch.int32, device=DEVICE)
        indptr, indices = impl(*args, out=out)
        assert indices is out and indptr.dtype == torch.int32
        assert (indptr.tolist(), indices.tolist()) == expected, impl.__name__
        results.append(indices)
    assert torch.equal(*results)
    return expected


def test_kv_indices_on_the_docstring_example():
    table = torch.zeros(5, 20, dtype=torch.int32, device=DEVICE)
    table[3, :10] = tensor([40, 41, 42, 43, 28, 29, 30, 31, 12, 13])
    table[1, :3] = tensor([20, 21, 22])
    assert run(table, [3, 1], [10, 3]) == ([0, 10, 13], [40, 41, 42, 43, 28, 29, 30, 31, 12, 13, 20, 21, 22])
    assert run(table, [3, 1], [10, 3], page_size=4) == ([0, 3, 4], [10, 7, 3, 5])


@pytest.mark.parametrize("with_start", [False, True])
def test_kv_indices_rows_longer_than_the_block(with_start):
    rng = random.Random(1)
    max_context_len = 2 * BLOCK + 77
    table = random_table(6, max_context_len, rng)
    rows = [2, 0, 5, 2, 1]  # the padding row and a repeated row too
    kv_lens = [max_context_len - 40, 0, BLOCK, 3, BLOCK + 1]
    kv_start = [37, 5, 0, max_context_len - 3, 400] if with_start else None
    if not with_start:
        kv_lens[0] = max_context_len
    run(table, rows, kv_lens, kv_start)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_kv_page_indices(page_size):
    rng = random.Random(page_size)
    max_context_len = BLOCK * page_size + 5 * page_size
    # Non-negative slots whose page is not simply the column's.
    table = random_table(5, max_context_len, rng)
    rows = [4, 1, 1, 0, 3]
    kv_lens = [max_context_len, 1, 2 * page_size + 1, 0, 3 * page_size]
    run(table, rows, kv_lens, page_size=page_size)
    kv_start = [0, 2 * page_size, page_size + 1, 7, max_context_len - 3 * page_size]  # one start not page-aligned
    kv_lens[0] = max_context_len - page_size
    run(table, rows, kv_lens, kv_start, page_size=page_size)


def test_empty_batches_and_empty_runs():
    table = random_table(3, 8, random.Random(2))
    assert run(table, [], []) == ([0], [])
    assert run(table, [], [], [], page_size=4) == ([0], [])
    assert run(table, [1, 2], [0, 0], [8, 0]) == ([0, 0, 0], [])


def test_int32_batch_tensors_and_strided_inputs():
    rng = random.Random(3)
    wide = random_table(4, 50, rng)
    table = wide[:, 10:40]  # rows 50 apart in memory
    run(table, [3, 1, 2], [30, 12, 5], [0, 4, 25], dtype=torch.int32)
    run(table, [3, 1, 2], [30, 12, 5], [0, 4, 25], page_size=4, dtype=torch.int32)
    rows = tensor([0, 3, 0, 1, 0, 2])[1::2]
    lens = tensor([9, 7, 5, 0, 8, 30])[::2]  # [9, 5, 8]
    expected = model(table.tolist(), [3, 1, 2], [9, 5, 8], [0, 0, 0])
    for impl in (build_kv_indices_triton, build_kv_indices_torch):
        indptr, indices = impl(table, rows, lens)
        assert (indptr.tolist(), indices.tolist()) == expected


def test_dispatchers_use_the_device_implementation():
    table = torch.arange(40, dtype=torch.int32, device=DEVICE).reshape(4, 10)
    indptr, indices = build_kv_indices(table, tensor([2, 1]), tensor([3, 2]), tensor([1, 0]))
    assert indptr.tolist() == [0, 3, 5] and indices.tolist() == [21, 22, 23, 10, 11]
    indptr, indices = build_kv_page_indices(table, tensor([3]), tensor([7]), 3, tensor([2]))
    assert indptr.tolist() == [0, 3] and indices.tolist() == [10, 11, 12]


@st.composite
def batches(draw):
    num_rows = draw(st.integers(1, 4))
    max_context_len = draw(st.integers(1, 40))
    runs = []
    for _ in range(draw(st.integers(0, 5))):
        row = draw(st.integers(0, num_rows - 1))
        start = draw(st.integers(0, max_context_len))
        runs.append((row, start, draw(st.integers(0, max_context_len - start))))
    seed = draw(st.integers(0, 2**16))
    return num_rows, max_context_len, runs, seed


@settings(max_examples=50, deadline=None)
@given(batches(), st.sampled_from([None, 1, 2, 3, 16]), st.booleans())
def test_random_batches(batch, page_size, with_start):
    num_rows, max_context_len, runs, seed = batch
    table = random_table(num_rows, max_context_len, random.Random(seed))
    rows = [row for row, _, _ in runs]
    kv_lens = [length + (start if not with_start else 0) for _, start, length in runs]
    kv_start = [start for _, start, _ in runs] if with_start else None
    run(table, rows, kv_lens, kv_start, page_size)


ERRORS = {
    # rows, kv_lens, kv_start; the table is 3 x 8
    "row_past_the_table": ([1, 3], [2, 2], None),
    "negative_row": ([-1], [2], None),
    "run_past_max_context_len": ([1, 2], [4, 9], None),
    "start_plus_len_past_max_context_len": ([1], [4], [5]),
    "negative_len": ([1], [-1], None),
    "negative_start": ([1], [2], [-1]),
    "mismatched_lengths": ([1, 2], [2], None),
    "mismatched_start": ([1, 2], [2, 2], [0]),
}


@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_batches_are_rejected(case, page_size):
    rows, kv_lens, kv_start = ERRORS[case]
    table = torch.zeros(3, 8, dtype=torch.int32, device=DEVICE)
    args = [table, tensor(rows), tensor(kv_lens)]
    if page_size is None:
        impls = (build_kv_indices_triton, build_kv_indices_torch)
    else:
        impls = (build_kv_page_indices_triton, build_kv_page_indices_torch)
        args.append(page_size)
    args.append(None if kv_start is None else tensor(kv_start))
    for impl in impls:
        with pytest.raises(InvalidArgument):
            impl(*args)


@pytest.mark.parametrize("impl", [build_kv_indices_triton, build_kv_indices_torch])
def test_bad_tensors_are_rejected(impl):
    table = torch.zeros(3, 8, dtype=torch.int32, device=DEVICE)
    rows, lens = tensor([1]), tensor([2])
    bad_calls = [
        (table.long(), rows, lens),
        (table[0], rows, lens),
        (table.t(), rows, lens),  # columns not contiguous
        (table, rows.float(), lens),
        (table, rows, lens.reshape(1, 1)),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgument):
            impl(*call)
    with pytest.raises(InvalidArgument):
        impl(table, rows, lens, out=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(InvalidArgument):
        impl(table, rows, lens, out=torch.zeros(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("page_size", [0, -4, 2.0])
@pytest.mark.parametrize("impl", [build_kv_page_indices_triton, build_kv_page_indices_torch])
def test_bad_page_sizes_are_rejected(impl, page_size):
    table = torch.zeros(3, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(InvalidArgument):
        impl(table, tensor([1]), tensor([2]), page_size)
