"""KV-cache events: what vLLM's and Dynamo's subscribers decode, over real zmq sockets."""

from __future__ import annotations

import os
import random
import signal
import struct
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.daemon.events import (
    END_SEQ, MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, EventPublisher, EventStream, StreamLedger, block_hash,
    seq_from_clock,
)
from hicache.errors import InvalidArgument

from kv_event_shapes import AllBlocksCleared, BlockRemoved, BlockStored, apply, decode

WAIT_S = 10.0  # a guard against hanging, never an assertion
PROBE = b"probe/"


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # closes what a failed test left open


@pytest.fixture
def publisher(context, tmp_path):
    with EventPublisher(f"ipc://{tmp_path / 'events'}", replay_endpoint=f"ipc://{tmp_path / 'replay'}",
                        context=context, clock=lambda: 1234.5) as pub:
        yield pub


def subscribe(context, publisher: EventPublisher, *topics: bytes) -> zmq.Socket:
    """A SUB socket that has joined: probe batches go out until one arrives (then the
    probes are drained). Call before queueing the events under test."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(publisher.endpoint)
    for topic in (*topics, PROBE):
        sub.setsockopt(zmq.SUBSCRIBE, topic)
    _probe_until_joined(publisher, sub, publisher.stream(PROBE + str(len(publisher.streams)).encode()))
    sub.setsockopt(zmq.UNSUBSCRIBE, PROBE)
    return sub


def _probe_until_joined(publisher: EventPublisher, sub: zmq.Socket, probe: EventStream) -> None:
    """Batches of ``probe`` go out until ``sub`` receives one; then the probes are drained."""
    deadline = time.monotonic() + WAIT_S
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the subscriber never joined"
        probe.removed([1], MEDIUM_CPU)
        publisher.publish()
    while sub.poll(20):
        assert sub.recv_multipart()[0].startswith(PROBE)


def receive(sub: zmq.Socket, count: int) -> list[list[bytes]]:
    messages = []
    while len(messages) < count:
        assert sub.poll(int(WAIT_S * 1000)), f"{len(messages)} of {count} messages arrived"
        messages.append(sub.recv_multipart())
    assert not sub.poll(50), "more messages than published"
    return messages


def ask(publisher: EventPublisher, dealer: zmq.Socket, *request: bytes) -> list[list[bytes]]:
    """Send a replay request; the replies up to and with the end marker."""
    dealer.send_multipart(list(request))
    replies = []
    deadline = time.monotonic() + WAIT_S
    while not replies or replies[-1][2] != END_SEQ:
        assert time.monotonic() < deadline, "no end marker"
        publisher.serve_replay()
        while dealer.poll(10):
            replies.append(dealer.recv_multipart())
    return replies


@pytest.fixture
def dealer(context, publisher):
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(publisher.replay_endpoint)
    yield sock
    sock.close()


def seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def test_block_hash_is_the_low_64_bits_of_the_key():
    key = bytes(range(0xF0, 0x100))
    assert block_hash(key) == struct.unpack(">Q", key[8:])[0] == 0xF8F9FAFBFCFDFEFF
    assert block_hash(bytes(16)) == 0
    with pytest.raises(InvalidArgument):
        block_hash(bytes(8))


def test_wire_shape_is_vllms():
    stream = EventStream(b"t", data_parallel_rank=3)
    assert stream.take_batch(1.0) is None
    top = (1 << 64) - 1
    stream.stored([top, 7], None, list(range(8)), 4, MEDIUM_CPU)
    stream.stored([9], 7, [1, 2, 3, 4], 4, MEDIUM_STORAGE, lora_name="adapter", extra_keys=[("salt",)])
    stream.removed([top], MEDIUM_CPU)
    seq, payload = stream.take_batch(2.5)
    assert seq == 0 and stream.take_batch(3.0) is None
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert (ts, rank) == (2.5, 3)
    assert events == [
        {"type": "BlockStored", "block_hashes": [top, 7], "parent_block_hash": None, "token_ids": list(range(8)),
         "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 7, "token_ids": [1, 2, 3, 4],
         "block_size": 4, "lora_id": None, "medium": "STORAGE", "lora_name": "adapter", "extra_keys": [["salt"]]},
        {"type": "BlockRemoved", "block_hashes": [top], "medium": "CPU"},
    ]
    batch = decode(payload)
    assert batch.events[1].extra_keys == [("salt",)]
    stream.cleared()
    assert msgspec.msgpack.decode(stream.take_batch(4.0)[1])[1] == [{"type": "AllBlocksCleared"}]


def test_bad_arguments_raise_at_the_caller():
    stream = EventStream(b"")
    with pytest.raises(InvalidArgument):
        stream.stored([1, 2], None, [], 16, MEDIUM_CPU, extra_keys=[None])
    with pytest.raises(OverflowError):
        stream.removed([1 << 64], MEDIUM_CPU)
    with pytest.raises(InvalidArgument):
        EventStream(b"", data_parallel_rank=-1)
    stream.stored([], None, [], 16, MEDIUM_CPU)
    stream.removed([], MEDIUM_CPU)
    assert stream.take_batch(0.0) is None


def test_the_callers_lists_are_not_kept():
    stream = EventStream(b"")
    hashes, tokens = [1], [5, 6]
    stream.stored(hashes, None, tokens, 2, MEDIUM_GPU)
    hashes.append(2)
    tokens.clear()
    (event,) = decode(stream.take_batch(0.0)[1]).events
    assert (event.block_hashes, event.token_ids) == ([1], [5, 6])


def test_frames_sequence_numbers_and_topics(context, publisher):
    a, b = publisher.stream("a", 0), publisher.stream(b"b", 1)
    assert publisher.stream("a") is a
    with pytest.raises(InvalidArgument):
        publisher.stream("a", 1)
    sub = subscribe(context, publisher, b"a", b"b")
    for i in range(3):
        a.stored([i], None, [i] * 4, 4, MEDIUM_CPU)
        if i != 1:
            b.removed([i], MEDIUM_STORAGE)
        assert publisher.publish() == (2 if i != 1 else 1)
    assert publisher.publish() == 0
    messages = receive(sub, 5)
    assert all(len(m) == 3 for m in messages)
    seqs = {b"a": [], b"b": []}
    for topic, seq, payload in messages:
        seqs[topic].append(int.from_bytes(seq, "big"))
        batch = decode(payload)
        assert batch.ts == 1234.5 and batch.data_parallel_rank == (topic == b"b")
        assert len(batch.events) == 1 and isinstance(batch.events[0], BlockStored if topic == b"a" else BlockRemoved)
    assert seqs == {b"a": [0, 1, 2], b"b": [0, 1]}
    assert (a.batches_sent, a.events_sent, b.batches_sent, b.events_sent) == (3, 3, 2, 2)
    assert publisher.batches_sent >= 5 and publisher.dropped == 0
    sub.close()


def test_a_subscriber_rebuilds_the_fed_blocks(context, publisher):
    stream = publisher.stream("model", 0)
    sub = subscribe(context, publisher, b"model")
    rng = random.Random(7)
    media = [MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE]
    fed: set[tuple[str, int]] = set()
    num_batches = 0
    for step in range(400):
        if step == 150:
            stream.cleared()
            fed.clear()
        elif rng.random() < 0.6 or not fed:
            medium = rng.choice(media)
            hashes = [rng.getrandbits(64) for _ in range(rng.randint(1, 4))]
            stream.stored(hashes, rng.choice([None, rng.getrandbits(64)]), [1] * 16 * len(hashes), 16, medium)
            fed.update((medium, h) for h in hashes)
        else:
            gone = rng.sample(sorted(fed), rng.randint(1, min(3, len(fed))))
            medium = gone[0][0]
            stream.removed([h for m, h in gone if m == medium], medium)
            fed.difference_update((m, h) for m, h in gone if m == medium)
        if step % 37 == 0:
            num_batches += publisher.publish()
    num_batches += publisher.publish()
    seen: set[tuple[str, int]] = set()
    for topic, seq, payload in receive(sub, num_batches):
        apply(seen, decode(payload))
    assert seen == fed and len(fed) > 50
    sub.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared", "batch"]),
                          st.sampled_from([MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE]),
                          st.lists(st.integers(0, 12), max_size=4)), max_size=60),
       st.integers(3, 8))  # a re-announcement is an event per medium
def test_batches_replay_the_fed_blocks(actions, max_queue_events):
    """Whatever the batching and overflows: after the owner re-announces on resync, the
    decoded batches give the fed picture."""
    stream = EventStream(b"", max_queue_events=max_queue_events, buffer_steps=1000)
    fed: set[tuple[str, int]] = set()
    seen: set[tuple[str, int]] = set()

    def take():
        while stream.needs_resync:  # the re-announcement may overflow what was queued since
            stream.needs_resync = False
            for medium in {m for m, _ in fed}:
                stream.stored(sorted(h for m, h in fed if m == medium), None, [], 16, medium)
        taken = stream.take_batch(0.0)
        if taken is not None:
            apply(seen, decode(taken[1]))

    for kind, medium, hashes in actions:
        if kind == "stored":
            stream.stored(hashes, None, [], 16, medium)
            fed.update((medium, h) for h in hashes)
        elif kind == "removed":
            stream.removed(hashes, medium)
            fed.difference_update((medium, h) for h in hashes)
        elif kind == "cleared":
            stream.cleared()
            fed.clear()
        else:
            take()
    take()
    assert seen == fed
    assert stream.next_seq == len(stream.replay(0))


def test_overflow_drops_counts_and_clears():
    stream = EventStream(b"", max_queue_events=5)
    for i in range(7):
        stream.stored([i], None, [], 16, MEDIUM_CPU)
    assert stream.dropped == 6 and stream.needs_resync  # the five queued and the sixth; the seventh is queued
    stream.needs_resync = False
    stream.stored([100], None, [], 16, MEDIUM_STORAGE)  # the owner's re-announcement
    events = decode(stream.take_batch(0.0)[1]).events
    assert isinstance(events[0], AllBlocksCleared)
    assert [e.block_hashes for e in events[1:]] == [[6], [100]]
    assert stream.take_batch(0.0) is None and not stream.needs_resync

    tight = EventStream(b"", max_queue_events=1)
    tight.removed([1], MEDIUM_CPU)
    tight.removed([2], MEDIUM_CPU)
    assert tight.needs_resync and tight.dropped == 2
    tight.needs_resync = False
    tight.stored([3], None, [], 16, MEDIUM_CPU)  # the clear at the head does not take the only place
    assert not tight.needs_resync
    assert [type(e) for e in decode(tight.take_batch(0.0)[1]).events] == [AllBlocksCleared, BlockStored]


def test_a_refused_batch_is_dropped_and_resynced(publisher):
    class FullPub:
        def send_multipart(self, *args, **kwargs):
            raise zmq.Again()

        def close(self, linger=None):
            pass

    stream = publisher.stream("x")
    stream.stored([1, 2], None, [], 16, MEDIUM_CPU)
    stream.removed([1], MEDIUM_CPU)
    real, publisher._pub = publisher._pub, FullPub()
    try:
        assert publisher.publish() == 0
    finally:
        publisher._pub = real
    assert (stream.dropped, publisher.dropped, stream.needs_resync) == (2, 2, True)
    assert stream.replay(0)[0][0] == 0  # the refused batch stays replayable
    assert publisher.publish() == 1
    (event,) = decode(stream.replay(1)[0][1]).events
    assert isinstance(event, AllBlocksCleared)


def test_an_ended_stream_clears_once_then_is_forgotten(context, publisher):
    """A stream that ends (its pool is gone) sends ``AllBlocksCleared`` — once the
    socket takes it — and nothing after; the publisher forgets it and its ring, and its
    counts stay in the totals (counters never go down)."""
    class FullPub:
        def send_multipart(self, *args, **kwargs):
            raise zmq.Again()

        def close(self, linger=None):
            pass

    gone, kept = publisher.stream("gone", 1), publisher.stream("kept", 2)
    sub = subscribe(context, publisher, b"gone")
    gone.stored([1, 2], None, [0] * 8, 4, MEDIUM_CPU)
    publisher.publish()
    batches_sent, events_sent = publisher.batches_sent, publisher.events_sent
    publisher.end(gone)
    gone.removed([1], MEDIUM_CPU)  # (an event of the tree's turn before it ended)
    real, publisher._pub = publisher._pub, FullPub()
    try:
        publisher.publish()  # the last batch refused: it is sent again
    finally:
        publisher._pub = real
    assert publisher.publish() == 1
    assert publisher.publish() == 0
    batches = [decode(payload).events for _, _, payload in receive(sub, 2)]
    assert [type(e) for events in batches for e in events] == [BlockStored, AllBlocksCleared]
    assert gone not in publisher.streams and kept in publisher.streams
    assert (publisher.batches_sent, publisher.events_sent) == (batches_sent + 1, events_sent + 1)
    assert publisher.dropped == 2  # (the refused batch: the clear and the removal)
    sub.close()


def test_a_late_subscriber_replays_missed_batches(publisher, dealer):
    first, second = publisher.stream("first"), publisher.stream("second", 2)
    for i in range(3):
        first.stored([i], None, [i] * 2, 2, MEDIUM_CPU)
        second.removed([10 + i], MEDIUM_STORAGE)
        publisher.publish()
    assert publisher.sockets() and publisher.sockets()[0].poll(0) == 0

    for request in ([seq8(0)], [b"", seq8(0)]):  # a DEALER's bare request; a REQ socket's envelope
        replies = ask(publisher, dealer, *request)
        assert all(r[0] == b"" for r in replies)
        assert [(r[1], r[2]) for r in replies[:-1]] == [(b"first", seq8(s)) for s in range(3)]
        assert [decode(r[3]).events[0].block_hashes for r in replies[:-1]] == [[0], [1], [2]]
        assert replies[-1] == [b"", b"", END_SEQ, b""]

    replies = ask(publisher, dealer, b"", b"second", seq8(1))
    assert [(r[1], r[2]) for r in replies[:-1]] == [(b"second", seq8(1)), (b"second", seq8(2))]
    assert decode(replies[0][3]).data_parallel_rank == 2
    assert ask(publisher, dealer, b"second", seq8(3)) == [[b"", b"", END_SEQ, b""]]


def test_a_start_older_than_the_ring_gets_what_the_ring_has(context, tmp_path):
    with EventPublisher(f"ipc://{tmp_path / 'e'}", replay_endpoint=f"ipc://{tmp_path / 'r'}",
                        buffer_steps=4, context=context) as publisher:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        stream = publisher.stream("")
        for i in range(10):
            stream.removed([i], MEDIUM_CPU)
            publisher.publish()
        replies = ask(publisher, dealer, b"", seq8(0))
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [6, 7, 8, 9]
        assert [decode(r[3]).events[0].block_hashes for r in replies[:-1]] == [[6], [7], [8], [9]]
        dealer.close(linger=0)


def test_streams_count_from_the_first_seq_the_publisher_is_given(context, tmp_path):
    """A restarted daemon's streams start past its predecessor's seqs (seq_from_clock):
    a replay from an old stream's seq gets the new stream from its first batch."""
    starts = iter([7_000_000, 9_000_000])
    with EventPublisher(f"ipc://{tmp_path / 'e'}", replay_endpoint=f"ipc://{tmp_path / 'r'}",
                        context=context, first_seq=lambda: next(starts)) as publisher:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        a, b = publisher.stream("a"), publisher.stream("b")
        a.cleared()  # (a daemon's stream begins with a clear)
        for i in range(2):
            b.removed([i], MEDIUM_CPU)
            publisher.publish()
            a.removed([i], MEDIUM_CPU)
        assert (a.next_seq, b.next_seq) == (7_000_002, 9_000_002)
        replies = ask(publisher, dealer, b"a", seq8(3))
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [7_000_000, 7_000_001]
        assert isinstance(decode(replies[0][3]).events[0], AllBlocksCleared)
        dealer.close(linger=0)
    assert 0 < seq_from_clock() < 1 << 62


