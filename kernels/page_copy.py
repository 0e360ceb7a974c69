"""Page copies between a device pool and the host pool: Triton kernel, torch reference.

Every copy hicache makes — device -> host backup of all layers, host -> device load of
one layer or all layers, MHA / MLA / fp8 / recurrent-state slots alike — is the same
operation on two flat byte buffers: for every pair ``(s, d)`` of page (or state-slot)
ids and every segment ``j`` of a :class:`Segments` table::

    dst[d * dst_stride[j] + dst_offset[j] : ... + nbytes[j]]
        = src[s * src_stride[j] + src_offset[j] : ... + nbytes[j]]

For a device -> host backup of a 2-layer MHA pool the table has four segments (L0.k,
L0.v, L1.k, L1.v): on the device each lives in its own region with one page every
``page_bytes`` bytes; on the host they sit side by side inside each host page::

    device  | L0.k: pad p1 p2 ... | L0.v: pad p1 p2 ... | L1.k: ... | L1.v: ... |
    host    | page 0: L0.k L0.v L1.k L1.v | page 1: L0.k L0.v L1.k L1.v | ...

Sources may repeat and come in any order; a destination repeated within one call is
rejected (two writers of one page is always a bug). Empty pair lists are a no-op.

:func:`copy_pages_triton` launches one kernel whose grid is capped at ``max_programs``
programs (a copy occupies a few SMs, not the GPU); each program walks (pair, segment)
items with a grid-stride loop and moves words of the widest size that divides every
offset, stride and length. :func:`copy_pages_reference` is the torch version with the
same signature: one strided copy per run of consecutive pairs and regular group of
segments, so contiguous page runs move in few large copies; on the CPU it can spread
the runs over a few threads (:class:`CpuCopyWorkers`). :func:`copy_pages` dispatches:
Triton when either buffer is on a CUDA device, the reference otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from hicache.errors import InvalidArgument
from hicache.kernels.copy_plan import CpuCopyWorkers, Segments, check_page_ids

DEFAULT_MAX_PROGRAMS = 16
# Pages per strided copy on the reference path: large enough to amortise a call, small
# enough to spread over worker threads evenly.
RUN_CAP_PAGES = 8
_BLOCK_WORDS = 1024
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _check_args(
    src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor, segments: Segments,
    check: bool,
) -> int:
    """The number of pairs to copy (0: nothing to do)."""
    for name, buf in (("src", src), ("dst", dst)):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise InvalidArgument(f"{name} must be a contiguous 1-D uint8 buffer")
    if check:
        num_pairs = check_page_ids(src_pages, dst_pages, segments, src.numel(), dst.numel())
    else:
        num_pairs = len(src_pages)
    return num_pairs if len(segments) else 0


@triton.jit
def _copy_pages_kernel(
    src,
    dst,
    src_pages,
    dst_pages,
    table,
    num_pairs,
    num_segments,
    BLOCK: tl.constexpr,
):
    i_prog = tl.program_id(0)
    n_prog = tl.num_programs(0)
    o_block = tl.arange(0, BLOCK)
    for i_item in range(i_prog, num_pairs * num_segments, n_prog):
        i_pair = i_item // num_segments
        i_seg = i_item % num_segments
        b_src_page = tl.load(src_pages + i_pair).to(tl.int64)
        b_dst_page = tl.load(dst_pages + i_pair).to(tl.int64)
        b_src_offset = tl.load(table + i_seg)
        b_src_stride = tl.load(table + num_segments + i_seg)
        b_dst_offset = tl.load(table + 2 * num_segments + i_seg)
        b_dst_stride = tl.load(table + 3 * num_segments + i_seg)
        b_words = tl.load(table + 4 * num_segments + i_seg)
        p_src = src + (b_src_page * b_src_stride + b_src_offset)
        p_dst = dst + (b_dst_page * b_dst_stride + b_dst_offset)
        for o_start in range(0, b_words, BLOCK):
            o_ = o_start + o_block
            m_ = o_ < b_words
            tl.store(p_dst + o_, tl.load(p_src + o_, mask=m_), mask=m_)


def copy_pages_triton(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    segments: Segments,
    *,
    max_programs: int = DEFAULT_MAX_PROGRAMS,
    workers: CpuCopyWorkers | None = None,
    check: bool = True,
) -> None:
    """Copy every segment of every page pair with one Triton launch (see module doc);
    ``workers`` is accepted for the common signature and ignored. ``check=False`` skips
    the page-id checks (which synchronise with the device) for callers that made them
    on the host already."""
    num_pairs = _check_args(src, dst, src_pages, dst_pages, segments, check)
    if num_pairs == 0:
        return
    word = segments.word_bytes
    while any(v % word for v in (src.numel(), dst.numel(), src.data_ptr(), dst.data_ptr())):
        word //= 2
    table = segments.table(src_pages.device, word)
    grid = (max(1, min(max_programs, num_pairs * len(segments))),)
    _copy_pages_kernel[grid](
        _kernel_arg(src.view(_WORD_DTYPES[word])),
        _kernel_arg(dst.view(_WORD_DTYPES[word])),
        src_pages,
        dst_pages,
        table,
        num_pairs,
        len(segments),
        BLOCK=_BLOCK_WORDS,
    )


def copy_pages_reference(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    segments: Segments,
    *,
    max_programs: int = DEFAULT_MAX_PROGRAMS,
    workers: CpuCopyWorkers | None = None,
    check: bool = True,
) -> None:
    """Torch version of :func:`copy_pages_triton`, same signature (``max_programs`` is
    accepted and ignored). One strided copy per run of consecutive pairs (at most
    ``RUN_CAP_PAGES`` long) and regular group of segments. On the CPU the copies are
    numpy's, which release the GIL, spread over ``workers``' threads when given: two
    threads each copying whole pages beat one copy split by torch's intra-op threads."""
    if _check_args(src, dst, src_pages, dst_pages, segments, check) == 0:
        return
    ReferencePlan([(src, dst, segments)]).run(page_runs(src_pages, dst_pages), workers)


