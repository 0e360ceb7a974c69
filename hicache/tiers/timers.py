"""Timers the owner thread runs from its poll (a prefetch that answers after a timeout)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Timers:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def add(self, delay_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (self._clock() + delay_s, next(self._seq), fn))

    def run_due(self) -> int:
        """Run the timers that are due; returns how many ran."""
        ran = 0
        now = self._clock()
        while self._heap and self._heap[0][0] <= now:
            _, _, fn = heapq.heappop(self._heap)
            fn()
            ran += 1
        return ran

    def next_due(self) -> float | None:
        """When the earliest timer is due (on this clock), if any."""
        return self._heap[0][0] if self._heap else None
