"""Tens of thousands of hostile messages against a live daemon, from a peer that holds a
registered session of its own and knows another engine's session id, node handles and
page ids (as if they had leaked): every message gets a reply, none is INTERNAL, the
daemon stays up, its invariants hold, and the other engine's cached and private pages
stay byte-exact throughout."""

import random

import msgspec
import numpy as np
import zmq

from daemon_util import ClientEngine, DaemonProcess, RawPeer
from hicache import protocol as p
from hicache.errors import ErrorCode
from hicache.keys import key_self_test
from tiers_util import SPEC, Engine, expected_page

MAX_MESSAGE = 1 << 20
NUM_MESSAGES = 20_000
BATCH = 100
PS = SPEC.page_size
OPS = [cls.__struct_config__.tag for cls in p.Request.__args__] + ["frobnicate", "", 7, None]
FIELDS = {cls.__struct_config__.tag: [f.name for f in msgspec.structs.fields(cls)] for cls in p.Request.__args__}
EXTREME_INTS = [-(2**63), -1, 0, 1, 2**31, 2**32 + 5, 2**62, 2**63 - 1, 2**64 - 1]
# Declared lengths far beyond the message: array32, map32, bin32, str32, ext32.
HUGE_HEADERS = [b"\xdd\xff\xff\xff\xf0", b"\xdf\xff\xff\xff\xf0", b"\xc6\xff\xff\xff\xf0", b"\xdb\xff\xff\xff\xf0",
                b"\xc9\xff\xff\xff\xf0\x01"]


