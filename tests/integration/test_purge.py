"""``purge``: a tenant's cached pages forgotten — on a real daemon (``hicache serve``,
host and disk tiers, LMDB) through the client and the command line — and nothing of any
other namespace."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from daemon_util import HICACHE, ClientEngine, DaemonProcess, RawPeer, run_hicache
from hicache import protocol as p
from hicache.client import CacheClient, RemoteError
from hicache.errors import ErrorCode
from tiers_util import SPEC

PS = SPEC.page_size


def _tokens(seed: int, pages: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30_000, pages * PS).tolist()


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path).start()
    yield d
    if d.proc is not None:
        d.stop()


def _started(daemon: DaemonProcess) -> CacheClient:
    """Start the daemon (again: on the same store) and connect an administrator."""
    daemon.start()
    return CacheClient(daemon.endpoint, heartbeat=False)


def _restarted(daemon: DaemonProcess) -> CacheClient:
    daemon.stop()
    return _started(daemon)


def _cached(engine: ClientEngine, tokens: list[int], extra_key: str = "") -> int:
    m = engine.client.match(tokens, extra_key)
    return m.num_tokens


def test_a_purged_extra_key_is_gone_from_every_tier_and_after_a_restart_and_nothing_else_is(daemon):
    """A user's pages (their cache salt's namespace) on device, host and disk are
    forgotten: misses from then on, and after a restart (the disk records are deleted,
    not just out of the tree); a prompt of theirs held by a lock stays until it is let
    go, then a purge again takes it. Pages of the same tokens under another extra key,
    and of no extra key, stay cached throughout."""
    engine = ClientEngine(daemon.endpoint)
    admin = CacheClient(daemon.endpoint, heartbeat=False)
    user, held, shared = _tokens(1, 3), _tokens(2, 2), _tokens(3, 2)
    try:
        engine.prefill(user, "user-42")
        engine.prefill(shared, "user-42")
        engine.prefill(shared, "user-7")  # (the same tokens, another user's: pages of their own)
        engine.prefill(shared)
        engine.prefill(held, "user-42")
        assert admin.flush()["not_on_disk_pages"] == 0
        m = engine.client.match(held, "user-42")
        engine.client.lock(m.handle)

        out = admin.purge("default", "user-42")
        assert out["namespaces"] == 1 and out["left_pages"] == len(held) // PS, out
        assert out["disk_pages"] == (len(user) + len(shared)) // PS, out  # (the held path's records stay)
        assert out["device_pages"] + out["host_pages"] >= (len(user) + len(shared)) // PS, out
        assert out["remote_pages"] == 0  # (no remote tier)
        assert _cached(engine, user, "user-42") == 0 and _cached(engine, shared, "user-42") == 0
        assert _cached(engine, held, "user-42") == len(held)  # (locked: still there)
        assert _cached(engine, shared, "user-7") == len(shared) and _cached(engine, shared) == len(shared)
        admin.check()

        engine.client.unlock(m.handle)
        out = admin.purge("default", "user-42")
        assert out["left_pages"] == 0 and out["disk_pages"] == len(held) // PS, out
        assert _cached(engine, held, "user-42") == 0
        assert admin.purge("default", "user-42") == {"namespaces": 1, "device_pages": 0, "host_pages": 0,
                                                     "disk_pages": 0, "remote_pages": 0, "left_pages": 0,
                                                     "remote_left_namespaces": 0}
        assert admin.purge("default", "never-used")["namespaces"] == 0
        admin.check()
    finally:
        engine.close()
        admin.close()
    daemon.stop()
    daemon.start()  # (the host tier is gone; the disk tier comes back)
    engine = ClientEngine(daemon.endpoint)
    try:
        for tokens in (user, shared, held):
            assert _cached(engine, tokens, "user-42") == 0
        assert _cached(engine, shared, "user-7") == len(shared) and _cached(engine, shared) == len(shared)
    finally:
        engine.close()


def test_purge_from_the_command_line_waits_for_what_a_lock_holds(daemon):
    """``hicache purge --tenant T`` forgets every namespace of the tenant, purging again
    while pages are held; it says what it dropped, and exits 2 if some were still held
    when ``--wait`` ran out (0 once nothing is left)."""
    engine = ClientEngine(daemon.endpoint)
    tokens = _tokens(4, 2)
    try:
        engine.prefill(tokens)
        engine.prefill(tokens, "salt")
        m = engine.client.match(tokens)
        engine.client.lock(m.handle)
        command = [HICACHE, "purge", "--endpoint", daemon.endpoint, "--tenant", "default", "--wait", "0.5"]
        (held,) = run_hicache(command)
        assert held.returncode == 2, held.stderr
        assert "2 namespaces" in held.stdout and f"{len(tokens) // PS} left" in held.stdout, held.stdout
        assert _cached(engine, tokens, "salt") == 0 and _cached(engine, tokens) == len(tokens)
        engine.client.unlock(m.handle)
        (done,) = run_hicache(command)
        assert done.returncode == 0 and "0 left" in done.stdout, (done.stdout, done.stderr)
        assert _cached(engine, tokens) == 0
    finally:
        engine.close()


def test_purge_is_for_administrators_and_checks_what_it_is_given(tmp_path):
    """With identities listed this process's user is no administrator: refused. Bad
    names, extra keys and types are refused too (the daemon keeps serving)."""
    d = DaemonProcess(tmp_path).start()
    admin = CacheClient(d.endpoint, heartbeat=False)
    try:
        for tenant, extra_key in (("a b", None), ("", None), ("x" * 65, None), ("default", "k" * 1025)):
            with pytest.raises(RemoteError) as excinfo:
                admin.purge(tenant, extra_key)
            assert excinfo.value.code == ErrorCode.INVALID_ARGUMENT, (tenant, extra_key)
        peer = RawPeer(d.endpoint)
        try:
            for fields in ({"tenant": 5}, {"tenant": ["default"]}, {"tenant": "default", "extra_key": 3}, {}):
                peer.send(msgspec.msgpack.encode({"op": "purge", "id": 9, **fields}))
                reply = peer.recv()
                assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, (fields, reply)
        finally:
            peer.close()
        assert admin.health().state == "serving"
    finally:
        admin.close()
        d.stop()
    d = DaemonProcess(tmp_path, auth={"identities": [{"name": "ops", "uids": [0x7FFF_FFF0]}]}).start()
    client = CacheClient(d.endpoint, heartbeat=False)
    try:
        with pytest.raises(RemoteError) as excinfo:
            client.purge("default")
        assert excinfo.value.code == ErrorCode.PERMISSION_DENIED
    finally:
        client.close()
        d.stop()


def test_a_purge_reaches_the_records_of_a_spec_no_engine_serves_now(daemon):
    """After a restart no engine has registered yet, so no tier manager holds the spec's
    pages: they are records in the store, which a registration would bring back. A
    purge of a user's (extra key) and then of a whole tenant finds their namespaces in
    the tenant log and deletes their records from the store: once an engine registers,
    and after another restart, they miss; another user's pages still hit."""
    engine = ClientEngine(daemon.endpoint)
    admin = CacheClient(daemon.endpoint, heartbeat=False)
    user, other, shared = _tokens(5, 3), _tokens(6, 2), _tokens(7, 2)
    try:
        engine.prefill(user, "user-42")
        engine.prefill(other, "user-7")
        engine.prefill(shared)
        assert admin.flush()["not_on_disk_pages"] == 0
    finally:
        engine.close()
        admin.close()
    admin = _restarted(daemon)
    try:
        out = admin.purge("default", "user-42")
        assert out["namespaces"] == 1 and out["disk_pages"] == len(user) // PS, out
        assert out["device_pages"] == out["host_pages"] == out["left_pages"] == 0, out
        engine = ClientEngine(daemon.endpoint)  # (the spec's tier manager: rebuilt from the store)
        try:
            assert _cached(engine, user, "user-42") == 0
            assert _cached(engine, other, "user-7") == len(other) and _cached(engine, shared) == len(shared)
        finally:
            engine.close()
    finally:
        admin.close()
    admin = _restarted(daemon)
    try:
        out = admin.purge("default")  # (the tenant's namespaces that the log names: user-42's again, gone)
        assert out["disk_pages"] == (len(other) + len(shared)) // PS, out
        engine = ClientEngine(daemon.endpoint)
        try:
            for tokens, extra_key in ((user, "user-42"), (other, "user-7"), (shared, "")):
                assert _cached(engine, tokens, extra_key) == 0, extra_key
        finally:
            engine.close()
        admin.check()
    finally:
        admin.close()


