"""Test helpers for the storage port."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

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



class InProcessMooncake:
    """A stand-in for ``MooncakeDistributedStore`` in this process: objects in a dict,
    the zero-copy calls reading and writing the buffers they are given (the addresses
    ``MooncakeBackend`` hands over), with Mooncake's return codes. ``hold(name)``: that
    method waits for :attr:`gate` (it starts open) — a store that hangs mid-call;
    :attr:`entered` is set once a held call waits."""

    NOT_FOUND = -704

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self._held: set[str] = set()

    def hold(self, *methods: str) -> None:
        self._held.update(methods)
        self.gate.clear()

    def release(self) -> None:
        self._held.clear()
        self.gate.set()

    def _wait(self, method: str) -> None:
        if method in self._held:
            self.entered.set()
            self.gate.wait(60)  # (a hang guard: the test releases it)

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def batch_is_exist(self, names: list[str]) -> list[int]:
        self._wait("batch_is_exist")
        return [int(name in self.objects) for name in names]

    def get_size(self, name: str) -> int:
        value = self.objects.get(name)
        return self.NOT_FOUND if value is None else len(value)

    def batch_put_from_multi_buffers(self, names, all_ptrs, all_sizes) -> list[int]:
        import ctypes

        self._wait("batch_put_from_multi_buffers")
        for name, ptrs, sizes in zip(names, all_ptrs, all_sizes):
            self.objects[name] = b"".join(ctypes.string_at(ptr, size) for ptr, size in zip(ptrs, sizes))
        return [0] * len(names)

    def batch_get_into_multi_buffers(self, names, all_ptrs, all_sizes) -> list[int]:
        import ctypes

        self._wait("batch_get_into_multi_buffers")
        codes = []
        for name, ptrs, sizes in zip(names, all_ptrs, all_sizes):
            value = self.objects.get(name)
            if value is None:
                codes.append(self.NOT_FOUND)
                continue
            if len(value) > sum(sizes):
                codes.append(-1)  # (the buffers cannot take the value)
                continue
            pos = 0
            for ptr, size in zip(ptrs, sizes):
                part = value[pos : pos + size]
                ctypes.memmove(ptr, part, len(part))
                pos += len(part)
            codes.append(len(value))
        return codes

    def batch_remove(self, names: list[str], force: bool = False) -> list[int]:
        return [0 if self.objects.pop(name, None) is not None else self.NOT_FOUND for name in names]

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        import re

        self._wait("remove_by_regex")
        names = [name for name in self.objects if re.search(pattern, name)]
        for name in names:
            del self.objects[name]
        return len(names)

    def close(self) -> int:
        return 0


def bad_sector(monkeypatch, store, key):
    """Every read of the slab bytes under ``key``'s record (as written now) fails with
    EIO from here on, as over a bad sector, while the event returned is set (it is); the
    bytes around it read as usual."""
    from hicache.storage import lmdb_backend
    from tiers_util import expected_page

    store.flush()
    pattern = expected_page(key)[:64]
    (slab,) = [p for p in Path(store.path).glob("slab-*.bin") if pattern in p.read_bytes()]
    bad = slab.read_bytes().index(pattern) + 10
    inode = slab.stat().st_ino
    real_preadv = os.preadv
    failing = threading.Event()
    failing.set()

    def preadv(fd, buffers, offset):
        length = sum(memoryview(b).nbytes for b in buffers)
        if failing.is_set() and offset <= bad < offset + length and os.fstat(fd).st_ino == inode:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(lmdb_backend.os, "preadv", preadv)
    return failing
