"""Identities, tenants and quotas without sockets: the [auth] configuration, the
identity table, the ZAP handler's answers, namespaces per tenant, client keys, and the
daemon's checks (tenant, administrator, request rate with an injected clock, lock
quota, reload)."""

import os
import zlib

import numpy as np
import pytest
import zmq

from hicache import protocol as p
from hicache.auth import ClientKeys, read_secret, write_keypair
from hicache.config import DaemonConfig
from hicache.daemon.auth import (
    EVENTS_REPLAY_ZAP_DOMAIN, EVENTS_ZAP_DOMAIN, ZAP_DOMAIN, IdentityTable, ZapHandler, own_events_domain,
)
from hicache.errors import ErrorCode, InvalidArgument
from hicache.keys import namespace_id
from test_daemon_service import Clock, engines, error, ok, session  # noqa: F401 (engines: a fixture)
from tiers_util import SPEC

KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a valid Z85 public key (40 characters)
KEY2 = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"


def auth(*identities, **keys) -> dict:
    return {"auth": {**keys, "identities": list(identities)}}


def config(data: dict) -> DaemonConfig:
    return DaemonConfig.from_dict(data)


def test_the_auth_section_is_validated(tmp_path):
    c = config(auth({"name": "a", "public_keys": [KEY], "tenants": ["t1", "t2"], "max_locks": 3}))
    (identity,) = c.auth.identities
    assert identity.tenants == ("t1", "t2") and identity.public_keys == (KEY,) and identity.max_locks == 3
    bad = [
        auth({"name": "a"}, {"name": "a"}),  # names repeat
        auth({"name": "a", "public_keys": [KEY]}, {"name": "b", "public_keys": [KEY]}),  # a key twice
        auth({"name": "a", "public_keys": ["short"]}),
        auth({"name": "a b"}),  # not a label
        auth({"name": "a", "tenants": []}),
        auth({"name": "a", "tenants": ["x|y"]}),
        auth({"name": "a", "uids": [-1]}),
        auth({"name": "a", "max_locks": -1}),
        auth({"name": "a", "public_keys": KEY}),  # a string, not a list
        auth({"name": "a", "frobnicate": 1}),
        {"auth": {"identities": {"name": "a"}}},  # a table, not an array of tables
        {"server": {"tcp": "tcp://127.0.0.1:7400"}},  # tcp:// without CURVE
        {"auth": {"curve_ipc": True}},  # CURVE on ipc:// without a key pair
        {"events": {"endpoint": "tcp://127.0.0.1:7401"}},  # KV events on tcp:// without CURVE
        {"events": {"replay_endpoint": "tcp://127.0.0.1:7401"}},
        auth({"name": "a", "events": 1}),
    ]
    for data in bad:
        with pytest.raises(InvalidArgument):
            config(data)
    assert config({"server": {"tcp": "tcp://127.0.0.1:7400"}, "auth": {"insecure_tcp": True}}).server.tcp
    assert config({"events": {"endpoint": "tcp://127.0.0.1:7401", "insecure_tcp": True}}).events.uses_tcp
    assert config({"events": {"endpoint": "tcp://127.0.0.1:7401"},
                   "auth": {"secret_key_file": str(tmp_path / "server.key_secret")}}).events.uses_tcp  # CURVE
    with pytest.raises(InvalidArgument):
        make_daemon_with(auth({"name": "a"}, default_identity="nobody"), tmp_path)


