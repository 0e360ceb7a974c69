"""Every metric, read from a fresh registry after driving the tier manager and the daemon."""

import numpy as np
import pytest

from hicache.config import DaemonConfig
from hicache import protocol as p
from hicache.daemon.service import Daemon
from hicache.fdpass import FdExchange
from hicache.errors import LoadFailed
from hicache.keys import key_self_test, namespace_id
from hicache.metrics import DIRECTIONS, MISS_REASONS, OPS, SESSION_END_REASONS, TIERS, Metrics
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierConfig, TierManager
from hicache.transfer import PageMover
from hicache.tree import Place, Tier
from tiers_util import SPEC, Engine, wired

PS = SPEC.page_size
NS = namespace_id(SPEC.fingerprint)


def value(metrics, name, **labels):
    got = metrics.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_every_counter_exists_at_zero_from_the_start():
    metrics = Metrics()
    for op in OPS:
        assert metrics.registry.get_sample_value("hicache_requests_total", {"op": op, "status": "OK"}) == 0
    for tier in TIERS:
        assert metrics.registry.get_sample_value("hicache_matched_tokens_total", {"tier": tier}) == 0
        assert metrics.registry.get_sample_value("hicache_evicted_pages_total", {"tier": tier}) == 0
    for reason in MISS_REASONS:
        assert metrics.registry.get_sample_value("hicache_missed_tokens_total", {"reason": reason}) == 0
    for direction in DIRECTIONS:
        assert metrics.registry.get_sample_value("hicache_transfer_bytes_total", {"direction": direction}) == 0


def test_every_refusal_and_loss_counter_exists_at_zero_from_the_start():
    """What the daemon refuses, drops or ends is counted from zero, so that the first
    one shows in an increase() (a series born at 1 shows none): every reason the
    metrics' table lists."""
    metrics = Metrics()
    for reason in ("unknown_key", "unknown_user", "revoked", "events", "shed"):
        assert metrics.registry.get_sample_value("hicache_auth_refused_total", {"reason": reason}) == 0, reason
    for reason in SESSION_END_REASONS:
        assert metrics.registry.get_sample_value("hicache_sessions_ended_total", {"reason": reason}) == 0
    for tier in TIERS:
        assert metrics.registry.get_sample_value("hicache_pages_dropped_total", {"tier": tier}) == 0
    assert metrics.registry.get_sample_value("hicache_remote_pages_total", {"op": "put", "result": "skipped"}) == 0
    for op in ("loop", "envelope"):  # (a step the loop dropped; a message over the envelope's bounds)
        assert metrics.registry.get_sample_value("hicache_requests_total", {"op": op, "status": "DROPPED"}) == 0, op


def test_request_latency_histogram_buckets_are_cumulative_and_inclusive():
    """Counted on the owner thread, exported at scrape time: a value equal to a bound
    falls in that bound's bucket (Prometheus' ``le``), buckets are cumulative, ``+Inf``
    equals the count, the sum is the sum, and an error status is its own series."""
    metrics = Metrics()
    for seconds in (50e-6, 51e-6, 1e-6, 10.0):  # on a bound, just above it, below all, above all
        metrics.request("match", "OK", seconds)
    metrics.request("match", "UNKNOWN_SESSION", 1e-3)

    def bucket(le):
        return value(metrics, "hicache_request_duration_seconds_bucket", op="match", le=le)

    assert bucket("2.5e-05") == 1
    assert bucket("5e-05") == 2
    assert bucket("0.0001") == 3
    assert bucket("0.001") == 4
    assert bucket("5.0") == 4
    assert bucket("+Inf") == 5 == value(metrics, "hicache_request_duration_seconds_count", op="match")
    assert value(metrics, "hicache_request_duration_seconds_sum", op="match") == pytest.approx(10.0 + 1e-3 + 102e-6)
    assert value(metrics, "hicache_requests_total", op="match", status="OK") == 4
    assert value(metrics, "hicache_requests_total", op="match", status="UNKNOWN_SESSION") == 1
    assert value(metrics, "hicache_request_duration_seconds_count", op="lock") == 0


