"""Checkpoints through the daemon's wire protocol: an insert offers them (its answer comes
once they are copied), a load with a state slot brings one back; bad ones are
INVALID_ARGUMENT (or undecodable) before anything changes; the metrics count them. A
spec with a sliding window registers over the wire."""

import numpy as np
import pytest

from hicache import protocol as p
from hicache.config import DaemonConfig
from hicache.daemon.service import Daemon
from hicache.errors import ErrorCode
from hicache.fdpass import FdExchange
from hicache.keys import key_self_test
from hicache.tree import Tier
from test_checkpoints import SPEC, STATE_SLOTS, StateEngine
from tiers_util import SPEC as PLAIN
from tiers_util import Engine, offered, wired

PS = SPEC.page_size


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0


@pytest.fixture
def daemon(tmp_path):
    config = DaemonConfig.load(overrides={"server.socket": str(tmp_path / "s"), "host.ratio": 1.0,
                                          "disk.path": str(tmp_path / "db"), "disk.capacity_bytes": 1 << 22})
    d = Daemon(config, fds=FdExchange(tmp_path / "fds"))
    yield d
    d.close()


def register(daemon, spec, exported):
    sid = daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION)).session
    reply = wired(daemon, p.Register(id=2, session=sid, spec=spec.to_dict(), fingerprint=spec.fingerprint,
                                     key_check=key_self_test(spec.fingerprint, spec.page_size),
                                     pools=[offered(daemon, exported)]))
    assert isinstance(reply, p.RegisterReply), reply
    return sid


def settle(daemon, reply):
    if isinstance(reply, p.Reply):
        return reply
    manager = next(iter(daemon.managers.values()))
    manager.flush()
    return reply.result()


def test_checkpoints_over_the_wire(daemon):
    engine = StateEngine()
    try:
        sid = register(daemon, SPEC, engine.exported)
        tokens = np.arange(100, 100 + 4 * PS, dtype="<i4").tobytes()
        pages = daemon.handle(p.Alloc(id=3, session=sid, num_pages=4)).pages
        engine.set_state(1, 71)
        engine.set_state(2, 72)
        for bad in ([(0, 1)], [(5, 1)], [(2, 1), (1, 2)], [(2, 0)], [(2, STATE_SLOTS + 1)], [(2, -1)]):
            reply = wired(daemon, p.Insert(id=4, session=sid, tokens=tokens, pages=pages, checkpoints=bad))
            assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, (bad, reply)
        # Refused before anything changed: the pages are still the session's own.
        manager = next(iter(daemon.managers.values()))
        assert manager.num_private(daemon.sessions[sid].pool_id) == 4
        for bad in ([[1, 2, 3]], [["a", 1]], [[1.5, 1]], [1], [[[1], 1]], [None]):
            reply = wired(daemon, p.Insert(id=5, session=sid, tokens=tokens, pages=pages, checkpoints=bad))
            assert isinstance(reply, p.Error), (bad, reply)
        inserted = settle(daemon, wired(daemon, p.Insert(id=6, session=sid, tokens=tokens, pages=pages,
                                                         checkpoints=[(2, 1), (4, 2)])))
        assert isinstance(inserted, p.InsertReply) and inserted.checkpoints == 2
        match = daemon.handle(p.Match(id=7, session=sid, tokens=tokens[: 3 * PS * 4]))
        assert len(match.device_pages) // 4 == 2  # the checkpoint after 2 pages ends the hit
        daemon.handle(p.Lock(id=8, session=sid, node=match.node))
        for bad in (STATE_SLOTS + 1, -1):
            reply = wired(daemon, p.Load(id=9, session=sid, node=match.node, state_slot=bad))
            assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT
        loaded = settle(daemon, wired(daemon, p.Load(id=10, session=sid, node=match.node, state_slot=3)))
        assert loaded.state and engine.state_label(3, [71, 72]) == 71
        plain = settle(daemon, wired(daemon, p.Load(id=11, session=sid, node=match.node)))
        assert not plain.state
        daemon.handle(p.Unlock(id=12, session=sid, node=match.node))
        manager.flush()
        daemon.refresh_snapshot()
        metrics = daemon.metrics
        assert value(metrics, "hicache_checkpoints", tier="host") == 2
        assert value(metrics, "hicache_checkpoints", tier="disk") == 2
        assert value(metrics, "hicache_checkpoint_events_total", event="offered") == 2
        assert value(metrics, "hicache_checkpoint_events_total", event="restored") == 1
        assert value(metrics, "hicache_checkpoint_host_slots") == manager.checkpoints.num_slots
        manager.check_invariants()
    finally:
        engine.close()


