import numpy as np
import pytest

from hicache.counters import CountersHandle, LayerCounters, LayerWaiter, Ticket
from hicache.errors import InvalidArgument, LoadFailed, StaleTicket, WaitTimeout


@pytest.fixture
def ring():
    counters = LayerCounters(num_slots=2, num_layers=3)
    waiter = LayerWaiter(CountersHandle.from_dict(counters.handle(b"t").to_dict()), counters.reader_fd())
    yield counters, waiter
    waiter.close()
    counters.close()


def test_layers_complete_in_any_order(ring):
    counters, waiter = ring
    ticket = counters.begin()
    assert [waiter.is_done(ticket, i) for i in range(3)] == [False] * 3
    counters.complete_layer(ticket, 1)
    assert [waiter.is_done(ticket, i) for i in range(3)] == [False, True, False]
    counters.complete_layer(ticket, 0)
    counters.complete_layer(ticket, 2)
    waiter.wait_layer(ticket, 2)
    with pytest.raises(InvalidArgument):
        waiter.is_done(ticket, 3)


def test_a_reused_slot_never_reports_an_older_load_as_done(ring):
    counters, waiter = ring
    first = counters.begin()
    for layer in range(3):
        counters.complete_layer(first, layer)
    counters.finish(first)
    second = counters.begin()  # the other slot
    for layer in range(3):
        counters.complete_layer(second, layer)
    counters.finish(second)
    third_slot_user = counters.begin()
    assert third_slot_user.slot == first.slot and third_slot_user.generation > first.generation
    # The new load has done nothing yet: layer 0 of it is not done...
    assert not waiter.is_done(third_slot_user, 0)
    # ...and a waiter still holding the first ticket learns the slot moved on.
    with pytest.raises(StaleTicket):
        waiter.is_done(first, 0)
    counters.complete_layer(third_slot_user, 0)
    with pytest.raises(StaleTicket):
        waiter.is_done(first, 0)


def test_a_ticket_is_held_by_its_own_ring_only_and_only_while_its_load_has_the_slot(ring):
    """What the client finds a ticket's ring by (a pool registered again has a new
    ring; loads of the old one may still be copying)."""
    counters, waiter = ring
    other = LayerCounters(num_slots=2, num_layers=3)
    other_waiter = LayerWaiter(CountersHandle.from_dict(other.handle(b"u").to_dict()), other.reader_fd())
    try:
        ours, theirs = counters.begin(), other.begin()
        assert ours.slot == theirs.slot  # (the same slot, each ring's own generations)
        assert waiter.holds(ours) and not waiter.holds(theirs)
        assert other_waiter.holds(theirs) and not other_waiter.holds(ours)
        assert not waiter.holds(Ticket(2, ours.generation)) and not waiter.holds(Ticket(-1, ours.generation))
        for layer in range(3):
            counters.complete_layer(ours, layer)
        assert waiter.holds(ours)  # landed: the slot is still its own
        counters.finish(ours)
        between = counters.begin()  # (the other slot)
        for layer in range(3):
            counters.complete_layer(between, layer)
        counters.finish(between)
        assert counters.begin().slot == ours.slot  # the slot moves on
        assert not waiter.holds(ours)
    finally:
        other_waiter.close()
        other.close()


def test_a_stale_stamp_from_the_previous_load_is_not_done(ring):
    counters, waiter = ring
    first = counters.begin()
    counters.complete_layer(first, 0)
    counters.fail(first)
    counters.finish(first)
    second = counters.begin()
    counters.fail(second)
    counters.finish(second)
    reuse = counters.begin()
    assert reuse.slot == first.slot
    # Layer 0 still carries the first load's stamp: it is not the new load's.
    assert not waiter.is_done(reuse, 0)


def test_failure_is_reported(ring):
    counters, waiter = ring
    ticket = counters.begin()
    counters.complete_layer(ticket, 0)
    counters.fail(ticket)
    assert waiter.is_done(ticket, 0)
    with pytest.raises(LoadFailed):
        waiter.wait_layer(ticket, 1)
    counters.finish(ticket)


def test_ring_exhaustion_and_misuse(ring):
    counters, waiter = ring
    a, b = counters.begin(), counters.begin()
    assert counters.begin() is None and counters.num_free_slots == 0
    with pytest.raises(InvalidArgument):
        counters.finish(a)  # layers still in flight
    with pytest.raises(InvalidArgument):
        counters.complete_layer(Ticket(a.slot, a.generation + 7), 0)
    with pytest.raises(InvalidArgument):
        counters.complete_layer(b, 3)
    with pytest.raises(WaitTimeout):
        waiter.wait_layer(a, 0, timeout_s=0)
    with pytest.raises(InvalidArgument):
        LayerCounters(0, 3)


def test_the_daemon_never_reads_the_shared_ring_back(ring):
    """Whatever lands in the shared words (an engine is untrusted input), the daemon's
    tickets, stamps and slot reuse go on from its own copy."""
    counters, waiter = ring
    ticket = counters.begin()
    counters.shared.array[:] = np.random.default_rng(3).integers(0, 256, counters.shared.nbytes, dtype=np.uint8)
    for layer in range(3):
        counters.complete_layer(ticket, layer)  # still a live ticket
    counters.finish(ticket)
    second = counters.begin()
    counters.shared.array[:] = 0xFF
    counters.fail(second)
    counters.finish(second)
    third = counters.begin()
    assert third.slot == ticket.slot and third.generation == second.generation + 1
    assert waiter.is_done(third, 0) is False  # the stamps it writes are right again
    counters.complete_layer(third, 0)
    assert waiter.is_done(third, 0)
    with pytest.raises(InvalidArgument):
        counters.complete_layer(ticket, 0)  # the old ticket is not live, whatever the ring says
