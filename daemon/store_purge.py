"""A purge's reach into the store, for the KV specs no tier manager serves now.

A spec has a tier manager only while engines of it are registered (see
:mod:`hicache.daemon.specs`): after a restart, or once its engines left and its manager
was closed, its pages are records in the store, put back into a tree at its next
registration. A purge must reach those too, or the purged pages would come back then.
No index leads from a namespace to its records, so a purge of such a spec's namespaces
walks the store's metadata and deletes their records — a batch at a time between
requests, as a background rebuild runs (a store of millions of records takes seconds to
walk). A registration of one of those specs meanwhile first finishes the walks that
concern it: its rebuild must not restore records being deleted.

The same walks find which of the namespaces the tenant log names still hold records
(:meth:`StoreWalks.find`), for its compaction (:mod:`hicache.daemon.tenant_log`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Container, Generator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from hicache.jobs import Completions, when_all

logger = logging.getLogger(__name__)

WALK_STEP = 1024  # records read from the store at once, and walked between two looks at the clock
WALK_SLICE_S = 0.005  # owner-thread time a walk takes between two looks at the socket


@dataclass(eq=False)
class _Walk:
    targets: dict[bytes, set[bytes]]  # spec fingerprint -> the namespaces whose records go
    steps: Generator[None, None, None]


class StoreWalks:
    """The walks of the store under way (purges, and :meth:`find`), oldest first.
    Owner thread only."""

    def __init__(self, storage, completions: Completions, clock: Callable[[], float]) -> None:
        self._storage = storage
        self._completions = completions
        self._clock = clock
        self._walks: deque[_Walk] = deque()

    @property
    def busy(self) -> bool:
        return bool(self._walks)

    def start(self, targets: dict[bytes, set[bytes]]) -> Future:
        """Delete the records of ``targets`` (spec fingerprint -> namespaces; specs
        that no manager serves). The future: how many, once committed (or the store's
        error)."""
        done: Future = Future()
        self._walks.append(_Walk(targets, self._walk(targets, done)))
        return done

    def find(self, wanted: Mapping[bytes, Container[bytes]]) -> Future:
        """Which of ``wanted``'s namespaces (spec fingerprint -> namespaces, read as the
        walk goes) hold a record: the future's set of ``(fingerprint, namespace)``, at
        the walk's end (or the store's error). Deletes nothing: a registration does not
        wait for it."""
        done: Future = Future()
        self._walks.append(_Walk({}, self._find(wanted, done)))
        return done

    def finish(self, fingerprint: bytes) -> None:
        """Run every walk that deletes records of spec ``fingerprint`` to its end, now,
        and wait for its deletes to commit (before the spec's manager reads the store)."""
        walks = [w for w in self._walks if fingerprint in w.targets]
        for walk in walks:
            for _ in walk.steps:
                pass
            self._walks.remove(walk)
        if walks:
            self._storage.flush()

    def run_slice(self) -> None:
        """A slice of the oldest walk."""
        walk = self._walks[0]
        deadline = self._clock() + WALK_SLICE_S
        for _ in walk.steps:
            if self._clock() >= deadline:
                return
        self._walks.popleft()

    def stop(self) -> None:
        """The daemon stops: the walks left are not finished (their purges are not
        answered; the records they had not reached yet stay)."""
        self._walks.clear()

    def _walk(self, targets: dict[bytes, set[bytes]], done: Future) -> Generator[None, None, None]:
        storage = self._storage
        deletes: list[Future] = []
        doomed: list[bytes] = []
        try:
            for seen, (key, meta) in enumerate(storage.iter_metadata(batch=WALK_STEP), 1):
                if meta.namespace in targets.get(meta.fingerprint, ()):
                    doomed.append(key)
                if seen % WALK_STEP == 0:
                    if doomed:
                        deletes.append(storage.delete(doomed))
                        doomed = []
                    yield
            if doomed:
                deletes.append(storage.delete(doomed))
        except Exception as exc:  # a store that fails to read: the purge says so
            logger.exception("purge: walking the store failed")
            done.set_exception(exc)
            return
        self._when_committed(deletes, done)

    def _find(self, wanted: Mapping[bytes, Container[bytes]], done: Future) -> Generator[None, None, None]:
        found: set[tuple[bytes, bytes]] = set()
        try:
            for seen, (_, meta) in enumerate(self._storage.iter_metadata(batch=WALK_STEP), 1):
                if meta.namespace in wanted.get(meta.fingerprint, ()):
                    found.add((meta.fingerprint, meta.namespace))
                if seen % WALK_STEP == 0:
                    yield
        except Exception as exc:  # a store that fails to read: nothing is dropped
            logger.exception("tenant log compaction: walking the store failed")
            done.set_exception(exc)
            return
        done.set_result(found)

    def _when_committed(self, deletes: list[Future], done: Future) -> None:
        """Resolve ``done`` with the records the ``deletes`` removed, once all are
        committed (on the owner thread)."""

        def committed(counts, error) -> None:
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(sum(counts))

        self._completions.forward(when_all(deletes), committed)
