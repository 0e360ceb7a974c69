"""Shared memory between an engine and the daemon: sealed memfd segments.

CPU-mode KV pools and layer-counter rings are anonymous memory files
(``memfd_create``) that one process creates and hands to the other as a file descriptor
(:mod:`hicache.fdpass`). Nothing has a name under ``/dev/shm``, so nothing outlives
the processes that map it: a segment is freed when its last descriptor and mapping are
gone, a crash included.

A segment is *sealed* at creation (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``):
neither side can change its size, so the other can never fault (SIGBUS) on a page that
a truncation took away. A process mapping a segment it did not create checks the seals
first (:func:`check_segment`) and refuses one that could shrink.

The daemon maps an engine's pool read-write (it loads pages into it) and hands the
engine its counter ring as a read-only descriptor (:meth:`SharedBuffer.reader_fd`) of
a segment sealed against any writer but the daemon's own mapping.

A new mapping of a segment has empty page tables: the first touch of each 4 KiB page
by the daemon faults, even where the engine wrote the page long ago. Loading 8 MiB into
blocks the daemon never touched took 3.7 ms against 0.6 ms once mapped. So the daemon
maps in the pages an engine's segment holds already, in the background, as soon as it
maps the segment (:func:`prefault`). It maps only pages that exist (``mincore``): a
sparse segment stays sparse, and its holes are never charged to the daemon.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import weakref
from typing import NamedTuple

import numpy as np
import torch

from hicache.errors import InvalidArgument, ResourceExhausted

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1
_WRITE_SEALS = fcntl.F_SEAL_WRITE | _FUTURE_WRITE

logger = logging.getLogger(__name__)

PREFAULT_CHUNK_BYTES = 16 << 20  # a close waits for at most one chunk's population
_MADV_POPULATE_READ = 22  # Linux 5.14
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)  # (ctypes calls run without the GIL)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class SegmentId(NamedTuple):
    """What makes two descriptors the same memory: the file's device and inode."""

    dev: int
    ino: int


