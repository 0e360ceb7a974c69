"""The request-to-token table: one row of token slots per running request.

Attention kernels find a request's KV through its row: ``req_to_token[row, pos]`` is the
slot of the token at position ``pos`` (seeds 000, 001, 004)::

    req_to_token  int32 [size + 1, max_context_len]
    row 0         [  0  0  0  0 ... ]   padding row: padded batch entries point here
    row 1         [ 40 41 42 43 ... ]   request A
    row 2         (free)
    row 3         [ 12 13  0  0 ... ]   request B
    ...
    row size

    _free_rows    [ ..., 7, 2 ]  <- alloc pops from here, free pushes here
    generation    int64 [size + 1]: times each row has been handed out

Row 0 is never handed out, so a padded batch (CUDA graphs replay a fixed batch size)
can read and write it without touching a live request. Free rows form a stack: alloc
and free are O(k) for k rows, and a freed row is the first to be handed out again. A
fresh or cleared pool hands out rows 1, 2, 3, ... in that order.

``generation[row]`` grows by one every time the row is handed out and is never reset,
not even by :meth:`ReqToTokenPool.clear`: a reader that saved ``(row, generation)``
can tell that the row has since been reused by another request (ABA), however many
clears happened in between. It lives on the host whatever the table's device.

The contents of a freed row are stale, not cleared. Caller bugs — freeing a row twice,
row 0, a row outside the table, keeping a row that is not allocated — raise
:class:`~hicache.errors.InvalidArgument` (:class:`~hicache.errors.DoubleFree` for the
double frees) before anything changes; running out of rows is not a bug: the alloc
methods return ``None``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

import torch

from hicache.errors import DoubleFree, InvalidArgument

PADDING_ROW = 0


class ReqToTokenPool:
    """``size`` request rows of ``max_context_len`` token slots each, plus the padding row."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"size must be a non-negative int, got {size!r}")
        if isinstance(max_context_len, bool) or not isinstance(max_context_len, int) or max_context_len < 1:
            raise InvalidArgument(f"max_context_len must be a positive int, got {max_context_len!r}")
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.generation = torch.zeros(size + 1, dtype=torch.int64)
        self._free_rows: list[int] = []
        # _is_free[row] is 1 for a free row; row 0 is never free.
        self._is_free = bytearray(size + 1)
        self.clear()

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    @property
    def num_allocated(self) -> int:
        return self.size - len(self._free_rows)

    def is_allocated(self, row: int) -> bool:
        row = _as_int(row, "row")
        return 0 < row <= self.size and not self._is_free[row]

    def alloc(self, num_rows: int) -> list[int] | None:
        """``num_rows`` rows, or ``None`` (and no change) if fewer are free. O(num_rows)."""
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
            raise InvalidArgument(f"cannot allocate {num_rows!r} rows")
        if num_rows > len(self._free_rows):
            return None
        if num_rows == 0:
            return []
        rows = self._free_rows[-num_rows:]
        del self._free_rows[-num_rows:]
        rows.reverse()  # pop order: the tail first
        for row in rows:
            self._is_free[row] = 0
        self.generation[rows] += 1
        return rows

    def alloc_for(self, current_rows: Sequence[int | None]) -> list[int] | None:
        """Rows for a batch in which some requests already hold one (chunked prefill).

        Entry ``i`` of the result is ``current_rows[i]`` when that is a row, else a newly
        allocated row. ``None`` (and no change) if too few rows are free. O(len(batch)).
        """
        rows = [None if row is None else _as_int(row, "row") for row in current_rows]
        seen: set[int] = set()
        for row in rows:
            if row is None:
                continue
            if not self.is_allocated(row):
                raise InvalidArgument(f"row {row} is kept by a request but is not allocated")
            if row in seen:
                raise InvalidArgument(f"row {row} is kept by two requests")
            seen.add(row)
        new_rows = self.alloc(len(rows) - len(seen))
        if new_rows is None:
            return None
        fresh = iter(new_rows)
        return [next(fresh) if row is None else row for row in rows]

    def free(self, rows: Iterable[int]) -> None:
        """Return rows to the pool; the last one freed is the next one handed out. O(k)."""
        rows = [_as_int(row, "row") for row in rows]
        seen: set[int] = set()
        for row in rows:
            if row == PADDING_ROW:
                raise InvalidArgument("row 0 is the padding row and is never allocated")
            if not 0 < row <= self.size:
                raise InvalidArgument(f"row {row} is outside [1, {self.size}]")
            if row in seen:
                raise DoubleFree(f"row {row} appears twice in one free")
            if self._is_free[row]:
                raise DoubleFree(f"row {row} is already free")
            seen.add(row)
        for row in rows:
            self._is_free[row] = 1
        self._free_rows.extend(rows)

    def clear(self) -> None:
        """Free every row; generations are kept (see the module docstring). O(size)."""
        self._free_rows = list(range(self.size, PADDING_ROW, -1))
        self._is_free = bytearray([0]) + bytearray([1]) * self.size

    def write(self, row: int, start: int, slots: torch.Tensor | Sequence[int]) -> None:
        """``req_to_token[row, start:start + len(slots)] = slots`` for an allocated row.

        Slot values are not checked (that would synchronise with the device); they are
        stored as int32.
        """
        row = _as_int(row, "row")
        if not self.is_allocated(row):
            raise InvalidArgument(f"row {row} is not allocated")
        slots = torch.as_tensor(slots)
        if slots.ndim != 1 or (slots.numel() and (slots.dtype.is_floating_point or slots.dtype.is_complex)):
            raise InvalidArgument(
                f"slots must be a one-dimensional integer tensor, got {slots.dtype} {tuple(slots.shape)}"
            )
        start = _as_int(start, "start")
        if start < 0 or start + slots.numel() > self.max_context_len:
            raise InvalidArgument(
                f"positions [{start}, {start + slots.numel()}) are outside [0, {self.max_context_len})"
            )
        self.req_to_token[row, start : start + slots.numel()] = slots

    def check_invariants(self) -> None:
        """Verify the free stack against the state bytes and the counters. O(size)."""
        assert self.req_to_token.shape == (self.size + 1, self.max_context_len), self.req_to_token.shape
        assert self.req_to_token.dtype == torch.int32
        assert self.generation.shape == (self.size + 1,) and self.generation.dtype == torch.int64
        assert len(self._is_free) == self.size + 1
        assert not self._is_free[PADDING_ROW], "the padding row is on the free list"
        free = set(self._free_rows)
        assert len(free) == len(self._free_rows), "a row is on the free list twice"
        assert free == {row for row in range(self.size + 1) if self._is_free[row]}, "state bytes disagree"
        assert int(self.generation[PADDING_ROW]) == 0, "the padding row was handed out"
        assert bool((self.generation >= 0).all())
        allocated = [row for row in range(1, self.size + 1) if not self._is_free[row]]
        assert bool((self.generation[allocated] >= 1).all()), "an allocated row has generation 0"


