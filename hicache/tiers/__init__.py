"""Tiers below the tree: device pools, the host pool and a disk tier, and the manager
that drives them as one (:class:`TierManager`). The module map is in
``docs/architecture.md``."""

from hicache.tiers.config import TierConfig
from hicache.tiers.manager import TierManager
from hicache.tiers.rebuild import REBUILD_PROGRESS_EVERY
from hicache.tiers.results import Hit, LoadResult, LoadTiming, TierAccount

__all__ = ["REBUILD_PROGRESS_EVERY", "Hit", "LoadResult", "LoadTiming", "TierAccount", "TierConfig", "TierManager"]
