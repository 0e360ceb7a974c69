"""CUDA IPC descriptions (``hicache.cuda_ipc.export_tensor``'s fields) built by hand, sane
and hostile, with reference-counter files in /dev/shm to name: no GPU needed."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

SHM = Path("/dev/shm")
# What torch writes: /dev/shm/torch_<pid>_<random>_<n>, a 64-byte header and then 10,000
# int64 counters (at::RefcountedMapAllocator of torch::CUDA_IPC_REF_COUNTER_FILE_SIZE).
REF_COUNTER_FILE_BYTES = 64 + 8 * 10_000
OTHER_UID = 65534  # nobody


class RefCounters:
    """Files and other entries in /dev/shm for descriptions to name, removed at the end.
    Every name is ``/<entry>``, as torch's ``ref_counter_handle`` is."""

    def __init__(self) -> None:
        self.prefix = f"hicache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths: list[Path] = []

    def _path(self, what: str) -> Path:
        path = SHM / f"{self.prefix}-{len(self.paths)}-{what}"
        self.paths.append(path)
        return path

    def file(self, what: str = "own", nbytes: int = REF_COUNTER_FILE_BYTES, uid: int | None = None) -> bytes:
        path = self._path(what)
        path.write_bytes(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
        if uid is not None:
            os.chown(path, uid, -1)
        return b"/" + path.name.encode()

    def symlink(self, to: bytes) -> bytes:
        path = self._path("link")
        path.symlink_to(SHM / to.decode().lstrip("/"))
        return b"/" + path.name.encode()

    def directory(self) -> bytes:
        path = self._path("dir")
        path.mkdir()
        return b"/" + path.name.encode()

    def fifo(self) -> bytes:
        path = self._path("fifo")
        os.mkfifo(path)
        return b"/" + path.name.encode()

    def snapshot(self) -> dict[str, tuple]:
        """What a refusal must leave as it was: every entry's bytes, size, owner, times."""
        out = {}
        for path in self.paths:
            st = path.lstat()
            data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
            out[path.name] = (data, st.st_size, st.st_uid, st.st_mtime_ns, st.st_ctime_ns)
        return out

    def close(self) -> None:
        for path in self.paths:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            elif path.exists() or path.is_symlink():
                path.unlink()


@contextmanager
def ref_counters():
    made = RefCounters()
    try:
        yield made
    finally:
        made.close()


def description(nbytes: int, ref_counter: bytes, **changes) -> dict:
    """A sane description of a flat ``nbytes``-byte CUDA tensor at byte 256 of its
    storage, at byte 4096 of its allocation, counted at index 3 of ``ref_counter``."""
    sane = {"size": [nbytes], "stride": [1], "offset": 256, "device": 0, "handle": b"h" * 64,
            "storage_size_bytes": nbytes + 512, "storage_offset_bytes": 4096, "ref_counter_handle": ref_counter,
            "ref_counter_offset": 3, "event_handle": b"e" * 64, "event_sync_required": True}
    return sane | changes


def hostile(nbytes: int, files: RefCounters) -> list[tuple[str, dict, str]]:
    """(what is wrong, the description, the field its refusal names): each must be
    refused before anything is opened. Another user's file is not among them: see
    :func:`another_users`."""
    own = files.file()
    short = files.file("short", nbytes=64 + 8 * 4)  # index 3 fits; torch maps 80,064 bytes and would grow it
    cases = [
        ("no name", {"ref_counter_handle": b""}, "ref_counter_handle"),
        ("/dev/shm itself", {"ref_counter_handle": b"/"}, "ref_counter_handle"),
        ("dot-dot", {"ref_counter_handle": b"/.."}, "ref_counter_handle"),
        ("a path out of /dev/shm", {"ref_counter_handle": b"/../../etc/passwd"}, "ref_counter_handle"),
        ("a path below /dev/shm", {"ref_counter_handle": own + b"/x"}, "ref_counter_handle"),
        ("two slashes", {"ref_counter_handle": b"/" + own}, "ref_counter_handle"),
        ("no slash", {"ref_counter_handle": own[1:]}, "ref_counter_handle"),
        ("a NUL byte", {"ref_counter_handle": own + b"\0/../../etc/passwd"}, "ref_counter_handle"),
        ("not text", {"ref_counter_handle": b"/\xff\xfe"}, "ref_counter_handle"),
        ("too long", {"ref_counter_handle": b"/" + b"x" * 300}, "ref_counter_handle"),
        ("no such file", {"ref_counter_handle": own + b"-gone"}, "ref_counter_handle"),
        ("a symlink", {"ref_counter_handle": files.symlink(own)}, "ref_counter_handle"),
        ("a directory", {"ref_counter_handle": files.directory()}, "ref_counter_handle"),
        ("a fifo", {"ref_counter_handle": files.fifo()}, "ref_counter_handle"),
        ("a file shorter than torch maps", {"ref_counter_handle": short}, "ref_counter_handle"),
        ("a negative counter index", {"ref_counter_offset": -1}, "ref_counter_offset"),
        ("a counter index past the file's", {"ref_counter_offset": 10_000}, "ref_counter_offset"),
        ("a huge counter index", {"ref_counter_offset": 1 << 60}, "ref_counter_offset"),
        ("an empty storage", {"storage_size_bytes": 0}, "storage_size_bytes"),
        ("a negative storage size", {"storage_size_bytes": -(1 << 40)}, "storage_size_bytes"),
        ("a negative storage offset", {"storage_offset_bytes": -4096}, "storage_offset_bytes"),
        ("a storage past 2^62", {"storage_offset_bytes": 1 << 62}, "storage_offset_bytes"),
        ("fewer bytes than the pool needs", {"size": [nbytes - 1]}, "size"),
        ("a tensor past its storage", {"offset": 513}, "offset"),
        ("a negative tensor offset", {"offset": -256}, "offset"),
        ("not contiguous", {"stride": [2]}, "stride"),
        ("a negative device", {"device": -1}, "device"),
        ("a GPU uuid that is not text", {"device_uuid": 3}, "device_uuid"),
        ("a GPU uuid longer than any", {"device_uuid": "GPU-" + "0" * 300}, "device_uuid"),
        ("no memory handle", {"handle": b""}, "handle"),
        ("an event to wait on without its handle", {"event_handle": b""}, "event_handle"),
        ("an event handle of the wrong size", {"event_handle": b"e" * 8}, "event_handle"),
    ]
    return [(what, description(nbytes, own, **changes), field) for what, changes, field in cases]


class VisibleGpus:
    """torch.cuda as one process of a node with four GPUs sees it: ``visible`` lists the
    node's GPUs it sees, in order (``CUDA_VISIBLE_DEVICES``), which are its ``cuda:0``,
    ``cuda:1``, ...; each reports the same UUID (``get_device_properties(i).uuid``) in
    every process, whatever its index there."""

    NODE = tuple(uuid.UUID(int=0x1D_0000 + gpu) for gpu in range(4))

    def __init__(self, monkeypatch, visible: tuple[int, ...] = (0, 1, 2, 3)) -> None:
        self.visible = visible
        self.current = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.visible))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.properties)

    def properties(self, device) -> SimpleNamespace:
        index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
        if not 0 <= index < len(self.visible):
            raise AssertionError("Invalid device id")  # (what torch raises)
        return SimpleNamespace(name="fake GPU", uuid=self.NODE[self.visible[index]])

    @classmethod
    def uuid(cls, gpu: int) -> str:
        """What ``str()`` of the node's GPU ``gpu``'s UUID reads, in any process."""
        return str(cls.NODE[gpu])


def another_users(nbytes: int, files: RefCounters) -> dict:
    """A sane description naming a file of another user (needs root to make)."""
    return description(nbytes, files.file("others", uid=OTHER_UID))
