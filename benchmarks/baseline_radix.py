"""The classic Python radix cache, as the baseline for bench_tree.py.

This is the textbook algorithm that SGLang's Python ``RadixCache`` implements (seed
articles 002 and 004): token ids as Python lists, children keyed by a tuple of the
first page, edges compared page by page in a Python loop, slot indices as int64 torch
tensors concatenated at the end of a match, access times from the clock, lock
references and evictable/protected accounting. It is written here from that
description so the benchmark can run it side by side with hicache.tree in one process;
it is not used by hicache itself.
"""

from __future__ import annotations

import time

import torch


class _Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "hit_count")

    def __init__(self) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent: _Node | None = None
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.hit_count = 0


class BaselineRadixTree:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = _Node()
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    def _child_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Common prefix length in whole pages, compared one page at a time."""
        n = min(len(a), len(b))
        i = 0
        while i < n:
            if a[i : i + self.page_size] != b[i : i + self.page_size]:
                break
            i += self.page_size
        return i

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, _Node]:
        key = key[: len(key) // self.page_size * self.page_size]
        values: list[torch.Tensor] = []
        node = self.root
        now = time.monotonic()
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
        if values:
            return torch.cat(values), node
        return torch.empty(0, dtype=torch.int64), node

    def _split(self, child: _Node, split_len: int) -> _Node:
        new = _Node()
        new.children = {self._child_key(child.key[split_len:]): child}
        new.parent = child.parent
        new.lock_ref = child.lock_ref
        new.key = child.key[:split_len]
        new.value = child.value[:split_len]
        new.hit_count = child.hit_count
        child.parent.children[self._child_key(new.key)] = new
        child.parent = new
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        return new

    def insert(self, key: list[int], values: torch.Tensor) -> int:
        """Insert whole pages; returns the length that was already cached."""
        node = self.root
        now = time.monotonic()
        total = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            total += n
            key = key[n:]
            values = values[n:]
            if n < len(child.key):
                node = self._split(child, n)
                break
            node = child
        if key:
            new = _Node()
            new.parent = node
            new.key = key
            new.value = values.clone()
            node.children[self._child_key(key)] = new
            self.evictable_size += len(key)
        return total

    def inc_lock_ref(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent
