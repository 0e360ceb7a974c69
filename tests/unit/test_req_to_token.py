import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.engine.req_to_token import PADDING_ROW, ReqToTokenPool
from hicache.errors import DoubleFree, InvalidArgument


def test_table_shape_and_padding_row():
    pool = ReqToTokenPool(3, 10)
    assert pool.req_to_token.shape == (4, 10) and pool.req_to_token.dtype == torch.int32
    assert pool.generation.tolist() == [0, 0, 0, 0]
    assert pool.num_free == 3 and pool.num_allocated == 0
    pool.check_invariants()


def test_rows_come_from_the_tail_and_freed_rows_come_back_first():
    pool = ReqToTokenPool(6, 4)
    assert pool.alloc(3) == [1, 2, 3]
    assert pool.alloc(1) == [4]
    pool.free([2, 4])
    pool.free([1])
    assert pool.alloc(2) == [1, 4]
    assert pool.alloc(2) == [2, 5]
    pool.check_invariants()


def test_row_zero_is_never_handed_out():
    pool = ReqToTokenPool(4, 2)
    rows = pool.alloc(4)
    assert PADDING_ROW not in rows and sorted(rows) == [1, 2, 3, 4]
    assert pool.alloc(1) is None
    pool.free(rows)
    pool.clear()
    assert sorted(pool.alloc(4)) == [1, 2, 3, 4]
    assert int(pool.generation[PADDING_ROW]) == 0
    pool.check_invariants()


def test_alloc_too_many_returns_none_and_changes_nothing():
    pool = ReqToTokenPool(3, 2)
    pool.alloc(2)
    generation = pool.generation.clone()
    assert pool.alloc(2) is None
    assert pool.num_free == 1 and torch.equal(pool.generation, generation)
    assert pool.alloc(0) == []
    with pytest.raises(InvalidArgument):
        pool.alloc(-1)
    assert ReqToTokenPool(0, 1).alloc(1) is None
    pool.check_invariants()


def test_alloc_for_keeps_held_rows_and_fills_the_rest_in_order():
    pool = ReqToTokenPool(5, 8)
    first = pool.alloc_for([None, None])
    assert first == [1, 2]
    # The first request's next chunk keeps row 1; two new requests join.
    assert pool.alloc_for([None, first[0], None]) == [3, 1, 4]
    assert pool.generation.tolist() == [0, 1, 1, 1, 1, 0]
    assert pool.alloc_for([1, 2, 3]) == [1, 2, 3]
    assert pool.num_free == 1
    pool.check_invariants()


def test_alloc_for_without_enough_rows_changes_nothing():
    pool = ReqToTokenPool(3, 8)
    held = pool.alloc(2)
    assert pool.alloc_for([held[0], None, None]) is None
    assert pool.num_free == 1 and pool.generation.tolist() == [0, 1, 1, 0]
    pool.check_invariants()


def test_alloc_for_rejects_rows_that_are_not_held():
    pool = ReqToTokenPool(4, 8)
    rows = pool.alloc(2)
    with pytest.raises(InvalidArgument):
        pool.alloc_for([3, None])  # free
    with pytest.raises(InvalidArgument):
        pool.alloc_for([PADDING_ROW])
    with pytest.raises(InvalidArgument):
        pool.alloc_for([9])
    with pytest.raises(InvalidArgument):
        pool.alloc_for([rows[0], rows[0]])
    with pytest.raises(InvalidArgument):
        pool.alloc_for(["1"])
    assert pool.num_free == 2
    pool.check_invariants()


def test_generation_counts_hand_outs_and_survives_clear():
    pool = ReqToTokenPool(2, 4)
    (row,) = pool.alloc(1)
    seen = int(pool.generation[row])
    assert seen == 1
    pool.free([row])
    assert int(pool.generation[row]) == seen  # freeing does not count
    assert pool.alloc(1) == [row]
    assert int(pool.generation[row]) == 2  # a late reader holding generation 1 sees the reuse
    pool.clear()
    assert pool.num_free == 2 and pool.generation.tolist() == [0, 2, 0]
    assert pool.alloc(2) == [1, 2]
    assert pool.generation.tolist() == [0, 3, 1]
    pool.check_invariants()


