"""Paged slot assignment for extend (prefill) and decode batches.

The daemon grants an engine whole pages; these functions turn a batch's length changes
into token slots (``slot = page_id * page_size + offset``). An extend fills a request's
positions ``[prefix_len, seq_len)`` in three segments (SGLang's paged ``alloc_extend``)::

    page_size 4, prefix_len 6, seq_len 17, last_loc 41, free_pages [7, 3, 9, ...]

    position   0   1   2   3 |  4   5   6   7 |  8   9  10  11 | 12  13  14  15 | 16
    segment    prefix        |  prefix  1   1 |  2   2   2   2 |  2   2   2   2 |  3
    slot                     | 40  41  42  43 | 28  29  30  31 | 12  13  14  15 | 36
    page                     | 10             |  7             |  3             |  9

1. the rest of the prefix's last page, when the prefix ends inside one (never past
   ``seq_len``);
2. whole new pages, taken from ``free_pages`` in order;
3. the first slots of one more new page for the tail.

Request ``i`` takes ``cdiv(seq_len, page_size) - cdiv(prefix_len, page_size)`` pages,
and requests take theirs in batch order: request 0 the first ones, request 1 the next.
A decode step adds one token per request, which goes to ``last_loc + 1`` unless the
previous token filled its page, in which case it opens the next free page.

Each operation comes three ways with one signature: ``*_triton`` (the kernel's launch
wrapper), ``*_torch`` (the plain torch reference, vectorised, any device) and a
dispatcher that picks the kernel for CUDA tensors and the reference otherwise.

Where a request's pages start in ``free_pages`` is an exclusive prefix sum of the pages
each request needs; likewise for where its slots start in the output. The wrappers
compute both sums with ``torch.cumsum`` before the launch, so every program reads its
two offsets directly, whatever the batch size (no in-kernel scan over the batch).
Within a program no segment needs a loop of its own: a position before
``cdiv(prefix_len, page_size) * page_size`` is in segment 1 (``last_loc + 1 + k``); a
later one is in the request's ``(pos - that boundary) // page_size``-th new page. The
same pass validates the batch; its results come to the host in one synchronisation,
which is needed anyway to size the output and to report the pages consumed.

Complexity: O(batch) in the wrappers plus O(extend tokens) in the kernel; the extend
kernel runs one program per request, the decode kernel one per ``DECODE_BLOCK``
requests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hicache.errors import InvalidArgument
from hicache.kernels._checks import check_out, check_page_size

# Extend positions per loop iteration of one program; longer extends loop.
EXTEND_BLOCK = 256
# Requests per program in the decode kernel.
DECODE_BLOCK = 128


class SlotAssignment(NamedTuple):
    """Token slots for a batch (int64, batch order) and how many of ``free_pages``,
    counted from the front, they consumed."""

    slots: torch.Tensor
    num_pages: int


@triton.jit
def _alloc_extend_kernel(
    prefix_lens_ptr,
    seq_lens_ptr,
    last_loc_ptr,
    free_pages_ptr,
    token_offsets_ptr,
    page_offsets_ptr,
    out_ptr,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    prefix_len = tl.load(prefix_lens_ptr + i_b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + i_b).to(tl.int64)
    last_loc = tl.load(last_loc_ptr + i_b).to(tl.int64)
    o_out = tl.load(token_offsets_ptr + i_b).to(tl.int64)
    o_first_page = tl.load(page_offsets_ptr + i_b).to(tl.int64)
    # Positions from here on live in new pages (segments 2 and 3); before it, segment 1.
    new_page_start = tl.cdiv(prefix_len, PAGE_SIZE) * PAGE_SIZE

    for i_blk in range(0, tl.cdiv(seq_len - prefix_len, BLOCK)):
        o_pos = prefix_len + i_blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m_pos = o_pos < seq_len
        m_new = o_pos >= new_page_start
        o_page = o_first_page + tl.maximum(o_pos - new_page_start, 0) // PAGE_SIZE
        b_page = tl.load(free_pages_ptr + o_page, mask=m_pos & m_new, other=0).to(tl.int64)
        b_slot = tl.where(m_new, b_page * PAGE_SIZE + o_pos % PAGE_SIZE, last_loc + 1 + (o_pos - prefix_len))
        tl.store(out_ptr + o_out + (o_pos - prefix_len), b_slot, mask=m_pos)


@triton.jit
def _alloc_decode_kernel(
    seq_lens_ptr,
    last_loc_ptr,
    free_pages_ptr,
    page_offsets_ptr,
    out_ptr,
    batch_size,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_blk = tl.program_id(0)
    o_b = i_blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_b = o_b < batch_size
    seq_len = tl.load(seq_lens_ptr + o_b, mask=m_b, other=1).to(tl.int64)
    last_loc = tl.load(last_loc_ptr + o_b, mask=m_b, other=0).to(tl.int64)
    o_page = tl.load(page_offsets_ptr + o_b, mask=m_b, other=0).to(tl.int64)
    m_new = (seq_len - 1) % PAGE_SIZE == 0
    b_page = tl.load(free_pages_ptr + o_page, mask=m_b & m_new, other=0).to(tl.int64)
    b_slot = tl.where(m_new, b_page * PAGE_SIZE, last_loc + 1)
    tl.store(out_ptr + o_b, b_slot, mask=m_b)


def _cdiv(x: torch.Tensor, d: int) -> torch.Tensor:
    return (x + (d - 1)) // d


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _check_vectors(free_pages: torch.Tensor, **batch: torch.Tensor) -> int:
    """Validate shapes, dtypes and devices; return the batch size."""
    sizes = set()
    for name, t in {**batch, "free_pages": free_pages}.items():
        if not isinstance(t, torch.Tensor) or t.ndim != 1:
            raise InvalidArgument(f"{name} must be a one-dimensional tensor")
        if t.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != free_pages.device:
            raise InvalidArgument(f"{name} is on {t.device}, free_pages on {free_pages.device}")
        if name != "free_pages":
            sizes.add(t.numel())
    if len(sizes) != 1:
        lengths = {name: t.numel() for name, t in batch.items()}
        raise InvalidArgument(f"batch tensors differ in length: {lengths}")
    return sizes.pop()


def _check_free_pages(free_pages: torch.Tensor, num_pages: int, min_page: int) -> None:
    if num_pages > free_pages.numel():
        raise InvalidArgument(f"the batch needs {num_pages} pages, free_pages holds {free_pages.numel()}")
    if min_page < 0:
        raise InvalidArgument(f"free_pages holds a negative page id {min_page}")


def _granted_pages(free_pages: torch.Tensor, num_pages: int, dummy: torch.Tensor) -> torch.Tensor:
    """The pages the kernel may read, contiguous. An empty tensor may have a null data
    pointer, which a launch can reject; with no page to read, any valid pointer does."""
    return free_pages[:num_pages].contiguous() if num_pages else dummy


class _ExtendPlan(NamedTuple):
    token_offsets: torch.Tensor  # int64 [bs]: where request i's slots start in the output
    page_offsets: torch.Tensor  # int64 [bs]: where request i's pages start in free_pages
    num_slots: int
    num_pages: int


def _plan_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
) -> _ExtendPlan:
    check_page_size(page_size)
    bs = _check_vectors(free_pages, prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last_loc)
    prefix = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    last = last_loc.to(torch.int64)
    extend_lens = seq - prefix
    new_pages = _cdiv(seq, page_size) - _cdiv(prefix, page_size)
    if bs == 0:
        return _ExtendPlan(extend_lens, new_pages, 0, 0)
    mid_page = prefix % page_size != 0
    bad_last = mid_page & ((last < 0) | (last % page_size != (prefix - 1) % page_size))
    free_min = free_pages.min() if free_pages.numel() else prefix.new_zeros(())  # 0: passes the check
    min_prefix, min_extend, num_bad_last, num_slots, num_pages, min_page = torch.stack(
        [prefix.min(), extend_lens.min(), bad_last.sum(), extend_lens.sum(), new_pages.sum(), free_min.to(torch.int64)]
    ).tolist()
    if min_prefix < 0:
        raise InvalidArgument(f"prefix_lens must be >= 0, got {min_prefix}")
    if min_extend < 0:
        raise InvalidArgument("seq_lens must be >= prefix_lens")
    if num_bad_last:
        raise InvalidArgument(
            f"{num_bad_last} requests have a last_loc that does not sit at offset "
            f"(prefix_len - 1) % page_size of a page"
        )
    _check_free_pages(free_pages, num_pages, min_page)
    return _ExtendPlan(_exclusive_cumsum(extend_lens), _exclusive_cumsum(new_pages), num_slots, num_pages)


def alloc_extend_triton(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
) -> SlotAssignment:
    """Slots for positions ``[prefix_lens[i], seq_lens[i])`` of every request, concatenated
    in batch order, and the number of ``free_pages`` consumed.

    ``last_loc[i]`` is the slot of position ``prefix_lens[i] - 1``; it is read only when
    the prefix ends inside a page (and may be -1 otherwise). Raises
    :class:`~hicache.errors.InvalidArgument`, before writing anything, on inconsistent
    lengths, a ``last_loc`` at the wrong offset of its page, or when ``free_pages``
    holds fewer pages than the batch needs.
    """
    plan = _plan_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size)
    out = check_out(out, plan.num_slots, torch.int64, free_pages.device)
    if plan.num_slots:
        _alloc_extend_kernel[(prefix_lens.numel(),)](
            prefix_lens.contiguous(),
            seq_lens.contiguous(),
            last_loc.contiguous(),
            _granted_pages(free_pages, plan.num_pages, out),
            plan.token_offsets,
            plan.page_offsets,
            out,
            PAGE_SIZE=page_size,
            BLOCK=EXTEND_BLOCK,
        )
    return SlotAssignment(out, plan.num_pages)


def alloc_extend_torch(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
) -> SlotAssignment:
    """Reference for :func:`alloc_extend_triton`: the same contract, in torch ops."""
    plan = _plan_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size)
    out = check_out(out, plan.num_slots, torch.int64, free_pages.device)
    if not plan.num_slots:
        return SlotAssignment(out, plan.num_pages)
    device = free_pages.device
    prefix = prefix_lens.to(torch.int64)
    extend_lens = seq_lens.to(torch.int64) - prefix
    req = torch.repeat_interleave(torch.arange(prefix.numel(), device=device), extend_lens, output_size=plan.num_slots)
    pos = prefix[req] + torch.arange(plan.num_slots, device=device) - plan.token_offsets[req]
    new_page_start = _cdiv(prefix, page_size)[req] * page_size
    in_new_page = pos >= new_page_start
    page_index = plan.page_offsets[req] + (pos - new_page_start).clamp(min=0) // page_size
    # Segment-1 positions compute an index too (discarded by the where); keep it in range.
    pages = free_pages[: plan.num_pages].to(torch.int64)
    page = pages[page_index.clamp(max=plan.num_pages - 1)] if plan.num_pages else torch.zeros_like(pos)
    tail_of_prefix_page = last_loc.to(torch.int64)[req] + 1 + (pos - prefix[req])
    out.copy_(torch.where(in_new_page, page * page_size + pos % page_size, tail_of_prefix_page))
    return SlotAssignment(out, plan.num_pages)


def alloc_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
) -> SlotAssignment:
    """:func:`alloc_extend_triton` for CUDA tensors, :func:`alloc_extend_torch` otherwise."""
    impl = alloc_extend_triton if free_pages.is_cuda else alloc_extend_torch
    return impl(prefix_lens, seq_lens, last_loc, free_pages, page_size, out=out)


class _DecodePlan(NamedTuple):
    page_offsets: torch.Tensor  # int64 [bs]: where request i's page (if any) is in free_pages
    num_pages: int


def _plan_decode(
    seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor, page_size: int
) -> _DecodePlan:
    check_page_size(page_size)
    bs = _check_vectors(free_pages, seq_lens=seq_lens, last_loc=last_loc)
    seq = seq_lens.to(torch.int64)
    last = last_loc.to(torch.int64)
    new_page = ((seq - 1) % page_size == 0).to(torch.int64)
    if bs == 0:
        return _DecodePlan(new_page, 0)
    bad_last = (new_page == 0) & ((last < 0) | (last % page_size != (seq - 2) % page_size))
    free_min = free_pages.min() if free_pages.numel() else seq.new_zeros(())
    min_seq, num_bad_last, num_pages, min_page = torch.stack(
        [seq.min(), bad_last.sum(), new_page.sum(), free_min.to(torch.int64)]
    ).tolist()
    if min_seq < 1:
        raise InvalidArgument(f"decode seq_lens count the new token and must be >= 1, got {min_seq}")
    if num_bad_last:
        raise InvalidArgument(
            f"{num_bad_last} requests have a last_loc that does not sit at offset (seq_len - 2) % page_size of a page"
        )
    _check_free_pages(free_pages, num_pages, min_page)
    return _DecodePlan(_exclusive_cumsum(new_page), num_pages)


def alloc_decode_triton(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
) -> SlotAssignment:
    """One slot per request for its new token, position ``seq_lens[i] - 1``.

    ``last_loc[i]`` is the slot of the previous token. A request whose new token starts
    a page takes the next page of ``free_pages`` (in batch order). Raises
    :class:`~hicache.errors.InvalidArgument`, before writing anything, on bad lengths or
    too few free pages.
    """
    plan = _plan_decode(seq_lens, last_loc, free_pages, page_size)
    bs = seq_lens.numel()
    out = check_out(out, bs, torch.int64, free_pages.device)
    if bs:
        _alloc_decode_kernel[(triton.cdiv(bs, DECODE_BLOCK),)](
            seq_lens.contiguous(),
            last_loc.contiguous(),
            _granted_pages(free_pages, plan.num_pages, out),
            plan.page_offsets,
            out,
            bs,
            PAGE_SIZE=page_size,
            BLOCK=DECODE_BLOCK,
        )
    return SlotAssignment(out, plan.num_pages)


def alloc_decode_torch(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
) -> SlotAssignment:
    """Reference for :func:`alloc_decode_triton`: the same contract, in torch ops."""
    plan = _plan_decode(seq_lens, last_loc, free_pages, page_size)
    out = check_out(out, seq_lens.numel(), torch.int64, free_pages.device)
    if not seq_lens.numel():
        return SlotAssignment(out, plan.num_pages)
    new_page = (seq_lens.to(torch.int64) - 1) % page_size == 0
    if plan.num_pages:
        pages = free_pages[: plan.num_pages].to(torch.int64)
        page = pages[plan.page_offsets.clamp(max=plan.num_pages - 1)]
    else:
        page = torch.zeros_like(plan.page_offsets)
    out.copy_(torch.where(new_page, page * page_size, last_loc.to(torch.int64) + 1))
    return SlotAssignment(out, plan.num_pages)


def alloc_decode(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
) -> SlotAssignment:
    """:func:`alloc_decode_triton` for CUDA tensors, :func:`alloc_decode_torch` otherwise."""
    impl = alloc_decode_triton if free_pages.is_cuda else alloc_decode_torch
    return impl(seq_lens, last_loc, free_pages, page_size, out=out)