def test_the_daemon_process_reports_its_cpu_memory_and_start_time():
    """An operator sees a daemon that burns CPU while idle, or restarted, without
    another exporter."""
    import time

    metrics = Metrics()
    sample = metrics.registry.get_sample_value
    start = sample("process_start_time_seconds")
    assert start is not None and time.time() - 86400 < start <= time.time()  # a Unix time, of this process
    cpu = sample("process_cpu_seconds_total")
    assert cpu is not None and cpu > 0
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert sample("process_cpu_seconds_total") > cpu
    assert sample("process_resident_memory_bytes") > 0


@pytest.fixture
def engine():
    e = Engine(12)
    yield e
    e.close()


def test_tier_manager_transfers_and_evictions(engine, tmp_path):
    metrics = Metrics()
    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    tm = TierManager(SPEC, host_pages=8, storage=store, metrics=metrics)
    tm.add_namespace(NS)
    handle = tm.register_pool(0, [engine.pool])
    tokens = list(range(100, 100 + 3 * PS))
    pages = tm.alloc(0, 3)
    engine.compute(NS, tokens, pages)
    tm.insert(NS, tokens, 0, pages)
    tm.flush()
    page = SPEC.host_page_bytes
    assert value(metrics, "hicache_transfer_bytes_total", direction="d2h") == 3 * page
    assert value(metrics, "hicache_transfer_bytes_total", direction="host_to_disk") == 3 * page
    assert value(metrics, "hicache_transfer_duration_seconds_count", direction="d2h") == 1
    tm.evict(Tier.DEVICE, 3, 0)
    tm.evict(Tier.HOST, 3)
    tm.flush()
    assert value(metrics, "hicache_evicted_pages_total", tier="device") == 3
    assert value(metrics, "hicache_evicted_pages_total", tier="host") == 3
    node = tm.match(NS, tokens, 0).match.node
    tm.lock(node, 0)
    loaded = tm.wait(tm.load(node, 0))
    engine.wait(handle, loaded.wait)
    tm.unlock(node, 0)
    tm.flush()
    assert value(metrics, "hicache_transfer_bytes_total", direction="disk_to_host") == 3 * page
    assert value(metrics, "hicache_transfer_bytes_total", direction="h2d") == 3 * page
    assert value(metrics, "hicache_load_first_layer_seconds_count") == 1
    tm.evict(Tier.DEVICE, 3, 0)
    tm.evict(Tier.HOST, 3)
    tm.evict(Tier.DISK, 3)
    assert value(metrics, "hicache_evicted_pages_total", tier="disk") == 3
    assert tm.miss_reason(node.page_key_list()[0]) == "evicted_disk"
    tm.close()
    store.close()


def test_backups_and_disk_writes_that_fail_count_their_pages(engine, tmp_path, monkeypatch):
    """A store that refuses every write (a full or failing disk) and a copy engine that
    fails leave pages off the tier they were going to — not on disk, lost at a crash —
    or drop them where an eviction wanted them gone: counted by direction, not only
    logged."""
    from hicache.errors import StorageUnavailable

    metrics = Metrics()
    store = LmdbBackend(tmp_path / "db", capacity_bytes=64 * SPEC.host_page_bytes)
    tm = TierManager(SPEC, host_pages=8, storage=store, metrics=metrics, config=TierConfig(copy_threads=1))
    tm.add_namespace(NS)
    tm.register_pool(0, [engine.pool])

    def failed():
        return {d: value(metrics, "hicache_transfer_failed_pages_total", direction=d) for d in ("d2h", "host_to_disk")}

    def refused(*args, **kwargs):
        raise StorageUnavailable("no space left on the device")

    def broken(self, *args, **kwargs):
        raise OSError("the copy engine failed")

    def prompt(start, num_pages):
        tm.insert(NS, list(range(start, start + num_pages * PS)), 0, tm.alloc(0, num_pages))
        tm.flush()

    try:
        assert metrics.registry.get_sample_value("hicache_transfer_failed_pages_total", {"direction": "d2h"}) == 0
        monkeypatch.setattr(store, "put_batch", refused)
        prompt(100, 3)
        assert failed() == {"d2h": 0, "host_to_disk": 3}
        monkeypatch.setattr(PageMover, "backup", broken)
        prompt(500, 2)
        assert failed() == {"d2h": 2, "host_to_disk": 3}
        assert tm.tree.sizes(Tier.DISK).cached == 0 and tm.tree.sizes(Tier.HOST).cached == 3
    finally:
        tm.close()
        store.close()


