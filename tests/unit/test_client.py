"""CacheClient against an in-process fake daemon (tests/fake_daemon.py): every call, the
one wait list, alloc's two answers, admin calls, node-handle errors, degraded mode,
reconnect and re-registration, orphan handles, heartbeats.

Timeouts are short (the fake answers in microseconds, or never when told to drop);
tests assert the order of what the fake received, never how long anything took."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from fake_daemon import DROP, HOLD, FakeClock, FakeDaemon
from hicache.client import CacheClient, NodeHandle, RemoteError
from hicache.errors import ErrorCode, InvalidArgument, LockUnderflow, Unavailable, UnknownNode
from tiers_util import SPEC, Engine

PS = SPEC.page_size
NUM_PAGES = 16
TIMEOUT_S = 0.2


def seq(start: int, num_pages: int) -> list[int]:
    return list(range(start, start + num_pages * PS))


def in_use(fake: FakeDaemon) -> set[int]:
    return set(np.frombuffer(fake.last("register").message.in_use, "<i4").tolist())


def released(fake: FakeDaemon, since: int) -> list[list[int]]:
    with fake.lock:
        return [np.frombuffer(r.message.pages, "<i4").tolist() for r in fake.received[since:] if r.op == "release"]


def eventually(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


@pytest.fixture
def fake(tmp_path):
    daemon = FakeDaemon(tmp_path)
    yield daemon
    daemon.close()
    assert daemon.errors == []


@pytest.fixture
def engine():
    e = Engine(NUM_PAGES)
    yield e
    e.close()


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def client(fake, engine, clock):
    """A registered client without the background thread: reconnects are attempted
    on calls, at most every reconnect_interval_s of the fake clock."""
    c = CacheClient(fake.endpoint, timeout_s=TIMEOUT_S, load_timeout_s=TIMEOUT_S, heartbeat=False,
                    reconnect_interval_s=10.0, clock=clock)
    c.register(SPEC, [engine.exported.handle])
    yield c
    c.close()


def prefill(client: CacheClient, tokens: list[int]):
    pages = client.alloc(len(tokens) // PS)
    return client.insert(tokens, pages)


def go_degraded(client: CacheClient, fake: FakeDaemon) -> None:
    """The daemon stops answering; a match finds out (and misses), and the one
    reconnect attempt that follows at once fails too."""
    fake.down()
    assert client.match(seq(0, 1)).handle is None
    assert client.degraded
    client.match(seq(0, 1))


def test_lifecycle_in_order(fake, client):
    tokens = seq(100, 3)
    assert fake.ops() == ["hello", "register"]
    assert client.match(tokens).handle is None
    new = client.alloc(3)
    assert len(new) == 3
    r = client.insert(tokens, new)
    assert r.device_pages.tolist() == new.tolist() and r.num_prefix_pages == 0 and len(r.freed) == 0
    m = client.match(tokens)
    assert m.device_pages.tolist() == new.tolist() and m.landing == () and m.num_tokens == 3 * PS
    client.lock(m.handle)
    ld = client.load(m.handle)
    assert ld.device_pages.tolist() == new.tolist() and ld.num_loaded_pages == 0 and ld.wait == ()
    client.unlock(m.handle)
    tail = client.alloc(1)
    client.release(tail)
    assert fake.ops()[2:] == ["match", "alloc", "insert", "match", "lock", "load", "unlock", "alloc", "release"]
    client.check()
    fake.check()


def test_session_id_is_public_and_read_only(fake, engine, clock):
    c = CacheClient(fake.endpoint, timeout_s=TIMEOUT_S, heartbeat=False, clock=clock)
    try:
        assert c.session_id is None
        c.register(SPEC, [engine.exported.handle])
        first = c.session_id
        assert first is not None and fake.session_of(fake.last("hello").identity) == [first]
        with pytest.raises(AttributeError):
            c.session_id = 5
        fake.restart()
        c.match(seq(0, 1))  # UNKNOWN_SESSION: hello, register, match again
        assert c.session_id not in (None, first) and c.epoch == 2
        assert fake.session_of(fake.last("hello").identity) == [c.session_id]
        go_degraded(c, fake)
        assert c.session_id is None
    finally:
        c.close()
    assert c.session_id is None


def test_loaded_wait_is_the_one_list_and_includes_what_the_match_saw_landing(fake, client):
    tokens = seq(200, 2)
    prefill(client, tokens)
    landing = fake.land(tokens)
    m = client.match(tokens)
    assert m.landing == (landing,) and m.wait == m.landing  # the old name still reads
    client.lock(m.handle)
    ld = client.load(m.handle)
    assert landing in ld.wait
    done = []
    waiter = threading.Thread(target=lambda: done.append(client.wait_layer(ld.wait, SPEC.num_layers - 1)))
    waiter.start()
    waiter.join(0.05)
    assert not done  # still landing
    fake.complete(landing)
    waiter.join(10)
    assert done == [None]
    client.unlock(m.handle)


def test_a_load_from_host_brings_its_own_ticket(fake, client):
    tokens = seq(300, 3)
    prefill(client, tokens)
    assert fake.evict() == 3
    m = client.match(tokens)
    assert m.num_device_pages == 0 and m.num_host_pages == 3
    client.lock(m.handle)
    ld = client.load(m.handle)
    assert ld.num_loaded_pages == 3 and len(ld.wait) == 1
    for layer in range(SPEC.num_layers):
        client.wait_layer(ld.wait, layer, timeout_s=10)
    client.unlock(m.handle)


def test_alloc_none_means_pool_full_and_degraded_raises_at_once(fake, client):
    pages = client.alloc(NUM_PAGES - 1)
    assert pages is not None
    assert client.alloc(2) is None  # full: free some, or wait, and retry
    client.release(pages[:2])
    assert len(client.alloc(2)) == 2
    go_degraded(client, fake)
    before = fake.count()
    with pytest.raises(Unavailable, match="degraded"):
        client.alloc(1)
    assert fake.count() == before  # nothing sent, no wait


def test_alloc_beyond_capacity_is_the_daemons_error(fake, client):
    with pytest.raises(RemoteError) as info:
        client.alloc(NUM_PAGES + 1)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT


def test_admin_calls_raise_on_their_own_connection_and_leave_the_session_alone(fake, client):
    assert client.health().state == "serving"
    assert client.stats()["sessions"] == 1
    client.flush()
    session, identity = client.session_id, fake.last("hello").identity
    fake.script("stats", DROP)
    with pytest.raises(Unavailable, match="stats"):
        client.stats()
    assert not client.degraded and client.session_id == session
    client.match(seq(0, 1))
    assert fake.last("match").identity == identity  # the session's connection, untouched
    assert fake.last("stats").identity != identity
    fake.script("check", ErrorCode.INTERNAL)
    with pytest.raises(RemoteError) as info:
        client.check()
    assert info.value.code == ErrorCode.INTERNAL
    # Degraded or not, admin calls ask the daemon.
    go_degraded(client, fake)
    fake.up()
    assert client.health().state == "serving" and client.degraded


def test_unlock_and_load_of_a_handle_not_held_raise_the_daemons_codes(fake, client):
    tokens = seq(400, 2)
    prefill(client, tokens)
    m = client.match(tokens)
    client.unlock(None)  # a miss: nothing to do
    assert client.load(None).device_pages.size == 0
    # Handed out, not locked: LOCK_UNDERFLOW, for unlock and load alike, with no round trip.
    before = fake.count()
    for call in (client.unlock, client.load):
        with pytest.raises(LockUnderflow) as info:
            call(m.handle)
        assert info.value.code == ErrorCode.LOCK_UNDERFLOW
    # Never handed out: UNKNOWN_NODE first, for every operation.
    stranger = NodeHandle(12345, client.epoch)
    for call in (client.unlock, client.load):
        with pytest.raises(UnknownNode) as info:
            call(stranger)
        assert info.value.code == ErrorCode.UNKNOWN_NODE
    assert fake.count() == before
    with pytest.raises(RemoteError) as info:
        client.lock(stranger)
    assert info.value.code == ErrorCode.UNKNOWN_NODE
    client.unlock(None)
    # Once too often.
    client.lock(m.handle)
    client.unlock(m.handle)
    with pytest.raises(LockUnderflow):
        client.unlock(m.handle)
    # The same answers in degraded mode.
    go_degraded(client, fake)
    with pytest.raises(LockUnderflow):
        client.unlock(m.handle)
    with pytest.raises(UnknownNode):
        client.load(stranger)


def test_degraded_session_calls_answer_at_once_and_send_nothing(fake, client, clock):
    tokens = seq(500, 2)
    prefill(client, tokens)
    m = client.match(tokens)
    tail = client.alloc(1)
    fake.down()
    mark = fake.count()
    assert client.match(tokens).handle is None and client.degraded  # this one waited
    client.match(tokens)  # and the reconnect attempt right after
    assert fake.ops(mark) == ["match", "hello"]
    mark = fake.count()
    assert client.match(tokens).handle is None
    assert client.match_many([tokens, tokens])[1].handle is None
    client.lock(m.handle)
    ld = client.load(m.handle)
    assert ld.num_loaded_pages == 0 and ld.wait == () and ld.device_pages.tolist() == m.device_pages.tolist()
    r = client.insert(tokens, m.device_pages)
    assert r.handle is None and r.device_pages.tolist() == m.device_pages.tolist()
    client.release(tail)
    client.unlock(m.handle)
    assert fake.count() == mark  # nothing sent
    # Back: after reconnect_interval_s, the next call reconnects.
    fake.up()
    clock.advance(10.0)
    assert client.match(tokens).handle is not None and not client.degraded
    assert fake.ops(mark) == ["hello", "register", "match"]


def test_a_late_answer_is_never_taken_for_the_next_one(fake, client, clock):
    tokens = seq(600, 1)
    prefill(client, tokens)
    fake.script("match", HOLD)
    assert client.match(tokens).handle is None and client.degraded
    fake.release_held()  # the late answer goes to the connection the client dropped
    clock.advance(10.0)
    m = client.match(tokens)
    assert m.handle is not None and m.handle.epoch == client.epoch == 2


@pytest.mark.parametrize("replace_sessions", [True, False])
def test_a_reconnect_names_the_session_it_gave_up_on_to_a_daemon_that_ends_it(tmp_path, engine, clock,
                                                                                replace_sessions):
    """A call not answered in time drops the connection, and the session with it; the
    reconnect's hello names that session (``replaces``) so that the daemon ends it at
    once, rather than keep the engine's pool for a lease — only to a daemon whose hello
    said it does so (an older one refuses the field). A hello answered with an error
    names none the next time (a daemon restarted as an older version meanwhile)."""
    from hicache import protocol as p

    fake = FakeDaemon(tmp_path, replace_sessions=replace_sessions)
    client = CacheClient(fake.endpoint, timeout_s=TIMEOUT_S, heartbeat=False, reconnect_interval_s=10.0,
                         clock=clock)
    try:
        client.register(SPEC, [engine.exported.handle])
        assert fake.last("hello").message.replaces is p.UNSET  # the first hello: nothing to end
        first = client.session_id
        fake.script("match", DROP)  # the daemon stalls
        assert client.match(seq(0, 1)).handle is None and client.degraded
        clock.advance(10.0)
        client.match(seq(0, 1))
        assert not client.degraded and client.session_id != first
        assert fake.last("hello").message.replaces == (first if replace_sessions else p.UNSET)
        if not replace_sessions:
            return
        fake.script("match", DROP)
        assert client.match(seq(0, 1)).handle is None and client.degraded
        fake.script("hello", ErrorCode.INVALID_ARGUMENT)  # (what an older daemon answers the field)
        clock.advance(10.0)
        client.match(seq(0, 1))
        assert client.degraded
        clock.advance(10.0)
        client.match(seq(0, 1))
        assert not client.degraded and fake.last("hello").message.replaces is p.UNSET
    finally:
        client.close()
        fake.close()
        assert fake.errors == []


def test_restart_reregisters_with_private_pages_and_locked_paths(fake, client):
    tokens = seq(700, 3)
    prefill(client, tokens)
    m = client.match(tokens)
    client.lock(m.handle)
    client.lock(m.handle)  # twice: counted once per handle when its pages come back
    ld = client.load(m.handle)
    private = client.alloc(2).tolist()
    fake.restart()
    mark = fake.count()
    assert client.match(seq(900, 1)).handle is None  # a miss in the new session
    assert fake.ops(mark) == ["match", "hello", "register", "match"]
    assert in_use(fake) == set(private) | set(ld.device_pages.tolist())
    # The orphan answers without the daemon, with the pages declared in use.
    orphan = client.load(m.handle)
    assert orphan.device_pages.tolist() == ld.device_pages.tolist() and orphan.wait == ()
    mark = fake.count()
    client.unlock(m.handle)
    assert released(fake, mark) == []
    client.unlock(m.handle)  # the last lock: its pages come back
    assert released(fake, mark) == [sorted(ld.device_pages.tolist())]
    with pytest.raises(UnknownNode):
        client.unlock(m.handle)
    client.release(private)
    fake.check()


def test_an_orphan_held_across_two_restarts_gives_its_pages_back_once(fake, client):
    tokens = seq(800, 2)
    prefill(client, tokens)
    m = client.match(tokens)
    client.lock(m.handle)
    for _ in range(2):
        fake.restart()
        client.match(tokens)
        assert in_use(fake) == set(m.device_pages.tolist())
    mark = fake.count()
    client.unlock(m.handle)
    assert released(fake, mark) == [sorted(m.device_pages.tolist())]
    fake.restart()
    client.match(tokens)
    assert in_use(fake) == set()


def test_an_insert_adopting_orphan_pages_keeps_them_from_the_unlock(fake, client):
    tokens = seq(1000, 2)
    prefill(client, tokens)
    m = client.match(tokens)
    client.lock(m.handle)
    fake.restart()
    client.match(seq(0, 1))  # reconnects
    inserted = client.insert(tokens, m.device_pages)  # the new daemon's tree takes them
    assert inserted.device_pages.tolist() == m.device_pages.tolist()
    mark = fake.count()
    client.unlock(m.handle)
    assert released(fake, mark) == []
    fake.check()


def test_pages_an_insert_gave_the_new_daemon_are_no_longer_the_orphans(fake, client):
    tokens = seq(1050, 2)
    prefill(client, tokens)
    m = client.match(tokens)
    client.lock(m.handle)
    old = client.load(m.handle).device_pages.tolist()
    fake.restart()
    again = client.match(tokens)  # reconnects; the new daemon has the prefix off the device
    client.lock(again.handle)
    reloaded = client.load(again.handle).device_pages.tolist()
    assert not set(reloaded) & set(old)
    # The conversation goes on from the orphan's pages: duplicates now, freed.
    r = client.insert(tokens + seq(5000, 1), old + client.alloc(1).tolist())
    assert sorted(r.freed.tolist()) == sorted(old) and r.device_pages.tolist()[:2] == reloaded
    mine = client.alloc(2).tolist()
    assert sorted(mine) == sorted(old)  # handed out again: the engine's own pages now
    assert client.load(m.handle).device_pages.size == 0  # the orphan's path is gone
    fake.restart()
    client.match(seq(0, 1))
    assert in_use(fake) == set(mine) | set(reloaded)
    mark = fake.count()
    client.unlock(m.handle)
    assert released(fake, mark) == []  # never the engine's own pages
    client.release(mine)
    client.unlock(again.handle)
    fake.check()


def test_node_calls_are_not_replayed_into_a_new_session(fake, client):
    tokens = seq(1100, 2)
    prefill(client, tokens)
    m = client.match(tokens)  # not locked when the daemon restarts
    fake.restart()
    mark = fake.count()
    client.lock(m.handle)  # UNKNOWN_SESSION: reconnect, and no Lock with an old handle
    assert fake.ops(mark) == ["lock", "hello", "register"] and in_use(fake) == set()
    ld = client.load(m.handle)  # an orphan whose pages were not declared: none to use
    assert ld.device_pages.size == 0 and fake.ops(mark)[3:] == []
    client.unlock(m.handle)
    assert fake.ops(mark)[3:] == []


def test_degraded_load_of_pages_still_landing_gives_none(fake, client):
    tokens = seq(1200, 2)
    prefill(client, tokens)
    landing = fake.land(tokens)
    m = client.match(tokens)
    client.lock(m.handle)
    go_degraded(client, fake)
    ld = client.load(m.handle)  # nothing to wait on without the daemon: compute instead
    assert ld.device_pages.size == 0 and ld.wait == ()
    client.unlock(m.handle)
    fake.up()
    fake.complete(landing)


def test_degraded_release_is_not_declared_again(fake, client, clock):
    kept, dropped = client.alloc(1).tolist(), client.alloc(2).tolist()
    go_degraded(client, fake)
    client.release(dropped)
    fake.up()
    clock.advance(10.0)
    client.match(seq(0, 1))
    assert not client.degraded and in_use(fake) == set(kept)


def test_unknown_session_twice_is_an_error(fake, client):
    fake.script("match", ErrorCode.UNKNOWN_SESSION)
    fake.script("match", ErrorCode.UNKNOWN_SESSION)
    with pytest.raises(RemoteError) as info:
        client.match(seq(0, 1))
    assert info.value.code == ErrorCode.UNKNOWN_SESSION
    assert fake.ops()[-4:] == ["match", "hello", "register", "match"]


def test_error_replies_reach_the_caller(fake, client):
    with pytest.raises(RemoteError) as info:
        client.release([3])
    assert info.value.code == ErrorCode.INVALID_ARGUMENT and not client.degraded


def test_register_raises_when_refused_or_unanswered(fake, engine, clock):
    c = CacheClient(fake.endpoint, timeout_s=TIMEOUT_S, heartbeat=False, clock=clock)
    try:
        fake.script("register", ErrorCode.SPEC_MISMATCH)
        with pytest.raises(RemoteError) as info:
            c.register(SPEC, [engine.exported.handle])
        assert info.value.code == ErrorCode.SPEC_MISMATCH and c.session_id is None
        fake.down()
        with pytest.raises(Unavailable):
            c.register(SPEC, [engine.exported.handle])
        fake.up()
        c.register(SPEC, [engine.exported.handle])
        assert c.session_id is not None
    finally:
        c.close()


def test_session_calls_need_a_registration(fake):
    c = CacheClient(fake.endpoint, timeout_s=TIMEOUT_S, heartbeat=False)
    try:
        with pytest.raises(InvalidArgument, match="register"):
            c.match(seq(0, 1))
    finally:
        c.close()


def test_heartbeats_keep_the_session_on_its_own_connection(fake, engine):
    fake.lease_s = 0.15  # heartbeats every 50 ms
    c = CacheClient(fake.endpoint, timeout_s=0.5, reconnect_interval_s=0.05)
    try:
        c.register(SPEC, [engine.exported.handle])
        identity, session = fake.last("hello").identity, c.session_id

        def heartbeats():
            with fake.lock:
                return [r for r in fake.received if r.op == "heartbeat"]

        eventually(lambda: len(heartbeats()) >= 3, "three heartbeats")
        assert all(r.identity == identity and r.message.session == session for r in heartbeats())
        # Calls between heartbeats get their own answers (the heartbeats' are dropped).
        for i in range(20):
            assert c.match(seq(i * PS, 1)).handle is None
        eventually(lambda: len(heartbeats()) >= 6, "more heartbeats after calls")
        # While degraded the thread probes (health, on a connection of its own) and the
        # next call after a probe got through reconnects.
        fake.down()
        assert c.match(seq(0, 1)).handle is None and c.degraded
        mark = fake.count()
        eventually(lambda: "health" in fake.ops(mark), "a probe")
        fake.up()
        eventually(lambda: (c.match(seq(0, 1)), not c.degraded)[1], "a reconnect")
        assert c.session_id not in (None, session)
        session = c.session_id
        ops = fake.ops(mark)
        assert ops.index("hello") < ops.index("register") < len(ops) - 1
    finally:
        c.close()
    assert fake.last("bye").message.session == session and fake.sessions == {}


def test_a_request_over_the_daemons_limit_is_refused_at_once_and_the_client_stays_up(tmp_path, engine, clock):
    """The daemon's hello says its ``max_message_bytes``: a request over it is
    INVALID_ARGUMENT here, never sent (the daemon would refuse it, or drop the
    connection), and the client is not degraded — its next calls are served."""
    fake = FakeDaemon(tmp_path, max_message_bytes=64 << 10)
    client = CacheClient(fake.endpoint, timeout_s=TIMEOUT_S, heartbeat=False, clock=clock)
    try:
        client.register(SPEC, [engine.exported.handle])
        assert client.max_message_bytes == 64 << 10
        for call in (lambda: client.match(list(range(1, 32 * 1024 + 1))),
                     lambda: client.match_many([list(range(1, 8 * 1024 + 1))] * 4)):
            with pytest.raises(InvalidArgument) as refused:
                call()
            assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "max_message_bytes" in str(refused.value)
        assert not client.degraded and fake.ops() == ["hello", "register"]
        assert client.match(seq(0, 1)).handle is None and fake.ops()[-1] == "match"
    finally:
        client.close()
        fake.close()
    assert fake.errors == []


def test_a_load_still_copying_is_waited_on_its_ring_after_many_registrations(fake, client):
    """A load answered on the pool's first ring is still copying (its daemon holds that
    ring: it may still write the engine's blocks) while the pool is registered again
    five times. Its ticket reads what its own ring says: not over, then landed once the
    daemon stamps it (before, the client kept only the last four rings: the ticket was
    looked up on the current ring, read as stale, and wait_over said the load was over
    — an engine reuses the blocks the daemon still writes)."""
    from hicache.errors import WaitTimeout

    tokens = seq(1200, 2)
    prefill(client, tokens)
    ring = fake.counters
    ticket = fake.land(tokens)
    for i in range(5):
        fake.restart()
        client.match(seq(2000 + 100 * i, 1))  # UNKNOWN_SESSION: hello, register again
    assert client.epoch == 6
    assert client.wait_over([ticket], timeout_s=0.0) is False
    with pytest.raises(WaitTimeout):
        client.wait_layer([ticket], 0, timeout_s=0.0)
    with fake.lock:
        for layer in range(ring.num_layers):
            ring.complete_layer(ticket, layer)
    client.wait_layer([ticket], ring.num_layers - 1, timeout_s=0.0)
    assert client.wait_over([ticket], timeout_s=0.0) is True


@pytest.mark.parametrize("takes_uuids", [False, True])
def test_a_cuda_pools_gpu_uuid_goes_only_to_a_daemon_whose_hello_takes_it(tmp_path, engine, takes_uuids):
    """A CUDA pool's description names its GPU by UUID (``device_uuid``), a field a
    daemon older than it refuses (nested values take no unknown field): the client
    sends it only to a daemon whose hello says ``device_uuids``; an older one opens the
    pool at the engine's index, as before."""
    from dataclasses import replace

    from cuda_ipc_util import description
    from hicache import protocol as p

    fake = FakeDaemon(tmp_path, device_uuids=takes_uuids)
    cuda = description(engine.exported.handle.nbytes, b"/hicache-test-ref", device_uuid="GPU-5d2c07a1")
    handle = replace(engine.exported.handle, kind="cuda_ipc", cuda_ipc=cuda, fd=-1)
    c = CacheClient(fake.endpoint, timeout_s=TIMEOUT_S, heartbeat=False)
    try:
        with pytest.raises(RemoteError, match="memfd pools only"):
            c.register(SPEC, [handle])
        sent = p.as_dict(fake.last("register").message.pools[0].cuda_ipc)
        assert sent["device"] == 0 and sent.get("device_uuid") == ("GPU-5d2c07a1" if takes_uuids else None)
    finally:
        c.close()
        fake.close()
    assert fake.errors == []


def test_a_call_not_answered_is_given_up_only_once_its_deadline_has_passed(fake, client, monkeypatch):
    """The wait is ZeroMQ's receive timeout, in whole milliseconds, which may end a little
    early: the call waits again while time is left, and is never given up before its
    deadline (a load's deadline, stamped before it is sent, is the moment the daemon is
    told not to write after: an engine that gave up sooner could reuse blocks the
    daemon still writes). Here every wait ends at once, unanswered."""
    waits = []

    class Early:
        def setsockopt(self, option, value):
            waits.append(value)

        def recv(self):
            raise zmq.Again()

        def close(self, linger=None):
            pass

    monkeypatch.setattr(client, "_socket", Early())
    deadline = time.monotonic() + 0.05
    with pytest.raises(Unavailable):
        client._receive_locked(1, deadline)
    assert time.monotonic() >= deadline and len(waits) >= 1 and client._socket is None
