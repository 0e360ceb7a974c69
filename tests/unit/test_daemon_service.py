"""The daemon's request handling, without sockets: sessions, validation, sharing off, TP
groups, leases (with an injected clock)."""

import gc
import os
import threading
from concurrent.futures import Future

import numpy as np
import pytest

from hicache.config import DaemonConfig
from hicache import protocol as p
from hicache.daemon import sessions, specs
from hicache.daemon.auth import Identity
from hicache.daemon.service import LOCAL, Daemon, PeerCreds
from hicache.fdpass import FdExchange
from hicache.engine.kv_pool import export_kv_pool
from hicache.errors import ErrorCode
from hicache.keys import key_self_test, namespace_id
from hicache.spec import KVSpec
from hicache.tree import Place, Tier
from storage_util import HungMooncakeStore, stored_run
from tiers_util import SPEC, Engine, offered, wired

PS = SPEC.page_size


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_daemon(tmp_path, clock=None, **overrides):
    values = {"disk.enabled": False, "server.socket": str(tmp_path / "s.sock"), "host.ratio": 1.0,
              "server.lease_s": 5.0}
    values.update(overrides)
    return Daemon(DaemonConfig.load(overrides=values), clock=clock or Clock(), fds=FdExchange(tmp_path / "fds"))


def ok(reply):
    """A reply that is not an error (a future: see :func:`answered`)."""
    assert not isinstance(reply, (p.Error, Future)), reply
    return reply


def error(reply, code):
    assert isinstance(reply, p.Error) and reply.code == code, reply
    return reply


def answered(daemon, reply):
    """The reply, or the reply a future ends with while the daemon's loop is driven (a
    registration waiting for its spec's rebuild in the background)."""
    while isinstance(reply, Future) and not reply.done():
        daemon.poll()
    return reply.result() if isinstance(reply, Future) else reply


def register(daemon, session_id, spec, handles, request_id=2):
    return wired(daemon, p.Register(id=request_id, session=session_id, spec=spec.to_dict(),
                                    fingerprint=spec.fingerprint, key_check=key_self_test(spec.fingerprint,
                                                                                          spec.page_size),
                                    pools=handles))


def session(daemon, engine=None, spec=SPEC, pools=None):
    hello = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION, client="test")))
    handles = pools if pools is not None else [engine.offered(daemon)]
    ok(answered(daemon, register(daemon, hello.session, spec, handles)))
    return hello.session


@pytest.fixture
def engines():
    made = []

    def make(num_pages=16, spec=SPEC):
        made.append(Engine(num_pages, spec=spec))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def test_hello_and_register_are_checked(tmp_path, engines):
    daemon = make_daemon(tmp_path, **{"server.max_sessions": 2})
    engine = engines()
    error(daemon.handle(p.Hello(id=1, version=99)), ErrorCode.VERSION_MISMATCH)
    hello = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION)))
    good = dict(id=2, session=hello.session, spec=SPEC.to_dict(), fingerprint=SPEC.fingerprint,
                key_check=key_self_test(SPEC.fingerprint, PS), pools=[engine.offered(daemon)])
    # A refused registration drops the descriptors it named: the engine offers again.
    error(wired(daemon, p.Register(**{**good, "fingerprint": b"\0" * 16})), ErrorCode.SPEC_MISMATCH)
    assert daemon.fds.take(good["pools"][0]["token"]) is None
    good["pools"] = [engine.offered(daemon)]
    error(wired(daemon, p.Register(**{**good, "key_check": b"\1" * 32})), ErrorCode.SPEC_MISMATCH)
    error(wired(daemon, p.Register(**{**good, "pools": []})), ErrorCode.INVALID_ARGUMENT)
    error(wired(daemon, p.Register(**{**good, "spec": {"format": 1}})), ErrorCode.INVALID_ARGUMENT)
    other = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=8, page_size=PS, model="other")
    error(wired(daemon, p.Register(**{**good, "spec": other.to_dict(), "fingerprint": other.fingerprint,
                                      "key_check": key_self_test(other.fingerprint, PS)})),
          ErrorCode.SPEC_MISMATCH)  # the pool was made for SPEC
    error(wired(daemon, p.Register(**{**good, "session": 12345})), ErrorCode.UNKNOWN_SESSION)
    error(daemon.handle(p.Alloc(id=3, session=hello.session, num_pages=1)), ErrorCode.INVALID_ARGUMENT)
    good["pools"] = [engine.offered(daemon)]
    ok(wired(daemon, p.Register(**good)))
    error(wired(daemon, p.Register(**good)), ErrorCode.INVALID_ARGUMENT)  # twice
    ok(daemon.handle(p.Hello(id=4, version=p.PROTOCOL_VERSION)))
    error(daemon.handle(p.Hello(id=5, version=p.PROTOCOL_VERSION)), ErrorCode.RESOURCE_EXHAUSTED)
    daemon.close()


def test_a_hello_ends_the_session_its_engine_gave_up_on_and_no_other(tmp_path, engines):
    """A client that gave up on a call (the daemon did not answer in time) dropped its
    connection, and any bye with it; its next hello names that session
    (``Hello.replaces``), and the daemon ends it at once — its private pages freed, its
    pool's memory free to register again — when the hello comes from the same engine:
    the same process of the same user (as the transport tells and as the hello says),
    peer and identity. Another process, user or identity naming the id, or a wrong id,
    ends nothing and is answered like any hello."""
    uid, gid = os.getuid(), os.getgid()
    creds = {
        b"engine": PeerCreds(uid, gid, 4242, f"uid:{uid}"),
        b"again": PeerCreds(uid, gid, 4242, f"uid:{uid}"),  # the engine's new connection
        b"sibling": PeerCreds(uid, gid, 4243, f"uid:{uid}"),  # another process of the user
        b"other-user": PeerCreds(uid + 1, gid, 4242, f"uid:{uid + 1}"),
        b"other-identity": PeerCreds(uid, gid, 4242, f"uid:{uid}", Identity("team-b", ("b",))),
    }
    daemon = make_daemon(tmp_path, **{"metrics.enabled": True})
    daemon.peer_creds = lambda peer: creds.get(peer, LOCAL)  # (b"": the test itself)
    engine = engines(num_pages=8)

    def hello(peer, pid=4242, replaces=p.UNSET):
        reply = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION, pid=pid, replaces=replaces), peer))
        assert reply.replace_sessions
        return reply.session

    old = hello(b"engine")
    ok(wired(daemon, p.Register(id=2, session=old, spec=SPEC.to_dict(), fingerprint=SPEC.fingerprint,
                                key_check=key_self_test(SPEC.fingerprint, PS), pools=[engine.offered(daemon)]),
             b"engine"))
    assert len(_pages(ok(daemon.handle(p.Alloc(id=3, session=old, num_pages=7), b"engine")))) == 7
    for peer, pid, replaces in ((b"sibling", 4243, old), (b"again", 4243, old), (b"other-user", 4242, old),
                                (b"other-identity", 4242, old), (b"again", 4242, old ^ 1), (b"again", 4242, 0)):
        sid = hello(peer, pid, replaces)
        assert old in daemon.sessions, (peer, pid)
        ok(daemon.handle(p.Bye(id=4, session=sid), peer))
    new = hello(b"again", replaces=old)
    assert old not in daemon.sessions and new in daemon.sessions
    ok(wired(daemon, p.Register(id=5, session=new, spec=SPEC.to_dict(), fingerprint=SPEC.fingerprint,
                                key_check=key_self_test(SPEC.fingerprint, PS), pools=[engine.offered(daemon)]),
             b"again"))  # the same memory: the old session's no longer
    assert len(_pages(ok(daemon.handle(p.Alloc(id=6, session=new, num_pages=7), b"again")))) == 7
    assert daemon.metrics.registry.get_sample_value("hicache_sessions_ended_total", {"reason": "replaced"}) == 1
    ok(answered(daemon, daemon.handle(p.Check(id=7))))
    daemon.close()


