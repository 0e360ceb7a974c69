"""Thousands of malformed and adversarial messages against a live daemon: every one gets
an error reply (with its request id when it has a readable one), the daemon stays up,
its invariants hold, and a real engine keeps working through it all."""

import random

import msgspec
import numpy as np
import zmq

from daemon_util import ClientEngine, DaemonProcess
from hicache.daemon import protocol as p
from hicache.errors import ErrorCode
from tiers_util import SPEC

MAX_MESSAGE = 1 << 20
OPS = ["hello", "register", "match", "match_many", "lock", "unlock", "load", "alloc", "insert", "release",
       "heartbeat", "bye", "stats", "health", "flush", "check", "frobnicate", ""]


def junk(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == 1:
        return rng.random() * 1e9
    if kind == 2:
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 3:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(0, 12)))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {str(junk(rng, depth + 1)): junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def adversarial(rng: random.Random, session: int, nodes: list[int], foreign_pages: list[int]):
    """(payload, request id or None when it has none / is unreadable)."""
    rid = rng.randrange(1, 2**40)
    kind = rng.randrange(12)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 300)), None
    if kind == 1:
        return msgspec.msgpack.encode(junk(rng)), None
    if kind == 2:  # a known op with wrong or missing fields
        body = {"op": rng.choice(OPS), "id": rid}
        for key in rng.sample(["session", "tokens", "pages", "node", "num_pages", "spec", "version"], 3):
            body[key] = junk(rng)
        return msgspec.msgpack.encode(body), rid
    if kind == 3:  # a length prefix promising far more than the message holds
        head = b"\x85\xa2op\xa5match\xa2id\xce" + rid.to_bytes(8, "big")[:4]
        return head + b"\xc6\xff\xff\xff\xf0ab", None
    if kind == 4:  # foreign and stale handles: another session's node, nodes that never were
        if rng.random() < 0.3:
            return p.encode(p.Lock(id=rid, session=session, node=rng.choice([-1, 10**6 + rng.randrange(10**6)]))), rid
        node = rng.choice(nodes + [rng.randrange(-5, 10**6)])
        op = rng.choice([p.Unlock, p.Load])
        return p.encode(op(id=rid, session=session, node=node)), rid
    if kind == 5:  # pages this session does not own
        pages = np.asarray(rng.sample(foreign_pages, min(3, len(foreign_pages))) or [1], dtype="<i4")
        op = rng.choice([p.Release, p.Insert])
        if op is p.Release:
            return p.encode(p.Release(id=rid, session=session, pages=pages.tobytes())), rid
        toks = np.arange(len(pages) * SPEC.page_size, dtype="<i4").tobytes()
        return p.encode(p.Insert(id=rid, session=session, tokens=toks, pages=pages.tobytes())), rid
    if kind == 6:  # out-of-range and malformed page ids / tokens
        bad = rng.choice([b"\x01\x02\x03", np.asarray([0, 10**6, -4], "<i4").tobytes(), b"\x07\0\0\0" * 2])
        return p.encode(p.Release(id=rid, session=session, pages=bad)), rid
    if kind == 7:
        return p.encode(p.Match(id=rid, session=session, tokens=rng.randbytes(rng.choice([1, 2, 3, 5])))), rid
    if kind == 8:  # sessions that do not exist
        return p.encode(p.Match(id=rid, session=rng.randrange(2**63), tokens=b"")), rid
    if kind == 9:
        return p.encode(p.Alloc(id=rid, session=session, num_pages=rng.choice([-1, 10**9, 2**62]))), rid
    if kind == 10:
        return p.encode(p.Hello(id=rid, version=rng.choice([0, 2, 99]), client="fuzz")), rid
    return p.encode(p.Register(id=rid, session=session, spec=junk(rng) if rng.random() < 0.5 else {},
                               fingerprint=b"x", key_check=b"", pools=[])), rid