def test_hostile_replay_requests_get_the_end_marker_at_most(publisher, dealer):
    assert ask(publisher, dealer, seq8(0)) == [[b"", b"", END_SEQ, b""]]  # no stream yet
    stream = publisher.stream("t")
    stream.removed([1], MEDIUM_CPU)
    publisher.publish()
    rng = random.Random(3)
    hostile = [[b""], [b"", b""], [b"", b"", b""], [seq8(0), seq8(0), seq8(0)], [b"", b"t", seq8(0), b"x"],
               [b"\x00" * 7], [b"", b"\x00" * 9], [b"unknown", seq8(0)], [b"", b"t", b"\x01" * 7],
               [rng.randbytes(rng.randint(1, 40)) for _ in range(5)]]
    hostile += [[rng.randbytes(rng.randint(0, 30)) for _ in range(rng.randint(1, 4))] for _ in range(30)]
    for request in hostile:
        for reply in ask(publisher, dealer, *request):
            assert reply[0] == b""
    replies = ask(publisher, dealer, b"", b"t", seq8(0))
    assert [r[2] for r in replies] == [seq8(0), END_SEQ]


def test_a_client_gone_before_its_reply_is_skipped(context, publisher, dealer):
    stream = publisher.stream("t")
    for i in range(5):
        stream.removed([i], MEDIUM_CPU)
        publisher.publish()
    gone = context.socket(zmq.DEALER)
    gone.setsockopt(zmq.LINGER, 0)
    gone.connect(publisher.replay_endpoint)
    gone.send(seq8(0))
    assert publisher.sockets()[0].poll(int(WAIT_S * 1000)), "the request never arrived"
    gone.close()
    publisher.serve_replay()  # the reply may find no one: it must not raise
    assert [r[2] for r in ask(publisher, dealer, seq8(3))] == [seq8(3), seq8(4), END_SEQ]


