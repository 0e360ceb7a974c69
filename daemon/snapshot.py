"""The figures the daemon reports: the ``stats`` reply, and the occupancy snapshot the
metrics collector serves.

Both are taken on the owner thread. The snapshot is a copy because a scrape runs on the
metrics HTTP thread and must not walk live structures; the daemon refreshes it every
half second (:data:`SNAPSHOT_S`) and before answering a test that asks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from hicache import __version__
from hicache import protocol as p
from hicache.metrics import CHECKPOINT_EVENTS, TIERS
from hicache.tiers import TierAccount, TierManager

SNAPSHOT_S = 0.5  # the metrics' occupancy figures are at most this old


def stats(*, uptime_s: float, sessions: int, draining: bool, counts: Counter, managers: dict[bytes, TierManager],
          storage, losses: dict[str, Any] | None = None, events: Mapping[str, int] | None = None,
          closed_checkpoint_events: Mapping[str, int] | None = None) -> p.DaemonStats:
    """What ``stats`` answers. ``counts``: requests by (op, status). ``losses``: the
    loss counters' values (:meth:`hicache.metrics.Metrics.losses`; None: nothing counts
    them, a daemon given :class:`~hicache.metrics.NullMetrics`), completed with the KV
    events' (``events``: their figures, None without [events]) and the checkpoints' as
    :func:`occupancy` reports them to the metrics."""
    specs: dict[str, p.SpecStats] = {}
    for fingerprint, manager in managers.items():
        figures: p.SpecStats = {str(place): p.TierAccountMsg(**account._asdict())
                                for place, account in manager.accounting().items()}
        figures["nodes"] = manager.num_nodes
        figures["pages"] = manager.num_cached_pages()
        specs[fingerprint.hex()] = figures
    tenants = {tenant or "unattributed": {"host_pages": host, "disk_pages": disk}
               for tenant, (host, disk) in tenant_pages(managers.values()).items()}
    if losses is not None:
        losses = dict(losses)  # (the caller's stays as it was)
        if events is not None:
            losses["kv_events_dropped"] = events["dropped"]
        checkpoints = checkpoint_events(managers.values(), closed_checkpoint_events)
        if checkpoints is not None:
            losses["checkpoints_lost"] = checkpoints["lost"]
    return p.DaemonStats(
        version=__version__, uptime_s=uptime_s, sessions=sessions, draining=draining, tenants=tenants,
        requests={f"{op}/{status}": n for (op, status), n in sorted(counts.items())}, specs=specs,
        storage=None if storage is None else p.StorageStatsMsg(**storage.stats()._asdict()),
        losses=None if losses is None else p.LossesMsg(**losses),
    )


def checkpoint_events(managers: Iterable[TierManager],
                      closed: Mapping[str, int] | None = None) -> dict[str, int] | None:
    """The checkpoint events (offered, restored, lost, refused) of the managers serving,
    plus ``closed`` (those of the managers let go: a counter does not go back when a
    spec is let go); None while no spec has state layers nor had."""
    held = [m.checkpoints for m in managers if m.checkpoints is not None]
    if not held and not closed:
        return None
    closed = closed or {}
    return {event: closed.get(event, 0) + sum(getattr(c, event) for c in held) for event in CHECKPOINT_EVENTS}


def tenant_pages(managers: Iterable[TierManager]) -> dict[str, list[int]]:
    """Host and disk pages per tenant, every spec together ("": tenant unknown)."""
    out: dict[str, list[int]] = {}
    for manager in managers:
        for tenant, (host, disk) in manager.tree.groups().items():
            total = out.setdefault(tenant, [0, 0])
            total[0] += host
            total[1] += disk
    return out


def occupancy(*, managers: Iterable[TierManager], sessions: int, oldest_lock_s: float, storage,
              closed_checkpoint_events: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The state figures of :meth:`hicache.metrics.Metrics.add_state_collector`: pages
    by tier and state (every spec together), sessions, the oldest lock's age, the queues
    between the tiers (every spec together), storage figures and the build.
    ``closed_checkpoint_events``: the checkpoint event counts of the managers let go,
    added to those serving (a counter does not go back when a spec is let go)."""
    managers = list(managers)
    pages: dict[str, dict[str, int]] = {tier: dict.fromkeys(TierAccount._fields, 0)
                                        for tier in TIERS}
    for manager in managers:
        for place, account in manager.accounting().items():
            tier = pages[place.tier.label]
            for state, value in account._asdict().items():
                tier[state] += value
    queues: dict[str, list] = {}
    for manager in managers:
        for queue, (pages_in, limit) in manager.queues().items():
            total = queues.setdefault(queue, [0, None])
            total[0] += pages_in
            if limit is not None:
                total[1] = (total[1] or 0) + limit
    gpu = any(pool.device.type == "cuda" for manager in managers for pool in manager.device_pools())
    tenants = tenant_pages(managers)
    out = {
        "pages": pages, "sessions": sessions,
        "storage": storage.stats()._asdict() if storage is not None else None,
        "oldest_lock_s": oldest_lock_s,
        "queues": queues,
        "tenants": tenants,
        "build": {"version": __version__, "protocol_version": p.PROTOCOL_VERSION, "mode": "gpu" if gpu else "cpu"},
    }
    events = checkpoint_events(managers, closed_checkpoint_events)
    if events is not None:
        held = [m.checkpoints for m in managers if m.checkpoints is not None]
        out["checkpoints"] = {
            "host": sum(c.count()[0] for c in held), "disk": sum(c.count()[1] for c in held),
            "device": sum(c.count()[2] for c in held),
            "host_slots": sum(c.num_slots for c in held),
            **events,
        }
    return out
