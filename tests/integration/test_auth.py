"""Authenticated clients and daemon-bound tenants, on a real daemon over
``tcp://127.0.0.1`` with real CURVE keys (``hicache keygen``'s files)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import zmq

from daemon_util import (HICACHE, ClientEngine, DaemonProcess, events_socket, handshake, replayed, run_hicache,
                         scraped, token_ids)
from hicache import protocol as p
from hicache.auth import read_public, read_secret, write_keypair
from hicache.client import CacheClient, RemoteError
from hicache.errors import ErrorCode, Unavailable
from kv_event_shapes import AllBlocksCleared, BlockStored, decode
from owned_util import OwnedEngine, layer_major
from tiers_util import SPEC

PS = SPEC.page_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def keys(tmp_path):
    """Key pairs by name: the server's and the clients' (the files hicache keygen writes)."""
    out = {}
    (tmp_path / "keys").mkdir()
    for name in ("server", "x", "y", "limited", "stranger", "x2", "s", "router"):
        public, secret = write_keypair(tmp_path / "keys" / name)
        out[name] = {"public": public, "secret": secret, "z85": read_public(public).decode()}
    return out


def _auth(keys, *, x_key: str = "x", **overrides) -> dict:
    identities = [
        {"name": "team-x", "public_keys": [keys[x_key]["z85"]], "tenants": ["a"]},
        {"name": "team-y", "public_keys": [keys["y"]["z85"]], "tenants": ["b", "b2"], "admin": True},
        {"name": "limited", "public_keys": [keys["limited"]["z85"]], "tenants": ["c"], "max_locks": 2,
         "requests_per_s": 0.01},
        {"name": "spacey", "public_keys": [keys["s"]["z85"]], "tenants": ["s"], "host_pages": 4, "disk_pages": 6},
    ]
    return {"secret_key_file": str(keys["server"]["secret"]), "default_identity": "", "identities": identities,
            **overrides}


@pytest.fixture
def daemon(tmp_path, keys):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    d = DaemonProcess(tmp_path, server={"tcp": endpoint}, auth=_auth(keys),
                      probe={"endpoint": endpoint, **_creds(keys, "y")})
    d.tcp = endpoint
    d.start()
    yield d
    d.stop()


def _creds(keys, who: str) -> dict:
    return {"server_key": keys["server"]["public"], "key_file": keys[who]["secret"]}


def _client(daemon, keys, who: str, **args) -> CacheClient:
    return CacheClient(daemon.tcp, heartbeat=False, **_creds(keys, who), **args)


def _code(excinfo) -> ErrorCode:
    return ErrorCode(excinfo.value.code)


def _tokens(seed: int, pages: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30_000, pages * PS).tolist()


def test_a_client_without_a_listed_key_gets_nothing(daemon, keys, tmp_path):
    """An unlisted key, no CURVE at all, the wrong server key: not even health."""
    for args in (_creds(keys, "stranger"), {}, {"server_key": keys["x"]["public"], "key_file": keys["x"]["secret"]}):
        client = CacheClient(daemon.tcp, heartbeat=False, timeout_s=0.5, **args)
        try:
            with pytest.raises(Unavailable):
                client.health()
        finally:
            client.close()
    # the ipc:// socket: its user is in no identity and there is no default identity
    client = CacheClient(daemon.endpoint, heartbeat=False, timeout_s=0.5)
    try:
        with pytest.raises(Unavailable):
            client.health()
    finally:
        client.close()
    listed = _client(daemon, keys, "x")
    try:
        assert listed.health().state == "serving"
    finally:
        listed.close()
    log = daemon.log.read_text()
    assert f"key {keys['stranger']['z85']} is not listed" in log
    assert "refused a NULL connection" in log


def test_tenants_are_bound_by_the_daemon(daemon, keys):
    """Identity X (tenant a) caches a prompt; identity Y (tenants b, b2) never hits it —
    not by naming tenant a (PERMISSION_DENIED), not by any extra key, not from host or
    disk, not after a restart — and X is refused Y's tenants likewise."""
    tokens = _tokens(1, 4)
    x = ClientEngine(daemon.tcp, **_creds(keys, "x"))
    y = ClientEngine(daemon.tcp, **_creds(keys, "y"))
    try:
        x.prefill(tokens)
        assert x.client.match(tokens).num_device_pages == 4
        assert x.client.match(tokens, tenant="a").num_device_pages == 4  # its one tenant, named
        for kwargs in ({}, {"tenant": "b"}, {"tenant": "b2"}, {"extra_key": "a"}, {"extra_key": "tenant:a"}):
            m = y.client.match(tokens, **kwargs)
            assert m.handle is None and m.num_tokens == 0, kwargs
        for call in (lambda: y.client.match(tokens, tenant="a"),
                     lambda: y.client.match_many([tokens], tenant="a"),
                     lambda: y.client.insert(tokens, y.client.alloc(4), tenant="a"),
                     lambda: x.client.match(tokens, tenant="b"),
                     lambda: x.client.match(tokens, tenant="default")):
            with pytest.raises(RemoteError) as excinfo:
                call()
            assert _code(excinfo) == ErrorCode.PERMISSION_DENIED
        # Y's own copy of the same tokens lives apart from X's
        y.prefill(tokens, wait_for_pages=True)
        assert y.client.match(tokens).num_device_pages == 4
        assert y.client.match(tokens, tenant="b2").handle is None
        with pytest.raises(RemoteError) as excinfo:
            x.client.stats()  # X is no administrator
        assert _code(excinfo) == ErrorCode.PERMISSION_DENIED
        assert y.client.flush()["not_on_disk_pages"] == 0
    finally:
        x.close()
        y.close()
    # Restart: the cache comes back from disk, bound the same way.
    daemon.stop()
    daemon.start()
    x = ClientEngine(daemon.tcp, **_creds(keys, "x"))
    y = ClientEngine(daemon.tcp, **_creds(keys, "y"))
    try:
        m = x.client.match(tokens)
        assert m.num_tokens == len(tokens) and m.num_device_pages == 0  # from host / disk
        x.prefill(tokens)  # loads it back, bytes checked
        for kwargs in ({"tenant": "b2"}, {"extra_key": "a"}):
            assert y.client.match(tokens, **kwargs).handle is None, kwargs
        with pytest.raises(RemoteError) as excinfo:
            y.client.match(tokens, tenant="a")
        assert _code(excinfo) == ErrorCode.PERMISSION_DENIED
        y.client.check()
    finally:
        x.close()
        y.close()



