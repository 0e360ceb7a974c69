"""KV events from a daemon: what a router builds from the stream is the tree's residency.

A daemon (in this process, so that its tree can be read) with the events on real ipc://
sockets, two engines registering one after the other, and a mixed workload: prefills,
hits and loads, device and host evictions, writes to disk. A subscriber decodes every
batch with structs of vLLM's and Dynamo's shapes, fills sequence gaps through the replay
socket, and keeps (medium, block hash) per stream; after every step that picture must
equal the tree's, and every ``BlockStored`` must carry the block's own tokens.
"""

from __future__ import annotations

import socket
from collections import Counter
from concurrent.futures import Future
from contextlib import contextmanager

import numpy as np
import pytest
import zmq

from hicache import protocol as p
from hicache.config import DaemonConfig
from hicache.daemon import kv_events
from hicache.daemon.service import Daemon
from hicache.daemon.sessions import PeerCreds
from hicache.fdpass import FdExchange
from hicache.keys import key_self_test, page_keys
from hicache.tree import DISK_SLOT, HOST_SLOT, Tier
from kv_event_shapes import AllBlocksCleared, BlockStored, apply, decode
from tiers_util import SPEC, Engine, offered, wired

PS = SPEC.page_size


class Subscriber:
    """A router's view of one daemon: every stream's (medium, hash) set, in order."""

    def __init__(self, context: zmq.Context, daemon: Daemon) -> None:
        self.daemon = daemon
        publisher = daemon.events.publisher
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(publisher.endpoint)
        self.replay = context.socket(zmq.DEALER)
        self.replay.connect(publisher.replay_endpoint)
        self.blocks: dict[bytes, set] = {}
        self.next_seq: dict[bytes, int] = {}
        self.tokens: dict[int, list[int]] = {}  # block hash -> the tokens a BlockStored gave it
        self.stored: dict[bytes, Counter] = {}  # topic -> BlockStored per (medium, hash) since its last clear
        self.clears: Counter = Counter()  # topic -> AllBlocksCleared seen
        self.batches = 0

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        batch = decode(payload)
        expected = self.next_seq.get(topic)
        if expected is None:  # (a stream's first seq is the daemon's to choose; its first event a clear)
            assert isinstance(batch.events[0], AllBlocksCleared), (topic, seq)
        elif seq < expected:
            return  # (already applied from a replay)
        else:
            assert seq == expected, (topic, seq)
        assert batch.data_parallel_rank == int(topic)
        apply(self.blocks.setdefault(topic, set()), batch)
        stored = self.stored.setdefault(topic, Counter())
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == PS
                for i, h in enumerate(event.block_hashes):
                    self.tokens[h] = event.token_ids[i * PS : (i + 1) * PS]
                    stored[event.medium, h] += 1
            elif isinstance(event, AllBlocksCleared):
                stored.clear()
                self.clears[topic] += 1
        self.next_seq[topic] = seq + 1
        self.batches += 1

    def ask_replay(self, topic: bytes, start: int) -> list[tuple[int, bytes]]:
        self.replay.send_multipart([topic, start.to_bytes(8, "big")])
        got = []
        while True:
            while not self.replay.poll(10):
                self.daemon.poll()  # (the daemon's loop answers replays)
            frames = self.replay.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4
            if frames[1] == b"":
                return got
            got.append((int.from_bytes(frames[2], "big"), frames[3]))

    def pump(self) -> None:
        """Everything published so far (a gap: fetched through the replay socket)."""
        self.daemon.poll()
        while self.sub.poll(50):
            topic, seq8, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq8, "big")
            if seq > self.next_seq.get(topic, 0):  # joined late, or missed some: replay them
                for s, data in self.ask_replay(topic, self.next_seq.get(topic, 0)):
                    self._apply(topic, s, data)
            self._apply(topic, seq, payload)

    def catch_up(self) -> None:
        """:meth:`pump`, and what the streams published beyond what arrived from the
        replay socket: a batch published before the subscription reached the publisher
        is lost to it, and only a later batch would show the gap."""
        self.pump()
        for stream in self.daemon.events.publisher.streams:
            for seq, payload in self.ask_replay(stream.topic, self.next_seq.get(stream.topic, 0)):
                self._apply(stream.topic, seq, payload)

    def close(self) -> None:
        self.sub.close(0)
        self.replay.close(0)


def residency(daemon: Daemon, pool_id: int, tenants: frozenset[str] | None = None) -> set:
    """(medium, block hash) of every page the pool's stream speaks of, from the tree:
    its own device pages, and the host and disk pages of ``tenants``' namespaces (None:
    every namespace's)."""
    out = set()
    for manager in daemon.managers.values():
        for node in manager.tree.nodes():
            hashes = np.frombuffer(node.page_keys, dtype=">u8")[1::2].tolist()
            shown = tenants is None or manager.tree.group_of(node.namespace) in tenants
            for slot in node.residency:
                medium = {pool_id: "GPU", HOST_SLOT: "CPU", DISK_SLOT: "STORAGE"}.get(slot)
                if medium is not None and (slot == pool_id or shown):
                    out.update((medium, h) for h in hashes)
    return out


def make_daemon(tmp_path, **overrides) -> Daemon:
    config = DaemonConfig.load(overrides={
        "server.socket": str(tmp_path / "s.sock"), "host.ratio": 1.0, "server.lease_s": 30.0,
        "disk.path": str(tmp_path / "lmdb"), "disk.capacity_bytes": 64 * SPEC.host_page_bytes,
        "events.enabled": True, **overrides})
    return Daemon(config, fds=FdExchange(tmp_path / "fds"))


@pytest.fixture
def daemon(tmp_path):
    d = make_daemon(tmp_path)
    yield d
    d.close()


