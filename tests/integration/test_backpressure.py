"""A disk that cannot keep up, behind a real daemon on a real socket: the daemon degrades
explicitly — the writer's queue stays within its bound, what does not fit is deferred and
counted, the backlog shows in the queue gauges and the alert on them fires — and nothing
is lost: every page stays cached somewhere, every hit counted is a page a load delivered,
``check`` passes, and after a flush every page is on disk."""

from __future__ import annotations

import gc
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hicache.config import DaemonConfig
from hicache.daemon.server import Server
from hicache.daemon.service import Daemon
from hicache.jobs import Completions
from hicache.keys import namespace_id, page_keys
from hicache.metrics import Metrics
from hicache.storage.lmdb_backend import LmdbBackend
from daemon_util import ClientEngine
from storage_util import SlowStore, stored_run
from tiers_util import SPEC

PS = SPEC.page_size
BACKLOG = 4  # pages the writer's queue may hold
ALERT_RULES = Path(__file__).parents[2] / "dashboards" / "prometheus" / "alerts.yml"


@pytest.fixture
def slow_daemon(tmp_path):
    config = DaemonConfig.load(overrides={
        "server.socket": str(tmp_path / "hicache.sock"), "metrics.enabled": False,
        "disk.path": str(tmp_path / "lmdb"), "disk.capacity_bytes": 4096 * SPEC.host_page_bytes,
        "host.bytes": 12 * SPEC.host_page_bytes,
        "tiers.write_policy": "write_through", "tiers.disk_policy": "write_through",
        "tiers.disk_write_backlog": BACKLOG,
    })
    store = SlowStore(LmdbBackend(tmp_path / "lmdb", capacity_bytes=config.disk.capacity_bytes), delay_s=0.02)
    wake = []
    daemon = Daemon(config, storage=store, metrics=Metrics(),
                    completions=Completions(wakeup=lambda: wake[0]() if wake else None))
    server = Server(config, daemon=daemon)
    wake.append(server._wake)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, name="daemon")
    thread.start()
    yield server, store
    store.open_gate()
    server.stop()
    thread.join(60)
    gc.unfreeze()  # (the served daemon froze this process's objects: give them back to the collector)
    assert not thread.is_alive()


def gauge(metrics: Metrics, name: str, queue: str) -> float:
    return metrics.registry.get_sample_value(name, {"queue": queue})


def wait_for(what: str, condition, timeout_s: float = 60.0) -> None:
    """Wait for an event (not a duration bound: the test fails only if it never comes)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


def test_a_disk_slower_than_the_traffic_degrades_explicitly_and_loses_nothing(slow_daemon, tmp_path):
    server, store = slow_daemon
    metrics = server.daemon.metrics
    value = metrics.registry.get_sample_value
    endpoint = server.endpoints[0]
    shared = list(range(1, PS + 1))
    prompts = [shared + [10_000 * i + j for j in range(2 * PS)] for i in range(1, 25)]
    reported = delivered = 0
    engines = [ClientEngine(endpoint, num_pages=16), ClientEngine(endpoint, num_pages=16)]
    try:
        first, second = engines

        def request(engine, tokens):
            nonlocal reported, delivered
            m, loaded, _ = engine.prefill(tokens, wait_for_pages=True)  # (checks the bytes it gets)
            reported += m.num_tokens
            delivered += len(loaded.device_pages) * PS

        # The disk stops: writes pile up to the queue's bound and no further.
        store.close_gate()
        for tokens in prompts[:3]:
            request(first, tokens)
        # (what HicacheTierBacklog looks at: the queue at 90 % of its bound, or deferred work)
        wait_for("the backlog in the queue gauges",
                 lambda: gauge(metrics, "hicache_queue_pages", "disk_write") >= 0.9 * BACKLOG
                 or gauge(metrics, "hicache_queue_pages", "disk_write_deferred") > 0)
        backlog = {q: gauge(metrics, "hicache_queue_pages", q) for q in ("disk_write", "disk_write_deferred",
                                                                           "backup_deferred")}
        limit = gauge(metrics, "hicache_queue_limit_pages", "disk_write")
        assert limit == BACKLOG and backlog["disk_write"] <= BACKLOG
        assert store.pages_in_flight <= BACKLOG
        # The disk comes back, slow: the rest of the traffic overruns it.
        store.open_gate()
        for tokens in prompts[3:]:
            request(first, tokens)
        for tokens in prompts:  # another engine asks for all of it again: host / disk hits
            request(second, tokens)
        assert store.max_pages_in_flight <= BACKLOG
        flushed = first.client.flush()  # (every load's completion has run: its hits are counted)
        first.client.stats()  # (and the requests' bookkeeping is settled)
        deferred = value("hicache_disk_writes_deferred_total") + value("hicache_backups_deferred_total")
        assert deferred > 0
        # Every hit counted is a page some load delivered; what fell short is counted apart.
        matched = sum(value("hicache_matched_tokens_total", {"tier": t}) for t in ("device", "host", "disk"))
        assert matched == delivered
        assert value("hicache_load_short_tokens_total") == reported - delivered
        assert value("hicache_matched_tokens_total", {"tier": "disk"}) + value(
            "hicache_matched_tokens_total", {"tier": "host"}) > 0
        # Nothing left the cache but from disk; everything is on disk after a flush.
        assert value("hicache_pages_dropped_total", {"tier": "device"}) == 0
        assert value("hicache_pages_dropped_total", {"tier": "host"}) == 0
        first.client.check()
        unique = len({tuple(t[: (k + 1) * PS]) for t in prompts for k in range(len(t) // PS)})
        assert store.stats().records == unique
        # The flush says so: everything durable, nothing waiting.
        assert flushed["on_disk_pages"] == unique and flushed["not_on_disk_pages"] == 0
        assert flushed["deferred_backups"] == 0
        for tokens in prompts:  # every page of every prompt, with its chain
            keys = page_keys(namespace_id(SPEC.fingerprint), tokens, PS)
            assert stored_run(store, keys) == len(keys)
    finally:
        for engine in engines:
            engine.close()
    assert_alert_fires(backlog, limit, tmp_path)


def assert_alert_fires(backlog: dict[str, float], limit: float, tmp_path) -> None:
    """The backlog this daemon showed, held for 15 minutes, fires HicacheTierBacklog
    (promtool evaluates the shipped rule on those series)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (Debian/Ubuntu: apt-get install prometheus)")
    labels = 'job="hicache", instance="slow:9477"'
    series = [f"      - series: 'hicache_queue_pages{{{labels}, queue=\"{q}\"}}'\n        values: '{v:g}x15'\n"
              for q, v in backlog.items()]
    series.append(f"      - series: 'hicache_queue_limit_pages{{{labels}, queue=\"disk_write\"}}'\n"
                  f"        values: '{limit:g}x15'\n")
    test = (f"rule_files:\n  - {ALERT_RULES}\nevaluation_interval: 1m\ntests:\n"
            "  - interval: 1m\n    input_series:\n" + "".join(series) +
            "    promql_expr_test:\n"
            "      - expr: ALERTS{alertname=\"HicacheTierBacklog\", alertstate=\"firing\"}\n"
            "        eval_time: 12m\n        exp_samples:\n"
            "          - labels: 'ALERTS{alertname=\"HicacheTierBacklog\", alertstate=\"firing\", "
            f"severity=\"warning\", {labels}}}'\n            value: 1\n")
    path = tmp_path / "backlog_test.yml"
    path.write_text(test)
    run = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
