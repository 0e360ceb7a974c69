"""The daemon's file descriptors (:mod:`hicache.fdpass`, :mod:`hicache.daemon.registration`,
:mod:`hicache.daemon.connections`): what a session had published and never fetched goes
with the session; unfetched descriptors are capped per user; out of descriptors, a
registration is refused (``RESOURCE_EXHAUSTED``, undone) and the descriptor socket
rests instead of spinning; a flood of connections is shed before libzmq runs out of
descriptors — and all of it comes back once descriptors do."""

from __future__ import annotations

import os
import resource
import socket
import time

import pytest

from daemon_util import ClientEngine, RawPeer, clean_daemon
from hicache import fdpass
from hicache import protocol as p
from hicache.errors import ErrorCode, HicacheError, Unavailable
from tiers_util import SPEC, Engine

PS = SPEC.page_size
SEQ = list(range(500, 500 + 4 * PS))


def _num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _lowest_free_fd(pid: int) -> int:
    """The descriptor number the process's next open would get."""
    used = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    return next(fd for fd in range(len(used) + 1) if fd not in used)


@pytest.fixture
def daemon(tmp_path):
    # Long leases: the raw sessions here send no heartbeats.
    with clean_daemon(tmp_path, server={"register_within_s": 60.0, "lease_s": 60.0}) as proc:
        yield proc


@pytest.fixture
def raw(daemon):
    peer = RawPeer(daemon.endpoint)
    yield peer
    peer.close()


def _register(raw: RawPeer, session: int, engine: Engine) -> p.Reply:
    handle = engine.exported.handle
    return raw.register(session, [handle.to_dict() | {"token": raw.offer(handle.fd)}])


def test_a_ring_never_fetched_goes_with_its_session(daemon, raw):
    """Three hundred hello / register / bye, never fetching the counter ring: the
    daemon's descriptors stay where they were (each ring used to wait 60 s)."""
    engine = Engine(8)
    try:
        session = raw.hello()
        assert isinstance(_register(raw, session, engine), p.RegisterReply)
        raw.call(p.Bye(id=0, session=session))
        before = _num_fds(daemon.proc.pid)
        for _ in range(300):
            session = raw.hello()
            assert isinstance(_register(raw, session, engine), p.RegisterReply)
            assert isinstance(raw.call(p.Bye(id=0, session=session)), p.Ok)
        assert _num_fds(daemon.proc.pid) - before < 30
        assert isinstance(raw.call(p.Check(id=0)), p.Ok)
    finally:
        engine.close()


def test_unfetched_rings_are_capped_per_user(daemon, raw):
    """A user's 65th registration whose ring waits unfetched is RESOURCE_EXHAUSTED,
    undone (the session unregistered, its pool not kept: the same memory registers
    once a session ends and its ring is withdrawn); fetching one makes room as well."""
    engines = [Engine(8) for _ in range(fdpass.MAX_PUBLISHED_PER_UID + 1)]
    try:
        registered = []
        for engine in engines[:-1]:
            session = raw.hello()
            reply = _register(raw, session, engine)
            assert isinstance(reply, p.RegisterReply), reply
            registered.append((session, reply))
        last = raw.hello()
        refused = _register(raw, last, engines[-1])
        assert isinstance(refused, p.Error) and refused.code == ErrorCode.RESOURCE_EXHAUSTED, refused
        assert isinstance(raw.call(p.Check(id=0)), p.Ok)
        # One engine fetches its ring: room for one more.
        first, reply = registered[0]
        os.close(fdpass.fetch(raw.fd_socket, reply.counters.token))
        assert isinstance(_register(raw, last, engines[-1]), p.RegisterReply)
        # Full again; a session that ends takes its unfetched ring with it.
        again = raw.hello()
        spare = Engine(8)
        try:
            assert _register(raw, again, spare).code == ErrorCode.RESOURCE_EXHAUSTED
            raw.call(p.Bye(id=0, session=registered[1][0]))
            assert isinstance(_register(raw, again, spare), p.RegisterReply)
        finally:
            raw.call(p.Bye(id=0, session=again))
            spare.close()
        assert isinstance(raw.call(p.Check(id=0)), p.Ok)
    finally:
        for engine in engines:
            engine.close()