def test_free_rejects_caller_bugs_before_any_change():
    pool = ReqToTokenPool(5, 4)
    rows = pool.alloc(4)
    pool.free([rows[3]])
    bad_calls = [
        (DoubleFree, [rows[0], rows[3]]),  # rows[3] already free
        (DoubleFree, [rows[0], rows[1], rows[0]]),
        (InvalidArgument, [rows[0], PADDING_ROW]),
        (InvalidArgument, [rows[0], 6]),
        (InvalidArgument, [rows[0], -1]),
        (InvalidArgument, [rows[0], 1.0]),
        (InvalidArgument, [True]),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            pool.free(call)
        assert pool.num_free == 2 and all(pool.is_allocated(row) for row in rows[:3]), call
        pool.check_invariants()
    pool.free(torch.tensor(rows[:3]))  # 0-d tensors and numpy ints are rows too
    assert pool.num_free == 5
    pool.check_invariants()


def test_write_fills_a_run_of_positions():
    pool = ReqToTokenPool(2, 6)
    (row,) = pool.alloc(1)
    pool.write(row, 0, torch.tensor([40, 41], dtype=torch.int64))
    pool.write(row, 2, [7, 8, 9])
    pool.write(row, 6, [])
    assert pool.req_to_token[row].tolist() == [40, 41, 7, 8, 9, 0]
    assert pool.req_to_token[PADDING_ROW].tolist() == [0] * 6


@pytest.mark.parametrize(
    "row, start, slots",
    [
        (2, 0, [1]),  # not allocated
        (PADDING_ROW, 0, [1]),
        (3, 0, [1]),  # outside the table
        (1, 5, [1, 2]),  # past max_context_len
        (1, -1, [1]),
        (1, 0, [[1]]),
        (1, 0, [1.5]),
    ],
)
def test_write_rejects_bad_targets(row, start, slots):
    pool = ReqToTokenPool(2, 6)
    pool.alloc(1)
    with pytest.raises(InvalidArgument):
        pool.write(row, start, slots)
    assert not pool.req_to_token.any()


def test_bad_construction():
    for size, max_context_len in [(-1, 4), (2, 0), (2.0, 4), (2, True)]:
        with pytest.raises(InvalidArgument):
            ReqToTokenPool(size, max_context_len)


class ReqToTokenPoolMachine(RuleBasedStateMachine):
    """The pool against a model: a stack of free rows and a hand-out count per row."""

    @initialize(size=st.integers(0, 6))
    def setup(self, size):
        self.size = size
        self.pool = ReqToTokenPool(size, 5)
        self.free_stack = list(range(size, 0, -1))
        self.generation = [0] * (size + 1)

    def allocated(self) -> list[int]:
        return sorted(set(range(1, self.size + 1)) - set(self.free_stack))

    def take(self, num_rows):
        rows = [self.free_stack.pop() for _ in range(num_rows)]
        for row in rows:
            self.generation[row] += 1
        return rows

    @rule(num_rows=st.integers(0, 4))
    def alloc(self, num_rows):
        rows = self.pool.alloc(num_rows)
        if num_rows > len(self.free_stack):
            assert rows is None
        else:
            assert rows == self.take(num_rows)

    @rule(data=st.data(), num_new=st.integers(0, 3))
    def alloc_for(self, data, num_new):
        held = data.draw(st.lists(st.sampled_from(self.allocated()), unique=True) if self.allocated() else st.just([]))
        batch = data.draw(st.permutations(held + [None] * num_new))
        rows = self.pool.alloc_for(batch)
        if num_new > len(self.free_stack):
            assert rows is None
            return
        fresh = iter(self.take(num_new))
        assert rows == [next(fresh) if row is None else row for row in batch]

    @precondition(lambda self: self.allocated())
    @rule(data=st.data())
    def free(self, data):
        rows = data.draw(st.lists(st.sampled_from(self.allocated()), min_size=1, unique=True))
        self.pool.free(rows)
        self.free_stack.extend(rows)

    @rule(data=st.data())
    def bad_free(self, data):
        candidates = [PADDING_ROW, self.size + 1, -1, *self.free_stack]
        bad = data.draw(st.sampled_from(candidates))
        good = data.draw(st.lists(st.sampled_from(self.allocated()), unique=True) if self.allocated() else st.just([]))
        if good and data.draw(st.booleans()):
            bad = good[0]  # the same row twice in one call
        with pytest.raises(InvalidArgument):
            self.pool.free(data.draw(st.permutations([*good, bad])))

    @precondition(lambda self: self.allocated())
    @rule(data=st.data(), start=st.integers(0, 5), values=st.lists(st.integers(0, 2**31 - 1), max_size=5))
    def write(self, data, start, values):
        row = data.draw(st.sampled_from(self.allocated()))
        if start + len(values) > 5:
            with pytest.raises(InvalidArgument):
                self.pool.write(row, start, values)
            return
        self.pool.write(row, start, values)
        assert self.pool.req_to_token[row, start : start + len(values)].tolist() == values

    @rule()
    def clear(self):
        self.pool.clear()
        self.free_stack = list(range(self.size, 0, -1))

    @invariant()
    def agrees_with_model(self):
        self.pool.check_invariants()
        assert self.pool.num_free == len(self.free_stack)
        assert self.pool.generation.tolist() == self.generation
        assert [row for row in range(self.size + 2) if self.pool.is_allocated(row)] == self.allocated()


TestReqToTokenPoolMachine = ReqToTokenPoolMachine.TestCase
TestReqToTokenPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
