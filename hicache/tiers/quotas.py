"""Space quotas: how many host and disk pages a group of tenants may hold.

The tree counts host and disk pages per namespace and per *group* (a tenant: the daemon
names each namespace's tenant as sessions use it, :meth:`HiRadixTree.set_group`). A
:class:`SpaceLimit` caps the pages of some tenants together — an identity's tenants,
with its ``host_pages`` / ``disk_pages`` — counting what is resident plus what is on
its way there (host pages being copied in, disk pages being written). Before a backup
or a store takes host pages for a namespace, and before a disk write, the tier manager
asks :meth:`SpaceQuotas.room`: over a limit, that limit's own evictable pages go first
(its tenants' least recently used, never another tenant's); if they cannot make room,
the copy is not made (counted per limit), and the page stays where it was. Reads from
disk into host are not refused (a load would fall short): their pages count, and the
tenant's next backup makes room among its own.

Pages of namespaces whose tenant is not known count under no group (the daemon keeps
the tenants across restarts: :mod:`hicache.daemon.tenant_log`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hicache.tree import HiRadixTree, Tier


@dataclass(frozen=True)
class SpaceLimit:
    name: str  # what the refusals are counted by (an identity)
    groups: frozenset[str]  # its tenants
    host_pages: int = 0  # 0: no limit
    disk_pages: int = 0

    def cap(self, tier: Tier) -> int:
        return self.host_pages if tier == Tier.HOST else self.disk_pages


class SpaceQuotas:
    """The limits in force and the pages on their way, per group. Owner thread only."""

    def __init__(self, tree: HiRadixTree, refused: Callable[[str, str], None] = lambda name, quota: None) -> None:
        """``refused(limit name, "host_pages" | "disk_pages")`` counts a copy not made."""
        self.tree = tree
        self._refused = refused
        self.source: object = None  # what the limits were made from (the daemon's identity table)
        self._by_group: dict[str, list[SpaceLimit]] = {}
        self.staged: Counter = Counter()  # (group, tier) -> pages on their way to that tier
        self.refused: Counter = Counter()  # (limit name, tier) -> copies not made

    def set_limits(self, limits: Iterable[SpaceLimit], source: object = None) -> None:
        self.source = source
        by_group: dict[str, list[SpaceLimit]] = {}
        for limit in limits:
            if limit.host_pages or limit.disk_pages:
                for group in limit.groups:
                    by_group.setdefault(group, []).append(limit)
        self._by_group = by_group

    @property
    def active(self) -> bool:
        return bool(self._by_group)

    def used(self, limit: SpaceLimit, tier: Tier) -> int:
        i = 0 if tier == Tier.HOST else 1
        return sum(self.tree.group_pages(group)[i] + self.staged[(group, tier)] for group in limit.groups)

    def room(self, namespace, tier: Tier, num_pages: int,
             evict: Callable[[set, int], int]) -> bool:
        """May ``num_pages`` more pages of ``namespace`` go to ``tier``? Over a limit,
        ``evict(namespaces, pages)`` frees that limit's own pages first."""
        limits = self._by_group.get(self.tree.group_of(namespace))
        if not limits:
            return True
        for limit in limits:
            cap = limit.cap(tier)
            if not cap:
                continue
            excess = self.used(limit, tier) + num_pages - cap
            if excess > 0 and num_pages <= cap:
                evict(self.tree.namespaces_of(limit.groups), excess)
                excess = self.used(limit, tier) + num_pages - cap
            if excess > 0:
                self.refused[(limit.name, tier)] += 1
                self._refused(limit.name, "host_pages" if tier == Tier.HOST else "disk_pages")
                return False
        return True

    def stage(self, namespace, tier: Tier, num_pages: int) -> str:
        """Pages of ``namespace`` on their way to ``tier``; returns the group to
        :meth:`unstage` them from when they land (or do not)."""
        group = self.tree.group_of(namespace)
        self.staged[(group, tier)] += num_pages
        return group

    def unstage(self, group: str, tier: Tier, num_pages: int) -> None:
        key = (group, tier)
        self.staged[key] -= num_pages
        if self.staged[key] <= 0:
            del self.staged[key]
