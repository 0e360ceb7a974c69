"""The remote tier's store: Mooncake Store, shared by every node of a fleet.

Mooncake Store (``mooncake-transfer-engine-non-cuda`` on CPU machines, the CUDA wheel
on GPU machines: the optional ``remote`` extra) keeps objects in memory segments that
its clients contribute, indexed by a master (``mooncake_master``) that also grants
leases and evicts. hicache stores one object per page, named by its namespace and page
key (``hicache/2/<namespace hex>/<page key hex>``) — equal on every machine for the same
namespace and tokens — so node B finds what node A stored by asking for the keys that
follow its own hit, and one call removes a namespace's pages from the whole fleet
(:meth:`MooncakeBackend.purge`, whichever node stored them). (Objects of the first
naming, ``hicache/1/<page key hex>``, are no longer read: the master evicts them in
time.)

An object is a record header, the page's token ids, then the host page as is::

    record header, little-endian (96 B)
    +-------+---------------------------------+
    | 0  4s | magic b"HCRM"                   |
    | 4  H  | record format version (1)       |
    | 6  H  | header size with tokens         |
    | 8  16s| spec fingerprint                |
    | 24 Q  | payload length                  |
    | 32 16s| page key                        |
    | 48 16s| namespace id                    |
    | 64 16s| parent page key                 |
    | 80 I  | token bytes that follow (4 per token)
    | 84 4x | reserved (zero)                 |
    | 88 Q  | xxh3_64 of the payload, seeded with xxh3_64 of bytes [0, 88) and the tokens
    +-------+---------------------------------+

The header carries what a node needs to put the page in its tree (namespace, parent,
tokens), and the checksum covers all of it: a value that fails any check (size, magic,
key, fingerprint, checksum) reads as missing and is counted (:attr:`StorageStats.corrupt_records`).
Puts and gets are zero-copy between the host pool's pages (registered with the store
once) and the store: each object is two buffers, its header (built in a small
registered scratch area) and the host page.

Every call into Mooncake may block for seconds while the master is unreachable (its RPC
timeouts): the tier manager calls this backend only from its own threads
(:mod:`hicache.tiers.remote`). The data calls let other threads run meanwhile; ``setup``
does not (it holds the interpreter's lock while it retries), so a lazy backend joins only
after a plain TCP connection to the master got through. A failed RPC raises :class:`RemoteUnavailable`; a key
that is not stored is just missing. Leases and eviction are the master's: nothing here
deletes on capacity, and :meth:`iter_metadata` lists nothing (a remote tier is not
rebuilt into the tree; it is asked).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash

from hicache.errors import InvalidArgument, StorageUnavailable
from hicache.keys import PAGE_KEY_BYTES
from hicache.storage.base import Buffer, PageBatch, PageMeta, PageRecord, PutResult, StorageStats

logger = logging.getLogger(__name__)

RECORD_MAGIC = b"HCRM"
RECORD_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQ16s16s16sI4xQ")
HEADER_BYTES = _HEADER.size  # 96
_CHECKSUM_OFFSET = HEADER_BYTES - 8
KEY_PREFIX = "hicache/2/"  # object names: this prefix, the namespace id in hex, "/", the page key in hex
PURGE_BATCH = 64  # namespaces per remove-by-pattern call at most (the master scans every object per call)

# Mooncake's error codes: object not found (missing, not bad), RPC failure (the store is
# unreachable), no segment with room (a put skipped). Any other failure of a get — a
# value of another size among them — reads as a bad record.
_NOT_FOUND = -704
_RPC_FAIL = -900
_NO_SPACE = -200  # no segment has room (or none is mounted): the put is skipped


class RemoteUnavailable(StorageUnavailable):
    """The remote store did not answer (its master or a segment is unreachable)."""


def object_name(namespace: bytes, key: bytes) -> str:
    return f"{KEY_PREFIX}{namespace.hex()}/{key.hex()}"


def namespace_pattern(namespaces: Sequence[bytes]) -> str:
    """The regular expression the master matches the names of these namespaces'
    objects with (hex digits only: nothing to escape)."""
    return f"^{KEY_PREFIX}({'|'.join(ns.hex() for ns in namespaces)})/"


@dataclass(frozen=True, kw_only=True)
class MooncakeConfig:
    """How to join a Mooncake Store (``[remote]`` in the daemon's config)."""

    master: str  # the master's host:port
    metadata_server: str = "P2PHANDSHAKE"  # P2PHANDSHAKE needs no metadata server
    protocol: str = "tcp"  # or "rdma"
    device_names: str = ""  # RDMA devices ("" = auto / none for tcp)
    local_hostname: str = "127.0.0.1"  # the address other nodes reach this one at
    segment_bytes: int = 0  # memory this node contributes to the store (0: none)
    buffer_bytes: int = 16 << 20  # the client's local transfer buffer

    def __post_init__(self) -> None:
        if not self.master or ":" not in self.master:
            raise InvalidArgument(f"remote master must be host:port, got {self.master!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise InvalidArgument(f"remote protocol must be tcp or rdma, got {self.protocol!r}")
        if self.segment_bytes < 0 or self.buffer_bytes <= 0:
            raise InvalidArgument("remote segment_bytes must be >= 0 and buffer_bytes > 0")


def _checksum(header, tokens, payload) -> int:
    """xxh3_64 of the payload, seeded with xxh3_64 of the header's first 88 bytes and
    the tokens (one pass over the payload, ~15 % faster than a streamed digest)."""
    seed = xxhash.xxh3_64_intdigest(bytes(header[:_CHECKSUM_OFFSET]) + bytes(tokens))
    return xxhash.xxh3_64_intdigest(payload, seed=seed)


def _bytes_of(buffer) -> np.ndarray:
    """A buffer's bytes as a flat uint8 array (no copy): numpy, torch, bytes-like."""
    if hasattr(buffer, "numpy"):  # a torch tensor
        buffer = buffer.numpy()
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


def _address(buffer) -> tuple[int, int]:
    """(pointer, bytes) of a contiguous buffer."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise InvalidArgument("a remote buffer must be contiguous")
        return buffer.ctypes.data, buffer.nbytes
    if hasattr(buffer, "data_ptr"):  # a torch tensor
        if not buffer.is_contiguous():
            raise InvalidArgument("a remote buffer must be contiguous")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()
    array = np.frombuffer(buffer, dtype=np.uint8)
    return array.ctypes.data, array.nbytes


class MooncakeBackend:
    """See the module docstring. Thread-safe: calls run on any thread (each thread has
    its own header scratch area)."""

    BATCH = 512  # objects per Mooncake call at most
    RUN = 32  # objects per get whose checks overlap the next get

    RECONNECT_S = 1.0  # between attempts to join the store while it is unreachable

    def __init__(self, config: MooncakeConfig, *, store=None, lazy: bool = False) -> None:
        """``store``: an already set-up ``MooncakeDistributedStore`` (tests), else one is
        made from ``config`` — now, or with ``lazy`` on the first call that needs it
        (a daemon starts while the master is down; every call retries the join, at most
        every :attr:`RECONNECT_S`, raising :class:`RemoteUnavailable` meanwhile)."""
        self.config = config
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []  # (pointer, bytes) to register with the store
        self._next_try = 0.0
        if store is None and not lazy:
            store = self._connect(config)
        self._store = store
        self._local = threading.local()
        self._keep: list[np.ndarray] = []  # scratch areas (registered: kept alive until close)
        self._corrupt = 0
        self._closed = False
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="hicache-remote-check")

    def _probe_master(self) -> None:
        """Is the master listening? Mooncake's ``setup`` holds the interpreter's lock
        while it retries an unreachable master (seconds: every thread of the daemon would
        stop), so it is called only once a plain connection gets through."""
        host, _, port = self.config.master.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0).close()
        except (OSError, ValueError) as exc:
            raise RemoteUnavailable(f"the Mooncake master at {self.config.master} does not answer: {exc}") from None

    @staticmethod
    def _connect(config: MooncakeConfig):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise StorageUnavailable(
                "the remote tier needs Mooncake: pip install 'hicache[remote]' "
                "(mooncake-transfer-engine-non-cuda; on Debian also apt-get install libibverbs1)"
                f" ({exc})") from exc
        store = MooncakeDistributedStore()
        rc = store.setup(config.local_hostname, config.metadata_server, config.segment_bytes,
                         config.buffer_bytes, config.protocol, config.device_names, config.master)
        if rc != 0:
            raise RemoteUnavailable(f"cannot join the Mooncake Store at {config.master} (setup returned {rc})")
        return store

    def _client(self):
        """The store, joined (now, if it was not: see ``lazy``)."""
        self._check_open()
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is None:
                now = time.monotonic()
                if now < self._next_try:
                    raise RemoteUnavailable(f"not joined to the Mooncake Store at {self.config.master} yet")
                self._next_try = now + self.RECONNECT_S
                self._probe_master()
                store = self._connect(self.config)
                for ptr, size in self._registered:
                    rc = store.register_buffer(ptr, size)
                    if rc != 0:
                        raise RemoteUnavailable(f"the store refused to register {size} bytes (rc {rc})")
                self._store = store
                logger.info("joined the Mooncake Store at %s", self.config.master)
            return self._store

    # -- memory registration ------------------------------------------------------------

    def register(self, array: np.ndarray) -> None:
        """Register ``array`` (the host pool's pages) for zero-copy transfers; idempotent
        (and remembered: registered again when the store is joined later)."""
        ptr, size = _address(array)
        with self._lock:
            if any(p <= ptr and ptr + size <= p + s for p, s in self._registered):
                return
            if self._store is not None:
                rc = self._store.register_buffer(ptr, size)
                if rc != 0:
                    raise RemoteUnavailable(f"the store refused to register {size} bytes (rc {rc})")
            self._registered.append((ptr, size))

    def unregister(self, array: np.ndarray) -> None:
        """Forget ``array`` (a closing manager's host pool): Mooncake refuses a region
        that overlaps a registered one, and the next host pool is often mapped over the
        freed range. Only what :meth:`register` registered itself is unregistered."""
        ptr, size = _address(array)
        with self._lock:
            if (ptr, size) not in self._registered:
                return
            self._registered.remove((ptr, size))
            if self._store is not None and not self._closed:
                rc = self._store.unregister_buffer(ptr)
                if rc != 0:
                    logger.warning("the store did not unregister %d bytes (rc %s)", size, rc)

    @property
    def registered_bytes(self) -> int:
        """Bytes registered with the store now (host pools, staging and scratch areas)."""
        with self._lock:
            return sum(size for _, size in self._registered)

    def release_scratch(self) -> None:
        """Unregister and free the calling thread's scratch area, if it has one (a thread
        that calls the store for the last time: a closing manager's lanes — the store
        outlives them)."""
        area = getattr(self._local, "area", None)
        if area is None:
            return
        self._local.area = None
        self.unregister(area)
        with self._lock:
            self._keep = [a for a in self._keep if a is not area]

    def _scratch(self, header_bytes: int) -> np.ndarray:
        """This thread's registered header area: :attr:`BATCH` headers of ``header_bytes``."""
        area = getattr(self._local, "area", None)
        if area is None or area.shape[1] != header_bytes:
            area = np.zeros((self.BATCH, header_bytes), dtype=np.uint8)
            self.register(area)
            with self._lock:
                self._keep.append(area)
            self._local.area = area
        return area

    # -- the remote tier's calls ----------------------------------------------------------

    def contains(self, keys: Sequence[bytes], *, namespace: bytes) -> list[bool]:
        """Which of ``keys`` (pages of ``namespace``) the store holds now (one master RPC
        per :attr:`BATCH`)."""
        store = self._client()
        found: list[bool] = []
        for start in range(0, len(keys), self.BATCH):
            names = [object_name(namespace, k) for k in keys[start : start + self.BATCH]]
            codes = store.batch_is_exist(names)
            if any(c < 0 for c in codes):
                raise RemoteUnavailable(f"the store did not answer is_exist (codes {sorted(set(codes))})")
            found.extend(c == 1 for c in codes)
        return found

    def put_batch(self, batch: PageBatch, *, fingerprint: bytes) -> Future[PutResult]:
        """Store ``batch``'s records (synchronously, on the caller's thread: the tier
        manager calls from its remote thread); the future is done when they are."""
        future: Future = Future()
        try:
            written, refused = self._put(batch, fingerprint)
            future.set_result(PutResult(written, (), refused))
        except BaseException as exc:  # (delivered through the future, as the port says)
            future.set_exception(exc)
        return future

    def _put(self, batch: PageBatch, fingerprint: bytes) -> tuple[int, tuple[bytes, ...]]:
        """The objects written, and the keys of those the store refused."""
        store = self._client()
        n = batch.num_records
        if n == 0:
            return 0, ()
        if len(batch.tokens) % n:
            raise InvalidArgument("the batch's tokens are not equal slices")
        token_bytes = len(batch.tokens) // n
        source = batch.source
        payload = source.shape[1]
        base, _ = _address(source)
        header_bytes = HEADER_BYTES + token_bytes
        area = self._scratch(header_bytes)
        area_ptr = area.ctypes.data
        written = 0
        refused: list[bytes] = []
        for start in range(0, n, self.BATCH):
            stop = min(n, start + self.BATCH)
            names, ptrs, sizes = [], [], []
            for j, i in enumerate(range(start, stop)):
                key = batch.keys[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES]
                tokens = batch.tokens[i * token_bytes : (i + 1) * token_bytes]
                row = int(batch.rows[i])
                header = area[j]
                _HEADER.pack_into(header, 0, RECORD_MAGIC, RECORD_VERSION, header_bytes, fingerprint, payload, key,
                                  batch.namespaces[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES],
                                  batch.parents[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES], token_bytes, 0)
                header[HEADER_BYTES:] = np.frombuffer(tokens, dtype=np.uint8)
                checksum = _checksum(header, tokens, source[row])
                struct.pack_into("<Q", header, _CHECKSUM_OFFSET, checksum)
                names.append(object_name(batch.namespaces[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES], key))
                ptrs.append([area_ptr + j * header_bytes, base + row * payload])
                sizes.append([header_bytes, payload])
            codes = store.batch_put_from_multi_buffers(names, ptrs, sizes)
            if codes and all(c == _RPC_FAIL for c in codes):
                raise RemoteUnavailable("the store did not answer a put")
            written += sum(1 for c in codes if c == 0)
            refused.extend(batch.keys[i * PAGE_KEY_BYTES : (i + 1) * PAGE_KEY_BYTES]
                           for i, c in zip(range(start, stop), codes) if c != 0)
            if any(c not in (0, _NO_SPACE) for c in codes):
                logger.warning("remote put: %d of %d objects refused (codes %s)",
                               sum(1 for c in codes if c != 0), len(codes), sorted(set(codes)))
        return written, tuple(refused)

    def put(self, records: Sequence[PageRecord], *, fingerprint: bytes) -> Future[PutResult]:
        """:meth:`put_batch` of records given one by one (tests, tools)."""
        if not records:
            return self.put_batch(PageBatch(b"", b"", b"", b"", np.zeros((0, 0), np.uint8), np.zeros(0, np.int64)),
                                  fingerprint=fingerprint)
        source = np.stack([_bytes_of(r.payload) for r in records])
        batch = PageBatch(b"".join(r.key for r in records), b"".join(r.meta.namespace for r in records),
                          b"".join(r.meta.parent for r in records), b"".join(r.meta.tokens for r in records),
                          source, np.arange(len(records)))
        return self.put_batch(batch, fingerprint=fingerprint)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Buffer], *, fingerprint: bytes, namespace: bytes,
            token_bytes: int | None = None) -> list[bool]:
        """Copy each stored, intact object (pages of ``namespace``) into its buffer (the
        payload only); ``False`` where it is missing or fails a check. ``token_bytes``:
        the tokens a record of this spec carries (by default, whatever the object says)."""
        store = self._client()
        if len(keys) != len(buffers):
            raise InvalidArgument("one buffer per key")
        found: list[bool] = []
        for start in range(0, len(keys), self.BATCH):
            found.extend(self._get(store, [object_name(namespace, k) for k in keys[start : start + self.BATCH]],
                                   keys[start : start + self.BATCH], buffers[start : start + self.BATCH],
                                   fingerprint, token_bytes))
        return found

    def _get(self, store, names, keys, buffers, fingerprint: bytes, token_bytes: int | None) -> list[bool]:
        addresses = [_address(b) for b in buffers]
        if token_bytes is None:
            sizes = [store.get_size(name) for name in names]
            token_bytes = max([s - HEADER_BYTES - a[1] for s, a in zip(sizes, addresses)] + [0])
        header_bytes = HEADER_BYTES + token_bytes
        area = self._scratch(header_bytes)
        area_ptr = area.ctypes.data
        ptrs = [[area_ptr + j * header_bytes, addresses[j][0]] for j in range(len(keys))]
        sizes = [[header_bytes, addresses[j][1]] for j in range(len(keys))]

        def check(start: int, codes: list[int]) -> list[bool]:
            found = []
            for j, code in enumerate(codes, start):
                ok = code == header_bytes + addresses[j][1] and self._intact(
                    area[j], keys[j], fingerprint, buffers[j], addresses[j][1])
                if not ok and code not in (_NOT_FOUND, _RPC_FAIL):  # (a value of another size: bad too)
                    with self._lock:
                        self._corrupt += 1
                    logger.warning("remote record %s fails its checks: read as missing", keys[j].hex())
                found.append(ok)
            return found

        # A run of gets, each run's checksums on the checker thread while the next run
        # transfers (both let go of the interpreter): the checks cost ~1/5 of a get here.
        checks = []
        failed = True
        for start in range(0, len(keys), self.RUN):
            stop = start + self.RUN
            codes = store.batch_get_into_multi_buffers(names[start:stop], ptrs[start:stop], sizes[start:stop])
            failed = failed and all(c == _RPC_FAIL for c in codes)
            checks.append(self._checker.submit(check, start, codes))
        found = [ok for done in checks for ok in done.result()]
        if keys and failed:
            raise RemoteUnavailable("the store did not answer a get")
        return found

    @staticmethod
    def _intact(header: np.ndarray, key: bytes, fingerprint: bytes, buffer, payload: int) -> bool:
        magic, version, size, fp, length, stored_key, _, _, tokens, checksum = _HEADER.unpack_from(header, 0)
        if (magic != RECORD_MAGIC or version != RECORD_VERSION or size != len(header) or fp != fingerprint
                or length != payload or stored_key != key or tokens != size - HEADER_BYTES):
            return False
        return _checksum(header, header[HEADER_BYTES:], _bytes_of(buffer)) == checksum

    # -- the rest of the storage port -----------------------------------------------------

    def delete(self, keys: Sequence[bytes], *, namespace: bytes) -> Future[int]:
        """Remove ``keys`` (pages of ``namespace``), leased or not (as :meth:`purge`)."""
        future: Future = Future()
        try:
            codes = self._client().batch_remove([object_name(namespace, k) for k in keys], True) if keys else []
            future.set_result(sum(1 for c in codes if c == 0))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def purge(self, namespaces: Sequence[bytes]) -> int:
        """Remove every object of ``namespaces`` from the store — whichever node put it,
        leased or not (a reader whose object goes mid-transfer finds it fails its
        checks: read as missing) — and return how many went. Synchronous (the tier
        manager calls from its remote write thread): one master call per
        :data:`PURGE_BATCH` namespaces, each a scan of the master's objects."""
        store = self._client()
        namespaces = list(namespaces)
        removed = 0
        for start in range(0, len(namespaces), PURGE_BATCH):
            count = store.remove_by_regex(namespace_pattern(namespaces[start : start + PURGE_BATCH]), True)
            if count < 0:
                raise RemoteUnavailable(f"the store did not remove the namespaces' objects (code {count})")
            removed += count
        return removed

    def iter_metadata(self, batch: int | None = None) -> Iterator[tuple[bytes, PageMeta]]:
        """A remote store is asked, not listed: nothing."""
        return iter(())

    def read_tokens(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [None] * len(keys)

    def flush(self, timeout_s: float | None = None) -> None:
        """Puts are synchronous: nothing is queued."""

    def stats(self) -> StorageStats:
        return StorageStats(records=0, bytes=0, capacity_bytes=0, map_size_bytes=0,
                            corrupt_records=self._corrupt, evicted_records=0, pending_writes=0)

    @property
    def corrupt_records(self) -> int:
        return self._corrupt

    def _check_open(self) -> None:
        if self._closed:
            raise StorageUnavailable("the remote store is closed")

    def close(self, timeout_s: float | None = None) -> None:
        """Unregister the memory registered with the store and leave it. Idempotent;
        every other method raises afterwards. Past ``timeout_s`` (``None``: no bound)
        with that still running — Mooncake's calls block while its master is gone —
        raises ``TimeoutError``: it is left to a daemon thread and the process's exit
        (the store's master leases and evicts on its own: nothing is lost but the wait)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        closer = threading.Thread(target=self._leave, name="hicache-remote-close", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            raise TimeoutError(f"closing the Mooncake Store client ({self.config.master}) did not finish in "
                               f"{timeout_s:g} s")

    def _leave(self) -> None:
        self._checker.shutdown(wait=True)
        if self._store is None:
            return
        try:
            for ptr, _ in self._registered:
                self._store.unregister_buffer(ptr)
            self._store.close()
        except Exception as exc:  # (closing a store whose master is gone)
            logger.warning("closing the remote store: %s", exc)