def answered(daemon: Daemon, reply):
    """The reply, or the one its future ends with while the daemon's loop turns."""
    while isinstance(reply, Future) and not reply.done():
        daemon.poll()
    reply = reply.result() if isinstance(reply, Future) else reply
    assert not isinstance(reply, p.Error), reply
    return reply


def register(daemon: Daemon, engine: Engine, peer: bytes = b"") -> tuple[int, int]:
    """A session for ``engine``'s pool, on the connection ``peer``: (session id, pool id)."""
    hello = daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION, client="test"), peer)
    reply = answered(daemon, wired(daemon, p.Register(
        id=2, session=hello.session, spec=SPEC.to_dict(), fingerprint=SPEC.fingerprint,
        key_check=key_self_test(SPEC.fingerprint, PS), pools=[offered(daemon, engine.exported)]), peer))
    return hello.session, reply.pool


def _request(daemon: Daemon, sid: int, tokens: list[int], peer: bytes = b"", **tenant) -> None:
    """An engine's request: match, lock, load what is on host / disk, compute the rest,
    insert, unlock (on the connection ``peer``; ``tenant``: its tenant, if named)."""
    packed = np.asarray(tokens, np.int32).tobytes()

    def call(request):
        return answered(daemon, daemon.handle(request, peer))

    m = call(p.Match(id=3, session=sid, tokens=packed, **tenant))
    have = np.frombuffer(m.device_pages, np.int32)
    if m.node >= 0:
        call(p.Lock(id=4, session=sid, node=m.node))
        if m.host_pages or m.disk_pages:
            have = np.frombuffer(call(p.Load(id=5, session=sid, node=m.node)).device_pages, np.int32)
    need = len(tokens) // PS - len(have)
    if need:
        have = np.concatenate([have, np.frombuffer(call(p.Alloc(id=6, session=sid, num_pages=need)).pages, np.int32)])
    call(p.Insert(id=7, session=sid, tokens=packed, pages=have.astype(np.int32).tobytes(), **tenant))
    if m.node >= 0:
        call(p.Unlock(id=8, session=sid, node=m.node))


def test_a_subscriber_sees_the_trees_residency(daemon, tmp_path):
    context = zmq.Context()
    engines = [Engine(16), Engine(16)]
    router = Subscriber(context, daemon)
    rng = np.random.default_rng(7)
    prompts: list[list[int]] = []
    true_tokens: dict[int, list[int]] = {}  # block hash -> its page's tokens
    pools: dict[int, int] = {}  # session id -> pool id
    try:
        sid, pool_id = register(daemon, engines[0])
        pools[sid] = pool_id
        manager = next(iter(daemon.managers.values()))

        def prefill(sid: int, tokens: list[int]) -> None:
            _request(daemon, sid, tokens)
            namespace = manager.tree.namespaces()[0]
            for i, key in enumerate(page_keys(namespace, tokens, PS)):
                true_tokens[int.from_bytes(key[8:], "big")] = tokens[i * PS : (i + 1) * PS]

        def check() -> None:
            router.pump()
            for pool_id in pools.values():
                assert router.blocks.get(str(pool_id).encode(), set()) == residency(daemon, pool_id)
            for h, tokens in router.tokens.items():
                assert tokens == true_tokens[h], f"block {h:x}: the event's tokens are not the block's"
            media.update(medium for blocks in router.blocks.values() for medium, _ in blocks)

        media: set[str] = set()  # every medium the streams spoke of, some time

        for step in range(40):
            if step == 20:  # a second engine joins late: its stream starts with a snapshot
                sid, pool_id = register(daemon, engines[1])
                pools[sid] = pool_id
            sid = list(pools)[int(rng.integers(0, len(pools)))]
            action = int(rng.integers(0, 6))
            if action <= 2 or not prompts:  # a new conversation
                prompts.append(rng.integers(0, 1000, int(rng.integers(2, 5)) * PS).tolist())
                prefill(sid, prompts[-1])
            elif action == 3:  # a turn on an earlier one: a hit, loaded, extended
                prompts.append(prompts[int(rng.integers(0, len(prompts)))] + rng.integers(0, 1000, PS).tolist())
                prefill(sid, prompts[-1])
            elif action == 4:  # to disk, then out of host memory
                manager.flush()
                manager.evict(Tier.HOST, int(rng.integers(1, 8)))
            else:
                manager.evict(Tier.DEVICE, int(rng.integers(1, 8)), pools[sid])
            check()
        manager.flush()
        check()
        assert media == {"GPU", "CPU", "STORAGE"}, media

        # A router that joins now recovers every stream through the replay socket alone.
        late = Subscriber(context, daemon)
        for topic in router.blocks:
            for seq, payload in late.ask_replay(topic, 0):
                late._apply(topic, seq, payload)
        assert late.blocks == router.blocks
        late.close()
    finally:
        router.close()
        context.destroy(linger=0)
        for engine in engines:
            engine.close()


