"""Sealed memfd segments: what a process creates, and what it accepts from another."""

import fcntl
import mmap
import os

import pytest

from hicache.errors import InvalidArgument
from hicache.shm import PREFAULT_CHUNK_BYTES, SharedBuffer, check_segment, prefault

PAGE = mmap.PAGESIZE


def mapped_bytes(buffer: SharedBuffer) -> int:
    """The bytes of ``buffer``'s mapping in this process's page tables (its Rss)."""
    start = buffer.array.ctypes.data
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == start
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no such mapping")


def populate_or_skip(buffer: SharedBuffer, start: int, end: int) -> int:
    mapped = buffer.populate(start, end)
    if mapped is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    return mapped


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


def test_populate_maps_in_the_pages_a_segment_holds_and_leaves_its_holes_alone():
    engine = SharedBuffer.create(64 * PAGE, name="hicache-test-populate")
    try:
        for page in [*range(0, 10), *range(20, 30), 63]:  # the engine wrote these pages
            engine.array[page * PAGE : (page + 1) * PAGE] = page + 1
        allocated = os.fstat(engine.fd).st_blocks
        daemon = SharedBuffer.attach(os.dup(engine.fd), 64 * PAGE)
        try:
            assert mapped_bytes(daemon) == 0  # a new mapping: every first touch would fault
            assert populate_or_skip(daemon, 0, 64 * PAGE) == 21 * PAGE
            assert mapped_bytes(daemon) == 21 * PAGE
            assert os.fstat(engine.fd).st_blocks == allocated  # no hole was filled
            for page in range(64):
                expected = page + 1 if page < 10 or 20 <= page < 30 or page == 63 else 0
                assert (daemon.array[page * PAGE : (page + 1) * PAGE] == expected).all()
            daemon.tensor[25 * PAGE] = 99  # the mapping writes through to the engine
            assert engine.array[25 * PAGE] == 99
        finally:
            daemon.close()
        assert daemon.populate(0, 64 * PAGE) is None  # closed: nothing to map
    finally:
        engine.close()


def test_a_read_only_mapping_is_populated_for_reading():
    engine = SharedBuffer.create(8 * PAGE, others_read_only=True)
    try:
        engine.array[: 4 * PAGE] = 5
        reader = SharedBuffer.attach(engine.reader_fd(), 8 * PAGE, writable=False)
        try:
            assert populate_or_skip(reader, 0, 8 * PAGE) == 4 * PAGE
            assert mapped_bytes(reader) == 4 * PAGE
            assert (reader.array[: 4 * PAGE] == 5).all()
        finally:
            reader.close()
    finally:
        engine.close()


def test_prefault_maps_a_segment_chunk_by_chunk_in_the_background_and_stops_at_close():
    size = 2 * PREFAULT_CHUNK_BYTES + 3 * PAGE  # a partial last chunk
    engine = SharedBuffer.create(size, name="hicache-test-prefault")
    try:
        engine.array[::PAGE] = 1  # every page allocated
        daemon = SharedBuffer.attach(os.dup(engine.fd), size)
        populate_or_skip(daemon, 0, PAGE)
        prefault(daemon).join()
        assert mapped_bytes(daemon) == size
        daemon.close()
        prefault(daemon).join()  # a closed buffer: the thread ends at once

        racing = SharedBuffer.attach(os.dup(engine.fd), size)
        thread = prefault(racing)
        racing.close()  # at any point of the population: it stops at the next chunk
        thread.join()
        assert racing.closed and not thread.is_alive()
    finally:
        engine.close()