def _pages(reply) -> np.ndarray:
    return np.frombuffer(reply.pages, dtype="<i4")


def test_sessions_cannot_touch_each_others_locks_and_pages(tmp_path, engines):
    daemon = make_daemon(tmp_path)
    a, b = engines(), engines()
    sa, sb = session(daemon, a), session(daemon, b)
    pages = ok(daemon.handle(p.Alloc(id=1, session=sa, num_pages=3))).pages
    tokens = np.arange(3 * PS, dtype="<i4").tobytes()
    inserted = ok(daemon.handle(p.Insert(id=2, session=sa, tokens=tokens, pages=pages)))
    ok(daemon.handle(p.Lock(id=3, session=sa, node=inserted.node)))
    # A handle is its session's: another session naming it names nothing.
    for op in (p.Lock, p.Unlock, p.Load):
        error(daemon.handle(op(id=4, session=sb, node=inserted.node)), ErrorCode.UNKNOWN_NODE)
    # The same node through b's own match (once backed up to host) has b's own handle,
    # on which b holds no lock.
    ok(answered(daemon, daemon.handle(p.Flush(id=5))))
    theirs = ok(daemon.handle(p.Match(id=5, session=sb, tokens=tokens))).node
    assert theirs not in (inserted.node, -1)
    error(daemon.handle(p.Unlock(id=5, session=sb, node=theirs)), ErrorCode.LOCK_UNDERFLOW)
    error(daemon.handle(p.Load(id=5, session=sb, node=theirs)), ErrorCode.LOCK_UNDERFLOW)
    error(daemon.handle(p.Lock(id=5, session=sa, node=theirs)), ErrorCode.UNKNOWN_NODE)
    mine = ok(daemon.handle(p.Alloc(id=6, session=sa, num_pages=2))).pages
    error(daemon.handle(p.Release(id=7, session=sb, pages=mine)), ErrorCode.INVALID_ARGUMENT)
    error(daemon.handle(p.Insert(id=8, session=sb, tokens=tokens[: 2 * PS * 4], pages=mine)),
          ErrorCode.INVALID_ARGUMENT)
    error(daemon.handle(p.Lock(id=9, session=sa, node=10**9)), ErrorCode.UNKNOWN_NODE)
    ok(daemon.handle(p.Unlock(id=10, session=sa, node=inserted.node)))
    error(daemon.handle(p.Unlock(id=11, session=sa, node=inserted.node)), ErrorCode.LOCK_UNDERFLOW)
    ok(daemon.handle(p.Release(id=12, session=sa, pages=mine)))
    ok(answered(daemon, daemon.handle(p.Check(id=13))))
    daemon.close()


def test_expired_lease_gives_everything_back(tmp_path, engines):
    clock = Clock()
    daemon = make_daemon(tmp_path, clock)
    engine = engines()
    sid = session(daemon, engine)
    pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=4))).pages
    tokens = np.arange(2 * PS, dtype="<i4").tobytes()
    node = ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages[:8]))).node
    ok(daemon.handle(p.Lock(id=3, session=sid, node=node)))
    (manager,) = daemon.managers.values()
    manager.flush()
    assert manager.accounting()[Place(Tier.HOST)].cached_protected == 2  # the lock keeps the host copy
    clock.now += 4.9
    daemon.poll()
    assert sid in daemon.sessions
    clock.now += 1.0
    daemon.poll()
    assert sid not in daemon.sessions
    manager.flush()
    manager.poll()
    assert not any(place.tier == Tier.DEVICE for place in manager.accounting())  # the pool is gone
    assert manager.accounting()[Place(Tier.HOST)].cached_protected == 0
    error(daemon.handle(p.Match(id=4, session=sid, tokens=tokens)), ErrorCode.UNKNOWN_SESSION)
    ok(answered(daemon, daemon.handle(p.Check(id=5))))
    daemon.close()


def test_stats_report_the_losses_the_metrics_count(tmp_path, engines):
    """``stats`` says what the daemon lost — pages dropped from the cache by tier, pages
    of failed transfers, remote puts skipped, sessions whose lease ran out — read from
    the counters the metrics export, so an operator without Prometheus (or a script on
    the client) sees them, and the two never disagree — also where the daemon serves
    no metrics (``[metrics] enabled = false``)."""
    clock = Clock()
    daemon = make_daemon(tmp_path, clock)
    engine = engines()
    sid = session(daemon, engine)
    losses = ok(daemon.handle(p.Stats(id=1))).stats.losses
    assert losses == p.LossesMsg(pages_dropped={"device": 0, "host": 0, "disk": 0},
                                 transfer_failed_pages={"d2h": 0, "host_to_disk": 0}, remote_put_skipped_pages=0,
                                 sessions_expired=0)
    pages = ok(daemon.handle(p.Alloc(id=2, session=sid, num_pages=3))).pages
    ok(daemon.handle(p.Insert(id=3, session=sid, tokens=np.arange(3 * PS, dtype="<i4").tobytes(), pages=pages)))
    (manager,) = daemon.managers.values()
    manager.flush()
    manager.evict(Tier.DEVICE, 3, daemon.sessions[sid].pool_id)  # (their host copies stay)
    manager.evict(Tier.HOST, 3)  # (no disk tier: the host copies were the last)
    clock.now += 6.0
    daemon.poll()  # (the engine stopped heartbeating: its lease runs out)
    assert sid not in daemon.sessions
    reply = p.decode_reply(p.encode(ok(daemon.handle(p.Stats(id=4)))))  # (as a client reads it)
    losses = reply.stats.losses
    assert losses.pages_dropped == {"device": 0, "host": 3, "disk": 0} and losses.sessions_expired == 1
    assert losses.kv_events_dropped is None and losses.checkpoints_lost is None  # (no [events], no state spec)
    registry = daemon.metrics.registry
    for tier, pages_dropped in losses.pages_dropped.items():
        assert registry.get_sample_value("hicache_pages_dropped_total", {"tier": tier}) == pages_dropped
    for direction, failed in losses.transfer_failed_pages.items():
        assert registry.get_sample_value("hicache_transfer_failed_pages_total", {"direction": direction}) == failed
    assert registry.get_sample_value("hicache_sessions_ended_total", {"reason": "lease_expired"}) == 1
    daemon.close()
    (tmp_path / "quiet").mkdir()
    quiet = make_daemon(tmp_path / "quiet", **{"metrics.enabled": False})
    assert ok(quiet.handle(p.Stats(id=1))).stats.losses.sessions_expired == 0
    quiet.close()


