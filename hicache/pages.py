"""Page allocators for the device and host tiers.

An allocator only hands out and takes back page ids; what a page holds and who owns an
allocated page (a session, the tree) is someone else's business. Layout after SGLang's
paged allocator::

    ids:      first_page_id ... first_page_id + capacity - 1
    _free:    [ ids ready for alloc, taken from the head ]
    _released:[ freed ids not yet merged ]   (sort_free=True only)

With ``sort_free=True`` freed pages wait in ``_released`` and are merged and sorted
into ``_free`` only when an allocation needs them, so consecutive allocations come out
in ascending, mostly contiguous runs (SGLang's ``need_sort`` / ``release_pages``).
:meth:`free_group` batches many frees into one concatenation (SGLang's ``free_group``).

The device allocator starts at page 1: page 0 is the padding page that engines point
padded batch entries at, and is never handed out. An engine-owned pool's engine
allocates its blocks itself: its :class:`NullPageAllocator` only knows their range.

Caller bugs — a page freed twice, an id outside the range, a repeated id in one call —
raise :class:`~hicache.errors.DoubleFree` / :class:`~hicache.errors.PageOutOfRange`
before anything changes. Running out of pages is not a bug: :meth:`alloc` returns
``None``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hicache.errors import DoubleFree, InvalidArgument, PageOutOfRange

PAGE_ID_DTYPE = np.dtype("<i4")

PageIds = NDArray[np.int32]
PageIdsLike = Union[ArrayLike, bytes]

# Device pools reserve page 0 as the padding page.
PADDING_PAGE = 0


def as_page_ids(pages: PageIdsLike) -> PageIds:
    """Page ids as a one-dimensional int32 array (packed ``bytes`` are little-endian int32)."""
    if isinstance(pages, (bytes, bytearray, memoryview)):
        if len(pages) % PAGE_ID_DTYPE.itemsize:
            raise InvalidArgument(f"packed page ids must be a multiple of 4 bytes, got {len(pages)}")
        return np.frombuffer(pages, dtype=PAGE_ID_DTYPE)
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise InvalidArgument(f"page ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=PAGE_ID_DTYPE)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"page ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != PAGE_ID_DTYPE:
        if arr.min() < 0 or arr.max() > np.iinfo(np.int32).max:
            raise PageOutOfRange(f"page ids must be in [0, 2**31), got [{arr.min()}, {arr.max()}]")
        arr = arr.astype(PAGE_ID_DTYPE)
    return arr


def distinct_page_ids(pages: PageIdsLike, capacity: int) -> PageIds:
    """``pages`` as ids of a pool of ``capacity`` pages (page 0 is padding): each in
    ``[1, capacity]``, none twice. An engine's request names pages this way."""
    ids = as_page_ids(pages)
    if ids.size:
        if int(ids.min()) < 1 or int(ids.max()) > capacity:
            raise InvalidArgument(f"page ids must be in [1, {capacity}]")
        if len(np.unique(ids)) != len(ids):
            raise InvalidArgument("a page id appears twice")
    return ids


