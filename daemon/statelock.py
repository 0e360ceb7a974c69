"""One daemon per state: an exclusive lock taken before anything is touched.

A second ``hicache serve`` on the same socket path or the same disk tier would take the
socket over (new engines reach it) and open the same LMDB environment while the first
still serves. Before it opens the store or binds, the daemon takes an exclusive
``flock`` on ``<socket>.lock`` next to its socket and on ``hicache.lock`` in its store
directory; a second daemon finds one held and exits with a message naming the holder,
having changed nothing. The kernel drops the locks when the process dies, however it
dies, so a crash leaves nothing to clean up (the files themselves stay, empty of
meaning).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from hicache.config import DaemonConfig
from hicache.errors import InvalidArgument


class AlreadyRunning(RuntimeError):
    """Another daemon holds this state."""


class StateLock:
    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self._fds: list[int] = []
        try:
            for path in paths:
                self._fds.append(self._take(path))
        except BaseException:
            self.release()
            raise

    @classmethod
    def for_config(cls, config: DaemonConfig) -> "StateLock":
        """The locks of a daemon with this configuration (creating the socket's and the
        store's directories: the runtime one 0750, for engines of the group to enter;
        the store 0700). A directory it cannot make or use is an :class:`InvalidArgument`
        naming the key, as for any other bad value (a typo, a volume not mounted)."""
        socket_path = config.server.socket_path
        _make_dir(socket_path.parent, 0o750, "[server].socket")
        paths = [(socket_path.with_name(socket_path.name + ".lock"), "[server].socket")]
        if config.disk.enabled:
            store = config.disk.store_path
            _make_dir(store, 0o700, "[disk].path")
            paths.append((store / "hicache.lock", "[disk].path"))
        try:
            return cls([path for path, _ in paths])
        except OSError as exc:  # (no permission, a read-only file system; AlreadyRunning is not one)
            key = next((key for path, key in paths if str(path) == exc.filename), "a state lock")
            raise InvalidArgument(f"{key}: cannot open {exc.filename}: {exc.strerror}") from None

    @staticmethod
    def _take(path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AlreadyRunning(f"another hicache daemon (pid {holder}) is serving this state: {path} is locked") \
                from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())  # closing the descriptor drops the lock


def _make_dir(path: Path, mode: int, key: str) -> None:
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:  # (exists as a file, a parent is a file, no permission, read-only, ...)
        raise InvalidArgument(f"{key}: cannot make the directory {path}: {exc.strerror}") from None