def test_a_failed_load_is_reported_and_leaks_nothing(engine, monkeypatch):
    metrics = Metrics()
    tm = TierManager(SPEC, host_pages=8, metrics=metrics, config=TierConfig(copy_threads=1))
    tm.add_namespace(NS)
    handle = tm.register_pool(0, [engine.pool])
    tokens = list(range(100, 100 + 2 * PS))
    pages = tm.alloc(0, 2)
    tm.insert(NS, tokens, 0, pages)
    tm.flush()
    tm.evict(Tier.DEVICE, 2, 0)

    def broken(self, *args, **kwargs):
        raise OSError("the copy engine failed")

    def prompt(start, num_pages):
        tm.insert(NS, list(range(start, start + num_pages * PS)), 0, tm.alloc(0, num_pages))
        tm.flush()

    monkeypatch.setattr(PageMover, "load", broken)
    node = tm.match(NS, tokens, 0).match.node
    tm.lock(node, 0)
    loaded = tm.wait(tm.load(node, 0))
    waiter = handle.waiter()
    with pytest.raises(LoadFailed):
        waiter.wait_layer(loaded.wait[0], 0, timeout_s=30)
    tm.flush()
    assert node.device_pages(0) is None, "a failed load's pages are not handed out again as cached"
    assert value(metrics, "hicache_missed_tokens_total", reason="load_failed") == 2 * PS
    tm.unlock(node, 0)
    assert tm.accounting()[Place.device(0)].free == 12
    tm.check_invariants()
    waiter.close()
    tm.close()


def test_daemon_requests_hits_misses_sessions_and_occupancy(engine, tmp_path):
    config = DaemonConfig.load(overrides={"disk.enabled": False, "server.socket": str(tmp_path / "s"),
                                          "host.ratio": 1.0})
    daemon = Daemon(config, fds=FdExchange(tmp_path / "fds"))
    metrics = daemon.metrics
    hello = daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION))
    sid = hello.session
    wired(daemon, p.Register(id=2, session=sid, spec=SPEC.to_dict(), fingerprint=SPEC.fingerprint,
                             key_check=key_self_test(SPEC.fingerprint, PS),
                             pools=[engine.offered(daemon)]))
    tokens = np.arange(100, 100 + 3 * PS, dtype="<i4").tobytes()
    # Nothing of this namespace was ever inserted.
    daemon.handle(p.Match(id=3, session=sid, tokens=tokens, extra_key="nobody"))
    assert value(metrics, "hicache_missed_tokens_total", reason="namespace_unknown") == 3 * PS
    pages = daemon.handle(p.Alloc(id=4, session=sid, num_pages=3)).pages
    daemon.handle(p.Insert(id=5, session=sid, tokens=tokens, pages=pages))
    longer = tokens + np.arange(500, 500 + 2 * PS + 1, dtype="<i4").tobytes()
    daemon.handle(p.Match(id=6, session=sid, tokens=longer))
    assert value(metrics, "hicache_matched_tokens_total", tier="device") == 3 * PS
    assert value(metrics, "hicache_missed_tokens_total", reason="never_stored") == 2 * PS + 1
    (manager,) = daemon.managers.values()
    manager.flush()
    manager.evict(Tier.DEVICE, 3, daemon.sessions[sid].pool_id)
    reply = daemon.handle(p.Match(id=7, session=sid, tokens=tokens))
    assert reply.host_pages == 3
    # A host hit counts once a load has delivered it.
    assert value(metrics, "hicache_matched_tokens_total", tier="host") == 0
    daemon.handle(p.Lock(id=70, session=sid, node=reply.node))
    loaded = daemon.handle(p.Load(id=71, session=sid, node=reply.node))
    manager.flush()
    assert loaded.result().loaded_pages == 3
    assert value(metrics, "hicache_matched_tokens_total", tier="host") == 3 * PS
    assert value(metrics, "hicache_load_short_tokens_total") == 0
    daemon.handle(p.Unlock(id=72, session=sid, node=reply.node))
    manager.evict(Tier.DEVICE, 3, daemon.sessions[sid].pool_id)
    manager.evict(Tier.HOST, 3)
    daemon.handle(p.Match(id=8, session=sid, tokens=tokens))
    assert value(metrics, "hicache_missed_tokens_total", reason="evicted_host") == 3 * PS
    daemon.handle(p.Lock(id=9, session=sid, node=10**9))  # an error
    assert value(metrics, "hicache_requests_total", op="match", status="OK") == 4
    assert value(metrics, "hicache_requests_total", op="lock", status="UNKNOWN_NODE") == 1
    assert value(metrics, "hicache_request_duration_seconds_count", op="match") == 4
    daemon.refresh_snapshot()
    assert value(metrics, "hicache_sessions") == 1
    assert value(metrics, "hicache_pages", tier="device", state="free") == 12
    assert value(metrics, "hicache_pages", tier="host", state="free") == 12
    assert value(metrics, "hicache_build_info", version=hello.daemon.split()[1],
                 protocol_version=str(p.PROTOCOL_VERSION), mode="cpu") == 1
    daemon.handle(p.Bye(id=10, session=sid))
    assert value(metrics, "hicache_sessions_ended_total", reason="bye") == 1
    daemon.close()