def _as_int(value: int, what: str) -> int:
    """``value`` as an int (numpy and 0-d torch integers too), or InvalidArgument."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InvalidArgument(f"{what} must be an int, got {value!r}")


PADDING_SLOT = 0


class HybridReqToTokenPool(ReqToTokenPool):
    """A :class:`ReqToTokenPool` for models with recurrent-state layers (linear attention,
    Mamba, KDA: seed 000 §8.3): each request row also owns one slot of the pool's state
    region — allocated with the row, freed with it — and ``row_to_state[row]`` is that
    slot, a tensor on the table's device for the kernels that gather a batch's states::

        row_to_state  int32 [size + 1]
        row 0         0      the padding row reads and writes the padding slot
        row 1         3      request A's conv / temporal state lives in slot 3
        row 2         0      (free: a freed row points at the padding slot again)

    Slots follow the rows' rules: slot 0 is the padding slot of the state region
    (``DeviceLayout`` keeps ``num_state_slots + 1``) and is never handed out; free slots
    form a stack (a freed slot is the next one handed out); ``slot_generation[slot]``
    counts hand-outs and survives :meth:`clear`. Running out of slots, like running out of
    rows, makes :meth:`alloc` return ``None`` with nothing changed.
    """

    def __init__(self, size: int, max_context_len: int, num_state_slots: int | None = None,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(size, max_context_len, device)
        slots = size if num_state_slots is None else num_state_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise InvalidArgument(f"num_state_slots must be a non-negative int, got {num_state_slots!r}")
        self.num_state_slots = slots
        self.row_to_state = torch.zeros(size + 1, dtype=torch.int32, device=device)
        self.slot_generation = torch.zeros(slots + 1, dtype=torch.int64)
        self._free_slots: list[int] = list(range(slots, PADDING_SLOT, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def state_slot(self, row: int) -> int:
        """The state slot of an allocated row."""
        row = _as_int(row, "row")
        if not self.is_allocated(row):
            raise InvalidArgument(f"row {row} is not allocated")
        return int(self.row_to_state[row])

    def alloc(self, num_rows: int) -> list[int] | None:
        """``num_rows`` rows, each with a state slot, or ``None`` (and no change) if fewer
        rows or slots are free."""
        if isinstance(num_rows, int) and not isinstance(num_rows, bool) and num_rows > len(self._free_slots):
            return None
        rows = super().alloc(num_rows)
        if not rows:
            return rows
        slots = self._free_slots[-len(rows):]
        del self._free_slots[-len(rows):]
        slots.reverse()
        self.slot_generation[slots] += 1
        self.row_to_state[rows] = torch.tensor(slots, dtype=torch.int32, device=self.row_to_state.device)
        return rows

    def free(self, rows: Iterable[int]) -> None:
        """Return rows and their state slots (checked as :meth:`ReqToTokenPool.free` does,
        before anything changes); the slots' states are stale, not cleared."""
        rows = [_as_int(row, "row") for row in rows]
        super().free(rows)
        if rows:
            self._free_slots.extend(int(s) for s in self.row_to_state[rows].tolist())
            self.row_to_state[rows] = PADDING_SLOT

    def clear(self) -> None:
        """Free every row and slot; generations are kept."""
        super().clear()
        if hasattr(self, "row_to_state"):  # (not yet while ReqToTokenPool.__init__ runs)
            self._free_slots = list(range(self.num_state_slots, PADDING_SLOT, -1))
            self.row_to_state.zero_()

    def check_invariants(self) -> None:
        """:meth:`ReqToTokenPool.check_invariants`, and: every allocated row owns a slot of
        its own, free rows point at the padding slot, and a slot is either free or
        owned by exactly one row. O(size + slots)."""
        super().check_invariants()
        assert self.row_to_state.shape == (self.size + 1,) and self.row_to_state.dtype == torch.int32
        assert self.slot_generation.shape == (self.num_state_slots + 1,)
        assert int(self.slot_generation[PADDING_SLOT]) == 0, "the padding slot was handed out"
        mapping = self.row_to_state.tolist()
        owned = [mapping[row] for row in range(1, self.size + 1) if self.is_allocated(row)]
        assert all(0 < s <= self.num_state_slots for s in owned), "an allocated row has no slot"
        assert len(set(owned)) == len(owned), "two rows share a state slot"
        assert all(mapping[row] == PADDING_SLOT for row in range(self.size + 1) if not self.is_allocated(row))
        free = self._free_slots
        assert len(set(free)) == len(free), "a slot is on the free list twice"
        assert set(free) | set(owned) == set(range(1, self.num_state_slots + 1)) and not set(free) & set(owned)
        assert bool((self.slot_generation[owned] >= 1).all()) if owned else True