def _ring_of_four(publisher: EventPublisher) -> None:
    """Four batches in stream ``t``'s ring (seq 0..3, one removed block each)."""
    stream = publisher.stream("t")
    for i in range(4):
        stream.removed([i], MEDIUM_CPU)
        publisher.publish()


def _slow_reader(context, publisher: EventPublisher, **options: int) -> zmq.Socket:
    """A replay client whose receive queue holds one message (inproc: the queue is the
    two ends' bounds)."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    for option, value in options.items():
        dealer.setsockopt(getattr(zmq, option), value)
    dealer.connect(publisher.replay_endpoint)
    return dealer


def _read_until_ends(publisher: EventPublisher, dealer: zmq.Socket, ends: int, why) -> list:
    """Serve replays and read replies until ``ends`` end markers arrived (``why(replies)``:
    the failure's message if they do not)."""
    replies = []
    deadline = time.monotonic() + WAIT_S
    while [r[2] for r in replies].count(END_SEQ) < ends:
        assert time.monotonic() < deadline, why(replies)
        publisher.serve_replay()
        while dealer.poll(10):
            replies.append(dealer.recv_multipart())
    return replies


def test_replies_over_a_clients_queue_go_on_as_it_reads(context):
    """A client asks for the whole ring twice back to back and reads nothing meanwhile:
    the replies fill its queue. Each still arrives whole, in order, with its end marker,
    as the client reads (vLLM's subscriber reads a replay up to that marker)."""
    with EventPublisher("inproc://events-full", replay_endpoint="inproc://replay-full", hwm=1, buffer_steps=4,
                        context=context) as publisher:
        _ring_of_four(publisher)
        dealer = _slow_reader(context, publisher)
        dealer.send(seq8(0))
        dealer.send(seq8(0))
        assert publisher.serve_replay() == 2
        replies = _read_until_ends(publisher, dealer, 2, lambda replies: "a reply without its end marker: "
                                   f"{[int.from_bytes(r[2], 'big', signed=True) for r in replies]}")
        assert [r[2] for r in replies] == [*(seq8(s) for s in range(4)), END_SEQ] * 2
        assert [decode(r[3]).events[0].block_hashes for r in replies if r[3]] == [[0], [1], [2], [3]] * 2
        dealer.close()


def test_a_client_that_never_reads_holds_a_bounded_number_of_replies(context):
    """Requests from a client whose replies wait for it to read queue up to
    ``MAX_REPLIES_WAITING`` replies; the ones beyond get nothing, and the replies queued
    still arrive whole, in order, once it reads."""
    from hicache.daemon.events import MAX_REPLIES_WAITING

    with EventPublisher("inproc://events-bound", replay_endpoint="inproc://replay-bound", hwm=1, buffer_steps=4,
                        context=context) as publisher:
        _ring_of_four(publisher)
        dealer = _slow_reader(context, publisher, SNDHWM=4 * MAX_REPLIES_WAITING)
        for _ in range(2 * MAX_REPLIES_WAITING):
            dealer.send(seq8(2))
        assert publisher.serve_replay() == 2 * MAX_REPLIES_WAITING
        replies = _read_until_ends(publisher, dealer, MAX_REPLIES_WAITING, lambda _: "replies lost")
        publisher.serve_replay()
        while dealer.poll(50):
            replies.append(dealer.recv_multipart())
        ends = [r[2] for r in replies].count(END_SEQ)
        # (the first replies fit the queue at once: only the later ones waited)
        assert MAX_REPLIES_WAITING <= ends < 2 * MAX_REPLIES_WAITING
        assert [r[2] for r in replies] == [seq8(2), seq8(3), END_SEQ] * ends
        dealer.close()


def _run(context, tmp_path, ledger, **kwargs) -> EventPublisher:
    """A publisher of one daemon run (its sockets in ``tmp_path``, its ledger given)."""
    return EventPublisher(f"ipc://{tmp_path / 'e'}", replay_endpoint=f"ipc://{tmp_path / 'r'}",
                          context=context, ledger=ledger, **kwargs)


def _last_run(context, tmp_path, path, streams, ended=()) -> None:
    """A run with a ledger at ``path`` that opens ``streams`` ((topic, rank)), each with
    a block stored, ends those of ``ended`` (their clears go out) and is killed."""
    run = _run(context, tmp_path, StreamLedger(path))
    for topic, rank in streams:
        run.stream(topic, data_parallel_rank=rank).stored([rank], None, [0] * 4, 4, MEDIUM_GPU)
    for stream in run.streams:
        if stream.topic in ended:
            run.end(stream)
    run.publish()
    run.publish()
    run.close()


def _batches(stream: EventStream) -> list[tuple[int, list]]:
    """(seq, events) of every batch in the stream's ring."""
    return [(seq, decode(payload).events) for seq, payload in stream.replay(0)]


def test_a_restarted_publisher_starts_past_every_seq_the_last_run_sent_though_the_clock_went_back(
        context, tmp_path, monkeypatch):
    """A run sends more batches than one reservation of the ledger covers, and is killed
    (its streams never end); the next run's clock reads far earlier (a clock stepped
    back at boot). Its streams, the topic taken up again and a new one, start past every
    seq the last run sent: a router sees a gap, never the old stream going on."""
    monkeypatch.setattr(StreamLedger, "SEQ_STEP", 4)
    path = tmp_path / "ledger"
    first = _run(context, tmp_path, StreamLedger(path, clock=lambda: 5_000_000))
    stream = first.stream("a", data_parallel_rank=1)
    for i in range(10):
        stream.removed([i], MEDIUM_CPU)
        first.publish()
    last_sent = stream.next_seq - 1
    first.close()  # (killed: no stream ended)

    again = _run(context, tmp_path, StreamLedger(path, clock=lambda: 1_000))
    try:
        taken_up, new = again.stream("a", data_parallel_rank=1), again.stream("b")
        assert taken_up.next_seq > last_sent and new.next_seq > last_sent
    finally:
        again.close()


def test_the_streams_a_killed_run_left_open_are_cleared_for_a_while_then_forgotten(context, tmp_path):
    """A run ends one stream (its clear went out) and is killed with two still open.
    The next run, before any pool speaks, says AllBlocksCleared on those two, with
    their ranks, again every LEFT_RESEND_S (a router may reconnect late), until
    left_clear_s is over; then they end and the ledger forgets them. A pool that takes
    one of the topics up meanwhile gets it as its own stream, which never ends by time."""
    path = tmp_path / "ledger"
    _last_run(context, tmp_path, path, [(b"a", 1), (b"b", 2), (b"c", 3)], ended=[b"c"])
    assert StreamLedger(path).left == {b"a": 1, b"b": 2}

    now = [0.0]
    again = _run(context, tmp_path, StreamLedger(path), left_clear_s=2.5, monotonic=lambda: now[0])
    try:
        again.publish()
        a, b = again.streams
        assert [(s.topic, s.data_parallel_rank) for s in (a, b)] == [(b"a", 1), (b"b", 2)]
        b_own = again.stream(b"b", data_parallel_rank=2)  # (a pool takes "b" up)
        assert b_own is b
        b_own.stored([9], None, [0] * 4, 4, MEDIUM_GPU)
        for step in range(1, 4):
            now[0] = step * 1.0
            again.publish()
        events = [e for _, batch in _batches(a) for e in batch]
        assert len(events) == 4 and all(isinstance(e, AllBlocksCleared) for e in events)
        assert [s.topic for s in again.streams] == [b"b"]  # a ended after its last clear; b goes on
        assert [type(e) for _, batch in _batches(b) for e in batch] == [AllBlocksCleared, BlockStored]
        assert StreamLedger(path).left == {b"b": 2}
    finally:
        again.close()


def test_a_left_topic_a_pool_takes_up_with_another_rank_is_a_new_stream(context, tmp_path):
    path = tmp_path / "ledger"
    _last_run(context, tmp_path, path, [(b"x11", 11)])
    again = _run(context, tmp_path, StreamLedger(path))
    try:
        stream = again.stream(b"x11", data_parallel_rank=1)
        assert [(s.topic, s.data_parallel_rank) for s in again.streams] == [(b"x11", 1)]
        stream.cleared()
        again.publish()
        assert StreamLedger(path).left == {b"x11": 1}
    finally:
        again.close()


def test_a_clean_close_leaves_no_stream_to_clear(context, tmp_path):
    path = tmp_path / "ledger"
    _last_run(context, tmp_path, path, [(b"a", 0)], ended=[b"a"])
    assert StreamLedger(path).left == {}


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"seq_floor": -1, "topics": {}}',
                                     b'{"seq_floor": 5, "topics": {"zz": 1}}', b'{"seq_floor": 5, "topics": []}',
                                     b'{"seq_floor": 5, "topics": {"61": "one"}}', b"[1, 2]"])