@pytest.mark.parametrize("ending", ["bye", "lease_expired"])
def test_a_pool_whose_engine_went_while_its_backup_copied_is_unmapped_once_the_copy_lands(tmp_path, engines,
                                                                                          ending):
    """The engine inserts and goes (bye, or killed: its lease runs out) before the
    daemon has taken in the write-through backup of its pages (no poll since): the pool
    is retired with a transfer in flight. Once that lands, the pool is unmapped and its
    pages forgotten — the same memory registers again."""
    clock = Clock()
    daemon = make_daemon(tmp_path, clock)
    engine = engines()
    sid = session(daemon, engine)
    pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=2))).pages
    ok(daemon.handle(p.Insert(id=2, session=sid, tokens=np.arange(2 * PS, dtype="<i4").tobytes(), pages=pages)))
    (manager,) = daemon.managers.values()
    assert not manager.idle()  # the backup is in flight
    if ending == "bye":
        ok(daemon.handle(p.Bye(id=3, session=sid)))
    else:
        clock.now += 6.0
        daemon.sessions.expire()
    assert sid not in daemon.sessions
    while not manager.idle():
        daemon.poll(0.01)
    assert not any(place.tier == Tier.DEVICE for place in manager.accounting())  # the pool is gone
    ok(answered(daemon, daemon.handle(p.Check(id=4))))
    session(daemon, engine)  # its memory is no other pool's
    ok(answered(daemon, daemon.handle(p.Check(id=5))))
    daemon.close()


def test_a_session_answers_only_on_the_connection_that_said_hello(tmp_path, engines):
    daemon = make_daemon(tmp_path)
    hello = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION), peer=b"conn-a"))
    engine = engines()
    reg = p.Register(id=2, session=hello.session, spec=SPEC.to_dict(), fingerprint=SPEC.fingerprint,
                     key_check=key_self_test(SPEC.fingerprint, PS), pools=[engine.offered(daemon)])
    error(wired(daemon, reg, peer=b"conn-b"), ErrorCode.UNKNOWN_SESSION)
    reg.pools = [engine.offered(daemon)]  # (the refused one dropped its descriptor)
    ok(wired(daemon, reg, peer=b"conn-a"))
    for request in (p.Alloc(id=3, session=hello.session, num_pages=1), p.Heartbeat(id=3, session=hello.session),
                    p.Bye(id=3, session=hello.session)):
        error(daemon.handle(request, peer=b"conn-b"), ErrorCode.UNKNOWN_SESSION)
    assert hello.session in daemon.sessions  # a foreign bye ended nothing
    ok(daemon.handle(p.Bye(id=4, session=hello.session), peer=b"conn-a"))
    assert hello.session not in daemon.sessions
    daemon.close()


def test_unregistered_sessions_lapse_and_count_against_their_peer(tmp_path, engines):
    clock = Clock()
    daemon = make_daemon(tmp_path, clock, **{"server.max_unregistered_per_peer": 2, "server.register_within_s": 1.0})
    first = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION))).session
    ok(daemon.handle(p.Hello(id=2, version=p.PROTOCOL_VERSION)))
    error(daemon.handle(p.Hello(id=3, version=p.PROTOCOL_VERSION)), ErrorCode.RESOURCE_EXHAUSTED)
    # Another peer is not held back by this one.
    daemon.peer_creds = lambda peer: PeerCreds.parse("localhost:1234:1234:99" if peer == b"other" else "")
    ok(daemon.handle(p.Hello(id=4, version=p.PROTOCOL_VERSION), peer=b"other"))
    daemon.peer_creds = lambda peer: LOCAL
    # A registration makes room; heartbeats do not keep an unregistered session.
    ok(answered(daemon, register(daemon, first, SPEC, [engines().offered(daemon)])))
    third = ok(daemon.handle(p.Hello(id=5, version=p.PROTOCOL_VERSION))).session
    for _ in range(3):
        clock.now += 0.5
        ok(daemon.handle(p.Heartbeat(id=6, session=first)))
        daemon.handle(p.Heartbeat(id=6, session=third))
        daemon.poll()
    assert first in daemon.sessions and third not in daemon.sessions
    assert len(daemon.sessions) == 1 and not daemon.sessions.unregistered  # every unregistered one lapsed
    ok(daemon.handle(p.Hello(id=7, version=p.PROTOCOL_VERSION)))
    daemon.close()


def test_peer_addresses():
    assert PeerCreds.parse("localhost:1000:100:4242") == PeerCreds(1000, 100, 4242, "uid:1000")
    for address in ("127.0.0.1", "::1", "2001:db8::1:2:3", "", "localhost", "localhost:a:b:c", "host:1:2:3"):
        creds = PeerCreds.parse(address)
        assert creds.uid is None and creds.key == address and creds.address == address
    # On CURVE the identity is proven: one identity's sessions never count against another's.
    x, y = (Identity(name, ("t",)) for name in ("x", "y"))
    keys = {PeerCreds.parse(address, who, "CURVE").key for who in (x, y) for address in ("10.0.0.1", "localhost:7:7:1")}
    assert len(keys) == 4
    assert PeerCreds.parse("10.0.0.1", x, "CURVE").address == "10.0.0.1"
    assert PeerCreds.parse("10.0.0.1", x, "NULL").key == "10.0.0.1"


def test_a_session_waiting_for_an_answer_keeps_its_lease(tmp_path, engines):
    clock = Clock()
    daemon = make_daemon(tmp_path, clock)
    sid = session(daemon, engines())
    waiting = Future()  # a load of this session waiting for disk, say
    chained = daemon._chain(waiting, 2, "load", 0.0, daemon.sessions[sid])
    clock.now += 60
    daemon.poll()
    assert sid in daemon.sessions  # its engine waits on us, not the other way round
    waiting.set_result(p.Ok(id=0))
    assert chained.result().id == 2
    clock.now += 4.9
    daemon.poll()
    assert sid in daemon.sessions  # the answer renewed it
    clock.now += 1.0
    daemon.poll()
    assert sid not in daemon.sessions
    daemon.close()


def test_a_session_forgets_its_oldest_unlocked_handles(tmp_path, engines, monkeypatch):
    monkeypatch.setattr(sessions, "_MAX_HANDLES", 8)
    daemon = make_daemon(tmp_path)
    sid = session(daemon, engines(num_pages=64))
    handles = []
    for i in range(12):
        pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=1))).pages
        tokens = np.arange(1000 * i, 1000 * i + PS, dtype="<i4").tobytes()
        handles.append(ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages))).node)
        if i == 0:
            ok(daemon.handle(p.Lock(id=3, session=sid, node=handles[0])))
    assert len(set(handles)) == 12 and len(daemon.sessions[sid].handles) <= 8
    ok(daemon.handle(p.Unlock(id=4, session=sid, node=handles[0])))  # locked: kept
    error(daemon.handle(p.Lock(id=5, session=sid, node=handles[1])), ErrorCode.UNKNOWN_NODE)  # forgotten
    ok(daemon.handle(p.Lock(id=6, session=sid, node=handles[-1])))
    tokens = np.arange(1000, 1000 + PS, dtype="<i4").tobytes()
    again = ok(daemon.handle(p.Match(id=7, session=sid, tokens=tokens))).node  # a new handle for it
    assert again not in (-1, handles[1])
    ok(answered(daemon, daemon.handle(p.Check(id=8))))
    daemon.close()