def test_an_administrator_purges_one_tenant_and_no_other(daemon, keys):
    """Team-y (an administrator, tenants b and b2) purges tenant a: team-x's pages under
    every extra key are gone, y's own — the same tokens — are not; team-x, no
    administrator, may purge nothing, its own tenant included."""
    tokens = _tokens(11, 3)
    x = ClientEngine(daemon.tcp, **_creds(keys, "x"))
    y = ClientEngine(daemon.tcp, **_creds(keys, "y"))
    admin = _client(daemon, keys, "y")
    try:
        for extra_key in ("", "lora-1"):
            x.prefill(tokens, extra_key)
        y.prefill(tokens)
        with pytest.raises(RemoteError) as excinfo:
            x.client.purge("a")
        assert _code(excinfo) == ErrorCode.PERMISSION_DENIED
        out = admin.purge("a")
        assert out["namespaces"] == 2 and out["left_pages"] == 0, out
        for extra_key in ("", "lora-1"):
            assert x.client.match(tokens, extra_key).num_tokens == 0
        assert y.client.match(tokens).num_tokens == len(tokens)
        admin.check()
    finally:
        x.close()
        y.close()
        admin.close()

def test_quotas_refuse_one_identity_and_not_another(daemon, keys):
    raw = _client(daemon, keys, "limited")
    other = ClientEngine(daemon.tcp, **_creds(keys, "x"))
    try:
        assert raw.health().state == "serving"  # health is never rated
        raw._admin(p.Hello(id=0, version=p.PROTOCOL_VERSION, client="limited"))  # its one request
        with pytest.raises(RemoteError) as excinfo:
            raw._admin(p.Hello(id=0, version=p.PROTOCOL_VERSION, client="limited"))
        assert _code(excinfo) == ErrorCode.RESOURCE_EXHAUSTED
        other.prefill(_tokens(2, 2))  # another identity goes on
        assert other.client.match(_tokens(2, 2)).num_device_pages == 2
    finally:
        raw.close()
        other.close()


def test_space_quotas_keep_a_tenant_to_its_pages_and_not_another_tenants(daemon, keys):
    """Identity "spacey" may hold 4 host and 6 disk pages: its tenant makes room among
    its own pages as it goes (its newest prompt still hits), another tenant keeps all of
    its pages, and stats show each tenant's occupancy."""
    s = ClientEngine(daemon.tcp, **_creds(keys, "s"))
    x = ClientEngine(daemon.tcp, **_creds(keys, "x"))
    admin = _client(daemon, keys, "y")
    try:
        x.prefill(_tokens(50, 5))
        admin.flush()
        for seed in range(6):
            s.prefill(_tokens(60 + seed, 2), wait_for_pages=True)
            admin.flush()
            tenants = admin.stats()["tenants"]
            assert tenants["s"]["host_pages"] <= 4 and tenants["s"]["disk_pages"] <= 6, tenants
            assert tenants["a"] == {"host_pages": 5, "disk_pages": 5}, tenants
        assert tenants["s"]["disk_pages"] == 6
        s.client.close()
        s.engine.close()
        s = ClientEngine(daemon.tcp, **_creds(keys, "s"))  # a new pool: no device pages
        m = s.client.match(_tokens(65, 2))
        assert m.num_tokens == 2 * PS and m.num_device_pages == 0
        s.prefill(_tokens(65, 2))  # loaded back from host / disk, bytes checked
        assert s.client.match(_tokens(60, 2)).num_tokens == 0  # its oldest made room
        assert x.client.match(_tokens(50, 5)).num_device_pages == 5
        admin.check()
    finally:
        s.close()
        x.close()
        admin.close()