def test_an_events_endpoint_is_validated_against_the_daemons_sockets(tmp_path):
    """An identity's own KV events socket: ipc:// or tcp:// (with CURVE: its subscribers
    are told apart by key), one identity's only, none of the daemon's own endpoints, and
    only with the KV events on."""
    key_file = str(tmp_path / "server.key_secret")
    own = {"name": "r", "tenants": ["a"], "events_endpoint": "ipc:///run/r-events.sock"}
    on = {"events": {"enabled": True}}
    c = config({**auth(own), **on})
    assert c.auth.identities[0].events_endpoint == "ipc:///run/r-events.sock"
    assert config({**auth({**own, "events_endpoint": "tcp://127.0.0.1:7402"}, secret_key_file=key_file), **on})
    bad = [
        ("events_endpoint is ipc", {**auth({**own, "events_endpoint": "udp://x"}), **on}),
        ("events_endpoint must be str", {**auth({**own, "events_endpoint": 7402}), **on}),
        ("one identity only", {**auth(own, {**own, "name": "s"}), **on}),
        ("needs CURVE", {**auth({**own, "events_endpoint": "tcp://127.0.0.1:7402"}), **on}),
        ("enabled = true", auth(own)),
        ("taken by the daemon", {**auth({**own, "events_endpoint": "ipc:///run/e.sock"}),
                                 "events": {"enabled": True, "endpoint": "ipc:///run/e.sock"}}),
        ("taken by the daemon", {**auth({**own, "events_endpoint": "ipc:///run/h.sock"}),
                                 "server": {"socket": "/run/h.sock"}, **on}),
        ("taken by the daemon", {**auth({**own, "events_endpoint": "ipc:///run/hicache-events-replay.sock"}),
                                 "server": {"socket": "/run/h.sock"}, **on}),
    ]
    for match, data in bad:
        with pytest.raises(InvalidArgument, match=match):
            config(data)


def make_daemon_with(data, directory, clock=None):
    from hicache.daemon.service import Daemon
    from hicache.fdpass import FdExchange

    directory.mkdir(parents=True, exist_ok=True)
    values = {"disk": {"enabled": False}, "server": {"socket": str(directory / "s.sock"), "lease_s": 5.0},
              "host": {"ratio": 1.0}, "metrics": {"enabled": False}, **data}
    return Daemon(DaemonConfig.from_dict(values), clock=clock or Clock(), fds=FdExchange(directory / "fds"))


def test_the_table_resolves_keys_users_and_the_default():
    table = IdentityTable(config(auth({"name": "k", "public_keys": [KEY]}, {"name": "u", "uids": [1001]},
                                      {"name": "g", "gids": [2002]})).auth)
    assert table.resolve("CURVE", "127.0.0.1", KEY.encode()).name == "k"
    assert table.resolve("CURVE", "127.0.0.1", KEY2.encode()) is None  # unknown key: never the default
    assert table.resolve("NULL", "localhost:1001:5:9").name == "u"
    assert table.resolve("NULL", "localhost:7:2002:9").name == "g"
    assert table.resolve("NULL", "localhost:7:7:9").name == "default"  # the built-in default
    assert not table.by_name["default"].admin  # beside listed identities: admin is granted by listing it
    assert table.resolve("NULL", "localhost:bad") is None
    assert table.resolve("NULL", "127.0.0.1") is None  # plain tcp:// only with insecure_tcp
    assert table.resolve("PLAIN", "localhost:1001:5:9") is None
    strict = IdentityTable(config(auth({"name": "u", "uids": [1001]}, default_identity="")).auth)
    assert strict.resolve("NULL", "localhost:7:7:9") is None and strict.default is None
    insecure = IdentityTable(config({"auth": {"insecure_tcp": True}}).auth)
    assert insecure.resolve("NULL", "10.0.0.1").name == "default"
    assert insecure.by_name["default"].admin  # a daemon without [auth] is as it was
    assert insecure.by_name["default"].max_sessions == 0  # the only identity: [server].max_sessions is its