class PageAllocator:
    """Free-list allocator of ``capacity`` page ids starting at ``first_page_id``.

    alloc: O(n) for n pages (amortised; merging released pages sorts them, O(r log r)).
    free: O(n log n) for n pages (validation sorts the batch).
    """

    def __init__(self, capacity: int, *, first_page_id: int = 0, sort_free: bool = False) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgument(f"capacity must be a non-negative int, got {capacity!r}")
        if first_page_id < 0 or first_page_id + capacity > np.iinfo(np.int32).max:
            raise InvalidArgument(f"page ids [{first_page_id}, {first_page_id + capacity}) do not fit int32")
        self.capacity = capacity
        self.first_page_id = first_page_id
        self.sort_free = sort_free
        self._end = first_page_id + capacity
        self._free: PageIds = np.arange(first_page_id, self._end, dtype=PAGE_ID_DTYPE)
        self._released: list[PageIds] = []
        self._num_released = 0
        # _is_free[i] is the state of page first_page_id + i.
        self._is_free = np.ones(capacity, dtype=bool)
        self._group: list[PageIds] | None = None

    @classmethod
    def for_device(cls, num_pages: int, *, sort_free: bool = True) -> "PageAllocator":
        """Device-pool allocator: ids 1..num_pages, page 0 kept as padding."""
        return cls(num_pages, first_page_id=PADDING_PAGE + 1, sort_free=sort_free)

    @classmethod
    def for_host(cls, num_pages: int, *, sort_free: bool = True) -> "PageAllocator":
        """Host-pool allocator: ids 0..num_pages-1."""
        return cls(num_pages, first_page_id=0, sort_free=sort_free)

    @property
    def num_free(self) -> int:
        return len(self._free) + self._num_released

    @property
    def num_allocated(self) -> int:
        return self.capacity - self.num_free

    def alloc(self, num_pages: int) -> PageIds | None:
        """``num_pages`` distinct free ids, or ``None`` (and no change) if there are fewer."""
        if num_pages < 0:
            raise InvalidArgument(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            if num_pages > self.num_free:
                return None
            self._merge_released()
        pages = self._free[:num_pages]
        self._free = self._free[num_pages:]
        self._is_free[pages - self.first_page_id] = False
        return pages

    def take(self, pages: PageIdsLike) -> None:
        """Allocate these specific free pages (a restarted daemon adopting pages an
        engine still uses). Raises if any is out of range, repeated or not free. O(free)."""
        ids = as_page_ids(pages)
        if not ids.size:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < self.first_page_id or hi >= self._end:
            raise PageOutOfRange(f"page ids must be in [{self.first_page_id}, {self._end}), got [{lo}, {hi}]")
        if len(np.unique(ids)) != len(ids) or not self._is_free[ids - self.first_page_id].all():
            raise InvalidArgument("pages to take must be distinct and free")
        self._merge_released()
        keep = np.ones(len(self._free), dtype=bool)
        keep[np.isin(self._free, ids)] = False
        self._free = self._free[keep]
        self._is_free[ids - self.first_page_id] = False

    def free(self, pages: PageIdsLike) -> None:
        """Return pages to the allocator (deferred to the end of a :meth:`free_group`)."""
        ids = as_page_ids(pages)
        if not ids.size:
            return
        if self._group is not None:
            self._group.append(ids)
            return
        self._release(ids)

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Collect every :meth:`free` inside the block and release them in one batch.

        The batch is validated as a whole when the block ends; if validation fails,
        none of it is released. Groups do not nest.
        """
        if self._group is not None:
            raise InvalidArgument("free_group does not nest")
        self._group = []
        try:
            yield
        finally:
            group, self._group = self._group, None
            if group:
                self._release(np.concatenate(group))

    def _release(self, ids: PageIds) -> None:
        self._validate_allocated(ids)
        self._is_free[ids - self.first_page_id] = True
        if self.sort_free:
            self._released.append(ids)
            self._num_released += len(ids)
        else:
            self._free = np.concatenate((self._free, ids))

    def _validate_allocated(self, ids: PageIds) -> None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < self.first_page_id or hi >= self._end:
            raise PageOutOfRange(
                f"page ids must be in [{self.first_page_id}, {self._end}), got [{lo}, {hi}]"
            )
        if len(ids) > 1:
            ordered = np.sort(ids)
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if repeated.size:
                raise DoubleFree(f"page {int(repeated[0])} appears twice in one free")
        already = ids[self._is_free[ids - self.first_page_id]]
        if already.size:
            raise DoubleFree(f"page {int(already[0])} is already free")

    def _merge_released(self) -> None:
        if not self._released:
            return
        merged = np.concatenate([self._free, *self._released])
        merged.sort()
        self._free = merged
        self._released = []
        self._num_released = 0

    def check_invariants(self) -> None:
        """Verify the free structures against the state bitmap. O(capacity)."""
        parts = [self._free, *self._released]
        free_ids = np.concatenate(parts) if parts else np.empty(0, dtype=PAGE_ID_DTYPE)
        assert free_ids.dtype == PAGE_ID_DTYPE, free_ids.dtype
        assert self._num_released == sum(len(p) for p in self._released)
        assert len(free_ids) == self.num_free
        assert len(np.unique(free_ids)) == len(free_ids), "a page is on the free list twice"
        if free_ids.size:
            assert free_ids.min() >= self.first_page_id and free_ids.max() < self._end
        expected = np.zeros(self.capacity, dtype=bool)
        expected[free_ids - self.first_page_id] = True
        assert np.array_equal(expected, self._is_free), "free bitmap disagrees with free list"
        if self.sort_free and len(self._free) > 1:
            # _free starts sorted, is sorted again by every merge, and only loses its head.
            assert bool(np.all(self._free[1:] > self._free[:-1])), "sorted free list out of order"


class NullPageAllocator:
    """The allocator of a pool whose engine allocates its pages itself (an engine-owned
    pool): ids ``1 .. capacity`` are checked against its ``capacity``, but it hands none
    out and takes none back, and keeps nothing per page. O(1) time and memory."""

    first_page_id = PADDING_PAGE + 1
    num_free = 0
    num_allocated = 0

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgument(f"capacity must be a non-negative int, got {capacity!r}")
        self.capacity = capacity

    def alloc(self, num_pages: int) -> PageIds | None:
        raise InvalidArgument("this pool's engine allocates its pages itself")

    def take(self, pages: PageIdsLike) -> None:
        raise InvalidArgument("this pool's engine allocates its pages itself")

    def free(self, pages: PageIdsLike) -> None:
        """Nothing was handed out: only nothing can come back."""
        if as_page_ids(pages).size:
            raise DoubleFree("this pool's allocator handed out no page")

    @contextmanager
    def free_group(self) -> Iterator[None]:
        yield

    def check_invariants(self) -> None:
        pass