def test_lock_quota(tmp_path, keys):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    auth = _auth(keys)
    auth["identities"][2]["requests_per_s"] = 0.0  # locks only
    d = DaemonProcess(tmp_path, server={"tcp": endpoint}, auth=auth, probe={"endpoint": endpoint, **_creds(keys, "y")})
    d.tcp = endpoint
    d.start()
    limited = ClientEngine(endpoint, **_creds(keys, "limited"))
    other = ClientEngine(endpoint, **_creds(keys, "x"))
    try:
        handles = []
        for seed in range(3):
            tokens = _tokens(10 + seed, 1)
            limited.prefill(tokens)
            other.prefill(tokens)
            handles.append(limited.client.match(tokens).handle)
        limited.client.lock(handles[0])
        limited.client.lock(handles[1])
        with pytest.raises(RemoteError) as excinfo:
            limited.client.lock(handles[2])
        assert _code(excinfo) == ErrorCode.RESOURCE_EXHAUSTED
        for seed in range(3):  # the other identity locks as it likes
            other.client.lock(other.client.match(_tokens(10 + seed, 1)).handle)
        limited.client.unlock(handles[0])
        limited.client.lock(handles[2])  # room again
        assert "identity 'limited'" in excinfo.value.message
    finally:
        limited.close()
        other.close()
        d.stop()


def test_reload_rotates_keys(daemon, keys):
    """X's key is replaced by a new one: after SIGHUP the old key's connection gets
    nothing more and its session ends; the new key works; a non-administrator cannot
    ask for a reload, and a bad file keeps the identities in force."""
    old = ClientEngine(daemon.tcp, **_creds(keys, "x"), timeout_s=1.0)
    admin = _client(daemon, keys, "y")
    try:
        old.prefill(_tokens(3, 2))
        with pytest.raises(RemoteError) as excinfo:
            old.client.reload()
        assert _code(excinfo) == ErrorCode.PERMISSION_DENIED
        sessions = admin.stats()["sessions"]
        daemon.rewrite(server={"tcp": daemon.tcp}, auth=_auth(keys, x_key="x2"))
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while admin.stats()["sessions"] != sessions - 1:  # the old key's session ends
            assert time.monotonic() < deadline, "the reload did not end the revoked session"
            time.sleep(0.05)
        old.client.timeout_s = 0.5
        m = old.client.match(_tokens(3, 2))  # no answer: the client degrades to a miss
        assert m.handle is None and old.client.degraded
        new = ClientEngine(daemon.tcp, **_creds(keys, "x2"))
        try:
            assert new.client.match(_tokens(3, 2)).num_tokens == 2 * PS  # same identity, same tenant
        finally:
            new.close()
        # the reload op, and a file that does not parse
        assert admin.reload() == {"identities": 4, "sessions_ended": 0}
        daemon.config.write_text(daemon.config.read_text() + "\n[auth\n")
        with pytest.raises(RemoteError) as excinfo:
            admin.reload()
        assert _code(excinfo) == ErrorCode.INVALID_ARGUMENT
        assert admin.health().state == "serving"
        (out,) = run_hicache([HICACHE, "reload", "--endpoint", daemon.tcp, "--server-key",
                              str(keys["server"]["public"]), "--key-file", str(keys["y"]["secret"])])
        assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr
    finally:
        old.close()
        admin.close()