def test_each_identity_has_a_share_of_the_sessions():
    table = IdentityTable(config(auth({"name": "k", "public_keys": [KEY]}, {"name": "few", "max_sessions": 3},
                                      max_sessions_per_identity=10)).auth)
    assert table.by_name["k"].max_sessions == 10 and table.by_name["few"].max_sessions == 3
    assert table.by_name["default"].max_sessions == 10  # the built-in default beside them, too
    assert IdentityTable(config(auth({"name": "k"})).auth).by_name["k"].max_sessions == 64
    for bad in (auth({"name": "k"}, max_sessions_per_identity=0), auth({"name": "k", "max_sessions": -1})):
        with pytest.raises(InvalidArgument):
            config(bad)


def test_the_zap_handler_answers_every_request():
    table = IdentityTable(config(auth({"name": "k", "public_keys": [KEY]})).auth)
    refused = []
    context = zmq.Context()
    zap = ZapHandler(context, lambda: table, refused.append)
    try:
        raw_key = zmq.utils.z85.decode(KEY.encode())
        ok_reply = zap.answer([b"1.0", b"7", ZAP_DOMAIN, b"127.0.0.1", b"", b"CURVE", raw_key])
        assert ok_reply[:4] == [b"1.0", b"7", b"200", b"OK"]
        assert ok_reply[4] == f"k|CURVE|127.0.0.1|{KEY}".encode()
        for request in ([], [b"1.0"], [b"2.0", b"1", ZAP_DOMAIN, b"", b"", b"NULL"],
                        [b"1.0", b"1", b"other", b"localhost:0:0:1", b"", b"NULL"],  # not our domain
                        [b"1.0", b"1", ZAP_DOMAIN, b"127.0.0.1", b"", b"CURVE", b"\0" * 32],
                        [b"1.0", b"1", ZAP_DOMAIN, b"127.0.0.1", b"", b"CURVE", b"short"],
                        [b"1.0", b"1", ZAP_DOMAIN, b"\xff\xfe", b"", b"\xff"]):
            reply = zap.answer(request)
            assert reply[2] in (b"400",) and len(reply) == 6, request
        assert refused.count("unknown_key") == 2
    finally:
        zap.close()
        context.term()


def _status_of(zap: ZapHandler):
    """``status(domain, mechanism, address, key="")``: ``zap``'s status code for such a
    connection."""
    def status(domain: bytes, mechanism: bytes, address: bytes, key: str = "") -> bytes:
        credentials = [zmq.utils.z85.decode(key.encode())] if key else []
        return zap.answer([b"1.0", b"1", domain, address, b"", mechanism, *credentials])[2]

    return status


def test_the_zap_handler_admits_to_the_events_only_identities_allowed_to_read_them():
    """The KV events carry every tenant's token ids: their domain admits administrators
    and identities with ``events = true``, not any other identity the server's socket
    takes (nor, as there, a peer no identity names)."""
    table = IdentityTable(config(auth({"name": "router", "public_keys": [KEY], "events": True},
                                      {"name": "engine", "public_keys": [KEY2]},
                                      {"name": "ops", "uids": [1001], "admin": True},
                                      default_identity="")).auth)
    refused = []
    context = zmq.Context()
    zap = ZapHandler(context, lambda: table, refused.append)
    status = _status_of(zap)
    try:
        assert status(EVENTS_ZAP_DOMAIN, b"CURVE", b"127.0.0.1", KEY) == b"200"
        assert status(EVENTS_ZAP_DOMAIN, b"NULL", b"localhost:1001:5:9") == b"200"  # an administrator
        assert status(EVENTS_ZAP_DOMAIN, b"CURVE", b"127.0.0.1", KEY2) == b"400"
        assert status(ZAP_DOMAIN, b"CURVE", b"127.0.0.1", KEY2) == b"200"  # (the server's socket takes it)
        assert status(EVENTS_ZAP_DOMAIN, b"NULL", b"localhost:7:7:9") == b"400"  # no identity, no default
        assert refused == ["events", "unknown_user"]
        table = IdentityTable(config({}).auth)  # no [auth]: every local peer is the default administrator
        assert status(EVENTS_ZAP_DOMAIN, b"NULL", b"localhost:7:7:9") == b"200"
    finally:
        zap.close()
        context.term()