def _logged_extra_keys(directory) -> list[str]:
    """The extra keys of the tenant log's lines (``<store>/tenants``)."""
    lines = (directory / "lmdb" / "tenants").read_text().splitlines()
    return sorted(bytes.fromhex(line.split()[3]).decode() for line in lines)


def test_a_tenant_past_the_tenant_logs_bound_is_purged_whole_after_a_restart(tmp_path):
    """The tenant log keeps 3 namespaces a tenant here (``[disk].tenant_namespaces``).
    Two of a tenant's three are purged (by extra key: their lines stay); after a restart
    the tenant stores under two new extra keys — past the bound, so the log compacts to
    the namespaces that still hold pages, and then names the new ones. After another
    restart, before any engine registers, a purge of the tenant alone finds every
    namespace that holds pages, and deletes their records: none comes back."""
    daemon = DaemonProcess(tmp_path, disk={"tenant_namespaces": 3}).start()
    pages = {f"user-{i}": _tokens(20 + i, 2) for i in range(5)}
    engine = ClientEngine(daemon.endpoint)
    admin = CacheClient(daemon.endpoint, heartbeat=False)
    try:
        for key in ("user-0", "user-1", "user-2"):
            engine.prefill(pages[key], key)
        assert admin.flush()["not_on_disk_pages"] == 0
        for key in ("user-0", "user-1"):
            assert admin.purge("default", key)["disk_pages"] == 2
    finally:
        engine.close()
        admin.close()
        daemon.stop()
    assert _logged_extra_keys(tmp_path) == ["user-0", "user-1", "user-2"]
    daemon.start()
    engine = ClientEngine(daemon.endpoint)
    admin = CacheClient(daemon.endpoint, heartbeat=False)
    try:
        for key in ("user-3", "user-4"):
            engine.prefill(pages[key], key)
        assert admin.flush()["not_on_disk_pages"] == 0
        for _ in range(2400):  # (the compaction runs between requests: a few loop turns)
            if _logged_extra_keys(tmp_path) == ["user-2", "user-3", "user-4"]:
                break
            admin.health()
            time.sleep(0.05)
        assert _logged_extra_keys(tmp_path) == ["user-2", "user-3", "user-4"]
        admin.check()
    finally:
        engine.close()
        admin.close()
        daemon.stop()
    admin = _started(daemon)
    try:
        out = admin.purge("default")
        assert out["namespaces"] == 3 and out["disk_pages"] == 3 * 2, out
        engine = ClientEngine(daemon.endpoint)
        try:
            for key, tokens in pages.items():
                assert _cached(engine, tokens, key) == 0, key
        finally:
            engine.close()
        admin.check()
    finally:
        admin.close()
        daemon.stop()
