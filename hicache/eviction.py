"""Eviction policies: which evictable leaf of a tier goes first.

A policy is a sort key over tree nodes; the smallest key is evicted first. Policies are
looked up by name in :data:`EVICTION_POLICIES`, so configuration picks one with a string
and adding one is a new entry, not a new branch in the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hicache.errors import InvalidArgument

if TYPE_CHECKING:
    from hicache.tree import Node


class EvictionPolicy(Protocol):
    name: str

    def key(self, node: "Node") -> Any:
        """Sort key; the node with the smallest key is evicted first."""


@dataclass(frozen=True)
class LRU:
    """Least recently used first."""

    name: str = "lru"

    def key(self, node: "Node") -> Any:
        return node.last_access


@dataclass(frozen=True)
class LFU:
    """Least frequently hit first; ties broken by least recently used."""

    name: str = "lfu"

    def key(self, node: "Node") -> Any:
        return (node.hit_count, node.last_access)


@dataclass(frozen=True)
class Priority:
    """Lowest caller-assigned priority first; ties broken by least recently used."""

    name: str = "priority"

    def key(self, node: "Node") -> Any:
        return (node.priority, node.last_access)


EVICTION_POLICIES: dict[str, EvictionPolicy] = {p.name: p for p in (LRU(), LFU(), Priority())}


def eviction_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(EVICTION_POLICIES))}"
        ) from None