def test_disk_figures(tmp_path):
    config = DaemonConfig.load(overrides={"disk.path": str(tmp_path / "db"), "server.socket": str(tmp_path / "s"),
                                          "disk.capacity_bytes": 1 << 20})
    daemon = Daemon(config, fds=FdExchange(tmp_path / "fds"))
    daemon.refresh_snapshot()
    metrics = daemon.metrics
    assert value(metrics, "hicache_disk_capacity_bytes") == 1 << 20
    assert value(metrics, "hicache_disk_records") == 0
    assert metrics.registry.get_sample_value("hicache_lmdb_map_size_bytes") > 0
    assert metrics.registry.get_sample_value("hicache_disk_corrupt_records_total") == 0
    daemon.close()


def test_a_queue_without_a_bound_has_no_limit_sample(engine, tmp_path):
    """hicache_queue_limit_pages is a bound: a queue without one (no disk writer: no
    disk tier, or no spec registered yet) has no sample, rather than a bound of 0 that a
    ratio divides by or that an empty queue is "at"."""
    config = DaemonConfig.load(overrides={"disk.enabled": False, "server.socket": str(tmp_path / "s"),
                                          "host.ratio": 1.0})
    daemon = Daemon(config, fds=FdExchange(tmp_path / "fds"))
    try:
        registry = daemon.metrics.registry
        daemon.refresh_snapshot()
        for queue in ("host_staging", "disk_write"):
            assert registry.get_sample_value("hicache_queue_pages", {"queue": queue}) == 0
            assert registry.get_sample_value("hicache_queue_limit_pages", {"queue": queue}) is None, queue
        sid = daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION)).session
        wired(daemon, p.Register(id=2, session=sid, spec=SPEC.to_dict(), fingerprint=SPEC.fingerprint,
                                 key_check=key_self_test(SPEC.fingerprint, PS), pools=[engine.offered(daemon)]))
        daemon.refresh_snapshot()
        assert registry.get_sample_value("hicache_queue_limit_pages", {"queue": "host_staging"}) == 12
        assert registry.get_sample_value("hicache_queue_limit_pages", {"queue": "disk_write"}) is None
    finally:
        daemon.close()
