"""What the tier manager answers: hits, loads, and page accounts."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

from hicache.counters import Ticket
from hicache.pages import PageIds
from hicache.tree import MatchResult, Node


class Hit(NamedTuple):
    """A match, plus the tickets of loads still landing in its device part.
    ``unclipped``: the match as the tree had it, when more was cached than a load could
    deliver now (``match`` is then the deliverable part)."""

    match: MatchResult
    wait: tuple[Ticket, ...]
    unclipped: MatchResult | None = None
    remote_pages: int = 0  # pages of ``match``'s host part the remote tier gave it (just now)


class LoadResult(NamedTuple):
    """``device_pages``: every page of the path from the root to ``node`` in the pool
    (what the engine writes into its req_to_token row); the last ``num_loaded_pages`` of
    them arrive layer by layer — wait on every ticket in ``wait`` before reading a
    layer. ``state``: a load with a state slot found ``node``'s checkpoint there before
    any layer (see :mod:`hicache.tiers.checkpoints`)."""

    node: Node
    device_pages: PageIds
    num_loaded_pages: int
    wait: tuple[Ticket, ...]
    state: bool = False


@dataclass
class Purged:
    """What a purge dropped, per tier: pages of hicache's own device pools, host pages,
    disk records; ``left``: pages still cached, held by a lock or a transfer.
    ``remote``: the remote tier's removal (the objects it removed from the store,
    once done: its error if it could not), ``None`` without a remote tier."""

    device: int = 0
    host: int = 0
    disk: int = 0
    left: int = 0
    remote: Future | None = None


class TierAccount(NamedTuple):
    free: int
    private: int
    cached_evictable: int
    cached_protected: int
    staging: int

    @property
    def total(self) -> int:
        return sum(self)


class LoadTiming(NamedTuple):
    """One finished CPU-mode load, as the copy threads saw it (``time.perf_counter``
    instants): copies started, layer 0 stamped complete, last layer stamped complete."""

    num_pages: int
    num_bytes: int
    started_at: float
    first_layer_at: float
    last_layer_at: float

    @property
    def first_layer_s(self) -> float:
        return self.first_layer_at - self.started_at

    @property
    def full_s(self) -> float:
        return self.last_layer_at - self.started_at
