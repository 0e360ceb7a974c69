"""Prometheus metrics.

Every metric is ``hicache_*``, in base units, with bounded label sets. Event counts are
counted where they happen (the daemon's request path, the tier manager's transfers and
evictions); occupancy is computed at scrape time by :class:`StateCollector` from the live
structures, never mirrored. Every counter exists, at zero, from the start.

=============================================  ======================================
metric                                          labels
=============================================  ======================================
hicache_requests_total                          op, status (``OK`` or an error code)
hicache_request_duration_seconds (histogram)    op
hicache_matched_tokens_total                    tier (device, host, disk)
hicache_missed_tokens_total                     reason (never_stored, evicted_device,
                                                evicted_host, evicted_disk,
                                                namespace_unknown, corrupt_record,
                                                load_failed)
hicache_transfer_bytes_total                    direction (d2h, h2d, host_to_disk,
                                                disk_to_host)
hicache_transfer_duration_seconds (histogram)   direction
hicache_load_first_layer_seconds (histogram)    —
hicache_evicted_pages_total                     tier (device, host, disk)
hicache_sessions_ended_total                    reason (bye, lease_expired, shutdown)
hicache_pages                          (gauge)  tier, state (free, private,
                                                cached_evictable, cached_protected,
                                                staging)
hicache_sessions                       (gauge)  —
hicache_disk_bytes / _records / _capacity_bytes, hicache_lmdb_map_size_bytes (gauges)
hicache_disk_corrupt_records_total              —
hicache_build_info                     (gauge)  version, protocol_version, mode
=============================================  ======================================
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")
STATES = ("free", "private", "cached_evictable", "cached_protected", "staging")
DIRECTIONS = ("d2h", "h2d", "host_to_disk", "disk_to_host")
MISS_REASONS = ("never_stored", "evicted_device", "evicted_host", "evicted_disk", "namespace_unknown",
                "corrupt_record", "load_failed")
SESSION_END_REASONS = ("bye", "lease_expired", "shutdown")
OPS = ("hello", "register", "match", "match_many", "lock", "unlock", "load", "alloc", "insert", "release",
       "heartbeat", "bye", "stats", "health", "flush", "check", "decode")

_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0, 5.0)
_TRANSFER_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class Metrics:
    """The event metrics, registered in ``registry`` (a fresh one per daemon or test)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total, process_resident_memory_bytes, process_start_time_seconds, ...
        ProcessCollector(registry=r)
        self.requests = Counter("hicache_requests", "Requests handled, by op and status", ["op", "status"],
                                registry=r)
        self.request_seconds = Histogram("hicache_request_duration_seconds", "Time to handle a request, by op",
                                         ["op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.matched_tokens = Counter("hicache_matched_tokens", "Tokens found cached by match, by tier", ["tier"],
                                      registry=r)
        self.missed_tokens = Counter("hicache_missed_tokens", "Tokens a match or load could not serve, by reason",
                                     ["reason"], registry=r)
        self.transfer_bytes = Counter("hicache_transfer_bytes", "Bytes moved between tiers, by direction",
                                      ["direction"], registry=r)
        self.transfer_seconds = Histogram("hicache_transfer_duration_seconds",
                                          "Time from a transfer's start to its completion, by direction",
                                          ["direction"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.first_layer_seconds = Histogram("hicache_load_first_layer_seconds",
                                             "Time from the start of a load's copies until layer 0 is usable",
                                             buckets=_TRANSFER_BUCKETS, registry=r)
        self.evicted_pages = Counter("hicache_evicted_pages", "Pages evicted, by tier", ["tier"], registry=r)
        self.sessions_ended = Counter("hicache_sessions_ended", "Sessions ended, by reason", ["reason"], registry=r)
        for op in OPS:
            self.requests.labels(op, "OK")
            self.request_seconds.labels(op)
        for tier in TIERS:
            self.matched_tokens.labels(tier)
            self.evicted_pages.labels(tier)
        for reason in MISS_REASONS:
            self.missed_tokens.labels(reason)
        for direction in DIRECTIONS:
            self.transfer_bytes.labels(direction)
            self.transfer_seconds.labels(direction)
        for reason in SESSION_END_REASONS:
            self.sessions_ended.labels(reason)
        self._request_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._matched = {tier: self.matched_tokens.labels(tier) for tier in TIERS}
        self._missed = {reason: self.missed_tokens.labels(reason) for reason in MISS_REASONS}

    # -- the observer interface the daemon and the tier manager call

    def request(self, op: str, status: str, seconds: float) -> None:
        children = self._request_children.get((op, status))
        if children is None:  # labels() costs microseconds: once per (op, status)
            children = self._request_children[(op, status)] = (
                self.requests.labels(op, status), self.request_seconds.labels(op))
        children[0].inc()
        children[1].observe(seconds)

    def matched(self, device: int, host: int, disk: int) -> None:
        if device:
            self._matched["device"].inc(device)
        if host:
            self._matched["host"].inc(host)
        if disk:
            self._matched["disk"].inc(disk)

    def missed(self, reason: str, tokens: int) -> None:
        if tokens:
            self._missed[reason].inc(tokens)

    def transfer(self, direction: str, num_bytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(direction).inc(num_bytes)
        self.transfer_seconds.labels(direction).observe(seconds)

    def first_layer(self, seconds: float) -> None:
        self.first_layer_seconds.observe(seconds)

    def evicted(self, tier: str, num_pages: int) -> None:
        if num_pages:
            self.evicted_pages.labels(tier).inc(num_pages)

    def session_ended(self, reason: str) -> None:
        self.sessions_ended.labels(reason).inc()

    def add_state_collector(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(StateCollector(snapshot))

    def serve(self, address: str, port: int):
        """Serve ``/metrics`` over HTTP (a daemon thread); returns the server."""
        server, _ = start_http_server(port, addr=address, registry=self.registry)
        logger.info("metrics on http://%s:%d/metrics", address, server.server_port)
        return server


class NullMetrics:
    """Metrics off: the same calls, doing nothing."""

    registry = None

    def request(self, op: str, status: str, seconds: float) -> None: ...
    def matched(self, device: int, host: int, disk: int) -> None: ...
    def missed(self, reason: str, tokens: int) -> None: ...
    def transfer(self, direction: str, num_bytes: int, seconds: float) -> None: ...
    def first_layer(self, seconds: float) -> None: ...
    def evicted(self, tier: str, num_pages: int) -> None: ...
    def session_ended(self, reason: str) -> None: ...
    def add_state_collector(self, snapshot: Callable[[], dict[str, Any]]) -> None: ...


class StateCollector:
    """Occupancy and inventory, read from the daemon at scrape time.

    ``snapshot()`` returns ``{"pages": {tier: {state: n}}, "sessions": n, "storage":
    StorageStats._asdict() or None, "build": {version, protocol_version, mode}}``; it is
    called from the HTTP thread, so it only reads plain counts.
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable:
        try:
            snap = self._snapshot()
        except Exception:  # a scrape must not take the daemon down; report no state
            logger.exception("metrics snapshot failed")
            return
        pages = GaugeMetricFamily("hicache_pages", "Pages by tier and state", labels=["tier", "state"])
        for tier in TIERS:
            counts = snap["pages"].get(tier, {})
            for state in STATES:
                pages.add_metric([tier, state], counts.get(state, 0))
        yield pages
        yield GaugeMetricFamily("hicache_sessions", "Engine sessions open", value=snap["sessions"])
        yield GaugeMetricFamily("hicache_oldest_lock_age_seconds",
                                "How long the oldest lock an engine still holds has been held (0: none)",
                                value=snap.get("oldest_lock_s", 0.0))
        storage = snap.get("storage")
        if storage is not None:
            yield GaugeMetricFamily("hicache_disk_bytes", "Payload bytes in the disk tier", value=storage["bytes"])
            yield GaugeMetricFamily("hicache_disk_records", "Records in the disk tier", value=storage["records"])
            yield GaugeMetricFamily("hicache_disk_capacity_bytes", "Disk tier capacity",
                                    value=storage["capacity_bytes"])
            yield GaugeMetricFamily("hicache_lmdb_map_size_bytes", "LMDB map size", value=storage["map_size_bytes"])
            yield CounterMetricFamily("hicache_disk_corrupt_records", "Disk records that failed a check on read",
                                      value=storage["corrupt_records"])
        build = GaugeMetricFamily("hicache_build_info", "Build information",
                                  labels=["version", "protocol_version", "mode"])
        info = snap["build"]
        build.add_metric([info["version"], str(info["protocol_version"]), info["mode"]], 1)
        yield build