def test_an_identitys_own_events_socket_admits_that_identity_alone():
    """Identity "tenant-router" reads its tenants' streams on a socket of its own: its
    domain admits it and nobody else — not an administrator, not another identity with
    its own socket; the daemon's PUB socket does not admit it (every tenant's streams);
    the replay socket admits both kinds of reader and nobody else."""
    table = IdentityTable(config({**auth({"name": "tenant-router", "public_keys": [KEY], "tenants": ["a"],
                                          "events_endpoint": "ipc:///run/own.sock"},
                                         {"name": "other", "public_keys": [KEY2], "tenants": ["b"],
                                          "events_endpoint": "ipc:///run/other.sock"},
                                         {"name": "ops", "uids": [1001], "admin": True},
                                         {"name": "engine", "uids": [1002]}, default_identity=""),
                                  "events": {"enabled": True}}).auth)
    refused = []
    context = zmq.Context()
    zap = ZapHandler(context, lambda: table, refused.append)
    status = _status_of(zap)
    router, other = (b"CURVE", b"127.0.0.1", KEY), (b"CURVE", b"127.0.0.1", KEY2)
    ops, engine = (b"NULL", b"localhost:1001:5:9"), (b"NULL", b"localhost:1002:5:9")
    try:
        mine = own_events_domain("tenant-router")
        assert [status(mine, *who) for who in (router, other, ops, engine)] == [b"200", b"400", b"400", b"400"]
        assert status(own_events_domain("no-such-identity"), *ops) == b"400"
        assert [status(EVENTS_ZAP_DOMAIN, *who) for who in (router, ops)] == [b"400", b"200"]
        replay = [status(EVENTS_REPLAY_ZAP_DOMAIN, *who) for who in (router, other, ops, engine)]
        assert replay == [b"200", b"200", b"200", b"400"]
        assert refused == ["events"] * 6
        assert table.by_name["tenant-router"].event_tenants == frozenset({"a"})
        assert table.by_name["ops"].event_tenants is None
    finally:
        zap.close()
        context.term()


def test_namespaces_per_tenant():
    fp = SPEC.fingerprint
    assert namespace_id(fp, "k", "default") == namespace_id(fp, "k") == namespace_id(fp, "k", "")
    named = {namespace_id(fp, extra, tenant) for tenant in ("a", "b", "ab") for extra in (None, "a", "b", "x")}
    assert len(named) == 12
    legacy = {namespace_id(fp, extra) for extra in (None, "a", "b", "ab", "x", "a|x", "ab|x")}
    assert not named & legacy  # no extra key of the default tenant reaches a named tenant's namespace


def test_client_keys(tmp_path, monkeypatch):
    server_public, _ = write_keypair(tmp_path / "server")
    public, secret = write_keypair(tmp_path / "client")
    monkeypatch.delenv("HICACHE_SERVER_KEY", raising=False)
    monkeypatch.delenv("HICACHE_CLIENT_KEY_FILE", raising=False)
    assert ClientKeys.load() is None
    keys = ClientKeys.load(server_public, secret)  # the server's .key file
    assert keys.public_key == read_secret(secret)[0] and len(keys.server_key) == 40
    assert ClientKeys.load(keys.server_key.decode(), secret) == keys  # or the key itself
    monkeypatch.setenv("HICACHE_SERVER_KEY", str(server_public))
    monkeypatch.setenv("HICACHE_CLIENT_KEY_FILE", str(secret))
    assert ClientKeys.load() == keys
    with pytest.raises(InvalidArgument):
        ClientKeys.load("x" * 39, secret)  # neither a key nor a readable file
    monkeypatch.delenv("HICACHE_CLIENT_KEY_FILE")
    with pytest.raises(InvalidArgument, match="key pair"):
        ClientKeys.load(server_public)
    os.chmod(secret, 0o644)
    with pytest.raises(InvalidArgument, match="readable by others"):
        ClientKeys.load(server_public, secret)
    os.chmod(secret, 0o600)
    mixed = tmp_path / "mixed.key_secret"
    other_secret = read_secret(write_keypair(tmp_path / "other")[1])[1]
    mixed.write_text(f'curve\n    public-key = "{read_secret(secret)[0].decode()}"\n'
                     f'    secret-key = "{other_secret.decode()}"\n')
    os.chmod(mixed, 0o600)
    with pytest.raises(InvalidArgument, match="not a pair"):
        ClientKeys.load(server_public, mixed)
    with pytest.raises(InvalidArgument, match="exists"):
        write_keypair(tmp_path / "client")