def check_segment(fd: int, nbytes: int, *, uid: int | None = None, writable: bool = True) -> SegmentId:
    """Refuse a descriptor that is not a sealed memory file of at least ``nbytes``
    bytes (owned by ``uid``, when given). Everything an engine hands over goes through
    this before it is mapped."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise InvalidArgument(f"bad segment descriptor: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument("a segment must be a memory file (memfd_create), not this kind of file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidArgument("a segment must be a memory file (memfd_create with sealing)") from None
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise InvalidArgument("a segment must be sealed against shrinking (F_SEAL_SHRINK | F_SEAL_SEAL)")
    if writable and seals & _WRITE_SEALS:
        raise InvalidArgument("a segment the daemon writes into must not be write-sealed")
    if st.st_size < nbytes:
        raise InvalidArgument(f"the segment holds {st.st_size} bytes, expected {nbytes}")
    if uid is not None and st.st_uid != uid:
        raise InvalidArgument(f"the segment belongs to uid {st.st_uid}, not to the registering uid {uid}")
    return SegmentId(st.st_dev, st.st_ino)


class SharedBuffer:
    """A mapped memfd segment: ``array`` (numpy bytes) and, when writable, ``tensor``
    (a flat uint8 torch tensor) over it. ``fd`` stays open while the buffer does, for
    handing the segment on; -1 once the caller said it need not (``keep_fd=False``)."""

    def __init__(self, fd: int, nbytes: int, *, writable: bool = True, keep_fd: bool = True) -> None:
        if nbytes <= 0:
            raise InvalidArgument(f"shared-memory size must be positive, got {nbytes}")
        self.nbytes = nbytes
        self.writable = writable
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise InvalidArgument(f"bad segment descriptor: {exc.strerror}") from None
        self.segment_id = SegmentId(st.st_dev, st.st_ino)
        # ACCESS_READ, not PROT_READ: a buffer over a read-only mapping must say so, or a
        # write through it would fault instead of raising.
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        try:
            self._map = mmap.mmap(fd, nbytes, access=access)
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):  # (mmap dups the fd)
                raise ResourceExhausted(f"cannot map the segment: out of file descriptors ({exc.strerror})") from None
            raise InvalidArgument(f"cannot map the segment: {exc}") from None
        if not keep_fd:
            os.close(fd)
            fd = -1
        self.fd = fd
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array) if writable else None
        self._address = self.array.ctypes.data
        self._populating = threading.Lock()  # a population step vs close (no unmap under it)
        self._finalizer = weakref.finalize(self, _release, self._map, fd)

    @classmethod
    def create(cls, nbytes: int, *, name: str = "hicache", others_read_only: bool = False) -> "SharedBuffer":
        """A new zeroed, sealed segment of ``nbytes`` bytes (``name`` shows in
        ``/proc/<pid>/maps`` as ``/memfd:<name>``). With ``others_read_only`` only this
        buffer's own mapping can write it (``F_SEAL_FUTURE_WRITE``): a descriptor
        handed on maps read-only, even reopened through ``/proc``."""
        if nbytes <= 0:
            raise InvalidArgument(f"shared-memory size must be positive, got {nbytes}")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS & ~fcntl.F_SEAL_SEAL)
            buffer = cls(fd, nbytes)
            seals = fcntl.F_SEAL_SEAL | (_FUTURE_WRITE if others_read_only else 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)  # after our own writable mapping exists
            return buffer
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, nbytes: int, *, uid: int | None = None, writable: bool = True,
               keep_fd: bool = False) -> "SharedBuffer":
        """Map a segment another process handed over (taking ``fd``: closed here, or at
        :meth:`close` with ``keep_fd``), after :func:`check_segment`."""
        try:
            check_segment(fd, nbytes, uid=uid, writable=writable)
            return cls(fd, nbytes, writable=writable, keep_fd=keep_fd)
        except BaseException:
            close_all((fd,))
            raise

    def reader_fd(self) -> int:
        """A new read-only descriptor of this segment (the caller closes it): whoever
        gets it can map the segment for reading, but not write, grow or shrink it."""
        if self.fd < 0:
            raise InvalidArgument("this buffer kept no descriptor")
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def populate(self, start: int, end: int) -> int | None:
        """Map bytes ``start .. end`` (page-aligned ``start``) of the segment into this
        process's page tables, where the segment holds pages already; holes stay holes.
        The bytes mapped; ``None`` once the buffer is closed, or where the kernel cannot
        (``MADV_POPULATE_*`` came with Linux 5.14). O(pages) in the kernel, no GIL."""
        page = mmap.PAGESIZE
        with self._populating:
            if self.closed or start >= end:
                return None
            count = (end - start + page - 1) // page
            resident = (ctypes.c_ubyte * count)()
            if _libc.mincore(self._address + start, end - start, resident) != 0:
                return None
            advice = _MADV_POPULATE_WRITE if self.writable else _MADV_POPULATE_READ
            mapped = 0
            i = 0
            while i < count:
                if not resident[i] & 1:
                    i += 1
                    continue
                j = i + 1
                while j < count and resident[j] & 1:
                    j += 1
                length = min(j * page, end - start) - i * page
                if _libc.madvise(self._address + start + i * page, length, advice) != 0:
                    return None  # EINVAL: an older kernel; EFAULT/ENOMEM: not ours to fix here
                mapped += length
                i = j
            return mapped

    def close(self) -> None:
        """Unmap and close. Views over the buffer (``array``, ``tensor`` and any taken
        from them) must be gone, or the mapping lives until they are."""
        with self._populating:
            self.tensor = self.array = None  # type: ignore[assignment]
            self._finalizer()


def prefault(buffer: SharedBuffer) -> threading.Thread | None:
    """Populate ``buffer`` (:meth:`SharedBuffer.populate`) chunk by chunk on a thread of
    its own, which ends at the end, at a close, or where the kernel cannot populate.
    ``None`` where no thread could start (the buffer then faults its pages in as used)."""
    ref = weakref.ref(buffer)
    nbytes = buffer.nbytes

    def run() -> None:
        mapped = 0
        for start in range(0, nbytes, PREFAULT_CHUNK_BYTES):
            held = ref()  # (not between chunks: an unreferenced buffer is unmapped meanwhile)
            done = None if held is None else held.populate(start, min(start + PREFAULT_CHUNK_BYTES, nbytes))
            del held
            if done is None:
                logger.debug("prefault of a %d-byte segment stopped at byte %d", nbytes, start)
                return
            mapped += done
        logger.debug("prefaulted %d of %d bytes of a segment", mapped, nbytes)

    thread = threading.Thread(target=run, name="hicache-prefault", daemon=True)
    try:
        thread.start()
    except RuntimeError as exc:  # out of threads: an optimisation is not worth a refusal
        logger.warning("cannot prefault a %d-byte segment: %s", nbytes, exc)
        return None
    return thread


def close_all(fds) -> None:
    """Close every descriptor of ``fds``, whatever state each is in."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _release(mapping: mmap.mmap, fd: int) -> None:
    try:
        mapping.close()
    except BufferError:
        # A view still holds the mapping: it is unmapped when the last view goes.
        pass
    if fd >= 0:
        close_all((fd,))