def test_sharing_off_for_the_daemon_or_one_extra_key(tmp_path, engines):
    for overrides, key in (({"sharing.enabled": False}, ""), ({"sharing.disabled_extra_keys": ["secret"]}, "secret")):
        daemon = make_daemon(tmp_path, **overrides)
        engine = engines()
        sid = session(daemon, engine)
        tokens = np.arange(3 * PS, dtype="<i4").tobytes()
        pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=3))).pages
        reply = ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages, extra_key=key)))
        assert reply.node == -1 and reply.freed == pages
        miss = ok(daemon.handle(p.Match(id=3, session=sid, tokens=tokens, extra_key=key)))
        assert miss.node == -1 and miss.device_pages == b""
        (manager,) = daemon.managers.values()
        assert manager.accounting()[Place.device(daemon.sessions[sid].pool_id)].free == 16
        if key:  # other keys still share
            pages = ok(daemon.handle(p.Alloc(id=4, session=sid, num_pages=3))).pages
            ok(daemon.handle(p.Insert(id=5, session=sid, tokens=tokens, pages=pages)))
            assert ok(daemon.handle(p.Match(id=6, session=sid, tokens=tokens))).device_pages == pages
        ok(answered(daemon, daemon.handle(p.Check(id=7))))
        daemon.close()


def test_misses_with_sharing_off_count_as_never_stored(tmp_path, engines):
    """Sharing off for the whole daemon or for one extra_key: a miss is a request never
    stored (not an unknown namespace), for match and match_many alike."""
    for overrides, key in (({"sharing.enabled": False}, ""), ({"sharing.disabled_extra_keys": ["secret"]}, "secret")):
        daemon = make_daemon(tmp_path, **overrides)
        sid = session(daemon, engines())
        tokens = np.arange(3 * PS, dtype="<i4").tobytes()
        ok(daemon.handle(p.Match(id=1, session=sid, tokens=tokens, extra_key=key)))
        ok(daemon.handle(p.MatchMany(id=2, session=sid, tokens=[tokens, tokens], extra_key=key)))
        missed = daemon.metrics.missed_tokens
        assert missed["never_stored"] == 9 * PS and missed["namespace_unknown"] == 0, missed
        daemon.close()


def test_a_tp_group_registers_once_and_host_pages_hold_every_rank(tmp_path):
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=PS, model="tp2", tp_size=2)
    ranks = [export_kv_pool(spec, 8, rank=r) for r in range(2)]
    daemon = make_daemon(tmp_path)
    try:
        sid = session(daemon, spec=spec, pools=[offered(daemon, r) for r in ranks])
        pages = np.frombuffer(ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=2))).pages, "<i4")
        for rank, exported in enumerate(ranks):  # each rank computes its own heads
            for region in exported.pool.layout.token_regions:
                for page in pages.tolist():
                    start = region.offset + page * region.unit_bytes
                    exported.pool.buffer[start : start + region.unit_bytes] = rank + 1
        tokens = np.arange(2 * PS, dtype="<i4").tobytes()
        ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages.tobytes())))
        (manager,) = daemon.managers.values()
        manager.flush()
        node = manager.tree.match(namespace_id(spec.fingerprint), tokens, daemon.sessions[sid].pool_id).node
        for host_page in node.host_pages.tolist():
            data = manager.host_pool.page(host_page).numpy()
            half = spec.rank_page_bytes
            assert (data[:half] == 1).all() and (data[half:] == 2).all()
        ok(answered(daemon, daemon.handle(p.Check(id=3))))
    finally:
        daemon.close()
        for exported in ranks:
            exported.close()


def test_draining_refuses_new_sessions(tmp_path):
    daemon = make_daemon(tmp_path)
    daemon.drain()
    error(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION)), ErrorCode.DRAINING)
    assert ok(daemon.handle(p.Health(id=2))).state == "draining"
    daemon.close()


def test_the_loop_sleeps_until_the_next_deadline_and_never_busy_polls(tmp_path, engines):
    """The server's receive timeout: the whole idle step without sessions, a short sleep
    (never 0, which would make the loop spin) while a lease check or a tier manager's
    timer is a few milliseconds away, 0 only once one is due."""
    import zmq

    from hicache.daemon.server import Server

    clock = Clock()
    daemon = make_daemon(tmp_path, clock=clock)
    context = zmq.Context()
    server = Server(daemon.config, daemon=daemon, context=context)
    try:
        assert daemon.next_deadline() is None
        assert server._timeout_ms() == 250
        session(daemon, engines())
        daemon.poll()
        lease_check = daemon.next_deadline()
        assert lease_check is not None and lease_check > clock.now
        for before in (0.049, 0.003, 1e-6):
            clock.now = lease_check - before
            assert server._timeout_ms() == 50
        clock.now = lease_check
        assert server._timeout_ms() == 0
        daemon.poll()  # the check ran: the next one is a step away
        assert daemon.next_deadline() > clock.now and server._timeout_ms() == 50

        manager = next(iter(daemon.managers.values()))
        fired = []
        manager.add_timer(0.01, lambda: fired.append(clock.now))
        assert daemon.next_deadline() == pytest.approx(clock.now + 0.01)
        clock.now += 0.01
        assert server._timeout_ms() == 0
        daemon.poll()
        assert fired == [clock.now]
    finally:
        daemon.close()
        context.destroy(linger=0)


def test_specs_sharing_the_store_hear_of_each_others_evictions(tmp_path, engines):
    """Two models share one LMDB store: when one's writes make the store evict the
    other's records, the other's tree stops claiming them (a match never reports disk
    pages that are gone)."""
    import dataclasses

    other_spec = dataclasses.replace(SPEC, model="other-model")
    assert other_spec.fingerprint != SPEC.fingerprint and other_spec.host_page_bytes == SPEC.host_page_bytes
    daemon = make_daemon(tmp_path, **{"disk.enabled": True, "disk.path": str(tmp_path / "store"),
                                      "disk.capacity_bytes": 6 * SPEC.host_page_bytes})
    a, b = engines(), engines(spec=other_spec)
    sa, sb = session(daemon, a), session(daemon, b, spec=other_spec)
    manager_a, manager_b = daemon.managers[SPEC.fingerprint], daemon.managers[other_spec.fingerprint]

    def insert(sid, engine, first_token, num_pages):
        tokens = np.arange(first_token, first_token + num_pages * PS, dtype="<i4").tobytes()
        pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=num_pages))).pages
        ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages)))
        return tokens

    def disk_keys_present(manager):
        for node in manager.tree.nodes():
            if manager.tree.is_live(node) and node.on_disk:
                keys = node.page_key_list()
                assert stored_run(daemon.storage, keys) == len(keys), "the tree claims a disk record that is gone"

    tokens_a = insert(sa, a, 0, 5)
    manager_a.flush()
    assert ok(daemon.handle(p.Match(id=3, session=sa, tokens=tokens_a))).node >= 0
    assert sum(n.num_pages for n in manager_a.tree.nodes() if n.on_disk) == 5
    insert(sb, b, 10_000, 5)  # 10 pages in a store of 6: the store evicts 4 of a's, oldest first
    manager_b.flush()
    manager_a.poll()
    manager_b.poll()
    disk_keys_present(manager_a)
    disk_keys_present(manager_b)
    assert sum(n.num_pages for n in manager_a.tree.nodes() if manager_a.tree.is_live(n) and n.on_disk) <= 1
    ok(answered(daemon, daemon.handle(p.Check(id=4))))
    daemon.close()


