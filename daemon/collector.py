"""The cyclic garbage collector, kept out of the owner thread's way.

A full (generation 2) collection walks every tracked object that is not frozen, on the
thread that allocated last — the owner thread, between two requests. What torch's import
and start-up bring is frozen when the daemon starts serving (and again when a tier
manager settles: :class:`hicache.daemon.specs.Specs`); what the tree and the transfers
add while serving (nodes with their dicts, closures of transfers in flight) made full
collections grow with the cache: 6 ms at first, 43 ms by the end of a 1 M-page trace
(``bench_scale``, a few minutes), with nothing collected: none of it was garbage.

:class:`Collector` freezes what survives each collection of the middle generation or
the oldest, so that a full collection walks only what came since the last of those; and
every ``unfreeze_every_s`` (an hour) it unfreezes everything, so that the next full
collection looks at all of it once — cyclic garbage made of objects that were alive at
a freeze is reclaimed then, at the cost of one longer pause an hour (a walk of every
tracked object: 0.2–0.3 s with torch loaded). The daemon makes next to no cyclic
garbage (the collections timed in a ``bench_scale`` run collected nothing).

Freezing only at full collections was not enough: a full collection walked the few
thousand objects the middle generation had promoted since, and took 20–50 ms of CPU
for them (memory latency, it seems: each object and what it refers to is a cache miss, at
a full collection also the frozen objects they refer to) — over every ``lock`` and
``unlock`` that waited behind it. Freezing the middle generation's survivors leaves
full collections next to nothing to walk (none over 2 ms in the same run); the middle
generation's own collections took up to 10 ms.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

UNFREEZE_EVERY_S = 3600.0


class Collector:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 unfreeze_every_s: float = UNFREEZE_EVERY_S) -> None:
        self._clock = clock
        self._every = unfreeze_every_s
        self._unfreeze_at = clock() + unfreeze_every_s
        self.unfrozen = 0  # times everything was unfrozen (for tests and logs)

    def install(self) -> None:
        """Freeze what exists now and every older collection's survivors from now on."""
        gc.freeze()
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def tick(self) -> None:
        """Called from the loop's catch-up: unfreeze everything when the hour is up."""
        now = self._clock()
        if now >= self._unfreeze_at:
            gc.unfreeze()
            self.unfrozen += 1
            self._unfreeze_at = now + self._every

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "stop" and info.get("generation", 0) >= 1:
            gc.freeze()