def junk(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([rng.randint(-(2**63), 2**64 - 1), *EXTREME_INTS])
    if kind == 1:
        return rng.choice([rng.random() * 1e9, float("nan"), float("inf"), -0.0])
    if kind == 2:
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 3:
        return "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randrange(0, 12)))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {str(junk(rng, depth + 1)): junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def deep(rng: random.Random) -> bytes:
    """A value nested a few hundred to many thousand levels deep (~1 byte a level)."""
    levels = rng.choice([300, 1_000, 5_000, 50_000])
    opener = rng.choice([b"\x91", b"\x81\xa1k", b"\x92\x01"])
    return opener * levels + b"\xc0"


def map_of(items: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map of already-encoded keys and values (< 16 entries)."""
    return bytes([0x80 | len(items)]) + b"".join(k + v for k, v in items)


def key(name: str) -> bytes:
    return msgspec.msgpack.encode(name)


class Hostile:
    """Makes messages: (payload, request id it carries or None, whether only an error
    reply is acceptable)."""

    def __init__(self, rng: random.Random, me: int, victim: int, victim_handles: list[int],
                 victim_pages: list[int], my_handles: list[int], offer_victims_pool) -> None:
        self.rng = rng
        self.me, self.victim = me, victim
        self.victim_handles, self.victim_pages, self.my_handles = victim_handles, victim_pages, my_handles
        self.offer_victims_pool = offer_victims_pool  # -> the victim pool's handle, offered by us
        self.fresh = 0  # a session of ours that has said hello and not registered
        self.next_id = 1

    def mutated_spec(self) -> dict:
        """The test spec with a field or two (of its own or of a layer's) made junk."""
        rng = self.rng
        spec = SPEC.to_dict()
        for _ in range(rng.randint(1, 2)):
            layers = [x for x in spec["layers"] if isinstance(x, dict)] if isinstance(spec["layers"], list) else []
            target = rng.choice(layers) if layers and rng.random() < 0.6 else spec
            target[rng.choice([*target, "extra"])] = junk(rng)
        return spec

    def rid(self) -> int:
        self.next_id += 1
        return self.next_id

    def message(self):
        rng = self.rng
        kind = rng.randrange(14)
        if kind == 0:
            return rng.randbytes(rng.randrange(0, 300)), None, True
        if kind == 1:
            return msgspec.msgpack.encode(junk(rng)), None, True
        if kind == 2:  # nesting: at the top, as a field's value (known or not), as the spec
            rid = self.rid()
            where = rng.choice(["top", "field", "unknown", "spec", "pools"])
            if where == "top":
                return deep(rng), None, True
            name = {"field": "tokens", "unknown": "nested", "spec": "spec", "pools": "pools"}[where]
            op = "register" if where in ("spec", "pools") else rng.choice(["match", "hello", "insert"])
            items = [(key("op"), key(op)), (key("id"), msgspec.msgpack.encode(rid)),
                     (key("session"), msgspec.msgpack.encode(self.me)), (key(name), deep(rng))]
            rng.shuffle(items)  # the tag after the nest too: the decoder skips it first
            return map_of(items), None, True
        if kind == 3:  # a length prefix promising far more than the message holds
            rid = self.rid()
            items = [(key("op"), key(rng.choice(OPS[:16]))), (key("id"), msgspec.msgpack.encode(rid)),
                     (key(rng.choice(["tokens", "pages", "spec", "pools", "x"])),
                      rng.choice(HUGE_HEADERS) + rng.randbytes(rng.randrange(0, 8)))]
            return map_of(items), None, True
        if kind == 4:  # a known op, every field wrong in turn, missing, or one too many
            rid = self.rid()
            op = rng.choice(OPS[:16])
            body = {"op": op, "id": rid}
            fields = [f for f in FIELDS[op] if f != "id"]
            for name in fields:
                body[name] = junk(rng)
            if fields and rng.random() < 0.3:
                del body[rng.choice(fields)]
            if rng.random() < 0.3:
                body[rng.choice(["extra", "shm_name", "fd"])] = junk(rng)
            return msgspec.msgpack.encode(body), rid, False  # junk may happen to type-check
        if kind == 5:  # handles: the victim's (leaked), guessed, old-style small ids, extremes
            rid = self.rid()
            node = rng.choice([*self.victim_handles, rng.randrange(2**63), rng.randrange(1, 1000),
                               *EXTREME_INTS[:8]])
            op = rng.choice([p.Lock, p.Unlock, p.Load])
            return p.encode(op(id=rid, session=self.me, node=node)), rid, True
        if kind == 6:  # the victim's session id, from this connection
            rid = self.rid()
            msg = rng.choice([
                p.Match(id=rid, session=self.victim, tokens=np.arange(PS, dtype="<i4").tobytes()),
                p.Lock(id=rid, session=self.victim, node=rng.choice(self.victim_handles)),
                p.Unlock(id=rid, session=self.victim, node=rng.choice(self.victim_handles)),
                p.Release(id=rid, session=self.victim, pages=np.asarray(self.victim_pages, "<i4").tobytes()),
                p.Alloc(id=rid, session=self.victim, num_pages=1),
                p.Bye(id=rid, session=self.victim),
                p.Heartbeat(id=rid, session=self.victim),
            ])
            return p.encode(msg), rid, True
        if kind == 7:  # page ids: the victim's numbers (in our own pool: maybe ours), out of range, malformed
            rid = self.rid()
            theirs = np.asarray(self.victim_pages, "<i4").tobytes()
            pages = rng.choice([theirs, b"\x01\x02\x03", np.asarray([0, 10**6, -4], "<i4").tobytes(),
                                b"\x07\0\0\0" * 2, np.asarray([2**31 - 1], "<i4").tobytes()])
            if rng.random() < 0.5:
                return p.encode(p.Release(id=rid, session=self.me, pages=pages)), rid, pages is not theirs
            toks = np.arange(len(pages) // 4 * PS, dtype="<i4").tobytes() + rng.choice([b"", b"\1"])
            return p.encode(p.Insert(id=rid, session=self.me, tokens=toks, pages=pages)), rid, pages is not theirs
        if kind == 8:  # tokens and sizes
            rid = self.rid()
            msg = rng.choice([
                p.Match(id=rid, session=self.me, tokens=rng.randbytes(rng.choice([1, 2, 3, 5, 4097]))),
                p.Match(id=rid, session=self.me, tokens=b"", extra_key="x" * 2000),
                p.MatchMany(id=rid, session=self.me, tokens=[b"\0\0\0\0"] * 300),
                p.MatchMany(id=rid, session=self.me, tokens=[b"\0" * 16, b"\1\2\3"]),
                p.Alloc(id=rid, session=self.me, num_pages=rng.choice([-1, 10**9, 2**62, -(2**63)])),
            ])
            return p.encode(msg), rid, True
        if kind == 9:  # sessions that never were, and this connection's hello done wrong
            rid = self.rid()
            msg = rng.choice([
                p.Match(id=rid, session=rng.randrange(2**63), tokens=b""),
                p.Hello(id=rid, client="fuzz",
                        version=rng.choice([0, p.PROTOCOL_VERSION - 1, p.PROTOCOL_VERSION + 1, -1, 2**63 - 1])),
                p.Register(id=rid, session=rng.randrange(2**63), spec={}, fingerprint=b"", key_check=b"",
                           pools=[]),
            ])
            return p.encode(msg), rid, True
        if kind == 10:  # registrations with hostile pools (a refused one leaves the session as it was)
            rid = self.rid()
            victims = self.offer_victims_pool() if rng.random() < 0.05 else None
            pools = rng.choice([
                [], [{}], [junk(rng)], [{"kind": "memfd", "layout": {}, "nbytes": 0, "token": b"\0" * 16}],
                [{"kind": "cuda_ipc", "layout": {"spec": SPEC.to_dict(), "num_pages": 4}, "nbytes": 1,
                  "cuda_ipc": {k: 0 for k in ("size", "stride", "handle")}}],
                [{"kind": "shm", "shm_name": "../../etc/passwd", "layout": {}, "nbytes": 8}],
            ]) if victims is None else [victims]
            spec = SPEC.to_dict() if victims is not None or rng.random() < 0.3 else self.mutated_spec()
            key_check = key_self_test(SPEC.fingerprint, PS) if victims is not None else rng.randbytes(32)
            msg = p.Register(id=rid, session=rng.choice([self.fresh, self.me]) if self.fresh else self.me,
                             spec=spec, fingerprint=SPEC.fingerprint, key_check=key_check, pools=pools)
            return p.encode(msg), rid, True
        if kind == 11:  # frames the server must not take for a message
            return rng.choice([b"", b"\x80", b"\xc1", b"\x81\xa2op\xc1"]), None, True
        # This connection's own, well-formed requests: the daemon must go on serving them.
        rid = self.rid()
        seq = np.arange(1000, 1000 + rng.randrange(1, 5) * PS, dtype="<i4").tobytes()
        msg = rng.choice([
            p.Match(id=rid, session=self.me, tokens=seq),
            p.Alloc(id=rid, session=self.me, num_pages=rng.randrange(0, 3)),
            p.Lock(id=rid, session=self.me, node=rng.choice(self.my_handles or [1])),
            p.Unlock(id=rid, session=self.me, node=rng.choice(self.my_handles or [1])),
            p.Heartbeat(id=rid, session=self.me),
            p.Stats(id=rid), p.Health(id=rid),
        ])
        return p.encode(msg), rid, False


def test_fuzz_every_message_gets_an_answer_and_nothing_breaks(tmp_path):
    daemon = DaemonProcess(tmp_path, server={"max_message_bytes": MAX_MESSAGE, "lease_s": 30.0,
                                             "register_within_s": 1.0}).start()
    victim = ClientEngine(daemon.endpoint)  # another engine, whose pages and locks must stay its own
    attacker_engine = Engine(24)
    attacker = RawPeer(daemon.endpoint)
    try:
        seq = list(range(100, 100 + 6 * PS))
        victim.prefill(seq)
        m = victim.client.match(seq)
        victim.client.lock(m.handle)
        held = victim.client.load(m.handle)
        private = victim.client.alloc(3).tolist()
        private_keys = [bytes([i]) * 16 for i in range(3)]
        for page, page_key in zip(private, private_keys):  # the victim's work in progress
            victim.engine.write(page, page_key)
        me = attacker.session(attacker_engine)
        attacker.call(p.Flush(id=0))  # the victim's pages on host: our match finds them too
        mine = attacker.call(p.Match(id=0, session=me, tokens=np.asarray(seq, "<i4").tobytes()))
        assert isinstance(mine, p.MatchReply) and mine.node not in (-1, m.handle.node)
        victim_handle = victim.engine.exported.handle
        hostile = Hostile(random.Random(20261130), me, victim.client._session, [m.handle.node], private,
                          [mine.node], lambda: victim_handle.to_dict() | {"token": attacker.offer(victim_handle.fd)})
        codes = set()
        for start in range(0, NUM_MESSAGES, BATCH):
            if not hostile.fresh or isinstance(attacker.call(p.Heartbeat(id=0, session=hostile.fresh)), p.Error):
                hostile.fresh = attacker.hello()  # (unregistered ones lapse after register_within_s)
            batch = [hostile.message() for _ in range(BATCH)]
            for payload, _, _ in batch:
                attacker.send(payload)
            replies = {}
            for _ in batch:  # one reply each; futures (a load, a flush) may answer out of order
                reply = attacker.recv()
                assert not (isinstance(reply, p.Error) and reply.code == ErrorCode.INTERNAL), reply
                replies.setdefault(reply.id, []).append(reply)
                if isinstance(reply, p.Error):
                    codes.add(ErrorCode(reply.code).name)
            for payload, rid, must_fail in batch:
                if rid is not None:
                    assert rid in replies, (payload[:80], rid)
                    if must_fail:
                        assert all(isinstance(r, p.Error) for r in replies[rid]), (payload[:80], replies[rid])
            if start % 2_000 == 0:  # the victim is served, its pages exact, all along
                victim.engine.check(victim.ns(), seq, held.device_pages)
                victim.prefill(seq + list(range(5000 + start, 5000 + start + PS)))
        assert {"INVALID_ARGUMENT", "UNKNOWN_NODE", "UNKNOWN_SESSION"} <= codes, codes
        # Still serving, consistent, the victim's session intact and its bytes exact.
        assert attacker.call(p.Health(id=0)).state == "serving"
        assert isinstance(attacker.call(p.Check(id=0)), p.Ok)
        victim.engine.check(victim.ns(), seq, held.device_pages)
        for page, page_key in zip(private, private_keys):
            assert victim.engine.read(page) == expected_page(page_key)
        victim.client.release(private)
        victim.client.unlock(m.handle)
        victim.prefill(seq + list(range(9000, 9000 + 2 * PS)))
        victim.client.check()
        assert not victim.client.degraded
    finally:
        attacker.close()
        attacker_engine.close()
        victim.close()
        assert daemon.stop() == 0, daemon.log.read_text()[-3000:]
    log = daemon.log.read_text()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]


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
