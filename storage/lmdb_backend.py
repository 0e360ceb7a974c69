"""The default disk tier: page payloads in slab files, their index in one LMDB
environment; one writer thread, readers on any thread.

Layout of the store directory::

    data.mdb, lock.mdb    the LMDB environment, sub-databases
        "meta":    page key (16 B) -> metadata record (88 B) + token ids
        "payload": page key (16 B) -> header (48 B) + page bytes   (stores written
                   before the slab files: read, never written; see "Legacy records")
    slab-<slot bytes>.bin one file per slot size: slot i at byte i * slot bytes

    metadata record, little-endian (version 3)
    +-------+-----------------------------------------------------------------+
    | 0  B  | meta format version (3)                                         |
    | 1  3x | reserved (zero)                                                 |
    | 4  Q  | payload size                                                    |
    | 12 d  | last access (unix s)                                            |
    | 20 16s| namespace id                                                    |
    | 36 16s| parent page key                                                 |
    | 52 16s| spec fingerprint                                                |
    | 68 I  | token bytes that follow                                         |
    | 72 Q  | slot: the payload is bytes [slot * S, slot * S + payload size)  |
    |       | of slab-<S>.bin, S = the slot size of the payload size          |
    | 80 Q  | xxh3_64 of the payload, seeded by key, fingerprint and size     |
    +-------+-----------------------------------------------------------------+

Why slab files: LMDB can only take a value as one buffer (py-lmdb has no MDB_RESERVE),
so a payload stored in LMDB was copied behind its header, then copied into LMDB's dirty
pages, then written out at the commit: puts ran at 0.23-0.37x a raw ``pwrite`` of the
same bytes. A put now checksums the caller's rows in place and ``pwritev``s them into
free slots, one call per run of adjacent slots; a get ``preadv``s into the caller's
buffers and checksums them there. LMDB keeps what it is good at: the small records, the
atomic commit and MVCC reads.

Slot sizes are classes (``m * 2^e``, ``m`` in 4..7, at least 512 bytes), so a store of
many payload sizes holds a handful of files; a payload shorter than its slot leaves the
slot's tail unwritten (a hole: no disk space). A slot is free when no committed record
names it. A slot freed by a commit is reused only once every read that began before that
commit is over (:class:`_ReadGate` counts readers by generation), so a read never sees a
slot being rewritten for another key. Opening the store rebuilds the free slots from
the metadata, truncates each file after its last used slot and punches out the free
slots below it (see "Disk space"); the records it finds naming a slot past their file's
end, or one another record names, count as gone and their slots as free, so the open
fails unless the commit that deletes them succeeds.

Disk space: a slot keeps its disk blocks when its record goes, and the free slots of
one size cannot hold payloads of another, so when the mix of payload sizes shifts
(pages with and without their SWA layers, a second spec) the files of the sizes in
decline would keep their space. After each commit the writer makes free what no read
can use any more (the read gate's test above). Each time the slots freed since the last
round (``_Slab.dirty``) and not taken again add up to more than the slack,
``min(2 * max_batch_bytes, capacity_bytes / 16)``, a round ends: the slots that stayed
free through the whole round before it (``_Slab.stale``: their size is in decline) give
their space back — each such file is cut after its last slot that is neither used nor
recently freed, and the stale slots below are punched out, one
``fallocate(PUNCH_HOLE | KEEP_SIZE)`` a run (where the file system cannot, only the cut
is done) — and this round's freed slots become stale. A store in steady state takes the
slots it frees again within a round or two, so it punches almost nothing (punching them
cost steady puts 2.5x: the file system allocates a punched slot again when it is
rewritten); free slots keep at most about two slacks of blocks::

    before a round's end | used | stale | hole | used | freed | hole | stale |
    after                | used | hole  | hole | used | stale |

Ordering: a put writes its payloads to free slots first and commits their metadata
after; a kill between the two leaves slots that no record names, which the next open
finds free. The commit is the only moment a record appears. With ``sync=True`` the slab
files are ``fdatasync``ed before each commit.

Legacy records (meta format version 2, 72-byte record without slot and checksum): their
payload is in the "payload" sub-database behind a 48-byte header (magic ``HCKV``,
version 1, header size, fingerprint, length, xxh3_64 of the header's first 32 bytes and
the payload). They stay readable, count toward the capacity and are evicted like any
other record; a put of the same key replaces one with a slab record. A store therefore
keeps its cache across the upgrade and sheds the old format as it turns over.

The checksum covers the key, the fingerprint and the size, so a record whose metadata
was damaged, or a slot that holds another key's bytes, fails like a flipped payload byte.

Integrity: every get checks the metadata's version and length, reads the payload and
checks its checksum before reporting it found. A record that fails is reported missing,
counted in ``corrupt_records`` and queued for deletion: the writer checks it again in
its own transaction (the key may have been rewritten since) and deletes it, so it stops
taking capacity. An intact record of another spec fingerprint, or of another size than
the buffer given for it, is reported missing and counted as well, but kept: deleting it
would punish a caller bug (the other records of the get are judged on their own). A read that fails
says nothing about the record, and the writer's second check keeps a record it cannot
read. An I/O error (EIO: a bad sector) is the bytes' own: the records of a run whose
read met one are read again one at a time, and the get judges the others and raises
:class:`~hicache.errors.RecordsUnreadable`, which names the unreadable ones (kept, not
counted) and carries what it found of the rest. Any other failure (ENOMEM, ...) fails
the whole get with :class:`~hicache.errors.StorageUnavailable`, judging no record.

Writes: :meth:`LmdbBackend.put` and :meth:`LmdbBackend.delete` validate on the caller's
thread and queue an operation; the writer thread (which also opens the environment, so
every write transaction lives on the thread that opened it) takes whatever is queued, up
to ``max_batch_records`` / ``max_batch_bytes``, applies it in ONE write transaction,
commits, updates the record and byte counts and only then resolves the futures, in queue order.
The byte bound defaults to 8 MiB of payload: the writer checksums and puts the metadata
of a batch while its slab writes run, so larger batches overlap more (1 and 2 MiB puts
~10% faster than with 2 MiB batches in ``bench_storage.py``). One put call is never
split (its records commit together), so a larger call makes a larger transaction.
A batch that raises (its commit included) is aborted, gives back the slots it took and
fails all its futures; the counts change only after a commit, so the store and the counts
stay consistent. ``lmdb.MapFullError`` (from a put or from the commit) doubles the map and
retries the batch.

Reads run on the caller's thread in their own read transaction (LMDB MVCC: they never
wait for a commit). Growing the map (and closing) needs every transaction of this
process to be finished — py-lmdb aborts open ones and the mapping moves, which would
leave a reader's zero-copy views pointing at unmapped memory — so readers hold a shared
:class:`_ReadGate` for the life of their transaction and the writer takes it exclusively
for a resize. That is the only time a read can wait, and a resize is rare (the map
doubles each time).

Durability: a commit is atomic and, once ``put``'s future resolves, survives the process
being killed at any moment (the data is in the OS page cache). With ``sync=False`` (the
default) an OS crash or power loss can lose the last commits, never tear one;
``sync=True`` fsyncs on every commit.

``writemap`` is off by default. On, LMDB writes its pages in the map in place, but the
data file becomes a sparse file of the map's size, and on a full disk the first write to
a page kills the process with SIGBUS; off, the commit fails with ENOSPC and only that
batch's futures fail. (A full disk under a slab write fails that batch the same way.)

Capacity: ``capacity_bytes`` bounds the stored payload bytes; the least recently used
records go first. The slab files' blocks hold at most that much written payload, plus
the slots freed by commits that readers still hold, the slack of free slots not yet
given back and one batch's worth (without hole punching, free slots below a used one
keep their blocks too). The LRU order is the stored last-access times: no per-record
index is kept in memory (an ordered dict of keys and sizes cost ~190 bytes a record,
3 GB for a 16 M-page store). Reads record their accesses in memory and the writer persists
them lazily, with the next batch or after ``access_flush_interval_s`` of idleness, never
one write per read; until then the later of a recorded and the stored time counts.
Eviction takes its victims from a queue of the oldest records, refilled by one scan of
the metadata (the oldest sixteenth of the store, at least 1,024): every record outside
the queue was newer than all inside at the scan, and times only grow, so a queued record
whose time has not changed since is the oldest there is — exact LRU at O(1) a victim
amortized.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import heapq
import itertools
import logging
import os
import struct
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import NamedTuple, Union

import lmdb
import numpy as np
import torch
import xxhash

from hicache.errors import HicacheError, InvalidArgument, RecordsUnreadable, StorageUnavailable
from hicache.keys import PAGE_KEY_BYTES, TOKEN_BYTES
from hicache.spec import FINGERPRINT_BYTES
from hicache.storage.base import Buffer, PageBatch, PageMeta, PageRecord, PutResult, StorageStats

logger = logging.getLogger(__name__)


# Legacy payload records (meta format version 2): header + payload in "payload".
PAYLOAD_MAGIC = b"HCKV"
PAYLOAD_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQQ8x")
HEADER_BYTES = _HEADER.size  # 48
_CHECKSUM_OFFSET = 32  # the checksum covers header bytes [0, 32) and the payload

META_VERSION = 3
LEGACY_META_VERSION = 2
_META = struct.Struct("<B3xQd16s16s16sI")  # the fields of both versions
_META_SLOT = _META.size  # 72: version 3 goes on with the slot and the checksum
_SLOT_CHECKSUM = struct.Struct("<QQ")
# A current-version record's version, size, fingerprint, token bytes, slot and checksum.
_META_READ = struct.Struct("<B3xQ40x16sIQQ")
META_BYTES = _META_SLOT + _SLOT_CHECKSUM.size  # 88
LEGACY_META_BYTES = _META.size  # 72
_META_ACCESS = struct.Struct("<d")
_META_ACCESS_OFFSET = 12
_META_NAMESPACE = 20  # offsets of the namespace id and the parent page key
_META_PARENT = 36

_PAYLOAD_DB = b"payload"
_META_DB = b"meta"
_SLAB_PREFIX, _SLAB_SUFFIX = "slab-", ".bin"
_SLOT_MIN_BYTES = 512
_MIB = 1 << 20
# Keeps successive access stamps strictly increasing, so the order persisted for a
# restart is the in-memory LRU order even when the clock does not advance between calls.
_STAMP_STEP_S = 1e-6
_CHECK_WAIT_S = 30.0  # check_invariants' wait for a moment between two commits
_CHECK_LOOK_EVERY = 4096  # records it reads between two looks at a close or a resize waiting for it
_META_SIZE_ACCESS = struct.Struct("<Qd")  # payload size and last access, at offset 4
_VICTIMS_MIN = 1024  # eviction candidates taken by one scan at least ...
_VICTIMS_SHARE = 16  # ... or this fraction of the records
_IOV_MAX = 1024  # buffers one preadv / pwritev takes (Linux's IOV_MAX)
# A get reads at most this many bytes per preadv and checksums them at once, while they
# are still in the CPU's cache (a whole run read first and checked after: ~0.6x the read
# alone; in pieces: ~0.75x, measured by bench_storage on a 2 MiB-L2 Xeon).
_READ_PIECE_BYTES = 256 << 10


def default_map_size(capacity_bytes: int) -> int:
    """Initial map size for a store of ``capacity_bytes`` of payload: room for headers,
    page rounding, the B-trees and pages freed but not yet reusable; the map doubles on
    demand beyond that. 2 MiB multiple."""
    size = capacity_bytes + capacity_bytes // 2 + 64 * _MIB
    return -(-size // (2 * _MIB)) * (2 * _MIB)


def _byte_view(buffer: Buffer, *, writable: bool) -> np.ndarray:
    """``buffer`` as a flat uint8 array over the same memory (no copy).

    Accepts contiguous CPU torch tensors, C-contiguous numpy arrays and objects with the
    buffer protocol (bytearray, memoryview; bytes only when ``writable`` is false).
    """
    if type(buffer) is np.ndarray and buffer.ndim == 1 and buffer.dtype == np.uint8 and buffer.flags.c_contiguous:
        if writable and not buffer.flags.writeable:
            raise InvalidArgument("numpy buffer is read-only")
        return buffer
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise InvalidArgument(f"tensor buffer must be on the CPU, got {buffer.device}")
        if not buffer.is_contiguous():
            raise InvalidArgument("tensor buffer must be contiguous")
        return buffer.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise InvalidArgument("numpy buffer must be C-contiguous")
        if writable and not buffer.flags.writeable:
            raise InvalidArgument("numpy buffer is read-only")
        if buffer.dtype.hasobject:
            raise InvalidArgument("numpy buffer must not hold objects")
        return buffer.reshape(-1).view(np.uint8)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise InvalidArgument(f"not a byte buffer: {type(buffer).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgument("buffer must be contiguous")
    if writable and view.readonly:
        raise InvalidArgument(f"buffer is read-only: {type(buffer).__name__}")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)


def _require_key(key: bytes, what: str = "page key") -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != PAGE_KEY_BYTES:
        raise InvalidArgument(f"{what} must be {PAGE_KEY_BYTES} bytes, got {key!r:.60}")
    return bytes(key)


def _require_bytes(data, what: str) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise InvalidArgument(f"{what} must be bytes, got {type(data).__name__}")


def _resolved(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _settle(future: Future, outcome) -> None:
    """Resolve ``future`` with ``outcome`` (an exception fails it), unless it is done
    already: its caller may cancel it at any moment, and the writer must go on (the
    operation it stands for was applied, or failed, all the same)."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass  # cancelled (nobody waits for it), or resolved before