def test_a_spec_without_state_layers_refuses_checkpoints_and_state_slots(daemon):
    engine = Engine(num_pages=8, spec=PLAIN)
    try:
        sid = register(daemon, PLAIN, engine.exported)
        tokens = np.arange(0, 2 * PLAIN.page_size, dtype="<i4").tobytes()
        pages = daemon.handle(p.Alloc(id=3, session=sid, num_pages=2)).pages
        reply = wired(daemon, p.Insert(id=4, session=sid, tokens=tokens, pages=pages, checkpoints=[(1, 1)]))
        assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT
        inserted = wired(daemon, p.Insert(id=5, session=sid, tokens=tokens, pages=pages))
        daemon.handle(p.Lock(id=6, session=sid, node=inserted.node))
        reply = wired(daemon, p.Load(id=7, session=sid, node=inserted.node, state_slot=1))
        assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT
        daemon.refresh_snapshot()
        assert daemon.metrics.registry.get_sample_value("hicache_checkpoint_host_slots") is None
    finally:
        engine.close()


def test_a_sliding_window_spec_registers_over_the_wire(daemon):
    from test_windows import SPEC as SWA
    engine = Engine(num_pages=8, spec=SWA)
    try:
        register(daemon, SWA, engine.exported)
        (manager,) = daemon.managers.values()
        assert manager.spec.fingerprint == SWA.fingerprint and manager.windows is not None
    finally:
        engine.close()


def test_ends_over_the_wire(daemon):
    from test_windows import SPEC as SWA
    engine = Engine(num_pages=16, spec=SWA)
    try:
        sid = register(daemon, SWA, engine.exported)
        tokens = np.arange(0, 6 * SWA.page_size, dtype="<i4").tobytes()
        pages = daemon.handle(p.Alloc(id=3, session=sid, num_pages=6)).pages
        for bad in ([0], [7], [3, 2], [2, 2]):
            reply = wired(daemon, p.Insert(id=4, session=sid, tokens=tokens, pages=pages, ends=bad))
            assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, bad
        for bad in (["2"], [[2]], [2.5], 3):
            assert isinstance(wired(daemon, p.Insert(id=5, session=sid, tokens=tokens, pages=pages, ends=bad)),
                              p.Error)
        assert isinstance(wired(daemon, p.Insert(id=6, session=sid, tokens=tokens, pages=pages, ends=[2, 5])),
                          p.InsertReply)
        (manager,) = daemon.managers.values()
        node = manager.match(next(iter(manager.tree.namespaces())), tokens, daemon.sessions[sid].pool_id).match.node
        assert [n.num_pages for n in manager.tree.path(node)] == [2, 3, 1]
        manager.flush()
        manager.check_invariants()
    finally:
        engine.close()


