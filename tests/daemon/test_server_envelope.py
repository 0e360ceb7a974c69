"""What one ZeroMQ message can cost the daemon (:mod:`hicache.daemon.server`): a message
of very many frames, or with large envelope frames, is read to its end, dropped and
answered with one small error frame; nothing of it is echoed or kept, and the engines
around it are served in order, their sessions intact."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from daemon_util import ClientEngine, RawPeer, clean_daemon
from hicache import protocol as p
from hicache.errors import ErrorCode, InvalidArgument
from tiers_util import SPEC

PS = SPEC.page_size
SEQ = list(range(300, 300 + 4 * PS))


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _dropped(raw: RawPeer) -> int:
    return raw.call(p.Stats(id=0)).stats.requests.get("envelope/DROPPED", 0)


@pytest.fixture
def daemon(tmp_path):
    with clean_daemon(tmp_path, server={"max_message_bytes": 1 << 20}) as proc:
        yield proc


@pytest.fixture
def dealer(daemon):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)
    sock.connect(daemon.endpoint)
    yield sock
    sock.close(linger=0)
    ctx.term()


def test_a_message_of_many_frames_is_dropped_and_the_others_are_served(daemon, dealer):
    """Half a million empty frames before a request: one small error frame back (no
    echo), and an engine with a 1-s lease that waited behind it keeps its session and
    its pages; a request sent after the bad message is answered after it, correctly."""
    victim = ClientEngine(daemon.endpoint)
    other = RawPeer(daemon.endpoint)
    try:
        victim.prefill(SEQ)
        dealer.send_multipart([b""] * 500_000 + [p.encode(p.Health(id=7))], copy=False)
        reply = dealer.recv_multipart()
        assert len(reply) == 1, len(reply)
        error = p.decode_reply(reply[0])
        assert isinstance(error, p.Error) and error.code == ErrorCode.INVALID_ARGUMENT, error
        assert "500001 frames" in error.message
        assert isinstance(other.call(p.Health(id=0)), p.HealthReply)
        again = victim.client.match(SEQ)
        assert again.num_device_pages == 4 and not victim.client.degraded
        victim.engine.check(victim.ns(), SEQ, again.device_pages)
        victim.client.check()
        # The same connection, well-formed now, is answered as any other.
        dealer.send(p.encode(p.Health(id=8)))
        assert p.decode_reply(dealer.recv()).id == 8
        assert _dropped(other) == 1
    finally:
        other.close()
        victim.close()


@pytest.mark.parametrize("envelope", [
    [b"x" * 256, b""],  # one frame over a routing id's 255 bytes
    [b"hop"] * 7 + [b""],  # a REQ behind seven proxies: one frame too many
])
def test_an_envelope_over_the_bounds_is_dropped(daemon, dealer, envelope):
    dealer.send_multipart(envelope + [p.encode(p.Health(id=3))])
    reply = dealer.recv_multipart()
    assert len(reply) == 1
    assert p.decode_reply(reply[0]).code == ErrorCode.INVALID_ARGUMENT
    # Within the bounds (a REQ behind six proxies), the envelope comes back in front of the answer.
    dealer.send_multipart([b"hop"] * 6 + [b"", p.encode(p.Health(id=4))])
    reply = dealer.recv_multipart()
    assert reply[:-1] == [b"hop"] * 6 + [b""] and p.decode_reply(reply[-1]).id == 4


def test_large_envelopes_from_a_client_that_never_reads_cost_nothing_kept(daemon):
    """Thirty messages each carrying 8 MiB of envelope (frames under the transport's
    per-frame limit), from a client that never reads: nothing is echoed, so the daemon's
    memory does not grow by what they carried; another client is answered after them."""
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.RCVHWM, 1)
    rogue.setsockopt(zmq.RCVBUF, 4096)
    rogue.connect(daemon.endpoint)
    other = RawPeer(daemon.endpoint)
    try:
        assert isinstance(other.call(p.Health(id=0)), p.HealthReply)
        before = _rss_bytes(daemon.proc.pid)
        big = zmq.Frame(b"x" * (1 << 20))
        body = p.encode(p.Health(id=1))
        for _ in range(30):
            rogue.send_multipart([big] * 8 + [body], copy=False)
        deadline = time.monotonic() + 60  # a bound on waiting for the transfer, not on how long it took
        while _dropped(other) < 30:
            assert time.monotonic() < deadline, f"{_dropped(other)} of 30 dropped"
            time.sleep(0.05)
        assert isinstance(other.call(p.Health(id=0)), p.HealthReply)
        grown = _rss_bytes(daemon.proc.pid) - before
        assert grown < 96 << 20, f"the daemon grew by {grown >> 20} MiB for 240 MiB of envelopes"
    finally:
        rogue.close(linger=0)
        other.close()
        ctx.term()


def test_a_request_over_the_size_limit_is_answered_with_its_id(daemon, dealer):
    """A request over ``max_message_bytes`` (within four times it) is refused at once,
    with the request's own id, so that its caller's wait ends with INVALID_ARGUMENT —
    and the daemon's hello says the limit, for the client to refuse such a request
    before it sends it (a real client: no wait, and not degraded)."""
    tokens = (b"\1\0\0\0" * (1 << 18))  # 1 MiB of tokens: over the daemon's 1 MiB with the rest of the match
    dealer.send(p.encode(p.Match(id=41, session=1, tokens=tokens, extra_key="k")))
    reply = p.decode_reply(dealer.recv())
    assert isinstance(reply, p.Error) and reply.id == 41 and reply.code == ErrorCode.INVALID_ARGUMENT, reply
    assert "exceeds the limit" in reply.message
    dealer.send(p.encode(p.Hello(id=42, version=p.PROTOCOL_VERSION)))
    hello = p.decode_reply(dealer.recv())
    assert hello.id == 42 and hello.max_message_bytes == 1 << 20
    engine = ClientEngine(daemon.endpoint, timeout_s=60.0, heartbeat=False)
    try:
        with pytest.raises(InvalidArgument):
            engine.client.match(list(range(1, (1 << 18) + 1)))
        assert not engine.client.degraded
        engine.prefill(SEQ)
        assert engine.client.match(SEQ).num_device_pages == 4
    finally:
        engine.close()