def _me(**fields) -> dict:
    return {"name": "me", "uids": [os.getuid()], **fields}


def test_tenants_admin_and_reload_through_the_daemon(tmp_path, engines):
    daemon = make_daemon_with(auth(_me(tenants=["a", "b"])), tmp_path)
    try:
        sid = session(daemon, engines())
        tokens = np.arange(2 * SPEC.page_size, dtype=np.int32).tobytes()
        ok(daemon.handle(p.Match(id=3, session=sid, tokens=tokens)))
        ok(daemon.handle(p.Match(id=3, session=sid, tokens=tokens, tenant="b")))
        pages = ok(daemon.handle(p.Alloc(id=3, session=sid, num_pages=2))).pages
        for request in (p.Match(id=3, session=sid, tokens=tokens, tenant="c"),
                        p.Match(id=3, session=sid, tokens=tokens, tenant="default"),
                        p.MatchMany(id=3, session=sid, tokens=[tokens], tenant="c"),
                        p.Insert(id=3, session=sid, tokens=tokens, pages=pages, tenant="c"),
                        p.Store(id=3, session=sid, tokens=tokens, pages=pages, tenant="c"),
                        p.Stats(id=3), p.Flush(id=3), p.Check(id=3), p.Reload(id=3)):
            error(daemon.handle(request), ErrorCode.PERMISSION_DENIED)
        ok(daemon.handle(p.Health(id=3)))
        # A reload that drops tenant b: the session stays (same identity), b is refused now.
        daemon.reload_source = lambda: config(auth(_me(tenants=["a"], admin=True))).auth
        assert daemon.reload_auth(daemon.reload_source()) == (2, 0)  # "me" and the built-in default
        error(daemon.handle(p.Match(id=3, session=sid, tokens=tokens, tenant="b")), ErrorCode.PERMISSION_DENIED)
        ok(daemon.handle(p.Stats(id=3)))  # an administrator now
        reply = ok(daemon.handle(p.Reload(id=3)))
        assert (reply.identities, reply.sessions_ended) == (2, 0)
        # A reload without this user: its session ends (revoked), and nothing is left of it.
        daemon.reload_auth(config(auth({"name": "other", "uids": [os.getuid() + 1]}, default_identity="")).auth)
        error(daemon.handle(p.Match(id=3, session=sid, tokens=tokens)), ErrorCode.UNKNOWN_SESSION)
        assert not daemon.sessions
        error(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION)), ErrorCode.PERMISSION_DENIED)
    finally:
        daemon.close()


def test_request_rate_with_an_injected_clock(tmp_path, engines):
    clock = Clock()
    daemon = make_daemon_with(auth(_me(requests_per_s=2.0, admin=True)), tmp_path, clock)
    try:
        hello = ok(daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION)))
        ok(daemon.handle(p.Stats(id=2)))  # the bucket holds two
        error(daemon.handle(p.Stats(id=3)), ErrorCode.RESOURCE_EXHAUSTED)
        for _ in range(5):
            ok(daemon.handle(p.Heartbeat(id=4, session=hello.session)))  # never refused
            ok(daemon.handle(p.Health(id=4)))
        clock.now += 0.5  # one more request's worth
        ok(daemon.handle(p.Stats(id=5)))
        error(daemon.handle(p.Stats(id=6)), ErrorCode.RESOURCE_EXHAUSTED)
        clock.now += 100.0  # refills to its burst of one second's worth, no more
        ok(daemon.handle(p.Stats(id=7)))
        ok(daemon.handle(p.Stats(id=8)))
        error(daemon.handle(p.Stats(id=9)), ErrorCode.RESOURCE_EXHAUSTED)
    finally:
        daemon.close()