def test_a_long_rebuild_on_the_loop_keeps_the_watchdog_fed(tmp_path):
    """The daemon's keepalive (called through a disk-tier rebuild) pings systemd's
    watchdog when a ping is due, and only then."""
    import zmq

    from hicache.daemon.server import Server

    class Recorder:
        def __init__(self, interval_s):
            self.watchdog_interval_s = interval_s
            self.pings = 0

        def watchdog(self):
            self.pings += 1

    context = zmq.Context()
    try:
        for interval_s, pings in ((3600.0, 1), (0.0, 3)):  # the first is due at once
            daemon = make_daemon(tmp_path)
            notifier = Recorder(interval_s)
            server = Server(daemon.config, daemon=daemon, notifier=notifier, context=context)
            for done in (16384, 32768, 49152):
                daemon.keepalive(done)
            assert notifier.pings == pings
            daemon.close()
            server.close()
    finally:
        context.destroy(linger=0)


def records_in(path) -> int:
    """The records of the LMDB store at ``path`` (what a restart would find)."""
    from hicache.storage.lmdb_backend import LmdbBackend

    store = LmdbBackend(path, capacity_bytes=1 << 30)
    try:
        return store.stats().records
    finally:
        store.close()


def test_drain_persists_pages_whose_backup_was_still_in_flight(tmp_path, engines):
    """SIGTERM right after an insert: the device -> host backup has not been taken in
    yet (no poll since), and the disk policy is write-back. The drain waits for it and
    then writes every host page to disk, so a restart hits all of it."""
    daemon = make_daemon(tmp_path, **{"disk.enabled": True, "disk.path": str(tmp_path / "store"),
                                      "tiers.disk_policy": "write_back"})
    engine = engines()
    sid = session(daemon, engine)
    tokens = np.arange(3 * PS, dtype="<i4").tobytes()
    pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=3))).pages
    ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages)))
    daemon.drain()
    daemon.close()
    assert records_in(tmp_path / "store") == 3


def test_drain_persists_host_pages_while_the_remote_store_hangs_in_a_put(tmp_path, engines):
    """SIGTERM while the remote store hangs in a put of the pages just inserted (its
    master gone mid-RPC), the disk policy write-back: the put is no reason to hold the
    host pages back from the disk. The drain writes them all, so a restart hits all of
    it — though the put never ends within the stop's deadline."""
    import time

    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig
    from storage_util import InProcessMooncake

    raw = InProcessMooncake()
    remote = MooncakeBackend(MooncakeConfig(master="127.0.0.1:1"), store=raw)
    config = DaemonConfig.load(overrides={"server.socket": str(tmp_path / "s.sock"), "host.ratio": 1.0,
                                          "disk.path": str(tmp_path / "store"), "tiers.disk_policy": "write_back"})
    daemon = Daemon(config, clock=time.monotonic, remote=remote, fds=FdExchange(tmp_path / "fds"))
    try:
        engine = engines()
        sid = session(daemon, engine)
        tokens = np.arange(3 * PS, dtype="<i4").tobytes()
        pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=3))).pages
        raw.hold("batch_put_from_multi_buffers")
        ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages)))
        (manager,) = daemon.managers.values()
        while not raw.entered.is_set():  # (the backup lands on host, and its put starts)
            manager.poll(0.01)
        daemon.drain(time.monotonic() + 2.0)
        assert manager.durability()["not_on_disk_pages"] == 0
        assert not raw.objects  # (the put still hangs)
    finally:
        raw.release()
        daemon.close()
    assert records_in(tmp_path / "store") == 3


def test_the_oldest_lock_age_is_exported(tmp_path, engines):
    """hicache_oldest_lock_age_seconds: how long the oldest lock still held has been
    held, over every session; back to 0 once it is released (or its session ends)."""
    clock = Clock()
    daemon = make_daemon(tmp_path, clock, **{"metrics.enabled": True})
    engine = engines()
    sid = session(daemon, engine)

    def age():
        daemon.refresh_snapshot()
        return daemon.metrics.registry.get_sample_value("hicache_oldest_lock_age_seconds")

    assert age() == 0
    pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=4))).pages
    first = ok(daemon.handle(p.Insert(id=2, session=sid, tokens=np.arange(2 * PS, dtype="<i4").tobytes(),
                                      pages=pages[:8]))).node
    second = ok(daemon.handle(p.Insert(id=3, session=sid, tokens=np.arange(100, 100 + 2 * PS, dtype="<i4").tobytes(),
                                       pages=pages[8:]))).node
    ok(daemon.handle(p.Lock(id=4, session=sid, node=first)))
    clock.now += 2.0
    ok(daemon.handle(p.Lock(id=5, session=sid, node=second)))
    ok(daemon.handle(p.Lock(id=6, session=sid, node=first)))  # a second lock keeps the first one's time
    clock.now += 3.0
    assert age() == 5.0
    ok(daemon.handle(p.Unlock(id=7, session=sid, node=first)))
    assert age() == 5.0  # still held once
    ok(daemon.handle(p.Unlock(id=8, session=sid, node=first)))
    assert age() == 3.0  # now the second one is the oldest
    ok(daemon.handle(p.Bye(id=9, session=sid)))
    assert age() == 0
    daemon.close()


def test_a_long_first_registration_does_not_expire_the_other_sessions(tmp_path, engines, monkeypatch):
    """A spec's first registration rebuilds its disk tier on the owner thread, which
    answers nothing meanwhile - heartbeats included. If that takes longer than a lease,
    the engines that were waiting must not lose their sessions (and everything they
    hold) for the daemon's own stall."""
    import dataclasses

    from hicache.tiers import TierManager

    clock = Clock()
    daemon = make_daemon(tmp_path, clock)
    a = engines()
    sa = session(daemon, a)
    pages = ok(daemon.handle(p.Alloc(id=1, session=sa, num_pages=2))).pages
    rebuild = TierManager.rebuild_from_storage

    def slow_rebuild(self, progress=None):
        clock.now += 30.0  # three leases
        return rebuild(self, progress)

    monkeypatch.setattr(TierManager, "rebuild_from_storage", slow_rebuild)
    other_spec = dataclasses.replace(SPEC, model="other-model")
    session(daemon, engines(spec=other_spec), spec=other_spec)
    daemon.poll()
    assert sa in daemon.sessions
    ok(daemon.handle(p.Release(id=2, session=sa, pages=pages)))  # still its pages
    clock.now += daemon.config.server.lease_s + 1.0  # a real silence still ends it
    daemon.poll()
    assert sa not in daemon.sessions
    daemon.close()


