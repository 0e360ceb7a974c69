import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache.errors import DoubleFree, InvalidArgument, PageOutOfRange
from hicache.pages import PADDING_PAGE, NullPageAllocator, PageAllocator, as_page_ids


def test_device_allocator_never_hands_out_the_padding_page():
    alloc = PageAllocator.for_device(8)
    pages = alloc.alloc(8)
    assert sorted(pages.tolist()) == list(range(1, 9))
    assert PADDING_PAGE not in pages
    assert alloc.alloc(1) is None
    with pytest.raises(PageOutOfRange):
        alloc.free([PADDING_PAGE])
    alloc.check_invariants()


def test_the_null_allocator_of_an_engine_owned_pool_knows_its_range_and_nothing_else():
    alloc = NullPageAllocator((1 << 31) - 2)  # (costs nothing whatever the engine claims)
    assert (alloc.capacity, alloc.first_page_id, alloc.num_free, alloc.num_allocated) == ((1 << 31) - 2, 1, 0, 0)
    with alloc.free_group():
        alloc.free([])
    with pytest.raises(DoubleFree):
        alloc.free([3])
    with pytest.raises(InvalidArgument):
        alloc.alloc(1)
    with pytest.raises(InvalidArgument):
        alloc.take([3])
    with pytest.raises(InvalidArgument):
        NullPageAllocator(-1)
    alloc.check_invariants()


def test_host_allocator_starts_at_zero():
    alloc = PageAllocator.for_host(4)
    assert sorted(alloc.alloc(4).tolist()) == [0, 1, 2, 3]


def test_alloc_too_many_returns_none_and_changes_nothing():
    alloc = PageAllocator.for_host(5)
    alloc.alloc(3)
    assert alloc.alloc(3) is None
    assert alloc.num_free == 2 and alloc.num_allocated == 3
    assert alloc.alloc(0).tolist() == []
    with pytest.raises(InvalidArgument):
        alloc.alloc(-1)
    alloc.check_invariants()


def test_double_free_and_out_of_range_are_rejected_without_change():
    alloc = PageAllocator.for_device(6, sort_free=False)
    pages = alloc.alloc(4)
    alloc.free(pages[:1])
    with pytest.raises(DoubleFree):
        alloc.free(pages[:2])  # pages[0] is already free
    with pytest.raises(DoubleFree):
        alloc.free([pages[1], pages[1]])
    with pytest.raises(PageOutOfRange):
        alloc.free([7])
    with pytest.raises(PageOutOfRange):
        alloc.free([-1])
    assert alloc.num_free == 3
    alloc.check_invariants()
    alloc.free(pages[1:])
    assert alloc.num_free == 6
    alloc.check_invariants()


def test_free_group_releases_once_and_validates_the_batch():
    alloc = PageAllocator.for_host(8, sort_free=False)
    pages = alloc.alloc(6)
    with alloc.free_group():
        alloc.free(pages[:2])
        alloc.free(pages[2:4])
        assert alloc.num_free == 2, "frees inside a group wait for its end"
    assert alloc.num_free == 6
    with pytest.raises(DoubleFree):
        with alloc.free_group():
            alloc.free(pages[4:])
            alloc.free(pages[5:])
    assert alloc.num_free == 6, "a rejected group frees nothing"
    with pytest.raises(InvalidArgument):
        with alloc.free_group():
            with alloc.free_group():
                pass
    alloc.check_invariants()


def test_sorted_free_list_gives_contiguous_runs():
    alloc = PageAllocator.for_device(12, sort_free=True)
    a, b, c = alloc.alloc(4), alloc.alloc(4), alloc.alloc(4)
    alloc.free(c)
    alloc.free(a)
    alloc.free(b[::-1])
    again = alloc.alloc(12)
    assert again.tolist() == list(range(1, 13))
    alloc.check_invariants()


def test_unsorted_free_list_is_fifo():
    alloc = PageAllocator.for_host(4, sort_free=False)
    pages = alloc.alloc(4)
    alloc.free(pages[[3, 1]])
    assert alloc.alloc(2).tolist() == [3, 1]


def test_as_page_ids():
    assert as_page_ids([3, 1]).dtype == np.dtype("<i4")
    assert as_page_ids(np.array([3, 1], dtype=np.int32).tobytes()).tolist() == [3, 1]
    for bad in (b"\x00", np.zeros((1, 1)), np.array([0.5]), [2**31], [-1]):
        with pytest.raises(InvalidArgument):
            as_page_ids(bad)


@pytest.mark.parametrize("capacity", [-1, 1.5])
def test_bad_capacity(capacity):
    with pytest.raises(InvalidArgument):
        PageAllocator(capacity)


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(0, 12), sort_free=st.booleans(), device=st.booleans())
    def setup(self, capacity, sort_free, device):
        self.first = 1 if device else 0
        factory = PageAllocator.for_device if device else PageAllocator.for_host
        self.alloc = factory(capacity, sort_free=sort_free)
        self.free_model = set(range(self.first, self.first + capacity))
        self.held: list[int] = []

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        pages = self.alloc.alloc(n)
        if n > len(self.free_model):
            assert pages is None
            return
        got = pages.tolist()
        assert len(set(got)) == n and set(got) <= self.free_model
        self.free_model -= set(got)
        self.held += got

    @rule(data=st.data(), grouped=st.booleans())
    def release(self, data, grouped):
        if not self.held:
            return
        chosen = data.draw(st.lists(st.sampled_from(self.held), unique=True, min_size=1))
        if grouped:
            with self.alloc.free_group():
                for page in chosen:
                    self.alloc.free([page])
        else:
            self.alloc.free(chosen)
        for page in chosen:
            self.held.remove(page)
        self.free_model |= set(chosen)

    @rule(data=st.data())
    def double_free(self, data):
        if not self.free_model:
            return
        page = data.draw(st.sampled_from(sorted(self.free_model)))
        with pytest.raises(DoubleFree):
            self.alloc.free([page])

    @invariant()
    def consistent(self):
        if hasattr(self, "alloc"):
            self.alloc.check_invariants()
            assert self.alloc.num_free == len(self.free_model)


AllocatorMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_allocator_state_machine = AllocatorMachine.TestCase


def test_take_specific_pages():
    alloc = PageAllocator.for_device(8)
    alloc.take([3, 5])
    assert alloc.num_free == 6 and 3 not in alloc.alloc(6).tolist()
    with pytest.raises(InvalidArgument):
        alloc.take([1])  # not free any more
    fresh = PageAllocator.for_host(4)
    with pytest.raises(PageOutOfRange):
        fresh.take([4])
    with pytest.raises(InvalidArgument):
        fresh.take([2, 2])
    fresh.check_invariants()
    alloc.check_invariants()