def test_fuzz_every_message_gets_an_error_and_nothing_breaks(tmp_path):
    daemon = DaemonProcess(tmp_path, server={"max_message_bytes": MAX_MESSAGE, "lease_s": 30.0}).start()
    victim = ClientEngine(daemon.endpoint)  # another session, whose pages and locks must stay its own
    attacker = ClientEngine(daemon.endpoint)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        seq = list(range(100, 100 + 6 * SPEC.page_size))
        victim.prefill(seq)
        m = victim.client.match(seq)
        victim.client.lock(m.handle)
        victim_pages = victim.client.alloc(3).tolist()
        nodes = [m.handle.node]
        session = attacker.client._session
        rng = random.Random(20261129)
        sent = 0
        for _ in range(30):
            batch = [adversarial(rng, session, nodes, victim_pages) for _ in range(100)]
            for payload, _ in batch:
                sock.send(payload)
            for payload, rid in batch:
                assert sock.poll(10_000), "the daemon stopped answering"
                reply = p.decode_reply(sock.recv())
                assert isinstance(reply, p.Error), (payload[:80], reply)
                assert reply.code in {int(c) for c in ErrorCode}
                if rid is not None:
                    assert reply.id == rid
            sent += len(batch)
        # Oversize: answered, not processed.
        sock.send(p.encode(p.Match(id=7, session=session, tokens=b"\0" * (MAX_MESSAGE + 64))))
        assert sock.poll(10_000)
        reply = p.decode_reply(sock.recv())
        assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT
        # Double unlock and a release of what another session holds, through the client.
        attacker_match = attacker.client.match(seq)
        attacker.client.lock(attacker_match.handle)
        attacker.client.unlock(attacker_match.handle)
        sock.send(p.encode(p.Unlock(id=8, session=session, node=attacker_match.handle.node)))
        assert sock.poll(10_000)
        assert p.decode_reply(sock.recv()).code == ErrorCode.LOCK_UNDERFLOW
        assert sent == 3000
        # Still serving, consistent, and the victim's session is intact.
        attacker.client.check()
        stats = attacker.client.stats()
        assert stats["sessions"] >= 2
        victim.client.release(victim_pages)
        victim.client.unlock(m.handle)
        victim.prefill(seq + list(range(5000, 5000 + 2 * SPEC.page_size)))
        attacker.client.check()
    finally:
        sock.close(linger=0)
        ctx.term()
        victim.close()
        attacker.close()
        assert daemon.stop() == 0, daemon.log.read_text()[-3000:]


def test_framing_stays_in_step_with_multipart_and_req_envelopes(tmp_path):
    """The server reads a message frame by frame: a DEALER's extra frames, a REQ's empty
    delimiter and empty frames must each stay part of their own message — a frame left
    behind would be read as the next message's routing identity."""
    daemon = DaemonProcess(tmp_path).start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    req = ctx.socket(zmq.REQ)
    try:
        for sock in (dealer, req):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.connect(daemon.endpoint)
        for rid in range(1, 4):
            # Extra frames ride in the envelope and come back in front of the reply.
            dealer.send_multipart([b"extra", b"", p.encode(p.Health(id=rid))])
            frames = dealer.recv_multipart()
            assert frames[:-1] == [b"extra", b""]
            assert isinstance(p.decode_reply(frames[-1]), p.HealthReply) and p.decode_reply(frames[-1]).id == rid
            # A lone empty frame is a malformed request: an error reply, nothing else.
            dealer.send(b"")
            assert isinstance(p.decode_reply(dealer.recv()), p.Error)
            # A REQ socket (delimiter frame) gets its answer through the same path.
            req.send(p.encode(p.Health(id=100 + rid)))
            reply = p.decode_reply(req.recv())
            assert isinstance(reply, p.HealthReply) and reply.id == 100 + rid
            # And a plain single-frame request right after is answered, in step.
            dealer.send(p.encode(p.Health(id=200 + rid)))
            assert p.decode_reply(dealer.recv()).id == 200 + rid
    finally:
        dealer.close(linger=0)
        req.close(linger=0)
        ctx.term()
        assert daemon.stop() == 0, daemon.log.read_text()[-3000:]
