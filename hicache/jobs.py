"""Work off the owner thread, and the way its results come back.

The tier manager's state (tree, allocators, in-flight registries) belongs to one owner
thread. Copies and storage reads run on worker threads; when one finishes, its ``done``
callback is *posted* to :class:`Completions`, and the owner runs it the next time it
drains the queue — so every state change still happens on the owner thread::

    owner:   submit(work, done) ──────────────────────────► drain(): done(result, None)
    worker:            work() ── result ── post(done) ──┘

``wakeup`` (optional) is called after every post, from the posting thread: the daemon
uses it to poke its event loop (an inproc socket), tests simply drain.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
Done = Callable[[Any, "BaseException | None"], None]

logger = logging.getLogger(__name__)


def when_all(futures: list[Future]) -> Future:
    """A future done once every one of ``futures`` is, on the thread that finished the
    last: their results in order, or the first error among them."""
    out: Future = Future()
    left = len(futures)
    lock = threading.Lock()
    if not left:
        out.set_result([])
        return out

    def one(_: Future) -> None:
        nonlocal left
        with lock:  # (futures may finish on different threads)
            left -= 1
            if left:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result([f.result() for f in futures])

    for future in futures:
        future.add_done_callback(one)
    return out


class Completions:
    def __init__(self, wakeup: Callable[[], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = wakeup

    def post(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` for the owner thread (any thread may call this)."""
        self._queue.put(fn)
        if self._wakeup is not None:
            self._wakeup()

    @property
    def pending(self) -> bool:
        """Callbacks are waiting for the owner thread."""
        return not self._queue.empty()

    def drain(self, timeout_s: float = 0.0, limit: int | None = None) -> int:
        """Run the queued callbacks on this (the owner) thread — at most ``limit`` of
        them (``None``: all), so that a caller serving requests between slices never
        keeps one waiting behind a backlog; if none is queued, wait up to ``timeout_s``
        for one. Returns how many ran."""
        ran = 0
        if limit == 0 or (timeout_s <= 0 and self._queue.empty()):
            return 0  # the usual case on every loop turn: no exception raised and caught
        try:
            fn = self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return 0
        while True:
            fn()
            ran += 1
            if ran == limit:
                return ran
            try:
                fn = self._queue.get_nowait()
            except queue.Empty:
                return ran

    def forward(self, future: Future, done: Done) -> None:
        """Post ``done(result, error)`` when a future from elsewhere (a storage write)
        completes."""

        def on_future(f: Future) -> None:
            error = f.exception()
            result = None if error is not None else f.result()
            self.post(lambda: done(result, error))

        future.add_done_callback(on_future)


class Workers:
    """A FIFO copy thread (transfers complete in submission order), a few I/O threads
    (storage reads) and a FIFO thread that prepares storage writes, all reporting
    through :class:`Completions`."""

    def __init__(self, completions: Completions, *, io_threads: int = 2) -> None:
        self.completions = completions
        self._copy = ThreadPoolExecutor(1, thread_name_prefix="hicache-transfer")
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache-io")
        self._prepare = ThreadPoolExecutor(1, thread_name_prefix="hicache-write-prep")

    def copy(self, work: Callable[[], T], done: Done) -> None:
        self.completions.forward(self._copy.submit(work), done)

    def io(self, work: Callable[[], T], done: Done) -> None:
        self.completions.forward(self._io.submit(work), done)

    def write(self, submit: Callable[[], Future], done: Done) -> None:
        """Run ``submit`` on the write-preparation thread (in order): it builds the
        records and hands them to the store, returning the store's future; ``done``
        is posted with that future's outcome (or with what ``submit`` raised). The
        per-page work of a write — records, buffer views, metadata — stays off the
        owner thread."""

        def run() -> None:
            try:
                stored = submit()
            except BaseException as exc:  # noqa: BLE001 - reported through done
                self.completions.post(lambda error=exc: done(None, error))
                return
            self.completions.forward(stored, done)

        self._prepare.submit(run)

    def close(self) -> None:
        self._prepare.shutdown(wait=True)
        self._copy.shutdown(wait=True)
        self._io.shutdown(wait=True)
