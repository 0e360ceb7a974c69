"""Test helpers for the storage port."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FuturesTimeout

from hicache.storage.base import StorageBackend


def stored_run(store: StorageBackend, keys: Sequence[bytes]) -> int:
    """How many of ``keys``, from the first, ``store`` holds a record of (present in its
    metadata listing; payloads not read). O(records): for tests. A backend whose
    ``check_invariants`` holds keeps a payload for every listed key and no other."""
    listed = {key for key, _ in store.iter_metadata()}
    for i, key in enumerate(keys):
        if bytes(key) not in listed:
            return i
    return len(keys)


class SlowStore:
    """A store whose writes are slowed on purpose: each ``put`` (or ``put_batch``) waits on one thread of
    its own — for ``gate`` to be open (it starts open; ``close_gate`` holds every write
    back), then ``delay_s`` — and then writes through the real store: a disk that
    cannot keep up. ``max_pages_in_flight``: the most pages ever handed to ``put`` and
    not yet written. Everything else goes straight to the real store."""

    def __init__(self, inner: StorageBackend, delay_s: float) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self._inner = inner
        self._delay_s = delay_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="slow-store")
        self._lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.pages_in_flight = 0
        self.max_pages_in_flight = 0
        self.puts = 0

    def close_gate(self) -> None:
        self.gate.clear()

    def open_gate(self) -> None:
        self.gate.set()

    def put(self, records, *, fingerprint: bytes):
        records = list(records)
        return self._slowly(len(records), lambda: self._inner.put(records, fingerprint=fingerprint))

    def put_batch(self, batch, *, fingerprint: bytes):
        return self._slowly(batch.num_records, lambda: self._inner.put_batch(batch, fingerprint=fingerprint))

    def _slowly(self, num_pages: int, put):
        import time

        with self._lock:
            self.pages_in_flight += num_pages
            self.max_pages_in_flight = max(self.max_pages_in_flight, self.pages_in_flight)
            self.puts += 1

        def slow():
            try:
                self.gate.wait()
                time.sleep(self._delay_s)
                return put().result()
            finally:
                with self._lock:
                    self.pages_in_flight -= num_pages

        return self._thread.submit(slow)

    def flush(self, timeout_s: float | None = None) -> None:
        try:
            self._thread.submit(lambda: None).result(timeout_s)
        except FuturesTimeout:  # (not yet the builtin TimeoutError on Python 3.10)
            raise TimeoutError("slow store: writes still held back") from None
        self._inner.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        self.gate.set()
        self._thread.shutdown(wait=True)
        self._inner.close(timeout_s)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class HungMooncakeStore:
    """A stand-in for ``MooncakeDistributedStore`` whose ``close`` hangs (a master gone
    mid-RPC) until the test lets it go."""

    def __init__(self):
        self.closing = threading.Event()
        self.release = threading.Event()

    def register_buffer(self, ptr, size):
        return 0

    def unregister_buffer(self, ptr):
        return 0

    def close(self):
        self.closing.set()
        self.release.wait(60)  # (a hang guard: the test sets it)

