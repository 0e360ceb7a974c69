import os
import pickle
import signal
import socket
import types

import numpy as np
import pytest
import torch

from cuda_ipc_util import VisibleGpus
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
    counters.complete_layer(first, 0)
    counters.fail(first)
    counters.finish(first)
    second = counters.begin()  # the other slot
    for layer in range(3):
        counters.complete_layer(second, layer)
    counters.finish(second)
    third_slot_user = counters.begin()
    assert third_slot_user.slot == first.slot and third_slot_user.generation > first.generation
    # The new load has done nothing yet: layer 0 of it is not done...
    assert not waiter.is_done(third_slot_user, 0)
    # ...and a waiter still holding the first ticket learns how its own load ended.
    with pytest.raises(LoadFailed):
        waiter.is_done(first, 1)
    counters.complete_layer(third_slot_user, 1)
    with pytest.raises(LoadFailed):
        waiter.is_done(first, 1)


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


def test_a_load_whose_slot_moved_on_still_reads_as_landed_or_failed(ring):
    """A waiter may look at a ticket only after its load ended and the slot went to a
    later load (a vLLM step answers more loads than the ring has slots; the worker
    waits after the daemon finished): the load is over, and the ring still says how it
    ended — landed (every layer done) or failed — not that it is stale. A ticket older
    than what the ring remembers, or of another ring, is still stale."""
    counters, waiter = ring
    landed = counters.begin()
    for layer in range(3):
        counters.complete_layer(landed, layer)
    counters.finish(landed)
    failed = counters.begin()
    counters.complete_layer(failed, 0)
    counters.fail(failed)
    counters.finish(failed)
    later = counters.begin(), counters.begin()
    assert [t.slot for t in later] == [landed.slot, failed.slot]
    assert not waiter.holds(landed) and not waiter.holds(failed)
    assert [waiter.is_done(landed, layer) for layer in range(3)] == [True] * 3
    waiter.wait_layer(landed, 2, timeout_s=0)
    for layer in range(3):
        with pytest.raises(LoadFailed):
            waiter.is_done(failed, layer)
    with pytest.raises(LoadFailed):
        waiter.wait_layer(failed, 2, timeout_s=0)
    assert not any(waiter.is_done(t, 0) for t in later)  # the later loads are their own
    for t in later:
        counters.fail(t)
        counters.finish(t)
    while True:  # a long way on: the ring has forgotten the first load
        t = counters.begin()
        counters.fail(t)
        counters.finish(t)
        try:
            waiter.is_done(landed, 0)
        except StaleTicket:
            break
        assert t.generation - landed.generation < 1000
    other = LayerCounters(num_slots=2, num_layers=3)
    try:
        with pytest.raises(StaleTicket):
            waiter.is_done(Ticket(0, other.begin().generation), 0)
    finally:
        other.close()


def test_gpu_mode_a_landed_load_whose_slot_moved_on_waits_on_no_event(ring):
    """The slot's events may be recorded for a later load by now: a load over reads
    from the ring's record of its outcome, and the engine's stream waits on nothing
    (its copies ran before the daemon gave the slot back)."""
    counters, waiter = ring
    waiter.events = events = _Events()
    ticket = counters.begin()
    for layer in range(3):
        counters.complete_layer(ticket, layer)
    counters.finish(ticket)
    between = counters.begin()
    later = counters.begin()
    assert later.slot == ticket.slot and between.slot != ticket.slot
    counters.complete_layer(later, 0)  # (its event for layer 0 recorded)
    waiter.wait_layer(ticket, 0, timeout_s=0)
    assert events.waited == []


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