def test_a_spec_rebuilt_while_others_are_served_answers_its_registration_when_done(tmp_path, engines, monkeypatch):
    """After a restart, a spec registering while another engine is being served gets its
    disk tier rebuilt a slice at a time between that engine's requests: the other
    engine's matches are answered meanwhile, the waiting session keeps its lease (its
    client sends no heartbeats before the answer), and once the rebuild is done the
    registration is answered and the persisted pages hit from disk."""
    import dataclasses

    store = {"disk.enabled": True, "disk.path": str(tmp_path / "store")}
    first = make_daemon(tmp_path, **store)
    a = engines()
    sa = session(first, a)
    tokens_a = np.arange(0, 6 * PS, dtype="<i4").tobytes()
    pages = ok(first.handle(p.Alloc(id=1, session=sa, num_pages=6))).pages
    ok(first.handle(p.Insert(id=2, session=sa, tokens=tokens_a, pages=pages)))
    first.drain()
    first.close()

    monkeypatch.setattr(specs, "_REBUILD_STEP", 1)  # one record a step,
    monkeypatch.setattr(specs, "_REBUILD_SLICE_S", 0.0)  # one step a slice (the test clock stands still)
    clock = Clock()
    daemon = make_daemon(tmp_path, clock, **store)
    other_spec = dataclasses.replace(SPEC, model="other-model")
    b = engines(spec=other_spec)
    sb = session(daemon, b, spec=other_spec)  # nobody else to serve: rebuilt at once
    tokens_b = np.arange(50_000, 50_000 + 2 * PS, dtype="<i4").tobytes()
    pages_b = ok(daemon.handle(p.Alloc(id=3, session=sb, num_pages=2))).pages
    ok(daemon.handle(p.Insert(id=4, session=sb, tokens=tokens_b, pages=pages_b)))

    a2 = engines()
    sa2 = ok(daemon.handle(p.Hello(id=5, version=p.PROTOCOL_VERSION, client="restarted"))).session
    assert gc.isenabled()
    pending = register(daemon, sa2, SPEC, [a2.offered(daemon)], request_id=6)
    assert isinstance(pending, Future) and not pending.done()
    assert not gc.isenabled()  # no full collection walks the rebuild's records meanwhile
    error(register(daemon, sa2, SPEC, [a2.offered(daemon)], request_id=7), ErrorCode.INVALID_ARGUMENT)
    slices = 0
    while not pending.done():
        assert ok(daemon.handle(p.Match(id=8, session=sb, tokens=tokens_b))).node >= 0  # b is served
        clock.now += daemon.config.server.lease_s / 2  # two slices: a whole lease without a word from a2
        daemon.poll()
        slices += 1
        assert sa2 in daemon.sessions
    assert slices >= 6  # the rebuild did take turns with b's requests
    reply = ok(pending.result())
    assert isinstance(reply, p.RegisterReply) and reply.id == 6
    assert gc.isenabled()
    hit = ok(daemon.handle(p.Match(id=9, session=sa2, tokens=tokens_a)))
    assert hit.disk_pages + hit.host_pages == 6 and hit.device_pages == b""
    ok(answered(daemon, daemon.handle(p.Check(id=10))))
    daemon.close()


def test_a_rebuild_goes_on_when_another_specs_writes_evict_its_records_meanwhile(tmp_path, engines, monkeypatch):
    """While a spec's disk tier is rebuilt between another engine's requests, that
    engine's writes fill the store and it evicts the oldest records: the rebuilding
    spec's. The rebuild must take the loss (those pages and what hangs below them are
    gone) and still answer its registration with a serving manager."""
    import dataclasses

    page_bytes = SPEC.host_page_bytes
    store = {"disk.enabled": True, "disk.path": str(tmp_path / "store"), "disk.capacity_bytes": 8 * page_bytes}
    first = make_daemon(tmp_path, **store)
    a = engines()
    sa = session(first, a)
    prefix = np.arange(0, PS, dtype="<i4")  # one page, then three branches of two
    branches = [np.concatenate((prefix, np.arange(1000 * b, 1000 * b + 2 * PS, dtype="<i4"))) for b in (1, 2, 3)]
    for i, tokens in enumerate(branches):
        pages = ok(first.handle(p.Alloc(id=10 + i, session=sa, num_pages=3 if i == 0 else 2))).pages
        hit = ok(first.handle(p.Match(id=20 + i, session=sa, tokens=tokens.tobytes())))
        ok(first.handle(p.Insert(id=30 + i, session=sa, tokens=tokens.tobytes(), pages=hit.device_pages + pages)))
    first.drain()
    first.close()

    monkeypatch.setattr(specs, "_REBUILD_STEP", 1)  # one record a step,
    monkeypatch.setattr(specs, "_REBUILD_SLICE_S", 0.0)  # one step a slice (the test clock stands still)
    daemon = make_daemon(tmp_path, Clock(), **store)
    other_spec = dataclasses.replace(SPEC, model="other-model")
    sb = session(daemon, engines(spec=other_spec), spec=other_spec)
    sa2 = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION))).session
    pending = register(daemon, sa2, SPEC, [engines().offered(daemon)], request_id=2)
    (rebuilding,) = [m for m in daemon.specs.all_managers() if m.spec.fingerprint == SPEC.fingerprint]
    while not rebuilding.tree.sizes(Tier.DISK).cached:  # up to the prefix's node, the branches still to come
        daemon.poll()
    assert not pending.done()
    # Another model's two pages take the store past its capacity: it evicts the
    # least recently used record, the prefix's page.
    tokens_b = np.arange(50_000, 50_000 + 2 * PS, dtype="<i4").tobytes()
    pages_b = ok(daemon.handle(p.Alloc(id=3, session=sb, num_pages=2))).pages
    ok(daemon.handle(p.Insert(id=4, session=sb, tokens=tokens_b, pages=pages_b)))
    daemon.managers[other_spec.fingerprint].flush()
    assert daemon.storage.stats().evicted_records >= 1
    assert isinstance(answered(daemon, pending), p.RegisterReply)
    for tokens in branches:  # nothing below the evicted prefix is left to hit ...
        hit = ok(daemon.handle(p.Match(id=5, session=sa2, tokens=tokens.tobytes())))
        assert hit.device_pages == b"" and hit.host_pages + hit.disk_pages == 0
    daemon.managers[SPEC.fingerprint].flush()
    # ... nor to take room in the store.
    assert not [key for key, meta in daemon.storage.iter_metadata() if meta.fingerprint == SPEC.fingerprint]
    ok(answered(daemon, daemon.handle(p.Check(id=6))))
    daemon.close()


