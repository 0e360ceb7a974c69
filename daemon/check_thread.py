"""``check``'s long parts, off the owner thread.

The store's check reads every record (a store of a million records takes seconds) and
reads one commit whatever its writers do meanwhile (see
:meth:`hicache.storage.lmdb_backend.LmdbBackend.check_invariants`); a tree's check
(~10 µs a node) checks a copy the owner thread made of it (~3 µs a node; see
:meth:`hicache.tree.HiRadixTree.check_invariants`). Both run on a thread of their own
while the loop answers requests. One runs at a time: ``check`` requests that arrive
while one runs share the next one, which starts once it ended — each is answered by a
check that began after it arrived (the trees as the last of them copied them: one copy
a spec waits, not one a request), and a client that sends ``check`` after ``check``
costs one walk at a time, not one thread each.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from hicache.errors import InvariantBroken
from hicache.jobs import Completions

logger = logging.getLogger(__name__)


def broken(where: str, exc: AssertionError) -> InvariantBroken:
    """The invariant an ``assert`` of ``where`` found broken: its source line."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    values = f" with {exc}" if str(exc) else ""
    return InvariantBroken(f"{where}: {frame.line} ({Path(frame.filename).name}:{frame.lineno}){values}")


class CheckThread:
    """The checks' long parts, one at a time. Owner thread only (but the walk's)."""

    def __init__(self, storage, completions: Completions) -> None:
        """``storage``: the disk tier's store (``None``: none, or one with no check)."""
        self._storage = storage if storage is not None and hasattr(storage, "check_invariants") else None
        self._completions = completions
        self._running: Future | None = None  # the check under way
        self._next: Future | None = None  # the one to start after it: requests that came meanwhile
        self._next_checks: dict[bytes, list[Callable[[], None]]] = {}  # the last asker's

    def ask(self, checks: dict[bytes, list[Callable[[], None]]]) -> Future:
        """A check of the store, and the ``checks`` (spec fingerprint -> what its tier
        manager's check left to run later: see :meth:`TierManager.check_invariants`),
        that begins now, or as soon as the one under way ended (with the ``checks`` of
        the last request that asks for it); done on the owner thread: ``None``, or
        ``InvariantBroken`` naming the assertion that failed (``StorageUnavailable`` for
        a store that closed or whose writer hangs)."""
        if self._running is None:
            self._running = self._start(Future(), checks)
            return self._running
        if self._next is None:
            self._next = Future()
        self._next_checks = checks  # (taken after the others': their copies are let go)
        return self._next

    def _start(self, future: Future, checks: dict[bytes, list[Callable[[], None]]]) -> Future:
        def walk() -> None:
            error: BaseException | None = None
            where = ""
            try:
                for fingerprint, deferred in checks.items():
                    where = f"tier manager of spec {fingerprint.hex()}"
                    for check in deferred:
                        check()
                if self._storage is not None:
                    where = "storage"
                    self._storage.check_invariants()
            except AssertionError as exc:
                error = broken(where, exc)
            except Exception as exc:  # (answered as the request's error; INTERNAL unless a HicacheError)
                error = exc
            self._completions.post(lambda: self._ended(future, error))

        threading.Thread(target=walk, name="hicache-check", daemon=True).start()
        return future

    def _ended(self, future: Future, error: BaseException | None) -> None:
        self._running = None
        if self._next is not None:
            checks, self._next_checks = self._next_checks, {}
            self._running, self._next = self._start(self._next, checks), None
        if error is None:
            future.set_result(None)
        else:
            logger.error("check: %s", getattr(error, "message", error))
            future.set_exception(error)