def test_hostile_checkpoints_ends_and_state_slots_get_errors_and_change_nothing(daemon):
    engine = StateEngine()
    try:
        sid = register(daemon, SPEC, engine.exported)
        tokens = np.arange(7, 7 + 2 * PS, dtype="<i4").tobytes()
        pages = daemon.handle(p.Alloc(id=3, session=sid, num_pages=2)).pages
        base = {"op": "insert", "id": 9, "session": sid, "tokens": tokens, "pages": pages}
        hostile = [
            {"checkpoints": [[2**62, 1]]}, {"checkpoints": [[1, 2**63 - 1]]}, {"checkpoints": [[-(2**63), 1]]},
            {"checkpoints": [[1, 1]] * (p.MAX_CHECKPOINTS + 1)}, {"ends": list(range(1, p.MAX_CHECKPOINTS + 2))},
            {"checkpoints": [[[[[[1]]]]], 1]}, {"checkpoints": {"1": 1}}, {"ends": [2**64 - 1]}, {"ends": [None]},
            {"ends": "12"}, {"checkpoints": [b"\x00" * 8]}, {"ends": [1, 1]}, {"ends": [-1]},
        ]
        for extra in hostile:
            assert isinstance(_raw(daemon, {**base, **extra}), p.Error), extra
        manager = next(iter(daemon.managers.values()))
        assert manager.num_private(daemon.sessions[sid].pool_id) == 2 and manager.num_nodes == 0
        inserted = settle(daemon, wired(daemon, p.Insert(id=10, session=sid, tokens=tokens, pages=pages,
                                                         checkpoints=[(2, 1)])))
        daemon.handle(p.Lock(id=11, session=sid, node=inserted.node))
        for slot in (2**62, -(2**62), STATE_SLOTS + 1):
            assert isinstance(_raw(daemon, {"op": "load", "id": 12, "session": sid, "node": inserted.node,
                                            "state_slot": slot}), p.Error)
        for slot in (2**64 - 1, "1", [1], None, 1.0):
            assert isinstance(_raw(daemon, {"op": "load", "id": 13, "session": sid, "node": inserted.node,
                                            "state_slot": slot}), p.Error)
        assert settle(daemon, wired(daemon, p.Load(id=14, session=sid, node=inserted.node, state_slot=2))).state
        manager.check_invariants()
    finally:
        engine.close()


def _raw(daemon, message: dict):
    """A message as raw msgpack, decoded as the server does (an undecodable one is
    answered with the decoder's error)."""
    import msgspec

    payload = msgspec.msgpack.encode(message)
    try:
        decoded = p.decode_request(payload)
    except p.ProtocolError as exc:
        return daemon.undecodable(payload, exc)
    return daemon.handle(decoded)


def test_checkpoint_events_are_kept_when_their_spec_is_let_go(daemon):
    """A spec let go (here: unused, its tree emptied by eviction, when another spec
    registers) takes its checkpoint counts with it; the counter must not go back."""
    engine, other = StateEngine(), Engine(num_pages=8, spec=PLAIN)
    try:
        sid = register(daemon, SPEC, engine.exported)
        tokens = np.arange(100, 100 + 4 * PS, dtype="<i4").tobytes()
        pages = daemon.handle(p.Alloc(id=3, session=sid, num_pages=4)).pages
        engine.set_state(1, 71)
        inserted = settle(daemon, wired(daemon, p.Insert(id=4, session=sid, tokens=tokens, pages=pages,
                                                         checkpoints=[(2, 1)])))
        assert inserted.checkpoints == 1
        daemon.refresh_snapshot()
        assert value(daemon.metrics, "hicache_checkpoint_events_total", event="offered") == 1
        daemon.handle(p.Bye(id=5, session=sid))
        (manager,) = daemon.managers.values()
        manager.flush()
        daemon.poll()
        for tier in (Tier.HOST, Tier.DISK):
            manager.evict(tier, 1 << 10)
        assert manager.num_nodes == 0
        register(daemon, PLAIN, other.exported)
        assert SPEC.fingerprint not in daemon.managers  # (let go: it cached nothing)
        daemon.refresh_snapshot()
        assert value(daemon.metrics, "hicache_checkpoint_events_total", event="offered") == 1
        # (stats' losses: the count the metric has, the spec let go or not)
        assert daemon.stats().losses.checkpoints_lost == value(daemon.metrics, "hicache_checkpoint_events_total",
                                                                event="lost") == 0
    finally:
        other.close()
        engine.close()