def test_keygen_writes_a_private_secret(tmp_path):
    out = subprocess.run([HICACHE, "keygen", str(tmp_path / "engine")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    secret = tmp_path / "engine.key_secret"
    assert os.stat(secret).st_mode & 0o777 == 0o600
    public, _ = read_secret(secret)
    assert read_public(tmp_path / "engine.key") == public
    again = subprocess.run([HICACHE, "keygen", str(tmp_path / "engine")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "exists" in again.stderr
    assert read_secret(secret)[0] == public  # untouched


def _raw(daemon, keys, who: str, routing_id: bytes) -> zmq.Socket:
    from hicache.auth import ClientKeys

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    ClientKeys.load(keys["server"]["public"], keys[who]["secret"]).apply(sock)
    sock.connect(daemon.tcp)
    return sock


def _ask(sock: zmq.Socket, message, timeout_s: float = 10.0) -> p.Reply | None:
    sock.send(p.encode(message))
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return p.decode_reply(sock.recv())


def test_a_routing_id_proves_nothing(daemon, keys):
    """ZeroMQ lets a client pick its routing id, a departed connection's included: the
    daemon goes by the identity each message was admitted as, not by the routing id."""
    admin = _raw(daemon, keys, "y", b"\0chosen")
    assert isinstance(_ask(admin, p.Stats(id=1)), p.StatsReply)  # Y is an administrator
    admin.close()
    deadline = time.monotonic() + 30
    while True:  # the same routing id, X's key, once the daemon has let Y's connection go
        other = _raw(daemon, keys, "x", b"\0chosen")
        reply = _ask(other, p.Stats(id=2), timeout_s=1.0)  # (refused while Y's is still known)
        if reply is not None:
            break
        other.close()
        assert time.monotonic() < deadline, "the routing id was never free again"
    assert reply.code == ErrorCode.PERMISSION_DENIED
    # A peer posing as the daemon's own wake-up socket is nobody either: answered as X.
    waker = _raw(daemon, keys, "x", b"\0hicache-wake-1")
    reply = _ask(waker, p.Stats(id=3))
    assert isinstance(reply, p.Error) and reply.code == ErrorCode.PERMISSION_DENIED
    waker.send(b"")  # an empty message: a wake-up at most
    assert _ask(waker, p.Health(id=4)).state == "serving"
    other.close()
    waker.close()


def test_ipc_peers_by_unix_user_and_curve_on_ipc(tmp_path, keys):
    """On plain ipc:// this process's user is the identity listing its uid (tenant "u");
    with curve_ipc the socket wants keys too: a plain client gets nothing there."""
    me = {"name": "me", "uids": [os.getuid()], "tenants": ["u"], "admin": True}
    (tmp_path / "plain").mkdir()
    d = DaemonProcess(tmp_path / "plain", auth={"default_identity": "", "identities": [me]})
    listed = {"name": "k", "public_keys": [keys["x"]["z85"]], "tenants": ["k"], "admin": True}
    (tmp_path / "curve").mkdir()
    endpoint = f"ipc://{tmp_path / 'curve' / 'hicache.sock'}"
    curve = DaemonProcess(tmp_path / "curve", auth={"secret_key_file": str(keys["server"]["secret"]),
                                                    "curve_ipc": True, "identities": [listed]},
                          probe={"endpoint": endpoint, **_creds(keys, "x")})
    d.launch()
    curve.launch()  # side by side: the two daemons have nothing to do with each other
    try:
        d.wait_ready()
        engine = ClientEngine(d.endpoint)
        try:
            engine.prefill(_tokens(7, 2))
            assert engine.client.match(_tokens(7, 2), tenant="u").num_device_pages == 2
            with pytest.raises(RemoteError) as excinfo:
                engine.client.match(_tokens(7, 2), tenant="default")
            assert _code(excinfo) == ErrorCode.PERMISSION_DENIED
            engine.client.flush()  # (the backup of its pages has landed)
            assert set(engine.client.stats().get("tenants", {})) == {"u"}
        finally:
            engine.close()
        d.stop()
        curve.wait_ready()
        plain = CacheClient(endpoint, heartbeat=False, timeout_s=0.5)
        try:
            with pytest.raises(Unavailable):
                plain.health()  # this user would be the default identity, but not without a key
        finally:
            plain.close()
        keyed = CacheClient(endpoint, heartbeat=False, **_creds(keys, "x"))
        try:
            assert keyed.health().state == "serving"
        finally:
            keyed.close()
    finally:
        d.stop()
        curve.stop()


# -- KV events: every tenant's token ids, for the identities allowed to read them ------


def test_a_peer_the_daemon_refuses_reads_no_kv_events(tmp_path, keys):
    """With [auth] (no default identity: this process's user, plain on ipc://, is
    nobody) the events sockets refuse it as the daemon's socket does; before, they
    were bound outside the ZAP handler's reach and it read tenant a's token ids."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    d = DaemonProcess(tmp_path, server={"tcp": endpoint}, auth=_auth(keys), events={"enabled": True},
                      probe={"endpoint": endpoint, **_creds(keys, "y")})
    d.tcp = endpoint
    d.start()
    sub, sub_monitor = events_socket(zmq.SUB, f"ipc://{tmp_path / 'hicache-events.sock'}")
    replay, replay_monitor = events_socket(zmq.DEALER, f"ipc://{tmp_path / 'hicache-events-replay.sock'}")
    x = ClientEngine(d.tcp, **_creds(keys, "x"))
    try:
        assert handshake(sub_monitor) == "refused"
        assert handshake(replay_monitor) == "refused"
        x.prefill(_tokens(99, 2))
        assert not sub.poll(0)  # (refused: nothing can arrive)
        assert "refused a NULL connection" in d.log.read_text()
    finally:
        x.close()
        for sock in (sub, sub_monitor, replay, replay_monitor):
            sock.close(0)
        d.stop()


def _events_auth(keys, **router) -> dict:
    auth = _auth(keys)
    auth["identities"].append({"name": "router", "public_keys": [keys["router"]["z85"]], "events": True, **router})
    return auth


def _events_daemon(tmp_path, keys) -> tuple[DaemonProcess, str, str]:
    """A daemon with its events on tcp:// (CURVE), and the identity "router" allowed
    them: (daemon, PUB endpoint, replay endpoint)."""
    endpoint, pub, replay_endpoint = (f"tcp://127.0.0.1:{_free_port()}" for _ in range(3))
    d = DaemonProcess(tmp_path, server={"tcp": endpoint}, auth=_events_auth(keys),
                      events={"enabled": True, "endpoint": pub, "replay_endpoint": replay_endpoint},
                      probe={"endpoint": endpoint, **_creds(keys, "y")})
    d.tcp = endpoint
    return d.start(), pub, replay_endpoint


def test_kv_events_reach_only_identities_allowed_to_read_them(tmp_path, keys):
    """Events on tcp:// take CURVE as the daemon's socket does: a key listed with
    ``events = true`` subscribes and replays, and reads tenant a's tokens; an engine's
    identity (listed, not allowed the events), an unlisted key and a plain client get
    nothing, counted as refused."""
    d, pub, replay_endpoint = _events_daemon(tmp_path, keys)
    subs = {who: events_socket(zmq.SUB, pub, keys, who) for who in ("router", "x", "stranger", "")}
    replays = {who: events_socket(zmq.DEALER, replay_endpoint, keys, who) for who in ("router", "x")}
    x = ClientEngine(d.tcp, **_creds(keys, "x"))
    try:
        assert {who: handshake(monitor) for who, (_, monitor) in subs.items()} == {
            "router": "admitted", "x": "refused", "stranger": "refused", "": "refused"}
        assert {who: handshake(monitor) for who, (_, monitor) in replays.items()} == {
            "router": "admitted", "x": "refused"}
        secret = _tokens(99, 2)
        x.prefill(secret)
        sub = subs["router"][0]
        seen: list[bytes] = []
        while not set(secret) <= token_ids(seen):
            assert sub.poll(30_000), "the router's subscription got no events"
            seen.append(sub.recv_multipart()[2])
        assert set(secret) <= token_ids(replayed(replays["router"][0]))
        assert not any(s.poll(0) for who, (s, _) in subs.items() if who != "router")
        log = d.log.read_text()
        assert "refused a KV events subscriber" in log and "identity 'team-x' may not read the events" in log
    finally:
        x.close()
        for sock, monitor in (*subs.values(), *replays.values()):
            sock.close(0)
            monitor.close(0)
        d.stop()


def _tokens_by_medium(payloads: list[bytes]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for payload in payloads:
        for event in decode(payload).events:
            if isinstance(event, BlockStored):
                out.setdefault(event.medium, set()).update(event.token_ids)
    return out


def test_an_engines_stream_shows_no_other_tenants_blocks(tmp_path, keys):
    """Over the daemon's sockets (CURVE, the ZAP handler's identities): team-x's engine
    (tenant a) and team-y's (tenant b) cache a prompt each, written to disk too — both
    in the same host and disk tiers. The router finds on x's topic a's tokens and none
    of b's, on the device, host and disk alike, and the reverse on y's: a router is not
    told that an engine holds blocks it can never hit."""
    d, pub, replay_endpoint = _events_daemon(tmp_path, keys)
    replay, monitor = events_socket(zmq.DEALER, replay_endpoint, keys, "router")
    engines = {"x": ClientEngine(d.tcp, **_creds(keys, "x")), "y": ClientEngine(d.tcp, **_creds(keys, "y"))}
    secrets = {"x": set(range(1, 1 + 2 * PS)), "y": set(range(5000, 5000 + 2 * PS))}
    try:
        assert handshake(monitor) == "admitted"
        for who, engine in engines.items():
            engine.prefill(sorted(secrets[who]))
        assert engines["y"].client.flush()["not_on_disk_pages"] == 0
        topics = {who: str(engine.client.pool_id) for who, engine in engines.items()}
        for who, topic in topics.items():  # (published at the daemon's next loop turns)
            deadline = time.monotonic() + 30
            while not secrets[who] <= _tokens_by_medium(replayed(replay, topic)).get("STORAGE", set()):
                assert time.monotonic() < deadline, f"{who}'s blocks never reached the disk on its stream"
                time.sleep(0.05)
        for who, topic in topics.items():
            other = secrets["y" if who == "x" else "x"]
            seen = _tokens_by_medium(replayed(replay, topic))
            assert {"GPU", "STORAGE"} <= set(seen), who
            assert all(secrets[who] <= tokens and not tokens & other for tokens in seen.values()), who
    finally:
        for engine in engines.values():
            engine.close()
        replay.close(0)
        monitor.close(0)
        d.stop()


def test_a_reload_admits_the_kv_events_subscribers_anew(tmp_path, keys):
    """A reload that withdraws the router's events right cuts its subscription off (the
    events sockets take their connections anew); an administrator's reconnects."""
    d, pub, replay_endpoint = _events_daemon(tmp_path, keys)
    subs = {who: events_socket(zmq.SUB, pub, keys, who) for who in ("router", "y")}
    admin = _client(d, keys, "y")
    x = ClientEngine(d.tcp, **_creds(keys, "x"))
    try:
        assert {who: handshake(monitor) for who, (_, monitor) in subs.items()} == {"router": "admitted", "y": "admitted"}
        d.rewrite(server={"tcp": d.tcp}, auth=_events_auth(keys, events=False),
                  events={"enabled": True, "endpoint": pub, "replay_endpoint": replay_endpoint})
        admin.reload()
        assert {who: handshake(monitor) for who, (_, monitor) in subs.items()} == {"router": "refused", "y": "admitted"}
        for sock, _ in subs.values():  # (what came before the reload)
            while sock.poll(0):
                sock.recv_multipart()
        secret = _tokens(98, 2)
        x.prefill(secret)
        seen: list[bytes] = []
        while not set(secret) <= token_ids(seen):
            assert subs["y"][0].poll(30_000), "the administrator's subscription got no events"
            seen.append(subs["y"][0].recv_multipart()[2])
        assert not subs["router"][0].poll(0)
    finally:
        x.close()
        admin.close()
        for sock, monitor in subs.values():
            sock.close(0)
            monitor.close(0)
        d.stop()


def test_one_identitys_unregistered_sessions_do_not_lock_out_another_on_the_same_address(tmp_path, keys):
    """``max_unregistered_per_peer`` counts a CURVE peer by address *and* identity: team-x
    holding its share of sessions that never register leaves team-y, on the same host
    (or behind the same NAT), free to say hello — while team-x itself is held back."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    d = DaemonProcess(tmp_path, server={"tcp": endpoint, "max_unregistered_per_peer": 2, "register_within_s": 30.0},
                      auth=_auth(keys), probe={"endpoint": endpoint, **_creds(keys, "y")})
    d.tcp = endpoint
    d.start()
    squatter, other = _client(d, keys, "x"), _client(d, keys, "y")
    hello = p.Hello(id=0, version=p.PROTOCOL_VERSION, client="test", pid=1)
    try:
        for _ in range(2):
            squatter._call(hello)
        with pytest.raises(RemoteError) as excinfo:
            squatter._call(hello)
        assert _code(excinfo) == ErrorCode.RESOURCE_EXHAUSTED
        assert other._call(hello).session
    finally:
        squatter.close()
        other.close()
        d.stop()


def test_one_identity_cannot_take_every_session_of_the_daemon(tmp_path, keys):
    """An identity holds at most its ``max_sessions`` (default ``[auth]
    max_sessions_per_identity``) sessions, pools with them: team-x's tiny pools stop at
    its share, and team-y's engine still registers."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    d = DaemonProcess(tmp_path, server={"tcp": endpoint, "max_sessions": 3},
                      auth=_auth(keys, max_sessions_per_identity=2), probe={"endpoint": endpoint, **_creds(keys, "y")})
    d.start()
    engines = []
    try:
        for _ in range(2):
            engines.append(ClientEngine(endpoint, num_pages=2, **_creds(keys, "x")))
        with pytest.raises(RemoteError) as excinfo:
            engines.append(ClientEngine(endpoint, num_pages=2, **_creds(keys, "x")))
        assert _code(excinfo) == ErrorCode.RESOURCE_EXHAUSTED and "team-x" in excinfo.value.message
        engines.append(ClientEngine(endpoint, **_creds(keys, "y")))
        engines.pop(0).close()  # an ended session makes room for its identity again
        engines.append(ClientEngine(endpoint, num_pages=2, **_creds(keys, "x")))
    finally:
        for engine in engines:
            engine.close()
        d.stop()


def test_engine_owned_pool_names_are_each_identitys_own(daemon, keys):
    """team-x's pool "vllm-worker" neither keeps team-y from a pool of that name nor
    shows through ``attach``: team-y is answered for it as for a name nobody used, and
    its own scheduler attaches to its own pool."""
    x_worker = OwnedEngine(daemon.tcp, layer_major(16), name="vllm-worker", heartbeat=False, **_creds(keys, "x"))
    y_worker = None
    probe = _client(daemon, keys, "y")
    try:
        messages = []
        for name in ("vllm-worker", "no-such-pool"):
            with pytest.raises(RemoteError) as excinfo:
                probe.attach(name)
            assert _code(excinfo) == ErrorCode.INVALID_ARGUMENT
            messages.append(excinfo.value.message.replace(name, "NAME"))
        assert messages[0] == messages[1]
        y_worker = OwnedEngine(daemon.tcp, layer_major(16), name="vllm-worker", heartbeat=False, **_creds(keys, "y"))
        probe.attach("vllm-worker")
        assert probe.session_id is not None
    finally:
        probe.close()
        for worker in (x_worker, y_worker):
            if worker is not None:
                worker.close()


def test_unlisted_local_users_are_no_administrators_once_identities_are_listed(tmp_path):
    """Identities listed, ``default_identity`` left out: this process's user, whom no
    identity lists, is the built-in default — its engine works on tenant "default", but
    ``stats`` (every tenant's occupancy), ``flush``, ``check`` and ``reload`` are refused."""
    engines = {"name": "engines", "uids": [os.getuid() + 4242], "tenants": ["prod"], "admin": True}
    d = DaemonProcess(tmp_path, auth={"identities": [engines]})
    d.start()
    engine = ClientEngine(d.endpoint, timeout_s=5.0)
    try:
        engine.prefill(_tokens(5, 2))
        for admin_call in (engine.client.stats, engine.client.flush, engine.client.check):
            with pytest.raises(RemoteError) as excinfo:
                admin_call()
            assert _code(excinfo) == ErrorCode.PERMISSION_DENIED
    finally:
        engine.close()
        d.stop()


# -- KV events of an identity's own tenants, on a socket of its own ----------------------


def _own_events_auth(keys, tenants=("a",)) -> dict:
    auth = _auth(keys)
    auth["identities"].append({"name": "router-a", "public_keys": [keys["router"]["z85"]],
                               "tenants": list(tenants), "events_endpoint": keys["own_endpoint"]})
    return auth


def _own_events_daemon(tmp_path, keys, **sections: dict) -> tuple[DaemonProcess, str, str]:
    """A daemon with its events on tcp:// (CURVE) and identity "router-a" (tenant a, no
    ``events`` right) reading its own tenants' streams on a socket of its own:
    (daemon, the daemon's events PUB endpoint, its replay endpoint)."""
    endpoint, pub, replay_endpoint, own = (f"tcp://127.0.0.1:{_free_port()}" for _ in range(4))
    keys["own_endpoint"] = own
    d = DaemonProcess(tmp_path, server={"tcp": endpoint}, auth=_own_events_auth(keys),
                      events={"enabled": True, "endpoint": pub, "replay_endpoint": replay_endpoint},
                      probe={"endpoint": endpoint, **_creds(keys, "y")}, **sections)
    d.tcp = endpoint
    return d.start(), pub, replay_endpoint


def _received(sock: zmq.Socket, until, what: str) -> list[list[bytes]]:
    """What ``sock`` receives until ``until(messages so far)`` holds."""
    out: list[list[bytes]] = []
    deadline = time.monotonic() + 60.0  # (a guard against hanging: a stream's beats come forever)
    while not until(out):
        assert time.monotonic() < deadline and sock.poll(30_000), f"never received {what}; received: " + ", ".join(
            f"{m[0].decode()}#{int.from_bytes(m[1], 'big')}: {[type(e).__name__ for e in decode(m[2]).events]}"
            for m in out)
        out.append(sock.recv_multipart())
    return out


def _joined(engine: ClientEngine, *subs: zmq.Socket) -> None:
    """Until each of ``subs`` has its subscription in place (a batch published before
    that is lost to it), ``engine`` stores a page of its own: then what it received is
    read and dropped."""
    waiting = set(subs)
    for seed in range(1000, 1100):
        engine.prefill(_tokens(seed, 1))
        waiting -= {sub for sub in waiting if sub.poll(200)}
        if not waiting:
            break
    assert not waiting, "a subscriber never joined"
    for sub in subs:
        while sub.poll(200):
            sub.recv_multipart()


def _stored_tokens(messages, topic: str | None = None) -> set[int]:
    return token_ids([m[2] for m in messages if topic is None or m[0] == topic.encode()])


def test_an_identity_reads_its_own_tenants_streams_on_its_own_socket(tmp_path, keys):
    """router-a (tenant a, no ``events`` right) subscribes to its ``events_endpoint``:
    it reads team-x's engine's stream (tenant a) and never team-y's (tenants b, b2); the
    daemon's events socket refuses it; its own socket refuses everyone else, an
    administrator included. The replay socket answers it for x's stream only: a
    one-frame (vLLM) request gets x's stream though y's is older, y's topic nothing."""
    d, pub, replay_endpoint = _own_events_daemon(tmp_path, keys)
    own = keys["own_endpoint"]
    subs = {who: events_socket(zmq.SUB, own, keys, who) for who in ("router", "x", "y", "stranger")}
    main = {who: events_socket(zmq.SUB, pub, keys, who) for who in ("router", "y")}
    replay, replay_monitor = events_socket(zmq.DEALER, replay_endpoint, keys, "router")
    engines = {}
    try:
        assert {who: handshake(m) for who, (_, m) in subs.items()} == {
            "router": "admitted", "x": "refused", "y": "refused", "stranger": "refused"}
        assert {who: handshake(m) for who, (_, m) in main.items()} == {"router": "refused", "y": "admitted"}
        assert handshake(replay_monitor) == "admitted"
        for who in ("y", "x"):  # (y's pool, and stream, first)
            engines[who] = ClientEngine(d.tcp, **_creds(keys, who))
        _joined(engines["x"], subs["router"][0], main["y"][0])
        secrets = {"y": _tokens(97, 2), "x": _tokens(96, 2)}
        for who in ("y", "x"):
            engines[who].prefill(secrets[who])
        topics = {who: str(engine.client.pool_id) for who, engine in engines.items()}
        # The administrator sees both streams; by then router-a's socket has had every batch it carries.
        _received(main["y"][0], lambda got: set(secrets["x"]) | set(secrets["y"]) <= _stored_tokens(got),
                  "both engines' blocks on the daemon's events socket")
        mine = _received(subs["router"][0], lambda got: set(secrets["x"]) <= _stored_tokens(got),
                         "team-x's blocks on router-a's socket")
        while subs["router"][0].poll(500):
            mine.append(subs["router"][0].recv_multipart())
        assert {m[0] for m in mine} == {topics["x"].encode()}
        assert not _stored_tokens(mine) & set(secrets["y"])
        assert not any(s.poll(0) for who, (s, _) in subs.items() if who != "router")
        assert set(secrets["x"]) <= token_ids(replayed(replay))  # (the oldest stream router-a reads)
        assert set(secrets["x"]) <= token_ids(replayed(replay, topics["x"]))
        assert replayed(replay, topics["y"]) == []
        log = d.log.read_text()
        assert "identity 'router-a' may not read the events (admin or events = true)" in log
        assert "identity 'team-y' may not read the events (the socket is 'router-a''s own)" in log
    finally:
        for engine in engines.values():
            engine.close()
        for sock, monitor in (*subs.values(), *main.values(), (replay, replay_monitor)):
            sock.close(0)
            monitor.close(0)
        d.stop()


def test_the_connections_on_each_events_socket_are_a_gauge(tmp_path, keys):
    """``hicache_kv_events_subscribers{socket}``: the connections open on the daemon's
    events socket (``daemon``) and on router-a's own (``own:router-a``). Those the
    sockets refuse are dropped, so they stop counting; one that closes is no longer
    counted."""
    port = _free_port()
    d, pub, _ = _own_events_daemon(tmp_path, keys, metrics={"enabled": True, "address": "127.0.0.1", "port": port})
    own = keys["own_endpoint"]
    subs = {who: events_socket(zmq.SUB, own, keys, who) for who in ("router", "stranger")}
    main = {who: events_socket(zmq.SUB, pub, keys, who) for who in ("router", "y", "x")}

    def counted(expected: dict[str, float], what: str) -> None:
        deadline = time.monotonic() + 30.0  # (a guard against hanging: the figures are refreshed every second)
        while {sock: scraped(port, "hicache_kv_events_subscribers", socket=sock) for sock in expected} != expected:
            assert time.monotonic() < deadline, f"never counted {what}"
            time.sleep(0.1)

    try:
        assert {who: handshake(m) for who, (_, m) in subs.items()} == {"router": "admitted", "stranger": "refused"}
        assert {who: handshake(m) for who, (_, m) in main.items()} == {
            "router": "refused", "y": "admitted", "x": "refused"}
        counted({"daemon": 1.0, "own:router-a": 1.0}, "the admitted subscribers alone")
        main["y"][0].close(0)
        counted({"daemon": 0.0, "own:router-a": 1.0}, "y's subscriber gone")
    finally:
        for sock, monitor in (*subs.values(), *main.values()):
            sock.close(0)
            monitor.close(0)
        d.stop()


def test_a_reload_that_moves_an_identity_to_other_tenants_clears_what_it_read(tmp_path, keys):
    """router-a moves from tenant a to team-y's tenants (b, b2): on its socket team-x's stream says
    ``AllBlocksCleared`` (and no block of x's any more), team-y's stream shows; the
    replay socket answers it for y's stream now (its blocks stored after the reload),
    and for x's nothing."""
    d, pub, replay_endpoint = _own_events_daemon(tmp_path, keys)
    sub, monitor = events_socket(zmq.SUB, keys["own_endpoint"], keys, "router")
    replay, replay_monitor = events_socket(zmq.DEALER, replay_endpoint, keys, "router")
    admin = _client(d, keys, "y")
    engines = {who: ClientEngine(d.tcp, **_creds(keys, who)) for who in ("x", "y")}
    try:
        assert handshake(monitor) == "admitted" and handshake(replay_monitor) == "admitted"
        topics = {who: str(engine.client.pool_id).encode() for who, engine in engines.items()}
        _joined(engines["x"], sub)
        first = _tokens(95, 2)
        engines["x"].prefill(first)
        _received(sub, lambda got: set(first) <= _stored_tokens(got), "team-x's blocks before the reload")
        d.rewrite(server={"tcp": d.tcp}, auth=_own_events_auth(keys, tenants=("b", "b2")),
                  events={"enabled": True, "endpoint": pub, "replay_endpoint": replay_endpoint})
        admin.reload()
        # (the sockets take their connections anew: what comes after is read once both are back)
        assert handshake(monitor) == "admitted" and handshake(replay_monitor) == "admitted"
        later = {"x": _tokens(94, 2), "y": _tokens(93, 2)}
        engines["x"].prefill(later["x"])
        engines["y"].prefill(later["y"])
        # (a batch sent before the socket has its subscription again is lost to it: y's blocks
        # may be, and come by replay — a stream new to a subscriber is one it replays)
        after = _received(sub, lambda got: any(m[0] == topics["y"] for m in got)
                          and any(m[0] == topics["x"] and decode(m[2]).events == [AllBlocksCleared()] for m in got),
                          "team-y's stream and team-x's clear")
        on_x = [decode(m[2]).events for m in after if m[0] == topics["x"]]
        cleared = on_x.index([AllBlocksCleared()])  # (before it: x's batches of before the reload)
        assert all(events == [AllBlocksCleared()] for events in on_x[cleared:]), on_x
        assert not _stored_tokens(after) & set(later["x"])
        assert set(later["y"]) <= token_ids(replayed(replay, topics["y"].decode()))
        assert replayed(replay, topics["x"].decode()) == []
    finally:
        admin.close()
        for engine in engines.values():
            engine.close()
        for sock in (sub, monitor, replay, replay_monitor):
            sock.close(0)
        d.stop()
