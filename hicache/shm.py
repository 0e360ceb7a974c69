"""Named POSIX shared memory, mapped into torch tensors.

CPU-mode KV pools, host pools and layer-counter rings live in files under ``/dev/shm``
that one process creates and others map by name. We open the files directly rather than
through ``multiprocessing.shared_memory``: on Python < 3.13 that module registers
every segment a process *attaches* with its resource tracker, which unlinks the
creator's segment when the attaching process exits.

The creator owns the name: it unlinks the file when it closes its buffer (or when the
buffer is garbage collected). Attachers only unmap.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from pathlib import Path

import torch

from hicache.errors import InvalidArgument

SHM_DIR = Path("/dev/shm")
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"


class SharedBuffer:
    """A named shared-memory segment and a flat uint8 tensor over it."""

    def __init__(self, name: str, nbytes: int, *, create: bool, mode: int = 0o600, directory: Path = SHM_DIR):
        if not name or set(name) - _NAME_CHARS or name.startswith("."):
            raise InvalidArgument(f"bad shared-memory name {name!r}")
        if nbytes <= 0:
            raise InvalidArgument(f"shared-memory size must be positive, got {nbytes}")
        self.name = name
        self.nbytes = nbytes
        self.owner = create
        self.path = directory / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, mode)
        except FileNotFoundError:
            raise InvalidArgument(f"no shared-memory segment {name!r}") from None
        except FileExistsError:
            raise InvalidArgument(f"shared-memory segment {name!r} already exists") from None
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise InvalidArgument(
                    f"shared-memory segment {name!r} holds {os.fstat(fd).st_size} bytes, expected {nbytes}"
                )
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self._finalizer = weakref.finalize(self, _release, self._map, self.path if create else None)

    @classmethod
    def create(cls, nbytes: int, *, prefix: str = "hicache", mode: int = 0o600, directory: Path = SHM_DIR):
        return cls(unique_name(prefix), nbytes, create=True, mode=mode, directory=directory)

    @classmethod
    def attach(cls, name: str, nbytes: int, *, directory: Path = SHM_DIR):
        return cls(name, nbytes, create=False, directory=directory)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unmap (and unlink, for the creator). Tensors over the buffer must be gone."""
        self.tensor = None  # type: ignore[assignment]
        self._finalizer()


def _release(mapping: mmap.mmap, path: Path | None) -> None:
    try:
        mapping.close()
    except BufferError:
        # A tensor still views the mapping; the memory goes when the process exits.
        pass
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
