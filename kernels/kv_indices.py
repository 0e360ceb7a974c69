"""``req_to_token`` rows to the CSR index arrays that attention backends read.

A batch names, per request, a row of the request-to-token table, a start column and a
length. :func:`build_kv_indices` gathers those token slots into one flat array, with an
``indptr`` marking where each request's run starts (SGLang's
``create_flashinfer_kv_indices_triton``); :func:`build_kv_page_indices` does the same per
page, a block table for paged attention::

    req_to_token  row 3: [ 40 41 42 43 28 29 30 31 12 13 ... ]   page_size 4
                  row 1: [ 20 21 22  0  0 ...              ]

    req_pool_indices [3, 1], kv_start [0, 0], kv_lens [10, 3]
    kv_indptr        [0, 10, 13]
    kv_indices       [40 41 42 43 28 29 30 31 12 13 | 20 21 22]
    page_indptr      [0, 3, 4]
    page_indices     [10 7 3 | 5]        (slot at kv_start + j * page_size, // page_size)

The page variant reads the slot at ``kv_start + j * page_size``; it is meant for
page-aligned ``kv_start``, where that slot is the first of its page. Slots are
non-negative; for a negative entry the kernel's division truncates toward zero, and the
reference does the same.

Each operation comes three ways with one signature: ``*_triton`` (launch wrapper),
``*_torch`` (plain torch reference, vectorised, any device) and a dispatcher that picks
the kernel for CUDA tensors and the reference otherwise. The wrappers build ``indptr``
with ``torch.cumsum`` and validate the batch in one host synchronisation (needed anyway
to size the output). The kernels run one program per request, looping over ``BLOCK``
entries at a time. Complexity: O(batch + output length).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hicache.errors import InvalidArgument
from hicache.kernels._checks import check_out, check_page_size

# Entries per loop iteration of one program; longer runs loop.
BLOCK = 512


class KvIndices(NamedTuple):
    """CSR indices: request ``i``'s entries are ``indices[indptr[i]:indptr[i + 1]]``.
    Both int32."""

    indptr: torch.Tensor
    indices: torch.Tensor


@triton.jit
def _kv_indices_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    kv_lens_ptr,
    kv_start_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    stride_row,
    HAS_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_row = tl.load(req_pool_indices_ptr + i_b).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + i_b).to(tl.int64)
    kv_start = 0
    if HAS_START:
        kv_start = tl.load(kv_start_ptr + i_b).to(tl.int64)
    o_out = tl.load(kv_indptr_ptr + i_b).to(tl.int64)
    p_row = req_to_token_ptr + i_row * stride_row + kv_start
    for i_blk in range(0, tl.cdiv(kv_len, BLOCK)):
        o_t = i_blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m_t = o_t < kv_len
        b_slot = tl.load(p_row + o_t, mask=m_t)
        tl.store(kv_indices_ptr + o_out + o_t, b_slot, mask=m_t)


@triton.jit
def _kv_page_indices_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    kv_lens_ptr,
    kv_start_ptr,
    page_indptr_ptr,
    page_indices_ptr,
    stride_row,
    HAS_START: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_row = tl.load(req_pool_indices_ptr + i_b).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + i_b).to(tl.int64)
    kv_start = 0
    if HAS_START:
        kv_start = tl.load(kv_start_ptr + i_b).to(tl.int64)
    o_out = tl.load(page_indptr_ptr + i_b).to(tl.int64)
    num_pages = tl.cdiv(kv_len, PAGE_SIZE)
    p_row = req_to_token_ptr + i_row * stride_row + kv_start
    for i_blk in range(0, tl.cdiv(num_pages, BLOCK)):
        o_p = i_blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m_p = o_p < num_pages
        b_slot = tl.load(p_row + o_p * PAGE_SIZE, mask=m_p)
        tl.store(page_indices_ptr + o_out + o_p, b_slot // PAGE_SIZE, mask=m_p)


class _Plan(NamedTuple):
    indptr: torch.Tensor  # int32 [bs + 1]
    counts: torch.Tensor  # int64 [bs]: entries per request
    kv_start: torch.Tensor | None  # int64 [bs], or None for all zeros
    total: int


def _plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_start: torch.Tensor | None,
    page_size: int,
) -> _Plan:
    """Validate the batch; count entries per request (pages when ``page_size`` > 1)."""
    if not isinstance(req_to_token, torch.Tensor) or req_to_token.ndim != 2 or req_to_token.dtype != torch.int32:
        raise InvalidArgument("req_to_token must be a two-dimensional int32 tensor")
    if req_to_token.stride(1) != 1:
        raise InvalidArgument("req_to_token rows must be contiguous")
    device = req_to_token.device
    batch = {"req_pool_indices": req_pool_indices, "kv_lens": kv_lens}
    if kv_start is not None:
        batch["kv_start"] = kv_start
    for name, t in batch.items():
        if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument(f"{name} must be a one-dimensional int32 or int64 tensor")
        if t.device != device:
            raise InvalidArgument(f"{name} is on {t.device}, req_to_token on {device}")
        if t.numel() != req_pool_indices.numel():
            raise InvalidArgument(f"{name} has {t.numel()} entries, req_pool_indices {req_pool_indices.numel()}")
    bs = req_pool_indices.numel()
    lens = kv_lens.to(torch.int64)
    start = None if kv_start is None else kv_start.to(torch.int64)
    counts = (lens + (page_size - 1)) // page_size
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    if bs == 0:
        return _Plan(indptr, counts, start, 0)
    rows = req_pool_indices.to(torch.int64)
    start_or_zero = lens.new_zeros(()) if start is None else start
    min_row, max_row, min_len, min_start, max_end, total = torch.stack(
        [
            rows.min(),
            rows.max(),
            lens.min(),
            start_or_zero.min(),
            (start_or_zero + lens).max(),
            counts.sum(),
        ]
    ).tolist()
    num_rows, max_context_len = req_to_token.shape
    if min_row < 0 or max_row >= num_rows:
        raise InvalidArgument(f"req_pool_indices must be in [0, {num_rows}), got [{min_row}, {max_row}]")
    if min_len < 0:
        raise InvalidArgument(f"kv_lens must be >= 0, got {min_len}")
    if min_start < 0:
        raise InvalidArgument(f"kv_start must be >= 0, got {min_start}")
    if max_end > max_context_len:
        raise InvalidArgument(f"kv_start + kv_lens reaches {max_end}, past max_context_len {max_context_len}")
    if total > torch.iinfo(torch.int32).max:
        raise InvalidArgument(f"{total} entries overflow an int32 indptr")
    indptr[1:] = torch.cumsum(counts, 0)
    return _Plan(indptr, counts, start, total)


def _gather_torch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, plan: _Plan, step: int) -> torch.Tensor:
    """Entry ``j`` of request ``i``: ``req_to_token[row_i, kv_start_i + j * step]``."""
    device = req_to_token.device
    bs = req_pool_indices.numel()
    req = torch.repeat_interleave(torch.arange(bs, device=device), plan.counts, output_size=plan.total)
    j = torch.arange(plan.total, device=device) - plan.indptr[:-1].to(torch.int64)[req]
    col = j * step if plan.kv_start is None else plan.kv_start[req] + j * step
    return req_to_token[req_pool_indices.to(torch.int64)[req], col]


def build_kv_indices_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_start: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> KvIndices:
    """``indices[indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j]`` for
    ``j < kv_lens[i]``; ``kv_start`` defaults to zeros.

    Raises :class:`~hicache.errors.InvalidArgument` for a row outside the table or a run
    past ``max_context_len``.
    """
    plan = _plan(req_to_token, req_pool_indices, kv_lens, kv_start, 1)
    out = check_out(out, plan.total, torch.int32, req_to_token.device)
    if plan.total:
        _kv_indices_kernel[(req_pool_indices.numel(),)](
            req_to_token,
            req_pool_indices.contiguous(),
            kv_lens.contiguous(),
            kv_lens if kv_start is None else kv_start.contiguous(),  # unread without a start
            plan.indptr,
            out,
            req_to_token.stride(0),
            HAS_START=kv_start is not None,
            BLOCK=BLOCK,
        )
    return KvIndices(plan.indptr, out)


def build_kv_indices_torch(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_start: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> KvIndices:
    """Reference for :func:`build_kv_indices_triton`: the same contract, in torch ops."""
    plan = _plan(req_to_token, req_pool_indices, kv_lens, kv_start, 1)
    out = check_out(out, plan.total, torch.int32, req_to_token.device)
    if plan.total:
        out.copy_(_gather_torch(req_to_token, req_pool_indices, plan, 1))
    return KvIndices(plan.indptr, out)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_start: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> KvIndices:
    """:func:`build_kv_indices_triton` for CUDA tensors, :func:`build_kv_indices_torch` otherwise."""
    impl = build_kv_indices_triton if req_to_token.is_cuda else build_kv_indices_torch
    return impl(req_to_token, req_pool_indices, kv_lens, kv_start, out=out)


def build_kv_page_indices_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    kv_start: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> KvIndices:
    """Block table: ``indices[indptr[i] + j] = req_to_token[row_i, kv_start_i + j * page_size]
    // page_size`` for ``j < cdiv(kv_lens[i], page_size)``.

    Raises :class:`~hicache.errors.InvalidArgument` like :func:`build_kv_indices_triton`.
    """
    check_page_size(page_size)
    plan = _plan(req_to_token, req_pool_indices, kv_lens, kv_start, page_size)
    out = check_out(out, plan.total, torch.int32, req_to_token.device)
    if plan.total:
        _kv_page_indices_kernel[(req_pool_indices.numel(),)](
            req_to_token,
            req_pool_indices.contiguous(),
            kv_lens.contiguous(),
            kv_lens if kv_start is None else kv_start.contiguous(),  # unread without a start
            plan.indptr,
            out,
            req_to_token.stride(0),
            HAS_START=kv_start is not None,
            PAGE_SIZE=page_size,
            BLOCK=BLOCK,
        )
    return KvIndices(plan.indptr, out)


def build_kv_page_indices_torch(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    kv_start: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> KvIndices:
    """Reference for :func:`build_kv_page_indices_triton`: the same contract, in torch ops."""
    check_page_size(page_size)
    plan = _plan(req_to_token, req_pool_indices, kv_lens, kv_start, page_size)
    out = check_out(out, plan.total, torch.int32, req_to_token.device)
    if plan.total:
        slots = _gather_torch(req_to_token, req_pool_indices, plan, page_size)
        out.copy_(torch.div(slots, page_size, rounding_mode="trunc"))
    return KvIndices(plan.indptr, out)


def build_kv_page_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    kv_start: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> KvIndices:
    """:func:`build_kv_page_indices_triton` for CUDA tensors, :func:`build_kv_page_indices_torch` otherwise."""
    impl = build_kv_page_indices_triton if req_to_token.is_cuda else build_kv_page_indices_torch
    return impl(req_to_token, req_pool_indices, kv_lens, page_size, kv_start, out=out)