def test_a_ledger_that_cannot_be_read_is_a_warning_and_the_clock_alone(tmp_path, caplog, content):
    path = tmp_path / "ledger"
    path.write_bytes(content)
    ledger = StreamLedger(path, clock=lambda: 42)
    assert ledger.first_seq() == 42 and ledger.left == {}
    assert "cannot read the stream ledger" in caplog.text
    # ... and the next write replaces it with a good one.
    assert StreamLedger(path).first_seq() > 42


def test_a_ledger_that_cannot_be_written_is_one_warning(tmp_path, caplog):
    ledger = StreamLedger(tmp_path / "gone" / "ledger", clock=lambda: 42)
    ledger.opened(b"a", 0)
    ledger.sent(1 << 40)
    assert ledger.first_seq() == 42
    assert caplog.text.count("cannot write the stream ledger") == 1


def _run_killed_at(tmp_path, path, kill_at: int) -> tuple[bool, dict[bytes, int]]:
    """The run after a killed one, in a process of its own (forked): it takes up the
    left topic ``a``, takes ``b`` up with another rank, opens ``c``, and publishes on
    each. The ``kill_at``-th step of its ledger writes (a sync of ``events.new``, the
    rename, the sync of the directory) is never reached: SIGKILL first. Returns
    whether it was killed, and each topic's last seq that ``publish`` returned from."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            os.close(reader)
            steps = [0]

            def step(fn):
                def run(*args):
                    steps[0] += 1
                    if steps[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*args)
                return run

            os.fsync, os.replace = step(os.fsync), step(os.replace)
            context = zmq.Context()
            run = _run(context, tmp_path, StreamLedger(path))
            streams = [run.stream(b"a", data_parallel_rank=1), run.stream(b"b", data_parallel_rank=5),
                       run.stream(b"c", data_parallel_rank=3)]
            for i in range(3):
                for stream in streams:
                    stream.removed([i], MEDIUM_CPU)
                run.publish()
                os.write(writer, b"".join(s.topic + seq8(s.next_seq - 1) for s in streams))
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        sent = pipe.read()
    _, status = os.waitpid(pid, 0)
    last = {sent[i : i + 1]: int.from_bytes(sent[i + 1 : i + 9], "big") for i in range(0, len(sent), 9)}
    return os.WIFSIGNALED(status), last


def test_a_run_killed_at_any_step_of_a_ledger_write_leaves_every_open_topic_and_the_floor(
        context, tmp_path, caplog):
    """A run is killed with two streams open (``a``, ``b``). The next run is killed
    too, at each step of its ledger writes in turn, while it takes ``a`` up, takes
    ``b`` up with another rank and opens ``c``. Whatever the step, the ledger it
    leaves reads without a warning, still names every topic routers may hold blocks
    of (``a`` and ``b``, and ``c`` once it sent on it), and its floor is past every seq
    sent. Before, each stream the next run opened rewrote the ledger with only the
    topics opened so far (and ``b``'s new rank was written after ``b`` was dropped):
    killed in between, its ledger forgot ``b``, whose blocks no run would clear."""
    path = tmp_path / "ledger"
    first = _run(context, tmp_path, StreamLedger(path))
    first.stream(b"a", data_parallel_rank=1)
    first.stream(b"b", data_parallel_rank=2)
    first.close()
    before = path.read_bytes()
    kill_at = 0
    while True:
        kill_at += 1
        path.write_bytes(before)
        killed, last = _run_killed_at(tmp_path, path, kill_at)
        caplog.clear()
        ledger = StreamLedger(path, clock=lambda: 0)
        assert "stream ledger" not in caplog.text, kill_at
        assert {b"a", b"b"} | set(last) <= set(ledger.left), kill_at
        assert all(ledger.first_seq() > seq for seq in last.values()), kill_at
        if not killed:
            break
    assert kill_at > 3


def test_a_floor_near_the_top_of_the_seqs_keeps_every_run_past_the_last(context, tmp_path, caplog, monkeypatch):
    """The ledger of a run whose clock was far ahead holds a floor near 2**62. The
    next run's stream sends past 2**62 and is killed; the run after reads its ledger
    as any other, and its streams — the topic taken up again and a new one — start
    past every seq sent. Each run writes the ledger once per reservation, not once per
    batch. Before, the floor written stopped at 2**62 - 1, below the seqs sent: the
    run after started its streams among them (and every batch past it rewrote the
    ledger, two fsyncs on the owner's thread)."""
    path = tmp_path / "ledger"
    path.write_text(f'{{"seq_floor": {(1 << 62) - 3}, "topics": {{}}}}')
    writes = [0]
    replace = os.replace

    def counted(*args):
        writes[0] += 1
        replace(*args)

    monkeypatch.setattr(os, "replace", counted)
    first = _run(context, tmp_path, StreamLedger(path, clock=lambda: 1_000))
    stream = first.stream("a")
    for i in range(6):
        stream.removed([i], MEDIUM_CPU)
        first.publish()
    last_sent = stream.next_seq - 1
    first.close()
    assert last_sent > 1 << 62 and writes[0] <= 2

    again = _run(context, tmp_path, StreamLedger(path, clock=lambda: 1_000))
    try:
        taken_up, new = again.stream("a"), again.stream("b")
        assert taken_up.next_seq > last_sent and new.next_seq > last_sent
    finally:
        again.close()
    assert "stream ledger" not in caplog.text


def test_after_a_rebind_every_stream_sends_a_batch_each_second_for_a_while(context, tmp_path):
    """A reload rebinds the sockets: every subscriber reconnects when it will, and a
    batch published before it did is lost to it. On a stream that then stays idle it
    would never see the gap. So for left_clear_s after a rebind each stream sends a
    batch every LEFT_RESEND_S, with no event if it has none: a subscriber back by then
    sees the gap and replays."""
    now = [0.0]
    with EventPublisher(f"ipc://{tmp_path / 'e'}", replay_endpoint=f"ipc://{tmp_path / 'r'}", context=context,
                        left_clear_s=2.5, monotonic=lambda: now[0]) as publisher:
        stream = publisher.stream(b"a")
        stream.removed([1], MEDIUM_CPU)
        publisher.publish()
        assert publisher.publish() == 0  # (idle: nothing to send)
        publisher.rebind()
        stream.removed([2], MEDIUM_CPU)
        publisher.publish()  # (lost to a subscriber not back yet)
        sent = []
        for step in range(1, 5):
            now[0] = step * 1.0
            sent.append(publisher.publish())
        assert sent == [1, 1, 0, 0]  # (at 1 s and 2 s; the while is over at 2.5 s)
        (removed_seq, removed), (last_seq, last) = _batches(stream)[-2:]
        assert [e.block_hashes for e in removed] == [[2]]
        assert (last_seq, last) == (removed_seq + 2, [])  # (two with no event: the ring keeps the last)


def test_a_stream_idle_for_idle_beat_s_sends_an_empty_batch(context, tmp_path):
    """A subscriber that reconnects (a restarted daemon, a rebind, its own network blip)
    after the batches it missed sees the gap only at the stream's next batch; on a
    stream that stays idle that never comes, and it keeps a picture of blocks long gone.
    So a stream that sent nothing for ``idle_beat_s`` sends a batch with no event; one
    that sent batches meanwhile sends no extra one."""
    now = [0.0]
    with EventPublisher(f"ipc://{tmp_path / 'e'}", context=context, idle_beat_s=10.0,
                        monotonic=lambda: now[0]) as publisher:
        idle, busy = publisher.stream(b"idle"), publisher.stream(b"busy")
        sent = {}
        for step in range(1, 31):
            now[0] = float(step)
            busy.removed([step], MEDIUM_CPU)
            sent[step] = publisher.publish()
        assert (idle.batches_sent, idle.next_seq) == (3, 3)  # (at 10, 20, 30 s)
        assert _batches(idle) == [(2, [])]  # (the ring keeps the last batch of a run with no event)
        assert [step for step, count in sent.items() if count == 2] == [10, 20, 30]
        assert [len(events) for _, events in _batches(busy)] == [1] * 30


def test_a_long_idle_stream_keeps_its_batches_with_events_for_replay(context, tmp_path):
    """An idle stream's beats (a batch with no event every idle_beat_s) must not push
    the batches that say something out of its replay ring: a router that joins a day
    later replays them to learn what the daemon holds. A run of batches with no event
    is kept as its last (they all say nothing); a replay asked from inside the run gets
    that one."""
    now = [0.0]
    with EventPublisher(f"ipc://{tmp_path / 'e'}", replay_endpoint=f"ipc://{tmp_path / 'r'}", buffer_steps=4,
                        idle_beat_s=10.0, context=context, monotonic=lambda: now[0]) as publisher:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        stream = publisher.stream(b"a")
        for i in range(3):
            stream.stored([i], None, [i] * 2, 2, MEDIUM_CPU)
            publisher.publish()
        now[0] = 10.0
        assert publisher.publish() == 0  # (it sent batches since it opened)
        for step in range(2, 12):  # (ten beats: more than the ring holds)
            now[0] = step * 10.0
            assert publisher.publish() == 1
        assert stream.next_seq == 13
        replies = ask(publisher, dealer, b"a", seq8(0))
        batches = [(int.from_bytes(r[2], "big"), decode(r[3]).events) for r in replies[:-1]]
        assert [seq for seq, _ in batches] == [0, 1, 2, 12]
        assert [[e.block_hashes for e in events] for _, events in batches] == [[[0]], [[1]], [[2]], []]
        assert [int.from_bytes(r[2], "big") for r in ask(publisher, dealer, b"a", seq8(5))[:-1]] == [12]
        assert ask(publisher, dealer, b"a", seq8(13)) == [[b"", b"", END_SEQ, b""]]
        dealer.close(linger=0)


def test_vllms_one_frame_replay_after_a_restart_answers_from_the_first_pools_stream(context, tmp_path):
    """vLLM's replay request names no topic: the oldest stream answers. After a restart
    the oldest are the last run's topics being cleared, which no pool speaks on; the
    request is for the stream of the engine the router follows, the first pool's."""
    path = tmp_path / "ledger"
    _last_run(context, tmp_path, path, [(b"old", 1)])
    again = _run(context, tmp_path, StreamLedger(path))
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(again.replay_endpoint)
        pool = again.stream(b"new", data_parallel_rank=2)
        pool.removed([7], MEDIUM_CPU)
        again.publish()
        replies = ask(again, dealer, seq8(0))
        assert {r[1] for r in replies[:-1]} == {b"new"}
        assert decode(replies[-2][3]).events[-1].block_hashes == [7]
        dealer.close(linger=0)
    finally:
        again.close()


# -- an identity's own socket: the streams of its tenants' engines ------------------------


def _own_subscriber(context, publisher: EventPublisher, name: str, tenants: frozenset[str]) -> zmq.Socket:
    """A SUB socket on identity ``name``'s own socket that has joined (probes of a
    stream scoped to ``tenants`` until one arrives, then drained)."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(publisher.own_endpoints[name])
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    probe = publisher.stream(PROBE + name.encode())
    probe.rescope(tenants)
    _probe_until_joined(publisher, sub, probe)
    publisher.end(probe)
    publisher.publish()
    assert sub.poll(int(WAIT_S * 1000)) and decode(sub.recv_multipart()[2]).events == [AllBlocksCleared()]
    return sub


def test_an_identitys_own_socket_carries_the_streams_within_its_tenants(context, tmp_path):
    """Reader "r" of tenants a and a2: its socket carries the streams scoped to a, to
    a2, to both — never one scoped to b, to a and b, or to nobody known (None: a pool
    whose tenants are not known yet). The daemon's socket carries them all."""
    now = [0.0]
    with EventPublisher(f"ipc://{tmp_path / 'e'}", context=context, monotonic=lambda: now[0]) as publisher:
        publisher.set_readers({"r": frozenset({"a", "a2"})}, {"r": (f"ipc://{tmp_path / 'r'}", frozenset({"a", "a2"}))})
        sub = _own_subscriber(context, publisher, "r", frozenset({"a"}))
        everything = subscribe(context, publisher, b"")
        scopes = {b"a": {"a"}, b"a2": {"a2"}, b"both": {"a", "a2"}, b"b": {"b"}, b"ab": {"a", "b"},
                  b"unknown": None}
        for topic, tenants in scopes.items():
            stream = publisher.stream(topic)
            stream.rescope(None if tenants is None else frozenset(tenants))
            stream.stored([len(topic)], None, [1, 2], 2, MEDIUM_CPU)
        publisher.publish()
        assert {m[0] for m in receive(everything, len(scopes))} == set(scopes)
        assert {m[0] for m in receive(sub, 3)} == {b"a", b"a2", b"both"}


def test_a_stream_an_identity_no_longer_reads_says_all_blocks_cleared_on_its_socket_for_a_while(context, tmp_path):
    """Reader "r" moves from tenant a to tenant b: at each batch of a's stream its
    socket carries ``AllBlocksCleared`` in the batch's place (same seq; none of its
    blocks) for ``left_clear_s``, then nothing; b's stream shows from its next batch.
    A stream it never carried is never announced to it, not even as cleared."""
    now = [0.0]
    with EventPublisher(f"ipc://{tmp_path / 'e'}", context=context, left_clear_s=5.0,
                        monotonic=lambda: now[0]) as publisher:
        own = f"ipc://{tmp_path / 'r'}"
        publisher.set_readers({"r": frozenset({"a"})}, {"r": (own, frozenset({"a"}))})
        sub = _own_subscriber(context, publisher, "r", frozenset({"a"}))
        streams = {name: publisher.stream(name.encode()) for name in ("a", "b", "c")}
        for name, stream in streams.items():
            stream.rescope(frozenset({name}))
            stream.stored([1], None, [1, 2], 2, MEDIUM_CPU)
        publisher.publish()
        assert [m[0] for m in receive(sub, 1)] == [b"a"]
        publisher.set_readers({"r": frozenset({"b"})}, {"r": (own, frozenset({"b"}))})
        assert publisher.own_endpoints["r"].startswith("ipc://")
        seqs = []
        for step in range(1, 8):
            now[0] = float(step)
            for name, stream in streams.items():
                seqs.append((name, stream.next_seq))
                stream.stored([step + 1], step, [step, step], 2, MEDIUM_CPU)
            publisher.publish()
        got = receive(sub, 7 + 4)  # (b's seven batches; a's clears at 1..4 s: the while ends at 5 s)
        on_a = [(int.from_bytes(m[1], "big"), decode(m[2]).events) for m in got if m[0] == b"a"]
        assert on_a == [(seq, [AllBlocksCleared()]) for name, seq in seqs if name == "a"][:4]
        on_b = [int.from_bytes(m[1], "big") for m in got if m[0] == b"b"]
        assert on_b == [seq for name, seq in seqs if name == "b"]
        assert all(isinstance(e, BlockStored) for m in got if m[0] == b"b" for e in decode(m[2]).events)


def test_an_own_socket_goes_when_its_identity_does_and_moves_with_its_endpoint(context, tmp_path):
    """set_readers binds a socket per identity named, keeps one whose endpoint did not
    change (its subscribers with it), closes one whose identity is gone, and binds anew
    at a changed endpoint; one that cannot bind is returned and logged, the others serve."""
    with EventPublisher(f"ipc://{tmp_path / 'e'}", context=context) as publisher:
        first = {"r": (f"ipc://{tmp_path / 'r'}", frozenset({"a"})), "s": (f"ipc://{tmp_path / 's'}", None)}
        assert publisher.set_readers({"r": frozenset({"a"}), "s": None}, first) == []
        sub = _own_subscriber(context, publisher, "r", frozenset({"a"}))
        on_s = context.socket(zmq.SUB)
        on_s.setsockopt(zmq.LINGER, 0)
        monitor = on_s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        on_s.connect(first["s"][0])
        assert monitor.poll(int(WAIT_S * 1000)) and recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        moved = {"r": first["r"], "s2": (f"ipc://{tmp_path / 's2'}", None),
                 "bad": (f"ipc://{tmp_path / 'no-such-dir' / 'x'}", None)}
        assert publisher.set_readers(None, moved) == [moved["bad"][0]]
        assert publisher.own_endpoints == {"r": moved["r"][0], "s2": moved["s2"][0]}
        stream = publisher.stream(b"a")
        stream.rescope(frozenset({"a"}))
        stream.stored([1], None, [1, 2], 2, MEDIUM_CPU)
        publisher.publish()
        assert [m[0] for m in receive(sub, 1)] == [b"a"]  # (the kept socket kept its subscriber)
        assert monitor.poll(int(WAIT_S * 1000))  # (s's socket closed: its subscriber is cut off)
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        monitor.close(0)
        on_s.close(0)



def _until(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_the_connections_open_on_each_socket_are_counted(context, tmp_path):
    """subscribers(): the connections open on the daemon's socket and on each
    identity's own, from their monitors — a subscriber counts once it connected and no
    more once it closed; an identity's socket closed with it is no longer reported."""
    with EventPublisher(f"ipc://{tmp_path / 'e'}", context=context) as publisher:
        assert publisher.subscribers() == {"daemon": 0}
        assert publisher.set_readers(None, {"r": (f"ipc://{tmp_path / 'r'}", None)}) == []
        assert publisher.subscribers() == {"daemon": 0, "own:r": 0}
        subs = [subscribe(context, publisher) for _ in range(2)]
        own = _own_subscriber(context, publisher, "r", frozenset({"a"}))
        _until(lambda: publisher.subscribers() == {"daemon": 2, "own:r": 1}, "three subscribers counted")
        subs[0].close(0)
        _until(lambda: publisher.subscribers() == {"daemon": 1, "own:r": 1}, "a closed one no longer counted")
        assert publisher.set_readers(None, {}) == []
        assert publisher.subscribers() == {"daemon": 1}
        own.close(0)
        subs[1].close(0)
        _until(lambda: publisher.subscribers() == {"daemon": 0}, "none left")


def test_a_publisher_closes_twice_with_its_own_sockets_and_their_monitors(context, tmp_path):
    publisher = EventPublisher(f"ipc://{tmp_path / 'e'}", context=context)
    assert publisher.set_readers(None, {"r": (f"ipc://{tmp_path / 'r'}", None)}) == []
    publisher.close()
    publisher.close()  # (the daemon's stop, then the context manager's exit)
    assert publisher.subscribers() == {}