def test_a_rebuild_at_once_that_fails_lets_go_of_the_new_tiers(tmp_path, engines, monkeypatch):
    """The first registration of a spec, nobody else to serve: its disk tier is rebuilt
    at once, and the store fails to read (EIO). The registration is refused, and the
    tier manager made for it is closed — its host pool released, as when a rebuild in
    slices fails — rather than left for the collector (a pinned pool stays registered
    with CUDA for good) once per retried registration; the retry, the store readable
    again, serves."""
    from hicache.errors import StorageUnavailable
    from hicache.pools import HostPool

    daemon = make_daemon(tmp_path, **{"disk.enabled": True, "disk.path": str(tmp_path / "store")})
    made = []
    real_init = HostPool.__init__

    def host_pool(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def unreadable(*args, **kwargs):
        raise StorageUnavailable("the store's metadata cannot be read: EIO")

    monkeypatch.setattr(HostPool, "__init__", host_pool)
    read = daemon.storage.iter_metadata
    monkeypatch.setattr(daemon.storage, "iter_metadata", unreadable)
    engine = engines()
    for attempt in range(2):
        sid = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION))).session
        error(register(daemon, sid, SPEC, [engine.offered(daemon)]), ErrorCode.STORAGE_UNAVAILABLE)
        assert len(made) == attempt + 1
        assert all(pool.buffer is None for pool in made), "a refused registration's host pool is still mapped"
        ok(daemon.handle(p.Bye(id=3, session=sid)))
    assert not daemon.managers and not daemon.specs.all_managers()
    monkeypatch.setattr(daemon.storage, "iter_metadata", read)
    sid = session(daemon, engine)
    ok(daemon.handle(p.Alloc(id=4, session=sid, num_pages=2)))
    assert made[-1].buffer is not None
    ok(answered(daemon, daemon.handle(p.Check(id=5))))
    daemon.close()


def test_a_registration_waiting_for_a_rebuild_is_refused_at_shutdown(tmp_path, engines):
    """A daemon closed mid-rebuild answers the waiting registration with an error (and
    closes the pool it had attached) rather than leaving it unanswered."""
    import dataclasses

    store = {"disk.enabled": True, "disk.path": str(tmp_path / "store")}
    daemon = make_daemon(tmp_path, **store)
    other_spec = dataclasses.replace(SPEC, model="other-model")
    session(daemon, engines(spec=other_spec), spec=other_spec)
    sid = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION))).session
    pending = register(daemon, sid, SPEC, [engines().offered(daemon)])
    assert isinstance(pending, Future) and not pending.done()
    daemon.close()
    assert isinstance(pending.result(), p.Error) and pending.result().code == ErrorCode.DRAINING
    assert gc.isenabled()


def test_check_names_the_broken_invariant(tmp_path, engines, monkeypatch):
    """``check`` answers an INTERNAL error naming what is broken — the daemon's own
    bookkeeping, or an assertion of the tier manager's checks — rather than relying on
    ``assert`` (gone under ``python -O``)."""
    daemon = make_daemon(tmp_path)
    session(daemon, engines())
    ok(answered(daemon, daemon.handle(p.Check(id=1))))
    daemon.sessions.unregistered["uid:4242"] += 1  # a count with no session behind it
    reply = error(daemon.handle(p.Check(id=2)), ErrorCode.INTERNAL)
    assert "unregistered sessions per peer" in reply.message, reply.message
    del daemon.sessions.unregistered["uid:4242"]
    ok(answered(daemon, daemon.handle(p.Check(id=3))))

    def broken(chains=None):
        assert 1 + 1 == 3, "made up"

    (manager,) = daemon.managers.values()
    monkeypatch.setattr(manager, "check_invariants", broken)
    reply = error(daemon.handle(p.Check(id=4)), ErrorCode.INTERNAL)
    assert f"tier manager of spec {SPEC.fingerprint_hex}" in reply.message and "1 + 1 == 3" in reply.message
    assert "made up" in reply.message
    daemon.close()


def test_check_walks_the_store_off_the_owner_thread_and_requests_are_answered_meanwhile(tmp_path, engines,
                                                                                         monkeypatch):
    """The store's check reads every record (seconds for a large store): it runs on a
    thread of its own, one at a time; the loop answers requests meanwhile, and the
    ``check`` requests that come during a walk share the next one, which begins after
    it — each answered by a walk that began after it was asked."""
    daemon = make_daemon(tmp_path, **{"disk.enabled": True, "disk.path": str(tmp_path / "store")})
    sid = session(daemon, engines())
    real_check = daemon.storage.check_invariants
    walks, release = [], [threading.Event(), threading.Event()]

    def walk():
        walks.append(threading.current_thread())
        if not release[len(walks) - 1].wait(60):
            raise AssertionError("never released")  # (the loop did not get on without it)
        real_check()

    monkeypatch.setattr(daemon.storage, "check_invariants", walk)
    first = daemon.handle(p.Check(id=1))
    assert isinstance(first, Future) and not first.done()
    ok(daemon.handle(p.Health(id=2)))
    ok(daemon.handle(p.Match(id=3, session=sid, tokens=list(range(2 * PS)))))
    later = [daemon.handle(p.Check(id=4)), daemon.handle(p.Check(id=5))]
    assert all(isinstance(f, Future) and not f.done() for f in later)
    assert len(walks) <= 1
    release[0].set()
    assert isinstance(answered(daemon, first), p.Ok) and answered(daemon, first).id == 1
    assert not any(f.done() for f in later)  # (their walk began after the first ended)
    release[1].set()
    assert [answered(daemon, f).id for f in later] == [4, 5]
    assert len(walks) == 2 and threading.main_thread() not in walks
    daemon.close()


def test_check_checks_a_copy_of_the_tree_off_the_owner_thread_and_names_a_broken_node(tmp_path, engines,
                                                                                       monkeypatch):
    """A tree's check (~10 µs a node, most of it hashing every node's tokens again to see
    its page keys chain from its parent's) runs on the check's thread, on a copy the
    loop made (~3 µs a node). A node whose page keys do not chain is named in the
    INTERNAL reply."""
    from hicache import tree as tree_module

    daemon = make_daemon(tmp_path)
    sid = session(daemon, engines())
    pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=3))).pages
    tokens = np.arange(3 * PS, dtype="<i4").tobytes()
    ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages)))
    hashed_on = []
    real_chain = tree_module.chain_page_keys

    def chain(*args):
        hashed_on.append(threading.current_thread())
        return real_chain(*args)

    monkeypatch.setattr(tree_module, "chain_page_keys", chain)
    ok(answered(daemon, daemon.handle(p.Check(id=3))))
    assert hashed_on and threading.main_thread() not in hashed_on
    (manager,) = daemon.managers.values()
    (node,) = [n for n in manager.tree._nodes.values() if n.parent is not None]
    node_id = node.node_id
    node.page_keys = node.page_keys[:-1] + bytes([node.page_keys[-1] ^ 1])  # (what a bug in a split would do)
    reply = error(answered(daemon, daemon.handle(p.Check(id=4))), ErrorCode.INTERNAL)
    assert f"tier manager of spec {SPEC.fingerprint_hex}" in reply.message, reply.message
    assert f"page keys of node {node_id} do not chain" in reply.message, reply.message
    daemon.close()