def test_out_of_descriptors_refuses_and_rests_then_recovers(daemon, raw):
    """At its descriptor limit the daemon answers a registration RESOURCE_EXHAUSTED
    (not INTERNAL, and nothing of it kept), the descriptor socket stops accepting for a
    moment rather than spin (a warning or two, not one per turn), an engine already
    registered is served throughout, and once the limit is raised everything works."""
    pid = daemon.proc.pid
    victim = ClientEngine(daemon.endpoint)
    engine = Engine(8)
    limit = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        victim.prefill(SEQ)
        session = raw.hello()
        handle = engine.exported.handle
        token = raw.offer(handle.fd)
        # No descriptor to spare. (No new ZeroMQ connection until the limit is back:
        # libzmq aborts when it cannot accept one.)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(pid), limit[1]))
        held = _num_fds(pid)
        refused = raw.register(session, [handle.to_dict() | {"token": token}])
        assert isinstance(refused, p.Error) and refused.code == ErrorCode.RESOURCE_EXHAUSTED, refused
        assert _num_fds(pid) <= held  # the offered pool was let go, nothing half-registered kept
        # (which freed its descriptor: take that one away too, or an offer could use it)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(pid), limit[1]))
        for _ in range(3):
            with pytest.raises((Unavailable, HicacheError)):
                fdpass.offer(raw.fd_socket, handle.fd, timeout_s=1.0)
        again = victim.client.match(SEQ)
        assert again.num_device_pages == 4
        victim.engine.check(victim.ns(), SEQ, again.device_pages)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limit)
        deadline = time.monotonic() + 30  # a bound on waiting for the listener to resume
        while True:
            try:
                token = raw.offer(handle.fd)
                break
            except (Unavailable, HicacheError):
                assert time.monotonic() < deadline, "the descriptor socket never accepted again"
        reply = raw.register(session, [handle.to_dict() | {"token": token}])
        assert isinstance(reply, p.RegisterReply), reply
        os.close(fdpass.fetch(raw.fd_socket, reply.counters.token))
        fresh = ClientEngine(daemon.endpoint)
        fresh.prefill(list(range(900, 900 + 2 * PS)))
        fresh.close()
        victim.client.check()
        assert isinstance(raw.call(p.Check(id=0)), p.Ok)
        warnings = [line for line in daemon.log.read_text().splitlines() if "out of descriptors" in line]
        assert 1 <= len(warnings) <= 3, warnings
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limit)
        victim.close()
        engine.close()


def test_a_flood_of_connections_is_shed_and_the_daemon_serves_on(daemon):
    """More connections than the daemon has descriptors for (raw ones that never speak,
    as a hostile local user can open): libzmq aborted the process when an accept failed
    for want of a descriptor. Near the limit the daemon now drops each new connection;
    the engine connected before is served throughout, and once the flood is gone new
    engines connect again."""
    pid = daemon.proc.pid
    flooding = 1500  # (the daemon is given 1,024 descriptors more than it has open)
    mine = resource.getrlimit(resource.RLIMIT_NOFILE)
    if mine[0] < flooding + 256:
        if mine[1] != resource.RLIM_INFINITY and mine[1] < flooding + 256:
            pytest.skip(f"this process may open {mine[1]} descriptors, the flood needs {flooding + 256}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (flooding + 256, mine[1]))
    victim = ClientEngine(daemon.endpoint)
    limit = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    path = daemon.endpoint[len("ipc://"):]
    flood: list[socket.socket] = []
    try:
        victim.prefill(SEQ)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_num_fds(pid) + 1024, limit[1]))
        for _ in range(flooding):
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(path)
            flood.append(conn)
        assert daemon.proc.poll() is None, daemon.log.read_text()[-2000:]
        again = victim.client.match(SEQ)
        assert again.num_device_pages == 4
        victim.engine.check(victim.ns(), SEQ, again.device_pages)
    finally:
        for conn in flood:
            conn.close()
        if daemon.proc.poll() is None:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limit)
    fresh = ClientEngine(daemon.endpoint)
    try:
        fresh.prefill(list(range(900, 900 + 2 * PS)))
        fresh.client.check()
    finally:
        fresh.close()
        victim.close()
        if mine[0] < flooding + 256:
            resource.setrlimit(resource.RLIMIT_NOFILE, mine)
    assert "shedding new connections" in daemon.log.read_text()
