"""The wire schema: nested values are typed structs whose bytes are those of the plain
``to_dict()`` mappings they mirror, checked when a message is decoded."""

import msgspec
import pytest

from hicache import protocol as p
from hicache.counters import CountersHandle
from hicache.engine.kv_pool import export_kv_pool
from hicache.errors import ErrorCode, InvalidArgument
from hicache.pools import DeviceLayout, PoolHandle
from hicache.spec import MAX_LAYERS, KVSpec, MHALayer, StateLayer
from tiers_util import SPEC

HYBRID = KVSpec(page_size=2, layers=(MHALayer(num_kv_heads=1, head_dim=4),
                                     StateLayer(conv_state_shape=(3, 4), temporal_state_shape=(2, 2, 2))),
                model="hybrid", tp_size=2)
CUDA_IPC = {"size": [4096], "stride": [1], "offset": 0, "device": 0, "handle": b"h" * 64, "storage_size_bytes": 4096,
            "storage_offset_bytes": 0, "ref_counter_handle": b"r" * 8, "ref_counter_offset": 0,
            "event_handle": b"e" * 64, "event_sync_required": True}


def memfd_handle() -> dict:
    exported = export_kv_pool(SPEC, 4)
    try:
        return exported.handle.to_dict() | {"token": b"t" * 16}
    finally:
        exported.close()


def cuda_handle() -> dict:
    layout = DeviceLayout.build(HYBRID, 8, 2)
    return PoolHandle("cuda_ipc", layout.to_dict(), layout.nbytes, 1, cuda_ipc=CUDA_IPC).to_dict()


def register(spec: KVSpec, pools: list) -> p.Register:
    return p.Register(id=7, session=99, spec=spec, fingerprint=b"f" * 16, key_check=b"k" * 32, pools=pools)


@pytest.mark.parametrize("spec, handle", [(SPEC, memfd_handle), (HYBRID, cuda_handle)])
def test_a_typed_register_has_the_bytes_of_its_mappings(spec, handle):
    data = handle()
    typed = register(p.from_dict(p.KVSpecMsg, spec.to_dict()), [p.from_dict(p.PoolHandleMsg, data)])
    plain = register(spec.to_dict(), [data])
    assert p.encode(typed) == p.encode(plain)
    decoded = p.decode_request(p.encode(plain))
    assert decoded == typed
    assert KVSpec.from_dict(p.as_dict(decoded.spec)) == spec
    assert PoolHandle.from_dict(p.as_dict(decoded.pools[0])) == PoolHandle.from_dict(data)


def test_fields_left_out_take_the_domain_defaults():
    sparse = {"format": 1, "page_size": 4, "layers": [{"kind": "mha", "num_kv_heads": 2, "head_dim": 8}]}
    decoded = p.decode_request(p.encode(register(sparse, [])))
    assert p.as_dict(decoded.spec) == sparse
    assert KVSpec.from_dict(p.as_dict(decoded.spec)) == KVSpec.mha(num_layers=1, num_kv_heads=2, head_dim=8,
                                                                    page_size=4)


@pytest.mark.parametrize("bad", [
    {"spec": {"format": 1}},
    {"spec": SPEC.to_dict() | {"colour": "red"}},
    {"spec": SPEC.to_dict() | {"page_size": True}},
    {"spec": SPEC.to_dict() | {"layers": [{"kind": "gqa", "heads": 2}]}},
    {"spec": SPEC.to_dict() | {"layers": [{"kind": "mha", "num_kv_heads": 2, "head_dim": 8, "extra": 1}]}},
    {"spec": SPEC.to_dict() | {"layers": [SPEC.to_dict()["layers"][0]] * (MAX_LAYERS + 1)}},
    {"pools": [{}]},
    {"pools": [memfd_handle() | {"kind": "shm"}]},
    {"pools": [memfd_handle() | {"shm_name": "x"}]},
    {"pools": [memfd_handle() | {"nbytes": "8"}]},
    {"pools": [memfd_handle() | {"layout": {"spec": SPEC.to_dict()}}]},
    {"pools": [cuda_handle() | {"cuda_ipc": {"size": [1], "stride": [1], "handle": b""}}]},
])
def test_a_malformed_register_is_refused_when_decoded(bad):
    message = {"spec": SPEC.to_dict(), "pools": [memfd_handle()]} | bad
    with pytest.raises(p.ProtocolError) as refused:
        p.decode_request(p.encode(register(message["spec"], message["pools"])))
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT


