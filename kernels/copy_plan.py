"""Copy plans: what a page copy moves, independent of how it runs.

A :class:`Segments` table says which byte ranges of a page pair move (the layout of
the two buffers); :func:`check_page_ids` validates a copy's page lists against two
buffers; :class:`CpuCopyWorkers` are the threads the CPU path spreads copies over. The
kernels that run a plan (Triton, and the torch reference) are
:mod:`hicache.kernels.page_copy`; pools and movers build plans without importing Triton.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import cached_property

import torch

from hicache.errors import InvalidArgument


@dataclass(frozen=True)
class SegmentGroup:
    """``count`` segments of equal length and strides whose offsets step regularly: one
    strided view per side, so the reference moves the whole group in one copy."""

    count: int
    nbytes: int
    src_offset: int
    src_step: int
    src_stride: int
    dst_offset: int
    dst_step: int
    dst_stride: int


@dataclass(frozen=True)
class Segments:
    """What one page pair moves: parallel tuples, one entry per segment (bytes)."""

    src_offset: tuple[int, ...]
    src_stride: tuple[int, ...]
    dst_offset: tuple[int, ...]
    dst_stride: tuple[int, ...]
    nbytes: tuple[int, ...]
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.nbytes)
        columns = (self.src_offset, self.src_stride, self.dst_offset, self.dst_stride)
        if any(len(col) != n for col in columns):
            raise InvalidArgument("segment columns differ in length")
        if any(v < 0 for col in (*columns, self.nbytes) for v in col):
            raise InvalidArgument("segment offsets, strides and lengths must be non-negative")

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def bytes_per_pair(self) -> int:
        return sum(self.nbytes)

    def reversed(self) -> "Segments":
        """The same segments with source and destination swapped."""
        return Segments(self.dst_offset, self.dst_stride, self.src_offset, self.src_stride, self.nbytes)

    def select(self, indices: range | list[int]) -> "Segments":
        pick = list(indices)
        return Segments(
            tuple(self.src_offset[i] for i in pick),
            tuple(self.src_stride[i] for i in pick),
            tuple(self.dst_offset[i] for i in pick),
            tuple(self.dst_stride[i] for i in pick),
            tuple(self.nbytes[i] for i in pick),
        )

    @cached_property
    def word_bytes(self) -> int:
        """The widest word (8, 4, 2 or 1 bytes) dividing every offset, stride and length."""
        values = (*self.src_offset, *self.src_stride, *self.dst_offset, *self.dst_stride, *self.nbytes)
        for word in (8, 4, 2):
            if all(v % word == 0 for v in values):
                return word
        return 1

    @cached_property
    def groups(self) -> tuple[SegmentGroup, ...]:
        """Maximal runs of consecutive segments that form one regular strided block."""
        groups: list[SegmentGroup] = []
        j = 0
        n = len(self)
        while j < n:
            k = j + 1
            src_step = self.src_offset[k] - self.src_offset[j] if k < n else 0
            dst_step = self.dst_offset[k] - self.dst_offset[j] if k < n else 0
            # (a group is one strided view a side: its steps cannot be negative, as when
            # SWA layers, last in a host page, come first in a device pool)
            if k < n and self._same_shape(j, k) and src_step >= 0 and dst_step >= 0:
                while (
                    k + 1 < n
                    and self._same_shape(j, k + 1)
                    and self.src_offset[k + 1] - self.src_offset[k] == src_step
                    and self.dst_offset[k + 1] - self.dst_offset[k] == dst_step
                ):
                    k += 1
                k += 1
            else:
                src_step = dst_step = 0
            groups.append(SegmentGroup(
                k - j, self.nbytes[j],
                self.src_offset[j], src_step, self.src_stride[j],
                self.dst_offset[j], dst_step, self.dst_stride[j],
            ))
            j = k
        return tuple(groups)

    def _same_shape(self, a: int, b: int) -> bool:
        return (
            self.nbytes[a] == self.nbytes[b]
            and self.src_stride[a] == self.src_stride[b]
            and self.dst_stride[a] == self.dst_stride[b]
        )

    def table(self, device: torch.device, word_bytes: int) -> torch.Tensor:
        """``[5, num_segments]`` int64 table in words of ``word_bytes``, cached (Triton)."""
        key = (str(device), word_bytes)
        cached = self._tables.get(key)
        if cached is None:
            rows = (self.src_offset, self.src_stride, self.dst_offset, self.dst_stride, self.nbytes)
            cached = torch.tensor([[v // word_bytes for v in row] for row in rows], dtype=torch.int64, device=device)
            self._tables[key] = cached
        return cached


def check_page_ids(
    src_pages: torch.Tensor, dst_pages: torch.Tensor, segments: Segments, src_bytes: int, dst_bytes: int,
    *, num_src_pages: int | None = None, num_dst_pages: int | None = None,
) -> int:
    """Validate a copy's page lists against buffers of ``src_bytes`` / ``dst_bytes``
    and, where given, against the ``num_src_pages`` / ``num_dst_pages`` ids (from 0)
    that a buffer's owner holds: a mover's buffers may have bytes past their last page
    (alignment padding, the next layer's blocks, an engine's spare bytes), which the
    byte check alone lets an id reach. Returns the number of pairs. Synchronises when
    the ids are on a device, so hot paths check host-side lists first and pass
    ``check=False`` to the kernels."""
    if src_pages.dim() != 1 or dst_pages.dim() != 1 or len(src_pages) != len(dst_pages):
        raise InvalidArgument(
            f"page lists must be 1-D and of equal length, got {tuple(src_pages.shape)} and {tuple(dst_pages.shape)}"
        )
    if src_pages.dtype.is_floating_point or dst_pages.dtype.is_floating_point:
        raise InvalidArgument("page ids must be integers")
    num_pairs = len(src_pages)
    if num_pairs == 0 or len(segments) == 0:
        return num_pairs
    if len(torch.unique(dst_pages)) != num_pairs:
        raise InvalidArgument("a destination page appears twice in one copy")
    for name, nbytes, num_pages, pages, offsets, strides in (
        ("source", src_bytes, num_src_pages, src_pages, segments.src_offset, segments.src_stride),
        ("destination", dst_bytes, num_dst_pages, dst_pages, segments.dst_offset, segments.dst_stride),
    ):
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0:
            raise InvalidArgument(f"negative {name} page id {lo}")
        if num_pages is not None and hi >= num_pages:
            raise InvalidArgument(f"{name} page {hi} is past the buffer's pages (ids 0 .. {num_pages - 1})")
        end = max(hi * s + o + n for s, o, n in zip(strides, offsets, segments.nbytes))
        if end > nbytes:
            raise InvalidArgument(f"{name} page {hi} reaches byte {end}, past the buffer's {nbytes}")
    return num_pairs


# A copy is split over threads only where each gets at least this many bytes: below
# it the hand-off costs more than a second thread gains, and takes a core an engine may
# want (8 pages of one vLLM-shaped block each, 7 MiB: 0.96 ms on one thread, 1.53 ms on
# two; 32 MiB: 6.2 ms on one, 4.6 ms on two; 2 cores, both busy).
SPREAD_MIN_BYTES = 8 << 20


class CpuCopyWorkers:
    """Threads that run the CPU copies of :func:`copy_pages_reference` in parallel."""

    def __init__(self, num_threads: int = 2, *, min_bytes_per_thread: int = SPREAD_MIN_BYTES) -> None:
        if num_threads <= 0:
            raise InvalidArgument(f"num_threads must be positive, got {num_threads}")
        if min_bytes_per_thread <= 0:
            raise InvalidArgument(f"min_bytes_per_thread must be positive, got {min_bytes_per_thread}")
        self.num_threads = num_threads
        self.min_bytes_per_thread = min_bytes_per_thread
        # The calling thread takes a share too, so the pool needs one thread fewer.
        self._pool = ThreadPoolExecutor(max(1, num_threads - 1), thread_name_prefix="hicache-copy")

    def parts(self, nbytes: int, items: int) -> int:
        """How many threads a copy of ``nbytes`` in ``items`` indivisible pieces is worth
        spreading over (1: the calling thread alone)."""
        return max(1, min(self.num_threads, items, nbytes // self.min_bytes_per_thread))

    def run(self, fn, batches) -> None:
        """``fn(batch)`` for every batch; the first on the calling thread (one hand-off
        fewer), the others on the pool's threads. Returns, or raises the first error,
        only once every batch has ended: a caller told of a failure takes the copy as
        over (a load's ticket failed, its blocks reused), so no thread may still write."""
        batches = list(batches)
        if not batches:
            return
        futures = [self._pool.submit(fn, batch) for batch in batches[1:]]
        try:
            fn(batches[0])
        finally:
            wait(futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