def _prefill(daemon: Daemon, sid: int, tokens: list[int]) -> None:
    """An engine's request on a pool that holds none of it: match, compute, insert."""
    packed = np.asarray(tokens, np.int32).tobytes()
    answered(daemon, daemon.handle(p.Match(id=3, session=sid, tokens=packed)))
    new = answered(daemon, daemon.handle(p.Alloc(id=6, session=sid, num_pages=len(tokens) // PS)))
    answered(daemon, daemon.handle(p.Insert(id=7, session=sid, tokens=packed, pages=new.pages)))


def test_a_gone_pools_stream_ends_with_all_blocks_cleared(daemon):
    """Pool 1's engine says bye while pool 2's works on. A router must stop counting on
    pool 1's rank: its stream's last batch clears every block it announced (the host
    and disk ones too: they stay pool 2's, on its stream), and nothing is published on
    it after — nor does the daemon keep a stream and its replay ring per pool it had."""
    context = zmq.Context()
    engines = [Engine(16), Engine(16)]
    router = Subscriber(context, daemon)
    try:
        sid1, pool1 = register(daemon, engines[0])
        sid2, pool2 = register(daemon, engines[1])
        topic1, topic2 = str(pool1).encode(), str(pool2).encode()
        manager = next(iter(daemon.managers.values()))
        _prefill(daemon, sid1, list(range(2 * PS)))
        manager.flush()
        router.catch_up()
        assert {medium for medium, _ in router.blocks[topic1]} == {"GPU", "CPU", "STORAGE"}
        answered(daemon, daemon.handle(p.Bye(id=9, session=sid1)))
        router.pump()
        assert router.blocks[topic1] == set()
        ended_at = router.next_seq[topic1]
        _prefill(daemon, sid2, list(range(1000, 1000 + 3 * PS)))  # (host and disk events: every stream's)
        manager.flush()
        router.pump()
        assert router.next_seq[topic1] == ended_at and router.blocks[topic1] == set()
        assert router.blocks[topic2] == residency(daemon, pool2)
        assert [stream.topic for stream in daemon.events.publisher.streams] == [topic2]
    finally:
        router.close()
        context.destroy(linger=0)
        for engine in engines:
            engine.close()


def test_a_namespace_that_holds_pages_keeps_its_extra_key_however_many_others_are_named(daemon, monkeypatch):
    """The events' extra keys are remembered for a bounded number of namespaces, so that
    a client naming ever new extra keys (a salt per request) does not grow the daemon.
    A tenant's namespace that holds pages must not lose its key to that flood, nor one
    that a session named before the flood and stores under after it: every
    ``BlockStored`` of their blocks — on the device, on host, on disk, before and after —
    carries its key, one entry per block."""
    from hicache.daemon import kv_events

    monkeypatch.setattr(kv_events, "EXTRA_KEYS", 4)
    context = zmq.Context()
    engines = [Engine(16), Engine(16)]
    router = Subscriber(context, daemon)
    try:
        sid, _ = register(daemon, engines[0])
        other, _ = register(daemon, engines[1])
        daemon.poll()  # (the streams exist from here on: the events go out as they happen)
        manager = next(iter(daemon.managers.values()))

        def prefill(tokens: list[int], extra_key: str) -> None:
            packed = np.asarray(tokens, np.int32).tobytes()
            new = answered(daemon, daemon.handle(p.Alloc(id=6, session=sid, num_pages=len(tokens) // PS)))
            answered(daemon, daemon.handle(p.Insert(id=7, session=sid, tokens=packed, pages=new.pages,
                                                    extra_key=extra_key)))

        prefill(list(range(2 * PS)), "tenant-a")
        answered(daemon, daemon.handle(p.Match(id=8, session=sid, tokens=np.arange(PS, dtype=np.int32).tobytes(),
                                               extra_key="tenant-b")))
        daemon.poll()
        for i in range(2 * kv_events.EXTRA_KEYS):  # (lookups only: nothing stored under these)
            answered(daemon, daemon.handle(p.Match(id=9, session=other, tokens=np.arange(PS, dtype=np.int32).tobytes(),
                                                   extra_key=f"salt-{i}")))
        prefill(list(range(100, 100 + 2 * PS)), "tenant-a")
        prefill(list(range(200, 200 + 2 * PS)), "tenant-b")
        manager.flush()
        router.catch_up()
        stored = [event for stream in daemon.events.publisher.streams
                  for _, payload in router.ask_replay(stream.topic, 0)
                  for event in decode(payload).events if isinstance(event, BlockStored)]
        assert {event.medium for event in stored} == {"GPU", "CPU", "STORAGE"}
        for event in stored:
            key = "tenant-b" if event.token_ids[0] >= 200 else "tenant-a"
            assert event.extra_keys == [(key,)] * len(event.block_hashes), (event.medium, event.token_ids)
    finally:
        router.close()
        context.destroy(linger=0)
        for engine in engines:
            engine.close()


# -- tenants: a pool's stream shows what its engine could hit ---------------------------

_TEAMS = {"team-x": ("a",), "team-y": ("b", "c"), "team-z": ("a",)}  # identity -> its tenants


def _auth(teams: dict[str, tuple[str, ...]], keys: dict[str, str]) -> dict:
    return {"auth.default_identity": "",
            "auth.identities": [{"name": name, "public_keys": [keys[name]], "tenants": list(tenants)}
                                for name, tenants in teams.items()]}


@contextmanager
def _tenants_daemon(tmp_path, context):
    """A daemon (in this process) with an identity per team of :data:`_TEAMS`, each
    known by its CURVE key on the connection named after it, and a router following it:
    ``(daemon, router, reload(teams))``."""
    keys = {name: zmq.curve_keypair()[0].decode() for name in _TEAMS}
    daemon = make_daemon(tmp_path, **_auth(_TEAMS, keys))
    # (the identity the current table gives the key, as the server's ZAP handler would)
    daemon.peer_creds = lambda peer: PeerCreds(None, None, None, peer.decode(), mechanism="CURVE",
                                               identity=daemon.identities.by_key[keys[peer.decode()].encode()],
                                               public_key=keys[peer.decode()].encode())

    def reload(teams: dict[str, tuple[str, ...]]) -> None:
        daemon.reload_auth(DaemonConfig.load(overrides=_auth(teams, keys)).auth)

    router = Subscriber(context, daemon)
    try:
        yield daemon, router, reload
    finally:
        router.close()
        daemon.close()


@pytest.fixture
def team_engines():
    """A ZeroMQ context for the routers and an engine per team of :data:`_TEAMS`."""
    context = zmq.Context()
    engines = {team: Engine(16) for team in _TEAMS}
    yield context, engines
    context.destroy(linger=0)
    for engine in engines.values():
        engine.close()


def _register_teams(daemon: Daemon, engines: dict[str, Engine]) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Each team's engine registered on its connection: ``(team -> (session id, pool
    id), team -> pool id)``."""
    sessions = {team: register(daemon, engine, team.encode()) for team, engine in engines.items()}
    return sessions, {team: pool_id for team, (_, pool_id) in sessions.items()}


def _settle(daemon: Daemon, router: Subscriber) -> None:
    """Every snapshot done, and the router caught up."""
    while any(events._snapshots for events in daemon.events._managers.values()):
        daemon.poll()
    router.catch_up()


def _shows_what_its_tenants_could_hit(daemon: Daemon, router: Subscriber, pools: dict[str, int],
                                      teams: dict[str, tuple[str, ...]]) -> int:
    """Each pool's stream is its device pages and its team's tenants' host and disk
    pages; returns how many host and disk blocks the streams left out (other tenants')."""
    hidden = 0
    for team, pool_id in pools.items():
        shown = residency(daemon, pool_id, frozenset(teams[team]))
        assert router.blocks.get(str(pool_id).encode(), set()) == shown, team
        hidden += len(residency(daemon, pool_id) - shown)
    return hidden


def test_each_stream_shows_the_host_and_disk_blocks_of_its_engines_tenants_only(tmp_path, team_engines):
    """Three identities' engines share one spec's host and disk tiers: team-x (tenant
    a), team-y (b and c), team-z (a). After every step of a mixed workload — prefills
    under each tenant, the same tokens under several, hits, flushes, host and device
    evictions — each pool's stream shows its own device pages and the host and disk
    pages of its identity's tenants only. (Before, every stream showed every tenant's: a
    router was told an engine held blocks it could never hit, and read their token ids
    on that engine's topic.)"""
    context, engines = team_engines
    with _tenants_daemon(tmp_path, context) as (daemon, router, _):
        sessions, pools = _register_teams(daemon, engines)
        manager = next(iter(daemon.managers.values()))
        rng = np.random.default_rng(11)
        prompts: list[list[int]] = []
        hidden = 0
        for _ in range(40):
            team = list(_TEAMS)[int(rng.integers(0, len(_TEAMS)))]
            tenant = _TEAMS[team][int(rng.integers(0, len(_TEAMS[team])))]
            sid = sessions[team][0]
            action = int(rng.integers(0, 6))
            if action <= 2 or not prompts:  # a new conversation
                prompts.append(rng.integers(0, 1000, int(rng.integers(2, 5)) * PS).tolist())
                _request(daemon, sid, prompts[-1], team.encode(), tenant=tenant)
            elif action == 3:  # a turn on an earlier one, whoever's it was
                prompts.append(prompts[int(rng.integers(0, len(prompts)))] + rng.integers(0, 1000, PS).tolist())
                _request(daemon, sid, prompts[-1], team.encode(), tenant=tenant)
            elif action == 4:  # to disk, then out of host memory
                manager.flush()
                manager.evict(Tier.HOST, int(rng.integers(1, 8)))
            else:
                manager.evict(Tier.DEVICE, int(rng.integers(1, 8)), pools[team])
            router.pump()
            hidden += _shows_what_its_tenants_could_hit(daemon, router, pools, _TEAMS)
        manager.flush()
        router.pump()
        hidden += _shows_what_its_tenants_could_hit(daemon, router, pools, _TEAMS)
        assert hidden, "no stream ever had another tenant's blocks to leave out"
        for team, pool_id in pools.items():
            assert {medium for medium, _ in router.blocks[str(pool_id).encode()]} == {"GPU", "CPU", "STORAGE"}


@pytest.mark.parametrize("turns", [0, 1, 2, 3, 5, 50])
def test_a_namespace_whose_tenant_becomes_known_is_announced_once_on_its_tenants_streams(tmp_path, monkeypatch,
                                                                                          team_engines, turns):
    """Pages restored from disk with no tenant on record (the tenant log lost) are
    nobody's: no stream shows them. Once an engine names their namespace (a match), the
    streams of its tenant announce them, each block once, and no other stream does —
    whether a stream's snapshot has yet to reach that namespace, is walking it, or is
    done (``turns``: loop turns before the match, a node of each snapshot per turn)."""
    monkeypatch.setattr(kv_events, "SNAPSHOT_SLICE", 1)
    context, engines = team_engines
    rng = np.random.default_rng(turns)
    stem = rng.integers(0, 1000, 2 * PS).tolist()
    prompts = {"a": [stem + rng.integers(0, 1000, PS).tolist(), stem + rng.integers(0, 1000, 2 * PS).tolist()],
               "b": [rng.integers(0, 1000, 3 * PS).tolist()]}
    owner = {"a": "team-x", "b": "team-y"}
    with _tenants_daemon(tmp_path, context) as (daemon, router, _):
        for tenant, tokens in prompts.items():
            sid, _ = register(daemon, engines[owner[tenant]], owner[tenant].encode())
            for t in tokens:
                _request(daemon, sid, t, owner[tenant].encode(), tenant=tenant)
        next(iter(daemon.managers.values())).flush()
        log = daemon.tenant_log.path
    log.unlink()

    with _tenants_daemon(tmp_path, context) as (daemon, router, _):
        sessions, pools = _register_teams(daemon, engines)
        manager = next(iter(daemon.managers.values()))
        assert {manager.tree.group_of(ns) for ns in manager.tree.namespaces()} == {""}
        for _ in range(turns):
            daemon.poll()
        for tenant in ("a", "b"):  # (a's while the snapshots go on, b's once they are done)
            team = owner[tenant]
            packed = np.asarray(prompts[tenant][0], np.int32).tobytes()
            answered(daemon, daemon.handle(p.Match(id=3, session=sessions[team][0], tokens=packed, tenant=tenant),
                                           team.encode()))
            if tenant == "a":
                _settle(daemon, router)
                assert not router.blocks.get(str(pools["team-y"]).encode())  # (b's: still nobody's)
        _settle(daemon, router)
        assert _shows_what_its_tenants_could_hit(daemon, router, pools, _TEAMS)
        for team, pool_id in pools.items():
            stored = router.stored[str(pool_id).encode()]
            disk = {h for medium, h in router.blocks[str(pool_id).encode()] if medium == "STORAGE"}
            assert len(disk) == sum(len(t) for t in prompts[_TEAMS[team][0]]) // PS - (
                len(stem) // PS if _TEAMS[team][0] == "a" else 0)
            assert all(stored["STORAGE", h] == 1 for h in disk), team


def test_a_reload_that_changes_an_identitys_tenants_starts_its_pools_stream_over(tmp_path, team_engines):
    """team-x is given tenant b too: its pool's stream starts over (``AllBlocksCleared``,
    then a snapshot) and shows b's host and disk blocks as well; the other streams go on
    as they were. Taken away again: x's stream starts over without them. (A reload
    takes the events sockets' connections anew: the router connects again after each,
    and replays every stream's ring from its start.)"""
    context, engines = team_engines
    with _tenants_daemon(tmp_path, context) as (daemon, router, reload):
        sessions, pools = _register_teams(daemon, engines)
        rng = np.random.default_rng(3)
        for team in _TEAMS:
            _request(daemon, sessions[team][0], rng.integers(0, 1000, 3 * PS).tolist(), team.encode())
        next(iter(daemon.managers.values())).flush()
        _settle(daemon, router)
        _shows_what_its_tenants_could_hit(daemon, router, pools, _TEAMS)
        topics = {team: str(pool_id).encode() for team, pool_id in pools.items()}
        assert router.clears == Counter(topics.values())  # (each stream's first batch)
        before = {medium for medium, _ in router.blocks[topics["team-x"]]}
        for reloads, teams in enumerate(({**_TEAMS, "team-x": ("a", "b")}, _TEAMS), start=1):
            reload(teams)
            again = Subscriber(context, daemon)
            try:
                _settle(daemon, again)
                _shows_what_its_tenants_could_hit(daemon, again, pools, teams)
                assert again.clears == Counter({**Counter(topics.values()), topics["team-x"]: 1 + reloads})
                blocks = again.blocks[topics["team-x"]]
            finally:
                again.close()
            if teams is not _TEAMS:
                gained = blocks - residency(daemon, pools["team-x"], frozenset({"a"}))
                assert {medium for medium, _ in gained} == {"CPU", "STORAGE"}
        assert {medium for medium, _ in blocks} == before


def test_every_stream_ends_when_the_daemon_closes(tmp_path):
    """A daemon that shuts down closes its managers: a router must not keep routing to
    its pools for blocks it no longer serves — each stream's last batch clears them."""
    daemon = make_daemon(tmp_path)
    context = zmq.Context()
    engine = Engine(16)
    router = Subscriber(context, daemon)
    try:
        sid, pool_id = register(daemon, engine)
        _prefill(daemon, sid, list(range(2 * PS)))
        router.catch_up()
        assert router.blocks[str(pool_id).encode()]
        daemon.close()
        while router.sub.poll(50):  # (the daemon's loop no longer turns: its last batches)
            topic, seq8, payload = router.sub.recv_multipart()
            router._apply(topic, int.from_bytes(seq8, "big"), payload)
        assert router.blocks[str(pool_id).encode()] == set()
    finally:
        router.close()
        context.destroy(linger=0)
        engine.close()


def test_a_subscriber_behind_at_the_stop_still_gets_the_last_clear(tmp_path):
    """A router reads the events slowly, over tcp://: when the daemon closes, megabytes
    of batches still wait for it in the daemon's socket (more than the connection's
    buffers hold). The stream's last batch, AllBlocksCleared, queued behind them, still
    reaches it after the daemon closed — discarded with the socket, the router would
    keep routing to a daemon that holds nothing."""
    config = DaemonConfig.load(overrides={
        "server.socket": str(tmp_path / "s.sock"), "host.ratio": 1.0, "disk.path": str(tmp_path / "lmdb"),
        "events.enabled": True, "events.endpoint": "tcp://127.0.0.1:0", "events.replay_endpoint": "none",
        "events.insecure_tcp": True})
    daemon = Daemon(config, fds=FdExchange(tmp_path / "fds"))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)  # (a message at a time, through a small buffer: the rest waits daemon-side)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    engine = Engine(16)
    closed = False
    try:
        sub.connect(daemon.events.publisher.endpoint)
        sid, pool_id = register(daemon, engine)
        _prefill(daemon, sid, list(range(2 * PS)))
        daemon.poll()
        assert sub.poll(10_000), "the subscriber never joined"
        stream = daemon.events.publisher.streams[0]
        for i in range(500):  # (a busy daemon's traffic: ~6 MB of announcements)
            stream.stored([i], None, list(range(1000, 5000)), 4000, "CPU")
            daemon.poll()
        daemon.close()
        closed = True
        batches = []
        while not batches or not isinstance(decode(batches[-1][2]).events[-1], AllBlocksCleared):
            assert sub.poll(10_000), f"the daemon closed without a last AllBlocksCleared ({len(batches)} batches read)"
            batches.append(sub.recv_multipart())
        assert batches[-1][0] == str(pool_id).encode()
        seqs = [int.from_bytes(b[1], "big") for b in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "batches lost before the last"
    finally:
        if not closed:
            daemon.close()
        sub.close(0)
        context.destroy(linger=0)
        engine.close()


def test_hostile_replay_requests_leave_the_daemon_serving(tmp_path):
    """Anything sent to the replay socket — garbage frames, many frames, an oversized
    message, a flood of whole-ring requests — gets at most the end marker; the daemon
    keeps answering its engines and a good replay request afterwards."""
    import random

    from daemon_util import ClientEngine, DaemonProcess

    daemon = DaemonProcess(tmp_path, events={"enabled": True, "buffer_steps": 64}).start()
    context = zmq.Context()
    engine = ClientEngine(daemon.endpoint)
    replay_endpoint = f"ipc://{tmp_path / 'hicache-events-replay.sock'}"
    try:
        for i in range(20):  # a ring of batches worth flooding for
            engine.prefill(np.random.default_rng(i).integers(0, 1000, 2 * PS).tolist(), wait_for_pages=True)
        rng = random.Random(3)
        attackers = [context.socket(zmq.DEALER) for _ in range(4)]
        for sock in attackers:
            sock.connect(replay_endpoint)
        bodies = [[b""], [b"", b"", b""], [b"\x00" * 7], [b"\xff" * 9], [b"no such topic", (0).to_bytes(8, "big")],
                  [b"x" * (1 << 20)], [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
                                        for _ in range(rng.randrange(1, 12))]]
        for _ in range(200):
            rng.choice(attackers).send_multipart(rng.choice(bodies + [[(0).to_bytes(8, "big")]]))
        # The daemon still serves its engines (while the flood is answered a few a turn) ...
        engine.prefill(np.random.default_rng(99).integers(0, 1000, 3 * PS).tolist(), wait_for_pages=True)
        engine.client.health()
        # ... and a good request gets every batch still in the ring, then the end marker.
        good = context.socket(zmq.DEALER)
        good.connect(replay_endpoint)
        good.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert good.poll(60_000), "no answer from the replay socket"
            frames = good.recv_multipart()
            if frames[-1] == b"" and frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
            seqs.append(int.from_bytes(frames[-2], "big"))
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        for sock in attackers + [good]:
            sock.close(0)
    finally:
        engine.close()
        context.destroy(linger=0)
        assert daemon.stop() == 0


def test_without_auth_any_local_subscriber_reads_and_replays_the_events(tmp_path):
    """A daemon without [auth] (every local peer the default administrator): a plain
    subscriber of the socket's user is admitted on both sockets, as before identities."""
    from daemon_util import DaemonProcess

    daemon = DaemonProcess(tmp_path, events={"enabled": True}).start()
    _reads_and_replays(daemon, f"ipc://{tmp_path / 'hicache-events.sock'}",
                       f"ipc://{tmp_path / 'hicache-events-replay.sock'}", seed=5)


def _reads_and_replays(daemon, endpoint: str, replay_endpoint: str, seed: int) -> None:
    """A plain subscriber and replay client of ``daemon``'s events are admitted, and see
    a prefill's blocks; then the daemon stops cleanly."""
    from daemon_util import ClientEngine, events_socket, handshake, replayed, token_ids

    sub, sub_monitor = events_socket(zmq.SUB, endpoint)
    replay, replay_monitor = events_socket(zmq.DEALER, replay_endpoint)
    engine = ClientEngine(daemon.endpoint)
    try:
        assert handshake(sub_monitor) == handshake(replay_monitor) == "admitted"
        tokens = np.random.default_rng(seed).integers(1, 30_000, 2 * PS).tolist()
        engine.prefill(tokens)
        seen: list[bytes] = []
        while not set(tokens) <= token_ids(seen):
            assert sub.poll(30_000), "the subscription got no events"
            seen.append(sub.recv_multipart()[2])
        assert set(tokens) <= token_ids(replayed(replay))
    finally:
        engine.close()
        for sock in (sub, sub_monitor, replay, replay_monitor):
            sock.close(0)
        assert daemon.stop() == 0


def test_an_insecure_tcp_events_endpoint_serves_whoever_reaches_it(tmp_path):
    """``[events] insecure_tcp = true``: ``hicache serve`` starts, and a plain subscriber
    over ``tcp://`` reads and replays the events (libzmq 4.3.5 refuses to set an empty
    ZAP domain, so the endpoint must be bound without one: setting it to "" failed the
    bind, and the daemon would not start)."""
    from daemon_util import DaemonProcess

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{port}" for port in ports)
    daemon = DaemonProcess(tmp_path, events={"enabled": True, "insecure_tcp": True, "endpoint": endpoint,
                                             "replay_endpoint": replay_endpoint}).start()
    _reads_and_replays(daemon, endpoint, replay_endpoint, seed=6)


def _blocks_stored(router: Subscriber, daemon: Daemon, medium: str) -> dict[int, tuple]:
    """Every block a ``BlockStored`` of ``medium`` announced on the daemon's streams:
    hash -> (its parent's hash, its tokens, its extra keys)."""
    out = {}
    for stream in daemon.events.publisher.streams:
        for _, payload in router.ask_replay(stream.topic, 0):
            for event in decode(payload).events:
                if not isinstance(event, BlockStored) or event.medium != medium:
                    continue
                parents = [event.parent_block_hash] + event.block_hashes[:-1]
                for i, h in enumerate(event.block_hashes):
                    extra = None if event.extra_keys is None else event.extra_keys[i]
                    out[h] = (parents[i], event.token_ids[i * PS : (i + 1) * PS], extra)
    return out


@contextmanager
def _daemon_and_router(tmp_path, context):
    """A daemon of ``tmp_path``'s state (in this process) and a router following it,
    both closed at the end (the next daemon of the same state is a restart)."""
    daemon = make_daemon(tmp_path)
    router = Subscriber(context, daemon)
    try:
        yield daemon, router
    finally:
        router.close()
        daemon.close()


def test_blocks_a_restart_restores_are_announced_as_before_with_their_extra_keys(tmp_path):
    """Pages stored under an extra key (a cache salt, a LoRA name) and written to disk
    are announced after a restart — the disk tier rebuilt at the first registration —
    with the hashes, parents, tokens and extra keys they had before: a router that
    keys its index on the extra keys finds them again."""
    context = zmq.Context()
    engine = Engine(16)
    try:
        with _daemon_and_router(tmp_path, context) as (daemon, router):
            sid, _ = register(daemon, engine)
            daemon.poll()
            for tokens, extra_key in ((list(range(3 * PS)), "lora-a"), (list(range(500, 500 + 2 * PS)), "")):
                packed = np.asarray(tokens, np.int32).tobytes()
                new = answered(daemon, daemon.handle(p.Alloc(id=6, session=sid, num_pages=len(tokens) // PS)))
                answered(daemon, daemon.handle(p.Insert(id=7, session=sid, tokens=packed, pages=new.pages,
                                                        extra_key=extra_key)))
            next(iter(daemon.managers.values())).flush()
            router.catch_up()
            before = _blocks_stored(router, daemon, "STORAGE")
        assert {extra for _, _, extra in before.values()} == {("lora-a",), None}

        with _daemon_and_router(tmp_path, context) as (daemon, router):
            register(daemon, engine)
            for _ in range(3):
                daemon.poll()
            router.catch_up()
            assert _blocks_stored(router, daemon, "STORAGE") == before
    finally:
        context.destroy(linger=0)
        engine.close()


def test_a_router_replaying_from_its_last_seq_across_a_restart_is_told_to_clear_first(tmp_path):
    """A router away while the daemon restarted (so it missed the old streams' last
    AllBlocksCleared, as it would for a daemon killed outright) comes back and asks for
    the batches after the last one it read, as for any gap. Pool ids count from 1
    again, so the new daemon's stream has the old one's topic; it must not hand the
    router batches that seem to continue its old picture: the router gets the new
    stream from its start, AllBlocksCleared first, and ends with the cache as it is."""
    context = zmq.Context()
    engine = Engine(16)
    try:
        with _daemon_and_router(tmp_path, context) as (daemon, router):  # (the router is away after it)
            sid, pool_id = register(daemon, engine)
            _prefill(daemon, sid, list(range(2 * PS)))
            router.catch_up()
            topic = str(pool_id).encode()
            picture, last_seq = set(router.blocks[topic]), router.next_seq[topic] - 1
            assert ("GPU", next(iter(picture))[1]) in picture

        with _daemon_and_router(tmp_path, context) as (daemon, back):
            sid, pool_id = register(daemon, engine)
            assert str(pool_id).encode() == topic
            for i in range(4):  # (more batches than the old stream had)
                _prefill(daemon, sid, list(range(1000 * (i + 1), 1000 * (i + 1) + PS)))
                daemon.poll()
            batches = [decode(payload) for _, payload in back.ask_replay(topic, last_seq + 1)]
            assert batches and isinstance(batches[0].events[0], AllBlocksCleared)
            for batch in batches:
                apply(picture, batch)
            assert picture == residency(daemon, pool_id)
    finally:
        context.destroy(linger=0)
        engine.close()


def test_a_killed_daemons_streams_are_cleared_by_its_next_run_though_no_engine_comes_back(tmp_path):
    """A daemon is killed outright (SIGKILL) while a router holds an engine's blocks;
    it comes back and no engine registers again (the engine went with it). The router,
    still subscribed, is told AllBlocksCleared on that topic, with that rank, at a seq
    past the old stream's: it stops routing to blocks nobody serves. Before, the next
    run knew nothing of the last run's topics and the router kept them for good."""
    from daemon_util import ClientEngine, DaemonProcess, events_socket, handshake, token_ids

    daemon = DaemonProcess(tmp_path, events={"enabled": True}).start()
    sub, monitor = events_socket(zmq.SUB, f"ipc://{tmp_path / 'hicache-events.sock'}")
    engine = ClientEngine(daemon.endpoint)
    try:
        assert handshake(monitor) == "admitted"
        tokens = np.random.default_rng(7).integers(1, 30_000, 2 * PS).tolist()
        engine.prefill(tokens)
        seen: dict[bytes, list] = {}
        last_seq: dict[bytes, int] = {}
        while not set(tokens) <= token_ids([b for batches in seen.values() for b in batches]):
            assert sub.poll(30_000), "the subscription got no events"
            topic, seq8, payload = sub.recv_multipart()
            seen.setdefault(topic, []).append(payload)
            last_seq[topic] = int.from_bytes(seq8, "big")
        (topic,) = [t for t, batches in seen.items() if token_ids(batches)]
        rank = decode(seen[topic][-1]).data_parallel_rank
        daemon.kill()
        engine.close()

        daemon = DaemonProcess(tmp_path, events={"enabled": True}).start()
        while True:
            assert sub.poll(30_000), "the next run said nothing on the old topic"
            got, seq8, payload = sub.recv_multipart()
            if got != topic:
                continue
            batch = decode(payload)
            if [type(e) for e in batch.events] == [AllBlocksCleared]:
                break
            # (the killed run's later batches — the pages' host and disk copies — read late)
            last_seq[topic] = max(last_seq[topic], int.from_bytes(seq8, "big"))
        assert batch.data_parallel_rank == rank and int.from_bytes(seq8, "big") > last_seq[topic]
    finally:
        engine.close()
        for sock in (sub, monitor):
            sock.close(0)
        assert daemon.stop() == 0


class Router:
    """A router following a daemon process's KV events: a SUB socket and a replay
    DEALER on its ipc:// sockets in ``directory``. A batch past the next seq it expects
    of a topic (a restart, a late connection, a topic never seen: from 0) is preceded
    by that topic's batches from the replay socket."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.blocks: dict[bytes, set] = {}
        self.next_seq: dict[bytes, int] = {}
        self.received: dict[bytes, int] = {}  # batches new to it read from the SUB socket, by topic
        self.connect()

    def connect(self) -> None:
        """Connect (again), and wait until the subscription is admitted."""
        from daemon_util import events_socket, handshake

        self.sub, self._sub_monitor = events_socket(zmq.SUB, f"ipc://{self.directory / 'hicache-events.sock'}")
        self.replay, self._replay_monitor = events_socket(
            zmq.DEALER, f"ipc://{self.directory / 'hicache-events-replay.sock'}")
        assert handshake(self._sub_monitor) == "admitted"

    def close(self) -> None:
        for sock in (self.sub, self._sub_monitor, self.replay, self._replay_monitor):
            sock.close(0)

    def ask_replay(self, topic: bytes, start: int) -> list[tuple[int, bytes]]:
        """The topic's batches from ``start`` on; never another topic's."""
        self.replay.send_multipart([topic, start.to_bytes(8, "big")])
        got = []
        while True:
            assert self.replay.poll(30_000), "no end marker from the replay socket"
            _, got_topic, seq8, payload = self.replay.recv_multipart()
            if not got_topic:
                assert seq8 == (-1).to_bytes(8, "big", signed=True) and not payload
                return got
            assert got_topic == topic
            got.append((int.from_bytes(seq8, "big"), payload))

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        if seq >= self.next_seq.get(topic, 0):
            apply(self.blocks.setdefault(topic, set()), decode(payload))
            self.next_seq[topic] = seq + 1

    def pump_until(self, done) -> None:
        """Read batches until ``done(self)``."""
        while not done(self):
            assert self.sub.poll(30_000), f"the events stopped short: {self.blocks}"
            topic, seq8, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq8, "big")
            if seq >= self.next_seq.get(topic, 0):
                self.received[topic] = self.received.get(topic, 0) + 1
            if seq > self.next_seq.get(topic, 0):
                for s, data in self.ask_replay(topic, self.next_seq.get(topic, 0)):
                    self._apply(topic, s, data)
            self._apply(topic, seq, payload)


def test_routers_follow_a_killed_daemon_through_its_restart_with_one_of_its_two_pools_back(tmp_path):
    """Two engines' pools (topics 1 and 2) have written their blocks to disk, and two
    routers hold them, when the daemon is killed outright (SIGKILL). It comes back, one
    engine registers again (pool 1: topic 1) and prefills anew, to disk, and then goes
    quiet. A router that kept its sockets through the restart, and one that was away
    and connects now (within the minute), both with the old run's seqs, end up with
    nothing on topic 2, whose pool is gone, and on topic 1 the new pool's device
    blocks and every block on disk — none of the old pool's device blocks. Before, a
    topic a pool took up said nothing more once that pool went quiet: a router that
    connected after its first batches never saw a gap, and kept the old pool's blocks."""
    from daemon_util import ClientEngine, DaemonProcess

    rng = np.random.default_rng(11)
    old = [rng.integers(1, 30_000, 2 * PS).tolist() for _ in range(2)]
    new = rng.integers(1, 30_000, 3 * PS).tolist()
    daemon = DaemonProcess(tmp_path, events={"enabled": True}).start()
    staying, away = Router(tmp_path), Router(tmp_path)
    engines = []
    try:
        engines = [ClientEngine(daemon.endpoint) for _ in old]
        for engine, tokens in zip(engines, old):
            engine.prefill(tokens)
        ns = engines[0].ns()

        def hashes(tokens: list[int]) -> set[int]:
            return {int.from_bytes(key[8:], "big") for key in page_keys(ns, tokens, PS)}

        on_disk = hashes(old[0]) | hashes(old[1])
        for router in (staying, away):
            router.pump_until(lambda r: all({("STORAGE", h) for h in on_disk} <= r.blocks.get(topic, set())
                                            for topic in (b"1", b"2")))
            assert {h for medium, h in router.blocks[b"1"] if medium == "GPU"} == hashes(old[0])
        away.close()
        daemon.kill()
        for engine in engines:
            engine.close()

        daemon = DaemonProcess(tmp_path, events={"enabled": True}).start()
        engines = [ClientEngine(daemon.endpoint)]
        engines[0].prefill(new)
        engines[0].client.flush()
        on_disk |= hashes(new)
        away.connect()
        for router in (staying, away):
            # Two of topic 2's repeated clears from here on: the publisher spoke on
            # every topic of the last run since this router was subscribed.
            clears = router.received.get(b"2", 0) + 2
            router.pump_until(lambda r: r.received.get(b"2", 0) >= clears)
            assert router.blocks[b"2"] == set()
            up = router.blocks[b"1"]
            assert {(medium, h) for medium, h in up if medium != "CPU"} == (
                {("GPU", h) for h in hashes(new)} | {("STORAGE", h) for h in on_disk})
            assert {h for medium, h in up if medium == "CPU"} <= hashes(new)
            # The left topic's replay from before the restart: its clears, then the end marker.
            batches = [decode(payload) for _, payload in router.ask_replay(b"2", 0)]
            assert batches and all(type(e) is AllBlocksCleared for batch in batches for e in batch.events)
    finally:
        for engine in engines:
            engine.close()
        staying.close()
        away.close()
        assert daemon.stop() == 0