def test_a_connection_the_server_does_not_know_is_nobody(tmp_path):
    """Requests handled without a socket are this process's user's; a connection the
    server has no identity for (say, one a reload just refused) is not, whatever the
    table's default."""
    from hicache.daemon.sessions import PeerCreds

    daemon = make_daemon_with(auth(_me(admin=True)), tmp_path)
    try:
        ok(daemon.handle(p.Stats(id=1)))
        daemon.peer_creds = lambda peer: PeerCreds(None, None, None, "", mechanism="NONE")
        for request in (p.Hello(id=2, version=p.PROTOCOL_VERSION), p.Stats(id=3), p.Check(id=4)):
            error(daemon.handle(request), ErrorCode.PERMISSION_DENIED)
    finally:
        daemon.close()


def test_stored_pages_count_as_their_tenants_after_a_restart(tmp_path, engines):
    """The namespaces' tenants are kept next to the disk tier: after a restart, the pages
    read back from disk are tenant a's again before any request names them."""
    store = {"disk": {"enabled": True, "path": str(tmp_path / "lmdb"), "capacity_bytes": 64 * SPEC.host_page_bytes}}
    tokens = np.arange(3 * SPEC.page_size, dtype=np.int32).tobytes()
    daemon = make_daemon_with({**auth(_me(tenants=["a", "b"], admin=True)), **store}, tmp_path / "one")
    try:
        sid = session(daemon, engines())
        pages = ok(daemon.handle(p.Alloc(id=2, session=sid, num_pages=3))).pages
        ok(daemon.handle(p.Insert(id=3, session=sid, tokens=tokens, pages=pages, tenant="b")))
        flushed = daemon.handle(p.Flush(id=4))
        while not flushed.done():
            daemon.poll(0.01)
        assert ok(daemon.handle(p.Stats(id=5))).stats.tenants["b"] == {"host_pages": 3, "disk_pages": 3}
    finally:
        daemon.close()
    lines = (tmp_path / "lmdb" / "tenants").read_text().splitlines()
    assert len(lines) == 1 and lines[0].split(" ")[2] == "b"
    with open(tmp_path / "lmdb" / "tenants", "a") as f:
        f.write("not a line\nzz 00 a\n")  # skipped, not fatal
    daemon = make_daemon_with({**auth(_me(tenants=["a", "b"], admin=True)), **store}, tmp_path / "two")
    try:
        session(daemon, engines())  # (registration rebuilds the disk tier)
        assert ok(daemon.handle(p.Stats(id=5))).stats.tenants == {"b": {"host_pages": 0, "disk_pages": 3}}
    finally:
        daemon.close()