def test_a_handle_that_does_not_fit_is_refused_before_it_is_sent():
    with pytest.raises(p.ProtocolError) as refused:
        p.from_dict(p.PoolHandleMsg, memfd_handle() | {"kind": "rdma"})
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT


def test_the_tokens_of_a_register_that_did_not_decode():
    data = memfd_handle()
    assert p.register_tokens(p.encode(register({"format": 1}, [data, {"token": b"u" * 16}]))) == [b"t" * 16,
                                                                                                 b"u" * 16]
    assert p.register_tokens(p.encode(p.Health(id=1))) == []
    assert p.register_tokens(msgspec.msgpack.encode({"op": "match", "pools": [data]})) == []
    assert p.register_tokens(b"\xc1") == []


def test_a_register_reply_carries_the_counters_handle():
    handle = CountersHandle(b"c" * 16, 64, 3, (b"e1", b"e2"), 0)
    typed = p.RegisterReply(id=1, pool=2, counters=p.from_dict(p.CountersMsg, handle.to_dict()), page_size=4,
                            num_pages=8)
    plain = p.RegisterReply(id=1, pool=2, counters=handle.to_dict(), page_size=4, num_pages=8)
    assert p.encode(typed) == p.encode(plain)
    reply = p.decode_reply(p.encode(plain))
    assert CountersHandle.from_dict(p.as_dict(reply.counters)) == handle


def test_a_register_reply_says_how_long_the_counters_outcome_log_is():
    """The log after the ring's slots (what a waiter reads a load whose slot moved on
    from): said in the handle, so that a client maps it; a client older than it maps
    the slots only. A handle without it (an older daemon's) has none."""
    handle = CountersHandle(b"c" * 16, 4, 3, writer_lock=True, log_words=64)
    reply = p.decode_reply(p.encode(p.RegisterReply(id=1, pool=2, counters=p.from_dict(p.CountersMsg, handle.to_dict()),
                                                    page_size=4, num_pages=8)))
    assert CountersHandle.from_dict(p.as_dict(reply.counters)) == handle
    assert handle.nbytes == (4 * (1 + 3) + 64) * 8
    older = {k: v for k, v in handle.to_dict().items() if k != "log_words"}
    assert CountersHandle.from_dict(older).log_words == 0
    with pytest.raises(InvalidArgument):
        CountersHandle.from_dict(handle.to_dict() | {"log_words": -1})


def test_a_register_reply_names_the_gpu_of_the_counters_events():
    """GPU mode: the daemon's index of the events' GPU, and its UUID for the engine,
    whose index of that GPU may be another."""
    handle = CountersHandle(b"c" * 16, 1, 2, (b"e" * 64, b"f" * 64), 3, writer_lock=True,
                            device_uuid="GPU-6a1b7f2e-0000-4000-8000-000000000003")
    reply = p.decode_reply(p.encode(p.RegisterReply(id=1, pool=2, counters=handle.to_dict(), page_size=4,
                                                    num_pages=8)))
    assert CountersHandle.from_dict(p.as_dict(reply.counters)) == handle
    with pytest.raises(InvalidArgument):
        CountersHandle.from_dict(handle.to_dict() | {"device_uuid": 3})


@pytest.mark.parametrize("storage", [None, {"records": 3, "bytes": 300, "capacity_bytes": 1000, "map_size_bytes": 4096,
                                            "corrupt_records": 0, "evicted_records": 1, "pending_writes": 0}])
