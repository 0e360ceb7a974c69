"""HybridReqToTokenPool: each request row owns a state slot, allocated and freed with it."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache.engine.req_to_token import PADDING_ROW, PADDING_SLOT, HybridReqToTokenPool
from hicache.errors import DoubleFree, InvalidArgument


def test_each_row_gets_a_slot_and_the_mapping_tensor_says_which():
    pool = HybridReqToTokenPool(4, 8)
    rows = pool.alloc(3)
    slots = [pool.state_slot(r) for r in rows]
    assert len(set(slots)) == 3 and PADDING_SLOT not in slots
    assert pool.row_to_state.dtype == torch.int32 and pool.row_to_state.shape == (5,)
    assert [int(pool.row_to_state[r]) for r in rows] == slots
    assert int(pool.row_to_state[PADDING_ROW]) == PADDING_SLOT
    # A batch's states are gathered through the table (padded entries read slot 0).
    batch = torch.tensor([rows[1], PADDING_ROW, rows[0]])
    assert pool.row_to_state[batch].tolist() == [slots[1], PADDING_SLOT, slots[0]]
    pool.check_invariants()


def test_a_freed_row_gives_its_slot_back_first_and_points_at_padding():
    pool = HybridReqToTokenPool(4, 8)
    a, b = pool.alloc(2)
    slot_a = pool.state_slot(a)
    pool.free([a])
    assert int(pool.row_to_state[a]) == PADDING_SLOT
    (c,) = pool.alloc(1)
    assert pool.state_slot(c) == slot_a  # the last freed slot is the next handed out
    assert int(pool.slot_generation[slot_a]) == 2
    with pytest.raises(InvalidArgument):
        pool.state_slot(4)  # never allocated
    pool.check_invariants()


def test_fewer_slots_than_rows_limits_allocation_without_change():
    pool = HybridReqToTokenPool(4, 8, num_state_slots=2)
    assert pool.alloc(3) is None
    assert pool.num_free == 4 and pool.num_free_slots == 2
    rows = pool.alloc(2)
    assert pool.alloc(1) is None and pool.num_free == 2
    pool.free(rows[:1])
    assert pool.alloc(1) is not None
    pool.check_invariants()


def test_chunked_prefill_keeps_its_row_and_slot():
    pool = HybridReqToTokenPool(4, 8)
    (held,) = pool.alloc(1)
    slot = pool.state_slot(held)
    rows = pool.alloc_for([held, None, None])
    assert rows[0] == held and pool.state_slot(held) == slot
    assert len({pool.state_slot(r) for r in rows}) == 3
    pool.check_invariants()


def test_caller_bugs_raise_before_any_change():
    pool = HybridReqToTokenPool(3, 4)
    rows = pool.alloc(2)
    before = (pool.row_to_state.clone(), list(pool._free_slots))
    for bad, error in (([rows[0], rows[0]], DoubleFree), ([PADDING_ROW], InvalidArgument), ([rows[0], 3], DoubleFree),
                       ([9], InvalidArgument)):
        with pytest.raises(error):
            pool.free(bad)
        assert torch.equal(pool.row_to_state, before[0]) and pool._free_slots == before[1]
    with pytest.raises(InvalidArgument):
        HybridReqToTokenPool(3, 4, num_state_slots=-1)
    pool.check_invariants()


def test_clear_frees_every_slot_and_keeps_generations():
    pool = HybridReqToTokenPool(3, 4)
    pool.alloc(3)
    pool.clear()
    assert pool.num_free_slots == 3 and not bool(pool.row_to_state.any())
    rows = pool.alloc(3)
    assert sorted(pool.state_slot(r) for r in rows) == [1, 2, 3]
    assert pool.slot_generation[1:].tolist() == [2, 2, 2]
    pool.check_invariants()


class HybridPoolMachine(RuleBasedStateMachine):
    """Random allocs, frees, chunked-prefill allocs and clears: the invariants after
    every step, and each live request keeps the slot it was given."""

    def __init__(self):
        super().__init__()
        self.pool = HybridReqToTokenPool(6, 4, num_state_slots=5)
        self.live: dict[int, int] = {}  # row -> its slot

    @rule(n=st.integers(0, 4))
    def alloc(self, n):
        rows = self.pool.alloc(n)
        if rows is None:
            assert n > min(self.pool.num_free, self.pool.num_free_slots)
            return
        for row in rows:
            assert row not in self.live
            self.live[row] = self.pool.state_slot(row)

    @rule(data=st.data())
    def free_some(self, data):
        if not self.live:
            return
        rows = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, max_size=3))
        self.pool.free(rows)
        for row in rows:
            del self.live[row]

    @rule(data=st.data(), fresh=st.integers(0, 2))
    def chunked(self, data, fresh):
        kept = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, max_size=2)) if self.live else []
        rows = self.pool.alloc_for(kept + [None] * fresh)
        if rows is None:
            return
        for row in rows[len(kept):]:
            self.live[row] = self.pool.state_slot(row)

    @rule()
    def clear(self):
        self.pool.clear()
        self.live.clear()

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        for row, slot in self.live.items():
            assert self.pool.state_slot(row) == slot


TestHybridPoolMachine = HybridPoolMachine.TestCase
TestHybridPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