def test_only_namespaces_that_store_pages_are_kept(tmp_path, engines):
    """Lookups naming ever new extra keys (a per-request salt, a hostile client) leave
    nothing behind — neither the tree's tenant of a namespace nor a line in the tenant
    log; a namespace is recorded when pages are stored in it."""
    store = {"disk": {"enabled": True, "path": str(tmp_path / "lmdb"), "capacity_bytes": 64 * SPEC.host_page_bytes}}
    daemon = make_daemon_with({**auth(_me(tenants=["a", "b"], admin=True)), **store}, tmp_path)
    log = tmp_path / "lmdb" / "tenants"
    tokens = np.arange(2 * SPEC.page_size, dtype=np.int32).tobytes()
    try:
        sid = session(daemon, engines())
        (manager,) = daemon.managers.values()
        for i in range(2000):
            ok(daemon.handle(p.Match(id=1, session=sid, tokens=tokens, extra_key=f"salt-{i}")))
        ok(daemon.handle(p.MatchMany(id=2, session=sid, tokens=[tokens], extra_key="salt-x", tenant="b")))
        assert not manager.tree.namespaces_of({"a", "b", "default"})
        assert not log.exists() or not log.read_text()
        pages = ok(daemon.handle(p.Alloc(id=3, session=sid, num_pages=2))).pages
        ok(daemon.handle(p.Insert(id=4, session=sid, tokens=tokens, pages=pages, extra_key="kept", tenant="b")))
        kept = namespace_id(SPEC.fingerprint, "kept", "b")
        assert manager.tree.namespaces_of({"a", "b", "default"}) == {kept}
        assert [line.split(" ")[:3] for line in log.read_text().splitlines()] == [[SPEC.fingerprint.hex(),
                                                                                   kept.hex(), "b"]]
        ok(daemon.handle(p.Match(id=5, session=session(daemon, engines()), tokens=tokens, extra_key="kept",
                                 tenant="b")))
        assert len(log.read_text().splitlines()) == 1
    finally:
        daemon.close()


def test_one_tenant_cannot_fill_the_tenant_log(tmp_path):
    from hicache.daemon.tenant_log import TenantLog

    fp = SPEC.fingerprint
    log = TenantLog(tmp_path / "tenants", max_entries=3)
    for i in range(10):
        log.note(fp, namespace_id(fp, f"junk-{i}", "a"), "a")
    log.note(fp, namespace_id(fp, "x", "b"), "b")
    log.close()
    lines = (tmp_path / "tenants").read_text().splitlines()
    assert [line.split()[2] for line in lines] == ["a", "a", "a", "b"]
    again = TenantLog(tmp_path / "tenants", max_entries=3)  # the counts per tenant come back with the log
    again.note(fp, namespace_id(fp, "junk-x", "a"), "a")
    again.note(fp, namespace_id(fp, "y", "b"), "b")
    again.close()
    assert len((tmp_path / "tenants").read_text().splitlines()) == 5
    assert set(again.tenants_of(fp).values()) == {"a", "b"}


def test_a_torn_or_damaged_line_of_the_tenant_log_names_no_tenant(tmp_path):
    """A power loss mid-append leaves the log's last line cut short — ``<fp> <ns> team``
    of ``<fp> <ns> team-a``: that must not give the namespace to tenant ``team`` (whose
    quota its pages would count against), nor swallow the line the restarted daemon
    appends next; a line whose bytes changed on disk names no tenant either. The lines
    before them still count, and a log of the old format (no checksums) is still read."""
    from hicache.daemon.tenant_log import TenantLog

    fp = SPEC.fingerprint
    path = tmp_path / "tenants"
    kept, torn, flipped, later = (namespace_id(fp, key, "team-a") for key in ("kept", "torn", "flipped", "later"))
    mine = namespace_id(fp, "mine", "team")
    log = TenantLog(path)
    log.note(fp, kept, "team-a")
    log.note(fp, flipped, "team-a")
    log.note(fp, mine, "team")
    log.note(fp, torn, "team-a")
    log.close()
    data = path.read_bytes()
    flip_at = data.index(flipped.hex().encode())
    line_end = data.index(b"\n", flip_at)
    data = data[:flip_at] + data[flip_at:line_end].replace(b"team-a", b"team-b") + data[line_end:]
    path.write_bytes(data[: data.rindex(b"team-a") + len("team")])  # torn in the tenant's name
    again = TenantLog(path)
    assert again.tenants_of(fp) == {kept: "team-a", mine: "team"}
    again.note(fp, later, "team-a")
    again.close()
    assert TenantLog(path).tenants_of(fp) == {kept: "team-a", mine: "team", later: "team-a"}
    old = tmp_path / "old-tenants"
    old.write_text(f"{fp.hex()} {kept.hex()} team-a\n{fp.hex()} {mine.hex()} team\n")  # before checksums
    assert TenantLog(old).tenants_of(fp) == {kept: "team-a", mine: "team"}