def _require_fingerprint(fingerprint: bytes) -> bytes:
    if not isinstance(fingerprint, (bytes, bytearray)) or len(fingerprint) != FINGERPRINT_BYTES:
        raise InvalidArgument(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
    return bytes(fingerprint)


@functools.cache
def slot_bytes_for(size: int) -> int:
    """The slot size that holds a payload of ``size`` bytes: the least ``m * 2^e`` (``m``
    in 4..7) not below it, at least 512 — under 25% over, and exact for powers of two."""
    if size <= _SLOT_MIN_BYTES:
        return _SLOT_MIN_BYTES
    step = 1 << (size.bit_length() - 3)
    return -(-size // step) * step


def _checksum_seed(fingerprint: bytes, size: int) -> int:
    """The part of a record's checksum seed that its spec and size give (see :func:`_checksum`)."""
    return int.from_bytes(fingerprint[:8], "little") ^ int.from_bytes(fingerprint[8:], "little") ^ size


def _record_seed(key: bytes, seed: int) -> int:
    """The xxh3 seed of one record's checksum: its key (itself a hash) with ``seed``
    (:func:`_checksum_seed`), so bytes stored for another key, spec or length do not pass."""
    return int.from_bytes(key[:8], "little") ^ seed


def _checksum(key: bytes, seed: int, payload) -> int:
    """The record checksum: the payload's xxh3_64 seeded by :func:`_record_seed`."""
    return xxhash.xxh3_64_intdigest(payload, seed=_record_seed(key, seed))


def _legacy_checksum(value, length: int) -> int:
    digest = xxhash.xxh3_64(value[:_CHECKSUM_OFFSET])
    digest.update(value[HEADER_BYTES : HEADER_BYTES + length])
    return digest.intdigest()


def _parse_legacy_payload(value) -> tuple[bytes, int] | None:
    """``(fingerprint, payload length)`` of an intact legacy payload value, ``None`` for a
    corrupt one (bad magic, version or header size, a value shorter or longer than its
    header says, or a checksum mismatch). Reads ``value`` in place."""
    if len(value) < HEADER_BYTES:
        return None
    magic, version, header_bytes, fingerprint, length, checksum = _HEADER.unpack_from(value, 0)
    if (
        magic != PAYLOAD_MAGIC
        or version != PAYLOAD_VERSION
        or header_bytes != HEADER_BYTES
        or len(value) != HEADER_BYTES + length
        or _legacy_checksum(value, length) != checksum
    ):
        return None
    return fingerprint, length


def _encode_metas(namespaces: bytes, parents: bytes, tokens: bytes, fingerprint: bytes,
                  payload_size: int) -> np.ndarray:
    """The metadata records of a put, one row each (``_META``, slot and checksum, then
    the token ids), with last access, slot and checksum 0: the writer fills them in.
    Arguments as in :class:`~hicache.storage.base.PageBatch`."""
    n = len(namespaces) // PAGE_KEY_BYTES
    token_bytes = len(tokens) // n
    fixed = bytearray(META_BYTES)  # (slot and checksum 0)
    _META.pack_into(fixed, 0, META_VERSION, payload_size, 0.0, bytes(PAGE_KEY_BYTES), bytes(PAGE_KEY_BYTES),
                    fingerprint, token_bytes)
    meta = np.empty((n, META_BYTES + token_bytes), dtype=np.uint8)
    meta[:, :META_BYTES] = np.frombuffer(fixed, dtype=np.uint8)
    meta[:, _META_NAMESPACE : _META_NAMESPACE + PAGE_KEY_BYTES] = _rows(namespaces, n)
    meta[:, _META_PARENT : _META_PARENT + PAGE_KEY_BYTES] = _rows(parents, n)
    meta[:, META_BYTES:] = _rows(tokens, n)
    return meta


def _rows(data: bytes, n: int) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).reshape(n, -1)


def _meta_fields(value) -> tuple | None:
    """The fixed fields of a metadata record (``_META``'s), or ``None`` if it is not a
    well-formed record of the current or the legacy version."""
    if len(value) < LEGACY_META_BYTES:
        return None
    fields = _META.unpack_from(value, 0)
    version, num_token_bytes = fields[0], fields[-1]
    if version == META_VERSION:
        fixed = META_BYTES
    elif version == LEGACY_META_VERSION:
        fixed = LEGACY_META_BYTES
    else:
        return None
    if len(value) != fixed + num_token_bytes or num_token_bytes % TOKEN_BYTES:
        return None
    return fields


@functools.cache
def _meta_columns(num_token_bytes: int) -> struct.Struct:
    """A current-version record with ``num_token_bytes`` of tokens, whole: ``_META``'s
    fields, the slot and checksum skipped, the tokens."""
    return struct.Struct(f"{_META.format}16x{num_token_bytes}s")


def _slot_of(value) -> tuple[int, int]:
    """``(slot, checksum)`` of a well-formed current-version metadata record."""
    return _SLOT_CHECKSUM.unpack_from(value, _META_SLOT)


def _tokens_of(value, version: int) -> bytes:
    return bytes(value[META_BYTES if version == META_VERSION else LEGACY_META_BYTES :])


def _decode_meta(value) -> PageMeta | None:
    """The metadata record, or ``None`` if it is not a well-formed record."""
    fields = _meta_fields(value)
    if fields is None:
        return None
    version, payload_size, last_access_s, namespace, parent, fingerprint, _ = fields
    return PageMeta(
        namespace=namespace,
        parent=parent,
        tokens=_tokens_of(value, version),
        payload_size=payload_size,
        last_access_s=last_access_s,
        fingerprint=fingerprint,
    )


def _pwritev_all(fd: int, buffers: list, offset: int) -> None:
    """Write ``buffers`` back to back at ``offset``, resuming after short writes."""
    while buffers:
        written = os.pwritev(fd, buffers, offset)
        if written <= 0:
            raise OSError(f"pwritev wrote {written} bytes")
        offset += written
        while buffers and written >= memoryview(buffers[0]).nbytes:
            written -= memoryview(buffers.pop(0)).nbytes
        if written:
            buffers[0] = memoryview(buffers[0]).cast("B")[written:]


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's ``fallocate`` with 64-bit offsets, ``None`` off Linux or where libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    for name in ("fallocate64", "fallocate"):  # (musl has only the latter, with a 64-bit off_t)
        function = getattr(libc, name, None)
        if function is not None:
            function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
            function.restype = ctypes.c_int
            return function
    return None


_fallocate = _load_fallocate()


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give back the disk blocks of bytes ``[offset, offset + length)`` of ``fd``'s file
    (they read as zeros after; the file's size stays): whether the file system could.
    Raises :class:`OSError` for any failure but "not supported"."""
    if _fallocate is None:
        return False
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(error, f"fallocate(PUNCH_HOLE): {os.strerror(error)}")


def _runs(slots: np.ndarray) -> Iterator[tuple[int, int]]:
    """``(first slot, count)`` of each run of consecutive slots in ascending ``slots``."""
    if not len(slots):
        return
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(slots)]))
    yield from zip(slots[starts].tolist(), (ends - starts).tolist())


class _Slab:
    """One slab file and its free slots. Owned by the writer thread (readers only use
    ``fd`` and ``slot_bytes``). Free slots below ``end`` form a min-heap: the lowest go
    first, so a batch's slots tend to be adjacent (one ``pwritev`` / ``preadv`` a run)
    and the file stays dense. The free slots that may still hold disk blocks are
    ``dirty`` (freed since the last :meth:`reclaim`) or ``stale`` (freed before it and
    free ever since); the others are holes."""

    def __init__(self, path: str, slot_bytes: int, used: np.ndarray) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.end = int(used.max()) + 1 if len(used) else 0
        free = np.setdiff1d(np.arange(self.end, dtype=np.int64), used)
        self.free: list[int] = free.tolist()  # (a sorted list is a heap)
        self.dirty: set[int] = set()
        self.stale: set[int] = set()
        self.punches_holes = True  # until the file system says it cannot
        if os.fstat(self.fd).st_size != self.end * slot_bytes:  # (ext4 flushes a file cut to 0 on close)
            os.ftruncate(self.fd, self.end * slot_bytes)  # what lies beyond is no record's
        self._punch(free)  # (what the last run freed, or a crash left, no read can use yet)

    def take(self, n: int) -> list[int]:
        """``n`` free slots, ascending (the file grows when none is left)."""
        slots = [heapq.heappop(self.free) for _ in range(min(n, len(self.free)))]
        self.dirty.difference_update(slots)
        self.stale.difference_update(slots)
        if len(slots) < n:
            start = self.end
            self.end += n - len(slots)
            slots.extend(range(start, self.end))
        return slots

    def give(self, slots) -> None:
        """Make ``slots`` free (call once no read can use them any more)."""
        for slot in slots:
            heapq.heappush(self.free, slot)
        self.dirty.update(slots)

    @property
    def dirty_bytes(self) -> int:
        return len(self.dirty) * self.slot_bytes

    def reclaim(self) -> None:
        """Give back the disk space of the stale slots (free since before the last call:
        none was taken again for a whole round, so the sizes are shifting away from this
        one): cut the file after its last slot that is not free or recently freed, and
        punch out the stale slots below. The slots freed since the last call become
        stale. O(free slots) when the file is cut, else O(stale slots)."""
        stale, self.stale, self.dirty = self.stale, self.dirty, set()
        if self.end - 1 in stale:
            free = set(self.free)
            end = self.end
            while end and end - 1 in free and end - 1 not in self.stale:
                end -= 1
            try:
                os.ftruncate(self.fd, end * self.slot_bytes)
            except OSError as exc:  # (the slots stay free; the next reclaim tries again)
                logger.error("cutting %s to %d slots failed: %r", self.path, end, exc)
                self.stale.add(self.end - 1)
            else:
                self.end = end
                self.free = [slot for slot in self.free if slot < end]
                heapq.heapify(self.free)
        self._punch(np.array(sorted(slot for slot in stale if slot < self.end), dtype=np.int64))

    def _punch(self, slots: np.ndarray) -> None:
        """Punch holes for ``slots`` (ascending, free), one call a run."""
        if not self.punches_holes:
            return
        for first, count in _runs(slots):
            try:
                self.punches_holes = _punch_hole(self.fd, first * self.slot_bytes, count * self.slot_bytes)
            except OSError as exc:  # (the slots stay free; only their space is not given back)
                logger.error("punching holes in %s failed: %r", self.path, exc)
                return
            if not self.punches_holes:
                logger.info("%s: the file system cannot punch holes; only a free tail is cut", self.path)
                return

    def close(self) -> None:
        os.close(self.fd)


class _MakeWay(Exception):
    """A long read gives way to a map resize (see ``LmdbBackend.check_invariants``)."""


class _BytesUnreadable(StorageUnavailable):
    """An I/O error (EIO) reading a slab file: the bytes read, not the store, failed."""


def _preadv(slab: _Slab, buffers: list, slot: int, skip: int = 0) -> int:
    """``preadv`` of ``buffers`` from ``skip`` bytes into ``slot`` on: the bytes read, -1
    for an offset past what a file can hold (a damaged slot number: a bad record).
    Raises :class:`StorageUnavailable` if the read itself failed (EIO, ENOMEM, ...): the
    bytes were never seen, so nothing says the record is bad — :class:`_BytesUnreadable`
    for EIO, which the bytes read cause (ENOMEM says nothing of them)."""
    try:
        return os.preadv(slab.fd, buffers, slot * slab.slot_bytes + skip)
    except (OSError, OverflowError) as exc:
        if isinstance(exc, OverflowError) or exc.errno == errno.EINVAL:
            logger.error("reading %s at slot %d: no such offset (%r)", slab.path, slot, exc)
            return -1
        failure = _BytesUnreadable if exc.errno == errno.EIO else StorageUnavailable
        raise failure(f"reading {slab.path} failed: {exc}") from exc


def _streamed_checksum(slab: _Slab, slot: int, size: int, seed: int,
                       buffer_for: Callable[[int, int], np.ndarray]) -> int | None:
    """The checksum (seed ``seed``) of the ``size`` bytes of ``slot``, read in pieces of
    up to ``_READ_PIECE_BYTES`` (one read call returns at most ~2 GiB on Linux), each
    into ``buffer_for(skip, piece bytes)`` and hashed right after it arrives; ``None``
    if a read came back short."""
    digest = xxhash.xxh3_64(seed=seed)
    for skip in range(0, size, _READ_PIECE_BYTES):
        piece = buffer_for(skip, min(_READ_PIECE_BYTES, size - skip))
        if _preadv(slab, [piece], slot, skip) != piece.nbytes:
            return None
        digest.update(piece)
    return digest.intdigest()


def _read_run(slab: _Slab, first: int, run: list[tuple[int, int]], targets: list[np.ndarray],
              seed_of) -> list[tuple[int, bool]] | None:
    """Read the ``(index, checksum)`` records of ``run`` (slots ``first``, ``first + 1``,
    ...; all full but the last) into ``targets[index]``, up to ``_READ_PIECE_BYTES`` per
    ``preadv``, each checksummed (seed ``seed_of(index)``) right after its bytes arrive:
    ``(index, intact)``, or None if a read came back short."""
    out = []
    j = 0
    slot = first
    while j < len(run):
        i, checksum = run[j]
        target = targets[i]
        size = target.nbytes
        if size > _READ_PIECE_BYTES:  # one record in pieces, its checksum streamed
            digest = _streamed_checksum(slab, slot, size, seed_of(i),
                                        lambda skip, n: target[skip : skip + n])
            if digest is None:
                return None
            out.append((i, digest == checksum))
            j += 1
            slot += 1
            continue
        group = run[j : j + max(1, _READ_PIECE_BYTES // size)]
        buffers = [targets[k] for k, _ in group]
        if _preadv(slab, buffers, slot) != sum(b.nbytes for b in buffers):
            return None
        out.extend((k, xxhash.xxh3_64_intdigest(targets[k], seed=seed_of(k)) == c) for k, c in group)
        j += len(group)
        slot += len(group)
    return out


def _read_one(slab: _Slab, slot: int, i: int, checksum: int, targets: list[np.ndarray], seed_of) -> bool | None:
    """:func:`_read_run` of the one record ``i`` at ``slot``: whether it is intact,
    ``None`` if an I/O error kept its bytes from being read."""
    try:
        return _read_run(slab, slot, [(i, checksum)], targets, seed_of) == [(i, True)]
    except _BytesUnreadable:
        return None


def _check_slabs(used: dict[int, array], free: dict[int, tuple[int, list[int]]], dirty: dict[int, set[int]],
                 file_bytes: dict[int, int], waiting: list[tuple[int, int]]) -> None:
    """:meth:`LmdbBackend.check_invariants` of the slots: each slot of a slab below its
    end used by one record, free, or waiting to be freed — once — and nothing past it.
    ``used``: slot bytes -> the records' slots; ``free``: slot bytes -> (end, free
    slots); ``dirty``: the slots to punch out; ``waiting``: (slot bytes, slot) freed by
    commits that reads may still see. Counted with numpy, a few milliseconds of the
    interpreter a slab of a million slots (sets of them held it for a tenth of a second
    each)."""
    for slot_bytes in used:
        assert slot_bytes in free, f"no slab of {slot_bytes}-byte slots"
    held_by_size: dict[int, list[int]] = {}
    for slot_bytes, slot in waiting:
        held_by_size.setdefault(slot_bytes, []).append(slot)
    assert held_by_size.keys() <= free.keys(), "a slot waits in a slab that does not exist"
    for slot_bytes, (end, free_slots) in free.items():
        taken = np.frombuffer(used.get(slot_bytes, array("q")), dtype=np.int64)
        assert not len(taken) or taken.max() < end, "a record's slot is past its slab's end"
        freed = np.asarray(free_slots, dtype=np.int64)
        held = np.asarray(held_by_size.get(slot_bytes, ()), dtype=np.int64)
        size = max([end] + [int(a.max()) + 1 for a in (freed, held) if len(a)])
        u, f, h = (np.bincount(a, minlength=size) for a in (taken, freed, held))
        assert (u <= 1).all(), "two records share a slot"
        assert not ((u > 0) & (f > 0)).any(), "a record's slot is free"
        assert not ((u > 0) & (h > 0)).any(), "a record's slot is waiting to be freed"
        assert (f <= 1).all(), "a slot is free twice"
        assert (h <= 1).all(), "a slot is waiting to be freed twice"
        assert not ((h > 0) & (f > 0)).any(), "a slot is free and waiting to be freed"
        assert size == end and ((u + f + h) == 1).all(), \
            "a slot is neither used, free nor waiting (lost), or past the slab's end"
        punched = np.fromiter(dirty[slot_bytes], dtype=np.int64, count=len(dirty[slot_bytes]))
        assert ((punched >= 0) & (punched < end)).all() and (f[punched] > 0).all(), "a slot to punch out is not free"
        assert not end or not f[end - 1] or end - 1 in dirty[slot_bytes], \
            "the slab's last slot is free but will not be cut"
        assert file_bytes[slot_bytes] <= end * slot_bytes, "the slab file goes on past its last slot"


class _ReadGate:
    """Many transactions of this process at once, or one exclusive holder (map resize,
    close). A waiting exclusive holder stops new readers, so a stream of gets cannot
    starve a resize; readers never wait for anything else while they hold the gate.

    It also counts readers by the generation they began in (the writer advances it after
    each commit), so the writer knows when no read can still use what a commit freed."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers: dict[int, int] = {}  # generation -> readers that began in it
        self._num_readers = 0
        self._exclusive = False
        self._generation = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            generation = self._generation
            self._readers[generation] = self._readers.get(generation, 0) + 1
            self._num_readers += 1
        try:
            yield
        finally:
            with self._cond:
                if self._readers[generation] == 1:
                    del self._readers[generation]
                else:
                    self._readers[generation] -= 1
                self._num_readers -= 1
                if not self._num_readers:
                    self._cond.notify_all()

    @property
    def wanted(self) -> bool:
        """An exclusive holder waits (or holds it: not under the gate, then)."""
        return self._exclusive

    def acquire_exclusive(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._num_readers:
                self._cond.wait()

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    def advance(self) -> int:
        """Start a new generation (after a commit); its number."""
        with self._cond:
            self._generation += 1
            return self._generation

    def oldest(self) -> int:
        """The generation of the oldest read still going (the current one if none)."""
        with self._cond:
            return min(self._readers, default=self._generation)


class _Part(NamedTuple):
    """Records of one put as columns (see :class:`~hicache.storage.base.PageBatch`), no
    object per record but its key: the writer's Python work per page stays small."""

    keys: list[bytes]  # one per record
    meta: np.ndarray  # (records, META_BYTES + token bytes): encoded; access, slot, checksum 0
    source: np.ndarray  # (pages, payload size) uint8
    rows: np.ndarray  # (records,) int64: each record's payload row in ``source``


@dataclass(frozen=True, slots=True)
class _PutOp:
    parts: tuple[_Part, ...]  # (one, but for records of several sizes: runs of one size each)
    sizes: dict[bytes, int]  # key -> payload size, each key once (the last record of a key wins)
    fingerprint: bytes
    future: Future

    @property
    def num_records(self) -> int:
        return sum(len(part.keys) for part in self.parts)

    @property
    def num_bytes(self) -> int:
        return sum(len(part.keys) * part.source.shape[1] for part in self.parts)


@dataclass(frozen=True, slots=True)
class _DeleteOp:
    keys: tuple[bytes, ...]
    future: Future


@dataclass(frozen=True, slots=True)
class _PurgeOp:
    """Delete ``keys`` if their record is (still) corrupt; ``force`` deletes them
    unconditionally, without freeing slots (records found unusable on open, whose slots
    the open already counted free)."""

    keys: tuple[bytes, ...]
    force: bool = False


@dataclass(frozen=True, slots=True)
class _DropLegacyOp:
    """Delete legacy payload values that no legacy metadata record names (found on open)."""

    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class _BarrierOp:
    future: Future


_Op = Union[_PutOp, _DeleteOp, _PurgeOp, _DropLegacyOp, _BarrierOp]


@dataclass(slots=True)
class _BatchState:
    """What one write transaction changes, applied to the index only after commit."""

    num_records: int
    num_bytes: int
    changes: dict  # key -> payload size, or None if removed; insertion order = recency
    access: dict  # key -> last access recorded by reads, persisted by this batch
    num_evicted: int = 0
    taken: list = field(default_factory=list)  # (slab, slots) written by this batch
    writes: list = field(default_factory=list)  # its slab writes (futures on the I/O thread)
    freed: list = field(default_factory=list)  # (slot bytes, slot) its records gave up


class LmdbBackend:
    """A :class:`~hicache.storage.base.StorageBackend` on slab files and one LMDB
    environment (see the module docstring).

    ``put``/``delete`` are O(records) on the caller's thread (validation only); a get is
    one read transaction, one ``preadv`` per run of adjacent slots and one checksum pass
    per record. Call :meth:`close` (or use it as a context manager); :meth:`flush` and
    :meth:`close` must not be called from a future's done-callback, which runs on the
    writer thread. One process owns a store: open it in that process only (after any
    fork) — slot reuse waits for this process's reads, not another's.

    The public methods run on the caller's thread; the private ones from
    :meth:`_writer_main` on run on the writer thread only.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        capacity_bytes: int,
        map_size_bytes: int | None = None,
        sync: bool = False,
        writemap: bool = False,
        max_batch_records: int = 512,
        max_batch_bytes: int = 8 * _MIB,
        max_readers: int = 126,
        access_flush_interval_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidArgument(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if map_size_bytes is not None and map_size_bytes <= 0:
            raise InvalidArgument(f"map_size_bytes must be positive, got {map_size_bytes!r}")
        if max_batch_records <= 0 or max_batch_bytes <= 0:
            raise InvalidArgument("max_batch_records and max_batch_bytes must be positive")
        self._path = os.fspath(path)
        # 0700: lmdb would create it with the files' mode (0600), which nobody can enter.
        os.makedirs(self._path, mode=0o700, exist_ok=True)
        self._capacity_bytes = capacity_bytes
        self._initial_map_size = map_size_bytes or default_map_size(capacity_bytes)
        self._sync = sync
        self._writemap = writemap
        self._max_readers = max_readers
        self._max_batch_records = max_batch_records
        self._max_batch_bytes = max_batch_bytes
        self._access_flush_interval_s = access_flush_interval_s
        # Free slots may keep their disk blocks up to this much (see the module docstring).
        self._reclaim_slack_bytes = min(2 * max_batch_bytes, capacity_bytes // 16)
        self._clock = clock
        self._pid = os.getpid()

        # Set by the writer thread while opening; read-only afterwards.
        self._env: lmdb.Environment | None = None
        self._payload_db = None
        self._meta_db = None
        self._map_size = 0
        # Slot bytes -> slab. Added to by the writer; readers look up fds of committed
        # records' slabs (every slab a committed record names exists until close).
        self._slabs: dict[int, _Slab] = {}
        # The writer's: (generation, [(slot bytes, slot)]) freed by the commit that
        # started that generation, reused once no read of an older one is left.
        self._freed: deque[tuple[int, list]] = deque()
        # Slab writes, so that the writer checksums one part while the disk takes another.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hicache-lmdb-io:{self._path}")

        # Committed records and their payload bytes. Guarded by _lock, like every other
        # field below that readers and the writer share.
        self._lock = threading.Lock()
        self._num_records = 0
        self._num_bytes = 0
        self._dirty_access: dict[bytes, float] = {}
        self._last_stamp = 0.0
        self._num_corrupt = 0
        self._num_evicted = 0
        # The writer is between its transaction's start and the index update (then the
        # store and the index may differ).
        self._committing = False
        self._between_commits = threading.Condition(self._lock)  # notified as a commit ends
        # The writer's eviction candidates, oldest first: (last access, key).
        self._victims: deque[tuple[float, bytes]] = deque()

        # The writer's queue.
        self._queue_cond = threading.Condition(threading.Lock())
        self._queue: deque[_Op] = deque()
        self._num_pending_records = 0
        self._closing = False

        self._gate = _ReadGate()
        self._open = False  # the environment is usable; changes under the exclusive gate

        ready: Future = Future()
        self._writer = threading.Thread(
            target=self._writer_main, args=(ready,), name=f"hicache-lmdb-writer:{self._path}", daemon=True
        )
        self._writer.start()
        ready.result()

    def put(self, records: Sequence[PageRecord], *, fingerprint: bytes) -> Future[PutResult]:
        """Queue ``records`` as one batch; the future gives a :class:`PutResult` once the
        batch is committed. The records of one put are one spec's pages: payloads of one
        size, as many token ids each; the payloads are copied by this call. Raises
        :class:`InvalidArgument` for a malformed record, or records larger in total than
        the capacity. (:meth:`put_batch` takes them as columns, without the copy.)"""
        self._check_usable()
        fingerprint = _require_fingerprint(fingerprint)
        keys, namespaces, parents, tokens, payloads = [], [], [], [], []
        for record in records:
            key, payload, meta = record.key, record.payload, record.meta
            keys.append(_require_key(key))
            namespaces.append(_require_key(meta.namespace, "namespace id"))
            parents.append(_require_key(meta.parent, "parent page key"))
            if not isinstance(meta.tokens, (bytes, bytearray, memoryview)) or len(meta.tokens) % TOKEN_BYTES:
                raise InvalidArgument(f"tokens must be packed int32 bytes (a multiple of {TOKEN_BYTES})")
            tokens.append(bytes(meta.tokens))
            payloads.append(_byte_view(payload, writable=False))
        if not keys:
            return _resolved(PutResult(0, ()))
        parts = []
        start = 0
        for end in range(1, len(keys) + 1):  # runs of records of one size: one part each
            if end < len(keys) and (payloads[end].nbytes, len(tokens[end])) == (payloads[start].nbytes, len(tokens[start])):
                continue
            parts.append(PageBatch(b"".join(keys[start:end]), b"".join(namespaces[start:end]),
                                   b"".join(parents[start:end]), b"".join(tokens[start:end]),
                                   np.stack(payloads[start:end]), np.arange(end - start, dtype=np.int64)))
            start = end
        return self._put_parts(parts, fingerprint)

    def put_batch(self, batch: PageBatch, *, fingerprint: bytes) -> Future[PutResult]:
        """:meth:`put` of ``batch``'s records (:class:`~hicache.storage.base.PageBatch`):
        validated in a few vectorized steps; the writer reads the payload rows."""
        self._check_usable()
        return self._put_parts([batch], _require_fingerprint(fingerprint))

    def put_batches(self, batches: Sequence[PageBatch], *, fingerprint: bytes) -> Future[PutResult]:
        """:meth:`put_batch` of several batches as one committed batch (payloads of
        different sizes: e.g. pages with and without their SWA layers)."""
        self._check_usable()
        return self._put_parts(list(batches), _require_fingerprint(fingerprint))

    def _put_parts(self, batches: list[PageBatch], fingerprint: bytes) -> Future[PutResult]:
        parts = [part for batch in batches if (part := self._part(batch, fingerprint)) is not None]
        if not parts:
            return _resolved(PutResult(0, ()))
        sizes = {key: part.source.shape[1] for part in parts for key in part.keys}
        total = sum(sizes.values())
        if total > self._capacity_bytes:
            raise InvalidArgument(
                f"put of {total} bytes does not fit a store of capacity {self._capacity_bytes} bytes"
            )
        future: Future[PutResult] = Future()
        self._enqueue(_PutOp(tuple(parts), sizes, fingerprint, future), sum(len(part.keys) for part in parts))
        return future

    def _part(self, batch: PageBatch, fingerprint: bytes) -> _Part | None:
        """``batch`` checked and its metadata encoded; ``None`` if it has no record."""
        keys, namespaces, parents, tokens = (_require_bytes(x, name) for x, name in zip(
            batch[:4], ("keys", "namespaces", "parents", "tokens"), strict=True))
        source, rows = batch.source, batch.rows
        n = len(keys) // PAGE_KEY_BYTES
        if len(keys) % PAGE_KEY_BYTES or len(namespaces) != len(keys) or len(parents) != len(keys):
            raise InvalidArgument(f"keys, namespaces and parents must be {PAGE_KEY_BYTES} bytes a record each")
        if not n:
            return None
        if len(tokens) % n or len(tokens) // n % TOKEN_BYTES:
            raise InvalidArgument(f"tokens must be packed int32 bytes, as many for each of the {n} records")
        if not (isinstance(source, np.ndarray) and source.dtype == np.uint8 and source.ndim == 2
                and source.strides[1] == 1):
            raise InvalidArgument("source must be a 2-D uint8 array of contiguous rows (one payload a row)")
        size = source.shape[1]
        if not size:
            raise InvalidArgument("empty payloads")
        if size > self._capacity_bytes:
            raise InvalidArgument(f"record of {size} bytes is larger than the capacity ({self._capacity_bytes} bytes)")
        rows = np.asarray(rows)
        if rows.shape != (n,) or rows.dtype.kind not in "iu":
            raise InvalidArgument(f"rows must be {n} integers, one per record")
        if rows.min() < 0 or rows.max() >= len(source):
            raise InvalidArgument(f"payload rows outside the source's {len(source)}")
        key_list = [keys[i : i + PAGE_KEY_BYTES] for i in range(0, len(keys), PAGE_KEY_BYTES)]
        return _Part(key_list, _encode_metas(namespaces, parents, tokens, fingerprint, size), source,
                     rows.astype(np.int64))

    def get(self, keys: Sequence[bytes], buffers: Sequence[Buffer], *, fingerprint: bytes) -> list[bool]:
        """Copy each present, intact record of spec ``fingerprint`` into its buffer (a
        contiguous CPU tensor, numpy array, bytearray or writable memoryview;
        :class:`InvalidArgument` otherwise). ``False`` where a record is missing, fails a
        check, or is not its buffer's size (its buffer may then hold anything): each
        record is judged on its own, so one that does not fit fails no other. A failed
        check is counted, and a corrupt record is deleted by the writer (one of another
        size is intact: kept). A hit counts as an access for LRU. Adjacent slots are read
        with one ``preadv``. Raises :class:`RecordsUnreadable` if the bytes of some
        records cannot be read (EIO), once the others are judged (it names them and
        carries the answer for the rest); :class:`StorageUnavailable` if a read fails
        otherwise (no record is judged)."""
        self._check_usable()
        fingerprint = _require_fingerprint(fingerprint)
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        keys = [key if type(key) is bytes and len(key) == PAGE_KEY_BYTES else _require_key(key) for key in keys]
        targets = [_byte_view(buffer, writable=True) for buffer in buffers]
        found = [False] * len(keys)
        corrupt: list[bytes] = []
        unreadable: list[int] = []  # (nothing is known of them: neither found nor corrupt)
        num_mismatched = 0
        reads: list[tuple[int, int, int, int]] = []  # (slot bytes, slot, index, checksum)
        unpack = _META_READ.unpack_from
        with self._gate.shared():  # (also keeps the slots read here from being reused)
            self._check_open()
            with self._env.begin(db=self._meta_db, buffers=True) as txn:
                for i, (key, target) in enumerate(zip(keys, targets, strict=True)):
                    value = txn.get(key)
                    if value is None:
                        continue
                    if len(value) >= META_BYTES:
                        version, length, stored_fingerprint, num_token_bytes, slot, checksum = unpack(value)
                        if (version == META_VERSION and stored_fingerprint == fingerprint and length == target.nbytes
                                and len(value) == META_BYTES + num_token_bytes):
                            reads.append((slot_bytes_for(length), slot, i, checksum))
                            continue
                    try:
                        outcome = self._get_other(txn, key, bytes(value), target, fingerprint)
                    except _BytesUnreadable:
                        unreadable.append(i)
                        continue
                    if outcome == "corrupt":
                        corrupt.append(key)
                    elif outcome == "mismatch":
                        num_mismatched += 1
                    elif outcome == "found":
                        found[i] = True
            for i, intact in self._read_slots(reads, keys, targets, fingerprint):
                if intact:
                    found[i] = True
                elif intact is None:
                    unreadable.append(i)
                else:
                    corrupt.append(keys[i])
        self._record_reads([k for k, hit in zip(keys, found, strict=True) if hit], len(corrupt) + num_mismatched)
        if corrupt:
            logger.warning("%d corrupt records in %s (first %s); deleting them", len(corrupt), self._path,
                           corrupt[0].hex())
            with self._queue_cond:
                if not self._closing:  # else a later open meets them again
                    self._queue.append(_PurgeOp(tuple(corrupt)))
                    self._queue_cond.notify()
        if unreadable:
            unreadable.sort()
            raise RecordsUnreadable(f"{len(unreadable)} records in {self._path} cannot be read (an I/O error; first "
                                    f"{keys[unreadable[0]].hex()})", found, unreadable)
        return found

    def _get_other(self, txn, key: bytes, meta: bytes, target: np.ndarray, fingerprint: bytes) -> str:
        """A get of what the fast path does not take: a legacy record, unreadable
        metadata, another spec's record, or a buffer of the wrong size. ``"found"`` (then
        copied), ``"corrupt"`` or ``"mismatch"`` (intact, but another spec's or not the
        buffer's size)."""
        fields = _meta_fields(meta)
        if fields is None:
            return "corrupt"
        if fields[0] == LEGACY_META_VERSION:
            return self._get_legacy(txn, key, target, fingerprint)
        if not self._check_stored(key, meta):
            return "corrupt"
        return "mismatch"  # (the fast path takes the rest: this is another spec's, or not the buffer's size)

    def _get_legacy(self, txn, key: bytes, target: np.ndarray, fingerprint: bytes) -> str:
        """Copy a legacy record out of the "payload" table: ``"found"``, ``"corrupt"`` or
        ``"mismatch"`` (another spec's, or not the buffer's size)."""
        value = txn.get(key, db=self._payload_db)
        parsed = None if value is None else _parse_legacy_payload(value)
        if parsed is None:
            return "corrupt"
        stored_fingerprint, length = parsed
        if stored_fingerprint != fingerprint or length != target.nbytes:
            return "mismatch"
        # The view dies with the transaction: copy out before it ends.
        np.copyto(target, np.frombuffer(value, dtype=np.uint8, count=length, offset=HEADER_BYTES))
        return "found"

    def _read_slots(self, reads: list[tuple[int, int, int, int]], keys: list[bytes], targets: list[np.ndarray],
                    fingerprint: bytes) -> list[tuple[int, bool | None]]:
        """Read each ``(slot bytes, slot, index, checksum)`` into ``targets[index]`` and
        check it: ``(index, intact)``, intact ``None`` where an I/O error kept its bytes
        from being read. Runs of adjacent full slots are read in pieces of up to
        ``_READ_PIECE_BYTES`` (:meth:`_read_run`); a run whose read met an I/O error is
        read again one record at a time, to tell which. Call under the shared gate."""
        seeds: dict[int, int] = {}

        def seed_of(i: int) -> int:
            size = targets[i].nbytes  # (the last of a run may be shorter than its slot)
            seed = seeds.get(size)
            if seed is None:
                seed = seeds[size] = _checksum_seed(fingerprint, size)
            return _record_seed(keys[i], seed)

        reads.sort()
        out = []
        start = 0
        while start < len(reads):
            slot_bytes, first, _, _ = reads[start]
            end = start + 1
            while (end < len(reads) and end - start < _IOV_MAX and reads[end][0] == slot_bytes
                   and reads[end][1] == reads[end - 1][1] + 1 and targets[reads[end - 1][2]].nbytes == slot_bytes):
                end += 1
            run = [(i, checksum) for _, _, i, checksum in reads[start:end]]
            start = end
            slab = self._slabs.get(slot_bytes)
            if slab is None:
                out.extend((i, False) for i, _ in run)
                continue
            try:
                checked = _read_run(slab, first, run, targets, seed_of)
            except _BytesUnreadable:
                checked = None
            if checked is not None:
                out.extend(checked)
            else:  # the file ends inside the run (or an offset no file holds), or an I/O error: one at a time
                out.extend((i, _read_one(slab, first + j, i, checksum, targets, seed_of))
                           for j, (i, checksum) in enumerate(run))
        return out

    def _check_stored(self, key: bytes, meta: bytes) -> bool:
        """Whether the current-version record of ``key`` with metadata ``meta`` is intact:
        its payload read back and checked against its own fingerprint and size."""
        _, length, _, _, _, stored_fingerprint, _ = _META.unpack_from(meta, 0)
        slot, checksum = _slot_of(meta)
        slab = self._slabs.get(slot_bytes_for(length))
        if slab is None or slot * slab.slot_bytes + length > os.fstat(slab.fd).st_size:
            return False  # (a length that damage made huge is never allocated)
        scratch = np.empty(min(length, _READ_PIECE_BYTES), dtype=np.uint8)
        seed = _record_seed(key, _checksum_seed(stored_fingerprint, length))
        return _streamed_checksum(slab, slot, length, seed, lambda _, n: scratch[:n]) == checksum

    def delete(self, keys: Sequence[bytes]) -> Future[int]:
        """Queue the deletion of ``keys``; the future gives how many existed."""
        self._check_usable()
        keys = tuple(_require_key(key) for key in keys)
        future: Future[int] = Future()
        if not keys:
            future.set_result(0)
            return future
        self._enqueue(_DeleteOp(keys, future), 0)
        return future

    def iter_metadata(self, batch: int | None = None) -> Iterator[tuple[bytes, PageMeta]]:
        """Every stored record's key and metadata, in key order, from one snapshot taken
        when this is called (O(records) memory; the read transaction is not held while
        the caller iterates) — or, with ``batch``, read ``batch`` records at a time, each
        batch from its own snapshot, when the caller asks for it (an owner thread that
        serves requests between batches: reading 400,000 records at once took 0.8 s).
        ``last_access_s`` is the persisted time, which may lag the in-memory LRU by up
        to one writer batch or ``access_flush_interval_s``."""
        self._check_usable()
        if batch is None:
            return self._decode_snapshot(self._read_meta(None, None))
        if type(batch) is not int or batch < 1:
            raise InvalidArgument(f"batch must be a positive int or None, got {batch!r}")
        return self._iter_batches(batch)

    def read_tokens(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The packed token ids in each key's metadata; ``None`` where there is none."""
        self._check_usable()
        keys = [_require_key(key) for key in keys]
        out: list[bytes | None] = []
        with self._gate.shared():
            self._check_open()
            with self._env.begin(db=self._meta_db, buffers=True) as txn:
                for key in keys:
                    value = txn.get(key)
                    fields = None if value is None else _meta_fields(value)
                    out.append(None if fields is None else _tokens_of(value, fields[0]))
        return out

    def _iter_batches(self, batch: int) -> Iterator[tuple[bytes, PageMeta]]:
        after = None
        while True:
            raw = self._read_meta(after, batch)
            yield from self._decode_snapshot(raw)
            if len(raw) < batch:
                return
            after = raw[-1][0]

    def _read_meta(self, after: bytes | None, limit: int | None) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` metadata records with keys above ``after`` (all: ``None``)."""
        with self._gate.shared():
            self._check_open()
            with self._env.begin(db=self._meta_db) as txn:
                cursor = txn.cursor()
                if after is not None:  # position on the first key above it (an unpositioned
                    # cursor would iterate from the first key again)
                    if not cursor.set_range(after) or (cursor.key() == after and not cursor.next()):
                        return []
                items = cursor.iternext()
                return list(items) if limit is None else list(itertools.islice(items, limit))

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every write queued before this call is committed (and the access
        times recorded so far are persisted); ``TimeoutError`` past ``timeout_s``."""
        self._check_usable()
        self._check_not_writer("flush")
        barrier: Future = Future()
        self._enqueue(_BarrierOp(barrier), 0)
        if not futures_wait([barrier], timeout_s).done:
            raise TimeoutError(f"storage {self._path}: writes still not committed after {timeout_s:g} s")
        barrier.result()

    def stats(self) -> StorageStats:
        self._check_usable()
        with self._queue_cond:
            pending = self._num_pending_records
        with self._lock:
            return StorageStats(
                records=self._num_records,
                bytes=self._num_bytes,
                capacity_bytes=self._capacity_bytes,
                map_size_bytes=self._map_size,
                corrupt_records=self._num_corrupt,
                evicted_records=self._num_evicted,
                pending_writes=pending,
            )

    def close(self, timeout_s: float | None = None) -> None:
        """Commit what is queued, persist access times, close the environment and join
        the writer. Idempotent; every other method raises afterwards. Past
        ``timeout_s`` with the writer still busy (a commit that hangs), raises
        ``TimeoutError``: the writer (a daemon thread) is left to the process's exit,
        and what it had not committed is lost, the store consistent."""
        if os.getpid() != self._pid:
            raise self._wrong_process()
        self._check_not_writer("close")
        with self._queue_cond:
            self._closing = True
            self._queue_cond.notify_all()
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            raise TimeoutError(f"storage {self._path}: the writer did not finish in {timeout_s:g} s")

    def __enter__(self) -> LmdbBackend:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def path(self) -> str:
        return self._path

    def lru_keys(self) -> list[bytes]:
        """Every stored key, least recently used first (O(records); for tests and tools)."""
        self._check_usable()
        with self._gate.shared():
            self._check_open()
            with self._env.begin(buffers=True) as txn:
                with self._lock:
                    recent = dict(self._dirty_access)
                keys, stamps = self._scan(txn, recent)
        return [keys[16 * i : 16 * i + 16] for i in np.argsort(stamps, kind="stable").tolist()]

    def check_invariants(self) -> None:
        """The record and byte counts equal the committed store's; every legacy record
        has its payload value and nothing else has one; no two records share a slot, no
        record's slot is free or waiting to be, and every other slot is free or waiting
        to be, once. Writes may go on meanwhile: the store is read in one transaction,
        begun between two commits together with a copy of what the writer keeps in
        memory, so both are the state of one commit whatever is committed during the
        read. (That read, like any, keeps the slots freed meanwhile from being taken
        again until it ends. A map resize waits for every read: the check's gives way
        to one, and reads again once the map has grown.)"""
        self._check_usable()
        self.flush()
        made_way = 0  # reads given up for a map resize (the writer's, which waits for every read)
        while True:
            with self._between_commits:
                if not self._between_commits.wait_for(lambda: not self._committing, _CHECK_WAIT_S):
                    raise StorageUnavailable(f"storage {self._path}: a commit has run for over "
                                             f"{_CHECK_WAIT_S:g} s; nothing checked")
            with self._gate.shared():
                self._check_open()
                with self._lock:
                    if self._committing:  # (one began since: wait for its end again)
                        continue
                    # The transaction and the copy are of the same commit: the writer
                    # starts the next one under this lock only.
                    txn = self._env.begin(buffers=True)
                    num_records, num_bytes = self._num_records, self._num_bytes
                    free = {slot_bytes: (slab.end, list(slab.free)) for slot_bytes, slab in self._slabs.items()}
                    dirty = {slot_bytes: slab.dirty | slab.stale for slot_bytes, slab in self._slabs.items()}
                    file_bytes = {slot_bytes: os.fstat(slab.fd).st_size for slot_bytes, slab in self._slabs.items()}
                    waiting = [slot for _, slots in self._freed for slot in slots]
                try:
                    stored_records, stored_bytes, legacy_keys, payload_keys, used = self._read_index(txn)
                except _MakeWay:
                    made_way += 1
                    logger.debug("storage %s: the check's read made way for a map resize (%d)", self._path, made_way)
                    continue  # (the gate stops new reads until the resize is done)
                finally:
                    txn.abort()
            break
        assert payload_keys == legacy_keys, "legacy payload and metadata keys differ"
        _check_slabs(used, free, dirty, file_bytes, waiting)
        assert num_records == stored_records, "record count differs from the store"
        assert num_bytes == stored_bytes, "byte count differs from the store"
        assert num_bytes <= self._capacity_bytes, "over capacity"

    def _read_index(self, txn) -> tuple[int, int, set[bytes], set[bytes], dict[int, array]]:
        """The records ``txn`` sees and their payload bytes, the keys of legacy records,
        the payload table's keys, and the slots in use by slot size. (No collection of
        every key: a dict of millions grows in steps that each hold the interpreter for
        a tenth of a second, and the daemon's loop with it.)"""
        num_records = num_bytes = 0
        legacy: set[bytes] = set()
        used: dict[int, array] = {}
        for key, value in txn.cursor(db=self._meta_db):
            fields = _meta_fields(value)
            assert fields is not None, f"unreadable metadata for {bytes(key).hex()}"
            num_records += 1
            if not num_records % _CHECK_LOOK_EVERY:
                if self._closing:  # (close waits for this read)
                    raise StorageUnavailable(f"storage {self._path} is closing; the check stopped")
                if self._gate.wanted:  # (a map resize waits for this read: it goes first)
                    raise _MakeWay()
            num_bytes += fields[1]
            if fields[0] == LEGACY_META_VERSION:
                legacy.add(bytes(key))
            else:
                slots = used.get(slot_bytes := slot_bytes_for(fields[1]))
                if slots is None:
                    slots = used[slot_bytes] = array("q")
                slots.append(_slot_of(value)[0])
        payload_keys = {bytes(k) for k in txn.cursor(db=self._payload_db).iternext(values=False)}
        return num_records, num_bytes, legacy, payload_keys, used

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise self._wrong_process()
        if self._closing:
            raise StorageUnavailable(f"storage {self._path} is closed")

    def _check_open(self) -> None:
        # Under the shared gate: close() flips this under the exclusive gate.
        if not self._open:
            raise StorageUnavailable(f"storage {self._path} is closed")

    def _wrong_process(self) -> HicacheError:
        return StorageUnavailable(
            f"storage {self._path} was opened in process {self._pid} and used in process {os.getpid()}; "
            "LMDB environments do not survive fork: open the store in the process that uses it"
        )

    def _check_not_writer(self, what: str) -> None:
        if threading.current_thread() is self._writer:
            raise HicacheError(f"{what}() called on the storage writer thread (from a future's callback?)")

    def _enqueue(self, op: _Op, num_records: int) -> None:
        with self._queue_cond:
            if self._closing:
                raise StorageUnavailable(f"storage {self._path} is closed")
            self._queue.append(op)
            self._num_pending_records += num_records
            self._queue_cond.notify()

    def _next_stamp(self) -> float:
        """A last-access time after every earlier one. Call with ``_lock`` held."""
        self._last_stamp = max(self._clock(), self._last_stamp + _STAMP_STEP_S)
        return self._last_stamp

    def _next_stamps(self, n: int) -> np.ndarray:
        """``n`` increasing last-access times after every earlier one (``_lock`` held)."""
        stamps = self._next_stamp() + np.arange(n) * _STAMP_STEP_S
        self._last_stamp = float(stamps[-1])
        return stamps

    def _record_reads(self, hits: list[bytes], num_failed: int) -> None:
        with self._lock:
            self._num_corrupt += num_failed
            if hits:
                self._dirty_access.update(zip(hits, self._next_stamps(len(hits)).tolist()))

    def _decode_snapshot(self, raw: list[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, PageMeta]]:
        """The records of ``raw`` decoded, in its order; unreadable ones skipped (logged).
        Current-version records of one length are unpacked together by one C loop
        (``Struct.iter_unpack``; one at a time was ~7 us a record, 3 s of a 450,000
        record rebuild); the rest one at a time."""
        metas: list[PageMeta | None] = [None] * len(raw)
        by_length: dict[int, list[int]] = {}
        for i, (_, value) in enumerate(raw):
            by_length.setdefault(len(value), []).append(i)
        for length, indices in by_length.items():
            num_token_bytes = length - META_BYTES
            if num_token_bytes < 0 or num_token_bytes % TOKEN_BYTES:
                continue
            records = _meta_columns(num_token_bytes).iter_unpack(b"".join([raw[i][1] for i in indices]))
            for i, (version, size, access, namespace, parent, fingerprint, stated, tokens) in zip(
                    indices, records, strict=True):
                if version == META_VERSION and stated == num_token_bytes:
                    metas[i] = PageMeta(namespace, parent, tokens, size, access, fingerprint)
        for (key, value), meta in zip(raw, metas, strict=True):
            if meta is None:
                meta = _decode_meta(value)
                if meta is None:
                    logger.warning("skipping unreadable metadata of %s in %s", key.hex(), self._path)
                    continue
            yield key, meta

    def _writer_main(self, ready: Future) -> None:
        try:
            startup = self._open_env()
        except BaseException as exc:  # handed to the constructor, which re-raises it
            ready.set_exception(exc)
            return
        try:
            # Before the constructor returns: whoever rebuilds from iter_metadata then
            # sees a store within capacity and without orphans. A failed commit fails
            # the open: the records it drops name slots the open counted free, which
            # the next put would take (and the next open drop with them).
            committed: Future = Future()
            self._commit([*startup, _BarrierOp(committed)])
            if committed.exception() is not None:
                raise StorageUnavailable(f"cannot open storage {self._path}: its start-up maintenance did not "
                                         f"commit: {committed.exception()!r}") from committed.exception()
        except BaseException as exc:
            self._close_env()
            ready.set_exception(exc)
            return
        ready.set_result(None)
        batch: list[_Op] = []
        try:
            while (batch := self._next_batch()) is not None:
                self._commit(batch)
            self._commit([])  # the last access times
        except BaseException as exc:  # a bug: fail what waits on the writer, not hang it
            logger.exception("storage writer of %s stopped", self._path)
            for op in batch:
                future = getattr(op, "future", None)
                if future is not None:
                    _settle(future, exc)  # (those resolved before the bug keep their outcome)
            raise
        finally:
            self._fail_queued(StorageUnavailable(f"storage {self._path} writer stopped"))
            self._close_env()

    def _open_env(self) -> list[_Op]:
        """Open the environment and rebuild the index; return the maintenance work."""
        try:
            env = lmdb.open(
                self._path,
                map_size=self._initial_map_size,
                subdir=True,
                max_dbs=2,
                sync=self._sync,
                metasync=self._sync,
                readahead=True,
                writemap=self._writemap,
                max_readers=self._max_readers,
                lock=True,
                # data.mdb and lock.mdb: the daemon's user only (cached prompts' KV and tokens)
                mode=0o600,
            )
        except lmdb.Error as exc:
            raise StorageUnavailable(f"cannot open storage {self._path}: {exc}") from exc
        try:
            self._check_length(env)
            # Reader slots of processes that died (kill -9) pin old pages; free them.
            num_stale = env.reader_check()
            if num_stale:
                logger.info("%s: cleared %d stale reader slots", self._path, num_stale)
            self._payload_db = env.open_db(_PAYLOAD_DB)
            self._meta_db = env.open_db(_META_DB)
            num_records = num_bytes = 0
            last_stamp = 0.0
            unreadable: list[bytes] = []  # metadata that does not parse: never counted
            unusable: list[bytes] = []  # counted, but the slot is past its file's end or shared
            file_bytes = self._slab_files()
            used: dict[int, array] = {}  # slot bytes -> slots of usable records
            with env.begin(buffers=True) as txn:
                for key, value in txn.cursor(db=self._meta_db):
                    # Only the access time, size and slot: a whole PageMeta (token bytes
                    # copied) for every record made opening a big store ~40% slower.
                    fields = _meta_fields(value)
                    if fields is None:
                        unreadable.append(bytes(key))
                        continue
                    num_records += 1
                    num_bytes += fields[1]
                    last_stamp = max(last_stamp, fields[2])
                    if fields[0] == META_VERSION:
                        slot_bytes, slot = slot_bytes_for(fields[1]), _slot_of(value)[0]
                        if slot * slot_bytes + fields[1] > file_bytes.get(slot_bytes, 0):
                            unusable.append(bytes(key))  # its payload never reached the file
                        else:
                            used.setdefault(slot_bytes, array("q")).append(slot)
                shared = self._shared_slots(used)
                if shared:  # (only damage does this): drop every record of such a slot
                    for key, value in txn.cursor(db=self._meta_db):
                        fields = _meta_fields(value)
                        if (fields is not None and fields[0] == META_VERSION
                                and _slot_of(value)[0] in shared.get(slot_bytes_for(fields[1]), ())):
                            unusable.append(bytes(key))
                # Both tables are in key order: walk them side by side.
                # (an empty value is unreadable metadata, dropped with the rest)
                legacy = (key for key, value in txn.cursor(db=self._meta_db)
                          if len(value) and value[0] == LEGACY_META_VERSION)
                legacy_key = next(legacy, None)
                orphans = []
                for key in txn.cursor(db=self._payload_db).iternext(values=False):
                    while legacy_key is not None and bytes(legacy_key) < bytes(key):
                        legacy_key = next(legacy, None)
                    if legacy_key is None or bytes(legacy_key) != bytes(key):
                        orphans.append(bytes(key))
            self._open_slabs(file_bytes, used)
        except BaseException:
            for slab in self._slabs.values():
                slab.close()
            self._slabs.clear()
            env.close()
            raise
        self._num_records = num_records
        self._num_bytes = num_bytes
        self._last_stamp = last_stamp
        self._env = env
        self._map_size = env.info()["map_size"]
        self._open = True
        if unreadable or unusable or orphans:
            logger.warning("%s: dropping %d records with unreadable metadata, %d whose slot is lost or shared "
                           "and %d orphan payloads", self._path, len(unreadable), len(unusable), len(orphans))
        logger.info("opened %s: %d records, %d bytes, map %d bytes, %d slab files", self._path, num_records,
                    num_bytes, self._map_size, len(self._slabs))
        return [_PurgeOp(tuple(unreadable + unusable), force=True), _DropLegacyOp(tuple(orphans))]

    def _check_length(self, env: lmdb.Environment) -> None:
        """Refuse a data file shorter than the pages its meta page names (a machine crash
        without ``sync`` on a file system that does not keep the order of writes, a copy
        cut short): LMDB reads them through its map, and a read past the end of the file
        is SIGBUS, which kills the process instead of failing the open. (The meta pages
        themselves are read with ``pread``: a file without them is refused by LMDB.)"""
        page_bytes = env.stat()["psize"]
        needed = (env.info()["last_pgno"] + 1) * page_bytes
        data = os.path.join(self._path, "data.mdb")
        size = os.stat(data).st_size
        if size < needed:
            raise StorageUnavailable(
                f"cannot open storage {self._path}: {data} holds {size} bytes, short of the {needed} its pages "
                "take: damaged; move the store aside to start with an empty disk tier")

    def _slab_files(self) -> dict[int, int]:
        """Slot bytes -> size of each slab file in the store directory."""
        files = {}
        for name in os.listdir(self._path):
            if not (name.startswith(_SLAB_PREFIX) and name.endswith(_SLAB_SUFFIX)):
                continue
            digits = name[len(_SLAB_PREFIX) : -len(_SLAB_SUFFIX)]
            if digits.isdigit() and slot_bytes_for(int(digits)) == int(digits) and str(int(digits)) == digits:
                files[int(digits)] = os.stat(os.path.join(self._path, name)).st_size
        return files

    @staticmethod
    def _shared_slots(used: dict[int, array]) -> dict[int, set[int]]:
        """The slots that more than one record names, by slot bytes; taken out of ``used``."""
        shared = {}
        for slot_bytes, slots in used.items():
            values, counts = np.unique(np.frombuffer(slots, dtype=np.int64), return_counts=True)
            if (counts > 1).any():
                shared[slot_bytes] = set(values[counts > 1].tolist())
                used[slot_bytes] = array("q", (slot for slot in slots if slot not in shared[slot_bytes]))
        return shared

    def _open_slabs(self, file_bytes: dict[int, int], used: dict[int, array]) -> None:
        """A slab for every slot size in use, its file cut after its last used slot; the
        files of other sizes deleted."""
        for slot_bytes in sorted(set(file_bytes) | set(used)):
            path = self._slab_path(slot_bytes)
            slots = np.frombuffer(used[slot_bytes], dtype=np.int64) if slot_bytes in used else None
            if slots is None or not len(slots):
                os.unlink(path)
                continue
            self._slabs[slot_bytes] = _Slab(path, slot_bytes, slots)

    def _slab_path(self, slot_bytes: int) -> str:
        return os.path.join(self._path, f"{_SLAB_PREFIX}{slot_bytes}{_SLAB_SUFFIX}")

    def _slab(self, slot_bytes: int) -> _Slab:
        """The slab of ``slot_bytes`` slots, created if there is none (writer thread)."""
        slab = self._slabs.get(slot_bytes)
        if slab is None:
            slab = self._slabs[slot_bytes] = _Slab(self._slab_path(slot_bytes), slot_bytes,
                                                   np.empty(0, dtype=np.int64))
            if self._sync:  # the new file's name is durable before any record names it
                directory = os.open(self._path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(directory)
                finally:
                    os.close(directory)
        return slab

    def _close_env(self) -> None:
        self._gate.acquire_exclusive()
        try:
            self._open = False
            if self._env is not None:
                self._env.close()
            self._io.shutdown()
            for slab in self._slabs.values():
                slab.close()
        finally:
            self._gate.release_exclusive()

    def _fail_queued(self, exc: BaseException) -> None:
        with self._queue_cond:
            self._closing = True
            ops, self._queue = list(self._queue), deque()
            self._num_pending_records = 0
        for op in ops:
            future = getattr(op, "future", None)
            if future is not None:
                _settle(future, exc)

    def _next_batch(self) -> list[_Op] | None:
        """Wait for work; take queued operations up to the batch bounds (at least one).
        ``[]`` means only access times are due; ``None`` means closing with nothing left."""
        with self._queue_cond:
            while not self._queue:
                if self._closing:
                    return None
                if not self._queue_cond.wait(self._access_flush_interval_s) and self._dirty_access:
                    return []
            batch: list[_Op] = []
            num_records = num_bytes = 0
            while self._queue:
                op = self._queue[0]
                op_records = op.num_records if isinstance(op, _PutOp) else 0
                op_bytes = op.num_bytes if isinstance(op, _PutOp) else 0
                if batch and (
                    num_records + op_records > self._max_batch_records or num_bytes + op_bytes > self._max_batch_bytes
                ):
                    break
                batch.append(self._queue.popleft())
                num_records += op_records
                num_bytes += op_bytes
            return batch

    def _commit(self, batch: list[_Op]) -> None:
        """Apply ``batch`` and the recorded accesses in one transaction, growing the map
        as needed; then update the index and resolve the futures, in order."""
        with self._lock:
            access, self._dirty_access = self._dirty_access, {}
            self._committing = True
        try:
            self._commit_batch(batch, access)
            self._reclaim()
        finally:
            with self._lock:
                self._committing = False
                self._between_commits.notify_all()

    def _reclaim(self) -> None:
        """Make free the slots that no read can use any more; each time the slots freed
        (and not taken again) add up to more than the slack, give back the space of
        those that stayed free since the last time (see the module docstring)."""
        self._reuse_freed_slots()
        if sum(slab.dirty_bytes for slab in self._slabs.values()) > self._reclaim_slack_bytes:
            for slab in self._slabs.values():
                if slab.dirty or slab.stale:
                    slab.reclaim()

    def _commit_batch(self, batch: list[_Op], access: dict[bytes, float]) -> None:
        num_records = sum(op.num_records for op in batch if isinstance(op, _PutOp))
        while True:
            try:
                state, outcomes = self._write_batch(batch, access)
                break
            except lmdb.MapFullError:
                pass  # the transaction is aborted: grow the map outside this handler, then retry
            except BaseException as exc:
                self._fail_batch(batch, access, num_records, exc)
                return
            try:
                self._grow_map()
            except BaseException as exc:
                self._fail_batch(batch, access, num_records, exc)
                return
        with self._lock:
            self._num_records = state.num_records
            self._num_bytes = state.num_bytes
            self._num_evicted += state.num_evicted
        self._finish(batch, outcomes, num_records)

    def _fail_batch(self, batch: list[_Op], access: dict[bytes, float], num_records: int,
                    exc: BaseException) -> None:
        logger.error("write batch of %d operations failed in %s: %r", len(batch), self._path, exc)
        with self._lock:
            for key, stamp in access.items():  # not persisted: keep them for the next batch
                if self._dirty_access.get(key, 0.0) < stamp:
                    self._dirty_access[key] = stamp
        self._finish(batch, [exc] * len(batch), num_records)

    def _finish(self, batch: list[_Op], outcomes: list, num_records: int) -> None:
        with self._queue_cond:
            self._num_pending_records -= num_records
        for op, outcome in zip(batch, outcomes, strict=True):
            future = getattr(op, "future", None)
            if future is not None:
                _settle(future, outcome)

    def _grow_map(self) -> None:
        new_size = self._map_size * 2
        logger.info("growing the map of %s from %d to %d bytes", self._path, self._map_size, new_size)
        self._gate.acquire_exclusive()
        try:
            self._env.set_mapsize(new_size)
        finally:
            self._gate.release_exclusive()
        self._map_size = self._env.info()["map_size"]

    def _write_batch(self, batch: list[_Op], access: dict[bytes, float]) -> tuple[_BatchState, list]:
        self._reuse_freed_slots()
        state = _BatchState(num_records=self._num_records, num_bytes=self._num_bytes, changes={}, access=access)
        outcomes: list = []
        txn = self._env.begin(write=True, buffers=True)
        try:
            for op in batch:
                if isinstance(op, _PutOp):
                    outcomes.append(self._write_put(txn, op, state))
                elif isinstance(op, _DeleteOp):
                    outcomes.append(self._write_delete(txn, op.keys, state))
                elif isinstance(op, _PurgeOp):
                    outcomes.append(self._write_purge(txn, op, state))
                elif isinstance(op, _DropLegacyOp):
                    outcomes.append(sum(txn.delete(key, db=self._payload_db) for key in op.keys))
                else:
                    outcomes.append(None)
            self._evict(txn, state, exclude=frozenset())
            self._write_access(txn, access, state)
            for write in state.writes:
                write.result()  # (raises what a write raised)
            if self._sync:
                for slab in {slab for slab, _ in state.taken}:
                    os.fdatasync(slab.fd)  # the payloads are on disk before the records naming them
            # Inside the try: a commit can fail too (ENOSPC without writemap; MapFullError
            # when LMDB saves its free pages), and LMDB then aborts the transaction.
            txn.commit()
        except BaseException:
            txn.abort()  # (no effect after a failed commit)
            self._victims.clear()  # it may have lost candidates the abort kept in the store
            futures_wait(state.writes)  # (a slot goes back to the free list once nothing writes it)
            for slab, slots in state.taken:  # no committed record names them
                slab.give(slots)
            raise
        generation = self._gate.advance()
        if state.freed:
            self._freed.append((generation, state.freed))
        return state, outcomes

    def _reuse_freed_slots(self) -> None:
        """Make free the slots given up by commits that every read still going began after."""
        oldest = self._gate.oldest()
        while self._freed and self._freed[0][0] <= oldest:
            for slot_bytes, slot in self._freed.popleft()[1]:
                self._slabs[slot_bytes].give((slot,))

    def _release(self, txn, key: bytes, value, state: _BatchState) -> None:
        """Give up what the record of ``key`` (its metadata ``value`` in this transaction,
        or ``None`` if there is none) holds besides its metadata: its slot, once this
        batch commits, or its legacy payload value. Reads ``value`` before any write."""
        fields = None if value is None else _meta_fields(value)
        if fields is None:
            if value is not None:  # unreadable: whatever it had in the legacy table goes
                txn.delete(key, db=self._payload_db)
        elif fields[0] == META_VERSION:
            slot_bytes, slot = slot_bytes_for(fields[1]), _slot_of(value)[0]
            slab = self._slabs.get(slot_bytes)
            if slab is not None and slot < slab.end:  # (else damage made it up: no slot to give)
                state.freed.append((slot_bytes, slot))
        else:
            txn.delete(key, db=self._payload_db)

    def _write_put(self, txn, op: _PutOp, state: _BatchState) -> PutResult:
        sizes = op.sizes
        self._count_puts(txn, sizes, state)
        n = op.num_records
        with self._lock:
            stamps = self._next_stamps(n).astype("<f8").view(np.uint8).reshape(n, 8)
        evicted = self._evict(txn, state, exclude=sizes)
        metas = txn.cursor(db=self._meta_db)
        changes = state.changes
        done = 0
        written: set[bytes] = set()  # by this put's earlier parts
        for keys, meta, source, rows in op.parts:
            meta[:, _META_ACCESS_OFFSET : _META_ACCESS_OFFSET + 8] = stamps[done : done + len(keys)]
            done += len(keys)
            if len(op.parts) > 1 or len(set(keys)) < len(keys):
                keys, meta, rows = self._last_of_each_key(txn, keys, meta, rows, written, state)
            self._write_payloads(keys, meta, source, rows, op.fingerprint, state)
            metas.putmulti(zip(keys, meta))
            for key in keys:
                changes.pop(key, None)  # (the insertion order is the recency order)
                changes[key] = source.shape[1]
        return PutResult(n, evicted)

    def _last_of_each_key(self, txn, keys: list[bytes], meta: np.ndarray, rows: np.ndarray,
                          written: set[bytes], state: _BatchState) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """A part's records less those a later record of the same key replaces; the slots
        of the records that ``written`` (this put's earlier parts) holds for these keys
        are given up, and these keys added to it. (Rare: a put that names a key twice.)"""
        last = {key: i for i, key in enumerate(keys)}
        keep = sorted(last.values())
        keys = [keys[i] for i in keep]
        for key in keys:
            if key in written:
                self._release(txn, key, txn.get(key, db=self._meta_db), state)
        written.update(keys)
        return keys, meta[keep], rows[keep]

    def _write_payloads(self, keys: list[bytes], meta: np.ndarray, source: np.ndarray, rows: np.ndarray,
                        fingerprint: bytes, state: _BatchState) -> None:
        """Write the payload rows to free slots, in place from ``source`` (one
        ``pwritev`` a run of adjacent slots, on the I/O thread: the batch waits for
        them before it commits), and put their slots and checksums in ``meta``."""
        n, size = len(keys), source.shape[1]
        slab = self._slab(slot_bytes_for(size))
        slots = slab.take(n)
        state.taken.append((slab, slots))
        payloads = [source[row] for row in rows.tolist()]
        start = 0
        while start < n:  # (slots ascend: take() gives them so)
            end = start + 1
            while end < n and end - start < _IOV_MAX and slots[end] == slots[end - 1] + 1 and size == slab.slot_bytes:
                end += 1
            state.writes.append(self._io.submit(_pwritev_all, slab.fd, payloads[start:end],
                                                slots[start] * slab.slot_bytes))
            start = end
        # Meanwhile (pwritev lets go of the interpreter): the checksums of the same rows.
        # First let the I/O thread take the interpreter to start its pwritev (else it
        # waits for the switch interval, 5 ms, behind the checksums).
        time.sleep(0)
        seed = _checksum_seed(fingerprint, size)
        sums = [_checksum(key, seed, payload) for key, payload in zip(keys, payloads, strict=True)]
        meta[:, _META_SLOT:META_BYTES] = np.array([slots, sums], dtype="<u8").T.copy().view(np.uint8)

    def _count_puts(self, txn, sizes: dict[bytes, int], state: _BatchState) -> None:
        """Add a put of ``sizes`` (key -> payload size) to the batch's record and byte
        counts, less what the keys held before (in this batch, else in the store), and
        give up what those records held."""
        changes = state.changes
        state.num_bytes += sum(sizes.values())
        state.num_records += len(sizes)
        stored = []
        for key in sizes:
            if key not in changes:
                stored.append(key)
            elif (old := changes[key]) is not None:
                state.num_bytes -= old
                state.num_records -= 1
                self._release(txn, key, bytes(txn.get(key, db=self._meta_db)), state)
        # (rare: keys written before; copied, since releasing writes to the transaction)
        for key, value in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._meta_db).getmulti(stored)]:
            if _meta_fields(value) is not None:
                state.num_bytes -= _META_SIZE_ACCESS.unpack_from(value, 4)[0]
                state.num_records -= 1
            self._release(txn, key, value, state)

    def _evict(self, txn, state: _BatchState, exclude) -> tuple[bytes, ...]:
        """Delete least-recently-used records until the batch fits the capacity; keys in
        ``exclude`` (the put being applied) are never chosen."""
        victims: list[bytes] = []
        while state.num_bytes > self._capacity_bytes:
            if not self._victims:
                self._refill_victims(txn, state, exclude)
                if not self._victims:
                    break  # every record left is this batch's own
            stamp, key = self._victims.popleft()
            if key in state.changes or key in exclude:
                continue  # rewritten or removed by this batch: not what the scan saw
            value = txn.get(key, db=self._meta_db)
            if value is None:
                continue  # deleted since the scan
            size, stored = _META_SIZE_ACCESS.unpack_from(value, 4)
            with self._lock:
                recent = self._dirty_access.get(key, 0.0)
            if max(recent, state.access.get(key, 0.0), stored) != stamp:
                continue  # used since the scan: newer than every candidate left
            self._evict_one(txn, key, value, size, state, victims)
        # Still over: records written earlier in this batch go next, oldest first.
        for key, size in list(state.changes.items()):
            if state.num_bytes <= self._capacity_bytes:
                break
            if size is not None and key not in exclude:
                self._evict_one(txn, key, txn.get(key, db=self._meta_db), size, state, victims)
        assert state.num_bytes <= self._capacity_bytes, "put larger than capacity passed validation"
        return tuple(victims)

    def _evict_one(self, txn, key: bytes, value, size: int, state: _BatchState, victims: list[bytes]) -> None:
        self._release(txn, key, value, state)
        txn.delete(key, db=self._meta_db)
        state.changes[key] = None
        state.num_bytes -= size
        state.num_records -= 1
        state.num_evicted += 1
        victims.append(key)

    def _refill_victims(self, txn, state: _BatchState, exclude) -> None:
        """The oldest records that this batch has not touched and ``exclude`` does not
        name, oldest first: the oldest sixteenth of the store (at least
        :data:`_VICTIMS_MIN`), from one scan."""
        with self._lock:
            recent = dict(self._dirty_access)
        for key, stamp in state.access.items():
            recent.setdefault(key, stamp)  # a newer read recorded since wins
        keys, stamps = self._scan(txn, recent, skip=(state.changes, exclude))
        count = len(stamps)
        take = min(count, max(_VICTIMS_MIN, count // _VICTIMS_SHARE))
        if not take:
            return
        oldest = np.argpartition(stamps, take - 1)[:take] if take < count else np.arange(count)
        oldest = oldest[np.argsort(stamps[oldest], kind="stable")]
        self._victims.extend((float(stamps[i]), keys[16 * i : 16 * i + 16]) for i in oldest.tolist())

    def _scan(self, txn, recent: dict[bytes, float], skip=()) -> tuple[bytes, np.ndarray]:
        """Every record's key (concatenated) and last access (the later of ``recent``'s
        and the stored time: a read of the record a put replaced may be recorded after
        the put's time), in key order; keys in any of the ``skip`` collections are left out."""
        keys = bytearray()
        stamps = array("d")
        unpack = _META_SIZE_ACCESS.unpack_from
        skip = [keys_ for keys_ in skip if keys_]
        for key, value in txn.cursor(db=self._meta_db):
            _, stamp = unpack(value, 4)
            if recent or skip:
                key = bytes(key)
                if any(key in keys_ for keys_ in skip):
                    continue
                stamp = max(recent.get(key, stamp), stamp)
            keys += key
            stamps.append(stamp)
        return bytes(keys), np.frombuffer(stamps, dtype=np.float64)

    def _write_delete(self, txn, keys: Sequence[bytes], state: _BatchState, *, release: bool = True) -> int:
        """Delete the records of ``keys``; how many existed. ``release=False`` keeps their
        slots out of the free list (the open already counted them free)."""
        num_existing = 0
        for key in keys:
            value = txn.get(key, db=self._meta_db)
            if value is None:
                if txn.delete(key, db=self._payload_db):  # (a legacy payload without metadata)
                    num_existing += 1
                state.changes[key] = None
                continue
            num_existing += 1
            fields = _meta_fields(value)
            if fields is not None:
                state.num_bytes -= fields[1]
                state.num_records -= 1
            if release:
                self._release(txn, key, value, state)
            else:
                txn.delete(key, db=self._payload_db)
            txn.delete(key, db=self._meta_db)
            state.changes[key] = None
        return num_existing

    def _write_purge(self, txn, op: _PurgeOp, state: _BatchState) -> None:
        if op.force:
            self._write_delete(txn, op.keys, state, release=False)
            return
        # A reader saw these corrupt; the key may have been rewritten since, so look again
        # (after this batch's own slab writes, which may be what it would read).
        for write in state.writes:
            write.result()
        doomed = [key for key in op.keys if (value := txn.get(key, db=self._meta_db)) is not None
                  and self._still_bad(txn, key, bytes(value))]
        if doomed:
            self._write_delete(txn, doomed, state)

    def _still_bad(self, txn, key: bytes, meta: bytes) -> bool:
        """Does the record a reader saw corrupt fail its checks again? One that cannot be
        read now (an I/O error) is kept: nothing says it is bad."""
        try:
            return not self._intact(txn, key, meta)
        except StorageUnavailable as exc:
            logger.warning("record %s not checked again (kept): %s", key.hex(), exc)
            return False

    def _intact(self, txn, key: bytes, meta: bytes) -> bool:
        """Whether the record of ``key`` (metadata ``meta``) passes every check."""
        fields = _meta_fields(meta)
        if fields is None:
            return False
        if fields[0] == LEGACY_META_VERSION:
            value = txn.get(key, db=self._payload_db)
            return value is not None and _parse_legacy_payload(value) is not None
        return self._check_stored(key, meta)

    def _write_access(self, txn, access: dict[bytes, float], state: _BatchState) -> None:
        """Persist the access times that reads recorded, each only over an older stored
        time: a read of a record that a later batch replaced (it began before that
        commit) is recorded with a time before the new record's."""
        for key, stamp in access.items():
            if key in state.changes:
                continue  # removed, or rewritten with a newer stamp
            value = txn.get(key, db=self._meta_db)
            if value is None or len(value) < META_BYTES:
                continue
            if _META_ACCESS.unpack_from(value, _META_ACCESS_OFFSET)[0] >= stamp:
                continue
            patched = bytearray(value)
            _META_ACCESS.pack_into(patched, _META_ACCESS_OFFSET, stamp)
            txn.put(key, patched, db=self._meta_db)
