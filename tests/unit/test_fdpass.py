"""The descriptor socket: offers and fetches over a real Unix socket, and everything it
refuses."""

import os
import socket

import pytest

from hicache import fdpass
from hicache.errors import InvalidArgument, Unavailable
from hicache.fdpass import FdExchange
from hicache.shm import SharedBuffer


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def exchange(tmp_path):
    ex = FdExchange(tmp_path / "hicache.sock.fds", mode=0o640)
    yield ex
    ex.close()


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def test_an_offer_is_taken_once_with_who_made_it(exchange):
    assert fdpass.socket_path_for("/run/x/hicache.sock") == fdpass.socket_path_for("/run/x/hicache.sock")
    assert str(fdpass.socket_path_for("/run/x/hicache.sock")) == "/run/x/hicache.sock.fds"
    assert oct(os.stat(exchange.path).st_mode & 0o777) == "0o640"
    segment = SharedBuffer.create(4096)
    token = fdpass.offer(exchange.path, segment.fd)
    assert len(token) == fdpass.TOKEN_BYTES
    offer = exchange.take(token)
    assert (offer.uid, offer.gid, offer.pid) == (os.getuid(), os.getgid(), os.getpid())
    assert offer.fd != segment.fd and _same_file(offer.fd, segment.fd)
    assert exchange.take(token) is None  # once
    os.close(offer.fd)
    segment.close()


def test_a_published_descriptor_is_fetched_once_by_its_user(exchange):
    segment = SharedBuffer.create(4096)
    token = exchange.publish(segment.reader_fd(), uid=os.getuid())
    fd = fdpass.fetch(exchange.path, token)
    assert _same_file(fd, segment.fd)
    os.close(fd)
    with pytest.raises(InvalidArgument):
        fdpass.fetch(exchange.path, token)  # gone
    other = exchange.publish(segment.reader_fd(), uid=os.getuid() + 1)
    with pytest.raises(InvalidArgument):
        fdpass.fetch(exchange.path, other)  # for another user
    segment.close()


def test_offers_expire_and_each_user_may_keep_only_so_many(tmp_path):
    clock = Clock()
    exchange = FdExchange(tmp_path / "x.fds", clock=clock)
    try:
        segment = SharedBuffer.create(4096)
        tokens = [fdpass.offer(exchange.path, segment.fd) for _ in range(fdpass.MAX_OFFERS_PER_UID)]
        with pytest.raises(InvalidArgument, match="too many"):
            fdpass.offer(exchange.path, segment.fd)
        os.close(exchange.take(tokens[0]).fd)
        fdpass.offer(exchange.path, segment.fd)  # room again
        clock.now += fdpass.OFFER_TTL_S + 1
        fdpass.offer(exchange.path, segment.fd)  # (a turn of the thread: expired ones dropped)
        assert exchange.take(tokens[1]) is None
        segment.close()
    finally:
        exchange.close()
    assert not exchange.path.exists()


def _raw(exchange, payload: bytes, fds=()) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect(str(exchange.path))
        socket.send_fds(sock, [payload], list(fds)) if fds else sock.send(payload)
        return sock.recv(256)


def test_malformed_requests_are_refused_and_the_exchange_goes_on(exchange):
    segment = SharedBuffer.create(4096)
    assert _raw(exchange, b"P" + b"t" * 16)[:1] == b"E"  # an offer without a descriptor
    assert _raw(exchange, b"P" + b"t" * 16, [segment.fd, segment.fd])[:1] == b"E"  # two
    assert _raw(exchange, b"P" + b"t" * 15, [segment.fd])[:1] == b"E"  # short token
    assert _raw(exchange, b"X" + b"t" * 16)[:1] == b"E"
    assert _raw(exchange, b"G" + b"t" * 16, [segment.fd])[:1] == b"E"  # nothing published; its fd dropped
    assert _raw(exchange, b"P" + b"t" * 16 + b"more")[:1] == b"E"
    assert exchange.take(b"t" * 16) is None
    # A peer that connects and says nothing does not stop the others.
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    idle.connect(str(exchange.path))
    token = fdpass.offer(exchange.path, segment.fd)
    os.close(exchange.take(token).fd)
    idle.close()
    segment.close()


def test_no_daemon_there_is_unavailable(tmp_path):
    with pytest.raises(Unavailable):
        fdpass.offer(tmp_path / "nothing.fds", 0)
    with pytest.raises(Unavailable):
        fdpass.fetch(tmp_path / "nothing.fds", b"t" * 16)
