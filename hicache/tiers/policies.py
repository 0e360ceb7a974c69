"""The tier manager's policies, as objects looked up by name in registries (like the
tree's eviction policies in :mod:`hicache.eviction`).

* :class:`WritePolicy` — when device pages are backed up to host: ``write_through``
  (on insert), ``write_through_selective`` (on the N-th hit), ``write_back`` (when a page
  is about to be evicted from the device);
* :class:`DiskPolicy` — when host pages are written to disk: ``write_through`` (once on
  host), ``write_back`` (before a host copy is dropped), ``none`` (no disk tier);
* :class:`PrefetchPolicy` — when a match whose prefix continues on disk is answered:
  ``best_effort`` (at once, the read goes on), ``wait_complete`` (once the disk part is
  in host memory), ``timeout`` (then, or after a timeout, whichever comes first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hicache.errors import InvalidArgument
from hicache.tree import MatchResult, Node


@dataclass(frozen=True)
class WritePolicy:
    """Device -> host backups. ``backup_before_evict``: a device page with no other copy
    is backed up (then dropped) instead of evicted."""

    name: str
    backup_before_evict: bool = False
    backs_up_on_hit: bool = False  # after_hit may name a node (the match path skips the call otherwise)

    def after_insert(self, node: Node) -> Node | None:
        """The node to back up once an insert ended at ``node`` (with its ancestors that
        lack a host copy), if any."""
        return None

    def after_hit(self, match: MatchResult) -> Node | None:
        """The node to back up after a match (with its ancestors), if any."""
        return None


@dataclass(frozen=True)
class WriteThrough(WritePolicy):
    def after_insert(self, node: Node) -> Node | None:
        return node if node.host_pages is None else None


@dataclass(frozen=True)
class WriteThroughSelective(WritePolicy):
    threshold: int = 1

    def after_hit(self, match: MatchResult) -> Node | None:
        # Hit counts only grow towards the root: back up from the deepest node that
        # reached the threshold (its ancestors without a host copy come along).
        if not match.num_device_pages:
            return None
        node = match.last_device_node
        while not node.is_root and node.host_pages is None:
            if node.hit_count >= self.threshold:
                return node
            node = node.parent
        return None


@dataclass(frozen=True)
class DiskPolicy:
    """Host -> disk writes. ``enabled``: there is a disk tier at all; ``write_on_host``:
    a page is written as soon as it is on host; ``write_before_drop``: a host page with
    no disk copy is written (then dropped) instead of evicted."""

    name: str
    enabled: bool = True
    write_on_host: bool = False
    write_before_drop: bool = False


@dataclass(frozen=True)
class PrefetchPolicy:
    """``waits``: a match with a disk part is answered once its reads are done;
    ``timeout_s``: or after this long (``None``: no limit)."""

    name: str
    waits: bool = False
    timeout_s: float | None = None


_WRITE: dict[str, Callable[[int], WritePolicy]] = {
    "write_through": lambda threshold: WriteThrough("write_through"),
    "write_through_selective": lambda threshold: WriteThroughSelective(
        "write_through_selective", backs_up_on_hit=True, threshold=threshold),
    "write_back": lambda threshold: WritePolicy("write_back", backup_before_evict=True),
}
_DISK: dict[str, DiskPolicy] = {
    "write_through": DiskPolicy("write_through", write_on_host=True),
    "write_back": DiskPolicy("write_back", write_before_drop=True),
    "none": DiskPolicy("none", enabled=False),
}
_PREFETCH: dict[str, Callable[[float], PrefetchPolicy]] = {
    "best_effort": lambda timeout_s: PrefetchPolicy("best_effort"),
    "wait_complete": lambda timeout_s: PrefetchPolicy("wait_complete", waits=True),
    "timeout": lambda timeout_s: PrefetchPolicy("timeout", waits=True, timeout_s=timeout_s),
}

WRITE_POLICIES = tuple(_WRITE)
DISK_POLICIES = tuple(_DISK)
PREFETCH_POLICIES = tuple(_PREFETCH)


def _lookup(kind: str, registry: dict, name: str):
    try:
        return registry[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"{kind} must be one of {', '.join(registry)}; got {name!r}") from None


def write_policy(name: str, threshold: int = 1) -> WritePolicy:
    return _lookup("write_policy", _WRITE, name)(threshold)


def disk_policy(name: str) -> DiskPolicy:
    return _lookup("disk_policy", _DISK, name)


def prefetch_policy(name: str, timeout_s: float = 0.05) -> PrefetchPolicy:
    return _lookup("prefetch_policy", _PREFETCH, name)(timeout_s)