def test_stats_are_typed_with_the_map_they_always_were(storage):
    account = {"free": 10, "private": 2, "cached_evictable": 3, "cached_protected": 1, "staging": 0}
    plain = {"version": "0.1.0", "uptime_s": 1.5, "sessions": 1, "draining": False,
             "requests": {"hello/OK": 1, "match/OK": 4},
             "specs": {SPEC.fingerprint_hex: {"device:1": account, "host": account, "disk": account, "nodes": 7}}}
    if storage is not None:
        plain["storage"] = storage
    typed = p.from_dict(p.DaemonStats, plain)
    assert isinstance(typed.specs[SPEC.fingerprint_hex]["host"], p.TierAccountMsg)
    assert p.encode(p.StatsReply(id=3, stats=typed)) == p.encode(p.StatsReply(id=3, stats=plain))
    assert p.as_dict(p.decode_reply(p.encode(p.StatsReply(id=3, stats=plain))).stats) == plain



def test_losses_in_stats_are_optional_both_ways():
    """``losses`` came after the other stats: an older daemon's stats decode without
    it, and a client that predates it reads stats that carry it, ignoring it."""
    plain = {"version": "0.1.0", "uptime_s": 1.5, "sessions": 1, "draining": False, "requests": {"hello/OK": 1},
             "specs": {}}
    assert p.decode_reply(p.encode(p.StatsReply(id=3, stats=plain))).stats.losses is None
    losses = {"pages_dropped": {"device": 0, "host": 3, "disk": 0},
              "transfer_failed_pages": {"d2h": 0, "host_to_disk": 1},
              "remote_put_skipped_pages": 2, "sessions_expired": 1, "checkpoints_lost": 0}
    sent = p.encode(p.StatsReply(id=3, stats={**plain, "losses": losses}))
    assert p.as_dict(p.decode_reply(sent).stats)["losses"] == losses

    class OldStats(msgspec.Struct, kw_only=True):  # (DaemonStats as it was before losses)
        version: str
        uptime_s: float
        sessions: int
        draining: bool
        requests: dict[str, int]
        specs: dict
        storage: dict | None = None
        tenants: dict[str, dict[str, int]] = {}

    class OldStatsReply(msgspec.Struct, tag_field="op", tag="stats", kw_only=True):
        id: int
        stats: OldStats

    old = msgspec.msgpack.decode(sent, type=OldStatsReply)
    assert old.id == 3 and old.stats.sessions == 1 and old.stats.requests == {"hello/OK": 1}


def test_a_store_deadline_is_optional_both_ways():
    """``Store.deadline_ns`` is left out by older clients (no deadline), and a client
    sends it only to a daemon whose hello says ``store_deadlines`` (an older daemon's
    hello has no such field, and it refuses fields it does not know)."""
    plain = p.decode_request(p.encode(p.Store(id=1, session=2, tokens=b"", pages=b"")))
    assert plain.deadline_ns is p.UNSET
    timed = p.decode_request(p.encode(p.Store(id=1, session=2, tokens=b"", pages=b"", deadline_ns=123)))
    assert timed.deadline_ns == 123
    old_hello = {"op": "hello", "id": 1, "session": 2, "version": p.PROTOCOL_VERSION, "daemon": "hicache 0.0",
                 "lease_s": 5.0}
    import msgpack

    assert p.decode_reply(msgpack.packb(old_hello)).store_deadlines is False


def test_a_load_into_deadline_is_optional_both_ways():
    """``LoadInto.deadline_ns`` likewise, sent only to a daemon whose hello says
    ``load_deadlines``."""
    plain = p.decode_request(p.encode(p.LoadInto(id=1, session=2, node=3, pages=b"")))
    assert plain.deadline_ns is p.UNSET
    timed = p.decode_request(p.encode(p.LoadInto(id=1, session=2, node=3, pages=b"", deadline_ns=123)))
    assert timed.deadline_ns == 123
    old_hello = {"op": "hello", "id": 1, "session": 2, "version": p.PROTOCOL_VERSION, "daemon": "hicache 0.0",
                 "lease_s": 5.0, "store_deadlines": True, "load_unlocked": True}
    import msgpack

    assert p.decode_reply(msgpack.packb(old_hello)).load_deadlines is False