def test_a_check_that_shares_the_next_walk_has_its_copy_of_the_tree_checked(tmp_path, engines, monkeypatch):
    """A check asked while another walks shares the next walk: the copy of the tree it
    made — a node broken since the first — is what that walk checks."""
    daemon = make_daemon(tmp_path, **{"disk.enabled": True, "disk.path": str(tmp_path / "store")})
    sid = session(daemon, engines())
    pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=3))).pages
    ok(daemon.handle(p.Insert(id=2, session=sid, tokens=np.arange(3 * PS, dtype="<i4").tobytes(), pages=pages)))
    release = threading.Event()
    real_check = daemon.storage.check_invariants

    def walk():
        if not release.wait(60):
            raise AssertionError("never released")
        real_check()

    monkeypatch.setattr(daemon.storage, "check_invariants", walk)
    first = daemon.handle(p.Check(id=3))
    (manager,) = daemon.managers.values()
    (node,) = [n for n in manager.tree._nodes.values() if n.parent is not None]
    node.page_keys = node.page_keys[:-1] + bytes([node.page_keys[-1] ^ 1])
    second = daemon.handle(p.Check(id=4))
    assert isinstance(second, Future) and not second.done()
    release.set()
    assert isinstance(answered(daemon, first), p.Ok)
    reply = error(answered(daemon, second), ErrorCode.INTERNAL)
    assert reply.id == 4 and f"page keys of node {node.node_id} do not chain" in reply.message, reply.message
    daemon.close()


def _until(daemon, done, turns: int = 10_000) -> None:
    """Drive the daemon's loop until ``done()`` (a compaction's walk and rewrite)."""
    for _ in range(turns):
        if done():
            return
        daemon.poll(0.01)
    raise AssertionError("the daemon's loop never got there")


def test_a_tenant_storing_under_ever_new_extra_keys_keeps_the_tenant_log_bounded(tmp_path, engines):
    """A client stores under a new extra key (a cache salt per user) again and again,
    the pages of most of them then dropped: the tenant log is compacted each time the
    tenant reaches its bound (4 here) and enough was noted since, to the namespaces that
    hold pages and those named in the last minute; the file never grows past the bound
    by more than what waits meanwhile, and after the last compaction it names exactly
    the namespaces that hold pages. The invariants hold throughout."""
    from hicache.daemon.tenant_log import GRACE_S

    clock = Clock()
    daemon = make_daemon(tmp_path, clock, **{"disk.enabled": True, "disk.path": str(tmp_path / "store"),
                                             "disk.tenant_namespaces": 4})
    sid = session(daemon, engines())
    (manager,) = daemon.managers.values()
    log = tmp_path / "store" / "tenants"
    kept = []
    sizes = []
    for i in range(24):
        key = f"user-{i}"
        pages = ok(daemon.handle(p.Alloc(id=1, session=sid, num_pages=1))).pages
        tokens = (np.arange(PS, dtype="<i4") + 1000 * i).tobytes()
        ok(daemon.handle(p.Insert(id=2, session=sid, tokens=tokens, pages=pages, extra_key=key)))
        manager.flush()  # (its copies to host and disk done: nothing holds the pages)
        if i % 8:  # (seven users of eight leave: their pages go)
            purged = answered(daemon, daemon.handle(p.Purge(id=3, tenant="default", extra_key=key)))
            assert purged.left_pages == 0 and purged.disk_pages == 1, purged
        else:
            kept.append(key)
        clock.now += GRACE_S / 2
        ok(daemon.handle(p.Heartbeat(id=5, session=sid)))  # (the lease: renewed at the new time)
        _until(daemon, lambda: not (daemon.specs.store_walks.busy or daemon.tenant_log._compacting))
        sizes.append(len(log.read_text().splitlines()))
        ok(answered(daemon, daemon.handle(p.Check(id=4))))
    assert daemon.tenant_log.compactions >= 3, daemon.tenant_log.compactions
    assert max(sizes) <= 4 + 1, sizes  # (the bound, and the line appended after a compaction freed room)
    clock.now += 2 * GRACE_S
    ok(daemon.handle(p.Heartbeat(id=5, session=sid)))
    daemon.tenant_log.note(SPEC.fingerprint, namespace_id(SPEC.fingerprint, "late", ""), "default", "late")
    _until(daemon, lambda: not (daemon.tenant_log.wants_compaction or daemon.specs.store_walks.busy
                                or daemon.tenant_log._compacting))
    logged = sorted(bytes.fromhex(line.split()[3]).decode() for line in log.read_text().splitlines())
    assert kept == ["user-0", "user-8", "user-16"] and logged == sorted([*kept, "late"]), logged
    daemon.close()


def test_check_names_a_broken_invariant_of_the_store(tmp_path, engines, monkeypatch):
    daemon = make_daemon(tmp_path, **{"disk.enabled": True, "disk.path": str(tmp_path / "store")})
    session(daemon, engines())

    def broken():
        assert 2 + 2 == 5, "made up"

    monkeypatch.setattr(daemon.storage, "check_invariants", broken)
    reply = error(answered(daemon, daemon.handle(p.Check(id=1))), ErrorCode.INTERNAL)
    assert reply.id == 1 and "storage" in reply.message and "2 + 2 == 5" in reply.message, reply.message
    monkeypatch.undo()
    ok(answered(daemon, daemon.handle(p.Check(id=2))))
    daemon.close()


def test_a_register_refused_at_decoding_drops_its_descriptors_too(tmp_path, engines):
    """A spec or pool handle of the wrong shape is refused by the decoder, before the
    daemon sees the message: the descriptors it named are dropped all the same."""
    daemon = make_daemon(tmp_path)
    hello = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION)))
    pools = [engines().offered(daemon)]
    error(wired(daemon, p.Register(id=2, session=hello.session, spec=SPEC.to_dict() | {"colour": "red"},
                                   fingerprint=SPEC.fingerprint, key_check=key_self_test(SPEC.fingerprint, PS),
                                   pools=pools)), ErrorCode.INVALID_ARGUMENT)
    assert daemon.fds.take(pools[0]["token"]) is None
    daemon.close()


class _TickingClock(Clock):
    """Every look is ``step_s`` later: the stop's deadline is past by the time it
    reaches the remote store."""

    def __init__(self, step_s):
        super().__init__()
        self.step_s = step_s

    def __call__(self):
        self.now += self.step_s
        return self.now


def test_close_gives_up_on_a_remote_store_whose_close_hangs_at_the_stops_deadline(tmp_path, caplog):
    """The stop has one deadline for the drain and every close: a Mooncake ``close``
    that hangs (its master gone) is given up at it, and the stop says so."""
    from hicache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig

    store = HungMooncakeStore()
    remote = MooncakeBackend(MooncakeConfig(master="127.0.0.1:1"), store=store)
    clock = _TickingClock(step_s=60.0)
    daemon = Daemon(DaemonConfig.load(overrides={"disk.enabled": False, "server.socket": str(tmp_path / "s.sock")}),
                    clock=clock, remote=remote, fds=FdExchange(tmp_path / "fds"))
    try:
        assert daemon.close(clock.now) is False
        assert store.closing.wait(60)  # (still hung: the stop went on without it)
        assert "remote store" in caplog.text
    finally:
        store.release.set()
