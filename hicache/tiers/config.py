"""The tier manager's settings (``[tiers]`` in the daemon's config)."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.errors import InvalidArgument
from hicache.eviction import eviction_policy
from hicache.tiers.policies import (
    DiskPolicy,
    PrefetchPolicy,
    WritePolicy,
    disk_policy,
    prefetch_policy,
    write_policy,
)

CAPACITY_POLICIES = ("inclusive", "exclusive")


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    write_policy: str = "write_through"
    write_threshold: int = 1  # hits before a write_through_selective backup
    disk_policy: str = "write_through"
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 0.05
    prefetch_min_pages: int = 1
    # Loads in flight at once per pool; one more loads nothing (missed: no_counter_slot).
    # A vLLM step starts a load per request with a hit, up to max_num_seqs of them (256
    # by default on most GPUs and the CPU). Cost per pool: a ring of
    # slots * (1 + 16 + layers) * 8 bytes and, on a GPU, slots * layers CUDA events.
    counter_slots: int = 256
    eviction: str = "lru"
    copy_threads: int = 2  # CPU copy threads inside a transfer (each takes 8 MiB or more of it)
    io_threads: int = 2  # storage readers
    # Pages queued to the disk writer at most (written, not committed: their host pages
    # stay pinned meanwhile); 0: half the host tier.
    disk_write_backlog: int = 0
    # Evicted page keys remembered for miss reasons (4 bytes each, allocated at the
    # first eviction; see hicache.tiers.misses for the error bounds): the last quarter
    # of this many evictions are reported exactly.
    eviction_log_slots: int = 1 << 22
    # "inclusive": a page may be cached in host and disk at once (under write_through to
    # disk the cache holds as much as the disk tier); "exclusive" (with disk_policy =
    # "write_back"): a page reaches disk as the host evicts it — always written first,
    # even with a device copy left — and the host keeps a sixteenth of its pages free
    # ahead of need, so host and disk hold different pages and the cache about as much
    # as both (the disk evicts records of pages read back to host first). See
    # TierManager._keep_host_free, LocalDisk.evict and systemd/hicache.toml for the trade-off.
    capacity: str = "inclusive"
    # Host state slots for recurrent-state checkpoints (specs with state layers only;
    # hicache.tiers.checkpoints); 0: enough to take an eighth of the host tier's bytes,
    # at least 16.
    host_checkpoints: int = 0

    def __post_init__(self) -> None:
        # Each names a registered policy. Checked here, when the file is read: the tier
        # manager is built at a spec's first registration, where a bad name or thread
        # count would fail every engine's registration instead of the daemon's start.
        self.writes(), self.disk(), self.prefetch()
        eviction_policy(self.eviction)
        if self.copy_threads < 1 or self.io_threads < 1:
            raise InvalidArgument("copy_threads and io_threads must be >= 1")
        if self.capacity not in CAPACITY_POLICIES:
            raise InvalidArgument(f"capacity must be one of {', '.join(CAPACITY_POLICIES)}; got {self.capacity!r}")
        if self.exclusive and self.disk_policy != "write_back":
            raise InvalidArgument('capacity = "exclusive" needs disk_policy = "write_back" (a page is written '
                                  f'when the host evicts it); got disk_policy = {self.disk_policy!r}')
        if self.write_threshold < 1 or self.prefetch_min_pages < 1 or self.counter_slots < 1:
            raise InvalidArgument("write_threshold, prefetch_min_pages and counter_slots must be >= 1")
        if self.eviction_log_slots < 16:
            raise InvalidArgument("eviction_log_slots must be >= 16")
        if self.disk_write_backlog < 0:
            raise InvalidArgument("disk_write_backlog must be >= 0 (0: half the host tier)")
        if self.host_checkpoints < 0:
            raise InvalidArgument("host_checkpoints must be >= 0 (0: an eighth of the host tier)")
        if self.prefetch_timeout_s < 0:
            raise InvalidArgument("prefetch_timeout_s must be >= 0")

    @property
    def exclusive(self) -> bool:
        return self.capacity == "exclusive"

    def checkpoint_slots(self, spec, host_pages: int) -> int:
        """Host state slots for ``spec``'s checkpoints (0 for a spec without state)."""
        slot_bytes = spec.tp_size * spec.state_bytes
        if not slot_bytes:
            return 0
        if self.host_checkpoints:
            return self.host_checkpoints
        return max(16, host_pages * spec.host_page_bytes // (8 * slot_bytes))

    def writes(self) -> WritePolicy:
        return write_policy(self.write_policy, self.write_threshold)

    def disk(self) -> DiskPolicy:
        return disk_policy(self.disk_policy)

    def prefetch(self) -> PrefetchPolicy:
        return prefetch_policy(self.prefetch_policy, self.prefetch_timeout_s)
