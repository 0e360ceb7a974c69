"""Sealed memfd segments: what a process creates, and what it accepts from another."""

import fcntl
import os

import pytest

from hicache.errors import InvalidArgument
from hicache.shm import SharedBuffer, check_segment


def test_a_created_segment_is_sealed_and_shared_through_its_descriptor():
    buffer = SharedBuffer.create(8192, name="hicache-test")
    try:
        seals = fcntl.fcntl(buffer.fd, fcntl.F_GET_SEALS)
        assert seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == \
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(buffer.fd, 4096)
        assert os.readlink(f"/proc/self/fd/{buffer.fd}").startswith("/memfd:hicache-test")
        other = SharedBuffer.attach(os.dup(buffer.fd), 8192, uid=os.getuid())
        buffer.tensor[100:104] = 7
        assert other.array[100:104].tolist() == [7] * 4
        assert other.segment_id == buffer.segment_id and other.fd == -1  # the attacher keeps no descriptor
        other.close()
    finally:
        buffer.close()
    assert buffer.closed


def test_a_reader_descriptor_maps_read_only_and_nobody_else_can_write_a_protected_segment():
    buffer = SharedBuffer.create(4096, others_read_only=True)
    try:
        reader = SharedBuffer.attach(buffer.reader_fd(), 4096, writable=False)
        buffer.array[:3] = [1, 2, 3]
        assert reader.array[:3].tolist() == [1, 2, 3] and reader.tensor is None
        with pytest.raises(ValueError):
            reader.array[0] = 9
        reopened = os.open(f"/proc/self/fd/{buffer.reader_fd()}", os.O_RDWR)
        with pytest.raises(InvalidArgument):  # F_SEAL_FUTURE_WRITE: no new writable mapping
            SharedBuffer.attach(reopened, 4096)
        buffer.array[3] = 4  # the creator's own mapping still writes
        assert reader.array[3] == 4
        reader.close()
    finally:
        buffer.close()


def test_segments_that_could_fault_or_are_not_memory_files_are_refused(tmp_path):
    def memfd(size, seals, flags=os.MFD_ALLOW_SEALING):
        fd = os.memfd_create("t", flags)
        os.ftruncate(fd, size)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd

    good = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
    fds = {
        "unsealed": memfd(4096, 0),
        "sealing not allowed": memfd(4096, 0, flags=0),
        "growable only": memfd(4096, fcntl.F_SEAL_SEAL),
        "too small": memfd(1024, good),
        "write-sealed": memfd(4096, good | fcntl.F_SEAL_WRITE),
    }
    path = tmp_path / "file"
    path.write_bytes(b"\0" * 4096)
    fds["a regular file"] = os.open(path, os.O_RDWR)
    fds["a pipe"] = os.pipe()[0]
    for what, fd in fds.items():
        with pytest.raises(InvalidArgument):
            check_segment(fd, 4096)
        os.close(fd)
    fd = memfd(4096, good)
    assert check_segment(fd, 4096, uid=os.getuid())
    with pytest.raises(InvalidArgument, match="belongs to uid"):
        check_segment(fd, 4096, uid=os.getuid() + 1)
    assert check_segment(fd, 4096, writable=False)
    os.close(fd)
    with pytest.raises(InvalidArgument):
        check_segment(fd, 4096)  # closed
    with pytest.raises(InvalidArgument):
        SharedBuffer.create(0)