def _ring_in_a_child() -> tuple[int, socket.socket, LayerWaiter, Ticket]:
    """A daemon's ring in a process of its own (forked), with one load begun and its
    layer 0 stamped; the child waits to be killed (or for the socket returned to
    close). Returns its pid, that socket, a waiter on its ring (the descriptor handed
    over as a daemon hands it), and the load's ticket."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            ours.close()
            counters = LayerCounters(num_slots=2, num_layers=3)
            ticket = counters.begin()
            counters.complete_layer(ticket, 0)
            handle = counters.handle(b"t").to_dict()
            socket.send_fds(theirs, [pickle.dumps((handle, tuple(ticket)))], [counters.reader_fd()])
            theirs.recv(1)  # (never answered: killed while it waits)
        finally:
            os._exit(0)
    theirs.close()
    data, fds, _, _ = socket.recv_fds(ours, 4096, 1)
    handle, ticket = pickle.loads(data)
    return pid, ours, LayerWaiter(CountersHandle.from_dict(handle), fds[0]), Ticket(*ticket)


def test_a_load_whose_daemon_was_killed_mid_copy_fails_at_once_and_what_landed_stays_landed():
    """The daemon holds a lock on its ring while it may stamp it: a waiter whose daemon
    is gone learns that its layers can never land (``LoadFailed``) instead of waiting
    out its timeout — and an engine that gave up on the load knows nothing writes its
    blocks any more. While the daemon lives, a wait times out as before."""
    pid, line, waiter, ticket = _ring_in_a_child()
    try:
        assert waiter.handle.writer_lock
        waiter.wait_layer(ticket, 0, timeout_s=30)
        with pytest.raises(WaitTimeout):
            waiter.wait_layer(ticket, 1, timeout_s=0.05)  # (the daemon lives: its lock is probed meanwhile)
        assert not waiter.writer_gone()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        line.close()
    try:
        assert waiter.writer_gone()
        waiter.wait_layer(ticket, 0, timeout_s=30)  # landed before: still landed
        with pytest.raises(LoadFailed):
            waiter.wait_layer(ticket, 1, timeout_s=30)
    finally:
        waiter.close()


def test_a_ring_let_go_of_by_its_daemon_fails_the_layers_not_landed_and_no_lock_says_nothing(ring):
    """The daemon closes a pool's ring once no copy for the pool is left: its loads'
    missing layers can never land. A handle without ``writer_lock`` (a daemon that
    holds no lock) never reads as gone: its waits time out."""
    counters, waiter = ring
    ticket = counters.begin()
    counters.complete_layer(ticket, 2)
    blind = LayerWaiter(CountersHandle.from_dict({**counters.handle(b"t").to_dict(), "writer_lock": False}),
                        counters.reader_fd())
    try:
        counters.close()
        waiter.wait_layer(ticket, 2, timeout_s=30)
        with pytest.raises(LoadFailed):
            waiter.wait_layer(ticket, 0, timeout_s=30)
        assert not blind.writer_gone()
        with pytest.raises(WaitTimeout):
            blind.wait_layer(ticket, 0, timeout_s=0.05)
    finally:
        blind.close()


class _Events:
    """A waiter's CUDA events, as seen from the CPU: which (ticket, layer) the engine's
    stream was made to wait on, in order."""

    def __init__(self) -> None:
        self.waited: list[tuple[Ticket, int]] = []

    def wait(self, ticket: Ticket, layer: int, stream=None) -> None:
        self.waited.append((ticket, layer))


def test_gpu_mode_waits_on_a_layers_event_only_once_the_ring_says_it_was_recorded_for_the_load(ring):
    """GPU mode: the daemon stamps a layer as it records the layer's event (the copy is
    on its stream); the engine's stream waits on the event only after that stamp. An
    event not yet recorded for this load holds its previous load's record, or none: a
    stream made to wait on it would not wait for this load's copy (before, the engine
    waited on the event at once, whatever the ring said)."""
    counters, waiter = ring
    waiter.events = events = _Events()
    ticket = counters.begin()
    with pytest.raises(WaitTimeout):
        waiter.wait_layer(ticket, 0, timeout_s=0.05)
    assert events.waited == []
    counters.complete_layer(ticket, 0)  # (CudaCopy.layer_done: recorded, then stamped)
    waiter.wait_layer(ticket, 0, timeout_s=30)
    assert events.waited == [(ticket, 0)]
    counters.fail(ticket)  # a load cut short: layers 1 and 2 never enqueued
    for layer in (1, 2):
        with pytest.raises(LoadFailed):
            waiter.wait_layer(ticket, layer, timeout_s=30)
    assert events.waited == [(ticket, 0)]


class _FakeCuda:
    """torch.cuda's event contract on a machine without CUDA (c10/cuda/CUDAEvent.h): an
    event is created lazily, on the device of the stream it is first recorded on or, if
    ``ipc_handle()`` comes first, on the current device (``torch.cuda.device(...)`` at
    construction does not bind it); recording it on another device's stream fails. Its
    IPC handle names the node's GPU (``gpus``: the process's view of them), which every
    process calls by its own index; opening one makes the index given current, which
    fails for an index the process does not have."""

    def __init__(self, gpus: VisibleGpus | None = None) -> None:
        self.current = 0
        self.gpus = gpus
        self.opened: list[tuple[int, int]] = []  # (the index opened on, the node's GPU of the handle)
        fake = self

        class Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                assert interprocess and not enable_timing  # (interprocess events cannot time)
                self.device = None

            def ipc_handle(self):
                if self.device is None:
                    self.device = fake.current
                return bytes([fake.node_gpu(self.device)]) * 64

            @classmethod
            def from_ipc_handle(cls, device, handle):
                index = torch.device(device).index
                if not 0 <= index < torch.cuda.device_count():
                    raise RuntimeError("CUDA error: invalid device ordinal")
                fake.opened.append((index, handle[0]))
                event = cls(interprocess=True)
                event.device = index
                return event

            def record(self, stream):
                if self.device is None:
                    self.device = stream.device
                if self.device != stream.device:
                    raise RuntimeError(f"Event device index {self.device} does not match recording stream's "
                                       f"device index {stream.device}")

        self.Event = Event

    def node_gpu(self, index: int) -> int:
        return index if self.gpus is None else self.gpus.visible[index]

    def device(self, index):
        fake = self

        class _Guard:
            def __enter__(self):
                self.previous, fake.current = fake.current, index

            def __exit__(self, *exc):
                fake.current = self.previous

        return _Guard()


def test_gpu_mode_events_belong_to_the_pools_device_whatever_the_current_device(monkeypatch):
    """A pool on a second GPU: its ring's events must be created there, where the
    daemon's copy stream records them, and their IPC handles opened there by the
    engine. The daemon hands the handles out on its owner thread, whose current device
    is the first (before, the events were created lazily by that first ipc_handle(),
    on device 0, and every load of the pool failed at its first record)."""
    fake = _FakeCuda(VisibleGpus(monkeypatch))
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    counters = LayerCounters(num_slots=2, num_layers=3, cuda_device=1)
    try:
        handle = counters.handle(b"token")
        assert handle.device == 1
        assert {h[0] for h in handle.event_handles} == {1}
        ticket = counters.begin()
        stream = types.SimpleNamespace(device=1)  # (CudaCopy's stream on cuda:1)
        for layer in range(3):
            counters.events.record(ticket, layer, stream)
            counters.complete_layer(ticket, layer)
        counters.finish(ticket)
    finally:
        counters.close()


def test_gpu_mode_events_are_opened_on_the_engines_index_of_the_daemons_gpu(monkeypatch):
    """The daemon sees every GPU of the node and the pool is on its cuda:3; the engine
    runs with CUDA_VISIBLE_DEVICES=3, so that GPU is its cuda:0. The handle names the
    GPU by UUID, and the engine opens the events on its own index of it (before, on its
    cuda:3: a device it does not have)."""
    gpus = VisibleGpus(monkeypatch)  # the daemon's view
    fake = _FakeCuda(gpus)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    counters = LayerCounters(num_slots=2, num_layers=3, cuda_device=3)
    try:
        handle = CountersHandle.from_dict(counters.handle(b"t").to_dict())
        assert (handle.device, handle.device_uuid) == (3, gpus.uuid(3))
        gpus.visible = (3,)  # the engine's view
        waiter = LayerWaiter(handle, counters.reader_fd())
        assert fake.opened == [(0, 3)] * 6 and waiter.events.device == 0
        waiter.close()
        gpus.visible = (0, 1)  # an engine that does not see the daemon's GPU
        with pytest.raises(InvalidArgument, match=f"GPU {gpus.uuid(3)} is not visible here"):
            LayerWaiter(handle, counters.reader_fd())
    finally:
        counters.close()


def test_gpu_mode_events_of_a_daemon_that_names_no_uuid_are_opened_on_its_index(monkeypatch):
    """A daemon older than the UUID: its index, as before."""
    gpus = VisibleGpus(monkeypatch)
    fake = _FakeCuda(gpus)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    handle = CountersHandle.from_dict({"token": b"t", "num_slots": 1, "num_layers": 2,
                                       "event_handles": [bytes([2]) * 64] * 2, "device": 2})
    counters = LayerCounters(num_slots=1, num_layers=2)
    try:
        waiter = LayerWaiter(handle, counters.reader_fd())
        assert handle.device_uuid is None and fake.opened == [(2, 2)] * 2 and waiter.events.device == 2
        waiter.close()
    finally:
        counters.close()