class ReferencePlan:
    """What the reference path needs of one or more (``src``, ``dst``, segments) triples
    that no page list changes: one ``[count, pages, nbytes]`` view per group and side,
    each run of pages a slice of it; the same runs move through every triple in turn (an
    engine-owned pool's store: one triple per allocation). A layer-wise load builds one
    per layer once per pool pair (:class:`hicache.transfer.PageMover`,
    :class:`hicache.foreign.ForeignMover`) and moves the same runs through each, instead
    of rebuilding views and runs for every layer."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor, Segments]]) -> None:
        self.on_cpu = all(src.device.type == "cpu" and dst.device.type == "cpu" for src, dst, _ in parts)
        self.bytes_per_pair = sum(segments.bytes_per_pair for _, _, segments in parts)
        self._views = [(_group_view(src, g.count, g.src_offset, g.src_step, g.src_stride, g.nbytes, self.on_cpu),
                        _group_view(dst, g.count, g.dst_offset, g.dst_step, g.dst_stride, g.nbytes, self.on_cpu))
                       for src, dst, segments in parts for g in segments.groups]

    def run(self, runs: list[tuple[int, int, int]], workers: CpuCopyWorkers | None = None) -> None:
        """Copy ``runs`` (:func:`page_runs`, unchecked), on the CPU spread over
        ``workers``' threads where each gets enough bytes to be worth a hand-off."""
        parts = 1 if workers is None or not self.on_cpu else workers.parts(
            sum(r[2] for r in runs) * self.bytes_per_pair, len(runs))
        if parts < 2:
            self.move(runs)
        else:
            workers.run(self.move, _split(runs, parts))

    def move(self, runs: list[tuple[int, int, int]]) -> None:
        """Copy ``runs`` (:func:`page_runs`, unchecked: the caller checked the ids)."""
        for src_view, dst_view in self._views:
            for s0, d0, length in runs:
                if self.on_cpu:
                    np.copyto(dst_view[:, d0 : d0 + length], src_view[:, s0 : s0 + length])
                else:
                    dst_view[:, d0 : d0 + length].copy_(src_view[:, s0 : s0 + length])


def copy_pages(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    segments: Segments,
    *,
    max_programs: int = DEFAULT_MAX_PROGRAMS,
    workers: CpuCopyWorkers | None = None,
    check: bool = True,
) -> None:
    """Triton on CUDA, the reference on the CPU (on ``workers``' threads, if given)."""
    if src.is_cuda or dst.is_cuda:
        copy_pages_triton(src, dst, src_pages, dst_pages, segments, max_programs=max_programs, check=check)
    else:
        copy_pages_reference(src, dst, src_pages, dst_pages, segments, workers=workers, check=check)


class _MappedHost:
    """A pinned host buffer handed to a kernel by address: with unified addressing the
    host pointer of page-locked, mapped memory is valid on the device, and Triton takes
    any argument with ``data_ptr()`` and ``dtype`` as a pointer."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self._tensor.data_ptr()


def _kernel_arg(buf: torch.Tensor):
    if buf.device.type == "cpu" and torch.cuda.is_available() and buf.is_pinned():
        return _MappedHost(buf)
    return buf


def _group_view(buf: torch.Tensor, count: int, offset: int, step: int, stride: int, nbytes: int,
                as_numpy: bool):
    """``buf`` seen as ``[count, pages, nbytes]``: every page the buffer holds whole."""
    room = buf.numel() - offset - (count - 1) * step - nbytes
    pages = room // stride + 1 if stride else 1
    view = buf.as_strided((count, pages, nbytes), (step, stride, 1), buf.storage_offset() + offset)
    return view.numpy() if as_numpy else view


def page_runs(src_pages: torch.Tensor, dst_pages: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs where both page lists step by +1, at most RUN_CAP_PAGES long:
    (first src, first dst, length)."""
    src_pages, dst_pages = src_pages.tolist(), dst_pages.tolist()
    runs = []
    i = 0
    n = len(src_pages)
    while i < n:
        j = i + 1
        while (j < n and j - i < RUN_CAP_PAGES
               and src_pages[j] == src_pages[j - 1] + 1 and dst_pages[j] == dst_pages[j - 1] + 1):
            j += 1
        runs.append((src_pages[i], dst_pages[i], j - i))
        i = j
    return runs


def _split(runs: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Split runs into at most ``parts`` consecutive batches of about equal page counts."""
    total = sum(r[2] for r in runs)
    batches: list[list[tuple[int, int, int]]] = [[]]
    done = 0
    for run in runs:
        if batches[-1] and done >= total * len(batches) / parts:
            batches.append([])
        batches[-1].append(run)
        done += run[2]
    return batches