def test_a_load_into_copy_deadline_is_optional_both_ways():
    """``LoadInto.copy_deadline_ns`` likewise, sent only to a daemon whose hello says
    ``copy_deadlines``."""
    plain = p.decode_request(p.encode(p.LoadInto(id=1, session=2, node=3, pages=b"", deadline_ns=5)))
    assert plain.copy_deadline_ns is p.UNSET
    timed = p.decode_request(p.encode(p.LoadInto(id=1, session=2, node=3, pages=b"", copy_deadline_ns=123)))
    assert timed.copy_deadline_ns == 123
    with pytest.raises(p.ProtocolError):
        p.decode_request(p.encode(p.LoadInto(id=1, session=2, node=3, pages=b"", copy_deadline_ns="soon")))
    old_hello = {"op": "hello", "id": 1, "session": 2, "version": p.PROTOCOL_VERSION, "daemon": "hicache 0.0",
                 "lease_s": 5.0, "store_deadlines": True, "load_unlocked": True, "load_deadlines": True}
    import msgpack

    assert p.decode_reply(msgpack.packb(old_hello)).copy_deadlines is False


def test_a_hello_naming_the_session_it_replaces_is_optional_both_ways():
    """``Hello.replaces`` is left out by older clients (nothing ended), and a client
    sends it only to a daemon whose hello says ``replace_sessions``."""
    plain = p.decode_request(p.encode(p.Hello(id=1, version=p.PROTOCOL_VERSION)))
    assert plain.replaces is p.UNSET
    named = p.decode_request(p.encode(p.Hello(id=1, version=p.PROTOCOL_VERSION, replaces=123)))
    assert named.replaces == 123
    old_hello = {"op": "hello", "id": 1, "session": 2, "version": p.PROTOCOL_VERSION, "daemon": "hicache 0.0",
                 "lease_s": 5.0, "store_deadlines": True, "load_unlocked": True, "load_deadlines": True}
    import msgpack

    assert p.decode_reply(msgpack.packb(old_hello)).replace_sessions is False


def test_the_id_of_a_request_too_large_to_decode_is_read_without_decoding_it():
    """``peek_request_id`` walks the top-level map to ``id`` (tokens and other bytes
    skipped by their length); anything else — a truncation, bad bytes, a walk past its
    bound — is 0, never an exception."""
    requests = [p.Match(id=5, session=1, tokens=b"\1\0\0\0" * 100_000, extra_key="k", tenant="t"),
                p.MatchMany(id=2**40, session=1, tokens=[b"\1\0\0\0" * 64] * 256),
                p.Insert(id=127, session=1, tokens=b"t" * 512, pages=b"p" * 64, ends=[1, 2]),
                register(SPEC, [memfd_handle()]), p.Health(id=128)]
    for request in requests:
        data = p.encode(request)
        assert p.peek_request_id(data) == request.id == p.request_id(data)
        for cut in range(0, len(data), max(1, len(data) // 200)):
            assert p.peek_request_id(data[:cut]) in (0, request.id)
    assert p.peek_request_id(msgspec.msgpack.encode({"op": "match", "id": -1})) == 0
    assert p.peek_request_id(msgspec.msgpack.encode({"op": "match", "id": "5"})) == 0
    assert p.peek_request_id(msgspec.msgpack.encode([5])) == 0
    assert p.peek_request_id(b"\xc1" * 64) == 0
    assert p.peek_request_id(msgspec.msgpack.encode({"x": [0] * 100_000, "id": 3})) == 0  # past the walk's bound
    assert p.peek_request_id(msgspec.msgpack.encode({"x": [[[0]]] * 100, "id": 3})) == 3
