"""Prometheus metrics.

Every metric is ``hicache_*``, in base units, with bounded label sets. Event counts are
counted where they happen (the daemon's request path, the tier manager's transfers and
evictions); the per-request ones are plain counts on the owner thread, turned into
Prometheus families at scrape time by ``_RequestCollector``. Occupancy and inventory are
served at scrape time by :class:`StateCollector` from a snapshot that the daemon copies on
its owner thread (``Daemon.refresh_snapshot``, redone every half second by the loop): the
scrape runs on the HTTP thread and never walks live structures. Every counter exists, at
zero, from the start. The loss counters are also ``stats``' ``losses``
(:meth:`Metrics.losses`): the daemon counts whether or not it serves ``/metrics``.

=============================================  ======================================
metric                                          labels
=============================================  ======================================
hicache_requests_total                          op, status (``OK`` or an error code;
                                                op ``loop``, status ``DROPPED``: a step
                                                the loop dropped; op ``envelope``, status
                                                ``DROPPED``: a message over the
                                                envelope's bounds, read and dropped)
hicache_request_duration_seconds (histogram)    op
hicache_matched_tokens_total                    tier (device, host, disk): tokens served
                                                from the cache — device pages when a
                                                match hands them out, host / disk pages
                                                when a load has delivered them
hicache_missed_tokens_total                     reason (never_stored, evicted_device,
                                                evicted_host, evicted_disk,
                                                namespace_unknown, corrupt_record,
                                                load_failed, unreadable_record: a disk
                                                record no read could get (I/O errors
                                                at every try), no_room: cached, but no
                                                room to load it now, no_counter_slot:
                                                cached, but every counter slot of the
                                                pool held a load in flight — raise
                                                [tiers] counter_slots)
hicache_load_short_tokens_total                 — (tokens a match reported on host / disk
                                                that the load could not bring)
hicache_transfer_bytes_total                    direction (d2h, h2d, host_to_disk,
                                                disk_to_host, host_to_remote,
                                                remote_to_host)
hicache_transfer_duration_seconds (histogram)   direction
hicache_transfer_failed_pages_total             direction (d2h, host_to_disk: pages of
                                                backups and disk writes that failed —
                                                not on the tier they were going to, or
                                                dropped where an eviction wanted them gone)
hicache_load_first_layer_seconds (histogram)    —
hicache_evicted_pages_total                     tier (device, host, disk)
hicache_pages_dropped_total                     tier (device, host, disk): pages that left
                                                the cache from their last tier — disk: the
                                                disk tier's capacity (with a remote
                                                write-back: those it did not put, skipped
                                                or failed); device / host: never written to
                                                disk (lost, under write-through)
hicache_purged_pages_total                      tier (device, host, disk, remote): pages a
                                                purge (an administrator's) deleted — remote:
                                                objects removed from the remote tier's store
hicache_backups_deferred_total                  — (device -> host backups the host tier
                                                had no room for yet: retried, not dropped)
hicache_disk_writes_deferred_total              — (host -> disk writes over the writer's
                                                queue bound: retried, not dropped)
hicache_remote_lookups_total                    result (hit, miss, recent_miss: not asked
                                                again within miss_ttl_s, unavailable: the remote
                                                tier is down; busy: its queue is full)
hicache_remote_pages_total                      op, result (get: hit, missing — gone since
                                                the lookup —, corrupt — failed a check,
                                                read as missing; put: ok, deferred — the
                                                queue full: put later —, skipped — the
                                                tier down, too much deferred, no room)
hicache_remote_errors_total                     op (lookup, get, put, purge): calls that failed
hicache_remote_up                      (gauge)  — (0 while the remote tier is marked down;
                                                only with a remote tier)
hicache_sessions_ended_total                    reason (bye, lease_expired, replaced: its
                                                engine's client gave up on it and said
                                                hello again, shutdown, pool_gone,
                                                revoked: its identity, key or user is no
                                                longer allowed after a reload)
hicache_auth_refused_total                      reason (unknown_key: a CURVE key no identity
                                                lists; unknown_user: an ipc:// user none
                                                names; revoked: a message of a connection
                                                a reload no longer allows; events: a KV
                                                events subscriber whose identity may not
                                                read them; shed: a new connection dropped
                                                near the descriptor limit)
hicache_quota_refused_total                     identity, quota (locks, requests, sessions:
                                                requests refused; host_pages, disk_pages: copies to
                                                that tier not made, the identity's own
                                                pages being all protected)
hicache_tenant_pages                   (gauge)  tenant, tier (host, disk): pages cached for
                                                each tenant (every spec together;
                                                "unattributed": namespaces whose tenant
                                                is not known — kept across restarts in
                                                <store>/tenants, up to a bound)
hicache_pages                          (gauge)  tier, state (free, private,
                                                cached_evictable, cached_protected,
                                                staging)
hicache_sessions                       (gauge)  —
hicache_oldest_lock_age_seconds        (gauge)  — (0 when no lock is held)
hicache_queue_pages                    (gauge)  queue (backup_deferred, host_staging,
                                                disk_write, disk_write_deferred,
                                                load_waiting)
hicache_queue_limit_pages              (gauge)  queue (the bounded ones: host_staging,
                                                disk_write; absent while a queue has no
                                                bound — no spec registered, no disk tier)
hicache_disk_bytes / _records / _capacity_bytes, hicache_lmdb_map_size_bytes (gauges)
hicache_disk_corrupt_records_total              —
hicache_disk_unreadable_pages_total             — (pages forgotten on disk because reads
                                                of their records kept failing with an I/O
                                                error: a bad sector; computed again. A
                                                write-back's read fails once: counted then)
hicache_kv_events_total / _event_batches_total  — (with [events]: events and batches published;
hicache_kv_events_dropped_total                   dropped: lost before the wire, each loss
                                                  restarting its stream with a snapshot)
hicache_kv_events_subscribers          (gauge)  socket (daemon: the daemon's PUB socket;
                                                own:<identity>: an identity's own): the
                                                connections open on it (with [events])
hicache_checkpoints                    (gauge)  tier (device, host, disk): recurrent-state
                                                checkpoints held (specs with state layers
                                                only; device: copies in the state slots
                                                engines lend, every pool together)
hicache_checkpoint_host_slots          (gauge)  — (host slots for them: ``host_checkpoints``)
hicache_checkpoint_events_total                 event (offered: taken from an engine's
                                                insert; restored: copied into a request's
                                                state slot; lost: gone with its last copy
                                                while its node stayed — its host or device
                                                slot taken while on no disk, or its disk
                                                record, the only copy, evicted by the store
                                                or unreadable; refused: an offer found no
                                                free slot)
hicache_build_info                     (gauge)  version, protocol_version, mode
=============================================  ======================================
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from hicache.tree import Tier

logger = logging.getLogger(__name__)

TIERS = tuple(tier.label for tier in Tier)  # device, host, disk
PURGED_TIERS = (*TIERS, "remote")
STATES = ("free", "private", "cached_evictable", "cached_protected", "staging")
DIRECTIONS = ("d2h", "h2d", "host_to_disk", "disk_to_host", "host_to_remote", "remote_to_host")
FAILED_DIRECTIONS = ("d2h", "host_to_disk")  # (a failed load is a miss: load_failed; a remote call, remote_errors)
REMOTE_LOOKUPS = ("hit", "miss", "recent_miss", "unavailable", "busy")
REMOTE_PAGES = (("get", "hit"), ("get", "missing"), ("get", "corrupt"), ("put", "ok"), ("put", "deferred"),
                ("put", "skipped"))
REMOTE_OPS = ("lookup", "get", "put", "purge")
QUEUES = ("backup_deferred", "host_staging", "disk_write", "disk_write_deferred", "load_waiting")
BOUNDED_QUEUES = ("host_staging", "disk_write")
MISS_REASONS = ("never_stored", "evicted_device", "evicted_host", "evicted_disk", "namespace_unknown",
                "corrupt_record", "load_failed", "unreadable_record", "no_room", "no_counter_slot")
SESSION_END_REASONS = ("bye", "lease_expired", "replaced", "shutdown", "pool_gone", "revoked")
AUTH_REFUSALS = ("unknown_key", "unknown_user", "revoked", "events", "shed")
QUOTAS = ("locks", "requests", "host_pages", "disk_pages", "sessions")
OPS = ("hello", "register", "attach", "match", "match_many", "lock", "unlock", "load", "alloc", "insert", "release",
       "store", "load_into", "heartbeat", "bye", "stats", "health", "flush", "check", "reload", "decode")
DROPPED_OPS = ("loop", "envelope")  # status DROPPED: a step the loop dropped, a message over the envelope's bounds

_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0, 5.0)
_TRANSFER_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


CHECKPOINT_EVENTS = ("offered", "restored", "lost", "refused")


class Metrics:
    """The event metrics, registered in ``registry`` (a fresh one per daemon or test)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total, process_resident_memory_bytes, process_start_time_seconds, ...
        ProcessCollector(registry=r)
        # Per-request figures (requests, their latency, matched and missed tokens) are
        # plain counts on the owner thread, exported at scrape time by _RequestCollector.
        self.request_counts: dict[tuple[str, str], int] = {(op, "OK"): 0 for op in OPS}
        self.request_counts.update(((op, "DROPPED"), 0) for op in DROPPED_OPS)
        self.latency_buckets: dict[str, list[int]] = {op: [0] * (len(_LATENCY_BUCKETS) + 1) for op in OPS}
        self.latency_sum: dict[str, float] = dict.fromkeys(OPS, 0.0)
        self.matched_tokens: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.missed_tokens: dict[str, int] = dict.fromkeys(MISS_REASONS, 0)
        self.short_tokens = 0
        r.register(_RequestCollector(self))
        self.transfer_bytes = Counter("hicache_transfer_bytes", "Bytes moved between tiers, by direction",
                                      ["direction"], registry=r)
        self.transfer_failed_pages = Counter("hicache_transfer_failed_pages",
                                             "Pages of transfers that failed, by direction", ["direction"],
                                             registry=r)
        self.transfer_seconds = Histogram("hicache_transfer_duration_seconds",
                                          "Time from a transfer's start to its completion, by direction",
                                          ["direction"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.first_layer_seconds = Histogram("hicache_load_first_layer_seconds",
                                             "Time from the start of a load's copies until layer 0 is usable",
                                             buckets=_TRANSFER_BUCKETS, registry=r)
        self.evicted_pages = Counter("hicache_evicted_pages", "Pages evicted, by tier", ["tier"], registry=r)
        self.dropped_pages = Counter("hicache_pages_dropped",
                                     "Pages that left the cache from their last tier, by that tier", ["tier"],
                                     registry=r)
        self.purged_pages = Counter("hicache_purged_pages", "Pages purges deleted, by tier", ["tier"], registry=r)
        for tier in PURGED_TIERS:
            self.purged_pages.labels(tier)
        self.backups_deferred = Counter("hicache_backups_deferred",
                                        "Backups the host tier had no room for yet (retried, not dropped)", registry=r)
        self.disk_writes_deferred = Counter(
            "hicache_disk_writes_deferred", "Disk writes over the writer's queue bound (retried, not dropped)",
            registry=r)
        self.disk_unreadable_pages = Counter(
            "hicache_disk_unreadable_pages",
            "Pages forgotten on disk because reads of their records failed with an I/O error", registry=r)
        self.sessions_ended = Counter("hicache_sessions_ended", "Sessions ended, by reason", ["reason"], registry=r)
        self.auth_refusals = Counter("hicache_auth_refused", "Connections (or their messages) refused, by reason",
                                     ["reason"], registry=r)
        for reason in AUTH_REFUSALS:
            self.auth_refusals.labels(reason)
        self.quota_refusals = Counter("hicache_quota_refused", "Requests refused over an identity's quota",
                                      ["identity", "quota"], registry=r)
        for tier in TIERS:
            self.evicted_pages.labels(tier)
            self.dropped_pages.labels(tier)
        for direction in DIRECTIONS:
            self.transfer_bytes.labels(direction)
            self.transfer_seconds.labels(direction)
        for direction in FAILED_DIRECTIONS:
            self.transfer_failed_pages.labels(direction)
        for reason in SESSION_END_REASONS:
            self.sessions_ended.labels(reason)
        self.remote_lookups = Counter("hicache_remote_lookups", "Remote tier lookups after a local hit, by result",
                                      ["result"], registry=r)
        self.remote_pages_moved = Counter("hicache_remote_pages", "Pages got from or put to the remote tier",
                                          ["op", "result"], registry=r)
        self.remote_errors = Counter("hicache_remote_errors", "Remote tier calls that failed, by op", ["op"],
                                     registry=r)
        self._remote_up: Gauge | None = None  # (registered with a remote tier: see remote_up)
        for result in REMOTE_LOOKUPS:
            self.remote_lookups.labels(result)
        for op, result in REMOTE_PAGES:
            self.remote_pages_moved.labels(op, result)
        for op in REMOTE_OPS:
            self.remote_errors.labels(op)

    def request(self, op: str, status: str, seconds: float) -> None:
        """Owner thread only. A dict and a list bump (~0.5 us) where prometheus_client's
        labelled counter and histogram took ~3.5 us (locks, a Python loop over the
        buckets) on every request."""
        key = (op, status)
        counts = self.request_counts
        counts[key] = counts.get(key, 0) + 1
        buckets = self.latency_buckets.get(op)
        if buckets is None:
            buckets = self.latency_buckets[op] = [0] * (len(_LATENCY_BUCKETS) + 1)
            self.latency_sum[op] = 0.0
        buckets[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum[op] += seconds

    def matched(self, device: int, host: int, disk: int) -> None:
        tokens = self.matched_tokens
        if device:
            tokens["device"] += device
        if host:
            tokens["host"] += host
        if disk:
            tokens["disk"] += disk

    def missed(self, reason: str, tokens: int) -> None:
        if tokens:
            self.missed_tokens[reason] += tokens

    def load_short(self, tokens: int) -> None:
        """A load brought ``tokens`` fewer than the match had reported (owner thread)."""
        self.short_tokens += tokens

    def transfer(self, direction: str, num_bytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(direction).inc(num_bytes)
        self.transfer_seconds.labels(direction).observe(seconds)

    def transfer_failed(self, direction: str, num_pages: int) -> None:
        if num_pages:
            self.transfer_failed_pages.labels(direction).inc(num_pages)

    def first_layer(self, seconds: float) -> None:
        self.first_layer_seconds.observe(seconds)

    def evicted(self, tier: Tier, num_pages: int) -> None:
        if num_pages:
            self.evicted_pages.labels(tier.label).inc(num_pages)

    def dropped(self, tier: Tier, num_pages: int) -> None:
        if num_pages:
            self.dropped_pages.labels(tier.label).inc(num_pages)

    def purged(self, tier: str, num_pages: int) -> None:
        if num_pages:
            self.purged_pages.labels(tier).inc(num_pages)

    def backup_deferred(self) -> None:
        self.backups_deferred.inc()

    def disk_write_deferred(self) -> None:
        self.disk_writes_deferred.inc()

    def disk_unreadable(self, num_pages: int) -> None:
        if num_pages:
            self.disk_unreadable_pages.inc(num_pages)

    def session_ended(self, reason: str) -> None:
        self.sessions_ended.labels(reason).inc()

    def remote_lookup(self, result: str) -> None:
        self.remote_lookups.labels(result).inc()

    def remote_pages(self, op: str, result: str, num_pages: int) -> None:
        if num_pages:
            self.remote_pages_moved.labels(op, result).inc(num_pages)

    def remote_error(self, op: str) -> None:
        self.remote_errors.labels(op).inc()

    def remote_up(self, up: bool) -> None:
        """The remote tier answers, or not (the gauge exists once a remote tier does)."""
        if self._remote_up is None:
            self._remote_up = Gauge("hicache_remote_up", "1 while the remote tier answers (0: marked down)",
                                    registry=self.registry)
        self._remote_up.set(1 if up else 0)

    def auth_refused(self, reason: str) -> None:
        """Any thread (the ZAP handler's too)."""
        self.auth_refusals.labels(reason).inc()

    def quota_refused(self, identity: str, quota: str) -> None:
        self.quota_refusals.labels(identity, quota).inc()

    def identities(self, names: Iterable[str]) -> None:
        """The configured identities' quota counters exist at zero (bounded: the config
        names them)."""
        for name in names:
            for quota in QUOTAS:
                self.quota_refusals.labels(name, quota)

    def losses(self) -> dict[str, Any]:
        """What the loss counters say (``stats``' ``losses``; the KV events' and the
        checkpoints' are counted where they happen and added by the daemon)."""
        return {"pages_dropped": {tier: n for (tier,), n in _values(self.dropped_pages).items()},
                "transfer_failed_pages": {d: n for (d,), n in _values(self.transfer_failed_pages).items()},
                "remote_put_skipped_pages": _values(self.remote_pages_moved)[("put", "skipped")],
                "sessions_expired": _values(self.sessions_ended)[("lease_expired",)]}

    def add_state_collector(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(StateCollector(snapshot))

    def serve(self, address: str, port: int):
        """Serve ``/metrics`` over HTTP (a daemon thread); returns the server."""
        server, _ = start_http_server(port, addr=address, registry=self.registry)
        logger.info("metrics on http://%s:%d/metrics", address, server.server_port)
        return server


def _values(counter: Counter) -> dict[tuple[str, ...], int]:
    """A labelled counter's value per label values (its children's ``_total`` samples)."""
    (family,) = counter.collect()
    return {tuple(s.labels.values()): int(s.value) for s in family.samples if s.name.endswith("_total")}


class SpecMetrics:
    """A tier manager's metrics: the daemon's (:attr:`metrics`), every call passed on,
    but the token figures (:meth:`~Metrics.matched`, :meth:`~Metrics.missed`,
    :meth:`~Metrics.load_short`) count only while :attr:`counts_tokens`. It is off for a
    spec whose serving pools all are a TP engine's ranks but the first (registered with
    ``counts_tokens=False``: see :class:`hicache.foreign.OwnedPoolHandle`): each rank's
    spec holds its shard of the same tokens, and the first rank's spec counts them. The
    rest — bytes moved, pages evicted, dropped — count in every spec: they are each
    shard's own."""

    def __init__(self, metrics: "Metrics | NullMetrics") -> None:
        self.metrics = metrics
        self.counts_tokens = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metrics, name)

    def matched(self, device: int, host: int, disk: int) -> None:
        if self.counts_tokens:
            self.metrics.matched(device, host, disk)

    def missed(self, reason: str, tokens: int) -> None:
        if self.counts_tokens:
            self.metrics.missed(reason, tokens)

    def load_short(self, tokens: int) -> None:
        if self.counts_tokens:
            self.metrics.load_short(tokens)


class NullMetrics:
    """Metrics off: the same calls, doing nothing."""

    registry = None

    def request(self, op: str, status: str, seconds: float) -> None: ...
    def matched(self, device: int, host: int, disk: int) -> None: ...
    def missed(self, reason: str, tokens: int) -> None: ...
    def load_short(self, tokens: int) -> None: ...
    def transfer(self, direction: str, num_bytes: int, seconds: float) -> None: ...
    def transfer_failed(self, direction: str, num_pages: int) -> None: ...
    def first_layer(self, seconds: float) -> None: ...
    def evicted(self, tier: Tier, num_pages: int) -> None: ...
    def dropped(self, tier: Tier, num_pages: int) -> None: ...
    def purged(self, tier: str, num_pages: int) -> None: ...
    def backup_deferred(self) -> None: ...
    def disk_write_deferred(self) -> None: ...
    def disk_unreadable(self, num_pages: int) -> None: ...
    def session_ended(self, reason: str) -> None: ...
    def remote_lookup(self, result: str) -> None: ...
    def remote_pages(self, op: str, result: str, num_pages: int) -> None: ...
    def remote_error(self, op: str) -> None: ...
    def remote_up(self, up: bool) -> None: ...
    def auth_refused(self, reason: str) -> None: ...
    def quota_refused(self, identity: str, quota: str) -> None: ...
    def identities(self, names: Iterable[str]) -> None: ...
    def losses(self) -> None: ...  # (nothing counts them: stats has no losses)
    def add_state_collector(self, snapshot: Callable[[], dict[str, Any]]) -> None: ...


class _RequestCollector:
    """The per-request figures of :class:`Metrics` as Prometheus families, at scrape time
    (the HTTP thread). Copies are taken first: the owner thread keeps counting while a
    scrape runs, so a histogram's sum may lead its count by a request — never a
    decreasing counter."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable:
        m = self._metrics
        requests = CounterMetricFamily("hicache_requests", "Requests handled, by op and status",
                                       labels=["op", "status"])
        for (op, status), count in sorted(dict(m.request_counts).items()):
            requests.add_metric([op, status], count)
        yield requests
        latency = HistogramMetricFamily("hicache_request_duration_seconds", "Time to handle a request, by op",
                                        labels=["op"])
        bounds = [floatToGoString(b) for b in _LATENCY_BUCKETS] + ["+Inf"]
        for op, buckets in sorted(dict(m.latency_buckets).items()):
            cumulative = list(itertools.accumulate(list(buckets)))
            latency.add_metric([op], list(zip(bounds, cumulative)), sum_value=m.latency_sum.get(op, 0.0))
        yield latency
        for name, doc, label, values in (
                ("hicache_matched_tokens", "Tokens served from the cache (device: by match; host, disk: by a "
                 "load that delivered them), by tier", "tier", m.matched_tokens),
                ("hicache_missed_tokens", "Tokens a match or load could not serve, by reason", "reason",
                 m.missed_tokens)):
            family = CounterMetricFamily(name, doc, labels=[label])
            for key, count in dict(values).items():
                family.add_metric([key], count)
            yield family
        yield CounterMetricFamily("hicache_load_short_tokens",
                                  "Tokens a match reported on host or disk that the load could not bring",
                                  value=m.short_tokens)


class StateCollector:
    """Occupancy and inventory, read from the daemon at scrape time.

    ``snapshot()`` returns the dict the daemon last copied on its owner thread::

        {"pages": {tier: {state: n}},        # tier: device (all pools), host, disk
         "sessions": n,
         "storage": StorageStats._asdict() or None (no disk tier),
         "oldest_lock_s": seconds,           # age of the oldest lock held, 0.0 if none
         "queues": {queue: [pages, limit or None]},  # every spec together
         "tenants": {tenant: [host pages, disk pages]},  # every spec together
         "events": {"events": n, "batches": n, "dropped": n, "subscribers": {socket: n}} or absent (no [events]),
         "checkpoints": {"host": n, "disk": n, "host_slots": n, "offered": n, ...} or absent
                        (no spec with state layers yet; the events keep the counts of
                        specs let go),
         "build": {"version": ..., "protocol_version": ..., "mode": "cpu" or "gpu"}}

    It is called from the HTTP thread, so it must only hand over that copy.
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
        queues = GaugeMetricFamily("hicache_queue_pages", "Pages in each queue between the tiers",
                                   labels=["queue"])
        limits = GaugeMetricFamily("hicache_queue_limit_pages", "The bound of each bounded queue between the tiers",
                                   labels=["queue"])
        for queue in QUEUES:
            pages_in, limit = snap.get("queues", {}).get(queue, (0, None))
            queues.add_metric([queue], pages_in)
            if queue in BOUNDED_QUEUES and limit is not None:  # (no bound yet, or none: no sample, not a 0)
                limits.add_metric([queue], limit)
        yield queues
        yield limits
        tenants = GaugeMetricFamily("hicache_tenant_pages", "Host and disk pages cached per tenant",
                                    labels=["tenant", "tier"])
        for tenant, (host, disk) in sorted(snap.get("tenants", {}).items()):
            tenants.add_metric([tenant or "unattributed", "host"], host)
            tenants.add_metric([tenant or "unattributed", "disk"], disk)
        yield tenants
        storage = snap.get("storage")
        if storage is not None:
            yield GaugeMetricFamily("hicache_disk_bytes", "Payload bytes in the disk tier", value=storage["bytes"])
            yield GaugeMetricFamily("hicache_disk_records", "Records in the disk tier", value=storage["records"])
            yield GaugeMetricFamily("hicache_disk_capacity_bytes", "Disk tier capacity",
                                    value=storage["capacity_bytes"])
            yield GaugeMetricFamily("hicache_lmdb_map_size_bytes", "LMDB map size", value=storage["map_size_bytes"])
            yield CounterMetricFamily("hicache_disk_corrupt_records", "Disk records that failed a check on read",
                                      value=storage["corrupt_records"])
        events = snap.get("events")
        if events is not None:
            yield CounterMetricFamily("hicache_kv_events", "KV events published (every stream)",
                                      value=events["events"])
            yield CounterMetricFamily("hicache_kv_event_batches", "KV event batches published (every stream)",
                                      value=events["batches"])
            yield CounterMetricFamily("hicache_kv_events_dropped",
                                      "KV events lost before the wire (each loss restarts its stream)",
                                      value=events["dropped"])
            subscribers = GaugeMetricFamily("hicache_kv_events_subscribers",
                                            "Connections open on each KV events PUB socket", labels=["socket"])
            for sock, n in sorted(events.get("subscribers", {}).items()):
                subscribers.add_metric([sock], n)
            yield subscribers
        checkpoints = snap.get("checkpoints")
        if checkpoints is not None:
            held = GaugeMetricFamily("hicache_checkpoints", "Recurrent-state checkpoints held", labels=["tier"])
            for tier in ("device", "host", "disk"):
                held.add_metric([tier], checkpoints[tier])
            yield held
            yield GaugeMetricFamily("hicache_checkpoint_host_slots", "Host slots for checkpoints",
                                    value=checkpoints["host_slots"])
            events = CounterMetricFamily("hicache_checkpoint_events", "Checkpoints offered, restored, lost, refused",
                                         labels=["event"])
            for event in CHECKPOINT_EVENTS:
                events.add_metric([event], checkpoints[event])
            yield events
        build = GaugeMetricFamily("hicache_build_info", "Build information",
                                  labels=["version", "protocol_version", "mode"])
        info = snap["build"]
        build.add_metric([info["version"], str(info["protocol_version"]), info["mode"]], 1)
        yield build