def test_the_tenant_log_keeps_each_namespaces_extra_key(tmp_path):
    """The extra key goes with its namespace's line — any characters, a space included —
    and comes back with the log; a namespace without one, or of a line written before
    extra keys were kept, has none."""
    from hicache.daemon.tenant_log import TenantLog

    fp = SPEC.fingerprint
    path = tmp_path / "tenants"
    salted, plain, old = namespace_id(fp, "lora a/é", "a"), namespace_id(fp, None, "a"), namespace_id(fp, "x", "b")
    log = TenantLog(path)
    log.note(fp, salted, "a", "lora a/é")
    log.note(fp, plain, "a")
    log.close()
    with path.open("a") as f:
        text = f"{fp.hex()} {old.hex()} b"
        f.write(f"{text} {zlib.crc32(text.encode()):08x}\n")  # (a line of the format before extra keys)
    again = TenantLog(path)
    assert again.tenants_of(fp) == {salted: "a", plain: "a", old: "b"}
    assert [again.extra_key(ns) for ns in (salted, plain, old)] == ["lora a/é", None, None]


def test_a_reload_that_takes_a_tenant_away_takes_the_sessions_handles_to_its_pages_too(tmp_path, engines):
    """An identity's session matched tenant b's cached pages, then a reload took b from
    the identity (the session lives on: same identity). The handle it was given must not
    go on reaching b's pages: locking or loading the node is PERMISSION_DENIED, while a
    lock taken before the reload can still be given back; tenant a's nodes are served
    as before."""
    from hicache.tree import Tier
    from test_daemon_service import answered

    daemon = make_daemon_with(auth(_me(tenants=["a", "b"])), tmp_path)
    try:
        sid = session(daemon, engines())
        manager, pool_id = daemon.sessions[sid].manager, daemon.sessions[sid].pool_id
        tokens = np.arange(2 * SPEC.page_size, dtype=np.int32).tobytes()
        for tenant in ("a", "b"):
            pages = ok(daemon.handle(p.Alloc(id=3, session=sid, num_pages=2))).pages
            ok(daemon.handle(p.Insert(id=4, session=sid, tokens=tokens, pages=pages, tenant=tenant)))
        manager.flush()
        manager.evict(Tier.DEVICE, 4, pool_id)  # (on host only: a load copies them into the pool)
        nodes = {}
        for tenant in ("a", "b"):
            m = ok(daemon.handle(p.Match(id=5, session=sid, tokens=tokens, tenant=tenant)))
            assert m.host_pages == 2, m
            nodes[tenant] = m.node
        ok(daemon.handle(p.Lock(id=6, session=sid, node=nodes["b"])))
        daemon.reload_auth(config(auth(_me(tenants=["a"]))).auth)
        for request in (p.Lock(id=7, session=sid, node=nodes["b"]), p.Load(id=8, session=sid, node=nodes["b"])):
            error(answered(daemon, daemon.handle(request)), ErrorCode.PERMISSION_DENIED)
        ok(daemon.handle(p.Unlock(id=9, session=sid, node=nodes["b"])))
        ok(daemon.handle(p.Lock(id=10, session=sid, node=nodes["a"])))
        assert ok(answered(daemon, daemon.handle(p.Load(id=11, session=sid, node=nodes["a"])))).loaded_pages == 2
        ok(daemon.handle(p.Unlock(id=12, session=sid, node=nodes["a"])))
        manager.check_invariants()
        daemon.sessions.check_invariants()
    finally:
        daemon.close()
